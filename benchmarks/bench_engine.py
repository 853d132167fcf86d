"""Wall-clock speed of the ddtree-patch CLI on full vLLM trees (every .py file of the wheel).

    python benchmarks/bench_engine.py [--repeat 5] [VERSION ...]     (default: 0.20.0 0.33.0)

Each command runs as the installed console script in a fresh process (what an operator sees,
interpreter start-up included). Each round starts from a pristine copy with no state, so
`apply` is a cold first run (nothing cached); `verify` follows it. Prints a table of medians.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import vllm_wheels  # noqa: E402

EXE = Path(sys.executable).with_name("ddtree-patch")


def timed(*args: str) -> tuple[float, int]:
    t = time.perf_counter()
    proc = subprocess.run([str(EXE), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    return time.perf_counter() - t, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("versions", nargs="*", default=["0.20.0", "0.33.0"])
    args = ap.parse_args()
    rows = []
    for version in args.versions:
        times: dict[str, list[float]] = {}
        codes: dict[str, set[int]] = {}
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                site = vllm_wheels.lay_out_site(Path(tmp) / "site", version)  # full tree
                for name, cmd in [("verify (cold, nothing applied)", ["verify"]),
                                  ("apply (first run)", ["apply"]),
                                  ("verify (after apply)", ["verify"]),
                                  ("apply again (no-op)", ["apply"]),
                                  ("revert", ["revert"])]:
                    dt, rc = timed(*cmd, "--vllm-path", str(site))
                    times.setdefault(name, []).append(dt)
                    codes.setdefault(name, set()).add(rc)
        n_py = sum(1 for _ in (vllm_wheels.extracted(version) / "vllm").rglob("*.py"))
        for name, ts in times.items():
            rows.append((version, n_py, name, statistics.median(ts), min(ts), max(ts), sorted(codes[name])))
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"{'vLLM':<8} {'.py files':>9}  {'command':<32} {'median s':>9} {'min':>7} {'max':>7}  exit")
    for v, n, name, med, lo, hi, rc in rows:
        print(f"{v:<8} {n:>9}  {name:<32} {med:>9.3f} {lo:>7.3f} {hi:>7.3f}  {rc}")


if __name__ == "__main__":
    main()
