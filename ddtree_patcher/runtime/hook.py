"""The runtime the tree-walk-hook call sites call (``patches/tree_walk_hook.py``).

Imported only when DDTree is requested (``DDTREE_PATCH_ENABLE=1`` or
``DDTREE_PATCH_CHAIN_AS_TREE=1``) on a runner's first speculative step; this module imports
nothing heavy at import time (``HOOK_ABI`` is read by ``verify`` and the boot guard), torch and
vLLM only inside :func:`bind`.

The call site (one per runner) does, once per runner::

    self.ddtree_hook = bind(self, "V1" | "V2", hook_abi=<ABI written into the call site>)

and each speculative step::

    sampler_output = self.ddtree_hook.sample_v1(spec_decode_metadata, draft_probs, logits,
                                                sampling_metadata)          # V1 _sample
    sampler_output = self.ddtree_hook.sample_v2(logits, input_batch, draft_logits[, invalid])
                                                                            # V2 sample
    if sampler_output is None: <vLLM's chain rejection sampler, unchanged>

**The tree channel.** A drafter attaches the tree of each request for the draft tokens it
proposes, before the step that verifies them::

    from ddtree_patcher.runtime import hook
    step = hook.tree_step(runner)          # the runner's TreeStep (None: DDTree not requested)
    step.attach(req_id, parent_ids)        # local parents of nodes 1..n in vLLM's draft-token
                                           # order: 0 = the root (last verified token), node j's
                                           # parent is in [0, j-1]

The hook engages for a step only when every request of the batch carries a tree whose node
count equals its number of draft tokens (a request with no draft tokens carries the empty tree)
and every request's sampling parameters are tree-safe (see :data:`FALLBACK_REASONS`); otherwise
``sample_*`` returns None and vLLM's chain sampler runs. Trees are consumed by the step that
verifies them. ``DDTREE_PATCH_CHAIN_AS_TREE=1`` submits every request's linear draft as the
chain-shaped tree (parent of node j is j-1) instead: greedy output is then identical to vLLM's
chain sampler.

After an engaged step, ``TreeStep`` holds (persistent device buffers, no host sync):
``parent_ids``/``depths`` [max_num_reqs * K] (flat, node order, first ``num_nodes`` valid),
``accepted_rows`` [max_num_reqs, K+1] (logits row of the root and of each accepted node, -1
padded), ``num_accepted`` [max_num_reqs]; host ints ``num_reqs``, ``num_nodes``; ``engaged``.
The next pieces of DDTree (KV and drafter hidden-state compaction, tree attention) read them.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

HOOK_ABI = 2  # the call-site <-> runtime contract; bump on any incompatible change
ENV_ENABLE = "DDTREE_PATCH_ENABLE"
ENV_CHAIN = "DDTREE_PATCH_CHAIN_AS_TREE"
RUNNERS = ("V1", "V2")

logger = logging.getLogger("ddtree_patcher.runtime.hook")
_LIVE: "weakref.WeakSet[TreeStep]" = weakref.WeakSet()


def live_steps() -> list["TreeStep"]:
    """Every TreeStep bound in this process (diagnostics and tests)."""
    return list(_LIVE)

# Why a step falls back to vLLM's chain sampler (counted in TreeStep.fallbacks).
FALLBACK_REASONS = {
    "no-tree": "a request with draft tokens carries no tree (or one of the wrong size)",
    "logprobs": "logprobs requested (per-position logprobs of the tree are not computed yet)",
    "penalties": "presence/frequency/repetition penalties (depend on the branch's prefix)",
    "bad-words": "bad words (depend on the branch's prefix)",
    "allowed-token-ids": "allowed_token_ids / logit bias masks",
    "logits-processors": "logits processors that read output history (min_tokens, thinking budget, ...)",
    "min-p": "min_p (V2)",
    "grammar": "structured output with per-draft validity (V2 invalid_drafts)",
    "synthetic": "synthetic rejection sampling mode",
    "layout": "unexpected logits layout",
    "unsupported": "runner attributes this hook does not know (other vLLM shape)",
}


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def requested() -> bool:
    """DDTree requested in this process (what the call site checks once per runner)."""
    return _flag(ENV_ENABLE) or _flag(ENV_CHAIN)


def chain_as_tree() -> bool:
    return _flag(ENV_CHAIN)


class HookABIError(RuntimeError):
    pass


def check_abi(hook_abi: int) -> None:
    if hook_abi != HOOK_ABI:
        raise HookABIError(
            f"ddtree-patch: this vLLM's tree-walk-hook call site speaks hook ABI {hook_abi}, the "
            f"installed ddtree_patcher speaks ABI {HOOK_ABI}: re-apply the patch with the installed "
            "tool (`ddtree-patch revert && ddtree-patch apply`, then restart vLLM), or install the "
            "ddtree-patch release that applied it")


def bind(runner: Any, kind: str, *, hook_abi: int) -> "TreeStep":
    """Called by the patched call site once per runner when DDTree is requested."""
    check_abi(hook_abi)
    if kind not in RUNNERS:
        raise ValueError(f"ddtree-patch: unknown runner kind {kind!r}")
    step = TreeStep(runner, kind)
    runner.__dict__["ddtree_hook"] = step
    try:
        from importlib.metadata import version as _v
        import vllm

        ver = getattr(vllm, "__version__", None) or _v("vllm")
    except Exception:  # pragma: no cover
        ver = "?"
    line = (f"ddtree-patch: hook active, runner={kind}, vLLM {ver} "
            f"({'chain-as-tree' if step.chain_as_tree else 'tree channel'}; "
            f"{type(runner).__name__}.{'_sample' if kind == 'V1' else 'sample'})")
    logger.warning(line)
    return step


def tree_step(runner: Any) -> "TreeStep | None":
    """The runner's TreeStep, creating it when DDTree is requested (for drafters that attach
    trees before the first verification step); None when DDTree is not requested."""
    step = runner.__dict__.get("ddtree_hook")
    if step is None and requested():
        v2 = type(runner).__module__.endswith(".gpu.model_runner") or hasattr(runner, "req_states")
        step = bind(runner, "V2" if v2 else "V1", hook_abi=HOOK_ABI)
    return step or None


def _use_reference(dev) -> bool:
    """The Triton kernel on CUDA, or on CPU tensors under TRITON_INTERPRET=1; else the reference."""
    return dev.type != "cuda" and not _flag("TRITON_INTERPRET")


class TreeStep:
    """Per-runner tree state: the pending trees (the tree channel) and the last step's result."""

    def __init__(self, runner: Any, kind: str):
        import torch

        self.runner = runner
        self.kind = kind
        self.chain_as_tree = chain_as_tree()
        self.device = torch.device(getattr(runner, "device", "cpu"))
        spec = getattr(runner, "speculative_config", None)
        self.K = int(getattr(spec, "num_speculative_tokens", 0) or 0)
        self.max_num_reqs = int(getattr(runner, "max_num_reqs", 0) or 0) or int(
            getattr(getattr(runner, "scheduler_config", None), "max_num_seqs", 256))
        self._pending: dict[str, list[int]] = {}
        self.fallbacks: dict[str, int] = {}
        self.engaged_steps = 0
        self.engaged = False
        self.num_reqs = 0
        self.num_nodes = 0
        self._alloc(max(self.K, 1))
        _LIVE.add(self)

    # ---- persistent buffers ------------------------------------------------------------------
    def _alloc(self, k: int) -> None:
        import torch

        self.K = max(self.K, k)
        n, dev, i32 = self.max_num_reqs, self.device, torch.int32
        self.parent_ids = torch.zeros(n * self.K, dtype=i32, device=dev)
        self.depths = torch.zeros(n * self.K, dtype=i32, device=dev)
        self.accepted_rows = torch.full((n, self.K + 1), -1, dtype=i32, device=dev)
        self.num_accepted = torch.zeros(n, dtype=i32, device=dev)
        pin = dev.type == "cuda"
        # two pinned staging slots, used in turn: an upload never overwrites host memory that the
        # previous step's asynchronous copy may still be reading
        self._stage = torch.zeros((2, 2, n * self.K), dtype=i32, pin_memory=pin)
        self._slot = 0

    # ---- the tree channel --------------------------------------------------------------------
    def attach(self, req_id: str, parent_ids) -> None:
        """Attach the tree of ``req_id``'s next draft: local parent of nodes 1..n (0 = root)."""
        par = [int(p) for p in (parent_ids.tolist() if hasattr(parent_ids, "tolist") else parent_ids)]
        for j, p in enumerate(par, start=1):
            if not 0 <= p < j:
                raise ValueError(f"ddtree-patch: tree of {req_id!r}: node {j} has parent {p}, "
                                 f"expected 0 <= parent < {j} (parents before children)")
        self._pending[req_id] = par

    def detach(self, req_id: str) -> None:
        self._pending.pop(req_id, None)

    def _trees(self, req_ids, num_draft: list[int]) -> list[list[int]] | None:
        """Parents of every request of the batch, or None (fallback). Consumes the trees."""
        if self.chain_as_tree:
            return [list(range(n)) for n in num_draft]
        trees = [self._pending.pop(r, None) for r in req_ids]
        out = []
        for tree, n in zip(trees, num_draft):
            if n == 0:
                out.append([])
            elif tree is None or len(tree) != n:
                return None
            else:
                out.append(tree)
        return out

    def _fallback(self, reason: str) -> None:
        self.engaged = False
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        if self.fallbacks[reason] == 1:
            logger.info("ddtree-patch: chain sampler for this step: %s", FALLBACK_REASONS[reason])
        return None

    def _upload(self, trees: list[list[int]]):
        """Parents and depths into the persistent device buffers (one H2D copy, no sync)."""
        import torch

        nd = sum(len(t) for t in trees)
        k = max((len(t) for t in trees), default=0)
        if k > self.K or len(trees) > self.max_num_reqs:
            self.max_num_reqs = max(self.max_num_reqs, len(trees))
            self._alloc(k)
        flat_p, flat_d = [], []
        for t in trees:
            depth = [0]
            for p in t:
                depth.append(depth[p] + 1)
            flat_p.extend(t)
            flat_d.extend(depth[1:])
        self._slot ^= 1
        stage = self._stage[self._slot, :, :nd]
        stage[0] = torch.tensor(flat_p, dtype=torch.int32)
        stage[1] = torch.tensor(flat_d, dtype=torch.int32)
        self.parent_ids[:nd].copy_(stage[0], non_blocking=True)
        self.depths[:nd].copy_(stage[1], non_blocking=True)
        self.num_nodes = nd
        return self.parent_ids[:nd]

    def _verify(self, draft_token_ids, parents, cu, width, max_nodes, **kw):
        from ddtree_patcher.kernels import tree_verify, tree_verify_ref

        fn = tree_verify_ref if _use_reference(draft_token_ids.device) else tree_verify
        if fn is tree_verify and draft_token_ids.device.type != "cuda":
            kw.setdefault("block_v", 1 << 16)  # the interpreter: few, large blocks
        return fn(draft_token_ids, parents, cu, width=width, max_num_nodes=max(max_nodes, 1),
                  check_data=False, **kw)

    def _keep(self, num_acc, rows, B: int) -> None:
        W = rows.shape[1]
        if W > self.K + 1 or B > self.max_num_reqs:
            self.max_num_reqs = max(self.max_num_reqs, B)
            self._alloc(W - 1)
        self.accepted_rows[:B, :W].copy_(rows)
        self.num_accepted[:B].copy_(num_acc)
        self.num_reqs = B
        self.engaged = True
        self.engaged_steps += 1

    # ---- V1: GPUModelRunner._sample ----------------------------------------------------------
    def sample_v1(self, metadata, draft_probs, logits, sampling_metadata):
        """vLLM's ``SamplerOutput`` (left-packed ``[B, max_spec_len + 1]`` int32, -1 padded)
        for a tree batch, or None (then vLLM's chain sampler runs)."""
        import torch

        sm = sampling_metadata
        num_draft = list(metadata.num_draft_tokens)
        B = len(num_draft)
        req_ids = list(self.runner.input_batch.req_ids[:B])
        trees = self._trees(req_ids, num_draft)
        if trees is None:
            return self._fallback("no-tree")
        reason = _v1_unsafe(sm, getattr(self.runner, "rejection_sampler", None))
        if reason:
            return self._fallback(reason)
        nd = int(metadata.draft_token_ids.shape[0])
        if logits is None or logits.shape[0] != nd + B or nd != sum(num_draft):
            return self._fallback("layout")
        parents = self._upload(trees)
        W = int(metadata.max_spec_len) + 1
        cu = metadata.cu_num_draft_tokens
        if sm.all_greedy:
            out, num_acc, rows = self._verify(metadata.draft_token_ids, parents, cu, W, W - 1,
                                              target_argmax=logits.argmax(dim=-1))
        else:
            counts = torch.tensor([n + 1 for n in num_draft], device="cpu")
            probs, is_greedy = _v1_probs(logits, sm, metadata, counts)
            coins, inv_noise = _v1_randomness(sm, num_draft, probs.shape[1], logits.device)
            out, num_acc, rows = self._verify(
                metadata.draft_token_ids, parents, cu, W, W - 1,
                target_argmax=logits.argmax(dim=-1), target_probs=probs, is_greedy=is_greedy,
                coins=coins, inv_exp_noise=inv_noise)
        self._keep(num_acc, rows, B)
        from vllm.v1.outputs import SamplerOutput

        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)

    # ---- V2: GPUModelRunner.sample (0.24+) ---------------------------------------------------
    def sample_v2(self, logits, input_batch, draft_logits=None, invalid_drafts=None):
        """V2's ``SamplerOutput`` with ``num_sampled``/``num_rejected`` computed exactly as
        upstream (both 0 for requests still in chunked prefill), or None."""
        import numpy as np
        import torch

        if invalid_drafts is not None:
            return self._fallback("grammar")
        runner = self.runner
        try:
            sampler = runner.sampler
            states = sampler.sampling_states
            idx_np = input_batch.idx_mapping_np
            cu_np = np.asarray(input_batch.cu_num_logits_np)
            B = int(input_batch.num_reqs)
        except AttributeError:
            return self._fallback("unsupported")
        counts = np.diff(cu_np[: B + 1]).astype(np.int64)
        if B == 0 or (counts < 1).any() or logits.shape[0] != int(cu_np[B]):
            return self._fallback("layout")
        num_draft = [int(c) - 1 for c in counts]
        trees = self._trees(list(input_batch.req_ids[:B]), num_draft)
        if trees is None:
            return self._fallback("no-tree")
        reason = _v2_unsafe(sampler, states, idx_np[:B], getattr(runner, "rejection_sampler", None))
        if reason:
            return self._fallback(reason)
        dev = logits.device
        T = int(cu_np[B])
        root_np = cu_np[:B].astype(np.int64)
        node_np = np.setdiff1d(np.arange(T, dtype=np.int64), root_np, assume_unique=True)
        node_rows = torch.from_numpy(node_np).to(dev, non_blocking=True)
        root_rows = torch.from_numpy(root_np).to(dev, non_blocking=True)
        draft = input_batch.input_ids[input_batch.logits_indices[node_rows]].to(torch.int32)
        cu = torch.from_numpy(np.cumsum(num_draft).astype(np.int32)).to(dev, non_blocking=True)
        parents = self._upload(trees)
        steps = getattr(getattr(runner, "rejection_sampler", None), "num_speculative_steps", None)
        W = int(steps if steps is not None else max(num_draft)) + 1
        W = max(W, max(num_draft) + 1)
        temps = np.asarray(states.temperature.np[idx_np[:B]], dtype=np.float32)
        argmax = logits.argmax(dim=-1)
        if (temps == 0).all():
            out, num_acc, rows = self._verify(draft, parents, cu, W, W - 1, target_argmax=argmax)
        else:
            rep = torch.from_numpy(counts)
            t_rows = torch.from_numpy(np.where(temps == 0, 1.0, temps).astype(np.float32))
            t_rows = t_rows.repeat_interleave(rep).to(dev, non_blocking=True)
            x = logits.to(torch.float32) / t_rows.unsqueeze(1)
            k_np = np.asarray(states.top_k.np[idx_np[:B]])
            p_np = np.asarray(states.top_p.np[idx_np[:B]], dtype=np.float32)
            k = p = None
            if (k_np != logits.shape[1]).any():
                k = torch.from_numpy(k_np.astype(np.int64)).repeat_interleave(rep).to(dev, non_blocking=True)
            if (p_np != 1.0).any():
                p = torch.from_numpy(p_np).repeat_interleave(rep).to(dev, non_blocking=True)
            x = _top_k_top_p(x, k, p)
            probs = torch.softmax(x, dim=-1)
            is_greedy = torch.from_numpy(temps == 0).to(dev, non_blocking=True)
            seeds = states.seeds.gpu[input_batch.idx_mapping].to(torch.int64)
            positions = input_batch.positions[input_batch.logits_indices[root_rows]].to(torch.int64)
            out, num_acc, rows = self._verify(draft, parents, cu, W, W - 1, target_argmax=argmax,
                                              target_probs=probs, is_greedy=is_greedy,
                                              seeds=seeds, positions=positions)
        self._keep(num_acc, rows, B)
        from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        req_states = getattr(runner, "req_states", None) or sampler.req_states
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            (num_acc + 1).to(torch.int32), input_batch.seq_lens, input_batch.cu_num_logits,
            input_batch.idx_mapping, req_states.prefill_len.gpu)
        num_nans = None
        if getattr(sampler, "compute_nans", False):
            from vllm.v1.worker.gpu.metrics.logits import get_num_nans

            num_nans = get_num_nans(logits)
        return SamplerOutput(sampled_token_ids=out.to(torch.int64), logprobs_tensors=None,
                             num_nans=num_nans, num_sampled=num_sampled, num_rejected=num_rejected)


# ---- sampling parameters -------------------------------------------------------------------------
def _v1_unsafe(sm, rejection_sampler) -> str | None:
    if getattr(rejection_sampler, "synthetic_mode", False):
        return "synthetic"
    if sm.max_num_logprobs is not None or getattr(sm, "logprob_token_ids", None):
        return "logprobs"
    if not sm.no_penalties:
        return "penalties"
    if sm.bad_words_token_ids:
        return "bad-words"
    if sm.allowed_token_ids_mask is not None:
        return "allowed-token-ids"
    for proc in getattr(sm.logitsprocs, "non_argmax_invariant", ()):
        if getattr(proc, "min_toks", None):
            return "logits-processors"
    holder = getattr(sm, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return "logits-processors"
    return None


def _v2_unsafe(sampler, states, idx_np, rejection_sampler) -> str | None:
    import numpy as np

    if getattr(rejection_sampler, "synthetic_conditional_rates", None) is not None:
        return "synthetic"
    try:
        from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS
    except ImportError:
        NO_LOGPROBS = -1
    if states.max_num_logprobs(idx_np) != NO_LOGPROBS:
        return "logprobs"
    needs = getattr(sampler, "needs_logits_processing", None)
    if needs is not None and bool(np.any(needs[idx_np])):
        return "penalties"
    min_p = getattr(states, "min_p", None)
    if min_p is not None and bool(np.any(min_p.np[idx_np] != 0.0)):
        return "min-p"
    return None


def _top_k_top_p(x, k, p):
    if k is None and p is None:
        return x
    from vllm.v1.sample.ops import topk_topp_sampler as ops

    if x.device.type == "cuda":
        return ops.apply_top_k_top_p(x, k, p)
    return ops.apply_top_k_top_p_pytorch(x, k, p)  # vLLM's CPU path


def _v1_probs(logits, sm, metadata, counts):
    """Per-row probabilities after temperature, top-k and top-p (vLLM's own ops), one row per
    node including each root, and the per-request greedy mask."""
    import torch

    dev = logits.device
    rep = counts.to(dev, non_blocking=True)
    temp = sm.temperature
    is_greedy = temp == 0
    t_rows = torch.where(is_greedy, torch.ones_like(temp), temp).repeat_interleave(rep)
    x = logits.to(torch.float32) / t_rows.unsqueeze(1)
    k = sm.top_k.repeat_interleave(rep) if sm.top_k is not None else None
    p = sm.top_p.repeat_interleave(rep) if sm.top_p is not None else None
    x = _top_k_top_p(x, k, p)
    return torch.softmax(x, dim=-1), is_greedy


def _v1_randomness(sm, num_draft: list[int], vocab: int, dev):
    """Coins (one per row) and 1/Exp(1) noise (one row per request) drawn like vLLM's
    rejection sampler: the global generator, then each seeded request's own generator."""
    import torch

    B = len(num_draft)
    T = sum(num_draft) + B
    coins = torch.rand(T, dtype=torch.float64, device=dev)
    q = torch.empty((B, vocab), dtype=torch.float32, device=dev).exponential_()
    if sm.generators:
        starts = [0]
        for n in num_draft:
            starts.append(starts[-1] + n + 1)
        for i, gen in sm.generators.items():
            if i < B:
                coins[starts[i]:starts[i + 1]].uniform_(generator=gen)
                q[i].exponential_(generator=gen)
    return coins, q.reciprocal_()
