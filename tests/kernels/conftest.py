"""Fixtures for the kernel tests (Triton interpreter on CPU).

The two settings below must be in place before torch/triton are imported:
``TRITON_INTERPRET=1`` selects the interpreter at decoration time, and an empty
``CUDA_VISIBLE_DEVICES`` keeps vLLM from swapping in its Triton placeholder.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import pathlib  # noqa: E402
import sys  # noqa: E402
import zipfile  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _shim import ensure_kernels_importable  # noqa: E402

ensure_kernels_importable()

VLLM_VERSION = "0.28.0"


def _extract_vllm_site(version: str = VLLM_VERSION) -> pathlib.Path:
    """Return a directory holding an importable ``vllm/`` package.

    ``DDTREE_VLLM_SITE`` wins. Otherwise the official wheel is taken from
    ``$DDTREE_PATCH_CACHE/wheels`` (default ``~/.cache/ddtree-patch``; ``vllm_wheels.wheel``
    downloads it if missing), and unzipped once into
    ``$DDTREE_PATCH_CACHE/site/<version>-full/`` (a marker file is written last).
    """
    env = os.environ.get("DDTREE_VLLM_SITE")
    if env:
        site = pathlib.Path(env)
        if not (site / "vllm" / "__init__.py").is_file():
            raise RuntimeError(f"DDTREE_VLLM_SITE={env} holds no vllm/ package")
        return site
    cache = pathlib.Path(os.environ.get("DDTREE_PATCH_CACHE", "~/.cache/ddtree-patch")).expanduser()
    site = cache / "site" / f"{version}-full"
    marker = site / ".ddtree-extracted"
    if marker.is_file():
        return site
    import vllm_wheels  # the wheel download and the cache's locks: the test processes share the cache

    with vllm_wheels._locked(f"site-vllm-{version}"):
        if not marker.is_file():
            whl = vllm_wheels.wheel(version)  # kept in $DDTREE_PATCH_CACHE/wheels, renamed in whole
            site.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(whl) as zf:
                zf.extractall(site)
            marker.write_text(f"{whl}\n")
    return site


@pytest.fixture(scope="session")
def vllm_rejection_sampler():
    """vLLM 0.28.0's ``vllm.v1.sample.rejection_sampler`` module (fails, not skips)."""
    if os.environ.get("DDTREE_SKIP_VLLM_IMPORT_TESTS") == "1":
        pytest.skip("DDTREE_SKIP_VLLM_IMPORT_TESTS=1")
    site = _extract_vllm_site()
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    try:
        import vllm.v1.sample.rejection_sampler as rs
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"cannot import vLLM {VLLM_VERSION} rejection_sampler from {site}: {exc!r}")
    return rs
