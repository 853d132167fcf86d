#!/bin/bash
# gpu_tree_e2e.sh STAGE : the DDTree tree step on an H200 (issue 13), vLLM 0.26.0 bundle
# (/work/shared/gpu/README.md), V1 runner, FlashAttention 3: the whole patch series applied to the
# bundle's vLLM, tiny random bf16 Qwen3 target + DFlash drafter made branchy
# (tests/patches/ddtree_tree_step/branchy_ckpts.py), then one process per engine
# (tests/patches/ddtree_tree_step/run_tree_engine.py): no speculation; DDTree budget 8 / depth 3
# eager; the same with PIECEWISE CUDA graphs; [the no-compaction control, eager]. Greedy DDTree must
# equal no speculation token for token, with trees walked and non-first children accepted.
#
# Build here, once (git-ignored; `run` carries them): .bundle/01, .bundle/02
# (bash /work/shared/gpu/make_bundle.sh .bundle) and .whl (libcst, see gpu_hook_parity.sh). Then:
#   run(carry=[".bundle/01", ".whl"], command="bash scripts/gpu_tree_e2e.sh stage1")
#   run(carry=[".bundle/02"],         command="bash scripts/gpu_tree_e2e.sh stage2")
# stage2 prints a table and "TREE-E2E ok" or "TREE-E2E FAIL <what>"; $OUT/tree_e2e.json, $OUT/*.log.
# vLLM 0.34.0 (V2 only; VLLM_VERSION=0.34.0 bash /work/shared/gpu/make_bundle.sh .bundle: three parts):
#   run(carry=[".bundle/01", ".whl"], command="bash scripts/gpu_tree_e2e.sh stage1")
#   run(carry=[".bundle/02"],         command="bash scripts/gpu_tree_e2e.sh stage1")
#   run(carry=[".bundle/03"],         command="ONLY='<*-v2 engines>' bash scripts/gpu_tree_e2e.sh stage2")
# (0.34.0 refuses VLLM_USE_V2_MODEL_RUNNER=0: run only the V2 engines there).
# ONLY="nospec dd-eager" limits the engines; BUDGET (s, default 420) bounds the engines' time.
# SIBLING=49.5: the contested drafter of branchy_ckpts.py (its top two close: most trees' spine-first
# node order differs from their pop order, so the tree step runs renumbered trees; default 48).
# nospec-mix / dd-mix: the CPU e2e test's mixed scenario (prefix caching, chunked prefill, joins,
# requests vLLM's chain sampler verifies in tree steps, preemption), PIECEWISE. *-fg: the same with
# FULL_AND_PIECEWISE (vLLM's default: FULL graphs for uniform decode batches; tree-step ABI 3), each
# against the no-spec engine of its own mode; "gstep" counts the uniform decode steps prepared for
# those graphs (attn counts eager layer calls only: a FULL replay runs no Python). dd-fg-pad: one
# capture size, 72 = 8 requests x 9 rows: every decode batch of the 6 prompts is padded (padded
# requests in the target's FULL graph; the drafter's 24 query rows pad to 72, past its 32-row buffers).
# *-v2*: the V2 runner (VLLM_USE_V2_MODEL_RUNNER=1; tree-step ABI 4), eager and FULL_AND_PIECEWISE,
# basic and mixed, each against the V2 no-spec engine of its mode. s-*: sampled output (temperature
# 1, V1 and V2), DDTree against no speculation by chi-square (every test p > 1e-3).
# Record of the V2 and sampled engines: docs/runs/h200-ddtree-v2-2026-12-01.json.
# DIAG_ALLOW_PW034=1 (every graph-mode DDTree engine of the V2 runner): lifts the runtime's refusal of
# CUDA graphs on vLLM 0.34.0's FlashAttention forward inside the engine process (run_tree_engine.py), so
# the same engines test 0.34.0's graph modes; on the other releases there is no such refusal to lift.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
O=${OUT:-/tmp/out}; mkdir -p "$O"
L=${LOGS:-/tmp/tree_e2e_logs_${DTYPE:-float16}${SIBLING:+-s$SIBLING}}; mkdir -p "$L"
T0=$(date +%s)
ph() { echo "=== PHASE $1 at +$(( $(date +%s) - T0 ))s"; }
# the mixed scenario of tests/patches/test_ddtree_e2e.py (prefix caching, chunked prefill, joins,
# chain-routed requests in tree steps, a KV cache of 10 blocks: preemption)
MIX="SCENARIO=mixed PREFIX_CACHING=1 BLOCK_SIZE=32 MAX_NUM_SEQS=4 MAX_MODEL_LEN=256 MAX_BATCHED_TOKENS=64 NUM_BLOCKS=10"
# sampled: temperature 1.0, 10,000 requests of 3 tokens per engine, independent seeds; DDTree's tokens
# against no speculation's by chi-square (tests/patches/ddtree_tree_step/sampled_stats.py, the CPU
# test's statistics: tests/patches/test_ddtree_e2e.py)
SAMPLED="SCENARIO=sampled N_PROMPTS=10000 MAX_TOKENS=3 MAX_NUM_SEQS=256 MAX_BATCHED_TOKENS=16384"
V2="VLLM_USE_V2_MODEL_RUNNER=1"  # the V2 runner's tree step (vLLM 0.26.0-0.34.0's shapes; tree-step ABI 4)
# issue 33: a seeded temperature-1 request alone (sd1*) and beside a seeded repetition_penalty request that
# vLLM's chain sampler verifies in the same steps (sd2*): its tokens must be the same both times
SEEDED="SCENARIO=seeded MAX_TOKENS=32"
#        tag          env
ENGINES=("nospec        SPEC=0 EAGER=1 LOGPROBS=2"
         "dd-eager      SPEC=1 EAGER=1 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1"
         "dflash-chain  SPEC=1 EAGER=1"
         "nospec-pw     SPEC=0 EAGER=0 CG_MODE=PIECEWISE LOGPROBS=2"
         "dd-pw         SPEC=1 EAGER=0 CG_MODE=PIECEWISE DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1"
         "ctl-nocompact SPEC=1 EAGER=1 DDTREE_PATCH_ENABLE=1 CONTROL=no-compaction"
         "nospec-mix    SPEC=0 EAGER=0 CG_MODE=PIECEWISE LOGPROBS=2 $MIX"
         "dd-mix        SPEC=1 EAGER=0 CG_MODE=PIECEWISE DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1 $MIX"
         "nospec-fg     SPEC=0 EAGER=0 CG_MODE=FULL_AND_PIECEWISE LOGPROBS=2"
         "dd-fg         SPEC=1 EAGER=0 CG_MODE=FULL_AND_PIECEWISE DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1"
         "nospec-mix-fg SPEC=0 EAGER=0 CG_MODE=FULL_AND_PIECEWISE LOGPROBS=2 $MIX"
         "dd-mix-fg     SPEC=1 EAGER=0 CG_MODE=FULL_AND_PIECEWISE DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1 $MIX"
         "dd-fg-pad     SPEC=1 EAGER=0 CG_MODE=FULL_AND_PIECEWISE CG_SIZES=72 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1"
         "nospec-v2        $V2 SPEC=0 EAGER=1 LOGPROBS=2"
         "dd-v2            $V2 SPEC=1 EAGER=1 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1"
         "nospec-v2-fg     $V2 SPEC=0 EAGER=0 CG_MODE=FULL_AND_PIECEWISE LOGPROBS=2"
         "dd-v2-fg         $V2 SPEC=1 EAGER=0 CG_MODE=FULL_AND_PIECEWISE DIAG_ALLOW_PW034=1 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1"
         "nospec-mix-v2    $V2 SPEC=0 EAGER=1 LOGPROBS=2 $MIX"
         "dd-mix-v2        $V2 SPEC=1 EAGER=1 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1 $MIX"
         "nospec-mix-v2-pw $V2 SPEC=0 EAGER=0 CG_MODE=PIECEWISE LOGPROBS=2 $MIX"
         "dd-mix-v2-pw     $V2 SPEC=1 EAGER=0 CG_MODE=PIECEWISE DIAG_ALLOW_PW034=1 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1 $MIX"
         "nospec-mix-v2-fg $V2 SPEC=0 EAGER=0 CG_MODE=FULL_AND_PIECEWISE LOGPROBS=2 $MIX"
         "dd-mix-v2-fg     $V2 SPEC=1 EAGER=0 CG_MODE=FULL_AND_PIECEWISE DIAG_ALLOW_PW034=1 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1 $MIX"
         "s-nospec         SPEC=0 EAGER=0 CG_MODE=FULL_AND_PIECEWISE SEED_BASE=0 $SAMPLED"
         "s-dd             SPEC=1 EAGER=0 CG_MODE=FULL_AND_PIECEWISE SEED_BASE=1000000 DDTREE_PATCH_ENABLE=1 $SAMPLED"
         "s-nospec-v2      $V2 SPEC=0 EAGER=0 CG_MODE=FULL_AND_PIECEWISE SEED_BASE=0 $SAMPLED"
         "s-dd-v2          $V2 SPEC=1 EAGER=0 CG_MODE=FULL_AND_PIECEWISE DIAG_ALLOW_PW034=1 SEED_BASE=1000000 DDTREE_PATCH_ENABLE=1 $SAMPLED"
         "sd1              SPEC=1 EAGER=0 CG_MODE=FULL_AND_PIECEWISE DDTREE_PATCH_ENABLE=1 $SEEDED N_PROMPTS=1"
         "sd2              SPEC=1 EAGER=0 CG_MODE=FULL_AND_PIECEWISE DDTREE_PATCH_ENABLE=1 $SEEDED N_PROMPTS=2"
         "sd1-v2           $V2 SPEC=1 EAGER=0 CG_MODE=FULL_AND_PIECEWISE DDTREE_PATCH_ENABLE=1 $SEEDED N_PROMPTS=1"
         "sd2-v2           $V2 SPEC=1 EAGER=0 CG_MODE=FULL_AND_PIECEWISE DDTREE_PATCH_ENABLE=1 $SEEDED N_PROMPTS=2"
         # vLLM 0.34.0, mixed batches: FULL decode graphs without torch.compile (fdonc, against the eager no-spec
         # engine: 7/12 on 2026-12-07, so the runtime allows only eager there now), and the diagnosis of the
         # divergences (DIAG_ALLOW_PW034: the runtime's refusal of torch.compile and CUDA graphs lifted),
         # each against nospec-mix-v2-pw: FULL decode graphs with torch.compile (fdo), compiled without graphs
         # (cg0); PIECEWISE through breakable CUDA graphs without torch.compile (bnc) and with it (brk);
         # LayerName opaque types off (ln0)
         "dd-mix-v2-fdo    $V2 SPEC=1 EAGER=0 CG_MODE=FULL_DECODE_ONLY DIAG_ALLOW_PW034=1 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1 $MIX"
         "dd-mix-v2-fdonc  $V2 SPEC=1 EAGER=0 CG_MODE=FULL_DECODE_ONLY LLM_KW={\"compilation_config\":{\"mode\":0}} DIAG_ALLOW_PW034=1 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1 $MIX"
         "dd-mix-v2-cg0    $V2 SPEC=1 EAGER=0 CG_MODE=NONE DIAG_ALLOW_PW034=1 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1 $MIX"
         "dd-mix-v2-pw-bnc $V2 SPEC=1 EAGER=0 CG_MODE=PIECEWISE DIAG_ALLOW_PW034=1 VLLM_USE_BREAKABLE_CUDAGRAPH=1 LLM_KW={\"compilation_config\":{\"mode\":0}} DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1 $MIX"
         "dd-mix-v2-pw-brk $V2 SPEC=1 EAGER=0 CG_MODE=PIECEWISE DIAG_ALLOW_PW034=1 VLLM_USE_BREAKABLE_CUDAGRAPH=1 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1 $MIX"
         "dd-mix-v2-pw-ln0 $V2 SPEC=1 EAGER=0 CG_MODE=PIECEWISE DIAG_ALLOW_PW034=1 VLLM_USE_LAYERNAME=0 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1 $MIX"
         # 0.34.0 with FULL decode graphs and no torch.compile (refused by the runtime since 2026-12-07: its mixed run
         # diverged; DIAG_ALLOW_PW034 lifts the refusal for diagnosis) on the basic and sampled scenarios,
         # and vLLM's own DFlash chain compiled under PIECEWISE graphs (is the compiled chain identical?)
         "dd-v2-fdonc      $V2 SPEC=1 EAGER=0 CG_MODE=FULL_DECODE_ONLY LLM_KW={\"compilation_config\":{\"mode\":0}} DIAG_ALLOW_PW034=1 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1"
         "s-dd-v2-fdonc    $V2 SPEC=1 EAGER=0 CG_MODE=FULL_DECODE_ONLY LLM_KW={\"compilation_config\":{\"mode\":0}} DIAG_ALLOW_PW034=1 SEED_BASE=1000000 DDTREE_PATCH_ENABLE=1 $SAMPLED"
         "chain-mix-v2-pw  $V2 SPEC=1 EAGER=0 CG_MODE=PIECEWISE $MIX"
         # the same pair in bfloat16 (its own no-spec engine): the allowed mode's mixed proof in the other dtype
         "nospec-mix-v2-bf   $V2 SPEC=0 EAGER=1 LOGPROBS=2 DTYPE=bfloat16 ROOT=@ROOT_BF@ $MIX"
         "dd-mix-v2-bf       $V2 SPEC=1 EAGER=1 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1 DTYPE=bfloat16 ROOT=@ROOT_BF@ $MIX"
         "dd-mix-v2-fdonc-bf $V2 SPEC=1 EAGER=0 CG_MODE=FULL_DECODE_ONLY LLM_KW={\"compilation_config\":{\"mode\":0}} DIAG_ALLOW_PW034=1 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1 DTYPE=bfloat16 ROOT=@ROOT_BF@ $MIX"
         # DDTREE_PATCH_BUDGET=auto (issue 35.2) in the allowed mode, mixed: the diagnostic cycle (the budget
         # changes every step, mid-request: FULL decode graphs of several widths) and the policy itself; the
         # accounting's record of each walk's widths in $L (@L@; host copies: no SYNC_DEBUG), the policy with
         # SYNC_DEBUG and its periodic log line
         "dd-mix-v2-fdonc-auto  $V2 SPEC=1 EAGER=0 CG_MODE=FULL_DECODE_ONLY LLM_KW={\"compilation_config\":{\"mode\":0}} DIAG_ALLOW_PW034=1 DDTREE_PATCH_ENABLE=1 DDTREE_PATCH_BUDGET=auto:8 DDTREE_PATCH_AUTO_CYCLE=8,3,5,1,8,2,6 DDTREE_ACCOUNTING_RECORD=@L@/dd-mix-v2-fdonc-auto.widths $MIX"
         "dd-mix-v2-fdonc-autop $V2 SPEC=1 EAGER=0 CG_MODE=FULL_DECODE_ONLY LLM_KW={\"compilation_config\":{\"mode\":0}} DIAG_ALLOW_PW034=1 DDTREE_PATCH_ENABLE=1 SYNC_DEBUG=1 DDTREE_PATCH_BUDGET=auto:8 VLLM_LOG_STATS_INTERVAL=0.5 $MIX"
         # DIAG=1 (diag_fa.py): every FA layer call of a tree step checked against the dense references
         # (host syncs: diagnosis only): eager, compiled (no graphs / FULL decode / default FULL_AND_PIECEWISE),
         # PIECEWISE without torch.compile
         "dg-mix-v2        $V2 SPEC=1 EAGER=1 DIAG=1 DDTREE_PATCH_ENABLE=1 $MIX"
         "dg-mix-v2-cg0    $V2 SPEC=1 EAGER=0 CG_MODE=NONE DIAG=1 DIAG_ALLOW_PW034=1 DDTREE_PATCH_ENABLE=1 $MIX"
         "dg-mix-v2-fdo    $V2 SPEC=1 EAGER=0 CG_MODE=FULL_DECODE_ONLY DIAG=1 DIAG_ALLOW_PW034=1 DDTREE_PATCH_ENABLE=1 $MIX"
         "dg-mix-v2-fg     $V2 SPEC=1 EAGER=0 CG_MODE=FULL_AND_PIECEWISE DIAG=1 DIAG_ALLOW_PW034=1 DDTREE_PATCH_ENABLE=1 $MIX"
         "dg-mix-v2-pw-bnc $V2 SPEC=1 EAGER=0 CG_MODE=PIECEWISE DIAG=1 DIAG_ALLOW_PW034=1 VLLM_USE_BREAKABLE_CUDAGRAPH=1 LLM_KW={\"compilation_config\":{\"mode\":0}} DDTREE_PATCH_ENABLE=1 $MIX")

. "$REPO/scripts/_gpu_bundle.sh"

case "${1:-}" in
stage1)
  bundle_stage1
  exit 0 ;;
stage2)
  ph install
  bundle_install
  export VLLM_USE_V2_MODEL_RUNNER=0 DTYPE=${DTYPE:-float16} GPU_MEM=0.2 DEPTH=3 DDTREE_PATCH_BUDGET=8 \
    N_PROMPTS=${N_PROMPTS:-6} MAX_TOKENS=${MAX_TOKENS:-48}
  export ROOT=/tmp/tiny-branchy-$DTYPE${SIBLING:+-s$SIBLING}
  ph apply
  bundle_apply_series
  grep -E "^(PATCH|[a-z-]+ +(applied|upstream|not-applicable|pending))" "$O/apply.log" 2>/dev/null | cut -c1-60
  for dt in "$DTYPE" bfloat16; do  # the *-bf engines run the same pair in bfloat16 (ROOT_BF)
    root=/tmp/tiny-branchy-$dt${SIBLING:+-s$SIBLING}
    [ -d "$root/target" ] && continue
    ph "ckpt $dt"
    python3 "$REPO/tests/patches/engine_tools/make_tiny_ckpts.py" "$root" "$dt" > /dev/null \
      && python3 "$REPO/tests/patches/ddtree_tree_step/branchy_ckpts.py" "$root" ${SIBLING:-} || exit 6
  done
  ROOT_BF=/tmp/tiny-branchy-bfloat16${SIBLING:+-s$SIBLING}
  run_engine() {  # TAG ENV...: one engine process, its log in $L/TAG.log
    local tag=$1; shift
    set -- "${@//@ROOT_BF@/$ROOT_BF}"
    set -- "${@//@L@/$L}"
    ( unset DDTREE_PATCH_ENABLE CONTROL CG_MODE LOGPROBS SYNC_DEBUG LLM_KW DIAG DIAG_ALLOW_PW034 VLLM_USE_BREAKABLE_CUDAGRAPH VLLM_USE_LAYERNAME; export VLLM_USE_V2_MODEL_RUNNER=0 TAG=$tag "$@"
      timeout "$left" python3 "$REPO/tests/patches/ddtree_tree_step/run_tree_engine.py" > "$L/$tag.log" 2>&1 )
    echo "$tag rc=$?"; grep -E "ddtree-patch: (tree|DDTree)|Error|error" "$L/$tag.log" | cut -c1-300 | head -6
  }
  if [ "${PAR:-0}" = 1 ]; then
    # PAR=1: the selected engines at once, one GPU (tiny models): GPU_MEM each (PAR_GPU_MEM, default 0.04), a
    # torch.compile cache each, and no engine exits (freeing GPU memory) before all are past their start
    # (run_tree_engine.py HOLD_DIR: vLLM's start-up asserts that free memory does not grow while it profiles)
    sel=(); for e in "${ENGINES[@]}"; do set -- $e; engine_pending "$1" "${BUDGET:-420}" 60 && sel+=("$e"); done
    hold=$(mktemp -d); ph "parallel: ${#sel[@]} engines (limit ${left:-0}s)"
    for e in "${sel[@]}"; do
      set -- $e; tag=$1; shift
      run_engine "$tag" "$@" GPU_MEM=${PAR_GPU_MEM:-0.04} HOLD_DIR=$hold HOLD_N=${#sel[@]} \
        VLLM_CACHE_ROOT=/tmp/vcache-$tag TORCHINDUCTOR_COMPILE_THREADS=2 &
      sleep 1
    done
    wait; ph "parallel done"
  else
    for e in "${ENGINES[@]}"; do
      set -- $e; tag=$1; shift
      engine_pending "$tag" "${BUDGET:-420}" 40 || continue
      ph "$tag (limit ${left}s)"
      run_engine "$tag" "$@"
    done
  fi
  tar czf "$O/tree_e2e_logs.tgz" -C "$L" . 2>/dev/null
  python3 - "$L" "$O" "$REPO" <<'PY'
import glob, json, sys
logs, out = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3] + "/tests/patches/ddtree_tree_step")
from sampled_stats import sampled_ok, sampled_tests
TIE = 0.5  # nats: a divergence where no-spec's top-2 margin is below this is a near-tie (fp16 noise)
res = {}
for f in sorted(glob.glob(logs + "/*.log")):
    tag = f.rsplit("/", 1)[-1][:-4]
    res[tag] = next((json.loads(l[7:]) for l in open(f, errors="replace") if l.startswith("RESULT ")),
                    {"ok": False, "error": "no RESULT line"})

# the no-spec engines against each other (the graph modes agree without speculation); every other
# engine against the no-spec engine of its scenario and graph mode
NOSPEC_REFS = {"nospec": "nospec-pw", "nospec-pw": "nospec", "nospec-mix": "nospec-mix", "nospec-fg": "nospec-pw",
               "nospec-mix-fg": "nospec-mix", "nospec-v2": "nospec", "nospec-v2-fg": "nospec-v2",
               "nospec-mix-v2-fg": "nospec-mix-fg", "nospec-mix-v2-pw": "nospec-mix-v2"}

def ref_of(tag):
    """The no-spec engine of the tag's scenario, runner and graph mode (eager: none)."""
    if tag in NOSPEC_REFS:
        return NOSPEC_REFS[tag]
    parts = tag.split("-")
    mode = "-fg" if "fg" in parts else "-pw" if "pw" in parts else ""
    if {"fdo", "cg0"} & set(parts):  # the 0.34.0 mixed engines: against the PIECEWISE no-spec engine
        mode = "-pw"
    ref = "nospec" + ("-mix" if "mix" in parts else "") + ("-v2" if "v2" in parts else "") + mode \
        + ("-bf" if "bf" in parts else "")
    if ref not in res and ref.endswith("-fg"):  # compiled either way: the PIECEWISE no-spec engine
        ref = ref[:-3] + "-pw"
    return ref

def compare(r, ref):
    """Per request: None (identical) or (position, margin of ref's top-2 there, picked ref's runner-up)."""
    out = []
    for i, (a, b) in enumerate(zip(ref["tokens"], r["tokens"])):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            out.append(None); continue
        lp = ref["logprobs"][i][k]
        out.append((k, round(lp[0][1] - lp[1][1], 3), len(lp) > 1 and lp[1][0] == b[k]))
    return out

print(f"{'engine':<16} {'ok':<5} {'vs':<16} {'identical':<9} {'start s':<8} {'gen s':<7} {'hook':<5} {'tree':<5} "
      f"{'gstep':<5} {'ahead':<5} {'attn':<5} {'moved':<6} {'syncs ours/vLLM':<15} accepted lengths / divergences (pos, ref margin, runner-up)")
bad, summary = [], {}
for tag, r in res.items():
    ref_tag = ref_of(tag)
    ref = res.get(ref_tag)
    ts = (r.get("tree_step") or [{}])[0]
    hk = (r.get("hook") or [{}])[0] if isinstance(r.get("hook"), list) else {}
    sampled = tag.startswith("s-")  # a distribution test (below), not a token comparison
    cmp = compare(r, ref) if not sampled and r.get("ok") and ref and ref.get("ok") and ref.get("logprobs") else None
    ident = None if cmp is None else sum(c is None for c in cmp)
    summary[tag] = dict(vs=ref_tag, identical=ident, divergences=cmp)
    print(f"{tag:<16} {str(r.get('ok')):<5} {ref_tag:<16} {f'{ident}/{len(cmp)}' if cmp else '-':<9} "
          f"{str(r.get('engine_start_s')):<8} {str(r.get('generate_s')):<7} {str(hk.get('engaged_steps')):<5} "
          f"{str(ts.get('tree_steps')):<5} {str(ts.get('graph_steps')):<5} {str(ts.get('expected_steps')):<5} "
          f"{str(ts.get('attention_calls')):<5} "
          f"{str(ts.get('moved_rows')):<6} "
          f"{(str(r['sync']['ours']) + '/' + str(r['sync']['vllm'])) if r.get('sync') else '-':<15} "
          f"{ts.get('accepted_depths') or ''} {[c for c in cmp if c] if cmp else ''}")
    if r.get("error"):
        print("   error:", r["error"][:600])
    if isinstance(r.get("diag"), dict):  # DIAG=1 engines: the FA layer checks per step kind
        d = r["diag"]
        print(f"   diag: {d['checked_calls']} layer calls; " + "; ".join(
            f"{k}: {v['calls']} calls, max err tree {v['tree']} other {v['other']} ctx {v['ctx']} kv {v['kv']} "
            f"(|ref| {v['ref_max']})" for k, v in d["by_kind"].items()) + (f"; errors {d['errors']}" if d["errors"] else ""))
        for b in d["first_bad"][:4]:
            print("   diag bad:", json.dumps(b)[:400])
    if not r.get("ok"):
        bad.append(tag); continue
    if tag.startswith("dd-"):  # trees walked, moved, and every divergence a near-tie resolved to the runner-up
        near = all(c is None or (c[1] < TIE and c[2]) for c in (cmp or [None]))
        # mixed: chain-routed requests share tree steps; V2: its warm-up (vllm/v1/worker/gpu/warmup.py)
        # runs one step with a grammar bitmask for dummy requests, verified by vLLM's chain sampler
        # (0.26.0: one step; 0.34.0: 8 steps, 20 grammar fallbacks, every chain step of the run a warm-up one)
        warmup = "v2" in tag.split("-") and hk.get("chain_steps") and set(hk.get("fallbacks") or {}) == {"grammar"}
        chain_ok = hk.get("chain_steps") == 0 or "mix" in tag or warmup
        graphs_ok = "-fg" not in tag or ts.get("graph_steps")  # FULL graphs: uniform decode steps seen
        if not (cmp and near and ts.get("tree_steps") and chain_ok and graphs_ok and ts.get("moved_rows")):
            bad.append(tag)
        elif r.get("sync") and r["sync"]["ours"]:
            bad.append(tag + " (host syncs in ddtree_patcher: " + str(r["sync"]["samples_ours"]) + ")")
for ref_tag, dd_tag in (("s-nospec", "s-dd"), ("s-nospec-v2", "s-dd-v2"),
                        ("s-nospec-v2", "s-dd-v2-fdonc")):  # sampled: same distribution
    ref, r = res.get(ref_tag), res.get(dd_tag)
    if not (ref and r and ref.get("ok") and r.get("ok")):
        continue
    tests = sampled_tests(ref["tokens"], r["tokens"])
    ts = (r.get("tree_step") or [{}])[0]
    summary[dd_tag] = dict(vs=ref_tag, n=[len(ref["tokens"]), len(r["tokens"])], tests=tests, tree_step=ts)
    print(f"{dd_tag} vs {ref_tag}: n={len(r['tokens'])}, tree steps {ts.get('tree_steps')}, moved {ts.get('moved_rows')}; "
          + "; ".join(f"{name} p={t['omnibus']['p']}/{t['top_vs_rest']['p']} (top {t['top_vs_rest']['freq']})"
                      for name, t in tests.items()))
    if not (sampled_ok(tests) and ts.get("tree_steps") and ts.get("moved_rows")):
        bad.append(dd_tag + " (distribution)")
for one, two in (("sd1", "sd2"), ("sd1-v2", "sd2-v2")):  # issue 33: a seeded request's tokens are its own
    a, b = res.get(one), res.get(two)
    if not (a and b and a.get("ok") and b.get("ok")):
        continue
    hk = (b.get("hook") or [{}])[0] if isinstance(b.get("hook"), list) else {}
    same = a["tokens"][0] == b["tokens"][0]
    summary[two] = dict(vs=one, seeded_same=same, alone=a["tokens"][0], beside=b["tokens"][0],
                        fallbacks=hk.get("fallbacks"), engaged_steps=hk.get("engaged_steps"))
    print(f"{two} vs {one}: seeded request {'identical' if same else 'DIFFERS'} alone and beside a penalties "
          f"request ({len(a['tokens'][0])} tokens; walk steps {hk.get('engaged_steps')}, fallbacks {hk.get('fallbacks')})")
    if not same or not hk.get("engaged_steps"):
        bad.append(two + " (seeded parity)")
json.dump({"engines": res, "summary": summary, "tie_nats": TIE}, open(out + "/tree_e2e.json", "w"), indent=1)
print("TREE-E2E", ("FAIL " + ",".join(bad)) if bad else "ok", f"({len(res)} engines; divergences allowed only at "
      f"no-spec near-ties < {TIE} nats resolved to the runner-up)")
PY
  ;;
*) echo "usage: gpu_tree_e2e.sh stage1|stage2" >&2; exit 2 ;;
esac
