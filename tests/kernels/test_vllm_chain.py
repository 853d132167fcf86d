"""A chain-shaped tree gives exactly what vLLM 0.28.0's chain sampler gives.

Uses the official wheel's ``vllm.v1.sample.rejection_sampler.rejection_sample``
(run through the Triton interpreter). The test FAILS if vLLM cannot be imported,
unless ``DDTREE_SKIP_VLLM_IMPORT_TESTS=1``.
"""

from __future__ import annotations

import torch

from ddtree_patcher.kernels import tree_verify


def _chain_batch(B, K, V, g, match_p):
    """B chains of K draft tokens plus full [T, V] logits (T = B*(K+1)) whose
    argmax follows the draft with probability match_p per position."""
    ns = [int(torch.randint(0, K + 1, (1,), generator=g)) if b % 3 else K for b in range(B)]
    toks, logits_rows, last_rows = [], [], []
    for n in ns:
        d = torch.randint(0, V, (n,), generator=g)
        toks.append(d)
        rows = torch.randn(n + 1, V, generator=g)
        for i in range(n):
            if float(torch.rand(1, generator=g)) < match_p:
                rows[i, d[i]] += 8.0
        logits_rows.append(rows)
    tok = torch.cat(toks).to(torch.int32) if toks else torch.zeros(0, dtype=torch.int32)
    cu = torch.cumsum(torch.tensor(ns), 0).to(torch.int32)
    par = torch.cat([torch.arange(n, dtype=torch.int32) for n in ns])  # node j -> j-1
    full = torch.cat(logits_rows)
    is_last = torch.zeros(full.shape[0], dtype=torch.bool)
    row = 0
    for n in ns:
        row += n + 1
        is_last[row - 1] = True
    return ns, tok, par, cu, full, is_last


def _metadata(rs, B, greedy, gens):
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=None if greedy else torch.ones(B), all_greedy=greedy, all_random=not greedy,
        top_p=None, top_k=None, generators=gens, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(B),
        presence_penalties=torch.zeros(B), repetition_penalties=torch.ones(B),
        output_token_ids=[[] for _ in range(B)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=None,
    )


def test_chain_greedy_matches_vllm(vllm_rejection_sampler):
    rs = vllm_rejection_sampler
    g = torch.Generator().manual_seed(0)
    B, K, V = 48, 7, 64
    ns, tok, par, cu, full, is_last = _chain_batch(B, K, V, g, match_p=0.75)
    am = full.argmax(-1)
    bonus = am[is_last].to(torch.int32).view(B, 1)
    ref = rs.rejection_sample(tok, ns, K, cu, None, full[~is_last].contiguous(), bonus,
                              _metadata(rs, B, True, {}))
    out, acc, rows = tree_verify(tok, par, cu, target_argmax=am, width=K + 1)
    assert torch.equal(out, ref), f"\nours={out}\nvllm={ref}"
    assert int(acc.max()) == K  # some chains fully accepted (bonus path exercised)


def test_chain_sampled_matches_vllm(vllm_rejection_sampler):
    """Random (target-only) chain: same uniforms and exponential noise as vLLM's
    per-request generators -> identical tokens (acceptance, recovery and bonus)."""
    rs = vllm_rejection_sampler
    g = torch.Generator().manual_seed(1)
    B, K, V = 24, 6, 48
    ns, tok, par, cu, full, is_last = _chain_batch(B, K, V, g, match_p=0.6)
    probs = full.softmax(dim=-1, dtype=torch.float32)
    seeds = [1000 + b for b in range(B)]
    # Replay vLLM's draws: per request, n uniforms (fp64) then V exponentials (fp32).
    coins = torch.full((full.shape[0],), 0.5, dtype=torch.float64)
    inv = torch.ones(B, V)
    row = 0
    for b, n in enumerate(ns):
        gb = torch.Generator().manual_seed(seeds[b])
        if n > 0:
            coins[row:row + n] = torch.empty(n, dtype=torch.float64).uniform_(generator=gb)
            inv[b] = torch.empty(V, dtype=torch.float32).exponential_(generator=gb).reciprocal()
        row += n + 1
    # Bonus token as vLLM's main sampler would draw it: here the same race on the last row.
    bonus = torch.argmax(probs[is_last] * inv, -1).to(torch.int32).view(B, 1)
    gens = {b: torch.Generator().manual_seed(seeds[b]) for b in range(B)}
    ref = rs.rejection_sample(tok, ns, K, cu, None, full[~is_last].contiguous(), bonus,
                              _metadata(rs, B, False, gens))
    out, acc, _ = tree_verify(tok, par, cu, target_probs=probs, coins=coins, inv_exp_noise=inv,
                              width=K + 1, block_v=64)
    # n = 0 requests: vLLM emits only the bonus; ours samples the root row (same race).
    assert torch.equal(out, ref), f"\nours={out}\nvllm={ref}"
    assert 0 < int((acc > 0).sum()) and int((acc < torch.tensor(ns)).sum()) > 0
