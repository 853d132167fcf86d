"""tree-walk-hook: a thin, gated call site in each runner's sampling function that hands a batch
of DDTree *trees* (one parent index per draft node) to the tree-walk kernel.

Every vLLM release verifies drafts as a chain: draft ``j`` is compared with row ``j-1``. A tree
submitted in node order is therefore verified against the wrong rows and acceptance collapses
to about one token. The rewrite wraps the runner's single ``self.rejection_sampler(...)`` call:

* once per runner (its first speculative step) it reads the environment: unless
  ``DDTREE_PATCH_ENABLE`` or ``DDTREE_PATCH_CHAIN_AS_TREE`` is set, the runner remembers
  ``None`` and every later step costs one attribute lookup and one branch before vLLM's own
  chain sampler runs, untouched;
* otherwise it imports ``ddtree_patcher.runtime.hook`` (lazily; a missing or incompatible module is a
  clear error naming the fix) and binds a per-runner ``VerifyStep`` with the call site's hook ABI
  (``hook_abi=N`` is written into the call site, so a mismatch is detected at call time);
* each step the ``VerifyStep`` returns vLLM's usual output when every request carries a tree and
  all sampling parameters are tree-safe, else ``None`` and the chain sampler runs.

Sites (one per runner; both classes are named ``GPUModelRunner``, so two files):

* V1 ``vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._sample``, two shapes: ``v1-0.20``
  (0.20.0-0.21.0, passes ``None`` as draft probs) and ``v1-0.22`` (0.22.0-0.33.0, passes
  ``self._get_spec_decode_draft_probs(...)``'s result). ``CPUModelRunner`` inherits it.
* V2 ``vllm/v1/worker/gpu/model_runner.py::GPUModelRunner.sample`` from 0.24.0 (the first
  release where DFlash runs on V2; the rejection sampler returns ``num_rejected`` itself).
  On 0.20.0-0.23.0 the V2 file exists but cannot host DFlash: not applicable.

Not applicable before 0.20.0 (no DFlash). Nothing is upstream. vLLM 0.34.0 has no V1 runner (its file is
not applicable); its V2 ``sample`` (the shard gather and the logits call moved, the grammar's invalid
drafts left the call) carries the V2 site, proven on CPU (tests/patches/test_ddtree_v2.py).
"""

from __future__ import annotations

from ddtree_patcher.runtime.contract import ENV_CHAIN, ENV_ENABLE, HOOK_ABI, mark
from ddtree_patcher.patchlib import (
    DFLASH_MODEL, V1_DFLASH, Patch, PatchFile, Site, Variant, cst, m, runtime_abi,
)

ID = "tree-walk-hook"
MARK = mark(ID)
V1_PY = "vllm/v1/worker/gpu_model_runner.py"
V2_PY = "vllm/v1/worker/gpu/model_runner.py"
V1_FN = "GPUModelRunner._sample"
V2_FN = "GPUModelRunner.sample"


# ---- anchor: `sampler_output = self.rejection_sampler(...)` ---------------------------------
def _rejection_call():
    return m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("rejection_sampler")))


def _assign_line():
    return m.SimpleStatementLine(body=[m.Assign(
        targets=[m.AssignTarget(target=m.Name("sampler_output"))], value=_rejection_call())])


MISSING = (
    "ddtree-patch: DDTree is requested but ddtree_patcher.runtime.hook (hook ABI {abi}) cannot be imported: "
    "install ddtree-patch in this environment, run `ddtree-patch revert`, or unset {env}"
)


def _call_site(runner: str, method: str, args: str) -> str:
    """The statements that replace the anchor (the anchor itself replaces ``__ORIGINAL__``)."""
    msg = MISSING.format(abi=HOOK_ABI, env=f"{ENV_ENABLE}/{ENV_CHAIN}")
    return f"""\
_ddtree = self.__dict__.get("ddtree_hook", False)  {MARK}
if _ddtree is False:  {MARK} (first speculative step of this runner)
    import os as _ddtree_os  {MARK}
    _ddtree = self.ddtree_hook = None  {MARK}
    if any(_ddtree_os.environ.get(k, "0") not in ("", "0") for k in ("{ENV_ENABLE}", "{ENV_CHAIN}")):  {MARK}
        try:  {MARK}
            from ddtree_patcher.runtime.hook import bind as _ddtree_bind  {MARK}
        except ImportError as _ddtree_err:  {MARK}
            raise RuntimeError({msg!r}) from _ddtree_err  {MARK}
        _ddtree = self.ddtree_hook = _ddtree_bind(self, "{runner}", hook_abi={HOOK_ABI})  {MARK}
sampler_output = None if _ddtree is None else _ddtree.{method}({args})  {MARK}
if sampler_output is None:  {MARK} (no tree in this batch: vLLM's chain sampler)
    __ORIGINAL__
"""


def _rewrite(runner: str, method: str):
    """A ``Site.rewrite``: the anchor line becomes the gated call site above."""

    def make(patch_id: str):
        from ddtree_patcher.rewriters import CountingTransformer

        class CallSite(CountingTransformer):
            def __init__(self):
                super().__init__(patch_id)
                self.matcher = _assign_line()

            def leave_SimpleStatementLine(self, original_node, updated_node):
                if not m.matches(original_node, self.matcher):
                    return updated_node
                self.matches += 1
                call = original_node.body[0].value
                empty = cst.Module(body=[])
                args = ", ".join(empty.code_for_node(a.value) for a in call.args)
                block = cst.parse_module(_call_site(runner, method, args))
                last = block.body[-1]  # `if sampler_output is None: __ORIGINAL__`
                original = original_node.with_changes(leading_lines=())
                last = last.with_changes(body=last.body.with_changes(body=[original]))
                first = block.body[0].with_changes(leading_lines=original_node.leading_lines)
                return cst.FlattenSentinel([first, *block.body[1:-1], last])

        return CallSite()

    return make


def _v2_hosts_dflash(module, node) -> bool:
    """From 0.24.0 the V2 rejection sampler returns ``num_rejected`` itself (and DFlash runs on
    V2); before, ``sample`` computes it and the V2 runner has no DFlash speculator."""
    return "sampler_output.num_rejected" in module.code_for_node(node)


V1_SITE = Site(
    function=V1_FN,
    anchor="`sampler_output = self.rejection_sampler(spec_decode_metadata, <draft probs>, logits, "
           "sampling_metadata)`",
    unfixed=_assign_line,
    rewrite=_rewrite("V1", "sample_v1"),
)

V2_SITE = Site(
    function=V2_FN,
    anchor="`sampler_output = self.rejection_sampler(logits, input_batch, ...)` (V2 runner)",
    unfixed=_assign_line,
    rewrite=_rewrite("V2", "sample_v2"),
    applies=_v2_hosts_dflash,
)

ON_V1_A = ("0.20.0", "0.20.1", "0.20.2", "0.21.0")
ON_V1_B = ("0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0",
           "0.30.0", "0.31.0", "0.32.0", "0.33.0")
ON_V2_OLD = ("0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0")
ON_V2 = ON_V1_B[3:]  # 0.24.0 ... 0.33.0

# Pristine cst shape hashes (ddtree_patcher.cst_helpers.shape_hash) from the official wheels.
SHAPES_V1_A = {V1_FN: frozenset({"dde44adabe45"})}  # 0.20.0-0.21.0: `None,  # draft_probs`
SHAPES_V1_B = {V1_FN: frozenset({"e8615af5c218"})}  # 0.22.0-0.33.0: `draft_probs`
# 0.24.0-0.28.0, 0.29.0-0.30.0, 0.31.0, 0.32.0-0.33.0 (adds invalid_drafts and batch sharding)
# 0.34.0 (V2-only): the shard gather and the logits call moved, the grammar's invalid drafts left the call
SHAPES_V2 = {V2_FN: frozenset({"d58876dc8445", "6a152f0c6da1", "cd371424437d", "5585f4a055cf", "ea37fe5f6b62"})}

def _runtime(site, python: str | None) -> str | None:
    """The call sites import ``ddtree_patcher.runtime.hook`` in vLLM's interpreter (``--python``, else
    the one running ddtree-patch): it must be importable there and speak the ABI written in them."""
    from ddtree_patcher.runtime.guard import _ABI_RE

    written = set()
    for rel in (V1_PY, V2_PY):
        try:
            written |= {int(a) for a in _ABI_RE.findall((site / rel).read_bytes())}
        except FileNotFoundError:
            pass
    abi, where = runtime_abi("ddtree_patcher.runtime.hook", "HOOK_ABI", python)
    if abi is None:
        return (f"{python} cannot import ddtree_patcher.runtime.hook ({where}): the patched vLLM would fail when "
                "DDTree is requested; install ddtree-patch in that environment or `ddtree-patch revert`")
    if written != {abi}:
        return (f"the call sites speak hook ABI {sorted(written)} but ddtree_patcher.runtime.hook in {where} speaks "
                f"{abi}: run `ddtree-patch revert && ddtree-patch apply` with the installed ddtree-patch")
    return None


PATCH = Patch(
    id=ID,
    summary="Gated call site in the V1 and V2 runners' sampling that verifies DDTree draft trees "
            "with the tree-walk kernel (ddtree_patcher.runtime.hook); vLLM's chain sampler otherwise",
    kind="hook",
    upstream=(),
    requires=(DFLASH_MODEL,),
    doc="docs/patches/tree-walk-hook.md",
    runtime=_runtime,
    files=(
        PatchFile(
            path=V1_PY,
            gone_with=V1_DFLASH,
            variants=(
                Variant("v1-0.20", ON_V1_A, (V1_SITE,), SHAPES_V1_A),
                Variant("v1-0.22", ON_V1_B, (V1_SITE,), SHAPES_V1_B),
            ),
        ),
        PatchFile(
            path=V2_PY,
            optional=True,
            variants=(Variant("v2-0.24", ON_V2 + ON_V2_OLD + ("0.34.0",), (V2_SITE,), SHAPES_V2),),
        ),
    ),
)
