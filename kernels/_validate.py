"""Argument checks shared by ``tree_verify`` and ``tree_verify_ref``.

Two levels:

* ``validate=True`` (default): metadata only -- ndim, shape, dtype, device,
  contiguity. Never reads tensor data, so it never synchronises with the GPU.
* ``check_data=True``: also reads the data (cu monotone and consistent with the
  number of draft tokens, parent ordering ``0 <= p < j``, token ids ``< V``,
  ``n_r <= max_num_nodes``). This copies small tensors to the host, i.e. it
  synchronises. ``tree_verify`` defaults it to True for CPU tensors and False for
  CUDA tensors; the reference always checks.

Without ``check_data`` an invalid node (parent outside ``[0, j-1]``, negative
token) is treated as unreachable (docs/kernel.md, GREEDY: padding and invalid nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_INT = (torch.int32, torch.int64)
_FLOAT = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass
class Checked:
    batch_size: int
    num_draft_tokens: int
    num_rows: int
    width: int
    vocab_size: int
    max_num_nodes: int
    is_greedy: torch.Tensor
    all_greedy: bool
    all_sampled: bool


def _err(name: str, msg: str) -> ValueError:
    return ValueError(f"tree_verify: argument `{name}` {msg}")


def _check_tensor(name, t, ndim, dtypes, device, shape=None):
    if not isinstance(t, torch.Tensor):
        raise _err(name, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise _err(name, f"must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise _err(name, f"must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != device:
        raise _err(name, f"must be on {device}, got {t.device}")
    if not t.is_contiguous():
        raise _err(name, "must be contiguous")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise _err(name, f"must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_inputs(
    draft_token_ids, draft_parent_ids, cu_num_draft_tokens,
    target_argmax, target_probs, is_greedy, coins, inv_exp_noise,
    draft_probs, width, seeds, positions, max_num_nodes,
    *, validate: bool = True, check_data: bool = False,
) -> Checked:
    dev = draft_token_ids.device if isinstance(draft_token_ids, torch.Tensor) else None
    if validate:
        _check_tensor("draft_token_ids", draft_token_ids, 1, _INT, dev)
        _check_tensor("draft_parent_ids", draft_parent_ids, 1, _INT, dev,
                      shape=draft_token_ids.shape)
        _check_tensor("cu_num_draft_tokens", cu_num_draft_tokens, 1, _INT, dev)
    B = int(cu_num_draft_tokens.shape[0])
    ND = int(draft_token_ids.shape[0])
    T = ND + B
    if target_argmax is None and target_probs is None:
        raise _err("target_argmax", "and `target_probs` cannot both be None")
    if validate:
        if target_argmax is not None:
            _check_tensor("target_argmax", target_argmax, 1, _INT, dev, shape=(T,))
        if target_probs is not None:
            _check_tensor("target_probs", target_probs, 2, _FLOAT, dev)
            if target_probs.shape[0] != T:
                raise _err("target_probs", f"must have {T} rows (num_draft_tokens + batch_size), "
                           f"got {target_probs.shape[0]}")
        if is_greedy is not None:
            _check_tensor("is_greedy", is_greedy, 1, (torch.bool,), dev, shape=(B,))
    V = int(target_probs.shape[1]) if target_probs is not None else 0
    if validate:
        if coins is not None:
            _check_tensor("coins", coins, 1, (torch.float32, torch.float64), dev, shape=(T,))
        if inv_exp_noise is not None:
            _check_tensor("inv_exp_noise", inv_exp_noise, 2, (torch.float32,), dev, shape=(B, V))
        if draft_probs is not None:
            _check_tensor("draft_probs", draft_probs, 2, _FLOAT, dev, shape=(ND, V))
        if seeds is not None:
            _check_tensor("seeds", seeds, 1, _INT, dev, shape=(B,))
        if positions is not None:
            _check_tensor("positions", positions, 1, _INT, dev, shape=(B,))
    if (coins is None) != (inv_exp_noise is None):
        raise _err("coins", "and `inv_exp_noise` must be given together (or both None)")
    if seeds is not None and coins is not None:
        raise _err("seeds", "cannot be combined with explicit `coins`/`inv_exp_noise`")

    if is_greedy is None:
        all_greedy = target_probs is None
        all_sampled = not all_greedy
    else:
        all_greedy = all_sampled = False
        if target_probs is None:
            raise _err("target_probs", "is required when `is_greedy` is given "
                       "(use is_greedy=None for an all-greedy batch)")
    if draft_probs is not None and target_probs is None:
        raise _err("draft_probs", "needs `target_probs`")

    need_n = width is None or max_num_nodes is None
    max_n = None
    if need_n or check_data:
        cu_h = cu_num_draft_tokens.detach().to("cpu", torch.int64)  # host sync
        starts = torch.cat([cu_h.new_zeros(1), cu_h[:-1]]) if B else cu_h
        n = cu_h - starts
        max_n = int(n.max()) if B else 0
    if width is None:
        width = max_n + 1
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise _err("width", f"must be a positive int, got {width!r}")
    if max_num_nodes is None:
        max_num_nodes = max_n
    if not isinstance(max_num_nodes, int) or max_num_nodes < 0:
        raise _err("max_num_nodes", f"must be a non-negative int, got {max_num_nodes!r}")

    if check_data and B:
        if bool((n < 0).any()):
            raise _err("cu_num_draft_tokens", "must be non-decreasing (an inclusive cumsum)")
        if int(cu_h[-1]) != ND:
            raise _err("cu_num_draft_tokens", f"last entry must equal len(draft_token_ids)={ND}, "
                       f"got {int(cu_h[-1])}")
        if max_n > max_num_nodes:
            raise _err("max_num_nodes", f"is {max_num_nodes} but a request has {max_n} nodes")
        if ND:
            req = torch.repeat_interleave(torch.arange(B), n)
            j = torch.arange(ND) - starts[req] + 1  # local index 1..n_r
            par = draft_parent_ids.detach().to("cpu", torch.int64)
            bad = (par < 0) | (par >= j)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                raise _err("draft_parent_ids", f"must hold the local parent index p with 0 <= p < j "
                           f"(parents before children); flat index {i} (request {int(req[i])}, "
                           f"node j={int(j[i])}) has parent {int(par[i])}")
            tok = draft_token_ids.detach().to("cpu", torch.int64)
            if bool((tok < -1).any()):
                raise _err("draft_token_ids", "must be >= 0, or -1 for an inert padding node")
            if V and bool((tok >= V).any()):
                raise _err("draft_token_ids", f"must be < vocab size {V}")
        if target_argmax is not None and T:
            am = target_argmax.detach().to("cpu", torch.int64)
            if bool((am < 0).any()):
                raise _err("target_argmax", "must be >= 0")

    return Checked(B, ND, T, width, V, max_num_nodes, is_greedy, all_greedy, all_sampled)
