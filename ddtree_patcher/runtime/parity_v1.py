"""Tree verification with vLLM's own semantics on the V1 runner (``GPUModelRunner._sample``).

What vLLM's V1 chain sampler applies to a request with drafts (``RejectionSampler.forward``, the
same in 0.20.0-0.33.0): rows that have a draft after them ("target rows") get
``apply_logits_processors`` (allowed-token-ids mask, penalties, bad words, ``min_tokens``, the
thinking budget) and ``apply_sampling_constraints`` (temperature with 0 -> 1, top-k, top-p);
the last row ("bonus row") goes through the ``Sampler`` (allowed ids, bad words, every
non-argmax-invariant logits processor such as logit bias and min_tokens, penalties, then
temperature, argmax-invariant processors such as min_p, top-k/top-p). Logit bias and min_p
therefore act on the bonus token only.

The tree path reproduces that per node: a node with children is a target row (the same
allowed-ids mask, the same temperature, vLLM's own ``apply_top_k_top_p``), and when the walk
ends at a node without children its final token is drawn by **vLLM's own Sampler** on that row
(one row per request, the layout of vLLM's bonus rows). Acceptance at target rows uses the
walk's target-only rule (the same distribution as vLLM's ``NO_DRAFT_PROBS`` rule: accept a child
with probability ``p(child)``, else draw from ``p`` without the children), so a chain submitted as
a tree gives the same greedy tokens and the same output distribution.

Tree-ok on V1: greedy, temperature, top-k, top-p, min-p, logit bias, allowed token ids, seeds,
prompt logprobs. Chain (reason): sample logprobs (``logprobs``), penalties, bad words,
``min_tokens``, thinking budget, structured output (``grammar``), custom logits processors,
synthetic and FLy modes, sampled drafts in chain-as-tree mode (``draft-probs``). (With a drafter
configured vLLM rejects min-p and logit bias requests, ``SamplingParams._validate_spec_decode``,
and ``build_logitsprocs`` builds only ``MinTokensLogitsProcessor``: both reach the step only at the
sampler level, where the final-token Sampler call applies whatever processors are built.)

Seeds: a request's random stream is its own, whatever else is in the batch. A walked request's
coins and noise come from its own generator (a request without draft tokens draws only its final
token, with vLLM's Sampler: what vLLM's samplers draw for it, in a speculative step or not); a
seeded request verified by vLLM's sampler is drawn only by vLLM's rejection sampler (its generator
advances exactly as upstream's). In a mixed step vLLM's rejection sampler and the final-token
Sampler call each sample every row of the batch: each is handed the generators of the rows it owns
and a throwaway generator for every other seeded row (:func:`split_generators`), so no generator
advances in the sampler that does not own its row, and each call sees as many generators as vLLM
would (vLLM's CPU sampler ignores them all unless every row has one).
"""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np

from .step_rows import chain_rows

BUILTIN_PROCS = ("vllm.v1.sample.logits_processor.builtin",)


def runner_reason(step) -> str | None:
    runner = step.runner
    rs = getattr(runner, "rejection_sampler", None)
    if getattr(rs, "synthetic_mode", False):
        return "synthetic"
    if getattr(rs, "fly_window_size", None):
        return "fly"
    procs = getattr(getattr(getattr(runner, "input_batch", None), "logitsprocs", None), "all", None)
    for proc in procs or ():
        if type(proc).__module__ not in BUILTIN_PROCS:
            return "custom-logits-processors"
    return None


def request_reason(step, req_id: str) -> str | None:
    state = getattr(step.runner, "requests", {}).get(req_id)
    sp = getattr(state, "sampling_params", None)
    if sp is None:
        return "unknown-request" if state is None else "unsupported"
    return params_reason(sp)


def params_reason(sp) -> str | None:
    """The chain reason of one request's ``SamplingParams`` on V1 (None: tree-ok)."""
    if sp.logprobs is not None or getattr(sp, "logprob_token_ids", None):
        return "logprobs"
    if sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0:
        return "penalties"
    if sp.bad_words or getattr(sp, "_bad_words_token_ids", None):
        return "bad-words"
    if sp.min_tokens:
        return "min-tokens"
    if getattr(sp, "thinking_token_budget", None) is not None:
        return "thinking-budget"
    if getattr(sp, "structured_outputs", None) is not None or getattr(sp, "guided_decoding", None) is not None:
        return "grammar"
    return None


def _bonus_metadata(sm, generators):
    """The batch's SamplingMetadata for the final-token Sampler call: no logprobs, no thinking
    budget state updates (tree requests have none; chain requests' rows are discarded), the
    tree requests' generators and throwaway ones for the seeded chain requests (a chain request's
    seeded generator advances exactly as upstream's: by vLLM's rejection sampler alone)."""
    names = {f.name for f in fields(sm)}
    kw = {"max_num_logprobs": None, "generators": generators}
    if "logprob_token_ids" in names:
        kw["logprob_token_ids"] = None
    if "thinking_budget_state_holder" in names:
        kw["thinking_budget_state_holder"] = None
    return replace(sm, **kw)


def split_generators(generators: dict, owned) -> dict:
    """The batch's generators for one of the two samplers of a mixed step: the rows ``owned(i)``
    keep their own generator, every other seeded row gets a throwaway one (its output from this
    sampler is discarded). A generator is never advanced by the sampler that does not own its row,
    and the call sees as many generators as vLLM would: vLLM's CPU sampler (0.28:
    ``TopKTopPSampler.forward_cpu``) honours per-request generators only when every row of the call
    has one, and would otherwise draw every row, seeded or not, from the global generator."""
    import torch

    out = {}
    for i, gen in generators.items():
        if owned(i):
            out[i] = gen
        else:
            out[i] = torch.Generator(device=gen.device)
            out[i].manual_seed(0)
    return out


def randomness(generators, counts: np.ndarray, vocab: int, dev):
    """Coins (one per row, fp64) and 1/Exp(1) noise (one row per request) drawn like vLLM's
    rejection sampler: the global generator, then each seeded tree request's own generator, except
    for requests without draft tokens (``counts`` 1: no coin or noise is read for them; like
    vLLM's rejection sampler, draw nothing from their generator)."""
    import torch

    B = len(counts)
    T = int(counts.sum())
    coins = torch.rand(T, dtype=torch.float64, device=dev)
    q = torch.empty((B, vocab), dtype=torch.float32, device=dev).exponential_()
    if generators:
        starts = np.concatenate([[0], np.cumsum(counts)])
        for i, gen in generators.items():
            if i < B and counts[i] > 1:
                coins[int(starts[i]):int(starts[i + 1])].uniform_(generator=gen)
                q[i].exponential_(generator=gen)
    return coins, q.reciprocal_()


def sample(step, metadata, draft_probs, logits, sm):
    import torch

    runner = step.runner
    num_draft = [int(n) for n in metadata.num_draft_tokens]
    B = len(num_draft)
    req_ids = list(runner.input_batch.req_ids[:B])
    nd = int(metadata.draft_token_ids.shape[0])
    reason = runner_reason(step)
    if reason is None and step.chain_as_tree and draft_probs is not None:
        reason = "draft-probs"
    if reason is None and (logits is None or logits.shape[0] != nd + B or nd != sum(num_draft)):
        reason = "layout"
    if reason is not None:
        step.all_chain(req_ids, num_draft, reason)
        return None
    ro = step.route(req_ids, num_draft, None)
    step.account(ro)
    if not ro.tree.any():
        step.engaged = False
        step.chain_steps += 1
        return None
    rejection_sampler = runner.rejection_sampler
    chain_out = None
    if not ro.tree.all():  # vLLM's own sampler for the chain requests (the whole batch) ...
        walked = [i for i in sm.generators if i < B and ro.tree[i]]
        chain_sm = replace(sm, generators=split_generators(sm.generators, lambda i: not (i < B and ro.tree[i]))) \
            if walked else sm
        chain_out = rejection_sampler(metadata, draft_probs, logits, chain_sm)  # ... with their generators only
        step.chain_steps += 1

    parents, _, has_child, node_rows, root_rows, tree_mask = step.tree_tensors(ro, depths=False)
    dev = logits.device
    W = int(metadata.max_spec_len) + 1
    counts = ro.num_draft + 1
    tree_gens = {i: g for i, g in sm.generators.items() if i < B and ro.tree[i]}
    bonus_gens = split_generators(sm.generators, lambda i: i < B and ro.tree[i])  # the final-token Sampler call
    if sm.all_greedy and sm.allowed_token_ids_mask is None:
        x = logits  # argmax of the logits as they are (a float32 copy would pick the same ids)
    else:
        # Target rows as vLLM processes them: allowed-ids mask, temperature (0 -> 1), top-k/top-p.
        row_req = step.upload(np.repeat(np.arange(B, dtype=np.int64), counts))
        x = logits.to(torch.float32, copy=True)
        if sm.allowed_token_ids_mask is not None:
            x.masked_fill_(sm.allowed_token_ids_mask[row_req], float("-inf"))
        if not sm.all_greedy:
            from vllm.v1.sample import rejection_sampler as rs_mod

            temp = sm.temperature
            temp = torch.where(temp == 0, torch.ones_like(temp), temp)
            x.div_(temp[row_req].unsqueeze(-1))
            k = sm.top_k[row_req] if sm.top_k is not None else None
            p = sm.top_p[row_req] if sm.top_p is not None else None
            x = rs_mod.apply_top_k_top_p(x, k, p)
    argmax = x.argmax(dim=-1)
    draft = metadata.draft_token_ids
    cu = metadata.cu_num_draft_tokens
    if sm.all_greedy:
        out, num_acc, rows = step.verify(draft, parents, cu, W, ro.maxn, target_argmax=argmax)
    else:
        probs = x.softmax(dim=-1, dtype=torch.float32)
        coins, inv_noise = randomness(tree_gens, counts, probs.shape[1], dev)
        out, num_acc, rows = step.verify(draft, parents, cu, W, ro.maxn, target_argmax=argmax,
                                         target_probs=probs, is_greedy=sm.temperature == 0,
                                         coins=coins, inv_exp_noise=inv_noise)
    # The walk ended at a node without children: its token is vLLM's bonus token, drawn by
    # vLLM's own Sampler on that row (logit bias, min_p, ... apply there, as upstream).
    col = num_acc.to(torch.int64).unsqueeze(1)
    final_rows = rows.to(torch.int64).gather(1, col).squeeze(1)
    is_leaf = ~has_child[final_rows]
    bonus = rejection_sampler.sampler(logits=logits[final_rows], sampling_metadata=_bonus_metadata(sm, bonus_gens),
                                      predict_bonus_token=True).sampled_token_ids.view(-1)
    out.scatter_(1, col, torch.where(is_leaf, bonus.to(out.dtype), out.gather(1, col).squeeze(1)).unsqueeze(1))

    logprobs = None
    if chain_out is not None:
        chain = chain_out.sampled_token_ids
        chain_acc = ((chain != -1).sum(dim=1) - 1).to(num_acc.dtype)
        out = torch.where(tree_mask.unsqueeze(1), out, chain)
        rows = torch.where(tree_mask.unsqueeze(1), rows, chain_rows(root_rows, chain_acc, W))
        num_acc = torch.where(tree_mask, num_acc, chain_acc)
        logprobs = chain_out.logprobs_tensors  # only chain requests ask for logprobs
    step.keep(ro, rows, num_acc, tree_mask)
    from vllm.v1.outputs import SamplerOutput

    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)
