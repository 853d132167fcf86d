"""The tree channel: the verify side's record of the trees a drafter attached and the walk has not
verified yet (``TreeChannel``, a part of ``hook.VerifyStep``), and which requests may be drafted as
trees at all (:meth:`TreeChannel.chain_reason`: vLLM's own sampling semantics per request, decided by
:mod:`.parity_v1` / :mod:`.parity_v2`). The drafter attaches (``attach``), the target-side tree step
reads the pending trees (``pending``, ``pending_tree``, ``pending_index``, ``attachment``), the walk
consumes them (``hook.VerifyStep.route``). Host bookkeeping only: parents stay on the device, by
reference."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Sequence

# Why a request (with draft tokens) is verified by vLLM's chain sampler; counted per request in
# VerifyStep.fallbacks. Request-level reasons come from the request's sampling parameters,
# step-level ones from the runner's configuration or this step's inputs.
FALLBACK_REASONS = {
    "no-tree": "no tree attached (the drafter submitted a chain)",
    "logprobs": "sample logprobs requested (per-node logprobs are not computed by the tree path)",
    "penalties": "presence/frequency/repetition penalties (per-branch histories not implemented)",
    "bad-words": "bad words (per-branch histories not implemented)",
    "min-tokens": "min_tokens (V1: the rejection sampler's per-position rule is not reproduced)",
    "thinking-budget": "thinking token budget (reads the branch's history)",
    "grammar": "structured output (grammar bitmask rows are built along the chain)",
    "custom-logits-processors": "custom logits processors are loaded (they may read the history)",
    "draft-probs": "chain-as-tree with sampled drafts (draft probabilities): the chain rule is the exact one",
    "synthetic": "synthetic rejection sampling mode",
    "fly": "FLy (lossy) verification mode",
    "watermark": "watermarking",
    "adaptive-verification": "adaptive verification (compacted logits)",
    "sampling-mask": "the runner returns sampling masks",
    "trace-replay": "trace replay",
    "layout": "unexpected logits layout",
    "unsupported": "runner attributes this hook does not know (other vLLM shape)",
    "unknown-request": "the runner holds no state for the request (not cached: asked again)",
}


class TreeChannelError(RuntimeError):
    """An attached (possibly branching) tree would be verified as a chain, or a channel misuse."""




class TreeChannel:
    """The channel part of :class:`hook.VerifyStep` (``runner``, ``kind``, ``device`` and
    ``max_num_reqs`` are the step's)."""

    on_attach = None  # called with (req ids, attachment index) after each attach: the tree step's look-ahead

    def _init_channel(self) -> None:
        self._att: list = []  # attached parent tensors of the pending trees
        self._where: dict[str, tuple[int, int]] = {}  # req id -> (attachment, row)
        # req id -> (the request's instance on the runner, its chain reason): see chain_reason
        self._reason_cache: dict[str, tuple[Any, str | None]] = {}

    # ---- the tree channel --------------------------------------------------------------------
    def _instance(self, req_id: str):
        """What the runner holds for the request now: V1 its ``CachedRequestState`` (a new object
        for a new request, even under a reused id), V2 its state index (V2 removals evict the
        cache: parity_v2.watch_removals); None when the runner holds nothing for it."""
        if self.kind == "V1":
            return getattr(self.runner, "requests", {}).get(req_id)
        return getattr(getattr(self.runner, "req_states", None), "req_id_to_index", {}).get(req_id)

    def _same(self, cached, now) -> bool:
        return cached is now if self.kind == "V1" else (now is not None and cached == now)

    def chain_reason(self, req_id: str) -> str | None:
        """Why ``req_id`` must be verified by vLLM's chain sampler (a FALLBACK_REASONS key), or
        None when the tree path reproduces its sampling semantics exactly. Host-only.

        Cached per request instance: an entry counts only while the runner holds the same request
        under that id (a finished request's id may be reused), and the cache is pruned to the
        requests the runner holds whenever it reaches ``2 * max_num_reqs + 8`` entries, so a
        server that has served millions of requests holds no more than that."""
        now = self._instance(req_id)
        hit = self._reason_cache.get(req_id)
        if hit is not None and self._same(hit[0], now):
            return hit[1]
        from . import parity_v1, parity_v2

        mod = parity_v1 if self.kind == "V1" else parity_v2
        reason = mod.runner_reason(self) or mod.request_reason(self, req_id)
        if reason != "unknown-request":
            if len(self._reason_cache) >= 2 * self.max_num_reqs + 8:
                self._prune()
            self._reason_cache[req_id] = (now, reason)
        return reason

    def _prune(self) -> None:
        """Drop the cached decisions of requests the runner no longer holds (amortised: called when
        the cache reaches its cap, which is twice the requests a step can hold)."""
        self._reason_cache = {rid: hit for rid, hit in self._reason_cache.items()
                              if self._same(hit[0], self._instance(rid))}

    def tree_ok(self, req_ids):
        """True where the request may be drafted as a tree (str -> bool, list -> list[bool])."""
        if isinstance(req_ids, str):
            return self.chain_reason(req_ids) is None
        return [self.chain_reason(r) is None for r in req_ids]

    def forget(self, req_id: str) -> None:
        """Drop cached decisions and a pending tree: the runner removed the request (finished or
        preempted; V2 calls this from ``req_states.remove_request``, parity_v2.watch_removals)."""
        self._reason_cache.pop(req_id, None)
        self._where.pop(req_id, None)
        seen = getattr(self, "_grammar_seen", None)
        if seen is not None:
            seen.discard(req_id)

    def attach(self, req_ids, parents) -> None:
        """Attach trees: ``parents[i]`` (local parents of nodes 1..n, 0 = root) is the tree of
        ``req_ids[i]``; a None id skips that row. ``parents`` is an int tensor ``[R, n]``
        (kept by reference, not copied, never read on the host), or for one request
        ``attach(req_id, [p1, ..., pn])`` (checked on the host)."""
        import torch

        if isinstance(req_ids, str):
            par = [int(p) for p in (parents.tolist() if hasattr(parents, "tolist") else parents)]
            for j, p in enumerate(par, start=1):
                if not 0 <= p < j:
                    raise ValueError(f"ddtree-patch: tree of {req_ids!r}: node {j} has parent {p}, "
                                     f"expected 0 <= parent < {j} (parents before children)")
            req_ids = [req_ids]
            parents = torch.tensor([par], dtype=torch.int32).to(self.device)
        if not isinstance(parents, torch.Tensor) or parents.ndim != 2 or parents.shape[0] != len(req_ids):
            raise TreeChannelError("ddtree-patch: attach(req_ids, parents): parents must be an int "
                                   f"tensor [len(req_ids), n], got {getattr(parents, 'shape', type(parents))}")
        if parents.dtype not in (torch.int32, torch.int64):
            raise TreeChannelError(f"ddtree-patch: attach: parents must be int32/int64, got {parents.dtype}")
        if parents.device != self.device:
            raise TreeChannelError(f"ddtree-patch: attach: parents are on {parents.device}, the runner "
                                   f"verifies on {self.device} (build them there: no host copy)")
        for rid in req_ids:
            if rid is not None and (reason := self.chain_reason(rid)) is not None:
                raise TreeChannelError(
                    f"ddtree-patch: request {rid!r} cannot be verified as a tree ({reason}: "
                    f"{FALLBACK_REASONS.get(reason, reason)}); ask step.tree_ok() before drafting and "
                    "submit a chain for it without attaching")
        if not self._where:
            self._att.clear()  # no pending tree references older attachments
        k = len(self._att)
        self._att.append(parents.contiguous())
        for i, rid in enumerate(req_ids):
            if rid is not None:
                self._where[rid] = (k, i)
        if self.on_attach is not None:
            self.on_attach(req_ids, k)

    def detach(self, req_id: str) -> None:
        self._where.pop(req_id, None)

    def attachment(self, k: int):
        """The parents ``[B, n]`` of attachment ``k`` (the ``k`` :meth:`attach` passed to
        ``on_attach``), or None once a later attach dropped it."""
        return self._att[k] if 0 <= k < len(self._att) else None

    @property
    def pending(self) -> "MappingProxyType[str, tuple[int, int]]":
        """Request id -> ``(attachment, row)`` of its tree attached and not yet verified (read-only)."""
        return MappingProxyType(self._where)

    def pending_tree(self, req_id: str, n: int):
        """The first ``n`` local parents (a device view) of the tree attached to ``req_id`` and
        not yet verified, or None (no tree: the request is verified as a chain). Does not consume
        it (the walk does)."""
        where = self._where.get(req_id)
        if where is None:
            return None
        k, row = where
        return self._att[k][row, :n]

    def _att_starts(self, first: int) -> list[int]:
        """Where each attachment starts in a flat source of the attachments placed from ``first``
        on, then the source's end."""
        starts = [first]
        for a in self._att:
            starts.append(starts[-1] + a.numel())
        return starts

    def pending_index(self, req_ids: Sequence[str], num_draft: Sequence[int], width: int, *,
                      chain_nodes: Sequence[int] | None = None):
        """Parents of the pending trees of a batch as a gather: ``(src, idx, has)``, ``src`` an int64
        device vector and ``idx`` a host int64 ``[len(req_ids), width]`` array, ``parents =
        src[idx]`` (column j = node j's local parent; -1 for the root column, past a request's
        ``num_draft`` nodes and on rows without a pending tree; the caller uploads ``idx`` with its
        other index arrays: one transfer), ``has`` a host bool array (row has a tree).
        ``chain_nodes`` (per row): rows without a tree get a chain of that many nodes instead (node
        j's parent j - 1). Reads no device data on the host; does not consume the trees (the walk
        does)."""
        import numpy as np
        import torch

        B = len(req_ids)
        offsets = self._att_starts(0)
        base = offsets[-1]  # after the parents: -1, 0, 1, ..., width - 2 (the sentinel, then a chain's)
        start, count, chain = [0] * B, [0] * B, [0] * B  # per row: first parent's index, nodes; chain nodes
        for r, (rid, n) in enumerate(zip(req_ids, num_draft)):  # host values only: no numpy call per row
            where = self._where.get(rid)
            n = min(int(n), width - 1)
            if where is None or n <= 0:
                chain[r] = min(int(chain_nodes[r]), width - 1) if chain_nodes is not None else 0
            else:
                k, row = where
                start[r], count[r] = offsets[k] + row * self._att[k].shape[1], n
        count_np = np.asarray(count, dtype=np.int64)[:, None]
        has = count_np[:, 0] > 0
        j = np.arange(width, dtype=np.int64)[None, :]
        idx = np.where((j >= 1) & (j <= count_np), np.asarray(start, dtype=np.int64)[:, None] + j - 1,
                       np.where((j >= 1) & (j <= np.asarray(chain, dtype=np.int64)[:, None]), base + j, base))
        flat = [a.reshape(-1).to(torch.int64) for a in self._att]
        src = torch.cat(flat + [torch.arange(-1, width - 1, dtype=torch.int64, device=self.device)])
        return src, idx, has
