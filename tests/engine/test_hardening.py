"""Issue 15: symbolic links, planted names, wedges, bad inputs and exit codes (one test per repro).

Everything runs the installed console script against real vLLM 0.20.0 files laid out as a site.
The full-disk repros (real tmpfs) are in test_full_disk.py, the syscall-level crash campaign in
test_crash_campaign.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import run_cli, statuses, tree_bytes
from ddtree_patcher.state import Lock, sha256

VERSION = "0.20.0"
ID = "dflash-prefix-cache-drop"  # two small files (scheduler.py, speculative.py): a cheap real apply
SCHED = "vllm/v1/core/sched/scheduler.py"
STATE = ".ddtree-patch"


@pytest.fixture
def site(make_site):
    return make_site(VERSION)


def _apply(site, *extra):
    rc, doc, err = run_cli("apply", "--vllm-path", str(site), "--patch", ID, "--json", *extra)
    assert rc == 0 and statuses(doc)[ID] == "applied", err
    return doc


def _outside(tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    out.mkdir()
    for name in ("precious.txt", "a" * 64):
        (out / name).write_text("precious\n")
    os.chmod(out / "precious.txt", 0o600)
    return out


def _untouched(out: Path) -> None:
    assert sorted(p.name for p in out.iterdir()) == sorted(["precious.txt", "a" * 64])
    for p in out.iterdir():
        assert p.read_text() == "precious\n"
    assert os.stat(out / "precious.txt").st_mode & 0o777 == 0o600


# ---- 2. a kill while the pre-flight probe exists must not wedge the tool ----------------------

def test_stale_probe_and_temp_files_do_not_wedge_and_are_removed(site):
    """What a kill between creating and removing the probe (or a temp file) leaves: files with
    the tool's fixed names of old. Today every later apply/revert exits 4 ("File exists")."""
    pristine = tree_bytes(site)
    stale = [site / "vllm/v1/core/sched/.ddtree-patch-probe.ddtree-patch-tmp",
             site / "vllm/v1/core/sched/.scheduler.py.ddtree-patch-tmp",
             site / STATE / ".ddtree-patch-probe.ddtree-patch-tmp",
             site / STATE / "backups" / ".0123.ddtree-patch-tmp"]
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"half")
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 6, err  # verify recovers too (it takes the lock only when there is something to recover)
    assert not any(p.exists() for p in stale)
    assert "temp file(s) of an interrupted run" in " ".join(doc["notes"])
    assert not (site / STATE).exists()  # nothing applied: the state folder went too
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"half")
    _apply(site)
    assert not any(p.exists() for p in stale)
    assert run_cli("revert", "--vllm-path", str(site), "--json")[0] == 0
    assert tree_bytes(site) == pristine


# ---- 3. a symbolic link in the state folder: nothing outside the site is touched -----------

@pytest.mark.parametrize("what", ["backups", "state-dir", "lock", "lock-dangling", "state.json", "journal.json",
                                  "scan-cache.json", "a-backup"])
def test_symlinks_in_the_state_folder_are_refused(site, tmp_path, what):
    out = _outside(tmp_path)
    state = site / STATE
    if what == "state-dir":
        os.symlink(out, state)
    else:
        _apply(site)
        if what == "backups":  # today: clean-up of old backups deletes every file in the link's target
            shutil.rmtree(state / "backups")
            os.symlink(out, state / "backups")
        elif what == "lock":  # today: the outside file is truncated to 0 bytes
            (state / "lock").unlink()
            os.symlink(out / "precious.txt", state / "lock")
        elif what == "lock-dangling":  # today: created outside
            (state / "lock").unlink()
            os.symlink(out / "created-by-us", state / "lock")
        elif what == "a-backup":
            victim = next(p for p in (state / "backups").iterdir())
            victim.unlink()
            os.symlink(out / "precious.txt", victim)
        else:
            target = state / what
            if target.exists():
                (out / "copy").write_bytes(target.read_bytes())
                target.unlink()
            os.symlink(out / "copy", target)
    before = tree_bytes(site)
    for command in (["verify", "--patch", ID], ["apply", "--patch", ID], ["revert"], ["revert", "--force"]):
        rc, doc, err = run_cli(*command, "--vllm-path", str(site), "--json")
        if what == "a-backup" and command[0] == "verify":
            assert rc == 0 and doc["warnings"], err  # verify itself needs no backup: it warns
            continue
        if what == "a-backup" and command[0] == "apply":
            assert rc == 0 and doc["changed"] is False, err  # nothing to write: no backup read
            continue
        assert rc == 3, (command, err)
        assert "symbolic link" in err and ("nothing was changed" in err or "cannot be used" in err), err
    assert tree_bytes(site) == before
    (out / "copy").unlink(missing_ok=True)
    _untouched(out)
    assert not (out / "created-by-us").exists()


def test_a_state_entry_of_the_wrong_kind_is_a_named_refusal(site, tmp_path):
    """Exit 1 today: the state path a folder, backups a file, a backup a folder, a journal
    without state_after."""
    _apply(site)
    state = site / STATE
    saved = (state / "state.json").read_bytes()
    cases = []

    def state_is_a_folder():
        (state / "state.json").unlink()
        (state / "state.json").mkdir()

    def backups_is_a_file():
        shutil.move(state / "backups", tmp_path / "backups")
        (state / "backups").write_text("x")

    def a_backup_is_a_folder():
        pristine = json.loads(saved)["files"][SCHED]["pristine"]
        (state / "backups" / pristine).unlink()
        (state / "backups" / pristine).mkdir()

    def journal_without_state_after():
        (state / "journal.json").write_text(json.dumps({"schema": 1, "op": "apply", "entries": [],
                                                        "state_before": None}))

    for fn, want in ((state_is_a_folder, "not a regular file"), (backups_is_a_file, "not a real folder"),
                     (a_backup_is_a_folder, "not a regular file"), (journal_without_state_after, "state_after")):
        fn()
        rc, doc, err = run_cli("revert", "--vllm-path", str(site), "--json")
        assert rc == 3, (fn.__name__, err)
        assert want in doc["error"] and "internal error" not in err, (fn.__name__, err)
        cases.append(fn.__name__)
        # put it back for the next case
        for name in ("state.json", "journal.json"):
            p = state / name
            if p.is_dir():
                p.rmdir()
            elif name == "journal.json":
                p.unlink(missing_ok=True)
        (state / "state.json").write_bytes(saved)
        if (state / "backups").is_file():
            (state / "backups").unlink()
            shutil.move(tmp_path / "backups", state / "backups")
        for p in (state / "backups").iterdir():
            if p.is_dir():
                p.rmdir()
    assert len(cases) == 4


# ---- 4/5. planted links at the names the tool writes ----------------------------------------

def test_links_planted_at_temp_names_are_never_written_through(site, tmp_path):
    out = _outside(tmp_path)
    (site / STATE / "backups").mkdir(parents=True)
    planted = [site / "vllm/v1/core/sched/.scheduler.py.ddtree-patch-tmp",
               site / "vllm/config/.speculative.py.ddtree-patch-tmp",
               site / STATE / ".state.json.ddtree-patch-tmp", site / STATE / ".journal.json.ddtree-patch-tmp",
               site / STATE / ".scan-cache.json.ddtree-patch-tmp", site / STATE / ".ddtree-patch-probe.ddtree-patch-tmp"]
    for p in planted:
        os.symlink(out / "precious.txt", p)
    rc, doc, err = run_cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"], err
    assert not (site / SCHED).is_symlink() and (site / SCHED).is_file()
    rc, doc, err = run_cli("revert", "--vllm-path", str(site), "--json")
    assert rc == 0, err
    _untouched(out)
    assert all(p.is_symlink() for p in planted)  # not ours: left alone (never deleted, never followed)


def test_a_patched_file_replaced_by_a_link_is_refused(site, tmp_path):
    out = _outside(tmp_path)
    _apply(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(site / SCHED, elsewhere / "scheduler.py")
    saved = (elsewhere / "scheduler.py").read_bytes()
    (site / SCHED).unlink()
    os.symlink(elsewhere / "scheduler.py", site / SCHED)
    for command in (["revert"], ["revert", "--force"], ["apply"]):
        rc, doc, err = run_cli(*command, "--vllm-path", str(site), "--json")
        assert rc == 3 and "symbolic link" in err, (command, err)
    assert (elsewhere / "scheduler.py").read_bytes() == saved and (site / SCHED).is_symlink()
    _untouched(out)


# ---- 6. bytecode clean-up never globs the site path -----------------------------------------

def test_bytecode_cleanup_treats_the_site_path_literally(tmp_path):
    import vllm_wheels
    from helpers import patch_files

    def layout(name):
        return vllm_wheels.lay_out_site(tmp_path / name / "site", VERSION, "vllm", patch_files())

    neighbour = layout("gAx")
    star = layout("g*x")
    bracket = layout("b[1]")
    pycs = {}
    for s in (neighbour, star, bracket):
        cache = s / "vllm/v1/core/sched/__pycache__"
        cache.mkdir()
        pycs[s] = [cache / "scheduler.cpython-311.pyc", cache / "scheduler.cpython-312.opt-1.pyc"]
        for p in pycs[s]:
            p.write_bytes(b"stale")
        (cache / "scheduler_helper.cpython-311.pyc").write_bytes(b"other module")
    for s in (star, bracket):
        _apply(s)
    assert all(p.exists() for p in pycs[neighbour])  # today: deleted through the glob g*x
    assert not any(p.exists() for p in pycs[star] + pycs[bracket])  # today: [1] keeps them
    for s in (neighbour, star, bracket):
        assert (s / "vllm/v1/core/sched/__pycache__/scheduler_helper.cpython-311.pyc").exists()


def test_bytecode_under_a_pycache_prefix_only_the_files_own_mirror(site, tmp_path):
    prefix = tmp_path / "pycache-prefix"
    mirror = prefix / str(site / "vllm/v1/core/sched").lstrip("/")
    mirror.mkdir(parents=True)
    (mirror / "scheduler.cpython-311.pyc").write_bytes(b"stale")
    (mirror / "request_queue.cpython-311.pyc").write_bytes(b"keep")
    rc, doc, err = run_cli("apply", "--vllm-path", str(site), "--patch", ID, "--json",
                           env={"PYTHONPYCACHEPREFIX": str(prefix)})
    assert rc == 0, err
    assert not (mirror / "scheduler.cpython-311.pyc").exists()
    assert (mirror / "request_queue.cpython-311.pyc").read_bytes() == b"keep"


# ---- 7. verify says when revert would be impossible ----------------------------------------

@pytest.mark.parametrize("how", ["missing", "altered"])
def test_verify_warns_when_a_backup_is_missing_or_altered(site, how):
    _apply(site)
    pristine = json.loads((site / STATE / "state.json").read_text())["files"][SCHED]["pristine"]
    backup = site / STATE / "backups" / pristine
    if how == "missing":
        backup.unlink()
    else:
        backup.write_bytes(backup.read_bytes() + b"#")
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied"  # vLLM is patched as recorded ...
    warning = " ".join(doc["warnings"])  # ... but revert cannot restore the original: say so, and the fix
    assert f"is {how}" in warning and SCHED in warning and "pip install --force-reinstall --no-deps vllm==0.20.0" in warning
    assert "warning: " in err
    rc, doc, err = run_cli("revert", "--vllm-path", str(site), "--json")
    assert rc == 3 and "backup" in err


# ---- 8/9. bad inputs: exit 2, 3 or 4 with a reason, never 1 ----------------------------------

@pytest.mark.parametrize("python,said", [("/bin/true", "printed nothing"), ("/bin/echo", "does not answer like"),
                                         ("/bin/false", "no output"), ("/nonexistent/python", "cannot run it")])
def test_a_python_that_is_not_one_is_an_environment_error(site, python, said):
    for extra in ([], ["--vllm-path", str(site)]):
        rc, doc, err = run_cli("verify", "--python", python, *extra, "--json")
        assert rc == 4 and said in doc["error"], err
        assert "internal error" not in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "-inf"])
def test_lock_timeout_must_be_a_finite_number(site, value):
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--lock-timeout", value, timeout=30)
    assert rc == 2 and "not a number of seconds" in err


def test_vllm_path_naming_a_file_is_an_environment_error_with_json(site):
    rc, doc, err = run_cli("verify", "--vllm-path", str(site / SCHED), "--json")
    assert rc == 4 and doc["exit_code"] == 4 and "a file, not a folder" in doc["error"]


@pytest.mark.parametrize("missing", ["RECORD", "METADATA"])
def test_dist_info_without_record_or_metadata_is_said(site, missing):
    info = next(site.glob("*.dist-info"))
    (info / missing).unlink()
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 6, err
    assert doc["vllm"]["dist"] == "source"
    note = " ".join(doc["notes"])
    assert info.name in note and f"no {'readable ' if missing == 'METADATA' else ''}{missing}" in note
    assert "note: " in err


def test_an_over_long_path_is_named_as_such(tmp_path):
    """A temp file needs ~35 more characters than the file it replaces: in a site whose path
    leaves less than that below PATH_MAX (4096) every file still reads, but pre-flight fails.
    Say "file name too long", not "read-only or no permission"."""
    import vllm_wheels

    files = ["vllm/v1/core/sched/scheduler.py", "vllm/config/speculative.py", "vllm/v1/spec_decode/dflash.py"]
    length = 4050  # + "/vllm-0.20.0.dist-info/entry_points.txt" fits; + "/.ddtree-patch/.<probe>" does not
    parts, base = [], str(tmp_path)
    while len(base) + sum(len(p) + 1 for p in parts) < length - 250:
        parts.append("d" * 200)
    parts.append("e" * (length - len(base) - 1 - sum(len(p) + 1 for p in parts)))
    deep = Path(base, *parts)
    assert len(str(deep)) == length
    site = vllm_wheels.lay_out_site(deep, VERSION, "vllm", files)
    rc, doc, err = run_cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 4, err
    assert "file name too long" in doc["error"] and "read-only" not in doc["error"], doc["error"]


def test_already_applied_read_only_site_is_ok(site):
    """Nothing to write must not need write access: 0, as README promises (4 today)."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a read-only bind mount (unshare -m)")
    if not shutil.which("unshare"):
        pytest.fail("running as root needs `unshare` (util-linux) for a read-only mount")
    _apply(site)
    before = tree_bytes(site)
    exe = Path(sys.executable).with_name("ddtree-patch")
    script = f'mount --bind {site} {site} && mount -o remount,ro,bind {site} {site} && exec "$@"'
    for command, want in ((["apply", "--patch", ID], 0), (["verify", "--patch", ID], 0),
                          (["apply", "--patch", ID, "--dry-run"], 0), (["revert"], 4)):
        proc = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(exe), *command, "--vllm-path",
                               str(site), "--json"], capture_output=True, text=True, cwd="/")
        assert proc.returncode == want, (command, proc.stderr)
        doc = json.loads(proc.stdout)
        assert doc["changed"] is False
        if want == 4:
            assert "read-only file system" in doc["error"] and "nothing was changed" in doc["error"]
    assert tree_bytes(site) == before


# ---- 10/11. a Unix tool: data on stdout, next steps, nothing left behind ---------------------

def test_list_prints_its_table_on_stdout():
    exe = Path(sys.executable).with_name("ddtree-patch")
    proc = subprocess.run([str(exe), "list"], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0 and "dflash-layer-offset" in proc.stdout and proc.stderr == ""
    proc = subprocess.run([str(exe), "list", "--json"], capture_output=True, text=True, cwd="/")
    assert json.loads(proc.stdout)["command"] == "list"  # exactly one JSON object


def test_verify_names_the_next_step(site):
    where = f"--vllm-path {site}"
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 6 and doc["next"] == f"run `ddtree-patch apply {where}`"
    assert f"next: run `ddtree-patch apply {where}`" in err
    _apply(site)
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and "next" not in doc
    (site / SCHED).write_bytes((site / SCHED).read_bytes() + b"\n# hotfix\n")
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 3 and doc["next"].startswith(f"`ddtree-patch revert --force {where}` restores the original bytes of {SCHED}")
    assert doc["next"].endswith(f"then `ddtree-patch apply {where}`")
    assert run_cli("revert", "--force", "--vllm-path", str(site))[0] == 0
    (site / SCHED).write_bytes((site / SCHED).read_bytes() + b"\n# foreign\n")
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 3 and doc["next"].startswith("Reinstalling vLLM (`pip install --force-reinstall --no-deps vllm==0.20.0`)")


def test_long_reasons_wrap_to_the_terminal_width(site):
    (site / SCHED).write_bytes((site / SCHED).read_bytes() + b"\n# foreign\n")
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json", env={"COLUMNS": "80"})
    assert rc == 3
    for line in err.splitlines():  # a single word longer than the width (a path) is not broken
        assert len(line) <= 80 or " " not in line.strip() or line.startswith("ddtree-patch verify:"), err
    assert "\n" in next(p for p in err.split("PATCH")[1:]), err
    reason = next(p for p in doc["patches"] if p["id"] == ID)["reason"]
    assert len(reason) > 80 and "\n" not in reason  # the JSON has it whole


def test_a_full_revert_leaves_nothing_behind(site):
    pristine = tree_bytes(site)
    for _ in range(2):
        _apply(site)
        assert (site / STATE / "state.json").exists()
        rc, doc, err = run_cli("revert", "--vllm-path", str(site), "--json")
        assert rc == 0 and doc["changed"], err
        assert not (site / STATE).exists(), list((site / STATE).rglob("*"))  # today: lock, scan-cache, backups/
        assert tree_bytes(site) == pristine
    for command in (["verify"], ["apply", "--dry-run"], ["revert"]):  # nothing applied: nothing created
        assert run_cli(*command, "--vllm-path", str(site))[0] in (0, 6)
        assert not (site / STATE).exists()


def test_the_holder_may_remove_the_lock_and_two_commands_still_exclude(site):
    """Removing the lock file while holding it is safe: a waiter that gets the old (unlinked)
    file sees it is no longer the lock and starts over, so it never holds the lock together with
    a newcomer."""
    a = Lock(site, timeout=5).__enter__()
    got = {}

    def waiter():
        got["b"] = Lock(site, timeout=10).__enter__()

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.3)  # b is waiting on a's lock file
    assert a.remove_state_dir(lambda: False) and not (site / STATE).exists()
    a.__exit__(None, None, None)
    t.join(10)
    b = got["b"]
    assert os.fstat(b.fd).st_ino == os.stat(site / STATE / "lock").st_ino  # b holds the current lock file
    with pytest.raises(Exception, match="lock timeout"):
        Lock(site, timeout=0.3).__enter__()  # a newcomer cannot take it too
    b.__exit__(None, None, None)


def test_concurrent_apply_and_revert_stay_consistent(site):
    """Four processes each applying and reverting, with the lock file (and the whole state
    folder) removed by every full revert: all succeed, and the end state is consistent."""
    exe = Path(sys.executable).with_name("ddtree-patch")
    pristine = tree_bytes(site)
    script = ";".join(f"{exe} {cmd} --vllm-path {site} --patch {ID} --lock-timeout 120 || exit 9"
                      for cmd in ("apply", "revert", "apply", "revert"))
    procs = [subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, errs
    assert tree_bytes(site) == pristine and not (site / STATE).exists()


def test_lock_file_is_created_without_following_links_and_kept_while_applied(site):
    _apply(site)
    lock = site / STATE / "lock"
    assert lock.is_file() and not lock.is_symlink()
    with open(lock) as fh:  # someone else holds it: a timeout names the lock (exit 4)
        fcntl.flock(fh, fcntl.LOCK_EX)
        rc, doc, err = run_cli("revert", "--vllm-path", str(site), "--lock-timeout", "0.2", "--json")
    assert rc == 4 and "lock timeout" in doc["error"]
    assert sha256((site / SCHED).read_bytes()) == json.loads((site / STATE / "state.json").read_text())["files"][SCHED]["patched"]


def test_demo_removes_its_scratch_folder_unless_asked_to_keep_it():
    """scripts/demo.sh leaves no ~600 MB scratch folder behind (whatever the outcome) unless KEEP=1.
    PYTHON=false makes it stop at once, after creating the folder."""
    import re

    from helpers import REPO

    for keep in ("0", "1"):
        proc = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh")], capture_output=True, text=True,
                              env={**os.environ, "PYTHON": "false", "KEEP": keep}, timeout=60)
        assert proc.returncode != 0
        work = Path(re.search(r"== scratch environment: (\S+)", proc.stdout).group(1))
        assert work.exists() == (keep == "1"), proc.stdout
        shutil.rmtree(work, ignore_errors=True)
