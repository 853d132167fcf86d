"""Issue 35.2: the budget policy of ``DDTREE_PATCH_BUDGET=auto`` (``ddtree_patcher.runtime.budget_policy``),
on synthetic step costs and acceptances (no torch, no vLLM).

The simulated engine: each step the policy picks a budget for B requests; the step "runs" it and
reports, as the runtime's accounting would, the accepted draft tokens of every budget up to the one
run (prefix budgets and the spine are counted from the same walk; ``counterfactual=False``: only the
budget run). Costs are the measured shape of docs/ddtree.md ("What to expect on the H200": N = 15 costs
1.03-1.09x the chain, N = 63 1.14x at B = 1, ~2x at B = 8, 3.3x at B = 32; N = 31 in between).
"""
from __future__ import annotations

import random
import subprocess
import sys

import pytest

from ddtree_patcher.runtime.budget_policy import BudgetPolicy

CHAIN = 16  # s = L_eff: the spine-only budget (DFlash's usual depth 16)
BUDGETS = (31, 63)  # above the spine (a prefix of b <= s nodes of a spine-first tree is the chain)
# step time relative to the chain's, per budget and B (the H200's shape)
COST = {
    CHAIN: {1: 1.00, 8: 1.00, 32: 1.00},
    31: {1: 1.08, 8: 1.27, 32: 1.80},
    63: {1: 1.14, 8: 2.00, 32: 3.33},
}


def policy(**kw) -> BudgetPolicy:
    p = BudgetPolicy(BUDGETS, chain=CHAIN, **kw)
    for b, pts in COST.items():
        for B, c in pts.items():
            p.set_cost(b, B, c * 1e-3 * (1 + 0.02 * B))  # seconds: the chain's step grows with B too
    return p


def run(p: BudgetPolicy, steps: int, B, acc, *, rng: random.Random | None = None, sd: float = 0.0,
        counterfactual: bool = True) -> list:
    """``steps`` decisions; ``B``: an int or step -> int; ``acc``: budget -> mean accepted draft tokens
    per request-step (or step -> that dict); per-request noise of standard deviation ``sd``."""
    out = []
    for i in range(steps):
        b_now = B(i) if callable(B) else B
        a_now = acc(i) if callable(acc) else acc
        d = p.decide(b_now)
        out.append(d)
        for b in p.candidates:
            if b == d.budget or (counterfactual and b <= d.budget):
                mean = a_now[b] + (rng.gauss(0.0, sd / b_now ** 0.5) if rng else 0.0)
                p.observe(b, b_now, max(0.0, mean) * b_now)
    return out


def exploited(decisions) -> list[int]:
    return [d.budget for d in decisions if not d.explore]


def test_import_is_pure():
    code = ("import sys; import ddtree_patcher.runtime.budget_policy; "
            "bad = [m for m in ('torch', 'vllm', 'numpy') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("B", [1, 8, 32])
def test_dummy_weights_pick_the_chain(B):
    # nothing accepted anywhere (1 token per step): every tree costs more for the same tokens
    p = policy()
    dec = run(p, 2000, B, {CHAIN: 0.0, 31: 0.0, 63: 0.0})
    assert set(exploited(dec)) == {CHAIN}
    assert p.switches == 0
    # exploration is the only cost above the chain's, bounded by its share (warm-up tries included)
    extra = sum(p.cost(d.budget, B) - p.cost(CHAIN, B) for d in dec if d.explore)
    total = sum(p.cost(d.budget, B) for d in dec)
    assert 0 < p.explorations and extra / total <= p.explore_fraction + 2 * (p.cost(63, B) / total)
    assert p.summary()["explore_share"] <= p.explore_fraction + 1e-9 + 2 * p.cost(63, B) / total


def test_tree_that_does_not_pay_its_cost_loses_to_the_chain():
    # the tree accepts more, but not enough for its cost at B = 8 (31: 1.27x the time, 1.2x the tokens)
    p = policy()
    dec = run(p, 1500, 8, {CHAIN: 3.0, 31: 3.8, 63: 4.2})
    assert set(exploited(dec[100:])) == {CHAIN}


def test_bigger_budgets_when_acceptance_pays():
    # B = 1: costs nearly flat, acceptance grows with the budget -> the largest budget
    p = policy()
    dec = run(p, 1000, 1, {CHAIN: 3.0, 31: 4.5, 63: 5.5})
    assert exploited(dec)[-500:] == [63] * 500
    assert p.switches <= 2
    # the pick's expected rate is at least the chain's
    d = dec[-1]
    assert d.rates[63] > d.rates[CHAIN]


def test_chain_unknown_means_chain():
    p = policy()
    p.observe(63, 10, 100.0)  # a great tree, but nothing known of the chain
    d = p.decide(1)
    assert (d.budget, d.explore) == (CHAIN, False) or d.explore
    assert p.current == CHAIN


def test_budget_shrinks_as_B_grows():
    # acceptance chain 3, 31: 4.2, 63: 4.8 (per request-step); cost grows with B faster for big budgets
    acc = {CHAIN: 3.0, 31: 4.2, 63: 4.8}
    picks = {}
    p = policy()
    for B in (1, 4, 8, 16, 32):  # one policy through the phases (interpolated costs at 4 and 16)
        dec = run(p, 600, B, acc)
        tail = exploited(dec[-200:])
        assert len(set(tail)) == 1, (B, set(tail))
        picks[B] = tail[-1]
    assert picks[1] == 63 and picks[32] == CHAIN, picks
    order = [picks[B] for B in (1, 4, 8, 16, 32)]
    assert order == sorted(order, reverse=True), picks
    # and each phase's pick is the best expected rate among the candidates at that B
    for B, b in picks.items():
        rates = {c: (1 + acc[c]) / p.cost(c, B) for c in p.candidates}
        assert b == max(rates, key=rates.get), (B, rates)


def test_no_oscillation_under_noise():
    # 31 and 63 within 1 % of each other, both well above the chain; noisy acceptance per step
    rng = random.Random(7)
    p = policy()
    c31, c63 = p.cost(31, 1), p.cost(63, 1)
    a63 = (1 + 4.5) * c63 / c31 - 1 + 0.01 * (1 + 4.5) * c63 / c31  # 63's rate 1 % above 31's
    dec = run(p, 5000, 1, {CHAIN: 2.0, 31: 4.5, 63: a63}, rng=rng, sd=2.0)
    assert p.switches <= 3, p.switches
    tail = exploited(dec[500:])
    assert set(tail) <= {31, 63} and len(set(tail)) == 1


def test_no_oscillation_at_the_chain_boundary():
    # a tree 2 % above the chain in expected rate: within noise; the pick must not flap
    rng = random.Random(11)
    p = policy()
    c, c31 = p.cost(CHAIN, 1), p.cost(31, 1)
    a31 = (1 + 3.0) * 1.02 * c31 / c - 1
    run(p, 5000, 1, {CHAIN: 3.0, 31: a31, 63: 0.0}, rng=rng, sd=2.5)
    assert p.switches <= 2, p.switches


@pytest.mark.parametrize("gain", [1.03, 1.05, 1.10])
@pytest.mark.parametrize("seed", range(2))
def test_no_oscillation_under_noisy_online_costs(gain, seed):
    # the tree's expected rate a few % above the chain's, its step times measured online with 15 %
    # noise: the cost's own standard error keeps the band wide enough not to flap
    rng = random.Random(seed)
    p = BudgetPolicy([31], chain=16)
    c = {16: 1e-3, 31: 1.08e-3}
    acc = {16: 3.0, 31: (1 + 3.0) * gain * 1.08 - 1}
    for _ in range(5000):
        d = p.decide(8)
        p.observe_cost(d.budget, 8, c[d.budget] * (1 + rng.gauss(0, 0.15)))
        for b in (16, 31):
            if b <= d.budget:
                p.observe(b, 8, max(0.0, acc[b] + rng.gauss(0, 1.5 / 8 ** 0.5)) * 8)
    assert p.switches <= 2 and p.current == 31, (p.switches, p.current)
    assert 0 < p.cost_se(31, 8) < 0.05


def test_converges_after_a_workload_change():
    # steps 0-1499: the tree pays (63); then the drafter stops matching (dummy-like): the chain
    p = policy()
    good, bad = {CHAIN: 3.0, 31: 4.5, 63: 5.5}, {CHAIN: 0.2, 31: 0.2, 63: 0.2}
    dec = run(p, 3000, 1, lambda i: good if i < 1500 else bad)
    assert exploited(dec[1000:1500])[-1] == 63
    after = exploited(dec[1500:])
    first_chain = after.index(CHAIN)
    assert first_chain <= 2 * p.half_life, first_chain  # the change detector: ~230 steps, not ~470
    assert p.summary()["changes"] >= 1
    assert set(after[first_chain:]) == {CHAIN}
    # and back: the tree pays again -> found by exploration, within a few half-lives
    p2 = policy()
    dec = run(p2, 3000, 1, lambda i: bad if i < 1500 else good)
    after = exploited(dec[1500:])
    assert after[-1] == 63 and after.index(63) <= p2.half_life / 2  # 63 forgotten and explored again


def test_exploration_without_counterfactuals_covers_every_budget():
    p = policy(counterfactual=False)
    run(p, 3000, 1, {CHAIN: 3.0, 31: 4.5, 63: 5.5}, counterfactual=False)
    acc = p.summary()["acceptance"]
    assert all(acc[b] is not None for b in p.candidates)
    assert p.current == 63


def test_exploration_is_spaced_and_only_upwards():
    p = policy()
    dec = run(p, 3000, 8, {CHAIN: 0.0, 31: 0.0, 63: 0.0})
    steps = [i for i, d in enumerate(dec) if d.explore]
    assert all(dec[i].budget > CHAIN for i in steps)
    gaps = [b - a for a, b in zip(steps[p.warmup:], steps[p.warmup + 1:])]
    assert gaps and min(gaps) >= p.explore_period


def test_deterministic():
    a = [d.budget for d in run(policy(), 800, 1, {CHAIN: 3.0, 31: 4.5, 63: 5.5}, rng=random.Random(3), sd=1.0)]
    b = [d.budget for d in run(policy(), 800, 1, {CHAIN: 3.0, 31: 4.5, 63: 5.5}, rng=random.Random(3), sd=1.0)]
    assert a == b


def test_cost_model():
    p = BudgetPolicy([31], chain=16)
    assert p.cost(31, 8) is None
    p.set_cost(31, 8, 2.0)
    assert p.cost(31, 1) == p.cost(31, 32) == 2.0  # one point: flat
    p.set_cost(31, 16, 3.0)
    assert p.cost(31, 12) == pytest.approx(2.5)  # interpolated
    assert p.cost(31, 4) == 2.0  # below the smallest: the smallest's
    assert p.cost(31, 24) == pytest.approx(4.0)  # above: the last segment's slope
    p.observe_cost(31, 16, 4.0)
    assert p.cost(31, 16) == pytest.approx(3.0 + p.cost_alpha * 1.0)  # online EWMA
    p.observe_cost(31, 2, 1.5)  # a new point
    assert p.cost(31, 2) == 1.5
    with pytest.raises(KeyError):
        p.set_cost(15, 1, 1.0)
    with pytest.raises(ValueError):
        p.set_cost(31, 1, 0.0)


def test_a_budget_without_cost_is_tried_once_never_exploited():
    # costs measured online: a budget never timed is tried once (a warm-up try), then only on its
    # measured cost; here its time is never reported, so it is never exploited
    p = BudgetPolicy([31, 63], chain=16)
    p.set_cost(16, 1, 1.0)
    p.set_cost(31, 1, 1.05)
    dec = run(p, 500, 1, {16: 1.0, 31: 3.0, 63: 9.0})
    assert 63 not in exploited(dec) and [d.budget for d in dec].count(63) <= p.warmup
    assert dec[-1].budget == 31 and dec[-1].rates[63] is None


def test_candidates():
    p = BudgetPolicy([15, 31, 63], chain=16, max_budget=31)
    assert p.candidates == (15, 16, 31)
    with pytest.raises(ValueError):
        BudgetPolicy([15], chain=64, max_budget=63)
    with pytest.raises(ValueError):
        BudgetPolicy([0, 15], chain=8)
    p.set_cost(16, 1, 1.0)
    assert p.decide(0).budget == 16  # an empty batch: the chain
