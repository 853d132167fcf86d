"""Kernel (Triton interpreter) == reference on hand-written and random trees."""

from __future__ import annotations

import pytest
import torch
from _trees import SHAPES, make_argmax, make_batch, make_probs

from ddtree_patcher.kernels import PLACEHOLDER_TOKEN_ID, tree_verify, tree_verify_ref

P = PLACEHOLDER_TOKEN_ID


def _eq(a, b):
    for x, y, name in zip(a, b, ("output_token_ids", "num_accepted", "accepted_rows")):
        assert x.dtype == y.dtype == torch.int32, name
        assert torch.equal(x, y), f"{name}\nkernel={x}\nref={y}"


def _both(*args, **kw):
    a = tree_verify(*args, **kw)
    b = tree_verify_ref(*args, **kw)
    _eq(a, b)
    return a


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


# ----------------------------------------------------------------------------
# Hand-written greedy cases
# ----------------------------------------------------------------------------
CAT, SAT, DOG = 11, 12, 13


def _catdog():
    return _i32([CAT, SAT, DOG, SAT]), _i32([0, 1, 0, 3]), _i32([4])


def test_catdog_example_from_spec():
    """docs/kernel.md worked example: argmax dog@root, sat@dog; node 4 is a leaf -> [dog, sat, am(4)]."""
    tok, par, cu = _catdog()
    am = _i32([DOG, 5, 5, SAT, 7])
    out, acc, rows = _both(tok, par, cu, target_argmax=am, width=5)
    assert out.tolist() == [[DOG, SAT, 7, P, P]]
    assert acc.tolist() == [2]
    assert rows.tolist() == [[0, 3, 4, P, P]]


def test_default_width_is_max_nodes_plus_one():
    tok, par, cu = _catdog()
    out, _, rows = _both(tok, par, cu, target_argmax=_i32([CAT, SAT, 9, 9, 9]))
    assert out.shape == (1, 5) and out.tolist() == [[CAT, SAT, 9, P, P]]
    assert rows.tolist() == [[0, 1, 2, P, P]]


def test_empty_tree_and_root_mismatch():
    tok = _i32([CAT])
    par = _i32([0])
    cu = _i32([0, 1, 1])  # request 0: n=0, request 1: n=1, request 2: n=0
    am = _i32([3, DOG, 4, 8])  # rows: r0 root=0; r1 root=1, node=2; r2 root=3
    out, acc, rows = _both(tok, par, cu, target_argmax=am, width=3)
    assert out.tolist() == [[3, P, P], [DOG, P, P], [8, P, P]]
    assert acc.tolist() == [0, 0, 0]
    assert rows.tolist() == [[0, P, P], [1, P, P], [3, P, P]]


def test_depth_cap_treats_deeper_nodes_as_leaves():
    tok = _i32([1, 2, 3, 4])
    par = _i32([0, 1, 2, 3])  # chain of 4
    am = _i32([1, 2, 3, 4, 5])
    out, acc, rows = _both(tok, par, _i32([4]), target_argmax=am, width=3)
    assert out.tolist() == [[1, 2, 3]] and acc.tolist() == [2]
    assert rows.tolist() == [[0, 1, 2]]


def test_duplicate_siblings_lowest_index_wins():
    tok = _i32([5, 5, 6])
    par = _i32([0, 0, 2])
    am = _i32([5, 9, 6, 4])
    out, acc, rows = _both(tok, par, _i32([3]), target_argmax=am, width=4)
    assert out.tolist() == [[5, 9, P, P]] and rows.tolist() == [[0, 1, P, P]]


def test_inert_and_invalid_nodes_are_unreachable():
    tok = _i32([-1, 7, 8])
    par = _i32([0, 0, 3])  # node 3 points at itself (invalid)
    am = _i32([7, 1, 8, 2])
    out, acc, rows = tree_verify(tok, par, _i32([3]), target_argmax=am, width=4, check_data=False)
    assert out.tolist() == [[7, 8, P, P]] and rows.tolist() == [[0, 2, P, P]]
    with pytest.raises(ValueError, match="draft_parent_ids"):
        tree_verify(tok, par, _i32([3]), target_argmax=am, width=4)


def test_argmax_int64_accepted():
    tok, par, cu = _catdog()
    am = torch.tensor([DOG, 5, 5, SAT, 7], dtype=torch.int64)
    out, _, _ = _both(tok, par, cu, target_argmax=am, width=5)
    assert out.tolist() == [[DOG, SAT, 7, P, P]]


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(draft_token_ids=torch.zeros(4, dtype=torch.float32)), "draft_token_ids"),
        (dict(draft_parent_ids=_i32([0, 1, 0])), "draft_parent_ids"),
        (dict(cu_num_draft_tokens=_i32([[4]])), "cu_num_draft_tokens"),
        (dict(target_argmax=_i32([1, 2, 3])), "target_argmax"),
        (dict(target_argmax=None), "target_argmax"),
        (dict(width=0), "width"),
        (dict(cu_num_draft_tokens=_i32([3])), "cu_num_draft_tokens"),
        (dict(draft_parent_ids=_i32([0, 2, 0, 3])), "draft_parent_ids"),
        (dict(max_num_nodes=2), "max_num_nodes"),
    ],
)
def test_validation_names_the_argument(kw, name):
    tok, par, cu = _catdog()
    base = dict(draft_token_ids=tok, draft_parent_ids=par, cu_num_draft_tokens=cu,
                target_argmax=_i32([1, 2, 3, 4, 5]))
    base.update(kw)
    with pytest.raises(ValueError, match=f"`{name}`"):
        tree_verify(**base)


def test_validation_sampled_args():
    tok, par, cu = _catdog()
    probs = torch.full((5, 8), 1 / 8)
    with pytest.raises(ValueError, match="`target_probs`"):
        tree_verify(tok, par, cu, target_probs=probs[:4])
    with pytest.raises(ValueError, match="`coins`"):
        tree_verify(tok, par, cu, target_probs=probs, coins=torch.rand(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="`inv_exp_noise`"):
        tree_verify(tok, par, cu, target_probs=probs, coins=torch.rand(5, dtype=torch.float64),
                    inv_exp_noise=torch.ones(1, 7))
    with pytest.raises(ValueError, match="`is_greedy`"):
        tree_verify(tok, par, cu, target_probs=probs, is_greedy=torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="`draft_token_ids`"):
        tree_verify(_i32([1, 2, 3, 99]), par, cu, target_probs=probs)


# ----------------------------------------------------------------------------
# Random batches: kernel == reference, bit for bit
# ----------------------------------------------------------------------------
def _rand_inputs(seed, B, max_n, V, distinct=True, inert_p=0.05, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    tok, par, cu, trees = make_batch(B, max_n, V, g, shapes=shapes, distinct=distinct, inert_p=inert_p)
    am = make_argmax(trees, V, g)
    probs = make_probs(trees, V, g)
    T = probs.shape[0]
    coins = torch.rand(T, dtype=torch.float64, generator=g)
    noise = 1.0 / torch.empty(B, V).exponential_(generator=g)
    is_greedy = torch.rand(B, generator=g) < 0.4
    return tok, par, cu, am, probs, coins, noise, is_greedy


@pytest.mark.parametrize("seed", range(6))
def test_random_greedy(seed):
    """~1200 random greedy trees (ragged, n=0, chains, stars, deep, inert -1 nodes)."""
    tok, par, cu, am, *_ = _rand_inputs(seed, 200, 24, 12 + seed, distinct=seed % 2 == 0)
    W = [None, 4, 9][seed % 3]
    out, acc, _ = _both(tok, par, cu, target_argmax=am, width=W)
    assert int(acc.max()) >= 2  # the generator produces real acceptance


@pytest.mark.parametrize("seed", range(4))
def test_random_sampled(seed):
    """~400 random target-only trees; duplicate siblings in odd seeds."""
    tok, par, cu, am, probs, coins, noise, _ = _rand_inputs(100 + seed, 100, 16, 16 + 5 * seed,
                                                            distinct=seed % 2 == 0)
    W = [None, 5][seed % 2]
    out, acc, _ = _both(tok, par, cu, target_probs=probs, coins=coins, inv_exp_noise=noise,
                        width=W)
    assert int(acc.max()) >= 2
    assert int(out.max()) < probs.shape[1]


@pytest.mark.parametrize("seed", range(2))
def test_random_mixed_greedy_sampled(seed):
    tok, par, cu, am, probs, coins, noise, is_greedy = _rand_inputs(200 + seed, 100, 16, 20)
    _both(tok, par, cu, target_argmax=am, target_probs=probs, is_greedy=is_greedy,
          coins=coins, inv_exp_noise=noise, width=[None, 6][seed])


def test_mixed_batch_without_argmax_uses_probs_argmax():
    tok, par, cu, am, probs, coins, noise, is_greedy = _rand_inputs(300, 40, 10, 12)
    _both(tok, par, cu, target_probs=probs, is_greedy=is_greedy, coins=coins, inv_exp_noise=noise)


def test_onehot_sampled_reproduces_greedy():
    """docs/kernel.md, "How losslessness is tested", 7: one-hot p in sampled mode gives exactly the greedy output."""
    tok, par, cu, am, probs, coins, noise, _ = _rand_inputs(400, 60, 16, 12, distinct=False)
    onehot = torch.nn.functional.one_hot(am.long(), 12).to(torch.float32)
    g = tree_verify(tok, par, cu, target_argmax=am, width=8)
    s = tree_verify(tok, par, cu, target_probs=onehot, coins=coins, inv_exp_noise=noise, width=8)
    _eq(g, s)


def test_zero_mass_residual_guard():
    """All of p on the children (rounded row sum < 1) and a coin above it: the final
    token is the last child with p > 0, never an arbitrary id (docs/kernel.md, zero-mass guard)."""
    tok = _i32([1, 2, 3])
    par = _i32([0, 0, 0])
    p = torch.zeros(4, 6)
    p[0, 1], p[0, 2], p[0, 3] = 0.25, 0.5, 0.0
    p[1:, 0] = 1.0
    coins = torch.tensor([0.9, 0.5, 0.5, 0.5], dtype=torch.float64)
    out, acc, _ = _both(tok, par, _i32([3]), target_probs=p, coins=coins,
                        inv_exp_noise=torch.ones(1, 6), width=3)
    assert out.tolist() == [[2, P, P]] and acc.tolist() == [0]


def test_vocab_tail_block_never_wins():
    """V just past a block boundary: masked lanes must not win the race."""
    V = 33
    tok = _i32([32])
    par = _i32([0])
    p = torch.zeros(2, V)
    p[0, 32], p[0, 31] = 0.25, 0.75
    p[1, 32] = 1.0
    coins = torch.tensor([0.9, 0.5], dtype=torch.float64)
    out, acc, _ = _both(tok, par, _i32([1]), target_probs=p, coins=coins,
                        inv_exp_noise=torch.ones(1, V), block_v=16)
    assert out.tolist() == [[31, P]]


def test_full_vocab_qwen3():
    """V = 151,936 (Qwen3) with a large BLOCK_V to keep the interpreter fast."""
    V = 151936
    g = torch.Generator().manual_seed(7)
    tok, par, cu, trees = make_batch(4, 6, 50, g, zero_p=0.0)
    T = int(cu[-1]) + 4
    logits = torch.randn(T, V, generator=g)
    kids = [k for k in __import__("_trees").children_tokens(trees)]
    for r, ks in enumerate(kids):
        for t in ks:
            if t >= 0:
                logits[r, t] += 12.0
    probs = torch.softmax(logits, -1)
    coins = torch.rand(T, dtype=torch.float64, generator=g)
    noise = 1.0 / torch.empty(4, V).exponential_(generator=g)
    out, acc, _ = _both(tok, par, cu, target_probs=probs, coins=coins, inv_exp_noise=noise,
                        block_v=32768)
    am = torch.argmax(probs, -1)
    _both(tok, par, cu, target_argmax=am)


def test_seeded_path_is_deterministic_and_valid():
    tok, par, cu, am, probs, coins, noise, _ = _rand_inputs(500, 30, 12, 16)
    seeds = torch.arange(30, dtype=torch.int64) * 7919
    pos = torch.arange(30, dtype=torch.int64) + 100
    a = tree_verify(tok, par, cu, target_probs=probs, seeds=seeds, positions=pos)
    b = tree_verify(tok, par, cu, target_probs=probs, seeds=seeds, positions=pos)
    _eq(a, b)
    out, acc, rows = a
    # every emitted token is a valid id with positive probability at its row
    for r in range(30):
        for d in range(int(acc[r]) + 1):
            row = int(rows[r, d])
            t = int(out[r, d])
            assert 0 <= t < 16 and float(probs[row, t]) > 0
    c = tree_verify(tok, par, cu, target_probs=probs, seeds=seeds, positions=pos + 1)
    assert not torch.equal(a[0], c[0])


def test_draft_probs_mode_runs_reference():
    tok, par, cu, am, probs, coins, noise, _ = _rand_inputs(600, 20, 8, 10)
    q = torch.softmax(torch.randn(tok.shape[0], 10), -1)
    a = tree_verify(tok, par, cu, target_probs=probs, coins=coins, inv_exp_noise=noise, draft_probs=q)
    b = tree_verify_ref(tok, par, cu, target_probs=probs, coins=coins, inv_exp_noise=noise, draft_probs=q)
    _eq(a, b)
