"""Device index helpers of a verify step (no host synchronisation): one host-to-device transfer for
a step's index arrays (:func:`upload_many`) and the accepted rows of chain-verified requests
(:func:`chain_rows`)."""

from __future__ import annotations


def upload_many(device, arrays) -> list:
    """Host integer arrays on ``device`` as int64 1-D views of one staging buffer: on CUDA one
    pinned copy and one non-blocking host-to-device transfer (no sync) instead of one per array."""
    import numpy as np
    import torch

    parts = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
    host = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))
    if device.type == "cuda":
        dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host.to(device)
    return list(dev.split([p.size for p in parts]))


def chain_rows(root_rows, num_acc, W: int):
    """accepted_rows of chain-verified requests: root + 0..a, -1 after (device)."""
    import torch

    col = torch.arange(W, device=root_rows.device)
    rows = root_rows[:, None] + col[None, :]
    return torch.where(col[None, :] <= num_acc[:, None].to(col.dtype), rows, -1).to(torch.int32)
