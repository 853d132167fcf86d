"""One vLLM engine on the trained pair (benchmarks/pair/train.py), in its own process; prints
``RESULT {json}`` (measure.py runs one of these per engine).

env:
  PAIR         the pair's folder (target/, dflash/, heldout.json)
  TAG          the engine's name in the result
  SPEC         0: no speculation; 1: DFlash (num_speculative_tokens DEPTH, default 15); DDTree when
               DDTREE_PATCH_ENABLE=1 (its budget DDTREE_PATCH_BUDGET), read by ddtree_patcher's runtime
  BATCHES      comma-separated concurrencies (default 1,8,32): each greedy pass sends the prompts in
               waves of B requests (one llm.generate per wave), so B requests decode together
  TEMP1_BATCHES  the same for temperature 1 (default: the largest of BATCHES; empty: none)
  N_PROMPTS    prompts used (default 64: heldout.json's first N), N_B1 for B = 1 (default 16)
  MAX_TOKENS   tokens generated per request (default 128; ignore_eos)
  EAGER        1: enforce_eager; 0 (default): CUDA graphs with compilation_config cudagraph_mode CG_MODE
               (default FULL_DECODE_ONLY) and capture sizes B' x (rows per request) for B' in
               1,2,4,8,16,24,32.. up to max(BATCHES) (rows: 1, 1+DEPTH for the chain, 1+budget for DDTree);
               CG_SIZES overrides (comma-separated, empty: vLLM's default)
  COMPILE      compilation_config mode (default: vLLM's; 0 = no torch.compile)
  DTYPE        bfloat16 (default on CUDA) | float32 | float16
  GPU_MEM      gpu_memory_utilization (default 0.3 on CUDA)
  SKIP_TOKENIZER  1 (default): token ids in and out, vLLM never loads the tokenizer; 0: it loads
               the pair's tokenizer.json (the outputs are still compared as token ids)
  LOGPROBS     >0: one extra greedy pass at the largest B asking the top-LOGPROBS logprobs (no-spec
               engine: the margins that tell a near-tie)
  KERNELS      reference (CPU runs): TRITON_INTERPRET dropped once the engine is built, as in
               tests/patches/ddtree_tree_step/run_tree_engine.py
  LLM_KW       a JSON dict merged into LLM()'s arguments (dicts one level deep)
  DIAG_ALLOW_PW034  1: lift the runtime's refusal of CUDA graphs and torch.compile on vLLM 0.34.0's
               FlashAttention forward for this engine (recorded as ``diag_allow_pw034``; only after a GPU
               run showed those modes identical to no speculation, as gpu_tree_e2e.sh's engines do)

Every pass records: the generated tokens, wall seconds, output tokens/s, and the deltas of vLLM's
spec-decode counters (drafts, draft tokens, accepted tokens, accepted per position) and, for DDTree,
of ddtree_patcher's tree/spine accounting (ddtree_patcher/runtime/accounting.py: tree accepted and
spine accepted tokens over walked requests).
"""
import json
import os
import sys
import time
import traceback


def _metrics(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        kind = type(m).__name__
        if kind == "Counter":
            out[m.name] = out.get(m.name, 0) + int(m.value)
        elif kind == "Vector":
            prev = out.get(m.name) or [0] * len(m.values)
            out[m.name] = [int(a) + int(b) for a, b in zip(prev, m.values)]
    return out


def _accounting() -> dict | None:
    try:
        from ddtree_patcher.runtime import hook
    except ImportError:
        return None
    tot = {}
    for o in hook.live_steps():
        acc = getattr(o, "accounting", None)
        if acc is None:
            continue
        for k, v in acc.counters().items():
            if isinstance(v, int):
                tot[k] = tot.get(k, 0) + v
    return tot


def _policy() -> list | None:
    """DDTREE_PATCH_BUDGET=auto: each live drafter's policy summary (picks, switches, acceptance per budget)."""
    try:
        from ddtree_patcher.runtime.budget_site import policy_summaries
    except ImportError:
        return None
    return policy_summaries() or None


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, list):
            out[k] = [x - y for x, y in zip(v, b or [0] * len(v))]
        elif isinstance(v, (int, float)):
            out[k] = v - (b or 0)
    return out


def _spec_summary(d: dict, acc: dict | None) -> dict:
    drafts = d.get("vllm:spec_decode_num_drafts", 0)
    acc_tok = d.get("vllm:spec_decode_num_accepted_tokens", 0)
    s = {"drafts": drafts, "draft_tokens": d.get("vllm:spec_decode_num_draft_tokens", 0), "accepted": acc_tok,
         "accepted_per_pos": d.get("vllm:spec_decode_num_accepted_tokens_per_pos"),
         "tau": round(1 + acc_tok / drafts, 4) if drafts else None}
    if acc and acc.get("requests"):
        s["ddtree"] = {"requests": acc["requests"], "steps": acc.get("steps"), "tree_accepted": acc.get("tree_accepted"),
                       "spine_accepted": acc.get("spine_accepted"),
                       "tau_tree": round(1 + acc["tree_accepted"] / acc["requests"], 4),
                       "tau_spine": round(1 + acc["spine_accepted"] / acc["requests"], 4)}
    return s


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t0 = time.perf_counter()
    pair = os.environ["PAIR"]
    spec = os.environ.get("SPEC") == "1"
    ddtree = spec and os.environ.get("DDTREE_PATCH_ENABLE") == "1"
    depth = int(os.environ.get("DEPTH", "15"))
    budget, auto, widths = 0, False, None
    if ddtree:  # the runtime's own reading of DDTREE_PATCH_BUDGET (N, or auto:N) and auto's candidate budgets
        from ddtree_patcher.runtime.ddtree_config import auto_candidates
        from ddtree_patcher.runtime.switches import budget_spec

        budget, auto = budget_spec()
        widths = list(auto_candidates(budget, depth)) if auto else None
    batches = [int(x) for x in os.environ.get("BATCHES", "1,8,32").split(",") if x]
    t1b = os.environ.get("TEMP1_BATCHES")
    temp1 = [int(x) for x in (str(max(batches)) if t1b is None else t1b).split(",") if x]
    n_prompts, n_b1 = int(os.environ.get("N_PROMPTS", "64")), int(os.environ.get("N_B1", "16"))
    max_tokens = int(os.environ.get("MAX_TOKENS", "128"))
    res = {"tag": os.environ.get("TAG", ""), "spec": "ddtree" if ddtree else "chain" if spec else "none",
           "depth": depth if spec else 0, "budget": (f"auto:{budget}" if auto else budget) if ddtree else None,
           "passes": []}
    step = "import"
    try:
        import torch
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        import vllm

        res["vllm"], res["vllm_file"], res["torch"] = vllm.__version__, vllm.__file__, torch.__version__
        if os.environ.get("DIAG_ALLOW_PW034") == "1":  # in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)
            from ddtree_patcher.runtime import tree_step as _ts

            _ts.refuse_compiled_fa034 = lambda *a, **k: None
            res["diag_allow_pw034"] = True
        cuda = torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES") != ""
        res["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
        held = json.load(open(os.path.join(pair, "heldout.json")))
        prompts_all = held["prompts"][:n_prompts]
        plen = max(len(p) for p in prompts_all)
        eager = os.environ.get("EAGER", "0" if cuda else "1") == "1"
        kw = dict(model=f"{pair}/target", dtype=os.environ.get("DTYPE", "bfloat16" if cuda else "float32"),
                  max_model_len=int(os.environ.get("MAX_MODEL_LEN", str(plen + max_tokens + 128))),
                  max_num_seqs=max(batches), enforce_eager=eager, disable_log_stats=False, seed=0,
                  max_num_batched_tokens=int(os.environ.get("MAX_BATCHED_TOKENS", "8192")),
                  skip_tokenizer_init=os.environ.get("SKIP_TOKENIZER", "1") == "1")
        if cuda:
            kw["gpu_memory_utilization"] = float(os.environ.get("GPU_MEM", "0.3"))
        rows = 1 + (budget if ddtree else depth if spec else 0)
        # draft tokens per request a step may take (auto: each candidate's, a FULL graph for each)
        widths = widths or [rows - 1]
        if not eager:
            cc = {"cudagraph_mode": os.environ.get("CG_MODE", "FULL_DECODE_ONLY")}
            sizes = os.environ.get("CG_SIZES")
            if sizes is None:
                bs = sorted({b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64) if b < max(batches)} | {max(batches)})
                cc["cudagraph_capture_sizes"] = sorted({b * (1 + w) for b in bs for w in widths})
            elif sizes:
                cc["cudagraph_capture_sizes"] = [int(x) for x in sizes.split(",")]
            if os.environ.get("COMPILE"):
                cc["mode"] = int(os.environ["COMPILE"])
            kw["compilation_config"] = cc
        if spec:
            kw["speculative_config"] = {"method": "dflash", "model": f"{pair}/dflash", "num_speculative_tokens": depth}
        if os.environ.get("LLM_KW"):
            for k, v in json.loads(os.environ["LLM_KW"]).items():
                kw[k] = {**kw[k], **v} if isinstance(v, dict) and isinstance(kw.get(k), dict) else v
        res["llm_kw"] = {k: v for k, v in kw.items() if k != "model"}
        step = "LLM()"
        t1 = time.perf_counter()
        llm = LLM(**kw)
        res["engine_start_s"] = round(time.perf_counter() - t1, 1)
        if os.environ.get("KERNELS") == "reference":  # CPU: ddtree_patcher's torch reference builder and walk
            os.environ.pop("TRITON_INTERPRET", None)  # (vLLM's own Triton kernels stay interpreted)

        def run(prompts, temp, B, logprobs=0, tokens=max_tokens):
            """Waves of B requests; (tokens per request, seconds, output tokens, logprobs)."""
            sp = SamplingParams(temperature=temp, max_tokens=tokens, ignore_eos=True, detokenize=False,
                                **({"logprobs": logprobs} if logprobs else {}))
            toks, lps, n, secs = [], [], 0, 0.0
            for i in range(0, len(prompts), B):
                wave = [TokensPrompt(prompt_token_ids=p) for p in prompts[i:i + B]]
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                outs = llm.generate(wave, [sp] * len(wave), use_tqdm=False)
                secs += time.perf_counter() - t
                for o in outs:
                    toks.append(list(o.outputs[0].token_ids))
                    n += len(o.outputs[0].token_ids)
                    if logprobs:
                        lps.append([sorted(([int(t), float(x.logprob)] for t, x in d.items()),
                                           key=lambda e: -e[1])[:logprobs] for d in (o.outputs[0].logprobs or [])])
            return toks, secs, n, lps

        step = "warm-up"
        tw = time.perf_counter()
        for temp in sorted({0.0} | ({1.0} if temp1 else set())):  # JIT / autotune of both sampling paths, every B
            for B in sorted(set(batches) | set(temp1 if temp else [])):
                run(prompts_all[:B], temp, B, tokens=24)
        res["warmup_s"] = round(time.perf_counter() - tw, 1)
        step = "passes"
        plan = [(0.0, B) for B in batches] + [(1.0, B) for B in temp1]
        for temp, B in plan:
            prompts = prompts_all[:n_b1] if B == 1 else prompts_all
            m0, a0 = _metrics(llm), _accounting()
            toks, secs, n, _ = run(prompts, temp, B)
            d = _delta(_metrics(llm), m0)
            a1 = _accounting()
            acc = _delta(a1, a0) if a1 is not None and a0 is not None else None
            p = {"temperature": temp, "B": B, "requests": len(prompts), "seconds": round(secs, 3),
                 "output_tokens": n, "tok_per_s": round(n / secs, 1), "spec": _spec_summary(d, acc) if spec else None,
                 "tokens": toks}
            pol = _policy()
            if pol:  # cumulative over the engine's passes so far
                p["policy"] = pol
            res["passes"].append(p)
            sd = p["spec"] or {}
            print(f"PASS {res['tag']} T={temp} B={B}: {n} tokens in {secs:.2f} s = {n / secs:.1f} tok/s, "
                  f"tau {sd.get('tau')}, ddtree {sd.get('ddtree')}", flush=True)
        lp = int(os.environ.get("LOGPROBS", "0"))
        if lp:
            B = max(batches)
            toks, secs, n, lps = run(prompts_all, 0.0, B, logprobs=lp)
            res["logprobs_pass"] = {"B": B, "tokens": toks, "logprobs": lps}
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported in RESULT
        res["ok"] = False
        res["error"] = f"at {step}: {type(e).__name__}: {str(e)[:1500]}"
        traceback.print_exc()
    res["total_s"] = round(time.perf_counter() - t0, 1)
    print("RESULT " + json.dumps(res), flush=True)
    sys.stdout.flush()
    os._exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()
