"""The runtime the tree-walk-hook call sites call (``patches/tree_walk_hook.py``).

Imported only when DDTree is requested (``DDTREE_PATCH_ENABLE=1`` or
``DDTREE_PATCH_CHAIN_AS_TREE=1``) on a runner's first speculative step (or earlier, by a drafter
calling :func:`tree_step`); importing this module imports neither torch nor vLLM (``HOOK_ABI``
is read by ``verify`` and the boot guard).

The call site (one per runner) does, once per runner::

    self.ddtree_hook = bind(self, "V1" | "V2", hook_abi=<ABI written into the call site>)

and each speculative step::

    sampler_output = self.ddtree_hook.sample_v1(spec_decode_metadata, draft_probs, logits,
                                                sampling_metadata)          # V1 _sample
    sampler_output = self.ddtree_hook.sample_v2(logits, input_batch, draft_logits[, invalid])
                                                                            # V2 sample
    if sampler_output is None: <vLLM's chain rejection sampler, unchanged>

**One rule, decided per request.** Every request is verified with exactly the semantics vLLM
applies to it. A request whose sampling parameters the tree path reproduces exactly is
*tree-ok*; any other request is verified by vLLM's own rejection sampler, alone, in the same
step (:mod:`.parity_v1`, :mod:`.parity_v2` list the parameters and the reason names).

**The tree channel (for a drafter, e.g. the DDTree proposer).** Per step, for the batch it
drafts for::

    from ddtree_patcher.runtime import hook
    step = hook.verify_step(runner)        # the runner's VerifyStep (None: DDTree not requested)
    ok = step.tree_ok(req_ids)           # list[bool], host-side, cached per request, no sync
    # draft a tree for requests with ok[i], a chain (node j's parent is j - 1) for the others
    step.attach(rows, parents)           # rows: list of req ids (None = a row to skip, e.g. a
                                         # chain); parents: [len(rows), n] int32 on the runner's
                                         # device: local parent of node j+1 (0 = the root, the
                                         # request's last verified token; 0 <= parents[i, j] <= j)

``attach`` keeps a reference to the tensor (no copy, no host read); the draft tokens the drafter
hands to vLLM are the nodes in the same (node) order, parents before children. Attaching a
request that is not tree-ok raises :class:`TreeChannelError`. A tree is consumed by the step that
verifies that request's drafts; if the scheduler kept only the first ``k`` draft tokens, the
first ``k`` nodes are verified (in node order they form a valid induced subtree). A request
without an attached tree is verified by vLLM's chain sampler. An attached tree can never reach
the chain sampler: where it would (more draft tokens than nodes, a step-level condition that
forbids trees), the step raises :class:`TreeChannelError` instead of emitting wrong tokens.
``attach(req_id, [p1, p2, ...])`` (one request, a list) is a convenience for tests.

``DDTREE_PATCH_CHAIN_AS_TREE=1`` verifies every tree-ok request's linear draft as the
chain-shaped tree instead (diagnostic): greedy output is identical to vLLM's chain sampler.

**In the step** (no host synchronisation; host work only on host-known data: request ids,
draft counts): chain-only batches return None (vLLM's sampler runs untouched); tree-only batches
run the walk (a request that is not tree-ok is never walked, with or without drafts); mixed
batches run vLLM's rejection sampler on the whole batch first (its output
for chain requests is exactly upstream's, same random draws) and then the walk, and take each
request's row from the path that owns it. After a step, ``VerifyStep`` holds persistent device
buffers (allocated for ``max_num_reqs`` and the widest step seen): ``accepted_rows``
``[max_num_reqs, K+1]`` (logits row of the root and of the node accepted at each depth, -1
padded; for chain requests the node-order prefix), ``num_accepted`` ``[max_num_reqs]``,
``spine_accepted`` ``[max_num_reqs]`` (how far the accepted path runs along the spine, nodes
1..s of a spine-first tree: what DFlash's chain would have accepted on the same draft, exact for
greedy requests; :mod:`.accounting`), ``tree_rows`` ``[max_num_reqs]`` bool (walked by the tree
path); host ``num_reqs``, ``num_nodes``, ``engaged``. The KV / hidden-state compaction reads them.
``VerifyStep.accounting`` sums tree and spine accepted tokens on the device (no sync), logs a line
every ``VLLM_LOG_STATS_INTERVAL`` seconds and answers :meth:`VerifyStep.counters` outside a step.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Sequence

from .contract import HOOK_ABI  # the call sites' contract
from .step_rows import upload_many
from .switches import ENV_CHAIN, ENV_ENABLE, switch
from .tree_channel import FALLBACK_REASONS, TreeChannel, TreeChannelError  # noqa: F401 - this module's public names

RUNNERS = ("V1", "V2")

logger = logging.getLogger("ddtree_patcher.runtime.hook")
_LIVE: "weakref.WeakSet[VerifyStep]" = weakref.WeakSet()


def live_steps() -> list["VerifyStep"]:
    """Every VerifyStep bound in this process (diagnostics and tests)."""
    return list(_LIVE)


class HookABIError(RuntimeError):
    pass


def requested() -> bool:
    """DDTree requested in this process (what the call site checks once per runner); a switch
    value other than 0/1 raises ``DDTreeConfigError`` (:mod:`.switches`)."""
    return switch(ENV_ENABLE) | switch(ENV_CHAIN)  # both parsed: a bad value is refused either way


def chain_as_tree() -> bool:
    return switch(ENV_CHAIN)


def check_abi(hook_abi: int) -> None:
    if hook_abi != HOOK_ABI:
        raise HookABIError(
            f"ddtree-patch: this vLLM's tree-walk-hook call site speaks hook ABI {hook_abi}, the "
            f"installed ddtree_patcher speaks ABI {HOOK_ABI}: re-apply the patch with the installed "
            "tool (`ddtree-patch revert && ddtree-patch apply`, then restart vLLM), or install the "
            "ddtree-patch release that applied it")


def bind(runner: Any, kind: str, *, hook_abi: int) -> "VerifyStep":
    """Called by the patched call site once per runner when DDTree is requested."""
    check_abi(hook_abi)
    requested()  # the call site's gate lets any value but "" and "0" through: refuse a bad one by name
    if kind not in RUNNERS:
        raise ValueError(f"ddtree-patch: unknown runner kind {kind!r}")
    step = runner.__dict__.get("ddtree_hook")
    if isinstance(step, VerifyStep):  # a drafter bound it first (tree_step)
        return step
    step = VerifyStep(runner, kind)
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


def verify_step(runner: Any) -> "VerifyStep | None":
    """The runner's VerifyStep, creating it when DDTree is requested (a drafter calls this once,
    e.g. when it is built, before its first draft); None when DDTree is not requested."""
    step = runner.__dict__.get("ddtree_hook")
    if step is None and requested():
        v2 = type(runner).__module__.endswith(".gpu.model_runner") or hasattr(runner, "req_states")
        step = bind(runner, "V2" if v2 else "V1", hook_abi=HOOK_ABI)
    return step or None


def _use_reference(dev) -> bool:
    """The Triton kernel on CUDA, or on CPU tensors under TRITON_INTERPRET=1; else the reference."""
    return dev.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


class Routing:
    """Host-side plan of one step: which request goes where, and the index arrays (numpy) that
    map the attached parents onto vLLM's flat draft layout."""

    __slots__ = ("B", "num_draft", "tree", "reasons", "src", "maxn", "ND", "T")


class VerifyStep(TreeChannel):
    """Per-runner verify-side state: the tree channel (pending trees, :class:`.tree_channel.TreeChannel`)
    and the last step's result."""

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
        self._init_channel()
        self.fallbacks: dict[str, int] = {}  # reason -> requests verified by the chain sampler
        self.tree_requests = 0  # requests verified by the tree walk
        self.engaged_steps = 0  # steps in which the walk ran
        self.chain_steps = 0  # steps that ran vLLM's sampler (alone or with the walk)
        self.engaged = False
        self.num_reqs = 0
        self.num_nodes = 0
        self.post_walk = None  # called with this VerifyStep after each walk (the tree step's KV compaction)
        self._alloc(max(self.K, 1))
        from .accounting import Accounting

        record = getattr(spec, "ddtree_patch", None)  # DDTree's {"budget", "depth"} (ddtree.configure)
        self.accounting = Accounting(self.device, record.get("budget") if isinstance(record, dict) else self.K)
        if kind == "V2":
            from . import parity_v2

            parity_v2.watch_grammar(self)
            parity_v2.watch_removals(self)
        _LIVE.add(self)

    # ---- persistent buffers ------------------------------------------------------------------
    def _alloc(self, k: int) -> None:
        import torch

        self.K = max(self.K, k)
        n, dev, i32 = self.max_num_reqs, self.device, torch.int32
        self.accepted_rows = torch.full((n, self.K + 1), -1, dtype=i32, device=dev)
        self.num_accepted = torch.zeros(n, dtype=i32, device=dev)
        self.spine_accepted = torch.zeros(n, dtype=i32, device=dev)
        self.tree_rows = torch.zeros(n, dtype=torch.bool, device=dev)
        self._chain_src = torch.arange(self.K, dtype=i32, device=dev)  # chain parents 0..K-1

    def _ensure(self, B: int, k: int) -> None:
        if k > self.K or B > self.max_num_reqs:
            self.max_num_reqs = max(self.max_num_reqs, B)
            self._alloc(k)

    def upload(self, array, dtype=None):
        """A host numpy array on the runner's device: pinned staging, non-blocking (no sync)."""
        import torch

        t = torch.from_numpy(array)
        if dtype is not None:
            t = t.to(dtype)
        if self.device.type == "cuda":
            t = t.pin_memory()
            return t.to(self.device, non_blocking=True)
        return t

    # ---- routing (host) ------------------------------------------------------------------------
    def route(self, req_ids: Sequence[str], num_draft: Sequence[int], step_reason: str | None, *,
              undrafted_walk: bool = True) -> Routing:
        """Decide per request (tree walk or vLLM's chain sampler) and consume the pending trees.
        Raises TreeChannelError where an attached tree would reach the chain sampler.

        A tree-ok request without draft tokens is walked only in a step that runs no chain sampler
        and only where ``undrafted_walk`` (V1: the walk then draws its token with vLLM's own Sampler
        and nothing else, exactly what vLLM's samplers draw for it; V2 passes False: the walk's
        in-kernel noise is not V2's, so such a request always takes vLLM's sampler). Either way the
        random stream of a seeded request never depends on the other requests of the batch."""
        import numpy as np

        B = len(num_draft)
        nd = np.asarray(num_draft, dtype=np.int64)
        self._ensure(B, int(nd.max(initial=0)))  # the chain source covers every draft
        tree = np.zeros(B, dtype=bool)
        reasons: list[str | None] = [None] * B
        src_base = [0] * B  # per row: where its parents start in the source (0: the chain's, 0..K-1)
        offsets = [0] + self._att_starts(self.K)  # chain source first
        for r, (rid, n) in enumerate(zip(req_ids, [int(x) for x in nd])):
            where = self._where.pop(rid, None)
            if self.chain_as_tree:
                reason = step_reason or self.chain_reason(rid)
                if where is not None:
                    raise TreeChannelError("ddtree-patch: DDTREE_PATCH_CHAIN_AS_TREE=1 verifies linear "
                                           f"drafts; request {rid!r} carries an attached tree")
            elif where is None:  # no tree attached: vLLM's sampler; counted under the request's own reason
                reason = step_reason or self.chain_reason(rid) or "no-tree"
            else:
                reason = step_reason or self.chain_reason(rid)
                if reason is not None:
                    raise TreeChannelError(
                        f"ddtree-patch: request {rid!r} carries a tree but this step verifies it with "
                        f"vLLM's chain sampler ({reason}: {FALLBACK_REASONS.get(reason, reason)}); "
                        "refusing to emit tokens verified against the wrong rows")
                k, row = where
                width = self._att[k].shape[1]
                if n > width:
                    raise TreeChannelError(
                        f"ddtree-patch: request {rid!r} has {n} draft tokens but its attached tree "
                        f"has {width} nodes")
            if n == 0 and reason == "no-tree":
                # nothing to verify: a tree-ok request may take either path, any other request
                # only vLLM's (its sampling parameters may read the history, seeds must match)
                reason = self.chain_reason(rid)
            if reason is None:
                tree[r] = True
                if where is not None:  # else chain-shaped (chain-as-tree): the chain source
                    k, row = where
                    src_base[r] = offsets[k + 1] + row * self._att[k].shape[1]
            else:
                reasons[r] = reason  # the chain, for the buffers
        # Requests without draft tokens go with the others: through vLLM's sampler when it runs
        # anyway (exact parity), through the walk only in an all-tree step.
        drafted = nd > 0
        walk_any = bool((tree & drafted).any())
        chain_any = any(reason is not None for reason in reasons)
        tree[~drafted] &= walk_any and not chain_any and undrafted_walk
        ro = Routing()
        ro.B, ro.num_draft, ro.tree, ro.reasons = B, nd, tree, reasons
        first = np.cumsum(nd) - nd  # each row's first flat draft index
        ro.src = np.repeat(np.asarray(src_base, dtype=np.int64) - first, nd) + np.arange(int(nd.sum()), dtype=np.int64)
        ro.maxn = int(nd.max(initial=0))
        ro.ND = int(nd.sum())
        ro.T = ro.ND + B
        return ro

    def account(self, ro: Routing) -> None:
        """Per-request counters of one step (host)."""
        drafted = ro.num_draft > 0
        for r in range(ro.B):
            if ro.reasons[r] is not None and drafted[r]:
                self._count(ro.reasons[r])
        self.tree_requests += int((ro.tree & drafted).sum())

    def _count(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        if self.fallbacks[reason] == 1 and reason != "no-tree":
            logger.info("ddtree-patch: vLLM's chain sampler verifies requests with %s",
                        FALLBACK_REASONS.get(reason, reason))

    def all_chain(self, req_ids, num_draft, reason: str) -> None:
        """A step verified entirely by vLLM's chain sampler (no tree attached may be pending)."""
        for rid, n in zip(req_ids, num_draft):
            if rid in self._where:
                raise TreeChannelError(
                    f"ddtree-patch: request {rid!r} carries a tree but this step verifies it with "
                    f"vLLM's chain sampler ({reason}: {FALLBACK_REASONS.get(reason, reason)})")
            if n:
                self._count(reason)
        self.engaged = False
        self.chain_steps += 1

    # ---- device side: tree tensors of one step (no host sync) -------------------------------
    def tree_tensors(self, ro: Routing, *, depths: bool = True):
        """Flat local parents [ND] (int32), per-row depth [T] (int64; None unless ``depths``: the V1
        walk reads none), per-row "has a child" [T] (bool), node rows [ND] (int64), root rows [B]
        (int64) and the tree-request mask [B] (bool), all on the runner's device; the index arrays
        in one host-to-device transfer."""
        import numpy as np
        import torch

        dev = self.device
        srcs = [self._chain_src] + [a.reshape(-1).to(torch.int32) for a in self._att]
        src_all = torch.cat(srcs) if len(srcs) > 1 else srcs[0]
        nd = ro.num_draft
        starts = np.concatenate([[0], np.cumsum(nd)[:-1]]).astype(np.int64)
        root_np = starts + np.arange(ro.B, dtype=np.int64)
        req_of_node = np.repeat(np.arange(ro.B, dtype=np.int64), nd)
        node_np = np.arange(ro.ND, dtype=np.int64) + req_of_node + 1
        idx, node_rows, root_rows, node_root, tree = upload_many(
            dev, [ro.src, node_np, root_np, root_np[req_of_node], ro.tree])
        parents = src_all[idx] if ro.ND else torch.zeros(0, dtype=torch.int32, device=dev)
        T = ro.T
        parent_rows = node_root + parents.to(torch.int64)  # each node's parent's row
        depth = None
        if depths:  # pointer jumping: ceil(log2(maxn + 1)) rounds
            a = torch.arange(T, dtype=torch.int64, device=dev)
            a[node_rows] = parent_rows
            depth = torch.zeros(T, dtype=torch.int64, device=dev)
            depth.index_fill_(0, node_rows, 1)  # not `depth[rows] = 1`: a Python scalar is copied to the device (a sync)
            for _ in range(max(ro.maxn, 1).bit_length()):
                depth = depth + depth[a]
                a = a[a]
        has_child = torch.zeros(T, dtype=torch.bool, device=dev)
        has_child.index_fill_(0, parent_rows, True)
        if not self._where:
            self._att.clear()  # every attached tree consumed: drop the references
        return parents.contiguous(), depth, has_child, node_rows, root_rows, tree.to(torch.bool)

    def verify(self, draft_token_ids, parents, cu, width, max_nodes, **kw):
        from ddtree_patcher.kernels import tree_verify, tree_verify_ref

        self.accounting.record_verify(draft_token_ids, parents, cu, kw.get("target_argmax"), kw.get("is_greedy"))
        fn = tree_verify_ref if _use_reference(draft_token_ids.device) else tree_verify
        if fn is tree_verify and draft_token_ids.device.type != "cuda":
            kw.setdefault("block_v", 1 << 16)  # the interpreter: few, large blocks
        return fn(draft_token_ids, parents, cu, width=width, max_num_nodes=max(max_nodes, 1),
                  check_data=False, **kw)

    def keep(self, ro: Routing, rows, num_acc, tree_mask) -> None:
        """The step's result into the persistent buffers (device copies only)."""
        B, W = rows.shape
        self._ensure(B, W - 1)
        if W < self.accepted_rows.shape[1]:
            self.accepted_rows[:B, W:].fill_(-1)
        self.accepted_rows[:B, :W].copy_(rows)
        self.num_accepted[:B].copy_(num_acc)
        self.tree_rows[:B].copy_(tree_mask)
        # tree vs spine (device; the walked requests with draft tokens are host-known)
        walked = int((ro.tree & (ro.num_draft > 0)).sum())
        spine = self.accounting.step(rows, num_acc, tree_mask, walked, width=ro.maxn)
        self.spine_accepted[:B].copy_(spine)
        self.accounting.record_step(rows, num_acc, tree_mask, spine, ro.num_draft)
        self.num_reqs = B
        self.num_nodes = ro.ND
        self.engaged = True
        self.engaged_steps += 1
        if self.post_walk is not None:
            self.post_walk(self)

    def counters(self) -> dict:
        """The walk's counters and the tree vs spine accounting (reads device sums: call it
        outside a step)."""
        return {"kind": self.kind, "engaged_steps": self.engaged_steps, "tree_requests": self.tree_requests,
                "chain_steps": self.chain_steps, "fallbacks": dict(self.fallbacks),
                "accounting": self.accounting.counters()}

    # ---- the two call sites ------------------------------------------------------------------
    def sample_v1(self, metadata, draft_probs, logits, sampling_metadata):
        """vLLM's ``SamplerOutput`` (left-packed ``[B, max_spec_len + 1]`` int32, -1 padded),
        or None (then vLLM's chain sampler runs alone)."""
        from . import parity_v1

        return parity_v1.sample(self, metadata, draft_probs, logits, sampling_metadata)

    def sample_v2(self, logits, input_batch, draft_logits=None, invalid_drafts=None):
        """V2's ``SamplerOutput`` with ``num_sampled``/``num_rejected`` as upstream computes them
        (both 0 for requests still in chunked prefill), or None."""
        from . import parity_v2

        return parity_v2.sample(self, logits, input_batch, draft_logits, invalid_drafts)
