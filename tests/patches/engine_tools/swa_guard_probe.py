"""How a release's own (patched) code resolves a mixed sliding/full DFlash drafter on each runner;
prints ``RESULT {json}``.

usage: python swa_guard_probe.py   (the patched release's Python first on PYTHONPATH; CUDA_VISIBLE_DEVICES="")

The resolver is the release's ``qwen3_dflash._resolve_layer_attention`` (0.25.0+, rewritten by
dflash-sliding-window) or, where the release has none (0.20.0-0.24.0), the runtime's
``resolve_layer_attention`` that the patched layer calls; the runner is the one the release's own
``VllmConfig.use_v2_model_runner`` picks with ``VLLM_USE_V2_MODEL_RUNNER`` = 0 / 1. Per runner:
``{"runner": draft_runner(), "layers": [[window, causal], ...]}`` or ``{"runner": ..., "error":
"Type", "message": ...}``.
"""
import json
import logging
import os
from types import SimpleNamespace

import vllm.model_executor.models.qwen3_dflash as model
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

from ddtree_patcher.runtime import swa

MIXED = SimpleNamespace(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                        sliding_window=4, dflash_config={})
resolve = getattr(model, "_resolve_layer_attention", None)
if resolve is None:
    def resolve(config, layer_idx):
        return swa.resolve_layer_attention(config, layer_idx, swa_abi=swa.SWA_ABI)

logging.disable(logging.WARNING)
out = {"file": model.__file__, "upstream_resolver": hasattr(model, "_resolve_layer_attention")}
for v2 in ("0", "1"):
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = v2
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        row = {"runner": getattr(swa, "draft_runner", lambda: None)()}  # (absent before issue 10)
        try:
            row["layers"] = [list(resolve(MIXED, i)) for i in range(MIXED.num_hidden_layers)]
        except Exception as exc:
            row.update(error=type(exc).__name__, message=str(exc))
    out["v2" if v2 == "1" else "v1"] = row
print("RESULT " + json.dumps(out), flush=True)
