"""A whole-wheel vLLM site for import tests that costs no copy of the ~800 MB wheel.

``overlay_site(dest, full_root, real_files)`` mirrors ``full_root`` (an unpacked wheel, see
``vllm_wheels.full``) at ``dest``: every directory on the way to one of ``real_files`` is a real
directory, the files named in ``real_files`` (and the dist-info) are real copies that the patcher
may rewrite, and everything else is a symlink into the cached wheel (never written: the patcher
only touches ``real_files``; import it with ``PYTHONDONTWRITEBYTECODE=1``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def overlay_site(dest: Path, full_root: Path, real_files: list[str]) -> Path:
    dest.mkdir(parents=True)
    for info in full_root.glob("*.dist-info"):
        shutil.copytree(info, dest / info.name)
    real = {Path(r) for r in real_files}
    real_dirs = {p for r in real for p in r.parents if p != Path(".")}
    _mirror(full_root, dest, Path("vllm"), real, real_dirs)
    return dest


def _mirror(src_root: Path, dest_root: Path, rel: Path, real: set[Path], real_dirs: set[Path]) -> None:
    (dest_root / rel).mkdir()
    with os.scandir(src_root / rel) as entries:
        for entry in entries:
            child = rel / entry.name
            if child in real:
                shutil.copy2(entry.path, dest_root / child)
            elif child in real_dirs:
                _mirror(src_root, dest_root, child, real, real_dirs)
            elif entry.name == "__pycache__" and any(r.parent == rel for r in real):
                # Share the wheel's bytecode except that of the files the patcher rewrites.
                stems = {r.stem + "." for r in real if r.parent == rel}
                (dest_root / child).mkdir()
                for pyc in os.scandir(entry.path):
                    if not any(pyc.name.startswith(s) for s in stems):
                        os.symlink(pyc.path, dest_root / child / pyc.name)
            else:
                os.symlink(entry.path, dest_root / child)
