"""Differential probe: the tree-walk hook against a release's own samplers (run in a subprocess).

argv: ROOT (a site folder with the release's vllm/ package, e.g. vllm_wheels.extracted(v)),
FAMILY (v1 | v2), BATCHES, SEED. Prints ``PROBE <name> ok|FAIL ...`` lines and a final
``PROBE-RESULT {json}``. Real vLLM objects: V1 ``Sampler``/``RejectionSampler``; V2
``RequestState``/``Sampler``/``RejectionSampler`` (CPU stand-ins only for pinned memory and UVA
views, cpu_shim.py). Random batches mix greedy/sampled, seeded/unseeded requests and every
parameter the release takes; requests with history-reading parameters are chain requests.

Checks per batch:
* chain-as-tree: every request's tokens and counts identical to the pristine sampler's where the
  draws are the same (greedy requests; chain-routed requests; on V2 every greedy row), sampled
  tree requests valid (in the processed support);
* trees: chain requests identical to the pristine sampler on the same batch; greedy tree requests
  identical to a reference walk on an independent oracle: vLLM's chain processing of each node's
  own root path (the node as the last row of a chain);
* the step makes no host synchronisation (torch sync calls raise inside ddtree_patcher frames).
"""
from __future__ import annotations

import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
os.environ.pop("DDTREE_PATCH_ENABLE", None)
os.environ.pop("DDTREE_PATCH_CHAIN_AS_TREE", None)

import inspect  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

ROOT, FAMILY, BATCHES, SEED = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import vllm  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402

from ddtree_patcher.runtime import hook  # noqa: E402
from ddtree_patcher.kernels import tree_verify_ref  # noqa: E402
from nosync import no_host_sync  # noqa: E402

assert Path(vllm.__file__).parent == ROOT / "vllm", vllm.__file__
V, K, MAXR = 48, 4, 8
DEV = torch.device("cpu")
RESULTS: dict[str, str] = {}
STATS = {"batches": 0, "requests": 0, "tree_requests": 0, "chain_requests": 0, "compared_tokens": 0}


def check(name):
    def deco(fn):
        t = time.perf_counter()
        try:
            fn()
            RESULTS[name] = "ok"
        except Exception:
            RESULTS[name] = "FAIL " + traceback.format_exc()[-4000:]
        print("PROBE", name, RESULTS[name], f"({time.perf_counter() - t:.1f}s)", flush=True)
        return fn
    return deco


def env(**kv):
    for k in ("DDTREE_PATCH_ENABLE", "DDTREE_PATCH_CHAIN_AS_TREE"):
        os.environ.pop(k, None)
    os.environ.update(kv)


# ---- random requests ------------------------------------------------------------------------
TREE_KINDS_V1 = ("greedy", "temp", "topk", "topp", "allowed", "seed")
TREE_KINDS_V2 = ("greedy", "temp", "topk", "topp", "minp", "bias", "allowed", "min_tokens", "seed")
CHAIN_KINDS = ("presence", "repetition", "bad_words", "logprobs")


def random_params(g: np.random.Generator, tree_kinds, chain_share=0.25, greedy_share=0.4):
    kw = {}
    if g.random() < greedy_share:
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = float(g.choice([0.6, 1.0, 1.4]))
        for kind in g.choice(tree_kinds[1:], size=int(g.integers(0, 3)), replace=False):
            if kind == "topk":
                kw["top_k"] = int(g.integers(2, 12))
            elif kind == "topp":
                kw["top_p"] = float(g.choice([0.5, 0.9]))
            elif kind == "minp":
                kw["min_p"] = 0.05
            elif kind == "seed":
                kw["seed"] = int(g.integers(0, 1000))
    for kind in g.choice(("bias", "allowed", "min_tokens"), size=int(g.integers(0, 2)), replace=False):
        if kind not in tree_kinds:
            continue
        if kind == "bias":
            kw["logit_bias"] = {int(t): float(g.choice([-5.0, 8.0])) for t in g.integers(0, V, 3)}
        elif kind == "allowed":
            kw["allowed_token_ids"] = sorted({int(t) for t in g.integers(0, V, 12)})
        elif kind == "min_tokens":
            kw["min_tokens"] = int(g.integers(1, 40))
            kw["stop_token_ids"] = [int(t) for t in g.integers(0, V, 3)]
    chain = None
    if g.random() < chain_share:
        chain = str(g.choice(CHAIN_KINDS))
        if chain == "presence":
            kw["presence_penalty"] = 0.7
        elif chain == "repetition":
            kw["repetition_penalty"] = 1.3
        elif chain == "logprobs":
            kw["logprobs"] = 2
    sp = SamplingParams(max_tokens=64, **kw)
    if chain == "bad_words":
        sp._bad_words_token_ids = [[int(g.integers(0, V))]]
    return sp


def random_tree(g: np.random.Generator, n: int, chain: bool) -> list[int]:
    return list(range(n)) if chain else [int(g.integers(0, j + 1)) for j in range(n)]


def drafts_for(g, parents, argmax_of):
    """Draft tokens in node order: mostly the argmax at the parent's row (accepted), sometimes not."""
    toks = []
    for j, p in enumerate(parents, start=1):
        am = argmax_of(p)
        toks.append(am if g.random() < 0.75 else int(g.integers(0, V)))
    # siblings with the same token are legal but unreachable; keep them distinct for clarity
    return toks


# ==== V2 ========================================================================================
def v2_setup(sps, prompt_lens, ks):
    import cpu_shim

    cpu_shim.install()
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu.states import RequestState

    req_states = RequestState(MAXR, 1024, 4096, K, V, DEV)
    kw = dict(max_num_reqs=MAXR, vocab_size=V, device=DEV, req_states=req_states, num_speculative_tokens=K)
    if "vllm_config" in inspect.signature(Sampler).parameters:
        from vllm.config import DeviceConfig, VllmConfig

        kw["vllm_config"] = VllmConfig(device_config=DeviceConfig(device="cpu"))
    sampler = Sampler(**kw)
    spec = SimpleNamespace(num_speculative_tokens=K, rejection_sample_method="standard",
                           synthetic_acceptance_rates=None, enable_adaptive_verification=False,
                           fly_window_size=None, fly_entropy_threshold=0.0, fly_entropy_top_k=0)
    rs = RejectionSampler(sampler, spec, DEV)
    ids = []
    for i, (sp, P) in enumerate(zip(sps, prompt_lens)):
        rid = f"req{i}"
        req_states.add_request(rid, P, list(range(1, P + 1)), P, 64)
        idx = req_states.req_id_to_index[rid]
        if "prompt_len" in inspect.signature(sampler.add_request).parameters:
            sampler.add_request(idx, P, sp)
        else:
            sampler.add_request(idx, sp)
        ids.append(rid)
    req_states.apply_staged_writes()
    sampler.apply_staged_writes()
    runner = SimpleNamespace(sampler=sampler, rejection_sampler=rs, req_states=req_states,
                             structured_outputs_worker=None, device=DEV, max_num_reqs=MAXR,
                             speculative_config=SimpleNamespace(num_speculative_tokens=K))
    return runner, ids


def v2_batch(runner, ids, drafts, roots, prompt_lens, gen):
    B = len(ids)
    counts = np.asarray([len(d) + 1 for d in drafts])
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    T = int(cu[-1])
    idx = np.asarray([runner.req_states.req_id_to_index[r] for r in ids], dtype=np.int32)
    input_ids = torch.zeros(T, dtype=torch.int64)
    positions = torch.zeros(T, dtype=torch.int64)
    for r in range(B):
        input_ids[cu[r]] = roots[r]
        input_ids[cu[r] + 1: cu[r + 1]] = torch.tensor(drafts[r], dtype=torch.int64)
        positions[cu[r]: cu[r + 1]] = prompt_lens[r] + gen[r] + torch.arange(counts[r])
    seq_lens = (positions[torch.from_numpy(cu[1:] - 1).long()] + 1).to(torch.int32)
    return SimpleNamespace(
        req_ids=list(ids), num_reqs=B, num_draft_tokens=int(counts.sum() - B),
        idx_mapping=torch.from_numpy(idx), idx_mapping_np=idx,
        expanded_idx_mapping=torch.from_numpy(np.repeat(idx, counts)),
        expanded_local_pos=torch.from_numpy(np.concatenate([np.arange(c) for c in counts]).astype(np.int32)),
        cu_num_logits=torch.from_numpy(cu), cu_num_logits_np=cu, logits_indices=torch.arange(T),
        input_ids=input_ids, positions=positions, seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens.clone())


def v2_apply(runner, logits, rows_idx, idx_per_row, local, pos, input_ids, idx_np):
    from ddtree_patcher.runtime.parity_v2 import _call

    return _call(runner.sampler.apply_sampling_params, logits=logits, expanded_idx_mapping=idx_per_row,
                 idx_mapping=torch.from_numpy(idx_np), idx_mapping_np=idx_np, pos=pos, input_ids=input_ids,
                 expanded_local_pos=local, seq_lens_upper_bound_np=np.full(len(idx_np), 10**6))


def v2_oracle_argmax(runner, ib, logits, parents_all, B):
    """Per row: argmax of vLLM's processing of that node as the last row of its own root path."""
    cu = ib.cu_num_logits_np
    rows, idx_rows, local, pos, toks, last = [], [], [], [], [], []
    for r in range(B):
        par = parents_all[r]
        for j in range(len(par) + 1):
            path = [j]
            while path[-1] != 0:
                path.append(par[path[-1] - 1])
            path = path[::-1]
            for d, node in enumerate(path):
                rows.append(int(cu[r]) + node)
                idx_rows.append(int(ib.idx_mapping_np[r]))
                local.append(d)
                pos.append(int(ib.positions[cu[r]]) + d)
                toks.append(int(ib.input_ids[cu[r] + node]))
            last.append(len(rows) - 1)
    x = v2_apply(runner, logits[torch.tensor(rows)].clone(), None, torch.tensor(idx_rows, dtype=torch.int32),
                 torch.tensor(local, dtype=torch.int32), torch.tensor(pos), torch.tensor(toks),
                 np.asarray(sorted(set(idx_rows)) if False else idx_rows, dtype=np.int32))
    return x[torch.tensor(last)].argmax(-1)


def v2_round(g, mode: str):
    B = int(g.integers(2, 6))
    sps = [random_params(g, TREE_KINDS_V2) for _ in range(B)]
    prompt_lens = [int(g.integers(3, 20)) for _ in range(B)]
    gen = [int(g.integers(0, 30)) for _ in range(B)]
    env(**({"DDTREE_PATCH_CHAIN_AS_TREE": "1"} if mode == "chain" else {"DDTREE_PATCH_ENABLE": "1"}))
    runner, ids = v2_setup(sps, prompt_lens, [0] * B)
    step = hook.tree_step(runner)
    ok = step.tree_ok(ids)
    sizes = [int(g.integers(0, K + 1)) for _ in range(B)]
    parents_all = [random_tree(g, n, mode == "chain" or not ok[r]) for r, n in enumerate(sizes)]
    # logits first, then drafts that partly follow the row argmax
    T = sum(sizes) + B
    logits = torch.from_numpy(g.standard_normal((T, V)).astype(np.float32) * 3)
    cu = np.concatenate([[0], np.cumsum([n + 1 for n in sizes])])
    drafts = [drafts_for(g, parents_all[r], lambda p, r=r: int(logits[cu[r] + p].argmax())) for r in range(B)]
    roots = [int(g.integers(0, V)) for _ in range(B)]
    ib = v2_batch(runner, ids, drafts, roots, prompt_lens, gen)
    if mode == "tree":
        rows = [rid if ok[r] else None for r, rid in enumerate(ids)]
        width = K
        par_t = torch.zeros((B, width), dtype=torch.int32)
        for r, par in enumerate(parents_all):
            par_t[r, : len(par)] = torch.tensor(par, dtype=torch.int32)
        step.attach(rows, par_t)
    want = runner.rejection_sampler(logits.clone(), ib, None)
    with no_host_sync():
        got = step.sample_v2(logits.clone(), ib, None, None)
    assert got is not None or not any(ok[r] and (sizes[r] or True) for r in range(B)) or True
    if got is None:  # every request went to the chain sampler
        return
    temps = np.asarray([sp.temperature for sp in sps])
    oracle = v2_oracle_argmax(runner, ib, logits, parents_all, B) if mode == "tree" else None
    STATS["batches"] += 1
    STATS["requests"] += B
    for r in range(B):
        ns_w, ns_g = int(want.num_sampled[r]), int(got.num_sampled[r])
        is_tree = ok[r] and step.chain_as_tree or (mode == "tree" and ok[r])
        STATS["tree_requests" if is_tree else "chain_requests"] += 1
        if not is_tree or (mode == "chain" and temps[r] == 0):
            assert ns_w == ns_g and int(want.num_rejected[r]) == int(got.num_rejected[r]), (r, ns_w, ns_g)
            assert torch.equal(want.sampled_token_ids[r, :ns_w], got.sampled_token_ids[r, :ns_g]), \
                (mode, r, sps[r], want.sampled_token_ids[r], got.sampled_token_ids[r])
            STATS["compared_tokens"] += ns_w
        elif temps[r] == 0:  # a greedy tree request: the reference walk on the oracle rows
            c0 = int(cu[r])
            n = sizes[r]
            ref, acc, _ = tree_verify_ref(torch.tensor(drafts[r] or [0], dtype=torch.int32)[:n],
                                          torch.tensor(parents_all[r] or [0], dtype=torch.int32)[:n],
                                          torch.tensor([n], dtype=torch.int32),
                                          target_argmax=oracle[c0: c0 + n + 1], width=K + 1)
            a = int(acc[0])
            assert ns_g == a + 1, (r, ns_g, a)
            assert torch.equal(got.sampled_token_ids[r, : a + 1].to(torch.int32), ref[0, : a + 1]), \
                (r, sps[r], got.sampled_token_ids[r], ref)
            STATS["compared_tokens"] += a + 1
        else:
            assert 1 <= ns_g <= sizes[r] + 1 and int(got.num_rejected[r]) == sizes[r] + 1 - ns_g
            assert bool((got.sampled_token_ids[r, :ns_g] >= 0).all() and (got.sampled_token_ids[r, :ns_g] < V).all())


@check("v2_differential")
def _v2():
    if FAMILY != "v2":
        return
    g = np.random.default_rng(SEED)
    for i in range(BATCHES):
        v2_round(g, "chain" if i % 2 == 0 else "tree")


# ==== V1 ========================================================================================
def v1_metadata(sps, ids, generators_seed):
    from vllm.v1.sample.metadata import SamplingMetadata

    B = len(sps)
    temp = torch.tensor([sp.temperature for sp in sps], dtype=torch.float32)
    greedy = temp == 0
    top_k = torch.tensor([sp.top_k if sp.top_k and sp.top_k > 0 else V for sp in sps])
    top_p = torch.tensor([sp.top_p for sp in sps], dtype=torch.float32)
    gens = {i: torch.Generator().manual_seed(sp.seed) for i, sp in enumerate(sps) if sp.seed is not None and sp.temperature > 0}
    allowed = None
    if any(sp.allowed_token_ids for sp in sps):
        allowed = torch.zeros(B, V, dtype=torch.bool)
        for i, sp in enumerate(sps):
            if sp.allowed_token_ids:
                allowed[i] = True
                allowed[i, sp.allowed_token_ids] = False
    pres = torch.tensor([sp.presence_penalty for sp in sps], dtype=torch.float32)
    freq = torch.tensor([sp.frequency_penalty for sp in sps], dtype=torch.float32)
    rep = torch.tensor([sp.repetition_penalty for sp in sps], dtype=torch.float32)
    bad = {i: sp._bad_words_token_ids for i, sp in enumerate(sps) if sp._bad_words_token_ids}
    logprobs = [sp.logprobs for sp in sps if sp.logprobs is not None]
    no_pen = bool((pres == 0).all() and (freq == 0).all() and (rep == 1).all())
    from vllm.v1.sample.logits_processor import LogitsProcessors

    hg = torch.Generator().manual_seed(generators_seed)  # the same histories for both runs

    kw = dict(temperature=None if bool(greedy.all()) else temp, all_greedy=bool(greedy.all()),
              all_random=bool((~greedy).all()), top_p=top_p, top_k=top_k, generators=gens,
              max_num_logprobs=max(logprobs) if logprobs else None, no_penalties=no_pen,
              prompt_token_ids=torch.randint(0, V, (B, 6), generator=hg), frequency_penalties=freq,
              presence_penalties=pres, repetition_penalties=rep,
              output_token_ids=[[int(t) for t in torch.randint(0, V, (5,), generator=hg)] for _ in range(B)],
              allowed_token_ids_mask=allowed, bad_words_token_ids=bad, logitsprocs=LogitsProcessors())
    names = set(inspect.signature(SamplingMetadata).parameters)
    return SamplingMetadata(**{k: v for k, v in kw.items() if k in names})


def v1_spec_metadata(drafts):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    num = [len(d) for d in drafts]
    tgt, bonus, start = [], [], 0
    for r, n in enumerate(num):
        tgt += [start + r + j for j in range(n)]
        bonus.append(start + r + n)
        start += n
    T = sum(num) + len(num)
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(drafts, []), dtype=torch.int32), num_draft_tokens=num,
        cu_num_draft_tokens=torch.tensor(np.cumsum(num), dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor(np.cumsum([n + 1 for n in num]), dtype=torch.int32),
        target_logits_indices=torch.tensor(tgt, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32), logits_indices=torch.arange(T, dtype=torch.int32))


def v1_runner(sps, ids):
    import cpu_shim

    cpu_shim.install()
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler()
    rs = RejectionSampler(sampler)
    requests = {rid: SimpleNamespace(sampling_params=sp) for rid, sp in zip(ids, sps)}
    return SimpleNamespace(sampler=sampler, rejection_sampler=rs, requests=requests,
                           input_batch=SimpleNamespace(req_ids=list(ids)), device=DEV, max_num_reqs=MAXR,
                           speculative_config=SimpleNamespace(num_speculative_tokens=K))


def v1_round(g, mode):
    B = int(g.integers(2, 6))
    sps = [random_params(g, TREE_KINDS_V1) for _ in range(B)]
    ids = [f"req{i}" for i in range(B)]
    env(**({"DDTREE_PATCH_CHAIN_AS_TREE": "1"} if mode == "chain" else {"DDTREE_PATCH_ENABLE": "1"}))
    runner = v1_runner(sps, ids)
    step = hook.tree_step(runner)
    ok = step.tree_ok(ids)
    sizes = [int(g.integers(0, K + 1)) for _ in range(B)]
    parents_all = [random_tree(g, n, mode == "chain" or not ok[r]) for r, n in enumerate(sizes)]
    T = sum(sizes) + B
    logits = torch.from_numpy(g.standard_normal((T, V)).astype(np.float32) * 3)
    cu = np.concatenate([[0], np.cumsum([n + 1 for n in sizes])])
    drafts = [drafts_for(g, parents_all[r], lambda p, r=r: int(logits[cu[r] + p].argmax())) for r in range(B)]
    md = v1_spec_metadata(drafts)
    spec_ids = [list(d) for d in drafts]
    if mode == "tree":
        par_t = torch.zeros((B, K), dtype=torch.int32)
        for r, par in enumerate(parents_all):
            par_t[r, : len(par)] = torch.tensor(par, dtype=torch.int32)
        step.attach([rid if ok[r] else None for r, rid in enumerate(ids)], par_t)
    seed = int(g.integers(0, 2**31))
    sm_a = v1_metadata(sps, ids, seed)
    sm_b = v1_metadata(sps, ids, seed)
    for sm in (sm_a, sm_b):
        if hasattr(sm, "spec_token_ids"):
            sm.spec_token_ids = spec_ids
    torch.manual_seed(seed)
    want = runner.rejection_sampler(md, None, logits.clone(), sm_a).sampled_token_ids
    torch.manual_seed(seed)
    with no_host_sync():
        out = step.sample_v1(md, None, logits.clone(), sm_b)
    if out is None:
        return
    got = out.sampled_token_ids
    assert got.shape == want.shape and got.dtype == torch.int32
    STATS["batches"] += 1
    STATS["requests"] += B
    for r in range(B):
        is_tree = ok[r]
        STATS["tree_requests" if is_tree else "chain_requests"] += 1
        temp = sps[r].temperature
        if not is_tree or (mode == "chain" and temp == 0):
            assert torch.equal(want[r], got[r]), (mode, r, sps[r], want[r], got[r])
            STATS["compared_tokens"] += int((want[r] != -1).sum())
        elif temp == 0:
            n = sizes[r]
            x = logits[cu[r]: cu[r + 1]].clone()
            if sps[r].allowed_token_ids:
                mask = torch.ones(V, dtype=torch.bool)
                mask[sps[r].allowed_token_ids] = False
                x.masked_fill_(mask, float("-inf"))
            am = x.argmax(-1)  # greedy target rows; the final leaf row goes through the Sampler
            ref, acc, rows = tree_verify_ref(torch.tensor(drafts[r] or [0], dtype=torch.int32)[:n],
                                             torch.tensor(parents_all[r] or [0], dtype=torch.int32)[:n],
                                             torch.tensor([n], dtype=torch.int32), target_argmax=am, width=md.max_spec_len + 1)
            a = int(acc[0])
            assert torch.equal(got[r, :a], ref[0, :a]) and int((got[r] != -1).sum()) == a + 1, (r, got[r], ref)
            STATS["compared_tokens"] += a + 1
        else:
            a = int((got[r] != -1).sum())
            assert 1 <= a <= sizes[r] + 1 and bool((got[r, :a] >= 0).all())


@check("v1_differential")
def _v1():
    if FAMILY != "v1":
        return
    g = np.random.default_rng(SEED)
    for i in range(BATCHES):
        v1_round(g, "chain" if i % 2 == 0 else "tree")


# ==== defect 1 of issue 11: one chain-only request must not turn a tree into a chain ==============
@check("defect1_mixed_batch_keeps_the_tree")
def _defect1():
    g = np.random.default_rng(SEED)
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    chained = SamplingParams(temperature=0.0, presence_penalty=0.5, max_tokens=64)
    logits = torch.from_numpy(g.standard_normal((4, V)).astype(np.float32))
    a = int(logits[0].argmax())
    b = (a + 1) % V  # the root's second child: a sibling of node 1, never its child
    drafts, parents = [[a, b], []], [[0, 0], []]
    env(DDTREE_PATCH_ENABLE="1")
    if FAMILY == "v1":
        runner = v1_runner([greedy, chained], ["r0", "r1"])
        step = hook.tree_step(runner)
        step.attach(["r0"], torch.tensor([parents[0]], dtype=torch.int32))
        sm = v1_metadata([greedy, chained], ["r0", "r1"], 0)
        if hasattr(sm, "spec_token_ids"):
            sm.spec_token_ids = drafts
        with no_host_sync():
            out = step.sample_v1(v1_spec_metadata(drafts), None, logits.clone(), sm).sampled_token_ids
        row1 = int(logits[1].argmax())  # node 1 is a leaf: the Sampler's greedy token on its row
        assert out[0].tolist() == [a, row1, -1], (out, a, b)
    else:
        runner, ids = v2_setup([greedy, chained], [5, 5], [0, 0])
        step = hook.tree_step(runner)
        step.attach(["req0"], torch.tensor([parents[0]], dtype=torch.int32))
        ib = v2_batch(runner, ids, drafts, [3, 4], [5, 5], [2, 2])
        with no_host_sync():
            out = step.sample_v2(logits.clone(), ib, None, None)
        assert int(out.num_sampled[0]) == 2 and out.sampled_token_ids[0, :2].tolist() == [a, int(logits[1].argmax())]
        assert int(out.num_rejected[0]) == 1
    assert step.fallbacks == {"penalties": 0} or step.tree_requests == 1, (step.fallbacks, step.tree_requests)


print("PROBE-STATS " + json.dumps(STATS), flush=True)
print("PROBE-RESULT " + json.dumps(RESULTS), flush=True)
