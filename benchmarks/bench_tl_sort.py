#!/usr/bin/env python3
"""What ``tl.sort`` costs inside one program (issue 12: the building block of a tree stage that
selects a level's top-n nodes in parallel instead of popping them one by one; docs/tree-builder.md,
"A parallel tree stage with tl.sort").

One launch of B programs, each sorting N keys (int64 or int32, descending) 16 times in a dependent
chain; per sort = (time with 16 sorts - time with none) / 16, so the launch cancels out. Timed by
``_timing.graph_time`` (20 launches per CUDA graph, replay median); each configuration checked
against ``torch.sort``.
Run on a GPU from the repository root: ``python benchmarks/bench_tl_sort.py`` (writes
``$OUT/sort_cost.json``, default /tmp/out). Record: benchmarks/results/h200_tl_sort_2026-12-02.json."""
import json
import os
import pathlib
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _timing import graph_time  # noqa: E402

CALLS = 20  # launches per timed graph


@triton.jit
def _k(x_ptr, out_ptr, N: tl.constexpr, ITERS: tl.constexpr):
    b = tl.program_id(0)
    o = tl.arange(0, N)
    acc = tl.load(x_ptr + b * N + o)
    for i in range(ITERS):
        acc = tl.sort(acc ^ i, descending=True)
    tl.store(out_ptr + b * N + o, acc)


def main():
    dev = torch.device("cuda")
    rows = []
    for B in (1, 64):
        for dt in ("i64", "i32"):
            for N in (128, 512, 2048):
                for nw in (1, 4, 8):
                    if nw == 1 and N > 512:
                        continue
                    x = torch.randint(-2**30, 2**30, (B, N), device=dev, dtype=torch.int64 if dt == "i64" else torch.int32)
                    out = torch.empty_like(x)
                    try:
                        t0 = graph_time([lambda: _k[(B,)](x, out, N=N, ITERS=0, num_warps=nw)] * CALLS)
                        t16 = graph_time([lambda: _k[(B,)](x, out, N=N, ITERS=16, num_warps=nw)] * CALLS)
                        ref = x.clone()
                        for i in range(16):
                            ref = torch.sort(ref ^ i, dim=1, descending=True).values
                        _k[(B,)](x, out, N=N, ITERS=16, num_warps=nw)
                        ok = bool(torch.equal(out, ref))
                        row = dict(B=B, dtype=dt, N=N, warps=nw, us_0=round(t0, 2), us_16=round(t16, 2),
                                   per_sort_us=round((t16 - t0) / 16, 3), ok=ok)
                    except Exception as ex:  # noqa: BLE001
                        row = dict(B=B, dtype=dt, N=N, warps=nw, error=str(ex)[:300])
                    rows.append(row)
                    print(row, flush=True)
    print(f"{'B':>3} {'keys':>4} {'N':>5} {'warps':>5} {'us per sort':>11} ok")
    for r in rows:
        if "error" not in r:
            print(f"{r['B']:>3} {r['dtype']:>4} {r['N']:>5} {r['warps']:>5} {r['per_sort_us']:>11.3f} {r['ok']}")
    os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows),
              open(os.path.join(os.environ.get("OUT", "/tmp/out"), "sort_cost.json"), "w"), indent=1)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options; --help
    main()
