"""DDTree kernels (installed as ``ddtree_patcher.kernels``).

``tree_verify`` is the Triton tree-verification kernel (``kernels/tree_verify.py``);
``tree_verify_ref`` is the plain-loop PyTorch reference (``kernels/reference.py``), the
executable spec. ``build_tree`` is the Triton DDTree tree builder (``kernels/build_tree.py``);
``build_tree_ref`` its heapq reference (``kernels/tree_reference.py``); both return a
``DraftTree``. If Triton cannot be imported, ``tree_verify`` and ``build_tree`` fall back to
their references and ``TRITON_AVAILABLE`` is False (a warning says why).

The tree-shaped target step (docs/tree-step.md): ``tree_attention`` (context + tree in one
kernel), ``tree_attention_merge`` (the tree pass merged with a FlashAttention context pass),
``KVCompactor`` / ``compact_kv`` (target KV moved along the accepted path), ``RowGatherer`` /
``gather_accepted_rows`` (drafter hidden rows + linear positions), ``kv_views`` /
``packed_kv_view`` (per-release cache layouts as views); references in
``kernels/tree_step_reference.py`` (also used without Triton).
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

# ---- tree-shaped target step (issue 13) ----
from .tree_step_reference import (  # noqa: E402
    ancestor_rows_ref,
    causal_attention_ref,
    compact_kv_ref,
    context_attention_ref,
    gather_accepted_rows_ref,
    tree_attention_ref,
)

if TRITON_AVAILABLE:
    from .kv_compact import (  # noqa: E402,F401
        KVCompactor,
        RowGatherer,
        compact_kv,
        gather_accepted_rows,
        kv_views,
        packed_kv_view,
    )
    from .tree_attention import (  # noqa: E402,F401
        ancestor_rows,
        merge_attention_states,
        tree_attention,
        tree_attention_dims,
        tree_attention_merge,
    )
else:  # pragma: no cover - exercised only without triton
    def _no_triton(name):
        def fn(*args, **kwargs):
            raise RuntimeError(f"ddtree_patcher.kernels.{name} needs Triton, which could not be "
                               f"imported ({TRITON_IMPORT_ERROR!r}); the PyTorch references in "
                               "ddtree_patcher.kernels.tree_step_reference run without it")
        return fn

    tree_attention = _no_triton("tree_attention")
    ancestor_rows = _no_triton("ancestor_rows")
    tree_attention_merge = _no_triton("tree_attention_merge")
    tree_attention_dims = _no_triton("tree_attention_dims")
    merge_attention_states = _no_triton("merge_attention_states")
    compact_kv = _no_triton("compact_kv")
    gather_accepted_rows = _no_triton("gather_accepted_rows")
    KVCompactor = _no_triton("KVCompactor")
    RowGatherer = _no_triton("RowGatherer")
    kv_views = _no_triton("kv_views")
    packed_kv_view = _no_triton("packed_kv_view")

__all__ += ["ancestor_rows", "ancestor_rows_ref", "merge_attention_states", "tree_attention", "tree_attention_dims", "tree_attention_merge", "tree_attention_ref", "context_attention_ref",
            "causal_attention_ref", "KVCompactor", "compact_kv", "compact_kv_ref", "RowGatherer",
            "gather_accepted_rows", "gather_accepted_rows_ref", "kv_views", "packed_kv_view"]
