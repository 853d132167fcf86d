#!/usr/bin/env python3
"""Benchmark the tree-shaped target step's kernels on a GPU (issue 13; design: docs/tree-step.md).

Dense bf16 Qwen3-8B attention shape (32 q heads, 8 KV heads, head_dim 128), paged KV in vLLM
0.26's FlashAttention layout (logical (nb, H, bs, 2D), stored (nb, bs, H, 2D), block size 16).

1. Correctness on the device: ``tree_attention`` (context + tree, one kernel) and, if vLLM's FA3
   is importable, FA3's context pass (``causal=False``, ``seqused_k = context_lens``,
   ``return_softmax_lse``) + ``tree_attention_merge`` in place, against an fp32 dense reference
   with the explicit ``[q_len, ctx + q_len]`` mask, on random trees, context 1K / 16K (tree keys
   are drawn larger so that the mask matters; "sens" is how far a wrong, causal mask would be);
   FA3's context ``softmax_lse`` against the reference (layout / units); a chain-shaped tree ==
   causal attention (reference, and FA3's own causal call: the max difference is reported);
   ``KVCompactor`` (36-layer-style pointer table, bf16 and fp8) and ``RowGatherer`` == the
   references bit for bit.
2. Timing, CUDA-graph replay medians (block tables rotated over disjoint blocks so one replay
   reads > 2x L2): B in {1, 8, 32}, n in {16, 64}, context 1K / 16K: the chain step's attention
   (FA3 causal over ``ctx + n + 1`` keys, ``n + 1`` query rows; AOT scheduler metadata and
   ``num_splits = 32`` as vLLM's FULL graphs call it), tree attention = FA3 context pass + merge,
   the FA3 context pass alone, the tree pass + merge alone, and the one-kernel mode; compaction
   of 36 layers and the drafter-row gather at B = 32.
3. Prints a table, writes ``--out`` JSON (default ``$OUT/bench_tree_step.json``), ends with
   ``TREE-STEP-BENCH ok`` or ``TREE-STEP-BENCH FAIL <what>``.

Without vLLM (no FA3) the FA columns read n/a and the rest runs (torch + Triton only).
``--smoke``: the same code on the CPU under the Triton interpreter, tiny shapes, the FA3 calls
replaced by a dense emulation (wall clock instead of CUDA graphs). From the repository root:
``PYTHONPATH=.:<site with vllm> python benchmarks/bench_tree_step.py --out x.json``.
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
TA = importlib.import_module("ddtree_patcher.kernels.tree_attention")
R = importlib.import_module("ddtree_patcher.kernels.tree_step_reference")

NUM_LAYERS = 36
STREAM_MAX_REQS = 8  # ddtree_patcher.runtime.tree_step.STREAM_MAX_REQS (not imported: no vLLM here)
MIN_CALLS = 8  # attention calls per timed graph at least (a step's graph holds one per layer)
FA_SPLITS = 32  # vLLM's attention_config.flash_attn_max_num_splits_for_cuda_graph default


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------
# Trees
# ----------------------------------------------------------------------------
def random_parents(n, gen, chain=False):
    if chain:
        return list(range(n))
    return [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n + 1)]


def ancestor_dense(parents, W):
    m = torch.zeros(W, W, dtype=torch.bool)
    m[0, 0] = True
    for j, p in enumerate(parents, start=1):
        m[j] = m[p]
        m[j, j] = True
    return m


def random_walk(parents, gen, stop=0.1):
    """A random root-to-node path; at each node the walk stops with probability ``stop`` (0: down
    to a leaf, a deep acceptance)."""
    children = {}
    for j, p in enumerate(parents, start=1):
        children.setdefault(p, []).append(j)
    path = [0]
    while children.get(path[-1]) and float(torch.rand(1, generator=gen)) >= stop:
        ch = children[path[-1]]
        path.append(ch[int(torch.randint(0, len(ch), (1,), generator=gen))])
    return path


# ----------------------------------------------------------------------------
# A step: paged KV in the FA 0.26 layout, B requests of n + 1 rows, random trees
# ----------------------------------------------------------------------------
class Cache:
    """One layer's KV: physical (nb, bs, H, 2D), logical (nb, H, bs, 2D) as vLLM 0.26 allocates."""

    def __init__(self, nb, bs, H, D, dtype, dev):
        self.phys = torch.randn(nb, bs, H, 2 * D, device=dev, dtype=torch.float32 if dev.type == "cpu"
                                else dtype).to(dtype)
        self.kv_cache = self.phys.transpose(1, 2)
        self.k, self.v = K.kv_views(self.kv_cache, "fa-nbhbs2d", D)
        self.nb, self.bs = nb, bs


class Step:
    def __init__(self, cache, B, n, ctx, Hq, dev, gen, sets=1, chain=False, tree_key_scale=1.0):
        bs, D = cache.bs, cache.k.shape[-1]
        self.B, self.n, self.ctx, self.W, self.bs, self.k_heads = B, n, ctx, n + 1, bs, cache.k.shape[2]
        self.blocks = math.ceil((ctx + n + 1) / bs)
        need = sets * B * self.blocks
        assert need <= cache.nb, f"cache too small: {need} > {cache.nb} blocks"
        perm = torch.randperm(cache.nb, generator=gen)[:need].to(torch.int32)
        self.block_tables = [perm[i * B * self.blocks:(i + 1) * B * self.blocks].view(B, self.blocks)
                             .contiguous().to(dev) for i in range(sets)]
        self.bt = self.block_tables[0]
        T = B * (n + 1)
        self.T = T
        self.qsl_list = [r * (n + 1) for r in range(B + 1)]
        self.qsl = torch.tensor(self.qsl_list, dtype=torch.int32, device=dev)
        self.ctx_lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        self.seq_lens = torch.full((B,), ctx + n + 1, dtype=torch.int32, device=dev)
        self.q = torch.randn(T, Hq, D, generator=gen).to(cache.k.dtype).to(dev)
        self.parents = [random_parents(n, gen, chain) for _ in range(B)]
        self.dense = [ancestor_dense(p, n + 1) for p in self.parents]
        self.mask = R.pack_mask(torch.stack(self.dense)).to(dev)
        self.dense = [d.to(dev) for d in self.dense]
        self.scale = D ** -0.5
        bt = self.bt.cpu()
        slots = [int(bt[r, (ctx + j) // bs]) * bs + (ctx + j) % bs for r in range(B) for j in range(n + 1)]
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=dev)
        if tree_key_scale != 1.0:  # tree keys larger than context keys: the mask matters
            s = self.slot_mapping
            cache.k[s // bs, s % bs] = (cache.k[s // bs, s % bs].float() * tree_key_scale).to(cache.k.dtype)

    def args(self, cache, i=0):
        return (self.q, cache.k, cache.v, self.block_tables[i], self.qsl, self.ctx_lens, self.mask,
                self.scale)


def dense_ref(q, k, v, bt, qsl, kv_len, scale, *, ctx=None, masks=None, causal=False):
    """fp32 attention per request on q's device: queries qsl[r]..qsl[r+1] over positions
    0..kv_len[r]-1; ``masks[r]`` (bool [nq, nq]) limits the keys at ctx[r].. (tree); ``causal``:
    bottom-right causal. Returns (out fp32 [T, Hq, D], lse fp32 [Hq, T]); other rows 0 / -inf."""
    T, Hq, D = q.shape
    G = Hq // k.shape[2]
    bs = k.shape[1]
    out = torch.zeros(T, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((Hq, T), -math.inf, dtype=torch.float32, device=q.device)
    for r in range(len(qsl) - 1):
        qs, qe, L = qsl[r], qsl[r + 1], kv_len[r]
        nq = qe - qs
        if nq == 0 or L == 0:
            continue
        pos = torch.arange(L, device=q.device)
        blk = bt[r, pos // bs].long()
        kk = k[blk, pos % bs].float().repeat_interleave(G, dim=1)  # [L, Hq, D]
        vv = v[blk, pos % bs].float().repeat_interleave(G, dim=1)
        s = torch.einsum("mhd,nhd->hmn", q[qs:qe].float(), kk) * scale
        vis = torch.ones(nq, L, dtype=torch.bool, device=q.device)
        if causal:
            vis = pos[None, :] <= (L - nq + torch.arange(nq, device=q.device))[:, None]
        if masks is not None:
            vis[:, ctx[r]:ctx[r] + nq] = masks[r]
        s = s.masked_fill(~vis[None], -math.inf)
        lse[:, qs:qe] = torch.logsumexp(s, dim=-1)
        out[qs:qe] = torch.einsum("hmn,nhd->mhd", torch.softmax(s, dim=-1), vv)
    return out, lse


# ----------------------------------------------------------------------------
# FlashAttention 3 (vLLM's bundle) or, in --smoke, a dense emulation with the same calls
# ----------------------------------------------------------------------------
class FA3:
    name = "FA3"

    def __init__(self, varlen, sched):
        self.varlen, self.sched = varlen, sched
        self.use_meta = True  # cleared (and said so) if FA3 rejects its own AOT metadata

    def metadata(self, st, causal):
        """vLLM's AOT scheduler metadata for one call shape (FULL-graph style); None if it fails."""
        if not self.use_meta:
            return None
        try:
            kv = st.seq_lens if causal else st.ctx_lens
            return self.sched(batch_size=st.B, max_seqlen_q=st.n + 1,
                              max_seqlen_k=st.ctx + (st.n + 1 if causal else 0),
                              num_heads_q=st.q.shape[1], num_heads_kv=st.k_heads, headdim=st.q.shape[2],
                              cache_seqlens=kv, qkv_dtype=st.q.dtype, cu_seqlens_q=st.qsl,
                              page_size=st.bs, causal=causal, window_size=(-1, -1),
                              num_splits=FA_SPLITS)
        except Exception as exc:  # noqa: BLE001
            log(f"[fa] get_scheduler_metadata failed ({exc!r}); calling without it")
            return None

    def call(self, st, cache, i, causal, out, meta, lse=False):
        return self.varlen(q=st.q, k=cache.k, v=cache.v, max_seqlen_q=st.n + 1, cu_seqlens_q=st.qsl,
                           max_seqlen_k=st.ctx + (st.n + 1 if causal else 0),
                           seqused_k=st.seq_lens if causal else st.ctx_lens,
                           softmax_scale=st.scale, causal=causal, block_table=st.block_tables[i],
                           return_softmax_lse=lse, out=out, scheduler_metadata=meta,
                           num_splits=FA_SPLITS if meta is not None else 0, fa_version=3)


class EmulatedFA(FA3):
    name = "emulated FA (dense fp32)"

    def __init__(self):
        pass

    def metadata(self, st, causal):
        return None

    def call(self, st, cache, i, causal, out, meta, lse=False):
        kv = [st.ctx + (st.n + 1 if causal else 0)] * st.B
        o, l_ = dense_ref(st.q, cache.k, cache.v, st.block_tables[i], st.qsl_list, kv, st.scale,
                          causal=causal)
        out.copy_(o.to(out.dtype))
        return (out, l_) if lse else out


def load_fa(smoke):
    if smoke:
        return EmulatedFA(), "smoke: FA3 emulated by a dense fp32 reference"
    t0 = time.time()
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fai
        import vllm
        if not fai.FA3_AVAILABLE:
            return None, f"vLLM {vllm.__version__}: FA3 unavailable ({fai.FA3_UNAVAILABLE_REASON})"
        return (FA3(fai.flash_attn_varlen_func, fai.get_scheduler_metadata),
                f"vLLM {vllm.__version__} FA3 from {fai.__file__} (import {time.time() - t0:.1f}s)")
    except Exception as exc:  # noqa: BLE001
        return None, f"vllm.vllm_flash_attn not importable: {exc!r}"


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------
def n_sets(bytes_per_set, l2, max_r=32):
    return max(1, min(max_r, math.ceil(2.0 * l2 / max(bytes_per_set, 1)))) if l2 else 1


# ----------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------
def _rel(got, ref):
    return ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def check_attention(cache, fa, dev, cfg, Hq, results):
    """Random trees and a chain at each context: one-kernel, FA3 context + merge, FA3's lse."""
    ok = True
    gen = torch.Generator().manual_seed(1)
    ctx_pass = fa if fa is not None else EmulatedFA()  # without FA3 the merge still gets checked
    for ctx, B, n, chain in cfg:
        name = f"attn ctx={ctx} B={B} n={n}" + (" chain" if chain else "")
        row = dict(check=name, ctx_pass=ctx_pass.name)
        try:
            st = Step(cache, B, n, ctx, Hq, dev, gen, chain=chain, tree_key_scale=3.0)
            kv = [ctx + n + 1] * B
            ref, rlse = dense_ref(st.q, cache.k, cache.v, st.bt, st.qsl_list, kv, st.scale,
                                  ctx=[ctx] * B, masks=st.dense)
            causal, _ = dense_ref(st.q, cache.k, cache.v, st.bt, st.qsl_list, kv, st.scale, causal=True)
            row["sens"] = _rel(causal, ref)  # what a causal mask over the nodes would get wrong
            out, lse = K.tree_attention(*st.args(cache), return_lse=True)
            row["one_kernel_rel_err"] = _rel(out, ref)
            row["one_kernel_lse_err"] = (lse - rlse).abs().max().item()
            good = row["one_kernel_rel_err"] <= 2e-2 and row["one_kernel_lse_err"] <= 2e-2
            meta = ctx_pass.metadata(st, causal=False)
            o = torch.empty_like(st.q)
            try:
                o, l_ = ctx_pass.call(st, cache, 0, False, o, meta, lse=True)
            except Exception:  # noqa: BLE001
                if meta is None:
                    raise
                row["fa_meta_error"] = traceback.format_exc()[-1500:]  # then FA3 without AOT metadata
                log(f"[fa] call with AOT scheduler metadata failed; without it from now on:\n{row['fa_meta_error']}")
                ctx_pass.use_meta = False
                o, l_ = ctx_pass.call(st, cache, 0, False, o, None, lse=True)
            cref, clse = dense_ref(st.q, cache.k, cache.v, st.bt, st.qsl_list, [ctx] * B, st.scale)
            row["fa_ctx_lse_shape"] = list(l_.shape)
            row["fa_ctx_lse_err"] = (l_[:, :st.T] - clse).abs().max().item()
            row["fa_ctx_rel_err"] = _rel(o, cref)
            K.tree_attention_merge(*st.args(cache), o, l_, out=o)
            row["merge_rel_err"] = _rel(o, ref)
            good = good and row["fa_ctx_lse_err"] <= 2e-2 and row["merge_rel_err"] <= 2e-2
            if chain:  # the chain step's own call on the same tokens
                mc = ctx_pass.metadata(st, causal=True)
                oc = ctx_pass.call(st, cache, 0, True, torch.empty_like(st.q), mc)
                row["fa_causal_rel_err"] = _rel(oc, ref)
                row["chain_tree_vs_fa_causal_maxdiff"] = (o.float() - oc.float()).abs().max().item()
                row["chain_tree_vs_fa_causal_identical"] = bool(torch.equal(o, oc))
            if chain:
                row["chain_ref_vs_causal"] = (ref - causal).abs().max().item()
                good = good and row["chain_ref_vs_causal"] < 1e-5
            row["ok"] = bool(good)
        except Exception:  # noqa: BLE001
            row.update(ok=False, error=traceback.format_exc()[-2500:])
            log(row["error"])
        ok &= row["ok"]
        results["checks"].append(row)
        log(f"[check] {name}: " + ", ".join(f"{k}={_g(v)}" for k, v in row.items() if k not in ("check", "error")))
    return ok


def _g(v):
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def make_walk(steps_parents, qsl_list, W, gen, dev, stop=0.1):
    B = len(steps_parents)
    rows = torch.full((B, W), -1, dtype=torch.int32)
    nacc = torch.zeros(B, dtype=torch.int32)
    for r, par in enumerate(steps_parents):
        path = random_walk(par, gen, stop)[:W]
        rows[r, :len(path)] = torch.tensor(path, dtype=torch.int32) + qsl_list[r]
        nacc[r] = len(path) - 1
    return rows.to(dev), nacc.to(dev)


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def check_compaction(dev, H, D, hidden, results):
    ok = True
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        name = f"compaction {str(dtype)[6:]} + gather"
        row = dict(check=name)
        try:
            layers = [Cache(64, 16, H, D, torch.bfloat16, dev) for _ in range(4)]
            for c in layers:
                c.phys = c.phys.to(dtype)
                c.kv_cache = c.phys.transpose(1, 2)
            st = Step(layers[0], 6, 16, 50, 2 * H, dev, gen)
            rows, nacc = make_walk(st.parents, st.qsl_list, st.W, gen, dev)
            views = [K.packed_kv_view(c.kv_cache) for c in layers]
            exp = [v.clone() for v in views]
            R.compact_kv_ref(exp, st.slot_mapping, st.qsl, rows, nacc)
            K.KVCompactor(views)(st.slot_mapping, st.qsl, rows, nacc)
            kv_ok = all(torch.equal(_bits(a.contiguous()), _bits(b.contiguous())) for a, b in zip(views, exp))
            h = torch.randn(st.T, hidden, device=dev).to(torch.bfloat16)
            pos = (torch.arange(st.T, device=dev) + 7).to(torch.int64)
            h2, pos2 = h.clone(), pos.clone()
            R.gather_accepted_rows_ref([h2], st.qsl, rows, nacc, positions=pos2)
            K.RowGatherer([h])(st.qsl, rows, nacc, positions=pos)
            g_ok = torch.equal(_bits(h), _bits(h2)) and torch.equal(pos, pos2)
            row.update(kv_identical=kv_ok, gather_identical=g_ok, mean_accepted=nacc.float().mean().item(),
                       ok=bool(kv_ok and g_ok))
        except Exception:  # noqa: BLE001
            row.update(ok=False, error=traceback.format_exc()[-2500:])
            log(row["error"])
        ok &= row["ok"]
        results["checks"].append(row)
        log(f"[check] {name}: " + ", ".join(f"{k}={_g(v)}" for k, v in row.items() if k not in ("check", "error")))
    return ok


# ----------------------------------------------------------------------------
# Timing rows
# ----------------------------------------------------------------------------
def bench_attention(cache, fa, dev, B, n, ctx, Hq, l2, timer):
    gen = torch.Generator().manual_seed(100 * B + n + ctx)
    Hkv, D = cache.k.shape[2], cache.k.shape[3]
    sets = n_sets(B * (ctx + n + 1) * Hkv * D * 2 * cache.k.element_size(), l2)
    while sets > 1 and sets * B * math.ceil((ctx + n + 1) / cache.bs) > cache.nb:
        sets -= 1
    st = Step(cache, B, n, ctx, Hq, dev, gen, sets=sets)
    row = dict(B=B, n=n, ctx=ctx, sets=sets)
    out = torch.empty_like(st.q)
    out2 = torch.empty_like(st.q)
    fake_ctx = torch.randn_like(st.q)
    fake_lse = torch.full((Hq, st.T), 8.0, device=dev)
    # at least MIN_CALLS calls per graph (cycling through the sets): with one call per replay the
    # replay's own cost (~15 µs: launch_floor) would be part of every time
    idx = [i % sets for i in range(max(sets, MIN_CALLS))]
    row["calls"] = len(idx)
    row["one_kernel"] = timer([lambda i=i: K.tree_attention(*st.args(cache, i), out=out) for i in idx])
    row["tree_pass_merge"] = timer([lambda i=i: K.tree_attention_merge(*st.args(cache, i), fake_ctx, fake_lse,
                                                                        out=out2) for i in idx])
    if fa is not None:
        try:  # an FA3 failure keeps the Triton timings of the row
            mc, mx = fa.metadata(st, causal=True), fa.metadata(st, causal=False)
            row["fa_meta"] = mc is not None and mx is not None

            def tree(i):
                o, l_ = fa.call(st, cache, i, False, out, mx, lse=True)
                K.tree_attention_merge(*st.args(cache, i), o, l_, out=o)

            # the two-pass form: the tree pass alone (it does not read the context pass), then an
            # lse merge; "conc" runs the tree pass on a second stream beside the FA3 context pass
            side = torch.cuda.Stream() if dev.type == "cuda" else None
            t_out = torch.empty(st.q.shape, dtype=torch.float32, device=dev)  # the tree pass unrounded
            t_lse = torch.empty(Hq, st.T, dtype=torch.float32, device=dev)
            out3 = torch.empty_like(st.q)

            def tree2(i, conc):
                args = st.args(cache, i)
                if conc and side is not None:
                    main = torch.cuda.current_stream()
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        K.tree_attention_merge(*args, None, None, out=t_out, lse=t_lse)
                    o, l_ = fa.call(st, cache, i, False, out, mx, lse=True)
                    main.wait_stream(side)
                else:
                    K.tree_attention_merge(*args, None, None, out=t_out, lse=t_lse)
                    o, l_ = fa.call(st, cache, i, False, out, mx, lse=True)
                K.merge_attention_states(o, l_, t_out, t_lse, st.qsl, st.ctx_lens, out=out3, width=st.W)

            row["chain_fa3"] = timer([lambda i=i: fa.call(st, cache, i, True, out2, mc) for i in idx])
            row["fa3_ctx"] = timer([lambda i=i: fa.call(st, cache, i, False, out, mx, lse=True) for i in idx])
            row["tree_fa3_merge"] = timer([lambda i=i: tree(i) for i in idx])
            row["ratio"] = row["tree_fa3_merge"] / row["chain_fa3"]
            row["tree_2pass"] = timer([lambda i=i: tree2(i, False) for i in idx])
            row["tree_conc"] = timer([lambda i=i: tree2(i, True) for i in idx])
            row["ratio_conc"] = row["tree_conc"] / row["chain_fa3"]
            tree(0)
            want = out.float().clone()
            tree2(0, True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            row["conc_maxdiff"] = (out3.float() - want).abs().max().item()
            row["ratio_one_kernel"] = row["one_kernel"] / row["chain_fa3"]
        except Exception:  # noqa: BLE001
            row["fa_error"] = traceback.format_exc()[-2500:]
            log(row["fa_error"])
    return row


SWEEP_SHAPES = ((32, 64, 1024), (8, 64, 1024), (8, 16, 1024), (1, 16, 1024), (32, 16, 1024), (1, 64, 1024))
# launch settings (TreeAttentionTuning fields) against PRODUCTION: key tiles in a loop (the
# 2026-11-30 sweep's winners: BLOCK_T 32, 1 stage) and one key tile (_tree_tile_kernel) with and
# without the folded last M tile
SWEEP_CFGS = ([dict(block_m=m, block_t=t, num_warps=4, num_stages=1) for m in (32, 64) for t in (16, 32)]
              + [dict(one_tile=True, fold_tail=f, block_m=m) for m in (32, 64) for f in (False, True)]
              + [dict(one_tile=True, block_m=64, num_warps=8)])


def sweep_pass(cache, dev, Hq, l2, timer, shapes, cfgs, deadline):
    """The tree pass + merge alone (tree_attention_merge from a given context pass) per launch
    configuration (``TreeAttentionTuning``; PRODUCTION first): which (BLOCK_M, BLOCK_T, warps,
    stages, one tile) is fastest at each shape."""
    out_rows = []
    for B, n, ctx in shapes:
        gen = torch.Generator().manual_seed(3 * B + n)
        Hkv, D = cache.k.shape[2], cache.k.shape[3]
        sets = n_sets(B * (n + 1) * Hq * D * 2 * 3, l2)
        while sets > 1 and sets * B * math.ceil((ctx + n + 1) / cache.bs) > cache.nb:
            sets -= 1
        st = Step(cache, B, n, ctx, Hq, dev, gen, sets=sets)
        fake_ctx = torch.randn_like(st.q)
        fake_lse = torch.full((Hq, st.T), 8.0, device=dev)
        out2 = torch.empty_like(st.q)
        ref = K.tree_attention_merge(*st.args(cache, 0), fake_ctx, fake_lse)
        res = []
        shape_deadline = time.time() + (deadline - time.time()) / max(1, len(shapes) - len(out_rows))
        for cfg in [dataclasses.asdict(TA.PRODUCTION)] + list(cfgs):  # the production settings first
            if time.time() > shape_deadline:
                break
            try:
                tuning = dataclasses.replace(TA.PRODUCTION, **cfg)
                got = TA._tree_attention_merge_tuned(*st.args(cache, 0), fake_ctx, fake_lse, tuning)
                err = (got.float() - ref.float()).abs().max().item()
                us = timer([lambda i=i % sets: TA._tree_attention_merge_tuned(*st.args(cache, i), fake_ctx, fake_lse,
                                                                             tuning, out=out2)
                            for i in range(max(sets, MIN_CALLS))])
                res.append(dict(cfg, us=us, maxdiff=err))
            except Exception as e:  # noqa: BLE001 (a config that does not compile: skipped)
                res.append(dict(cfg, error=f"{type(e).__name__}: {str(e)[:200]}"))
        ok = sorted((r for r in res if "us" in r), key=lambda r: r["us"])
        default = res[0] if res else None  # PRODUCTION
        out_rows.append(dict(B=B, n=n, ctx=ctx, best=ok[:5], default=default, tried=len(res)))
        log(f"[sweep] B={B} n={n} ctx={ctx}: best {ok[:3]} default {default}")
    return out_rows


def compaction_case(dev, B, n, H, D, layers_n, walk="random"):
    """(layers, step, accepted rows, accepted depths): ``layers_n`` bf16 caches, B trees of n nodes
    over a 64-token context and a walk result, seeded by n. ``walk="random"``: random trees
    (shallow), a random walk (mean accepted ~2); ``"deep"``: spine-heavy trees (each node's
    parent is the node before it with probability 0.7, as a best-first tree around a confident
    chain) walked down to a leaf, at most DEEP_A accepted (the paper's tau ~ 8-11);
    ``"drafted"`` / ``"drafted-pop"``: the trees ``build_tree`` makes from drafter-like logits
    (DRAFT_SHARP x N(0, 1) over DRAFT_V ids, depth 16, default K) in the runtime's spine-first node
    order / in pop order, walked as a target that takes the drafter's rank-r token with probability
    DRAFT_ACCEPT[r] at every depth (stops otherwise): the same trees and walks in both orders."""
    gen = torch.Generator().manual_seed(7 + n)
    ctx = 64
    nb = B * math.ceil((ctx + n + 1) / 16) + 8
    layers = [Cache(nb, 16, H, D, torch.bfloat16, dev) for _ in range(layers_n)]
    st = Step(layers[0], B, n, ctx, 2 * H, dev, gen)
    if walk.startswith("drafted"):
        rows, nacc = drafted_walk(B, n, st.qsl_list, st.W, dev, spine_first=walk == "drafted")
        return layers, st, rows, nacc
    if walk == "deep":  # compaction reads only the walk result and the slots: the mask is left as is
        st.parents = [[j - 1 if float(torch.rand(1, generator=gen)) < 0.7 else
                       int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n + 1)] for _ in range(B)]
    rows, nacc = make_walk(st.parents, st.qsl_list, min(st.W, DEEP_A + 1) if walk == "deep" else st.W, gen, dev,
                           0.0 if walk == "deep" else 0.1)
    if rows.shape[1] < st.W:
        rows = torch.cat([rows, rows.new_full((B, st.W - rows.shape[1]), -1)], 1).contiguous()
    return layers, st, rows, nacc


DEEP_A = 10
DRAFT_SHARP, DRAFT_V, DRAFT_L = 4.0, 512, 16
DRAFT_ACCEPT = (0.85, 0.08, 0.03)  # the target takes the drafter's rank-r token (else: the walk stops)


def drafted_walk(B, n, qsl_list, W, dev, spine_first=True):
    """(rows, accepted) of a walk over ``build_tree``'s trees (see ``compaction_case``); the same
    logits and the same rank draws whatever the node order."""
    g = torch.Generator().manual_seed(11 + n)
    x = (DRAFT_SHARP * torch.randn(B, DRAFT_L, DRAFT_V, generator=g)).to(dev)
    tree = K.build_tree(x, n, spine_first=spine_first)
    par, tok = tree.parents.cpu().tolist(), tree.tokens.cpu().tolist()
    rows = torch.full((B, W), -1, dtype=torch.int32)
    nacc = torch.zeros(B, dtype=torch.int32)
    cum = torch.tensor(DRAFT_ACCEPT).cumsum(0)
    for b in range(B):
        kids = {}
        for j in range(1, n + 1):  # siblings in rank order in both node orders
            if tok[b][j - 1] >= 0:
                kids.setdefault(par[b][j - 1], []).append(j)
        path = [0]
        for u in torch.rand(DRAFT_L, generator=g).tolist():
            r = int((cum <= u).sum())  # rank r with probability DRAFT_ACCEPT[r]; past them: stop
            ch = kids.get(path[-1], [])
            if r >= len(ch):
                break
            path.append(ch[r])
        rows[b, :len(path)] = torch.tensor(path, dtype=torch.int32) + qsl_list[b]
        nacc[b] = len(path) - 1
    return rows.to(dev), nacc.to(dev)


def bench_compaction(dev, B, n, walk, H, D, hidden, layers_n, timer):
    """The runtime's defaults: KV compaction of ``layers_n`` layers and the drafter-row gather,
    each timed as one call per graph replay (``*_us``) and per call of SEQ calls in one graph
    (``*_seq_us``: the kernel as it runs inside a step's graph, without the replay's launch)."""
    layers, st, rows, nacc = compaction_case(dev, B, n, H, D, layers_n, walk)
    comp = K.KVCompactor([K.packed_kv_view(c.kv_cache) for c in layers])
    h = torch.randn(st.T, hidden, device=dev).to(torch.bfloat16)
    pos = torch.arange(st.T, device=dev, dtype=torch.int64)
    gat = K.RowGatherer([h])
    row = dict(B=B, n=n, walk=walk, layers=layers_n, mean_accepted=nacc.float().mean().item(),
               max_accepted=int(nacc.max()), hidden=hidden)
    # the bytes the compaction must move: every accepted depth whose node is not the chain's (j_d != d)
    col = torch.arange(rows.shape[1], device=rows.device)
    live = (col[None, :] >= 1) & (col[None, :] <= nacc[:, None].to(col.dtype))
    moved = int((live & (rows.to(torch.int64) != st.qsl[:-1, None].to(torch.int64) + col[None, :])).sum())
    row["moved_rows"] = moved
    row["moved_bytes"] = moved * layers_n * 2 * H * D * layers[0].phys.element_size()  # K and V, every layer
    f = lambda: comp(st.slot_mapping, st.qsl, rows, nacc)  # noqa: E731
    g = lambda: gat(st.qsl, rows, nacc, positions=pos)  # noqa: E731
    row["compact_us"], row["compact_seq_us"] = timer([f]), timer([f] * SEQ)
    row["gather_us"], row["gather_seq_us"] = timer([g]), timer([g] * SEQ)
    del layers
    return row


def copy_bandwidth(dev, timer, nbytes=1 << 30, rates=None):
    """Device copy bandwidth (bytes read + written per second) over 1 GiB timed like the rows, the
    faster of a ``copy_`` (in a graph: a memcpy node, which may run on a copy engine) and an
    elementwise kernel on the SMs (``torch.add(a, 1, out=b)``, as the compaction's kernel moves
    bytes): the compaction's floor is its moved bytes, read once and written once, at this rate.
    ``rates``: a dict that receives both."""
    if dev.type != "cuda":
        return None
    a = torch.zeros(nbytes // 2, dtype=torch.int16, device=dev)
    b = torch.empty_like(a)
    got = {"copy_": 2 * nbytes / (timer([lambda: b.copy_(a)]) * 1e-6),
           "add_out": 2 * nbytes / (timer([lambda: torch.add(a, 1, out=b)]) * 1e-6)}
    del a, b
    if rates is not None:
        rates.update(got)
    return max(got.values())


def launch_floor(dev, timer):
    """A one-element kernel timed as the compaction rows are: what a graph replay costs by itself."""
    one = torch.zeros(1, device=dev)
    return dict(us=timer([lambda: one.add_(1)]), seq_us=timer([lambda: one.add_(1)] * SEQ))


COMP_SWEEP = ([dict(num_warps=1, depths_per_tile=1, chunk=1024, vectorize=False)]  # the 2026-12-01 kernel
              + [dict(num_warps=w, depths_per_tile=g, chunk=c) for g in (1, 2, 4) for c in (1024, 2048)
                 for w in (1, 2)])
GATHER_SWEEP = ([dict(num_warps=4, depths_per_tile=1, chunk=1024, vectorize=False)]
                + [dict(num_warps=w, depths_per_tile=g, chunk=1024) for g in (1, 4) for w in (1, 4)])
# (n, walk): compaction_case's random (mean accepted ~2) and deep (up to DEEP_A accepted) walks
COMP_CASES = ((16, "random"), (64, "random"), (64, "deep"), (64, "drafted"), (64, "drafted-pop"))
SEQ = 16  # calls per graph for the in-sequence time (the kernel among others in a step's graph)


def compaction_sweep(dev, H, D, hidden, layers_n, timer, cfgs, gcfgs, deadline, results):
    """Launch configurations of the KV compaction and of the drafter-row gather at B = 32, each
    checked bit for bit against the reference first. Two times per configuration: ``us`` = one
    call per graph replay (launch latency included, as the other rows), ``seq_us`` = per call of
    SEQ back-to-back calls in one graph (a repeated compaction moves the same bytes again: sources
    are never destinations). ``floor`` rows: a one-element kernel timed the same two ways."""
    out = []
    floor = dict(kind="floor", **launch_floor(dev, timer))
    out.append(floor)
    log(f"[comp-sweep] {floor}")
    for n, walk in COMP_CASES:
        B = 32
        layers, st, rows, nacc = compaction_case(dev, B, n, H, D, layers_n, walk)
        views = [K.packed_kv_view(c.kv_cache) for c in layers]
        exp = [v.clone() for v in views]
        R.compact_kv_ref(exp, st.slot_mapping, st.qsl, rows, nacc)
        base = [v.clone() for v in views]
        h = torch.randn(st.T, hidden, device=dev).to(torch.bfloat16)
        pos = torch.arange(st.T, device=dev, dtype=torch.int64)
        h_exp, pos_exp = h.clone(), pos.clone()
        R.gather_accepted_rows_ref([h_exp], st.qsl, rows, nacc, positions=pos_exp)
        h_base, pos_base = h.clone(), pos.clone()
        case = dict(n=n, B=B, walk=walk, layers=layers_n,
                    mean_accepted=nacc.float().mean().item(), max_accepted=int(nacc.max()))
        for kind, cs in (("kv", cfgs), ("gather", gcfgs)):
            for cfg in cs:
                if time.time() > deadline:
                    break
                row = dict(kind=kind, **case, **cfg)
                try:
                    if kind == "kv":
                        for v, b in zip(views, base):  # the timing runs of the last configuration moved rows
                            v.copy_(b)
                        comp = K.KVCompactor(views, **cfg)
                        f = lambda comp=comp: comp(st.slot_mapping, st.qsl, rows, nacc)  # noqa: E731
                        f()
                        row["identical"] = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(views, exp))
                    else:
                        h.copy_(h_base)
                        pos.copy_(pos_base)
                        gat = K.RowGatherer([h], **cfg)
                        f = lambda gat=gat: gat(st.qsl, rows, nacc, positions=pos)  # noqa: E731
                        f()
                        row["identical"] = bool(torch.equal(_bits(h), _bits(h_exp)) and torch.equal(pos, pos_exp))
                    row["us"] = timer([f])
                    row["seq_us"] = timer([f] * SEQ)
                except Exception:  # noqa: BLE001
                    row["error"] = traceback.format_exc()[-1500:]
                out.append(row)
                log(f"[comp-sweep] {row}")
        del layers, views, exp, base
    ok = [r for r in out if r.get("identical") and "us" in r]
    for kind in ("kv", "gather"):
        for n, walk in COMP_CASES:
            sel = [r for r in ok if r["kind"] == kind and r["n"] == n and r["walk"] == walk]
            best = min(sel, key=lambda r: r["seq_us"], default=None)
            if best:
                cfg = {k: best[k] for k in ("num_warps", "depths_per_tile", "chunk", "vectorize") if k in best}
                log(f"[comp-sweep] {kind} n={n} walk={walk} (mean a {best['mean_accepted']:.1f}, max "
                    f"{best['max_accepted']}): best in sequence {best['seq_us']:.1f} us (one replay "
                    f"{best['us']:.1f}) with {cfg}; floor {floor['seq_us']:.1f} ({floor['us']:.1f})")
    results["compaction_sweep"] = out
    return all(r.get("identical") for r in out if r.get("kind") != "floor")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny sizes")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/bench_tree_step.json)")
    ap.add_argument("--time-budget", type=float, default=115.0,
                    help="seconds after which the remaining timing rows are skipped")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--no-fa", action="store_true", help="do not import vLLM's FlashAttention (FA columns n/a)")
    ap.add_argument("--sweep", type=float, default=0.0,
                    help="seconds for a launch-configuration sweep of the tree pass (0: none)")
    ap.add_argument("--compaction-sweep", type=float, default=0.0,
                    help="seconds for a launch-configuration sweep of the KV compaction (0: none)")
    ap.add_argument("--compaction-only", action="store_true",
                    help="only the compaction check, its timing rows and its sweep (no attention)")
    args = ap.parse_args()
    t_start = time.time()
    smoke = args.smoke
    torch.manual_seed(0)
    dev = torch.device("cpu" if smoke else "cuda")
    import triton

    if smoke:  # tiny: 4 q heads, 2 KV heads, D 32
        Hq, Hkv, D, hidden = 4, 2, 32, 48
        batches, ns, ctxs = [1, 2], [4], [20]
        checks = [(20, 2, 5, False), (40, 1, 9, False), (20, 2, 4, True)]
        comp_cfg, layers_n = [(2, 4, "random"), (2, 6, "drafted")], 3
    else:
        Hq, Hkv, D, hidden = 32, 8, 128, 3 * 4096  # Qwen3-8B; hidden: a stand-in for DFlash's aux rows
        batches, ns, ctxs = [1, 8, 32], [16, 64], [1024, 16384]
        checks = [(1024, 4, 16, False), (1024, 2, 64, False), (16384, 2, 16, False),
                  (16384, 2, 64, False), (1024, 4, 16, True), (16384, 1, 64, True)]
        comp_cfg, layers_n = [(32, 16, "random"), (32, 64, "random"), (32, 64, "deep"),
                              (32, 64, "drafted"), (32, 64, "drafted-pop")], NUM_LAYERS
    results = dict(torch=torch.__version__, triton=triton.__version__, smoke=smoke,
                   date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), shape=dict(Hq=Hq, Hkv=Hkv, D=D, block_size=16),
                   checks=[], rows=[], compaction=[], skipped=[])
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        l2 = getattr(props, "L2_cache_size", 50 * 2**20) or 50 * 2**20
        results.update(device=props.name, sms=props.multi_processor_count, l2_bytes=l2)
        timer = graph_time
    else:
        l2 = 0
        results.update(device="cpu (Triton interpreter)", sms=0, l2_bytes=0)
        timer = wall_time
    fa, fa_note = (None, "--no-fa: FA3 not loaded") if args.no_fa else load_fa(smoke)
    if dev.type == "cuda":  # the fp32 references must not run in TF32 (vLLM's import may touch this)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    results["fa"] = fa_note
    log(f"device {results['device']}, torch {torch.__version__}, triton {triton.__version__}; {fa_note}")

    # one cache big enough for every timing row (B = 32 at 16K is the largest: ~2.2 GB bf16)
    nb = max(B * math.ceil((c + n + 1) / 16) for B in batches for n in ns for c in ctxs)
    nb = max(nb, max(b * math.ceil((c + n + 1) / 16) for c, b, n, _ in checks)) + 16
    cache = Cache(nb, 16, Hkv, D, torch.bfloat16, dev)
    log(f"KV cache: {nb} blocks x 16 x {Hkv} x {2 * D} bf16 = {cache.phys.numel() * 2 / 2**30:.2f} GiB "
        f"({time.time() - t_start:.1f}s)")
    failed = []
    if args.compaction_only:
        ctxs = []
    if not args.skip_checks:
        if not args.compaction_only and not check_attention(cache, fa, dev, checks, Hq, results):
            failed.append("attention")
        if not check_compaction(dev, Hkv, D, hidden if smoke else 256, results):
            failed.append("compaction")
        log(f"[check] done ({time.time() - t_start:.1f}s)")
    if comp_cfg:
        results["launch_floor"] = launch_floor(dev, timer)
        results["copy_rates"] = {}
        results["copy_bytes_per_s"] = copy_bandwidth(dev, timer, rates=results["copy_rates"])
    for B, n, walk in comp_cfg:
        try:
            results["compaction"].append(bench_compaction(dev, B, n, walk, Hkv, D, hidden, layers_n, timer))
            bw = results["copy_bytes_per_s"]
            if bw:  # the copy floor: the moved bytes read and written once at the measured copy rate
                c = results["compaction"][-1]
                c["copy_floor_us"] = 2 * c["moved_bytes"] / bw * 1e6
                c["x_copy_floor"] = c["compact_seq_us"] / c["copy_floor_us"] if c["copy_floor_us"] else None
            log(f"[bench] compaction {results['compaction'][-1]}")
        except Exception:  # noqa: BLE001
            results["compaction"].append(dict(B=B, n=n, walk=walk, error=traceback.format_exc()[-2500:]))
            log(results["compaction"][-1]["error"])
            failed.append(f"compaction-bench B={B} n={n} {walk}")
    if args.compaction_sweep > 0:
        cfgs = COMP_SWEEP if not smoke else COMP_SWEEP[::6]
        gcfgs = GATHER_SWEEP if not smoke else GATHER_SWEEP[::3]
        if not compaction_sweep(dev, Hkv, D, hidden, layers_n, timer, cfgs, gcfgs,
                                time.time() + args.compaction_sweep, results):
            failed.append("compaction-sweep")
    if args.sweep > 0 and not args.compaction_only:
        shapes = SWEEP_SHAPES if not smoke else ((2, 4, 20),)
        cfgs = SWEEP_CFGS if not smoke else SWEEP_CFGS[:2]
        results["sweep"] = sweep_pass(cache, dev, Hq, l2, timer, shapes, cfgs, time.time() + args.sweep)
    for ctx in ctxs:
        for n in ns:
            for B in batches:
                if time.time() - t_start > args.time_budget:
                    results["skipped"].append(dict(B=B, n=n, ctx=ctx))
                    log(f"[bench] time budget spent: skipping B={B} n={n} ctx={ctx}")
                    continue
                t0 = time.time()
                try:
                    results["rows"].append(bench_attention(cache, fa, dev, B, n, ctx, Hq, l2, timer))
                    if "fa_error" in results["rows"][-1]:
                        failed.append(f"FA3 B={B} n={n} ctx={ctx}")
                except Exception:  # noqa: BLE001
                    results["rows"].append(dict(B=B, n=n, ctx=ctx, error=traceback.format_exc()[-2500:]))
                    log(results["rows"][-1]["error"])
                    failed.append(f"bench B={B} n={n} ctx={ctx}")
                log(f"[bench] B={B} n={n} ctx={ctx} ({time.time() - t0:.1f}s)")
    results["fa_aot_metadata"] = getattr(fa, "use_meta", None)
    results["elapsed_s"] = time.time() - t_start
    results["ok"] = not failed
    out = args.out or (os.path.join(os.environ["OUT"], "bench_tree_step.json") if os.environ.get("OUT") else None)
    if out:
        pathlib.Path(out).write_text(json.dumps(results, indent=1))
        log(f"wrote {out}")
    print_table(results)
    log(f"elapsed {results['elapsed_s']:.0f}s")
    skipped = f" ({len(results['skipped'])} timing rows skipped: time budget)" if results["skipped"] else ""
    if fa is not None and not getattr(fa, "use_meta", True):
        skipped += " (FA3 ran without AOT scheduler metadata: see fa_meta_error)"
    log("TREE-STEP-BENCH " + ("ok" + skipped if not failed else "FAIL " + "; ".join(failed)))
    return 0 if not failed else 1


def _f(v, w=8, p=1):
    return f"{v:{w}.{p}f}" if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else f"{'n/a':>{w}}"


def print_table(res):
    log("\n" + "=" * 110)
    log(f"{res['device']} | torch {res['torch']} | triton {res['triton']} | {res['fa']} | {res['date']}")
    for c in res["checks"]:
        log(f"check {c['check']:<34} ok={c['ok']}  " + ", ".join(
            f"{k}={_g(v)}" for k, v in c.items() if k not in ("check", "ok", "error")))
    log(f"µs per call, CUDA-graph replay median over graphs of >= {MIN_CALLS} calls (sets of block tables / calls). chain = FA3 causal over ctx+n+1 keys (the chain step's "
        "attention, n+1 query rows); tree = FA3 context pass + tree_attention_merge; ctx = FA3 context "
        "pass alone; pass = tree pass + merge alone; one = tree_attention (one kernel); 2pass = tree pass alone, "
        "FA3 context pass, merge_attention_states; conc = the same with the tree pass on a second stream beside "
        "the context pass (diff: max |conc - tree| of one call)")
    log(f"{'B':>3} {'n':>3} {'ctx':>6} | {'chain':>8} {'tree':>8} {'x':>6} | {'ctx':>8} {'pass':>8} | "
        f"{'one':>8} {'x':>6} | {'2pass':>8} {'conc':>8} {'x':>6} {'diff':>8} | sets/calls")
    for r in res["rows"]:
        if "error" in r:
            log(f"{r['B']:>3} {r['n']:>3} {r['ctx']:>6} | ERROR")
            continue
        log(f"{r['B']:>3} {r['n']:>3} {r['ctx']:>6} | {_f(r.get('chain_fa3'))} {_f(r.get('tree_fa3_merge'))} "
            f"{_f(r.get('ratio'), 6, 2)} | {_f(r.get('fa3_ctx'))} {_f(r.get('tree_pass_merge'))} | "
            f"{_f(r.get('one_kernel'))} {_f(r.get('ratio_one_kernel'), 6, 2)} | {_f(r.get('tree_2pass'))} "
            f"{_f(r.get('tree_conc'))} {_f(r.get('ratio_conc'), 6, 2)} {_g(r.get('conc_maxdiff'))} | {r['sets']}/{r.get('calls', r['sets'])}")
    fl = res.get("launch_floor")
    if res.get("copy_bytes_per_s"):
        rates = ", ".join(f"{k} {v / 1e12:.2f}" for k, v in (res.get("copy_rates") or {}).items())
        log(f"copy bandwidth (1 GiB, read + write, the faster of {rates or 'copy_'} TB/s): "
            f"{res['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    if fl:
        log(f"compaction: µs per call in a graph of {SEQ} calls (one call per replay in brackets; a one-element "
            f"kernel: {fl['seq_us']:.1f} ({fl['us']:.1f}))")
    for c in res["compaction"]:
        if "error" in c:
            log(f"compaction B={c['B']} n={c['n']}: ERROR")
            continue
        floor = (f"; {c['moved_rows']} rows moved, {c['moved_bytes'] / 1e6:.1f} MB: copy floor "
                 f"{c['copy_floor_us']:.1f} µs, {c['x_copy_floor']:.2f}x") if c.get("copy_floor_us") else ""
        log(f"compaction B={c['B']} n={c['n']} walk {c.get('walk', 'random')} {c['layers']} layers (mean a "
            f"{c['mean_accepted']:.1f}, max {c['max_accepted']}): {c.get('compact_seq_us', float('nan')):.1f} "
            f"({c['compact_us']:.1f}) µs; drafter rows [{c['hidden']}] + positions: "
            f"{c.get('gather_seq_us', float('nan')):.1f} ({c['gather_us']:.1f}) µs{floor}")
    for s in res["skipped"]:
        log(f"skipped (time budget): B={s['B']} n={s['n']} ctx={s['ctx']}")
    rat = [r["ratio"] for r in res["rows"] if "ratio" in r]
    rc = [r["ratio_conc"] for r in res["rows"] if "ratio_conc" in r]
    if rc:
        log(f"tree <= 1.1x chain with the concurrent two-pass form: {sum(x <= 1.1 for x in rc)} of {len(rc)} rows "
            f"(ratios {min(rc):.2f} .. {max(rc):.2f})")
    if rat:
        log(f"goal tree <= 1.1x chain: met in {sum(x <= 1.1 for x in rat)} of {len(rat)} rows "
            f"(ratios {min(rat):.2f} .. {max(rat):.2f})")
    # what the runtime runs in FULL decode graphs: the second stream up to STREAM_MAX_REQS requests
    rt = [r["ratio_conc"] if r["B"] <= STREAM_MAX_REQS else r["ratio"] for r in res["rows"]
          if "ratio" in r and "ratio_conc" in r]
    if rt:
        log(f"goal with the runtime's form (conc at B <= {STREAM_MAX_REQS}, one stream above): met in "
            f"{sum(x <= 1.1 for x in rt)} of {len(rt)} rows (ratios {min(rt):.2f} .. {max(rt):.2f})")
    for walk in ("random", "deep", "drafted", "drafted-pop"):
        cu = [c["compact_seq_us"] for c in res["compaction"] if "compact_seq_us" in c and c["B"] == 32
              and c.get("walk") == walk]
        if cu:
            log(f"goal compaction <= 10 µs at B = 32 ({walk} walks, in a graph): "
                f"{'met' if max(cu) <= 10 else 'NOT met'} ({', '.join(f'{x:.1f}' for x in cu)} µs)")


if __name__ == "__main__":
    sys.exit(main())
