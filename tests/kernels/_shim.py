"""Make ``ddtree_patcher.kernels`` importable from a plain checkout.

Until the package is installed (editable), ``kernels/`` is loaded from the
repository under the name ``ddtree_patcher.kernels``.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
import types

REPO = pathlib.Path(__file__).resolve().parents[2]


def ensure_kernels_importable():
    try:
        return importlib.import_module("ddtree_patcher.kernels")
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "ddtree_patcher.kernels" or m.startswith("ddtree_patcher.kernels.")]:
        del sys.modules[name]
    try:
        parent = importlib.import_module("ddtree_patcher")
    except ImportError:
        parent = types.ModuleType("ddtree_patcher")
        parent.__path__ = []  # namespace-like placeholder
        sys.modules["ddtree_patcher"] = parent
    kdir = REPO / "kernels"
    spec = importlib.util.spec_from_file_location(
        "ddtree_patcher.kernels", kdir / "__init__.py", submodule_search_locations=[str(kdir)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ddtree_patcher.kernels"] = mod
    spec.loader.exec_module(mod)
    parent.kernels = mod
    return mod
