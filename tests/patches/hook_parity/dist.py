"""Distribution tests of the tree path (imported by parity_probe.py, group ``dist``).

One real tree, replicated over many requests of one batch (one call of the walk): the root has
two children ``a``, ``b`` (the two most likely tokens), ``a`` has one child ``c``; ``b`` and
``c`` are leaves. The tree path's output (first token, the (first, second) pair with END for
a stop after one token, the token after ``a c``, and the number of accepted drafts) must follow
the target distribution, each node's row processed as vLLM processes it for that request
(independent oracle below), by Pearson chi-square (p > P_MIN). The same counts must *reject*
the target moved by 2% of probability between its two most likely tokens (simulated power:
``probe_lib.shift_power``) where the check claims that power.

V1 rows: a node with children is a target row (temperature with 0 -> 1, top-k, top-p); a leaf's
token comes from vLLM's Sampler (logit bias, temperature, min-p, top-k, top-p; bias and min-p
only where the release's build_logitsprocs builds their processors: without a drafter
configured). V2 rows: logit bias, temperature, min-p, top-k, top-p on every row (vLLM's
``apply_sampling_params``; the node's position does not enter these stages).

Sizes: HOOK_PARITY_DIST_N (default 8000) requests per V1 check and per cheap V2 check
(temperature 1, top-k, top-p: no Triton kernel under the interpreter), N // 16 per costly V2
check (temperature != 1 and min-p run Triton kernels, interpreted on CPU: milliseconds per row).
The walk itself is the PyTorch reference here (bit-identical to the Triton kernel on the same
coins and noise, tests/kernels; the kernel's own Philox stream is tested for losslessness there).
"""
from __future__ import annotations

import os

import numpy as np
import torch
from vllm.sampling_params import SamplingParams

from ddtree_patcher.runtime import hook
from probe_lib import V1World, V2World, check, chi2_pvalue, env, log, shift_power, v1_spec_metadata

VD, K = 12, 4
PARENTS = [0, 0, 1]  # nodes 1 (a) and 2 (b) under the root, node 3 (c) under a
P_MIN = 1e-3  # deterministic (seeded) runs: a fixed pass/fail, not a flake rate
POWER = 0.9
LOGITS_SEED = 3  # fixed rows (the power below depends on them); the draws follow the probe's SEED
N = int(os.environ.get("HOOK_PARITY_DIST_N", "8000"))


def _top_k_top_p(x, top_k, top_p):
    x = x.clone()
    if top_k and top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x[x < kth] = float("-inf")
    if top_p < 1.0:
        p = torch.softmax(x, -1)
        order = torch.argsort(p)  # ascending, as vLLM: drop the tail whose mass is <= 1 - top_p
        cum = torch.cumsum(p[order], 0)
        drop = cum <= 1 - top_p
        drop[-1] = False
        x[order[drop]] = float("-inf")
    return x


def oracle(logits_row, sp, *, temp_zero_to_one=True, bias=False, min_p=False):
    """The request's processed distribution for one row (independent of vLLM's code)."""
    x = logits_row.to(torch.float64).clone()
    if bias and sp.logit_bias:
        for t, b in sp.logit_bias.items():
            x[int(t)] += b
    t = sp.temperature if sp.temperature > 0 or not temp_zero_to_one else 1.0
    x = x / t
    if min_p and sp.min_p:
        p = torch.softmax(x, -1)
        x[p < sp.min_p * p.max()] = float("-inf")
    x = _top_k_top_p(x, sp.top_k if sp.top_k and sp.top_k > 0 else 0, sp.top_p)
    return torch.softmax(x, -1)


def _logits(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, VD, generator=g, dtype=torch.float32) * 0.5  # flat-ish: p_max ~ 0.15


def _drafts(p_root, p_a):
    order = torch.argsort(p_root, descending=True)
    a, b = int(order[0]), int(order[1])
    c = int(torch.argmax(p_a))
    return a, b, c


def _stats(out, p, a, b, c):
    """Chi-square p-values of the tree path's outputs ``out`` [n, >= 3] (-1 padded) against the
    node distributions ``p = (p_root, p_a, p_b, p_c)``."""
    p_root, p_a, p_b, p_c = p
    t1, t2, t3 = out[:, 0], out[:, 1], out[:, 2]
    res = {"first": chi2_pvalue(np.bincount(t1.numpy(), minlength=VD), p_root.numpy())}
    # (first, second | END): a and b have rows (a second token follows), other tokens end the step
    cat = torch.where(t1 == a, VD + t2.clamp(min=0), torch.where(t1 == b, 2 * VD + t2.clamp(min=0), t1))
    exp = torch.cat([p_root * (1 - torch.nn.functional.one_hot(torch.tensor([a, b]), VD).sum(0)),
                     p_root[a] * p_a, p_root[b] * p_b])
    res["pair"] = chi2_pvalue(np.bincount(cat.numpy(), minlength=3 * VD), exp.numpy())
    sel = (t1 == a) & (t2 == c)  # the token after the path a -> c (leaf c)
    res["after_a_c"] = chi2_pvalue(np.bincount(t3[sel].numpy(), minlength=VD), p_c.numpy())
    acc = (out != -1).sum(1) - 1  # accepted drafts: 0, 1 (b, or a then not c) or 2 (a, c)
    exp_acc = torch.stack([1 - p_root[a] - p_root[b], p_root[b] + p_root[a] * (1 - p_a[c]), p_root[a] * p_a[c]])
    res["accepted"] = chi2_pvalue(np.bincount(acc.numpy(), minlength=3), exp_acc.numpy())
    return res


def _analyse(tag, out, p, a, b, c, need_power: bool, wrong=None):
    """Every check passes against the processed distributions ``p``; the power against a 2%
    shift is reported (and required where ``need_power``); where ``wrong`` (the distributions a
    path that skipped a processing stage would follow) is given, the same counts reject it."""
    out = out.to(torch.int64)
    n = out.shape[0]
    t1, t2 = out[:, 0], out[:, 1]
    assert bool((t1 >= 0).all()), out[:5]
    assert bool((((t1 == a) | (t1 == b)) == (t2 >= 0)).all()), "a second token exactly after a or b"
    res = _stats(out, p, a, b, c)
    power = shift_power(p[0].numpy(), n, alpha=P_MIN)
    line = f"DIST {tag}: n={n} p-values " + " ".join(f"{k}={v:.3g}" for k, v in res.items())
    line += f"; power vs a 2% shift of the first token: {power:.2f}"
    if wrong is not None:
        res_w = _stats(out, wrong, a, b, c)
        line += "; without the stage: " + " ".join(f"{k}={v:.2g}" for k, v in res_w.items())
    log(line)
    bad = {k: v for k, v in res.items() if not v > P_MIN}
    assert not bad, (tag, bad)
    if need_power:
        assert power >= POWER, (tag, "too few samples to see a 2% shift", n, power)
    if wrong is not None:
        assert min(res_w.values()) < P_MIN, (tag, "the checks cannot tell the stage's absence", res_w)
    return res


# ---- V1 -------------------------------------------------------------------------------------------
def v1_dist(spec: bool, seeded: bool, seed: int):
    """With a drafter (spec) the release builds no logit-bias / min-p processors: vLLM ignores
    both, and so must the tree path; without one, vLLM's Sampler applies them at the leaves."""
    n = N
    logits4 = _logits(LOGITS_SEED)
    base = dict(temperature=0.8, top_k=10, top_p=0.95, min_p=0.5, logit_bias={3: 1.0, 7: -2.0}, max_tokens=64)
    sps = [SamplingParams(**base, seed=(seed * 1_000_003 + i if seeded else None)) for i in range(n)]
    sp = sps[0]
    built = not spec

    def rows(leaf_stages):
        return (oracle(logits4[0], sp), oracle(logits4[1], sp),
                oracle(logits4[2], sp, bias=leaf_stages, min_p=leaf_stages),
                oracle(logits4[3], sp, bias=leaf_stages, min_p=leaf_stages))

    p, wrong = rows(built), rows(not built)
    a, b, c = _drafts(p[0], p[1])
    env(DDTREE_PATCH_ENABLE="1")
    world = V1World(sps, vocab=VD, k=K, spec=spec, maxr=n)
    step = hook.verify_step(world.runner)
    drafts = [[a, b, c]] * n
    step.attach(world.ids, torch.tensor([PARENTS] * n, dtype=torch.int32))
    sm = world.set_drafts(drafts)
    md = v1_spec_metadata(drafts)
    torch.manual_seed(seed)
    out = step.sample_v1(md, None, logits4.repeat(n, 1), sm).sampled_token_ids
    assert step.tree_requests == n, step.fallbacks
    tag = f"v1 {'drafter' if spec else 'no drafter'} {'seeded' if seeded else 'unseeded'} {world.procs}"
    _analyse(tag, out, p, a, b, c, need_power=True, wrong=wrong)


# ---- V2 -------------------------------------------------------------------------------------------
V2_SLOTS = 1000  # request slots of the V2 world; rounds re-add requests into them (new seeds)


def v2_dist(world, costly: bool, seed: int):
    """Rounds of V2_SLOTS requests, half of them seeded (distinct seeds), half unseeded (vLLM
    draws their seeds when the request is added), re-added into the same slots each round."""
    n = N // 16 if costly else N
    logits4 = _logits(LOGITS_SEED)
    if costly:
        base = dict(temperature=0.7, min_p=0.3, top_k=9, logit_bias={3: 1.0, 7: -2.0}, max_tokens=64)
    else:
        base = dict(temperature=1.0, top_k=10, top_p=0.9, max_tokens=64)
    sp = SamplingParams(**base)
    p = [oracle(logits4[i], sp, temp_zero_to_one=False, bias=True, min_p=True) for i in range(4)]
    if costly:  # a path without logit bias and min-p
        wrong = [oracle(logits4[i], sp, temp_zero_to_one=False) for i in range(4)]
    else:  # a path without top-k / top-p
        wrong = [torch.softmax(logits4[i].to(torch.float64), -1) for i in range(4)]
    a, b, c = _drafts(p[0], p[1])
    env(DDTREE_PATCH_ENABLE="1")
    m = min(V2_SLOTS, n)
    outs, seeded = [], []
    step = hook.verify_step(world.runner)
    for k in range(0, n, m):
        sps = [SamplingParams(**base, seed=(seed * 1_000_003 + k + i if i % 2 else None)) for i in range(m)]
        world.readd(sps)
        step.attach(world.ids[:m], torch.tensor([PARENTS] * m, dtype=torch.int32))
        ib = world.batch([[a, b, c]] * m, [1] * m, [0] * m)
        got = step.sample_v2(logits4.repeat(m, 1), ib, None, None)
        outs.append(torch.where(torch.arange(got.sampled_token_ids.shape[1])[None, :] < got.num_sampled[:, None],
                                got.sampled_token_ids, -1))
        seeded.append(torch.arange(m) % 2 == 1)
    assert step.tree_requests >= n, step.fallbacks
    out, seeded = torch.cat(outs), torch.cat(seeded)
    tag = f"v2 {'costly' if costly else 'cheap'} {base}"
    _analyse(tag + " seeded+unseeded", out, p, a, b, c, need_power=not costly, wrong=wrong)
    _analyse(tag + " seeded", out[seeded], p, a, b, c, need_power=False)
    _analyse(tag + " unseeded", out[~seeded], p, a, b, c, need_power=False)


def run(family: str, seed: int, stats) -> None:
    from ddtree_patcher.runtime import hook as h

    h._use_reference = lambda dev: True  # the walk's PyTorch reference (see the module docstring)
    np.random.seed(seed)  # V2 draws unseeded requests' seeds with numpy
    if family == "v1":
        for spec in (True, False):
            for seeded in (False, True):
                check(f"dist_v1_{'drafter' if spec else 'builtins'}_{'seeded' if seeded else 'unseeded'}")(
                    lambda spec=spec, seeded=seeded: v1_dist(spec, seeded, seed))
    else:
        world = V2World([SamplingParams(temperature=1.0)] * min(V2_SLOTS, N), vocab=VD, k=K)
        for costly in (False, True):
            check(f"dist_v2_{'costly' if costly else 'cheap'}")(lambda costly=costly: v2_dist(world, costly, seed))
