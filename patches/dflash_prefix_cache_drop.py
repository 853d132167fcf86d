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
  ``Scheduler._mamba_block_aligned_split`` backs off one block only for non-DFlash EAGLE.
* ``sched-0.23`` (0.23.0-0.29.0): the same two scheduler sites, no back-port needed.
  ``Scheduler.use_eagle`` itself is never changed: DFlash still needs the lookahead, the
  encoder shift and the other behaviours it drives.
* ``predicate-0.30`` (0.30.0-0.32.0): ``SpeculativeConfig.use_eagle_block_drop()`` excludes
  DFlash (every consumer follows); the scheduler's "block dropping is disabled" warning is
  gated so that it does not fire for DFlash.
* 0.33.0: upstream. Before 0.20.0: not applicable (no DFlash).
"""

from __future__ import annotations

from ddtree_patcher.patchlib import Patch, PatchFile, Site, Variant, absent_site, any_of, cst, m, rules_rewrite

ID = "dflash-prefix-cache-drop"
MARK = f"# ddtree-patch: {ID}"
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
    from ddtree_patcher.examine import mark_line

    return mark_line(line, ID)


def _mark_header(node):  # "if ...:  # marker"
    from ddtree_patcher.examine import marked

    return node.with_changes(body=node.body.with_changes(header=marked(node.body.header, ID)))


def _mark_arg(arg):  # "    keyword=value,  # marker" (not on its own line: unmarked, then refused)
    from ddtree_patcher.examine import mark_comma

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
    rewrite=rules_rewrite((_warning_if, _warn_unless_dflash)),
)


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

PATCH = Patch(
    id=ID,
    summary="Do not drop the last prefix-cache block for DFlash (EAGLE block drop); "
            "back-port the DFlash +1 lookahead slot on 0.20-0.22",
    kind="fix",
    upstream=("vllm-project/vllm#53388", "vllm-project/vllm#42971", "vllm-project/vllm#51771",
              "vllm-project/vllm#53670"),
    requires=("vllm/v1/spec_decode/dflash.py",),
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
    ),
)
