"""dflash-layer-offset on the real releases: where it is pending, and what it changes."""

from __future__ import annotations

import ast
import types

import pytest

import vllm_wheels

ID = "dflash-layer-offset"
PENDING = {"0.20.0", "0.20.1", "0.20.2", "0.21.0"}
NOT_APPLICABLE = {"0.19.1"}  # no DFlash


def expected(version: str) -> str:
    if version in PENDING:
        return "pending"
    if version in NOT_APPLICABLE:
        return "not-applicable"
    return "upstream"


@pytest.mark.parametrize("version", vllm_wheels.MATRIX)
def test_status_per_release(version, matrix_statuses):
    assert matrix_statuses[version][ID] == expected(version)


def _function(source: bytes, qualname: str, namespace: dict) -> types.FunctionType:
    """Compile one function of a (patched) vLLM file and return it, decorators dropped."""
    tree = ast.parse(source)
    body, node = tree.body, None
    for part in qualname.split("."):
        node = next(n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
        body = node.body
    node.decorator_list = []
    module = ast.Module(body=[node], type_ignores=[])
    exec(compile(module, qualname, "exec"), namespace)
    return namespace[node.name]


def _runner_with(hf_config):
    draft = types.SimpleNamespace(hf_config=hf_config)
    return types.SimpleNamespace(speculative_config=types.SimpleNamespace(draft_model_config=draft))


@pytest.mark.parametrize("version", sorted(PENDING))
def test_patched_code_adds_one_and_keeps_speculators_ids(version, make_site, cli):
    site = make_site(version)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"], err
    runner_src = (site / "vllm/v1/worker/gpu_model_runner.py").read_bytes()
    aux_layers = _function(runner_src, "GPUModelRunner._get_eagle3_aux_layers_from_config", {})

    dflash = types.SimpleNamespace(dflash_config={"mask_token_id": 7, "target_layer_ids": [1, 17, 33]})
    assert aux_layers(_runner_with(dflash)) == (2, 18, 34)
    speculators = types.SimpleNamespace(eagle_aux_hidden_state_layer_ids=[2, 18, 34],
                                        dflash_config={"target_layer_ids": [1, 17, 33]})
    assert aux_layers(_runner_with(speculators)) == (2, 18, 34)  # EAGLE ids take precedence, unchanged

    algos_src = (site / "vllm/transformers_utils/configs/speculators/algos.py").read_bytes()
    update_dflash = _function(algos_src, "update_dflash", {})
    out: dict = {}
    update_dflash({"aux_hidden_state_layer_ids": [2, 18, 34], "mask_token_id": 7}, out)
    assert out["eagle_aux_hidden_state_layer_ids"] == [2, 18, 34]
    assert out["dflash_config"]["target_layer_ids"] == [1, 17, 33]

    # The pristine code fed the raw DFlash ids: the bug the patch fixes.
    pristine = vllm_wheels.extracted(version) / "vllm/v1/worker/gpu_model_runner.py"
    assert _function(pristine.read_bytes(), "GPUModelRunner._get_eagle3_aux_layers_from_config", {})(
        _runner_with(dflash)) == (1, 17, 33)


def _as_source_tree(site):
    """Drop the dist-info: a source tree has no RECORD, so edited code is judged by shape alone."""
    import shutil

    for info in site.glob("*.dist-info"):
        shutil.rmtree(info)
    return site


def test_untested_shape_is_refused_unless_allowed(make_site, cli):
    site = _as_source_tree(make_site("0.20.0"))
    runner = site / "vllm/v1/worker/gpu_model_runner.py"
    text = runner.read_text()
    edited = text.replace("hf_config = self.speculative_config.draft_model_config.hf_config",
                          "hf_config = self.speculative_config.draft_model_config.hf_config  # local tweak", 1)
    assert edited != text
    runner.write_text(edited)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--json")
    assert rc == 3, err
    assert "untested shape" in err and "_get_eagle3_aux_layers_from_config" in err
    assert runner.read_text() == edited
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--allow-untested", "--json")
    assert rc == 0 and doc["changed"], err
    assert "layer_ids = [i + 1 for i in" in runner.read_text()


def test_missing_anchor_is_refused_naming_file_function_and_anchor(make_site, cli):
    site = _as_source_tree(make_site("0.20.0"))
    runner = site / "vllm/v1/worker/gpu_model_runner.py"
    edited = runner.read_text().replace('layer_ids = dflash_config.get("target_layer_ids")',
                                        'layer_ids = dflash_config["target_layer_ids"]', 1)
    runner.write_text(edited)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--allow-untested", "--json")
    assert rc == 3
    patch = next(p for p in doc["patches"] if p["id"] == ID)
    assert patch["status"] == "unsupported"
    assert "vllm/v1/worker/gpu_model_runner.py" in patch["reason"]
    assert "GPUModelRunner._get_eagle3_aux_layers_from_config" in patch["reason"]
    assert 'dflash_config.get("target_layer_ids")' in patch["reason"] and "matched 0 times" in patch["reason"]
    assert runner.read_text() == edited
    assert not (site / ".ddtree-patch" / "state.json").exists()
