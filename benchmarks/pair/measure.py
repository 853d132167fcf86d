"""Measure the trained pair (benchmarks/pair/train.py) in vLLM: one process per engine
(benchmarks/pair/worker.py), the same held-out prompts for each:

  nospec   no speculation (plus one greedy pass asking logprobs: the margins of any divergence)
  chain    DFlash, num_speculative_tokens 15
  dd15, dd31, dd63   DDTree (DDTREE_PATCH_ENABLE=1), depth 15, DDTREE_PATCH_BUDGET 15 / 31 / 63

Each engine: greedy passes at every B of --batches (tokens/s: output tokens over the wall of the
waves; B = 1 on --n-b1 prompts) and temperature-1 passes at --temp1-batches; acceptance
tau = 1 + accepted / drafts from vLLM's spec-decode counters (tokens per verify step per request,
the bonus token included) and, for DDTree, the tree and spine tau from ddtree_patcher's accounting
(the spine: what the DFlash chain would have accepted on the same draft). Every speculative
engine's greedy tokens are compared with no speculation's at the same B (identical requests;
for a divergence: its position and no-spec's top-2 logprob margin there, from the logprobs pass
at the largest B).

The vLLM the workers import is the caller's: run this with PYTHONPATH (and the environment) of the
patched site, or pass --python. Writes --record (the docs/runs-style JSON: device, vLLM, commit,
every number; no tokens) and --full (everything, tokens included), prints a markdown table.

usage: python measure.py --pair DIR --record OUT.json [--full FULL.json] [--engines nospec,chain,dd15,...]
       [--batches 1,8,32] [--temp1-batches 32] [--n-prompts 64] [--n-b1 16] [--max-tokens 128]
       [--cg-mode FULL_DECODE_ONLY | --eager] [--budget-s S] [--logs DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
ENGINES = {
    "nospec": {"SPEC": "0", "LOGPROBS": "2"},
    "chain": {"SPEC": "1"},
    "dd15": {"SPEC": "1", "DDTREE_PATCH_ENABLE": "1", "DDTREE_PATCH_BUDGET": "15"},
    "dd31": {"SPEC": "1", "DDTREE_PATCH_ENABLE": "1", "DDTREE_PATCH_BUDGET": "31"},
    "dd63": {"SPEC": "1", "DDTREE_PATCH_ENABLE": "1", "DDTREE_PATCH_BUDGET": "63"},
    # issue 35.2: the budget of each step picked among the spine (the chain), 31 and 63 by the policy
    "ddauto": {"SPEC": "1", "DDTREE_PATCH_ENABLE": "1", "DDTREE_PATCH_BUDGET": "auto:63"},
}
TIE = 0.5  # nats: a divergence where no-spec's top-2 margin is below this is a near-tie


def run_engine(tag, env_extra, a, logs, timeout) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_PATCH_")}
    env.update({"PAIR": a.pair, "TAG": tag, "BATCHES": a.batches, "TEMP1_BATCHES": a.temp1_batches,
                "N_PROMPTS": str(a.n_prompts), "N_B1": str(a.n_b1), "MAX_TOKENS": str(a.max_tokens),
                "DEPTH": str(a.depth), "EAGER": "1" if a.eager else "0", "CG_MODE": a.cg_mode,
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, **env_extra)
    log = os.path.join(logs, f"{tag}.log")
    t = time.time()
    try:
        with open(log, "w") as fh:
            proc = subprocess.run([a.python, os.path.join(HERE, "worker.py")], stdout=subprocess.PIPE,
                                  stderr=fh, text=True, env=env, timeout=timeout,
                                  cwd=logs)  # not the repository: its kernels/ would shadow a module of that name
        out = proc.stdout
        with open(log, "a") as fh:
            fh.write(out)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"tag": tag, "ok": False, "error": f"timed out after {timeout} s", "wall_s": round(time.time() - t, 1)}
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    res = json.loads(lines[-1][7:]) if lines else {"tag": tag, "ok": False, "error": f"no RESULT (exit {proc.returncode})"}
    res["wall_s"] = round(time.time() - t, 1)
    return res


def compare(ref_tokens, tokens, margins=None) -> dict:
    """Identical requests; per divergence (request, position, no-spec's top-2 margin there or None)."""
    div = []
    for i, (x, y) in enumerate(zip(ref_tokens, tokens)):
        k = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if k is None and len(x) != len(y):
            k = min(len(x), len(y))
        if k is not None:
            m = None
            if margins and i < len(margins) and k < len(margins[i]) and len(margins[i][k]) > 1:
                m = round(margins[i][k][0][1] - margins[i][k][1][1], 4)
            div.append([i, k, m])
    return {"identical": len(ref_tokens) - len(div), "requests": len(ref_tokens), "divergences": div,
            "near_ties": sum(1 for _, _, m in div if m is not None and m < TIE)}


def summarise(results: dict) -> dict:
    """Per engine and pass: the numbers (no tokens), greedy comparison with no-spec, speed-ups."""
    ref = results.get("nospec") if results.get("nospec", {}).get("ok") else None
    ref_pass = {(p["temperature"], p["B"]): p for p in (ref or {}).get("passes", [])}
    margins = ((ref or {}).get("logprobs_pass") or {}).get("logprobs")
    out = {}
    for tag, r in results.items():
        e = {k: r.get(k) for k in ("ok", "error", "spec", "depth", "budget", "engine_start_s", "warmup_s",
                                   "total_s", "wall_s", "device", "vllm")}
        e["passes"] = []
        for p in r.get("passes", []):
            q = {k: v for k, v in p.items() if k != "tokens"}
            rp = ref_pass.get((p["temperature"], p["B"]))
            if rp:
                q["speedup"] = round(p["tok_per_s"] / rp["tok_per_s"], 3) if rp["tok_per_s"] else None
                if p["temperature"] == 0.0 and tag != "nospec":
                    q["vs_nospec"] = compare(rp["tokens"], p["tokens"], margins if p["B"] == max(
                        x["B"] for x in ref["passes"]) else None)
            e["passes"].append(q)
        if tag == "nospec" and r.get("logprobs_pass") and ref_pass:  # the logprobs pass = the timed pass?
            big = max(b for (_, b) in ref_pass)
            e["logprobs_pass_same_tokens"] = r["logprobs_pass"]["tokens"] == ref_pass[(0.0, big)]["tokens"]
        out[tag] = e
    return out


def table(summary: dict, batches: list[int]) -> str:
    hdr = ["engine", "τ greedy (B=max)", "spine τ", "τ T=1", *[f"tok/s B={b}" for b in batches],
           *[f"× B={b}" for b in batches], "greedy identical (per B)"]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for tag, e in summary.items():
        if not e.get("ok"):
            lines.append(f"| {tag} | failed: {str(e.get('error'))[:120]} |" + " |" * (len(hdr) - 2))
            continue
        g = {p["B"]: p for p in e["passes"] if p["temperature"] == 0.0}
        t1 = [p for p in e["passes"] if p["temperature"] == 1.0]
        gm = g.get(max(g)) if g else None
        sp = (gm or {}).get("spec") or {}
        dd = sp.get("ddtree") or {}
        t1s = (t1[-1].get("spec") or {}) if t1 else {}
        ident = " / ".join(f"{g[b]['vs_nospec']['identical']}/{g[b]['vs_nospec']['requests']}" for b in batches
                           if b in g and g[b].get("vs_nospec")) or "-"
        row = [tag, str(sp.get("tau", "-")), str(dd.get("tau_spine", "-")),
               f"{t1s.get('tau', '-')}" + (f" (spine {t1s['ddtree']['tau_spine']})" if t1s.get("ddtree") else ""),
               *[str(g[b]["tok_per_s"]) if b in g else "-" for b in batches],
               *[str(g[b].get("speedup", "-")) if b in g else "-" for b in batches], ident]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def git_commit() -> str | None:
    try:
        c = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        d = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, timeout=10)
        return c.stdout.strip() + ("+dirty" if d.stdout.strip() else "") if c.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", required=True)
    p.add_argument("--record", required=True)
    p.add_argument("--full")
    p.add_argument("--logs")
    p.add_argument("--engines", default="nospec,chain,dd15,dd31,dd63,ddauto")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--temp1-batches", default=None, help="default: the largest of --batches; '' for none")
    p.add_argument("--n-prompts", type=int, default=64)
    p.add_argument("--n-b1", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=15)
    p.add_argument("--cg-mode", default="FULL_DECODE_ONLY")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--budget-s", type=float, default=540, help="wall budget of all engines")
    p.add_argument("--min-engine-s", type=float, default=60, help="skip an engine with less than this left")
    p.add_argument("--rerun", action="store_true", help="rerun engines finished in an earlier call (--logs)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--commit", default=None, help="the repository commit to record (default: git here)")
    a = p.parse_args(argv)
    if a.temp1_batches is None:
        a.temp1_batches = str(max(int(x) for x in a.batches.split(",")))
    a.pair = os.path.abspath(a.pair)
    logs = a.logs or os.path.join(os.path.dirname(os.path.abspath(a.record)), "pair_logs")
    os.makedirs(logs, exist_ok=True)
    t0 = time.time()
    results = {}
    for tag in a.engines.split(","):
        done = os.path.join(logs, f"{tag}.json")  # a finished engine of an earlier call (same logs dir): kept
        if os.path.exists(done) and not a.rerun:
            r = results[tag] = json.load(open(done))
            if r.get("ok"):
                print(f"=== {tag}: kept from {done}", flush=True)
                continue
        left = a.budget_s - (time.time() - t0)
        if left < a.min_engine_s:
            print(f"SKIP {tag} ({left:.0f} s left)", flush=True)
            results[tag] = {"tag": tag, "ok": False, "error": f"skipped: {left:.0f} s of the budget left"}
            continue
        print(f"=== {tag} (limit {left:.0f} s)", flush=True)
        r = results[tag] = run_engine(tag, ENGINES[tag], a, logs, int(left))
        if r.get("ok"):
            json.dump(r, open(done, "w"))
        print(f"{tag}: ok={r.get('ok')} start {r.get('engine_start_s')} s, warm-up {r.get('warmup_s')} s, "
              f"wall {r.get('wall_s')} s {r.get('error') or ''}", flush=True)
        for q in r.get("passes", []):
            s = q.get("spec") or {}
            print(f"   T={q['temperature']} B={q['B']}: {q['tok_per_s']} tok/s, tau {s.get('tau')}, "
                  f"ddtree {s.get('ddtree')}", flush=True)
    summary = summarise(results)
    batches = [int(x) for x in a.batches.split(",")]
    md = table(summary, batches)
    train_rep = {}
    tr = os.path.join(a.pair, "train_report.json")
    if os.path.exists(tr):
        t = json.load(open(tr))
        train_rep = {"target_heldout": t["target"]["best"], "target_params": t["target"]["params"],
                     "drafter_params": t["drafter"]["params"], "drafter_heldout": t["drafter"]["final"],
                     "offline_acceptance": t.get("offline_acceptance"), "target_shape": t["target_shape"],
                     "drafter_shape": t["drafter_shape"], "target_layer_ids": t["target_layer_ids"],
                     "corpus": t["corpus"], "python": t["python"], "files": t["files"], "tokens": t["tokens"],
                     "train_wall_s": t["wall_s"], "train_device": t["device"], "args": t["args"]}
    ok = [r for r in results.values() if r.get("ok")]
    record = {"what": "issue 36: a trained Qwen3 target + DFlash drafter (benchmarks/pair), chain vs DDTree in vLLM",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": a.commit or git_commit(), "device": ok[0].get("device") if ok else None,
              "vllm": ok[0].get("vllm") if ok else None, "torch": ok[0].get("torch") if ok else None,
              "settings": {k: v for k, v in vars(a).items() if k not in ("python",)}, "pair": train_rep,
              "engines": summary, "table": md, "tie_nats": TIE, "wall_s": round(time.time() - t0, 1)}
    os.makedirs(os.path.dirname(os.path.abspath(a.record)), exist_ok=True)
    json.dump(record, open(a.record, "w"), indent=1)
    if a.full:
        json.dump(results, open(a.full, "w"))
    print(md)
    print("PAIR-MEASURE", "ok" if len(ok) == len(results) else "FAIL " + ",".join(t for t, r in results.items()
                                                                                  if not r.get("ok")))
    return record


if __name__ == "__main__":
    main()
