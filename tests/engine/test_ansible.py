"""The Ansible example, for real (ansible-core from the package index, tests/requirements.txt),
against a local host (local connection) described by an inventory file, as an operator would:
host and group variables, no ``-e`` for what the inventory sets (extra vars win over everything,
so a test passing them cannot see a play that ignores the inventory; issue 39).

The "vLLM host" is a fresh virtual environment whose site-packages holds the official vLLM 0.20.0
wheel's files; the playbook installs ddtree-patch there with that environment's pip, from a wheel
built from this checkout (the install source an operator controls), applies, verifies, restarts
vLLM through the configured command, and on a later run reverts. First run: changed; second run:
nothing changed, no restart; revert: every file matches the wheel's RECORD again. Without an
install source, or with a bare package name the public index would answer, every host fails
before pip runs.
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
INSTALL = "ddtree-patch is installed in vLLM's environment"
SOURCE = "the install source is one the operator controls"


def _playbook(tmp: Path, inventory: Path, *extra: str, ok: bool = True):
    """Run the example playbook (-v: each task's result as JSON); returns ({(task, host):
    (ok|changed|skipping|failed|fatal, result dict)}, {host: recap counts}, output)."""
    exe = Path(sys.executable).with_name("ansible-playbook")
    env = {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8", "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_HOME": str(tmp / "ansible-home"), "ANSIBLE_LOCAL_TEMP": str(tmp / "ansible-tmp"),
           "ANSIBLE_REMOTE_TEMP": str(tmp / "ansible-tmp"), "ANSIBLE_RETRY_FILES_ENABLED": "0",
           "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.default", "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
           "ANSIBLE_CALLBACK_FORMAT_PRETTY": "0"}
    proc = subprocess.run([str(exe), "-v", "-i", str(inventory), str(PLAYBOOK), *extra],
                          capture_output=True, text=True, env=env, cwd=str(tmp), timeout=600)
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, out[-6000:]
    tasks, current = {}, None
    for line in proc.stdout.splitlines():
        m = re.match(r"(?:TASK|RUNNING HANDLER) \[(?:ddtree_patch : )?(.+?)\]", line)
        if m:
            current = m.group(1)
        m = re.match(r"(ok|changed|skipping|failed|fatal): \[([^\]]+)\](?:: FAILED!)?(?: => (\{.*\}))?\s*$", line)
        if m and current:
            tasks[(current, m.group(2))] = (m.group(1), json.loads(m.group(3)) if m.group(3) else {})
    recap = {host: {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counts)}
             for host, counts in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", proc.stdout, re.M)}
    return tasks, recap, out


def test_ansible_example_takes_the_inventory_applies_restarts_and_reverts(tmp_path):
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
    # The install source the operator controls: a wheel built from this checkout.
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
                   check=True, cwd=str(tmp_path))
    wheel = next(wheels.glob("ddtree_patch-*.whl"))
    restarts = tmp_path / "restarts.log"
    restart = tmp_path / "restart-vllm"
    restart.write_text(f"#!/bin/sh\necho restarted >> {restarts}\n")
    restart.chmod(0o755)
    # Everything from the inventory, as docs/fleet.md says: vllm_python per host, the rest per group.
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(
        "[vllm]\n"
        f"vllm-host ansible_connection=local ansible_python_interpreter={sys.executable} vllm_python={py}\n\n"
        "[vllm:vars]\n"
        f"ddtree_patch_package={wheel}\n"
        f"ddtree_patch_restart_command={restart}\n")
    h = "vllm-host"

    tasks, recap, out = _playbook(tmp_path, inventory)
    status, result = tasks[(INSTALL, h)]
    assert status == "changed" and str(env_dir / "bin" / "pip") in " ".join(map(str, result["cmd"])), out
    status, result = tasks[("apply", h)]
    assert status == "changed" and result["cmd"][:4] == [str(env_dir / "bin" / "ddtree-patch"), "apply",
                                                         "--python", str(py)], out
    doc = json.loads(result["stdout"])
    assert doc["vllm"]["path"] == str(site / "vllm") and doc["restart_required"] is True, out
    assert tasks[("verify (health check)", h)][0] == "ok" and tasks[("revert", h)][0] == "skipping", out
    assert tasks[("restart vllm (command)", h)][0] == "changed", out
    assert tasks[("restart vllm (systemd unit)", h)][0] == "skipping", out
    assert restarts.read_text().splitlines() == ["restarted"], out
    patched = [rel for rel in record if rel.startswith("vllm/") and (site / rel).exists()
               and sha256((site / rel).read_bytes()) != record[rel]]
    assert len(patched) >= 2, out

    tasks, recap, out = _playbook(tmp_path, inventory)  # the same run again: nothing to do, no restart
    assert tasks[(INSTALL, h)][0] == "ok" and tasks[("apply", h)][0] == "ok", out
    assert tasks[("verify (health check)", h)][0] == "ok", out
    assert recap[h]["changed"] == 0 and recap[h]["failed"] == 0, out
    assert restarts.read_text().splitlines() == ["restarted"], out

    # Revert, with no restart configured: the handler still runs, to say the host needs one.
    tasks, recap, out = _playbook(tmp_path, inventory, "-e", "ddtree_patch_state=reverted",
                                  "-e", "ddtree_patch_restart_command=")
    assert tasks[("revert", h)][0] == "changed" and tasks[("apply", h)][0] == "skipping", out
    assert tasks[("restart vllm (not configured)", h)][0] == "ok" and "RESTART NEEDED" in out, out
    for rel, digest in record.items():
        if rel.startswith("vllm/") and (site / rel).exists():
            assert sha256((site / rel).read_bytes()) == digest, rel
    assert not (site / ".ddtree-patch").exists()


def test_ansible_example_never_installs_a_bare_name_from_the_public_index(tmp_path):
    """No install source set, or a bare name that PyPI would answer (the name ddtree-patch is
    unclaimed there): the host fails before pip runs, saying what to set."""
    if not Path(sys.executable).with_name("ansible-playbook").exists():
        pytest.fail("ansible-playbook is missing: install tests/requirements.txt (ansible-core)")
    local = f"ansible_connection=local ansible_python_interpreter={sys.executable} vllm_python={tmp_path}/bin/python"
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(
        "[vllm]\n"
        f"unset {local}\n"
        f"bare {local} ddtree_patch_package=ddtree-patch\n"
        f"pinned-name {local} ddtree_patch_package=ddtree-patch==0.1.0\n"
        f"extra-index {local} ddtree_patch_package=ddtree-patch "
        "ddtree_patch_pip_args='--extra-index-url https://pypi.internal/simple'\n"
        f"own-index {local} ddtree_patch_package=ddtree-patch "
        f"ddtree_patch_pip_args='--no-index --find-links {tmp_path}'\n")
    tasks, recap, out = _playbook(tmp_path, inventory, ok=False)
    # A name is fine where the pip arguments replace the public index (here one with no wheel).
    assert tasks[(SOURCE, "own-index")][0] == "ok" and tasks[(INSTALL, "own-index")][0] in ("failed", "fatal"), out
    for host in ("unset", "bare", "pinned-name", "extra-index"):
        status, result = tasks[(SOURCE, host)]
        assert status in ("failed", "fatal") and "unclaimed" in result["msg"], (host, out)
        assert (INSTALL, host) not in tasks and recap[host]["failed"] == 1, (host, out)
