"""The DDTree tree builder: kernel (Triton interpreter) == heapq reference, bit for bit.

The kernel's logsumexp is computed in another summation order than torch's, so each exact
comparison hands the kernel's ``lse`` to the reference (``build_tree_ref(..., lse=...)``) and
separately checks that lse against torch.logsumexp. Sizes are small (the interpreter is slow);
``chunk`` is lowered in some cases so that a row spans several vocab chunks.
"""

from __future__ import annotations

import math

import pytest
import torch

from ddtree_patcher.kernels import (
    PLACEHOLDER_TOKEN_ID,
    build_tree,
    build_tree_ref,
    tree_verify,
    unpack_ancestor_mask,
)
from ddtree_patcher.kernels.build_tree import BuildTreeTuning, _build_tree_tuned

TUNING_FIELDS = set(BuildTreeTuning.__dataclass_fields__)

P = PLACEHOLDER_TOKEN_ID
NINF = -math.inf


@pytest.fixture(autouse=True, scope="module")
def _fast_interpreter_xor_sum():
    """Speed only: ``tl.topk``'s bitonic network reduces with ``xor_sum``, which Triton's
    interpreter runs as a Python loop over elements; numpy's xor reduction is the same
    function (xor is associative and commutative), so the kernel computes exactly the same."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    orig = interpreter.ReduceOps.apply_impl

    def apply_impl(self, input):
        if self.combine_fn == tl.standard._xor_combine:
            d = input[0].handle.data
            out = np.bitwise_xor.reduce(d, axis=self.axis, keepdims=self.keep_dims)
            return self.to_tensor(out, input[0].dtype)
        return orig(self, input)

    interpreter.ReduceOps.apply_impl = apply_impl
    yield
    interpreter.ReduceOps.apply_impl = orig


def _sanitized(x):
    x = x.float()
    return torch.where(x < math.inf, x, torch.full_like(x, NINF))


def _spine_len(par, tok):
    """Nodes 1..s that form the chain of first children from the root (node order)."""
    s = 0
    while s < len(par) and tok[s] != P and par[s] == s:
        s += 1
    return s


def _check_invariants(t, n, L, spine_first=False):
    """Tree properties that hold whatever the logits (docs/tree-builder.md rules 3 and 5: I1-I4, padding); in
    spine-first order I3 holds within the spine (nodes 1..s) and within the rest, and the spine
    is complete (node s has no child: its rank-0 child would be on the spine)."""
    B = t.tokens.shape[0]
    for b in range(B):
        tok, par, dep, sc = (v[b].tolist() for v in (t.tokens, t.parents, t.depths, t.scores))
        s = _spine_len(par, tok) if spine_first else 0
        if spine_first:
            assert s == 0 or all(p != s for p in par[s:]), (b, s)
        depth = [0]
        kids: dict[int, list[int]] = {}
        for j in range(1, n + 1):
            p = par[j - 1]
            assert 0 <= p < j, (b, j, p)  # I1
            if tok[j - 1] == P:  # padding: parent 0, depth 1, score -inf, and only at the end
                assert (p, dep[j - 1], sc[j - 1]) == (0, 1, NINF)
                assert all(v == P for v in tok[j - 1:])
                depth.append(1)
                continue
            assert dep[j - 1] == depth[p] + 1 <= L
            depth.append(dep[j - 1])
            assert tok[j - 1] not in kids.setdefault(p, [])  # I4: distinct siblings
            kids[p].append(tok[j - 1])
            if j > 1 and j != s + 1:
                assert sc[j - 1] <= sc[j - 2]  # I3: scores non-increasing
            if p:
                assert sc[j - 1] <= sc[p - 1]
    if t.ancestor_mask is not None:
        vis = unpack_ancestor_mask(t.ancestor_mask, n)
        for b in range(B):
            par = [0] + t.parents[b].tolist()
            for j in range(n + 1):
                path, k = {0, j}, j
                while k:
                    k = par[k]
                    path.add(k)
                assert set(torch.nonzero(vis[b, j]).flatten().tolist()) == path, (b, j)


def _build(x, n, k=None, **kw):
    """build_tree, or the tuned entry point when ``kw`` holds launch settings (BuildTreeTuning)."""
    tuning = {key: kw.pop(key) for key in list(kw) if key in TUNING_FIELDS}
    if tuning:
        return _build_tree_tuned(x, n, k, BuildTreeTuning(**tuning), **kw)
    return build_tree(x, n, k, **kw)


def _both(x, n, k=None, **kw):
    a = _build(x, n, k, **kw)
    ref_kw = {key: v for key, v in kw.items() if key in ("active", "ancestor_mask", "spine_first")}
    b = build_tree_ref(x, n, k, lse=a.lse, **ref_kw)
    for f in a._fields:
        va, vb = getattr(a, f), getattr(b, f)
        if va is None or vb is None:
            assert va is None and vb is None, f
            continue
        assert va.dtype == vb.dtype and va.shape == vb.shape, (f, va.dtype, vb.dtype, va.shape, vb.shape)
        assert torch.equal(va, vb), f"{f}\nkernel={va}\nref={vb}"
    lse_t = torch.logsumexp(_sanitized(x), dim=-1)
    act = kw.get("active")
    if act is not None:
        lse_t = torch.where(act[:, None], lse_t, torch.full_like(lse_t, NINF))
    torch.testing.assert_close(a.lse, lse_t, rtol=2e-6, atol=2e-6)
    L = x.shape[1]
    _check_invariants(a, n, L, kw.get("spine_first", False))
    return a


# ----------------------------------------------------------------------------
# Hand-written trees
# ----------------------------------------------------------------------------
def test_worked_example():
    """docs/tree-builder.md: q1 = [.6, .3, .1, 0], q2 = [.7, .2, .1, 0], budget 5, K = 3."""
    q = torch.tensor([[[0.6, 0.3, 0.1, 0.0], [0.7, 0.2, 0.1, 0.0]]])
    t = _both(q.log(), 5, 3)
    assert t.tokens.tolist() == [[0, 0, 1, 0, 1]]
    assert t.parents.tolist() == [[0, 1, 0, 3, 1]]
    assert t.depths.tolist() == [[1, 2, 1, 2, 2]]
    expect = [0.6, 0.42, 0.3, 0.21, 0.12]
    assert torch.allclose(t.scores.exp(), torch.tensor([expect]), rtol=1e-5)
    assert t.exact.tolist() == [True]  # rank 3 has probability 0
    vis = unpack_ancestor_mask(t.ancestor_mask, 5)[0].int().tolist()
    assert vis[4] == [1, 0, 0, 1, 1, 0]  # node 4 sees the root, node 3 and itself


def test_tie_order_sigma_depth_rank_parent():
    """Uniform q over 2 tokens: every tie is decided by depth, then rank, then parent."""
    t = _both(torch.zeros(1, 2, 2), 6, 2)
    assert t.tokens.tolist() == [[0, 1, 0, 0, 1, 1]]
    assert t.parents.tolist() == [[0, 0, 1, 2, 1, 2]]
    assert t.depths.tolist() == [[1, 1, 2, 2, 2, 2]]


def test_equal_logits_rank_by_lower_token_id():
    x = torch.tensor([[[1.0, 3.0, 3.0, -0.0, 0.0, 3.0]]])
    t = _both(x, 3, 6)
    assert t.tokens.tolist() == [[1, 2, 5]]
    assert t.topk_ids.tolist() == [[[1, 2, 5, 0, 3, 4]]]  # -0.0 ranks like +0.0


def test_chain_budget_reproduces_argmax():
    """budget == L with K = 1: the spine, token for token DFlash's per-position argmax."""
    g = torch.Generator().manual_seed(1)
    B, L, V = 3, 6, 97
    x = torch.randint(-3, 4, (B, L, V), generator=g).to(torch.bfloat16)  # many exact ties
    t = _both(x, L, 1, chunk=64)
    assert torch.equal(t.tokens, torch.argmax(x.float(), dim=-1).to(torch.int32))
    assert t.parents.tolist() == [list(range(L))] * B
    assert t.depths.tolist() == [list(range(1, L + 1))] * B


# ----------------------------------------------------------------------------
# Random logits, edge cases
# ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "B,L,V,n,k,dtype,chunk,kind",
    [
        (3, 5, 300, 40, None, torch.float32, None, "normal"),
        (2, 4, 300, 7, 3, torch.float32, 64, "normal"),
        (2, 5, 200, 33, 4, torch.bfloat16, 64, "ties"),  # ties; many candidates per chunk
        (2, 3, 128, 24, 8, torch.float16, 32, "peaked"),
        (1, 6, 61, 64, 16, torch.float32, 64, "normal"),  # B = 1, K = 16 (KP = 32)
        (2, 6, 100, 2, 4, torch.float32, None, "normal"),  # budget < L
        (2, 3, 50, 40, 2, torch.float32, None, "normal"),  # budget >= K*L: 14 nodes, then padding
        (2, 4, 3, 20, 8, torch.float32, None, "normal"),  # V < K
        (2, 4, 40, 30, 40, torch.bfloat16, None, "ties"),
        (2, 3, 600, 20, 4, torch.float32, 256, "const"),  # > CAPT - KP candidates: 3 batches  # K = budget + 10 > V: exact Lemma 1
    ],
)
def test_random_matches_reference(B, L, V, n, k, dtype, chunk, kind):
    g = torch.Generator().manual_seed(B * 1000 + L * 100 + V + n)
    if kind == "ties":
        x = torch.randint(-2, 3, (B, L, V), generator=g).float()
    elif kind == "const":
        x = torch.zeros(B, L, V)
        x[..., torch.randint(0, V, (5,), generator=g)] = 1.0
    elif kind == "peaked":
        x = torch.randn(B, L, V, generator=g)
        x[..., :3] += torch.tensor([6.0, 4.0, 3.5])
    else:
        x = 2.0 * torch.randn(B, L, V, generator=g)
    _both(x.to(dtype), n, k, chunk=chunk)


def _paths(t, b):
    """{token path from the root: (depth, score)} of request b's non-padding nodes."""
    par, tok = t.parents[b].tolist(), t.tokens[b].tolist()
    out = {}
    for j in range(1, len(par) + 1):
        if tok[j - 1] == P:
            continue
        path, k = [], j
        while k:
            path.append(tok[k - 1])
            k = par[k - 1]
        out[tuple(reversed(path))] = (int(t.depths[b, j - 1]), float(t.scores[b, j - 1]))
    return out


@pytest.mark.parametrize(
    "B,L,V,n,k,dtype,chunk,kind",
    [
        (3, 5, 300, 40, None, torch.float32, None, "peaked"),
        (2, 5, 200, 33, 4, torch.bfloat16, 64, "ties"),
        (2, 6, 100, 2, 4, torch.float32, None, "normal"),  # budget < L
        (2, 3, 50, 40, 2, torch.float32, None, "normal"),  # padding after 14 nodes
        (2, 4, 3, 20, 8, torch.float32, None, "normal"),  # V < K
    ],
)
def test_spine_first_matches_reference(B, L, V, n, k, dtype, chunk, kind):
    """spine_first=True: the same tree renumbered (the rank-0 chain from the root as nodes 1..s,
    the rest in pop order), kernel == reference, and the same nodes as the pop-order tree."""
    g = torch.Generator().manual_seed(B * 1000 + L * 100 + V + n + 5)
    if kind == "ties":
        x = torch.randint(-2, 3, (B, L, V), generator=g).float()
    else:
        x = 2.0 * torch.randn(B, L, V, generator=g)
        if kind == "peaked":  # a spine that is not popped first: siblings come between
            x[..., :2] += torch.tensor([3.0, 2.5])
    x = x.to(dtype)
    t = _both(x, n, k, chunk=chunk, spine_first=True)
    pop = build_tree_ref(x, n, k, lse=t.lse)
    for b in range(B):
        assert _paths(t, b) == _paths(pop, b)
        s = _spine_len(t.parents[b].tolist(), t.tokens[b].tolist())
        assert t.tokens[b, :s].tolist() == t.topk_ids[b, :s, 0].tolist()  # the per-depth argmax
    if kind == "peaked":  # the case is one where the order differs
        assert not torch.equal(t.parents, pop.parents)


def test_spine_first_worked_example():
    """The worked example's spine is popped first: both orders agree. Uniform q over 2 tokens:
    the spine (nodes 1 and 3 in pop order) becomes nodes 1, 2; pop node 2 becomes node 3."""
    q = torch.tensor([[[0.6, 0.3, 0.1, 0.0], [0.7, 0.2, 0.1, 0.0]]])
    t = _both(q.log(), 5, 3, spine_first=True)
    assert t.parents.tolist() == [[0, 1, 0, 3, 1]]
    t = _both(torch.zeros(1, 2, 2), 6, 2, spine_first=True)
    assert t.tokens.tolist() == [[0, 0, 1, 0, 1, 1]]
    assert t.parents.tolist() == [[0, 1, 0, 3, 1, 3]]  # pop order: [0, 0, 1, 2, 1, 2]
    assert t.depths.tolist() == [[1, 2, 1, 2, 2, 2]]
    vis = unpack_ancestor_mask(t.ancestor_mask, 6)[0].int().tolist()
    assert vis[6] == [1, 0, 0, 1, 0, 0, 1]  # node 6 sees the root, node 3 and itself
    # inactive rows stay all padding; 2 tree warps (the spine reductions across warps)
    x = torch.randn(3, 3, 40, generator=torch.Generator().manual_seed(4))
    t = _both(x, 10, 3, active=torch.tensor([True, False, True]), spine_first=True, tree_warps=2)
    assert t.tokens[1].tolist() == [P] * 10 and t.parents[1].tolist() == [0] * 10


@pytest.mark.parametrize("start", [32, 64])
@pytest.mark.parametrize(
    "B,L,V,n,k,kind,spine_first",
    [
        (2, 8, 120, 130, 8, "peaked", True),  # NP 256: the frontier at 32 or 64 slots, doubling
        (2, 6, 40, 70, None, "ties", False),  # ties across the widening
        (3, 6, 100, 2, 4, "normal", True),  # budget < the first width: one phase does everything
    ],
)
def test_frontier_start_matches_reference(B, L, V, n, k, kind, spine_first, start):
    """The pops starting on a narrow frontier that doubles as the nodes need (frontier_start <
    the budget's width) build the same trees bit for bit, with inactive rows and ancestor rows."""
    g = torch.Generator().manual_seed(B * 1000 + L * 100 + V + n)
    if kind == "ties":
        x = torch.randint(-2, 3, (B, L, V), generator=g).float()
    else:
        x = 2.0 * torch.randn(B, L, V, generator=g)
        if kind == "peaked":
            x[..., :2] += torch.tensor([3.0, 2.5])
    active = torch.ones(B, dtype=torch.bool)
    active[-1] = False
    _both(x, n, k, active=active, spine_first=spine_first, frontier_start=start)


def test_neg_inf_nan_and_pos_inf_policy():
    """-inf entries are never drafted; NaN and +inf count as -inf; an all -inf row ends the
    branch (nothing deeper), an all -inf first row gives an all-padding tree."""
    g = torch.Generator().manual_seed(7)
    B, L, V = 4, 4, 64
    x = torch.randn(B, L, V, generator=g)
    x[..., 10] += 5.0  # a strong spine, so the tree is deep
    x[0, :, V // 2:] = NINF  # half the vocab masked
    x[1, 2] = NINF  # depth 3 impossible: tree holds depths 1-2 only
    x[2, 0] = NINF  # no tree at all
    x[3, 1, :5] = float("nan")
    x[3, 2, 7] = math.inf
    x[3, 3, :] = float("nan")
    t = _both(x, 40, 6, chunk=32)
    tok = t.tokens
    assert bool((tok[0][tok[0] >= 0] < V // 2).all())
    assert int(t.depths[1][tok[1] >= 0].max()) == 2 and bool((tok[1] >= 0).any())
    assert tok[2].tolist() == [P] * 40 and bool(torch.isinf(t.lse[2, 0]))
    assert int(t.depths[3][tok[3] >= 0].max()) == 3
    d2 = tok[3][(t.depths[3] == 2) & (tok[3] >= 0)]
    assert not bool(((d2 >= 0) & (d2 < 5)).any())  # NaN entries never drafted
    d3 = tok[3][(t.depths[3] == 3) & (tok[3] >= 0)]
    assert 7 not in d3.tolist()  # +inf counts as -inf


def test_inactive_requests_get_padding_and_strided_input():
    g = torch.Generator().manual_seed(3)
    big = torch.randn(4, 7, 90, generator=g).to(torch.bfloat16)
    x = big[:, 1:5]  # [4, 4, 90], strided over B
    active = torch.tensor([True, False, True, False])
    t = _both(x, 12, 3, active=active, chunk=64, mask_block=4)  # 4 blocks of ancestor rows
    assert t.tokens[1].tolist() == [P] * 12 and t.parents[1].tolist() == [0] * 12
    assert t.depths[3].tolist() == [1] * 12 and bool(torch.isinf(t.scores[3]).all())
    assert t.exact[1] and bool((t.topk_ids[1] == -1).all())
    active_all = _build(x, 12, 3, chunk=64)
    for f in ("tokens", "parents", "depths", "scores"):
        assert torch.equal(getattr(t, f)[::2], getattr(active_all, f)[::2])


def test_no_ancestor_mask_and_empty_budget():
    x = torch.randn(2, 3, 20)
    t = _both(x, 5, 2, ancestor_mask=False)
    assert t.ancestor_mask is None
    t0 = _both(x, 0)
    assert t0.tokens.shape == (2, 0) and t0.ancestor_mask.tolist() == [[[1]], [[1]]]


def test_exact_certificate():
    """`exact` True => the K-capped tree equals the tree with K = budget (Algorithm 1)."""
    g = torch.Generator().manual_seed(11)
    B, L, V, n = 16, 4, 64, 8
    x = torch.randn(B, L, V, generator=g) * torch.linspace(0.5, 6.0, B)[:, None, None]
    capped = build_tree_ref(x, n, 3)
    full = build_tree_ref(x, n, n)
    assert bool(full.exact.all())
    flags = capped.exact.tolist()
    assert any(flags) and not all(flags), flags
    for b, ok in enumerate(flags):
        same = torch.equal(capped.tokens[b], full.tokens[b]) and torch.equal(capped.parents[b], full.parents[b])
        if ok:
            assert same, b
    _both(x[:4], n, 3)  # the kernel computes the same flags


@pytest.mark.parametrize("preload", [1024, 0])
def test_segment_of_several_tiles_nan_redo_and_merge(preload):
    """A segment of several 4096-entry tiles (the in-flight prefetch and the masked tail), a NaN
    in one row (the segment is read again sanitised) and the top-K spread over tiles, rows split
    into two segments (the last one merges); the tree kernel with and without its table
    preload."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(1, 3, 2 * 4096 + 8200, generator=g).to(torch.bfloat16)
    x[0, 0, 5] = 7.0
    x[0, 0, 4096 + 5] = 7.0  # equal value, same slot, later tile
    x[0, 0, 3 * 4096 + 11] = 8.0
    x[0, 1, 9000] = float("nan")
    x[0, 2, :100] = float("-inf")
    t = _both(x, 12, 8, chunk=16384, tree_preload_max=preload)
    assert t.topk_ids[0, 0, :3].tolist() == [3 * 4096 + 11, 5, 4096 + 5]


def test_scratch_reused_across_calls():
    """The first stage's scratch is made once per shape and reused (_seg_scratch): consecutive
    builds of one shape with other logits are still exact, the rows' tickets are zero again after
    each launch (rows split into segments), and another shape gets its own scratch."""
    import importlib

    mod = importlib.import_module("ddtree_patcher.kernels.build_tree")
    g = torch.Generator().manual_seed(29)
    shape = (2, 3, 200)
    before = set(mod._SCRATCH)
    for _ in range(3):
        _both(torch.randn(*shape, generator=g), 10, 4, chunk=64)  # 4 segments per row
    new = [k for k in mod._SCRATCH if k not in before]
    assert len(new) == 1, new
    scratch = mod._SCRATCH[new[0]]
    assert scratch[4] is not scratch[3] and not scratch[4].any()  # the tickets, zero again
    _both(torch.randn(1, 3, 200, generator=g), 10, 4, chunk=64)
    assert len([k for k in mod._SCRATCH if k not in before]) == 2
    assert mod._SCRATCH[new[0]] is scratch


def test_full_vocab_row():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 2, 151936, generator=g).to(torch.bfloat16)
    x[0, 0, 151935] = 9.0  # the very last id, in the last (partial) chunk
    t = _both(x, 16)
    assert t.tokens[0, 0].item() == 151935


def test_tree_feeds_tree_verify():
    """The builder's output is tree_verify's input as is (tokens, parents in node order)."""
    g = torch.Generator().manual_seed(9)
    B, L, V, n = 2, 4, 50, 10
    x = torch.randn(B, L, V, generator=g)
    t = build_tree(x, n, 3)
    draft = t.tokens.reshape(-1)
    par = t.parents.reshape(-1)
    cu = torch.arange(1, B + 1, dtype=torch.int32) * n
    # the target agrees with the spine: argmax at the root and at each spine node
    am = torch.zeros(B * (n + 1), dtype=torch.int32)
    expect = []
    for b in range(B):
        cur, steps = 0, 0
        while True:  # children come in rank order (I2): the first one is the spine
            kids = [j for j in range(1, n + 1) if t.parents[b, j - 1] == cur and t.tokens[b, j - 1] >= 0]
            if not kids:
                break
            am[b * (n + 1) + cur] = t.tokens[b, kids[0] - 1]
            cur, steps = kids[0], steps + 1
        expect.append(steps)
    out, acc, rows = tree_verify(draft, par, cu, target_argmax=am, width=n + 1, max_num_nodes=n)
    assert acc.tolist() == expect and min(expect) >= 1


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: build_tree(torch.zeros(2, 8), 4), "draft_logits"),
        (lambda: build_tree(torch.zeros(1, 2, 8, dtype=torch.int32), 4), "draft_logits"),
        (lambda: build_tree(torch.zeros(1, 2, 8).transpose(1, 2), 4), "draft_logits"),
        (lambda: build_tree(torch.zeros(1, 64, 8), 4), "draft_logits"),
        (lambda: build_tree(torch.zeros(1, 2, 8), -1), "budget"),
        (lambda: build_tree(torch.zeros(1, 2, 8), 4, 0), "topk"),
        (lambda: build_tree(torch.zeros(1, 2, 8), 4, active=torch.ones(2, dtype=torch.bool)), "active"),
        (lambda: _build(torch.zeros(1, 2, 8), 4, chunk=24), "chunk"),
        (lambda: _build(torch.zeros(1, 2, 8), 4, chunk_warps=3), "chunk_warps"),
        (lambda: _build(torch.zeros(1, 2, 8), 4, frontier_start=48), "frontier_start"),
        (lambda: _build(torch.zeros(1, 2, 8), 4, mask_block=3), "mask_block"),
        (lambda: build_tree_ref(torch.zeros(1, 2, 8), 4, lse=torch.zeros(2)), "lse"),
    ],
)
def test_named_errors(call, match):
    with pytest.raises(ValueError, match=f"`{match}`"):
        call()


def test_benchmark_script_smoke(tmp_path):
    """benchmarks/bench_build_tree.py --smoke: the GPU script's code paths, tiny, on the CPU."""
    import os
    import pathlib
    import subprocess
    import sys

    repo = pathlib.Path(__file__).resolve().parents[2]
    out = tmp_path / "bench.json"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_build_tree.py"), "--smoke",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "CHECKS PASSED" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    import json

    res = json.loads(out.read_text())
    assert res["rows"] and res["sweep"] and all("error" not in row for row in res["rows"] + res["sweep"])


def test_public_signatures_carry_production_arguments_only():
    """build_tree / draft_topk / tree_stage take what production passes; launch settings go
    through BuildTreeTuning (issue 37). PRODUCTION is the tuned default set."""
    import importlib
    import inspect

    BT = importlib.import_module("ddtree_patcher.kernels.build_tree")
    for fn in (BT.build_tree, BT.draft_topk, BT.tree_stage, build_tree_ref):
        names = set(inspect.signature(fn).parameters)
        assert not names & TUNING_FIELDS, (fn.__name__, names & TUNING_FIELDS)
    assert BT.PRODUCTION == BuildTreeTuning()
    for name in ("SEG_TILE", "SEG_MAXNREG", "SEG_CTAS_PER_SM", "TREE_PRELOAD_MAX", "SEG_STAGES", "FRONTIER_START"):
        assert not hasattr(BT, name), name
