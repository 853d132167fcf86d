"""The state directory ``<site>/.ddtree-patch/`` beside the ``vllm`` package.

It is found from the vLLM location alone and is not importable (its name starts with a dot):

* ``state.json``   schema-versioned record of what is applied: per file the pristine and the
                   patched sha256 and the patches in it;
* ``journal.json`` exists only while a transaction is open (see transaction.py);
* ``backups/<sha256>`` content-addressed copies of every file's bytes before and after;
* ``lock``         ``flock``-ed by every command that writes.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ddtree_patcher.errors import EnvironmentProblem, Refused

SCHEMA = 1
DIRNAME = ".ddtree-patch"
_SHA = re.compile(r"^[0-9a-f]{64}$")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def state_dir(site: Path) -> Path:
    return site / DIRNAME


def safe_path(site: Path, rel: str, what: str) -> Path:
    """``site/rel`` for a path read from state or journal, refusing anything that could leave
    the vLLM package: absolute paths, ``..``, paths outside ``vllm/``, and any symlink on the way."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts or p.parts[0] != "vllm" or str(p) != rel:
        raise Refused(f"{what}: refusing path {rel!r}: not a plain relative path inside vllm/")
    full = site / Path(*p.parts)
    cur = site
    for part in p.parts:
        cur = cur / part
        if cur.is_symlink():
            raise Refused(f"{what}: refusing path {rel!r}: {cur} is a symbolic link")
    return full


@dataclass
class FileRecord:
    pristine: str
    patched: str
    patches: list[str]


@dataclass
class State:
    vllm_version: str = ""
    vllm_dist: str = ""
    patches: list[str] = field(default_factory=list)
    files: dict[str, FileRecord] = field(default_factory=dict)

    def to_json(self, tool_version: str) -> bytes:
        doc = {
            "schema": SCHEMA,
            "tool": tool_version,
            "vllm": {"version": self.vllm_version, "dist": self.vllm_dist},
            "patches": self.patches,
            "files": {
                k: {"pristine": v.pristine, "patched": v.patched, "patches": v.patches}
                for k, v in sorted(self.files.items())
            },
        }
        return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def load_state(site: Path, known_ids: set[str]) -> State:
    """The recorded state (empty when none). Tampered or corrupted state is refused (exit 3)."""
    path = state_dir(site) / "state.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return State()
    except OSError as exc:
        raise EnvironmentProblem(f"cannot read {path}: {exc}") from exc
    where = str(path)
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise Refused(f"{where} is corrupted (not JSON: {exc}); nothing was changed") from exc
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise Refused(f"{where}: unknown schema {doc.get('schema') if isinstance(doc, dict) else doc!r} "
                      f"(this ddtree-patch reads schema {SCHEMA}); nothing was changed")
    try:
        patches = list(doc["patches"])
        files = doc["files"]
        vllm = doc["vllm"]
        state = State(str(vllm["version"]), str(vllm["dist"]), [str(p) for p in patches], {})
        for rel, rec in files.items():
            safe_path(site, rel, where)
            fr = FileRecord(str(rec["pristine"]), str(rec["patched"]), [str(p) for p in rec["patches"]])
            if not (_SHA.match(fr.pristine) and _SHA.match(fr.patched)):
                raise Refused(f"{where}: {rel}: malformed sha256")
            state.files[rel] = fr
    except (KeyError, TypeError, AttributeError) as exc:
        raise Refused(f"{where} is malformed ({exc!r}); nothing was changed") from exc
    unknown = set(state.patches) - known_ids
    for rec in state.files.values():
        unknown |= set(rec.patches) - set(state.patches)
    if unknown:
        raise Refused(f"{where} names patches this ddtree-patch does not know or did not record: "
                      f"{sorted(unknown)}; nothing was changed")
    return state


class Lock:
    """An exclusive ``flock`` on ``<state dir>/lock``, waiting at most ``timeout`` seconds."""

    def __init__(self, site: Path, timeout: float):
        self.path = state_dir(site) / "lock"
        self.timeout = timeout
        self.fd: int | None = None

    def __enter__(self) -> "Lock":
        try:
            self.path.parent.mkdir(exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise EnvironmentProblem(f"cannot create the lock {self.path}: {exc.strerror or exc}; "
                                     "is site-packages read-only? patch at image-build time") from exc
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    holder = ""
                    try:
                        holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip()
                    except OSError:
                        pass
                    os.close(self.fd)
                    self.fd = None
                    raise EnvironmentProblem(
                        f"lock timeout after {self.timeout:g}s: another ddtree-patch run "
                        f"({'pid ' + holder if holder else 'unknown pid'}) holds {self.path}"
                    )
                time.sleep(0.05)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)
            finally:
                os.close(self.fd)  # closing releases the flock
            self.fd = None
