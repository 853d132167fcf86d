#!/usr/bin/env bash
# hook_defects_on.sh [REV] : run the regression tests of issue 11's defects 1-4
# (tests/patches/hook_parity/defects.py, group "defects" of parity_probe.py) against the
# ddtree_patcher runtime of git revision REV (default a85ada1, main before the fix), on every
# runner family. Each defect check must FAIL there (and pass on this checkout:
# tests/patches/hook_parity). Prints one line per family and check. Needs .venv-test
# (bash scripts/run-tests.sh creates it) and the cached wheels; no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:-a85ada1}
PY=.venv-test/bin/python
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git archive "$REV" | tar -x -C "$WORK" --one-top-level=src
"$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile --target "$WORK/site" "$WORK/src"
for fv in "v1 0.20.0" "v1 0.28.0" "v2 0.24.0" "v2 0.26.0" "v2 0.28.0" "v2 0.33.0"; do
  set -- $fv
  root=$("$PY" -c "import sys; sys.path.insert(0, 'tests'); import vllm_wheels; print(vllm_wheels.extracted('$2'))")
  (cd "$WORK" && CUDA_VISIBLE_DEVICES="" "$OLDPWD/$PY" "$OLDPWD/tests/patches/hook_parity/parity_probe.py" \
      "$root" "$1" 0 7 defects "$WORK/site" 2>/dev/null) \
    | "$PY" -c "
import json, sys
res = json.loads([l for l in sys.stdin if l.startswith('PROBE-RESULT ')][-1][13:])
for k, v in res.items():
    why = v.strip().splitlines()[-1][:160] if v != 'ok' else ''
    print(f'$1-$2 {k}: {\"ok\" if v == \"ok\" else \"FAIL\"} {why}')"
done
