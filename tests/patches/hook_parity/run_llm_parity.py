"""One vLLM engine run with a mix of sampling parameters; prints ``RESULT {json}`` (H200 script
scripts/gpu_hook_parity.sh; tiny checkpoints of tests/patches/engine_tools/make_tiny_ckpts.py).

env: ROOT, SPEC=1 (DFlash K=3), EAGER=1|0, TAG, DTYPE (bfloat16), SYNC_DEBUG=1 (every call of
TreeStep.sample_v1/sample_v2 runs under torch.cuda.set_sync_debug_mode("error"): a host
synchronisation inside the step raises and the run fails).
Requests: 4 greedy (compared with the no-speculation run), then sampled ones with temperature,
top-k, top-p, min-p, logit bias, allowed token ids, min_tokens, seeds (tree-ok), and chain-only
ones with presence/repetition penalties and bad words (verified by vLLM's own sampler in the same
steps). Logprobs requests are left out of the sync proof (vLLM's own logprob ranking syncs).
"""
import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
t0 = time.perf_counter()
root = os.environ.get("ROOT", "/tmp/tiny")
spec = os.environ.get("SPEC") == "1"
eager = os.environ.get("EAGER", "1") == "1"
res = {"tag": os.environ.get("TAG", ""), "spec": spec, "eager": eager}
step = "import"
try:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm

    res["vllm"] = vllm.__version__
    calls = {"n": 0}
    if os.environ.get("SYNC_DEBUG") == "1":
        from ddtree_patcher.runtime import hook

        def guarded(fn):
            def run(self, *a, **k):
                calls["n"] += 1
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return fn(self, *a, **k)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            return run

        hook.TreeStep.sample_v1 = guarded(hook.TreeStep.sample_v1)
        hook.TreeStep.sample_v2 = guarded(hook.TreeStep.sample_v2)
    step = "LLM()"
    kw = dict(model=f"{root}/target", skip_tokenizer_init=True, dtype=os.environ.get("DTYPE", "bfloat16"),
              max_model_len=256, max_num_seqs=16, enforce_eager=eager, gpu_memory_utilization=0.25,
              disable_log_stats=False, seed=0)
    if not eager:
        kw["compilation_config"] = {"max_cudagraph_capture_size": 32}
    if spec:
        kw["speculative_config"] = {"method": "dflash", "model": f"{root}/dflash", "num_speculative_tokens": 3}
    t1 = time.perf_counter()
    llm = LLM(**kw)
    res["engine_start_s"] = round(time.perf_counter() - t1, 1)
    step = "generate"
    prompts = [TokensPrompt(prompt_token_ids=[(7 * j + 3 * i) % 997 + 2 for j in range(8 + 5 * i)]) for i in range(12)]
    base = dict(max_tokens=32, detokenize=False, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, **base) for _ in range(4)] + [
        SamplingParams(temperature=0.8, top_k=20, seed=1, **base),
        SamplingParams(temperature=1.0, top_p=0.9, **base),
        SamplingParams(temperature=0.7, min_p=0.05, seed=2, **base),
        SamplingParams(temperature=0.0, logit_bias={7: 2.0}, **base),
        SamplingParams(temperature=0.9, allowed_token_ids=list(range(2, 400)), seed=3, **base),
        SamplingParams(temperature=0.0, min_tokens=8, stop_token_ids=[5], **base),
        SamplingParams(temperature=0.0, presence_penalty=0.5, repetition_penalty=1.1, **base),
        SamplingParams(temperature=0.6, frequency_penalty=0.3, seed=4, **base),
    ]
    t2 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    res["generate_s"] = round(time.perf_counter() - t2, 2)
    res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    res["step_calls_under_sync_debug"] = calls["n"]
    try:
        from ddtree_patcher.runtime.hook import live_steps

        res["hook"] = [{"kind": o.kind, "chain_as_tree": o.chain_as_tree, "engaged_steps": o.engaged_steps,
                        "chain_steps": o.chain_steps, "tree_requests": o.tree_requests, "fallbacks": o.fallbacks}
                       for o in live_steps()]
    except ImportError:
        res["hook"] = "ddtree_patcher not importable"
    res["ok"] = True
except BaseException as e:  # noqa: BLE001 - reported in RESULT
    res["ok"] = False
    res["error"] = f"at {step}: {type(e).__name__}: {str(e)[:800]}"
    traceback.print_exc()
res["total_s"] = round(time.perf_counter() - t0, 1)
print("RESULT " + json.dumps(res), flush=True)
sys.stdout.flush()
os._exit(0 if res["ok"] else 1)
