"""Crash campaign at the system-call level (issue 15): ``strace`` fault injection.

Every ``write``/``pwrite64``/``rename``/``unlink``/``fsync``/``ftruncate``/``mkdir``/``rmdir``
of ``apply`` and ``revert`` in turn gets a ``SIGKILL`` (``strace -f -e inject=SYSCALL:signal=
SIGKILL:when=N``); so does every such call of the recovery itself (a ``verify`` run on an
interrupted transaction); and every ``write``/``fsync`` in turn fails with ENOSPC. After each
trial the next command must recover, leave every file pristine or every file patched with the
state agreeing, no journal and no temp file of ours — and then apply/revert must still work:
0 wedged, 0 corrupt.

CI runs it sized to fit (about a minute and a half on 2 cores): one patch
(``dflash-prefix-cache-drop`` on vLLM 0.20.0: the scheduler), kills at every rename, unlink,
mkdir, rmdir, ftruncate, pwrite64 and every write to a file, ENOSPC at every write to a file.
Skipped there, because a kill at them leaves the same files as a kill at the next call: kills at
fsync and at writes to stdout/stderr, ENOSPC at fsync and at stdout/stderr. The full campaign
(all of them, plus ``dflash-layer-offset``: two files, the 221 KB V1 runner) is

    DDTREE_CAMPAIGN=full bash scripts/run-tests.sh tests/engine/test_crash_campaign.py -s

Without strace (or where ptrace is not allowed) the tests are skipped, saying so; the
checkpoint kills of test_reliability.py (DDTREE_PATCH_CRASH_AT) still run.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import tree_bytes
from ddtree_patcher.engine import Engine
from ddtree_patcher.state import sha256
from ddtree_patcher.target import from_site

VERSION = "0.20.0"
EXE = str(Path(sys.executable).with_name("ddtree-patch"))
KILL_CALLS = ("write", "pwrite64", "rename", "unlink", "fsync", "ftruncate", "mkdir", "rmdir")
NOSPACE_CALLS = ("write", "fsync")
FULL = os.environ.get("DDTREE_CAMPAIGN") == "full"
PATCHES = ["dflash-prefix-cache-drop"] + (["dflash-layer-offset"] if FULL else [])


def _strace_works() -> str | None:
    if not shutil.which("strace"):
        return "strace is not installed (apt-get install strace): the syscall campaign needs it"
    proc = subprocess.run(["strace", "-f", "-o", "/dev/null", "true"], capture_output=True, text=True)
    return None if proc.returncode == 0 else f"strace cannot trace here: {proc.stderr.strip()[-200:]}"


pytestmark = pytest.mark.skipif(_strace_works() is not None, reason=str(_strace_works()))


def _cli(args: list[str], inject: str | None = None, trace_to: str | None = None) -> int:
    cmd = [EXE, *args]
    if inject or trace_to:
        calls = ",".join(KILL_CALLS)
        cmd = ["strace", "-f", "-qq", "-o", trace_to or "/dev/null", "-e", f"trace={calls}",
               *(["-e", f"inject={inject}"] if inject else []), *cmd]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/",
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, timeout=300)
    return proc.returncode


def _invocations(args: list[str], tmp: Path, calls=KILL_CALLS) -> dict[str, list[int]]:
    """The invocation numbers (strace counts per syscall) of each of ``calls`` in one
    uninterrupted run: all of them in the full campaign; in CI, no fsync and no write to
    stdout/stderr (see the module docstring)."""
    log = tmp / "trace.log"
    assert _cli(args, trace_to=str(log)) in (0, 6)
    seen: dict[str, int] = collections.Counter()
    out: dict[str, list[int]] = {c: [] for c in calls}
    for line in log.read_text().splitlines():
        m = re.match(r"\d+\s+(\w+)\((\d*)", line)
        if not m or m.group(1) not in KILL_CALLS:
            continue
        call = m.group(1)
        seen[call] += 1
        if call not in calls:
            continue
        if not FULL and (call == "fsync" or (call == "write" and m.group(2) in ("1", "2"))):
            continue
        out[call].append(seen[call])
    return out


class Campaign:
    def __init__(self, site: Path, pid: str, tmp: Path):
        self.site, self.pid, self.tmp = site, pid, tmp
        self.pristine_snap = tmp / f"pristine-{pid}"
        shutil.copytree(site, self.pristine_snap, symlinks=True)
        self.pristine = tree_bytes(site)
        assert _cli(["apply", "--vllm-path", str(site), "--patch", pid]) == 0
        self.patched = tree_bytes(site)
        assert self.patched != self.pristine
        self.applied_snap = tmp / f"applied-{pid}"
        shutil.copytree(site, self.applied_snap, symlinks=True)
        self.stats = collections.Counter()

    def restore(self, snap: Path) -> None:
        shutil.rmtree(self.site)
        shutil.copytree(snap, self.site, symlinks=True)

    def consistent(self, what: str) -> str:
        """Run the next command (verify: it recovers); then the tree is whole and agrees with the
        state, and nothing of an interrupted run is left. Returns "pristine" or "patched"."""
        result = Engine(from_site(self.site)).verify([self.pid])
        doc = result.as_json()
        assert result.code in (0, 6), (what, doc)
        now = tree_bytes(self.site)
        state_dir = self.site / ".ddtree-patch"
        assert not (state_dir / "journal.json").exists(), what
        assert not list(self.site.rglob("*.ddtree-patch-tmp")), (what, list(self.site.rglob("*.ddtree-patch-tmp")))
        status = {p["id"]: p["status"] for p in doc["patches"]}[self.pid]
        if now == self.pristine:
            assert status == "pending", (what, doc)
            assert not (state_dir / "state.json").exists(), what
            return "pristine"
        assert now == self.patched, f"{what}: files are neither all pristine nor all patched (corrupt)"
        assert status == "applied", (what, doc)
        state = json.loads((state_dir / "state.json").read_text())
        for rel, rec in state["files"].items():
            assert sha256(now[rel]) == rec["patched"], what
        return "patched"

    def not_wedged(self, what: str) -> None:
        """apply, then revert, both work after the trial (in this process: same code, no start-up)."""
        engine = Engine(from_site(self.site))
        assert engine.apply([self.pid]).code == 0, what
        assert tree_bytes(self.site) == self.patched, what
        assert Engine(from_site(self.site)).revert([self.pid]).code == 0, what
        assert tree_bytes(self.site) == self.pristine and not (self.site / ".ddtree-patch").exists(), what

    def trial(self, snap: Path, args: list[str], inject: str, what: str, check_wedge: bool) -> tuple[int, str]:
        self.restore(snap)
        rc = _cli(args, inject=inject)
        outcome = self.consistent(what)
        if check_wedge:
            self.not_wedged(what)
        self.stats[(args[0], "killed" if rc in (-9, 137) else f"exit {rc}", outcome)] += 1
        return rc, outcome

    def kills(self, command: str) -> set[str]:
        snap = self.pristine_snap if command == "apply" else self.applied_snap
        self.restore(snap)
        args = [command, "--vllm-path", str(self.site), "--patch", self.pid]
        outcomes = set()
        for call, numbers in _invocations(args, self.tmp).items():
            for n in numbers:
                rc, outcome = self.trial(snap, args, f"{call}:signal=SIGKILL:when={n}", f"{command} {call}#{n}",
                                         check_wedge=n == numbers[-1])
                assert rc in (-9, 137), f"{command} {call}#{n}: not killed (exit {rc}): the count changed"
                outcomes.add(outcome)
        return outcomes

    def no_space(self, command: str) -> list[tuple[str, int, str]]:
        snap = self.pristine_snap if command == "apply" else self.applied_snap
        self.restore(snap)
        args = [command, "--vllm-path", str(self.site), "--patch", self.pid]
        outcomes = []
        for call, numbers in _invocations(args, self.tmp, NOSPACE_CALLS).items():
            for n in numbers:
                rc, outcome = self.trial(snap, args, f"{call}:error=ENOSPC:when={n}", f"{command} ENOSPC {call}#{n}",
                                         check_wedge=False)
                assert rc in (0, 4), f"{command} ENOSPC at {call}#{n}: exit {rc}"
                if rc == 0:  # the failed write was one whose failure is harmless (the scan cache, the lock's pid)
                    assert outcome == ("patched" if command == "apply" else "pristine"), (command, call, n)
                outcomes.append((command, rc, outcome))
        return outcomes


@pytest.fixture(params=PATCHES)
def campaign(request, make_site, tmp_path):
    c = Campaign(make_site(VERSION), request.param, tmp_path)
    yield c
    print(f"\ncampaign {request.param}: " + ", ".join(f"{k[0]} {k[1]} -> {k[2]}: {v}" for k, v in sorted(c.stats.items())))


def test_sigkill_at_every_syscall_of_apply_and_revert(campaign):
    assert campaign.kills("apply") == {"pristine", "patched"}  # killed before and after the commit point
    assert campaign.kills("revert") == {"pristine", "patched"}


def test_enospc_at_every_write_and_fsync(campaign):
    outcomes = set(campaign.no_space("apply") + campaign.no_space("revert"))
    # refused and rolled back, both ways (exit 4 may also come after the commit, when only printing
    # the result failed: the files are then consistent all the same)
    assert ("apply", 4, "pristine") in outcomes and ("revert", 4, "patched") in outcomes, outcomes


def test_sigkill_during_recovery(campaign):
    """Interrupted transactions (checkpoint kills inside the commit), then a kill at every
    syscall of the recovery (`verify` finishing or rolling back)."""
    interrupted = []
    n = sum(1 for rel in campaign.patched if campaign.patched[rel] != campaign.pristine[rel])
    for command, snap in (("apply", campaign.pristine_snap), ("revert", campaign.applied_snap)):
        # checkpoints (transaction.py): 1 pre-flight, 2 backups, 3 journal, then per file a
        # mid-write and an after-write one, then post-check, [mid-state,] state written/removed
        state_done = 3 + 2 * n + (3 if command == "apply" else 2)
        for at in (5, state_done):  # the first file replaced; the state written (journal still there)
            campaign.restore(snap)
            env = {**os.environ, "DDTREE_PATCH_CRASH_AT": str(at)}
            proc = subprocess.run([EXE, command, "--vllm-path", str(campaign.site), "--patch", campaign.pid],
                                  env=env, capture_output=True, cwd="/")
            if proc.returncode == -9 and (campaign.site / ".ddtree-patch" / "journal.json").exists():
                dest = campaign.tmp / f"interrupted-{command}-{at}"
                shutil.copytree(campaign.site, dest, symlinks=True)
                interrupted.append(dest)
    assert len(interrupted) == 4
    outcomes = set()
    for snap in interrupted:
        campaign.restore(snap)
        args = ["verify", "--vllm-path", str(campaign.site), "--patch", campaign.pid]
        for call, numbers in _invocations(args, campaign.tmp).items():
            for n in numbers:
                rc, outcome = campaign.trial(snap, args, f"{call}:signal=SIGKILL:when={n}",
                                             f"recovery {snap.name} {call}#{n}", check_wedge=False)
                outcomes.add(outcome)
    assert outcomes == {"pristine", "patched"}
