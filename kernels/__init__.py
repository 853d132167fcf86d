"""DDTree tree-verification kernels (installed as ``ddtree_patcher.kernels``).

``tree_verify`` is the Triton implementation (``kernels/tree_verify.py``);
``tree_verify_ref`` is the plain-loop PyTorch reference (``kernels/reference.py``),
the executable spec. If Triton cannot be imported, ``tree_verify`` falls back to
the reference and ``TRITON_AVAILABLE`` is False (a warning says why).
"""

from __future__ import annotations

import warnings

from .reference import PLACEHOLDER_TOKEN_ID, tree_verify_ref

try:  # Triton is optional: CPU-only environments fall back to the reference.
    from .tree_verify import tree_verify  # noqa: F401

    TRITON_AVAILABLE = True
    TRITON_IMPORT_ERROR = None
except Exception as exc:  # pragma: no cover - exercised only without triton
    TRITON_AVAILABLE = False
    TRITON_IMPORT_ERROR = exc

    def tree_verify(*args, **kwargs):  # type: ignore[no-redef]
        warnings.warn(
            "ddtree_patcher.kernels: Triton could not be imported "
            f"({TRITON_IMPORT_ERROR!r}); using the slow PyTorch reference tree_verify_ref.",
            RuntimeWarning,
            stacklevel=2,
        )
        return tree_verify_ref(*args, **kwargs)


__all__ = ["tree_verify", "tree_verify_ref", "PLACEHOLDER_TOKEN_ID", "TRITON_AVAILABLE"]
