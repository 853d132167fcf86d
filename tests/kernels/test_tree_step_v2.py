"""The tree step's V2-runner entry points on CPU (tree-step ABI 4): ``prepare_v2`` (the V2
``execute_model`` site, right after ``prepare_attn``), the compaction's V2 slot ids (the step's
``slot_mappings``, not V1's block table) and ``drafter_rows_v2`` (the V2 ``DFlashSpeculator.propose``
site). The input batch carries the fields of vLLM 0.26.0's V2 ``InputBatch`` that the tree step
reads; the V2 runner itself needs CUDA: it runs end to end on the H200 (scripts/gpu_tree_e2e.sh,
the ``*-v2`` engines; docs/runs/h200-ddtree-v2-2026-12-01.json)."""
from __future__ import annotations

import types

import numpy as np
import torch

from ddtree_patcher.runtime import hook
from ddtree_patcher.runtime import tree_step as TS
from helpers import bare_tree_step


def v2_step():
    h = hook.VerifyStep.__new__(hook.VerifyStep)
    h.device = torch.device("cpu")
    # request "a": 4 nodes (0-based parents of nodes 1..4: root, root, node 1, node 2); "c": 3 nodes
    h._att = [torch.tensor([[0, 0, 1, 2], [0, 1, 1, 0]], dtype=torch.int32)]
    h._where = {"a": (0, 0), "c": (0, 1)}
    return bare_tree_step(v2=True, graph_bufs=None, hook=h)


def test_prepare_v2_compaction_slots_and_drafter_rows():
    """Batch (V2 order): "a" verifies 4 nodes (context 10), "b" is a prefill chunk of 3 tokens
    (context 0), "c" verifies 3 nodes (context 20). prepare_v2: the tree rows' positions become
    root + depth, b's stay; the walk accepts a's node 2 then node 4 (depths 1, 2: both moved) and
    c's node 1 (the chain's: not moved); the compaction moves KV along the step's V2 slot ids; then
    drafter_rows_v2 gathers the aux hidden rows along the accepted path and makes positions linear."""
    st = v2_step()
    nsched = np.array([5, 3, 4], dtype=np.int32)
    linear = torch.tensor([10 + i for i in range(5)] + [0, 1, 2] + [20 + i for i in range(4)], dtype=torch.int64)
    positions = torch.cat([linear, torch.zeros(4, dtype=torch.int64)])  # padded to 16 rows (a graph's size)
    ib = types.SimpleNamespace(num_reqs=3, req_ids=["a", "b", "c"], cu_num_logits_np=np.array([0, 5, 6, 10]),
                               num_scheduled_tokens=nsched, num_tokens=12, positions=positions)
    slots = torch.randperm(64)[:16].view(1, 16)  # [groups, T_padded], what prepare_attn returned
    st.prepare_v2(None, ib, slots)
    assert st.active and st.B == 3 and st.T == 12 and st.req_mask.tolist() == [True, False, True]
    depth_a, depth_c = [0, 1, 1, 2, 2], [0, 1, 2, 2]
    assert positions[:5].tolist() == [10 + d for d in depth_a]
    assert positions[5:8].tolist() == [0, 1, 2] and positions[8:12].tolist() == [20 + d for d in depth_c]
    assert torch.equal(st._slots(0), slots[0, :12])

    # the walk's result (hook.VerifyStep.keep's buffers): accepted rows [B, W], -1 padded
    kv = torch.randn(16, 4, 2, 3)  # (blocks, block size, heads, dim): 64 slots
    before = kv.clone()
    st.groups = [(0, [kv])]
    walk = types.SimpleNamespace(accepted_rows=torch.tensor([[0, 2, 4, -1], [5, -1, -1, -1], [8, 9, -1, -1]]),
                                 num_accepted=torch.tensor([2, 0, 1]), tree_rows=torch.tensor([True, False, True]))
    st.after_walk(walk)
    assert st.compactions == 1 and st.moved_rows == 2 and st.accepted_depths == {2: 1, 1: 1}
    s = slots[0].tolist()
    for src, dst in ((2, 1), (4, 2)):  # a's accepted nodes 2 and 4 now at depths 1 and 2
        assert torch.equal(kv[s[dst] // 4, s[dst] % 4], before[s[src] // 4, s[src] % 4])
    moved = {s[1], s[2]}
    for slot in range(64):
        if slot not in moved:
            assert torch.equal(kv[slot // 4, slot % 4], before[slot // 4, slot % 4])

    aux = [torch.arange(16 * 3, dtype=torch.float32).view(16, 3) + 1000 * i for i in range(2)]
    ref = [a.clone() for a in aux]
    st.drafter_rows_v2(None, aux, positions)
    for a, r in zip(aux, ref):
        assert torch.equal(a[1], r[2]) and torch.equal(a[2], r[4])  # a's accepted path
        assert torch.equal(a[0], r[0]) and torch.equal(a[3:], r[3:])  # everything else as it was
    assert torch.equal(positions[:12], linear) and st.node_rows is None
    st.drafter_rows_v2(None, aux, positions)  # a second call (a dummy run's propose): nothing to do
    assert torch.equal(positions[:12], linear)


def test_prepare_v2_without_trees_is_not_a_tree_step():
    st = v2_step()
    st.hook._where = {}
    positions = torch.arange(8, dtype=torch.int64)
    ib = types.SimpleNamespace(num_reqs=2, req_ids=["x", "y"], cu_num_logits_np=np.array([0, 4, 8]),
                               num_scheduled_tokens=np.array([4, 4]), num_tokens=8, positions=positions)
    st.prepare_v2(None, ib, torch.zeros(1, 8, dtype=torch.int64))
    assert not st.active and positions.tolist() == list(range(8))
    st.drafter_rows_v2(torch.zeros(8, 2), None, positions)  # no plan: unchanged
    assert positions.tolist() == list(range(8))


def test_device_path_gathers_with_a_kept_gatherer():
    """The CUDA path's compaction and drafter-row gather (Triton kernels, here under the
    interpreter) over two steps: the drafter's context tensors keep their memory (as CUDA graphs'
    static buffers do), so the second step reuses the first step's RowGatherer (no pointer table
    rebuilt); new memory gets a new one. Both steps gather along their own accepted path. The
    compaction kernel adds the moved-depth and accepted-length counters."""
    from ddtree_patcher.kernels import KVCompactor

    class DeviceStep(TS.TargetTreeStep):  # the CUDA path's code on CPU tensors (Triton interpreter)
        cuda = True

    st = v2_step()
    st.__class__ = DeviceStep
    nsched = np.array([5, 3, 4], dtype=np.int32)
    aux = [torch.arange(16 * 3, dtype=torch.float32).view(16, 3) + 1000 * i for i in range(2)]
    kv = torch.randn(16, 4, 2, 3)
    slots = torch.randperm(64)[:16].view(1, 16)
    st.groups = [(0, [kv])]
    st.compactors = [(0, KVCompactor([kv]))]
    gatherers = []
    for path, tensors in (([0, 2, 4, -1], aux), ([0, 1, 3, -1], aux), ([0, 2, 4, -1], [a.clone() for a in aux])):
        positions = torch.cat([torch.tensor([10 + i for i in range(5)] + [0, 1, 2] + [20 + i for i in range(4)]),
                               torch.zeros(4, dtype=torch.int64)])
        ib = types.SimpleNamespace(num_reqs=3, req_ids=["a", "b", "c"], cu_num_logits_np=np.array([0, 5, 6, 10]),
                                   num_scheduled_tokens=nsched, num_tokens=12, positions=positions)
        st.hook._where = {"a": (0, 0), "c": (0, 1)}
        st.prepare_v2(None, ib, slots)
        walk = types.SimpleNamespace(accepted_rows=torch.tensor([path, [5, -1, -1, -1], [8, 9, -1, -1]]),
                                     num_accepted=torch.tensor([2, 0, 1]), tree_rows=torch.tensor([True, False, True]))
        st.after_walk(walk)
        ref = [t.clone() for t in tensors]
        st.drafter_rows_v2(None, tensors, positions)
        for t, r in zip(tensors, ref):
            assert torch.equal(t[1], r[path[1]]) and torch.equal(t[2], r[path[2]])
            assert torch.equal(t[0], r[0]) and torch.equal(t[3:], r[3:])
        gatherers.append(st._row_gatherer[1])
    assert gatherers[0] is gatherers[1] and gatherers[2] is not gatherers[1]
    # the compaction kernel's counters: a moves depths 1 and 2, then 2, then 1 and 2; c's node is the chain's
    c = st.counters()
    assert c["compactions"] == 3 and c["moved_rows"] == 5 and c["accepted_depths"] == {1: 3, 2: 3}, c
