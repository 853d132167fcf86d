"""Tree verification with vLLM's own semantics on the V2 runner (``GPUModelRunner.sample``,
0.24.0-0.33.0).

vLLM's V2 rejection sampler processes every logits row of a request the same way,
``Sampler.apply_sampling_params(logits, expanded_idx_mapping, [idx_mapping,] idx_mapping_np, pos,
input_ids, expanded_local_pos[, seq_lens_upper_bound_np])``: logit bias / allowed token ids /
``min_tokens`` (the row's position ``pos``), penalties and bad words (the chain's history read
from the previous rows), the thinking budget (0.28+), custom processors (0.33), temperature,
min_p, top-k/top-p; on 0.28+ only when some request of the batch needs it
(``needs_logits_processing``), on 0.26 in place in the logits' dtype.

The tree path calls **that same function** on the step's rows, with each tree node's position
set to ``root position + depth`` (the position the token would have on its branch), so every
row-local stage is exactly upstream's per node; the walk then verifies the tree on the processed
rows (greedy: their argmax; sampled: their softmax, in-kernel Philox keyed by the request's seed
and position, as V2 keys its Gumbel noise). The history-reading stages are the chain's, so
requests that use them are verified by the chain sampler.

Tree-ok on V2: greedy, temperature, top-k, top-p, min-p, logit bias (these two: vLLM rejects
them when a drafter is configured), allowed token ids, ``min_tokens``, seeds, prompt logprobs;
block verification (0.28+) walks too (the same output distribution). Chain (reason): sample logprobs / logprob token ids
(``logprobs``), penalties, bad words, thinking budget, structured output (``grammar``), custom
logits processors (0.33), synthetic and FLy modes, watermarking, adaptive verification,
sampling masks, trace replay.

Structured output on V2 is known to the runner only through the grammar bitmask it applies in
``sample`` just before the hook: the VerifyStep wraps the runner's
``structured_outputs_worker.apply_grammar_bitmask`` (an instance attribute, set at bind) to see
which requests have a grammar; a drafter must call ``hook.verify_step(runner)`` before the first
step of a request so that its prefill step is seen.
"""

from __future__ import annotations

import inspect

import numpy as np

from .step_rows import chain_rows

NATIVE_PROCS = ("LogitBiasState", "PenaltiesState", "BadWordsState")


def _processor(sampler, attr: str, cls: str):
    obj = getattr(sampler, attr, None)
    if obj is not None:
        return obj
    for proc in getattr(sampler, "logits_processors", ()) or ():
        if type(proc).__name__ == cls:
            return proc
    return None


def watch_grammar(step) -> None:
    """Record which requests get a grammar bitmask (V2 applies it in ``sample`` before the hook)."""
    step._grammar_seen = set()
    worker = getattr(step.runner, "structured_outputs_worker", None)
    fn = getattr(worker, "apply_grammar_bitmask", None)
    if fn is None or getattr(fn, "_ddtree_watch", False):
        return

    def apply_grammar_bitmask(logits, input_batch, grammar_req_ids, *args, **kwargs):
        for rid in grammar_req_ids or ():
            if rid not in step._grammar_seen:
                step._grammar_seen.add(rid)
                step._reason_cache.pop(rid, None)
        return fn(logits, input_batch, grammar_req_ids, *args, **kwargs)

    apply_grammar_bitmask._ddtree_watch = True
    worker.apply_grammar_bitmask = apply_grammar_bitmask


def watch_removals(step) -> None:
    """Forget a request when the runner removes it (finished or preempted: ``_remove_request`` calls
    ``req_states.remove_request``): its cached decision, a pending tree, its grammar mark (a resumed
    request's grammar bitmask is applied again, and seen, in its first sampling step). Wraps the
    instance attribute, as watch_grammar does; without it the cache's cap still bounds it."""
    states = getattr(step.runner, "req_states", None)
    fn = getattr(states, "remove_request", None)
    if fn is None or getattr(fn, "_ddtree_watch", False):
        return

    def remove_request(req_id, *args, **kwargs):
        step.forget(req_id)
        return fn(req_id, *args, **kwargs)

    remove_request._ddtree_watch = True
    states.remove_request = remove_request


def runner_reason(step) -> str | None:
    runner = step.runner
    rs = getattr(runner, "rejection_sampler", None)
    sampler = getattr(runner, "sampler", None)
    if getattr(rs, "synthetic_conditional_rates", None) is not None:
        return "synthetic"
    if getattr(rs, "fly_window_size", None):
        return "fly"
    if getattr(rs, "watermark_key", None) is not None:
        return "watermark"
    if getattr(rs, "enable_adaptive_verification", False):
        return "adaptive-verification"
    if getattr(sampler, "return_sampling_mask", False):
        return "sampling-mask"
    if getattr(sampler, "trace_replay_state", None) is not None:
        return "trace-replay"
    procs = getattr(sampler, "logits_processors", None)
    if procs is not None and any(type(p).__name__ not in NATIVE_PROCS for p in procs):
        return "custom-logits-processors"
    return None


def request_reason(step, req_id: str) -> str | None:
    runner = step.runner
    idx = getattr(getattr(runner, "req_states", None), "req_id_to_index", {}).get(req_id)
    if idx is None:
        return "unknown-request"
    if req_id in getattr(step, "_grammar_seen", ()):
        return "grammar"
    sampler = runner.sampler
    one = np.asarray([idx])
    try:
        from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS
    except ImportError:  # pragma: no cover
        NO_LOGPROBS = -1
    if sampler.sampling_states.max_num_logprobs(one) != NO_LOGPROBS:
        return "logprobs"
    lti = getattr(sampler, "logprob_token_ids_state", None)
    if lti is not None and lti.max_num_token_ids(one) > 0:
        return "logprobs"
    pen = _processor(sampler, "penalties_state", "PenaltiesState")
    if pen is not None and bool(pen.use_penalty[idx]):
        return "penalties"
    bad = _processor(sampler, "bad_words_state", "BadWordsState")
    if bad is not None and int(bad.num_bad_words.np[idx]) > 0:
        return "bad-words"
    tb = getattr(sampler, "thinking_budget_state", None)
    if tb is not None and getattr(tb, "enabled", False) and bool(tb.use_thinking_budget[idx]):
        return "thinking-budget"
    return None


def _call(fn, **available):
    """Call a vLLM function with the arguments its signature names (they differ per release)."""
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in available.items() if k in params})


def _output(**kw):
    from dataclasses import fields

    from vllm.v1.worker.gpu.sample.output import SamplerOutput

    names = {f.name for f in fields(SamplerOutput)}
    return SamplerOutput(**{k: v for k, v in kw.items() if k in names})


def sample(step, logits, ib, draft_logits=None, invalid_drafts=None):
    import torch

    runner = step.runner
    try:
        sampler = runner.sampler
        states = sampler.sampling_states
        idx_np = np.asarray(ib.idx_mapping_np)
        cu_np = np.asarray(ib.cu_num_logits_np)
        B = int(ib.num_reqs)
        req_ids = list(ib.req_ids[:B])
    except AttributeError:
        step.engaged = False
        step._count("unsupported")
        return None
    counts = np.diff(cu_np[: B + 1]).astype(np.int64)
    num_draft = counts - 1
    reason = runner_reason(step)
    if reason is None and (B == 0 or (counts < 1).any() or logits.shape[0] != int(cu_np[B])):
        reason = "layout"
    if reason is not None:
        step.all_chain(req_ids, [int(x) for x in num_draft.clip(0)], reason)
        return None
    ro = step.route(req_ids, [int(x) for x in num_draft], None, undrafted_walk=False)
    step.account(ro)
    if not ro.tree.any():
        step.engaged = False
        step.chain_steps += 1
        return None
    rejection_sampler = runner.rejection_sampler
    mixed = not ro.tree.all()
    num_nans = None
    if getattr(sampler, "compute_nans", False) and not mixed:
        from vllm.v1.worker.gpu.metrics.logits import get_num_nans

        num_nans = get_num_nans(logits)
    x_in = logits
    chain_out = None
    if mixed:  # vLLM's own sampler for the chain requests (the whole batch, original logits)
        x_in = logits.clone()  # 0.26 processes logits in place
        args = (logits, ib, draft_logits) + ((invalid_drafts,) if invalid_drafts is not None else ())
        chain_out = rejection_sampler(*args)
        step.chain_steps += 1

    parents, depth, has_child, node_rows, root_rows, tree_mask = step.tree_tensors(ro)
    dev = logits.device
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler as rs_mod

    prefill_len = sampler.req_states.prefill_len.gpu
    if hasattr(rs_mod, "gather_draft_sampled"):  # 0.32+: placeholder drafts become -1
        draft_sampled, pos = rs_mod.gather_draft_sampled(
            ib.input_ids, ib.positions, ib.logits_indices, ib.expanded_idx_mapping,
            ib.expanded_local_pos, prefill_len)
    else:
        draft_sampled = ib.input_ids[ib.logits_indices]
        pos = ib.positions[ib.logits_indices]
    local = ib.expanded_local_pos
    # A node's position on its branch: root position + depth (a chain's rows keep theirs). The root's
    # row is read, not derived: with the tree step the tree rows' positions are already ctx + depth.
    logit_rows = torch.arange(pos.shape[0], device=pos.device)
    pos_tree = pos[logit_rows - local.to(torch.int64)] + depth.to(pos.dtype)
    upper = getattr(ib, "seq_lens_cpu_upper_bound", None)  # a host tensor (0.31+), as vLLM reads it
    x = _call(sampler.apply_sampling_params, logits=x_in, expanded_idx_mapping=ib.expanded_idx_mapping,
              idx_mapping=ib.idx_mapping, idx_mapping_np=idx_np, pos=pos_tree, input_ids=draft_sampled,
              expanded_local_pos=local,
              seq_lens_upper_bound_np=np.asarray(upper) if upper is not None else None)
    argmax = x.argmax(dim=-1)
    draft = draft_sampled[node_rows].to(torch.int32)
    cu = (ib.cu_num_logits[1: B + 1] - torch.arange(1, B + 1, device=dev)).to(torch.int32)
    steps = getattr(rejection_sampler, "num_speculative_steps", None)
    W = max(int(steps if steps is not None else ro.maxn), ro.maxn) + 1
    temps = np.asarray(states.temperature.np[idx_np[:B]], dtype=np.float32)
    if (temps[ro.tree] == 0).all():
        out, num_acc, rows = step.verify(draft, parents, cu, W, ro.maxn, target_argmax=argmax)
    else:
        probs = x.softmax(dim=-1, dtype=torch.float32)
        is_greedy = step.upload(temps == 0)
        seeds = states.seeds.gpu[ib.idx_mapping].to(torch.int64)
        positions = pos[root_rows].to(torch.int64)
        out, num_acc, rows = step.verify(draft, parents, cu, W, ro.maxn, target_argmax=argmax,
                                         target_probs=probs, is_greedy=is_greedy, seeds=seeds,
                                         positions=positions)
    sampled = out.to(torch.int64)
    raw_sampled = (num_acc + 1).to(torch.int32)
    logprobs = None
    if chain_out is not None:
        chain = chain_out.sampled_token_ids
        sampled = torch.where(tree_mask.unsqueeze(1), sampled[:, : chain.shape[1]].to(chain.dtype), chain)
        chain_sampled = chain_out.num_sampled.to(torch.int32)
        raw_sampled = torch.where(tree_mask, raw_sampled, chain_sampled)
        chain_acc = (chain_sampled - 1).clamp(min=0).to(num_acc.dtype)
        rows = torch.where(tree_mask.unsqueeze(1), rows, chain_rows(root_rows, chain_acc, W))
        num_acc = torch.where(tree_mask, num_acc, chain_acc)
        logprobs = chain_out.logprobs_tensors  # only chain requests ask for logprobs
        num_nans = chain_out.num_nans
    step.keep(ro, rows, num_acc, tree_mask)
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected

    num_sampled, num_rejected = get_num_sampled_and_rejected(
        raw_sampled, ib.seq_lens, ib.cu_num_logits, ib.idx_mapping, prefill_len)
    return _output(sampled_token_ids=sampled, logprobs_tensors=logprobs, num_nans=num_nans,
                   num_sampled=num_sampled, num_rejected=num_rejected)
