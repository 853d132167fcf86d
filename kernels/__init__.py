"""DDTree kernels (installed as ``ddtree_patcher.kernels``).

``tree_verify`` is the Triton tree-verification kernel (``kernels/tree_verify.py``);
``tree_verify_ref`` is the plain-loop PyTorch reference (``kernels/reference.py``), the
executable spec. ``build_tree`` is the Triton DDTree tree builder (``kernels/build_tree.py``);
``build_tree_ref`` its heapq reference (``kernels/tree_reference.py``); both return a
``DraftTree``. If Triton cannot be imported, ``tree_verify`` and ``build_tree`` fall back to
their references and ``TRITON_AVAILABLE`` is False (a warning says why).
"""

from __future__ import annotations

import warnings

from .reference import PLACEHOLDER_TOKEN_ID, tree_verify_ref
from .tree_reference import DraftTree, build_tree_ref, unpack_ancestor_mask

try:  # Triton is optional: CPU-only environments fall back to the reference.
    from .build_tree import build_tree  # noqa: F401
    from .tree_verify import tree_verify  # noqa: F401

    TRITON_AVAILABLE = True
    TRITON_IMPORT_ERROR = None
except Exception as exc:  # pragma: no cover - exercised only without triton
    TRITON_AVAILABLE = False
    TRITON_IMPORT_ERROR = exc

    def _fallback_warning(ref_name: str) -> None:
        warnings.warn(
            "ddtree_patcher.kernels: Triton could not be imported "
            f"({TRITON_IMPORT_ERROR!r}); using the slow PyTorch reference {ref_name}.",
            RuntimeWarning,
            stacklevel=3,
        )

    def tree_verify(*args, **kwargs):  # type: ignore[no-redef]
        _fallback_warning("tree_verify_ref")
        return tree_verify_ref(*args, **kwargs)

    def build_tree(*args, **kwargs):  # type: ignore[no-redef]
        _fallback_warning("build_tree_ref")
        return build_tree_ref(*args, **kwargs)


__all__ = ["tree_verify", "tree_verify_ref", "build_tree", "build_tree_ref", "DraftTree",
           "unpack_ancestor_mask", "PLACEHOLDER_TOKEN_ID", "TRITON_AVAILABLE"]
