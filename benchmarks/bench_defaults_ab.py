#!/usr/bin/env python3
"""Before/after at the production defaults: ``build_tree`` and tree attention from two copies of
the kernels, in one process on one GPU (issue 37: the launch settings left the public signatures
for ``BuildTreeTuning`` / ``TreeAttentionTuning``; the launches, hence the times, must stay).

Run from the repository root on a GPU::

    python3 benchmarks/bench_defaults_ab.py --before DIR [--out FILE]

``DIR`` is a ``kernels/`` folder of the earlier code, made beside the checkout before the run, e.g.
``mkdir -p .ab && git archive <rev> kernels | tar -x -C .ab`` (``.ab/kernels``; git-ignore ``.ab``
and carry it). The checkout's own ``kernels/`` is "after". The calls are the production ones, with
the arguments both versions take:

* ``build_tree(x, N, None, ancestor_mask=False, spine_first=True)`` (the proposer's call), bf16
  drafter-like logits, L = 16, V = 151,936, B 1 / 8 / 64, budgets 16 / 64 / 256 (64 only at B = 64);
* ``tree_attention_merge`` as the tree step calls it: after a context pass (``ctx_out``,
  ``ctx_lse``: here a stand-in, not FA3), and the tree pass alone (``None, None``, the second-stream
  path); ``tree_attention`` (the one-kernel fallback) at one shape. Qwen3-8B attention shape
  (32 q heads, 8 KV heads, head size 128, block size 16, bf16), context 1,024, B 1 / 8 / 32,
  n 16 / 64, random trees.

Each configuration: the same inputs through both versions, every output compared bit for bit;
then CUDA-graph replay medians (several calls per graph on input sets rotated past the L2), before
and after interleaved three times each (the median of the three is reported); and ``eager_us``, the
wall time per call of 50 back-to-back eager calls (host launch cost where the GPU work is small).
Prints a table, writes JSON (``--out``, default ``$OUT/defaults_ab.json``), and ends with
``DEFAULTS-AB ok`` (every output equal and every after / before graph time within ``--tol``) or
``DEFAULTS-AB FAIL <what>``. ``--smoke``: the same code on the CPU under Triton's interpreter,
tiny shapes, wall-clock times (checks the script, times nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import statistics
import sys
import time
import types

SMOKE = "--smoke" in sys.argv
if SMOKE:  # before the first triton import
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _timing import graph_time, wall_time  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
V_FULL = 300 if SMOKE else 151936


def load_kernels(kdir: pathlib.Path, name: str):
    """The kernels package in ``kdir`` under its own module name (two versions side by side)."""
    pkg = types.ModuleType(name)
    pkg.__path__ = []
    sys.modules[name] = pkg
    spec = importlib.util.spec_from_file_location(f"{name}.kernels", kdir / "__init__.py",
                                                  submodule_search_locations=[str(kdir)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"{name}.kernels"] = mod
    spec.loader.exec_module(mod)
    return mod


def log(*a):
    print(*a, flush=True)


def n_sets(nbytes, l2, cap=16):
    return max(1, min(cap, math.ceil(2.0 * l2 / max(nbytes, 1))))


def sync():
    if not SMOKE:
        torch.cuda.synchronize()


def eager_us(call, n=50):
    n = 2 if SMOKE else n
    call()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    sync()
    return (time.perf_counter() - t0) * 1e6 / n


def ab_time(calls_before, calls_after, rounds=3):
    """(before, after): the median of ``rounds`` interleaved graph medians of each."""
    def timer(calls):
        return wall_time(calls) if SMOKE else graph_time(calls, budget_s=0.15)
    b, a = [], []
    for _ in range(1 if SMOKE else rounds):
        b.append(timer(calls_before))
        a.append(timer(calls_after))
    return statistics.median(b), statistics.median(a)


def same(x, y):
    if isinstance(x, torch.Tensor):
        return x.shape == y.shape and x.dtype == y.dtype and bool(torch.equal(x, y))
    if isinstance(x, (tuple, list)):
        return len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
    return x == y


def drafter_logits(B, L, V, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(B, L, V, device=DEV, generator=g).mul_(2.0)
    ids = torch.randint(0, V, (B, L, 8), device=DEV, generator=g)
    x.scatter_add_(2, ids, 4.0 + 10.0 * torch.rand(B, L, 8, device=DEV, generator=g))
    return x.to(torch.bfloat16)


def bench_build(KB, KA, B, n, l2, rows):
    L, V = (4 if SMOKE else 16), V_FULL
    R = n_sets(B * L * V * 2, l2)
    sets = [drafter_logits(B, L, V, 100 + r) for r in range(R)]
    def call(K, x):
        return K.build_tree(x, n, None, ancestor_mask=False, spine_first=True)
    tb, ta = call(KB, sets[0]), call(KA, sets[0])
    eq = all(same(getattr(tb, f), getattr(ta, f)) for f in tb._fields)
    gb, ga = ab_time([lambda x=x: call(KB, x) for x in sets], [lambda x=x: call(KA, x) for x in sets])
    row = dict(what="build_tree", B=B, n=n, sets=R, equal=eq, before_us=gb, after_us=ga, ratio=ga / gb,
               eager_before_us=eager_us(lambda: call(KB, sets[0])), eager_after_us=eager_us(lambda: call(KA, sets[0])))
    rows.append(row)
    log(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))


class AttnCase:
    """Paged K/V and ``sets`` rotated block tables for B requests of context ``ctx`` and random
    trees of n nodes (query rows: root + n per request)."""

    def __init__(self, B, n, ctx, sets, Hq=32, Hkv=8, D=128, bs=16, seed=0):
        if SMOKE:
            Hq, Hkv, D = 4, 2, 16
        g = torch.Generator().manual_seed(seed)
        W = n + 1
        per = math.ceil((ctx + W) / bs)
        nb = per * B * sets
        dt = torch.bfloat16
        self.k = torch.randn(nb, bs, Hkv, D, generator=g).to(dt).to(DEV)
        self.v = torch.randn(nb, bs, Hkv, D, generator=g).to(dt).to(DEV)
        perm = torch.randperm(nb, generator=g).view(sets, B, per).to(torch.int32)
        self.bts = [perm[s].contiguous().to(DEV) for s in range(sets)]
        T = B * W
        self.q = torch.randn(T, Hq, D, generator=g).to(dt).to(DEV)
        self.qsl = torch.arange(0, T + 1, W, dtype=torch.int32).to(DEV)
        self.ctx = torch.full((B,), ctx, dtype=torch.int32).to(DEV)
        self.req = torch.ones(B, dtype=torch.bool).to(DEV)
        NW = (W + 31) // 32
        anc = torch.zeros(B, W, NW, dtype=torch.int32)
        for b in range(B):
            par = [0] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, W)]
            for j in range(W):
                k = j
                bits = {0, j}
                while k:
                    k = par[k]
                    bits.add(k)
                for i in bits:
                    anc[b, j, i // 32] |= (1 << (i % 32)) if i % 32 < 31 else -(1 << 31)
        self.anc = anc.to(DEV)
        self.ctx_out = torch.randn(T, Hq, D, generator=g).to(dt).to(DEV)
        self.ctx_lse = torch.full((Hq, T), 8.0).to(DEV)
        self.scale = D ** -0.5
        self.B = B

    def args(self, s):
        return (self.q, self.k, self.v, self.bts[s], self.qsl, self.ctx, self.anc, self.scale)


def bench_attention(KB, KA, B, n, l2, rows, modes):
    ctx = 40 if SMOKE else 1024
    kv_bytes = B * (ctx + n + 1) * 8 * 128 * 2 * 2
    R = n_sets(kv_bytes, l2, cap=8)
    c = AttnCase(B, n, ctx, R, seed=B * 100 + n)
    outs = {K: torch.empty_like(c.q) for K in (KB, KA)}
    two = {K: (torch.empty(c.q.shape, dtype=torch.float32, device=DEV),
               torch.empty(c.ctx_lse.shape, dtype=torch.float32, device=DEV)) for K in (KB, KA)}
    # checked once per layout, as the tree step does
    dims = {K: K.tree_attention_dims(*c.args(0)[:7], num_reqs=c.B, request_mask=c.req) for K in (KB, KA)}
    for mode in modes:
        if mode == "merge":  # the eager / PIECEWISE / one-stream path: after FA3's context pass
            def call(K, s):
                return K.tree_attention_merge(*c.args(s), c.ctx_out, c.ctx_lse, out=outs[K],
                                              request_mask=c.req, num_reqs=c.B, dims=dims[K])
        elif mode == "tree_pass":  # the FULL-graph second-stream path: tree keys only, fp32 out + lse
            def call(K, s):
                return K.tree_attention_merge(*c.args(s), None, None, out=two[K][0], lse=two[K][1],
                                              request_mask=c.req, num_reqs=c.B, dims=dims[K])
        else:  # the one-kernel fallback
            def call(K, s):
                return K.tree_attention(*c.args(s), out=outs[K])
        eq = same(call(KB, 0), call(KA, 0))
        if mode == "tree_pass":
            eq = eq and same(two[KB], two[KA])
        calls = max(R, 4)
        gb, ga = ab_time([lambda i=i: call(KB, i % R) for i in range(calls)],
                         [lambda i=i: call(KA, i % R) for i in range(calls)])
        row = dict(what=f"attention {mode}", B=B, n=n, ctx=ctx, sets=R, equal=eq, before_us=gb, after_us=ga,
                   ratio=ga / gb, eager_before_us=eager_us(lambda: call(KB, 0)),
                   eager_after_us=eager_us(lambda: call(KA, 0)))
        rows.append(row)
        log(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a kernels/ folder of the earlier code")
    ap.add_argument("--tol", type=float, default=1.05, help="largest after / before graph time accepted")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/defaults_ab.json)")
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes (checks the script)")
    args = ap.parse_args()
    before = pathlib.Path(args.before).resolve()
    if not (before / "build_tree.py").is_file():
        sys.exit(f"--before {before}: no build_tree.py there (a kernels/ folder is expected)")
    KB = load_kernels(before, "ab_before")
    KA = load_kernels(REPO / "kernels", "ab_after")
    if SMOKE:
        name, l2 = "cpu (Triton interpreter)", 0
    else:
        props = torch.cuda.get_device_properties(0)
        name, l2 = props.name, getattr(props, "L2_cache_size", 50 * 2**20) or 50 * 2**20
    res = dict(device=name, torch=torch.__version__, before=str(before),
               date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), rows=[])
    log(f"{name}, torch {torch.__version__}; before = {before}, after = {REPO / 'kernels'}")
    t0 = time.time()
    for B, budgets in (((2, (8,)),) if SMOKE else ((1, (16, 64, 256)), (8, (16, 64, 256)), (64, (64,)))):
        for n in budgets:
            bench_build(KB, KA, B, n, l2, res["rows"])
    for B in ((8,) if SMOKE else (1, 8, 32)):
        for n in ((16,) if SMOKE else (16, 64)):
            bench_attention(KB, KA, B, n, l2, res["rows"],
                            ("merge", "tree_pass") + (("one_kernel",) if (B, n) == (8, 16) else ()))
    res["elapsed_s"] = time.time() - t0
    out = args.out or (os.path.join(os.environ["OUT"], "defaults_ab.json") if os.environ.get("OUT") else None)
    if out:
        pathlib.Path(out).write_text(json.dumps(res, indent=1))
        log(f"wrote {out}")
    log(f"\n{'what':<22} {'B':>3} {'n':>4} | {'before':>8} {'after':>8} {'ratio':>6} | "
        f"{'eager b':>8} {'eager a':>8} | equal   (µs; graph replay medians, eager = wall per call)")
    for r in res["rows"]:
        log(f"{r['what']:<22} {r['B']:>3} {r['n']:>4} | {r['before_us']:8.2f} {r['after_us']:8.2f} "
            f"{r['ratio']:6.3f} | {r['eager_before_us']:8.1f} {r['eager_after_us']:8.1f} | {r['equal']}")
    bad = [f"{r['what']} B={r['B']} n={r['n']}" + ("" if r["equal"] else " (outputs differ)")
           for r in res["rows"] if not r["equal"] or (r["ratio"] > args.tol and not SMOKE)]  # smoke: no timing
    log(f"elapsed {res['elapsed_s']:.0f}s")
    log("DEFAULTS-AB " + ("ok" if not bad else "FAIL " + "; ".join(bad)))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
