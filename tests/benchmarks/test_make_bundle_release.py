"""scripts/make_bundle_release.sh: the GPU bundle of a release make_bundle.sh has no pin list for.

The real make_bundle.sh lives outside the repository (../shared/gpu) and downloads ~100 wheels; here a
stand-in with the same `case` anchor prints the pin list it would download, so the test checks only what
the wrapper adds: 0.34.0's list without transformers / huggingface-hub / tokenizers, openai-harmony for
0.28.x, a refusal for other releases and when the anchor is gone.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_bundle_release.sh"

STAND_IN = """#!/bin/bash
PINNED="old==1"
PINNED_0340="aiohttp==3.14.5 huggingface-hub==2.4.0 oss-harmony==0.0.11
tokenizers==0.23.3 transformers==5.22.2 xgrammar==0.2.8"
case "$VLLM_VERSION" in
  0.34.*) PINNED=$PINNED_0340 ;;
esac
echo "PINS $PINNED"
"""


def run(tmp_path, version, stand_in=STAND_IN):
    shared = tmp_path / "gpu"
    (shared / "shim034").mkdir(parents=True, exist_ok=True)
    (shared / "make_bundle.sh").write_text(stand_in)
    (shared / "device_install.sh").write_text("")
    env = dict(os.environ, SHARED_GPU=str(shared), VLLM_VERSION=version)
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=env, capture_output=True, text=True)


def pins(r):
    line = next(l for l in r.stdout.splitlines() if l.startswith("PINS "))
    return line.split()[1:]


def test_0_28_takes_0_34s_pins_without_the_device_packages_and_with_openai_harmony(tmp_path):
    r = run(tmp_path, "0.28.0")
    assert r.returncode == 0, r.stderr
    assert pins(r) == ["aiohttp==3.14.5", "openai-harmony==0.0.8", "xgrammar==0.2.8"]


def test_0_33_keeps_oss_harmony(tmp_path):
    r = run(tmp_path, "0.33.0")
    assert r.returncode == 0, r.stderr
    assert pins(r) == ["aiohttp==3.14.5", "oss-harmony==0.0.11", "xgrammar==0.2.8"]


def test_other_releases_are_refused_by_name(tmp_path):
    r = run(tmp_path, "0.26.0")
    assert r.returncode == 2 and "0.28.x and 0.33.x" in r.stderr


def test_a_make_bundle_without_the_anchor_is_refused(tmp_path):
    r = run(tmp_path, "0.28.0", STAND_IN.replace("  0.34.*) PINNED=$PINNED_0340 ;;\n", ""))
    assert r.returncode != 0 and "0.34 case line" in r.stderr
