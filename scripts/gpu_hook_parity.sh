#!/bin/bash
# gpu_hook_parity.sh STAGE : tree-walk-hook parity on an H200 with the offline vLLM 0.26.0 bundle
# (/work/shared/gpu/README.md), V1 and V2 runners, eager and CUDA graphs, a batch mixing sampling
# parameters (tests/patches/hook_parity/run_llm_parity.py), with the step under
# torch.cuda.set_sync_debug_mode("error"). Two `run` calls (one bundle chunk each, the second
# while the machine is warm), from the repository root:
#
#   run(carry=[".bundle/01", ".whl"], command="bash scripts/gpu_hook_parity.sh stage1")
#   run(carry=[".bundle/02"],         command="bash scripts/gpu_hook_parity.sh stage2")
#
# .bundle/ and .whl/ as for scripts/gpu_e2e.sh. Each configuration runs twice in its own process:
# without speculation (reference) and with DFlash + DDTREE_PATCH_CHAIN_AS_TREE=1 + SYNC_DEBUG=1.
# Prints a table (run, greedy identical to no-spec, steps through the walk, chain steps, tree
# requests, per-request fallbacks, step calls under sync debug) and writes $OUT/parity.json.
# BUDGET (s, default 330) skips the configurations that no longer fit.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
O=${OUT:-/tmp/out}; mkdir -p "$O"
T0=$(date +%s)
ph() { echo "=== PHASE $1 at +$(( $(date +%s) - T0 ))s"; }
case "${1:-}" in
stage1)
  mkdir -p /tmp/vb && cp "$REPO"/.bundle/01/* /tmp/vb/ && ls -la /tmp/vb | tail -3
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tools "$REPO"/.whl/*.whl
  nvidia-smi -L
  exit 0 ;;
stage2) ;;
*) echo "usage: gpu_hook_parity.sh stage1|stage2" >&2; exit 2 ;;
esac

ph install
cp "$REPO"/.bundle/02/* /tmp/vb/ || exit 3
eval "$(bash /tmp/vb/device_install.sh | tee "$O/install.log" | grep '^export ')" || exit 4
export PYTHONPATH=/tmp/site:/tmp/tools:$REPO PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 ROOT=/tmp/tiny
ph apply
python3 -m ddtree_patcher.cli apply --vllm-path /tmp/site --patch tree-walk-hook > "$O/apply.log" 2>&1 || { cat "$O/apply.log"; exit 5; }
ph ckpt; python3 "$REPO/tests/patches/engine_tools/make_tiny_ckpts.py" $ROOT > /dev/null
#        tag         spec runner eager
for cfg in "v2-eager 0 1 1" "v2-eager 1 1 1" "v1-eager 0 0 1" "v1-eager 1 0 1" \
           "v2-graphs 0 1 0" "v2-graphs 1 1 0" "v1-graphs 0 0 0" "v1-graphs 1 0 0"; do
  set -- $cfg
  tag=$1-$([ "$2" = 1 ] && echo tree || echo nospec)
  left=$(( ${BUDGET:-330} - ($(date +%s) - T0) ))
  if [ $left -lt 60 ]; then echo "SKIP $tag (no time left)"; continue; fi
  ph "$tag"
  ( export VLLM_USE_V2_MODEL_RUNNER=$3
    [ "$2" = 1 ] && export DDTREE_PATCH_CHAIN_AS_TREE=1 SYNC_DEBUG=1
    TAG=$tag SPEC=$2 EAGER=$4 timeout $(( left < 150 ? left : 150 )) \
      python3 "$REPO/tests/patches/hook_parity/run_llm_parity.py" > "$O/$tag.log" 2>&1 )
  echo "rc=$?"; grep -E "Error|ddtree-patch: hook" "$O/$tag.log" | cut -c1-250 | head -6
done
ph compare
python3 - "$O" <<'PY'
import glob, json, sys
r = {}
for f in sorted(glob.glob(sys.argv[1] + "/*-*-*.log")):
    for line in open(f, errors="replace"):
        if line.startswith("RESULT "):
            d = json.loads(line[7:]); r[d["tag"]] = d
rows = []
print(f"{'run':<16} {'ok':<3} {'greedy==nospec':<15} {'walk steps':<10} {'chain steps':<11} {'tree reqs':<9} {'sync-debug calls':<16} fallbacks")
for tag in sorted(t for t in r if t.endswith("-tree")):
    d, base = r[tag], r.get(tag[:-5] + "-nospec", {})
    same = None
    if d.get("tokens") and base.get("tokens"):
        same = d["tokens"][:4] == base["tokens"][:4]  # the 4 greedy requests
    h = (d.get("hook") or [{}])[0] if isinstance(d.get("hook"), list) and d.get("hook") else {}
    row = dict(run=tag, ok=d.get("ok"), greedy_identical=same, walk_steps=h.get("engaged_steps"),
               chain_steps=h.get("chain_steps"), tree_requests=h.get("tree_requests"),
               fallbacks=h.get("fallbacks"), sync_debug_calls=d.get("step_calls_under_sync_debug"),
               error=d.get("error"), nospec_ok=base.get("ok"), engine_start_s=d.get("engine_start_s"))
    rows.append(row)
    print(f"{tag:<16} {str(d.get('ok')):<3} {str(same):<15} {str(h.get('engaged_steps')):<10} {str(h.get('chain_steps')):<11} "
          f"{str(h.get('tree_requests')):<9} {str(d.get('step_calls_under_sync_debug')):<16} {h.get('fallbacks')}")
    if d.get("error"):
        print("   error:", d["error"][:300])
json.dump({"vllm": next((v.get("vllm") for v in r.values()), None), "rows": rows}, open(sys.argv[1] + "/parity.json", "w"), indent=1)
PY
ph end
cd "$O" && tar czf logs.tgz *-*-*.log && rm -f *-*-*.log
