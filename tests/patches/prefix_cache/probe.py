"""Prefix-cache probe, run in its own process with a vLLM site first on ``sys.path``.

Builds a real ``Scheduler`` (and through it the real ``KVCacheManager``) from the vLLM sources
on the path, once per speculative method, and prints one JSON object on stdout:

    {"version": ..., "block_size": 16, "prefix_blocks": N,
     "methods": {"dflash": {...}, "eagle3": {...}}}

where each method reports:

* ``hit_blocks``: how many of the N cached full prefix blocks a second request hits
  (``num_computed_tokens // block_size`` of its first schedule() step);
* ``manager_drops``: the drop flag the Scheduler handed to ``KVCacheManager(use_eagle=...)``;
* ``scheduler_use_eagle``: ``Scheduler.use_eagle`` (must stay True for DFlash);
* ``num_lookahead_tokens``: the scheduler's lookahead slots (DFlash: num_spec + 1);
* ``mamba_split``: ``_mamba_block_aligned_split`` for a whole 100-token prompt in one chunk
  (96 = no eagle back-off, 80 = backs off one block);
* ``lookahead_blocks``: blocks a fresh 64-token request owns after its first schedule (the
  prefill), then after each of two decode steps (one sampled token, K drafts proposed, then one
  draft accepted), in a scheduler of its own; the drafter writes K + 1 positions past the last
  token (DFlash), so after the prefill it needs ceil((64 + K + 1) / 16) = 5 blocks.

Only ``SpeculativeConfig``'s validation is skipped (it needs a draft checkpoint): the object is
the real class with its defaults, ``method`` and ``num_speculative_tokens`` set, so every
predicate the scheduler calls (``use_eagle()``, ``use_dflash()``, ``use_eagle_block_drop()``,
...) is vLLM's own code.

Usage: python probe.py MODEL_DIR   (a folder with a tiny config.json; no weights needed)
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import sys

BLOCK = 16
N = 4  # full prefix blocks
NUM_SPEC = 3


def spec_config(method: str):
    from vllm.config import SpeculativeConfig

    spec = object.__new__(SpeculativeConfig)
    for f in dataclasses.fields(SpeculativeConfig):
        value = f.default
        if value is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        default = getattr(value, "default", None)  # a pydantic FieldInfo
        if type(value).__name__ == "FieldInfo":
            factory = getattr(value, "default_factory", None)
            value = factory() if factory is not None else default
        if value is dataclasses.MISSING:
            value = None
        object.__setattr__(spec, f.name, value)
    object.__setattr__(spec, "method", method)
    object.__setattr__(spec, "num_speculative_tokens", NUM_SPEC)
    return spec


def build_scheduler(model_dir: str, method: str):
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=2048)
    vllm_config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        device_config=DeviceConfig(device="cpu"),
    )
    object.__setattr__(vllm_config, "speculative_config", spec_config(method))
    vllm_config.cache_config.num_gpu_blocks = 128  # what the engine sets after profiling
    kv_cache_config = KVCacheConfig(
        num_blocks=128,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32))],
    )
    kwargs = dict(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                  structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK,
                  log_stats=False)
    accepted = inspect.signature(Scheduler.__init__).parameters
    return Scheduler(**{k: v for k, v in kwargs.items() if k in accepted})


def make_request(request_id: str, tokens: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(request_id=request_id, prompt_token_ids=tokens,
                   sampling_params=SamplingParams(max_tokens=8), pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))


def probe(model_dir: str, method: str) -> dict:
    sched = build_scheduler(model_dir, method)
    prefix = [(7 * i + 3) % 200 + 1 for i in range(N * BLOCK)]
    first = make_request("first", prefix + [201, 202, 203])
    sched.add_request(first)
    out1 = sched.schedule()
    assert [r.req_id for r in out1.scheduled_new_reqs] == ["first"], out1
    second = make_request("second", prefix + [211, 212, 213])
    sched.add_request(second)
    out2 = sched.schedule()
    new = {r.req_id: r for r in out2.scheduled_new_reqs}
    hit_tokens = new["second"].num_computed_tokens
    split = sched._mamba_block_aligned_split(make_request("split", list(range(1, 101))), 100)
    return {
        "hit_tokens": hit_tokens,
        "hit_blocks": hit_tokens // BLOCK,
        "manager_drops": bool(sched.kv_cache_manager.use_eagle),
        "scheduler_use_eagle": bool(sched.use_eagle),
        "num_lookahead_tokens": sched.num_lookahead_tokens,
        "mamba_split": split,
    }


def lookahead_blocks(model_dir: str, method: str) -> list[int]:
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    sched = build_scheduler(model_dir, method)
    req = make_request("fresh", [(5 * i + 1) % 200 + 1 for i in range(64)])
    sched.add_request(req)
    owned = []

    def step(sampled: list[int] | None):
        out = sched.schedule()
        owned.append(len(sched.kv_cache_manager.get_block_ids("fresh")[0]))
        return out

    out = step(None)
    for sampled in ([7], [8, 9]):  # prefill samples one token; then one draft accepted + one sampled
        sched.update_from_output(out, ModelRunnerOutput(req_ids=["fresh"], req_id_to_index={"fresh": 0},
                                                        sampled_token_ids=[sampled]))
        sched.update_draft_token_ids(DraftTokenIds(["fresh"], [[8, 10, 11][:NUM_SPEC]]))
        out = step(sampled)
    return owned


def main() -> None:
    logging.disable(logging.WARNING)
    import vllm
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256_cbor)  # once: without PYTHONHASHSEED each call draws a new random seed

    from vllm.v1.core.sched import scheduler

    with open(scheduler.__file__) as fh:
        marked = "# ddtree-patch: dflash-prefix-cache-drop" in fh.read()
    result = {"version": vllm.__version__, "file": vllm.__file__, "scheduler_marked": marked, "block_size": BLOCK, "prefix_blocks": N,
              "num_spec": NUM_SPEC, "methods": {}}
    for method in ("dflash", "eagle3"):
        result["methods"][method] = probe(sys.argv[1], method)
        result["methods"][method]["lookahead_blocks"] = lookahead_blocks(sys.argv[1], method)
    print("PROBE-RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
