"""One journaled, all-or-nothing change of a set of files plus the state file.

Order of a commit (each step survives a kill -9 at any instant):

1. preflight: a real temp file is created and removed in every folder to be written;
2. backups: the bytes before and after of every file go to ``backups/<sha256>`` (fsync);
3. journal: ``journal.json`` lists every file with its before/after sha256 and the sha256 of
   the state file before and after (written atomically);
4. every file: a temp file beside it (mode and owner copied, fsync), then ``os.replace`` —
   never an in-place write (uv and conda hardlink site-packages into their caches);
5. re-hash every file; run the optional post-check (e.g. an import check);
6. the new ``state.json`` (atomically); 7. delete the journal; 8. drop stale bytecode.

Recovery (:func:`recover`, run under the lock by every command that finds a journal): when the
state file already is the journal's "after", the commit happened and only the journal is
removed; otherwise every file is put back to its "before" bytes. Either way every file ends
pristine or every file patched, with the state agreeing.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ddtree_patcher.errors import DDTreeError, EnvironmentProblem, Refused, ValidationFailed
from ddtree_patcher.state import SCHEMA, safe_path, sha256, state_dir

TMP_SUFFIX = ".ddtree-patch-tmp"
_crash_counter = 0


def checkpoint() -> None:
    """Test hook: ``DDTREE_PATCH_CRASH_AT=N`` kills this process (SIGKILL) at the N-th checkpoint."""
    global _crash_counter
    _crash_counter += 1
    at = os.environ.get("DDTREE_PATCH_CRASH_AT")
    if at is not None and int(at) == _crash_counter:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Change:
    rel: str
    before: bytes
    after: bytes


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, like: Path | None = None, split: bool = False) -> None:
    """Write ``data`` to a temp file beside ``path`` and ``os.replace`` it over ``path``.

    Mode and owner are copied from ``like`` (default: ``path`` itself when it exists)."""
    tmp = path.with_name("." + path.name + TMP_SUFFIX)
    ref = like if like is not None else path
    try:
        st = os.stat(ref)
    except FileNotFoundError:
        st = None
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if split:  # two halves with a checkpoint between: lets tests kill us mid-write
            os.write(fd, data[: len(data) // 2])
            checkpoint()
            os.write(fd, data[len(data) // 2:])
        else:
            os.write(fd, data)
        os.fsync(fd)
        if st is not None:
            os.fchmod(fd, st.st_mode & 0o7777)
            try:
                os.fchown(fd, st.st_uid, st.st_gid)
            except PermissionError:
                pass
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def invalidate_bytecode(path: Path) -> None:
    """Remove every cached .pyc of ``path``: all interpreters and optimisation levels, and the
    copy under ``PYTHONPYCACHEPREFIX`` if one is set."""
    stem = path.stem
    candidates = glob.glob(str(path.parent / "__pycache__" / f"{stem}.*.pyc"))
    prefix = os.environ.get("PYTHONPYCACHEPREFIX") or getattr(sys, "pycache_prefix", None)
    if prefix:
        mirror = Path(prefix) / str(path.parent.resolve()).lstrip(os.sep)
        candidates += glob.glob(str(mirror / f"{stem}.*.pyc"))
    for c in candidates:
        try:
            os.unlink(c)
        except FileNotFoundError:
            pass


class Store:
    """The state directory's files (state, journal, backups) for one vLLM location."""

    def __init__(self, site: Path):
        self.site = site
        self.dir = state_dir(site)
        self.state_path = self.dir / "state.json"
        self.journal_path = self.dir / "journal.json"
        self.backups = self.dir / "backups"

    def backup(self, data: bytes) -> str:
        digest = sha256(data)
        path = self.backups / digest
        if not path.exists() or sha256(path.read_bytes()) != digest:
            self.backups.mkdir(parents=True, exist_ok=True)
            atomic_write(path, data)
        return digest

    def read_backup(self, digest: str, what: str) -> bytes:
        try:
            data = (self.backups / digest).read_bytes()
        except FileNotFoundError:
            raise Refused(f"the backup of {what} ({digest[:12]}) is missing from {self.backups}; "
                          "cannot restore its bytes") from None
        if sha256(data) != digest:
            raise Refused(f"the backup of {what} ({digest[:12]}) in {self.backups} is corrupted")
        return data

    def state_sha(self) -> str | None:
        try:
            return sha256(self.state_path.read_bytes())
        except FileNotFoundError:
            return None

    def gc(self, keep: set[str]) -> None:
        if not self.backups.is_dir():
            return
        for p in self.backups.iterdir():
            if p.name not in keep:
                try:
                    p.unlink()
                except OSError:
                    pass


def _preflight(paths: list[Path]) -> None:
    for folder in sorted({p.parent for p in paths}):
        probe = folder / (".ddtree-patch-probe" + TMP_SUFFIX)
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise EnvironmentProblem(
                f"cannot write in {folder}: {exc.strerror or exc} (read-only or no permission); "
                "nothing was changed. Patch at image-build time or run as the owner of site-packages."
            ) from exc


def _restore(store: Store, entries: list[dict], to: str) -> None:
    """Put every journal entry's file back to its ``to`` ("before" or "after") bytes."""
    for e in entries:
        path = safe_path(store.site, e["path"], str(store.journal_path))
        want = e[to]
        try:
            cur = sha256(path.read_bytes())
        except FileNotFoundError:
            cur = None
        if cur != want:
            if cur not in (e["before"], e["after"]) and cur is not None:
                raise Refused(
                    f"{path} changed by something else during an interrupted ddtree-patch transaction "
                    f"(sha256 {cur[:12]} is neither before nor after); restore it by hand "
                    f"(backups in {store.backups}), then delete {store.journal_path}"
                )
            atomic_write(path, store.read_backup(want, str(path)))
        tmp = path.with_name("." + path.name + TMP_SUFFIX)
        if tmp.exists():
            tmp.unlink()
        invalidate_bytecode(path)


def recover(store: Store) -> str | None:
    """Finish or undo an interrupted transaction. Returns what was done, or None if nothing was."""
    stray = store.dir / ("journal.json" + TMP_SUFFIX)
    for p in (stray, store.dir / (".journal.json" + TMP_SUFFIX), store.dir / (".state.json" + TMP_SUFFIX)):
        if p.exists():
            p.unlink()
    if not store.journal_path.exists():
        return None
    try:
        journal = json.loads(store.journal_path.read_bytes())
        if journal.get("schema") != SCHEMA:
            raise ValueError(f"schema {journal.get('schema')!r}")
        entries = journal["entries"]
        for e in entries:
            safe_path(store.site, e["path"], str(store.journal_path))
    except (ValueError, KeyError, TypeError) as exc:
        raise Refused(f"{store.journal_path} is corrupted ({exc}); an interrupted transaction cannot be "
                      f"recovered automatically (backups are in {store.backups})") from exc
    if store.state_sha() == journal["state_after"]:
        _restore(store, entries, "after")
        done = f"finished an interrupted {journal.get('op', '?')} (it had committed)"
    else:
        _restore(store, entries, "before")
        done = f"rolled back an interrupted {journal.get('op', '?')}"
    store.journal_path.unlink()
    _fsync_dir(store.dir)
    return done


def commit(
    store: Store,
    op: str,
    changes: list[Change],
    new_state: bytes | None,
    post_check: Callable[[], None] | None = None,
) -> None:
    """Apply ``changes`` and write ``new_state`` (None: remove the state file), all or nothing."""
    paths = [safe_path(store.site, c.rel, "plan") for c in changes]
    _preflight(paths + [store.state_path])
    checkpoint()
    for c in changes:
        store.backup(c.before)
        store.backup(c.after)
    checkpoint()
    old_state = store.state_sha()
    journal = {
        "schema": SCHEMA,
        "op": op,
        "entries": [{"path": c.rel, "before": sha256(c.before), "after": sha256(c.after)} for c in changes],
        "state_before": old_state,
        "state_after": None if new_state is None else sha256(new_state),
    }
    atomic_write(store.journal_path, json.dumps(journal, indent=1).encode())
    checkpoint()
    try:
        for c, path in zip(changes, paths):
            atomic_write(path, c.after, split=True)
            invalidate_bytecode(path)
            checkpoint()
        for c, path in zip(changes, paths):
            if sha256(path.read_bytes()) != sha256(c.after):
                raise ValidationFailed(f"{path}: re-hash after write does not match what was written")
        if post_check is not None:
            post_check()
        checkpoint()
        if new_state is None:
            if store.state_path.exists():
                store.state_path.unlink()
                _fsync_dir(store.dir)
        else:
            atomic_write(store.state_path, new_state, split=True)
        checkpoint()
    except BaseException as exc:
        try:
            _restore(store, journal["entries"], "before")
            if store.state_sha() != old_state:  # pragma: no cover - state is written last
                raise DDTreeError("state changed during a failed transaction")
            store.journal_path.unlink()
        except Exception as rb:  # the journal stays: the next command recovers
            raise DDTreeError(f"{exc}; and rolling back failed too ({rb}); the next ddtree-patch "
                              "command will recover from the journal") from exc
        if isinstance(exc, DDTreeError):
            raise
        if isinstance(exc, OSError):
            raise EnvironmentProblem(f"writing failed ({exc}); every file was rolled back") from exc
        raise
    store.journal_path.unlink()
    _fsync_dir(store.dir)
    checkpoint()
