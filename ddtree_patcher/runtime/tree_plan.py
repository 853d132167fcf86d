"""The step plan of the tree-shaped target step: which query rows of a verify step are tree rows,
their depth positions and ancestor bit rows (``TreePlan``, a part of ``tree_step.TargetTreeStep``),
made in the runner's input preparation (V1 ``_prepare_inputs``: :meth:`TreePlan.prepare`; V2
``execute_model``: :meth:`TreePlan.prepare_v2`) from the trees the DDTree proposer attached to the
verify-side channel (``hook.VerifyStep``), or, in DDTree's steady state, one step ahead from the
proposer's attach (:meth:`TreePlan.expect`). The attention, the compaction and the drafter rows
read what this leaves on the step (``B``, ``T``, ``W``, ``req_mask``, ``ancestor_mask``, the row
index tensors). Host index arrays: :func:`plan_rows`; bit rows: :func:`pack_rows`."""

from __future__ import annotations


class TreePlan:
    """The plan part of :class:`tree_step.TargetTreeStep` (its state is made by ``_init_state``)."""

    # ---- 1. _prepare_inputs: depth positions and this step's tree metadata -------------------
    def prepare(self, runner, scheduler_output, num_reqs: int, num_scheduled_tokens, total_tokens: int) -> None:
        """V1, after ``compute_slot_mapping``: positions of tree rows become ``ctx + depth``."""
        B = int(num_reqs)
        req_ids = runner.input_batch.req_ids[:B]
        spec = scheduler_output.scheduled_spec_decode_tokens
        nd = [len(spec.get(rid, ())) for rid in req_ids]
        self._prepare(req_ids, nd, num_scheduled_tokens, B, int(total_tokens), runner.positions)

    def prepare_v2(self, runner, input_batch, slot_mappings) -> None:
        """V2 ``execute_model``, after ``prepare_attn`` (slots from linear positions): positions of
        tree rows (``input_batch.positions``, the FULL graphs' input buffer) become ``ctx +
        depth``; ``slot_mappings`` (``[groups, T_padded]``) are kept for the compaction after the
        walk. The drafted nodes per request come from ``cu_num_logits_np`` (1 + drafts)."""
        import numpy as np

        B = int(input_batch.num_reqs)
        nd = (np.diff(np.asarray(input_batch.cu_num_logits_np[:B + 1], dtype=np.int64)) - 1).clip(0).tolist()
        self.slot_mappings = slot_mappings
        self._prepare(list(input_batch.req_ids[:B]), nd, input_batch.num_scheduled_tokens, B,
                      int(input_batch.num_tokens), input_batch.positions)

    def _prepare(self, req_ids, nd, num_scheduled_tokens, B: int, total_tokens: int, positions) -> None:
        self.active = False
        self.capturing = False
        self.graph_step = False
        self.moves = None
        self.node_rows = None
        if self._prepare_expected(req_ids, nd, num_scheduled_tokens, B, total_tokens, positions):
            return
        if self.graph_bufs is not None:
            Q = self.graph_bufs[2]
            if B and all(int(n) == Q for n in num_scheduled_tokens[:B]):
                # a uniform decode batch: vLLM may replay a FULL graph captured with the tree path, so
                # every request is scored with a mask: its tree, or a chain (requests vLLM's chain
                # sampler verifies; a prefill chunk of exactly Q tokens): causal attention
                src, idx, has = self.hook.pending_index(req_ids, nd, Q, chain_nodes=[Q - 1] * B)
                self.set_plan_parents(B, total_tokens, num_scheduled_tokens, [Q - 1] * B, (src, idx),
                                      positions, trees=int(has.sum()), graph=True)
                return
        if not any(n and self.hook.pending_tree(rid, n) is not None for rid, n in zip(req_ids, nd)):
            return
        W = max(nd) + 1
        src, idx, has = self.hook.pending_index(req_ids, nd, W)  # parents = src[idx], [B, W], -1 = no link
        self.set_plan_parents(B, total_tokens, num_scheduled_tokens,
                              [n if h else 0 for n, h in zip(nd, has)], (src, idx), positions)

    def _ancestor_rows(self, parents, out=None, kernel=False):
        """(bit rows, depths) of ``parents`` ``[B, W]`` (-1 = no parent): ``kernels.ancestor_rows`` on
        CUDA, into the FULL graphs' buffer (``out``) and where ``kernel``; on CPU otherwise the same
        rows by walking up W times (torch ops; no Triton interpreter needed)."""
        import torch

        if kernel or out is not None or self.cuda:
            from ddtree_patcher.kernels import ancestor_rows

            return ancestor_rows(parents, out=out)
        B, W = parents.shape
        dev = self.device
        par = torch.where(parents >= 0, parents, torch.arange(W, device=dev).expand(B, W))
        anc = torch.zeros(B, W, W, dtype=torch.bool, device=dev)
        cur = torch.arange(W, dtype=torch.int64, device=dev).repeat(B, 1)
        for _ in range(W):
            anc.scatter_(2, cur.unsqueeze(-1), True)
            cur = par.gather(1, cur)
        return pack_rows(anc), anc.sum(-1) - 1  # depths [B, W]

    # ---- 0. the proposer's attach: the next step's tree metadata, one step ahead --------------
    def expect(self, req_ids, k: int) -> None:
        """``VerifyStep.attach`` hook: when every row of attachment ``k`` is a tree (DDTree's steady
        state), its ancestor bit rows and depths are made now, on the device behind the drafter,
        for a next step that has exactly this batch (same requests in the same order, each 1 + n
        rows). That step's prepare (:meth:`_prepare_expected`) then checks the batch on the host and
        writes the positions: no index upload and no launch where V1 has the GPU idle (between the
        previous step's end and the forward's launch: issue 14's host-bound V1 steps). Anything else
        takes the general prepare, which does not read what this made."""
        import torch
        import torch.nn.functional as F

        self.expected = None
        if not req_ids or any(rid is None for rid in req_ids):
            return
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return
        att = self.hook.attachment(k)
        if att is None:
            return
        W = att.shape[1] + 1
        graph = self.graph_bufs is not None and self.graph_bufs[2] == W
        par = F.pad(att, (1, 0), value=-1)  # [B, W]: the root column (-1), then node j's parent
        anc, depth = self._ancestor_rows(par, kernel=graph)  # as the general prepare computes them
        self.expected = (list(req_ids), att, k, anc, depth.to(torch.int64))

    def _uniform_plan(self, B: int, W: int):
        """Index tensors of a step of B tree requests of W rows each (cached per (B, W)), in
        :meth:`set_plan_parents`'s order: node rows, their roots, their local index, root rows,
        root rows + T, tree rows, the request mask, the graph buffers' request mask (or None)."""
        import numpy as np
        import torch

        from .step_rows import upload_many

        key = (B, W)
        plan = self._uniform.get(key)
        if plan is None:
            if len(self._uniform) >= 64:
                self._uniform.clear()
            rows, _, _ = plan_rows(np.full(B, W, dtype=np.int64), np.full(B, W - 1, dtype=np.int64), B * W)
            up = upload_many(self.device, rows)
            on = torch.ones(B, dtype=torch.bool, device=self.device)
            req_rows = None
            if self.graph_bufs is not None:
                req_rows = torch.zeros_like(self.graph_bufs[1])
                req_rows[:B] = True
            plan = self._uniform[key] = (*up, on, req_rows)
        return plan

    def _prepare_expected(self, req_ids, nd, num_scheduled_tokens, B: int, total_tokens: int, positions) -> bool:
        """The prepare of a step that is the batch :meth:`expect` saw: its metadata, or False (then
        the general prepare runs). Equal to what the general prepare makes for that batch
        (``tests/kernels/test_tree_step_expect.py``)."""
        exp, self.expected = self.expected, None
        if exp is None:
            return False
        ids, att, k, anc, depth = exp
        W = depth.shape[1]
        n = W - 1
        if B != len(ids) or total_tokens != B * W or self.hook.attachment(k) is not att:
            return False
        where = self.hook.pending
        for i, rid in enumerate(req_ids):
            if rid != ids[i] or where.get(rid) != (k, i) or int(nd[i]) != n or int(num_scheduled_tokens[i]) != W:
                return False
        graph = self.graph_bufs is not None and self.graph_bufs[2] == W
        (self.node_rows, self.node_root, self.node_index, self.root_rows, self.root_ext, self.tree_rows, on,
         req_rows) = self._uniform_plan(B, W)
        if graph:
            self.ancestor_mask = self.graph_bufs[0][:B]
            self.ancestor_mask.copy_(anc)
            self.graph_bufs[1].copy_(req_rows)
            self.req_mask = self.graph_bufs[1][:B]
        else:
            self.ancestor_mask = anc
            self.req_mask = on
        if positions is not None:  # node j at its root's position + depth (the root's depth is 0)
            p = positions[:B * W].view(B, W)
            p.copy_(p[:, :1] + depth)
        self.fa_step = None
        self.all_tree = True
        self.graph_step = graph
        self.graph_steps += int(graph)
        self.B, self.T, self.W = B, B * W, W
        self.active = True
        self.tree_steps += 1
        self.tree_requests += B
        self.expected_steps += 1
        return True

    def set_plan_parents(self, B: int, T: int, num_scheduled_tokens, num_nodes, parents, positions=None, *,
                         trees: int | None = None, graph: bool = False) -> None:
        """The step's tree metadata: ``num_nodes`` (host, per batch row; 0 = no tree) and
        ``parents`` int64 ``[B, W]`` on the device (local parent of node j, -1 for the root and
        rows without a tree), or ``(src, idx)`` with ``parents = src[idx]`` and ``idx`` a host
        array (:meth:`VerifyStep.pending_index`: uploaded with the step's other index arrays, one
        transfer). Ancestor bit rows and depths in one launch on CUDA (``kernels.ancestor_rows``);
        ``positions`` get ``ctx + depth`` at the tree rows, in place.
        ``trees``: how many rows carry a drafted tree (counters; default: rows with nodes).
        ``graph``: a uniform decode step under FULL decode graphs: the bit rows and the request
        mask are written into ``graph_bufs`` (every row after B off)."""
        import numpy as np
        import torch

        from .step_rows import upload_many

        nsched = np.asarray(num_scheduled_tokens[:B], dtype=np.int64)
        nd = np.asarray(num_nodes, dtype=np.int64)
        src = None
        if isinstance(parents, tuple):
            src, idx = parents
            W = int(idx.shape[1])
        else:
            W = int(parents.shape[1])
        tree_req = nd > 0
        rows, node_r, node_j = plan_rows(nsched, nd, T)
        if graph:  # the request mask of every buffer row: on for the B requests, off after them
            req_buf = self.graph_bufs[1]
            nd_rows = np.zeros(req_buf.shape[0], dtype=np.int64)
            nd_rows[:B] = nd
        else:
            nd_rows = nd
        arrays = rows + [node_r * W + node_j, nd_rows]
        up = upload_many(self.device, arrays + ([idx] if src is not None else []))
        (self.node_rows, self.node_root, self.node_index, self.root_rows, self.root_ext, self.tree_rows, flat,
         num_nodes) = up[:8]
        if src is not None:
            parents = src[up[8]].view(B, W)
        self.ancestor_mask, depth = self._ancestor_rows(parents, out=self.graph_bufs[0][:B] if graph else None)
        if graph:
            torch.gt(num_nodes, 0, out=req_buf)
            self.req_mask = req_buf[:B]
        else:
            self.req_mask = num_nodes > 0  # one transfer for the step's index arrays (above), no second one
        if positions is not None:
            positions.index_copy_(0, self.node_rows,
                                  positions[self.node_root] + depth.reshape(-1)[flat].to(positions.dtype))
        self.fa_step = None
        self.all_tree = bool(tree_req.all() and (nsched == nd + 1).all())
        self.graph_step = graph
        self.graph_steps += int(graph)
        self.B, self.T, self.W = B, int(T), W
        self.active = True
        trees = int(tree_req.sum()) if trees is None else int(trees)
        self.tree_steps += int(trees > 0)
        self.tree_requests += trees


def plan_rows(nsched, nd, T: int):
    """Host index arrays of a step's tree plan from the rows per request ``nsched`` and the tree
    nodes per request ``nd`` (int64 arrays; 0 = no tree; a request's root is ``nd + 1`` rows
    before its end): ``[node rows, their roots' rows, their local index j, root rows, root rows then
    T, tree rows (the roots of tree requests, then the nodes)]`` in :meth:`TargetTreeStep.set_plan_parents`'s
    order, and each node's request and local index."""
    import numpy as np

    root = np.cumsum(nsched) - 1 - nd  # the root's query row (a verify request: its first row)
    node_r = np.repeat(np.arange(len(nd)), nd)  # per node: its request
    node_j = np.concatenate([np.arange(1, n + 1) for n in nd if n]) if nd.any() else np.zeros(0, np.int64)
    node_rows = root[node_r] + node_j
    return ([node_rows, root[node_r], node_j, root, np.append(root, int(T)),
             np.concatenate([root[nd > 0], node_rows])], node_r, node_j)


def pack_rows(anc):
    """bool ``[B, W, W]`` visibility -> int32 ``[B, W, ceil(W/32)]`` bit rows (DraftTree layout)."""
    import torch

    B, W, _ = anc.shape
    NW = (W + 31) // 32
    pad = torch.zeros(B, W, NW * 32, dtype=torch.int64, device=anc.device)
    pad[:, :, :W] = anc.to(torch.int64)
    bits = torch.arange(32, device=anc.device, dtype=torch.int64)
    words = (pad.view(B, W, NW, 32) << bits).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)
