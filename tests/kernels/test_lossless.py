"""Losslessness of sampled verification (docs/kernel.md, "How losslessness is tested").

Many-trial statistics run through the PyTorch reference (the Triton kernel is
bit-identical to it on explicit coins/noise, see test_tree_verify.py); a smaller
check runs through the Triton kernel itself, with explicit and in-kernel (Philox)
randomness. Negative controls show the tests have power: known-wrong rules must
fail them. All seeds are fixed.
"""

from __future__ import annotations

import math
import random

import torch

from ddtree_patcher.kernels import tree_verify, tree_verify_ref

P_MIN = 1e-4  # pass threshold for chi-square p-values


def chi2_pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    counts = counts.to(torch.float64)
    p = p.to(torch.float64) / p.sum()
    M = counts.sum()
    if bool(((p == 0) & (counts > 0)).any()):
        return 0.0
    e = M * p
    keep = e > 0
    stat = (((counts - e) ** 2)[keep] / e[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2.0))


def tv(counts, p):
    emp = counts.to(torch.float64) / counts.sum()
    return 0.5 * float((emp - p.to(torch.float64) / p.sum()).abs().sum())


# A 14-node DDTree-like tree (parents before children, distinct siblings), V = 8.
TREE_TOK = [3, 1, 5, 2, 3, 0, 6, 1, 4, 2, 7, 3, 5, 0]
TREE_PAR = [0, 0, 1, 0, 1, 3, 2, 4, 1, 5, 5, 6, 8, 9]
V = 8


def _target_rows(seed=0, n_rows=15, temp=1.2):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(n_rows, V, generator=g) * temp, -1)


def _replicate(tok, par, rows, M):
    n = len(tok)
    t = torch.tensor(tok * M, dtype=torch.int32)
    p = torch.tensor(par * M, dtype=torch.int32)
    cu = (torch.arange(1, M + 1, dtype=torch.int64) * n).to(torch.int32)
    probs = rows.repeat(M, 1).contiguous()
    return t, p, cu, probs


def _run(fn, tok, par, rows, M, seed, **kw):
    g = torch.Generator().manual_seed(seed)
    t, p, cu, probs = _replicate(tok, par, rows, M)
    T = probs.shape[0]
    coins = torch.rand(T, dtype=torch.float64, generator=g)
    noise = 1.0 / torch.empty(M, V).exponential_(generator=g)
    return fn(t, p, cu, target_probs=probs, coins=coins, inv_exp_noise=noise, **kw)


def expected_acceptance(tok, par, rows):
    """E[A] = sum over nodes u of prod over path edges (v -> w) of p_v(tok w)."""
    reach = [1.0] + [0.0] * len(tok)
    for j in range(1, len(tok) + 1):
        pj = par[j - 1]
        reach[j] = reach[pj] * float(rows[pj, tok[j - 1]])
    return sum(reach[1:])


# ----------------------------------------------------------------------------
# Reference, many trials
# ----------------------------------------------------------------------------
M_REF = 20000
_cache = {}


def _ref_trials():
    if "ref" not in _cache:
        rows = _target_rows(0)
        _cache["ref"] = (rows, _run(tree_verify_ref, TREE_TOK, TREE_PAR, rows, M_REF, seed=1))
    return _cache["ref"]


def test_first_token_marginal():
    rows, (out, acc, _) = _ref_trials()
    counts = torch.bincount(out[:, 0].long(), minlength=V)
    pv = chi2_pvalue(counts, rows[0])
    assert pv > P_MIN, (pv, tv(counts, rows[0]))
    assert tv(counts, rows[0]) < 0.02


def test_conditional_second_token():
    rows, (out, acc, accepted_rows) = _ref_trials()
    checked = 0
    for j in range(1, len(TREE_TOK) + 1):
        if TREE_PAR[j - 1] != 0:
            continue
        sel = out[:, 0] == TREE_TOK[j - 1]
        if int(sel.sum()) < 1000:
            continue
        # first token == tok(c) happens only by accepting c; the next token ~ p_c
        assert bool((accepted_rows[sel, 1] == j + (accepted_rows[sel, 0])).all())
        counts = torch.bincount(out[sel, 1].long(), minlength=V)
        pv = chi2_pvalue(counts, rows[j])
        assert pv > P_MIN, (j, pv)
        checked += 1
    assert checked >= 2


def test_expected_acceptance_z():
    rows, (out, acc, _) = _ref_trials()
    ea = expected_acceptance(TREE_TOK, TREE_PAR, rows)
    a = acc.to(torch.float64)
    z = (float(a.mean()) - ea) / (float(a.std()) / math.sqrt(len(a)))
    assert abs(z) < 5, (float(a.mean()), ea, z)


def test_degenerate_star_topk_and_covering_children():
    """Star with K children, top-k truncated p (zeros), and children covering all mass."""
    rows = _target_rows(3, n_rows=5)
    rows[0, [1, 4, 6]] = 0.0  # top-k style zeros at the root, one of them a child
    rows[0] /= rows[0].sum()
    tok, par = [2, 4, 5, 7], [0, 0, 0, 0]
    out, acc, _ = _run(tree_verify_ref, tok, par, rows, 10000, seed=4)
    counts = torch.bincount(out[:, 0].long(), minlength=V)
    assert int(counts[[1, 4, 6]].sum()) == 0
    assert chi2_pvalue(counts, rows[0]) > P_MIN
    cover = rows.clone()
    cover[0] = 0.0
    cover[0, [2, 4]] = torch.tensor([0.3, 0.7])
    out, acc, _ = _run(tree_verify_ref, [2, 4], [0, 0], cover[:3], 5000, seed=5)
    assert bool((acc == 1).all())
    counts = torch.bincount(out[:, 0].long(), minlength=V)
    assert chi2_pvalue(counts, cover[0]) > P_MIN


def test_duplicate_siblings_reference_is_lossless():
    rows = _target_rows(5, n_rows=4)
    tok, par = [2, 2, 5], [0, 0, 0]
    out, _, _ = _run(tree_verify_ref, tok, par, rows, 10000, seed=6)
    counts = torch.bincount(out[:, 0].long(), minlength=V)
    assert chi2_pvalue(counts, rows[0]) > P_MIN


def test_multi_round_autoregressive_histogram():
    """The strongest check (docs/kernel.md, "How losslessness is tested", 4): 3 tokens over several rounds of tree verification
    against a synthetic p(. | last two tokens) table; compare the 3-token histogram
    with the exact product distribution."""
    Vs = 4
    g = torch.Generator().manual_seed(11)
    table = torch.softmax(torch.randn(Vs, Vs, Vs, generator=g) * 1.3, -1)  # p(x | a, b)

    def p_next(ctx):
        return table[ctx[-2], ctx[-1]]

    M, K = 4000, 3
    rng = random.Random(12)
    seqs = []
    for _ in range(M):
        ctx = [0, 1]
        while len(ctx) < 2 + K:
            # a random tree: root children 2 tokens, each with one child
            kids = rng.sample(range(Vs), 2)
            tok = [kids[0], kids[1], rng.randrange(Vs), rng.randrange(Vs)]
            par = [0, 0, 1, 2]
            paths = [[], [tok[0]], [tok[1]], [tok[0], tok[2]], [tok[1], tok[3]]]
            rows = torch.stack([p_next(ctx + pth) for pth in paths])
            coins = torch.tensor([rng.random() for _ in range(5)], dtype=torch.float64)
            noise = 1.0 / torch.tensor([rng.expovariate(1.0) for _ in range(Vs)], dtype=torch.float32)
            out, acc, _ = tree_verify_ref(
                torch.tensor(tok, dtype=torch.int32), torch.tensor(par, dtype=torch.int32),
                torch.tensor([4], dtype=torch.int32), target_probs=rows.to(torch.float32),
                coins=coins, inv_exp_noise=noise.view(1, Vs))
            ctx += out[0, : int(acc[0]) + 1].tolist()
        seqs.append(ctx[2:2 + K])
    idx = torch.tensor([(s[0] * Vs + s[1]) * Vs + s[2] for s in seqs])
    counts = torch.bincount(idx, minlength=Vs**K)
    exact = torch.zeros(Vs**K, dtype=torch.float64)
    for a in range(Vs):
        for b in range(Vs):
            for c in range(Vs):
                exact[(a * Vs + b) * Vs + c] = float(table[0, 1, a] * table[1, a, b] * table[a, b, c])
    assert chi2_pvalue(counts, exact) > P_MIN


def test_draft_probs_mode_b_lossless_with_sampled_siblings():
    """Mode B (RRS, i.i.d. siblings drawn from q) on trees whose siblings really are
    sampled from q: first-token marginal equals p, and acceptance beats target-only
    on the same q-sampled siblings when q is close to p."""
    g = torch.Generator().manual_seed(21)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.log(p) + 0.3 * torch.randn(V, generator=g), -1)
    M, k = 6000, 3
    kids = torch.multinomial(q.expand(M, V), k, replacement=True, generator=g).to(torch.int32)
    tok = kids.reshape(-1)
    par = torch.zeros(M * k, dtype=torch.int32)
    cu = (torch.arange(1, M + 1) * k).to(torch.int32)
    probs = p.expand(M * (k + 1), V).contiguous()
    coins = torch.rand(M * (k + 1), dtype=torch.float64, generator=g)
    noise = 1.0 / torch.empty(M, V).exponential_(generator=g)
    qp = q.expand(M * k, V).contiguous()
    out, acc, _ = tree_verify_ref(tok, par, cu, target_probs=probs, coins=coins,
                                  inv_exp_noise=noise, draft_probs=qp)
    counts = torch.bincount(out[:, 0].long(), minlength=V)
    assert chi2_pvalue(counts, p) > P_MIN
    out_a, acc_a, _ = tree_verify_ref(tok, par, cu, target_probs=probs, coins=coins,
                                      inv_exp_noise=noise)
    assert float(acc.float().mean()) > float(acc_a.float().mean())


# ----------------------------------------------------------------------------
# Through the Triton kernel (interpreter): fewer trials
# ----------------------------------------------------------------------------
SMALL_TOK = [1, 3, 5, 2, 0]
SMALL_PAR = [0, 0, 0, 1, 2]


def test_kernel_first_token_and_acceptance_explicit_randomness():
    rows = _target_rows(7, n_rows=6)
    out, acc, _ = _run(tree_verify, SMALL_TOK, SMALL_PAR, rows, 200, seed=8)
    counts = torch.bincount(out[:, 0].long(), minlength=V)
    assert chi2_pvalue(counts, rows[0]) > P_MIN
    ea = expected_acceptance(SMALL_TOK, SMALL_PAR, rows)
    a = acc.to(torch.float64)
    assert abs(float(a.mean()) - ea) / (float(a.std()) / math.sqrt(len(a))) < 5


def test_kernel_first_token_in_kernel_philox():
    rows = _target_rows(9, n_rows=6)
    M = 200
    t, p, cu, probs = _replicate(SMALL_TOK, SMALL_PAR, rows, M)
    seeds = torch.arange(M, dtype=torch.int64) * 1_000_003 + 17
    out, acc, _ = tree_verify(t, p, cu, target_probs=probs, seeds=seeds,
                              positions=torch.full((M,), 1234, dtype=torch.int64))
    counts = torch.bincount(out[:, 0].long(), minlength=V)
    assert chi2_pvalue(counts, rows[0]) > P_MIN, counts
    ea = expected_acceptance(SMALL_TOK, SMALL_PAR, rows)
    a = acc.to(torch.float64)
    assert abs(float(a.mean()) - ea) / (float(a.std()) / math.sqrt(len(a))) < 5


# ----------------------------------------------------------------------------
# Negative controls: wrong rules must FAIL the same tests
# ----------------------------------------------------------------------------
def _sample(w, rng):
    tot = sum(w)
    x = rng.random() * tot
    for i, wi in enumerate(w):
        x -= wi
        if x < 0 and wi > 0:
            return i
    return max(i for i, wi in enumerate(w) if wi > 0)


def _first_token_buggy(p, kids, M, rule, q=None, seed=0):
    rng = random.Random(seed)
    p = [float(x) for x in p]
    counts = [0] * len(p)
    for _ in range(M):
        if rule == "q_ratio":  # q-based SWOR RRS on deterministic children: biased
            r, s = p[:], [float(x) for x in q]
            tok = None
            for c in kids:
                if s[c] > 0 and rng.random() * s[c] < r[c]:
                    tok = c
                    break
                r = [max(a - b, 0.0) for a, b in zip(r, s)]
                tr = sum(r)
                r = [a / tr for a in r] if tr > 0 else r
                s[c] = 0.0
                ts = sum(s)
                s = [a / ts for a in s] if ts > 0 else s
            if tok is None:
                tok = _sample(r, rng)
        else:
            u, S, tok = rng.random(), 0.0, None
            for c in kids:  # duplicates NOT skipped ("counted twice")
                S += p[c]
                if u < S:
                    tok = c
                    break
            if tok is None:
                excl = set(kids) if rule == "dup_twice" else set()  # "no_exclude": forget it
                tok = _sample([0.0 if i in excl else x for i, x in enumerate(p)], rng)
        counts[tok] += 1
    return torch.tensor(counts)


def test_negative_control_q_ratio_rule_fails():
    g = torch.Generator().manual_seed(31)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    kids = torch.topk(q, 3).indices.tolist()  # deterministic top-3 by q
    counts = _first_token_buggy(p, kids, 20000, "q_ratio", q=q, seed=1)
    assert chi2_pvalue(counts, p) < P_MIN and tv(counts, p) > 0.05


def test_negative_control_duplicate_counted_twice_fails():
    p = _target_rows(5, n_rows=1)[0]
    counts = _first_token_buggy(p, [2, 2, 5], 20000, "dup_twice", seed=2)
    assert chi2_pvalue(counts, p) < P_MIN


def test_negative_control_residual_without_exclusion_fails():
    p = _target_rows(5, n_rows=1)[0]
    counts = _first_token_buggy(p, [2, 5], 20000, "no_exclude", seed=3)
    assert chi2_pvalue(counts, p) < P_MIN
