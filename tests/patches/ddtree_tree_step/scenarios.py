"""The request sets of ``run_tree_engine.py`` (SCENARIO): prompts as token ids and the keyword
arguments of each request's ``SamplingParams`` (``detokenize=False, ignore_eos=True`` are added
by the runner). No vLLM import: the tests read ``MIXED`` to know which requests are chain-routed.

* ``basic``: ``n_prompts`` greedy prompts of 8, 13, 18, ... tokens, ``max_tokens`` each.
* ``mixed`` (block size 32 in the tests): two shared prefixes (80 tokens = 2.5 blocks, 96 tokens
  = 3 blocks) under most prompts, two long unique prompts (170 and 200 tokens: several prefill
  chunks at a small ``max_num_batched_tokens``), short ones; ``max_tokens`` from 8 to 48 (requests
  finish at different steps, waiting ones join); greedy tree requests mixed with requests the
  tree walk does not take on V1 (repetition / presence / frequency penalties -> ``penalties``,
  sample logprobs -> ``logprobs``: docs/patches/tree-walk-hook.md "One rule, per request"), which
  vLLM's chain sampler verifies in the same steps.
* ``sampled``: ``n_prompts`` copies of one short prompt, temperature 1.0 (no top-k / top-p),
  ``max_tokens`` each, request ``i`` seeded ``seed_base + i``.
* ``seeded`` (issue 33): the first ``n_prompts`` of ``SEEDED``: a seeded temperature-1 request, then
  a seeded neighbour with a repetition penalty (chain-routed).
* ``with_logprobs`` (issue 33): the first ``n_prompts`` of ``WITH_LOGPROBS``: greedy requests, the
  second asking for sample logprobs (chain-routed).
"""
from __future__ import annotations


def _ids(n: int, salt: int) -> list[int]:
    return [(7 * j + 13 * salt + (j * j) % 11) % 997 + 2 for j in range(n)]


PREFIX_A, PREFIX_B = _ids(80, 1), _ids(96, 2)
# (prompt, max_tokens, extra sampling parameters, the chain reason the tree walk reports for it)
MIXED = [
    (PREFIX_A + _ids(6, 10), 24, {}, None),
    (PREFIX_A + _ids(11, 11), 40, {}, None),
    (PREFIX_A + _ids(3, 12), 16, {"repetition_penalty": 1.3}, "penalties"),
    (PREFIX_B + _ids(20, 13), 12, {}, None),
    (_ids(200, 14), 30, {}, None),
    (PREFIX_B + _ids(7, 15), 20, {"logprobs": 2}, "logprobs"),
    (_ids(10, 16), 48, {}, None),
    (PREFIX_B + _ids(40, 17), 28, {"presence_penalty": 0.5, "frequency_penalty": 0.3}, "penalties"),
    (_ids(170, 18), 20, {}, None),
    (PREFIX_A + PREFIX_B[:40], 36, {}, None),
    (_ids(15, 19), 8, {}, None),
    (PREFIX_A + _ids(50, 20), 44, {}, None),
]
SAMPLED_PROMPT = [5, 17, 29, 41, 53, 65]
# issue 33: a seeded sampled request (the tree walk takes it) and, with n_prompts 2, a seeded neighbour
# with a repetition penalty (vLLM's chain sampler takes it, in the same steps)
SEEDED = [(_ids(9, 30), dict(temperature=1.0, seed=11)),
          (_ids(12, 31), dict(temperature=1.0, seed=5, repetition_penalty=1.3))]
# issue 33: greedy requests beside one asking for sample logprobs (vLLM's rejection sampler verifies it
# over the whole batch in the same steps); the ``basic`` prompts 0..2 (the tiny target has no near-tie on them)
WITH_LOGPROBS = [([(7 * j + 3 * i) % 997 + 2 for j in range(8 + 5 * i)],
                  dict(temperature=0.0, **({"logprobs": 1} if i == 1 else {}))) for i in range(3)]


def requests(scenario: str, n_prompts: int = 4, max_tokens: int = 32, logprobs: int = 0,
             seed_base: int = 0) -> tuple[list[list[int]], list[dict]]:
    if scenario == "basic":
        prompts = [[(7 * j + 3 * i) % 997 + 2 for j in range(8 + 5 * i)] for i in range(n_prompts)]
        return prompts, [dict(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs or None)] * n_prompts
    if scenario == "mixed":  # logprobs (a no-speculation reference's margins): where a request has none
        return [p for p, *_ in MIXED], [dict(max_tokens=m, temperature=0.0, **({"logprobs": logprobs} if logprobs and
                                                                               "logprobs" not in extra else {}), **extra)
                                        for _, m, extra, _ in MIXED]
    if scenario == "sampled":
        return ([list(SAMPLED_PROMPT) for _ in range(n_prompts)],
                [dict(max_tokens=max_tokens, temperature=1.0, seed=seed_base + i) for i in range(n_prompts)])
    if scenario in ("seeded", "with_logprobs"):
        chosen = (SEEDED if scenario == "seeded" else WITH_LOGPROBS)[:n_prompts]
        return [list(p) for p, _ in chosen], [dict(max_tokens=max_tokens, **kw) for _, kw in chosen]
    raise ValueError(f"unknown SCENARIO {scenario!r}")
