"""One in-process vLLM engine run (V1, CPU) on the tiny checkpoints; prints ``RESULT {json}``.

env: ROOT (checkpoints: make_tiny_ckpts.py, optionally branchy_ckpts.py), DTYPE (float32), EAGER=1|0,
CG_MODE (with EAGER=0: compilation_config cudagraph_mode, e.g. PIECEWISE; CG_SIZES: its
cudagraph_capture_sizes, comma-separated), GPU_MEM (gpu_memory_utilization),
LOGPROBS (top-k logprobs of each generated token), ORDER_STATS=1 (CPU: "order" counts the drafted trees whose spine-first node order differs from pop
order; it rebuilds each tree on the host), SYNC_DEBUG=1 (CUDA: host syncs during generation,
attributed to ddtree_patcher or vLLM frames), SPEC=0|1 (DFlash with
num_speculative_tokens DEPTH, default 3), DDTREE_PATCH_ENABLE / DDTREE_PATCH_BUDGET (DDTree),
N_PROMPTS, MAX_TOKENS; VLLM_ENABLE_V1_MULTIPROCESSING=1: vLLM's default engine core in its own process (as
``vllm serve`` runs it; the runtime's counters then live in that process: "hook", "tree_step" and "drafter"
come back empty, vLLM's metrics and the tokens do not); SCENARIO (``scenarios.py``: basic (default: N_PROMPTS greedy prompts x MAX_TOKENS),
mixed (prefix-sharing, long and short prompts, per-request max_tokens, greedy tree requests mixed
with chain-routed ones: penalties, logprobs), sampled (N_PROMPTS copies of one prompt, temperature 1,
per-request seeds SEED_BASE + i, MAX_TOKENS each)); engine knobs PREFIX_CACHING=1, BLOCK_SIZE,
MAX_NUM_SEQS, MAX_MODEL_LEN, NUM_BLOCKS (num_gpu_blocks_override: a tight KV cache forces
preemption), MAX_BATCHED_TOKENS; LLM_KW (a JSON dict merged into LLM()'s arguments, one level deep); KERNELS=reference (once the engine is built, TRITON_INTERPRET is
removed from the environment: vLLM's Triton kernels stay interpreted (decorated at import), while
ddtree_patcher's runtime, which decides per call, takes its torch reference tree builder and tree
walk (``kernels/tree_reference.py``, ``kernels/reference.py``, proven equal to the Triton kernels by tests/kernels) instead of
the interpreted Triton kernels: ~0.45 s per request and step for the builder alone under the
interpreter, the cost that makes large CPU runs impractical); DIAG_ALLOW_PW034=1 (diagnosis: lifts the runtime's refusal of torch.compile and CUDA graphs on vLLM 0.34.0's FA forward);
DIAG=1 (diagnosis: every FlashAttention layer call of a tree step checked against the dense references, diag_fa.py;
host syncs, so never in a proof run); HOLD_DIR / HOLD_N (engines started together on one GPU: this one exits only once
HOLD_N engines are past their start, so none frees GPU memory while another profiles); CONTROL=no-compaction (a negative control: the tree step runs but leaves
the KV where the tree put it; the engine runs in-process, so the class is patched here). The result carries the generated tokens and, for a DDTree run, the
counters of the tree walk (``hook.live_steps()``), of the tree-shaped target step
(``runtime.tree_step``) and of the DDTree drafter, and vLLM's own Prometheus counters
(``LLM.get_metrics()``: spec-decode drafts / accepted tokens, preemptions, prefix-cache hits).
"""
import json
import os
import sys
import time
import traceback


def _hold_mark(what: str) -> None:
    """HOLD_DIR (engines started together on one GPU, gpu_tree_e2e.sh PAR=1): this engine is past its start
    (or failed); vLLM's start-up asserts that no other process frees GPU memory while it profiles."""
    d = os.environ.get("HOLD_DIR")
    if d:
        open(os.path.join(d, f"{os.environ.get('TAG', os.getpid())}.{what}"), "w").close()


def _hold_wait() -> None:
    """HOLD_DIR: exit (freeing this engine's GPU memory) only once every engine of the wave (HOLD_N) is
    past its start, or after HOLD_MAX_S (default 400) seconds."""
    d = os.environ.get("HOLD_DIR")
    if not d:
        return
    n, t_end = int(os.environ.get("HOLD_N", "1")), time.time() + float(os.environ.get("HOLD_MAX_S", "400"))
    while time.time() < t_end and sum(f.endswith(".started") for f in os.listdir(d)) < n:
        time.sleep(1)


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t0 = time.perf_counter()
    root = os.environ.get("ROOT", "/tmp/tiny")
    spec = os.environ.get("SPEC") == "1"
    res = {"tag": os.environ.get("TAG", ""), "spec": spec}
    step = "import"
    try:
        if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1" and os.environ.get("CUDA_VISIBLE_DEVICES") == "":
            # the V2 runner on a CPU machine: Triton kept, its kernels interpreted (v2_cpu.py)
            import v2_cpu

            res["shims"] = [s for s in [v2_cpu.apply()] if s]
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        import vllm

        res["vllm"] = vllm.__version__
        res["vllm_file"] = vllm.__file__
        if os.environ.get("DIAG_ALLOW_PW034") == "1":  # diagnosis only (in-process engine): lift the runtime's
            from ddtree_patcher.runtime import tree_step as _ts  # refusal of torch.compile and CUDA graphs

            _ts.refuse_compiled_fa034 = lambda *a, **k: None  # on 0.34.0's FA forward
            res["diag_allow_pw034"] = True
        if os.environ.get("CONTROL") == "no-compaction":
            from ddtree_patcher.runtime import tree_step as _ts

            _orig = _ts.TargetTreeStep.after_walk

            def _no_moves(self, hook_step):  # CPU path: no groups; CUDA path: no compactors
                groups, self.groups = self.groups, []
                comps, self.compactors = self.compactors, ([] if self.compactors is not None else None)
                try:
                    _orig(self, hook_step)
                finally:
                    self.groups, self.compactors = groups, comps

            _ts.TargetTreeStep.after_walk = _no_moves
            res["control"] = "no-compaction"
        if os.environ.get("DIAG") == "1":  # diagnosis (in-process engine): every tree step's FA layer checked
            import diag_fa  # against the dense references (host syncs: never in a proof run)

            diag_fa.install()
            res["diag"] = True
        order = {"rows": 0, "reordered": 0}
        if os.environ.get("ORDER_STATS") == "1":  # host-side, CPU runs: trees whose node order the spine-first rule changed
            from ddtree_patcher.kernels import build_tree_ref
            from ddtree_patcher.runtime import ddtree as _dd

            _build = _dd.DDTreeDrafter.build

            def _counted(self, logits):
                tree, tokens = _build(self, logits)
                pop = build_tree_ref(logits.view(-1, self.depth, logits.shape[-1]), self.budget, self.topk,
                                     ancestor_mask=False)
                order["rows"] += pop.parents.shape[0]
                order["reordered"] += int((pop.parents.cpu() != tree.parents.cpu()).any(1).sum())
                return tree, tokens

            _dd.DDTreeDrafter.build = _counted
            res["order"] = order
        step = "LLM()"
        eager = os.environ.get("EAGER", "1") == "1"
        kw = dict(model=f"{root}/target", skip_tokenizer_init=True, dtype=os.environ.get("DTYPE", "float32"),
                  max_model_len=int(os.environ.get("MAX_MODEL_LEN", "256")),
                  max_num_seqs=int(os.environ.get("MAX_NUM_SEQS", "8")), enforce_eager=eager, disable_log_stats=False,
                  seed=0, max_num_batched_tokens=int(os.environ.get("MAX_BATCHED_TOKENS", "512")))
        if os.environ.get("PREFIX_CACHING"):
            kw["enable_prefix_caching"] = os.environ["PREFIX_CACHING"] == "1"
        if os.environ.get("BLOCK_SIZE"):
            kw["block_size"] = int(os.environ["BLOCK_SIZE"])
        if os.environ.get("NUM_BLOCKS"):  # a tight KV cache: the scheduler preempts
            kw["num_gpu_blocks_override"] = int(os.environ["NUM_BLOCKS"])
        if os.environ.get("GPU_MEM"):  # GPU runs: a small KV cache starts faster
            kw["gpu_memory_utilization"] = float(os.environ["GPU_MEM"])
        if not eager and os.environ.get("CG_MODE"):  # e.g. PIECEWISE (DDTree: attention outside the graphs)
            kw["compilation_config"] = {"cudagraph_mode": os.environ["CG_MODE"]}
            if os.environ.get("CG_SIZES"):  # e.g. "72": every decode batch padded to 8 requests of 9 rows
                kw["compilation_config"]["cudagraph_capture_sizes"] = [int(x) for x in os.environ["CG_SIZES"].split(",")]
        if os.environ.get("LLM_KW"):  # a JSON dict merged into LLM()'s arguments (dicts one level deep), e.g.
            # '{"compilation_config": {"pass_config": {...}}, "kernel_config": {"enable_jit_warmup": false}}'
            for k, v in json.loads(os.environ["LLM_KW"]).items():
                kw[k] = {**kw[k], **v} if isinstance(v, dict) and isinstance(kw.get(k), dict) else v
            res["llm_kw"] = json.loads(os.environ["LLM_KW"])
        res["eager"], res["cg_mode"], res["dtype"] = eager, os.environ.get("CG_MODE"), kw["dtype"]
        if spec:
            kw["speculative_config"] = {"method": "dflash", "model": f"{root}/dflash",
                                        "num_speculative_tokens": int(os.environ.get("DEPTH", "3"))}
        t1 = time.perf_counter()
        llm = LLM(**kw)
        res["engine_start_s"] = round(time.perf_counter() - t1, 1)
        _hold_mark("started")
        # the model runner this engine built (in-process engine core): its class and bases (V1 or V2)
        found = llm  # LLM -> engine -> in-process engine core -> executor -> worker -> model_runner
        for name in ("llm_engine", "engine_core", "engine_core", "model_executor", "driver_worker", "worker",
                     "model_runner"):
            found = getattr(found, name, None)
        res["runner_mro"] = sorted(f"{c.__module__}.{c.__qualname__}" for c in type(found).__mro__
                                   if c.__module__.startswith("vllm.")) if found is not None else []
        res["kernels"] = os.environ.get("KERNELS", "triton")
        if res["kernels"] == "reference":
            os.environ.pop("TRITON_INTERPRET", None)
        step = "generate"
        from scenarios import requests

        scenario = res["scenario"] = os.environ.get("SCENARIO", "basic")
        lp = int(os.environ.get("LOGPROBS", "0"))  # >0: the top-`lp` logprobs of every generated token
        token_lists, sp_kwargs = requests(scenario, n_prompts=int(os.environ.get("N_PROMPTS", "4")),
                                          max_tokens=int(os.environ.get("MAX_TOKENS", "32")), logprobs=lp,
                                          seed_base=int(os.environ.get("SEED_BASE", "0")))
        prompts = [TokensPrompt(prompt_token_ids=t) for t in token_lists]
        sp = [SamplingParams(detokenize=False, ignore_eos=True, **k) for k in sp_kwargs]
        res["n_requests"] = len(prompts)
        sync = os.environ.get("SYNC_DEBUG") == "1"
        if sync:  # CUDA: count host-synchronising calls during generation, by the innermost of our / vLLM's frames
            import warnings

            import torch

            SYNC = res["sync"] = {"ours": 0, "vllm": 0, "other": 0, "samples_ours": []}

            def _show(message, category, filename, lineno, file=None, line=None):
                if "synchroniz" not in str(message):
                    return
                who = "other"
                for fr in reversed(traceback.extract_stack()[:-1]):
                    if "/ddtree_patcher/" in fr.filename:
                        who = "ours"
                        where = f"{fr.filename.rsplit('/', 2)[-1]}:{fr.lineno} {fr.name}"
                        if len(SYNC["samples_ours"]) < 8 and where not in SYNC["samples_ours"]:
                            SYNC["samples_ours"].append(where)
                        break
                    if "/vllm/" in fr.filename:
                        who = "vllm"
                        break
                SYNC[who] += 1

            warnings.showwarning = _show
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        t2 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        res["generate_s"] = round(time.perf_counter() - t2, 2)
        if sync:
            torch.cuda.set_sync_debug_mode(0)
        res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        res["metrics"] = {}  # vLLM's counters (summed over label values)
        for m in llm.get_metrics():
            if type(m).__name__ == "Counter":
                res["metrics"][m.name] = res["metrics"].get(m.name, 0) + int(m.value)
        if lp:  # per request, per position: [[token, logprob], ...] best first
            res["logprobs"] = [[sorted(([int(t), float(x.logprob)] for t, x in d.items()), key=lambda e: -e[1])[:lp]
                                for d in (o.outputs[0].logprobs or [])] for o in outs]
        step = "counters"
        try:
            from ddtree_patcher.runtime import hook, tree_step

            res["hook"] = [{"kind": o.kind, "runner": type(o.runner).__name__, "engaged_steps": o.engaged_steps,
                            "tree_requests": o.tree_requests, "chain_steps": o.chain_steps, "fallbacks": o.fallbacks,
                            "reason_cache": len(o._reason_cache), "max_num_reqs": o.max_num_reqs}
                           for o in hook.live_steps()]
            res["accounting"] = [o.accounting.counters() for o in hook.live_steps()]  # tree vs spine (issue 35.1)
            res["tree_step"] = [tree_step.live(o.runner).counters() for o in hook.live_steps()
                                if tree_step.live(o.runner) is not None]
            drafters = [getattr(getattr(o.runner, "drafter", None) or getattr(o.runner, "speculator", None),
                                "ddtree_proposer", None) for o in hook.live_steps()]
            res["drafter"] = [{"budget": d.budget, "depth": d.depth, "steps": d.steps, "tree_rows": d.tree_rows,
                               "chain_rows": d.chain_rows} for d in drafters if d is not None]
        except ImportError:
            res["hook"] = "ddtree_patcher not importable"
        if res.get("diag"):
            import diag_fa

            res["diag"] = diag_fa.summary()
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported in RESULT
        res["ok"] = False
        res["error"] = f"at {step}: {type(e).__name__}: {str(e)[:1500]}"
        traceback.print_exc()
        _hold_mark("started")
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":  # stop the engine core process before os._exit
        try:
            llm.llm_engine.engine_core.shutdown()
        except BaseException:  # noqa: BLE001 - no engine (it failed to start), or already gone
            pass
    res["total_s"] = round(time.perf_counter() - t0, 1)
    print("RESULT " + json.dumps(res), flush=True)
    sys.stdout.flush()
    _hold_wait()
    os._exit(0 if res["ok"] else 1)


if __name__ == "__main__":  # vLLM spawns its engine core process, which re-imports this module: run nothing there
    main()
