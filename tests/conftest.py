"""Shared fixtures: real vLLM releases laid out as site-packages folders.

Helpers live in tests/helpers.py and tests/vllm_wheels.py (``pythonpath = tests`` in pyproject).
"""

from __future__ import annotations

import pytest

import vllm_wheels
from helpers import patch_files, run_cli


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
