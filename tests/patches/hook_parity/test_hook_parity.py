"""tree-walk-hook parity: the hook against each runner family's real samplers (no fakes).

One subprocess per release (parity_probe.py, the release's own Python from the official wheel,
the test venv's torch on CPU, the Triton interpreter): random batches mixing every sampling
parameter the release takes, seeded and unseeded, chain-as-tree and real trees, under a guard
that fails on any host synchronisation in the step (group ``differential``); the regression
tests of issue 11's defects 1-4 (group ``defects``, defects.py); chi-square tests of the tree
path's output distribution (group ``dist``, dist.py; on DIST_FAMILIES in CI).

CI: HOOK_PARITY_BATCHES (default 12) random batches per family, HOOK_PARITY_DIST_N (default
8000) samples per distribution check. Offline, e.g. (about 2000 batches per family, every
family's distribution checks, and the costly V2 ones at 8000 samples)::

    HOOK_PARITY_BATCHES=2000 HOOK_PARITY_DIST_N=128000 HOOK_PARITY_DIST_FAMILIES=all \\
        bash scripts/run-tests.sh tests/patches/hook_parity -q -k against_real_samplers

Also: the step functions contain no host-synchronising call (an AST lint).
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_wheels
from helpers import cpu_env, probe_result

HERE = Path(__file__).resolve().parent
FAMILIES = [("0.20.0", "v1"), ("0.28.0", "v1"), ("0.24.0", "v2"), ("0.26.0", "v2"), ("0.28.0", "v2"), ("0.33.0", "v2")]
BATCHES = int(os.environ.get("HOOK_PARITY_BATCHES", "12"))
_dist = os.environ.get("HOOK_PARITY_DIST_FAMILIES", "v1-0.20.0,v1-0.28.0,v2-0.33.0")
DIST_FAMILIES = {f"{f}-{v}" for v, f in FAMILIES} if _dist == "all" else set(_dist.split(","))
DEFECTS = {"v1": ("defect1_tree_beside_a_chain_request_stays_a_tree", "defect3_v1_logit_bias_at_the_final_token",
                  "defect3_v1_min_p_at_the_final_token", "defect4_v1_sampled_step_has_no_host_sync",
                  "defect4_attach_takes_device_tensors"),
           "v2": ("defect1_tree_beside_a_chain_request_stays_a_tree", "defect2_v2_logits_processing_in_tree_mode",
                  "defect2_v2_sampled_requests_walked")}
DIST = {"v1": ("dist_v1_drafter_unseeded", "dist_v1_drafter_seeded", "dist_v1_builtins_unseeded",
               "dist_v1_builtins_seeded"),
        "v2": ("dist_v2_cheap", "dist_v2_costly")}


def run_probe(version: str, family: str, groups: str, tmp_path: Path, runtime: str = "") -> tuple[dict, dict, str]:
    root = vllm_wheels.extracted(version)
    proc = subprocess.run([sys.executable, str(HERE / "parity_probe.py"), str(root), family, str(BATCHES), "7",
                           groups] + ([runtime] if runtime else []),
                          capture_output=True, text=True, timeout=1800, cwd=str(tmp_path),
                          env=cpu_env(PYTHONDONTWRITEBYTECODE="1"))
    res = probe_result("probe", proc.returncode, proc.stdout, proc.stderr)
    stats = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("PROBE-STATS "))[12:])
    return res, stats, proc.stdout


@pytest.mark.parametrize("version,family", FAMILIES, ids=[f"{f}-{v}" for v, f in FAMILIES])
def test_parity_against_real_samplers(version, family, tmp_path):
    dist = f"{family}-{version}" in DIST_FAMILIES
    res, stats, out = run_probe(version, family, "differential,defects" + (",dist" if dist else ""), tmp_path)
    names = (f"{family}_differential",) + DEFECTS[family] + (DIST[family] if dist else ())
    for name in names:
        assert res.get(name) == "ok", (name, res.get(name, "not run"))
    failed = {k: v for k, v in res.items() if v != "ok"}
    assert not failed, failed
    assert stats["batches"] >= BATCHES // 2 and stats["tree_requests"] and stats["chain_requests"], stats
    print("\n".join(line for line in out.splitlines() if line.startswith("DIST ")))


# ---- no host synchronisation in the step: AST lint ------------------------------------------------
RUNTIME = Path(__import__("ddtree_patcher.runtime.hook", fromlist=["x"]).__file__).parent
STEP_FUNCTIONS = {"hook.py": ("route", "tree_tensors", "keep", "verify", "upload", "account"),
                  "step_rows.py": ("upload_many", "chain_rows"),
                  "tree_channel.py": ("pending_tree", "pending_index", "attachment"),
                  "parity_v1.py": ("sample", "randomness", "_bonus_metadata"),
                  "parity_v2.py": ("sample", "_call", "_output")}
SYNC_ATTRS = {"item", "tolist", "cpu", "numpy", "nonzero", "synchronize"}


def _violations(tree: ast.AST) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr = node.func.attr
            if attr in SYNC_ATTRS:
                bad.append(f"line {node.lineno}: .{attr}()")
            if attr == "repeat_interleave" and not any(k.arg == "output_size" for k in node.keywords):
                bad.append(f"line {node.lineno}: repeat_interleave without output_size")
            if attr in ("tensor", "as_tensor") and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                bad.append(f"line {node.lineno}: torch.{attr}(...)")
    return bad


def _step_functions():
    for fname, names in STEP_FUNCTIONS.items():
        module = ast.parse((RUNTIME / fname).read_text())
        found = {n.name: n for n in ast.walk(module) if isinstance(n, ast.FunctionDef)}
        for name in names:
            assert name in found, (fname, name)
            yield f"{fname}:{name}", found[name]


def test_step_functions_have_no_host_sync_calls():
    bad = {name: v for name, fn in _step_functions() if (v := _violations(fn))}
    assert not bad, bad


def test_the_lint_sees_a_sync_call():
    fn = ast.parse("def sample(x):\n    n = int(x.sum().item())\n    y = x.repeat_interleave(r)\n    return n")
    assert len(_violations(fn)) == 2
