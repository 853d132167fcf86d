"""Triton kernels and host wrapper for the DDTree tree builder (paper Algorithm 1).

``build_tree(draft_logits [B, L, V], budget)`` turns the drafter's per-position logits into a
batch of draft trees of ``budget`` nodes each, entirely on the device (static grids, no host
synchronisation: CUDA-graph capturable). The contract is the reference's
(``kernels/tree_reference.py``, ``docs/tree-builder.md``); the kernels reproduce it bit for bit
given the same per-row logsumexp.

Stage 1 (per-row logsumexp and top-(K+1), one read of the logits), K + 1 <= SMALL_KP:

* ``_seg_kernel`` -- grid (B*L*NSEG,), 4 warps. A program streams one vocab segment of one row
  in 4096-entry tiles (16-byte loads, the next tile in flight), keeping per lane an online
  (max, sum of exp) and per slot (position within the tile) the running maximum G. Then
  t = the (K+1)-th largest lane maximum (K+1 distinct entries are >= t), so the segment's
  top-(K+1) lie in the few slots with G >= t: their entries are gathered (one strided load per
  tile), keyed (value, then lower id, int64) and merged into a running top-KP list with
  ``tl.topk``. NaN / +inf are not sanitised on the fast path: they make a lane's sum NaN (or
  the max +inf), and the segment is then read again sanitised. Many exact ties at t are taken
  in batches of slots in id order, stopping once no later slot can enter the list. With
  NSEG > 1 segments per row the last program to finish (an atomic ticket) merges the row.
* ``_chunk_kernel`` + ``_merge_kernel`` -- the large-K path (K + 1 > SMALL_KP, up to 1023):
  grid (B*L, cdiv(V, CHUNK)) chunk programs find each chunk's top-KP with a column-maxima
  threshold, a prefix-sum compaction and ``tl.topk``; the merge kernel combines them per row.

Stage 2:

* ``_tree_kernel`` -- grid (B,), 1 warp. Best-first expansion in registers: the frontier holds
  at most one candidate per emitted node (that node's next unexpanded child), as int32 keys
  HI = ord(σ) and LO = (63 - depth, 1023 - rank, 2047 - parent) bit fields, ordered exactly
  like the reference heap; a pop is two int32 max reductions (REDUX on sm_80+), then two slot
  updates (the parent's next sibling, the new node's first child). Then padding, the
  ``exact`` certificate and the ancestor bit rows (max-depth parent hops per row block).

Launch settings (tile sizes, warps, pipelining, the pops' first frontier width): the
``BuildTreeTuning`` dataclass; ``build_tree`` always uses ``PRODUCTION``.

Legend of the short names inside the kernels (Triton constexprs and per-lane vectors):

* Sizes: B requests, L depths (drafted positions), V vocab, K ranks kept per depth, KP =
  next_pow2(K + 1) columns of the top-K table (one rank more than K, for ``exact``), n (also
  ``budget``) nodes per tree.
* ``_seg_kernel``: T vocab entries per tile = U x NTHR x VEC (U sub-tiles, NTHR threads, VEC
  entries per 16-byte load); SEG entries per segment, NSEG segments per row (NSEGP its next
  power of two), NTP = next_pow2(tiles per segment); CS candidate slots staged per batch;
  G = each slot's running maximum over the tiles, r / s = each lane's running max / sum of
  exp; STAGES tiles in flight (0: register prefetch).
* ``_chunk_kernel`` / ``_merge_kernel``: CHUNK entries per program, NCH chunks per row (NCHP
  its next power of two), CAPT = KP + candidates per batch, SUB entries per re-read tile.
* ``_tree_kernel``: NP frontier slots (>= n, a power of two >= 32), W0 the first phase's width,
  NPH the number of doublings from W0 to NP; NW 32-bit words per ancestor row (NWP its next
  power of two), RB ancestor rows per step; TP > 0: the [L, KP] table is preloaded (TP =
  next_pow2(L * KP)). The frontier (one slot per emitted node, holding that node's next
  unexpanded child): HI = ord(σ) of the slot's candidate, LO its tie-break bits
  (63 - depth) << 21 | (1023 - rank) << 11 | (2047 - parent), PS = σ of the slot's node (the
  candidate's parent), SL = the slot's id (its node index).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .device import sm_count
from .tree_reference import DraftTree, check_build_args

DEFAULT_CHUNK = 4096  # large-K path: vocab entries per _chunk_kernel program
MAX_MERGE = 16384  # keys one _merge_kernel program sorts (16 warps; 128 KiB of shared memory)

# NOTE: module constants must be tl.constexpr instances for the compiler.
SENT = tl.constexpr(-9223372036854775808)  # below every key
SENT32 = tl.constexpr(-2147483648)  # below every 32-bit key
LOG2E = tl.constexpr(1.4426950408889634)
ORD_NEG_INF = tl.constexpr(-2139095041)  # _ord(-inf)


@triton.jit
def _ord(x):
    """float32 -> int32 with the same order (for non-NaN x)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _unord(o):
    bits = tl.where(o >= 0, o, o ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _vkey(x, gid):
    """Packed (value desc, id asc) key of vocab entries: larger key = earlier rank."""
    x = tl.where(x == 0, 0.0, x)  # -0.0 ranks like +0.0
    return (_ord(x).to(tl.int64) << 32) + (2147483647 - gid).to(tl.int64)


@triton.jit
def _unvkey(k):
    v = _unord((k >> 32).to(tl.int32))
    gid = 2147483647 - k.to(tl.int32)  # low 32 bits
    return v, gid


@triton.jit
def _bit(idx, w):
    """[R, NWP] int32 rows with bit idx % 32 set in word idx // 32."""
    return tl.where(w[None, :] == (idx >> 5)[:, None], (1 << (idx & 31))[:, None], 0)


@triton.jit
def _stage_candidates(cand, li, sbase, q0, CB: tl.constexpr):
    """Store the offsets li of candidates number q0..q0+CB-1 (counted in id order) into the
    batch scratch; returns the number of candidates."""
    c32 = cand.to(tl.int32)
    pos = tl.cumsum(c32, axis=0) - 1 - q0
    tl.store(sbase + pos, li, mask=cand & (pos >= 0) & (pos < CB))
    return tl.sum(c32, axis=0)


@triton.jit
def _key32(y, li, DT16: tl.constexpr):
    """16-bit inputs: packed (value desc, local offset asc) int32 key. y holds float32 values
    exactly representable in DT16 (bf16/fp16 logits), li < 65536."""
    y = tl.where(y == 0, 0.0, y)
    h = y.to(DT16).to(tl.int16, bitcast=True).to(tl.int32)
    o = tl.where(h >= 0, h, h ^ 0x7FFF)
    return (o << 16) + (65535 - li)


@triton.jit
def _unkey32(k, DT16: tl.constexpr):
    o = k >> 16
    h = tl.where(o >= 0, o, o ^ 0x7FFF)
    v = h.to(tl.int16).to(DT16, bitcast=True).to(tl.float32)
    return v, 65535 - (k & 65535)


@triton.jit
def _reduce_batch(base, start, sbase, kbase, q0, cnt, KP: tl.constexpr, CAPT: tl.constexpr,
                  KEY32: tl.constexpr):
    """Running top-KP keys (kbase) := top-KP of (running list, staged candidates).

    With 16-bit logits the selection runs on int32 keys (value, offset in the chunk): half the
    work of int64 keys in the bitonic network; the list is stored as int64 (value, global id)."""
    tl.debug_barrier()  # the staged offsets are visible to every lane
    lane = tl.arange(0, CAPT)
    bl = lane - KP
    bm = (lane >= KP) & (bl + q0 < cnt)
    ci = tl.load(sbase + bl, mask=bm, other=0)
    y = tl.load(base + start + ci, mask=bm, other=float("-inf")).to(tl.float32)
    y = tl.where(y < float("inf"), y, float("-inf"))
    rk = tl.load(kbase + lane, mask=(lane < KP) & (q0 > 0), other=SENT)
    if KEY32:
        DT16: tl.constexpr = base.dtype.element_ty
        rv, rid = _unvkey(rk)
        rk32 = tl.where(rk > SENT, _key32(rv, rid - start, DT16), SENT32)
        kb32 = tl.where(bm, _key32(y, ci, DT16), SENT32)
        top32 = tl.topk(tl.where(lane < KP, rk32, kb32), KP)
        tv, tli = _unkey32(top32, DT16)
        top = tl.where(top32 > SENT32, _vkey(tv, start + tli), SENT)
    else:
        kb = tl.where(bm, _vkey(y, start + ci), SENT)
        top = tl.topk(tl.where(lane < KP, rk, kb), KP)
    tl.debug_barrier()  # every lane has read the running list before it is replaced
    tl.store(kbase + tl.arange(0, KP), top)
    tl.debug_barrier()


@triton.jit
def _chunk_kernel(
    logits_ptr,  # [B, L, V] bf16/fp16/fp32, stride(2) == 1
    active_ptr,  # [B] bool or None
    part_key_ptr,  # [B*L*NCH, KP] int64: the chunk's top-KP keys, descending
    part_m_ptr,  # [B*L*NCH] float32: chunk max
    part_s_ptr,  # [B*L*NCH] float32: sum exp(x - max)
    idx_scr_ptr,  # [B*L*NCH, CAPT - KP] int32 scratch: candidate offsets
    L,
    V,
    stride_b,
    stride_l,
    NCH,
    CHUNK: tl.constexpr,
    KP: tl.constexpr,
    CAPT: tl.constexpr,
    SUB: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    KEY32: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.program_id(1)
    b = row // L
    l_ = row - b * L
    if HAS_ACTIVE:
        run = tl.load(active_ptr + b) != 0
    else:
        run = row >= 0
    if run:
        CB: tl.constexpr = CAPT - KP
        base = logits_ptr + b.to(tl.int64) * stride_b + l_.to(tl.int64) * stride_l
        start = c * CHUNK
        li = tl.arange(0, CHUNK)
        valid = start + li < V
        x = tl.load(base + start + li, mask=valid, other=float("-inf")).to(tl.float32)
        x = tl.where(x < float("inf"), x, float("-inf"))  # NaN and +inf -> -inf
        m = tl.max(x, axis=0)
        # exp(x - m) as one FMA + ex2: 2**(x*log2(e) - m*log2(e))
        s = tl.sum(tl.where(x > float("-inf"), tl.exp2(x * LOG2E - m * LOG2E), 0.0), axis=0)
        # KP column maxima each hold a distinct value >= t: the chunk's top-KP are all >= t.
        t = tl.min(tl.max(tl.reshape(x, [CHUNK // KP, KP]), axis=0), axis=0)
        pid = row.to(tl.int64) * NCH + c
        kbase = part_key_ptr + pid * KP
        sbase = idx_scr_ptr + pid * CB
        # first batch: candidates 0..CB-1 (nothing but scalars stays live past it)
        cnt = _stage_candidates(valid & (x >= t), li, sbase, c * 0, CB)
        _reduce_batch(base, start, sbase, kbase, cnt * 0, cnt, KP, CAPT, KEY32)
        # more candidates than one batch (many exact ties): re-read the chunk per batch, in
        # small tiles so that this rare path keeps the register footprint of the common one
        q0 = cnt * 0 + CB
        while q0 < cnt:
            seen = cnt * 0
            for s0 in range(0, CHUNK, SUB):
                lj = s0 + tl.arange(0, SUB)
                vj = start + lj < V
                y = tl.load(base + start + lj, mask=vj, other=float("-inf")).to(tl.float32)
                cj = vj & (y < float("inf")) & (y >= t)
                seen += _stage_candidates(cj, lj, sbase, q0 - seen, CB)
            _reduce_batch(base, start, sbase, kbase, q0, cnt, KP, CAPT, KEY32)
            q0 += CB
        tl.store(part_m_ptr + pid, m)
        tl.store(part_s_ptr + pid, s)


@triton.jit
def _merge_kernel(
    part_key_ptr,
    part_m_ptr,
    part_s_ptr,
    active_ptr,
    top_lp_ptr,  # [B, L, KP] float32: logprobs, descending
    top_id_ptr,  # [B, L, KP] int32: their ids (-1 past V)
    lse_ptr,  # [B, L] float32
    L,
    V,
    NCH,
    NCHP: tl.constexpr,
    KP: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
):
    row = tl.program_id(0)
    b = row // L
    if HAS_ACTIVE:
        run = tl.load(active_ptr + b) != 0
    else:
        run = row >= 0
    kl = tl.arange(0, KP)
    lp = tl.full([KP], float("-inf"), tl.float32)
    ids = tl.full([KP], -1, tl.int32)
    lse = (row * 0).to(tl.float32) - float("inf")
    if run:
        ci = tl.arange(0, NCHP)
        cm = ci < NCH
        pb = row.to(tl.int64) * NCH
        m = tl.load(part_m_ptr + pb + ci, mask=cm, other=float("-inf"))
        s = tl.load(part_s_ptr + pb + ci, mask=cm, other=0.0)
        mx = tl.max(m, axis=0)
        tot = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - mx), 0.0), axis=0)
        lse = tl.where(mx > float("-inf"), mx + tl.log(tot), float("-inf"))
        keys = tl.load(part_key_ptr + (pb + ci[:, None]) * KP + kl[None, :], mask=cm[:, None],
                       other=SENT)
        top = tl.topk(tl.reshape(keys, [NCHP * KP]), KP)
        v, tid = _unvkey(top)
        real = (top > SENT) & (tid < V)
        lp = tl.where(real & (v > float("-inf")), v - lse, float("-inf"))
        lp = tl.where(mx > float("-inf"), lp, float("-inf"))
        ids = tl.where(real, tid, -1)
    ob = row.to(tl.int64) * KP
    tl.store(top_lp_ptr + ob + kl, lp)
    tl.store(top_id_ptr + ob + kl, ids)
    tl.store(lse_ptr + row, lse)


# ----------------------------------------------------------------------------
# Stage 1, fast path (K + 1 <= SMALL_KP): _seg_kernel
# ----------------------------------------------------------------------------
@triton.jit
def _ord0(x):
    """float32 -> int32 with the same order, -0.0 ranked as +0.0 (x not NaN)."""
    x = tl.where(x == 0, 0.0, x)
    return _ord(x)


@triton.jit
def _tile_update(x, G, r, s, SANITIZE: tl.constexpr):
    """One tile x [U, NTHR, VEC] (float32) into the running slot maxima G (same shape), the
    lanes' maxima r [NTHR] and their sums s [NTHR] of exp(x - r)."""
    if SANITIZE:
        x = tl.where(x < float("inf"), x, float("-inf"))  # NaN and +inf -> -inf
    G = tl.maximum(G, x)
    rn = tl.maximum(r, tl.max(tl.max(x, axis=2), axis=0))
    rc = tl.where(rn > float("-inf"), rn, 0.0) * LOG2E
    e = tl.sum(tl.sum(tl.exp2(x * LOG2E - rc[None, :, None]), axis=2), axis=0)
    s = s * tl.exp2(r * LOG2E - rc) + e
    return G, rn, s


@triton.jit
def _stream(row_ptr, seg_start, seg_end, OFF, G, r, s, T: tl.constexpr, SANITIZE: tl.constexpr,
            STAGES: tl.constexpr):
    """Read the segment [seg_start, seg_end) once: full tiles unmasked, then the partial tail
    tile masked. STAGES > 0: the full tiles' loads are left to Triton's software pipeliner
    (STAGES tiles in flight through shared memory); 0: the next tile is prefetched into
    registers while the current one is reduced."""
    nfull = (seg_end - seg_start) // T
    if STAGES > 0:
        for i in tl.range(0, nfull, num_stages=STAGES):
            x = tl.load(row_ptr + seg_start + i * T + OFF)
            G, r, s = _tile_update(x.to(tl.float32), G, r, s, SANITIZE)
        pos = seg_start + nfull * T
    else:
        xn = tl.load(row_ptr + seg_start + OFF, mask=nfull > 0)
        pos = seg_start
        for i in range(0, nfull):
            x = xn
            xn = tl.load(row_ptr + (pos + T) + OFF, mask=i + 1 < nfull)
            G, r, s = _tile_update(x.to(tl.float32), G, r, s, SANITIZE)
            pos += T
    if pos < seg_end:
        x = tl.load(row_ptr + pos + OFF, mask=pos + OFF < seg_end, other=float("-inf"))
        G, r, s = _tile_update(x.to(tl.float32), G, r, s, SANITIZE)
    return G, r, s


@triton.jit
def _positions3(f):
    """Exclusive running count of the int32 flags f [A, B, C] in (a, b, c) order, at the flagged
    entries (scans along each axis, no reshape: the last axis stays in-thread)."""
    rt = tl.sum(f, axis=2)
    cl = tl.cumsum(rt, axis=1) - rt
    ut = tl.sum(rt, axis=1)
    cu = tl.cumsum(ut, axis=0) - ut
    return tl.cumsum(f, axis=2) - f + cl[:, :, None] + cu[:, None, None]


@triton.jit
def _positions2(f):
    """Exclusive running count of the int32 flags f [A, B] in (a, b) order."""
    rt = tl.sum(f, axis=1)
    ca = tl.cumsum(rt, axis=0) - rt
    return tl.cumsum(f, axis=1) - f + ca[:, None]


@triton.jit
def _finish_row(top, lse, row, top_lp_ptr, top_id_ptr, V, KP: tl.constexpr):
    v, gid = _unvkey(top)
    real = (top > SENT) & (gid < V)
    lp = tl.where(real & (v > float("-inf")), v - lse, float("-inf"))
    lp = tl.where(lse > float("-inf"), lp, float("-inf"))
    ob = row.to(tl.int64) * KP + tl.arange(0, KP)
    tl.store(top_lp_ptr + ob, lp)
    tl.store(top_id_ptr + ob, tl.where(real, gid, -1))


@triton.jit
def _seg_kernel(
    logits_ptr,  # [B, L, V] bf16/fp16/fp32, stride(2) == 1
    active_ptr,  # [B] bool or None
    part_key_ptr,  # [B*L*NSEG, KP] int64: each segment's top-(K+1) keys (then filler), descending
    part_m_ptr,  # [B*L*NSEG] float32: segment max
    part_s_ptr,  # [B*L*NSEG] float32: sum exp(x - max)
    scr_ptr,  # [B*L*NSEG, CS] int32 scratch: candidate slots
    ticket_ptr,  # [B*L] int32, zero before the launch (NSEG > 1); left zero
    top_lp_ptr,  # [B, L, KP] float32
    top_id_ptr,  # [B, L, KP] int32
    lse_ptr,  # [B, L] float32
    L,
    V,
    stride_b,
    stride_l,
    NSEG,
    SEG,  # vocab entries per segment (a multiple of T unless NSEG == 1)
    K,
    U: tl.constexpr,
    NTHR: tl.constexpr,
    VEC: tl.constexpr,
    NTP: tl.constexpr,  # next_pow2(tiles per segment)
    KP: tl.constexpr,
    CS: tl.constexpr,
    NSEGP: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    STAGES: tl.constexpr = 0,  # the fast pass's stream: > 0 pipelined, STAGES tiles in flight (_stream)
):
    pid = tl.program_id(0)
    row = pid // NSEG
    sg = pid - row * NSEG
    b = row // L
    l_ = row - b * L
    if HAS_ACTIVE:
        run = tl.load(active_ptr + b) != 0
    else:
        run = pid >= 0
    T: tl.constexpr = U * NTHR * VEC
    if run:
        row_ptr = logits_ptr + b.to(tl.int64) * stride_b + l_.to(tl.int64) * stride_l
        seg_start = sg * SEG
        seg_end = tl.minimum(seg_start + SEG, V)
        u = tl.arange(0, U)
        ln = tl.arange(0, NTHR)
        vv = tl.arange(0, VEC)
        OFF = u[:, None, None] * (NTHR * VEC) + ln[None, :, None] * VEC + vv[None, None, :]
        G = tl.full([U, NTHR, VEC], float("-inf"), tl.float32)
        r = tl.full([NTHR], float("-inf"), tl.float32)
        s = tl.zeros([NTHR], dtype=tl.float32)
        # fast pass without sanitising; NaN or +inf anywhere makes a lane's sum NaN (or the
        # max +inf): then redo the segment sanitised
        G1, r1, s1 = _stream(row_ptr, seg_start, seg_end, OFF, G, r, s, T, False, STAGES)
        m = tl.max(r1, axis=0)
        # lanes without a finite entry add their sum (0, or NaN): the total is NaN iff a lane's is
        ssum = tl.sum(tl.where(r1 > float("-inf"), s1 * tl.exp2((r1 - m) * LOG2E), s1), axis=0)
        if (ssum != ssum) | (m != m) | (m == float("inf")):
            # (the rare redo keeps the register prefetch: the form checked on the GPU with NaN rows)
            G1, r1, s1 = _stream(row_ptr, seg_start, seg_end, OFF, G, r, s, T, True, 0)
            m = tl.max(r1, axis=0)
            ssum = tl.sum(tl.where(r1 > float("-inf"), s1 * tl.exp2((r1 - m) * LOG2E), 0.0),
                          axis=0)
        # t = the (K+1)-th largest lane maximum: K+1 distinct entries are >= t, so the
        # segment's top-(K+1) lie in the slots whose maximum G is >= t.
        kk = tl.arange(0, KP)
        t = tl.max(tl.where(kk == K, tl.topk(r1, KP), float("-inf")), axis=0)
        valid = seg_start + OFF < seg_end
        # candidate slots: first those with G > t, then those with G == t in slot order; a
        # batch of the latter whose first slot s has key(t, s) <= the running (K+1)-th key
        # (and every later one) cannot improve the list: stop there (many ties, -inf rows)
        fhi = valid & (G1 > t)
        feq = valid & (G1 == t)
        n_hi = tl.sum(tl.sum(tl.sum(fhi.to(tl.int32), axis=2), axis=1), axis=0)
        n_eq = tl.sum(tl.sum(tl.sum(feq.to(tl.int32), axis=2), axis=1), axis=0)
        spos = tl.where(fhi, _positions3(fhi.to(tl.int32)), n_hi + _positions3(feq.to(tl.int32)))
        flags = fhi | feq
        nsl = n_hi + n_eq
        base = pid.to(tl.int64)
        kbase = part_key_ptr + base * KP  # staged candidate keys; at the end this segment's list
        sbase = scr_ptr + base * CS  # staged candidate slots
        NT = tl.cdiv(seg_end - seg_start, T)
        ci = tl.arange(0, CS)
        ii = tl.arange(0, NTP)
        lst = tl.full([KP], SENT, tl.int64)  # the running top-KP keys, descending
        sb = nsl * 0
        go = nsl > 0
        while go:  # batches of CS candidate slots (one, unless many ties)
            tl.debug_barrier()  # the previous batch's slots are read
            tl.store(sbase + spos - sb, OFF, mask=flags & (spos >= sb) & (spos < sb + CS))
            tl.debug_barrier()
            inb = ci < nsl - sb
            sl = tl.load(sbase + ci, mask=inb, other=0)
            kth = tl.max(tl.where(kk == K, lst, SENT), axis=0)  # the running (K+1)-th key
            s0 = tl.min(tl.where(inb, sl, 2147483647), axis=0)
            stop = (sb >= n_hi) & (kth >= _vkey(t, seg_start + s0))
            if stop == 0:
                gid = seg_start + ii[None, :] * T + sl[:, None]
                gm = inb[:, None] & (ii[None, :] < NT) & (gid < seg_end)
                y = tl.load(row_ptr + gid, mask=gm, other=float("-inf")).to(tl.float32)
                y = tl.where(y < float("inf"), y, float("-inf"))
                key = _vkey(y, gid)
                cand = gm & (y >= t) & (key > kth)
                epos = _positions2(cand.to(tl.int32))
                cnt = tl.max(tl.max(tl.where(cand, epos, -1), axis=1), axis=0) + 1
                for q0 in range(0, cnt, KP):  # batches of KP candidate entries
                    tl.store(kbase + epos - q0, key, mask=cand & (epos >= q0) & (epos < q0 + KP))
                    tl.debug_barrier()  # the staged keys are visible to every lane
                    new = tl.load(kbase + kk, mask=kk < cnt - q0, other=SENT)
                    lst = tl.topk(tl.reshape(tl.join(lst, new), [2 * KP]), KP)
                    tl.debug_barrier()  # every lane has read them before the next batch
            sb += CS
            go = (sb < nsl) & (stop == 0)
        if NSEG == 1:
            lse = tl.where(m > float("-inf"), m + tl.log(ssum), float("-inf"))
            tl.store(lse_ptr + row, lse)
            _finish_row(lst, lse, row, top_lp_ptr, top_id_ptr, V, KP)
        else:
            tl.store(kbase + kk, lst)
            tl.store(part_m_ptr + pid, m)
            tl.store(part_s_ptr + pid, ssum)
            tl.debug_barrier()  # this program's partials are written before its ticket
            prev = tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel")
            if prev == NSEG - 1:  # the row's last segment merges the row
                ci2 = tl.arange(0, NSEGP)
                cm = ci2 < NSEG
                pb = row.to(tl.int64) * NSEG
                pm = tl.load(part_m_ptr + pb + ci2, mask=cm, other=float("-inf"), cache_modifier=".cg")
                ps = tl.load(part_s_ptr + pb + ci2, mask=cm, other=0.0, cache_modifier=".cg")
                mx = tl.max(pm, axis=0)
                tot = tl.sum(tl.where(pm > float("-inf"), ps * tl.exp(pm - mx), 0.0), axis=0)
                lse = tl.where(mx > float("-inf"), mx + tl.log(tot), float("-inf"))
                keys = tl.load(part_key_ptr + (pb + ci2[:, None]) * KP + kk[None, :],
                               mask=cm[:, None], other=SENT, cache_modifier=".cg")
                top = tl.topk(tl.reshape(keys, [NSEGP * KP]), KP)
                tl.store(lse_ptr + row, lse)
                _finish_row(top, lse, row, top_lp_ptr, top_id_ptr, V, KP)
                tl.store(ticket_ptr + row, 0)
    elif sg == 0:  # inactive request: -inf / -1 / lse -inf, no logits read
        kk = tl.arange(0, KP)
        ob = row.to(tl.int64) * KP + kk
        tl.store(top_lp_ptr + ob, tl.full([KP], float("-inf"), tl.float32))
        tl.store(top_id_ptr + ob, tl.full([KP], -1, tl.int32))
        tl.store(lse_ptr + row, float("-inf"))


@triton.jit
def _pops(HI, LO, PS, SL, count, maxd, last, go, lim, budget, K, L, lp_b, id_b, tok_b, par_b, dep_b,
          score_b, KP: tl.constexpr):
    """Best-first pops until ``count == lim`` (or the frontier is spent). The frontier vectors
    (HI, LO, PS) hold one entry per emitted node, SL its slot id (the node index); ``lim`` is
    below their width, so the new node's slot j = count + 1 is always held."""
    while go & (count < lim):
        mhi = tl.max(HI, axis=0)
        ok = mhi > ORD_NEG_INF  # σ > -inf (and not the empty sentinel)
        lo = tl.max(tl.where(HI == mhi, LO, -1), axis=0)
        p = 2047 - (lo & 2047)
        r = 1023 - ((lo >> 11) & 1023)
        d = 63 - (lo >> 21)
        sig = _unord(mhi)
        j = count + 1
        has_sib = ok & (r + 1 < K)
        has_child = ok & (d < L)
        trow = (d - 1) * KP  # int32 offsets from the request's table
        lp_sib = tl.load(lp_b + trow + r + 1, mask=has_sib, other=float("-inf"))
        lp_ch = tl.load(lp_b + trow + KP, mask=has_child, other=float("-inf"))
        tok = tl.load(id_b + trow + r, mask=ok, other=-1)
        # slot p: the popped node's next sibling (σ(p) + lp, fp32), rank + 1; without one
        # lp_sib = -inf, so σ = -inf: never popped, like an empty slot
        HI = tl.where(SL == p, _ord0(PS + lp_sib), HI)
        LO = tl.where(SL == p, lo - 2048, LO)
        # slot j: the new node's first child
        HI = tl.where(SL == j, tl.where(has_child, _ord0(sig + lp_ch), SENT32), HI)
        LO = tl.where(SL == j, ((62 - d) << 21) + (1023 << 11) + (2047 - j), LO)
        PS = tl.where(SL == j, sig, PS)
        tl.store(tok_b + count, tok, mask=ok)
        tl.store(par_b + count, p, mask=ok)
        tl.store(dep_b + count, d, mask=ok)
        tl.store(score_b + count, sig, mask=ok)
        last = tl.where(ok, sig, last)
        maxd = tl.where(ok, tl.maximum(maxd, d), maxd)
        count = tl.where(ok, j, count)
        go = ok & (count < budget)

    return HI, LO, PS, count, maxd, last, go


@triton.jit
def _widen(x, y):
    """[W], [W] -> [2W]: x's entries and y's, interleaved (the order of the frontier's entries
    does not matter: SL carries each entry's slot id)."""
    return tl.reshape(tl.join(x, y), [2 * x.shape[0]])


@triton.jit
def _tree_kernel(
    top_lp_ptr,  # [B, L, KP] float32
    top_id_ptr,  # [B, L, KP] int32
    active_ptr,  # [B] bool or None
    tok_ptr,  # [B, budget] int32
    par_ptr,  # [B, budget] int32
    dep_ptr,  # [B, budget] int32
    score_ptr,  # [B, budget] float32
    mask_ptr,  # [B, budget + 1, NW] int32 or None
    exact_ptr,  # [B] bool
    ord_ptr,  # [B, budget] int32 scratch (SPINE_FIRST) or None
    L,
    K,
    budget,
    NW,
    KP: tl.constexpr,
    NP: tl.constexpr,  # >= budget frontier slots (slot = node whose next child it holds)
    NWP: tl.constexpr,
    RB: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    WRITE_MASK: tl.constexpr,
    TP: tl.constexpr,  # > 0: touch the whole [L, KP] table first, TP = next_pow2(L * KP)
    SPINE_FIRST: tl.constexpr,  # reorder the nodes: the spine (rank-0 chain) first, then pop order
    W0: tl.constexpr,  # the first pops' frontier width (a power of two <= NP)
    NPH: tl.constexpr,  # W0 << NPH == NP: the frontier doubles NPH times during the pops
):
    b = tl.program_id(0)
    tb = b.to(tl.int64) * L * KP
    ob = b.to(tl.int64) * budget
    slot = tl.arange(0, NP)
    if HAS_ACTIVE:
        act = tl.load(active_ptr + b) != 0
    else:
        act = b >= 0
    # frontier: HI = ord(σ) of the slot's candidate (SENT32: none), LO = its tie-break bits
    # (63 - depth) << 21 | (1023 - rank) << 11 | (2047 - parent); a pop is two int32 max
    # reductions (σ, then the tie-break among equal σ)
    lp_b = top_lp_ptr + tb
    id_b = top_id_ptr + tb
    tok_b = tok_ptr + ob
    par_b = par_ptr + ob
    dep_b = dep_ptr + ob
    score_b = score_ptr + ob
    lp00 = tl.load(lp_b)
    SL = tl.arange(0, W0)  # each frontier entry's slot (its node index)
    HI = tl.where((SL == 0) & act, _ord0(lp00), SENT32)
    LO = tl.where(SL == 0, (62 << 21) + (1023 << 11) + 2047, 0)
    PS = tl.zeros([W0], dtype=tl.float32)  # σ of emitted nodes (root: 0)
    count = b * 0
    maxd = count
    last = count.to(tl.float32) - float("inf")
    go = act & (budget > 0)
    if TP > 0:
        # One vector load of each table brings the request's whole top-K table (2 x L x KP x 4
        # bytes) into L1 before the pops, whose three dependent scalar loads per pop would
        # otherwise go to L2 whenever they touch a new sector. The condition is always true
        # (ids are >= -1); it only makes the pops wait for these loads.
        tq = tl.arange(0, TP)
        tm = tq < L * KP
        warm_i = tl.load(id_b + tq, mask=tm, other=0)
        warm_l = tl.load(lp_b + tq, mask=tm, other=0.0)
        go = go & ((tl.min(warm_i, axis=0) >= -1) | (tl.max(warm_l, axis=0) > 0.0))
    # The pops run on frontier vectors only as wide as the slots they can reach: the first pops on
    # W0 slots, then the vectors double (NPH times) up to NP. A pop's cost grows with the width
    # (the frontier's two reductions and its updates run over every entry), so narrow first
    # phases save time at large budgets (BuildTreeTuning.frontier_start).
    for ph in tl.static_range(NPH):
        HI, LO, PS, count, maxd, last, go = _pops(HI, LO, PS, SL, count, maxd, last, go,
                                                  tl.minimum(budget, (W0 << ph) - 1), budget, K, L,
                                                  lp_b, id_b, tok_b, par_b, dep_b, score_b, KP)
        HI, LO, PS, SL = (_widen(HI, HI * 0 + SENT32), _widen(LO, LO * 0), _widen(PS, PS * 0.0),
                          _widen(SL, SL + (W0 << ph)))
    HI, LO, PS, count, maxd, last, go = _pops(HI, LO, PS, SL, count, maxd, last, go, budget, budget, K, L,
                                              lp_b, id_b, tok_b, par_b, dep_b, score_b, KP)

    # padding: nodes count+1..budget
    pad = (slot >= count) & (slot < budget)
    tl.store(tok_ptr + ob + slot, tl.full([NP], -1, tl.int32), mask=pad)
    tl.store(par_ptr + ob + slot, tl.zeros([NP], tl.int32), mask=pad)
    tl.store(dep_ptr + ob + slot, tl.full([NP], 1, tl.int32), mask=pad)
    tl.store(score_ptr + ob + slot, tl.full([NP], float("-inf"), tl.float32), mask=pad)

    # exact: no node of rank >= K can beat node `budget` (σ = tau)
    tau = tl.where(count == budget, last, float("-inf"))
    allok = act | (act == 0)
    P = count.to(tl.float32) * 0.0
    for dd in range(0, L):
        lk = tl.load(top_lp_ptr + tb + dd * KP + K)
        allok = allok & ((lk == float("-inf")) | (P == float("-inf")) | (P + lk < tau))
        P = P + tl.load(top_lp_ptr + tb + dd * KP)
    ex = allok | (K >= budget) | (act == 0)
    tl.store(exact_ptr + b, ex)

    if SPINE_FIRST:
        # Column c (pop order) moves to: the spine node of depth d -> d - 1 (its rank among the
        # spine); any other node -> s + (the non-spine columns before it), s = spine length.
        # Padding (c >= count, never spine) keeps its column. Parents are renumbered through
        # the scratch row ord_ptr (a gather), then every column is written at its new place.
        # The spine: a node's first child in pop order is its rank-0 child (a sibling is pushed
        # only when the one before it pops), so the spine is the chain of first children from the
        # root: one reduction per depth after the pops, which keep no spine bookkeeping (marking
        # the spine inside the pop loop, by a vector update or a masked store per pop, was slower).
        tl.debug_barrier()  # the pops' and the padding's stores are visible to every lane
        col = slot
        col_ok = col < budget
        PAR = tl.load(par_ptr + ob + col, mask=col < count, other=-1)  # emitted nodes only
        SPF = tl.zeros([NP], dtype=tl.int32)
        tip = count * 0  # the spine's deepest node so far (0: the root)
        for _h in range(0, maxd):
            fc = tl.min(tl.where(PAR == tip, col, NP), axis=0)  # its first child's column
            SPF = tl.where(col == fc, 1, SPF)
            tip = tl.where(fc < NP, fc + 1, -2)  # -2: no child, nothing matches from here on
        cs = tl.cumsum(SPF, axis=0)  # spine columns <= c
        s = tl.sum(SPF, axis=0)
        newc = tl.where(SPF != 0, cs - 1, s + col - cs)
        o_tok = tl.load(tok_ptr + ob + col, mask=col_ok, other=0)
        o_par = tl.load(par_ptr + ob + col, mask=col_ok, other=0)
        o_dep = tl.load(dep_ptr + ob + col, mask=col_ok, other=0)
        o_sc = tl.load(score_ptr + ob + col, mask=col_ok, other=0.0)
        tl.store(ord_ptr + ob + col, newc, mask=col_ok)
        tl.debug_barrier()
        n_par = tl.load(ord_ptr + ob + o_par - 1, mask=col_ok & (o_par > 0), other=-1) + 1
        tl.store(tok_ptr + ob + newc, o_tok, mask=col_ok)
        tl.store(par_ptr + ob + newc, n_par, mask=col_ok)
        tl.store(dep_ptr + ob + newc, o_dep, mask=col_ok)
        tl.store(score_ptr + ob + newc, o_sc, mask=col_ok)

    if WRITE_MASK:
        tl.debug_barrier()  # the parents stored above are visible to every lane
        w = tl.arange(0, NWP)
        mb = b.to(tl.int64) * (budget + 1) * NW
        for r0 in range(0, budget + 1, RB):
            rows = r0 + tl.arange(0, RB)
            live = rows <= budget
            bits = _bit(rows, w) | _bit(rows * 0, w)
            cur = rows
            for _t in range(0, maxd):  # a node is at most maxd hops below the root
                cur = tl.load(par_ptr + ob + cur - 1, mask=live & (cur > 0), other=0)
                bits = bits | _bit(cur, w)
            tl.store(mask_ptr + mb + rows[:, None] * NW + w[None, :], bits,
                     mask=live[:, None] & (w[None, :] < NW))


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


SMALL_KP = 32  # K + 1 <= SMALL_KP: the one-pass segment kernel; larger K: chunk + merge kernels
SEG_MIN_TILES = 4  # tiles per segment at least (the default segmentation)


@dataclass(frozen=True)
class BuildTreeTuning:
    """Launch settings of the builder's kernels. Results never depend on them (the tests check
    the trees bit for bit under other values); only the time does.

    ``build_tree``, ``draft_topk`` and ``tree_stage`` always launch with ``PRODUCTION``, the
    settings chosen on an H200 (the measurements: docs/notebook/tree-builder.md). Benchmarks and
    tests pass other values to ``_build_tree_tuned`` / ``_draft_topk_tuned`` /
    ``_tree_stage_tuned``; nothing in production does.

    Stage 1, K + 1 <= SMALL_KP (``_seg_kernel``):

    * ``seg_tile``: vocab entries a program reads per step of its stream (one tile).
    * ``seg_stages``: tiles in flight per program through Triton's software pipeliner (cp.async
      into shared memory); 0: the next tile is prefetched into registers instead. With 3 or 4
      stages the pipelined stream was faster at B = 64 and most at B = 256, the same at B = 1
      and 8, and bit-identical; 2 stages were slower than the register prefetch.
    * ``seg_ctas_per_sm``: programs resident per SM (4 warps, <= 128 registers), which sizes the
      wave the segmentation rule (``_default_segment``) fills.
    * ``seg_maxnreg``: register cap of ``_seg_kernel``: the streaming loop fits; the rare paths
      (NaN redo, many ties) may spill.

    Stage 1, either path: ``chunk`` (vocab entries per program, a power of two >= 2 *
    next_pow2(K + 1); None: the segmentation rule, or DEFAULT_CHUNK on the large-K path) and
    ``chunk_warps`` (warps per program; None: 4, or CHUNK // 1024 within 4..16 on the large-K
    path).

    Stage 2 (``_tree_kernel``):

    * ``tree_warps`` (None: 1) and ``mask_block`` (ancestor rows per step, a power of two; None:
      as many as 1024 words per warp hold).
    * ``frontier_start``: width of the pops' first frontier (a power of two >= 32, or the
      budget's width when smaller), doubled as the nodes need it. A pop costs about linearly in
      the width (its two reductions and its slot updates run over every entry), so the first
      pops run narrow; starting at 32 was no faster than 64 anywhere.
    * ``tree_preload_max``: the kernel first loads the request's whole [L, KP] top-K table (one
      vector load per table, into L1) when L * KP <= this; 0: never.
    """

    chunk: Optional[int] = None
    chunk_warps: Optional[int] = None
    seg_tile: int = 4096
    seg_stages: int = 4
    seg_ctas_per_sm: int = 4
    seg_maxnreg: int = 128
    tree_warps: Optional[int] = None
    mask_block: Optional[int] = None
    frontier_start: int = 64
    tree_preload_max: int = 1024


PRODUCTION = BuildTreeTuning()


@functools.lru_cache(maxsize=256)  # a pure function of the shape, called every step (its loop is host time)
def _default_segment(rows: int, V: int, T: int, KP: int, slots: int) -> int:
    """Segment length (whole tiles) so that rows * segments fills the GPU's resident programs
    (`slots`) in close to whole waves: one wave when the rows alone are fewer, else the fewest
    segments per row whose last wave is at least 85% full; at least SEG_MIN_TILES tiles per
    segment (a program's fixed cost, the candidate selection and the merge, is a few tiles'
    worth of streaming)."""
    ntile = triton.cdiv(V, T)
    best = None
    for nseg in range(1, max(1, ntile // SEG_MIN_TILES) + 1):
        seg = triton.cdiv(ntile, nseg) * T
        nseg = triton.cdiv(V, seg)
        if _next_pow2(nseg) * KP > MAX_MERGE:
            break
        progs = rows * nseg
        waves = progs / slots
        eff = waves / math.ceil(waves)
        if best is None or eff > best[0] + 1e-9:
            best = (eff, seg)
        if progs >= slots // 2 and eff >= 0.85:
            return seg
        if progs > 4 * slots:
            break
    return best[1]


def _check_chunk(chunk, V, KP):
    CH = int(chunk)
    if CH & (CH - 1) or CH < 2 * KP or _next_pow2(triton.cdiv(V, CH)) * KP > MAX_MERGE:
        raise ValueError(f"build_tree: tuning `chunk` must be a power of two >= {2 * KP} with "
                         f"next_pow2(ceil(V / chunk)) * {KP} <= {MAX_MERGE}, got {chunk!r}")
    return CH


_SCRATCH: dict = {}  # (device, stream, rows, NSEG, KP, CS) -> _seg_kernel's scratch, see _seg_scratch
_SCRATCH_MAX = 64


def _seg_scratch(dev, rows, NSEG, KP, CS):
    """``_seg_kernel``'s scratch (partials, candidate slots, tickets), made once per shape and
    stream and reused: the kernel only reads what it wrote in the same launch, and leaves the
    tickets zero, so consecutive launches on one stream can share it. Saves five allocations and
    the tickets' memset per step (host time on V1's critical path). Inside a CUDA graph capture
    the scratch is allocated fresh (the graph's own pool, as before) and not cached."""
    P = rows * NSEG
    f32 = torch.float32
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    key = None
    if not capturing:
        stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
        key = (dev, stream, rows, NSEG, KP, CS)
        got = _SCRATCH.get(key)
        if got is not None:
            return got
    got = (torch.empty((P * KP,), dtype=torch.int64, device=dev),
           torch.empty((P,), dtype=f32, device=dev),
           torch.empty((P,), dtype=f32, device=dev),
           torch.empty((P * CS,), dtype=torch.int32, device=dev))
    got += (torch.zeros((rows,), dtype=torch.int32, device=dev) if NSEG > 1 else got[3],)
    if key is not None:
        if len(_SCRATCH) >= _SCRATCH_MAX:
            _SCRATCH.pop(next(iter(_SCRATCH)))
        _SCRATCH[key] = got
    return got


def _topk_segments(x, K, KP, active, tuning: BuildTreeTuning):
    """Stage 1 for K + 1 <= SMALL_KP: ``_seg_kernel``, one launch (the first call of a shape also
    zeroes the segment tickets: ``_seg_scratch``)."""
    B, L, V = x.shape
    dev = x.device
    rows = B * L
    VEC = max(1, 16 // x.element_size())  # 16-byte loads
    chunk_warps = tuning.chunk_warps
    nw = int(chunk_warps) if chunk_warps else 4
    NTHR = 32 * nw
    if nw & (nw - 1) or NTHR < KP:
        raise ValueError(f"build_tree: tuning `chunk_warps` must be a power of two with "
                         f"32 * chunk_warps >= {KP}, got {chunk_warps!r}")
    U = max(1, tuning.seg_tile // (NTHR * VEC))
    T = U * NTHR * VEC
    if tuning.chunk:
        SEG = _check_chunk(tuning.chunk, V, KP)
    else:
        SEG = _default_segment(rows, V, T, KP, sm_count(dev) * tuning.seg_ctas_per_sm)
    NSEG = triton.cdiv(V, SEG)
    f32 = torch.float32
    lse = torch.empty((B, L), dtype=f32, device=dev)
    top_lp = torch.empty((B, L, KP), dtype=f32, device=dev)
    top_id = torch.empty((B, L, KP), dtype=torch.int32, device=dev)
    if rows == 0:
        return lse, top_lp, top_id
    CS = 16
    part_key, part_m, part_s, scr, ticket = _seg_scratch(dev, rows, NSEG, KP, CS)
    _seg_kernel[(rows * NSEG,)](
        x, active, part_key, part_m, part_s, scr, ticket, top_lp, top_id, lse,
        L, V, x.stride(0), x.stride(1), NSEG, SEG, K,
        U=U, NTHR=NTHR, VEC=VEC, NTP=_next_pow2(triton.cdiv(min(SEG, V), T)), KP=KP, CS=CS,
        NSEGP=_next_pow2(NSEG), HAS_ACTIVE=active is not None, num_warps=nw,
        maxnreg=tuning.seg_maxnreg,
        STAGES=tuning.seg_stages,
    )
    return lse, top_lp, top_id


def _topk_chunks(x, KP, active, tuning: BuildTreeTuning):
    """Stage 1 for large K: ``_chunk_kernel`` + ``_merge_kernel``."""
    B, L, V = x.shape
    dev = x.device
    if tuning.chunk:
        CH = _check_chunk(tuning.chunk, V, KP)
    else:  # the merge sorts next_pow2(#chunks) * KP keys in one program: keep that <= MAX_MERGE
        CH = min(DEFAULT_CHUNK, max(_next_pow2(V), 2 * KP))
        while _next_pow2(triton.cdiv(V, CH)) * KP > MAX_MERGE:
            CH *= 2
    NCH = triton.cdiv(V, CH)
    CAPT = max(128, min(8 * KP, 4096))  # candidates per batch: CAPT - KP (about KP*ln(KP) expected)
    f32 = torch.float32
    lse = torch.empty((B, L), dtype=f32, device=dev)
    top_lp = torch.empty((B, L, KP), dtype=f32, device=dev)
    top_id = torch.empty((B, L, KP), dtype=torch.int32, device=dev)
    rows = B * L
    if rows == 0:
        return lse, top_lp, top_id
    part_key = torch.empty((rows * NCH * KP,), dtype=torch.int64, device=dev)
    part_m = torch.empty((rows * NCH,), dtype=f32, device=dev)
    part_s = torch.empty((rows * NCH,), dtype=f32, device=dev)
    idx_scr = torch.empty((rows * NCH * (CAPT - KP),), dtype=torch.int32, device=dev)
    has_active = active is not None
    _chunk_kernel[(rows, NCH)](
        x, active, part_key, part_m, part_s, idx_scr,
        L, V, x.stride(0), x.stride(1), NCH,
        CHUNK=CH, KP=KP, CAPT=CAPT, SUB=min(CH, 1024), HAS_ACTIVE=has_active,
        KEY32=x.element_size() == 2 and CH <= 65536,
        num_warps=tuning.chunk_warps or max(4, min(16, CH // 1024)),
    )
    _merge_kernel[(rows,)](
        part_key, part_m, part_s, active, top_lp, top_id, lse, L, V, NCH,
        NCHP=_next_pow2(NCH), KP=KP, HAS_ACTIVE=has_active,
        num_warps=max(4, min(16, _next_pow2(NCH) * KP // 512)),
    )
    return lse, top_lp, top_id


def draft_topk(draft_logits: torch.Tensor, topk: int, *, active: Optional[torch.Tensor] = None):
    """Stage 1 of ``build_tree`` alone: per-row logsumexp and top-(K+1), one read of the logits.

    Returns ``(lse [B, L] float32, logprobs [B, L, KP] float32, ids [B, L, KP] int32)`` with
    KP = next_pow2(K + 1) >= K + 1 columns, logprob descending: columns 0..K are the row's
    top-(K+1) (ties to the lower id; -inf / -1 past V); columns past K are filler (real entries
    of the row, not necessarily its next ranks). Inactive requests: -inf / -1 / lse -inf.
    """
    return _draft_topk_tuned(draft_logits, topk, PRODUCTION, active=active)


def _draft_topk_tuned(draft_logits, topk, tuning: BuildTreeTuning, *, active=None):
    """``draft_topk`` with the launch settings ``tuning`` (benchmarks and tests)."""
    B, L, V, _, K = check_build_args(draft_logits, 1, topk, active)
    KP = _next_pow2(K + 1)  # one more rank than K, for the `exact` certificate
    if KP <= SMALL_KP:
        return _topk_segments(draft_logits, K, KP, active, tuning)
    return _topk_chunks(draft_logits, KP, active, tuning)


def build_tree(
    draft_logits: torch.Tensor,
    budget: int,
    topk: Optional[int] = None,
    *,
    active: Optional[torch.Tensor] = None,
    ancestor_mask: bool = True,
    spine_first: bool = False,
) -> DraftTree:
    """Build one DDTree draft tree per request from the drafter's logits; see ``docs/tree-builder.md``.

    ``draft_logits`` [B, L, V] (bf16/fp16/fp32, stride(2) == 1; B and L may be strided),
    ``budget`` n nodes per request, ``topk`` K per depth (default ``min(budget, 8)``),
    ``active`` bool [B] (False: the request gets an all-padding tree, e.g. in prefill; pass the
    static max_num_reqs batch with the unused rows False), ``ancestor_mask`` (compute the bit
    rows), ``spine_first`` (node order: the spine, i.e. the chain of rank-0 nodes from the root,
    as nodes 1..s, then the other nodes in pop order; default: pop order). Returns a
    :class:`DraftTree`; no host synchronisation, static shapes; two launches
    for K + 1 <= 32 (plus, at the first call of a shape, a 4-byte-per-row memset when rows are
    split into segments), three for larger K. Launch settings: ``PRODUCTION``
    (:class:`BuildTreeTuning`).
    """
    return _build_tree_tuned(draft_logits, budget, topk, PRODUCTION, active=active,
                             ancestor_mask=ancestor_mask, spine_first=spine_first)


def _build_tree_tuned(draft_logits, budget, topk, tuning: BuildTreeTuning, *, active=None,
                      ancestor_mask: bool = True, spine_first: bool = False) -> DraftTree:
    """``build_tree`` with the launch settings ``tuning`` (benchmarks and tests)."""
    B, L, V, n, K = check_build_args(draft_logits, budget, topk, active)
    _frontier_start(tuning.frontier_start)  # before any launch
    lse, top_lp, top_id = _draft_topk_tuned(draft_logits, K, tuning, active=active)
    return _tree_stage_tuned(lse, top_lp, top_id, n, K, tuning, active=active,
                             ancestor_mask=ancestor_mask, spine_first=spine_first)


def _frontier_start(v) -> int:
    w = int(v) if v else PRODUCTION.frontier_start
    if w < 32 or w & (w - 1):
        raise ValueError(f"build_tree: tuning `frontier_start` must be a power of two >= 32, got {v!r}")
    return w


def tree_stage(lse, top_lp, top_id, n: int, K: int, *, active=None, ancestor_mask: bool = True,
               spine_first: bool = False) -> DraftTree:
    """Stage 2 of ``build_tree`` alone (one launch of ``_tree_kernel``) on ``draft_topk``'s output
    (``K`` <= its columns - 1, ``n`` the budget); arguments checked by ``build_tree``."""
    return _tree_stage_tuned(lse, top_lp, top_id, n, K, PRODUCTION, active=active,
                             ancestor_mask=ancestor_mask, spine_first=spine_first)


def _tree_stage_tuned(lse, top_lp, top_id, n: int, K: int, tuning: BuildTreeTuning, *, active=None,
                      ancestor_mask: bool = True, spine_first: bool = False) -> DraftTree:
    """``tree_stage`` with the launch settings ``tuning`` (benchmarks and tests)."""
    B, L, KP = top_lp.shape
    dev = top_lp.device
    NW = (n + 1 + 31) // 32
    i32 = torch.int32
    tokens = torch.empty((B, n), dtype=i32, device=dev)
    parents = torch.empty((B, n), dtype=i32, device=dev)
    depths = torch.empty((B, n), dtype=i32, device=dev)
    scores = torch.empty((B, n), dtype=torch.float32, device=dev)
    exact = torch.empty((B,), dtype=torch.bool, device=dev)
    mask = torch.empty((B, n + 1, NW), dtype=i32, device=dev) if ancestor_mask else None
    order = torch.empty((B, n), dtype=i32, device=dev) if spine_first and n else None
    if B:
        NP = max(32, _next_pow2(n))
        NWP = max(1, _next_pow2(NW))
        nw = int(tuning.tree_warps) if tuning.tree_warps else 1
        mask_block = tuning.mask_block
        RB = int(mask_block) if mask_block else max(1, min(_next_pow2(n + 1), 1024 * nw // NWP))
        if RB & (RB - 1):
            raise ValueError(f"build_tree: tuning `mask_block` must be a power of two, got {mask_block!r}")
        W0 = min(_frontier_start(tuning.frontier_start), NP)
        _tree_kernel[(B,)](
            top_lp, top_id, active, tokens, parents, depths, scores, mask, exact, order,
            L, K, n, NW,
            KP=KP, NP=NP, NWP=NWP, RB=RB, HAS_ACTIVE=active is not None,
            WRITE_MASK=ancestor_mask, num_warps=nw,
            TP=_next_pow2(L * KP) if 0 < L * KP <= tuning.tree_preload_max else 0,
            SPINE_FIRST=order is not None, W0=W0, NPH=(NP // W0).bit_length() - 1,
        )
    return DraftTree(tokens, parents, depths, scores, mask, exact, lse, top_lp[..., :K],
                     top_id[..., :K])
