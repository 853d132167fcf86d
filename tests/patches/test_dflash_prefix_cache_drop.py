"""dflash-prefix-cache-drop on the real releases: where it is pending, what it changes, and what
the patched scheduler does with a prefix-cache hit (a real Scheduler/KVCacheManager on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import libcst as cst
import pytest

import vllm_wheels
from helpers import added_lines, assert_shapes_are_those_of_the_wheels, statuses, tree_bytes
from ddtree_patcher.engine import series
from ddtree_patcher.examine import examine
from ddtree_patcher.patches import dflash_prefix_cache_drop as P
from ddtree_patcher.state import sha256
from ddtree_patcher.target import read_record

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "prefix_cache"))
from overlay import overlay_site  # noqa: E402

ID = P.ID
MARK = P.MARK
MATRIX = vllm_wheels.MATRIX
NOT_APPLICABLE = {"0.19.1"}  # no DFlash (vllm/model_executor/models/qwen3_dflash.py absent)
UPSTREAM = {"0.33.0", "0.34.0"}  # SpeculativeConfig.needs_eagle_block_drop() excludes DFlash/DSpark
PENDING = [v for v in MATRIX if v not in NOT_APPLICABLE | UPSTREAM]  # 0.20.0 ... 0.32.0
NEEDS_SLOT = {"0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1"}  # no #42971 (+1 slot) yet
SCHED_030 = {"0.30.0", "0.31.0", "0.32.0"}


def expected(version: str) -> str:
    if version in NOT_APPLICABLE:
        return "not-applicable"
    if version in UPSTREAM:
        return "upstream"
    return "pending"


def _key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _between(version: str, first: str, last: str) -> bool:
    return _key(first) <= _key(version) <= _key(last)


def expected_variants(version: str) -> dict[str, tuple[str | None, str]]:
    """{file: (variant, status)} on a pristine release (variant None: the file is absent)."""
    if version in NEEDS_SLOT:
        sched = {P.SCHEDULER_PY: ("sched-0.20", "pending"), P.SPECULATIVE_PY: ("no-predicate", "not-applicable")}
    elif version in SCHED_030:
        sched = {P.SCHEDULER_PY: ("sched-0.30", "pending"), P.SPECULATIVE_PY: ("predicate-0.30", "pending")}
    else:
        sched = {P.SCHEDULER_PY: ("sched-0.23", "pending"), P.SPECULATIVE_PY: ("no-predicate", "not-applicable")}
    if version in UPSTREAM:
        sched = {P.SCHEDULER_PY: ("sched-0.30", "upstream"), P.SPECULATIVE_PY: ("predicate-0.30", "upstream")}

    def connector(variant: str, first: str, absent_before: str | None = None, gone_from: str | None = None):
        """bare use_eagle() from ``first`` to 0.29.0; use_eagle_block_drop() (upstream's predicate) from 0.30.0."""
        if absent_before and _key(version) < _key(absent_before):
            return (None, "absent")
        if gone_from and _key(version) >= _key(gone_from):
            return (variant, "not-applicable")  # the decision moved out of this function
        if _key(version) >= (0, 30, 0):
            return (variant, "upstream")
        return (variant, "pending" if _key(version) >= _key(first) else "not-applicable")

    if _between(version, "0.20.0", "0.28.0"):
        utils = ("annotate-dsv4-0.20", "pending")
    elif version == "0.29.0":
        utils = ("annotate-0.29", "pending")
    elif version in SCHED_030:
        utils = ("warn-0.30", "pending")
    else:
        utils = ("planning-0.33", "not-applicable")
    return {**sched,
            P.OFFLOADING_PY: connector("offloading-0.24", "0.24.0"),
            P.MOONCAKE_PY: connector("mooncake-0.22", "0.22.0", absent_before="0.21.0", gone_from="0.32.0"),
            P.SIMPLE_OFFLOAD_PY: connector("simple-offload-0.27", "0.27.0"),
            P.KV_UTILS_PY: utils}


def changed_files(version: str) -> list[str]:
    return sorted(f for f, (_, status) in expected_variants(version).items() if status == "pending")


def test_registered_in_series_after_layer_offset():
    ids = [p.id for p in series()]
    assert ID in ids and ids.index(ID) > ids.index("dflash-layer-offset")


@pytest.mark.parametrize("version", MATRIX)
def test_status_per_release(version, matrix_statuses):
    assert matrix_statuses[version][ID] == expected(version)


@pytest.mark.parametrize("version", MATRIX[1:])
def test_pending_releases_match_a_verified_shape(version):
    """Each pending file is recognised by the expected variant, on a shape it was verified on."""
    root = vllm_wheels.extracted(version)
    for pf in P.PATCH.files:
        want, status = expected_variants(version)[pf.path]
        if want is None:
            assert pf.optional and not (root / pf.path).exists(), pf.path
            continue
        finding = examine(P.PATCH, pf, cst.parse_module((root / pf.path).read_bytes()))
        assert (finding.variant, finding.status) == (want, status), (pf.path, finding)
        if status == "pending":
            assert not finding.untested, finding
            assert version in next(v for v in pf.variants if v.name == want).verified_on


# ---- structural: apply -> verify -> revert, byte-exact -----------------------------------------
ROUND_TRIP = ("0.20.0", "0.23.0", "0.29.0", "0.32.0")  # one release per scheduler variant, plus 0.23


@pytest.mark.parametrize("version", ROUND_TRIP)
def test_apply_verify_revert_is_byte_exact(version, make_site, cli):
    site = make_site(version)
    record = read_record(next(site.glob("*.dist-info")))
    pristine = tree_bytes(site)

    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"], err
    assert statuses(doc)[ID] == "applied"
    patched = tree_bytes(site)
    changed = sorted(k for k in patched if patched[k] != pristine[k])
    assert changed == changed_files(version)
    for rel in changed:
        compile(patched[rel], rel, "exec", dont_inherit=True)
        added = added_lines(pristine[rel], patched[rel])
        code_lines = [line for line in added if not line.strip().startswith("#")]
        assert code_lines and all(line.endswith(MARK) for line in code_lines), added  # every changed line marked

    sched = patched[P.SCHEDULER_PY].decode()
    if version in SCHED_030:
        assert "not self.use_dflash() and not self.disable_eagle_block_drop  " + MARK in \
            patched[P.SPECULATIVE_PY].decode()
        assert "and not speculative_config.use_dflash():  " + MARK in sched  # the warning's gate
    else:
        assert "use_eagle=self.use_eagle and not speculative_config.use_dflash(),  " + MARK in sched
        assert "if self.use_eagle and not self.vllm_config.speculative_config.use_dflash():  " + MARK in sched
        assert "self.use_eagle = True\n" in sched or "self.use_eagle = speculative_config.use_eagle()\n" in sched
    slot = "self.num_lookahead_tokens = self.num_spec_tokens + 1"
    if version in NEEDS_SLOT:
        assert slot + "  " + MARK in sched and sched.count(slot) == 1  # the #42971 back-port
    else:
        assert slot + "  " + MARK not in sched

    rc, doc, err = cli("verify", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and statuses(doc)[ID] == "applied", err
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] is False, err

    rc, doc, err = cli("revert", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0, err
    assert statuses(doc)[ID] == "pending"
    assert tree_bytes(site) == pristine
    for rel in changed:
        assert sha256(pristine[rel]) == record[rel], rel


@pytest.mark.parametrize("version", sorted(UPSTREAM | NOT_APPLICABLE))
def test_apply_is_a_no_op_where_not_pending(version, make_site, cli):
    site = make_site(version)
    pristine = tree_bytes(site)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] is False, err
    assert statuses(doc)[ID] == expected(version)
    assert tree_bytes(site) == pristine


def test_shape_hashes_are_those_of_the_wheels():
    """Every hash listed in a variant is the pristine shape of a release where it is pending."""
    assert_shapes_are_those_of_the_wheels(
        P.PATCH, lambda version, path, variant: expected_variants(version)[path] == (variant, "pending"))


# ---- behaviour: a real Scheduler + KVCacheManager, pristine vs patched ----------------------------
# 0.22.1 also shows the #42971 back-port (+1 DFlash lookahead slot) at work; marked slow (~40 s).
# 0.24.0: offloading + Mooncake connectors, DeepSeek-V4 annotation; 0.29.0: every connector and the
# annotation of 0.29; 0.31.0: the predicate's consumers and the "no draft group" warning.
BEHAVIOUR = (pytest.param("0.22.1", marks=pytest.mark.slow), "0.24.0", "0.29.0", "0.31.0")
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "float32", "head_dim": 16,
}


def _start_probe(site: Path, model_dir: Path, tmp: Path, name: str) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "PYTHONPATH": str(site), "CUDA_VISIBLE_DEVICES": "", "VLLM_LOGGING_LEVEL": "ERROR",
           "PYTHONDONTWRITEBYTECODE": "1" if name.startswith("patched") else os.environ.get("PYTHONDONTWRITEBYTECODE", "")}
    env.pop("VLLM_TARGET_DEVICE", None)
    log = tmp / f"{name}.log"
    proc = subprocess.Popen([sys.executable, str(HERE / "prefix_cache" / "probe.py"), str(model_dir)],
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=str(tmp), env=env)
    return proc, log


def _result(proc: subprocess.Popen, log: Path, name: str) -> dict:
    out, _ = proc.communicate(timeout=300)
    lines = [line for line in out.splitlines() if line.startswith("PROBE-RESULT ")]
    if proc.returncode != 0 or not lines:  # an import failure is a failure, never a skip
        pytest.fail(f"{name} probe failed (exit {proc.returncode}):\n{out[-2000:]}\n{log.read_text()[-4000:]}")
    return json.loads(lines[-1][len("PROBE-RESULT "):])


def _patched_site(tmp_path: Path, version: str, cli) -> Path:
    """An overlay of the release's own Python (``vllm_wheels.extracted``: every .py file, which
    imports on CPU without the wheel's compiled parts) with this patch applied."""
    files = sorted({*P.PATCH.requires, *(pf.path for pf in P.PATCH.files)})
    site = overlay_site(tmp_path / f"site-{version}", vllm_wheels.extracted(version), files)
    rc, doc, err = cli("apply", "--vllm-path", str(site), "--patch", ID, "--json")
    assert rc == 0 and doc["changed"] and statuses(doc)[ID] == "applied", err
    return site


def _model_dir(tmp_path: Path) -> Path:
    model_dir = tmp_path / "tiny-llama"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TINY_CONFIG))
    return model_dir


@pytest.mark.parametrize("version", BEHAVIOUR)
def test_dflash_hits_every_cached_block_after_patch(version, tmp_path, cli):
    full = vllm_wheels.extracted(version)
    site = _patched_site(tmp_path, version, cli)
    model_dir = _model_dir(tmp_path)
    running = {name: _start_probe(path, model_dir, tmp_path, name)
               for name, path in (("pristine", full), ("patched", site))}
    got = {name: _result(*running[name], name) for name in running}

    for name, path in (("pristine", full), ("patched", site)):
        assert got[name]["version"] == version
        assert Path(got[name]["file"]).parent == path / "vllm", got[name]["file"]
        assert got[name]["scheduler_marked"] is (name == "patched")

    n, k = got["patched"]["prefix_blocks"], got["patched"]["num_spec"]
    pristine, patched = got["pristine"]["methods"], got["patched"]["methods"]
    # Pristine vLLM drops the last matched block for both drafters.
    assert pristine["dflash"]["hit_blocks"] == n - 1 and pristine["eagle3"]["hit_blocks"] == n - 1
    assert pristine["dflash"]["manager_drops"] and pristine["eagle3"]["manager_drops"]
    assert pristine["dflash"]["mamba_split"] == pristine["eagle3"]["mamba_split"] == 80
    # Patched: DFlash hits all N blocks, EAGLE still N - 1.
    assert patched["dflash"]["hit_blocks"] == n, patched
    assert not patched["dflash"]["manager_drops"]
    assert patched["dflash"]["mamba_split"] == 96  # no eagle back-off of the mamba cache position
    assert patched["eagle3"] == pristine["eagle3"]
    assert patched["eagle3"]["hit_blocks"] == n - 1 and patched["eagle3"]["manager_drops"]
    # Scheduler.use_eagle is untouched (DFlash keeps the lookahead and the rest it drives) ...
    assert patched["dflash"]["scheduler_use_eagle"] and pristine["dflash"]["scheduler_use_eagle"]
    # ... and DFlash has its +1 lookahead slot: back-ported on 0.20-0.22, upstream (#42971) after.
    assert patched["dflash"]["num_lookahead_tokens"] == k + 1
    assert pristine["dflash"]["num_lookahead_tokens"] == (k if version in NEEDS_SLOT else k + 1)
    assert patched["eagle3"]["num_lookahead_tokens"] == pristine["eagle3"]["num_lookahead_tokens"] == k
    # A fresh 64-token prompt owns ceil((64 + K + 1) / 16) = 5 blocks from its first prefill on; before
    # 0.23.0 (#43733) pristine vLLM allocates no lookahead at a first prefill (4 blocks).
    assert patched["dflash"]["lookahead_blocks"] == [5, 5, 5]
    assert pristine["dflash"]["lookahead_blocks"] == ([4, 5, 5] if version in NEEDS_SLOT else [5, 5, 5])
    # Issue 10, defect 4: every other block-drop decision of the release's own code. The KV
    # connectors (offloading 0.24+, Mooncake store 0.22+, simple CPU offload 0.27+; absent: None) drop
    # for EAGLE, and for DFlash only before the patch; so does the draft-group annotation (here: a
    # DeepSeek-V4 target's last-layer group); the "no draft group on a hybrid target" warning
    # (0.30-0.32) no longer fires for DFlash, whose groups are no longer annotated.
    present = {name: flag for name, flag in pristine["eagle3"]["connectors"].items() if flag is not None}
    assert present and all(present.values()), pristine["eagle3"]
    assert pristine["dflash"]["connectors"] == pristine["eagle3"]["connectors"]
    assert patched["eagle3"]["connectors"] == pristine["eagle3"]["connectors"]
    assert patched["dflash"]["connectors"] == {name: (None if flag is None else False)
                                               for name, flag in pristine["eagle3"]["connectors"].items()}
    assert pristine["dflash"]["annotated"] is pristine["eagle3"]["annotated"] is patched["eagle3"]["annotated"] is True
    assert patched["dflash"]["annotated"] is False
    warns = version in SCHED_030  # 0.29.0's warning function logs nothing; before 0.29.0 there is none
    assert pristine["dflash"]["warned"] is pristine["eagle3"]["warned"] is patched["eagle3"]["warned"] is (
        warns if _key(version) >= (0, 29, 0) else None)
    assert patched["dflash"]["warned"] is (False if _key(version) >= (0, 29, 0) else None)


def test_dflash_first_prefill_allocates_like_0_23(tmp_path, cli):
    """Issue 10, defect 2: the #42971 back-port (0.20-0.22) must also allocate DFlash's lookahead at
    the first prefill, as 0.23.0 does (#43733): otherwise the drafter's first pass writes positions
    64-67 of a 64-token prompt past the blocks the request owns. Real Schedulers: patched 0.22.0 owns
    what pristine 0.23.0 owns after the first schedule and after later ones. EAGLE keeps its own
    0.22 behaviour (the patch changes DFlash only)."""
    site = _patched_site(tmp_path, "0.22.0", cli)
    model_dir = _model_dir(tmp_path)
    running = {name: _start_probe(path, model_dir, tmp_path, name)
               for name, path in (("patched-0.22.0", site), ("0.23.0", vllm_wheels.extracted("0.23.0")))}
    got = {name: _result(*running[name], name) for name in running}
    patched, upstream = got["patched-0.22.0"]["methods"], got["0.23.0"]["methods"]
    assert got["patched-0.22.0"]["scheduler_marked"] and got["0.23.0"]["version"] == "0.23.0"
    assert patched["dflash"]["lookahead_blocks"] == upstream["dflash"]["lookahead_blocks"] == [5, 5, 5]
    assert patched["eagle3"]["lookahead_blocks"] == [4, 5, 5]
