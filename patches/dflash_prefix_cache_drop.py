"""dflash-prefix-cache-drop ("eagle cache fix"): stop dropping the last matched prefix-cache
block for DFlash.

EAGLE-family drafters build a position's draft KV from that position's hidden state *and the
next token*, so on a prefix-cache hit vLLM drops the trailing matched block. DFlash writes its
context KV from the same position's hidden state only, but ``SpeculativeConfig.use_eagle()`` is
True for ``"dflash"``, so every DFlash deployment loses its last block on every hit (on hybrid
targets with inflated block sizes: thousands of recomputed tokens per hit, hit rate down to 0%).

Upstream: #53388 (0.30.0) adds the opt-in ``disable_eagle_block_drop`` and the predicate
``use_eagle_block_drop()``; the default excludes DFlash only from 0.33.0
(``needs_eagle_block_drop()``). This patch covers DFlash only (0.33 also exempts DSpark).

Shapes, chosen by code shape (never by version):

* ``sched-0.20`` (0.20.0-0.22.1): ``Scheduler.__init__`` passes ``use_eagle=self.use_eagle and
  not speculative_config.use_dflash()`` to ``KVCacheManager`` and gains the DFlash ``+1``
  lookahead slot of #42971 (absent before 0.23.0, written as 0.23.0 writes it);
  ``Scheduler._mamba_block_aligned_split`` backs off one block only for non-DFlash EAGLE;
  ``Scheduler.schedule`` allocates DFlash's lookahead at a first prefill too, as 0.23.0 (#43733).
* ``sched-0.23`` (0.23.0-0.29.0): the same two scheduler sites, no back-port needed.
  ``Scheduler.use_eagle`` itself is never changed: DFlash still needs the lookahead, the
  encoder shift and the other behaviours it drives.
* ``predicate-0.30`` (0.30.0-0.32.0): ``SpeculativeConfig.use_eagle_block_drop()`` excludes
  DFlash (every consumer follows); the scheduler's "block dropping is disabled" warning is
  gated so that it does not fire for DFlash.
* The other block-drop decisions that 0.33.0 routes through ``use_eagle_block_drop()`` and that
  call the bare ``use_eagle()`` before 0.30.0: the offloading connector (``offloading-0.24``), the
  Mooncake store worker (``mooncake-0.22``), the simple CPU offload manager
  (``simple-offload-0.27``) and the draft-group annotation of ``kv_cache_utils.py``
  (``annotate-dsv4-0.20``, ``annotate-0.29``) exempt DFlash; on 0.30.0-0.32.0 the "no draft
  group" warning (``warn-0.30``) no longer fires for DFlash.
* 0.33.0: upstream. Before 0.20.0: not applicable (no DFlash). DSpark, which 0.33.0 also
  exempts, keeps the drop (docs/patches/dflash-prefix-cache-drop.md says why).
"""

from __future__ import annotations

from ddtree_patcher.runtime.contract import mark
from ddtree_patcher.patchlib import (
    DFLASH_MODEL, Patch, PatchFile, Site, Variant, absent_site, any_of, cst, m, never, rules_rewrite,
)

ID = "dflash-prefix-cache-drop"
MARK = mark(ID)
INIT = "Scheduler.__init__"
SPLIT = "Scheduler._mamba_block_aligned_split"
SCHEDULE = "Scheduler.schedule"
PREDICATE = "SpeculativeConfig.use_eagle_block_drop"
USE_EAGLE = "SpeculativeConfig.use_eagle"
SCHEDULER_PY = "vllm/v1/core/sched/scheduler.py"
SPECULATIVE_PY = "vllm/config/speculative.py"


# ---- matcher building blocks (built lazily: libcst is imported on first use) ---------------
def _attr(obj: str, name: str):
    return m.Attribute(value=m.Name(obj), attr=m.Name(name))


def _call(obj: str, meth: str):
    return m.Call(func=_attr(obj, meth), args=[])


def _not(operand):
    return m.UnaryOperation(operator=m.Not(), expression=operand)


def _and(left, right):
    return m.BooleanOperation(left=left, operator=m.And(), right=right)


# ---- marking: the marker goes on every physical line that changes ---------------------------
def _mark_line(line):
    from ddtree_patcher.rewriters import mark_line

    return mark_line(line, ID)


def _mark_header(node):  # "if ...:  # marker"
    from ddtree_patcher.rewriters import marked

    return node.with_changes(body=node.body.with_changes(header=marked(node.body.header, ID)))


def _mark_arg(arg):  # "    keyword=value,  # marker" (not on its own line: unmarked, then refused)
    from ddtree_patcher.rewriters import mark_comma

    return mark_comma(arg, ID)


# ---- 0.20.0-0.29.0: Scheduler.__init__ -------------------------------------------------------
def _use_eagle_kwarg():  # KVCacheManager(..., use_eagle=self.use_eagle, ...)
    return m.Arg(keyword=m.Name("use_eagle"), value=_attr("self", "use_eagle"))


def _drop_unless_dflash(arg):
    value = cst.parse_expression("self.use_eagle and not speculative_config.use_dflash()")
    return _mark_arg(arg.with_changes(value=value))


def _spec_block_without_dflash_slot():
    """``if speculative_config:`` whose last statement is ``if speculative_config.uses_draft_model():``
    (0.20.0-0.22.1; 0.23.0 adds ``if speculative_config.use_dflash(): ... + 1`` right after it)."""
    return m.If(
        test=m.Name("speculative_config"),
        body=m.IndentedBlock(body=[m.ZeroOrMore(), m.If(test=_call("speculative_config", "uses_draft_model"))]),
        orelse=None,
    )


DFLASH_SLOT = f"""\
if speculative_config.use_dflash():  {MARK}
    # DFlash requires an extra lookahead slot since it uses in-fill-style
    # decoding instead of standard next-token sampling, so it has a query
    # for the last sampled token plus queries for each draft token.
    # (back-port of vllm-project/vllm#42971, in vLLM from 0.23.0)
    self.num_lookahead_tokens = self.num_spec_tokens + 1  {MARK}
"""


def _add_dflash_slot(node):
    body = node.body
    return node.with_changes(body=body.with_changes(body=(*body.body, cst.parse_statement(DFLASH_SLOT))))


INIT_020 = Site(
    function=INIT,
    anchor="`use_eagle=self.use_eagle` in KVCacheManager(...) and `if speculative_config:` ending "
           "with `if speculative_config.uses_draft_model():` (no DFlash lookahead slot)",
    unfixed=any_of(_use_eagle_kwarg, _spec_block_without_dflash_slot),
    rewrite=rules_rewrite((_use_eagle_kwarg, _drop_unless_dflash), (_spec_block_without_dflash_slot, _add_dflash_slot)),
    expect=2,
)

INIT_023 = Site(
    function=INIT,
    anchor="`use_eagle=self.use_eagle` in KVCacheManager(...)",
    unfixed=_use_eagle_kwarg,
    rewrite=rules_rewrite((_use_eagle_kwarg, _drop_unless_dflash)),
)


# ---- 0.20.0-0.22.1: Scheduler.schedule, the lookahead slots of a first prefill ----------------
def _first_prefill_lookahead():
    """``effective_lookahead_tokens = (0 if request.num_computed_tokens == 0 else self.num_lookahead_tokens)``
    (0.23.0, #43733: ``0 if load_kv_async and self.use_eagle else self.num_lookahead_tokens``)."""
    return m.SimpleStatementLine(body=[m.Assign(
        targets=[m.AssignTarget(target=m.Name("effective_lookahead_tokens"))],
        value=m.IfExp(test=m.Comparison(left=_attr("request", "num_computed_tokens"),
                                        comparisons=[m.ComparisonTarget(m.Equal(), m.Integer("0"))]),
                      body=m.Integer("0"), orelse=_attr("self", "num_lookahead_tokens")))])


DFLASH_FIRST_PREFILL = f"""\
if self.use_eagle and self.vllm_config.speculative_config.use_dflash():  {MARK}
    # DFlash's first draft pass writes K + 1 positions past the prompt: allocate them from the
    # first prefill on, as 0.23.0 does (vllm-project/vllm#43733); none while KV loads async.
    effective_lookahead_tokens = 0 if load_kv_async else self.num_lookahead_tokens  {MARK}
"""


def _dflash_first_prefill(line):
    return cst.FlattenSentinel([line, cst.parse_statement(DFLASH_FIRST_PREFILL)])


SCHEDULE_020 = Site(
    function=SCHEDULE,
    anchor="`effective_lookahead_tokens = (0 if request.num_computed_tokens == 0 else "
           "self.num_lookahead_tokens)` (no lookahead at a first prefill)",
    unfixed=_first_prefill_lookahead,
    rewrite=rules_rewrite((_first_prefill_lookahead, _dflash_first_prefill)),
)


# ---- 0.20.0-0.29.0: Scheduler._mamba_block_aligned_split -----------------------------------
def _if_use_eagle():  # if self.use_eagle:  (back off last_cache_position by one block)
    return m.If(test=_attr("self", "use_eagle"))


def _if_drop_unless_dflash(node):
    test = cst.parse_expression("self.use_eagle and not self.vllm_config.speculative_config.use_dflash()")
    return _mark_header(node.with_changes(test=test))


SPLIT_020 = Site(
    function=SPLIT,
    anchor="`if self.use_eagle:` (eagle prune of last_cache_position)",
    unfixed=_if_use_eagle,
    rewrite=rules_rewrite((_if_use_eagle, _if_drop_unless_dflash)),
)


# ---- 0.30.0-0.32.0: SpeculativeConfig.use_eagle_block_drop ---------------------------------
def _predicate_line():  # return self.use_eagle() and not self.disable_eagle_block_drop
    return m.SimpleStatementLine(body=[m.Return(value=_and(
        _call("self", "use_eagle"), _not(_attr("self", "disable_eagle_block_drop"))))])


def _predicate_upstream():  # 0.33.0: return self.needs_eagle_block_drop() and not ...
    return _call("self", "needs_eagle_block_drop")


def _predicate_excludes_dflash(line):
    ret = line.body[0].with_changes(value=cst.parse_expression(
        "self.use_eagle() and not self.use_dflash() and not self.disable_eagle_block_drop"))
    return _mark_line(line.with_changes(body=[ret]))


PREDICATE_030 = Site(
    function=PREDICATE,
    anchor="`return self.use_eagle() and not self.disable_eagle_block_drop`",
    unfixed=_predicate_line,
    fixed=_predicate_upstream,
    fixed_by="0.33.0's needs_eagle_block_drop(): DFlash exempt by default",
    rewrite=rules_rewrite((_predicate_line, _predicate_excludes_dflash)),
)

# 0.20.0-0.29.0 have no block-drop predicate (the scheduler variants fix the drop): the file is
# not applicable there. Where the predicate exists this variant never matches (anchor: nothing).
_NO_PREDICATE = absent_site(
    USE_EAGLE, "SpeculativeConfig.use_eagle_block_drop is absent (the drop is fixed in the scheduler)", PREDICATE)


# ---- 0.30.0-0.32.0: the "block dropping is disabled" warning in Scheduler.__init__ ----------
def _warning_if():  # if self.use_eagle and not self.use_eagle_block_drop:  logger.warning(...)
    return m.If(test=_and(_attr("self", "use_eagle"), _not(_attr("self", "use_eagle_block_drop"))))


def _warning_upstream():  # 0.33.0: if (speculative_config.needs_eagle_block_drop() and ...)
    return _call("speculative_config", "needs_eagle_block_drop")


def _warn_unless_dflash(node):
    test = cst.parse_expression(
        "self.use_eagle and not self.use_eagle_block_drop and not speculative_config.use_dflash()")
    return _mark_header(node.with_changes(test=test))


WARNING_030 = Site(
    function=INIT,
    anchor="`if self.use_eagle and not self.use_eagle_block_drop:` (block-drop-disabled warning)",
    unfixed=_warning_if,
    fixed=_warning_upstream,
    fixed_by="0.33.0's needs_eagle_block_drop(): DFlash exempt by default",
    rewrite=rules_rewrite((_warning_if, _warn_unless_dflash)),
)


# ---- the other block-drop decisions: KV connectors and the KV cache group annotation -----------
# 0.33.0 routes every one of them through ``use_eagle_block_drop()`` (DFlash and DSpark exempt); from
# 0.30.0 they consult that predicate (fixed by predicate-0.30), before it they call ``use_eagle()``.
OFFLOADING_PY = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
MOONCAKE_PY = "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py"
SIMPLE_OFFLOAD_PY = "vllm/v1/simple_kv_offload/manager.py"
KV_UTILS_PY = "vllm/v1/core/kv_cache_utils.py"
OFFLOADING_FN = "SchedulerOffloadConfig.from_spec"
MOONCAKE_FN = "MooncakeStoreWorker.__init__"
SIMPLE_OFFLOAD_FN = "SimpleCPUOffloadScheduler.__init__"
ANNOTATE_DSV4 = "_annotate_eagle_groups_deepseek_v4"
ANNOTATE = "_annotate_eagle_groups"
WARN = "_warn_if_unannotated_eagle_mamba"


def _use_eagle_call():  # <anything>.use_eagle()
    return m.Call(func=m.Attribute(attr=m.Name("use_eagle")), args=[])


def _predicate_call():  # <anything>.use_eagle_block_drop(): upstream's predicate (#53388)
    return m.Call(func=m.Attribute(attr=m.Name("use_eagle_block_drop")), args=[])


def _use_eagle_assignment():
    """``use_eagle = <an expression calling X.use_eagle()>`` (offloading: ``X is not None and
    X.use_eagle()``; simple offload: the same; Mooncake: ``bool(X.use_eagle() if ... else False)``)."""
    call = _use_eagle_call()
    return m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name("use_eagle"))],
                                                value=m.MatchIfTrue(lambda v: bool(m.findall(v, call))))])


def _and_not_dflash(line):
    """The assignment, then ``use_eagle = use_eagle and not X.use_dflash()`` (X: the object whose
    ``use_eagle()`` it calls; not None where ``use_eagle`` is true)."""
    call = m.findall(line, _use_eagle_call())[0]
    obj = cst.Module(body=[]).code_for_node(call.func.value)
    return cst.FlattenSentinel([line, cst.parse_statement(
        f"use_eagle = use_eagle and not {obj}.use_dflash()  # DFlash: no block drop  {MARK}\n")])


def _decides_block_drop(module, node) -> bool:
    """Whether this function decides the block drop at all (0.22.0-0.26.0's simple offload
    manager passes ``use_eagle=False``; 0.32.0+'s Mooncake worker leaves it to its coordinator)."""
    code = module.code_for_node(node)
    return ".use_eagle()" in code or ".use_eagle_block_drop()" in code


def _connector_site(function: str, what: str) -> Site:
    return Site(
        function=function,
        anchor=f"`use_eagle = ... .use_eagle() ...` ({what}'s block-drop flag)",
        unfixed=_use_eagle_assignment,
        fixed=_predicate_call,  # 0.30.0+: consults use_eagle_block_drop() (DFlash exempt: predicate-0.30, 0.33.0)
        fixed_by="vllm#53388's use_eagle_block_drop()",
        applies=_decides_block_drop,
        rewrite=rules_rewrite((_use_eagle_assignment, _and_not_dflash)),
    )


OFFLOADING_024 = _connector_site(OFFLOADING_FN, "the offloading connector")
MOONCAKE_022 = _connector_site(MOONCAKE_FN, "the Mooncake store")
SIMPLE_OFFLOAD_027 = _connector_site(SIMPLE_OFFLOAD_FN, "the simple CPU offload manager")


def _unless_eagle():  # if spec_config is None or not spec_config.use_eagle():  return
    return m.If(test=m.BooleanOperation(
        left=m.Comparison(left=m.Name("spec_config"), comparisons=[m.ComparisonTarget(m.Is(), m.Name("None"))]),
        operator=m.Or(), right=_not(_call("spec_config", "use_eagle"))))


def _unless_eagle_or_dflash(node):
    test = cst.parse_expression("spec_config is None or not spec_config.use_eagle() or spec_config.use_dflash()")
    return _mark_header(node.with_changes(test=test))


def _annotation_site(function: str, what: str) -> Site:
    return Site(function=function, anchor=f"`if spec_config is None or not spec_config.use_eagle(): return` ({what})",
                unfixed=_unless_eagle, rewrite=rules_rewrite((_unless_eagle, _unless_eagle_or_dflash)))


ANNOTATE_DSV4_020 = _annotation_site(ANNOTATE_DSV4, "flags a DeepSeek-V4 target's last-layer group as a draft group")
ANNOTATE_029 = _annotation_site(ANNOTATE, "flags the KV cache groups of draft layers")
WARN_030 = _annotation_site(WARN, "warns that no group is a draft group: reuse drops to zero")


def _no_annotation(module, node) -> bool:
    from ddtree_patcher.cst_helpers import find_def

    return all(find_def(module, fn) is None for fn in (ANNOTATE_DSV4, WARN))


# 0.33.0 moved the annotation to kv_cache_planning.py (gated by use_eagle_block_drop() there).
_NO_ANNOTATION = Site(function="hash_block_tokens", anchor=f"neither {ANNOTATE_DSV4} nor {WARN} (0.33.0: upstream)",
                      unfixed=never, rewrite=rules_rewrite(),
                      applies=lambda module, node: not _no_annotation(module, node))


# ---- the patch -------------------------------------------------------------------------------
ON_020 = ("0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1")
ON_023 = ("0.23.0", "0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0")
ON_030 = ("0.30.0", "0.31.0", "0.32.0")

# Pristine cst shape hashes (ddtree_patcher.cst_helpers.shape_hash) from the official wheels.
SHAPES_020 = {
    INIT: frozenset({"bc95a9f15113", "515a511c7ab1", "c6aee3281b1f"}),  # 0.20.0-0.20.2, 0.21.0, 0.22.x
    SPLIT: frozenset({"8f6fcba25809"}),  # 0.20.0-0.22.1
    SCHEDULE: frozenset({"b6e10e6f1132", "158d7e20d39d"}),  # 0.20.0-0.20.2, 0.21.0-0.22.1
}
SHAPES_023 = {
    # 0.23.0, 0.24.0, 0.25.0, 0.26.0, 0.27.0, 0.28.0, 0.29.0
    INIT: frozenset({"6009a42348b7", "ffaa1181fd71", "99885e33caec", "24a8f4eeecb3", "5400e9ddba85",
                     "103a0af9987e", "a4513e11b37c"}),
    # 0.23.0, 0.24.0-0.25.0, 0.26.0, 0.27.0-0.28.0, 0.29.0
    SPLIT: frozenset({"99c04345ed95", "fe3e2485de83", "9f99d31c822d", "517e12cf1237", "44f5bc1544d7"}),
}
SHAPES_030_SCHED = {INIT: frozenset({"e5ee05610823", "b1f00a808480", "b6205d4d574f"})}  # 0.30.0, 0.31.0, 0.32.0
SHAPES_030_SPEC = {PREDICATE: frozenset({"62e1b644c840"})}  # 0.30.0-0.32.0

ON_022_029 = ("0.22.0", "0.22.1") + ON_023
ON_024_029 = ON_023[1:]
ON_027_029 = ON_023[4:]
ON_020_028 = ON_020 + ON_023[:-1]
# Pristine shape hashes of the functions that decide the block drop with a bare use_eagle().
SHAPES_OFFLOADING = {OFFLOADING_FN: frozenset({"21d503e811f2", "1261cf867fdc", "df922b8fb695"})}  # 0.24-0.25, 0.26-0.27, 0.28-0.29
SHAPES_MOONCAKE = {MOONCAKE_FN: frozenset({  # 0.22.x, 0.23.0, 0.24.0, 0.25.0-0.26.0, 0.27.0, 0.28.0, 0.29.0
    "472326b910a2", "2a0ed554c74c", "98678392d530", "f548d6f02093", "afaec33fc92b", "c72626a3c5a5", "ef01f02b1a49"})}
SHAPES_SIMPLE_OFFLOAD = {SIMPLE_OFFLOAD_FN: frozenset({"8e51ae9d8eb0", "c60543f3f1f4"})}  # 0.27.0, 0.28.0-0.29.0
SHAPES_ANNOTATE_DSV4 = {ANNOTATE_DSV4: frozenset({"b28e74a074f2"})}  # 0.20.0-0.28.0
SHAPES_ANNOTATE_029 = {ANNOTATE: frozenset({"85b9cb3e660a"})}  # 0.29.0 (its warning function logs nothing yet)
SHAPES_WARN_030 = {WARN: frozenset({"42c1385927c6", "a6de5e4750db"})}  # 0.30.0, 0.31.0-0.32.0

PATCH = Patch(
    id=ID,
    summary="Do not drop the last prefix-cache block for DFlash (EAGLE block drop); "
            "back-port the DFlash +1 lookahead slot on 0.20-0.22",
    kind="fix",
    upstream=("vllm-project/vllm#53388", "vllm-project/vllm#42971", "vllm-project/vllm#51771",
              "vllm-project/vllm#53670"),
    requires=(DFLASH_MODEL,),
    doc="docs/patches/dflash-prefix-cache-drop.md",
    files=(
        PatchFile(
            path=SCHEDULER_PY,
            variants=(
                # sched-0.20 first: its anchors are the stricter ones (no DFlash lookahead slot).
                Variant("sched-0.20", ON_020, (INIT_020, SPLIT_020, SCHEDULE_020), SHAPES_020),
                Variant("sched-0.23", ON_023, (INIT_023, SPLIT_020), SHAPES_023),
                Variant("sched-0.30", ON_030, (WARNING_030,), SHAPES_030_SCHED),
            ),
        ),
        PatchFile(
            path=SPECULATIVE_PY,
            variants=(
                Variant("predicate-0.30", ON_030, (PREDICATE_030,), SHAPES_030_SPEC),
                Variant("no-predicate", ON_020 + ON_023, (_NO_PREDICATE,)),
            ),
        ),
        # Before 0.24.0 / from 0.30.0 the function exists without a bare use_eagle() decision:
        # not applicable (before) or upstream's predicate (from 0.30.0). Absent files: not applicable.
        PatchFile(path=OFFLOADING_PY, optional=True,
                  variants=(Variant("offloading-0.24", ON_024_029, (OFFLOADING_024,), SHAPES_OFFLOADING),)),
        PatchFile(path=MOONCAKE_PY, optional=True,
                  variants=(Variant("mooncake-0.22", ON_022_029, (MOONCAKE_022,), SHAPES_MOONCAKE),)),
        PatchFile(path=SIMPLE_OFFLOAD_PY, optional=True,
                  variants=(Variant("simple-offload-0.27", ON_027_029, (SIMPLE_OFFLOAD_027,), SHAPES_SIMPLE_OFFLOAD),)),
        PatchFile(
            path=KV_UTILS_PY,
            variants=(
                Variant("annotate-dsv4-0.20", ON_020_028, (ANNOTATE_DSV4_020,), SHAPES_ANNOTATE_DSV4),
                Variant("annotate-0.29", ("0.29.0",), (ANNOTATE_029,), SHAPES_ANNOTATE_029),
                Variant("warn-0.30", ON_030, (WARN_030,), SHAPES_WARN_030),
                Variant("planning-0.33", ("0.33.0",), (_NO_ANNOTATION,)),
            ),
        ),
    ),
)
