"""Regenerate docs/matrix.md and patches/fingerprints.json by parsing every target file of every
release of the matrix (downloads the official wheels once). Run after changing a patch."""

import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import matrix_doc  # noqa: E402

statuses, entries = matrix_doc.scan_matrix(Path(tempfile.mkdtemp()))
matrix_doc.DOC.write_text(matrix_doc.render(statuses))
matrix_doc.FINGERPRINTS.write_text(matrix_doc.render_fingerprints(entries))
print(f"wrote {matrix_doc.DOC} and {matrix_doc.FINGERPRINTS}")
