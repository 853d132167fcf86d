"""Tree attention (Triton interpreter) == a dense float64 reference with an explicit
``[q_len, ctx + q_len]`` mask per request (``tree_attention_ref``), on random trees and contexts,
paged KV in several block sizes and layouts, GQA; a chain-shaped tree == causal attention (what
vLLM's chain step computes); the merge with an emulated FlashAttention context pass, in place.
"""

from __future__ import annotations

import math

import pytest
import torch

from _tree_step_cases import make_case
from ddtree_patcher.kernels import (
    causal_attention_ref,
    context_attention_ref,
    merge_attention_states,
    tree_attention,
    tree_attention_merge,
    tree_attention_ref,
)
from ddtree_patcher.kernels.tree_attention import (
    TreeAttentionError,
    TreeAttentionTuning,
    _tree_attention_merge_tuned,
    _tree_attention_tuned,
)

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _args(c):
    return (c.q, c.k, c.v, c.block_table, c.query_start_loc, c.context_lens, c.ancestor_mask,
            c.scale)


def _tuned(*args, block_n=64, block_t=None, **kw):
    """tree_attention with smaller tiles (several context / tree tiles on small cases)."""
    return _tree_attention_tuned(*args, TreeAttentionTuning(block_n=block_n, block_t=block_t), **kw)


def _close(got, ref, c, dtype, lse=None, rlse=None, rows=None):
    T = int(c.query_start_loc[-1])
    rows = slice(0, T) if rows is None else rows
    err = (got[rows].float() - ref[rows]).abs().max().item()
    assert err <= TOL[dtype], f"max abs err {err}"
    if lse is not None:
        lerr = (lse[:, rows] - rlse[:, rows]).abs().max().item()
        assert lerr <= (1e-4 if dtype == torch.float32 else 1e-2), f"lse err {lerr}"


# (contexts, nodes per request, Hq, Hkv, D, block size, dtype, layout)
CASES = [
    ([5, 37, 0, 20], [6, 3, 4, 0], 4, 2, 32, 4, torch.float32, "fa-nbhbs2d"),
    ([70, 1, 16], [12, 12, 7], 8, 2, 16, 16, torch.float32, "fa-nb2bshd"),
    ([33, 9], [5, 9], 2, 2, 64, 5, torch.float32, "cpu-nbhbs2d"),
    ([40, 3, 64], [10, 2, 15], 4, 1, 32, 16, torch.bfloat16, "fa-nbhbs2d"),
    ([19, 0], [8, 3], 6, 3, 48, 8, torch.float16, "fa-2nbbshd"),
    ([25, 12], [4, 6], 4, 2, 16, 32, torch.float32, "cpu-2nbhbsd"),
]


@pytest.mark.parametrize("ctx,n,Hq,Hkv,D,bs,dtype,layout", CASES)
def test_tree_attention_matches_dense_reference(ctx, n, Hq, Hkv, D, bs, dtype, layout):
    c = make_case(ctx, n, Hq=Hq, Hkv=Hkv, D=D, bs=bs, dtype=dtype, layout=layout, seed=len(ctx) + bs)
    ref, rlse = tree_attention_ref(*_args(c))
    out, lse = _tuned(*_args(c), return_lse=True, block_n=16)
    _close(out, ref, c, dtype, lse, rlse)


@pytest.mark.parametrize("ctx,n,Hq,Hkv,D,bs,dtype,layout", CASES[:4])
def test_tree_pass_merged_with_context_pass(ctx, n, Hq, Hkv, D, bs, dtype, layout):
    """FlashAttention's context pass (emulated: non-causal over ``seqused_k = context_lens``,
    lse; NaN rows where the context is empty) + ``tree_attention_merge`` writing in place."""
    c = make_case(ctx, n, Hq=Hq, Hkv=Hkv, D=D, bs=bs, dtype=dtype, layout=layout, seed=7)
    ref, rlse = tree_attention_ref(*_args(c))
    ctx_out, ctx_lse = context_attention_ref(*_args(c)[:6], c.scale)
    out, lse = tree_attention_merge(*_args(c), ctx_out, ctx_lse, out=ctx_out, lse=ctx_lse,
                                    return_lse=True)
    assert out is ctx_out and lse is ctx_lse
    _close(out, ref, c, dtype, lse, rlse)


@pytest.mark.parametrize("ctx,n,Hq,Hkv,D,bs,dtype,layout", CASES[:5])
def test_context_and_tree_passes_merged_by_lse(ctx, n, Hq, Hkv, D, bs, dtype, layout):
    """The two-pass form (the tree pass alone, which does not wait for the context pass, then
    ``merge_attention_states``) == the dense reference; rows of a masked-off request and rows
    past the last request keep what ``out`` held; an empty context's NaN rows are never read."""
    c = make_case(ctx, n, Hq=Hq, Hkv=Hkv, D=D, bs=bs, dtype=dtype, layout=layout, seed=9)
    ref, _ = tree_attention_ref(*_args(c))
    ctx_out, ctx_lse = context_attention_ref(*_args(c)[:6], c.scale)
    t_out, t_lse = tree_attention_merge(*_args(c), None, None, return_lse=True)
    W = c.ancestor_mask.shape[1]
    out = torch.full_like(c.q, 123.0)
    merge_attention_states(ctx_out, ctx_lse, t_out, t_lse, c.query_start_loc, c.context_lens, out=out, width=W)
    _close(out, ref, c, dtype)
    B = len(ctx)
    keep = torch.tensor([r % 2 == 0 for r in range(B)])
    out2 = torch.full_like(c.q, 123.0)
    merge_attention_states(ctx_out, ctx_lse, t_out, t_lse, c.query_start_loc, c.context_lens, out=out2, width=W,
                           request_mask=keep, num_reqs=B)
    qsl = c.query_start_loc.tolist()
    for r in range(B):
        rows = slice(qsl[r], qsl[r + 1])
        if keep[r]:
            _close(out2, ref, c, dtype, rows=rows)
        else:
            assert bool((out2[rows] == 123.0).all())


# the tree pass's two kernels (one key tile / key tiles in a loop) and the folded last M tile:
# W * G = 17 * 4 = 68 rows leave a 4-row last tile at BLOCK_M 64 (n = 16 and 64 have this shape)
@pytest.mark.parametrize("one_tile,fold_tail,block_m", [(True, False, 64), (True, True, 64), (True, True, 16),
                                                        (False, None, None), (True, None, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_pass_kernels_and_folded_last_tile(one_tile, fold_tail, block_m, dtype):
    c = make_case([21, 0, 9], [16, 16, 11], Hq=4, Hkv=1, D=16, bs=8, dtype=dtype, seed=21)
    ref, rlse = tree_attention_ref(*_args(c))
    tuning = TreeAttentionTuning(one_tile=one_tile, fold_tail=fold_tail, block_m=block_m)
    ctx_out, ctx_lse = context_attention_ref(*_args(c)[:6], c.scale)
    keep = torch.tensor([True, True, False])
    out = ctx_out.clone()
    out[int(c.query_start_loc[2]):] = 123.0
    _tree_attention_merge_tuned(*_args(c), ctx_out, ctx_lse, tuning, out=out, request_mask=keep)
    qsl = c.query_start_loc.tolist()
    _close(out, ref, c, dtype, rows=slice(0, qsl[2]))
    assert bool((out[qsl[2]:] == 123.0).all())  # a masked-off request's rows are left as they were
    t_out, t_lse = _tree_attention_merge_tuned(*_args(c), None, None, tuning, return_lse=True)  # tree keys only
    c0 = make_case([0, 0, 0], [16, 16, 11], Hq=4, Hkv=1, D=16, bs=8, dtype=dtype, seed=21)
    ref0, rlse0 = tree_attention_ref(*_args(c0))
    t0, l0 = _tree_attention_merge_tuned(*_args(c0), None, None, tuning, return_lse=True)
    _close(t0, ref0, c0, dtype, l0, rlse0)
    out2 = torch.empty_like(c.q)
    merge_attention_states(ctx_out, ctx_lse, t_out, t_lse, c.query_start_loc, c.context_lens, out=out2,
                           width=c.ancestor_mask.shape[1])
    _close(out2, ref, c, dtype)


def test_tile_plan_follows_the_measured_rule():
    """_tile_plan (Qwen3-8B shape: 8 KV heads, G = 4; 132 SMs): one key tile up to W = 64, and up
    to W = 128 on a grid of at most a third of the SMs when merged with the context state; BLOCK_M 32
    there; the last M tile of W = 17 (4 rows) folded only when the grid exceeds two waves."""
    from ddtree_patcher.kernels.tree_attention import _tile_plan
    plan = lambda B, W: _tile_plan(B, 8, W, 4, 132, None, None, None)  # noqa: E731
    assert plan(1, 17) == (True, 32, 3)
    assert plan(8, 17) == (True, 64, 2)
    assert plan(32, 17) == (True, 64, 1)  # 512 programs unfolded: the 4-row tile joins the first
    assert plan(32, 64) == (True, 64, 4)
    assert plan(1, 65) == (True, 32, 9)
    assert _tile_plan(1, 8, 65, 4, 132, None, None, None, False) == (False, 64, 5)  # the tree pass alone
    assert plan(8, 65) == (False, 64, 5)  # 65 keys: tiles of 32 in a loop
    assert plan(1, 257) == (False, 64, 17)
    assert _tile_plan(1, 8, 65, 4, 132, None, True, None)[0]  # forced
    assert not _tile_plan(1, 8, 200, 4, 132, None, True, None)[0]  # never past 128 keys


def test_tree_pass_alone_is_attention_over_the_tree():
    c = make_case([0, 0], [9, 5], seed=3)  # no context: the tree keys are all there is
    ref, rlse = tree_attention_ref(*_args(c))
    out, lse = tree_attention_merge(*_args(c), None, None, return_lse=True)
    _close(out, ref, c, torch.float32, lse, rlse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_shaped_tree_equals_causal_attention(dtype):
    c = make_case([23, 0, 41], [7, 4, 15], Hq=4, Hkv=2, D=32, bs=16, dtype=dtype, chain=True, seed=5)
    causal = causal_attention_ref(*_args(c)[:6], c.scale)
    ref, _ = tree_attention_ref(*_args(c))
    T = int(c.query_start_loc[-1])
    assert (ref[:T] - causal[:T]).abs().max().item() < 1e-6  # the mask of a chain is causal
    _close(_tuned(*_args(c), block_n=32), causal, c, dtype)
    ctx_out, ctx_lse = context_attention_ref(*_args(c)[:6], c.scale)
    _close(tree_attention_merge(*_args(c), ctx_out, ctx_lse, out=ctx_out), causal, c, dtype)


def test_wide_tree_multiword_mask_and_siblings_invisible():
    """W > 32 (two mask words per row) and a star tree: a node must not see its siblings."""
    c = make_case([30, 8], [40, 45], Hq=2, Hkv=1, D=16, bs=16, seed=11)
    ref, rlse = tree_attention_ref(*_args(c))
    out, lse = _tuned(*_args(c), return_lse=True, block_n=32, block_t=16)
    _close(out, ref, c, torch.float32, lse, rlse)
    # a star (every node a child of the root): row j == attention over context + root + j
    star = make_case([12], [20], Hq=2, Hkv=1, D=16, bs=4, seed=12)
    star.ancestor_mask.zero_()
    for j in range(21):
        star.ancestor_mask[0, j, 0] = 1 | (1 << j) if j < 31 else 1
    ref, _ = tree_attention_ref(*_args(star))
    _close(tree_attention(*_args(star)), ref, star, torch.float32)


def test_request_mask_and_padding_rows_untouched():
    c = make_case([10, 20, 5], [4, 6, 3], seed=13)
    sentinel = torch.full_like(c.q, 123.0)
    out = sentinel.clone()
    keep = torch.tensor([True, False, True])
    tree_attention(*_args(c), out=out, request_mask=keep)
    ref, _ = tree_attention_ref(*_args(c))
    qsl = c.query_start_loc.tolist()
    _close(out, ref, c, torch.float32, rows=slice(qsl[0], qsl[1]))
    _close(out, ref, c, torch.float32, rows=slice(qsl[2], qsl[3]))
    assert torch.equal(out[qsl[1]:qsl[2]], sentinel[qsl[1]:qsl[2]])  # masked-out request
    assert torch.equal(out[qsl[3]:], sentinel[qsl[3]:])  # padding rows past the last request


def test_num_reqs_and_oversized_buffers():
    """VerifyStep-style buffers sized for max_num_reqs: only the first num_reqs requests count."""
    c = make_case([9, 14], [5, 3], seed=17)
    big_mask = torch.cat([c.ancestor_mask, torch.full((3,) + c.ancestor_mask.shape[1:], -1,
                                                      dtype=torch.int32)])
    big_ctx = torch.cat([c.context_lens, torch.tensor([99, 99, 99], dtype=torch.int32)])
    big_qsl = torch.cat([c.query_start_loc, c.query_start_loc[-1:].repeat(3)])
    ref, _ = tree_attention_ref(*_args(c))
    out = tree_attention(c.q, c.k, c.v, c.block_table, big_qsl, big_ctx, big_mask, c.scale,
                         num_reqs=2)
    _close(out, ref, c, torch.float32)


def test_named_errors():
    c = make_case([4], [2], seed=1)
    with pytest.raises(TreeAttentionError, match="k_cache"):
        tree_attention(c.q, c.k.to(torch.float16), c.v, *_args(c)[3:])
    with pytest.raises(TreeAttentionError, match="num_kv_heads"):
        tree_attention(c.q[:, :3], c.k, c.v, *_args(c)[3:])
    with pytest.raises(TreeAttentionError, match="ancestor_mask"):
        tree_attention(*_args(c)[:6], c.ancestor_mask.long(), c.scale)
    with pytest.raises(TreeAttentionError, match="ctx_lse"):
        tree_attention_merge(*_args(c), c.q, torch.zeros(4, 1))


# ---- ancestor_rows: the tree step's bit rows from parent links, one launch ------------------------
@pytest.mark.parametrize("W", [1, 2, 17, 33, 65])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_ancestor_rows_equal_the_reference_and_the_builders_rows(W, dtype):
    """Random trees (parents before children), padding and rows without a tree (-1 links) ==
    ``ancestor_rows_ref``; the rows of a built DraftTree equal its own ``ancestor_mask``."""
    import random

    from ddtree_patcher.kernels import ancestor_rows, ancestor_rows_ref, build_tree_ref

    rng = random.Random(W)
    par = torch.full((4, W), -1, dtype=dtype)
    for b in range(3):
        for j in range(1, rng.randint(0, W - 1) + 1):
            par[b, j] = rng.randint(0, j - 1)
    m, d = ancestor_rows(par)
    mr, dr = ancestor_rows_ref(par)
    assert torch.equal(m, mr) and torch.equal(d, dr)
    assert torch.equal(d[3], torch.zeros(W, dtype=torch.int32))  # no tree: every node its own root
    if W > 1:  # a DraftTree's ancestor_mask is the same function of its parents
        logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(W))
        tree = build_tree_ref(logits, W - 1, 4)
        p = torch.cat([torch.full((2, 1), -1, dtype=torch.int64), tree.parents.to(torch.int64)], 1)
        p[:, 1:][tree.tokens < 0] = -1  # padding nodes: roots of their own
        m2, _ = ancestor_rows(p)
        pad = (tree.tokens < 0)
        ref = tree.ancestor_mask.clone()
        assert torch.equal(m2[:, 1:][~pad], ref[:, 1:][~pad]) and torch.equal(m2[:, 0], ref[:, 0])


def test_ancestor_rows_named_errors():
    from ddtree_patcher.kernels import ancestor_rows

    with pytest.raises(TreeAttentionError, match="parents"):
        ancestor_rows(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TreeAttentionError, match="out"):
        ancestor_rows(torch.zeros(2, 5, dtype=torch.int32), out=torch.zeros(2, 5, 2, dtype=torch.int32))


def test_public_signatures_carry_production_arguments_only():
    """tree_attention / tree_attention_merge take what production passes; launch settings go
    through TreeAttentionTuning (issue 37)."""
    import inspect

    tuning = set(TreeAttentionTuning.__dataclass_fields__)
    for fn in (tree_attention, tree_attention_merge):
        assert not set(inspect.signature(fn).parameters) & tuning, fn.__name__
