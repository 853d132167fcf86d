"""Random tree-step cases for the tree attention / compaction tests and the benchmark smoke:
random trees (parents before children), paged KV caches in every layout of the integration map
with shuffled block tables, queries with padding rows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from ddtree_patcher.kernels import kv_views
from ddtree_patcher.kernels.tree_step_reference import pack_mask

# layout name -> (physical cache shape builder, which kv_views layout reads it)
LAYOUTS = ("fa-2nbbshd", "fa-nb2bshd", "fa-nbhbs2d", "cpu-2nbhbsd", "cpu-nbhbs2d")


def make_cache(layout: str, nb: int, bs: int, H: int, D: int, dtype, gen) -> torch.Tensor:
    """One layer's cache tensor as the release allocates it (memory order included)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)
    if layout == "fa-2nbbshd":
        return rnd(2, nb, bs, H, D)
    if layout == "fa-nb2bshd":
        return rnd(nb, 2, bs, H, D)
    if layout == "fa-nbhbs2d":  # logical (nb, H, bs, 2D), stored (nb, bs, H, 2D)
        return rnd(nb, bs, H, 2 * D).transpose(1, 2)
    if layout == "cpu-2nbhbsd":
        return rnd(2, nb, H, bs, D)
    if layout == "cpu-nbhbs2d":
        return rnd(nb, H, bs, 2 * D)
    raise ValueError(layout)


def random_parents(n: int, gen, chain: bool = False) -> List[int]:
    if chain:
        return [j - 1 for j in range(1, n + 1)]
    return [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n + 1)]


def ancestor_dense(parents: List[int], W: int) -> torch.Tensor:
    n = len(parents)
    m = torch.zeros(W, W, dtype=torch.bool)
    m[0, 0] = True
    for j in range(1, n + 1):
        m[j] = m[parents[j - 1]]
        m[j, j] = True
    for j in range(n + 1, W):  # unused rows: just themselves (like padding nodes)
        m[j, 0] = m[j, j] = True
    return m


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    ancestor_mask: torch.Tensor
    parents: List[List[int]]
    scale: float
    slot_mapping: torch.Tensor


def make_case(ctx: List[int], n: List[int], *, Hq=4, Hkv=2, D=32, bs=16, dtype=torch.float32,
              layout="fa-nbhbs2d", seed=0, chain=False, W: Optional[int] = None, pad_rows=3,
              extra_blocks=3) -> Case:
    gen = torch.Generator().manual_seed(seed)
    B = len(ctx)
    W = W or max(n) + 1
    qlen = [x + 1 if x >= 0 else 0 for x in n]  # n = -1: a request with no rows this step
    blocks_per = [math.ceil((c + ql) / bs) for c, ql in zip(ctx, qlen)]
    max_blocks = max(max(blocks_per), 1) + 1
    nb = sum(blocks_per) + extra_blocks
    perm = torch.randperm(nb, generator=gen).to(torch.int32)
    block_table = torch.randint(0, nb, (B, max_blocks), generator=gen, dtype=torch.int32)
    used = 0
    for r in range(B):
        block_table[r, :blocks_per[r]] = perm[used:used + blocks_per[r]]
        used += blocks_per[r]
    qsl = [0]
    for ql in qlen:
        qsl.append(qsl[-1] + ql)
    T = qsl[-1] + pad_rows
    slots = torch.full((T,), -1, dtype=torch.int64)
    for r in range(B):
        for j in range(qlen[r]):
            p = ctx[r] + j
            slots[qsl[r] + j] = int(block_table[r, p // bs]) * bs + p % bs
    q = torch.randn(T, Hq, D, generator=gen, dtype=torch.float32).to(dtype)
    cache = make_cache(layout, nb, bs, Hkv, D, dtype, gen)
    k, v = kv_views(cache, layout, D)
    parents = [random_parents(max(x, 0), gen, chain) for x in n]
    dense = torch.stack([ancestor_dense(p, W) for p in parents])
    return Case(q=q, k=k, v=v, cache=cache, block_table=block_table,
                query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                context_lens=torch.tensor(ctx, dtype=torch.int32),
                ancestor_mask=pack_mask(dense, W), parents=parents, scale=D ** -0.5,
                slot_mapping=slots)


def depth_of(parents: List[int]) -> List[int]:
    dep = [0]
    for p in parents:
        dep.append(dep[p] + 1)
    return dep


def random_walk(parents: List[int], gen, width: int) -> List[int]:
    """A random accepted path from the root: local node indices [0, j_1, ..., j_a]."""
    children = {}
    for j, p in enumerate(parents, start=1):
        children.setdefault(p, []).append(j)
    path = [0]
    while len(path) < width and children.get(path[-1]):
        if float(torch.rand(1, generator=gen)) < 0.15:
            break
        ch = children[path[-1]]
        path.append(ch[int(torch.randint(0, len(ch), (1,), generator=gen))])
    return path
