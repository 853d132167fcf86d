#!/bin/bash
# gpu_e2e.sh STAGE : the tree-walk-hook end to end on an H200 with the offline vLLM 0.26.0 bundle
# (/work/shared/gpu/README.md). Run from the repository root on the device, in two `run` calls
# (each carries one bundle chunk; the second within 30 s of the first, while the machine is warm):
#
#   run(carry=[".bundle/01", ".whl"], command="bash scripts/gpu_e2e.sh stage1")
#   run(carry=[".bundle/02"],         command="bash scripts/gpu_e2e.sh stage2")
#
# .bundle/ : bash /work/shared/gpu/make_bundle.sh .bundle   (git-ignored)
# .whl/    : the libcst wheel for cp312 (the device image has click and packaging, not libcst):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl libcst==1.9.0
#
# stage2 unpacks vLLM into /tmp/site, applies the patch there with `python3 -m ddtree_patcher.cli
# apply`, registers the boot guard's entry point (a dist-info generated from pyproject.toml: the
# repository travels as a source tree), makes the tiny checkpoints and runs, each in its own
# process, greedy, eager: V2 runner without speculation, V2 + DFlash with
# DDTREE_PATCH_CHAIN_AS_TREE=1, the same two on the V1 runner, then (time permitting) V2 + DFlash
# with DDTree off. Logs and summary.json land in $OUT.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
O=${OUT:-/tmp/out}; mkdir -p "$O"
T0=$(date +%s)
ph() { echo "=== PHASE $1 at +$(( $(date +%s) - T0 ))s"; }
. "$REPO/scripts/_gpu_bundle.sh"
case "${1:-}" in
stage1)
  bundle_stage1
  exit 0 ;;
stage2) ;;
*) echo "usage: gpu_e2e.sh stage1|stage2" >&2; exit 2 ;;
esac

ph install
bundle_install
export ROOT=/tmp/tiny
python3 - "$REPO" <<'PY' || exit 5
import pathlib, sys, tomllib
repo = pathlib.Path(sys.argv[1])
proj = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
eps = proj["entry-points"]["vllm.general_plugins"]
d = pathlib.Path("/tmp/tools") / f"ddtree_patch-{proj['version']}.dist-info"
d.mkdir(parents=True, exist_ok=True)
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: ddtree-patch\nVersion: {proj['version']}\n")
(d / "entry_points.txt").write_text("[vllm.general_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
print("entry points:", eps)
PY

ph apply
python3 -m ddtree_patcher.cli apply --vllm-path "$SITE" --patch tree-walk-hook 2>&1 | tee "$O/apply.log"
python3 -m ddtree_patcher.cli verify --vllm-path "$SITE" 2>&1 | tee -a "$O/apply.log"
grep -c "ddtree-patch: tree-walk-hook" "$SITE"/vllm/v1/worker/gpu_model_runner.py "$SITE"/vllm/v1/worker/gpu/model_runner.py

ph ckpt; python3 "$REPO/tests/patches/engine_tools/make_tiny_ckpts.py" $ROOT
for cfg in "v2-nospec 0 - -" "v2-tree 1 - 1" "v1-nospec 0 0 -" "v1-tree 1 0 1" "v2-spec-off 1 - -"; do
  set -- $cfg
  left=$(( ${BUDGET:-540} - ($(date +%s) - T0) ))
  if [ $left -lt 70 ]; then echo "SKIP $1 (no time left)"; continue; fi
  ph "$1 (limit $(( left < 200 ? left : 200 ))s)"
  ( [ "$3" != "-" ] && export VLLM_USE_V2_MODEL_RUNNER=$3; [ "$4" != "-" ] && export DDTREE_PATCH_CHAIN_AS_TREE=1
    TAG=$1 SPEC=$2 EAGER=1 timeout $(( left < 200 ? left : 200 )) python3 "$REPO/tests/patches/engine_tools/run_llm_hook.py" > "$O/$1.log" 2>&1 )
  echo "rc=$?"
  grep -E "Error|Traceback|ddtree-patch|Model Runner|model runner" "$O/$1.log" | cut -c1-300 | head -20
  grep -h "^RESULT " "$O/$1.log" >> "$O/results.jsonl"   # whole lines: the comparison reads them
done
ph compare
python3 - "$O" <<'PY' | tee "$O/summary.json"
import glob, json, sys
r = {}
for f in sorted(glob.glob(sys.argv[1] + "/*-*.log")):  # the per-run logs only
    for line in open(f, errors="replace"):
        if line.startswith("RESULT "):
            d = json.loads(line[7:]); r[d["tag"]] = d
        if "ddtree-patch: hook" in line and line.find("ddtree-patch") >= 0:
            r.setdefault(f.split("/")[-1][:-4], {}).setdefault("lines", []).append(line.strip()[-200:])
out = {k: {x: v.get(x) for x in ("ok", "vllm", "engine_start_s", "generate_s", "hook", "error", "lines")} for k, v in r.items()}
for run, base in (("v2-tree", "v2-nospec"), ("v1-tree", "v1-nospec"), ("v2-spec-off", "v2-nospec")):
    if run in r and base in r and r[run].get("tokens") and r[base].get("tokens"):
        out[run]["identical_to_" + base] = r[run]["tokens"] == r[base]["tokens"]
print(json.dumps(out, indent=1))
PY
ph end
cd "$O" && tar czf logs.tgz *-*.log && rm -f *-*.log   # at most 8 files come back: one archive
