# Shared by the H200 scripts that run an offline vLLM bundle (/work/shared/gpu/README.md: 0.26.0 in two
# chunks, 0.34.0 in three) with the whole repository patched in: sourced, needs REPO and O set.
# Where: the parts travel in $REPO/$BUNDLE_DIR/0* (default .bundle), are gathered in $VB (/tmp/vb) and unpacked
# into $SITE (/tmp/site). A second release on the same warm machine takes its own three, e.g.
# BUNDLE_DIR=.bundle-0.28.0 VB=/tmp/vb-0.28.0 SITE=/tmp/site-0.28.0 (and its own LOGS).
#   bundle_stage1   first `run` call (carry .bundle/01 and .whl): part 1 of the bundle, libcst; a
#                   bundle of more parts: the same for each further part but the last (carry .bundle/02)
#   bundle_install  the last part's call (carry .bundle/02, or 03): unpack into $SITE once per machine, export
#                   the environment every engine process of these scripts runs with; installs
#                   libcst if stage 1 did not (.whl may travel with either call: with a larger
#                   bundle part 1, .bundle/01 + .whl + the tree can exceed the 64 MiB a call carries)
#   bundle_apply_series   the whole patch series applied to $SITE once per machine ($O/apply.log)
#   engine_pending TAG BUDGET MIN   whether engine TAG still has to run: not finished in $L (a RESULT
#                   line with "ok": true), selected by ONLY, and at least MIN of the BUDGET seconds
#                   since T0 left (then sets `left`); says SKIP otherwise

BUNDLE_DIR=${BUNDLE_DIR:-.bundle} VB=${VB:-/tmp/vb} SITE=${SITE:-/tmp/site}

bundle_libcst() {  # libcst into /tmp/tools from the carried .whl, once per machine
  [ -d /tmp/tools/libcst ] && return 0
  ls "$REPO"/.whl/*.whl > /dev/null 2>&1 || { echo "no .whl here: libcst not installed yet"; return 0; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tools "$REPO"/.whl/*.whl \
    && python3 -c "import sys; sys.path.insert(0, '/tmp/tools'); import libcst; print('libcst', libcst.__file__)"
}

bundle_gather() {  # the parts this call carries ($REPO/$BUNDLE_DIR/0*/) into $VB; non-zero when a copy fails
  local d
  mkdir -p "$VB" || return 1
  for d in "$REPO/$BUNDLE_DIR"/0*/; do
    [ -d "$d" ] || continue
    cp -f "$d"* "$VB"/ || return 1
  done
}

bundle_stage1() {  # every part this call carries
  bundle_gather || return 3
  ls -la "$VB" | tail -3
  bundle_libcst
  nvidia-smi -L
}

bundle_install() {
  bundle_libcst
  if [ ! -f "$SITE/.bundle-sha256" ]; then
    bundle_gather || exit 3
    eval "$(bash "$VB/device_install.sh" "$VB" "$SITE" | tee "$O/install.log" | grep '^export ')" || exit 4
  fi
  export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=$SITE:/tmp/tools:$(ddtree_path) PYTHONUNBUFFERED=1 \
    VLLM_ENABLE_V1_MULTIPROCESSING=0
  cd /tmp  # engines never run in the checkout: `python -m` subprocesses (vLLM's model registry) put the
           # working directory first on sys.path, where the checkout's kernels/ would shadow the
           # `kernels` package transformers imports
}

ddtree_path() {  # a folder holding only a link to the checkout's ddtree_patcher: PYTHONPATH gets the package,
  # never the checkout's other top-level folders (kernels/, patches/, tests/: they would shadow packages
  # of the same name, e.g. `kernels`, which transformers 5.x imports)
  mkdir -p /tmp/ddtree_path && ln -sfn "$REPO/ddtree_patcher" /tmp/ddtree_path/ddtree_patcher && echo /tmp/ddtree_path
}

bundle_apply_series() {
  if ! grep -q "ddtree-patch: ddtree-tree-step" "$SITE/vllm/v1/attention/backends/flash_attn.py" 2>/dev/null; then
    python3 -m ddtree_patcher.cli apply --vllm-path "$SITE" > "$O/apply.log" 2>&1 || { cat "$O/apply.log"; exit 5; }
  fi
}

engine_pending() {
  local tag=$1
  [ -f "$L/$tag.log" ] && grep -q '^RESULT .*"ok": true' "$L/$tag.log" && return 1
  case " ${ONLY:-$tag} " in *" $tag "*) ;; *) return 1 ;; esac
  left=$(( $2 - ($(date +%s) - T0) ))
  if [ $left -lt "$3" ]; then echo "SKIP $tag (${left} s left)"; return 1; fi
}
