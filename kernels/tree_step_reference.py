"""PyTorch references for the tree-shaped target step (issue 13): the executable spec of
``tree_attention`` / ``tree_attention_merge`` (``kernels/tree_attention.py``) and of
``compact_kv`` / ``gather_accepted_rows`` (``kernels/kv_compact.py``).

Everything here loops over requests on the host and reads device values (``.tolist()``), so it
synchronises: it is for tests, for the CPU attention backend (where a host loop costs nothing
and there is no graph to capture), and for nothing on a GPU hot path.

Conventions shared with the kernels (docs/tree-step.md):

* A step has B requests; request r owns query rows ``query_start_loc[r] .. query_start_loc[r+1]``
  (root first, then nodes 1..n in node order). Its KV for those rows is already in the cache at
  linear positions ``context_lens[r] + j`` (vLLM writes the step's K/V before attention, one
  slot per node, slots derived from linear positions).
* ``k_cache`` / ``v_cache`` are 4-D views ``(num_blocks, block_size, num_kv_heads, head_dim)``
  with any strides (``kv_views`` in ``kv_compact.py`` makes them from every release's layout).
  Position p of request r lives at ``(block_table[r, p // bs], p % bs)``.
* ``ancestor_mask`` int32 ``[>= B, W, NW]``: bit i % 32 of word i // 32 of row j is set iff
  node i is visible to node j (the root, j's ancestors, j itself): ``DraftTree.ancestor_mask``.
* Log-sum-exp values are natural-log, of the scaled scores, laid out ``[num_q_heads, T]`` like
  FlashAttention's ``softmax_lse`` (and vLLM's ``merge_attn_states``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def unpack_mask_rows(mask: torch.Tensor, n_rows: int) -> torch.Tensor:
    """bool [n_rows, n_rows] visibility of one request from its ``[W, NW]`` int32 bit rows."""
    m = mask[:n_rows].to(torch.int64) & 0xFFFFFFFF
    cols = torch.arange(n_rows, device=mask.device)
    words = m[:, cols // 32]
    return ((words >> (cols % 32)) & 1).bool()


def pack_mask(dense: torch.Tensor, width: Optional[int] = None) -> torch.Tensor:
    """int32 ``[B, W, ceil(W/32)]`` bit rows from a bool ``[B, n, n]`` matrix (padded to W)."""
    B, n, _ = dense.shape
    W = width or n
    NW = (W + 31) // 32
    out = torch.zeros(B, W, NW, dtype=torch.int64)
    for i in range(n):
        out[:, :n, i // 32] |= dense[:, :n, i].to(torch.int64) << (i % 32)
    out = torch.where(out >= 2**31, out - 2**32, out)
    return out.to(torch.int32)


def _gather_positions(cache: torch.Tensor, block_table_row: torch.Tensor, pos: torch.Tensor):
    bs = cache.shape[1]
    blk = block_table_row[pos // bs].long()
    return cache[blk, pos % bs]  # [len(pos), Hkv, D]


def _attend(q, k, v, visible, scale):
    """q [M, Hq, D], k/v [N, Hkv, D], visible bool [M, N]: fp64 softmax; out [M, Hq, D], lse [Hq, M]."""
    Hq, Hkv = q.shape[1], k.shape[1]
    G = Hq // Hkv
    kq = k.double().repeat_interleave(G, dim=1)  # [N, Hq, D]
    vq = v.double().repeat_interleave(G, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.double(), kq) * scale
    s = s.masked_fill(~visible[None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [Hq, M]
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    p = torch.where(visible[None], p, torch.zeros_like(p))
    out = torch.einsum("hmn,nhd->mhd", p, vq)
    return out, lse


def tree_attention_ref(q, k_cache, v_cache, block_table, query_start_loc, context_lens,
                       ancestor_mask, softmax_scale, *, request_mask=None, num_reqs=None):
    """Dense reference: per request an explicit bool mask ``[q_len, ctx + q_len]`` (all context
    keys, then the tree bits), softmax in float64. Returns ``(out float32 [T, Hq, D], lse float32
    [Hq, T])``; rows outside the requests (or of requests with ``request_mask`` 0) are 0 / -inf."""
    T, Hq, D = q.shape
    B = num_reqs if num_reqs is not None else query_start_loc.numel() - 1
    out = torch.zeros(T, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((Hq, T), -math.inf, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    ctx_l = context_lens.tolist()
    for r in range(B):
        if request_mask is not None and not bool(request_mask[r]):
            continue
        qs, qe, ctx = qsl[r], qsl[r + 1], ctx_l[r]
        n = qe - qs
        if n == 0:
            continue
        pos = torch.arange(ctx + n, device=q.device)
        k = _gather_positions(k_cache, block_table[r], pos)
        v = _gather_positions(v_cache, block_table[r], pos)
        visible = torch.zeros(n, ctx + n, dtype=torch.bool, device=q.device)
        visible[:, :ctx] = True
        visible[:, ctx:] = unpack_mask_rows(ancestor_mask[r], n)
        o, l_ = _attend(q[qs:qe], k, v, visible, softmax_scale)
        out[qs:qe] = o.float()
        lse[:, qs:qe] = l_.float()
    return out, lse


def causal_attention_ref(q, k_cache, v_cache, block_table, query_start_loc, context_lens,
                         softmax_scale):
    """What vLLM's chain step computes: causal attention, query i of a request sees positions
    ``0 .. ctx + i`` (FlashAttention's bottom-right causal mask over ``seq_len = ctx + q_len``)."""
    T, Hq, D = q.shape
    B = query_start_loc.numel() - 1
    out = torch.zeros(T, Hq, D, dtype=torch.float32, device=q.device)
    qsl, ctx_l = query_start_loc.tolist(), context_lens.tolist()
    for r in range(B):
        qs, qe, ctx = qsl[r], qsl[r + 1], ctx_l[r]
        n = qe - qs
        if n == 0:
            continue
        pos = torch.arange(ctx + n, device=q.device)
        k = _gather_positions(k_cache, block_table[r], pos)
        v = _gather_positions(v_cache, block_table[r], pos)
        visible = pos[None, :] <= (ctx + torch.arange(n, device=q.device))[:, None]
        o, _ = _attend(q[qs:qe], k, v, visible, softmax_scale)
        out[qs:qe] = o.float()
    return out


def context_attention_ref(q, k_cache, v_cache, block_table, query_start_loc, context_lens,
                          softmax_scale, *, empty_fill=math.nan):
    """Emulates the context pass the integration runs with the release's FlashAttention 3:
    ``flash_attn_varlen_func(q, k, v, seqused_k=context_lens, causal=False,
    return_softmax_lse=True, block_table=...)``: every query row of a request attends to the
    request's first ``context_lens[r]`` positions. Returns ``(out in q.dtype [T, Hq, D], lse
    float32 [Hq, T])``. A request with no context gets lse -inf and output rows filled with
    ``empty_fill`` (FlashAttention leaves them undefined; NaN makes a test catch any use)."""
    T, Hq, D = q.shape
    B = query_start_loc.numel() - 1
    out = torch.full((T, Hq, D), empty_fill, dtype=q.dtype, device=q.device)
    lse = torch.full((Hq, T), -math.inf, dtype=torch.float32, device=q.device)
    qsl, ctx_l = query_start_loc.tolist(), context_lens.tolist()
    for r in range(B):
        qs, qe, ctx = qsl[r], qsl[r + 1], ctx_l[r]
        n = qe - qs
        if n == 0 or ctx == 0:
            continue
        pos = torch.arange(ctx, device=q.device)
        k = _gather_positions(k_cache, block_table[r], pos)
        v = _gather_positions(v_cache, block_table[r], pos)
        o, l_ = _attend(q[qs:qe], k, v, torch.ones(n, ctx, dtype=torch.bool, device=q.device), softmax_scale)
        out[qs:qe] = o.to(q.dtype)
        lse[:, qs:qe] = l_.float()
    return out, lse


def _accepted_moves(query_start_loc, accepted_rows, num_accepted, num_reqs):
    """[(request, d, j_d)] for every accepted depth d >= 1 with j_d != d."""
    qsl = query_start_loc.tolist()
    moves = []
    for r in range(num_reqs):
        a = int(num_accepted[r])
        row0 = int(accepted_rows[r, 0])
        for d in range(1, a + 1):
            j = int(accepted_rows[r, d]) - row0
            if j != d:
                moves.append((r, qsl[r], d, j))
    return moves


def compact_kv_ref(views: Sequence[torch.Tensor], slot_mapping, query_start_loc, accepted_rows,
                   num_accepted, num_reqs=None):
    """In place, per view ``(nb, bs, H, X)``: ``view[slot(qs + d)] = old view[slot(qs + j_d)]``
    for d = 1..a (sources read before any write: a clone)."""
    B = num_reqs if num_reqs is not None else query_start_loc.numel() - 1
    moves = _accepted_moves(query_start_loc, accepted_rows, num_accepted, B)
    slots = slot_mapping.tolist()
    for view in views:
        bs = view.shape[1]
        old = view.clone()
        for _r, qs, d, j in moves:
            src, dst = slots[qs + j], slots[qs + d]
            if src < 0 or dst < 0:
                continue
            view[dst // bs, dst % bs] = old[src // bs, src % bs]


def gather_accepted_rows_ref(tensors: Sequence[torch.Tensor], query_start_loc, accepted_rows,
                             num_accepted, positions=None, num_reqs=None):
    """In place: ``t[qs + d] = old t[qs + j_d]`` (d = 1..a) for every 2-D tensor, and
    ``positions[qs + i] = positions[qs] + i`` for ``i < min(q_len, W)`` (W = accepted_rows
    width) of every request."""
    B = num_reqs if num_reqs is not None else query_start_loc.numel() - 1
    moves = _accepted_moves(query_start_loc, accepted_rows, num_accepted, B)
    for t in tensors:
        old = t.clone()
        for _r, qs, d, j in moves:
            t[qs + d] = old[qs + j]
    if positions is not None:
        W = accepted_rows.shape[1]
        qsl = query_start_loc.tolist()
        for r in range(B):
            n = min(qsl[r + 1] - qsl[r], W)
            if n > 0:
                positions[qsl[r]:qsl[r] + n] = positions[qsl[r]] + torch.arange(n, dtype=positions.dtype,
                                                                          device=positions.device)


def ancestor_rows_ref(parents: torch.Tensor):
    """Reference of ``ancestor_rows``: ``parents`` int ``[B, W]`` (node j's local parent, ``-1``
    for none: the root, padding and rows without a tree). Returns the int32 bit rows
    ``[B, W, ceil(W/32)]`` of ancestors-or-self (``DraftTree.ancestor_mask``'s layout) and the
    int32 depths ``[B, W]`` (number of ancestors). Plain loops over the host copy."""
    B, W = parents.shape
    par = parents.detach().cpu().tolist()
    dense = torch.zeros(B, W, W, dtype=torch.bool)
    depth = torch.zeros(B, W, dtype=torch.int32)
    for b in range(B):
        for j in range(W):
            cur, hops = j, 0
            while cur >= 0:
                dense[b, j, cur] = True
                cur = par[b][cur]
                hops += 1
                if hops > W:
                    raise ValueError(f"ancestor_rows_ref: row {b} node {j}: parent links form a cycle")
            depth[b, j] = hops - 1
    return pack_mask(dense, W).to(parents.device), depth.to(parents.device)
