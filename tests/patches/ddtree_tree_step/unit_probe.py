"""Unit checks of the tree-shaped target step on the real CPU attention backend of a patched
vLLM 0.25.0-0.28.0 site (run with PYTHONPATH=<site>; prints ``PROBE-RESULT {json}``).

Per case (block size, dtype): a batch of four requests on a paged KV cache with random block
tables: r0 a random tree (n = 7, ctx 37), r1 a prefill chunk (5 rows, ctx 11), r2 a random tree
(n = 5, ctx 3), r3 a chain (4 rows, ctx 20). K/V are written with the backend's own
``do_kv_cache_update``; the *patched* ``CPUAttentionBackendImpl.forward`` runs with the real
metadata object and the op's scheduler metadata (0.25.0/0.26.0's forward writes this step's K/V
again before its attention call: it is given the same values). Checked against a dense float64 reference
computed here from the K/V values written (not read back through our views):

* ``attention``: tree rows == explicit ``[q_len, ctx + q_len]`` ancestor mask; other rows ==
  causal (the backend's own); without the tree step, tree rows differ (the site matters);
* ``chain_tree``: a chain-shaped tree reproduces the causal rows (to rounding);
* ``positions``: ``set_plan`` writes ``ctx + depth`` at tree rows only;
* ``compaction``: after a random accepted path per tree, every accepted node's K/V sits at the
  slot of ``ctx + d`` (== the values written for node j_d), every other byte of the cache is
  unchanged, and the result equals ``compact_kv_ref`` on the same views;
* ``drafter_rows``: hidden rows gathered along the path, positions linear again.
"""
import inspect
import json
import math
import os
import random
import sys
import traceback
from types import SimpleNamespace

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import vllm.v1.attention.backends.cpu_attn as ca  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from ddtree_patcher.kernels import compact_kv_ref  # noqa: E402
from ddtree_patcher.runtime import tree_step as TS  # noqa: E402

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # tests/: helpers
from helpers import bare_tree_step, set_plan  # noqa: E402

RESULTS = {}
Hq, Hkv, D = 4, 2, 64


def check(name):
    def deco(fn):
        try:
            fn()
            RESULTS[name] = "ok"
        except Exception as e:  # noqa: BLE001 - reported
            RESULTS[name] = f"{type(e).__name__}: {e}"[:800]
            traceback.print_exc()
        return fn
    return deco


def make_impl(bs, dtype):
    ca.get_current_vllm_config = lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=dtype),
                                                         cache_config=SimpleNamespace(block_size=bs))
    return ca.CPUAttentionBackendImpl(num_heads=Hq, head_size=D, scale=D ** -0.5, num_kv_heads=Hkv,
                                      alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")


def random_parents(n, rng):
    return [rng.randint(0, j - 1) for j in range(1, n + 1)]


def ancestors(parents, j):
    out = {j}
    while j:
        j = parents[j - 1]
        out.add(j)
    return out


def dense_ref(q, K, V, ctx, visible, scale):
    """q [n, Hq, D], K/V [ctx+n, Hkv, D], visible bool [n, ctx+n] -> [n, Hq, D] float64."""
    G = Hq // Hkv
    k = K.double().repeat_interleave(G, 1)
    v = V.double().repeat_interleave(G, 1)
    s = torch.einsum("mhd,nhd->hmn", q.double(), k) * scale
    s = s.masked_fill(~visible[None], -math.inf)
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), v)


class Case:
    def __init__(self, bs, dtype, seed, trees=None):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        self.bs, self.dtype = bs, dtype
        self.impl = make_impl(bs, dtype)
        # the ISA: the impl's (0.25.0-0.28.0) or, from 0.29.0, what the builder sets on the layer
        self.isa = getattr(self.impl, "isa", None) or ca._get_attn_isa(dtype, bs, D, "auto")
        # (ctx, q_len, parents or None)
        p0 = random_parents(7, rng)
        p2 = random_parents(5, rng)
        if trees is not None:
            p0, p2 = trees
        self.reqs = [(37, 8, p0), (11, 5, None), (3, 6, p2), (20, 4, None)]
        B = self.B = len(self.reqs)
        maxblk = max((c + n + bs - 1) // bs for c, n, _ in self.reqs)
        nb = B * maxblk + 3
        perm = torch.randperm(nb).tolist()
        self.block_table = torch.tensor([perm[r * maxblk:(r + 1) * maxblk] for r in range(B)], dtype=torch.int32)
        self.kv_cache = (torch.randn(nb, Hkv, bs, 2 * D) * 0.1).to(dtype)
        self.K = [torch.randn(c + n, Hkv, D).to(dtype) for c, n, _ in self.reqs]
        self.V = [torch.randn(c + n, Hkv, D).to(dtype) for c, n, _ in self.reqs]
        self.layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0, isa=self.isa)
        for r, (c, n, _) in enumerate(self.reqs):  # context and this step's rows: the backend's own write
            self.impl.do_kv_cache_update(self.layer, self.K[r], self.V[r], self.kv_cache, self.slots(r, range(c + n)))
        nsched = [n for _, n, _ in self.reqs]
        self.nsched = np.asarray(nsched, dtype=np.int64)
        self.qsl = torch.tensor([0] + list(np.cumsum(nsched)), dtype=torch.int32)
        self.T = int(self.qsl[-1])
        self.seq_lens = torch.tensor([c + n for c, n, _ in self.reqs], dtype=torch.int32)
        self.slot_mapping = torch.cat([self.slots(r, range(c, c + n)) for r, (c, n, _) in enumerate(self.reqs)])
        self.query = torch.randn(self.T, Hq, D).to(dtype)
        self.positions = torch.cat([torch.arange(c, c + n) for c, n, _ in self.reqs]).to(torch.int64)

    def slots(self, r, positions):
        pos = torch.tensor(list(positions), dtype=torch.int64)
        return self.block_table[r, pos // self.bs].to(torch.int64) * self.bs + pos % self.bs

    def metadata(self):
        extra = {}  # 0.27.0+ take the KV-cache dtype
        if "kv_cache_dtype" in inspect.signature(ops.cpu_attn_get_scheduler_metadata).parameters:
            extra["kv_cache_dtype"] = "auto"
        sm = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=self.B, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, seq_lens=self.seq_lens, dtype=self.dtype,
            query_start_loc=self.qsl, causal=True, sliding_window_size=-1, isa=self.isa, enable_kv_split=False,
            dynamic_causal=None, **extra)
        return ca.CPUAttentionMetadata(num_actual_tokens=self.T, max_query_len=int(self.nsched.max()),
                                       query_start_loc=self.qsl, max_seq_len=int(self.seq_lens.max()),
                                       seq_lens=self.seq_lens, block_table=self.block_table,
                                       slot_mapping=self.slot_mapping, scheduler_metadata=sm, causal=True)

    def step(self):
        st = bare_tree_step()
        st.impl_views[id(self.impl)] = TS.cpu_kv_views(self.impl, self.kv_cache, self.isa)
        if self.isa in ("vec", "vec16"):  # the kernels' static description == the measured layout
            from ddtree_patcher.kernels import kv_views

            static = kv_views(self.kv_cache, "cpu-nbhbs2d", self.impl.head_size)
            for got, want in zip(static, st.impl_views[id(self.impl)]):
                assert got.stride() == want.stride() and got.storage_offset() == want.storage_offset(), \
                    (self.isa, got.stride(), want.stride())
        trees = [(r, len(p), torch.tensor(p, dtype=torch.int32)) for r, (_, _, p) in enumerate(self.reqs) if p]
        self.pos_tree = self.positions.clone()
        set_plan(st, self.B, self.T, self.nsched, trees, self.pos_tree)
        return st

    def forward(self, st):
        if st is None:
            self.impl.__dict__.pop(TS.ATTR, None)
        else:
            self.impl.__dict__[TS.ATTR] = st
        out = torch.zeros(self.T, Hq, D, dtype=self.dtype)
        # this step's K/V (already written by do_kv_cache_update; 0.25.0/0.26.0's forward writes them again)
        key = torch.cat([self.K[r][c:c + n] for r, (c, n, _) in enumerate(self.reqs)])
        value = torch.cat([self.V[r][c:c + n] for r, (c, n, _) in enumerate(self.reqs)])
        self.impl.forward(self.layer, self.query, key, value, self.kv_cache, self.metadata(), out)
        self.impl.__dict__.pop(TS.ATTR, None)
        return out

    def reference(self):
        """(rows of tree requests, dense expected output [T, Hq, D] float64)."""
        exp = torch.zeros(self.T, Hq, D, dtype=torch.float64)
        tree_rows = []
        for r, (c, n, p) in enumerate(self.reqs):
            qs = int(self.qsl[r])
            vis = torch.zeros(n, c + n, dtype=torch.bool)
            vis[:, :c] = True
            for i in range(n):
                if p:
                    for a in ancestors(p, i):
                        vis[i, c + a] = True
                else:
                    vis[i, c:c + i + 1] = True
            if p:
                tree_rows += list(range(qs, qs + n))
            exp[qs:qs + n] = dense_ref(self.query[qs:qs + n], self.K[r], self.V[r], c, vis, self.impl.scale)
        return tree_rows, exp


CASES = [(16, torch.float32), (32, torch.float32), (32, torch.bfloat16)]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}

for bs, dtype in CASES:
    tag = f"bs{bs}-{str(dtype).split('.')[-1]}"

    @check(f"attention[{tag}]")
    def _():
        case = Case(bs, dtype, seed=bs)
        RESULTS[f"isa[{tag}]"] = case.isa
        st = case.step()
        rows, exp = case.reference()
        got = case.forward(st).double()
        err = (got - exp).abs().max().item()
        assert err < TOL[dtype], (err, TOL[dtype])
        assert st.attention_calls == 1
        plain = case.forward(None).double()  # the unpatched path: causal over node order
        other = [i for i in range(case.T) if i not in rows]
        assert (plain[other] - exp[other]).abs().max().item() < TOL[dtype]  # non-tree rows: the backend's own
        assert (plain[rows] - exp[rows]).abs().max().item() > 50 * TOL[dtype]  # tree rows need the tree step

    @check(f"chain_tree[{tag}]")
    def _():
        chain0, chain2 = list(range(7)), list(range(5))
        case = Case(bs, dtype, seed=bs + 1, trees=(chain0, chain2))
        st = case.step()
        got = case.forward(st).float()
        plain = case.forward(None).float()
        err = (got - plain).abs().max().item()
        assert err < TOL[dtype], err
        assert torch.equal(case.pos_tree, case.positions)  # a chain's depths are its linear offsets

    @check(f"positions[{tag}]")
    def _():
        case = Case(bs, dtype, seed=bs + 2)
        case.step()
        for r, (c, n, p) in enumerate(case.reqs):
            qs = int(case.qsl[r])
            want = [c + (len(ancestors(p, i)) - 1 if p else i) for i in range(n)]
            assert case.pos_tree[qs:qs + n].tolist() == want, (r, case.pos_tree[qs:qs + n].tolist(), want)

    @check(f"compaction_and_drafter_rows[{tag}]")
    def _():
        rng = random.Random(bs + 3)
        for attempt in range(20):
            case = Case(bs, dtype, seed=100 * attempt + bs)
            st = case.step()
            W = 8
            acc_rows = torch.full((case.B, W), -1, dtype=torch.int32)
            num_acc = torch.zeros(case.B, dtype=torch.int32)
            paths = {}
            base = 0  # logits rows: only the offsets inside a request matter
            for r, (c, n, p) in enumerate(case.reqs):
                if p:
                    path, j = [], 0
                    while True:
                        kids = [k for k in range(1, len(p) + 1) if p[k - 1] == j]
                        if not kids or (path and rng.random() < 0.2):
                            break
                        j = rng.choice(kids)
                        path.append(j)
                    paths[r] = path
                    a = len(path)
                    acc_rows[r, :a + 1] = torch.tensor([base] + [base + j for j in path], dtype=torch.int32)
                    num_acc[r] = a
                elif r == 3:  # a chain request that accepted two drafts: nothing moves
                    acc_rows[r, :3] = torch.tensor([base, base + 1, base + 2], dtype=torch.int32)
                    num_acc[r] = 2
                else:
                    acc_rows[r, 0] = base
                base += n + 7
            if any(j != d for path in paths.values() for d, j in enumerate(path, start=1)):
                break
        else:
            raise AssertionError("no branching path drawn")
        hook_step = SimpleNamespace(accepted_rows=acc_rows, num_accepted=num_acc,
                                    tree_rows=torch.tensor([bool(p) for _, _, p in case.reqs]))
        st.runner = SimpleNamespace(input_batch=SimpleNamespace(block_table=[SimpleNamespace(
            slot_mapping=SimpleNamespace(gpu=case.slot_mapping))]))
        st.groups = [(0, list(st.impl_views[id(case.impl)]))]
        before = case.kv_cache.clone()
        expected = case.kv_cache.clone()
        ref_views = TS.cpu_kv_views(case.impl, expected, case.isa)
        compact_kv_ref(list(ref_views), case.slot_mapping, case.qsl, acc_rows, num_acc)
        st.after_walk(hook_step)
        assert torch.equal(case.kv_cache, expected), "!= compact_kv_ref"
        k_view, v_view = st.impl_views[id(case.impl)]
        dst_slots = []
        for r, path in paths.items():
            c = case.reqs[r][0]
            for d, j in enumerate(path, start=1):
                s = int(case.slots(r, [c + d])[0])
                dst_slots.append(s)
                assert torch.equal(k_view[s // bs, s % bs], case.K[r][c + j]), (r, d, j)
                assert torch.equal(v_view[s // bs, s % bs], case.V[r][c + j]), (r, d, j)
        # every other slot: unchanged bytes
        mask = torch.ones(case.kv_cache.shape[0], bs, dtype=torch.bool)
        for s in dst_slots:
            mask[s // bs, s % bs] = False
        kb, vb = TS.cpu_kv_views(case.impl, before, case.isa)
        assert torch.equal(k_view[mask], kb[mask]) and torch.equal(v_view[mask], vb[mask])
        assert st.moved_rows == sum(1 for path in paths.values() for d, j in enumerate(path, 1) if j != d)
        # the drafter's inputs
        hidden = torch.randn(case.T, 16)
        old = hidden.clone()
        pos = case.pos_tree.clone()
        st.drafter_rows(hidden, pos)
        assert torch.equal(pos, case.positions), "positions not linear again"
        for r, (c, n, p) in enumerate(case.reqs):
            qs = int(case.qsl[r])
            path = paths.get(r, [])
            for i in range(n):
                if 1 <= i <= len(path):
                    assert torch.equal(hidden[qs + i], old[qs + path[i - 1]]), (r, i)
                else:
                    assert torch.equal(hidden[qs + i], old[qs + i]), (r, i)

print("PROBE-RESULT " + json.dumps(RESULTS), flush=True)
sys.exit(0)
