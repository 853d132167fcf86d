"""fa_forward_probe.py ROOT FLASH_ATTN_PY: a release's own, patched ``FlashAttentionImpl.forward`` on CPU
with its tree-step site (ddtree-tree-step's FA variants), FlashAttention 3 emulated.

ROOT: a folder holding that release's ``vllm`` Python package (its official ``.py`` files; no compiled
parts are loaded); FLASH_ATTN_PY: the patched ``vllm/v1/attention/backends/flash_attn.py``, loaded in
place of the release's. The module's ``flash_attn_varlen_func`` (what both the forward's own call and,
from vLLM 0.30.0, its ``_FA4_DENSE_ATTENTION_KERNEL`` wrapper call) is replaced by the dense references
of ``kernels/tree_step_reference.py``, as in tests/kernels/test_tree_step_fa.py; the impl is built
without ``__init__`` (no GPU) with the attributes a bf16 decoder layer has (no window, softcap, ALiBi,
sinks, quantized KV, DCP; FA version 3), the metadata has every field the forwards read before the site.
``tree_attention_merge`` runs in Triton's interpreter.

Three steps through ``impl.forward(layer, query, key, value, kv_cache, attn_metadata, output)``:
every request a tree request (the site writes every row and the forward returns: one FA call, the
context pass), a mixed step (the causal call first, then the context pass), and no tree step (the site
returns nothing: the forward's own causal call runs). Prints ``RESULT {json}``."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types

os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT, PATCHED = sys.argv[1], sys.argv[2]
sys.path.insert(0, ROOT)
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # tests/: helpers

import torch  # noqa: E402

from ddtree_patcher.kernels.tree_step_reference import (  # noqa: E402
    causal_attention_ref, context_attention_ref, tree_attention_ref,
)
from ddtree_patcher.runtime import tree_step as TS  # noqa: E402
from helpers import bare_tree_step, paged_batch, set_plan  # noqa: E402

NAME = "vllm.v1.attention.backends.flash_attn"
spec = importlib.util.spec_from_file_location(NAME, PATCHED)
FA = importlib.util.module_from_spec(spec)
sys.modules[NAME] = FA
spec.loader.exec_module(FA)

NB, BS, HKV, HQ, D = 24, 4, 2, 4, 16
SCALE = D ** -0.5
calls: list[str] = []


def fa(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal, block_table,
       return_softmax_lse=False, **kw):
    """``flash_attn_varlen_func`` for FA3 (dense float references); what the forwards pass besides
    (window, softcap, ALiBi, descales, sinks, mask_mod, ...) must be the no-op values."""
    assert kw.get("fa_version") == 3, kw.get("fa_version")
    for name in ("alibi_slopes", "s_aux", "mask_mod", "aux_tensors", "dynamic_causal", "q_descale"):
        assert kw.get(name) is None, (name, kw.get(name))
    assert kw.get("window_size") in (None, [-1, -1], (-1, -1)) and not kw.get("softcap"), kw
    calls.append("causal" if causal else "context")
    B = cu_seqlens_q.numel() - 1
    if causal:
        qlen = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        out.copy_(causal_attention_ref(q, k, v, block_table, cu_seqlens_q, seqused_k[:B] - qlen,
                                       softmax_scale).to(out.dtype))
        return out
    o, lse = context_attention_ref(q, k, v, block_table, cu_seqlens_q, seqused_k[:B], softmax_scale, empty_fill=0.0)
    out.copy_(o)
    return (out, lse) if return_softmax_lse else out


FA.flash_attn_varlen_func = fa  # the forward's call and the _FA4_DENSE_ATTENTION_KERNEL wrapper's


def make_impl():
    impl = FA.FlashAttentionImpl.__new__(FA.FlashAttentionImpl)
    attn_type = getattr(getattr(FA, "AttentionType", None), "DECODER", "decoder")
    impl.__dict__.update(num_heads=HQ, head_size=D, scale=SCALE, num_kv_heads=HKV, vllm_flash_attn_version=3,
                         attn_type=attn_type, kv_cache_dtype="auto", supports_quant_query_input=False,
                         dcp_world_size=1, sliding_window=(-1, -1), alibi_slopes=None, logits_soft_cap=0,
                         sinks=None, fa4_hd256=False, kv_sharing_target_layer_name=None)
    return impl


def run(nsched, trees, ctx, seed, active=True):
    g = torch.Generator().manual_seed(seed)
    B, T = len(nsched), sum(nsched)
    st = bare_tree_step(fa_varlen=getattr(FA, "flash_attn_varlen_func"))  # what bind takes (TargetTreeStep._fa_views)
    set_plan(st, B, T, nsched, [(r, n, torch.tensor(p)) for r, n, p in trees], None)
    st.active = active
    seq_lens, bt, qsl = paged_batch(nsched, ctx, NB, BS, g)
    md = types.SimpleNamespace(
        num_actual_tokens=T, query_start_loc=qsl, seq_lens=seq_lens,
        max_query_len=max(nsched), max_seq_len=int(seq_lens.max()), block_table=bt, scheduler_metadata=None, max_num_splits=0,
        use_cascade=False, causal=True, sliding_window=None, mm_prefix_range_tensor=None,
        mm_prefix_query_range_tensor=None, rswa_prefix_lens=None, rswa_window_tensor=None)
    impl = make_impl()
    impl.__dict__[TS.ATTR] = st
    one = torch.ones((), dtype=torch.float32)
    layer = types.SimpleNamespace(_q_scale=one, _k_scale=one, _v_scale=one, _q_scale_float=1.0, _k_scale_float=1.0,
                                  _v_scale_float=1.0)
    kv_cache = torch.randn(NB, HKV, BS, 2 * D, generator=g)  # FlashAttention's logical (nb, H, bs, 2D)
    k, v = kv_cache.transpose(1, 2).split(D, dim=-1)  # what the forward hands the site
    pad = 2
    q = torch.randn(T + pad, HQ, D, generator=g)
    out = torch.full((T + pad, HQ, D), float("nan"))
    calls.clear()
    ret = impl.forward(layer, q, torch.zeros_like(q[:, :HKV]), torch.zeros_like(q[:, :HKV]), kv_cache, md, out)
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    causal = causal_attention_ref(q[:T], k, v, bt, qsl, ctx_t, SCALE)
    exp = causal.clone()
    if active:
        tree, _ = tree_attention_ref(q[:T], k, v, bt, qsl, ctx_t, st.ancestor_mask, SCALE, request_mask=st.req_mask,
                                     num_reqs=B)
        for r, _, _ in trees:
            exp[qsl[r]:qsl[r + 1]] = tree[qsl[r]:qsl[r + 1]]
    err = float((out[:T] - exp).abs().max())
    return {"calls": list(calls), "max_err": err, "returned_output": ret is out,
            "padding_untouched": bool(torch.isnan(out[T:]).all()), "attention_calls": st.attention_calls}


res = {"module": FA.__file__, "has_fa4_wrapper": hasattr(FA, "_FA4_DENSE_ATTENTION_KERNEL")}
res["all_tree"] = run([5, 3], [(0, 4, [0, 0, 1, 2]), (1, 2, [0, 0])], [7, 10], 0)
res["mixed"] = run([5, 3, 4], [(0, 4, [0, 0, 1, 2]), (2, 3, [0, 1, 1])], [6, 9, 3], 1)
res["no_tree_step"] = run([3, 2], [(0, 2, [0, 0])], [5, 4], 2, active=False)
print("RESULT " + json.dumps(res))
