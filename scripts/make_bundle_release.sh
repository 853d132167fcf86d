#!/bin/bash
# make_bundle_release.sh OUT_DIR [WORK_DIR]: the offline GPU bundle (../shared/gpu/make_bundle.sh) for a
# release whose pin list make_bundle.sh does not carry: VLLM_VERSION 0.28.x or 0.33.x (issue 34.4).
# Pins: docs/notebook/torch211-compat.md "Pin lists": 0.34.0's list without its transformers, huggingface-hub
# and tokenizers (the device's own 5.17.0 / 1.33.0 / 0.23.2 satisfy both releases), and for 0.28.x
# openai-harmony==0.0.8 instead of oss-harmony. make_bundle.sh is copied to a scratch folder with one more
# `case` line; everything else (download, strip, pack, chunks, device_install.sh) is its own.
set -euo pipefail
SHARED=${SHARED_GPU:-$(cd "$(dirname "$0")/../.." && pwd)/shared/gpu}
V=${VLLM_VERSION:?set VLLM_VERSION (0.28.x or 0.33.x)}
case "$V" in
  0.28.*) swap='s/oss-harmony==0.0.11/openai-harmony==0.0.8/' ;;
  0.33.*) swap='s/^//' ;;
  *) echo "error: make_bundle_release.sh knows 0.28.x and 0.33.x; 0.26.0 and 0.34.x: $SHARED/make_bundle.sh" >&2; exit 2 ;;
esac
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
cp "$SHARED/make_bundle.sh" "$SHARED/device_install.sh" "$T/"; cp -r "$SHARED/shim034" "$T/"
python3 - "$T/make_bundle.sh" "$swap" <<'PY'
import sys
path, swap = sys.argv[1], sys.argv[2]
src = open(path).read()
anchor = '  0.34.*) PINNED=$PINNED_0340 ;;\n'
assert src.count(anchor) == 1, "make_bundle.sh changed: its 0.34 case line is not there once"
line = ('  0.28.*|0.33.*) PINNED=$(echo $PINNED_0340 | tr " " "\\n" | grep -v -e "^transformers==" '
        '-e "^huggingface-hub==" -e "^tokenizers==" | sed "%s" | tr "\\n" " ") ;;\n' % swap)
open(path, "w").write(src.replace(anchor, anchor + line))
PY
bash "$T/make_bundle.sh" "$@"
