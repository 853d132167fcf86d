"""Ancestor-only attention for the DDTree target step (issue 13; design: docs/tree-step.md).

Request r of a step owns query rows ``query_start_loc[r] .. query_start_loc[r+1]`` (root, then
nodes 1..n in node order) and has ``context_lens[r]`` committed positions. Its step K/V are
already in the paged cache at positions ``context_lens[r] + j``. Query row j attends to every
context position and to the tree positions whose bit is set in ``ancestor_mask[r, j]`` (the
root, j's ancestors and j itself).

One Triton kernel, three modes:

* ``tree_attention`` (``CTX_MODE=1``): context and tree in one pass. Standalone; no split over
  the context, so a long context with few programs is slow on a GPU (the benchmark measures it).
* ``tree_attention_merge`` (``CTX_MODE=2``): the tree pass, started from a context pass that
  someone else computed (FlashAttention 3's non-causal ``seqused_k=context_lens`` call with
  ``return_softmax_lse=True``): the running softmax state begins at ``(m, l, acc) = (lse_ctx, 1,
  out_ctx)``, which is the log-sum-exp merge fused into the tree pass. ``ctx_out`` may be
  ``out`` itself (each program reads its rows before it writes them). Rows of requests with
  ``context_lens == 0`` ignore ``ctx_out``/``ctx_lse`` (FlashAttention leaves them undefined).
* ``CTX_MODE=0`` (``tree_attention_merge(..., ctx_out=None)``): tree keys only.

Grid ``(B, num_kv_heads, cdiv(W * G, BLOCK_M))`` with G = q heads per KV head: a program takes
BLOCK_M (node, q-head) rows of one request and one KV head (GQA packed: the K/V tiles are read
once for the G heads). Static shapes (W = ``ancestor_mask.shape[1]``), loop bounds read on the
device, no host synchronisation: capturable in a CUDA graph.

The tree pass (modes 0 and 2) has a second kernel for trees whose keys fit one tile
(``_tree_tile_kernel``, W <= 64, or W <= 128 on a small grid in mode 2: ``_tile_plan``): each
program loads the request's tree K/V first (their block ids depend only on the context length),
then q and the context state, and runs one exact softmax over the tile; on grids over two waves
a last M tile at most a quarter full (W = 17, 65 at G = 4) is done by the program before it
(``_tile_plan``; the A/B behind the rule: docs/tree-step.md, "One key tile").

Launch settings (tiles, warps, stages, the one-tile and fold choices): the
``TreeAttentionTuning`` dataclass; ``tree_attention`` and ``tree_attention_merge`` always use
``PRODUCTION``. Legend of the kernels' constexprs: G q heads per KV head, BLOCK_M (node, q-head)
rows per program, BLOCK_N context keys per tile (one-kernel mode), BLOCK_T tree keys per tile,
BLOCK_D = next_pow2(HEAD_DIM), CTX_MODE as above; W = ``ancestor_mask.shape[1]`` (the widest
tree, root included).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .device import sm_count

LOG2E = tl.constexpr(1.4426950408889634)
_LOG2E = 1.4426950408889634
# Under TRITON_INTERPRET=1 (read at import, like @triton.jit) bf16 dots run in fp32 (see
# _attend_tile); compiled kernels use the bf16 tensor-core dot.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, blk, off, kv_ok, visible, kvh, offs_d, d_ok,
                 qk_scale, s_kb, s_ko, s_kh, s_kd, s_vb, s_vo, s_vh, s_vd,
                 DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr):
    kmask = kv_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + blk[:, None] * s_kb + off[:, None] * s_ko + kvh * s_kh
                + offs_d[None, :] * s_kd, mask=kmask, other=0.0)
    if DOT_UPCAST:  # the interpreter's bf16 tl.dot is wrong (Triton 3.7.1): same math in fp32
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    s = s * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + blk[:, None] * s_vb + off[:, None] * s_vo + kvh * s_vh
                + offs_d[None, :] * s_vd, mask=kmask, other=0.0)
    if DOT_UPCAST:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _request(qsl_ptr, ctx_len_ptr, req_mask_ptr, r, W, HAS_REQ_MASK: tl.constexpr):
    """Request r's first query row, its row count (at most W), whether it is attended (rows, and
    the request mask), and its context length."""
    qs = tl.load(qsl_ptr + r)
    qlen = tl.minimum(tl.load(qsl_ptr + r + 1) - qs, W)
    act = qlen > 0
    if HAS_REQ_MASK:
        act = act & (tl.load(req_mask_ptr + r) != 0)
    return qs, qlen, act, tl.maximum(tl.load(ctx_len_ptr + r), 0)


@triton.jit
def _context_state(ctx_out_ptr, ctx_lse_ptr, tok, qh, offs_d, d_ok, row_ok, ctx, s_cot, s_coh, s_cod, s_clh,
                   s_clt):
    """A given context pass's softmax state of the rows: (output as float32, max in log2 units,
    whether the row has one). Rows of requests without context have none (FlashAttention leaves
    them undefined)."""
    has_ctx = row_ok & (ctx > 0)
    acc = tl.load(ctx_out_ptr + tok[:, None] * s_cot + qh[:, None] * s_coh + offs_d[None, :] * s_cod,
                  mask=has_ctx[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    lse_c = tl.load(ctx_lse_ptr + qh * s_clh + tok * s_clt, mask=has_ctx, other=0.0)
    return acc, tl.where(has_ctx, lse_c * LOG2E, float("-inf")), has_ctx


@triton.jit
def _write_rows(acc, m_i, l_i, out_ptr, lse_ptr, tok, qh, offs_d, io_mask, row_ok, s_ot, s_oh, s_od, s_lh, s_lt,
                WRITE_LSE: tl.constexpr):
    """The rows' normalised output and (WRITE_LSE) their natural-log lse."""
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * s_ot + qh[:, None] * s_oh + offs_d[None, :] * s_od,
             o.to(out_ptr.dtype.element_ty), mask=io_mask)
    if WRITE_LSE:
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / LOG2E, float("-inf"))
        tl.store(lse_ptr + qh * s_lh + tok * s_lt, lse, mask=row_ok)


# Per-step sizes (block size, W, T-dependent LSE strides, block-table / mask row strides) are not
# specialised: batch size and tree width would otherwise each JIT a new variant.
@triton.jit(do_not_specialize=["block_size", "W", "s_lh", "s_clh", "s_btr", "s_mr", "s_mn"])
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, ctx_out_ptr, ctx_lse_ptr,
    block_table_ptr, qsl_ptr, ctx_len_ptr, mask_ptr, req_mask_ptr,
    qk_scale,
    s_qt, s_qh, s_qd,
    s_kb, s_ko, s_kh, s_kd,
    s_vb, s_vo, s_vh, s_vd,
    s_ot, s_oh, s_od,
    s_lh, s_lt,
    s_cot, s_coh, s_cod,
    s_clh, s_clt,
    s_btr, s_mr, s_mn, s_mw,
    block_size, W,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    CTX_MODE: tl.constexpr, WRITE_LSE: tl.constexpr, HAS_REQ_MASK: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    mt = tl.program_id(2)
    qs, qlen, act, ctx = _request(qsl_ptr, ctx_len_ptr, req_mask_ptr, r, W, HAS_REQ_MASK)

    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    node = offs_m // G
    qh = kvh * G + offs_m % G
    row_ok = (node < qlen) & act
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    tok = (qs + node).to(tl.int64)
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok[:, None] * s_qt + qh[:, None] * s_qh + offs_d[None, :] * s_qd,
                mask=io_mask, other=0.0)
    bt_row = block_table_ptr + r.to(tl.int64) * s_btr

    if CTX_MODE == 2:
        acc, m_i, has_ctx = _context_state(ctx_out_ptr, ctx_lse_ptr, tok, qh, offs_d, d_ok, row_ok, ctx,
                                           s_cot, s_coh, s_cod, s_clh, s_clt)
        l_i = tl.where(has_ctx, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    if CTX_MODE == 1:
        n_ctx = tl.where(act & (mt * BLOCK_M < qlen * G), ctx, 0)
        for start in range(0, n_ctx, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            kv_ok = pos < n_ctx
            blk = tl.load(bt_row + pos // block_size, mask=kv_ok, other=0).to(tl.int64)
            off = (pos % block_size).to(tl.int64)
            visible = kv_ok[None, :] & row_ok[:, None]
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, blk, off, kv_ok, visible,
                                         kvh, offs_d, d_ok, qk_scale, s_kb, s_ko, s_kh, s_kd,
                                         s_vb, s_vo, s_vh, s_vd, DOT_PREC, DOT_UPCAST)

    # Tree keys: nodes 0 .. last node of this tile (ancestors precede their descendants).
    n_tree = tl.where(act, tl.minimum((mt * BLOCK_M + BLOCK_M - 1) // G + 1, qlen), 0)
    for start in range(0, n_tree, BLOCK_T):
        j = start + tl.arange(0, BLOCK_T)
        j_ok = j < n_tree
        pos = ctx + j
        blk = tl.load(bt_row + pos // block_size, mask=j_ok, other=0).to(tl.int64)
        off = (pos % block_size).to(tl.int64)
        wmask = row_ok[:, None] & j_ok[None, :]
        word = tl.load(mask_ptr + r.to(tl.int64) * s_mr + node[:, None] * s_mn
                       + (j[None, :] // 32) * s_mw, mask=wmask, other=0)
        visible = (((word >> (j[None, :] % 32)) & 1) != 0) & wmask
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, blk, off, j_ok, visible,
                                     kvh, offs_d, d_ok, qk_scale, s_kb, s_ko, s_kh, s_kd,
                                     s_vb, s_vo, s_vh, s_vd, DOT_PREC, DOT_UPCAST)

    _write_rows(acc, m_i, l_i, out_ptr, lse_ptr, tok, qh, offs_d, io_mask, row_ok, s_ot, s_oh, s_od, s_lh, s_lt,
                WRITE_LSE)


# Per-step sizes as in _tree_attention_kernel: not specialised.
@triton.jit(do_not_specialize=["block_size", "W", "s_lh", "s_clh", "s_btr", "s_mr", "s_mn"])
def _tree_tile_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, ctx_out_ptr, ctx_lse_ptr,
    block_table_ptr, qsl_ptr, ctx_len_ptr, mask_ptr, req_mask_ptr,
    qk_scale,
    s_qt, s_qh, s_qd,
    s_kb, s_ko, s_kh, s_kd,
    s_vb, s_vo, s_vh, s_vd,
    s_ot, s_oh, s_od,
    s_lh, s_lt,
    s_cot, s_coh, s_cod,
    s_clh, s_clt,
    s_btr, s_mr, s_mn, s_mw,
    block_size, W,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
    CTX_MODE: tl.constexpr, WRITE_LSE: tl.constexpr, HAS_REQ_MASK: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """The tree pass (CTX_MODE 0 or 2) when all W tree keys fit one tile (BLOCK_T >= W): the
    request's tree K/V are loaded first (their block ids depend only on the context length), then
    each of the program's M tiles (one; two for the last program when the grid folds a small last
    tile into it) takes one exact softmax over the context state and the tile."""
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    ms = tl.program_id(2)
    qs, qlen, act, ctx = _request(qsl_ptr, ctx_len_ptr, req_mask_ptr, r, W, HAS_REQ_MASK)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    j = tl.arange(0, BLOCK_T)
    j_ok = (j < qlen) & act
    pos = ctx + j
    blk = tl.load(block_table_ptr + r.to(tl.int64) * s_btr + pos // block_size, mask=j_ok, other=0).to(tl.int64)
    off = (pos % block_size).to(tl.int64)
    kmask = j_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + blk[:, None] * s_kb + off[:, None] * s_ko + kvh * s_kh + offs_d[None, :] * s_kd,
                mask=kmask, other=0.0)
    v = tl.load(v_ptr + blk[:, None] * s_vb + off[:, None] * s_vo + kvh * s_vh + offs_d[None, :] * s_vd,
                mask=kmask, other=0.0)
    if DOT_UPCAST:  # as in _attend_tile
        k = k.to(tl.float32)
    kt = tl.trans(k)
    # the last program also takes the M tiles past the grid (a folded small last tile)
    n_mt = tl.where(ms == tl.num_programs(2) - 1, tl.cdiv(W * G, BLOCK_M) - ms, 1)
    for i in range(n_mt):
        offs_m = (ms + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        node = offs_m // G
        qh = kvh * G + offs_m % G
        row_ok = (node < qlen) & act
        tok = (qs + node).to(tl.int64)
        io_mask = row_ok[:, None] & d_ok[None, :]
        wmask = row_ok[:, None] & j_ok[None, :]
        word = tl.load(mask_ptr + r.to(tl.int64) * s_mr + node[:, None] * s_mn + (j[None, :] // 32) * s_mw,
                       mask=wmask, other=0)
        q = tl.load(q_ptr + tok[:, None] * s_qt + qh[:, None] * s_qh + offs_d[None, :] * s_qd,
                    mask=io_mask, other=0.0)
        if CTX_MODE == 2:
            acc, m_c, _ = _context_state(ctx_out_ptr, ctx_lse_ptr, tok, qh, offs_d, d_ok, row_ok, ctx,
                                         s_cot, s_coh, s_cod, s_clh, s_clt)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            m_c = tl.full([BLOCK_M], float("-inf"), tl.float32)
        if DOT_UPCAST:
            s = tl.dot(q.to(tl.float32), kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt, input_precision=DOT_PREC)
        s = s * qk_scale  # log2 units
        s = tl.where((((word >> (j[None, :] % 32)) & 1) != 0) & wmask, s, float("-inf"))
        m = tl.maximum(m_c, tl.max(s, 1))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w_c = tl.exp2(m_c - m_safe)  # the context state's weight (0 without one)
        p = tl.exp2(s - m_safe[:, None])
        l_i = w_c + tl.sum(p, 1)
        if DOT_UPCAST:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        acc = acc * w_c[:, None] + pv
        _write_rows(acc, m, l_i, out_ptr, lse_ptr, tok, qh, offs_d, io_mask, row_ok, s_ot, s_oh, s_od, s_lh, s_lt,
                    WRITE_LSE)


@triton.jit(do_not_specialize=["W", "s_pb", "s_mb", "s_mr", "s_db"])
def _ancestor_rows_kernel(par_ptr, mask_ptr, depth_ptr, W, s_pb, s_mb, s_mr, s_db,
                          NW: tl.constexpr, NWP: tl.constexpr, BLOCK_W: tl.constexpr):
    """One program per request: every node walks up its parent links (-1 ends a walk) and sets
    one bit per visited node; depth = links followed. W hops at most (cycle-safe)."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_W)
    ok = j < W
    row = par_ptr + b * s_pb
    cur = tl.where(ok, j, -1)
    wi = tl.arange(0, NWP)
    words = tl.zeros([BLOCK_W, NWP], tl.int32)
    depth = tl.full([BLOCK_W], -1, tl.int32)
    hops = 0
    while (tl.max(cur, 0) >= 0) & (hops <= W):
        live = cur >= 0
        c = tl.where(live, cur, 0)
        bit = (tl.full([BLOCK_W], 1, tl.int32) << (c % 32).to(tl.int32))
        hit = live[:, None] & ((c // 32)[:, None] == wi[None, :])
        words = words | tl.where(hit, bit[:, None], 0)
        depth = depth + live.to(tl.int32)
        cur = tl.where(live, tl.load(row + c, mask=live & (c < W), other=-1).to(tl.int32), -1)
        hops += 1
    tl.store(mask_ptr + b * s_mb + j[:, None] * s_mr + wi[None, :], words,
             mask=ok[:, None] & (wi[None, :] < NW))
    tl.store(depth_ptr + b * s_db + j, depth, mask=ok)


def ancestor_rows(parents: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                  depths: Optional[torch.Tensor] = None):
    """Ancestor-or-self bit rows of a batch of trees in one launch: ``parents`` int32/int64
    ``[B, W]`` (node j's local parent, ``-1`` for none: the root, padding, rows of requests
    without a tree). Returns ``(mask int32 [B, W, ceil(W/32)], depths int32 [B, W])`` — the
    layout of ``DraftTree.ancestor_mask`` that ``tree_attention`` reads. Device work only."""
    if not isinstance(parents, torch.Tensor) or parents.ndim != 2 or \
            parents.dtype not in (torch.int32, torch.int64):
        raise _err("parents", f"must be an int32/int64 [B, W] tensor, got {getattr(parents, 'shape', parents)}")
    B, W = parents.shape
    NW = (W + 31) // 32
    if out is None:
        out = torch.empty(B, W, NW, dtype=torch.int32, device=parents.device)
    if depths is None:
        depths = torch.empty(B, W, dtype=torch.int32, device=parents.device)
    if tuple(out.shape) != (B, W, NW) or out.dtype != torch.int32 or out.stride(2) != 1:
        raise _err("out", f"must be int32 [{B}, {W}, {NW}] with unit inner stride")
    if tuple(depths.shape) != (B, W) or depths.dtype != torch.int32 or depths.stride(1) != 1:
        raise _err("depths", f"must be int32 [{B}, {W}] with unit inner stride")
    if parents.stride(1) != 1:
        raise _err("parents", "must be contiguous in its last dimension")
    if B and W:
        _ancestor_rows_kernel[(B,)](parents, out, depths, W, parents.stride(0), out.stride(0), out.stride(1),
                                    depths.stride(0), NW=NW, NWP=max(1, triton.next_power_of_2(NW)),
                                    BLOCK_W=max(2, triton.next_power_of_2(W)), num_warps=4)
    return out, depths


@triton.jit(do_not_specialize=["W", "s_lh", "s_lt", "s_blh", "s_blt"])
def _merge_states_kernel(a_ptr, a_lse_ptr, b_ptr, b_lse_ptr, out_ptr, qsl_ptr, ctx_len_ptr, req_mask_ptr,
                         s_at, s_ah, s_ad, s_lh, s_lt, s_bt, s_bh, s_bd, s_blh, s_blt, s_ot, s_oh, s_od, W,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
                         HAS_REQ_MASK: tl.constexpr):
    """One program per (request, q head, BLOCK_W rows): the request's rows (at most W) of two
    softmax states (context ``a``, tree ``b``) merged by log-sum-exp into ``out``; ``a`` is ignored
    where the request has no context (FlashAttention leaves it undefined there)."""
    r = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    qs = tl.load(qsl_ptr + r)
    qlen = tl.minimum(tl.load(qsl_ptr + r + 1) - qs, W)
    act = qlen > 0
    if HAS_REQ_MASK:
        act = act & (tl.load(req_mask_ptr + r) != 0)
    has_ctx = tl.load(ctx_len_ptr + r) > 0
    j = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    row_ok = (j < qlen) & act
    tok = (qs + j).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    m2 = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    lb = tl.load(b_lse_ptr + h * s_blh + tok * s_blt, mask=row_ok, other=0.0)
    la = tl.load(a_lse_ptr + h * s_lh + tok * s_lt, mask=row_ok & has_ctx, other=float("-inf"))
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp2((la - m) * LOG2E)
    wb = tl.exp2((lb - m) * LOG2E)
    inv = 1.0 / tl.where(wa + wb > 0, wa + wb, 1.0)
    ob = tl.load(b_ptr + tok[:, None] * s_bt + h * s_bh + offs_d[None, :] * s_bd, mask=m2, other=0.0).to(tl.float32)
    oa = tl.load(a_ptr + tok[:, None] * s_at + h * s_ah + offs_d[None, :] * s_ad, mask=m2 & has_ctx,
                 other=0.0).to(tl.float32)
    o = (oa * (wa * inv)[:, None]) + (ob * (wb * inv)[:, None])
    tl.store(out_ptr + tok[:, None] * s_ot + h * s_oh + offs_d[None, :] * s_od, o.to(out_ptr.dtype.element_ty),
             mask=m2)


def merge_attention_states(a, a_lse, b, b_lse, query_start_loc, context_lens, *, out, width: int,
                           request_mask: Optional[torch.Tensor] = None, num_reqs: Optional[int] = None):
    """Two attention results over disjoint key sets merged by log-sum-exp, per request: ``a``
    ``[T, Hq, D]`` with ``a_lse`` float32 ``[Hq, >= T]`` (a FlashAttention context pass: rows of
    requests with ``context_lens == 0`` are ignored), ``b``/``b_lse`` the same (the tree pass:
    ``tree_attention_merge(..., None, None, return_lse=True)``); the rows of request r
    (``query_start_loc``, at most ``width``) of ``out`` are written where ``request_mask`` is set,
    other rows are left as they are. One launch, grid (B, Hq, cdiv(width, 16)); device work only."""
    T, Hq, D = a.shape
    B = query_start_loc.shape[0] - 1 if num_reqs is None else int(num_reqs)
    for name, t in (("b", b), ("out", out)):
        if t.shape != a.shape or t.device != a.device:
            raise _err(name, f"must have a's shape {tuple(a.shape)} on {a.device}")
    for name, t in (("a_lse", a_lse), ("b_lse", b_lse)):
        if t.ndim != 2 or t.shape[0] != Hq or t.shape[1] < T or t.dtype != torch.float32:
            raise _err(name, f"must be float32 [num_q_heads={Hq}, >= {T}]")
    if B > 0 and T > 0:
        bw = min(16, max(2, triton.next_power_of_2(int(width))))
        _merge_states_kernel[(B, Hq, triton.cdiv(int(width), bw))](
            a, a_lse, b, b_lse, out, query_start_loc, context_lens,
            request_mask if request_mask is not None else context_lens,
            *a.stride(), *a_lse.stride(), *b.stride(), *b_lse.stride(), *out.stride(), int(width),
            HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
            BLOCK_W=bw, HAS_REQ_MASK=request_mask is not None,
            num_warps=4)
    return out


class TreeAttentionError(ValueError):
    """A tree-attention argument is malformed (metadata checks only; never reads device data)."""


def _err(name, msg):
    return TreeAttentionError(f"tree_attention: argument `{name}` {msg}")


def _check(q, k_cache, v_cache, block_table, query_start_loc, context_lens, ancestor_mask,
           num_reqs, request_mask):
    dev = q.device
    for name, t, nd in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4),
                        ("block_table", block_table, 2), ("query_start_loc", query_start_loc, 1),
                        ("context_lens", context_lens, 1), ("ancestor_mask", ancestor_mask, 3)):
        if not isinstance(t, torch.Tensor):
            raise _err(name, f"must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != nd:
            raise _err(name, f"must be {nd}-D, got shape {tuple(t.shape)}")
        if t.device != dev:
            raise _err(name, f"must be on {dev} like q, got {t.device}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise _err("q", f"dtype must be float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise _err(name, f"dtype must equal q's ({q.dtype}), got {t.dtype} (a quantized KV "
                       "cache is not supported by the tree pass)")
    if k_cache.shape != v_cache.shape:
        raise _err("v_cache", f"shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    T, Hq, D = q.shape
    nb, bs, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise _err("k_cache", f"head_dim {Dk} != q head_dim {D}; pass (num_blocks, block_size, "
                   "num_kv_heads, head_dim) views (kv_views)")
    if Hkv == 0 or Hq % Hkv:
        raise _err("q", f"num_q_heads {Hq} must be a multiple of num_kv_heads {Hkv}")
    for name, t in (("block_table", block_table), ("query_start_loc", query_start_loc),
                    ("context_lens", context_lens), ("ancestor_mask", ancestor_mask)):
        if t.dtype not in (torch.int32, torch.int64):
            raise _err(name, f"dtype must be int32 or int64, got {t.dtype}")
    if ancestor_mask.dtype != torch.int32:
        raise _err("ancestor_mask", "must be int32 (DraftTree.ancestor_mask)")
    if query_start_loc.stride(0) != 1 or context_lens.stride(0) != 1 or block_table.stride(1) != 1:
        raise _err("query_start_loc", "query_start_loc, context_lens and block_table rows must "
                   "be contiguous")
    B = query_start_loc.shape[0] - 1 if num_reqs is None else int(num_reqs)
    if B < 0 or B + 1 > query_start_loc.shape[0]:
        raise _err("num_reqs", f"{B} needs query_start_loc of at least {B + 1} entries")
    for name, t in (("context_lens", context_lens), ("block_table", block_table),
                    ("ancestor_mask", ancestor_mask)):
        if t.shape[0] < B:
            raise _err(name, f"has {t.shape[0]} rows, fewer than the {B} requests")
    W = ancestor_mask.shape[1]
    if ancestor_mask.shape[2] * 32 < W:
        raise _err("ancestor_mask", f"shape {tuple(ancestor_mask.shape)}: {ancestor_mask.shape[2]} "
                   f"words per row cannot hold {W} bits")
    if request_mask is not None:
        if not isinstance(request_mask, torch.Tensor) or request_mask.ndim != 1 \
                or request_mask.shape[0] < B or request_mask.device != dev:
            raise _err("request_mask", "must be a 1-D tensor with one entry per request on q's device")
    return B, T, Hq, D, Hkv, bs, W


@dataclass(frozen=True)
class TreeAttentionTuning:
    """Launch settings of the tree-attention kernels. Results do not depend on them beyond
    rounding; only the time does. ``tree_attention`` and ``tree_attention_merge`` always launch
    with ``PRODUCTION`` (chosen on an H200: docs/tree-step.md, docs/notebook/tree-step.md);
    benchmarks and tests pass other values to ``_tree_attention_tuned`` /
    ``_tree_attention_merge_tuned``; nothing in production does.

    * ``one_tile``: all tree keys in one tile (``_tree_tile_kernel``); None: ``_tile_plan``'s rule.
      Only in the tree pass (modes 0 and 2), and only when ``block_t`` is None.
    * ``fold_tail``: a small last M tile done by the program before it; None: ``_tile_plan``'s rule.
    * ``block_m``: (node, q-head) rows per program; None: ``_tile_plan``'s rule.
    * ``block_n``: context keys per tile (the one-kernel mode).
    * ``block_t``: tree keys per tile; given, the looped kernel runs; None: all W keys in the
      one-tile kernel, else 32-key tiles (16 and up for narrower trees).
    * ``num_warps``, ``num_stages``: Triton's launch options.
    """

    one_tile: Optional[bool] = None
    fold_tail: Optional[bool] = None
    block_m: Optional[int] = None
    block_n: int = 64
    block_t: Optional[int] = None
    num_warps: int = 4
    num_stages: int = 1


PRODUCTION = TreeAttentionTuning()


@functools.lru_cache(maxsize=256)  # a pure function of the shape, called once per layer in eager steps
def _tile_plan(B, Hkv, W, G, sms, block_m, one_tile, fold_tail, fused=True):
    """Launch plan of the tree pass: (one_tile, BLOCK_M, programs per (request, KV head)). The
    rule: one tile for W <= 64, and for W <= 128 on a grid of at most a third of the SMs when the
    context state is merged in (``fused``; the tree pass alone runs beside FA3 on a second stream,
    where a 128-key tile's shared memory hurt); BLOCK_M 32 on such small grids, 64 otherwise; a
    last M tile at most a quarter full is folded into the program before it when the grid exceeds
    two waves (the measurements behind it: docs/tree-step.md, "One key tile")."""
    small = B * Hkv * triton.cdiv(W * G, 64) * 3 <= sms
    bt1 = max(16, triton.next_power_of_2(W))
    if one_tile is None:
        one_tile = bt1 <= 64 or (bt1 <= 128 and small and fused)
    one_tile = one_tile and bt1 <= 128  # wider trees: key tiles in a loop (_tree_attention_kernel)
    if block_m is None:
        block_m = (32 if small else 64) if one_tile else (64 if W * G >= 64 else max(16, triton.next_power_of_2(W * G)))
    n_mt = triton.cdiv(W * G, block_m)
    rem = (W * G) % block_m
    if fold_tail is None:
        fold_tail = one_tile and n_mt >= 2 and 0 < rem <= block_m // 4 and B * Hkv * n_mt > 2 * sms
    return one_tile, block_m, n_mt - 1 if (fold_tail and one_tile and n_mt >= 2) else n_mt


def _launch(q, k_cache, v_cache, block_table, query_start_loc, context_lens, ancestor_mask,
            softmax_scale, ctx_mode, ctx_out, ctx_lse, out, lse, return_lse, request_mask,
            num_reqs, tuning: TreeAttentionTuning, dims=None):
    B, T, Hq, D, Hkv, bs, W = dims if dims is not None else _check(
        q, k_cache, v_cache, block_table, query_start_loc, context_lens, ancestor_mask, num_reqs, request_mask)
    G = Hq // Hkv
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.device != q.device:
        raise _err("out", f"must have q's shape {tuple(q.shape)} on {q.device}")
    if ctx_mode == 2:
        if ctx_out.shape[:3] != q.shape or ctx_out.device != q.device:
            raise _err("ctx_out", f"must have q's shape {tuple(q.shape)} on {q.device}")
        if ctx_lse.ndim != 2 or ctx_lse.shape[0] != Hq or ctx_lse.shape[1] < T \
                or ctx_lse.dtype != torch.float32:
            raise _err("ctx_lse", f"must be float32 [num_q_heads={Hq}, >= {T}] (FlashAttention's "
                       f"softmax_lse), got {tuple(ctx_lse.shape)} {ctx_lse.dtype}")
    write_lse = return_lse or lse is not None
    if write_lse and lse is None:
        lse = torch.empty(Hq, T, dtype=torch.float32, device=q.device)
    if lse is not None and (lse.ndim != 2 or lse.shape[0] != Hq or lse.shape[1] < T
                            or lse.dtype != torch.float32):
        raise _err("lse", f"must be float32 [num_q_heads={Hq}, >= {T}]")
    BLOCK_D = max(16, triton.next_power_of_2(D))
    block_t = tuning.block_t
    # the one-kernel mode and an explicit key tile (block_t) take the looped kernel
    one_tile, block_m, n_prog = _tile_plan(B, Hkv, W, G, sm_count(q.device), tuning.block_m,
                                           tuning.one_tile if ctx_mode != 1 and block_t is None else False,
                                           tuning.fold_tail, ctx_mode == 2)
    if block_t is None:  # 32-key tiles in the looped kernel (bench_tree_step.py --sweep)
        block_t = max(16, triton.next_power_of_2(W)) if one_tile else (32 if W >= 32 else max(16, triton.next_power_of_2(W)))
    grid = (B, Hkv, n_prog)
    dummy = out
    cdo = ctx_out if ctx_mode == 2 else dummy
    cdl = ctx_lse if ctx_mode == 2 else (lse if lse is not None else context_lens)
    lse_arg = lse if lse is not None else cdl
    if B > 0 and W > 0:
        (_tree_tile_kernel if one_tile else _tree_attention_kernel)[grid](
            q, k_cache, v_cache, out, lse_arg, cdo, cdl,
            block_table, query_start_loc, context_lens, ancestor_mask,
            request_mask if request_mask is not None else context_lens,
            float(softmax_scale) * _LOG2E,
            q.stride(0), q.stride(1), q.stride(2),
            *k_cache.stride(), *v_cache.stride(),
            out.stride(0), out.stride(1), out.stride(2),
            lse_arg.stride(0), lse_arg.stride(1) if lse_arg.ndim == 2 else 0,
            cdo.stride(0), cdo.stride(1), cdo.stride(2),
            cdl.stride(0), cdl.stride(1) if cdl.ndim == 2 else 0,
            block_table.stride(0), ancestor_mask.stride(0), ancestor_mask.stride(1),
            ancestor_mask.stride(2),
            bs, W,
            G=G, HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=block_m, BLOCK_T=block_t,
            **({} if one_tile else dict(BLOCK_N=tuning.block_n)),
            CTX_MODE=ctx_mode, WRITE_LSE=write_lse, HAS_REQ_MASK=request_mask is not None,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
            DOT_UPCAST=q.dtype == torch.bfloat16 and _INTERPRETING,
            num_warps=tuning.num_warps, num_stages=tuning.num_stages,
        )
    return (out, lse) if return_lse else out


def tree_attention(q, k_cache, v_cache, block_table, query_start_loc, context_lens, ancestor_mask,
                   softmax_scale: float, *, out: Optional[torch.Tensor] = None,
                   lse: Optional[torch.Tensor] = None, return_lse: bool = False,
                   request_mask: Optional[torch.Tensor] = None, num_reqs: Optional[int] = None):
    """Context + tree attention in one kernel.

    q ``[T, Hq, D]``; k_cache / v_cache ``(num_blocks, block_size, Hkv, D)`` views (any strides,
    same dtype as q); block_table ``[>= B, max_blocks]``; query_start_loc ``[>= B+1]``;
    context_lens ``[>= B]``; ancestor_mask int32 ``[>= B, W, ceil(W/32)]`` (W >= every q_len);
    request_mask ``[>= B]`` (optional, 0 = leave the request's rows untouched). Returns ``out``
    (q's dtype) and, with ``return_lse``, lse float32 ``[Hq, T]`` (natural log). Launch
    settings: ``PRODUCTION`` (:class:`TreeAttentionTuning`).
    """
    return _launch(q, k_cache, v_cache, block_table, query_start_loc, context_lens, ancestor_mask,
                   softmax_scale, 1, None, None, out, lse, return_lse, request_mask, num_reqs, PRODUCTION)


def _tree_attention_tuned(q, k_cache, v_cache, block_table, query_start_loc, context_lens, ancestor_mask,
                          softmax_scale: float, tuning: TreeAttentionTuning, *, out=None, lse=None,
                          return_lse: bool = False, request_mask=None, num_reqs=None):
    """``tree_attention`` with the launch settings ``tuning`` (benchmarks and tests)."""
    return _launch(q, k_cache, v_cache, block_table, query_start_loc, context_lens, ancestor_mask,
                   softmax_scale, 1, None, None, out, lse, return_lse, request_mask, num_reqs, tuning)


def tree_attention_merge(q, k_cache, v_cache, block_table, query_start_loc, context_lens,
                         ancestor_mask, softmax_scale: float, ctx_out: Optional[torch.Tensor],
                         ctx_lse: Optional[torch.Tensor], *, out: Optional[torch.Tensor] = None,
                         lse: Optional[torch.Tensor] = None, return_lse: bool = False,
                         request_mask: Optional[torch.Tensor] = None,
                         num_reqs: Optional[int] = None, dims: Optional[tuple] = None):
    """The tree pass merged with a given context pass (``ctx_out [T, Hq, D]``, ``ctx_lse``
    float32 ``[Hq, >= T]``, FlashAttention's output and ``softmax_lse``). ``out`` may be
    ``ctx_out`` (in place). ``ctx_out=None`` and ``ctx_lse=None``: tree keys only. ``dims``:
    what :func:`tree_attention_dims` returned for arguments of the same shapes, dtypes and
    devices (skips the argument checks: a caller launching once per layer with one layout).
    Other arguments as ``tree_attention``; launch settings ``PRODUCTION``."""
    return _tree_attention_merge_tuned(q, k_cache, v_cache, block_table, query_start_loc, context_lens,
                                       ancestor_mask, softmax_scale, ctx_out, ctx_lse, PRODUCTION, out=out,
                                       lse=lse, return_lse=return_lse, request_mask=request_mask,
                                       num_reqs=num_reqs, dims=dims)


def _tree_attention_merge_tuned(q, k_cache, v_cache, block_table, query_start_loc, context_lens,
                                ancestor_mask, softmax_scale: float, ctx_out, ctx_lse,
                                tuning: TreeAttentionTuning, *, out=None, lse=None, return_lse: bool = False,
                                request_mask=None, num_reqs=None, dims=None):
    """``tree_attention_merge`` with the launch settings ``tuning`` (benchmarks and tests)."""
    if (ctx_out is None) != (ctx_lse is None):
        raise _err("ctx_out", "and `ctx_lse` must be given together (or both None)")
    mode = 0 if ctx_out is None else 2
    return _launch(q, k_cache, v_cache, block_table, query_start_loc, context_lens, ancestor_mask,
                   softmax_scale, mode, ctx_out, ctx_lse, out, lse, return_lse, request_mask,
                   num_reqs, tuning, dims)


def tree_attention_dims(q, k_cache, v_cache, block_table, query_start_loc, context_lens, ancestor_mask,
                        *, num_reqs: Optional[int] = None, request_mask: Optional[torch.Tensor] = None):
    """The argument checks of ``tree_attention`` / ``tree_attention_merge`` alone: raises their
    named errors, returns the launch dimensions ``(B, T, Hq, D, Hkv, block_size, W)`` to pass as
    ``dims=`` to later calls with arguments of the same shapes, dtypes and devices."""
    return _check(q, k_cache, v_cache, block_table, query_start_loc, context_lens, ancestor_mask,
                  num_reqs, request_mask)
