"""The tree step's look-ahead (``TargetTreeStep.expect`` at the proposer's attach, then
``_prepare_expected`` in the next step's prepare; issue 14's host-bound V1 steps): for a step whose
batch is the one attached (every request a tree of 1 + n rows, same requests in the same order)
the prepare makes exactly the metadata of the general prepare (index tensors, bit rows, request
mask, FULL-graph buffers, depth positions, counters), without its upload and launch; for every
other batch it leaves the step to the general prepare. On CPU, with the real ``hook.VerifyStep``
(its attach calls the look-ahead) and the graph path's kernel under the Triton interpreter."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from ddtree_patcher.kernels import ancestor_rows
from ddtree_patcher.runtime import hook
from ddtree_patcher.runtime import tree_step as TS
from helpers import bare_tree_step

FIELDS = ("node_rows", "node_root", "node_index", "root_rows", "root_ext", "tree_rows", "ancestor_mask", "req_mask")
SCALARS = ("all_tree", "graph_step", "graph_steps", "B", "T", "W", "active", "tree_steps", "tree_requests")


def _params():
    return types.SimpleNamespace(logprobs=None, logprob_token_ids=None, presence_penalty=0.0,
                                 frequency_penalty=0.0, repetition_penalty=1.0, bad_words=None,
                                 _bad_words_token_ids=None, min_tokens=0, thinking_token_budget=None,
                                 structured_outputs=None, guided_decoding=None)


def make_step(ids, n, graph_q=None, look_ahead=True):
    """A V1 tree step on CPU with a real hook (requests ``ids``, budget n); ``graph_q``: FULL-graph
    buffers of that query length (chains, every row on, as ``_init_graph_buffers`` makes them)."""
    runner = types.SimpleNamespace(device="cpu", speculative_config=types.SimpleNamespace(num_speculative_tokens=n),
                                   max_num_reqs=8, requests={r: types.SimpleNamespace(sampling_params=_params())
                                                             for r in ids})
    st = bare_tree_step()
    st.hook = hook.VerifyStep(runner, "V1")
    st.graph_bufs = None
    if graph_q:
        rows = len(ids) + 2
        chain = torch.arange(-1, graph_q - 1, dtype=torch.int64).expand(rows, graph_q).contiguous()
        st.graph_bufs = (ancestor_rows(chain)[0], torch.ones(rows, dtype=torch.bool), graph_q)
    if look_ahead:
        st.hook.on_attach = st.expect
    return st


def random_trees(gen, B, n):
    par = np.zeros((B, n), dtype=np.int32)
    for b in range(B):
        for j in range(1, n + 1):
            par[b, j - 1] = j - 1 if gen.random() < 0.5 else gen.integers(0, j)
    return torch.from_numpy(par)


def run(st, ids, parents, batch, nd, nsched, ctx):
    """Attach ``parents`` for ``ids``, then prepare the step of ``batch`` (its drafts ``nd``, rows
    ``nsched``, linear positions from ``ctx``); returns the positions."""
    st.hook.attach(ids, parents)
    pos = torch.cat([torch.arange(c, c + q, dtype=torch.int64) for c, q in zip(ctx, nsched)] +
                    [torch.full((3,), -7, dtype=torch.int64)])  # a padded tail, never written
    st._prepare(list(batch), list(nd), np.asarray(nsched, dtype=np.int32), len(batch), int(sum(nsched)), pos)
    return pos


def same_plan(a, b, pa, pb):
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), f
    for f in SCALARS:
        assert getattr(a, f) == getattr(b, f), f
    assert torch.equal(pa, pb)
    if a.graph_bufs is not None:
        assert torch.equal(a.graph_bufs[0], b.graph_bufs[0]) and torch.equal(a.graph_bufs[1], b.graph_bufs[1])


@pytest.mark.parametrize("graph", ["none", "same-q", "other-q"])
def test_expected_batch_equals_the_general_prepare(graph):
    """Random trees, batches and contexts: the look-ahead's prepare == the general prepare, with
    and without FULL-graph buffers (of the step's query length, or of another one), over two
    consecutive steps (the second attach replaces the first)."""
    gen = np.random.default_rng(3)
    for trial in range(6):
        B, n = int(gen.integers(1, 5)), int(gen.integers(1, 7))
        ids = [f"r{trial}-{i}" for i in range(B)]
        q = {"none": None, "same-q": n + 1, "other-q": n + 3}[graph]
        fast, slow = make_step(ids, n, q), make_step(ids, n, q, look_ahead=False)
        for _ in range(2):
            parents = random_trees(gen, B, n)
            ctx = [int(c) for c in gen.integers(0, 50, size=B)]
            pf = run(fast, ids, parents, ids, [n] * B, [n + 1] * B, ctx)
            ps = run(slow, ids, parents, ids, [n] * B, [n + 1] * B, ctx)
            same_plan(fast, slow, pf, ps)
            for st in (fast, slow):  # the walk consumes the step's trees
                st.hook._where.clear()
                st.hook._att.clear()
        assert fast.expected_steps == 2 and slow.expected_steps == 0
        assert fast.graph_steps == (2 if graph == "same-q" else 0)


def _changed(case, ids, n):
    """(attached ids, attached rows, step batch, nd, nsched) of a batch that is not the one attached."""
    B = len(ids)
    if case == "reordered":
        return ids, ids[::-1], [n] * B, [n + 1] * B
    if case == "fewer-requests":
        return ids, ids[:-1], [n] * (B - 1), [n + 1] * (B - 1)
    if case == "trimmed-drafts":
        return ids, ids, [n] * (B - 1) + [n - 1], [n + 1] * (B - 1) + [n]
    if case == "chain-row":  # a request the proposer drafted as a chain (no tree attached)
        return [None] + ids[1:], ids, [n] * B, [n + 1] * B
    if case == "prefill-joins":
        return ids, ids + ["new"], [n] * B + [0], [n + 1] * B + [7]
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["reordered", "fewer-requests", "trimmed-drafts", "chain-row", "prefill-joins",
                                  "detached"])
def test_other_batches_take_the_general_prepare(case):
    """A batch other than the attached one (reordered, a request gone, drafts trimmed by the
    scheduler, a chain-drafted row, a joining prefill, a tree detached after the attach): the
    look-ahead is not used, and the step's metadata is the general prepare's."""
    gen = np.random.default_rng(11)
    B, n = 3, 4
    ids = [f"r{i}" for i in range(B)]
    fast, slow = make_step(ids + ["new"], n), make_step(ids + ["new"], n, look_ahead=False)
    parents = random_trees(gen, B, n)
    if case == "detached":
        attached, batch, nd, nsched = ids, ids, [n] * B, [n + 1] * B
    else:
        attached, batch, nd, nsched = _changed(case, ids, n)
    ctx = [int(c) for c in gen.integers(0, 40, size=len(batch))]
    out = []
    for st in (fast, slow):
        st.hook.attach(attached, parents)
        if case == "detached":
            st.hook.detach(ids[1])
        pos = torch.cat([torch.arange(c, c + q, dtype=torch.int64) for c, q in zip(ctx, nsched)])
        st._prepare(list(batch), list(nd), np.asarray(nsched, dtype=np.int32), len(batch), int(sum(nsched)), pos)
        out.append(pos)
    assert fast.expected_steps == 0
    same_plan(fast, slow, *out)


def test_no_look_ahead_while_capturing_or_without_a_tree(monkeypatch):
    """No look-ahead while a CUDA graph is captured (the ops would be recorded into it), nor for an
    attach of no tree row; a look-ahead serves one prepare only."""
    ids = ["a", "b"]
    st = make_step(ids, 3)
    st.hook.attach([None, None], torch.zeros(2, 3, dtype=torch.int32))
    assert st.expected is None
    st.hook.attach(ids, torch.zeros(2, 3, dtype=torch.int32))
    assert st.expected is not None
    st._prepare(ids, [3, 3], np.asarray([4, 4]), 2, 8, None)
    assert st.expected is None and st.expected_steps == 1
    st._prepare(ids, [3, 3], np.asarray([4, 4]), 2, 8, None)
    assert st.expected_steps == 1  # the general prepare this time
    monkeypatch.setattr(TS.TargetTreeStep, "cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    st.expect(ids, 0)
    assert st.expected is None
