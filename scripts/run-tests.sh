#!/usr/bin/env bash
# The test command (README): build a fresh virtual environment, install ddtree-patch from this
# checkout (a real, non-editable install: the tests run the installed console script) and the
# test requirements, then run the whole suite. Official vLLM wheels are downloaded with pip
# into $DDTREE_PATCH_CACHE (default ~/.cache/ddtree-patch) on first use and reused afterwards.
# Two test processes by default (pytest-xdist, whole files per process: most tests leave a core
# idle); DDTREE_TEST_WORKERS=N sets the number, 0 runs everything in this process.
#   --fast (first argument): the fast tier only (pytest -m fast: no vLLM engine, no torch 2.11.0
#   environment, no real vLLM run; tests/conftest.py TIERS, docs/testing.md). Other arguments pass
#   through to pytest; narrow the tier with -k or a path (a second -m would replace `fast`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${DDTREE_TEST_VENV:-.venv-test}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r tests/requirements.txt
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall .

if [ "${1:-}" = "--fast" ]; then
    shift
    set -- -m fast "$@"
fi

export CUDA_VISIBLE_DEVICES=""  # the Triton interpreter and vLLM's CPU paths (tests/kernels set TRITON_INTERPRET)
set +e
WORKERS=${DDTREE_TEST_WORKERS:-2}
if [ "$WORKERS" = "0" ]; then
    "$VENV/bin/pytest" "$@"
else
    # --no-loadscope-reorder: files in collection order (tests/conftest.py puts the longest first)
    "$VENV/bin/pytest" -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
fi
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "run-tests: pytest collected no tests: that is a failure here" >&2
    exit 1
fi
exit "$rc"
