"""After the tree walk: the accepted path made linear for the rest of the engine
(``AcceptedPath``, a part of ``tree_step.TargetTreeStep``):

* **KV compaction** (:meth:`AcceptedPath.after_walk`, called by the verify-side channel's
  ``keep`` right after the walk): for every target layer of every KV-cache group, the KV of the
  node accepted at depth d (slot of ``ctx + j_d``) moves to the slot of ``ctx + d``, so vLLM's
  bookkeeping (accepted = the first a + 1 query tokens) is true; CUDA: one ``KVCompactor`` launch
  per group;
* **drafter rows** (:meth:`AcceptedPath.drafter_rows` on V1, :meth:`AcceptedPath.drafter_rows_v2`
  on V2, before the drafter runs): the drafter's context hidden rows gathered along the accepted
  path and the tree rows' positions linear again."""

from __future__ import annotations


class AcceptedPath:
    """The compaction and drafter-row part of :class:`tree_step.TargetTreeStep`."""

    # ---- 3. after the walk: KV compaction ----------------------------------------------------
    def after_walk(self, hook_step) -> None:
        """``VerifyStep.keep`` (the walk's result is in its buffers): move the accepted path's KV
        to the linear slots, every target layer of every KV-cache group."""
        if not self.active:
            return
        import torch

        self.active = False  # the drafter's forward (its own layers) comes next
        B = self.B
        if self.cuda:
            return self._after_walk_device(hook_step)
        rows = hook_step.accepted_rows[:B].to(torch.int64)
        acc = hook_step.num_accepted[:B].to(torch.int64)
        tree = hook_step.tree_rows[:B] & self.req_mask
        d, j, branch = moved_depths(rows, torch.where(tree, acc, torch.zeros_like(acc)))
        # CPU path: host-side selection (no graph, the device is the host)
        src = (self.root_rows[:, None] + j)[branch]
        dst = (self.root_rows[:, None] + d[None, :])[branch]
        self.compactions += 1
        n = int(src.numel())
        self.moved_rows += n
        for a in acc[tree].tolist():
            self.accepted_depths[a] = self.accepted_depths.get(a, 0) + 1
        self.moves = (src, dst) if n else None
        if not n:
            return
        for gid, views in self.groups:
            slots = self._slots(gid).to(torch.int64)
            s, t = slots[src], slots[dst]
            for view in views:
                bs = view.shape[1]
                view[t // bs, t % bs] = view[s // bs, s % bs]  # the right side is gathered first

    def _after_walk_device(self, hook_step) -> None:
        """CUDA: one ``KVCompactor`` launch per KV-cache group (every target layer), on device
        data only; the drafter's row gather reuses the same accepted rows."""
        import torch

        B = self.B
        rows = hook_step.accepted_rows[:B]
        tree = hook_step.tree_rows[:B] & self.req_mask
        acc = torch.where(tree, hook_step.num_accepted[:B], torch.zeros_like(hook_step.num_accepted[:B]))
        self.acc_rows, self.acc_eff = rows, acc
        self.compactions += 1
        # counters on the device (read by counters(), outside the step): rows moved, accepted lengths;
        # the compaction kernel adds them (saves ~15 small torch ops of host time per step)
        if self.dev_counts is None:
            self.dev_counts = torch.zeros(1 + rows.shape[1], dtype=torch.int64, device=rows.device)
        counted = False
        for gid, comp in self.compactors:
            counted |= comp(self._slots(gid), self.root_ext, rows, acc, num_reqs=B,
                            counts=None if counted else self.dev_counts, tree=tree)
        if not counted:  # nothing launched (no views): count with torch
            self.dev_counts[0] += moved_depths(rows, acc)[2].sum()
            self.dev_counts[1:].scatter_add_(0, acc.to(torch.int64).clamp(0, rows.shape[1] - 1),
                                             tree.to(torch.int64))

    def _slots(self, gid: int):
        """The step's slot ids of KV-cache group ``gid`` (T rows): V1's block table buffer, V2's
        ``slot_mappings`` from ``prepare_attn`` (DFlash's ``propose`` rewrites that buffer later)."""
        if self.v2:
            return self.slot_mappings[gid][:self.T]
        return self.runner.input_batch.block_table[gid].slot_mapping.gpu[:self.T]

    # ---- 4. the drafter's inputs ---------------------------------------------------------------
    def drafter_rows(self, target_hidden_states, target_positions):
        """``propose_draft_token_ids``, before the drafter: hidden rows along the accepted path
        (in place), tree rows' positions linear again (in place); returns the positions."""
        self._drafter_rows([target_hidden_states], target_positions)
        return target_positions

    def drafter_rows_v2(self, last_hidden_states, aux_hidden_states, positions) -> None:
        """V2 ``DFlashSpeculator.propose``, first thing: the tensors DFlash reads its context from
        (the aux hidden states, else the last hidden states) gathered along the accepted path and
        the tree rows' positions (``input_batch.positions``) linear again, in place. A dummy run's
        propose finds no plan and changes nothing."""
        self._drafter_rows(list(aux_hidden_states) if aux_hidden_states else [last_hidden_states], positions)

    def _gatherer(self, tensors):
        """A ``RowGatherer`` bound to ``tensors``, kept while the drafter's context tensors keep
        their memory and layout (CUDA graphs' static buffers: every step), so its pointer table
        is not rebuilt and uploaded in each step (measured under cProfile on the H200: ~120 µs of
        host time per step)."""
        from ddtree_patcher.kernels import RowGatherer

        key = tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors)
        if self._row_gatherer is None or self._row_gatherer[0] != key:
            self._row_gatherer = (key, RowGatherer(tensors))
        return self._row_gatherer[1]

    def _drafter_rows(self, tensors, positions) -> None:
        """Rows ``root + d`` of each tensor take row ``root + j_d`` (CUDA: ``RowGatherer`` on the
        walk's accepted rows; CPU: the moves :meth:`after_walk` recorded), then the tree rows'
        positions are linear again; nothing without a plan."""
        if self.node_rows is None:
            return
        if self.cuda:
            if self.acc_eff is not None:
                self._gatherer(tensors)(self.root_ext, self.acc_rows, self.acc_eff, num_reqs=self.B)
                self.acc_eff = self.acc_rows = None
        elif self.moves is not None:
            src, dst = self.moves
            for t in tensors:
                t[dst] = t[src]
            self.moves = None
        positions.index_copy_(0, self.node_rows, positions[self.node_root] + self.node_index.to(positions.dtype))
        self.node_rows = None


def moved_depths(rows, acc):
    """The accepted path's moves of a walk: ``rows`` the accepted rows ``[B, W]`` (column 0 the
    root's, -1 padded), ``acc`` the accepted depth per request (0 = nothing to move). Returns
    ``(d [W-1], j [B, W-1], moved [B, W-1])``: depth d's node has local index ``j``; ``moved``
    marks accepted depths whose node is not the chain's (``j != d``)."""
    import torch

    d = torch.arange(1, rows.shape[1], device=rows.device)
    j = rows[:, 1:] - rows[:, :1]
    valid = (d[None, :] <= acc[:, None]) & (rows[:, 1:] >= 0)
    return d, j, valid & (j != d[None, :])
