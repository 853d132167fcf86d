"""Files generated from the patch registry must be current."""

import json

import matrix_doc
from ddtree_patcher.engine import series
from helpers import REPO


def test_matrix_doc_is_fresh(matrix_statuses):
    assert matrix_doc.DOC.read_text() == matrix_doc.render(matrix_statuses), (
        "docs/matrix.md is stale: run `python scripts/gen_matrix.py`")


def test_fingerprints_are_fresh(matrix_scan):
    committed = json.loads(matrix_doc.FINGERPRINTS.read_text())["entries"]
    assert committed == json.loads(matrix_doc.render_fingerprints(matrix_scan[1]))["entries"], (
        "patches/fingerprints.json is stale: run `python scripts/gen_matrix.py`")


def test_every_patch_has_a_doc_page():
    for p in series():
        page = REPO / "docs" / "patches" / f"{p.id}.md"
        assert page.is_file(), f"missing {page}"
        text = page.read_text()
        for ref in p.upstream:
            assert ref.split("#")[-1] in text, f"{page} does not mention upstream {ref}"
