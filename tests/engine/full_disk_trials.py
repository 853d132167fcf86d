"""Run inside a private mount namespace (``unshare -m``) by test_full_disk.py, as root:

    python full_disk_trials.py MOUNTPOINT PRISTINE_SITE APPLIED_SITE PATCH_ID MODE LEVEL...

MOUNTPOINT is a fresh tmpfs. For every LEVEL (free bytes): copy the starting site (pristine for
MODE=apply, applied for MODE=revert) into the tmpfs, fill the tmpfs until LEVEL bytes are free,
run ``ddtree-patch MODE``, then free the space and run ``verify`` (the next command, which
recovers) and ``revert``. Prints one JSON line per level: exit codes, messages, and which tree
(pristine / patched / other) was seen after each step.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

EXE = str(Path(sys.executable).with_name("ddtree-patch"))


def tree(site: Path) -> dict[str, str]:
    return {str(p.relative_to(site)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((site / "vllm").rglob("*")) if p.is_file()}


def run(*args: str) -> tuple[int, dict | None, str]:
    proc = subprocess.run([EXE, *args, "--json"], capture_output=True, text=True, cwd="/")
    try:
        doc = json.loads(proc.stdout) if proc.stdout.strip() else None
    except ValueError:
        doc = None
    return proc.returncode, doc, proc.stderr


def fill(mount: Path, free: int) -> None:
    st = os.statvfs(mount)
    avail = st.f_bavail * st.f_frsize
    todo = max(0, avail - free)
    chunk = b"\0" * (1 << 20)
    with open(mount / "filler", "wb") as fh:
        while todo > 0:
            n = min(todo, len(chunk))
            try:
                fh.write(chunk[:n])
                fh.flush()
            except OSError:
                break
            todo -= n


def main() -> None:
    mount, pristine_site, applied_site = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    pid, mode, levels = sys.argv[4], sys.argv[5], [int(x) for x in sys.argv[6:]]
    pristine, patched = tree(pristine_site), tree(applied_site)

    def which(site: Path) -> str:
        t = tree(site)
        return "pristine" if t == pristine else "patched" if t == patched else "other"

    for level in levels:
        site = mount / "site"
        shutil.rmtree(site, ignore_errors=True)
        shutil.copytree(pristine_site if mode == "apply" else applied_site, site, symlinks=True)
        fill(mount, level)
        st = os.statvfs(mount)
        out = {"level": level, "free": st.f_bavail * st.f_frsize}
        args = [mode, "--vllm-path", str(site)] + (["--patch", pid] if mode == "apply" else [])
        out["rc"], doc, err = run(*args)
        out["error"] = (doc or {}).get("error") or ("" if out["rc"] == 0 else err[-600:])
        out["after"] = which(site)
        (mount / "filler").unlink()
        out["verify_rc"], doc, err = run("verify", "--vllm-path", str(site), "--patch", pid)
        out["verify_status"] = {p["id"]: p["status"] for p in (doc or {}).get("patches", [])}.get(pid)
        out["after_verify"] = which(site)
        out["leftovers"] = sorted(str(p.relative_to(site)) for p in site.rglob("*ddtree-patch-tmp*"))
        out["journal"] = (site / ".ddtree-patch" / "journal.json").exists()
        out["revert_rc"], doc, err = run("revert", "--vllm-path", str(site))
        out["after_revert"] = which(site)
        out["state_dir_left"] = (site / ".ddtree-patch").exists()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
