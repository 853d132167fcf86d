#!/bin/bash
# gpu_swa_e2e.sh STAGE : dflash-sliding-window end to end on an H200 with the offline vLLM 0.26.0
# bundle, FlashAttention (0.26 takes the window from the attention group's spec, see
# docs/patches/dflash-sliding-window.md). Two `run` calls, as for gpu_e2e.sh (same stage1):
#
#   run(carry=[".bundle/01", ".whl"], command="bash scripts/gpu_swa_e2e.sh stage1")
#   run(carry=[".bundle/02"],         command="bash scripts/gpu_swa_e2e.sh stage2")
#
# stage2: tiny Qwen3 target + DFlash drafter [sliding_attention (window 4), full_attention], greedy,
# eager, each run in its own process:
#   v1-nospec           pristine vLLM, V1, no speculation (the reference output)
#   v1-mixed-unpatched  pristine vLLM, V1, DFlash: must raise NotImplementedError
#   (apply dflash-sliding-window)
#   v1-mixed            patched, V1, DFlash, SWA_PROBE=1 (windows, groups, recorded attention calls)
#   v2-mixed            patched, V2 (vLLM's own choice for mixed drafters), DFlash, SWA_PROBE=1
# Logs and summary.json land in $OUT.
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
*) echo "usage: gpu_swa_e2e.sh stage1|stage2" >&2; exit 2 ;;
esac

ph install
bundle_install
export ROOT=/tmp/tiny

ph ckpt
DRAFT_LAYER_TYPES=sliding_attention,full_attention DRAFT_WINDOW=4 \
  python3 "$REPO/tests/patches/engine_tools/make_tiny_ckpts.py" $ROOT

one() {  # one TAG SPEC RUNNER(0|1|-) [ENV=VALUE ...]
  local tag=$1 spec=$2 runner=$3; shift 3
  local left=$(( ${BUDGET:-540} - ($(date +%s) - T0) ))
  if [ $left -lt 60 ]; then echo "SKIP $tag (no time left)"; return; fi
  ph "$tag (limit $(( left < 180 ? left : 180 ))s)"
  ( [ "$runner" != "-" ] && export VLLM_USE_V2_MODEL_RUNNER=$runner
    env TAG=$tag SPEC=$spec EAGER=1 "$@" timeout $(( left < 180 ? left : 180 )) \
      python3 "$REPO/tests/patches/engine_tools/run_llm_hook.py" > "$O/$tag.log" 2>&1 )
  echo "rc=$?"
  grep -E "Error|ddtree-patch|Model Runner|model runner|FLASH|backend" "$O/$tag.log" | cut -c1-250 | head -8
}
one v1-nospec 0 0
one v1-mixed-unpatched 1 0
ph apply
python3 -m ddtree_patcher.cli apply --vllm-path "$SITE" --patch dflash-sliding-window 2>&1 | tee "$O/apply.log"
one v1-mixed 1 0 SWA_PROBE=1
one v2-mixed 1 - SWA_PROBE=1

ph compare
python3 - "$O" <<'PY' | tee "$O/summary.json"
import glob, json, sys
r = {}
for f in sorted(glob.glob(sys.argv[1] + "/v*.log")):
    for line in open(f, errors="replace"):
        if line.startswith("RESULT "):
            d = json.loads(line[7:]); r[d["tag"]] = d
out = {}
for k, v in r.items():
    o = {x: v.get(x) for x in ("ok", "vllm", "engine_start_s", "generate_s", "error")}
    if v.get("tokens") and r.get("v1-nospec", {}).get("tokens"):
        o["identical_to_v1-nospec"] = v["tokens"] == r["v1-nospec"]["tokens"]
    s = v.get("swa")
    if s:
        o["layers"] = s["layers"]; o["draft_groups"] = s["draft_groups"]; o["kv_cache_gid"] = s.get("kv_cache_gid")
        o["calls"] = {name: [{k2: c[k2] for k2 in c if k2 != "num_queries"} for c in calls[:3]]
                      for name, calls in s["calls"].items()}
    out[k] = o
print(json.dumps(out, indent=1))
PY
ph end
cd "$O" && tar czf logs.tgz v*.log && rm -f v*.log
