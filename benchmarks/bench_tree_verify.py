#!/usr/bin/env python3
"""Benchmark DDTree ``tree_verify`` against vLLM's chain rejection sampler on a GPU.

What it does, in one process:

1. Correctness on the GPU: kernel == ``tree_verify_ref`` (bit-exact) on random
   mixed greedy/sampled batches (small V and V = 151,936), and a B=256 x 512-node
   run at V = 151,936 (greedy and sampled) checked request by request against the
   reference on sliced rows (rows beyond int32 element offsets included).
2. Timing (CUDA-graph replay, median of many replays, inputs rotated so that the
   bytes touched per replay exceed 2x L2 where memory allows) of
   * ours greedy (argmax given), ours sampled target-only with in-kernel Philox
     (probs given) and with explicit coins + inv_exp noise,
   * vLLM chain kernels on the same number of draft tokens (chain of K = n):
     ``rejection_greedy_sample_kernel`` alone (argmax given), the random path with
     probs given (uniforms + ``sample_recovered_tokens`` + random kernel), and the
     full ``rejection_sample`` random path from logits (includes its softmax),
   for B in {1, 8, 64, 256}, n in {8, 32, 128}, V = 151,936, fp32.
3. Prints a compact table (each timing next to its bytes floor, docs/benchmarks.md) and
   writes everything to ``$OUT/bench.json`` when OUT is set.

Run from the repository root: ``PYTHONPATH=. python benchmarks/bench_tree_verify.py``.
If ``ddtree_patcher.kernels`` is not installed, ``kernels/`` is loaded from the repo.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import pathlib
import sys
import time
import traceback
import types

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _timing import graph_time  # noqa: E402

HBM_PEAK = 4.8e12  # H200 datasheet, bytes/s


def import_kernels():
    try:
        return importlib.import_module("ddtree_patcher.kernels")
    except ImportError:
        pass
    for name in [m for m in sys.modules if m.startswith("ddtree_patcher.kernels")]:
        del sys.modules[name]
    try:
        parent = importlib.import_module("ddtree_patcher")
    except ImportError:
        parent = types.ModuleType("ddtree_patcher")
        parent.__path__ = []
        sys.modules["ddtree_patcher"] = parent
    kdir = REPO / "kernels"
    spec = importlib.util.spec_from_file_location(
        "ddtree_patcher.kernels", kdir / "__init__.py", submodule_search_locations=[str(kdir)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ddtree_patcher.kernels"] = mod
    spec.loader.exec_module(mod)
    parent.kernels = mod
    return mod


K = import_kernels()
tree_verify, tree_verify_ref = K.tree_verify, K.tree_verify_ref


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------
def make_trees(B, n, V, gen, chain=False, spine_p=0.6):
    """B DDTree-like trees with exactly n nodes each (flat layout, on CPU)."""
    j = torch.arange(1, n + 1)
    if chain:
        par = (j - 1).repeat(B)
    else:
        r = torch.rand(B, n, generator=gen)
        rnd = (torch.rand(B, n, generator=gen) * j).long() // 2
        par = torch.where(r < spine_p, (j - 1).expand(B, n), rnd).reshape(-1)
    tok = torch.randint(0, V, (B * n,), generator=gen)
    cu = (torch.arange(1, B + 1) * n).to(torch.int32)
    return tok.to(torch.int32), par.to(torch.int32), cu


def first_child_rows(par, B, n):
    """Flat target row of each node's first child (-1 if none), per row."""
    T = B * (n + 1)
    fc = torch.full((T,), -1, dtype=torch.long)
    req = torch.arange(B).repeat_interleave(n)
    jj = torch.arange(1, n + 1).repeat(B)
    row0 = req * (n + 1)
    prow = row0 + par.long()
    crow = row0 + jj
    order = torch.argsort(crow, descending=True)  # assign highest first, lowest wins
    fc[prow[order]] = crow[order]
    return fc


def greedy_inputs(B, n, V, gen, follow_p=0.85, chain=False):
    tok, par, cu = make_trees(B, n, V, gen, chain=chain)
    T = B * (n + 1)
    fc = first_child_rows(par, B, n)
    node_tok = torch.full((T,), 0, dtype=torch.long)
    req = torch.arange(B).repeat_interleave(n)
    node_tok[req * (n + 1) + torch.arange(1, n + 1).repeat(B)] = tok.long()
    am = torch.randint(0, V, (T,), generator=gen)
    follow = (fc >= 0) & (torch.rand(T, generator=gen) < follow_p)
    am = torch.where(follow, node_tok[fc.clamp(min=0)], am)
    return tok, par, cu, am.to(torch.int32)


def sampled_probs(tok, par, B, n, V, dev, gen, edge_first=0.8, edge_other=0.04):
    """fp32 [T, V] rows with background mass and boosted edge probabilities."""
    T = B * (n + 1)
    probs = torch.rand(T, V, device=dev, dtype=torch.float32)
    probs.mul_(0.1 / V)
    req = torch.arange(B).repeat_interleave(n)
    jj = torch.arange(1, n + 1).repeat(B)
    prow = req * (n + 1) + par.long()
    fc = first_child_rows(par, B, n)
    is_first = fc[prow] == req * (n + 1) + jj
    val = torch.where(is_first, torch.tensor(edge_first), torch.tensor(edge_other))
    probs[prow.to(dev), tok.long().to(dev)] = val.to(dev)
    return probs


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------
def n_rotations(bytes_touched, bytes_per_set, l2, mem_cap=24e9, max_r=64):
    need = max(1, math.ceil(2.0 * l2 / max(bytes_touched, 1)))
    cap = max(1, int(mem_cap // max(bytes_per_set, 1)))
    r = min(need, cap, max_r)
    return r, r * bytes_touched > 2.0 * l2


def reps_for(us_est):
    return int(min(400, max(25, 2e5 / max(us_est, 1.0))))


# ----------------------------------------------------------------------------
# Correctness
# ----------------------------------------------------------------------------
def _eq(a, b):
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def correctness(dev, results):
    ok = True
    gen = torch.Generator().manual_seed(0)
    for (B, n, V) in [(64, 32, 1000), (16, 128, 4096), (4, 16, 151936)]:
        tok, par, cu = make_trees(B, n, V, gen)
        _, _, _, am = greedy_inputs(B, n, V, gen)
        T = B * (n + 1)
        probs = sampled_probs(tok, par, B, n, V, dev, gen)
        probs = probs / probs.sum(-1, keepdim=True)
        coins = torch.rand(T, dtype=torch.float64, generator=gen)
        noise = 1.0 / torch.empty(B, V).exponential_(generator=gen)
        isg = torch.rand(B, generator=gen) < 0.4
        args = [x.to(dev) for x in (tok, par, cu)]
        kw = dict(target_argmax=am.to(dev), target_probs=probs, is_greedy=isg.to(dev),
                  coins=coins.to(dev), inv_exp_noise=noise.to(dev), width=n + 1, max_num_nodes=n)
        a = tree_verify(*args, **kw)
        b = tree_verify_ref(*args, **kw)
        same = _eq(a, b)
        g1 = tree_verify(*args, target_argmax=am.to(dev), width=n + 1, max_num_nodes=n)
        g2 = tree_verify_ref(*args, target_argmax=am.to(dev), width=n + 1, max_num_nodes=n)
        same_g = _eq(g1, g2)
        log(f"[check] mixed B={B} n={n} V={V}: kernel==ref {same}; greedy {same_g}; "
            f"mean accepted {a[1].float().mean().item():.2f}")
        results["checks"].append(dict(B=B, n=n, V=V, mixed_equal=same, greedy_equal=same_g))
        ok &= same and same_g
        del probs
    # B=256, 512 nodes, V=151936: T*V = 2.0e10 elements (int64 offsets needed).
    B, n, V = 256, 512, 151936
    tok, par, cu, am = greedy_inputs(B, n, V, gen)
    T = B * (n + 1)
    args = [x.to(dev) for x in (tok, par, cu)]
    t0 = time.time()
    try:
        g1 = tree_verify(*args, target_argmax=am.to(dev), width=n + 1, max_num_nodes=n)
        g2 = tree_verify_ref(*args, target_argmax=am.to(dev), width=n + 1, max_num_nodes=n)
        same_g = _eq(g1, g2)
        probs = sampled_probs(tok, par, B, n, V, dev, gen)
        coins = torch.rand(T, dtype=torch.float64, generator=gen).to(dev)
        noise = (1.0 / torch.empty(B, V).exponential_(generator=gen)).to(dev)
        s1 = tree_verify(*args, target_probs=probs, coins=coins, inv_exp_noise=noise,
                         width=n + 1, max_num_nodes=n)
        torch.cuda.synchronize()
        # reference per request on its own rows (a 313 MB slice each), incl. the last ones
        same_s = True
        for r in (0, 1, 100, 254, 255):
            lo, hi = r * (n + 1), (r + 1) * (n + 1)
            sub = tree_verify_ref(tok[r * n:(r + 1) * n], par[r * n:(r + 1) * n],
                                  torch.tensor([n], dtype=torch.int32),
                                  target_probs=probs[lo:hi].cpu(), coins=coins[lo:hi].cpu(),
                                  inv_exp_noise=noise[r:r + 1].cpu(), width=n + 1)
            got = (s1[0][r:r + 1].cpu(), s1[1][r:r + 1].cpu(), s1[2][r:r + 1].cpu() - lo)
            got = (got[0], got[1], torch.where(s1[2][r:r + 1].cpu() >= 0, got[2], -1))
            same_s &= _eq(got, sub)
        seeds = torch.arange(B, dtype=torch.int64, device=dev)
        s2 = tree_verify(*args, target_probs=probs, seeds=seeds, width=n + 1, max_num_nodes=n)
        s3 = tree_verify(*args, target_probs=probs, seeds=seeds, width=n + 1, max_num_nodes=n)
        det = _eq(s2, s3)
        valid = bool(((s2[0] >= -1) & (s2[0] < V)).all())
        torch.cuda.synchronize()
        msg = (f"[check] B=256 n=512 V=151936: greedy kernel==ref {same_g}; sampled "
               f"kernel==ref(5 reqs) {same_s}; philox deterministic {det}, valid {valid}; "
               f"mean accepted greedy {g1[1].float().mean().item():.2f} sampled "
               f"{s1[1].float().mean().item():.2f} ({time.time() - t0:.1f}s)")
        log(msg)
        results["checks"].append(dict(B=B, n=n, V=V, greedy_equal=same_g, sampled_equal=same_s,
                                      deterministic=det, valid=valid))
        ok &= same_g and same_s and det and valid
        del probs
    except Exception:  # noqa: BLE001
        log("[check] B=256 n=512 FAILED:\n" + traceback.format_exc())
        results["checks"].append(dict(B=B, n=n, V=V, error=traceback.format_exc()))
        ok = False
    torch.cuda.empty_cache()
    return ok


# ----------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------
def bench_config(B, n, V, dev, l2, rs, gen, walk_warps, block_vs):
    row = dict(B=B, n=n, V=V, T=B * (n + 1))
    T = B * (n + 1)
    W = n + 1
    # -------- ours: greedy (argmax given) --------
    greedy_bytes = T * 12 + B * W * 8 + 4 * B + 4 * B
    R, cold = n_rotations(greedy_bytes, greedy_bytes, l2, max_r=64)
    sets = []
    for _ in range(R):
        tok, par, cu, am = greedy_inputs(B, n, V, gen)
        sets.append([x.to(dev) for x in (tok, par, cu, am)])
    row["greedy_floor_us"] = greedy_bytes / HBM_PEAK * 1e6
    for nw in walk_warps:
        calls = [lambda s=s: tree_verify(s[0], s[1], s[2], target_argmax=s[3], width=W,
                                         max_num_nodes=n, num_warps=nw) for s in sets]
        row[f"ours_greedy_w{nw}_us"] = graph_time(calls, reps_for(3))
    row["ours_greedy_us"] = min(row[f"ours_greedy_w{nw}_us"] for nw in walk_warps)
    acc = tree_verify(*sets[0][:3], target_argmax=sets[0][3], width=W, max_num_nodes=n)[1]
    row["greedy_mean_accepted"] = acc.float().mean().item()
    # -------- vLLM greedy chain kernel alone (K = n draft tokens, argmax given) --------
    if rs is not None:
        vsets = []
        for s in sets:
            tok, _, cu, am = s
            out = torch.empty(B, n + 1, dtype=torch.int32, device=dev)
            # chain argmax rows: the ND draft rows (vLLM layout excludes bonus rows)
            vam = am[: B * n].to(torch.int64)
            bonus = torch.zeros(B, 1, dtype=torch.int32, device=dev)
            vsets.append((out, cu, tok, vam, bonus))
        calls = [lambda v=v: rs.rejection_greedy_sample_kernel[(B,)](
            v[0], v[1], v[2], v[3], v[4], None, n, None, None, SYNTHETIC_MODE=False)
            for v in vsets]
        try:
            row["vllm_greedy_us"] = graph_time(calls, reps_for(3))
        except Exception as e:  # noqa: BLE001
            row["vllm_greedy_us"] = None
            row["vllm_greedy_error"] = repr(e)[:300]
        del vsets
    del sets
    # -------- ours: sampled target-only (probs given) --------
    probs_bytes = T * V * 4
    touched = B * V * 4 + T * 32
    R, cold_s = n_rotations(touched, probs_bytes, l2)
    row["sampled_rotations"], row["sampled_cold_l2"] = R, cold_s
    ssets = []
    for _ in range(R):
        tok, par, cu = make_trees(B, n, V, gen)
        probs = sampled_probs(tok, par, B, n, V, dev, gen)
        ssets.append(dict(tok=tok.to(dev), par=par.to(dev), cu=cu.to(dev), probs=probs,
                          seeds=torch.randint(0, 2**40, (B,), device=dev),
                          pos=torch.randint(0, 2**20, (B,), device=dev),
                          coins=torch.rand(T, dtype=torch.float64, device=dev),
                          noise=1.0 / torch.empty(B, V, device=dev).exponential_()))
    row["sampled_floor_us"] = touched / HBM_PEAK * 1e6
    row["sampled_explicit_floor_us"] = (touched + B * V * 4 + T * 8) / HBM_PEAK * 1e6
    for bv in block_vs:
        calls = [lambda s=s: tree_verify(s["tok"], s["par"], s["cu"], target_probs=s["probs"],
                                         seeds=s["seeds"], positions=s["pos"], width=W,
                                         max_num_nodes=n, block_v=bv) for s in ssets]
        row[f"ours_sampled_bv{bv}_us"] = graph_time(
            calls, reps_for(row["sampled_floor_us"] * 2 + 5))
        calls = [lambda s=s: tree_verify(s["tok"], s["par"], s["cu"], target_probs=s["probs"],
                                         coins=s["coins"], inv_exp_noise=s["noise"], width=W,
                                         max_num_nodes=n, block_v=bv) for s in ssets]
        row[f"ours_sampled_explicit_bv{bv}_us"] = graph_time(
            calls, reps_for(row["sampled_explicit_floor_us"] * 2 + 5))
    row["ours_sampled_us"] = min(row[f"ours_sampled_bv{bv}_us"] for bv in block_vs)
    row["ours_sampled_explicit_us"] = min(row[f"ours_sampled_explicit_bv{bv}_us"]
                                          for bv in block_vs)
    s = ssets[0]
    row["sampled_mean_accepted"] = tree_verify(
        s["tok"], s["par"], s["cu"], target_probs=s["probs"], seeds=s["seeds"], width=W,
        max_num_nodes=n)[1].float().mean().item()
    del ssets, calls, s
    torch.cuda.empty_cache()
    # -------- vLLM sampled chain (K = n draft tokens per request) --------
    ND = B * n
    if rs is not None:
        if ND * V >= 2**31:
            row["vllm_sampled_us"] = row["vllm_sampled_full_us"] = None
            row["vllm_sampled_error"] = ("skipped: ND*V >= 2**31 (int32 offsets in vLLM's "
                                         "kernels; illegal memory access, see docs)")
        else:
            try:
                row.update(bench_vllm_sampled(B, n, V, dev, l2, rs, gen))
            except Exception as e:  # noqa: BLE001
                row["vllm_sampled_us"] = None
                row["vllm_sampled_error"] = repr(e)[:300]
            torch.cuda.empty_cache()
    return row


def _vllm_metadata(B, dev):
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.ones(B, device=dev), all_greedy=False, all_random=True,
        top_p=None, top_k=None, generators={}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(B, device=dev),
        presence_penalties=torch.zeros(B, device=dev),
        repetition_penalties=torch.ones(B, device=dev), output_token_ids=[[] for _ in range(B)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=None)


def bench_vllm_sampled(B, n, V, dev, l2, rs, gen):
    ND = B * n
    out = {}
    md = _vllm_metadata(B, dev)
    nums = [n] * B
    touched = ND * V * 4 * 2 + B * V * 8  # logits read + probs write (full path)
    R, _ = n_rotations(touched, ND * V * 4, l2, mem_cap=16e9, max_r=8)
    sets = []
    for _ in range(R):
        tok, _, cu = make_trees(B, n, V, gen, chain=True)
        logits = torch.randn(ND, V, device=dev)
        logits[torch.arange(ND, device=dev), tok.long().to(dev)] += 6.0
        sets.append(dict(tok=tok.to(dev), cu=cu.to(dev), logits=logits,
                         probs=logits.softmax(-1, dtype=torch.float32),
                         bonus=torch.zeros(B, 1, dtype=torch.int32, device=dev),
                         is_greedy=torch.zeros(B, dtype=torch.bool, device=dev)))

    def probs_given(s):
        o = torch.full((B, n + 1), -1, dtype=torch.int32, device=dev)
        u = rs.generate_uniform_probs(ND, nums, {}, dev)
        rec = rs.sample_recovered_tokens(n, nums, s["cu"], s["tok"], None, s["probs"], md, dev)
        rs.rejection_random_sample_kernel[(B,)](
            o, s["cu"], s["tok"], None, s["probs"], s["bonus"], rec, u, s["is_greedy"], n, V,
            None, NO_DRAFT_PROBS=True, SYNTHETIC_MODE=False)
        return o

    def full(s):
        return rs.rejection_sample(s["tok"], nums, n, s["cu"], None, s["logits"], s["bonus"], md)

    out["vllm_sampled_us"] = graph_time([lambda s=s: probs_given(s) for s in sets], 25)
    out["vllm_sampled_full_us"] = graph_time([lambda s=s: full(s) for s in sets], 25)
    return out


def measure_copy_bw(dev):
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    t = graph_time([lambda: y.copy_(x)], 20)
    del x, y
    return 2 * 2 * 2**30 / (t * 1e-6)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8, 64, 256])
    ap.add_argument("--nodes", type=int, nargs="*", default=[8, 32, 128])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--walk-warps", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--block-v", type=int, nargs="*", default=[4096])
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--vllm-from", default=None,
                    help="bench.json of an earlier run whose vLLM timings fill the vLLM columns "
                         "(the vLLM chain kernels do not change between runs of this script)")
    args = ap.parse_args()

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 60 * 2**20) or 60 * 2**20
    import triton

    results = dict(device=props.name, sms=props.multi_processor_count, l2_bytes=l2,
                   torch=torch.__version__, triton=triton.__version__,
                   date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), checks=[], rows=[])
    log(f"device {props.name}, {props.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MiB, "
        f"torch {torch.__version__}, triton {triton.__version__}")
    rs = None
    if not args.no_vllm:
        try:
            t0 = time.time()
            import vllm  # noqa: F401
            import vllm.v1.sample.rejection_sampler as rs  # noqa: F811

            results["vllm"] = vllm.__version__
            log(f"vLLM {vllm.__version__} imported in {time.time() - t0:.1f}s")
        except Exception as e:  # noqa: BLE001
            log(f"vLLM import failed: {e!r}")
            results["vllm_error"] = repr(e)
    results["copy_bw"] = measure_copy_bw(dev)
    log(f"device-to-device copy: {results['copy_bw'] / 1e12:.2f} TB/s (read+write)")

    ok = True
    if not args.skip_checks:
        ok = correctness(dev, results)
    gen = torch.Generator().manual_seed(1)
    for B in args.batch:
        for n in args.nodes:
            t0 = time.time()
            try:
                row = bench_config(B, n, args.vocab, dev, l2, rs, gen, args.walk_warps, args.block_v)
            except Exception:  # noqa: BLE001
                row = dict(B=B, n=n, error=traceback.format_exc()[-1500:])
                ok = False
                log(row["error"])
            results["rows"].append(row)
            log(f"[bench] B={B} n={n}: {json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()})} ({time.time() - t0:.1f}s)")
            torch.cuda.empty_cache()
    if args.vllm_from and rs is None:
        prev = json.loads(pathlib.Path(args.vllm_from).read_text())
        results["vllm_from"] = dict(file=args.vllm_from, vllm=prev.get("vllm"), date=prev.get("date"))
        results.setdefault("vllm", f"{prev.get('vllm')} (from {pathlib.Path(args.vllm_from).name})")
        by = {(r["B"], r["n"]): r for r in prev.get("rows", [])}
        for r in results["rows"]:
            for k, v in by.get((r["B"], r["n"]), {}).items():
                if k.startswith("vllm_"):
                    r[k] = v
    out = os.environ.get("OUT")
    if out:
        pathlib.Path(out, "bench.json").write_text(json.dumps(results, indent=1))
    print_table(results)
    log("CHECKS " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


def _f(v, w=7, p=1):
    return f"{v:{w}.{p}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"


def print_table(res):
    log("\n" + "=" * 118)
    log(f"{res['device']} | torch {res['torch']} | triton {res['triton']} | vLLM "
        f"{res.get('vllm', 'n/a')} | copy {res['copy_bw'] / 1e12:.2f} TB/s | {res['date']}")
    log("times in µs (CUDA-graph replay, median); floor = bytes / 4.8 TB/s; x = time / floor; "
        "spd = vLLM chain / ours")
    log(f"{'B':>4} {'n':>4} | {'greedy':>7} {'w1':>6} {'w4':>6} {'floor':>6} {'vllmG':>7} {'spd':>5}"
        f" | {'sampled':>8} {'floor':>7} {'x':>5} {'explicit':>8} {'x':>5} {'vllmS':>8} "
        f"{'spd':>5} {'vllmFull':>9} | {'A_g':>5} {'A_s':>5}")
    for r in res["rows"]:
        if "error" in r:
            log(f"{r['B']:>4} {r['n']:>4} | ERROR")
            continue
        vg, vs = r.get("vllm_greedy_us"), r.get("vllm_sampled_us")
        spg = vg / r["ours_greedy_us"] if vg else None
        sps = vs / r["ours_sampled_us"] if vs else None
        log(f"{r['B']:>4} {r['n']:>4} | {_f(r['ours_greedy_us'], 7, 2)} "
            f"{_f(r.get('ours_greedy_w1_us'), 6, 2)} {_f(r.get('ours_greedy_w4_us'), 6, 2)} "
            f"{_f(r['greedy_floor_us'], 6, 2)} {_f(vg, 7, 2)} {_f(spg, 5, 1)} | "
            f"{_f(r['ours_sampled_us'], 8, 1)} {_f(r['sampled_floor_us'], 7, 1)} "
            f"{_f(r['ours_sampled_us'] / r['sampled_floor_us'], 5, 2)} "
            f"{_f(r['ours_sampled_explicit_us'], 8, 1)} "
            f"{_f(r['ours_sampled_explicit_us'] / r['sampled_explicit_floor_us'], 5, 2)} "
            f"{_f(vs, 8, 1)} {_f(sps, 5, 1)} {_f(r.get('vllm_sampled_full_us'), 9, 1)} | "
            f"{_f(r['greedy_mean_accepted'], 5, 2)} {_f(r['sampled_mean_accepted'], 5, 2)}")
    log("=" * 118)


if __name__ == "__main__":
    sys.exit(main())
