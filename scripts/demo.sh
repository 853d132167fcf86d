#!/usr/bin/env bash
# The main job, end to end, on a real vLLM: download the official vLLM wheel, install it (no
# dependencies: patching needs none) and ddtree-patch into a scratch virtual environment (the
# patched vLLM imports ddtree_patcher, so both belong in one environment), then
#   ddtree-patch apply -> verify (status table) -> apply again (no-op) -> revert
# against that environment's interpreter, and check every file against the wheel's RECORD.
#   usage: bash scripts/demo.sh [VLLM_VERSION]     (default 0.20.0; try 0.33.0 too)
# The scratch folder (~600 MB: a venv with vLLM) is removed at the end, whatever happens, unless
# KEEP=1 (or DEMO_DIR names a folder of your own, which is never removed).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-0.20.0}
PYTHON=${PYTHON:-python3}
if [ -n "${DEMO_DIR:-}" ]; then
    WORK=$DEMO_DIR
    OWN=0
else
    WORK=$(mktemp -d /tmp/ddtree-demo.XXXXXX)
    OWN=1
fi
cleanup() {
    if [ "$OWN" = 1 ] && [ "${KEEP:-0}" != 1 ]; then
        rm -rf -- "$WORK"
        echo "== removed the scratch environment $WORK (KEEP=1 keeps it)"
    else
        echo "== kept the scratch environment $WORK"
    fi
}
trap cleanup EXIT
echo "== scratch environment: $WORK"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q --disable-pip-version-check .
"$WORK/venv/bin/pip" install -q --disable-pip-version-check --no-deps "vllm==$VERSION"
T="$WORK/venv/bin/ddtree-patch"
PY="$WORK/venv/bin/python"
step() { echo; echo "== ddtree-patch $*"; "$T" "$@" --python "$PY"; }
set +e
step verify;           echo "   exit $?  (6 = something pending)"
step apply --dry-run;  echo "   exit $?"
step apply;            echo "   exit $?"
step verify;           echo "   exit $?  (0 = desired state holds)"
step apply;            echo "   exit $?  (re-apply: changed: no)"
step revert;           echo "   exit $?"
set -e
echo
echo "== every file of the vllm wheel matches its RECORD hash again:"
"$PY" - <<'PY'
import base64, hashlib, importlib.metadata as md
dist = md.distribution("vllm")
bad = 0
for f in dist.files:
    if f.hash is None or not str(f).startswith("vllm/"):
        continue
    digest = base64.urlsafe_b64encode(hashlib.sha256(f.locate().read_bytes()).digest()).rstrip(b"=").decode()
    bad += digest != f.hash.value
print(f"   {sum(1 for f in dist.files if f.hash and str(f).startswith('vllm/'))} files checked, {bad} differ")
raise SystemExit(1 if bad else 0)
PY
