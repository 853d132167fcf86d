"""The committed results of the runtime matrix (docs/runs/runtime-matrix.json): plain data,
written only by the matrix run (``DDTREE_RUNTIME_MATRIX_RESULTS``), read by scripts/gen_matrix.py
(``releases``: the V1 records, docs/matrix.md) and tests/ddtree_status_doc.py (``releases``' check
``ddtree.tree_v1`` and the ``ddtree_v2`` section's V2 cells: docs/ddtree.md's status table)."""

from __future__ import annotations

import json
from pathlib import Path

from packaging.version import Version

SCHEMA = 1
COMMAND = "bash scripts/runtime-matrix.sh"


def load(path: Path) -> dict:
    if not path.exists():
        return {"schema": SCHEMA, "command": COMMAND, "releases": {}}
    doc = json.loads(path.read_text())
    if doc.get("schema") != SCHEMA:
        raise RuntimeError(f"{path}: schema {doc.get('schema')}, expected {SCHEMA}")
    return doc


# the V2 DDTree cells (ddtree_v2.py): a section of their own, by release (0.34.0 has no V1 record)
V2_SECTION = "ddtree_v2"
V2_WHAT = ("DDTree on vLLM's V2 model runner on CPU, each release's own code (tests/runtime_matrix/ddtree_v2.py): "
           "checks ddtree.v2.faithful (V2 without speculation == V1, V2 DFlash == no speculation: the shim "
           "cpu-v2-triton-interpreted faithful), ddtree.v2.basic and ddtree.v2.mixed (greedy DDTree == no speculation)")


def merge(path: Path, records: dict, section: str | None = None) -> None:
    """Merge ``records`` (by release) into the results: the V1 records (``releases``) or, with
    ``section``, that section's (``doc[section]["releases"]``); each run replaces its releases'
    records there and leaves everything else as it was."""
    doc = load(path)
    if section is None:
        where = doc
    else:
        where = doc.setdefault(section, {"what": V2_WHAT if section == V2_SECTION else "", "releases": {}})
    where["releases"].update(records)
    where["releases"] = dict(sorted(where["releases"].items(), key=lambda kv: Version(kv[0])))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
