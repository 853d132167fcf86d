"""DDTree's start-up checks: the switch, the ``SpeculativeConfig`` DDTree sizes, and the refusals by name
of what it does not run with (the ddtree-proposer config site calls :func:`configure`; the drafters'
binds in :mod:`.ddtree` call :func:`config_record` and the refusals). Torch-free; reads vLLM only where
a refusal needs the installed release's limit (:func:`v1_max_budget`).

**The switch.** ``DDTREE_PATCH_ENABLE=1`` (plus ``DDTREE_PATCH_BUDGET=N``, default
:data:`DEFAULT_BUDGET`) with a DFlash drafter configured as usual: its ``num_speculative_tokens``
is L, the drafter depth. No vLLM config key is added. Where the ``SpeculativeConfig`` is built
(the front end: ``LLM(...)``, ``vllm serve``), :func:`configure` validates the switch, records
``{"budget": N, "depth": L}`` on the config object (attribute :data:`CONFIG_ATTR`, pickled to the
engine core and the workers with it) and sets ``num_speculative_tokens = N``: the scheduler
(draft slots, lookahead, async placeholders), the runner (``1 + N`` verify rows, draft buffers,
CUDA-graph query length) and the KV slots are sized for N verify nodes per request. Every process
that builds a drafter (:func:`bind_v1`, :func:`bind_v2`) checks that its own environment agrees
with that record; a mismatch is a named error.

**Only where the tree-shaped target step is installed** (issue 13: the ddtree-tree-step patch,
``runtime.tree_step``: the V1 runner of the vLLM 0.24.0-0.33.0 shapes with CPU_ATTN, and of the
0.26.0/0.27.0 shape with FlashAttention 3) does DDTree start:
:func:`configure` ends with :func:`refuse_without_tree_target_step`; elsewhere a chain-shaped
target pass would verify trees with causal attention over node order and linear positions.
``DDTREE_PATCH_CHAIN_AS_TREE=1`` (the tree-walk-hook diagnostic) does not involve this module.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .contract import CONFIG_ATTR, DDTREE_ABI, abi_mismatch, mark
from .switches import ENV_BUDGET, ENV_CHAIN, ENV_ENABLE, DDTreeConfigError, budget_auto, budget_from_env, switch
from .tree_step_coverage import DDTreeNotReady

logger = logging.getLogger("vllm.ddtree_patch")


class DDTreeABIError(RuntimeError):
    pass


def enabled() -> bool:
    """DDTree drafting requested in this process (``DDTREE_PATCH_ENABLE``; a value other than
    0/1 raises DDTreeConfigError)."""
    return switch(ENV_ENABLE)


def check_abi(ddtree_abi: int) -> None:
    if ddtree_abi != DDTREE_ABI:
        raise DDTreeABIError(abi_mismatch("ddtree-proposer", ddtree_abi, DDTREE_ABI))


def mode_line() -> str:
    """The mode and budget, for the boot guard's line (raises DDTreeConfigError on a bad budget)."""
    enable, chain = switch(ENV_ENABLE), switch(ENV_CHAIN)
    if enable and chain:
        raise DDTreeConfigError(f"ddtree-patch: {ENV_ENABLE}=1 and {ENV_CHAIN}=1 exclude each other "
                                "(DDTree trees, or the chain-as-tree diagnostic)")
    if enable:
        return f"mode=ddtree budget={'auto:' if budget_auto() else ''}{budget_from_env()}"
    if chain:
        return "mode=chain-as-tree"
    return "mode=off"


# ---- start-up: the SpeculativeConfig ---------------------------------------------------------
def _conflicts(spec) -> list[str]:
    """vLLM options DDTree cannot run with (named reasons; empty: none)."""
    out = []
    if getattr(spec, "num_speculative_tokens_per_batch_size", None):
        out.append("dynamic speculative decoding (num_speculative_tokens_per_batch_size): the number "
                   "of draft tokens per request must be the node budget in every step")
    if getattr(spec, "draft_sample_method", "greedy") == "probabilistic":
        out.append("draft_sample_method='probabilistic': a tree is built from the drafter's logits, "
                   "not from sampled drafts (and the chain fallback's draft probabilities would cover "
                   "L positions, not the N verified nodes)")
    if getattr(spec, "use_local_argmax_reduction", False):
        out.append("use_local_argmax_reduction: the drafter never materialises the logits a tree is "
                   "built from")
    if getattr(spec, "use_heterogeneous_vocab", False):
        out.append("use_heterogeneous_vocab: tree tokens would need the draft->target vocabulary map")
    return out


def configure(spec, *, ddtree_abi: int) -> None:
    """Called from ``SpeculativeConfig._verify_args`` for a DFlash drafter when DDTree is
    requested: validate, record ``{budget, depth}``, size vLLM for N verify nodes."""
    check_abi(ddtree_abi)
    mode_line()  # exclusive switches, budget syntax
    budget = budget_from_env()
    record = vars(spec).get(CONFIG_ATTR)
    if record is not None:  # configured already (the same object validated twice)
        if record["budget"] != budget or spec.num_speculative_tokens != budget:
            raise DDTreeConfigError(f"ddtree-patch: the speculative config was set up for budget "
                                    f"{record['budget']}, this process asks for {budget}")
        return
    bad = _conflicts(spec)
    if bad:
        raise DDTreeConfigError("ddtree-patch: DDTree (DDTREE_PATCH_ENABLE=1) cannot run with " + "; ".join(bad))
    depth = int(spec.num_speculative_tokens)
    vars(spec)[CONFIG_ATTR] = {"budget": budget, "depth": depth, "abi": DDTREE_ABI}
    spec.num_speculative_tokens = budget
    logger.warning("ddtree-patch: DDTree drafting: %d verify nodes per request (scheduler, runner and KV "
                   "slots sized for num_speculative_tokens=%d); the DFlash drafter drafts %d positions "
                   "(its num_speculative_tokens=%d)", budget, budget, min(depth, budget), depth)
    refuse_without_tree_target_step()


# ---- issue 13: DDTree starts only where the tree-shaped target step is installed ------------
def refuse_without_tree_target_step() -> None:
    """The target must score the trees as trees (ancestor-only attention, depth positions, KV
    compaction: the ddtree-tree-step patch, ``runtime.tree_step``). Where that step is not
    installed (another vLLM shape, VLLM_USE_V2_MODEL_RUNNER=1 where V2 has no tree step, the patch not applied) a
    chain-shaped target pass would score the trees against the wrong prefixes: refuse to start,
    naming why. The rest is checked where it is known: a V2 runner without the tree step's V2
    sites (every V2 shape but vLLM 0.26.0's) refuses when it is built (a ddtree-tree-step site),
    and the runner checks the attention backend and the layers' options when it binds the step."""
    from .tree_step_coverage import not_installed_reason

    why = not_installed_reason()
    if why is not None:
        raise DDTreeNotReady(
            "ddtree-patch: DDTREE_PATCH_ENABLE=1 is refused: DDTree drafting (ddtree-proposer) is "
            "installed, but the tree-shaped target step (ancestor-only attention, depth positions, "
            f"KV compaction; issue 13) is not: {why}; the target would score the trees as chains. Unset "
            f"{ENV_ENABLE} to run DFlash, or use {ENV_CHAIN}=1 for the chain-as-tree diagnostic.")


def config_record(spec_config, where: str) -> dict:
    """The configure() record, checked against this process's environment."""
    record = vars(spec_config).get(CONFIG_ATTR)
    if not enabled():
        raise DDTreeConfigError(
            f"ddtree-patch: {where}: the speculative config was built with DDTree (budget "
            f"{record['budget']}) but {ENV_ENABLE} is not set in this process (pid {os.getpid()}): the "
            "tree-walk hook would verify trees as chains; set the same DDTREE_PATCH_* variables "
            "in every vLLM process")
    if record is None:
        raise DDTreeConfigError(
            f"ddtree-patch: {where}: {ENV_ENABLE}=1 here (pid {os.getpid()}) but the speculative config "
            "was built without DDTree (in a process where it was not set, or by a vLLM the "
            "ddtree-proposer patch is not applied to): set the DDTREE_PATCH_* variables where "
            "the engine is created, and run `ddtree-patch verify`")
    if record.get("abi") != DDTREE_ABI:
        raise DDTreeABIError(f"ddtree-patch: {where}: config record of ABI {record.get('abi')}, "
                             f"runtime ABI {DDTREE_ABI}")
    budget = budget_from_env()
    if budget != record["budget"] or spec_config.num_speculative_tokens != budget:
        raise DDTreeConfigError(
            f"ddtree-patch: {where}: {ENV_BUDGET} is {budget} in this process (pid {os.getpid()}) "
            f"but the speculative config was built for budget {record['budget']} "
            f"(num_speculative_tokens {spec_config.num_speculative_tokens})")
    return record


def v1_max_budget() -> int | None:
    """The largest budget the V1 runner of the installed vLLM can verify: vLLM's V1 rejection
    sampler asserts ``max_spec_len <= MAX_SPEC_LEN`` (128 in 0.20.0-0.33.0), and it verifies, in
    the same steps as the walk and over the whole batch, every request the tree walk does not take
    (sample logprobs, penalties, ..., a request drafted without a tree). None where the module or
    the constant is absent."""
    try:
        from vllm.v1.sample import rejection_sampler
    except ImportError:
        return None
    limit = getattr(rejection_sampler, "MAX_SPEC_LEN", None)
    return int(limit) if isinstance(limit, int) else None


def refuse_v1_budget(budget: int) -> None:
    """At start (the V1 drafter's bind): a budget the V1 rejection sampler cannot take is refused
    by name, with the largest one that works, instead of a bare AssertionError at the first step
    that falls back to it."""
    limit = v1_max_budget()
    if limit is not None and budget > limit:
        raise DDTreeConfigError(
            f"ddtree-patch: {ENV_BUDGET}={budget} is refused on vLLM's V1 runner: its rejection sampler, "
            f"which verifies the requests the tree walk does not take (sample logprobs, penalties, "
            f"bad words, structured output, ...) over the whole batch in the same steps, takes at most "
            f"MAX_SPEC_LEN = {limit} draft tokens per request (vllm/v1/sample/rejection_sampler.py). "
            f"The largest budget on this runner is {limit}")


# ---- DDTREE_PATCH_BUDGET=auto (issue 35.2) ------------------------------------------------------
AUTO_BUDGETS = (15, 31, 63)  # the candidates above the spine (1 + N a multiple of 16), up to N


def auto_candidates(budget: int, depth: int) -> tuple[int, ...]:
    """The budgets ``auto`` chooses among: the spine-only chain (``depth`` = L_eff nodes: a prefix of
    b <= s nodes of a spine-first tree is a chain), the AUTO_BUDGETS between it and N, and N."""
    return tuple(sorted({depth, budget} | {b for b in AUTO_BUDGETS if depth < b <= budget}))


# Where the budget of a step is decided (docs/notebook/budget-auto-study.md): vLLM's scheduler sets the
# next step's draft count (``num_spec_tokens_to_schedule``, vLLM's dynamic-SD count: the async scheduler's
# placeholders follow it); ddtree-proposer's scheduler site sets it from the policy (runtime.budget_site).
# The runner must draft that many: the code that says so, per runner file.
SCHEDULER_PY = "vllm/v1/core/sched/scheduler.py"
SCHEDULER_SITE = "bind_scheduler("  # the scheduler call site's runtime call
RUNNER_FOLLOWS = {"V1": ("vllm/v1/worker/gpu_model_runner.py", "num_speculative_tokens=num_spec_tokens_to_schedule"),
                  "V2": ("vllm/v1/worker/gpu/model_runner.py", "num_speculative_tokens=num_spec_tokens,")}


def _source(rel: str) -> str | None:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        return (Path(list(spec.submodule_search_locations)[0]).parent / rel).read_text(encoding="utf-8")
    except OSError:
        return None


def refuse_auto(kind: str, vllm_config: Any) -> None:
    """Where ``auto`` cannot decide the budget of a step, refuse it at start, by name. It runs where vLLM's
    scheduler carries ddtree-proposer's budget site (vLLM 0.24.0-0.34.0), the runner drafts the count the
    scheduler asks for (V1 0.24.0-0.33.0; V2 from 0.32.0: 0.26.0-0.31.0's V2 runner drafts a fixed count),
    and the scheduler shares its process with the drafter (one GPU: no tensor, pipeline or data parallelism),
    under sync and async scheduling alike."""
    why = None
    sched = _source(SCHEDULER_PY)
    runner_py, follows = RUNNER_FOLLOWS.get(kind, (None, None))
    runner = _source(runner_py) if runner_py else None
    par = getattr(vllm_config, "parallel_config", None)
    if sched is None or mark("ddtree-proposer") not in sched or SCHEDULER_SITE not in sched:
        why = (f"a vLLM scheduler without ddtree-proposer's budget site ({SCHEDULER_PY}: `ddtree-patch verify`; it "
               "applies to vLLM 0.24.0-0.34.0)")
    elif runner is None or follows not in runner:
        why = (f"this vLLM's {kind} runner ({runner_py}), which drafts a fixed count instead of the scheduler's "
               "(the V1 runner of 0.24.0-0.33.0 and the V2 runner from 0.32.0 follow it)")
    elif par is not None and max(int(getattr(par, "tensor_parallel_size", 1) or 1),
                                 int(getattr(par, "pipeline_parallel_size", 1) or 1),
                                 int(getattr(par, "data_parallel_size", 1) or 1)) > 1:
        why = ("tensor, pipeline or data parallelism (the policy runs in the scheduler's process, beside the "
               "drafter: one GPU)")
    if why is not None:
        raise DDTreeConfigError(
            f"ddtree-patch: {ENV_BUDGET}=auto is refused with {why} (docs/notebook/budget-auto-study.md). Pin a "
            f"budget ({ENV_BUDGET}=31)")
