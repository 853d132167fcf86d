"""The state directory ``<site>/.ddtree-patch/`` beside the ``vllm`` package.

It is found from the vLLM location alone and is not importable (its name starts with a dot):

* ``state.json``   schema-versioned record of what is applied: per file the pristine and the
                   patched sha256 and the patches in it;
* ``journal.json`` exists only while a transaction is open (see transaction.py);
* ``backups/<sha256>`` content-addressed copies of every file's bytes before and after;
* ``lock``         ``flock``-ed by every command that writes;
* ``scan-cache.json`` derived classifications (engine.py).

Every one of them must be a real folder or a regular file: a symbolic link (or a folder where a
file belongs) is refused with :class:`UnsafeStateDir` (exit 3) before anything is read through
it or written, and nothing is ever deleted through a link. The folder goes away when nothing
stays applied (see :meth:`Lock.remove_state_dir`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import stat
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


class UnsafeStateDir(Refused):
    """A state-directory entry is a symbolic link, or of the wrong kind (exit 3)."""


_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a folder", stat.S_IFREG: "a regular file",
          stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


def lstat_kind(path: Path, want: str) -> bool:
    """Whether ``path`` exists, refusing it unless it is ``want`` ("dir" or "file") itself, not a
    symbolic link to one."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    ok = stat.S_ISDIR(st.st_mode) if want == "dir" else stat.S_ISREG(st.st_mode)
    if not ok:
        expected = "a real folder" if want == "dir" else "a regular file"
        raise UnsafeStateDir(f"{path} is {_kind(st.st_mode)}, not {expected}: ddtree-patch never reads, "
                             "writes or deletes through a symbolic link, nor replaces what it did not "
                             "create; remove it; nothing was changed")
    return True


def read_regular(path: Path, follow: bool = False) -> bytes | None:
    """The bytes of the regular file ``path`` (None when it does not exist), opened without
    following a symbolic link (unless ``follow``: reading a vLLM file to classify it) and without
    blocking on a FIFO; anything but a regular file is refused."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO) and not follow:
            lstat_kind(path, "file")  # raises, naming what it is
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            if not follow:
                lstat_kind(path, "file")
            raise UnsafeStateDir(f"{path} is {_kind(st.st_mode)}, not a regular file; nothing was changed")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


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
    if not lstat_kind(state_dir(site), "dir"):
        return State()
    try:
        raw = read_regular(path)
    except OSError as exc:
        raise EnvironmentProblem(f"cannot read {path}: {exc.strerror or exc}") from exc
    if raw is None:
        return State()
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
    """An exclusive ``flock`` on ``<state dir>/lock``, waiting at most ``timeout`` seconds.

    The lock file is opened without following a symbolic link and must be a regular file. It
    may be unlinked (with the whole state folder, when nothing stays applied) only by its
    holder: so after every ``flock`` the holder checks that the path still names the inode it
    locked, and starts over if not. Two commands therefore never both hold "the" lock, even
    while one of them removes it.

    Where the state folder cannot be written (read-only file system, no permission), the lock
    is taken on a read-only descriptor when the file exists, else not at all (``read_only``):
    such a run can only succeed if it has nothing to write, which is checked before any write.
    """

    _READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)

    def __init__(self, site: Path, timeout: float):
        self.dir = state_dir(site)
        self.path = self.dir / "lock"
        self.timeout = timeout
        self.fd: int | None = None
        self.read_only = False

    def _open(self) -> int | None:
        """A descriptor on the lock file (created if needed); None: read-only and no lock file."""
        try:
            if not lstat_kind(self.dir, "dir"):
                os.mkdir(self.dir, 0o755)
            lstat_kind(self.dir, "dir")
            lstat_kind(self.path, "file")
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except FileExistsError:  # a concurrent mkdir: the caller starts over
            return -1
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                lstat_kind(self.path, "file")
            if exc.errno == errno.ENOENT:  # the folder went away under us (a full revert)
                return -1
            if exc.errno not in self._READ_ONLY:
                from ddtree_patcher.errors import environment

                raise environment(exc, f"cannot create the lock {self.path}") from exc
        self.read_only = True
        try:
            return os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                lstat_kind(self.path, "file")
            if exc.errno in self._READ_ONLY:
                return None
            raise

    def __enter__(self) -> "Lock":
        deadline = time.monotonic() + self.timeout
        while True:
            self.read_only = False
            fd = self._open()
            if fd is None:
                return self  # read-only, no lock file: nobody can be writing here
            if fd < 0:  # the folder changed under us (created or removed concurrently): again
                if time.monotonic() >= deadline:
                    raise EnvironmentProblem(f"cannot create the lock {self.path}: its folder keeps changing")
                time.sleep(0.01)
                continue
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise UnsafeStateDir(f"{self.path} is {_kind(st.st_mode)}, not a regular file; remove it")
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        os.close(fd)
                        raise
                if time.monotonic() >= deadline:
                    holder = ""
                    try:
                        holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                    except OSError:
                        pass
                    os.close(fd)
                    raise EnvironmentProblem(
                        f"lock timeout after {self.timeout:g}s: another ddtree-patch run "
                        f"({'pid ' + holder if holder.isdigit() else 'unknown pid'}) holds {self.path}"
                    )
                time.sleep(0.05)
            try:  # still the lock file? (its previous holder may have removed it)
                same = os.lstat(self.path)
                current = (same.st_dev, same.st_ino) == (st.st_dev, st.st_ino)
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        self.fd = fd
        if not self.read_only:
            try:  # who holds it, for a timeout message; best effort (a full disk must not stop us)
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
            except OSError:
                pass
        return self

    def remove_state_dir(self, keep_if) -> bool:
        """While holding the lock: unlink the lock file and remove the state folder, unless
        ``keep_if()`` says something in it is still needed. Returns whether it was removed."""
        if self.fd is None or self.read_only or keep_if():
            return False
        try:
            st = os.fstat(self.fd)
            cur = os.lstat(self.path)
            if (cur.st_dev, cur.st_ino) != (st.st_dev, st.st_ino):
                return False
            os.unlink(self.path)  # a waiter that flocks the old inode sees it gone and starts over
            os.rmdir(self.dir)  # only when empty: never removes anything it did not name
        except OSError:
            return False
        return True

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            try:
                if not self.read_only:
                    os.ftruncate(self.fd, 0)
            except OSError:
                pass
            finally:
                os.close(self.fd)  # closing releases the flock
            self.fd = None
