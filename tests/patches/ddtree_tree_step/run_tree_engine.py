"""One in-process vLLM engine run (V1, CPU) on the tiny checkpoints; prints ``RESULT {json}``.

env: ROOT (checkpoints: make_tiny_ckpts.py, optionally branchy_ckpts.py), SPEC=0|1 (DFlash with
num_speculative_tokens DEPTH, default 3), DDTREE_PATCH_ENABLE / DDTREE_PATCH_BUDGET (DDTree),
N_PROMPTS, MAX_TOKENS; CONTROL=no-compaction (a negative control: the tree step runs but leaves
the KV where the tree put it; the engine runs in-process, so the class is patched here). The result carries the generated tokens and, for a DDTree run, the
counters of the tree walk (``hook.live_steps()``), of the tree-shaped target step
(``runtime.tree_step``) and of the DDTree drafter.
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
res = {"tag": os.environ.get("TAG", ""), "spec": spec}
step = "import"
try:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm

    res["vllm"] = vllm.__version__
    res["vllm_file"] = vllm.__file__
    if os.environ.get("CONTROL") == "no-compaction":
        from ddtree_patcher.runtime import tree_step as _ts

        _orig = _ts.TargetTreeStep.after_walk

        def _no_moves(self, hook_step):
            groups, self.groups = self.groups, []
            try:
                _orig(self, hook_step)
            finally:
                self.groups = groups

        _ts.TargetTreeStep.after_walk = _no_moves
        res["control"] = "no-compaction"
    step = "LLM()"
    kw = dict(model=f"{root}/target", skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              max_num_seqs=8, enforce_eager=True, disable_log_stats=False, seed=0,
              max_num_batched_tokens=int(os.environ.get("MAX_BATCHED_TOKENS", "512")))
    if spec:
        kw["speculative_config"] = {"method": "dflash", "model": f"{root}/dflash",
                                    "num_speculative_tokens": int(os.environ.get("DEPTH", "3"))}
    t1 = time.perf_counter()
    llm = LLM(**kw)
    res["engine_start_s"] = round(time.perf_counter() - t1, 1)
    step = "generate"
    n_prompts = int(os.environ.get("N_PROMPTS", "4"))
    max_tokens = int(os.environ.get("MAX_TOKENS", "32"))
    prompts = [TokensPrompt(prompt_token_ids=[(7 * j + 3 * i) % 997 + 2 for j in range(8 + 5 * i)])
               for i in range(n_prompts)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    t2 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    res["generate_s"] = round(time.perf_counter() - t2, 2)
    res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    step = "counters"
    try:
        from ddtree_patcher.runtime import hook, tree_step

        res["hook"] = [{"kind": o.kind, "runner": type(o.runner).__name__, "engaged_steps": o.engaged_steps,
                        "tree_requests": o.tree_requests, "chain_steps": o.chain_steps, "fallbacks": o.fallbacks}
                       for o in hook.live_steps()]
        res["tree_step"] = [tree_step.live(o.runner).counters() for o in hook.live_steps()
                            if tree_step.live(o.runner) is not None]
        drafters = [getattr(getattr(o.runner, "drafter", None), "ddtree_proposer", None) for o in hook.live_steps()]
        res["drafter"] = [{"budget": d.budget, "depth": d.depth, "steps": d.steps, "tree_rows": d.tree_rows,
                           "chain_rows": d.chain_rows} for d in drafters if d is not None]
    except ImportError:
        res["hook"] = "ddtree_patcher not importable"
    res["ok"] = True
except BaseException as e:  # noqa: BLE001 - reported in RESULT
    res["ok"] = False
    res["error"] = f"at {step}: {type(e).__name__}: {str(e)[:1500]}"
    traceback.print_exc()
res["total_s"] = round(time.perf_counter() - t0, 1)
print("RESULT " + json.dumps(res), flush=True)
sys.stdout.flush()
os._exit(0 if res["ok"] else 1)
