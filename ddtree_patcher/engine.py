"""resolve -> scan -> plan in memory -> one transaction -> state.

The engine is generic: everything patch-specific lives in the patch modules
(``ddtree_patcher.patches``), reached through :mod:`ddtree_patcher.patchlib`.
"""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ddtree_patcher import __version__
from ddtree_patcher.errors import DDTreeError, ExitCode, Refused, ValidationFailed
from ddtree_patcher.patchlib import (
    APPLIED, DRIFTED, LOST, NOT_APPLICABLE, PENDING, UNSUPPORTED, UPSTREAM, Finding, Patch,
)
from ddtree_patcher.state import FileRecord, Lock, State, load_state, sha256
from ddtree_patcher.target import Target
from ddtree_patcher import transaction as tx


def _examine():
    from ddtree_patcher import examine  # imports libcst: only when a file must be parsed

    return examine


def series() -> tuple[Patch, ...]:
    from ddtree_patcher.patches import SERIES

    return SERIES


def select(ids: tuple[str, ...] | list[str] | None) -> tuple[Patch, ...]:
    """The patches named by ``--patch`` (all when none), in series order."""
    all_ = series()
    if not ids:
        return all_
    known = {p.id for p in all_}
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise DDTreeError(f"unknown patch id(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})",
                          code=ExitCode.USAGE)
    return tuple(p for p in all_ if p.id in ids)


@dataclass
class FileReport:
    path: str
    status: str
    reason: str = ""
    finding: Finding | None = None


@dataclass
class PatchReport:
    patch: Patch
    files: list[FileReport]

    @property
    def status(self) -> str:
        kinds = [f.status for f in self.files]
        for bad in (UNSUPPORTED, DRIFTED, LOST):
            if bad in kinds:
                return bad
        if PENDING in kinds:
            return PENDING
        if APPLIED in kinds:
            return APPLIED
        if UPSTREAM in kinds:
            return UPSTREAM
        return NOT_APPLICABLE

    @property
    def reason(self) -> str:
        status = self.status
        reasons = [f"{f.reason}" for f in self.files if f.status == status and f.reason]
        return "; ".join(dict.fromkeys(reasons))

    def as_json(self) -> dict:
        return {
            "id": self.patch.id,
            "status": self.status,
            "reason": self.reason,
            "files": [{"path": f.path, "status": f.status, "reason": f.reason} for f in self.files],
        }


@dataclass
class Result:
    command: str
    target: Target
    reports: list[PatchReport]
    changed: bool = False
    code: ExitCode = ExitCode.OK
    notes: list[str] = field(default_factory=list)
    diff: str = ""

    def as_json(self) -> dict:
        doc = {
            "schema": 1,
            "command": self.command,
            "vllm": self.target.as_json(),
            "changed": self.changed,
            "exit_code": int(self.code),
            "patches": [r.as_json() for r in self.reports],
        }
        if self.notes:
            doc["notes"] = self.notes
        if self.diff:
            doc["diff"] = self.diff
        return doc


class _Sources:
    """Reads target files once and parses each at most once per content."""

    def __init__(self, target: Target):
        self.target = target
        self._bytes: dict[str, bytes | None] = {}
        self._parsed: dict[str, object] = {}

    def read(self, rel: str) -> bytes | None:
        if rel not in self._bytes:
            try:
                self._bytes[rel] = (self.target.site / rel).read_bytes()
            except FileNotFoundError:
                self._bytes[rel] = None
        return self._bytes[rel]

    def parse(self, data: bytes, what: str):
        key = sha256(data)
        if key not in self._parsed:
            import libcst as cst

            try:
                self._parsed[key] = cst.parse_module(data)
            except Exception as exc:  # libcst raises ParserSyntaxError and friends
                raise Refused(f"{what}: cannot parse: {exc}") from exc
        return self._parsed[key]


def _scan(target: Target, state: State, patches: tuple[Patch, ...], src: _Sources) -> list[PatchReport]:
    reports = []
    for patch in patches:
        files = []
        missing = [r for r in patch.requires if not (target.site / r).exists()]
        for pf in patch.files:
            rel = pf.path
            if missing:
                files.append(FileReport(rel, NOT_APPLICABLE, f"{missing[0]} is absent from this vLLM"))
                continue
            data = src.read(rel)
            rec = state.files.get(rel)
            if data is None:
                if rec is not None:
                    files.append(FileReport(rel, LOST, f"{rel} is gone since apply"))
                elif pf.optional:
                    files.append(FileReport(rel, NOT_APPLICABLE, f"{rel} is absent from this vLLM"))
                else:
                    files.append(FileReport(rel, UNSUPPORTED, f"{rel}: file not found"))
                continue
            cur = sha256(data)
            pristine_by_record = target.record.get(rel)
            if rec is not None:
                if cur == rec.patched:
                    if patch.id in rec.patches:
                        files.append(FileReport(rel, APPLIED, f"{rel}: recorded and unchanged since apply"))
                        continue
                elif cur in (rec.pristine, pristine_by_record):
                    if patch.id in rec.patches:
                        files.append(FileReport(rel, LOST, f"{rel} is back to pristine bytes since apply "
                                                "(vLLM reinstalled?)"))
                        continue
                else:
                    files.append(FileReport(rel, DRIFTED, f"{rel} was modified since apply "
                                            f"(sha256 {cur[:12]}, recorded {rec.patched[:12]})"))
                    continue
            elif pristine_by_record is not None and cur != pristine_by_record:
                finding = _examine().examine(patch, pf, src.parse(data, rel))
                who = " (carries a ddtree-patch marker but no state records it)" if finding.status == APPLIED else ""
                files.append(FileReport(rel, DRIFTED, f"{rel} differs from the {target.dist} {target.version} "
                                        f"RECORD (foreign edit){who}"))
                continue
            finding = _examine().examine(patch, pf, src.parse(data, rel))
            status, reason = finding.status, finding.reason
            if status == APPLIED:  # our marker, but no state (or not this patch): not ours to trust
                status, reason = DRIFTED, f"{rel} carries '{patch.marker}' but the state does not record it"
            files.append(FileReport(rel, status, reason, finding))
        reports.append(PatchReport(patch, files))
    return reports


def _desired_bytes(target: Target, state: State, store: tx.Store, src: _Sources, rel: str,
                   wanted: list[Patch], allow_untested: bool) -> tuple[bytes, bytes]:
    """(pristine bytes, bytes with ``wanted`` applied in series order) for one file."""
    rec = state.files.get(rel)
    cur = src.read(rel)
    if rec is not None and (cur is None or sha256(cur) not in (rec.pristine, target.record.get(rel))):
        pristine = store.read_backup(rec.pristine, rel)  # patched (or modified, under --force)
    else:
        pristine = cur
    if pristine is None:
        raise Refused(f"{rel}: file not found")
    if not wanted:
        return pristine, pristine
    import libcst as cst

    module = src.parse(pristine, rel)
    rewrote = False
    for patch in wanted:
        pf = next(f for f in patch.files if f.path == rel)
        finding = _examine().examine(patch, pf, module)
        if finding.status in (UPSTREAM, NOT_APPLICABLE):
            continue
        if finding.status != PENDING:
            raise Refused(f"{patch.id}: {finding.reason}")
        if finding.untested and not allow_untested:
            raise Refused(f"{patch.id}: {finding.reason}; pass --allow-untested to apply anyway")
        try:
            module = _examine().rewrite(patch, pf, module, finding)
        except _examine().RewriteError as exc:
            raise Refused(f"{patch.id}: {exc}") from exc
        rewrote = True
        after = _examine().examine(patch, pf, module)
        if after.status != APPLIED:
            raise Refused(f"{patch.id}: {rel}: the rewritten code is not recognised as applied "
                          f"({after.status}: {after.reason}); refusing")
    if not rewrote:
        return pristine, pristine
    new = module.code.encode()
    if new == pristine:
        raise Refused(f"{rel}: the planned rewrite changes nothing; refusing to report it applied")
    try:
        compile(new, str(target.site / rel), "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise Refused(f"{rel}: the rewritten file does not compile: {exc}") from exc
    return pristine, new


def _plan(target: Target, state: State, store: tx.Store, src: _Sources, desired_ids: list[str],
          allow_untested: bool, force_files: set[str] = frozenset()) -> tuple[list[tx.Change], State]:
    """Changes that move every file to ``desired_ids`` applied, and the state that records it."""
    all_ = series()
    touched = sorted({pf.path for p in all_ for pf in p.files if p.id in desired_ids} | set(state.files))
    changes: list[tx.Change] = []
    new_state = State(target.version, target.dist, [p.id for p in all_ if p.id in desired_ids], {})
    for rel in touched:
        wanted = [p for p in all_ if p.id in desired_ids and any(pf.path == rel for pf in p.files)]
        if src.read(rel) is None and not wanted:
            continue  # recorded, but gone (vLLM changed underneath): nothing to restore
        if src.read(rel) is None:
            raise Refused(f"{rel}: file not found")
        pristine, new = _desired_bytes(target, state, store, src, rel, wanted, allow_untested)
        cur = src.read(rel)
        if new != pristine:
            applied_here = []
            for p in wanted:
                pf = next(f for f in p.files if f.path == rel)
                if _examine().examine(p, pf, src.parse(new, rel)).status == APPLIED:
                    applied_here.append(p.id)
            new_state.files[rel] = FileRecord(sha256(pristine), sha256(new), applied_here)
        if cur != new:
            changes.append(tx.Change(rel, cur, new))
    return changes, new_state


def _diff(changes: list[tx.Change]) -> str:
    out = []
    for c in changes:
        out.extend(difflib.unified_diff(
            c.before.decode(errors="replace").splitlines(True), c.after.decode(errors="replace").splitlines(True),
            f"a/{c.rel}", f"b/{c.rel}"))
    return "".join(out)


def _import_check(target: Target, rels: list[str], python: str | None) -> None:
    """Import the patched modules in a subprocess of the target interpreter."""
    mods = sorted({r[:-3].replace("/", ".") for r in rels if r.endswith(".py")})
    if not mods:
        return
    code = (
        "import importlib, sys\n"
        f"sys.path.insert(0, {str(target.site)!r})\n"
        f"for m in {mods!r}:\n"
        "    importlib.import_module(m)\n"
    )
    proc = subprocess.run([python or sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                          env={**os.environ}, timeout=600)
    if proc.returncode != 0:
        raise ValidationFailed("import check failed: " + proc.stderr.strip()[-1500:])


class Engine:
    def __init__(self, target: Target, lock_timeout: float = 60.0, python: str | None = None):
        self.target = target
        self.store = tx.Store(target.site)
        self.lock_timeout = lock_timeout
        self.python = python
        self.known = {p.id for p in series()}

    def _state(self) -> State:
        return load_state(self.target.site, self.known)

    def _recover(self, notes: list[str]) -> None:
        done = tx.recover(self.store)
        if done:
            notes.append(done)

    # ---- commands -------------------------------------------------------------------------

    def scan(self, patches: tuple[Patch, ...]) -> list[PatchReport]:
        return _scan(self.target, self._state(), patches, _Sources(self.target))

    def verify(self, ids=None, import_check: bool = False) -> Result:
        patches = select(ids)
        notes: list[str] = []
        if self.store.journal_path.exists():
            with Lock(self.target.site, self.lock_timeout):
                self._recover(notes)
        reports = self.scan(patches)
        result = Result("verify", self.target, reports, notes=notes)
        statuses = {r.status for r in reports}
        if statuses & {DRIFTED, UNSUPPORTED}:
            result.code = ExitCode.REFUSED
        elif statuses & {PENDING, LOST}:
            result.code = ExitCode.NOT_APPLIED
        if import_check and result.code == ExitCode.OK:
            rels = [f.path for r in reports for f in r.files if f.status == APPLIED]
            _import_check(self.target, rels, self.python)
        return result

    def apply(self, ids=None, dry_run: bool = False, allow_untested: bool = False,
              import_check: bool = False) -> Result:
        patches = select(ids)
        notes: list[str] = []
        with Lock(self.target.site, self.lock_timeout):
            self._recover(notes)
            state = self._state()
            src = _Sources(self.target)
            reports = _scan(self.target, state, series(), src)
            selected = {p.id for p in patches}
            refusals = []
            for r in reports:
                st = r.status
                if r.patch.id in selected and st in (DRIFTED, UNSUPPORTED):
                    refusals.append(f"{r.patch.id}: {st}: {r.reason}")
                elif r.patch.id in selected and st == PENDING and not allow_untested:
                    untested = [f for f in r.files if f.finding and f.finding.untested]
                    if untested:
                        refusals.append(f"{r.patch.id}: {untested[0].reason}; pass --allow-untested "
                                        "(the anchors still match exactly once) to apply anyway")
                elif r.patch.id not in selected and r.patch.id in state.patches and st == DRIFTED:
                    refusals.append(f"{r.patch.id} (applied earlier): drifted: {r.reason}")
            shown = [r for r in reports if r.patch.id in selected]
            if refusals:
                raise _RefusedWith(Result("apply", self.target, shown, notes=notes), "; ".join(refusals))
            desired = [p.id for p in series()
                       if (p.id in state.patches and p.id not in selected
                           and _report(reports, p.id).status == APPLIED)
                       or (p.id in selected and _report(reports, p.id).status in (PENDING, APPLIED, LOST))]
            changes, new_state = _plan(self.target, state, self.store, src, desired, allow_untested)
            result = Result("apply", self.target, shown, notes=notes)
            if dry_run:
                result.diff = _diff(changes)
                return result
            if changes or new_state.files != state.files or new_state.patches != state.patches:
                post = None
                if import_check:
                    post = lambda: _import_check(self.target, [c.rel for c in changes], self.python)  # noqa: E731
                tx.commit(self.store, "apply", changes,
                          new_state.to_json(__version__) if new_state.files else None, post)
                self.store.gc({r.pristine for r in new_state.files.values()})
                result.changed = bool(changes)
            result.reports = self.scan(patches)
            return result

    def revert(self, ids=None, force: bool = False, dry_run: bool = False) -> Result:
        patches = select(ids)
        notes: list[str] = []
        with Lock(self.target.site, self.lock_timeout):
            self._recover(notes)
            state = self._state()
            src = _Sources(self.target)
            selected = {p.id for p in patches}
            reports = _scan(self.target, state, series(), src)
            shown = [r for r in reports if r.patch.id in selected]
            # Files recorded in state that something else modified since apply.
            drifted = sorted({f.path for r in reports if r.patch.id in state.patches
                              for f in r.files if f.status == DRIFTED and f.path in state.files})
            remaining = [p for p in state.patches if p not in selected]
            shared_drift = [rel for rel in drifted if any(
                pid in remaining for pid in state.files[rel].patches)]
            if drifted and not force:
                raise _RefusedWith(Result("revert", self.target, shown, notes=notes),
                                   "modified since apply: " + ", ".join(drifted)
                                   + "; revert --force restores the pristine bytes (dropping those edits)")
            if shared_drift:
                raise _RefusedWith(Result("revert", self.target, shown, notes=notes),
                                   "modified since apply and shared with patches that stay applied: "
                                   + ", ".join(shared_drift) + "; revert those patches too")
            changes, new_state = _plan(self.target, state, self.store, src, remaining, allow_untested=True)
            result = Result("revert", self.target, shown, notes=notes)
            if dry_run:
                result.diff = _diff(changes)
                return result
            if changes or state.files or state.patches:
                def post() -> None:
                    for c in changes:
                        if c.rel not in new_state.files:
                            record = self.target.record.get(c.rel)
                            if record is not None and sha256(c.after) != record:
                                raise ValidationFailed(f"{c.rel}: restored bytes differ from RECORD")

                tx.commit(self.store, "revert", changes,
                          new_state.to_json(__version__) if new_state.files else None, post)
                self.store.gc({r.pristine for r in new_state.files.values()})
                result.changed = bool(changes)
            result.reports = self.scan(patches)
            return result


def _report(reports: list[PatchReport], pid: str) -> PatchReport:
    return next(r for r in reports if r.patch.id == pid)


class _RefusedWith(Refused):
    """A refusal that still carries the scan (for the status table and JSON)."""

    def __init__(self, result: Result, message: str):
        super().__init__(message + "; nothing was changed")
        self.result = result
        result.code = ExitCode.REFUSED


RefusedWith = _RefusedWith
