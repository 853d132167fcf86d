"""dflash-sliding-window probe for run_llm_hook.py (SWA_PROBE=1, engine in-process, CPU).

``install()`` (after ``LLM()``) finds the drafter's attention layers and wraps each layer's
attention impl ``forward`` so that its calls are recorded (query, paged KV cache, metadata,
output). ``report()`` (after ``generate``) says what the V1 drafter was built with (per-layer
windows, full KV storage, draft attention groups and their builders' windows) and, for every
recorded call, how far the layer's output is from a reference attention computed here from the
KV cache: full attention and three windowed masks, so a test can assert which one the engine ran.
"""

from __future__ import annotations

import gc

_LAYERS: list = []  # DFlashQwen3Attention modules
_CALLS: dict[str, list[dict]] = {}
_KV: dict[str, dict[int, tuple]] = {}  # layer -> slot -> (key, value) as written to the cache


def _objects(name: str) -> list:
    gc.unfreeze()  # vLLM freezes everything built at start-up (gc.get_objects() would skip it)
    return [o for o in gc.get_objects() if type(o).__name__ == name]


def install(max_calls: int = 6) -> None:
    _LAYERS[:] = sorted(_objects("DFlashQwen3Attention"), key=lambda o: o.layer_name)
    for layer in _LAYERS:
        impl = layer.attn.impl
        calls = _CALLS.setdefault(layer.layer_name, [])
        original = impl.forward

        def forward(attn_layer, query, key, value, kv_cache, attn_metadata, output, *a, _orig=original,
                    _calls=calls, _name=layer.layer_name, **kw):
            out = _orig(attn_layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
            res = output if out is None else out
            if attn_metadata is not None and len(_calls) < max_calls:
                n = attn_metadata.num_actual_tokens
                _calls.append({
                    "query": _copy(query[:n]), "output": _copy(res[:n]),
                    "block_size": _block_size(kv_cache), "kv": dict(_KV.get(_name, {})),
                    "query_start_loc": _copy(attn_metadata.query_start_loc),
                    "seq_lens": _copy(attn_metadata.seq_lens), "block_table": _copy(attn_metadata.block_table),
                    "causal": getattr(attn_metadata, "causal", None),
                })
            return out

        impl.forward = forward

        # The paged cache's layout is ISA-specific: the reference reads K/V as they were written.
        shadow = _KV.setdefault(layer.layer_name, {})
        update = impl.do_kv_cache_update

        def do_kv_cache_update(attn_layer, key, value, kv_cache, slot_mapping, *a, _orig=update, _kv=shadow, **kw):
            k, v = _copy(key), _copy(value)
            for i, slot in enumerate(slot_mapping[: key.shape[0]].tolist()):
                if slot >= 0:
                    _kv[slot] = (k[i], v[i])
            return _orig(attn_layer, key, value, kv_cache, slot_mapping, *a, **kw)

        impl.do_kv_cache_update = do_kv_cache_update


def _copy(t):
    """A CPU copy (``.cpu()`` of a CPU tensor is the same buffer, which the engine reuses)."""
    return t.detach().to("cpu", copy=True)


def _block_size(kv_cache) -> int:
    """The block size of a paged cache: CPU and FlashAttention (0.26+) lay it out as
    ``[num_blocks, num_kv_heads, block_size, 2 * head]``, older FlashAttention as
    ``[2, num_blocks, block_size, num_kv_heads, head]``."""
    return int(kv_cache.shape[2])


def _reference(call: dict, impl, window: int | None, mode: str):
    """Attention of the recorded queries over the request's cached keys. ``mode``: "full" (every
    key), "left" (keys within ``window`` before or at the query position, or after it),
    "causal" (p - window < j <= p), "symmetric" (|p - j| < window)."""
    import torch

    block_size = call["block_size"]
    head = impl.head_size
    q_all = call["query"].float().view(call["query"].shape[0], -1, head)
    heads = q_all.shape[1]
    out = torch.empty_like(q_all)
    qsl, seq_lens, bt = call["query_start_loc"].tolist(), call["seq_lens"].tolist(), call["block_table"]
    for r in range(len(seq_lens)):
        q0, q1, s = qsl[r], qsl[r + 1], seq_lens[r]
        if q1 == q0:
            continue
        slots = [int(bt[r, p // block_size]) * block_size + p % block_size for p in range(s)]
        k = torch.stack([call["kv"][x][0].float().view(-1, head) for x in slots], 1)  # [kv_heads, s, head]
        v = torch.stack([call["kv"][x][1].float().view(-1, head) for x in slots], 1)
        kv_heads = k.shape[0]
        k = k.repeat_interleave(heads // kv_heads, 0)
        v = v.repeat_interleave(heads // kv_heads, 0)
        q = q_all[q0:q1].transpose(0, 1)  # [heads, q, head]
        pos = torch.arange(s - (q1 - q0), s)[:, None]
        j = torch.arange(s)[None, :]
        allowed = torch.ones(q1 - q0, s, dtype=torch.bool)
        if mode == "left":
            allowed = j > pos - window
        elif mode == "causal":
            allowed = (j > pos - window) & (j <= pos)
        elif mode == "symmetric":
            allowed = (j - pos).abs() < window
        scores = (q @ k.transpose(1, 2)) * impl.scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[q0:q1] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out.reshape(q_all.shape[0], -1)


def report() -> dict:
    res: dict = {"layers": [], "draft_groups": [], "calls": {}}
    for layer in _LAYERS:
        window = layer.attn.sliding_window
        res["layers"].append({"prefix": layer.layer_name, "window": window,
                              "impl_window": getattr(layer.attn.impl, "sliding_window", None),
                              "full_kv_storage": bool(getattr(layer.attn, "ddtree_full_kv_storage", False))})
        rows = []
        for call in _CALLS.get(layer.layer_name, []):
            got = call["output"].float().reshape(call["output"].shape[0], -1)
            row = {"meta_causal": call["causal"] if isinstance(call["causal"], (bool, type(None))) else "tensor", "max_seq_len": max(call["seq_lens"].tolist()),
                   "num_queries": int(call["query"].shape[0])}
            for mode in ("full", "left", "causal", "symmetric"):
                if mode != "full" and window is None:
                    continue
                ref = _reference(call, layer.attn.impl, window, mode)
                row[mode] = float((ref - got).abs().max())
            rows.append(row)
        res["calls"][layer.layer_name] = rows
    for proposer in _objects("DFlashProposer"):
        res["kv_cache_gid"] = proposer.kv_cache_gid
        res["draft_groups"] = [
            {"layers": sorted(g.layer_names), "spec": type(g.kv_cache_spec).__name__,
             "window": getattr(g.kv_cache_spec, "sliding_window", None),
             "builder_window": getattr(g.get_metadata_builder(), "window_size", None)}
            for g in proposer.draft_attn_groups]
    return res
