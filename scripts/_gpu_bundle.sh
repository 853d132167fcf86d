# Shared by the H200 scripts that run the offline vLLM 0.26.0 bundle (/work/shared/gpu/README.md)
# with the whole repository patched in: sourced, needs REPO and O set.
#   bundle_stage1   first `run` call (carry .bundle/01 and .whl): part 1 of the bundle, libcst
#   bundle_install  second call (carry .bundle/02): unpack into /tmp/site once per machine, export
#                   the environment every engine process of these scripts runs with

bundle_stage1() {
  mkdir -p /tmp/vb && cp "$REPO"/.bundle/01/* /tmp/vb/ && ls -la /tmp/vb | tail -3
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tools "$REPO"/.whl/*.whl \
    && python3 -c "import sys; sys.path.insert(0, '/tmp/tools'); import libcst; print('libcst', libcst.__file__)"
  nvidia-smi -L
}

bundle_install() {
  if [ ! -f /tmp/site/.bundle-sha256 ]; then
    cp "$REPO"/.bundle/02/* /tmp/vb/ || exit 3
    eval "$(bash /tmp/vb/device_install.sh | tee "$O/install.log" | grep '^export ')" || exit 4
  fi
  export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/site:/tmp/tools:$REPO PYTHONUNBUFFERED=1 \
    VLLM_ENABLE_V1_MULTIPROCESSING=0
}
