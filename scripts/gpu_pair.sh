#!/bin/bash
# gpu_pair.sh STAGE : issue 36 on the GPU machine: train a small Qwen3 target + DFlash drafter on the
# device's Python standard library (benchmarks/pair/train.py), then measure chain vs DDTree in the
# patched vLLM bundle (benchmarks/pair/measure.py: one process per engine).
#
#   train    needs only the device's torch/tokenizers/safetensors (no bundle): writes the pair to
#            $PAIR (default /tmp/pair: it stays on the warm machine for the next call).
#            TRAIN_MINUTES (default 6.5: the script's own wall cap), SEED (0), TRAIN_ARGS (more flags).
#   measure  the bundle staged beforehand (gpu_tree_e2e.sh stage1 for every part: $VB; or the
#            parts carried in $BUNDLE_DIR/0*), unpacked to $SITE once, the whole patch series applied
#            once, then the engines (ENGINES, default nospec,chain,dd15,dd31,dd63,ddauto) within
#            MEASURE_BUDGET s (default 480). A second call on the same machine keeps the engines
#            already finished (their results in /tmp/pair_logs) and runs the rest; RERUN=1 reruns all.
#            N_PROMPTS (64), N_B1 (prompts at B = 1, 16), MAX_TOKENS (128), BATCHES (1,8,32),
#            TEMP1_BATCHES (32), CG_MODE (FULL_DECODE_ONLY; EAGER=1: no CUDA graphs), COMPILE (0: no
#            torch.compile, CUDA graphs still captured; unset it for vLLM's default compilation),
#            GPU_MEM (0.3).
#   train-bg the train stage in its own process session (setsid), so it runs on while later calls carry the
#            bundle's parts: returns at once; its log /tmp/pair_train.log, /tmp/pair_train.rc when it ends
#            (its outputs are copied into the measure call's $OUT). PAIR is /tmp/pair unless set.
#   all      train then measure in one call (TRAIN_MINUTES + MEASURE_BUDGET must fit the call).
# Outputs under $OUT (flat, at most 8 files): train_report.json, train.log, pair_record.json (the
# docs/runs record), pair_full.json (with tokens), pair_logs.tgz (one log per engine), apply.log,
# install.log.
#
# With CUDA graphs, measure on the 0.26.0 bundle (two parts; VLLM_USE_V2_MODEL_RUNNER=0 for the ddauto
# engine: auto needs a runner that drafts the scheduler's count, V1 there). On vLLM 0.34.0 (V2 only) the
# runtime refuses torch.compile and every CUDA graph mode with DDTree (docs/notebook/fa034-compiled-mixed.md):
# EAGER=1 there, every engine eager (the same mode for all: a fair comparison, not vLLM's fastest).
# With graphs, the 0.26.0 bundle (bash /work/shared/gpu/make_bundle.sh .bundle: two parts; a part of 60 MB,
# .whl and the tree together exceed what a call carries, so .whl goes with the smaller part), training
# while the parts travel:
#   run(carry=[".bundle/01"],         command="bash scripts/gpu_tree_e2e.sh stage1; bash scripts/gpu_pair.sh train-bg")
#   run(carry=[".bundle/02", ".whl"], command="bash scripts/gpu_tree_e2e.sh stage1")
#   run(command="VLLM_USE_V2_MODEL_RUNNER=0 COMMIT=<sha> bash scripts/gpu_pair.sh measure")  # waits for the training
#   run(command="VLLM_USE_V2_MODEL_RUNNER=0 bash scripts/gpu_pair.sh measure")   # again if engines were left (SKIP)
# On 0.34.0 (three parts, the third with .whl), the same with EAGER=1 and without VLLM_USE_V2_MODEL_RUNNER.
# (DIAG_ALLOW_PW034=1 instead of EAGER=1: graphs on 0.34.0, only after a wave showed them identical:
# docs/notebook/gpu-queue.md.)
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
O=${OUT:-/tmp/out}; mkdir -p "$O"
PAIR=${PAIR:-/tmp/pair}
L=${LOGS:-/tmp/pair_logs}; mkdir -p "$L"
T0=$(date +%s)
ph() { echo "=== PHASE $1 at +$(( $(date +%s) - T0 ))s"; }
. "$REPO/scripts/_gpu_bundle.sh"

train() {
  ph train
  nvidia-smi -L
  python3 -c "import torch, tokenizers, safetensors; print('torch', torch.__version__, 'tokenizers', tokenizers.__version__)"
  # HOLD=1 (train-bg): the process keeps its GPU memory after training (it touches /tmp/pair_train.done) until
  # /tmp/pair_release exists (at most 900 s): engines starting beside it on the same GPU must not see free
  # memory grow while vLLM profiles (it asserts so at start-up)
  python3 -c "import os, runpy, sys, time
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name='__main__')
finally:
    if os.environ.get('HOLD') == '1':
        open('/tmp/pair_train.done', 'w').close()
        t = time.time()
        while not os.path.exists('/tmp/pair_release') and time.time() - t < 900:
            time.sleep(1)" "$REPO/benchmarks/pair/train.py" --out "$PAIR" --device cuda --minutes "${TRAIN_MINUTES:-6.5}" \
    --seed "${SEED:-0}" ${TRAIN_ARGS:-} 2>&1 | tee "$O/train.log"
  local rc=${PIPESTATUS[0]}
  cp -f "$PAIR/train_report.json" "$O/" 2>/dev/null
  du -sh "$PAIR"/* 2>/dev/null
  [ "$rc" = 0 ] || { echo "PAIR-TRAIN FAIL rc=$rc"; exit 6; }
  echo "PAIR-TRAIN ok"
}

measure() {
  local tm=$(date +%s)
  # install and apply first: they need no GPU, so they overlap a train-bg run still training
  ph install
  bundle_install
  ph apply
  bundle_apply_series
  if [ -f /tmp/pair_train.log ]; then  # a train-bg run: wait for its end (at most TRAIN_WAIT_S, default 420 s; MEASURE_BUDGET counts the wait)
    local w=0; while [ ! -f /tmp/pair_train.done ] && [ ! -f /tmp/pair_train.rc ] && [ $w -lt "${TRAIN_WAIT_S:-420}" ]; do
      sleep 5; w=$((w + 5)); done
    touch /tmp/pair_release  # its process may exit now (GPU memory freed before the engines start)
    while [ ! -f /tmp/pair_train.rc ] && [ $w -lt "$(( ${TRAIN_WAIT_S:-420} + 60 ))" ]; do sleep 1; w=$((w + 1)); done
    echo "train-bg: rc $(cat /tmp/pair_train.rc 2>/dev/null || echo 'still running') after waiting ${w}s"
    cp -f /tmp/pair_train.log "$O/train.log"; cp -f "$PAIR/train_report.json" "$O/" 2>/dev/null
  fi
  [ -f "$PAIR/dflash/model.safetensors" ] || { echo "no trained pair in $PAIR: run the train stage first"; exit 7; }
  grep -E "^(PATCH|[a-z-]+ +(applied|upstream|not-applicable|pending))" "$O/apply.log" 2>/dev/null | cut -c1-60
  ph engines
  export COMPILE=${COMPILE-0} GPU_MEM=${GPU_MEM:-0.3}
  [ -n "$COMPILE" ] || unset COMPILE
  left=$(( ${MEASURE_BUDGET:-480} - ($(date +%s) - tm) ))  # MEASURE_BUDGET counts install and apply too
  python3 "$REPO/benchmarks/pair/measure.py" --pair "$PAIR" --record "$O/pair_record.json" --full "$O/pair_full.json" \
    --logs "$L" --engines "${ENGINES:-nospec,chain,dd15,dd31,dd63,ddauto}" --batches "${BATCHES:-1,8,32}" \
    --temp1-batches "${TEMP1_BATCHES-32}" --n-prompts "${N_PROMPTS:-64}" --n-b1 "${N_B1:-16}" \
    --max-tokens "${MAX_TOKENS:-128}" --cg-mode "${CG_MODE:-FULL_DECODE_ONLY}" --budget-s "$left" \
    ${COMMIT:+--commit "$COMMIT"} $([ "${EAGER:-0}" = 1 ] && echo --eager) $([ "${RERUN:-0}" = 1 ] && echo --rerun)
  tar czf "$O/pair_logs.tgz" -C "$L" . 2>/dev/null
}

case "${1:-}" in
train) train ;;
train-bg)
  rm -f /tmp/pair_train.rc /tmp/pair_train.done /tmp/pair_release
  HOLD=1 PAIR=$PAIR OUT=/tmp/pair_train_out setsid nohup bash -c "bash '$REPO/scripts/gpu_pair.sh' train > /tmp/pair_train.log 2>&1; echo \$? > /tmp/pair_train.rc" \
    > /dev/null 2>&1 < /dev/null &
  sleep 20; tail -5 /tmp/pair_train.log; echo "PAIR-TRAIN started in the background (PAIR=$PAIR)" ;;
measure) measure ;;
all) train; measure ;;
*) echo "usage: gpu_pair.sh train|measure|all" >&2; exit 2 ;;
esac
