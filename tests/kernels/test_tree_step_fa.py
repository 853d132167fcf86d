"""The tree step's FlashAttention path (``TargetTreeStep.fa_attention``, tree-step ABI 2) on CPU:
FlashAttention 3 emulated by the dense references of ``kernels/tree_step_reference.py`` (the
forward's ``flash_attn_varlen_func`` is the one thing replaced), ``tree_attention_merge`` under
the Triton interpreter. The FA3 site sits before the forward's causal call and returns when
``fa_attention`` says it wrote the layer:

* every request a tree request (the steady state): one FA call (the context pass), then the
  merge; every row = the tree-masked reference; the forward's own causal call is skipped;
* a mixed step (a request without a tree): the causal call first for all rows, then the context
  pass + merge for the tree rows: tree rows = tree reference, other rows = causal reference;
* not a tree step: False, nothing called (the forward goes on unchanged);
* a second layer of the same step reuses the first layer's checked dimensions.

On the H200 the same path runs with the real FA3 in scripts/gpu_tree_e2e.sh."""
from __future__ import annotations

import types

import pytest
import torch

from ddtree_patcher.kernels.tree_step_reference import (
    causal_attention_ref,
    context_attention_ref,
    tree_attention_ref,
)
from helpers import bare_tree_step, paged_batch, set_plan

NB, BS, HKV, HQ, D = 24, 4, 2, 4, 16
SCALE = D ** -0.5


def fa_emulation(calls):
    """``flash_attn_varlen_func`` as the tree step calls it, dense float32/64 math."""

    def fa(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
           block_table, return_softmax_lse=False, **kw):
        calls.append("causal" if causal else "context")
        B = cu_seqlens_q.numel() - 1
        if causal:
            qlen = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
            o = causal_attention_ref(q, k, v, block_table, cu_seqlens_q, seqused_k[:B] - qlen, softmax_scale)
            out.copy_(o.to(out.dtype))
            return out
        o, lse = context_attention_ref(q, k, v, block_table, cu_seqlens_q, seqused_k[:B], softmax_scale,
                                       empty_fill=0.0)
        out.copy_(o)
        return (out, lse) if return_softmax_lse else out

    return fa


def step(nsched, trees, ctx, seed):
    g = torch.Generator().manual_seed(seed)
    B, T = len(nsched), sum(nsched)
    calls = []
    st = bare_tree_step(fa_varlen=fa_emulation(calls))
    set_plan(st, B, T, nsched, trees, None)
    seq_lens, bt, qsl = paged_batch(nsched, ctx, NB, BS, g)
    md = types.SimpleNamespace(num_actual_tokens=T, query_start_loc=qsl, seq_lens=seq_lens,
                               max_query_len=max(nsched), max_seq_len=int(seq_lens.max()), block_table=bt,
                               scheduler_metadata=None, max_num_splits=0)
    impl = types.SimpleNamespace(num_heads=HQ, head_size=D, scale=SCALE, vllm_flash_attn_version=3)
    return st, md, impl, calls, g


def layer(st, md, impl, g, T, pad=2):
    k = torch.randn(NB, BS, HKV, D, generator=g)
    v = torch.randn(NB, BS, HKV, D, generator=g)
    q = torch.randn(T + pad, HQ, D, generator=g)  # the forward's query / output: [tokens, heads, head_size]
    out = torch.full((T + pad, HQ, D), float("nan"))
    done = st.fa_attention(impl, q, k, v, md, out)
    return done, q[:T], k, v, out


def expected(st, md, q, k, v, ctx, tree_reqs):
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    qsl_t = md.query_start_loc[:len(ctx) + 1]  # (a padded batch's metadata has more requests)
    tree, _ = tree_attention_ref(q, k, v, md.block_table, qsl_t, ctx_t, st.ancestor_mask, SCALE,
                                 request_mask=st.req_mask, num_reqs=len(ctx))
    causal = causal_attention_ref(q, k, v, md.block_table, qsl_t, ctx_t, SCALE)
    qsl = qsl_t.tolist()
    exp = causal.clone()
    for r in tree_reqs:
        exp[qsl[r]:qsl[r + 1]] = tree[qsl[r]:qsl[r + 1]]
    return exp


def test_all_tree_step_is_one_context_pass_and_the_merge():
    nsched, ctx = [5, 3], [7, 10]
    trees = [(0, 4, torch.tensor([0, 0, 1, 2])), (1, 2, torch.tensor([0, 0]))]
    st, md, impl, calls, g = step(nsched, trees, ctx, 0)
    assert st.all_tree
    T = sum(nsched)
    for n_layer in range(2):  # the second layer reuses the step's dims, context lengths, scratch
        done, q, k, v, out = layer(st, md, impl, g, T)
        assert done and calls == ["context"] * (n_layer + 1), calls
        exp = expected(st, md, q, k, v, ctx, [0, 1])
        torch.testing.assert_close(out[:T], exp, atol=2e-4, rtol=2e-4)
        assert torch.isnan(out[T:]).all()  # padding rows untouched
    assert st.attention_calls == 2


def test_mixed_step_runs_the_causal_call_first():
    nsched, ctx = [5, 3, 4], [6, 9, 3]  # request 1: no tree (a chain-verified or prefill request)
    trees = [(0, 4, torch.tensor([0, 0, 1, 2])), (2, 3, torch.tensor([0, 1, 1]))]
    st, md, impl, calls, g = step(nsched, trees, ctx, 1)
    assert not st.all_tree
    T = sum(nsched)
    done, q, k, v, out = layer(st, md, impl, g, T)
    assert done and calls == ["causal", "context"], calls
    torch.testing.assert_close(out[:T], expected(st, md, q, k, v, ctx, [0, 2]), atol=2e-4, rtol=2e-4)


def test_tree_request_with_extra_rows_is_not_all_tree():
    # a request scheduled with more rows than its tree's (not a verify row layout): the causal call runs
    st, *_ = step([6, 3], [(0, 4, torch.tensor([0, 0, 1, 2])), (1, 2, torch.tensor([0, 0]))], [4, 4], 2)
    assert not st.all_tree


@pytest.mark.parametrize("why", ["inactive", "no-metadata"])
def test_not_a_tree_step_leaves_the_forward_alone(why):
    st, md, impl, calls, g = step([3], [(0, 2, torch.tensor([0, 0]))], [5], 3)
    if why == "inactive":
        st.active = False
    else:
        md = None
    out = torch.zeros(3, HQ, D)
    assert st.fa_attention(impl, torch.randn(3, HQ, D), torch.zeros(NB, BS, HKV, D), torch.zeros(NB, BS, HKV, D),
                           md, out) is False
    assert calls == [] and not out.any()


# ---- FULL decode CUDA graphs (tree-step ABI 3): the graph path ----------------------------------
Q = 5  # uniform decode query length: 1 + N, N = 4


def graph_step(seed, rows=4):
    """A tree step with FULL-decode-graph buffers, as ``_init_graph_buffers`` makes them: chain bit
    rows, every request on."""
    from ddtree_patcher.kernels import ancestor_rows

    calls = []
    st = bare_tree_step(fa_varlen=fa_emulation(calls))
    chain = torch.arange(-1, Q - 1, dtype=torch.int64).expand(rows, Q).contiguous()
    st.graph_bufs = (ancestor_rows(chain)[0], torch.ones(rows, dtype=torch.bool), Q)
    return st, calls, torch.Generator().manual_seed(seed)


def padded_md(g, ctx, pad_reqs):
    """Uniform decode metadata as a FULL-graph replay sees it: ``len(ctx)`` requests of Q rows,
    then ``pad_reqs`` padded requests (no rows, sequence length 0, the null block)."""
    B = len(ctx)
    seq = [c + Q for c in ctx] + [0] * pad_reqs
    need = [(s + BS - 1) // BS for s in seq[:B]]
    blocks = torch.randperm(NB - 1, generator=g) + 1  # block 0: the null block of the padded rows
    bt = torch.zeros(B + pad_reqs, max(need), dtype=torch.int32)
    at = 0
    for r, k in enumerate(need):
        bt[r, :k] = blocks[at:at + k]
        at += k
    qsl = torch.tensor([Q * min(r, B) for r in range(B + pad_reqs + 1)], dtype=torch.int32)
    return types.SimpleNamespace(num_actual_tokens=Q * B, query_start_loc=qsl,
                                 seq_lens=torch.tensor(seq, dtype=torch.int32), max_query_len=Q,
                                 max_seq_len=max(seq), block_table=bt, scheduler_metadata=None, max_num_splits=32)


def test_uniform_decode_step_under_full_graphs_masks_every_request():
    """A uniform decode step under FULL decode graphs: request 0 has a tree, request 1 is verified
    by vLLM's chain sampler (a chain mask: causal attention), one padded request in the metadata
    (a replay's padding): one context pass, no causal call; the masks are the buffers' rows and
    every buffer row after the batch is off."""
    st, calls, g = graph_step(4)
    ctx = [6, 9]
    parents = torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 1, 2, 3]])
    st.set_plan_parents(2, 2 * Q, [Q, Q], [Q - 1, Q - 1], parents, None, trees=1, graph=True)
    assert st.all_tree and st.graph_step and st.tree_requests == 1 and st.tree_steps == 1
    anc, req, _ = st.graph_bufs
    assert st.ancestor_mask.data_ptr() == anc.data_ptr() and req.tolist() == [True, True, False, False]
    md = padded_md(g, ctx, pad_reqs=1)
    T = 2 * Q
    impl = types.SimpleNamespace(num_heads=HQ, head_size=D, scale=SCALE, vllm_flash_attn_version=3)
    for n_layer in range(2):
        done, q, k, v, out = layer(st, md, impl, g, T, pad=3)
        assert done and calls == ["context"] * (n_layer + 1), calls
        torch.testing.assert_close(out[:T], expected(st, md, q, k, v, ctx, [0]), atol=2e-4, rtol=2e-4)
        assert torch.isnan(out[T:]).all()  # rows of no request (the padded ones) untouched


def test_capture_runs_the_graph_path_and_writes_no_buffer():
    """From before_capture() to the first step: forwards of uniform decode shape take the graph
    path with the buffers as they are (chains, every request on: causal attention), read only
    (a write would be captured and replayed over prepare's); other shapes: vLLM's own path."""
    st, calls, g = graph_step(5)
    st.before_capture()
    assert st.capturing and not st.active
    anc0, req0 = st.graph_bufs[0].clone(), st.graph_bufs[1].clone()
    ctx = [3, 0, 7]
    md = padded_md(g, ctx, pad_reqs=0)
    impl = types.SimpleNamespace(num_heads=HQ, head_size=D, scale=SCALE, vllm_flash_attn_version=3)
    done, q, k, v, out = layer(st, md, impl, g, 3 * Q)
    assert done and calls == ["context"]
    exp = causal_attention_ref(q, k, v, md.block_table, md.query_start_loc, torch.tensor(ctx, dtype=torch.int32), SCALE)
    torch.testing.assert_close(out[:3 * Q], exp, atol=2e-4, rtol=2e-4)
    assert torch.equal(st.graph_bufs[0], anc0) and torch.equal(st.graph_bufs[1], req0)
    md.max_query_len = Q + 1  # not the uniform decode shape
    assert st.fa_attention(impl, q, k, v, md, out) is False and calls == ["context"]


def test_pending_index_masks_rows_without_a_tree_as_chains():
    """``hook.pending_index(..., chain_nodes=...)`` (what ``prepare`` asks in a uniform decode
    step under FULL graphs; parents = src[idx]): rows with a pending tree get its parents, rows
    without one (chain-verified requests, prefill chunks) a chain of ``chain_nodes`` nodes; without
    ``chain_nodes`` they stay unlinked (-1)."""
    from ddtree_patcher.runtime import hook

    def pending_parents(h, *args, **kw):
        src, idx, has = h.pending_index(*args, **kw)
        return src[torch.from_numpy(idx)], has

    h = hook.VerifyStep.__new__(hook.VerifyStep)
    h.device = torch.device("cpu")
    h._att = [torch.tensor([[0, 0, 1, 2], [0, 1, 1, 0]], dtype=torch.int32)]
    h._where = {"a": (0, 0), "c": (0, 1)}
    ids, nd = ["a", "b", "c", "d"], [4, 0, 3, 4]
    par, has = pending_parents(h, ids, nd, 5, chain_nodes=[4, 4, 4, 2])
    assert has.tolist() == [True, False, True, False]
    assert par.tolist() == [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3], [-1, 0, 1, 1, -1], [-1, 0, 1, -1, -1]]
    par, has = pending_parents(h, ids, nd, 5)
    assert par.tolist()[1] == [-1] * 5 and par.tolist()[3] == [-1] * 5 and has.tolist() == [True, False, True, False]


def test_pending_index_equals_a_per_row_loop():
    """``pending_index`` builds its gather index with array ops (no numpy call per row): the same
    index as the per-row loop it replaced, over several attachments, rows without a tree, zero
    drafts, more drafts than the width and chain rows."""
    import numpy as np

    from ddtree_patcher.runtime import hook

    rng = np.random.default_rng(5)
    for trial in range(20):
        h = hook.VerifyStep.__new__(hook.VerifyStep)
        h.device = torch.device("cpu")
        h._att = [torch.zeros(int(rng.integers(1, 4)), int(rng.integers(1, 9)), dtype=torch.int32) for _ in range(3)]
        B = int(rng.integers(1, 9))
        ids = [f"r{i}" for i in range(B)]
        h._where = {rid: (k, int(rng.integers(0, h._att[k].shape[0])))
                    for rid in ids if (k := int(rng.integers(0, 4))) < 3}
        nd = [int(rng.integers(0, 12)) for _ in ids]
        width = int(rng.integers(2, 10))
        chain = [int(rng.integers(0, 12)) for _ in ids] if trial % 2 else None
        src, idx, has = h.pending_index(ids, nd, width, chain_nodes=chain)
        offsets = np.cumsum([0] + [a.numel() for a in h._att])
        want = np.full((B, width), offsets[-1], dtype=np.int64)
        want_has = np.zeros(B, dtype=bool)
        for r, (rid, n) in enumerate(zip(ids, nd)):
            where, n = h._where.get(rid), min(n, width - 1)
            if where is None or n <= 0:
                c = min(chain[r], width - 1) if chain is not None else 0
                want[r, 1:c + 1] = offsets[-1] + 1 + np.arange(c)
                continue
            k, row = where
            want[r, 1:n + 1] = offsets[k] + row * h._att[k].shape[1] + np.arange(n)
            want_has[r] = True
        assert np.array_equal(idx, want) and np.array_equal(has, want_has), trial
        assert src.shape[0] == offsets[-1] + width
