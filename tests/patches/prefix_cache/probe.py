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
* ``connectors``: the block-drop flag of the KV connectors' own code (offloading, Mooncake store,
  simple CPU offload; None where absent), see :func:`connector_drop`;
* ``annotated`` / ``warned``: the KV cache group annotation and its "no draft group" warning
  (None where absent), see :func:`annotation`;
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
import os
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


CONNECTORS = {  # file -> the function that decides its block drop
    "offloading": ("vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py", "SchedulerOffloadConfig.from_spec"),
    "mooncake": ("vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py", "MooncakeStoreWorker.__init__"),
    "simple_offload": ("vllm/v1/simple_kv_offload/manager.py", "SimpleCPUOffloadScheduler.__init__"),
}


def _calls(node, names) -> bool:
    import ast

    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in names
               for n in ast.walk(node))


def connector_drop(site_root: str, rel: str, qualname: str, spec) -> bool | None:
    """The block-drop flag the release's own function computes for ``spec``: its statement
    ``<flag> = <... X.use_eagle() / X.use_eagle_block_drop() ...>`` and any following statements
    that reassign the flag (a patch's), executed with the real SpeculativeConfig as X. None where
    the file or the decision is absent."""
    import ast
    import os
    from types import SimpleNamespace

    path = os.path.join(site_root, rel)
    if not os.path.exists(path):
        return None
    tree = ast.parse(open(path).read())
    body = tree.body
    for part in qualname.split("."):
        body = next(n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part).body
    fn_body = [n for n in ast.walk(ast.Module(body=body, type_ignores=[])) if hasattr(n, "body")
               and isinstance(getattr(n, "body"), list)]
    for block in fn_body:
        for i, stmt in enumerate(block.body):
            if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                    and _calls(stmt.value, {"use_eagle", "use_eagle_block_drop"})):
                flag = stmt.targets[0].id
                stmts = [stmt]
                for nxt in block.body[i + 1:]:
                    if isinstance(nxt, ast.Assign) and [t.id for t in nxt.targets if isinstance(t, ast.Name)] == [flag]:
                        stmts.append(nxt)
                    else:
                        break
                vllm_config = SimpleNamespace(speculative_config=spec)
                ns = {"spec_config": spec, "spec_cfg": spec, "vllm_config": vllm_config,
                      "spec": SimpleNamespace(vllm_config=vllm_config)}
                exec(compile(ast.Module(body=stmts, type_ignores=[]), path, "exec"), ns)
                return bool(ns[flag])
    return None


def annotation(spec) -> dict:
    """What the release's kv_cache_utils does for ``spec``: whether it flags a DeepSeek-V4 target's
    last-layer group as a draft group (``annotated``) and whether it warns that no group is one on a
    hybrid target (``warned``); None where the release has no such function."""
    import torch
    from types import SimpleNamespace

    from vllm.v1.core import kv_cache_utils as ku
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    vllm_config = SimpleNamespace(speculative_config=spec)
    layers = {"model.layers.0.attn": SimpleNamespace(model_version="deepseek_v4"),
              "model.layers.1.attn": SimpleNamespace(model_version="deepseek_v4")}
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    out = {"annotated": None, "warned": None}
    groups = [KVCacheGroupSpec(list(layers), full)]
    if hasattr(ku, "_annotate_eagle_groups_deepseek_v4"):
        ku._annotate_eagle_groups_deepseek_v4(vllm_config, layers, groups)
        out["annotated"] = groups[0].is_eagle_group
    elif hasattr(ku, "_annotate_eagle_groups"):  # 0.29.0+: rule 2, the trailing-layer fallback, enabled
        import inspect

        fallback = next(p for p in inspect.signature(ku._annotate_eagle_groups).parameters if p.startswith("use_"))
        ku._annotate_eagle_groups(vllm_config, layers, groups, **{fallback: True})
        out["annotated"] = groups[0].is_eagle_group
    if hasattr(ku, "_warn_if_unannotated_eagle_mamba"):
        from vllm.v1.kv_cache_interface import MambaSpec

        mamba = MambaSpec(block_size=BLOCK, shapes=((4,),), dtypes=(torch.float32,))
        warnings = []
        original, ku.logger.warning = ku.logger.warning, lambda *a, **k: warnings.append(a)
        try:
            ku._warn_if_unannotated_eagle_mamba(vllm_config, [KVCacheGroupSpec(["model.layers.0.mixer"], mamba)])
        finally:
            ku.logger.warning = original
        out["warned"] = bool(warnings)
    return out


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
        root = os.path.dirname(os.path.dirname(vllm.__file__))
        result["methods"][method]["connectors"] = {
            name: connector_drop(root, rel, fn, spec_config(method)) for name, (rel, fn) in CONNECTORS.items()}
        result["methods"][method].update(annotation(spec_config(method)))
    print("PROBE-RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
