"""The tree-walk hook against a release's own samplers (run in a subprocess per release).

argv: ROOT (a site folder with the release's vllm/ package, e.g. vllm_wheels.extracted(v)),
FAMILY (v1 | v2), BATCHES, SEED, [GROUPS] (comma-separated: differential, defects, dist; default
all), [RUNTIME] (a site folder with another ddtree_patcher to test instead of the installed one,
e.g. an install of an older commit: ``defects`` must then fail). Prints ``PROBE <name> ok|FAIL``
lines, ``PROBE-STATS {json}`` and a final ``PROBE-RESULT {json}``. Environment:
HOOK_PARITY_DIST_N (samples per distribution check, default 6000).

Real vLLM objects throughout (probe_lib.py). Groups:

* ``differential``: random batches mixing greedy/sampled, seeded/unseeded requests and every
  parameter the release takes (requests with history-reading parameters are chain requests),
  chain-as-tree and real trees: chain-routed requests and chain-as-tree greedy requests
  identical to the pristine sampler on the same batch; greedy tree requests identical to the
  reference walk on an independent oracle (V1: vLLM's target-row processing at nodes with
  children and vLLM's Sampler processing at leaves; V2: vLLM's chain processing of each node's
  own root path); sampled tree requests valid; every step under a guard that raises on host
  synchronisation from ddtree_patcher frames (nosync.py);
* ``defects`` (defects.py): issue 11's defects 1-4, written against the API that existed before
  the fix too (``tree_step``, ``attach(req_id, list)``, ``sample_v1``/``sample_v2``);
* ``dist`` (dist.py): chi-square tests of the tree path's output distribution.
"""
from __future__ import annotations

import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
os.environ.pop("DDTREE_PATCH_ENABLE", None)
os.environ.pop("DDTREE_PATCH_CHAIN_AS_TREE", None)

import json  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT, FAMILY, BATCHES, SEED = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
GROUPS = set((sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] else "differential,defects,dist").split(","))
RUNTIME = sys.argv[6] if len(sys.argv) > 6 else ""
if RUNTIME:
    sys.path.insert(0, RUNTIME)
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import vllm  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402

from ddtree_patcher.runtime import hook  # noqa: E402
from ddtree_patcher.kernels import tree_verify_ref  # noqa: E402
from nosync import no_host_sync  # noqa: E402
from probe_lib import RESULTS, V1World, V2World, check, env, v1_spec_metadata  # noqa: E402

assert Path(vllm.__file__).parent == ROOT / "vllm", vllm.__file__
if RUNTIME:
    assert hook.__file__.startswith(RUNTIME), hook.__file__
print("PROBE-RUNTIME", hook.__file__, flush=True)
V, K, MAXR = 48, 4, 8
STATS = {"batches": 0, "requests": 0, "tree_requests": 0, "chain_requests": 0, "compared_tokens": 0}


# ---- random requests ------------------------------------------------------------------------
TREE_KINDS_V1 = ("greedy", "temp", "topk", "topp", "minp", "bias", "allowed", "seed")
TREE_KINDS_V2 = ("greedy", "temp", "topk", "topp", "minp", "bias", "allowed", "min_tokens", "seed")
CHAIN_KINDS = {"v1": ("presence", "repetition", "bad_words", "logprobs", "min_tokens"),
               "v2": ("presence", "repetition", "bad_words", "logprobs")}


def random_params(g: np.random.Generator, family: str, chain_share=0.25, greedy_share=0.4):
    tree_kinds = TREE_KINDS_V1 if family == "v1" else TREE_KINDS_V2
    kw = {}
    if g.random() < greedy_share:
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = float(g.choice([0.6, 1.0, 1.4]))
        for kind in g.choice(("topk", "topp", "minp", "seed"), size=int(g.integers(0, 3)), replace=False):
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
        chain = str(g.choice(CHAIN_KINDS[family]))
        if chain == "presence":
            kw["presence_penalty"] = 0.7
        elif chain == "repetition":
            kw["repetition_penalty"] = 1.3
        elif chain == "logprobs":
            kw["logprobs"] = 2
        elif chain == "min_tokens":
            kw["min_tokens"] = int(g.integers(1, 12))
            kw["stop_token_ids"] = [int(t) for t in g.integers(0, V, 3)]
    sp = SamplingParams(max_tokens=64, **kw)
    if chain == "bad_words":
        sp._bad_words_token_ids = [[int(g.integers(0, V))]]
    return sp


def random_tree(g: np.random.Generator, n: int, chain: bool) -> list[int]:
    return list(range(n)) if chain else [int(g.integers(0, j + 1)) for j in range(n)]


def drafts_for(g, parents, argmax_of):
    """Draft tokens in node order: mostly the argmax at the parent's row (accepted), sometimes not."""
    return [argmax_of(p) if g.random() < 0.75 else int(g.integers(0, V)) for p in parents]


def parents_tensor(parents_all):
    t = torch.zeros((len(parents_all), K), dtype=torch.int32)
    for r, par in enumerate(parents_all):
        t[r, : len(par)] = torch.tensor(par, dtype=torch.int32)
    return t


def ref_walk(drafts, parents, argmax_rows, width):
    n = len(parents)
    return tree_verify_ref(torch.tensor(drafts or [0], dtype=torch.int32)[:n],
                           torch.tensor(parents or [0], dtype=torch.int32)[:n],
                           torch.tensor([n], dtype=torch.int32), target_argmax=argmax_rows, width=width)


# ==== V2 ========================================================================================
def v2_oracle_argmax(world, ib, logits, parents_all, B):
    """Per row: argmax of vLLM's processing of that node as the last row of its own root path."""
    from ddtree_patcher.runtime.parity_v2 import _call

    cu = ib.cu_num_logits_np
    rows, idx_rows, local, pos, toks, last = [], [], [], [], [], []
    for r in range(B):
        par = parents_all[r]
        for j in range(len(par) + 1):
            path = [j]
            while path[-1] != 0:
                path.append(par[path[-1] - 1])
            for d, node in enumerate(path[::-1]):
                rows.append(int(cu[r]) + node)
                idx_rows.append(int(ib.idx_mapping_np[r]))
                local.append(d)
                pos.append(int(ib.positions[cu[r]]) + d)
                toks.append(int(ib.input_ids[cu[r] + node]))
            last.append(len(rows) - 1)
    idx_np = np.asarray(idx_rows, dtype=np.int32)
    x = _call(world.sampler.apply_sampling_params, logits=logits[torch.tensor(rows)].clone(),
              expanded_idx_mapping=torch.tensor(idx_rows, dtype=torch.int32), idx_mapping=torch.from_numpy(idx_np),
              idx_mapping_np=idx_np, pos=torch.tensor(pos), input_ids=torch.tensor(toks),
              expanded_local_pos=torch.tensor(local, dtype=torch.int32),
              seq_lens_upper_bound_np=np.full(len(idx_np), 10**6))
    return x[torch.tensor(last)].argmax(-1)


def v2_round(g, mode: str):
    B = int(g.integers(2, 6))
    sps = [random_params(g, "v2") for _ in range(B)]
    prompt_lens = [int(g.integers(3, 20)) for _ in range(B)]
    gen = [int(g.integers(0, 30)) for _ in range(B)]
    env(**({"DDTREE_PATCH_CHAIN_AS_TREE": "1"} if mode == "chain" else {"DDTREE_PATCH_ENABLE": "1"}))
    world = V2World(sps, vocab=V, k=K, maxr=MAXR, prompt_lens=prompt_lens)
    ids = world.ids
    step = hook.verify_step(world.runner)
    ok = step.tree_ok(ids)
    sizes = [int(g.integers(0, K + 1)) for _ in range(B)]
    parents_all = [random_tree(g, n, mode == "chain" or not ok[r]) for r, n in enumerate(sizes)]
    T = sum(sizes) + B
    logits = torch.from_numpy(g.standard_normal((T, V)).astype(np.float32) * 3)
    cu = np.concatenate([[0], np.cumsum([n + 1 for n in sizes])])
    drafts = [drafts_for(g, parents_all[r], lambda p, r=r: int(logits[cu[r] + p].argmax())) for r in range(B)]
    roots = [int(g.integers(0, V)) for _ in range(B)]
    ib = world.batch(drafts, roots, gen)
    if mode == "tree":
        step.attach([rid if ok[r] else None for r, rid in enumerate(ids)], parents_tensor(parents_all))
    want = world.rejection_sampler(logits.clone(), ib, None)
    with no_host_sync():
        got = step.sample_v2(logits.clone(), ib, None, None)
    if got is None:  # every request goes to the chain sampler (the call site runs it)
        assert not any(ok[r] for r in range(B) if sizes[r]) or not any(sizes), (ok, sizes)
        return
    temps = np.asarray([sp.temperature for sp in sps])
    oracle = v2_oracle_argmax(world, ib, logits, parents_all, B) if mode == "tree" else None
    STATS["batches"] += 1
    STATS["requests"] += B
    for r in range(B):
        ns_w, ns_g = int(want.num_sampled[r]), int(got.num_sampled[r])
        is_tree = ok[r]
        STATS["tree_requests" if is_tree else "chain_requests"] += 1
        if not is_tree or (mode == "chain" and temps[r] == 0):
            assert ns_w == ns_g and int(want.num_rejected[r]) == int(got.num_rejected[r]), (r, ns_w, ns_g)
            assert torch.equal(want.sampled_token_ids[r, :ns_w], got.sampled_token_ids[r, :ns_g]), \
                (mode, r, sps[r], want.sampled_token_ids[r], got.sampled_token_ids[r])
            STATS["compared_tokens"] += ns_w
        elif temps[r] == 0:  # a greedy tree request: the reference walk on the oracle rows
            c0, n = int(cu[r]), sizes[r]
            ref, acc, _ = ref_walk(drafts[r], parents_all[r], oracle[c0: c0 + n + 1], K + 1)
            a = int(acc[0])
            assert ns_g == a + 1, (r, ns_g, a)
            assert torch.equal(got.sampled_token_ids[r, : a + 1].to(torch.int32), ref[0, : a + 1]), \
                (r, sps[r], got.sampled_token_ids[r], ref)
            STATS["compared_tokens"] += a + 1
        else:
            assert 1 <= ns_g <= sizes[r] + 1 and int(got.num_rejected[r]) == sizes[r] + 1 - ns_g
            assert bool((got.sampled_token_ids[r, :ns_g] >= 0).all() and (got.sampled_token_ids[r, :ns_g] < V).all())


# ==== V1 ========================================================================================
def v1_oracle_argmax(world, sps, logits, parents_all, sizes, cu):
    """Greedy target per row as vLLM's V1 path processes it: rows with children are target rows
    (allowed-ids mask, no logits processors); leaf rows are bonus rows (vLLM's Sampler: the
    allowed mask and the built processors, e.g. logit bias)."""
    bias_built = "LogitBiasLogitsProcessor" in world.procs
    out = []
    for r, sp in enumerate(sps):
        par = parents_all[r]
        has_child = set(par)
        for j in range(sizes[r] + 1):
            x = logits[cu[r] + j].clone()
            if sp.allowed_token_ids:
                mask = torch.ones(V, dtype=torch.bool)
                mask[sp.allowed_token_ids] = False
                x.masked_fill_(mask, float("-inf"))
            if j not in has_child and bias_built and sp.logit_bias:
                for t, b in sp.logit_bias.items():
                    x[int(t)] += b
            out.append(int(x.argmax()))
    return torch.tensor(out)


def v1_round(g, mode: str, spec: bool):
    B = int(g.integers(2, 6))
    sps = [random_params(g, "v1") for _ in range(B)]
    env(**({"DDTREE_PATCH_CHAIN_AS_TREE": "1"} if mode == "chain" else {"DDTREE_PATCH_ENABLE": "1"}))
    outputs = [[int(t) for t in g.integers(0, V, int(g.integers(0, 6)))] for _ in range(B)]
    world = V1World(sps, vocab=V, k=K, spec=spec, maxr=MAXR, outputs=outputs)
    ids = world.ids
    step = hook.verify_step(world.runner)
    ok = step.tree_ok(ids)
    sizes = [int(g.integers(0, K + 1)) for _ in range(B)]
    parents_all = [random_tree(g, n, mode == "chain" or not ok[r]) for r, n in enumerate(sizes)]
    T = sum(sizes) + B
    logits = torch.from_numpy(g.standard_normal((T, V)).astype(np.float32) * 3)
    cu = np.concatenate([[0], np.cumsum([n + 1 for n in sizes])])
    drafts = [drafts_for(g, parents_all[r], lambda p, r=r: int(logits[cu[r] + p].argmax())) for r in range(B)]
    md = v1_spec_metadata(drafts)
    sm = world.set_drafts(drafts)
    if mode == "tree":
        step.attach([rid if ok[r] else None for r, rid in enumerate(ids)], parents_tensor(parents_all))
    seed = int(g.integers(0, 2**31))
    gens = world.gen_states()
    torch.manual_seed(seed)
    want = world.rejection_sampler(md, None, logits.clone(), sm).sampled_token_ids
    gens_want = world.gen_states()
    world.restore(gens)
    torch.manual_seed(seed)
    with no_host_sync():
        out = step.sample_v1(md, None, logits.clone(), sm)
    walked = out is not None
    if out is None:  # what the call site does then: vLLM's chain sampler
        out = world.rejection_sampler(md, None, logits.clone(), sm)
    # a seeded chain request's generator advances exactly as upstream's (its next steps match)
    idx = {rid: world.ib.req_id_to_index[rid] for rid in ids}
    for r, rid in enumerate(ids):
        if not ok[r] and idx[rid] in gens_want:
            assert torch.equal(world.ib.sampling_metadata.generators[idx[rid]].get_state(),
                               gens_want[idx[rid]]), (r, sps[r])
    if not walked:
        assert not any(ok[r] for r in range(B) if sizes[r]) or not any(sizes), (ok, sizes)
        assert torch.equal(out.sampled_token_ids, want)
        return
    got = out.sampled_token_ids
    assert got.shape == want.shape and got.dtype == torch.int32
    oracle = v1_oracle_argmax(world, sps, logits, parents_all, sizes, cu)
    STATS["batches"] += 1
    STATS["requests"] += B
    for r in range(B):
        is_tree = ok[r]
        STATS["tree_requests" if is_tree else "chain_requests"] += 1
        temp = sps[r].temperature
        if not is_tree or (mode == "chain" and temp == 0):
            assert torch.equal(want[r], got[r]), (mode, spec, r, sps[r], want[r], got[r])
            STATS["compared_tokens"] += int((want[r] != -1).sum())
        elif temp == 0:  # greedy tree request: the reference walk on the oracle rows, final token included
            ref, acc, _ = ref_walk(drafts[r], parents_all[r], oracle[cu[r]: cu[r + 1]], md.max_spec_len + 1)
            a = int(acc[0])
            assert torch.equal(got[r], ref[0]), (spec, r, sps[r], got[r], ref, parents_all[r], drafts[r])
            STATS["compared_tokens"] += a + 1
        else:
            a = int((got[r] != -1).sum())
            assert 1 <= a <= sizes[r] + 1 and bool((got[r, :a] >= 0).all()) and bool((got[r, :a] < V).all())


if "differential" in GROUPS:
    @check(f"{FAMILY}_differential")
    def _differential():
        g = np.random.default_rng(SEED)
        for i in range(BATCHES):
            mode = "chain" if i % 2 == 0 else "tree"
            if FAMILY == "v1":  # the logits processors of a run with a drafter, and the full built-in set
                v1_round(g, mode, spec=(i // 2) % 2 == 0)
            else:
                v2_round(g, mode)

if "defects" in GROUPS:
    import defects

    defects.run(FAMILY)

if "dist" in GROUPS:
    import dist

    dist.run(FAMILY, SEED, STATS)

print("PROBE-STATS " + json.dumps(STATS), flush=True)
print("PROBE-RESULT " + json.dumps(RESULTS), flush=True)
