"""Plain-loop reference for the DDTree tree builder (the executable spec of ``build_tree``).

``build_tree_ref`` takes the same arguments and returns the same :class:`DraftTree` as
:func:`ddtree_patcher.kernels.build_tree`. It is the DDTree paper's Algorithm 1 (best-first
expansion, ``docs/tree-builder.md`` "The rules") with Python's ``heapq``; it is slow and synchronises with the device. See
``docs/tree-builder.md`` for the contract; the rules, in short:

* **Log-probabilities.** Per request and depth d (row ``draft_logits[b, d]``): logits are read
  as float32; NaN and +inf count as -inf (an invalid entry); ``lse = logsumexp(row)`` (-inf for
  a row without a finite entry); ``logprob = x - lse`` in float32, -inf where x or lse is -inf.
* **Per-depth top-K.** The K entries of largest logprob, ties to the lower token id (-0.0 counts
  as +0.0). K = ``topk``, at most V; ranks past V (K > V) have logprob -inf and id -1.
* **Best-first.** Candidates are (σ, depth, rank, parent); σ is the float32 cumulative logprob,
  ``σ(child) = σ(parent) + logprob[depth][rank]`` added in float32 in that order (σ(root) = 0).
  The heap starts with (depth 1, rank 0, parent 0). Each pop emits node j = (pops so far) + 1
  and pushes its next sibling (rank + 1 < K: same parent, σ(parent) + logprob[depth][rank+1])
  and its first child (depth < L: parent j, rank 0).
* **Ties.** Pop order is: larger σ first, then lower depth, then lower rank, then lower parent
  index. This order is total, and each candidate's generator (previous sibling or parent) comes
  before it, so the popped nodes are exactly the first ``budget`` prefixes in that order.
* **Node order.** Nodes are numbered in pop order; with ``spine_first=True`` the spine (the
  chain of rank-0 nodes from the root: node j is on it iff its rank is 0 and its parent is the
  root or on it) becomes nodes 1..s in depth order and every other node follows in pop order.
  Both orders put parents before children and siblings in rank order; spine-first puts the
  accepted path's nodes at their final KV slots for as long as it follows the drafter's top-1
  (the tree step's compaction moves nothing there).
* **Zero probability.** A candidate with σ = -inf is never emitted: when the best candidate has
  σ = -inf (or none is left) the request's remaining nodes are **padding**.
* **Padding and inactive requests.** A padding node has token -1 (``PLACEHOLDER_TOKEN_ID``,
  which ``tree_verify`` treats as unreachable), parent 0, depth 1, score -inf. A request with
  ``active[b] == False`` (e.g. in prefill) gets ``budget`` padding nodes, lse -inf, top-K
  logprobs -inf and ids -1, and ``exact`` True.
* **exact.** True when the tree is provably the one Algorithm 1 builds with K = min(budget, V)
  (paper Lemma 1: then no rank limit applies): K >= budget, or, with τ the score of node
  ``budget`` (-inf if the tree is not full) and P_d the spine score (sum of the rank-0 logprobs
  of depths 1..d, P_0 = 0), every depth d has logprob[d][K] = -inf or P_{d-1} = -inf or
  P_{d-1} + logprob[d][K] < τ (float32): then no node of rank >= K can be among the first
  ``budget`` prefixes.
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple, Optional

import numpy as np
import torch

PLACEHOLDER_TOKEN_ID = -1
DEFAULT_TOPK = 8
MAX_BUDGET = 2047
MAX_TOPK = 1023
MAX_DEPTH = 63

__all__ = ["DraftTree", "build_tree_ref", "check_build_args", "unpack_ancestor_mask",
           "DEFAULT_TOPK", "MAX_BUDGET", "MAX_TOPK", "MAX_DEPTH"]


class DraftTree(NamedTuple):
    """A batch of DDTree draft trees (every tensor on the logits' device).

    Node j (1..n, n = budget) of request b is column j - 1; the root (local index 0) is the last
    verified token and is not stored.
    """

    tokens: torch.Tensor  # int32 [B, n]: token of node j; -1 for padding
    parents: torch.Tensor  # int32 [B, n]: local parent index in [0, j-1]; 0 = root
    depths: torch.Tensor  # int32 [B, n]: depth in 1..L (position = seq_len + depth)
    scores: torch.Tensor  # float32 [B, n]: cumulative draft logprob σ; -inf for padding
    ancestor_mask: Optional[torch.Tensor]  # int32 [B, n+1, ceil((n+1)/32)]: bit i of row j set
    #                                        iff node i is node j, an ancestor of j, or the root
    exact: torch.Tensor  # bool [B]: the tree is Algorithm 1's with K = min(budget, V)
    lse: torch.Tensor  # float32 [B, L]: logsumexp of each depth's logits
    topk_logprobs: torch.Tensor  # float32 [B, L, K]: per-depth top-K logprobs, descending
    topk_ids: torch.Tensor  # int32 [B, L, K]: their token ids (-1 past V)


def _err(name: str, msg: str) -> ValueError:
    return ValueError(f"build_tree: argument `{name}` {msg}")


def check_build_args(draft_logits, budget, topk, active, lse=None):
    """Validate the arguments (metadata only, no host sync); returns (B, L, V, n, K)."""
    if not isinstance(draft_logits, torch.Tensor):
        raise _err("draft_logits", f"must be a torch.Tensor, got {type(draft_logits).__name__}")
    if draft_logits.ndim != 3:
        raise _err("draft_logits", f"must be 3-D [B, L, V], got shape {tuple(draft_logits.shape)}")
    if draft_logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise _err("draft_logits", f"must be bfloat16, float16 or float32, got {draft_logits.dtype}")
    B, L, V = (int(s) for s in draft_logits.shape)
    if V >= 1 and draft_logits.stride(2) != 1:
        raise _err("draft_logits", "must be contiguous in the vocab dimension (stride(2) == 1)")
    if V < 1:
        raise _err("draft_logits", "must have a vocab dimension of at least 1")
    if not 1 <= L <= MAX_DEPTH:
        raise _err("draft_logits", f"must have 1 <= L <= {MAX_DEPTH} positions, got {L}")
    if not isinstance(budget, int) or isinstance(budget, bool) or not 0 <= budget <= MAX_BUDGET:
        raise _err("budget", f"must be an int in [0, {MAX_BUDGET}], got {budget!r}")
    if topk is None:
        topk = max(1, min(budget, DEFAULT_TOPK))
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= MAX_TOPK:
        raise _err("topk", f"must be an int in [1, {MAX_TOPK}], got {topk!r}")
    K = min(topk, V)
    if active is not None:
        if not isinstance(active, torch.Tensor) or active.dtype != torch.bool or active.shape != (B,):
            raise _err("active", f"must be a bool tensor of shape ({B},)")
        if active.device != draft_logits.device:
            raise _err("active", f"must be on {draft_logits.device}, got {active.device}")
    if lse is not None:
        if not isinstance(lse, torch.Tensor) or lse.shape != (B, L):
            raise _err("lse", f"must be a tensor of shape ({B}, {L})")
    return B, L, V, budget, K


def _sanitize(x: torch.Tensor) -> torch.Tensor:
    """float32 logits with NaN / +inf -> -inf and -0.0 -> +0.0."""
    x = x.to(torch.float32)
    x = torch.where(x < math.inf, x, torch.full_like(x, -math.inf))
    return torch.where(x == 0, torch.zeros_like(x), x)


def unpack_ancestor_mask(mask: torch.Tensor, n: int) -> torch.Tensor:
    """int32 [B, n+1, W] bit rows -> bool [B, n+1, n+1] (row j, column i: i visible to j)."""
    B = mask.shape[0]
    i = torch.arange(n + 1, device=mask.device)
    words = mask.to(torch.int64)[:, :, i // 32]  # [B, n+1, n+1]
    return ((words >> (i % 32)) & 1).bool().reshape(B, n + 1, n + 1)


def _ancestor_rows(parents: list[int], n: int) -> torch.Tensor:
    W = (n + 1 + 31) // 32
    rows = [[0] * W for _ in range(n + 1)]
    rows[0][0] = 1
    for j in range(1, n + 1):
        rows[j] = list(rows[parents[j - 1]])
        rows[j][j // 32] |= 1 << (j % 32)
    out = torch.tensor(rows, dtype=torch.int64) if n + 1 else torch.zeros((0, W), dtype=torch.int64)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _spine_first(b, spine, tokens, parents, depths, scores):
    """Renumber request b's nodes in place: the spine's nodes (in depth order) become 1..s, every
    other node keeps its pop order after them (padding stays at the end). Parents still come
    before children, and siblings keep their rank order."""
    n = tokens.shape[1]
    on_spine = set(spine)
    order = spine + [j for j in range(1, n + 1) if j not in on_spine]  # old node index per new one
    new = {0: 0}
    new.update({old: i + 1 for i, old in enumerate(order)})
    cols = torch.tensor([j - 1 for j in order])
    tokens[b] = tokens[b, cols]
    depths[b] = depths[b, cols]
    scores[b] = scores[b, cols]
    parents[b] = torch.tensor([new[int(p)] for p in parents[b, cols]], dtype=parents.dtype)


def build_tree_ref(
    draft_logits: torch.Tensor,
    budget: int,
    topk: Optional[int] = None,
    *,
    active: Optional[torch.Tensor] = None,
    ancestor_mask: bool = True,
    lse: Optional[torch.Tensor] = None,
    spine_first: bool = False,
) -> DraftTree:
    """Reference DDTree builder; see the module docstring and ``build_tree``.

    ``lse`` [B, L] (float32) replaces the computed logsumexp: the kernel computes it with a
    different summation order, so passing the kernel's own ``lse`` makes the two bit-comparable.
    """
    B, L, V, n, K = check_build_args(draft_logits, budget, topk, active, lse)
    dev = draft_logits.device
    x = _sanitize(draft_logits.detach().cpu())
    if lse is None:
        lse_t = torch.logsumexp(x, dim=-1) if V else torch.full((B, L), -math.inf)
    else:
        lse_t = lse.detach().cpu().to(torch.float32)
    act = [True] * B if active is None else [bool(a) for a in active.detach().cpu()]

    Kc = min(K + 1, V)  # one rank past K for the `exact` certificate
    vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)  # ties: lower id first
    vals, ids = vals[..., :Kc], ids[..., :Kc]
    lp = torch.where((vals > -math.inf) & (lse_t[..., None] > -math.inf),
                     vals - lse_t[..., None], torch.full_like(vals, -math.inf))
    if Kc < K + 1:
        pad = K + 1 - Kc
        lp = torch.cat([lp, torch.full((B, L, pad), -math.inf)], dim=-1)
        ids = torch.cat([ids, torch.full((B, L, pad), -1, dtype=ids.dtype)], dim=-1)

    tokens = torch.full((B, n), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    parents = torch.zeros((B, n), dtype=torch.int32)
    depths = torch.ones((B, n), dtype=torch.int32)
    scores = torch.full((B, n), -math.inf, dtype=torch.float32)
    exact = torch.ones(B, dtype=torch.bool)
    W = (n + 1 + 31) // 32
    masks = torch.zeros((B, n + 1, W), dtype=torch.int32)
    lp_np = lp.numpy().astype(np.float32)
    ids_np = ids.numpy()
    out_lse = lse_t.clone()
    out_lp = lp[..., :K].clone()
    out_ids = ids[..., :K].to(torch.int32).clone()

    for b in range(B):
        if not act[b]:
            out_lse[b] = -math.inf
            out_lp[b] = -math.inf
            out_ids[b] = -1
            if ancestor_mask:
                masks[b] = _ancestor_rows([0] * n, n)
            continue
        table = lp_np[b]
        sig = [np.float32(0.0)]  # σ of emitted nodes; index 0 = root
        par_l: list[int] = []
        spine: list[int] = []  # the spine's nodes, depth 1 first (the chain of rank-0 nodes)
        heap = [(-float(table[0, 0]), 1, 0, 0)]
        while len(par_l) < n and heap:
            neg, d, r, p = heapq.heappop(heap)
            s = np.float32(-neg)
            if s == -np.inf:
                break
            j = len(par_l) + 1
            tokens[b, j - 1] = int(ids_np[b, d - 1, r])
            parents[b, j - 1] = p
            depths[b, j - 1] = d
            scores[b, j - 1] = float(s)
            par_l.append(p)
            sig.append(s)
            if r == 0 and p == (spine[-1] if spine else 0):
                spine.append(j)
            if r + 1 < K:
                heapq.heappush(heap, (-float(np.float32(sig[p] + table[d - 1, r + 1])), d, r + 1, p))
            if d < L:
                heapq.heappush(heap, (-float(np.float32(s + table[d, 0])), d + 1, 0, j))
        if K < n:
            tau = sig[-1] if len(par_l) == n else np.float32(-np.inf)
            P = np.float32(0.0)
            for d in range(L):
                lk = table[d, K]
                if not (lk == -np.inf or P == -np.inf or np.float32(P + lk) < tau):
                    exact[b] = False
                P = np.float32(P + table[d, 0])
        if spine_first:
            _spine_first(b, spine, tokens, parents, depths, scores)
        if ancestor_mask:
            masks[b] = _ancestor_rows([int(v) for v in parents[b]], n)

    return DraftTree(
        tokens=tokens.to(dev), parents=parents.to(dev), depths=depths.to(dev),
        scores=scores.to(dev), ancestor_mask=masks.to(dev) if ancestor_mask else None,
        exact=exact.to(dev), lse=out_lse.to(dev), topk_logprobs=out_lp.to(dev),
        topk_ids=out_ids.to(dev),
    )
