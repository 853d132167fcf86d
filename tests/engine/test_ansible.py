"""Issue 15 item 12: the Ansible example, for real (ansible-core from the package index,
tests/requirements.txt), against localhost with the local connection.

The "vLLM host" is a fresh virtual environment whose site-packages holds the official vLLM 0.20.0
wheel's files; the playbook installs ddtree-patch there with pip (from a wheel built from this
checkout), applies, verifies, and on a later run reverts. First run: changed; second run:
nothing changed; revert: every file matches the wheel's RECORD again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_wheels
from helpers import REPO, patch_files
from ddtree_patcher.state import sha256
from ddtree_patcher.target import read_record

PLAYBOOK = REPO / "examples" / "ansible" / "ddtree-patch.yml"
VERSION = "0.20.0"


def _playbook(tmp: Path, *extra: str) -> tuple[dict[str, str], dict[str, int], str]:
    """Run the example playbook; returns ({task: ok|changed|skipping|failed}, recap counts, output)."""
    exe = Path(sys.executable).with_name("ansible-playbook")
    env = {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8", "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_HOME": str(tmp / "ansible-home"), "ANSIBLE_LOCAL_TEMP": str(tmp / "ansible-tmp"),
           "ANSIBLE_REMOTE_TEMP": str(tmp / "ansible-tmp"), "ANSIBLE_RETRY_FILES_ENABLED": "0",
           "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.default"}
    proc = subprocess.run([str(exe), "-i", "localhost,", "-c", "local", str(PLAYBOOK),
                           "-e", f"ansible_python_interpreter={sys.executable}", "-e", "ddtree_patch_hosts=localhost",
                           *extra], capture_output=True, text=True, env=env, cwd=str(tmp), timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    tasks, current = {}, None
    for line in proc.stdout.splitlines():
        m = re.match(r"(?:TASK|RUNNING HANDLER) \[(.+?)\]", line)
        if m:
            current = m.group(1)
        m = re.match(r"(ok|changed|skipping|failed|fatal): \[localhost\]", line)
        if m and current:
            tasks[current] = m.group(1)
    recap = re.search(r"localhost\s+:\s+(.*)", proc.stdout)
    counts = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", recap.group(1))} if recap else {}
    return tasks, counts, out


def test_ansible_example_applies_is_idempotent_and_reverts(tmp_path):
    if not Path(sys.executable).with_name("ansible-playbook").exists():
        pytest.fail("ansible-playbook is missing: install tests/requirements.txt (ansible-core)")
    # The vLLM host: a virtual environment with the official wheel's files in its site-packages.
    env_dir = tmp_path / "vllm-env"
    base = getattr(sys, "_base_executable", None) or shutil.which("python3")
    subprocess.run([base, "-m", "venv", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    site = vllm_wheels.lay_out_site(Path(purelib), VERSION, "vllm", patch_files())
    record = read_record(next(site.glob("vllm-*.dist-info")))
    # What the fleet's package index would serve: a wheel of this checkout.
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
                   check=True, cwd=str(tmp_path))
    extra = ["-e", json.dumps({"vllm_python": str(py), "ddtree_patch_pip_args": f"--find-links {wheels}"})]

    tasks, counts, out = _playbook(tmp_path, *extra)
    assert tasks["ddtree-patch is installed in vLLM's environment"] == "changed", out
    assert tasks["apply"] == "changed" and tasks["verify (health check)"] == "ok", out
    assert tasks["revert"] == "skipping", out
    patched = [rel for rel in record if rel.startswith("vllm/") and (site / rel).exists()
               and sha256((site / rel).read_bytes()) != record[rel]]
    assert len(patched) >= 2, out

    tasks, counts, out = _playbook(tmp_path, *extra)  # the same run again: nothing to do
    assert tasks["apply"] == "ok" and tasks["verify (health check)"] == "ok", out
    assert counts["changed"] == 0 and counts["failed"] == 0, out

    tasks, counts, out = _playbook(tmp_path, *extra, "-e", "ddtree_patch_state=reverted")
    assert tasks["revert"] == "changed" and tasks["apply"] == "skipping", out
    for rel, digest in record.items():
        if rel.startswith("vllm/") and (site / rel).exists():
            assert sha256((site / rel).read_bytes()) == digest, rel
    assert not (site / ".ddtree-patch").exists()
