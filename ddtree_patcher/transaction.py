"""One journaled, all-or-nothing change of a set of files plus the state file.

Order of a commit (each step survives a kill -9 at any instant):

1. preflight: a real temp file is created and removed in every folder to be written;
2. backups: the bytes before and after of every file go to ``backups/<sha256>`` (fsync);
3. journal: ``journal.json`` lists every file with its before/after sha256 and the sha256 of
   the state file before and after (written atomically);
4. every file: a temp file beside it (mode and owner copied, every byte written, fsync, size
   and sha256 checked), then ``os.replace`` — never an in-place write (uv and conda hardlink
   site-packages into their caches), never a partial file in place of a target;
5. re-hash every file; run the optional post-check (e.g. an import check);
6. the new ``state.json`` (atomically); 7. delete the journal; 8. drop stale bytecode.

Every file the tool creates is created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` under a name nobody
can predict (``.<name>.<random>.ddtree-patch-tmp``), so a planted symbolic link is never
written through; nothing is deleted through a link (``lstat`` first, regular files only).

Recovery (:func:`recover`, run under the lock by every command that finds a journal or a stray
temp file of ours): stray temp and probe files of an interrupted run are removed (regular files
only, in the folders the tool writes); when the state file already is the journal's "after",
the commit happened and only the journal is removed; otherwise every file is put back to its
"before" bytes. Either way every file ends pristine or every file patched, with the state
agreeing. Any failure while writing (a full disk included) rolls back the same way; if even the
roll-back cannot write, the journal stays and the next command finishes it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import signal
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ddtree_patcher.errors import DDTreeError, ExitCode, Refused, describe, environment, is_space
from ddtree_patcher.state import (
    _SHA, SCHEMA, UnsafeStateDir, lstat_kind, read_regular, safe_path, sha256, state_dir,
)

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


def tmp_name(name: str) -> str:
    """A fresh temp-file name for ``name``: hidden, unpredictable, ours by its suffix, and short
    enough for any file system that takes ``name`` itself."""
    return f".{name[:150]}.{secrets.token_hex(8)}{TMP_SUFFIX}"


def is_temp(name: str) -> bool:
    return name.endswith(TMP_SUFFIX)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a short write is not success)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # pragma: no cover - a 0-byte write of a non-empty buffer
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


def remove_file(path: Path) -> bool:
    """Unlink ``path`` if it is a regular file (never through or of a symbolic link). Returns
    whether something was removed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write(path: Path, data: bytes, *, like: Path | None = None, split: bool = False) -> None:
    """Write ``data`` to a fresh temp file beside ``path`` and ``os.replace`` it over ``path``.

    The temp file is created with ``O_EXCL|O_NOFOLLOW`` under an unpredictable name; its size
    and sha256 are checked after fsync, before the replace, so ``path`` only ever holds its old
    bytes or all of ``data``. On any error the temp file is removed. Mode and owner are copied
    from ``like`` (default: ``path`` itself when it exists). ``path`` must be a regular file or
    absent."""
    lstat_kind(path, "file")
    ref = like if like is not None else path
    try:
        st = os.lstat(ref)
    except FileNotFoundError:
        st = None
    tmp = path.with_name(tmp_name(path.name))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    done = False
    try:
        try:
            if split:  # two halves with a checkpoint between: lets tests kill us mid-write
                write_all(fd, data[: len(data) // 2])
                checkpoint()
                write_all(fd, data[len(data) // 2:])
            else:
                write_all(fd, data)
            os.fsync(fd)
            if st is not None and stat.S_ISREG(st.st_mode):
                os.fchmod(fd, st.st_mode & 0o7777)
                try:
                    os.fchown(fd, st.st_uid, st.st_gid)
                except PermissionError:
                    pass
            else:
                os.fchmod(fd, 0o644 & ~_UMASK)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size != len(data) or sha256(read_regular(tmp) or b"") != sha256(data):
            raise OSError(errno.EIO, f"{tmp}: wrote {size} of {len(data)} bytes, or they read back differently")
        os.replace(tmp, path)
        done = True
    finally:
        if not done:
            try:
                remove_file(tmp)
            except OSError:
                pass
    _fsync_dir(path.parent)


def _real_dir(folder: Path, below: Path | None = None) -> bool:
    """``folder`` exists and neither it nor any component under ``below`` is a symbolic link."""
    parts = [folder] if below is None else []
    if below is not None:
        try:
            rel = folder.relative_to(below)
        except ValueError:
            return False
        cur = below
        for part in rel.parts:
            cur = cur / part
            parts.append(cur)
    for p in parts:
        try:
            if not stat.S_ISDIR(os.lstat(p).st_mode):
                return False
        except OSError:
            return False
    return True


def invalidate_bytecode(path: Path) -> None:
    """Remove every cached .pyc of ``path``: all interpreters and optimisation levels, and the
    copy under ``PYTHONPYCACHEPREFIX`` if one is set.

    Names are matched in a directory listing (never a glob: the site path may hold ``*`` or
    ``[``); only regular files are removed, only in ``__pycache__`` beside the file or at the file's
    own mirror path under the prefix, and never through a symbolic link. Best effort: a stale
    .pyc left behind is also rejected by Python itself (its source mtime and size changed)."""
    name = re.compile(re.escape(path.stem) + r"\.[A-Za-z0-9_-]+(\.opt-[0-9]+)?\.pyc\Z")
    folders = []
    if _real_dir(path.parent / "__pycache__"):
        folders.append(path.parent / "__pycache__")
    prefix = os.environ.get("PYTHONPYCACHEPREFIX") or getattr(sys, "pycache_prefix", None)
    if prefix and os.path.isabs(prefix):
        base = Path(prefix)
        mirror = base / str(path.parent).lstrip(os.sep)
        if _real_dir(base) and _real_dir(mirror, below=base):
            folders.append(mirror)
    for folder in folders:
        try:
            with os.scandir(folder) as it:
                hits = [e.name for e in it if name.match(e.name) and e.is_file(follow_symlinks=False)]
        except OSError:
            continue
        for hit in hits:
            try:
                remove_file(folder / hit)
            except OSError:
                pass


class Store:
    """The state directory's files (state, journal, backups) for one vLLM location."""

    def __init__(self, site: Path):
        self.site = site
        self.dir = state_dir(site)
        self.state_path = self.dir / "state.json"
        self.journal_path = self.dir / "journal.json"
        self.backups = self.dir / "backups"
        self.lock_path = self.dir / "lock"
        self.cache_path = self.dir / "scan-cache.json"

    def check(self) -> bool:
        """Refuse (exit 3) a state folder, or any entry of ours in it, that is a symbolic link or
        of the wrong kind, before anything is read through it. Returns whether the folder exists."""
        if not lstat_kind(self.dir, "dir"):
            return False
        lstat_kind(self.backups, "dir")
        for f in (self.state_path, self.journal_path, self.lock_path, self.cache_path):
            lstat_kind(f, "file")
        return True

    def ensure_dirs(self) -> None:
        for d in (self.dir, self.backups):
            if not lstat_kind(d, "dir"):
                try:
                    os.mkdir(d, 0o755)
                except FileExistsError:
                    pass
                lstat_kind(d, "dir")

    def backup(self, data: bytes) -> str:
        digest = sha256(data)
        path = self.backups / digest
        self.ensure_dirs()
        have = read_regular(path)
        if have is None or sha256(have) != digest:
            atomic_write(path, data)
        return digest

    def read_backup(self, digest: str, what: str) -> bytes:
        try:
            data = read_regular(self.backups / digest) if lstat_kind(self.backups, "dir") else None
        except UnsafeStateDir as exc:
            raise Refused(f"the backup of {what} ({digest[:12]}) cannot be used: {exc}") from None
        if data is None:
            raise Refused(f"the backup of {what} ({digest[:12]}) is missing from {self.backups}; "
                          "cannot restore its bytes")
        if sha256(data) != digest:
            raise Refused(f"the backup of {what} ({digest[:12]}) in {self.backups} is corrupted")
        return data

    def backup_ok(self, digest: str) -> str | None:
        """None when ``backups/<digest>`` holds those bytes; else what is wrong with it."""
        try:
            data = read_regular(self.backups / digest) if lstat_kind(self.backups, "dir") else None
        except (UnsafeStateDir, OSError) as exc:
            return f"unusable ({exc})"
        if data is None:
            return "missing"
        return None if sha256(data) == digest else "altered"

    def state_sha(self) -> str | None:
        data = read_regular(self.state_path)
        return None if data is None else sha256(data)

    def gc(self, keep: set[str]) -> None:
        """Remove the backups not in ``keep`` (content-addressed regular files only)."""
        if not lstat_kind(self.backups, "dir"):
            return
        with os.scandir(self.backups) as it:
            names = [e.name for e in it]
        for name in names:
            if name not in keep and (_SHA.match(name) or is_temp(name)):
                try:
                    remove_file(self.backups / name)
                except OSError:
                    pass

    def drop_derived(self) -> None:
        """Nothing stays applied: remove the scan cache and the (empty) backups folder."""
        try:
            remove_file(self.cache_path)
            if lstat_kind(self.backups, "dir"):
                os.rmdir(self.backups)
        except OSError:
            pass

    def stray_temps(self, rels: list[str]) -> list[Path]:
        """Temp and probe files of ours (regular files only) left by an interrupted run, in the
        state folder, ``backups/`` and the folders of ``rels`` (files the tool may write)."""
        folders = [self.dir, self.backups]
        for rel in sorted({str(Path(r).parent) for r in rels}):
            try:
                folders.append(safe_path(self.site, rel, "stray check"))
            except Refused:  # a symbolic link on the way: we never write there
                continue
        out = []
        for folder in dict.fromkeys(folders):
            if not _real_dir(folder):
                continue
            try:
                with os.scandir(folder) as it:
                    out += [folder / e.name for e in it if is_temp(e.name) and e.is_file(follow_symlinks=False)]
            except OSError:
                continue
        return out


def _preflight(store: Store, paths: list[Path]) -> None:
    """Make sure every folder to be written takes a new file (nothing is changed otherwise)."""
    for folder in [store.dir, store.backups] + sorted({p.parent for p in paths}):
        probe = folder / tmp_name("ddtree-patch-probe")
        try:
            if folder in (store.dir, store.backups):
                store.ensure_dirs()
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise environment(exc, f"cannot write in {folder}", name=False) from exc


def _restore(store: Store, entries: list[dict], to: str) -> None:
    """Put every journal entry's file back to its ``to`` ("before" or "after") bytes."""
    for e in entries:
        path = safe_path(store.site, e["path"], str(store.journal_path))
        want = e[to]
        data = read_regular(path)
        cur = None if data is None else sha256(data)
        if cur != want:
            if cur not in (e["before"], e["after"]) and cur is not None:
                raise Refused(
                    f"{path} changed by something else during an interrupted ddtree-patch transaction "
                    f"(sha256 {cur[:12]} is neither before nor after); restore it by hand "
                    f"(backups in {store.backups}), then delete {store.journal_path}"
                )
            atomic_write(path, store.read_backup(want, str(path)))
        invalidate_bytecode(path)


def _read_journal(store: Store) -> dict | None:
    raw = read_regular(store.journal_path)
    if raw is None:
        return None
    try:
        journal = json.loads(raw)
        if not isinstance(journal, dict) or journal.get("schema") != SCHEMA:
            raise ValueError(f"schema {journal.get('schema') if isinstance(journal, dict) else None!r}")
        for key in ("entries", "state_before", "state_after"):
            if key not in journal:
                raise ValueError(f"no {key!r}")
        for value in (journal["state_before"], journal["state_after"]):
            if value is not None and not (isinstance(value, str) and _SHA.match(value)):
                raise ValueError(f"malformed state sha256 {value!r}")
        if not isinstance(journal["entries"], list):
            raise ValueError("entries is not a list")
        for e in journal["entries"]:
            if not isinstance(e, dict) or not all(isinstance(e.get(k), str) for k in ("path", "before", "after")):
                raise ValueError(f"malformed entry {e!r}")
            if not (_SHA.match(e["before"]) and _SHA.match(e["after"])):
                raise ValueError(f"malformed sha256 in {e!r}")
            safe_path(store.site, e["path"], str(store.journal_path))
    except (ValueError, TypeError) as exc:
        raise Refused(f"{store.journal_path} is corrupted ({exc}); an interrupted transaction cannot be "
                      f"recovered automatically (backups are in {store.backups})") from exc
    return journal


def recover(store: Store, rels: list[str] = ()) -> str | None:
    """Finish or undo an interrupted transaction and remove the stray temp files of an
    interrupted run (in the folders of ``rels`` and the state folder). Returns what was done,
    or None if nothing was."""
    if not store.check():
        return None
    journal = _read_journal(store)
    notes = []
    strays = store.stray_temps(list(rels) + ([e["path"] for e in journal["entries"]] if journal else []))
    for p in strays:
        remove_file(p)
    if strays:
        notes.append(f"removed {len(strays)} temp file(s) of an interrupted run")
    if journal is not None:
        try:
            if store.state_sha() == journal["state_after"]:
                _restore(store, journal["entries"], "after")
                notes.append(f"finished an interrupted {journal.get('op', '?')} (it had committed)")
            else:
                _restore(store, journal["entries"], "before")
                notes.append(f"rolled back an interrupted {journal.get('op', '?')}")
            remove_file(store.journal_path)
        except OSError as exc:
            raise environment(exc, "recovering an interrupted transaction failed",
                              changed=f"the journal {store.journal_path} is kept and the next command "
                                      "tries again") from exc
        _fsync_dir(store.dir)
    return "; ".join(notes) or None


def commit(
    store: Store,
    op: str,
    changes: list[Change],
    new_state: bytes | None,
    post_check: Callable[[], None] | None = None,
) -> None:
    """Apply ``changes`` and write ``new_state`` (None: remove the state file), all or nothing."""
    paths = [safe_path(store.site, c.rel, "plan") for c in changes]
    _preflight(store, paths)
    checkpoint()
    try:
        for c in changes:
            store.backup(c.before)
            store.backup(c.after)
    except OSError as exc:  # only extra copies were written: nothing of vLLM changed
        raise environment(exc, "writing the backups failed") from exc
    checkpoint()
    old_state = store.state_sha()
    journal = {
        "schema": SCHEMA,
        "op": op,
        "entries": [{"path": c.rel, "before": sha256(c.before), "after": sha256(c.after)} for c in changes],
        "state_before": old_state,
        "state_after": None if new_state is None else sha256(new_state),
    }
    try:
        atomic_write(store.journal_path, json.dumps(journal, indent=1).encode())
    except OSError as exc:
        raise environment(exc, "writing the journal failed") from exc
    checkpoint()
    try:
        for c, path in zip(changes, paths):
            atomic_write(path, c.after, split=True)
            invalidate_bytecode(path)
            checkpoint()
        for c, path in zip(changes, paths):
            if sha256(read_regular(path) or b"") != sha256(c.after):
                raise OSError(errno.EIO, f"{path}: re-hash after write does not match what was written")
        if post_check is not None:
            post_check()
        checkpoint()
        if new_state is None:
            if remove_file(store.state_path):
                _fsync_dir(store.dir)
        else:
            atomic_write(store.state_path, new_state, split=True)
        checkpoint()
    except BaseException as exc:
        _roll_back(store, journal, old_state, exc)
        if isinstance(exc, DDTreeError):
            raise
        if isinstance(exc, OSError):
            raise environment(exc, f"{op}: writing failed", changed="every file was rolled back; "
                              "nothing was changed") from exc
        raise
    remove_file(store.journal_path)
    _fsync_dir(store.dir)
    checkpoint()


def _roll_back(store: Store, journal: dict, old_state: str | None, exc: BaseException) -> None:
    """Undo a failed commit. When that fails too, the journal stays and the next command
    finishes the roll-back; raise an error that says so (exit 4 when the cause is the disk)."""
    try:
        _restore(store, journal["entries"], "before")
        if store.state_sha() != old_state:  # pragma: no cover - state is written last
            raise DDTreeError("state changed during a failed transaction")
        remove_file(store.journal_path)
        _fsync_dir(store.dir)
    except BaseException as rb:
        first = describe(exc) if isinstance(exc, OSError) else str(exc)
        second = describe(rb) if isinstance(rb, OSError) else str(rb)
        if isinstance(rb, DDTreeError):
            code = rb.code
        elif isinstance(rb, OSError) or is_space(exc):
            code = ExitCode.ENVIRONMENT
        else:
            code = ExitCode.INTERNAL
        tip = " (free some space first)" if is_space(exc) or is_space(rb) else ""
        raise DDTreeError(f"{first}; rolling back failed too ({second}); the journal {store.journal_path} "
                          f"is kept: the next ddtree-patch command{tip}, e.g. `ddtree-patch verify`, finishes "
                          "the roll-back", code=code) from exc
