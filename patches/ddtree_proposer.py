"""ddtree-proposer: gated call sites that make a DFlash drafter draft DDTree *trees* (a node
budget N per request, decoupled from the drafter's depth L) on the V1 and V2 runners.

The switch is the environment: ``DDTREE_PATCH_ENABLE=1`` and ``DDTREE_PATCH_BUDGET=N``; off, every
site costs one dict lookup and one branch (the config site: one environment lookup, once). The
logic lives in ``ddtree_patcher.runtime.ddtree`` (imported lazily, only when DDTree is on).

Sites (each insert is a few marked lines; the anchor itself is kept unchanged):

* ``vllm/config/speculative.py::SpeculativeConfig._verify_args`` (0.20.0-0.33.0), after
  ``if self.num_speculative_tokens <= 0: raise ...``: for a DFlash drafter with DDTree on,
  ``configure(self)`` validates the switch, records ``{budget: N, depth: L}`` on the config and
  sets ``num_speculative_tokens = N`` (scheduler, runner and KV slots sized for N verify nodes),
  then, until issue 13's tree-shaped target step exists, refuses to start.
* V1 ``vllm/v1/spec_decode/dflash.py::DFlashProposer.__init__``, after ``super().__init__(...)``:
  bind the per-drafter DDTree state and pin ``num_speculative_tokens`` to L_eff = min(L, N)
  before DFlash sizes its query buffers.
* V1 ``vllm/v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer.propose``: (0.24.0+ only,
  variant ``v1-0.24``) after ``self.num_speculative_tokens = num_speculative_tokens`` (the
  runner's per-call K = N) re-pin L_eff; (every release) at the top of the parallel-drafting
  early exit ``if self.num_speculative_tokens == 1 or self.parallel_drafting:`` return the node
  tokens ``[B, N]`` built from the position logits instead of the per-position argmax. On
  0.20.0-0.23.0 (variant ``v1-0.20``) ``propose`` takes no K: the pin at construction holds.
* V2 ``vllm/v1/worker/gpu/spec_decode/dflash/speculator.py`` (0.24.0+):
  ``DFlashSpeculator.__init__`` after ``super().__init__(vllm_config, device)`` (the base class
  sized ``draft_tokens`` ``[max_num_reqs, N]``; pin ``num_speculative_steps`` to L_eff), and
  ``DFlashSpeculator._generate_draft`` before ``draft_tokens = self.sample_draft(...)`` (inside
  the FULL draft graph: the tree is built into fixed-address buffers).
* V2 ``vllm/v1/worker/gpu/model_runner.py::GPUModelRunner.sample_tokens`` (0.24.0+), before
  ``self.req_states.draft_tokens[input_batch.idx_mapping] = draft_tokens``: per request the tree
  (attached to the runner's VerifyStep) or a chain. On 0.20.0-0.23.0 the V2 runner exists but
  cannot host DFlash: not applicable (the test of tree-walk-hook's V2 site).
* ``vllm/v1/core/sched/scheduler.py::Scheduler.schedule`` (0.24.0+, where vLLM's dynamic speculative
  decoding sets ``num_spec_tokens_to_schedule``), right after that lookup: with
  ``DDTREE_PATCH_BUDGET=auto`` the next step's draft count is the budget policy's pick
  (``runtime.budget_site``); otherwise vLLM's count stands (one dict lookup and one branch per step).
  Not applicable where the scheduler has no such count (0.20.0-0.23.0).

Not applicable before 0.20.0 (no DFlash). Nothing is upstream. vLLM 0.34.0 has no V1 runner (its files
are not applicable); its config, V2 speculator and V2 runner carry the V2 sites (new shapes, the
anchors and what the runtime reads unchanged; proven on CPU: tests/patches/test_ddtree_v2.py).
"""

from __future__ import annotations

from ddtree_patcher.runtime.contract import CONFIG_ATTR, DDTREE_ABI, ENV_ENABLE, mark
from ddtree_patcher.patchlib import (
    DFLASH_MODEL, V1_DFLASH, Patch, PatchFile, Site, Variant, cst, insert_statements, m, runtime_check,
)

ID = "ddtree-proposer"
MARK = mark(ID)

SPEC_PY = "vllm/config/speculative.py"
DFLASH_V1_PY = "vllm/v1/spec_decode/dflash.py"
PROPOSER_PY = "vllm/v1/spec_decode/llm_base_proposer.py"
DFLASH_V2_PY = "vllm/v1/worker/gpu/spec_decode/dflash/speculator.py"
RUNNER_V2_PY = "vllm/v1/worker/gpu/model_runner.py"
SCHED_PY = "vllm/v1/core/sched/scheduler.py"
SCHED_FN = "Scheduler.schedule"
CONFIG_FN = "SpeculativeConfig._verify_args"
V1_INIT_FN = "DFlashProposer.__init__"
PROPOSE_FN = "SpecDecodeBaseProposer.propose"
V2_INIT_FN = "DFlashSpeculator.__init__"
V2_DRAFT_FN = "DFlashSpeculator._generate_draft"
V2_RUNNER_FN = "GPUModelRunner.sample_tokens"

MISSING = ("ddtree-patch: DDTree is requested but ddtree_patcher.runtime.ddtree (ABI {abi}) cannot be "
           "imported: install ddtree-patch in this environment, run `ddtree-patch revert`, or unset "
           f"{ENV_ENABLE}")


def _import(name: str, alias: str) -> str:
    msg = MISSING.format(abi=DDTREE_ABI)
    return f"""\
    try:  {MARK}
        from ddtree_patcher.runtime.ddtree import {name} as {alias}  {MARK}
    except ImportError as _ddtree_err:  {MARK}
        raise RuntimeError({msg!r}) from _ddtree_err  {MARK}
"""


def _gate(record: str) -> str:
    """The condition of a binding site: the config carries DDTree's record, or this process
    asks for DDTree (the runtime checks that both agree)."""
    return (f'vars({record}).get("{CONFIG_ATTR}") is not None or '
            f'_ddtree_os.environ.get("{ENV_ENABLE}", "0") not in ("", "0")')


CONFIG_CODE = f"""\
import os as _ddtree_os  {MARK}
if self.method == "dflash" and _ddtree_os.environ.get("{ENV_ENABLE}", "0") not in ("", "0"):  {MARK}
{_import("configure", "_ddtree_configure")}\
    _ddtree_configure(self, ddtree_abi={DDTREE_ABI})  {MARK}
"""

V1_BIND_CODE = f"""\
self.ddtree_proposer = None  {MARK}
import os as _ddtree_os  {MARK}
if {_gate("self.speculative_config")}:  {MARK}
{_import("bind_v1", "_ddtree_bind")}\
    self.ddtree_proposer = _ddtree_bind(self, runner, ddtree_abi={DDTREE_ABI})  {MARK}
"""

V1_DEPTH_CODE = f"""\
_ddtree = self.__dict__.get("ddtree_proposer")  {MARK}
if _ddtree is not None:  {MARK} (DDTree: the runner's K is the node budget; draft L_eff positions)
    self.num_speculative_tokens = _ddtree.steps_for(num_speculative_tokens)  {MARK}
"""

V1_TREE_CODE = f"""\
_ddtree = self.__dict__.get("ddtree_proposer")  {MARK}
if _ddtree is not None:  {MARK} (DDTree: node tokens [B, N] from the position logits)
    return _ddtree.propose_v1(self, sample_hidden_states)  {MARK}
"""

V2_BIND_CODE = f"""\
self.ddtree_proposer = None  {MARK}
import os as _ddtree_os  {MARK}
if {_gate("self.speculative_config")}:  {MARK}
{_import("bind_v2", "_ddtree_bind")}\
    self.ddtree_proposer = _ddtree_bind(self, ddtree_abi={DDTREE_ABI})  {MARK}
"""

V2_TREE_CODE = f"""\
if self.__dict__.get("ddtree_proposer") is not None:  {MARK} (DDTree: the tree instead of the argmax)
    return self.ddtree_proposer.draft_v2(self, sample_hidden_states, num_reqs)  {MARK}
"""

SCHED_MISSING = MISSING.replace("ddtree_patcher.runtime.ddtree", "ddtree_patcher.runtime.budget_site")
SCHED_CODE = f"""\
_ddtree_auto = self.__dict__.get("ddtree_budget_auto", False)  {MARK}
if _ddtree_auto is False:  {MARK} (the first schedule() of this scheduler)
    _ddtree_auto = self.ddtree_budget_auto = None  {MARK}
    if self.num_spec_tokens and __import__("os").environ.get("{ENV_ENABLE}", "0") not in ("", "0"):  {MARK}
        try:  {MARK}
            from ddtree_patcher.runtime.budget_site import bind_scheduler as _ddtree_bind_scheduler  {MARK}
        except ImportError as _ddtree_err:  {MARK}
            raise RuntimeError({SCHED_MISSING.format(abi=DDTREE_ABI)!r}) from _ddtree_err  {MARK}
        _ddtree_auto = self.ddtree_budget_auto = _ddtree_bind_scheduler(self, ddtree_abi={DDTREE_ABI})  {MARK}
if _ddtree_auto is not None and num_scheduled_tokens:  {MARK} (DDTREE_PATCH_BUDGET=auto: the next step's budget)
    num_spec_tokens_to_schedule = _ddtree_auto.pick(len(num_scheduled_tokens))  {MARK}
"""

V2_TOKENS_CODE = f"""\
_ddtree = self.speculator.__dict__.get("ddtree_proposer")  {MARK}
if _ddtree is not None:  {MARK} (DDTree: per request the tree or a chain; trees to the TreeStep)
    draft_tokens = _ddtree.tokens_v2(self, input_batch, draft_tokens)  {MARK}
"""


# ---- anchors --------------------------------------------------------------------------------
def _self_attr(name: str):
    return m.Attribute(value=m.Name("self"), attr=m.Name(name))


def _config_anchor():
    """``if self.num_speculative_tokens <= 0: raise ValueError(...)``"""
    return m.If(test=m.Comparison(left=_self_attr("num_speculative_tokens"),
                                  comparisons=[m.ComparisonTarget(operator=m.LessThanEqual(),
                                                                  comparator=m.Integer("0"))]))


def _super_init():
    """``super().__init__(...)`` on its own line."""
    return m.SimpleStatementLine(body=[m.Expr(value=m.Call(func=m.Attribute(
        value=m.Call(func=m.Name("super")), attr=m.Name("__init__"))))])


def _k_assign():
    """``self.num_speculative_tokens = num_speculative_tokens`` (0.24.0+)."""
    return m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=_self_attr("num_speculative_tokens"))],
                                                value=m.Name("num_speculative_tokens"))])


def _parallel_exit():
    """``if self.num_speculative_tokens == 1 or self.parallel_drafting:``"""
    return m.If(test=m.BooleanOperation(
        left=m.Comparison(left=_self_attr("num_speculative_tokens"),
                          comparisons=[m.ComparisonTarget(operator=m.Equal(), comparator=m.Integer("1"))]),
        operator=m.Or(), right=_self_attr("parallel_drafting")))


def _sample_draft_assign():
    """``draft_tokens = self.sample_draft(...)`` (V2 ``_generate_draft``)."""
    return m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name("draft_tokens"))],
                                                value=m.Call(func=_self_attr("sample_draft")))])


def _store_drafts():
    """``self.req_states.draft_tokens[input_batch.idx_mapping] = draft_tokens`` (V2 runner)."""
    return m.SimpleStatementLine(body=[m.Assign(
        targets=[m.AssignTarget(target=m.Subscript(value=m.Attribute(
            value=_self_attr("req_states"), attr=m.Name("draft_tokens"))))],
        value=m.Name("draft_tokens"))])


def _dynamic_sd_if():
    """``if self.dynamic_sd_lookup is not None and len(num_scheduled_tokens) > 0:`` (vLLM's dynamic-SD
    count of the next step, right after ``num_spec_tokens_to_schedule = self.num_spec_tokens``)."""
    return m.If(test=m.BooleanOperation(
        left=m.Comparison(left=_self_attr("dynamic_sd_lookup"),
                          comparisons=[m.ComparisonTarget(operator=m.IsNot(), comparator=m.Name("None"))]),
        operator=m.And()))


def _has_scheduled_count(module, node) -> bool:
    """The scheduler decides the next step's draft count (``num_spec_tokens_to_schedule``, 0.24.0+)."""
    from ddtree_patcher.cst_helpers import contains_text

    return contains_text(module, node, "num_spec_tokens_to_schedule")


# ---- rewrites -------------------------------------------------------------------------------
def _prepend_to_body(matcher, code: str):
    """A ``Site.rewrite``: ``code`` becomes the first statements of the anchor's (an ``if``) body."""

    def make(patch_id: str):
        from ddtree_patcher.rewriters import CountingTransformer

        class Prepend(CountingTransformer):
            def __init__(self):
                super().__init__(patch_id)
                self.matcher = matcher()

            def leave_If(self, original_node, updated_node):
                if not m.matches(original_node, self.matcher):
                    return updated_node
                self.matches += 1
                body = list(cst.parse_module(code).body)
                block = updated_node.body
                return updated_node.with_changes(body=block.with_changes(body=[*body, *block.body]))

        return Prepend()

    return make


def _v2_hosts_dflash(module, node) -> bool:
    """The V2 runner hosts DFlash from 0.24.0 (tree-walk-hook's criterion: its ``sample`` takes
    ``num_rejected`` from the rejection sampler); before, it has no DFlash speculator."""
    from ddtree_patcher.cst_helpers import find_def
    from ddtree_patcher.patches.tree_walk_hook import V2_FN, _v2_hosts_dflash as hosts

    sample = find_def(module, V2_FN)
    return sample is not None and hosts(module, sample)


CONFIG_SITE = Site(function=CONFIG_FN, anchor="`if self.num_speculative_tokens <= 0: raise ValueError(...)`",
                   unfixed=_config_anchor, rewrite=insert_statements(_config_anchor, CONFIG_CODE, after=True))
V1_BIND_SITE = Site(function=V1_INIT_FN, anchor="`super().__init__(vllm_config=..., ..., runner=runner)`",
                    unfixed=_super_init, rewrite=insert_statements(_super_init, V1_BIND_CODE, after=True))
V1_DEPTH_SITE = Site(function=PROPOSE_FN, anchor="`self.num_speculative_tokens = num_speculative_tokens`",
                     unfixed=_k_assign, rewrite=insert_statements(_k_assign, V1_DEPTH_CODE, after=True))
V1_TREE_SITE = Site(function=PROPOSE_FN, anchor="`if self.num_speculative_tokens == 1 or self.parallel_drafting:`",
                    unfixed=_parallel_exit, rewrite=_prepend_to_body(_parallel_exit, V1_TREE_CODE))
V2_BIND_SITE = Site(function=V2_INIT_FN, anchor="`super().__init__(vllm_config, device)`",
                    unfixed=_super_init, rewrite=insert_statements(_super_init, V2_BIND_CODE, after=True))
V2_TREE_SITE = Site(function=V2_DRAFT_FN, anchor="`draft_tokens = self.sample_draft(...)`",
                    unfixed=_sample_draft_assign,
                    rewrite=insert_statements(_sample_draft_assign, V2_TREE_CODE, after=False))
V2_TOKENS_SITE = Site(function=V2_RUNNER_FN,
                      anchor="`self.req_states.draft_tokens[input_batch.idx_mapping] = draft_tokens`",
                      unfixed=_store_drafts, rewrite=insert_statements(_store_drafts, V2_TOKENS_CODE, after=False),
                      applies=_v2_hosts_dflash)

SCHED_SITE = Site(function=SCHED_FN, anchor="`if self.dynamic_sd_lookup is not None and len(num_scheduled_tokens) > 0:`",
                  unfixed=_dynamic_sd_if, rewrite=insert_statements(_dynamic_sd_if, SCHED_CODE, after=True),
                  applies=_has_scheduled_count,
                  absent="no draft count of the next step in the scheduler (before vLLM 0.24.0)")

ON_020 = ("0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0")
ON_024 = ("0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")
ON_034 = ("0.34.0",)  # V2-only

# Pristine cst shape hashes (ddtree_patcher.cst_helpers.shape_hash) from the official wheels.
SHAPES_CONFIG = {CONFIG_FN: frozenset({
    "ef3224f0c560",  # 0.20.0-0.20.2
    "7be8fdf36554",  # 0.21.0
    "cd75127b1bea",  # 0.22.0-0.24.0
    "f9421ea8e372",  # 0.25.0-0.32.0
    "e18604151c96",  # 0.33.0
    "cf5f16e7b8cc",  # 0.34.0
})}
SHAPES_V1_INIT = {V1_INIT_FN: frozenset({
    "cb9015b2a492",  # 0.20.0-0.22.1
    "a53454f4c90c",  # 0.23.0-0.25.0
    "99ae83a38dde",  # 0.26.0
    "25cb1ebb5edd",  # 0.27.0-0.29.0
    "f93118f5083d",  # 0.30.0-0.33.0
})}
SHAPES_PROPOSE_020 = {PROPOSE_FN: frozenset({
    "67c63ab9a0a3",  # 0.20.0-0.20.2
    "99bd123dac4e",  # 0.21.0
    "dabb38f21131",  # 0.22.0-0.22.1
    "c3a58b9526f4",  # 0.23.0
})}
SHAPES_PROPOSE_024 = {PROPOSE_FN: frozenset({
    "3309494cd506",  # 0.24.0
    "b40ee002bba2",  # 0.25.0-0.29.0
    "00baa3a1c681",  # 0.30.0-0.33.0
})}
SHAPES_V2_DFLASH = {
    V2_INIT_FN: frozenset({"fca0226a7ece", "6f4b193333f9", "e1c82515f176", "234c9afbea61", "723c61a37167",
                           "695cfb363a2c", "4636b7d9ba9b", "9a2a3816fae0", "bda2c3b5752e",
                           "7080234e035e"}),  # one per release, 0.24.0-0.34.0
    V2_DRAFT_FN: frozenset({"498d57be3d08", "22817856ec51", "2f52e16e6ff9", "defe4d3d5887", "3e95cbdeaa54"}),
}
SHAPES_V2_RUNNER = {V2_RUNNER_FN: frozenset({
    "e60d9b244842", "7287dbcf1c44", "6fbc9bd3eeae", "88cdd6c7055b", "8ec88c11b1c6", "24b076836f52",
    "709bf1f0b05b", "082e70cc9640", "9a20d14a1b61", "e3e53dc1dfad",  # 0.24.0 ... 0.33.0, one per release
    "50e11efe9bab",  # 0.34.0
})}

SHAPES_SCHED = {SCHED_FN: frozenset({
    "87a6016cdb08", "ebed3172cfa9", "eab0eb28895f", "2ca842f13a45", "2576f7d72289", "9e36e8e9b571", "23146d5ff34a",
    "8f24ffc6ee51", "b858cfaada39", "32f915f36c77",  # 0.24.0 ... 0.33.0, one per release
    "3dbfac60910b",  # 0.34.0
})}

# the call sites import ddtree_patcher.runtime.ddtree in vLLM's interpreter
_runtime = runtime_check("ddtree_patcher.runtime.ddtree", "DDTREE_ABI", "ddtree",
                         (SPEC_PY, DFLASH_V1_PY, DFLASH_V2_PY, SCHED_PY), rb"ddtree_abi=(\d+)\)")


PATCH = Patch(
    id=ID,
    summary="Gated call sites that make a DFlash drafter draft DDTree trees (node budget N, decoupled "
            "from the drafter depth) on the V1 and V2 runners (ddtree_patcher.runtime.ddtree)",
    kind="hook",
    upstream=(),
    requires=(DFLASH_MODEL,),
    doc="docs/patches/ddtree-proposer.md",
    runtime=_runtime,
    files=(
        PatchFile(path=SPEC_PY, variants=(Variant("config-0.20", ON_020 + ON_024 + ON_034, (CONFIG_SITE,), SHAPES_CONFIG),)),
        PatchFile(path=DFLASH_V1_PY, gone_with=V1_DFLASH,
                  variants=(Variant("v1-init-0.20", ON_020 + ON_024, (V1_BIND_SITE,), SHAPES_V1_INIT),)),
        PatchFile(path=PROPOSER_PY, gone_with=V1_DFLASH, variants=(
            Variant("v1-0.24", ON_024, (V1_DEPTH_SITE, V1_TREE_SITE), SHAPES_PROPOSE_024),
            Variant("v1-0.20", ON_020, (V1_TREE_SITE,), SHAPES_PROPOSE_020),
        )),
        PatchFile(path=DFLASH_V2_PY, optional=True,
                  variants=(Variant("v2-0.24", ON_024 + ON_034, (V2_BIND_SITE, V2_TREE_SITE), SHAPES_V2_DFLASH),)),
        PatchFile(path=RUNNER_V2_PY, optional=True,
                  variants=(Variant("v2-runner-0.24", ON_024 + ON_020 + ON_034, (V2_TOKENS_SITE,), SHAPES_V2_RUNNER),)),
        PatchFile(path=SCHED_PY, variants=(Variant("sched-0.24", ON_024 + ON_034, (SCHED_SITE,), SHAPES_SCHED),)),
    ),
)
