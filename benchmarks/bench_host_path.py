#!/usr/bin/env python3
"""Host time of the DDTree runtime's per-step calls, without vLLM (issue 14: host-bound V1 steps).

In the engine (bench_ddtree_step.py) a V1 step at B = 1 can be host bound, and the tree step's
prepare then sits on the critical path. This script times the same runtime calls on the device
with synthetic inputs and nothing else in the process: each call's host time (``perf_counter``,
the GPU drained before every call, so nothing waits on a full launch queue), median over
``--iters`` calls, for B in ``--batch`` and budgets N in ``--budget``:

=================  ===========================================================================
``attach``         ``VerifyStep.attach`` (the proposer hands the batch's trees to the channel)
``prepare``        ``TargetTreeStep._prepare`` (V1's ``prepare`` body: ``pending_index`` +
                   ``set_plan_parents``: ancestor rows, depth positions, one index upload)
``pending_index``  its first part alone
``expect``         ``TargetTreeStep.expect`` (the look-ahead at the attach: the next step's bit rows
                   and depths, one launch; on V1 it runs behind the drafter's GPU work)
``prepare_ahead``  ``_prepare`` of the batch ``expect`` saw (``_prepare_expected``: host checks,
                   the positions; what V1 now runs where its GPU is idle)
``route``          ``VerifyStep.route`` + ``account`` (the walk's host routing)
``tree_tensors``   ``VerifyStep.tree_tensors(depths=False)`` (the V1 walk's index arrays)
``verify``         ``VerifyStep.verify`` (the tree walk kernel, greedy)
``upload_many``    ``hook.upload_many`` of the prepare's nine index arrays
``compact``        ``KVCompactor`` over 36 layers' K/V views with the device counters (the
                   compaction after the walk: its kernel launch and checks)
``rows``           ``RowGatherer`` on one ``[T, 12288]`` tensor with positions (the drafter rows)
``build_tree``     ``kernels.build_tree`` on bf16 logits ``[B, L, V]`` (the proposer's call: spine-first, no mask)
``build_fresh``    the same with the first stage's scratch cache emptied before each call (the
                   builder before the cache: five allocations and a memset more)
``dd_build``       ``DDTreeDrafter.build`` + ``choose`` of an all-tree batch (the V1 proposer's
                   device-side calls: builder, token cast, no chain)
``triton_launch``  one launch of a one-program Triton kernel with 8 arguments (the floor of any
                   Triton call on this host)
``torch_op``       one ``Tensor.add_`` on a device tensor (the floor of any torch call)
=================  ===========================================================================

Prints a table and ``HOST-PATH-BENCH ok``; ``--out`` (default ``$OUT/bench_host_path.json``).
``--profile B N``: also cProfile ``--iters`` steps of that case (attach with the look-ahead, prepare,
route, tree_tensors, verify, compaction, drafter rows) and print the top functions by own time (µs
per step), which is where the next host-time cut comes from.
``--smoke``: CPU, tiny shapes (the tree step's CPU path, the references), for the CPU test. From
the repository root, on the GPU: ``PYTHONPATH=. python benchmarks/bench_host_path.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
import types

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from ddtree_patcher.runtime import hook, tree_step  # noqa: E402


def _params():
    """A SamplingParams stand-in with what ``parity_v1.params_reason`` reads: greedy, tree-ok."""
    return types.SimpleNamespace(logprobs=None, logprob_token_ids=None, presence_penalty=0.0,
                                 frequency_penalty=0.0, repetition_penalty=1.0, bad_words=None,
                                 _bad_words_token_ids=None, min_tokens=0, thinking_token_budget=None,
                                 structured_outputs=None, guided_decoding=None)


def random_parents(B, n, gen):
    """Best-first-like trees: node j's parent is j - 1 with probability 0.6, else a random earlier node."""
    par = np.zeros((B, n), dtype=np.int32)
    for b in range(B):
        for j in range(1, n + 1):
            par[b, j - 1] = j - 1 if gen.random() < 0.6 else gen.integers(0, j)
    return par


class Case:
    """One batch of B decode requests with N-node trees: the hook's VerifyStep and a V1 tree step."""

    def __init__(self, dev, B, N, ctx=1024, seed=0):
        gen = np.random.default_rng(seed)
        self.B, self.N, self.dev = B, N, dev
        self.req_ids = [f"req-{i}" for i in range(B)]
        runner = types.SimpleNamespace(
            device=dev, speculative_config=types.SimpleNamespace(num_speculative_tokens=N), max_num_reqs=max(B, 8),
            requests={r: types.SimpleNamespace(sampling_params=_params()) for r in self.req_ids})
        self.hk = hook.VerifyStep(runner, "V1")
        self.parents = torch.from_numpy(random_parents(B, N, gen)).to(dev)
        self.nd = [N] * B
        self.nsched = [N + 1] * B
        self.T = B * (N + 1)
        self.positions = torch.arange(self.T, dtype=torch.int64, device=dev) + ctx
        st = tree_step.TargetTreeStep.__new__(tree_step.TargetTreeStep)
        st._init_state()
        st.device, st.hook, st.graph_bufs = dev, self.hk, None
        self.st = st
        self.draft = torch.randint(0, 1000, (B * N,), dtype=torch.int32, device=dev)
        self.cu = torch.arange(1, B + 1, dtype=torch.int32, device=dev) * N
        self.argmax = torch.randint(0, 1000, (self.T,), dtype=torch.int64, device=dev)
        self.arrays = [np.arange(B * N)] * 8 + [np.zeros((B, N + 1), np.int64)]
        from ddtree_patcher import kernels as K

        small = dev.type != "cuda"
        nb = B * ((ctx + N + 1) // 16 + 1) + 1
        H, X, layers = (2, 8, 2) if small else (8, 256, 36)  # Qwen3-8B: 8 KV heads, K and V of 128 packed
        self.caches = [torch.zeros(nb, 16, H, X, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
        self.compactor = K.KVCompactor(self.caches)
        self.slots = torch.arange(self.T, dtype=torch.int64, device=dev) + 16
        self.root_ext = torch.arange(B + 1, dtype=torch.int64, device=dev) * (N + 1)
        acc = gen.integers(0, min(3, N) + 1, size=B)  # a walk result: the root, then a nodes j_1 < ... < j_a
        rows = np.full((B, N + 1), -1, dtype=np.int32)
        for b in range(B):
            path = np.sort(gen.choice(np.arange(1, N + 1), size=int(acc[b]), replace=False))
            rows[b, :acc[b] + 1] = b * (N + 1) + np.concatenate([[0], path])
        self.acc = torch.from_numpy(acc.astype(np.int32)).to(dev)
        rows = torch.from_numpy(rows)
        self.rows = rows.to(dev)
        self.tree = torch.ones(B, dtype=torch.bool, device=dev)
        self.counts = torch.zeros(1 + N + 1, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(self.T, 48 if small else 3 * 4096, dtype=torch.bfloat16, device=dev)
        self.gatherer = K.RowGatherer([self.hidden])

    def attach(self):
        self.hk.attach(self.req_ids, self.parents)

    def fresh(self, ahead=False):
        """A channel holding only this step's trees (as after the walk consumed the last step's);
        ``ahead``: the attach runs the tree step's look-ahead (``expect``), as in the engine."""
        self.hk._where.clear()
        self.hk._att.clear()
        self.hk.on_attach = self.st.expect if ahead else None
        self.attach()
        self.hk.on_attach = None

    def prepare(self):
        self.st._prepare(self.req_ids, self.nd, self.nsched, self.B, self.T, self.positions)

    def pending_index(self):
        self.hk.pending_index(self.req_ids, self.nd, self.N + 1)

    def route(self):
        ro = self.hk.route(self.req_ids, self.nd, None)
        self.hk.account(ro)
        return ro

    def tree_tensors(self, ro):
        return self.hk.tree_tensors(ro, depths=False)

    def verify(self, tt):
        parents = tt[0]
        return self.hk.verify(self.draft, parents, self.cu, self.N + 1, self.N, target_argmax=self.argmax)

    def upload_many(self):
        hook.upload_many(self.dev, self.arrays)

    def compact(self):
        self.compactor(self.slots, self.root_ext, self.rows, self.acc, num_reqs=self.B, counts=self.counts,
                       tree=self.tree)

    def drafter_rows(self):
        self.gatherer(self.root_ext, self.rows, self.acc, positions=self.positions, num_reqs=self.B)


def host_us(fn, iters, sync, setup=None):
    """Median host µs of ``fn(setup())`` (``fn()`` without setup), the device drained before each call."""
    ts = []
    for i in range(iters + 3):
        arg = setup() if setup is not None else None
        sync()
        t0 = time.perf_counter()
        fn(arg) if setup is not None else fn()
        t = (time.perf_counter() - t0) * 1e6
        if i >= 3:  # the first calls compile / warm caches
            ts.append(t)
    sync()
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--batch", type=int, nargs="+", default=None)
    ap.add_argument("--budget", type=int, nargs="+", default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", type=int, nargs=2, metavar=("B", "N"), default=None,
                    help="cProfile the step's runtime calls of this case: the top functions by own time")
    a = ap.parse_args()
    dev = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda:0")  # as vLLM's runner.device
    batches = a.batch or ([1, 2] if a.smoke else [1, 8, 32])
    budgets = a.budget or ([4] if a.smoke else [16, 32, 64])
    iters = a.iters or (5 if a.smoke else 200)
    V = a.vocab or (64 if a.smoke else 151936)
    L = 3 if a.smoke else 15
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    from ddtree_patcher import kernels as K

    res = dict(device=torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", torch=torch.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), iters=iters, rows=[], floors={})
    x = torch.zeros(16, device=dev)
    res["floors"]["torch_op"] = host_us(lambda: x.add_(1), iters, sync)
    if dev.type == "cuda":
        import triton
        import triton.language as tl

        @triton.jit
        def _tiny(a, b, c, d, e, f, g, n, BLOCK: tl.constexpr):
            i = tl.arange(0, BLOCK)
            tl.store(a + i, tl.load(b + i, mask=i < n, other=0), mask=i < n)

        bufs = [torch.zeros(16, device=dev) for _ in range(7)]
        res["floors"]["triton_launch"] = host_us(lambda: _tiny[(1,)](*bufs, 16, BLOCK=16), iters, sync)
    ok = True
    kernels_run = dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"  # Triton on this device
    for B in batches:
        for N in budgets:
            try:
                c = Case(dev, B, N)
                row = dict(B=B, N=N)
                row["attach"] = host_us(lambda _: c.attach(), iters, sync, setup=lambda: c.hk._where.clear())
                row["pending_index"] = host_us(lambda _: c.pending_index(), iters, sync, setup=c.fresh)
                row["prepare"] = host_us(lambda _: c.prepare(), iters, sync, setup=c.fresh)
                row["expect"] = host_us(lambda _: c.st.expect(c.req_ids, 0), iters, sync, setup=c.fresh)
                row["prepare_ahead"] = host_us(lambda _: c.prepare(), iters, sync, setup=lambda: c.fresh(ahead=True))
                assert c.st.expected_steps >= iters, "the look-ahead prepare did not run"
                row["upload_many"] = host_us(c.upload_many, iters, sync)
                row["route"] = host_us(lambda _: c.route(), iters, sync, setup=c.fresh)

                def routed():
                    c.fresh()
                    return c.route()

                row["tree_tensors"] = host_us(c.tree_tensors, iters, sync, setup=routed)
                row["verify"] = host_us(c.verify, iters, sync, setup=lambda: c.tree_tensors(routed()))
                if kernels_run:
                    row["compact"] = host_us(c.compact, iters, sync)
                    row["rows"] = host_us(c.drafter_rows, iters, sync)
                    logits = torch.randn(B, L, V, device=dev).to(torch.bfloat16 if dev.type == "cuda" else torch.float32)
                    from ddtree_patcher.runtime.ddtree import SPINE_FIRST

                    def build():  # the proposer's call (DDTreeDrafter.build)
                        return K.build_tree(logits, N, None, ancestor_mask=False, spine_first=SPINE_FIRST)

                    row["build_tree"] = host_us(build, iters, sync)
                    import importlib

                    bt = importlib.import_module("ddtree_patcher.kernels.build_tree")
                    row["build_fresh"] = host_us(lambda _: build(), iters, sync, setup=bt._SCRATCH.clear)
                    t1, t2 = build(), build()  # cached scratch: same trees
                    for f in ("tokens", "parents", "depths", "scores", "exact", "lse", "topk_ids"):
                        assert torch.equal(getattr(t1, f), getattr(t2, f)), f
                    from ddtree_patcher.runtime.ddtree import DDTreeDrafter

                    dd = DDTreeDrafter("V1", N, L, dev, B)
                    flat = logits.view(B * L, V)
                    row["dd_build"] = host_us(lambda: dd.choose([True] * B, *dd.build(flat)[::-1]), iters, sync)
                row["step_sum"] = sum(row[k] for k in ("attach", "prepare", "route", "tree_tensors", "verify",
                                                       "build_tree", "compact", "rows") if k in row)
                # the same step with the look-ahead: expect at the attach, the short prepare
                row["step_sum_ahead"] = row["step_sum"] - row["prepare"] + row["expect"] + row["prepare_ahead"]
                res["rows"].append(row)
            except Exception as exc:  # noqa: BLE001
                import traceback

                res["rows"].append(dict(B=B, N=N, error=traceback.format_exc()[-2000:]))
                print(res["rows"][-1]["error"], file=sys.stderr)
                ok = False
    if a.profile:
        import cProfile
        import pstats

        c = Case(dev, *a.profile)

        def one_step():  # a V1 step's runtime calls with the look-ahead, as the engine makes them
            c.hk._where.clear()
            c.hk._att.clear()
            c.hk.on_attach = c.st.expect
            c.attach()  # the proposer (with expect)
            c.prepare()
            c.verify(c.tree_tensors(c.route()))
            if kernels_run:
                c.compact()
                c.drafter_rows()

        for _ in range(3):
            one_step()
        sync()
        pr = cProfile.Profile()
        for _ in range(iters):
            sync()
            pr.enable()
            one_step()
            pr.disable()
        st = pstats.Stats(pr)
        top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:25]  # (file, line, fn) -> (cc, nc, tt, ct, ...)
        res["profile"] = dict(B=a.profile[0], N=a.profile[1], calls=iters, top=[
            dict(fn=f"{pathlib.Path(k[0]).name}:{k[1]}({k[2]})", own_us=v[2] / iters * 1e6, cum_us=v[3] / iters * 1e6,
                 calls=v[1] / iters) for k, v in top])
    res["ok"] = ok
    out = a.out or (os.path.join(os.environ["OUT"], "bench_host_path.json") if os.environ.get("OUT") else None)
    if out:
        pathlib.Path(out).write_text(json.dumps(res, indent=1))
    fl = res["floors"]
    print(f"{res['device']} | torch {res['torch']} | {res['date']} | host µs per call, median of {iters} "
          f"(device drained before each call)")
    print("floors: " + ", ".join(f"{k} {v:.1f}" for k, v in fl.items()))
    cols = ("attach", "pending_index", "prepare", "expect", "prepare_ahead", "upload_many", "route", "tree_tensors",
            "verify", "build_tree", "build_fresh", "dd_build", "compact", "rows", "step_sum", "step_sum_ahead")
    print(f"{'B':>3} {'N':>3} " + " ".join(f"{k:>13}" for k in cols))
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['B']:>3} {r['N']:>3} ERROR")
            continue
        print(f"{r['B']:>3} {r['N']:>3} " + " ".join(f"{r[k]:>13.1f}" if k in r else f"{'-':>13}" for k in cols))
    if "profile" in res:
        pf = res["profile"]
        print(f"\ncProfile of a step's runtime calls, B = {pf['B']}, N = {pf['N']} (µs per step; profiling inflates each "
              "call):")
        print(f"{'own':>8} {'cum':>8} {'calls':>6}  function")
        for t in pf["top"]:
            print(f"{t['own_us']:>8.1f} {t['cum_us']:>8.1f} {t['calls']:>6.1f}  {t['fn']}")
    print("HOST-PATH-BENCH " + ("ok" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
