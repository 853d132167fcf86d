"""DDTree drafting on top of DFlash: the runtime the ddtree-proposer call sites call
(``patches/ddtree_proposer.py``; ``docs/patches/ddtree-proposer.md``).

Importing this module imports neither torch nor vLLM (the boot guard reads ``DDTREE_ABI`` and
parses the budget); the device work imports torch lazily.

**The drafter** drafts ``L_eff = min(L, N)`` positions (a tree of N nodes is at most N deep): the
drafter's own depth attribute (V1 ``num_speculative_tokens``, V2 ``num_speculative_steps``) is
pinned to ``L_eff`` when it is built (and, on 0.24+ V1, again after ``propose`` stores the
runner's per-call K), so DFlash runs ``1 + L_eff`` queries per request and produces
``[B * L_eff, V]`` position logits. Where DFlash turns them into a chain (an argmax per
position), :meth:`DDTreeDrafter.tree_tokens` builds the DDTree tree instead
(``ddtree_patcher.kernels.build_tree``, budget N) and hands vLLM ``[B, N]`` node tokens in node
order (parents before children), and the parents ``[B, N]`` to the runner's ``VerifyStep``
(``hook.verify_step(runner).attach``: device tensors, no copy). The node order is spine-first
(:data:`SPINE_FIRST`): the chain of the drafter's per-depth top-1 from the root is nodes 1..s,
the other nodes follow in the builder's pop order. An accepted path that follows the top-1
therefore already sits where vLLM's chain bookkeeping expects it, and the tree step's KV
compaction moves only the nodes after the first accepted non-top-1 node.

**``DDTREE_PATCH_BUDGET=auto``** (or ``auto:N``; issue 35.2, docs/notebook/budget-auto-study.md): vLLM is
sized for N as above, and every step vLLM's scheduler sets the next step's draft count b
(``num_spec_tokens_to_schedule``) from :meth:`DDTreeDrafter.scheduled_budget` (the scheduler's budget
site, ``runtime.budget_site``): ``runtime.budget_policy`` picks b among :func:`auto_candidates` from the
step times between picks and the accounting's prefix-budget counts (:meth:`DDTreeDrafter.next_budget`).
The runner asks the drafter for b tokens (V1: :meth:`DDTreeDrafter.steps_for`; V2 from 0.32.0: the
runner keeps the first b), which are the first b nodes of every tree (node order: a subtree; b <= s:
the spine, DFlash's chain). Where the runner drafts a fixed count :func:`refuse_auto` stops the engine
at the drafter's bind, by name.

**Per request**: a request the tree walk can verify (``VerifyStep.tree_ok``) gets its tree; any
other request gets a chain (node j's parent is j - 1) made of DFlash's own per-position argmax
for nodes 1..L_eff and the filler token :data:`FILLER_TOKEN` for nodes L_eff+1..N, and is not
attached (vLLM's chain sampler verifies it). Padding nodes of a tree (fewer than N nodes of
nonzero draft probability) carry token -1 in the builder's output; they are handed to vLLM as
:data:`FILLER_TOKEN` (an input id must be a valid token). Both are lossless: a verifier accepts a
draft token only when it is the token the target itself samples at that node's parent (tree walk
or chain rejection rule), so what a filler node "proposes" can only change how many tokens are
accepted, never which tokens are emitted.

All of it runs on the device with static shapes: no ``.item()``, ``.tolist()``, ``.cpu()``,
``nonzero`` or boolean indexing; the only host work is on host-known data (request ids, the
per-request tree-ok flags, uploaded with a non-blocking copy when some row is a chain; on V1 a batch
of trees only is handed over as the builder made it).

The start-up checks (the switch, :func:`configure`, the refusals) live in :mod:`.ddtree_config`; this
module re-exports the names the call sites import.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

from .contract import CONFIG_ATTR, DDTREE_ABI  # noqa: F401 - the call sites' contract
from .ddtree_config import (  # noqa: F401 - the start-up checks: the call sites' and the guard's names
    AUTO_BUDGETS, DDTreeABIError, auto_candidates, check_abi, config_record, configure, enabled, mode_line,
    refuse_auto, refuse_v1_budget, refuse_without_tree_target_step, v1_max_budget,
)
from .budget_site import register_drafter
from .switches import (  # noqa: F401  (DEFAULT_BUDGET, MAX_BUDGET: this module's public names)
    DEFAULT_BUDGET, ENV_AUTO_CYCLE, ENV_BUDGET, ENV_CHAIN, ENV_ENABLE, MAX_BUDGET, DDTreeConfigError, auto_cycle,
    budget_auto, budget_from_env, switch,
)
from .tree_step_coverage import DDTreeNotReady  # noqa: F401 - raised by the start-up checks, this module's public name

FILLER_TOKEN = 0  # chain nodes past the drafter's depth, and tree padding nodes
# node order of the trees (build_tree's spine_first): the top-1 chain first, so the compaction
# after the walk moves only what follows the first accepted non-top-1 node (docs/tree-step.md)
SPINE_FIRST = True

logger = logging.getLogger("vllm.ddtree_patch")


# ---- the drafters ----------------------------------------------------------------------------
def bind_v1(drafter: Any, runner: Any, *, ddtree_abi: int) -> "DDTreeDrafter":
    """``DFlashProposer.__init__`` (V1), right after ``super().__init__``: pin the drafter's
    depth (``num_speculative_tokens``) to L_eff before DFlash sizes its query buffers."""
    check_abi(ddtree_abi)
    spec = drafter.speculative_config
    if spec.method != "dflash":
        raise DDTreeConfigError(f"ddtree-patch: DDTree drafts with DFlash drafters only (method={spec.method!r})")
    record = config_record(spec, type(drafter).__name__)
    refuse_v1_budget(record["budget"])
    from .tree_step_coverage import refuse_uncovered_config

    refuse_uncovered_config(drafter.vllm_config)  # FULL graphs, KV connectors: before any capture
    if budget_auto():
        refuse_auto("V1", drafter.vllm_config)
    dd = DDTreeDrafter("V1", record["budget"], record["depth"], drafter.device,
                       drafter.vllm_config.scheduler_config.max_num_seqs, runner)
    drafter.num_speculative_tokens = dd.depth
    return dd


def fit_query_buffers(drafter: Any, compilation_config: Any) -> int:
    """Before CUDA graphs are captured (the tree step's ``capture_model`` site): DFlash (V1) sizes
    its query buffers (``positions``, ``_slot_mapping_buffer``) for ``max_query_tokens = max_num_seqs
    * (1 + L_eff)`` rows, but its graph dispatch pads a batch to the next capture size, and with
    DDTree the capture sizes are rounded to multiples of N + 1 for FULL decode graphs (vLLM's
    ``adjust_cudagraph_sizes_for_spec_decode``), not of L_eff + 1: a full batch (e.g. 32 x 16 = 512
    query rows) pads to 527 = 31 x 17 and the drafter's forward would read positions and slots
    past the buffers (RoPE index asserts, KV written to stray slots; measured on the H200). The
    buffers grow to the smallest capture size that holds ``max_query_tokens`` (zeros past the old
    rows: position 0, and the padding rows' slots are set by DFlash per step). Returns the rows."""
    import torch

    if drafter is None or drafter.__dict__.get("ddtree_proposer") is None:
        return 0
    max_q = int(getattr(drafter, "max_query_tokens", 0) or 0)
    sizes = [int(s) for s in (getattr(compilation_config, "cudagraph_capture_sizes", None) or ()) if int(s) >= max_q]
    need = min(sizes) if sizes and max_q else max_q
    for name in ("positions", "_slot_mapping_buffer"):
        buf = drafter.__dict__.get(name)
        if isinstance(buf, torch.Tensor) and buf.ndim == 1 and buf.shape[0] < need:
            grown = torch.zeros(need, dtype=buf.dtype, device=buf.device)
            grown[:buf.shape[0]].copy_(buf)
            drafter.__dict__[name] = grown
            logger.info("ddtree-patch: DFlash drafter %s grown from %d to %d rows (graph padding of %d query rows)",
                        name, buf.shape[0], need, max_q)
    return need


def bind_v2(speculator: Any, *, ddtree_abi: int) -> "DDTreeDrafter":
    """``DFlashSpeculator.__init__`` (V2), right after ``super().__init__``: the base class sized
    ``draft_tokens`` ``[max_num_reqs, N]`` (it holds the node tokens); pin
    ``num_speculative_steps`` to L_eff before DFlash sizes its query and sample buffers."""
    check_abi(ddtree_abi)
    spec = speculator.speculative_config
    name = type(speculator).__name__
    if spec.method != "dflash" or name != "DFlashSpeculator":
        raise DDTreeConfigError(f"ddtree-patch: DDTree drafts with the V2 DFlashSpeculator only "
                                f"(method={spec.method!r}, speculator {name})")
    record = config_record(spec, name)
    if budget_auto():
        refuse_auto("V2", getattr(speculator, "vllm_config", None))
    dd = DDTreeDrafter("V2", record["budget"], record["depth"], speculator.device, speculator.max_num_reqs)
    if tuple(speculator.draft_tokens.shape) != (speculator.max_num_reqs, dd.budget):
        raise DDTreeConfigError(f"ddtree-patch: {name}.draft_tokens is {tuple(speculator.draft_tokens.shape)}, "
                                f"expected ({speculator.max_num_reqs}, {dd.budget})")
    speculator.num_speculative_steps = dd.depth
    dd.alloc_v2()
    return dd


def _use_kernel(dev) -> bool:
    """The Triton builder on CUDA, or on CPU tensors under TRITON_INTERPRET=1; else the reference."""
    return dev.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class DDTreeDrafter:
    """Per-drafter DDTree state: budget N, depth L_eff, the tree builder, the tree channel."""

    def __init__(self, kind: str, budget: int, drafter_depth: int, device, max_num_reqs: int, runner=None):
        import torch

        self.kind = kind
        self.budget = int(budget)  # N: verify nodes per request
        self.drafter_depth = int(drafter_depth)  # L: the drafter's configured depth
        self.depth = min(self.drafter_depth, self.budget)  # L_eff: positions drafted
        self.topk = None  # per-depth top-K of the builder (None: its default, min(N, 8))
        self.device = torch.device(device)
        self.max_num_reqs = int(max_num_reqs)
        self._runner = weakref.ref(runner) if runner is not None else None
        self._attached: list[str] = []  # request ids attached by the last step
        self.chain_parents = torch.arange(self.budget, dtype=torch.int32, device=self.device)
        self.steps = 0
        self.tree_rows = 0  # requests drafted as trees (attached)
        self.chain_rows = 0  # requests drafted as chains
        self.last_tree = None  # the last DraftTree (diagnostics)
        # DDTREE_PATCH_BUDGET=auto: each step's budget from the policy (or the diagnostic cycle)
        self.auto = budget_auto()
        self.policy = None
        self.cycle = auto_cycle() if self.auto else None
        self.budget_steps: dict[int, int] = {}  # budget -> drafting steps that handed it to vLLM
        self._cycle_i = 0
        self._picks: list = []  # (budget, B, host time) of the last two picks: the step time each took
        self._seen = None  # the accounting's prefix snapshot at the previous pick
        self.k = self.budget  # auto: the draft tokens the runner asked for this step (the scheduler's pick)
        self._step = None  # the runner's VerifyStep (its accounting feeds the policy), from the first draft
        if self.auto:
            from .budget_policy import BudgetPolicy

            cands = auto_candidates(self.budget, self.depth)
            if self.cycle and max(self.cycle) > self.budget:
                raise DDTreeConfigError(f"ddtree-patch: {ENV_AUTO_CYCLE} budgets must be at most N = {self.budget}, "
                                        f"got {self.cycle}")
            self.policy = BudgetPolicy(cands, chain=self.depth, max_budget=self.budget)
        register_drafter(self)  # the scheduler's budget site finds its policy there
        logger.info("ddtree-patch: DDTree drafter bound (%s): budget %s%d, drafter depth %d (configured %d)%s",
                    kind, "auto, at most " if self.auto else "", self.budget, self.depth, self.drafter_depth,
                    f"; candidates {', '.join(map(str, self.policy.candidates))}" if self.policy else "")

    # ---- device side: logits -> tokens -------------------------------------------------------
    def build(self, logits):
        """Position logits ``[B * L_eff, V]`` (request-major) -> (tree DraftTree, node tokens
        ``[B, N]`` int64 with padding -> FILLER_TOKEN)."""
        import torch

        from ddtree_patcher.kernels import build_tree, build_tree_ref

        L, N = self.depth, self.budget
        V = logits.shape[-1]
        x = logits.view(-1, L, V)
        fn = build_tree if _use_kernel(x.device) else build_tree_ref
        tree = fn(x, N, self.topk, ancestor_mask=False, spine_first=SPINE_FIRST)
        tokens = tree.tokens.to(torch.int64).clamp_min(FILLER_TOKEN)
        self.last_tree = tree
        return tree, tokens

    def chain_of(self, tree):
        """DFlash's own drafts from the tree's per-depth top-1 (its argmax): ``[B, N]`` int64, the
        L_eff drafted positions then FILLER_TOKEN."""
        import torch

        spine = tree.topk_ids[:, :, 0].to(torch.int64).clamp_min(FILLER_TOKEN)
        chain = torch.full((spine.shape[0], self.budget), FILLER_TOKEN, dtype=torch.int64,
                           device=spine.device)
        chain[:, :self.depth] = spine
        return chain

    def select(self, ok, tree_tokens, tree_parents, chain_tokens):
        """Per row: the tree (``ok[b]``) or the chain. ``ok`` bool ``[B]`` on the device."""
        import torch

        tokens = torch.where(ok[:, None], tree_tokens, chain_tokens)
        parents = torch.where(ok[:, None], tree_parents, self.chain_parents[None, :])
        return tokens, parents

    def choose(self, ok, tree_tokens, tree):
        """:meth:`select` from host flags ``ok``; when every row is a tree (the steady state) the tree
        tensors as they are: no chain, no upload, no select."""
        if all(ok):
            return tree_tokens, tree.parents
        return self.select(self.upload(ok), tree_tokens, tree.parents, self.chain_of(tree))

    def upload(self, flags):
        """A host list of bools as a device tensor (pinned, non-blocking: no sync)."""
        import numpy as np
        import torch

        t = torch.from_numpy(np.asarray(flags, dtype=np.bool_))
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    # ---- the tree channel (host: request ids and flags only) --------------------------------
    def _channel(self, runner, req_ids):
        """(VerifyStep, tree-ok flags) for the batch's requests."""
        from . import hook

        step = hook.verify_step(runner)
        if step is None:  # cannot happen: _record checked DDTREE_PATCH_ENABLE
            raise DDTreeConfigError("ddtree-patch: the runner has no tree channel")
        for rid in self._attached:  # trees of the previous step that no verify step consumed
            step.detach(rid)
        self._step = step
        return step, step.tree_ok(list(req_ids))

    def _attach(self, step, req_ids, ok, parents) -> None:
        rows = [rid if flag else None for rid, flag in zip(req_ids, ok)]
        self._attached = [rid for rid in rows if rid is not None]
        if self._attached:
            step.attach(rows, parents)
        self.steps += 1
        self.tree_rows += len(self._attached)
        self.chain_rows += len(rows) - len(self._attached)

    # ---- V1: SpecDecodeBaseProposer.propose ---------------------------------------------------
    def steps_for(self, num_speculative_tokens: int) -> int:
        """0.24+ ``propose(num_speculative_tokens, ...)``: the runner's K must be the budget (``auto``: the
        scheduler's pick, at most the budget: the first K nodes are handed over); the drafter drafts
        L_eff positions."""
        k = int(num_speculative_tokens)
        if k != self.budget and not (self.auto and 1 <= k <= self.budget):
            raise DDTreeConfigError(
                f"ddtree-patch: the runner asked the drafter for {num_speculative_tokens} draft tokens "
                f"per request, DDTree verifies exactly {self.budget} (its node budget)")
        self.k = k
        return self.depth

    def propose_v1(self, drafter, sample_hidden_states):
        """Where DFlash returns ``argmax(logits).view(-1, L)``: the node tokens ``[B, N]``."""
        logits = drafter.model.compute_logits(sample_hidden_states)
        tree, tokens = self.build(logits)
        B = tokens.shape[0]
        runner = self._runner() if self._runner is not None else None
        req_ids = list(runner.input_batch.req_ids[:B])
        step, ok = self._channel(runner, req_ids)
        tokens, parents = self.choose(ok, tokens, tree)  # the builder's tensors: new every step
        if self.k < self.budget:  # auto: the scheduler's pick b, the first b nodes (node order: a subtree;
            tokens, parents = tokens[:, :self.k].contiguous(), parents[:, :self.k]  # b <= s: the spine)
        self._attach(step, req_ids, ok, parents)
        return tokens

    def budget_note(self) -> str:
        """``auto`` and the budgets picked since the previous call (the accounting's log line)."""
        last = getattr(self, "_noted", {})
        now = dict(self.budget_steps)
        self._noted = now
        picks = ", ".join(f"{b}: {n - last.get(b, 0)}" for b, n in sorted(now.items()) if n > last.get(b, 0))
        return f"auto ({picks} steps)" if picks else "auto"

    def scheduled_budget(self, B: int) -> int:
        """``auto``, the scheduler's pick (``runtime.budget_site``): the budget of the drafts the step being
        scheduled produces. The interval since the previous pick is the previous step, which verified the
        drafts of the pick before that (the same under sync and async scheduling, in steady state)."""
        return self.next_budget(self._step, B, lag=2)

    def next_budget(self, step, B: int, lag: int = 1) -> int:
        """``auto``: the budget of the step these drafts go to (host only). The policy is fed the step
        time since the previous pick, as the cost of the budget picked ``lag`` picks ago (the one the
        timed step verified), and the accounting's prefix-budget counts as the host sees them (CPU: now;
        CUDA: a landed copy); ``step`` (the VerifyStep) None before the first draft: no acceptance yet."""
        import time

        now = time.perf_counter()
        if self._picks:  # the interval since the last pick: the step scheduled then, of its batch size
            _, B0, t0 = self._picks[-1]
            timed = self._picks[-lag] if len(self._picks) >= lag else None
            if timed is not None and timed[0] in self.policy.candidates:  # (a diagnostic cycle may take others)
                self.policy.observe_cost(timed[0], B0, now - t0)
        acc = getattr(step, "accounting", None)
        if acc is not None:
            if acc.prefix_budgets != self.policy.candidates:
                acc.track(self.policy.candidates)
                acc.budget_note = self.budget_note
                self._seen = None
            budgets, sums, reqs = acc.prefix_snapshot()
            if self._seen is not None:
                for b, s1, r1, s0, r0 in zip(budgets, sums, reqs, *self._seen):
                    if r1 > r0:
                        self.policy.observe(b, r1 - r0, s1 - s0)
            self._seen = (sums, reqs)
        if self.cycle:
            b = self.cycle[self._cycle_i % len(self.cycle)]
            self._cycle_i += 1
            self.policy.decide(B)  # the policy still runs (its log), its pick is overridden
        else:
            b = self.policy.pick(B)
        self._picks = (self._picks + [(b, B, now)])[-2:]
        self.budget_steps[b] = self.budget_steps.get(b, 0) + 1
        return b

    # ---- V2: DFlashSpeculator._generate_draft (in the FULL draft graph) + the runner ----------
    def alloc_v2(self) -> None:
        import torch

        R, dev = self.max_num_reqs, self.device
        self.parents_v2 = torch.zeros(R, self.budget, dtype=torch.int32, device=dev)
        self.chain_v2 = torch.zeros(R, self.budget, dtype=torch.int64, device=dev)

    def draft_v2(self, speculator, sample_hidden_states, num_reqs: int) -> None:
        """Replaces the argmax and the write of ``draft_tokens``: writes the node tokens into
        ``speculator.draft_tokens[:num_reqs]`` (``[R, N]``) and the parents and the chain into
        persistent buffers (fixed addresses: this runs inside the captured draft graph)."""
        logits = speculator.model.compute_logits(sample_hidden_states)
        tree, tokens = self.build(logits)
        speculator.draft_tokens[:num_reqs] = tokens
        self.parents_v2[:num_reqs] = tree.parents
        self.chain_v2[:num_reqs] = self.chain_of(tree)

    def tokens_v2(self, runner, input_batch, draft_tokens):
        """``GPUModelRunner.sample_tokens``, before ``req_states.draft_tokens[idx_mapping] =
        draft_tokens``: per request the tree (attached) or the chain; returns ``[num_reqs, N]``."""
        num_reqs = draft_tokens.shape[0]
        req_ids = list(input_batch.req_ids[:num_reqs])
        step, ok = self._channel(runner, req_ids)
        # always a select: its output is a new tensor, so the attached trees are not views of the
        # persistent buffers the next draft graph replay overwrites
        tokens, parents = self.select(self.upload(ok), draft_tokens, self.parents_v2[:num_reqs],
                                      self.chain_v2[:num_reqs])
        self._attach(step, req_ids, ok, parents)
        return tokens
