"""Helpers shared by the tests (importable as ``helpers``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def patch_files() -> list[str]:
    """Every file a registered patch reads (its targets and its ``requires``)."""
    from ddtree_patcher.engine import series

    out = set()
    for p in series():
        out.update(p.requires)
        out.update(pf.path for pf in p.files)
    return sorted(out)


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, **popen):
    """Run the installed ``ddtree-patch`` console script; returns (exit code, JSON or None, stderr)."""
    exe = Path(sys.executable).with_name("ddtree-patch")
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=timeout, cwd="/", **popen)
    doc = json.loads(proc.stdout) if "--json" in args and proc.stdout.strip() else None
    if "--json" in args and doc is None and proc.returncode in (0, 3, 4, 5, 6):
        raise AssertionError(f"exit {proc.returncode} without JSON on stdout; stderr:\n{proc.stderr}")
    return proc.returncode, doc, proc.stderr


def statuses(doc: dict) -> dict[str, str]:
    return {p["id"]: p["status"] for p in doc["patches"]}


def tree_bytes(site: Path) -> dict[str, bytes]:
    """Every file under site/vllm, for byte-exact comparisons."""
    return {str(p.relative_to(site)): p.read_bytes() for p in sorted((site / "vllm").rglob("*")) if p.is_file()}


def added_lines(before: bytes, after: bytes) -> list[str]:
    """The lines a rewrite added (unified diff of two versions of a file, "+" lines)."""
    import difflib

    return [line[1:] for line in difflib.unified_diff(before.decode().splitlines(), after.decode().splitlines(),
                                                      lineterm="", n=0)
            if line.startswith("+") and not line.startswith("+++")]
