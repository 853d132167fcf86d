#!/usr/bin/env python3
"""Benchmark the DDTree tree builder ``build_tree`` on a GPU (issue 12, piece 3).

What it does, in one process:

1. Measures the device's bandwidth: a 2 GiB device-to-device copy (read + write bytes) and a
   2 GiB bf16 read (``torch.sum``), each as a CUDA-graph median.
2. Correctness at full vocab on the GPU: kernel == ``build_tree_ref`` bit for bit (given the
   kernel's logsumexp, which is also checked against ``torch.logsumexp``) on drafter-like bf16
   logits, with inactive rows; the chain budget (K = 1, budget = L) == ``torch.argmax``.
3. Timing (CUDA-graph replay, median; inputs rotated so one replay reads > 2x L2): for
   B in {1, 8, 64, 256}, budget in {16, 64, 256}, L = 16, V = 151,936, bf16 logits:
   ``build_tree`` (default K) as the runtime calls it (spine-first node order, no ancestor rows),
   and with the ancestor rows in spine-first and in pop order, its stage 1 alone (``draft_topk``: the one
   read of the logits), DFlash's own ``torch.argmax(logits, -1)``, and the floor
   B*L*V*2 bytes / copy bandwidth. A short sweep of tuning knobs follows.
4. Prints a table and writes everything to ``$OUT/bench_build_tree.json`` (or ``--out``).

Run from the repository root: ``PYTHONPATH=. python benchmarks/bench_build_tree.py``.
``--smoke`` runs the same code on the CPU under the Triton interpreter with tiny sizes (wall
clock instead of CUDA graphs), to catch mistakes before a GPU run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import pathlib
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from _timing import graph_time, wall_time  # noqa: E402
K = importlib.import_module("ddtree_patcher.kernels")
BT = importlib.import_module("ddtree_patcher.kernels.build_tree")
build_tree, build_tree_ref, draft_topk = K.build_tree, K.build_tree_ref, BT.draft_topk
sm_count = importlib.import_module("ddtree_patcher.kernels.device").sm_count


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------
def drafter_logits(B, L, V, dev, gen_seed, dtype=torch.bfloat16):
    """Drafter-like logits: N(0, 2^2) noise plus 8 spikes per row (+4..+14) at random ids."""
    g = torch.Generator(device=dev).manual_seed(gen_seed)
    x = torch.randn(B, L, V, device=dev, generator=g, dtype=torch.float32).mul_(2.0)
    ids = torch.randint(0, V, (B, L, 8), device=dev, generator=g)
    boost = 4.0 + 10.0 * torch.rand(B, L, 8, device=dev, generator=g)
    x.scatter_add_(2, ids, boost)
    return x.to(dtype)


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------
def timer(dev):
    return graph_time if dev.type == "cuda" else (lambda calls, reps: wall_time(calls, 1))


def reps_for(us_est):
    return int(min(400, max(25, 2e5 / max(us_est, 1.0))))


def n_sets(bytes_per_set, l2, cap_bytes=8e9, max_r=32):
    need = max(1, math.ceil(2.0 * l2 / max(bytes_per_set, 1)))
    return max(1, min(need, int(cap_bytes // max(bytes_per_set, 1)), max_r))


def measure_bw(dev):
    if dev.type != "cuda":
        return float("nan"), float("nan")
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    t = graph_time([lambda: y.copy_(x)], 20)
    copy_bw = 2 * x.numel() / (t * 1e-6)
    del y
    xb = x.view(torch.bfloat16).normal_()
    out = torch.empty((), dtype=torch.float32, device=dev)
    t = graph_time([lambda: torch.sum(xb, dim=0, dtype=torch.float32, out=out)], 20)  # (out= needs dim=)
    read_bw = xb.numel() * 2 / (t * 1e-6)
    del x, xb
    torch.cuda.empty_cache()
    return copy_bw, read_bw


# ----------------------------------------------------------------------------
# Correctness
# ----------------------------------------------------------------------------
def _special_logits(B, L, V, dev, seed):
    """Drafter-like logits with the rare cases: NaN entries, an all -inf position, +inf, half
    the vocab masked, and a row of heavy exact ties (small integers in bf16)."""
    x = drafter_logits(B, L, V, dev, seed)
    x[0, 1 % L, 7::1000] = float("nan")
    x[0, 3 % L] = float("-inf")
    x[min(1, B - 1), 2 % L, 12345 % V] = float("inf")
    x[min(1, B - 1), 4 % L, V // 2:] = float("-inf")
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    x[-1, 5 % L] = torch.randint(-3, 4, (V,), device=dev, generator=g).to(x.dtype)
    x[-1, 6 % L] = 0.0
    return x


def correctness(dev, L, V, results, smoke):
    ok = True
    cfgs = ([(2, 64, None, "drafter", False), (4, 256, None, "drafter", False), (3, 64, 16, "drafter", False),
             (3, 64, None, "special", False), (8, 64, None, "drafter", False),
             (8, 64, None, "drafter", True), (4, 256, None, "drafter", True), (3, 64, None, "special", True),
             # B = 32: rows in one segment (one program per row, no merge)
             (32, 256, None, "drafter", True), (32, 64, None, "special", True)]
            if not smoke else [(2, 12, None, "special", False), (2, 12, None, "drafter", True)])
    for i, (B, n, k, kind, sf) in enumerate(cfgs):
        x = (drafter_logits if kind == "drafter" else _special_logits)(B, L, V, dev, 100 + i)
        active = torch.ones(B, dtype=torch.bool, device=dev)
        if kind == "drafter":
            active[-1] = False  # the last request is in prefill: all padding
        t0 = time.time()
        a = build_tree(x, n, k, active=active, spine_first=sf)
        b = build_tree_ref(x, n, k, active=active, lse=a.lse, spine_first=sf)
        same = {f: bool(torch.equal(getattr(a, f).cpu(), getattr(b, f).cpu())) for f in a._fields}
        xs = x.float()
        xs = torch.where(xs < math.inf, xs, torch.full_like(xs, -math.inf))
        lse_t = torch.logsumexp(xs, dim=-1)
        inactive_ok = bool(torch.isneginf(a.lse[~active]).all())
        fin = active[:, None] & torch.isfinite(lse_t)
        lse_err = float((a.lse - lse_t)[fin].abs().max()) if inactive_ok else math.inf
        lse_err = lse_err if bool((a.lse[~torch.isfinite(lse_t)] == -math.inf).all()) else math.inf
        # the same launch again, 3 times: bit-identical (no race in the per-row merge)
        rep = all(all(torch.equal(getattr(build_tree(x, n, k, active=active, spine_first=sf), f), getattr(a, f))
                      for f in ("tokens", "parents", "topk_ids", "topk_logprobs", "lse"))
                  for _ in range(0 if smoke else 3))
        good = all(same.values()) and lse_err < 1e-4 and rep
        log(f"[check] {kind} B={B} n={n} K={k or 'default'} V={V}{' spine-first' if sf else ''}: kernel==ref {all(same.values())} "
            f"{'' if all(same.values()) else same} lse max err {lse_err:.2e}; repeatable {rep}; "
            f"exact {a.exact.tolist()} ({time.time() - t0:.1f}s)")
        results["checks"].append(dict(B=B, n=n, K=k, V=V, kind=kind, spine_first=sf, equal=same,
                                      lse_max_err=lse_err, repeatable=rep, exact=a.exact.tolist()))
        ok &= good
    B = 2 if smoke else 4
    x = drafter_logits(B, L, V, dev, 7)
    a = build_tree(x, L, 1)
    am = torch.argmax(x, dim=-1).to(torch.int32)
    chain = bool(torch.equal(a.tokens, am))
    log(f"[check] chain budget (K=1, budget=L={L}) == torch.argmax: {chain}")
    results["checks"].append(dict(chain_equals_argmax=chain))
    return ok and chain


# ----------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------
def tuning_of(knobs):
    """The launch settings (``BuildTreeTuning``) of a sweep entry's knobs, PRODUCTION's where a
    knob is not set: ``seg`` = (seg_tile, seg_maxnreg, seg_ctas_per_sm), ``preload`` =
    tree_preload_max (0: off), ``seg_stages`` (0: the register prefetch), and ``chunk``,
    ``chunk_warps``, ``tree_warps``, ``frontier_start`` by name. ``topk`` is an argument of the
    call, not a launch setting."""
    kw = {}
    if knobs.get("seg"):
        kw.update(zip(("seg_tile", "seg_maxnreg", "seg_ctas_per_sm"), knobs["seg"]))
    if "preload" in knobs:
        kw["tree_preload_max"] = knobs["preload"]
    if "seg_stages" in knobs:
        kw["seg_stages"] = knobs["seg_stages"]
    for name in ("chunk", "chunk_warps", "tree_warps", "frontier_start"):
        if knobs.get(name):
            kw[name] = knobs[name]
    return dataclasses.replace(BT.PRODUCTION, **kw)


def _first_stage(x, stages):
    """draft_topk(x, 8) with stage 1's stream at ``stages`` tiles in flight (0: the register
    prefetch)."""
    return BT._draft_topk_tuned(x, 8, dataclasses.replace(BT.PRODUCTION, seg_stages=stages))


def bench(B, budgets, L, V, dev, l2, bw, read_bw, knobs, seed):
    """One table block: ``build_tree`` as the runtime calls it, and its parts, under the launch
    settings of ``knobs`` (``tuning_of``; none: PRODUCTION, through the public functions)."""
    tuning = tuning_of(knobs)
    if tuning == BT.PRODUCTION:
        def stage1(s, k):
            return draft_topk(s, k)

        def build_with(s, n, topk, **kw):
            return build_tree(s, n, topk, **kw)
    else:
        def stage1(s, k):
            return BT._draft_topk_tuned(s, k, tuning)

        def build_with(s, n, topk, **kw):
            return BT._build_tree_tuned(s, n, topk, tuning, **kw)
    tm = timer(dev)
    nbytes = B * L * V * 2
    R = n_sets(nbytes, l2) if dev.type == "cuda" else 1
    sets = [drafter_logits(B, L, V, dev, seed + r) for r in range(R)]
    rows = []
    floor = nbytes / bw * 1e6 if bw == bw else float("nan")
    read_floor = nbytes / read_bw * 1e6 if read_bw == read_bw else float("nan")
    argmax_us = tm([lambda s=s: torch.argmax(s, dim=-1) for s in sets], reps_for(floor * 2 + 10))
    k_default = None
    for n in budgets:
        k = knobs.get("topk") or min(n, 8)
        if k != k_default:
            stage1_us = tm([lambda s=s, k=k: stage1(s, k) for s in sets], reps_for(floor * 2 + 10))
            k_default = k

        def build(s, sf, rows=True):
            return build_with(s, n, knobs.get("topk"), spine_first=sf, ancestor_mask=rows)
        # the runtime's exact call (ddtree_patcher.runtime.ddtree: spine-first node order, no ancestor
        # rows: the tree step makes its own), then the builder's default output (with the rows) in
        # spine-first and in pop order
        us = tm([lambda s=s: build(s, True, False) for s in sets], reps_for(floor * 2 + 30))
        rows_us = tm([lambda s=s: build(s, True) for s in sets], reps_for(floor * 2 + 30))
        pop_us = tm([lambda s=s: build(s, False) for s in sets], reps_for(floor * 2 + 30))
        t = build_tree(sets[0], n, knobs.get("topk"))
        row = dict(B=B, n=n, L=L, V=V, K=k,
                   knobs={a: b for a, b in knobs.items() if b or a == "preload"},
                   sets=R, build_us=us, build_rows_us=rows_us, build_pop_order_us=pop_us, stage1_us=stage1_us,
                   tree_stage_us=us - stage1_us,
                   argmax_us=argmax_us, floor_us=floor, x_floor=us / floor,
                   read_floor_us=read_floor, x_read_floor=us / read_floor,
                   minus_argmax_us=us - argmax_us,
                   exact_frac=float(t.exact.float().mean()),
                   mean_depth=float(t.depths.float().mean()),
                   max_depth=int(t.depths.max()))
        rows.append(row)
        log(f"[bench] {json.dumps({a: (round(b, 2) if isinstance(b, float) else b) for a, b in row.items()})}")
    del sets
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _same_tree(a, b):
    """Every field of two DraftTrees equal (a field may be None in both)."""
    return all((getattr(a, f) is None and getattr(b, f) is None) or torch.equal(getattr(a, f), getattr(b, f))
               for f in a._fields)


def tree_ab(B, budgets, L, V, dev, seed, reps=200):
    """The tree stage alone (``tree_stage``, one ``_tree_kernel`` launch) on one set of stage-1
    tables, per knob variant: the pops' first frontier width (``frontier_start``; NP = one width
    throughout), the ancestor rows on / off, the node order. Each variant's output must equal the
    first variant's of its (order, rows), which is checked against ``build_tree_ref`` at B <= 8.
    µs per launch, 8 launches per CUDA graph (the tables stay in L2, as after stage 1)."""
    x = drafter_logits(B, L, V, dev, seed)
    out = []
    for n in budgets:
        k = min(n, 8)
        lse, lp, ids = draft_topk(x, k)
        base = {}
        NP = max(32, BT._next_pow2(n))
        starts = [NP] + [w for w in (128, 64, 32) if w < NP]  # NP: one width throughout
        for sf, am, w0 in ([(True, False, w) for w in starts] + [(True, True, w) for w in starts]
                           + [(False, True, NP), (False, True, min(NP, BT.PRODUCTION.frontier_start))]):
            def call(sf=sf, am=am, w0=w0):
                return BT._tree_stage_tuned(lse, lp, ids, n, k, dataclasses.replace(BT.PRODUCTION, frontier_start=w0),
                                            ancestor_mask=am, spine_first=sf)
            t = call()
            key = (sf, am)
            if key not in base:
                base[key] = t
                if B <= 8:  # the first variant against the reference (the others against it below)
                    r = build_tree_ref(x, n, k, lse=t.lse, spine_first=sf, ancestor_mask=am)
                    if not _same_tree(t, r):
                        log(f"[tree-ab] B={B} n={n} sf={sf} am={am}: the kernel != build_tree_ref")
                        base[key] = r  # every variant is then compared with the reference
            same = _same_tree(t, base[key])
            us = graph_time([call] * 8, reps) if dev.type == "cuda" else wall_time([call], 2)
            row = dict(B=B, n=n, K=k, spine_first=sf, ancestor_mask=am, frontier_start=w0, tree_us=us,
                       equal=same, max_depth=int(t.depths.max()))
            out.append(row)
            log(f"[tree-ab] {json.dumps({a: (round(b, 2) if isinstance(b, float) else b) for a, b in row.items()})}")
    return out


def anatomy(B, L, V, dev, l2, bw):
    """Where the first stage's time goes: the same grid and segments as ``_seg_kernel``, streaming
    only (online max and sum of exp, the slot maxima; writes (max, sum) per program), against the
    whole first stage and two torch reductions over the same bytes."""
    import triton
    import triton.language as tl

    @triton.jit
    def _stream_only(x_ptr, m_ptr, s_ptr, L, V, stride_b, stride_l, NSEG, SEG,
                     U: tl.constexpr, NTHR: tl.constexpr, VEC: tl.constexpr, STAGES: tl.constexpr):
        pid = tl.program_id(0)
        row = pid // NSEG
        sg = pid - row * NSEG
        b = row // L
        l_ = row - b * L
        row_ptr = x_ptr + b.to(tl.int64) * stride_b + l_.to(tl.int64) * stride_l
        seg_start = sg * SEG
        seg_end = tl.minimum(seg_start + SEG, V)
        OFF = (tl.arange(0, U)[:, None, None] * (NTHR * VEC) + tl.arange(0, NTHR)[None, :, None] * VEC
               + tl.arange(0, VEC)[None, None, :])
        G = tl.full([U, NTHR, VEC], float("-inf"), tl.float32)
        r = tl.full([NTHR], float("-inf"), tl.float32)
        s = tl.zeros([NTHR], dtype=tl.float32)
        G, r, s = BT._stream(row_ptr, seg_start, seg_end, OFF, G, r, s, U * NTHR * VEC, False, STAGES)
        tl.store(m_ptr + pid, tl.max(tl.max(tl.max(G, axis=2), axis=0), axis=0))
        tl.store(s_ptr + pid, tl.sum(s, axis=0) + tl.max(r, axis=0))

    R = n_sets(B * L * V * 2, l2)
    sets = [drafter_logits(B, L, V, dev, 50 + r) for r in range(R)]
    rows = B * L
    NTHR, VEC = 128, 8
    P = BT.PRODUCTION
    U = P.seg_tile // (NTHR * VEC)
    T = U * NTHR * VEC
    SEG = BT._default_segment(rows, V, T, 16, sm_count(dev) * P.seg_ctas_per_sm)
    NSEG = triton.cdiv(V, SEG)
    m = torch.empty(rows * NSEG, dtype=torch.float32, device=dev)
    sm = torch.empty_like(m)

    def so(x):
        _stream_only[(rows * NSEG,)](x, m, sm, L, V, x.stride(0), x.stride(1), NSEG, SEG,
                                     U=U, NTHR=NTHR, VEC=VEC, STAGES=P.seg_stages, num_warps=4,
                                     maxnreg=P.seg_maxnreg)

    floor = B * L * V * 2 / bw * 1e6
    reps = reps_for(floor * 2 + 10)
    row = dict(B=B, nseg=NSEG, tiles_per_seg=SEG // T, floor_us=floor,
               stream_only_us=graph_time([lambda x=x: so(x) for x in sets], reps),
               stage1_us=graph_time([lambda x=x: draft_topk(x, 8) for x in sets], reps),
               amax_us=graph_time([lambda x=x: torch.amax(x, dim=-1) for x in sets], reps),
               sum_us=graph_time([lambda x=x: torch.sum(x, dim=-1) for x in sets], reps),
               empty_kernel_us=graph_time([lambda: m.add_(0.0) for _ in sets], reps))
    log(f"[anatomy] {json.dumps({a: (round(b, 2) if isinstance(b, float) else b) for a, b in row.items()})}")
    del sets
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny sizes")
    ap.add_argument("--batch", type=int, nargs="*", default=None)
    ap.add_argument("--budget", type=int, nargs="*", default=None)
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--no-sweep", action="store_true", help="skip the tuning-knob sweep")
    ap.add_argument("--quick", action="store_true", help="a short sweep (K = 16 and 256, warps)")
    ap.add_argument("--ab", action="store_true",
                    help="the sweep is the A/B of the tree kernel's table preload (2026-12-02)")
    ap.add_argument("--anatomy", action="store_true",
                    help="also time the first stage's streaming alone (no candidate selection, "
                         "no merge) and torch.amax / torch.sum of the same logits")
    ap.add_argument("--tree-ab", action="store_true",
                    help="also time the tree stage alone per knob: the pops' first frontier width, "
                         "ancestor rows, node order (2026-12-03)")
    ap.add_argument("--seg-ab", action="store_true",
                    help="the sweep is stage 1 with more segments per row at B = 64 and 256 "
                         "(chunk 65,536 and 32,768 vocab entries; 2026-12-03)")
    ap.add_argument("--stages", action="store_true",
                    help="the sweep is stage 1's stream: the register prefetch (0) and Triton's "
                         "pipeliner with 2-4 tiles in flight, at budget 64 (2026-12-03)")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--time-budget", type=float, default=150.0,
                    help="seconds after which the remaining sweep entries are skipped")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/bench_build_tree.json)")
    args = ap.parse_args()

    smoke = args.smoke
    t_start = time.time()
    dev = torch.device("cpu" if smoke else "cuda")
    batch = args.batch or ([2] if smoke else [1, 8, 64, 256])
    budgets = args.budget or ([8] if smoke else [16, 64, 256])
    L = args.depth or (4 if smoke else 16)
    V = args.vocab or (300 if smoke else 151936)
    import triton

    results = dict(torch=torch.__version__, triton=triton.__version__, smoke=smoke,
                   date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), checks=[], rows=[], sweep=[])
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        l2 = getattr(props, "L2_cache_size", 60 * 2**20) or 60 * 2**20
        results.update(device=props.name, sms=props.multi_processor_count, l2_bytes=l2)
    else:
        l2 = 0
        results.update(device="cpu (Triton interpreter)", sms=0, l2_bytes=0)
    log(f"device {results['device']}, torch {torch.__version__}, triton {triton.__version__}")
    copy_bw, read_bw = measure_bw(dev)
    results.update(copy_bw=copy_bw, read_bw=read_bw)
    log(f"bandwidth: copy {copy_bw / 1e12:.2f} TB/s (read+write), bf16 read {read_bw / 1e12:.2f} TB/s")

    ok = True
    if not args.skip_checks:
        try:
            ok = correctness(dev, L, V, results, smoke)
        except Exception:  # noqa: BLE001
            log("[check] FAILED:\n" + traceback.format_exc())
            results["checks"].append(dict(error=traceback.format_exc()))
            ok = False
    for i, B in enumerate(batch):
        t0 = time.time()
        try:
            results["rows"] += bench(B, budgets, L, V, dev, l2, copy_bw, read_bw, {}, 1000 * i)
        except Exception:  # noqa: BLE001
            results["rows"].append(dict(B=B, error=traceback.format_exc()[-2000:]))
            log(results["rows"][-1]["error"])
            ok = False
        log(f"[bench] B={B} done ({time.time() - t0:.1f}s)")
    if not args.no_sweep:
        sweep = ([(8, [64, 256], dict(tree_warps=w)) for w in (1, 2, 4)]
                 + [(b, [64], dict(chunk_warps=w)) for b in (1, 64, 256) for w in (2, 8)]
                 + [(b, [64], dict(topk=16)) for b in (1, 64)]
                 + [(b, [256], dict(topk=256)) for b in (1, 8)])
        if args.quick:
            sweep = ([(b, [64], dict(topk=16)) for b in (1, 64)] + [(1, [256], dict(topk=256))]
                     # not yet measured: 2048-entry tiles, 64 registers, 8 programs per SM
                     + [(b, [64], dict(seg=(2048, 64, 8))) for b in (8, 64, 256)]
                     # B = 8 (issue 12's unmet row): more, shorter segments per row than the
                     # default 4 x 10 tiles (chunk = vocab entries per segment)
                     + [(8, [16, 64], dict(chunk=c)) for c in (8192, 16384, 32768)])
        if args.stages:  # stage 1 through Triton's pipeliner, 2-4 tiles in flight (2026-12-03)
            # (0 = the register prefetch, the stream before 2026-12-03)
            sweep = [(b, [64], dict(seg_stages=st)) for b in batch for st in (0, 2, 3, 4)]
            results["stages_equal"] = []
            for b_ in (1, 8, 64):  # the pipelined stream gives the same first stage bit for bit
                x = drafter_logits(b_, L, V, dev, 3)
                ref = _first_stage(x, 0)
                for st in (2, 3, 4):
                    got = _first_stage(x, st)
                    same = all(torch.equal(a_, b2) for a_, b2 in zip(got, ref))
                    results["stages_equal"].append(dict(B=b_, stages=st, equal=same))
                    log(f"[stages] B={b_} stages={st}: first stage equal to the register prefetch's: {same}")
                    ok = ok and same
                del x
        if args.seg_ab:  # B >= 32 reads each row in one segment by default: split it (2026-12-03)
            sweep = [(b, [64, 256], dict(chunk=c)) for b in (64, 256) for c in (65536, 32768) if b in batch]
        if args.ab:  # the tree kernel without the table preload (the design before 2026-12-02)
            sweep = [(b, budgets, dict(preload=0)) for b in batch]
        if smoke:
            sweep = [(1, [16], dict(tree_warps=2, chunk=256, topk=16))]
        for B, bud, knobs in sweep:
            if time.time() - t_start > args.time_budget:
                log(f"[sweep] time budget {args.time_budget:.0f}s spent: skipping B={B} {knobs}")
                results["sweep_skipped"] = results.get("sweep_skipped", 0) + 1
                continue
            try:
                results["sweep"] += bench(B, bud, L, V, dev, l2, copy_bw, read_bw, knobs, 7)
            except Exception:  # noqa: BLE001
                results["sweep"].append(dict(B=B, knobs=knobs, error=traceback.format_exc()[-2000:]))
                log(results["sweep"][-1]["error"])
                ok = False
    if args.tree_ab:
        results["tree_ab"] = []
        for B in batch:
            try:
                results["tree_ab"] += tree_ab(B, sorted(set(budgets) | ({63} if not smoke else set())),
                                              L, V, dev, 11)
            except Exception:  # noqa: BLE001
                results["tree_ab"].append(dict(B=B, error=traceback.format_exc()[-2000:]))
                log(results["tree_ab"][-1]["error"])
                ok = False
        if not all(r.get("equal", False) for r in results["tree_ab"]):
            ok = False
    if args.anatomy and dev.type == "cuda":
        results["anatomy"] = []
        for B in batch:
            try:
                results["anatomy"].append(anatomy(B, L, V, dev, l2, copy_bw))
            except Exception:  # noqa: BLE001  (an experiment: its failure fails nothing else)
                results["anatomy"].append(dict(B=B, error=traceback.format_exc()[-2000:]))
                log(results["anatomy"][-1]["error"])
    results["elapsed_s"] = time.time() - t_start
    out = args.out or (os.path.join(os.environ["OUT"], "bench_build_tree.json") if os.environ.get("OUT")
                       else None)
    if out:
        pathlib.Path(out).write_text(json.dumps(results, indent=1))
        log(f"wrote {out}")
    print_table(results)
    log(f"elapsed {results['elapsed_s']:.0f}s")
    log("CHECKS " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


def _f(v, w=7, p=1):
    return f"{v:{w}.{p}f}" if isinstance(v, (int, float)) and v == v else f"{'-':>{w}}"


def print_table(res):
    log("\n" + "=" * 136)
    log(f"{res['device']} | torch {res['torch']} | triton {res['triton']} | copy "
        f"{res['copy_bw'] / 1e12:.2f} TB/s, read {res['read_bw'] / 1e12:.2f} TB/s | {res['date']}")
    log("µs, CUDA-graph replay median; floor = B*L*V*2 B / copy bandwidth (x = build / floor; "
        "xR: same with the bf16 read bandwidth); stage1 = top-K + lse (one read of the logits); "
        "tree = build - stage1; -argmax = build - torch.argmax; build = the runtime's call (spine-first "
        "node order, no ancestor rows), +rows = the same with the ancestor rows, pop = +rows in pop order")
    log(f"{'B':>4} {'n':>4} {'K':>4} | {'build':>8} {'+rows':>8} {'pop':>8} {'stage1':>8} {'tree':>7} | {'argmax':>8} "
        f"{'floor':>8} {'x':>5} {'xR':>5} {'-argmax':>8} | {'exact':>5} {'depth':>5} | knobs")
    for r in res["rows"] + res["sweep"]:
        if "error" in r:
            log(f"{r['B']:>4} ERROR {r.get('knobs', '')}")
            continue
        log(f"{r['B']:>4} {r['n']:>4} {r['K']:>4} | {_f(r['build_us'], 8)} {_f(r.get('build_rows_us'), 8)} "
            f"{_f(r.get('build_pop_order_us'), 8)} "
            f"{_f(r['stage1_us'], 8)} "
            f"{_f(r['tree_stage_us'], 7)} | {_f(r['argmax_us'], 8)} {_f(r['floor_us'], 8)} "
            f"{_f(r['x_floor'], 5, 2)} {_f(r['x_read_floor'], 5, 2)} {_f(r['minus_argmax_us'], 8)} | "
            f"{_f(r['exact_frac'], 5, 2)} "
            f"{_f(r['mean_depth'], 5, 1)} | {r['knobs'] or ''}")
    if res.get("tree_ab"):
        log("tree stage alone (one launch on stage 1's tables), µs: sf = spine-first, rows = ancestor "
            "rows, w0 = first frontier width")
        log(f"{'B':>4} {'n':>4} | {'sf':>2} {'rows':>4} {'w0':>4} | {'tree':>7} | equal")
        for r in res["tree_ab"]:
            if "error" in r:
                log(f"{r['B']:>4} ERROR")
                continue
            log(f"{r['B']:>4} {r['n']:>4} | {int(r['spine_first']):>2} {int(r['ancestor_mask']):>4} "
                f"{r['frontier_start']:>4} | "
                f"{_f(r['tree_us'], 7)} | {r['equal']}")
    log("=" * 136)


if __name__ == "__main__":
    sys.exit(main())
