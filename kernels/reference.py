"""Plain-loop PyTorch reference for DDTree tree verification (the executable spec).

``tree_verify_ref`` has the same signature and the same outputs as
:func:`ddtree_patcher.kernels.tree_verify`. It walks every request with Python
loops, so it is slow and syncs with the device; it exists to define the
semantics (the contract: ``docs/kernel.md``, Layout and Modes) and as the CPU fallback when Triton is unavailable.

Vocabulary (same as vLLM's ``RejectionSampler``):

* **root row** -- target row ``row(r, 0) = start_r + r``: the distribution after
  the last committed token.
* **accepted path** -- the nodes accepted at depths 1..A_r; at most one node per
  depth is ever visited.
* **final token** -- the token written after the accepted draft tokens: the bonus
  token when the walk ends at a leaf, the recovered/correction token otherwise.

Numerics that the Triton kernel reproduces bit for bit:

* Target-only acceptance compares fixed-point values: every edge probability is
  clamped to [0, 1] and converted with ``int64(fp64(p) * 2**52)`` (truncation),
  the coin with ``int64(fp64(u) * 2**52)``. The inclusive cumulative sum is then
  integer arithmetic, so the result does not depend on summation order.
* The final sample is an exponential race: ``argmax_v p(v) * inv_exp_noise[r, v]``
  computed in fp32, with tokens of ``p <= 0`` (or NaN) and excluded children at
  ``-inf``; ties go to the lowest token id.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

PLACEHOLDER_TOKEN_ID = -1
FIXED_POINT_SCALE = float(2**52)

__all__ = ["tree_verify_ref", "PLACEHOLDER_TOKEN_ID", "FIXED_POINT_SCALE"]


def _fx(x: torch.Tensor) -> torch.Tensor:
    """fp32/fp64 probability or coin -> int64 fixed point (2**-52 units)."""
    x = x.to(torch.float64)
    x = torch.where(x > 0, x, torch.zeros_like(x))  # NaN and negatives -> 0
    x = torch.clamp(x, max=1.0)
    return (x * FIXED_POINT_SCALE).to(torch.int64)


def _fx_scalar(x: float) -> int:
    """Same as :func:`_fx` for one Python float (fp64 arithmetic, truncation)."""
    if not x > 0:  # NaN, zero, negative
        return 0
    return int(min(x, 1.0) * FIXED_POINT_SCALE)


def _race(p: torch.Tensor, inv: torch.Tensor, excluded: Sequence[int]) -> int:
    """Exponential race over one row; returns -1 when no token has positive mass."""
    p = p.to(torch.float32)
    s = p * inv.to(torch.float32)
    s = torch.where(p > 0, s, torch.full_like(s, -math.inf))
    if len(excluded):
        idx = torch.tensor([t for t in excluded if 0 <= t < p.numel()], dtype=torch.long)
        if idx.numel():
            s[idx] = -math.inf
    m = torch.max(s)
    if not bool(m > -math.inf):
        return -1
    return int(torch.argmax(s))  # first maximal index = lowest token id


def tree_verify_ref(
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
    block_v: int = 0,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
):
    """Reference tree verification; see :func:`ddtree_patcher.kernels.tree_verify`.

    Randomness: when ``coins`` / ``inv_exp_noise`` are None the reference draws
    them with ``torch`` (``generator``, or one ``torch.Generator`` per request
    seeded from ``seeds[r]``). These streams differ from the kernel's in-kernel
    Philox stream, so only explicit coins and noise give bit-identical results.
    ``positions``, ``max_num_nodes``, ``check_duplicates``, ``check_data`` and the
    kernel tuning knobs (``block_v``, ``block_n``, ``num_warps``) are accepted for
    signature compatibility (``check_duplicates=False`` promises
    distinct sibling tokens, which the reference does not need).
    """
    from . import _validate as V

    args = V.check_inputs(
        draft_token_ids, draft_parent_ids, cu_num_draft_tokens,
        target_argmax, target_probs, is_greedy, coins, inv_exp_noise,
        draft_probs, width, seeds, positions, max_num_nodes,
        validate=validate, check_data=True if check_data is None else check_data,
    )
    B, W, vocab = args.batch_size, args.width, args.vocab_size

    tok_all = draft_token_ids.detach().cpu().to(torch.int64)
    par_all = draft_parent_ids.detach().cpu().to(torch.int64)
    cu = cu_num_draft_tokens.detach().cpu().to(torch.int64)
    if args.is_greedy is None:
        greedy_mask = torch.full((B,), args.all_greedy, dtype=torch.bool)
    else:
        greedy_mask = args.is_greedy.detach().cpu().bool()
    if target_argmax is None and target_probs is not None and bool(greedy_mask.any()):
        target_argmax = torch.argmax(target_probs, dim=-1)
    am = target_argmax.detach().cpu().to(torch.int64) if target_argmax is not None else None
    probs = target_probs.detach().cpu() if target_probs is not None else None
    qprobs = draft_probs.detach().cpu() if draft_probs is not None else None

    T = args.num_rows
    if probs is not None and not bool(greedy_mask.all()):
        if coins is None:
            coins_c = torch.empty(T, dtype=torch.float64)
            for r in range(B):
                g = _gen(generator, seeds, r)
                lo = (0 if r == 0 else int(cu[r - 1])) + r
                hi = int(cu[r]) + r + 1
                c = torch.rand(hi - lo, dtype=torch.float64, generator=g)
                coins_c[lo:hi] = c
        else:
            coins_c = coins.detach().cpu().to(torch.float64)
        if inv_exp_noise is None:
            noise = torch.empty(B, vocab, dtype=torch.float32)
            for r in range(B):
                g = _gen(generator, seeds, r, salt=1)
                noise[r] = 1.0 / torch.empty(vocab, dtype=torch.float32).exponential_(generator=g)
        else:
            noise = inv_exp_noise.detach().cpu().to(torch.float32)
    else:
        coins_c = noise = None

    out = torch.full((B, W), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    rows_out = torch.full((B, W), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    num_acc = torch.zeros(B, dtype=torch.int32)

    for r in range(B):
        start = 0 if r == 0 else int(cu[r - 1])
        n = int(cu[r]) - start
        row0 = start + r
        tok = [int(t) for t in tok_all[start:start + n]]
        par = [int(p) for p in par_all[start:start + n]]
        # local index j = i + 1
        valid = [tok[i] >= 0 and 0 <= par[i] < i + 1 for i in range(n)]

        def children(cur: int):
            return [i + 1 for i in range(n) if valid[i] and par[i] == cur]

        rows_out[r, 0] = row0
        cur, depth = 0, 0
        if bool(greedy_mask[r]):
            while True:
                t = int(am[row0 + cur])
                nxt = -1
                if depth < W - 1:
                    for c in children(cur):  # ascending index: lowest wins
                        if tok[c - 1] == t:
                            nxt = c
                            break
                if nxt < 0:
                    out[r, depth] = t
                    break
                out[r, depth] = t
                depth += 1
                rows_out[r, depth] = row0 + nxt
                cur = nxt
            num_acc[r] = depth
            continue

        if qprobs is None:
            final = _walk_target_only(r, row0, tok, children, probs, coins_c, noise, W, vocab,
                                      out, rows_out)
        else:
            final = _walk_draft_probs(r, start, row0, tok, children, probs, qprobs, coins_c,
                                      noise, W, vocab, out, rows_out)
        depth, tok_final = final
        out[r, depth] = tok_final
        num_acc[r] = depth

    dev = draft_token_ids.device
    return out.to(dev), num_acc.to(dev), rows_out.to(dev)


def _gen(generator, seeds, r, salt=0):
    if generator is not None:
        return generator
    g = torch.Generator()
    if seeds is not None:
        g.manual_seed((int(seeds[r]) * 2 + salt) & ((1 << 63) - 1))
    else:
        g.seed()
    return g


def _walk_target_only(r, row0, tok, children, probs, coins, noise, W, vocab, out, rows_out):
    """Mode A (target-only, docs/kernel.md "TARGET_ONLY") with fixed-point cumulative sums."""
    cur, depth = 0, 0
    while True:
        p = probs[row0 + cur]
        if depth >= W - 1:
            # Depth cap: the node is treated as a leaf (residual = full p_cur).
            return depth, _race(p, noise[r], [])
        kids, seen = [], set()
        for c in children(cur):
            t = tok[c - 1]
            if t in seen:  # later duplicate sibling: unreachable, never counted twice
                continue
            seen.add(t)
            kids.append(c)
        u = _fx_scalar(float(coins[row0 + cur]))
        S, nxt = 0, -1
        for c in kids:
            t = tok[c - 1]
            S += _fx_scalar(float(p[t])) if t < vocab else 0
            if S > u:
                nxt = c
                break
        if nxt < 0:
            excl = [tok[c - 1] for c in kids]
            t = _race(p, noise[r], excl)
            if t < 0:
                # Zero-mass residual (docs/kernel.md, zero-mass guard): emit the last child with p > 0.
                nz = [tok[c - 1] for c in kids if tok[c - 1] < vocab and bool(p[tok[c - 1]] > 0)]
                t = nz[-1] if nz else PLACEHOLDER_TOKEN_ID
            return depth, t
        out[r, depth] = tok[nxt - 1]
        depth += 1
        rows_out[r, depth] = row0 + nxt
        cur = nxt


def _walk_draft_probs(r, start, row0, tok, children, probs, qprobs, coins, noise, W, vocab,
                      out, rows_out):
    """Mode B (recursive rejection sampling, siblings drawn i.i.d. from their q rows).

    ``draft_probs[start_r + j - 1]`` is the distribution node j was drawn from
    (the proposal at its parent). The uniform that tests child c is
    ``coins[row(r, c)]`` (each child row is tested at most once). Residuals are
    kept in float64.
    """
    cur, depth = 0, 0
    while True:
        p = probs[row0 + cur].to(torch.float64)
        p = torch.where(p > 0, p, torch.zeros_like(p))
        if depth >= W - 1:
            return depth, _race(probs[row0 + cur], noise[r], [])
        res = p / p.sum() if float(p.sum()) > 0 else p
        nxt, last_tested = -1, -1
        for c in children(cur):
            t = tok[c - 1]
            if t >= vocab:
                continue
            q = qprobs[start + c - 1].to(torch.float64)
            q = torch.where(q > 0, q, torch.zeros_like(q))
            u = float(coins[row0 + c])
            if float(q[t]) > 0 and u * float(q[t]) < float(res[t]):
                nxt = c
                break
            if float(res[t]) > 0:
                last_tested = t
            new = torch.clamp(res - q / q.sum() if float(q.sum()) > 0 else res, min=0.0)
            tot = float(new.sum())
            if tot > 0:
                res = new / tot
            else:
                res = new
                break
        if nxt < 0:
            t = _race(res.to(torch.float32), noise[r], [])
            if t < 0:
                t = last_tested if last_tested >= 0 else PLACEHOLDER_TOKEN_ID
            return depth, t
        out[r, depth] = tok[nxt - 1]
        depth += 1
        rows_out[r, depth] = row0 + nxt
        cur = nxt
