"""The V1 runner's attention groups, built by the release's own (pristine or patched)
``GPUModelRunner.initialize_attn_backend``; prints ``RESULT {json}``.

usage: python swa_runner_probe.py   (the release's vLLM Python first on PYTHONPATH; CUDA_VISIBLE_DEVICES="")

The runner module, its ``AttentionGroupKey``/``AttentionGroup``, the KV cache specs and groups, the
CPU attention backend and ``VllmConfig`` are the release's own; the official wheels' Python imports
on CPU without their compiled parts. Only the layers are minimal ``AttentionLayerBase`` subclasses
(what the function reads of a layer: its backend and ``sliding_window``), and the cudagraph-mode
check is skipped (it needs a device). Two cases, each in one KV cache group:

* ``full``: two plain full-attention layers (every model without sliding layers);
* ``mixed``: a windowed layer (4) and a full one in one full-storage group (a mixed DFlash drafter
  on V1 after dflash-sliding-window).

Each case reports ``{"groups": [[layer names], ...]}`` or ``{"error": "Type: message"}``.
"""
import json
import logging
from types import SimpleNamespace

import torch
import vllm.v1.worker.gpu_model_runner as runner_mod
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec


class Layer(runner_mod.AttentionLayerBase):
    def __init__(self, sliding_window):
        self.sliding_window = sliding_window

    def get_attn_backend(self):
        return CPUAttentionBackend

    def get_kv_cache_spec(self, vllm_config):  # pragma: no cover - not called by the function
        raise NotImplementedError


def groups(windows: dict) -> dict:
    vc = VllmConfig(device_config=DeviceConfig(device="cpu"))
    names = list(windows)
    vc.compilation_config.static_forward_context.update({n: Layer(w) for n, w in windows.items()})
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    runner = SimpleNamespace(attn_groups=[], vllm_config=vc, kv_sharing_fast_prefill_eligible_layers=set(),
                             _check_and_update_cudagraph_mode=lambda *a, **k: None)
    try:
        with set_current_vllm_config(vc):
            runner_mod.GPUModelRunner.initialize_attn_backend(runner, config)
    except Exception as exc:  # the defect shows up as an exception: report it
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"groups": sorted(sorted(g.layer_names) for g in runner.attn_groups[0])}


logging.disable(logging.WARNING)
print("RESULT " + json.dumps({
    "file": runner_mod.__file__,
    "full": groups({"model.layers.0.attn": None, "model.layers.1.attn": None}),
    "mixed": groups({"draft.layers.0.attn": 4, "draft.layers.1.attn": None}),
}), flush=True)
