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
