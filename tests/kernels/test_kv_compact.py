"""KV compaction and drafter-row gather (Triton interpreter): after a random walk result every
layer's KV at positions ``ctx + 1 .. ctx + a`` equals the accepted nodes' KV, every other slot is
unchanged, for every cache layout of the integration map and fp8 / bf16 / fp32 (raw bytes);
overlapping chains (``j_d > d``) are safe; the hidden-state gather equals the gathered rows and
positions are linear again."""

from __future__ import annotations

import pytest
import torch

from _tree_step_cases import LAYOUTS, make_cache, make_case, random_walk
from ddtree_patcher.kernels import (
    KVCompactor,
    RowGatherer,
    compact_kv,
    compact_kv_ref,
    gather_accepted_rows,
    gather_accepted_rows_ref,
    kv_views,
    packed_kv_view,
)
from ddtree_patcher.kernels.kv_compact import KVCompactError

D = 16


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(
        {2: torch.int16, 4: torch.int32}[t.element_size()])


def _walk(c, gen, W, row_base=None, forced=None):
    """VerifyStep-style accepted_rows [B, W] (-1 padded; any row numbering) and num_accepted."""
    B = len(c.parents)
    rows = torch.full((B + 2, W), -1, dtype=torch.int32)  # oversized like max_num_reqs buffers
    nacc = torch.zeros(B + 2, dtype=torch.int32)
    qsl = c.query_start_loc.tolist()
    for r in range(B):
        path = forced[r] if forced and forced[r] is not None else random_walk(c.parents[r], gen, W)
        base = qsl[r] if row_base is None else row_base[r]
        rows[r, :len(path)] = torch.tensor(path, dtype=torch.int32) + base
        nacc[r] = len(path) - 1
    return rows, nacc


def _expected(layer_views_before, c, rows, nacc):
    """Per layer view: the original tensor with positions ctx+d <- ctx+j_d (explicit loop)."""
    out = []
    qsl, ctx = c.query_start_loc.tolist(), c.context_lens.tolist()
    for view in layer_views_before:
        exp = view.clone()
        bs = view.shape[1]
        for r in range(len(c.parents)):
            row0 = int(rows[r, 0])
            for d in range(1, int(nacc[r]) + 1):
                j = int(rows[r, d]) - row0
                bt = c.block_table[r]
                src, dst = ctx[r] + j, ctx[r] + d
                exp[int(bt[dst // bs]), dst % bs] = view[int(bt[src // bs]), src % bs]
        out.append(exp)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("g", [1, 2, 16])  # depths per tile (2: groups in sequence, 16: one group; the
def test_compaction_every_layout_and_dtype(layout, dtype, g):  # forced chains read slots their group writes
    gen = torch.Generator().manual_seed(LAYOUTS.index(layout) * 7 + dtype.itemsize)
    bs = 16 if layout.startswith("fa") else 8
    c = make_case([5, 37, 0, 20, 3], [9, 12, 4, 0, 7], Hq=2, Hkv=2, D=D, bs=bs, seed=3)
    nb = c.cache.shape[0]  # the case's own cache is fa-nbhbs2d; its block table indexes nb blocks
    # three layers, each its own tensor in the release's layout and memory order
    layers = [make_cache(layout, nb, bs, 2, D, torch.float32, gen).to(dtype) for _ in range(3)]
    W = 10
    forced = [[0, 2, 3, 5], None, None, None, [0, 1, 3, 6, 7]]  # overlapping chains (j_d > d)
    rows, nacc = _walk(c, gen, W, forced=forced)
    views = []
    for t in layers:
        views += [packed_kv_view(t)] if layout == "fa-nbhbs2d" else kv_views(t, layout, D)
    per_layer_kv = [kv_views(t, layout, D) for t in layers]  # K and V as the backend reads them
    expected = [_expected(kv, c, rows, nacc) for kv in per_layer_kv]
    before = [t.clone() for t in layers]
    compact_kv(views, c.slot_mapping, c.query_start_loc, rows, nacc, num_reqs=5, depths_per_tile=g)
    moved = 0
    for kv, exp in zip(per_layer_kv, expected):
        for got, want in zip(kv, exp):
            assert torch.equal(_bits(got), _bits(want))
    for t, b in zip(layers, before):
        moved += int((_bits(t) != _bits(b)).any(dim=-1).sum())
    assert moved > 0  # the forced chains do move data
    # the reference agrees on the whole tensors (slots it does not move stay as they were)
    ref_layers = [b.clone() for b in before]
    ref_views = []
    for t in ref_layers:
        ref_views += [packed_kv_view(t)] if layout == "fa-nbhbs2d" else kv_views(t, layout, D)
    compact_kv_ref(ref_views, c.slot_mapping, c.query_start_loc, rows, nacc, num_reqs=5)
    for t, rt in zip(layers, ref_layers):
        assert torch.equal(_bits(t), _bits(rt))


def test_untouched_slots_unchanged_and_chain_is_a_no_op():
    gen = torch.Generator().manual_seed(5)
    c = make_case([8, 30], [6, 10], Hq=2, Hkv=2, D=D, bs=16, dtype=torch.bfloat16, seed=9)
    before = c.cache.clone()
    # chain results (j_d == d) and a rejected-everything request move nothing
    rows = torch.tensor([[0, 1, 2, 3, -1, -1], [7, -1, -1, -1, -1, -1]], dtype=torch.int32)
    nacc = torch.tensor([3, 0], dtype=torch.int32)
    compact_kv(kv_views(c.cache, "fa-nbhbs2d", D), c.slot_mapping, c.query_start_loc, rows, nacc)
    assert torch.equal(_bits(c.cache), _bits(before))
    # a real move touches exactly the destination positions ctx+1..ctx+a of that request
    rows = torch.tensor([[0, -1, -1, -1, -1, -1], [7, 9, 10, 12, -1, -1]], dtype=torch.int32)
    nacc = torch.tensor([0, 3], dtype=torch.int32)
    KVCompactor([packed_kv_view(c.cache)])(c.slot_mapping, c.query_start_loc, rows, nacc)
    k_after, _ = kv_views(c.cache, "fa-nbhbs2d", D)
    k_before, _ = kv_views(before, "fa-nbhbs2d", D)
    changed = (_bits(k_after) != _bits(k_before)).flatten(2).any(-1).nonzero().tolist()
    bt = c.block_table[1].tolist()
    dst = sorted([bt[(30 + d) // 16], (30 + d) % 16] for d in (1, 2, 3))
    assert sorted(changed) == dst


def test_pad_slots_and_duplicate_views_are_safe():
    c = make_case([4, 6], [5, 5], Hq=2, Hkv=2, D=D, bs=4, seed=2)
    rows = torch.tensor([[0, 2, 4, -1], [6, 7, 9, 11]], dtype=torch.int32)
    nacc = torch.tensor([2, 3], dtype=torch.int32)
    exp_cache = c.cache.clone()
    compact_kv_ref(kv_views(exp_cache, "fa-nbhbs2d", D), c.slot_mapping, c.query_start_loc, rows, nacc)
    k, v = kv_views(c.cache, "fa-nbhbs2d", D)
    compact_kv([k, v, k], c.slot_mapping, c.query_start_loc, rows, nacc)  # k twice: moved once
    assert torch.equal(c.cache, exp_cache)
    slots = c.slot_mapping.clone()
    slots[0 + 4] = -1  # request 0's source node 4 has no slot (PAD): that move is skipped
    before = c.cache.clone()
    compact_kv([packed_kv_view(c.cache)], slots, c.query_start_loc, rows[:1], nacc[:1], num_reqs=1)
    exp = before.clone()
    compact_kv_ref([packed_kv_view(exp)], slots, c.query_start_loc, rows[:1], nacc[:1], num_reqs=1)
    assert torch.equal(c.cache, exp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hidden_gather_and_positions(dtype):
    gen = torch.Generator().manual_seed(21)
    c = make_case([11, 40, 7], [8, 12, 5], seed=4)
    T = c.q.shape[0]
    W = 9
    rows, nacc = _walk(c, gen, W, forced=[[0, 3, 5, 6], None, [0, 2]])
    hidden = [torch.randn(T, 48, generator=gen).to(dtype) for _ in range(3)]
    wide = torch.randn(T, 80, generator=gen).to(dtype)[:, :72]  # strided rows
    positions = torch.arange(T, dtype=torch.int64) * 0
    qsl = c.query_start_loc.tolist()
    for r in range(3):  # tree positions ctx + depth (siblings share one)
        for j in range(qsl[r + 1] - qsl[r]):
            positions[qsl[r] + j] = c.context_lens[r] + (j and (j % 3) + 1)
    exp = [h.clone() for h in hidden] + [wide.clone()]
    exp_pos = positions.clone()
    gather_accepted_rows_ref(exp, c.query_start_loc, rows, nacc, exp_pos, num_reqs=3)
    gather_accepted_rows(hidden + [wide], c.query_start_loc, rows, nacc, positions, num_reqs=3)
    for got, want in zip(hidden + [wide], exp):
        assert torch.equal(got, want)
    assert torch.equal(positions, exp_pos)
    for r in range(3):  # linear again: ctx, ctx + 1, ... for min(q_len, W) rows
        n = min(qsl[r + 1] - qsl[r], W)
        assert positions[qsl[r]:qsl[r] + n].tolist() == list(range(int(c.context_lens[r]),
                                                                    int(c.context_lens[r]) + n))
    # hidden rows: explicit check for request 0 (path 0, 3, 5, 6)
    h0 = exp[0]
    assert torch.equal(hidden[0][qsl[0] + 1], h0[qsl[0] + 1])
    # positions alone (no tensors)
    pos2 = torch.zeros(T, dtype=torch.int32)
    RowGatherer([])(c.query_start_loc, rows, nacc, pos2, num_reqs=3)
    assert pos2[qsl[1]:qsl[1] + 3].tolist() == [0, 1, 2]


def test_named_errors():
    c = make_case([4], [2], seed=1)
    rows = torch.zeros(1, 3, dtype=torch.int32)
    nacc = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(KVCompactError, match="layout"):
        kv_views(c.cache, "fa-bogus", D)
    with pytest.raises(KVCompactError, match="4-D"):
        compact_kv([c.cache[0, 0]], c.slot_mapping, c.query_start_loc, rows, nacc)
    with pytest.raises(KVCompactError, match="accepted_rows"):
        compact_kv([packed_kv_view(c.cache)], c.slot_mapping, c.query_start_loc,
                   rows.float(), nacc)
    with pytest.raises(KVCompactError, match="num_reqs"):
        compact_kv([packed_kv_view(c.cache)], c.slot_mapping, c.query_start_loc, rows, nacc,
                   num_reqs=5)


def test_compaction_counters_match_the_torch_count():
    """``counts``/``tree``: the kernel adds each request's moved depths (j_d != d, d <= a) and a
    histogram of a over tree rows, as the tree step counted with torch before (``moved_depths``);
    counts accumulate over calls; only the first view group counts."""
    from ddtree_patcher.runtime.tree_compaction import moved_depths

    gen = torch.Generator().manual_seed(5)
    c = make_case([5, 37, 0, 20, 3], [9, 12, 4, 0, 7], Hq=2, Hkv=2, D=D, bs=16, seed=3)
    W = 10
    rows, nacc = _walk(c, gen, W, forced=[[0, 2, 3, 5], None, None, None, [0, 1, 3, 6, 7]])
    layers = [make_cache("fa-nbhbs2d", c.cache.shape[0], 16, 2, D, torch.float32, gen) for _ in range(2)]
    views = [packed_kv_view(layers[0]), packed_kv_view(layers[1])[:, :, :1]]  # two view groups
    rows, nacc = rows[:5], nacc[:5]
    tree = torch.tensor([True, True, False, True, True])
    acc = torch.where(tree, nacc, torch.zeros_like(nacc))
    counts = torch.zeros(1 + W, dtype=torch.int64)
    comp = KVCompactor(views)
    assert len(comp.groups) == 2
    for _ in range(2):
        assert comp(c.slot_mapping, c.query_start_loc, rows, acc, num_reqs=5, counts=counts, tree=tree)
    want_moved = int(moved_depths(rows.to(torch.int64), acc.to(torch.int64))[2].sum())
    want_hist = torch.zeros(W, dtype=torch.int64).scatter_add_(0, acc.to(torch.int64).clamp(0, W - 1),
                                                               tree.to(torch.int64))
    assert want_moved > 0
    assert counts[0].item() == 2 * want_moved and counts[1:].tolist() == (2 * want_hist).tolist()
    with pytest.raises(KVCompactError, match="counts"):
        comp(c.slot_mapping, c.query_start_loc, rows, acc, num_reqs=5, counts=counts.to(torch.int32), tree=tree)


def test_16_byte_accesses_only_where_every_view_allows_them():
    """The kernel is told its rows are contiguous and 16-byte aligned only when they are: the
    packed FA layout (bf16: 8 elements, fp8: 16), not a view whose base or rows are misaligned
    or whose elements are strided (the CPU layout's keys); the moves are exact either way."""
    from ddtree_patcher.kernels.kv_compact import _group_views

    c = make_case([5, 9], [6, 6], Hq=2, Hkv=2, D=D, bs=16, dtype=torch.bfloat16, seed=4)
    packed = packed_kv_view(c.cache)
    assert [g.vec for g in _group_views([packed], "v")] == [8]
    assert [g.vec for g in _group_views([packed.to(torch.float8_e4m3fn)], "v")] == [16]
    flat = torch.zeros(packed.numel() + 1, dtype=torch.bfloat16)
    shifted = flat[1:].view(packed.shape)  # base one element past a 16-byte boundary
    assert [g.vec for g in _group_views([shifted], "v")] == [1]
    cpu = make_cache("cpu-nbhbs2d", 4, 8, 2, D, torch.float32, torch.Generator().manual_seed(1))
    kv = kv_views(cpu, "cpu-nbhbs2d", D)
    assert sorted(g.vec for g in _group_views(kv, "v")) == [1, 4]  # keys strided, values rows
    # the misaligned view still moves exactly
    shifted.copy_(packed)
    rows = torch.tensor([[0, 2, 4, -1], [6, 7, 9, 11]], dtype=torch.int32)
    nacc = torch.tensor([2, 3], dtype=torch.int32)
    exp = packed.clone()
    compact_kv_ref([exp], c.slot_mapping, c.query_start_loc, rows, nacc)
    compact_kv([shifted], c.slot_mapping, c.query_start_loc, rows, nacc)
    assert torch.equal(_bits(shifted), _bits(exp))
