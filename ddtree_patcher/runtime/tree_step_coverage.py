"""What the tree-shaped target step covers, and the refusals by name of what it does not
(``DDTreeNotReady``): the call-site ABI, whether this process's vLLM carries the sites (read from
its source files, no vLLM import: ``verify`` and the DDTree start-up check), the V2 runner's sites,
engine options (FULL graphs of mixed batches, KV connectors), torch.compile / PIECEWISE graphs on
vLLM 0.34.0's FlashAttention forward, and the per-layer options of an attention impl.

Torch-free and vLLM-free; :mod:`.tree_step` (the call sites' entry points and the per-runner state)
and :mod:`.ddtree` (the proposer's start-up) call it."""

from __future__ import annotations

import os
from pathlib import Path

from .contract import ENV_ENABLE, TREE_STEP_ABI, TREE_STEP_ATTR, abi_mismatch, mark

# The second stream pays where FA3's context pass leaves the GPU idle: measured on the H200 (Qwen3-8B
# attention shape, ctx 1K, in-graph): B = 1 saves 3-4.5 µs per layer, B = 8 is within +-1 µs, B = 32
# loses 2-9 µs (the context pass fills the GPU; the extra merge launch remains). FULL graphs are
# captured per padded batch size, so each capture takes the faster form.
STREAM_MAX_REQS = 8
ATTR = TREE_STEP_ATTR  # on the runner, and on the attention impls of the target layers
MARK = mark("ddtree-tree-step")
# Files that carry the call sites (relative to the directory holding the ``vllm`` package).
RUNNER_PY = "vllm/v1/worker/gpu_model_runner.py"
RUNNER_V2_PY = "vllm/v1/worker/gpu/model_runner.py"
V2_PREP_CALL = "prepare_v2("  # the V2 runner's tree-step site (execute_model) calls this
CPU_ATTN_PY = "vllm/v1/attention/backends/cpu_attn.py"
FLASH_ATTN_PY = "vllm/v1/attention/backends/flash_attn.py"
ATTN_FILES = (CPU_ATTN_PY, FLASH_ATTN_PY)  # a tree step needs the site of the backend it runs on
# attention impls whose forward can carry the site
COVERED_IMPLS = ("CPUAttentionBackendImpl", "FlashAttentionImpl")


class DDTreeNotReady(RuntimeError):
    """DDTree mode is refused where the tree-shaped target step (issue 13) is not installed or
    does not cover the configuration (runner, attention backend, layer options)."""


class TreeStepABIError(RuntimeError):
    pass


def not_ready(why: str) -> DDTreeNotReady:
    return DDTreeNotReady(
        "ddtree-patch: DDTREE_PATCH_ENABLE=1 is refused: the tree-shaped target step (issue 13; "
        f"ancestor-only attention, depth positions, KV compaction) does not cover this: {why}. Unset "
        f"{ENV_ENABLE} to run DFlash (chains).")


def check_abi(tree_step_abi: int) -> None:
    if tree_step_abi != TREE_STEP_ABI:
        raise TreeStepABIError(abi_mismatch("ddtree-tree-step", tree_step_abi, TREE_STEP_ABI))


def gpu_platform() -> bool:
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
    (default: asked of vLLM's platform, :func:`gpu_platform`): on a GPU the tree attention is
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
    gpu = gpu_platform() if gpu is None else gpu
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


def has_site(fn) -> bool:
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
        raise not_ready(f"the V2 model runner of this vLLM ({type(runner).__module__}; vLLM picked it, or "
                         "VLLM_USE_V2_MODEL_RUNNER=1): its tree-step sites are written for the V2 runner of vLLM "
                         "0.26.0-0.34.0 only; set VLLM_USE_V2_MODEL_RUNNER=0 (the V1 runner: 0.24.0-0.33.0)")
    refuse_uncovered_config(getattr(runner, "vllm_config", None))


def refuse_uncovered_config(vllm_config) -> None:
    """Engine-level options the tree step does not cover, refused by name when the DDTree drafter
    binds (engine start, before any graph capture; V2: the runner's construction): FULL CUDA graphs
    for mixed batches; a KV connector (offloading or transfer: it may save or load a block's KV
    before the walk's compaction moved it)."""
    refuse_full_cuda_graphs(getattr(vllm_config, "compilation_config", None))
    kvt = getattr(vllm_config, "kv_transfer_config", None)
    if kvt is not None:
        name = getattr(kvt, "kv_connector", None) or repr(kvt)
        raise not_ready(f"KV connector {name} (kv_transfer_config): "
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
        raise not_ready(
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

FA034_CALL = "_FA4_DENSE_ATTENTION_KERNEL("  # vLLM 0.30.0-0.34.0's FlashAttention forwards call FA through it
PIECEWISE_034_RECORD = "docs/runs/h100-ddtree-v2-0.34.0-2026-12-05.json"
COMPILED_034_NOTE = "docs/notebook/fa034-compiled-mixed.md"
FDONC_034_RECORD = "docs/runs/h100-ddtree-v2-0.34.0-2026-12-07.json"


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
    ``fa-0.34`` and ``fa-0.30`` sites) under torch.compile or any CUDA graph mode: mixed batches diverged
    from no speculation on GPUs (H100, PIECEWISE: 7/12, margins up to 1.0 nats; H200, FULL_DECODE_ONLY
    with torch.compile: the same five requests; H100, FULL_DECODE_ONLY without torch.compile: 7/12, four of
    the five), while eager mixed batches did not; cause not found yet (docs/notebook/fa034-compiled-mixed.md).
    The reason, or None (other forwards; compilation mode NONE with CUDA graph mode NONE: enforce_eager)."""
    mode = getattr(graph_config, "cudagraph_mode", None)
    graphs = mode is not None and getattr(mode, "name", str(mode)) != "NONE"
    compiled = _compiled(compilation_config)
    if not (graphs or compiled):
        return None
    import inspect

    try:
        src = inspect.getsource(type(impl).forward)
    except (OSError, TypeError):
        return None
    if FA034_CALL not in src:
        return None
    cmode = _compilation_mode(compilation_config)
    what = (f"CUDA graph mode {getattr(mode, 'name', mode)}" if graphs else
            f"torch.compile (compilation mode {getattr(cmode, 'name', None) or cmode})")
    return (f"{what} on this vLLM's FlashAttention forward ({FLASH_ATTN_PY}: FlashAttentionImpl.forward, vLLM "
            "0.34.0's shape): mixed batches diverged from "
            "no speculation in the tree step's GPU proofs with CUDA graphs or torch.compile (PIECEWISE graphs: "
            f"{PIECEWISE_034_RECORD}; FULL_DECODE_ONLY without torch.compile: {FDONC_034_RECORD}; with it: "
            f"{COMPILED_034_NOTE}); eager mixed batches did not. Start vLLM with enforce_eager=True")


def forward_has_site(impl) -> bool:
    return has_site(type(impl).forward)


def impl_refusal(impl) -> str | None:
    """Why an attention impl's layer options are not covered (None: covered): sliding window,
    softcap, ALiBi, sinks, a quantized KV cache, a non-decoder attention type."""
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
