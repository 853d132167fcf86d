"""diag_fa.py: a diagnosis of the FlashAttention tree step inside a running engine (``run_tree_engine.py``
with ``DIAG=1``; in-process engines only). Test tooling: it synchronises on every layer call it checks.

``install()`` wraps ``FlashAttentionImpl.forward`` of the vLLM in this process. After every forward of a
target layer in a tree step (eager or inside a PIECEWISE / compiled step; not while a CUDA graph is being
captured, and a FULL graph's replay runs no Python), it checks, against the dense float64 references of
``kernels/tree_step_reference.py`` on the same paged KV cache:

* ``kv``: the step's new keys and values are in the cache at the step's slot mapping (what vLLM's KV update
  wrote before the forward: every row, tree rows at their linear slots);
* ``tree``: the rows of tree requests equal the ancestor-masked attention (context + ancestors + self);
* ``other``: the rows of the other requests (prefill chunks, chain-verified requests) equal causal attention;
* ``ctx``: for tree rows, the context pass's output (the step's scratch) equals attention over the context
  alone (where the context is not empty).

Per step kind (``uniform``: every request a tree request with exactly its tree's rows; ``mixed``: anything
else) it keeps the number of layer calls checked, the largest absolute error of each check and the
reference's largest magnitude, the tensors' layouts seen, and the first few calls whose tree or other error
exceeds ``TOL`` (absolute), with the step's shape. ``summary()`` is what ``run_tree_engine.py`` puts in its
RESULT under ``diag``."""

from __future__ import annotations

import math

TOL = 0.05  # absolute error on fp16/bf16 attention outputs of magnitude <= ~5 that counts as wrong

_state = {"calls": 0, "kinds": {}, "bad": [], "layouts": set(), "errors": []}


def _kind(ts) -> str:
    return "uniform" if ts.all_tree else "mixed"


def _check(impl, layer, query, key, value, kv_cache, md, output) -> None:
    import torch

    from ddtree_patcher.kernels.tree_step_reference import causal_attention_ref, tree_attention_ref

    ts = impl.__dict__.get(_attr())
    if ts is None or md is None or not ts.active:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    T, B = int(md.num_actual_tokens), int(ts.B)
    H, D, Hkv = impl.num_heads, impl.head_size, impl.num_kv_heads
    kc, vc = kv_cache.transpose(1, 2).split(D, dim=-1)  # (nb, bs, Hkv, D), as the forward reads them
    bs = kc.shape[1]
    q = query[:T].view(T, H, D)
    o = output[:T].view(T, H, D).float()
    _state["layouts"].add((f"q{tuple(query.shape)}{tuple(query.stride())}", f"o{tuple(output.stride())}",
                           f"k{tuple(key.stride())}", f"kv{tuple(kv_cache.stride())}"))
    # kv: the step's new K/V at its slots
    slots = md.slot_mapping[:T].long()
    ok = slots >= 0
    s = slots.clamp(min=0)
    kin = kc[s // bs, s % bs]
    vin = vc[s // bs, s % bs]
    kv_err = max(float(((kin - key[:T].view(T, Hkv, D)).abs().amax(dim=(1, 2)) * ok).max()),
                 float(((vin - value[:T].view(T, Hkv, D)).abs().amax(dim=(1, 2)) * ok).max()))
    qsl = md.query_start_loc[:B + 1]
    ctx = md.seq_lens[:B] - (qsl[1:] - qsl[:-1])
    req = ts.req_mask[:B]
    ref_t, _ = tree_attention_ref(q, kc, vc, md.block_table, qsl, ctx, ts.ancestor_mask, impl.scale,
                                  request_mask=req, num_reqs=B)
    ref_c = causal_attention_ref(q, kc, vc, md.block_table, qsl, ctx, impl.scale)
    row_req = torch.repeat_interleave(torch.arange(B, device=q.device), qsl[1:] - qsl[:-1], output_size=T) \
        if T == int(qsl[-1]) else None
    if row_req is None:
        _state["errors"].append(f"query_start_loc ends at {int(qsl[-1])}, T={T}")
        return
    tree_rows = req[row_req]
    err = (o - torch.where(tree_rows[:, None, None], ref_t, ref_c)).abs().amax(dim=(1, 2))
    t_err = float(err[tree_rows].max()) if bool(tree_rows.any()) else 0.0
    o_err = float(err[~tree_rows].max()) if bool((~tree_rows).any()) else 0.0
    c_err = 0.0
    st = getattr(ts, "fa_step", None)
    if st is not None and st.md is md and bool(tree_rows.any()):
        zero = torch.zeros_like(ts.ancestor_mask)
        ref_x, lse_x = tree_attention_ref(q, kc, vc, md.block_table, qsl, ctx, zero, impl.scale, request_mask=req,
                                          num_reqs=B)
        has_ctx = tree_rows & torch.isfinite(lse_x[0])
        if bool(has_ctx.any()):
            c_err = float((st.scratch[:T].float() - ref_x).abs().amax(dim=(1, 2))[has_ctx].max())
    scale = float(torch.where(tree_rows[:, None, None], ref_t, ref_c).abs().max())
    k = _state["kinds"].setdefault(_kind(ts), {"calls": 0, "kv": 0.0, "tree": 0.0, "other": 0.0, "ctx": 0.0,
                                               "ref_max": 0.0})
    k["calls"] += 1
    for name, v in (("kv", kv_err), ("tree", t_err), ("other", o_err), ("ctx", c_err), ("ref_max", scale)):
        k[name] = max(k[name], round(v, 5))
    _state["calls"] += 1
    if (t_err > TOL or o_err > TOL or kv_err > 0 or c_err > TOL) and len(_state["bad"]) < 12:
        rows = (qsl[1:] - qsl[:-1]).tolist()
        bad_req = sorted({int(row_req[i]) for i in torch.nonzero(err > TOL).flatten().tolist()})
        _state["bad"].append({"kind": _kind(ts), "T": T, "B": B, "rows": rows, "ctx": ctx.tolist(),
                              "tree_req": req.tolist(), "tree": round(t_err, 4), "other": round(o_err, 4),
                              "ctx_err": round(c_err, 4), "kv": round(kv_err, 4), "bad_requests": bad_req,
                              "graph_step": bool(ts.graph_step), "call": _state["calls"]})


def _attr() -> str:
    from ddtree_patcher.runtime.contract import TREE_STEP_ATTR

    return TREE_STEP_ATTR


def install() -> None:
    from vllm.v1.attention.backends import flash_attn

    cls = flash_attn.FlashAttentionImpl
    orig = cls.forward

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        r = orig(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        try:
            _check(self, layer, query, key, value, kv_cache, attn_metadata, output)
        except Exception as e:  # noqa: BLE001 - a diagnosis never stops the engine
            if len(_state["errors"]) < 5:
                _state["errors"].append(f"{type(e).__name__}: {str(e)[:300]}")
        return r

    cls.forward = forward


def summary() -> dict:
    return {"checked_calls": _state["calls"], "by_kind": _state["kinds"], "first_bad": _state["bad"],
            "layouts": sorted(map(list, _state["layouts"]))[:6], "errors": _state["errors"], "tol": TOL,
            "nan": any(isinstance(v, float) and math.isnan(v) for k in _state["kinds"].values() for v in k.values())}
