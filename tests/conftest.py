"""Shared fixtures: real vLLM releases laid out as site-packages folders.

Helpers live in tests/helpers.py and tests/vllm_wheels.py (``pythonpath = tests`` in pyproject).
"""

from __future__ import annotations

import pytest

import vllm_wheels
from helpers import patch_files, run_cli


# The longest test files, longest first. scripts/run-tests.sh runs the suite in two processes
# (pytest-xdist, whole files per process): starting these first keeps one process from being left
# with one of them at the end while the other is idle. Serial runs only see another file order.
SLOW_FIRST = (
    "runtime_matrix/test_runtime_matrix.py",
    "patches/test_ddtree_e2e.py",
    "engine/test_crash_campaign.py",
    "patches/test_ddtree_tree_step.py",
    "patches/test_dflash_sliding_window.py",
    "patches/hook_parity/test_hook_parity.py",
    "patches/test_dflash_prefix_cache_drop.py",
    "patches/test_tree_walk_hook.py",
    "engine/test_docs.py",
    "engine/test_reliability.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))


@pytest.fixture
def make_site(tmp_path):
    """``make_site(version, dist="vllm", full=False)`` -> a fresh site-packages copy of a release.

    By default only the files the patches read are copied (fast); ``full=True`` copies every
    .py file of the wheel."""
    counter = iter(range(1000))

    def make(version: str, dist: str = "vllm", full: bool = False):
        dest = tmp_path / f"site{next(counter)}-{dist}-{version}"
        return vllm_wheels.lay_out_site(dest, version, dist, None if full else patch_files())

    return make


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def matrix_scan(tmp_path_factory):
    """({version: {patch id: status}}, fingerprint entries) for every release, by fresh parses."""
    import matrix_doc

    return matrix_doc.scan_matrix(tmp_path_factory.mktemp("matrix-scan"))


@pytest.fixture(scope="session")
def matrix_statuses(matrix_scan):
    """{version: {patch id: status}} for every release of the matrix, as a fresh scan sees it."""
    return matrix_scan[0]
