"""What the kernels' launch plans read from the device (shared by the builder and tree attention)."""

from __future__ import annotations

import torch

CPU_SM_COUNT = 132  # off CUDA (the interpreter, the AOT checks): an H200's / H100 SXM's SM count
_SM_COUNT: dict = {}


def sm_count(dev: torch.device) -> int:
    """Streaming multiprocessors of ``dev`` (cached per device index)."""
    if dev.type != "cuda":
        return CPU_SM_COUNT
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]
