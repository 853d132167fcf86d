"""benchmarks/bench_tree_step.py --smoke: every code path of the H200 script (checks with the FA3
calls emulated, timing rows, compaction), tiny, on the CPU under the Triton interpreter; the GPU
scripts parse; bench_host_path.py and bench_defaults_ab.py in their smoke modes."""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_benchmark_script_smoke(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_tree_step.py"), "--smoke",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("TREE-STEP-BENCH ok"), \
        r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and len(res["checks"]) == 5 and all(c["ok"] for c in res["checks"])
    assert [c for c in res["checks"] if "chain" in c["check"]][0]["chain_ref_vs_causal"] < 1e-5
    assert res["rows"] and all("one_kernel" in row and "tree_fa3_merge" in row and "tree_conc" in row for row in res["rows"])
    assert all(row["conc_maxdiff"] < 2e-2 for row in res["rows"])  # the two-pass form == the fused merge (bf16)
    assert res["compaction"] and all("compact_us" in c for c in res["compaction"])


def test_gpu_script_parses():
    for script in sorted((REPO / "scripts").glob("*gpu_*.sh")):  # gpu_tree_step.sh, its siblings, _gpu_bundle.sh
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, (script.name, r.stderr)


def test_defaults_ab_benchmark_smoke(tmp_path):
    """benchmarks/bench_defaults_ab.py --smoke (the before/after of the production launches, issue 37):
    the checkout's kernels as both versions, every output equal, every row timed."""
    out = tmp_path / "ab.json"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_defaults_ab.py"), "--smoke",
                        "--before", str(REPO / "kernels"), "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("DEFAULTS-AB ok"), r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {row["what"] for row in rows} == {"build_tree", "attention merge", "attention tree_pass",
                                             "attention one_kernel"}
    assert all(row["equal"] and row["after_us"] > 0 for row in rows)


def test_host_path_benchmark_smoke(tmp_path):
    """benchmarks/bench_host_path.py --smoke: the runtime's per-step host calls (attach, prepare,
    route, tree_tensors, verify) on synthetic trees, CPU paths, every row timed."""
    out = tmp_path / "host.json"
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_host_path.py"), "--smoke", "--out", str(out),
                        "--profile", "2", "4"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("HOST-PATH-BENCH ok"), r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and len(res["rows"]) == 2 and res["profile"]["top"]
    for row in res["rows"]:
        assert all(row[k] > 0 for k in ("attach", "prepare", "route", "tree_tensors", "verify", "upload_many")), row
