"""A CPU guard against host synchronisation in the hook's step functions.

Inside ``no_host_sync()``, the torch calls that synchronise with the device on CUDA
(``Tensor.item/tolist/cpu/numpy/nonzero/__bool__/__int__/__float__/__index__``,
``torch.nonzero``, ``torch.repeat_interleave``/``Tensor.repeat_interleave`` without
``output_size``, ``torch.tensor``/``as_tensor`` of a tensor, and boolean-mask indexing via
``Tensor.__getitem__``, and ``Tensor.__setitem__`` of a Python scalar: a blocking H2D copy on CUDA, found on the
H200) raise ``HostSyncError`` when they are called from a frame of
``ddtree_patcher`` (vLLM's own code and the Triton interpreter may still call them). On CPU
nothing synchronises, so this is what makes a sync added to the step visible in the CPU tests.
"""
from __future__ import annotations

import contextlib
import sys

import torch


class HostSyncError(RuntimeError):
    pass


OURS = ("ddtree_patcher/runtime/", "ddtree_patcher/kernels/tree_verify.py", "ddtree_patcher/kernels/_validate.py")
# functions of ours that read host memory only: the accounting's periodic log line reads CPU tensors on CPU and,
# on CUDA, a pinned copy whose event has landed (no wait; the GPU runs' SYNC_DEBUG checks that path). Guarded,
# its CPU branch failed a step whenever a slow machine let the log interval elapse inside one
HOST_ONLY = {("ddtree_patcher/runtime/accounting.py", "_maybe_log")}


def _ours() -> bool:
    code = sys._getframe(2).f_code
    name = code.co_filename.replace("\\", "/")
    if any(name.endswith(f) and code.co_name == fn for f, fn in HOST_ONLY):
        return False
    return any(part in name for part in OURS)


def _guard(name, orig, cond=None):
    def wrapped(*a, **k):
        if _ours() and (cond is None or cond(*a, **k)):
            raise HostSyncError(f"host synchronisation in the step: {name}")
        return orig(*a, **k)
    return wrapped


def _bool_index(self, idx, *a, **k):
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _scalar_value(self, idx, value, *a, **k):
    """``t[idx] = 1``: on CUDA the Python scalar is copied from a CPU tensor, a blocking copy."""
    return isinstance(value, (bool, int, float)) and self.device.type != "meta"


def _no_output_size(*a, **k):
    return "output_size" not in k and any(isinstance(x, torch.Tensor) for x in a[1:2])


@contextlib.contextmanager
def no_host_sync():
    T = torch.Tensor
    saved = []

    def patch(owner, attr, cond=None):
        orig = getattr(owner, attr)
        saved.append((owner, attr, orig))
        setattr(owner, attr, _guard(f"{getattr(owner, '__name__', owner)}.{attr}", orig, cond))

    for attr in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__"):
        patch(T, attr)
    patch(T, "__getitem__", _bool_index)
    patch(T, "__setitem__", _scalar_value)
    patch(T, "repeat_interleave", _no_output_size)
    patch(torch, "repeat_interleave", _no_output_size)
    patch(torch, "nonzero")
    patch(torch, "tensor", lambda data, *a, **k: isinstance(data, torch.Tensor) or (
        isinstance(data, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in data)))
    try:
        yield
    finally:
        for owner, attr, orig in reversed(saved):
            setattr(owner, attr, orig)
