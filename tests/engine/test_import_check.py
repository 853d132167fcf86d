"""Issue 15 item 10: `verify --import` says whether vLLM itself cannot import (a missing
dependency: exit 4, not the patches' fault) or the patched modules do not import (exit 5).
Real vLLM 0.28.0 (the whole wheel, as an overlay site)."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

import vllm_wheels
from helpers import REPO, patch_files, run_cli, statuses

ID = "dflash-prefix-cache-drop"  # no runtime of ours: the import check is about vLLM's own modules


@pytest.fixture
def site028(tmp_path):
    spec = importlib.util.spec_from_file_location("overlay", REPO / "tests/patches/prefix_cache/overlay.py")
    overlay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(overlay)
    site = overlay.overlay_site(tmp_path / "site", vllm_wheels.full("0.28.0"), patch_files())
    rc, doc, err = run_cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied", err
    return site


ENV = {"CUDA_VISIBLE_DEVICES": "", "PYTHONDONTWRITEBYTECODE": "1"}


def test_vllm_itself_missing_a_dependency_is_an_environment_error(site028):
    bare = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "/usr/bin/python3"
    import subprocess

    if subprocess.run([bare, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"{bare} has torch: no interpreter without vLLM's dependencies here")
    rc, doc, err = run_cli("verify", "--vllm-path", str(site028), "--python", bare, "--patch", ID, "--import",
                           "--json", env={**ENV, "PYTHONPATH": str(site028)})
    assert rc == 4, err
    assert "vLLM itself cannot be imported" in doc["error"] and "missing dependency 'torch'" in doc["error"]
    assert "not caused by the patched modules" in doc["error"]


def test_patched_modules_that_do_not_import_are_a_validation_failure(site028):
    # The scheduler (patched) imports request_queue (not patched): take that module away
    # (in the overlay it is a link into the cached wheel: only the link goes).
    link = site028 / "vllm/v1/core/sched/request_queue.py"
    assert link.is_symlink()
    link.unlink()
    rc, doc, err = run_cli("verify", "--vllm-path", str(site028), "--patch", ID, "--import", "--json", env=ENV,
                           timeout=600)
    assert rc == 5, err
    assert "the patched modules do not import" in doc["error"]
    assert "vllm.v1.core.sched.scheduler" in doc["error"] and "request_queue" in doc["error"]
    assert "vLLM itself" not in doc["error"]
