"""The tree-shaped target step on the V1 and V2 runners (issue 13): the runtime the ddtree-tree-step call
sites call (``patches/ddtree_tree_step.py``; ``docs/patches/ddtree-tree-step.md``; the design is
``docs/tree-step.md``).

Importing this module imports neither torch nor vLLM (``verify`` and the DDTree start-up check
read :data:`TREE_STEP_ABI` and :func:`not_installed_reason`); the device work imports torch lazily.

A DDTree verify step scores, per request, the tree the DDTree proposer attached to the runner's
``VerifyStep`` (``hook.verify_step(runner)``): row 0 is the root (the last verified token), rows
1..n the nodes in node order. Four things make the target's forward and the engine's state
right for that tree:

1. **Depth positions** (:meth:`TargetTreeStep.prepare`, in ``_prepare_inputs`` right after the
   slot mapping is computed from linear positions): ``positions[root + j] = positions[root] +
   depth(j)``; KV slots stay one per node (node j at linear position ``ctx + j``).
2. **Ancestor-only attention**: the rows of tree requests attend with the ancestor mask (whole
   context + ancestors + itself). CPU_ATTN (:meth:`TargetTreeStep.attention`, right after the
   backend's own call; its op takes no mask): those rows are recomputed with the explicit
   ``[q_len, ctx + q_len]`` mask on the backend's measured paged KV views (the reference math of
   ``ddtree_patcher.kernels``). FlashAttention 3 (:meth:`TargetTreeStep.fa_attention`, right
   *before* the forward's own causal call, which it replaces in a tree step): the forward's
   ``flash_attn_varlen_func`` over the context only (``causal=False``, ``seqused_k = ctx``,
   ``return_softmax_lse``), then ``tree_attention_merge`` (Triton) adds the tree keys to that
   softmax state. When every request of the step is a tree request (the steady state) that is
   the layer's only FlashAttention call; otherwise the causal call runs first, for the rows of
   the other requests, with the arguments the forward passes for the configurations DDTree
   admits.
3. **KV compaction** (:meth:`TargetTreeStep.after_walk`, called by ``VerifyStep.keep`` right after
   the tree walk, before the drafter and before the next step): for every target layer of every
   KV-cache group, the KV of the node accepted at depth d (slot of ``ctx + j_d``) moves to the
   slot of ``ctx + d``; vLLM's bookkeeping (accepted = first a + 1 query tokens) is then true.
4. **Drafter rows** (:meth:`TargetTreeStep.drafter_rows`, in ``propose_draft_token_ids`` before
   the drafter runs): the drafter's context hidden rows gathered along the accepted path
   (``hidden[root + d] = hidden[root + j_d]``) and the tree rows' positions linear again, so
   DFlash sees the accepted path and its context-KV writes land on distinct slots.

The V2 runner (vLLM 0.26.0-0.34.0's shapes) runs the same four pieces from its own sites:
:meth:`TargetTreeStep.prepare_v2` in ``execute_model`` right after ``prepare_attn`` (slots from
linear positions; positions are ``input_batch.positions``, the FULL graphs' input buffer), the
same attention and the same compaction (the slots are the step's ``slot_mappings``, read before
DFlash's ``propose`` rewrites that buffer), and :meth:`TargetTreeStep.drafter_rows_v2` at the top
of ``DFlashSpeculator.propose`` (the aux hidden states along the accepted path, positions linear).

Start-up (:func:`bind`: at ``capture_model`` through :func:`before_capture` when CUDA graphs are
captured, else at the runner's first ``_prepare_inputs`` / ``execute_model``, with
``DDTREE_PATCH_ENABLE`` set) refuses by name (``DDTreeNotReady``) what the tree step does not
cover: a V2 runner without the V2 sites (0.24.0, 0.25.0: :func:`check_v2_runner`),
an attention backend other than CPU_ATTN / FlashAttention 3 (with this patch's forward site),
FULL CUDA graphs of mixed batches (``cudagraph_mode`` FULL; FULL decode graphs are captured with
the tree attention on persistent mask buffers, every uniform decode step a tree step: see
``docs/tree-step.md``), decode context parallelism, sliding window, softcap, ALiBi, sinks, a quantized KV cache,
non-attention (Mamba/GDN) KV-cache groups, M-RoPE / XD-RoPE, encoder-decoder. Cascade attention
is switched off (logged). On CUDA every per-step operation is a device operation (no host
synchronisation; measured on the H200).

Where each concern lives: what is covered and every refusal, :mod:`.tree_step_coverage`; the step
plan (1), :mod:`.tree_plan`; the attention (2), :mod:`.tree_attention_step`; the compaction and the
drafter rows (3, 4), :mod:`.tree_compaction`. This module holds the call sites' entry points
(:func:`bind`, :func:`before_capture`, :func:`check_v2_runner`, :func:`live`) and
:class:`TargetTreeStep`'s start-up (layer binding, graph buffers, counters).
"""

from __future__ import annotations

from __future__ import annotations

import logging

from .switches import ENV_TREE_STREAM, switch  # TREE_STREAM=0: no second stream for the tree pass in FULL graphs (A/B)
from .tree_attention_step import FAStep, TreeAttention, cpu_kv_views  # noqa: F401 - the call sites' and tests' names
from .tree_compaction import AcceptedPath, moved_depths  # noqa: F401
from .tree_plan import TreePlan, pack_rows, plan_rows  # noqa: F401
from .tree_step_coverage import (  # noqa: F401 - re-exported: the names verify, the call sites and the tests use
    ATTN_FILES, ATTR, COMPILED_034_NOTE, COVERED_IMPLS, FDONC_034_RECORD, CPU_ATTN_PY, FA034_CALL, FLASH_ATTN_PY, MARK,
    PIECEWISE_034_RECORD, RUNNER_PY, RUNNER_V2_PY, STREAM_MAX_REQS, TREE_STEP_ABI, V2_PREP_CALL, DDTreeNotReady,
    TreeStepABIError, check_abi, check_v2_runner, forward_has_site, full_decode_graphs, has_site, impl_refusal,
    not_installed_reason, not_ready, refuse_compiled_fa034, refuse_full_cuda_graphs, refuse_uncovered_config,
)

logger = logging.getLogger("vllm.ddtree_patch")


def bind(runner, *, tree_step_abi: int) -> "TargetTreeStep":
    """Called by the ``_prepare_inputs`` (V1) / ``execute_model`` (V2) call site once per runner
    when DDTree is on, or by :func:`before_capture` (the KV caches are bound by then): check what
    the tree step covers, bind the target layers."""
    check_abi(tree_step_abi)
    step = TargetTreeStep(runner)
    runner.__dict__[ATTR] = step
    return step


def before_capture(runner, *, tree_step_abi: int) -> None:
    """Called by the ``capture_model`` call site (after its ``cudagraph_mode == NONE`` return)
    when DDTree is on: the DFlash drafter's query buffers grow to the capture size its batches pad
    to (``ddtree.fit_query_buffers``), and the tree step binds now (the KV caches exist), before
    any graph is captured, so that FULL decode graphs capture the tree attention
    (:meth:`TargetTreeStep.before_capture`)."""
    check_abi(tree_step_abi)
    from .ddtree import fit_query_buffers

    fit_query_buffers(getattr(runner, "drafter", None), getattr(runner, "compilation_config", None))  # V1
    step = runner.__dict__.get(ATTR)
    if step is not None and step.stale(runner):
        # vLLM 0.30.0+ estimates CUDA graph memory by a throwaway capture against a minimal KV cache before the
        # real one exists (gpu_worker: profile_cudagraph_memory -> capture_model(profile_only=True)), then frees
        # that cache and the graph manager: a step bound then holds the freed cache's views and pointer tables
        logger.info("ddtree-patch: the KV caches or the graph manager changed since the tree step bound (vLLM's "
                    "capture-memory profiling): binding again")
        step = None
    if step is None:
        step = bind(runner, tree_step_abi=tree_step_abi)
    step.before_capture()


class TargetTreeStep(TreePlan, TreeAttention, AcceptedPath):
    """Per-runner state of the tree-shaped target step (persistent across steps)."""

    v2 = False  # the V2 runner (set in __init__; a step made with __new__ is V1's)
    # FULL decode graphs of at most STREAM_MAX_REQS requests: the tree pass runs on this stream beside
    # FA3's context pass (captured as a fork and a join), then merge_attention_states; otherwise (and
    # None): the tree pass after the context pass, the merge fused (tree_attention_merge), as in eager
    # and PIECEWISE steps
    side_stream = None

    def __init__(self, runner):
        import torch

        from . import hook

        self.v2 = hasattr(runner, "req_states") or type(runner).__module__.endswith(".gpu.model_runner")
        self.runner = runner
        self.device = torch.device(getattr(runner, "device", "cpu"))
        self.hook = hook.verify_step(runner)
        if self.hook is None:
            raise not_ready("the tree-walk hook is not active in this process (DDTREE_PATCH_ENABLE unset)")
        if self.hook.chain_as_tree:
            raise not_ready("DDTREE_PATCH_CHAIN_AS_TREE=1 verifies chains")
        if (getattr(runner, "uses_mrope", False) or getattr(runner, "uses_xdrope_dim", 0)
                or getattr(getattr(runner, "model_config", None), "uses_mrope", False)):
            raise not_ready("M-RoPE / XD-RoPE target (positions are not one row per token)")
        if getattr(getattr(runner, "model_config", None), "is_encoder_decoder", False):
            raise not_ready("encoder-decoder target")
        # the graph mode in force: V2 resolves it into its graph manager
        self.graph_config = (getattr(runner, "cudagraph_manager", None) if self.v2 else None) or \
            getattr(runner, "compilation_config", None)
        self.compilation_config = getattr(runner, "compilation_config", None)
        if self.cuda:
            refuse_full_cuda_graphs(self.graph_config)
        self.speculator = None
        if self.v2:
            spec = getattr(runner, "speculator", None)
            if spec is None or not has_site(type(spec).propose):
                raise not_ready(f"V2 speculator {type(spec).__name__} without the tree step's propose site "
                                 "(DFlashSpeculator of vLLM 0.26.0-0.34.0)")
            self.speculator = spec
        self._init_state()
        self.groups = self._bind_layers(runner)  # [(gid, [K/V views (nb, bs, H, X)])]
        self.graph_bufs = None
        if self.cuda and full_decode_graphs(self.graph_config):
            if self.fa_varlen is None:
                raise not_ready(f"FULL CUDA graphs for decode batches on {self.backend} (the tree step captures "
                                 "FlashAttention 3's path only): use PIECEWISE or enforce_eager=True")
            self._init_graph_buffers(runner)
            if switch(ENV_TREE_STREAM):
                self.side_stream = torch.cuda.Stream(device=self.device)
        self.compactors = None
        if self.cuda:  # one Triton launch per group and step, pointer tables built once here
            from ddtree_patcher.kernels import KVCompactor

            self.compactors = [(gid, KVCompactor(views)) for gid, views in self.groups]
        if getattr(runner, "cascade_attn_enabled", False):
            runner.cascade_attn_enabled = False  # cascade attention runs another FA call: no tree pass
            logger.warning("ddtree-patch: cascade attention disabled for DDTree (tree steps need the "
                           "non-cascade attention path)")
        self.hook.post_walk = self.after_walk
        self.hook.on_attach = self.expect
        if self.speculator is not None:
            self.speculator.__dict__[ATTR] = self  # its propose site (drafter_rows_v2)
        logger.warning("ddtree-patch: tree-shaped target step active (%s %s, %d target layers in %d KV-cache "
                       "group(s), %s tree attention, KV compaction after the walk%s)",
                       "V2" if self.v2 else "V1", type(runner).__name__, self.num_layers, len(self.groups), self.backend,
                       ", FULL decode CUDA graphs: every uniform decode step is a tree step" if self.graph_bufs
                       else "")

    def _init_graph_buffers(self, runner) -> None:
        """FULL decode graphs replay the tree attention at captured addresses: the ancestor bit
        rows and the request mask live in buffers made here, written in place by :meth:`prepare`
        in every uniform decode step (vLLM's FULL-graph batches: every request ``1 + N`` rows).
        Rows start as chains with every request on (causal attention: what the warm-up and
        capture runs compute)."""
        import torch

        from ddtree_patcher.kernels import ancestor_rows

        Q = int(getattr(runner, "uniform_decode_query_len", 0) or getattr(runner, "decode_query_len", 0) or 0)
        if Q < 2:
            raise not_ready(f"uniform decode query length {Q} (no speculative tokens)")
        cap = getattr(runner.compilation_config, "max_cudagraph_capture_size", None) or 0
        rows = max(int(getattr(runner, "max_num_reqs", 0) or 0), int(cap))
        chain = torch.arange(-1, Q - 1, dtype=torch.int64, device=self.device).expand(rows, Q).contiguous()
        anc, _ = ancestor_rows(chain)
        self.graph_bufs = (anc, torch.ones(rows, dtype=torch.bool, device=self.device), Q)

    def stale(self, runner) -> bool:
        """Whether what the step bound is gone: a bound layer's KV cache is another tensor now (or none), or
        V2's graph manager was replaced (the step keeps the one it bound as its graph config)."""
        for layer, bound in getattr(self, "kv_bound", ()):  # (the new cache may reuse the old address)
            kv = _layer_kv(layer)
            if kv is None or not hasattr(kv, "data_ptr") or kv.numel() == 0 or _kv_key(kv) != bound:
                return True
        mgr = getattr(runner, "cudagraph_manager", None)
        return bool(self.v2 and mgr is not None and self.graph_config is not mgr)

    def before_capture(self) -> None:
        """``capture_model`` is about to warm up and capture: until the first real step
        (:meth:`prepare`), FlashAttention forwards of uniform decode shape take the graph path
        (context pass + merge on the persistent buffers; no Python decision that a replay could
        not repeat)."""
        if self.graph_bufs is not None:
            self.capturing = True

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def _init_state(self) -> None:
        self.impl_views = {}  # id(attention impl) -> its layer's measured (K, V) views (CPU_ATTN)
        self.fa_varlen = None  # FlashAttention's flash_attn_varlen_func (the forward's own), FA3 path
        self.fa_step: FAStep | None = None  # made by the step's first FA3 layer (tree_attention_step)
        self.all_tree = False  # every request of the step is a tree request with exactly its tree's rows
        self.graph_step = False  # this step's tree metadata is in graph_bufs (a uniform decode step)
        self.capturing = False  # between before_capture() and the first prepare()
        self.backend = None  # "CPU_ATTN" | "FLASH_ATTN (FA3)"
        self.num_layers = 0
        self.slot_mappings = None  # V2: the step's slot ids [groups, T_padded] (prepare_attn's)
        self.root_ext = None  # int64 [B + 1]: each request's root row (then T): the compaction's row base
        self.acc_eff = None  # int32 [B]: accepted depth of tree requests, 0 elsewhere (CUDA path)
        self.acc_rows = None  # the walk's accepted rows [B, W] (CUDA path)
        self._row_gatherer = None  # (tensors' key, RowGatherer): _gatherer
        self.dev_counts = None  # int64 [1 + W] on the device: moved rows, then the accepted-length histogram
        # this step's plan (set by prepare, consumed by attention / after_walk / drafter_rows)
        self.active = False
        self.B = 0
        self.T = 0
        self.req_mask = None  # bool [B]: requests scored as trees
        self.ancestor_mask = None  # int32 [B, W, NW] (DraftTree.ancestor_mask layout)
        self.tree_rows = None  # int64 [R]: query rows of the tree requests (root and nodes)
        self.root_rows = None  # int64 [B]: query row of each request's root
        self.node_rows = None  # int64 [M]: query rows of the nodes (j >= 1) of tree requests
        self.node_root = None  # int64 [M]: their roots' rows
        self.node_index = None  # int64 [M]: their local index j
        self.moves = None  # (src rows, dst rows) of the accepted path, after the walk
        self.expected = None  # (req ids, attachment, its index, bit rows, depths): expect(), for the next prepare
        self._uniform = {}  # (B, W) -> index tensors of a uniform step (every request 1 + n rows, all trees)
        # counters (host)
        self.tree_steps = 0  # steps with at least one tree request
        self.graph_steps = 0  # uniform decode steps prepared for FULL decode graphs (trees or chains)
        self.tree_requests = 0  # requests scored as trees
        self.expected_steps = 0  # steps prepared from expect()'s look-ahead (no index upload, no launch)
        self.attention_calls = 0  # layer forwards that ran the tree attention
        self.compactions = 0  # steps whose accepted paths were compacted
        self.moved_rows = 0  # accepted depths whose node was not the chain's (j_d != d): KV rows moved
        self.accepted_depths: dict[int, int] = {}  # accepted length a -> requests (tree requests)

    # ---- start-up ---------------------------------------------------------------------------
    def _bind_layers(self, runner):
        cfg = getattr(runner, "kv_cache_config", None)
        if cfg is None:
            raise not_ready("the runner has no KV-cache config (KV caches not initialised)")
        ctx = runner.compilation_config.static_forward_context
        drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
        draft_names = set(getattr(drafter, "_draft_attn_layer_names", None)
                          or getattr(drafter, "draft_attn_layer_names", None) or ())
        groups = []
        seen = set()
        self.kv_bound = []  # (layer, (its KV cache's data_ptr, shape)) of every bound layer: stale()
        for gid, group in enumerate(cfg.kv_cache_groups):
            spec = group.kv_cache_spec
            kind = type(spec).__name__
            if kind not in ("FullAttentionSpec",):
                targets = [n for n in group.layer_names if n not in draft_names]
                if not targets:
                    continue
                raise not_ready(f"KV-cache group {gid} ({kind}: {targets[:3]}...): only full-attention "
                                 "KV is compacted (hybrid, sliding-window or recurrent targets are refused)")
            views = []
            for name in group.layer_names:
                if name in draft_names:
                    continue
                layer = ctx[name]
                impl = getattr(layer, "impl", None)
                iname = type(impl).__name__
                if iname not in COVERED_IMPLS or not forward_has_site(impl):
                    raise not_ready(
                        f"layer {name}: this vLLM's FlashAttention forward has no tree-step site (it is written "
                        "for the forwards of vLLM 0.26.0-0.27.0 and 0.34.0)" if iname == "FlashAttentionImpl" else
                        f"attention backend {iname} of layer {name} (covered: CPU_ATTN and FlashAttention 3, with "
                        "this patch's forward site)")
                why = impl_refusal(impl)
                if why:
                    raise not_ready(f"layer {name}: {why}")
                kv = _layer_kv(layer)
                if iname == "FlashAttentionImpl":
                    layer_views = self._fa_views(impl, kv, name)
                    backend = "FLASH_ATTN (FA3)"
                else:
                    # the ISA: the impl's (0.24.0-0.28.0) or, from 0.29.0, the layer's (set by the builder)
                    k, v = cpu_kv_views(impl, kv, getattr(impl, "isa", None) or getattr(layer, "isa", None))
                    self.impl_views[id(impl)] = (k, v)
                    layer_views = [k, v]
                    backend = "CPU_ATTN"
                if self.backend not in (None, backend):
                    raise not_ready(f"layers on two attention backends ({self.backend}, {backend})")
                self.backend = backend
                impl.__dict__[ATTR] = self
                self.kv_bound.append((layer, _kv_key(kv)))
                self.num_layers += 1
                if kv.data_ptr() in seen:  # a layer sharing another's KV (KV sharing): moved once
                    continue
                seen.add(kv.data_ptr())
                views.extend(layer_views)
            if views:
                groups.append((gid, views))
        if not groups:
            raise not_ready("no target attention layer found")
        return groups

    def _fa_views(self, impl, kv, name):
        """FlashAttention 0.26+: the layer cache is logical ``(nb, H, bs, 2D)`` (any stride order);
        ``kv.transpose(1, 2)`` = ``(nb, bs, H, 2D)`` moves K and V of a token together."""
        version = getattr(impl, "vllm_flash_attn_version", None)
        if version != 3:
            raise not_ready(f"layer {name}: FlashAttention version {version} (the tree step's context pass "
                             "calls FA3's flash_attn_varlen_func with return_softmax_lse)")
        if getattr(impl, "dcp_world_size", 1) > 1:
            raise not_ready(f"layer {name}: decode context parallelism (dcp_world_size {impl.dcp_world_size})")
        if kv.ndim != 4 or kv.shape[1] != impl.num_kv_heads or kv.shape[3] != 2 * impl.head_size:
            raise not_ready(f"layer {name}: KV cache of shape {tuple(kv.shape)}, expected the FlashAttention "
                             f"(num_blocks, {impl.num_kv_heads}, block_size, {2 * impl.head_size}) layout")
        if impl.head_size > 256 or impl.head_size % 8:
            raise not_ready(f"layer {name}: head size {impl.head_size}")
        why = refuse_compiled_fa034(self.graph_config, getattr(self, "compilation_config", None), impl)
        if why:
            raise not_ready(why)
        import sys

        self.fa_varlen = getattr(sys.modules[type(impl).__module__], "flash_attn_varlen_func")
        return [kv.transpose(1, 2)]

    def counters(self) -> dict:
        if self.dev_counts is not None:  # CUDA: fold the device counters in (a sync: not in a step)
            c = self.dev_counts.tolist()
            self.dev_counts = None
            self.moved_rows += c[0]
            for a, n in enumerate(c[1:]):
                if n:
                    self.accepted_depths[a] = self.accepted_depths.get(a, 0) + n
        return {"tree_steps": self.tree_steps, "tree_requests": self.tree_requests, "graph_steps": self.graph_steps,
                "expected_steps": self.expected_steps,
                "attention_calls": self.attention_calls, "compactions": self.compactions,
                "moved_rows": self.moved_rows,
                "accepted_depths": dict(sorted(self.accepted_depths.items()))}


def _layer_kv(layer):
    """A layer's KV cache tensor (V1 keeps one per virtual engine: the first), or None (none, or cleared)."""
    kv = getattr(layer, "kv_cache", None)
    if isinstance(kv, (list, tuple)):
        kv = kv[0] if kv else None
    return kv


def _kv_key(kv) -> tuple:
    """What identifies a bound KV cache for :meth:`TargetTreeStep.stale`: its address and shape."""
    return kv.data_ptr(), tuple(kv.shape)


def live(runner) -> "TargetTreeStep | None":
    return runner.__dict__.get(ATTR) or None
