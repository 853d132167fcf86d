"""Timing helpers shared by the benchmarks (imported as ``_timing`` from benchmarks/)."""

from __future__ import annotations

import statistics
import time

import torch


def graph_time(calls, reps=None, *, budget_s=0.25):
    """Median µs per closure of one CUDA graph that runs every closure in ``calls`` once.

    The closures run once eagerly (JIT compilation, allocations) and once on a side stream (the
    caching allocator's warm-up for capture), then are captured; the graph is replayed 3 times
    untimed, then ``reps`` times, each replay timed by CUDA events. ``reps=None``: as many
    replays as fit ``budget_s`` seconds (sized by the first timed replay), 15 to 300."""
    for c in calls:  # warm up / JIT outside the graph
        c()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if reps is None:
        st.record()
        g.replay()
        en.record()
        en.synchronize()
        reps = int(min(300, max(15, budget_s * 1e6 / max(st.elapsed_time(en) * 1e3, 1.0))))
    ts = []
    for _ in range(reps):
        st.record()
        g.replay()
        en.record()
        en.synchronize()
        ts.append(st.elapsed_time(en) * 1e3 / len(calls))
    del g
    return statistics.median(ts)


def wall_time(calls, reps=1):
    """The CPU stand-in (smoke runs, no CUDA graphs): median over ``reps`` passes of the wall µs
    per closure of one pass over ``calls``."""
    ts = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        for c in calls:
            c()
        ts.append((time.perf_counter() - t0) * 1e6 / len(calls))
    return statistics.median(ts)
