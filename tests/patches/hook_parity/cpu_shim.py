"""CPU stand-ins for the two CUDA-only *allocation* services V2's sampler states use (pinned host
memory and a UVA device view of it): on CPU the pinned buffer is an ordinary tensor and its
"device view" is itself. Nothing of the samplers' logic is replaced. Also the one libdevice
function V2's Gumbel sampling calls (``log1p``), which the Triton interpreter does not provide:
``log(1 + x)`` under the interpreter (both the pristine and the hooked path see the same one).
Call install() after torch and before the first vLLM V2 state is built."""
import torch
_zeros, _empty, _full, _tensor, _ones = torch.zeros, torch.empty, torch.full, torch.tensor, torch.ones
def _nopin(fn):
    def w(*a, **k):
        k.pop("pin_memory", None); return fn(*a, **k)
    return w
def install():
    if getattr(torch.zeros, "_ddtree_nopin", False):
        return
    torch.zeros, torch.empty, torch.full, torch.tensor, torch.ones = (
        _nopin(_zeros), _nopin(_empty), _nopin(_full), _nopin(_tensor), _nopin(_ones))
    torch.zeros._ddtree_nopin = True
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    import vllm.utils.platform_utils as pu, vllm.utils.torch_utils as tu
    pu.is_uva_available = lambda: True
    for name in ("get_accelerator_view_from_cpu_tensor", "get_cuda_view_from_cpu_tensor"):
        if hasattr(tu, name): setattr(tu, name, lambda t: t)
    import triton.language as tl
    import triton.language.extra.libdevice as ld

    ld.log1p = lambda x, *a, **k: tl.log(1.0 + x)
    pu.num_compute_units = lambda *a, **k: 2  # a hardware query (sizes Triton grids only)
    try:
        import vllm.v1.sample.ops.topk_topp_triton as tt

        tt.num_compute_units = pu.num_compute_units
    except ImportError:
        pass
    # On a CPU platform vLLM routes top-k/top-p to its Triton kernel, which the interpreter cannot
    # run; use vLLM's own PyTorch implementation of the same op instead (both paths see it).
    import inspect

    import vllm.v1.sample.ops.topk_topp_sampler as ts

    torch_impl = ts.apply_top_k_top_p_pytorch
    extra = {"allow_cpu_sync": True} if "allow_cpu_sync" in inspect.signature(torch_impl).parameters else {}
    ts.apply_top_k_top_p_triton = lambda logits, k, p, *a, **kw: torch_impl(logits, k, p, **extra)
    import vllm.v1.worker.gpu.buffer_utils as bu
    bu.is_uva_available = lambda: True
    for name in ("get_accelerator_view_from_cpu_tensor", "get_cuda_view_from_cpu_tensor"):
        if hasattr(bu, name): setattr(bu, name, lambda t: t)
