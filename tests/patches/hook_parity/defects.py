"""Regression tests for defects 1-4 of issue 11 (imported by parity_probe.py, group ``defects``).

They drive the hook only through the API that existed before the fix too (``hook.tree_step``,
``step.attach(req_id, [parents])``, ``step.sample_v1``/``step.sample_v2``, ``step.fallbacks``,
``step.engaged``) and check behaviour (tokens, counts, host syncs), so the same checks run
against the runtime of a85ada1 (``parity_probe.py ROOT FAMILY 0 7 defects OLD_SITE``), where
each fails:

1. a whole-batch fallback verified a real tree as a chain (a sibling accepted as a child);
2. V2: sampling parameters ignored in tree mode (0.24/0.26: logit bias, penalties, ...) or
   falling back for nearly every sampled request (0.28+: any temperature other than 0 or 1);
   watermarking (0.33) not seen;
3. V1: logit bias and min-p dropped at the final token (vLLM's Sampler applies the built
   logits processors there; the release's ``build_logitsprocs`` builds them when no drafter is
   configured, the issue's repro; with a drafter only ``MinTokensLogitsProcessor``);
4. a host synchronisation in the V1 sampled step (``repeat_interleave`` without
   ``output_size``) and ``attach`` reading the parents on the host.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
from vllm.sampling_params import SamplingParams

from ddtree_patcher.runtime import hook
from nosync import HostSyncError, no_host_sync
from probe_lib import V1World, V2World, check, env, v1_spec_metadata

V, K = 48, 4


def _rows(*argmaxes, second=None, margin=4.0, seed=0):
    """Logits rows with the given argmax per row (and, optionally, a given runner-up)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(argmaxes), V, generator=g)
    for i, a in enumerate(argmaxes):
        x[i, a] = x[i].max() + margin
        if second is not None and second[i] is not None:
            x[i, second[i]] = x[i, a] - 1.0
    return x


# ---- V1 -------------------------------------------------------------------------------------------
def _v1_step(world, drafts, logits, attach=None, guard=True):
    step = hook.verify_step(world.runner)
    for rid, par in (attach or {}).items():
        step.attach(rid, par)
    sm = world.set_drafts(drafts)
    md = v1_spec_metadata(drafts)
    gens = world.gen_states()
    torch.manual_seed(0)
    want = world.rejection_sampler(md, None, logits.clone(), sm).sampled_token_ids
    world.restore(gens)
    torch.manual_seed(0)
    with no_host_sync() if guard else contextlib.nullcontext():
        out = step.sample_v1(md, None, logits.clone(), sm)
    got = want if out is None else out.sampled_token_ids
    return step, want, got


def v1_defect1():
    # r0: tree [0, 0] = two children of the root, a (argmax of row 0) and b (argmax of row 1,
    # so a chain would accept b as a's child). r1: a neighbour verified by vLLM's sampler.
    a, b, c = 11, 12, 13
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    bad = SamplingParams(temperature=0.0, max_tokens=64)
    bad._bad_words_token_ids = [[30]]
    errors = []
    for name, p1, d1 in (("bad-words neighbour", bad, []), ("chain neighbour", greedy, [c])):
        env(DDTREE_PATCH_ENABLE="1")
        world = V1World([greedy, p1], vocab=V, k=K, spec=True)
        logits = _rows(a, b, c, *([c, 5] if d1 else [7]))
        step, want, got = _v1_step(world, [[a, b], d1], logits, attach={"req0": [0, 0]})
        # the walk: a accepted at the root; node 1 is a leaf: its token comes from row 1 (= b)
        if got[0].tolist() != [a, b, -1] or not torch.equal(got[1], want[1]):
            errors.append((name, got.tolist(), "chain verification gives", want.tolist()))
    assert not errors, errors


def v1_defect3():
    # The repro: chain-as-tree, greedy, drafts [11, 12] accepted, logit bias +10 on 14
    # (the runner-up of the bonus row 2).
    bias = SamplingParams(temperature=0.0, logit_bias={14: 10.0}, max_tokens=64)
    logits = _rows(11, 12, 13, second=[None, None, 14])
    for spec, expect in ((False, [11, 12, 14]), (True, [11, 12, 13])):
        env(DDTREE_PATCH_CHAIN_AS_TREE="1")
        world = V1World([bias], vocab=V, k=K, spec=spec)
        step, want, got = _v1_step(world, [[11, 12]], logits, guard=False)  # (the sync check: defect 4)
        assert want[0].tolist() == expect, (world.procs, want)  # what vLLM itself does
        assert got[0].tolist() == expect, (world.procs, got[0].tolist(), "pristine", want[0].tolist())
        assert step.engaged, step.fallbacks


def v1_defect3_min_p():
    # min-p at the final token: the bonus row keeps one token (p = 0.4 > min_p * p_max = 0.2);
    # without min-p each of 24 seeded requests would emit it with probability 0.4
    n = 24
    sps = [SamplingParams(temperature=1.0, min_p=0.5, seed=100 + i, max_tokens=64) for i in range(n)]
    env(DDTREE_PATCH_CHAIN_AS_TREE="1")
    world = V1World(sps, vocab=V, k=K, spec=False)
    bonus = torch.full((V,), -10.0)
    bonus[5] = 0.0
    bonus[6:] = float(np.log(0.6 / (V - 6))) - float(np.log(0.4))  # 0.6 of the mass spread thin
    row0 = torch.zeros(V)
    row0[9] = 30.0  # the draft 9 is accepted (p ~ 1)
    logits = torch.stack([row0, bonus] * n)
    step, want, got = _v1_step(world, [[9]] * n, logits, guard=False)
    assert (want[:, 1] == 5).all(), want  # vLLM: min-p leaves token 5 alone
    assert got[:, 0].tolist() == [9] * n and got[:, 1].tolist() == [5] * n, got


def v1_defect4():
    # a sampled V1 step must not synchronise with the device (the guard raises from our frames)
    sps = [SamplingParams(temperature=0.8, top_k=10, max_tokens=64) for _ in range(3)]
    env(DDTREE_PATCH_CHAIN_AS_TREE="1")
    world = V1World(sps, vocab=V, k=K, spec=True)
    logits = _rows(1, 2, 3, 4, 5, 6, 7, 8)
    drafts = [[1, 2], [4], [6, 7]]
    try:
        step, want, got = _v1_step(world, drafts, logits)
    except HostSyncError as e:
        raise AssertionError(f"host synchronisation in the V1 sampled step: {e}") from e
    assert step.engaged and got.shape == want.shape


def attach_device_tensor():
    # a drafter's parents, built on the device, are attached without a host read
    env(DDTREE_PATCH_ENABLE="1")
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    world = V1World([greedy, greedy], vocab=V, k=K, spec=True)
    step = hook.verify_step(world.runner)
    parents = torch.tensor([[0, 0], [0, 1]], dtype=torch.int32, device=world.runner.device)
    try:
        with no_host_sync():
            step.attach(["req0", "req1"], parents)
    except HostSyncError as e:
        raise AssertionError(f"attach read the parents on the host: {e}") from e
    a, b, c = 11, 12, 13
    logits = _rows(a, b, c, a, b, c)
    sm = world.set_drafts([[a, b], [a, b]])
    md = v1_spec_metadata([[a, b], [a, b]])
    with no_host_sync():
        got = step.sample_v1(md, None, logits.clone(), sm).sampled_token_ids
    assert got.tolist() == [[a, b, -1], [a, b, c]], got


# ---- V2 -------------------------------------------------------------------------------------------
def _v2_step(world, drafts, logits, attach=None, gen=None, guard=True):
    step = hook.verify_step(world.runner)
    for rid, par in (attach or {}).items():
        step.attach(rid, par)
    ib = world.batch(drafts, [3] * len(drafts), gen or [2] * len(drafts))
    want = world.rejection_sampler(logits.clone(), ib, None)
    with no_host_sync() if guard else contextlib.nullcontext():
        got = step.sample_v2(logits.clone(), ib, None, None)
    return step, want, want if got is None else got


def _tokens(out, r):
    n = int(out.num_sampled[r])
    return out.sampled_token_ids[r, :n].tolist()


def v2_defect1():
    a, b, c = 11, 12, 13
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    pen = SamplingParams(temperature=0.0, presence_penalty=0.5, max_tokens=64)
    errors = []
    for name, p1, d1 in (("penalty neighbour", pen, []), ("chain neighbour", greedy, [c])):
        env(DDTREE_PATCH_ENABLE="1")
        world = V2World([greedy, p1], vocab=V, k=K)
        logits = _rows(a, b, c, *([c, 5] if d1 else [7]))
        step, want, got = _v2_step(world, [[a, b], d1], logits, attach={"req0": [0, 0]})
        if not (_tokens(got, 0) == [a, b] and int(got.num_rejected[0]) == 1 and _tokens(got, 1) == _tokens(want, 1)):
            errors.append((name, [_tokens(got, r) for r in range(2)], "chain verification gives",
                           [_tokens(want, r) for r in range(2)]))
    assert not errors, errors


def v2_defect2_processing():
    # (a) the request's logits processing applies in tree mode: logit bias +30 on 20 makes 20
    # every row's greedy token; drafts [20, 20] are accepted (vLLM: [20, 20, 20])
    env(DDTREE_PATCH_CHAIN_AS_TREE="1")
    sps = [SamplingParams(temperature=0.0, logit_bias={20: 30.0}, max_tokens=64),
           SamplingParams(temperature=0.0, presence_penalty=1.5, max_tokens=64)]
    world = V2World(sps, vocab=V, k=K)
    logits = _rows(11, 12, 13, 11, 12)
    step, want, got = _v2_step(world, [[20, 20], [11]], logits, guard=False)
    assert _tokens(want, 0) == [20, 20, 20], _tokens(want, 0)
    for r in range(2):
        assert _tokens(got, r) == _tokens(want, r), (r, _tokens(got, r), "pristine", _tokens(want, r))


def v2_defect2_sampled():
    # (b) sampled requests with a temperature other than 1, top-k, top-p, min-p are walked
    env(DDTREE_PATCH_CHAIN_AS_TREE="1")
    sps = [SamplingParams(temperature=0.7, max_tokens=64), SamplingParams(temperature=1.0, top_k=5, max_tokens=64),
           SamplingParams(temperature=0.9, top_p=0.8, min_p=0.05, seed=3, max_tokens=64)]
    world = V2World(sps, vocab=V, k=K)
    step, want, got = _v2_step(world, [[11, 12]] * 3, _rows(11, 12, 13).repeat(3, 1), guard=False)
    assert step.engaged and not step.fallbacks, (step.engaged, step.fallbacks)


def v2_defect2_watermark():
    # (c) watermarking (0.33+): seeded sampled requests keep vLLM's (watermarked) draws
    env(DDTREE_PATCH_CHAIN_AS_TREE="1")
    sps = [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=64) for i in range(8)]
    world = V2World(sps, vocab=V, k=K, watermark_key=1234)
    logits = torch.randn(3 * 8, V, generator=torch.Generator().manual_seed(5))
    step, want, got = _v2_step(world, [[11, 12]] * 8, logits, guard=False)
    for r in range(8):
        assert _tokens(got, r) == _tokens(want, r), (r, _tokens(got, r), "pristine", _tokens(want, r))


def run(family: str) -> None:
    if family == "v1":
        check("defect1_tree_beside_a_chain_request_stays_a_tree")(v1_defect1)
        check("defect3_v1_logit_bias_at_the_final_token")(v1_defect3)
        check("defect3_v1_min_p_at_the_final_token")(v1_defect3_min_p)
        check("defect4_v1_sampled_step_has_no_host_sync")(v1_defect4)
        check("defect4_attach_takes_device_tensors")(attach_device_tensor)
    else:
        check("defect1_tree_beside_a_chain_request_stays_a_tree")(v2_defect1)
        check("defect2_v2_logits_processing_in_tree_mode")(v2_defect2_processing)
        check("defect2_v2_sampled_requests_walked")(v2_defect2_sampled)
        try:
            from vllm.config.watermarking import WatermarkConfig  # noqa: F401
        except ImportError:  # before 0.33
            return
        check("defect2_v2_watermarking_stays_on_vllms_sampler")(v2_defect2_watermark)
