#!/bin/bash
# gpu_tree_step.sh STAGE : the tree-step kernels on an H200 (issue 13, docs/tree-step.md):
# benchmarks/bench_tree_step.py = correctness at the Qwen3-8B attention shape (tree attention vs
# an fp32 dense reference, FA3 context pass + merge, chain == causal, compaction bit for bit) and
# CUDA-graph timings (the chain step's FA3 attention vs tree attention, B 1/8/32, n 16/64,
# context 1K/16K; compaction of 36 layers at B = 32), with FlashAttention 3 from the offline
# vLLM 0.26.0 bundle (/work/shared/gpu/README.md). Without the bundle, or if importing vLLM
# kills the process, the bench runs its torch + Triton parts only (FA columns n/a).
#
# Build here, once (git-ignored; `run` carries it):
#   bash /work/shared/gpu/make_bundle.sh .bundle            # .bundle/01, .bundle/02 (~2.5 min)
# Then, from the repository root, two `run` calls on one warm machine:
#   run(carry=[".bundle/01"], command="bash scripts/gpu_tree_step.sh stage1")
#   run(carry=[".bundle/02"], command="bash scripts/gpu_tree_step.sh stage2")
# (A machine whose /tmp/site already holds the bundle, e.g. after gpu_hook_parity.sh stage2, needs
# only `bash scripts/gpu_tree_step.sh stage2`, no carry.) Device time, estimated: stage1 ~10 s,
# stage2 ~10 s install + the bench (its timing rows stop starting after 115 s; ~70-110 s
# expected). stage2 writes $OUT/bench_tree_step.json and $OUT/bench_tree_step.log; its last line
# is "TREE-STEP-BENCH ok" or "TREE-STEP-BENCH FAIL <what>", exit status 0 / 1.
#
# CPU smoke of the script and the bench (no GPU, no bundle; Triton interpreter, FA3 emulated):
#   bash scripts/gpu_tree_step.sh smoke
# The bundle steps are scripts/_gpu_bundle.sh's (its BUNDLE_DIR, VB, SITE: .bundle, /tmp/vb, /tmp/site unless
# set); a broken or missing bundle only costs the FA columns. Overrides (for testing the script): OUT, PYEXE,
# BENCH_ARGS.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
O=${OUT:-/tmp/out}; mkdir -p "$O"
PY=${PYEXE:-python3}
T0=$(date +%s)
ph() { echo "=== PHASE $1 at +$(( $(date +%s) - T0 ))s"; }

bench() {  # bench PYTHONPATH [args...]: one run of the benchmark, log in $O/bench_tree_step.log
  local pp=$1; shift
  # shellcheck disable=SC2086
  PYTHONPATH=$pp PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 timeout "${BENCH_TIMEOUT:-240}" \
    "$PY" "$REPO/benchmarks/bench_tree_step.py" --out "$O/bench_tree_step.json" ${BENCH_ARGS:-} "$@" \
    > "$O/bench_tree_step.log" 2>&1
  local rc=$?
  cat "$O/bench_tree_step.log"
  return $rc
}

finished() { grep -q '^TREE-STEP-BENCH ' "$O/bench_tree_step.log"; }

. "$REPO/scripts/_gpu_bundle.sh"

case "${1:-}" in
stage1)
  if [ -d "$REPO/$BUNDLE_DIR/01" ]; then
    bundle_stage1
  else
    echo "no $BUNDLE_DIR/01 here: stage2 will run the bench without vLLM (FA columns n/a)"
    nvidia-smi -L
  fi
  exit 0 ;;
stage2)
  ph install
  if [ ! -f "$SITE/.bundle-sha256" ] && [ -d "$REPO/$BUNDLE_DIR/02" ]; then
    # in a subshell: a failed install (its exit) leaves this script to run the bench without vLLM;
    # bench() sets the environment each run needs itself
    ( bundle_install ); echo "bundle_install rc=$?"; tail -3 "$O/install.log"
  fi
  if [ -f "$SITE/.bundle-sha256" ]; then
    ph "bench with vLLM FA3 ($SITE)"
    bench "$SITE:$REPO"; rc=$?
    if ! finished; then  # the process died (rc $rc) before its last line: again without vLLM
      cp "$O/bench_tree_step.log" "$O/bench_tree_step_with_vllm.log"
      ph "bench without vLLM (the run with $SITE died, rc=$rc; its log: bench_tree_step_with_vllm.log)"
      bench "$REPO" --no-fa; rc=$?
    fi
  else
    ph "bench without vLLM (no bundle in $SITE)"
    bench "$REPO" --no-fa; rc=$?
  fi ;;
smoke)
  PY=${PYEXE:-$REPO/.venv-test/bin/python}
  ph "smoke (CPU, Triton interpreter)"
  TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" BENCH_ARGS="--smoke ${BENCH_ARGS:-}" bench "$REPO"; rc=$? ;;
*) echo "usage: gpu_tree_step.sh stage1|stage2|smoke" >&2; exit 2 ;;
esac
ph "end (rc=$rc)"
exit $rc
