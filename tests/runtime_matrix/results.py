"""The committed results of the runtime matrix (docs/runs/runtime-matrix.json): plain data,
written only by the matrix run (``DDTREE_RUNTIME_MATRIX_RESULTS``), read by scripts/gen_matrix.py."""

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


def merge(path: Path, records: dict) -> None:
    doc = load(path)
    doc["releases"].update(records)
    doc["releases"] = dict(sorted(doc["releases"].items(), key=lambda kv: Version(kv[0])))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
