"""Regenerate docs/matrix.md and patches/fingerprints.json by parsing every target file of every
release of the matrix (downloads the official wheels once). Run after changing a patch.

``--runtime-only``: only re-render docs/matrix.md's runtime section from
docs/runs/runtime-matrix.json (no wheel scan; scripts/runtime-matrix.sh runs this)."""

import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import matrix_doc  # noqa: E402

if "--runtime-only" in sys.argv[1:]:
    matrix_doc.DOC.write_text(matrix_doc.splice_runtime(matrix_doc.DOC.read_text(), matrix_doc.load_runtime()))
    print(f"wrote the runtime section of {matrix_doc.DOC}")
    sys.exit(0)
statuses, entries = matrix_doc.scan_matrix(Path(tempfile.mkdtemp()))
matrix_doc.DOC.write_text(matrix_doc.render(statuses))
matrix_doc.FINGERPRINTS.write_text(matrix_doc.render_fingerprints(entries))
print(f"wrote {matrix_doc.DOC} and {matrix_doc.FINGERPRINTS}")
