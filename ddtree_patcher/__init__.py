"""ddtree-patch: versioned, reversible source rewrites for an installed vLLM."""

import os as _os

__version__ = "0.1.0"

# Installed, the repository's patches/ and kernels/ folders are the subpackages
# ddtree_patcher.patches and ddtree_patcher.kernels (pyproject.toml maps them). In a source
# checkout they sit beside this folder instead; let the same import names work there too
# (tests, `PYTHONPATH=<checkout>` on a GPU host), without ever adding a top-level name.
_here = _os.path.dirname(_os.path.realpath(__file__))  # (a link to the checkout's folder: the checkout)
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "patches")) and all(
    _os.path.exists(_os.path.join(_root, p)) for p in ("pyproject.toml", "patches/__init__.py", "kernels/__init__.py")
):
    __path__.append(_root)  # noqa: F821 - the package's own __path__
