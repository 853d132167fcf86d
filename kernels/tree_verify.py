"""Triton kernels and host wrapper for DDTree tree verification.

Layout (docs/kernel.md, Layout): ``cu_num_draft_tokens`` is the inclusive
cumsum of n_r; node j (1..n_r) of request r sits at flat index
``start_r + j - 1``; ``draft_parent_ids`` holds its LOCAL parent (0 = root);
the target row of node (r, j) is ``start_r + r + j`` (j = 0 is the root row).

Kernels (one launch each, no host synchronisation, static grids):

* ``tree_verify_walk_kernel`` -- grid (B,). Preloads the request's tokens,
  parents and either the argmax values (greedy) or the edge probabilities
  ``p_parent(tok)`` plus coins (sampled) as ``BLOCK_N`` vectors, then walks the
  tree in registers (one masked reduction per depth, no dependent global load).
  Writes the accepted tokens, ``accepted_rows``, ``num_accepted`` and, for greedy
  requests, the final token.
* ``tree_verify_sample_kernel`` -- grid (B, cdiv(V, BLOCK_V)), sampled requests
  only. Exponential race ``argmax_v p(v) * inv_exp(v)`` over the final node's row
  with that node's children excluded; one (max, argmax) per vocab block. Reads
  exactly one V-row per request.
* ``tree_verify_reduce_kernel`` -- grid (B,). Lowest-id winner over the blocks,
  zero-mass guard, writes column ``num_accepted``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._validate import check_inputs

# NOTE: module constants must be tl.constexpr *instances* for the compiler
# (an annotation alone is rejected); the interpreter does not check this.
PLACEHOLDER_TOKEN_ID = tl.constexpr(-1)
# NOTE: target-only acceptance is decided in 2**-52 fixed point (int64) so the
# inclusive cumulative sum is exact and independent of the scan order; the
# PyTorch reference does the same arithmetic and matches bit for bit.
FIXED_POINT_SCALE = tl.constexpr(4503599627370496.0)  # 2**52
DEFAULT_BLOCK_V = 4096
# Philox-4x32 rounds for the in-kernel final-token noise (Triton's default is 10).
PHILOX_ROUNDS = tl.constexpr(10)
DUP_CHUNK = 16


@triton.jit
def _pick(vec, offs, idx):
    # Masked reduction instead of a dependent global load: vec[idx].
    return tl.sum(tl.where(offs == idx, vec, 0), axis=0)


@triton.jit
def _philox_coin_fx(seed, position):
    # 52-bit uniform integer in [0, 2**52) from two 31-bit Philox outputs keyed by
    # (request seed, absolute position of the visited node).
    two = tl.arange(0, 2)
    r = tl.randint(seed, position.to(tl.int32) * 2 + two)
    r31 = (r >> 1).to(tl.int32).to(tl.int64)
    hi = tl.sum(tl.where(two == 0, r31, 0), axis=0)
    lo = tl.sum(tl.where(two == 1, r31, 0), axis=0)
    return hi * 2097152 + (lo >> 10)  # hi * 2**21 + lo / 2**10


@triton.jit
def _final_seed(seed, position):
    # Separate Philox key for the final-token noise of one (request, round).
    return seed * 6364136223846793005 + position * 1442695040888963407 + 1013904223


@triton.jit
def _greedy_walk(target_argmax_ptr, tok, par, offs, wo, out_tok, out_row, row0, num_nodes, width,
                 BLOCK_N: tl.constexpr):
    cur = row0 * 0
    depth = row0 * 0
    # ---------------- greedy: follow the target argmax ----------------
    am = tl.load(target_argmax_ptr + row0 + offs, mask=offs <= num_nodes, other=-1).to(tl.int32)
    go = depth == 0
    while go:
        t = _pick(am, offs, cur)
        match = (par == cur) & (tok == t)
        nxt = tl.min(tl.where(match, offs, BLOCK_N), axis=0)  # lowest index wins
        acc = (nxt < BLOCK_N) & (depth < width - 1)
        out_tok = tl.where(acc & (wo == depth), t, out_tok)
        out_row = tl.where(acc & (wo == depth + 1), row0 + nxt, out_row)
        cur = tl.where(acc, nxt, cur)
        depth = tl.where(acc, depth + 1, depth)
        go = acc
    t = _pick(am, offs, cur)
    out_tok = tl.where(wo == depth, t, out_tok)
    return out_tok, out_row, depth


@triton.jit
def _sampled_walk(target_probs_ptr, coins_ptr, seeds_ptr, positions_ptr, scratch_ptr,
                  draft_token_ids_ptr, draft_parent_ids_ptr, tok, par, valid, offs, wo,
                  out_tok, out_row, req_idx, start_idx, row0, num_nodes, batch_size, width,
                  vocab_size, BLOCK_N: tl.constexpr, HAS_COINS: tl.constexpr,
                  HAS_POSITIONS: tl.constexpr, CHECK_DUPLICATES: tl.constexpr,
                  DUP_CHUNK: tl.constexpr):
    cur = row0 * 0
    depth = row0 * 0
    # ---------------- sampled, target-only (Mode A) ----------------
    # Edge probability e[j] = p_{parent(j)}(tok(j)): one independent gather
    # per node. NOTE: int64 row offsets (row * V overflows int32 at T > 14134).
    in_vocab = valid & (tok < vocab_size)
    erow = (row0 + tl.where(in_vocab, par, 0)).to(tl.int64)
    e = tl.load(target_probs_ptr + erow * vocab_size + tl.where(in_vocab, tok, 0),
                mask=in_vocab, other=0.0).to(tl.float32)
    e = tl.where(e > 0, e, 0.0)  # NaN / negative -> 0
    sib = valid
    if CHECK_DUPLICATES:
        # A later sibling with the same token is unreachable (docs/kernel.md: duplicate siblings).
        dup = offs < 0
        for i0 in range(0, num_nodes, DUP_CHUNK):
            io = i0 + 1 + tl.arange(0, DUP_CHUNK)
            im = io <= num_nodes
            ti = tl.load(draft_token_ids_ptr + start_idx + io - 1, mask=im, other=-1).to(tl.int32)
            pi = tl.load(draft_parent_ids_ptr + start_idx + io - 1, mask=im, other=-1).to(tl.int32)
            vi = im & (ti >= 0) & (pi >= 0) & (pi < io)
            eq = ((pi[:, None] == par[None, :]) & (ti[:, None] == tok[None, :])
                  & (io[:, None] < offs[None, :]) & vi[:, None])
            dup = dup | (tl.max(eq.to(tl.int32), axis=0) > 0)
        sib = valid & (dup == 0)
    efx = (tl.minimum(e, 1.0).to(tl.float64) * FIXED_POINT_SCALE).to(tl.int64)
    efx = tl.where(sib, efx, 0)
    if HAS_COINS:
        cf = tl.load(coins_ptr + row0 + offs, mask=offs <= num_nodes, other=0.5).to(tl.float64)
        cf = tl.where(cf > 0, cf, 0.0)
        cfx = (tl.minimum(cf, 1.0) * FIXED_POINT_SCALE).to(tl.int64)
        seed = 0
        pos0 = 0
    else:
        cfx = efx  # unused
        seed = tl.load(seeds_ptr + req_idx).to(tl.int64)
        if HAS_POSITIONS:
            pos0 = tl.load(positions_ptr + req_idx).to(tl.int64)
        else:
            pos0 = seed * 0
    go = depth == 0
    while go:
        child = sib & (par == cur)
        csum = tl.cumsum(tl.where(child, efx, 0), axis=0)
        if HAS_COINS:
            ufx = _pick(cfx, offs, cur)
        else:
            ufx = _philox_coin_fx(seed, pos0 + depth)
        nxt = tl.min(tl.where(child & (csum > ufx), offs, BLOCK_N), axis=0)
        acc = (nxt < BLOCK_N) & (depth < width - 1)
        t = _pick(tok, offs, nxt)
        out_tok = tl.where(acc & (wo == depth), t, out_tok)
        out_row = tl.where(acc & (wo == depth + 1), row0 + nxt, out_row)
        cur = tl.where(acc, nxt, cur)
        depth = tl.where(acc, depth + 1, depth)
        go = acc
    # Final node: exclude its (tested) children unless it sits at the depth cap,
    # where it is treated as a leaf.
    capped = depth >= width - 1
    child = sib & (par == cur) & (capped == 0)
    last = tl.max(tl.where(child & (e > 0), offs, -1), axis=0)
    fallback = tl.where(last >= 0, _pick(tok, offs, last), PLACEHOLDER_TOKEN_ID)
    tl.store(scratch_ptr + req_idx, row0 + cur)
    tl.store(scratch_ptr + batch_size + req_idx, tl.where(capped, -1, cur))
    tl.store(scratch_ptr + 2 * batch_size + req_idx, fallback)

    return out_tok, out_row, depth


@triton.jit(do_not_specialize=["width", "vocab_size"])
def tree_verify_walk_kernel(
    output_token_ids_ptr,  # [batch_size, width] int32
    accepted_rows_ptr,  # [batch_size, width] int32
    num_accepted_ptr,  # [batch_size] int32
    scratch_ptr,  # [3, batch_size] int32: final row, excluded parent, fallback token
    draft_token_ids_ptr,  # [num_draft_tokens] int32/int64
    draft_parent_ids_ptr,  # [num_draft_tokens] int32/int64 (local parent, 0 = root)
    cu_num_draft_tokens_ptr,  # [batch_size] inclusive cumsum
    target_argmax_ptr,  # [num_tokens] or None (ALL_SAMPLED)
    target_probs_ptr,  # [num_tokens, vocab_size] or None (ALL_GREEDY)
    is_greedy_ptr,  # [batch_size] bool or None (ALL_GREEDY / ALL_SAMPLED)
    coins_ptr,  # [num_tokens] float32/float64 or None (HAS_COINS=False)
    seeds_ptr,  # [batch_size] int64 or None (HAS_COINS=True)
    positions_ptr,  # [batch_size] int64 or None
    batch_size,
    width,
    vocab_size,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    ALL_SAMPLED: tl.constexpr,
    HAS_COINS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    CHECK_DUPLICATES: tl.constexpr,
    DUP_CHUNK: tl.constexpr,
):
    req_idx = tl.program_id(0)
    if req_idx == 0:
        start_idx = 0
    else:
        start_idx = tl.load(cu_num_draft_tokens_ptr + req_idx - 1).to(tl.int32)
    end_idx = tl.load(cu_num_draft_tokens_ptr + req_idx).to(tl.int32)
    num_nodes = end_idx - start_idx
    row0 = start_idx + req_idx  # root row

    offs = tl.arange(0, BLOCK_N)  # local node index j (0 = root)
    is_node = (offs >= 1) & (offs <= num_nodes)
    tok = tl.load(draft_token_ids_ptr + start_idx + offs - 1, mask=is_node, other=-1).to(tl.int32)
    par = tl.load(draft_parent_ids_ptr + start_idx + offs - 1, mask=is_node, other=-1).to(tl.int32)
    # NOTE: a parent outside [0, j-1] or a negative token makes the node unreachable
    # (contract violation; tree_verify(check_data=True) raises instead).
    valid = is_node & (tok >= 0) & (par >= 0) & (par < offs)
    par = tl.where(valid, par, -1)

    wo = tl.arange(0, BLOCK_W)
    out_tok = tl.full([BLOCK_W], PLACEHOLDER_TOKEN_ID, tl.int32)
    out_row = tl.where(wo == 0, row0, tl.full([BLOCK_W], PLACEHOLDER_TOKEN_ID, tl.int32))

    if ALL_GREEDY:
        out_tok, out_row, depth = _greedy_walk(
            target_argmax_ptr, tok, par, offs, wo, out_tok, out_row, row0, num_nodes, width,
            BLOCK_N)
    elif ALL_SAMPLED:
        out_tok, out_row, depth = _sampled_walk(
            target_probs_ptr, coins_ptr, seeds_ptr, positions_ptr, scratch_ptr,
            draft_token_ids_ptr, draft_parent_ids_ptr, tok, par, valid, offs, wo,
            out_tok, out_row, req_idx, start_idx, row0, num_nodes, batch_size, width,
            vocab_size, BLOCK_N, HAS_COINS, HAS_POSITIONS, CHECK_DUPLICATES, DUP_CHUNK)
    else:
        depth = row0 * 0
        if tl.load(is_greedy_ptr + req_idx) != 0:
            out_tok, out_row, depth = _greedy_walk(
                target_argmax_ptr, tok, par, offs, wo, out_tok, out_row, row0, num_nodes,
                width, BLOCK_N)
        else:
            out_tok, out_row, depth = _sampled_walk(
                target_probs_ptr, coins_ptr, seeds_ptr, positions_ptr, scratch_ptr,
                draft_token_ids_ptr, draft_parent_ids_ptr, tok, par, valid, offs, wo,
                out_tok, out_row, req_idx, start_idx, row0, num_nodes, batch_size, width,
                vocab_size, BLOCK_N, HAS_COINS, HAS_POSITIONS, CHECK_DUPLICATES, DUP_CHUNK)

    wmask = wo < width
    obase = req_idx.to(tl.int64) * width
    tl.store(output_token_ids_ptr + obase + wo, out_tok, mask=wmask)
    tl.store(accepted_rows_ptr + obase + wo, out_row, mask=wmask)
    tl.store(num_accepted_ptr + req_idx, depth)


@triton.jit
def _race_quarter(prow, nrow, start, qi, rbits, ctok, vocab_size, HAS_NOISE: tl.constexpr):
    """Best (score, id) of p(v) * inv_exp(v) over ids start + qi, children excluded."""
    voffs = start + qi
    vmask = voffs < vocab_size
    p = tl.load(prow + voffs, mask=vmask, other=0.0).to(tl.float32)
    if HAS_NOISE:
        inv = tl.load(nrow + voffs, mask=vmask, other=0.0)
    else:
        u = tl.random.uint_to_uniform_float(rbits)  # [0, 1)
        # E = -log(1 - u) ~ Exp(1); a series near 0, where the race is decided.
        e_small = u * (1.0 + u * (0.5 + u * (0.3333333333 + u * 0.25)))
        expo = tl.where(u < 0.0078125, e_small, -tl.log(1.0 - u))
        inv = 1.0 / expo
    # NOTE: masked lanes, p <= 0 (top-k/top-p) and NaN get -inf so they never win.
    s = tl.where(vmask & (p > 0), p * inv, float("-inf"))
    m, idx = tl.max(s, axis=0, return_indices=True, return_indices_tie_break_left=True)
    gid = start + idx
    go = (tl.max((ctok == gid).to(tl.int32), axis=0) > 0) & (m > float("-inf"))
    # Remove excluded children one by one (usually zero or one iteration).
    while go:
        s = tl.where(voffs == gid, float("-inf"), s)
        m, idx = tl.max(s, axis=0, return_indices=True, return_indices_tie_break_left=True)
        gid = start + idx
        go = (tl.max((ctok == gid).to(tl.int32), axis=0) > 0) & (m > float("-inf"))
    return m, gid


@triton.jit(do_not_specialize=["width", "vocab_size"])
def tree_verify_sample_kernel(
    block_max_ptr,  # [batch_size, NUM_VBLOCKS] float32
    block_idx_ptr,  # [batch_size, NUM_VBLOCKS] int32
    scratch_ptr,  # [3, batch_size] int32 (from the walk)
    num_accepted_ptr,  # [batch_size] int32 (from the walk)
    draft_token_ids_ptr,  # [num_draft_tokens]
    draft_parent_ids_ptr,  # [num_draft_tokens]
    cu_num_draft_tokens_ptr,  # [batch_size]
    target_probs_ptr,  # [num_tokens, vocab_size]
    is_greedy_ptr,  # [batch_size] bool or None (ALL_SAMPLED)
    inv_exp_noise_ptr,  # [batch_size, vocab_size] float32 or None (HAS_NOISE=False)
    seeds_ptr,  # [batch_size] int64 or None
    positions_ptr,  # [batch_size] int64 or None
    batch_size,
    width,
    vocab_size,
    NUM_VBLOCKS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALL_SAMPLED: tl.constexpr,
    HAS_NOISE: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
):
    req_idx = tl.program_id(0)
    vb = tl.program_id(1)
    if ALL_SAMPLED:
        run = req_idx >= 0
    else:
        run = tl.load(is_greedy_ptr + req_idx) == 0
    if run:
        final_row = tl.load(scratch_ptr + req_idx)
        excl_parent = tl.load(scratch_ptr + batch_size + req_idx)
        if req_idx == 0:
            start_idx = 0
        else:
            start_idx = tl.load(cu_num_draft_tokens_ptr + req_idx - 1).to(tl.int32)
        num_nodes = tl.load(cu_num_draft_tokens_ptr + req_idx).to(tl.int32) - start_idx
        offs = tl.arange(0, BLOCK_N)
        is_node = (offs >= 1) & (offs <= num_nodes)
        tok = tl.load(draft_token_ids_ptr + start_idx + offs - 1, mask=is_node, other=-1).to(tl.int32)
        par = tl.load(draft_parent_ids_ptr + start_idx + offs - 1, mask=is_node, other=-1).to(tl.int32)
        ex = is_node & (tok >= 0) & (par >= 0) & (par < offs) & (par == excl_parent)
        ctok = tl.where(ex, tok, -1)  # excluded token ids (children of the final node)

        # One program covers BLOCK_V ids as 4 contiguous quarters of Q = BLOCK_V // 4;
        # one Philox call yields the 4 uniforms of lane i (one per quarter).
        Q: tl.constexpr = BLOCK_V // 4
        qi = tl.arange(0, Q)
        base = vb * BLOCK_V
        # NOTE: int64 row offset; final_row * V overflows int32.
        prow = target_probs_ptr + final_row.to(tl.int64) * vocab_size
        if HAS_NOISE:
            nrow = inv_exp_noise_ptr + req_idx.to(tl.int64) * vocab_size
            r0 = qi
            r1 = qi
            r2 = qi
            r3 = qi
        else:
            seed = tl.load(seeds_ptr + req_idx).to(tl.int64)
            if HAS_POSITIONS:
                pos = tl.load(positions_ptr + req_idx).to(tl.int64)
            else:
                pos = seed * 0
            pos = pos + tl.load(num_accepted_ptr + req_idx).to(tl.int64)
            nrow = prow  # unused
            r0, r1, r2, r3 = tl.randint4x(_final_seed(seed, pos), vb * Q + qi, PHILOX_ROUNDS)
        m0, i0 = _race_quarter(prow, nrow, base, qi, r0, ctok, vocab_size, HAS_NOISE)
        m1, i1 = _race_quarter(prow, nrow, base + Q, qi, r1, ctok, vocab_size, HAS_NOISE)
        m2, i2 = _race_quarter(prow, nrow, base + 2 * Q, qi, r2, ctok, vocab_size, HAS_NOISE)
        m3, i3 = _race_quarter(prow, nrow, base + 3 * Q, qi, r3, ctok, vocab_size, HAS_NOISE)
        # Quarters are in increasing id order: strict '>' keeps the lowest id on ties.
        m = m0
        gid = i0
        gid = tl.where(m1 > m, i1, gid)
        m = tl.maximum(m, m1)
        gid = tl.where(m2 > m, i2, gid)
        m = tl.maximum(m, m2)
        gid = tl.where(m3 > m, i3, gid)
        m = tl.maximum(m, m3)
        tl.store(block_max_ptr + req_idx * NUM_VBLOCKS + vb, m)
        tl.store(block_idx_ptr + req_idx * NUM_VBLOCKS + vb, gid)


@triton.jit(do_not_specialize=["width"])
def tree_verify_reduce_kernel(
    output_token_ids_ptr,  # [batch_size, width] int32
    block_max_ptr,  # [batch_size, NUM_VBLOCKS] float32
    block_idx_ptr,  # [batch_size, NUM_VBLOCKS] int32
    scratch_ptr,  # [3, batch_size] int32
    num_accepted_ptr,  # [batch_size] int32
    is_greedy_ptr,  # [batch_size] bool or None (ALL_SAMPLED)
    batch_size,
    width,
    NUM_VBLOCKS: tl.constexpr,
    BLOCK_VB: tl.constexpr,
    ALL_SAMPLED: tl.constexpr,
):
    req_idx = tl.program_id(0)
    if ALL_SAMPLED:
        run = req_idx >= 0
    else:
        run = tl.load(is_greedy_ptr + req_idx) == 0
    if run:
        b = tl.arange(0, BLOCK_VB)
        bm = b < NUM_VBLOCKS
        m = tl.load(block_max_ptr + req_idx * NUM_VBLOCKS + b, mask=bm, other=float("-inf"))
        ids = tl.load(block_idx_ptr + req_idx * NUM_VBLOCKS + b, mask=bm, other=0)
        best, where_ = tl.max(m, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tok = _pick(ids, b, where_)
        # Zero-mass residual guard (docs/kernel.md): the last child with p > 0.
        fallback = tl.load(scratch_ptr + 2 * batch_size + req_idx)
        tok = tl.where(best > float("-inf"), tok, fallback)
        a = tl.load(num_accepted_ptr + req_idx)
        tl.store(output_token_ids_ptr + req_idx.to(tl.int64) * width + a, tok)


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def tree_verify(
    draft_token_ids: torch.Tensor,
    draft_parent_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_argmax: Optional[torch.Tensor] = None,
    target_probs: Optional[torch.Tensor] = None,
    is_greedy: Optional[torch.Tensor] = None,
    coins: Optional[torch.Tensor] = None,
    inv_exp_noise: Optional[torch.Tensor] = None,
    draft_probs: Optional[torch.Tensor] = None,
    width: Optional[int] = None,
    *,
    seeds: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None,
    max_num_nodes: Optional[int] = None,
    validate: bool = True,
    check_data: Optional[bool] = None,
    check_duplicates: bool = True,
    generator: Optional[torch.Generator] = None,
    block_v: int = DEFAULT_BLOCK_V,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
):
    """Verify a batch of draft trees; see ``docs/kernel.md``.

    Returns ``(output_token_ids [B, W] int32, num_accepted [B] int32,
    accepted_rows [B, W] int32)``.

    Host-sync-free when ``width`` and ``max_num_nodes`` are given and
    ``check_data`` is False (the default for CUDA tensors). Leaving ``width`` or
    ``max_num_nodes`` as None computes ``max(n_r)`` on the host (one sync).

    Randomness for sampled requests: explicit ``coins`` [T] and ``inv_exp_noise``
    [B, V] (deterministic, bit-identical to ``tree_verify_ref``), or in-kernel
    Philox keyed by ``seeds`` [B] int64 and ``positions`` [B] (absolute position
    of the root token; node at depth d uses ``positions + d``). With neither, fresh
    seeds are drawn on the device with ``torch.randint`` (``generator``).

    ``draft_probs`` (Mode B, recursive rejection sampling) currently runs the
    PyTorch reference (slow, syncs); the Triton path covers greedy and
    target-only.
    """
    if draft_probs is not None:
        from .reference import tree_verify_ref

        return tree_verify_ref(
            draft_token_ids, draft_parent_ids, cu_num_draft_tokens, target_argmax,
            target_probs, is_greedy, coins, inv_exp_noise, draft_probs, width,
            seeds=seeds, positions=positions, max_num_nodes=max_num_nodes,
            validate=validate, check_data=check_data, generator=generator)

    dev = draft_token_ids.device
    if check_data is None:
        check_data = dev.type == "cpu"
    args = check_inputs(
        draft_token_ids, draft_parent_ids, cu_num_draft_tokens,
        target_argmax, target_probs, is_greedy, coins, inv_exp_noise,
        draft_probs, width, seeds, positions, max_num_nodes,
        validate=validate, check_data=check_data,
    )
    B, W, V = args.batch_size, args.width, args.vocab_size
    out = torch.empty((B, W), dtype=torch.int32, device=dev)
    rows = torch.empty((B, W), dtype=torch.int32, device=dev)
    num_acc = torch.empty((B,), dtype=torch.int32, device=dev)
    if B == 0:
        return out, num_acc, rows

    all_greedy = args.all_greedy
    all_sampled = args.all_sampled
    if target_argmax is None and not all_sampled:
        # Mixed batch without argmax: derive it from the probs (one pass over [T, V]).
        target_argmax = torch.argmax(target_probs, dim=-1)
    has_coins = coins is not None
    if not all_greedy and not has_coins and seeds is None:
        seeds = torch.randint(0, 2**62, (B,), dtype=torch.int64, device=dev, generator=generator)

    BLOCK_N = block_n or max(16, _next_pow2(args.max_num_nodes + 1))
    if BLOCK_N < args.max_num_nodes + 1:
        raise ValueError(f"tree_verify: argument `block_n`={BLOCK_N} must be > max_num_nodes")
    BLOCK_W = max(2, _next_pow2(W))
    scratch = torch.empty((3, B), dtype=torch.int32, device=dev)

    tree_verify_walk_kernel[(B,)](
        out,
        rows,
        num_acc,
        scratch,
        draft_token_ids,
        draft_parent_ids,
        cu_num_draft_tokens,
        target_argmax,
        target_probs,
        is_greedy if not (all_greedy or all_sampled) else None,
        coins,
        seeds,
        positions,
        B,
        W,
        V,
        BLOCK_N=BLOCK_N,
        BLOCK_W=BLOCK_W,
        ALL_GREEDY=all_greedy,
        ALL_SAMPLED=all_sampled,
        HAS_COINS=has_coins,
        HAS_POSITIONS=positions is not None,
        CHECK_DUPLICATES=check_duplicates,
        DUP_CHUNK=DUP_CHUNK,
        # Greedy walks are reduction-latency bound: one warp keeps every per-depth
        # reduction inside a warp (no shared-memory round trip) up to BLOCK_N = 256.
        num_warps=num_warps or (1 if all_greedy and BLOCK_N <= 256 else 4),
    )
    if all_greedy:
        return out, num_acc, rows

    BLOCK_V = min(int(block_v), max(64, _next_pow2(V)))
    NUM_VBLOCKS = triton.cdiv(V, BLOCK_V)
    block_max = torch.empty((B, NUM_VBLOCKS), dtype=torch.float32, device=dev)
    block_idx = torch.empty((B, NUM_VBLOCKS), dtype=torch.int32, device=dev)
    tree_verify_sample_kernel[(B, NUM_VBLOCKS)](
        block_max,
        block_idx,
        scratch,
        num_acc,
        draft_token_ids,
        draft_parent_ids,
        cu_num_draft_tokens,
        target_probs,
        is_greedy if not all_sampled else None,
        inv_exp_noise,
        seeds,
        positions,
        B,
        W,
        V,
        NUM_VBLOCKS=NUM_VBLOCKS,
        BLOCK_V=BLOCK_V,
        BLOCK_N=BLOCK_N,
        ALL_SAMPLED=all_sampled,
        HAS_NOISE=inv_exp_noise is not None,
        HAS_POSITIONS=positions is not None,
        num_warps=8 if BLOCK_V >= 4096 else 4,
    )
    tree_verify_reduce_kernel[(B,)](
        out,
        block_max,
        block_idx,
        scratch,
        num_acc,
        is_greedy if not all_sampled else None,
        B,
        W,
        NUM_VBLOCKS=NUM_VBLOCKS,
        BLOCK_VB=max(2, _next_pow2(NUM_VBLOCKS)),
        ALL_SAMPLED=all_sampled,
        num_warps=1 if NUM_VBLOCKS <= 64 else 4,
    )
    return out, num_acc, rows
