"""dflash-sliding-window: DFlash drafters with sliding-window layers attend as they were trained,
on the V1 runner of every release 0.20.0-0.33.0.

Current drafters (z-lab Qwen3.5/3.6-DFlash: 5 sliding layers of 4096 + 1 full; Gemma-4 DFlash;
MiMo) declare ``layer_types`` with ``"sliding_attention"``. Up to 0.24.0 vLLM builds every draft
layer as full attention; 0.25.0 (#46104) honours all-sliding drafters and raises
``NotImplementedError`` for mixed ones; 0.26.0+ (#47914) runs mixed drafters on the V2 runner only
and refuses them on V1 (a V1 back-port was declined upstream, #50715). The seed design is #40898
(never merged): full KV storage for sliding layers, windowed compute.

Rewrites, chosen by code shape (never by version):

``vllm/model_executor/models/qwen3_dflash.py``
  * ``resolve-0.20`` (0.20.0-0.24.0): ``DFlashQwen3Model.__init__`` passes ``layer_idx`` to each
    ``DFlashQwen3DecoderLayer``; the layer resolves ``(sliding_window, causal)`` with
    ``ddtree_patcher.runtime.swa.resolve_layer_attention`` (0.28's resolver) and passes the window to
    ``DFlashQwen3Attention``, which passes ``per_layer_sliding_window=`` to its ``Attention``.
    Upstream marker: the keyword ``per_layer_sliding_window`` (0.25.0+).
  * ``guard-0.25`` (0.25.0-0.33.0): the ``raise NotImplementedError`` for mixed drafters in
    ``_resolve_layer_attention`` (0.25: always; 0.26+: unless V2) becomes
    ``ddtree_patcher.runtime.swa.check_mixed_drafter``: V1 runs them; a V2 runner that cannot run them
    (0.25.0, and 0.24.0 through the resolver of ``resolve-0.20``) refuses them with a named
    ``NotImplementedError`` (``MixedDrafterOnV2Error``) instead of running their sliding layers with
    full attention.
  * ``resolved-0.34`` (0.34.0): upstream. The resolver raises for no drafter: 0.34.0 removed the V1
    runner (``vllm/v1/spec_decode/*`` but ``metrics.py``, ``gpu_model_runner.py``), so mixed drafters run
    on the V2 runner as upstream has run them since #47914; the V1 files below are not applicable there
    (``gone_with``: missing together with the V1 runner's DFlash).
  * both: after ``self.self_attn = DFlashQwen3Attention(...)`` the layer calls
    ``ddtree_patcher.runtime.swa.finish_draft_layer`` (full KV storage for the sliding layers of a mixed
    drafter; symmetric window for non-causal sliding layers).
``vllm/v1/spec_decode/llm_base_proposer.py`` (all): ``SpecDecodeBaseProposer.initialize_attn_backend``
  keys draft attention groups by ``(backend, layer window)`` and gives a windowed group a spec that
  carries the window (so FlashAttention 0.25-0.27, which takes the window from the group spec, and
  every builder see it).
``vllm/v1/spec_decode/dflash.py`` (all): ``DFlashProposer.build_per_group_and_layer_attn_metadata``
  rebuilds, through ``ddtree_patcher.runtime.swa.causal_draft_groups``, the metadata of the draft groups
  whose layers are all causal as causal (V1 builds one drafter-wide causality; V2 has per-group).
``vllm/v1/worker/gpu_model_runner.py`` (all): the runner's ``AttentionGroupKey`` gains the layer's
  window (#50707: FlashInfer needs one window per metadata builder).
``vllm/config/vllm.py`` (0.29.0+): the V1 "mixed sliding/full dflash drafts" unsupported-feature
  entry is dropped. Where the entry does not exist the file is not applicable.

V2 is left as upstream has it where it runs mixed drafters (0.26.0+; ``VLLM_USE_V2_MODEL_RUNNER=0``
selects V1); where it runs DFlash but not mixed drafters (0.24.0-0.25.0) a mixed drafter is refused
with a named error (``ddtree_patcher.runtime.swa.MixedDrafterOnV2Error``). ``gpu_model_runner.py`` on
0.20.0-0.22.1 also unpacks the three-field key in ``create_attn_groups`` (upstream reads
``key.attn_backend`` from 0.23.0). Not applicable before 0.20.0 (no DFlash).
"""

from __future__ import annotations

from ddtree_patcher.runtime.contract import SWA_ABI, mark
from ddtree_patcher.patchlib import (
    V1_DFLASH, Patch, PatchFile, Site, Variant, absent_site, any_of, cst, m, never, rules_rewrite, runtime_abi,
)

ID = "dflash-sliding-window"
MARK = mark(ID)
DFLASH_PY = "vllm/model_executor/models/qwen3_dflash.py"
PROPOSER_PY = "vllm/v1/spec_decode/llm_base_proposer.py"
DFLASH_PROPOSER_PY = "vllm/v1/spec_decode/dflash.py"
RUNNER_PY = "vllm/v1/worker/gpu_model_runner.py"
CONFIG_PY = "vllm/config/vllm.py"
ATTN_INIT = "DFlashQwen3Attention.__init__"
LAYER_INIT = "DFlashQwen3DecoderLayer.__init__"
MODEL_INIT = "DFlashQwen3Model.__init__"
RESOLVE = "_resolve_layer_attention"
PROPOSER_FN = "SpecDecodeBaseProposer.initialize_attn_backend"
METADATA_FN = "DFlashProposer.build_per_group_and_layer_attn_metadata"
RUNNER_FN = "GPUModelRunner.initialize_attn_backend"
CREATE_GROUPS_FN = f"{RUNNER_FN}.create_attn_groups"
UNSUPPORTED_FN = "VllmConfig._get_v1_model_runner_unsupported_features"
LAYER_WINDOW = 'getattr(layers[layer_name], "sliding_window", None)'


# ---- marking and small edits (every changed physical line carries the marker) ---------------
def _marked(ws):
    from ddtree_patcher.rewriters import marked

    return marked(ws, ID)


def _mark_line(line):
    from ddtree_patcher.rewriters import mark_line

    return mark_line(line, ID)


def _mark_comma(node):  # a Param or Arg on its own line: marker at the end of that line
    from ddtree_patcher.rewriters import mark_comma

    return mark_comma(node, ID)


def _own_line(node) -> bool:
    comma = node.comma
    return isinstance(comma, cst.Comma) and isinstance(comma.whitespace_after, cst.ParenthesizedWhitespace)


def _append(items, new):
    """``items`` (params or args, one per line, the last one with a trailing comma) plus ``new``,
    laid out like the last one, marked."""
    *head, last = items
    if not (_own_line(last) and head and _own_line(head[-1])):
        from ddtree_patcher.rewriters import RewriteError

        raise RewriteError("expected one parameter or argument per line, each with a trailing comma")
    new = new.with_changes(comma=last.comma)
    return [*head, last.with_changes(comma=head[-1].comma), _mark_comma(new)]


def _param(code: str):  # "name: annotation = default"
    return cst.parse_statement(f"def f({code}): pass").params.params[0]


def _arg(code: str):  # "keyword=value"
    return cst.parse_expression(f"f({code})").args[0]


def _with_param(fn, code: str, kwonly: bool):
    params = fn.params
    if kwonly:
        return fn.with_changes(params=params.with_changes(kwonly_params=_append(params.kwonly_params, _param(code))))
    return fn.with_changes(params=params.with_changes(params=_append(params.params, _param(code))))


def _with_arg(call, code: str):
    return call.with_changes(args=_append(call.args, _arg(code)))


def _pass_marked(node, why: str):
    """A compound statement replaced by ``pass  # marker (why)``."""
    line = cst.parse_statement(f"pass  {MARK} ({why})")
    return line.with_changes(leading_lines=node.leading_lines)


def _def(name: str):  # the FunctionDef itself (a rule on the site's own node)
    return lambda: m.FunctionDef(name=m.Name(name))


# ---- qwen3_dflash.py --------------------------------------------------------------------------
def _per_layer_window_kwarg():  # upstream (0.25.0+): Attention(..., per_layer_sliding_window=...)
    return m.Arg(keyword=m.Name("per_layer_sliding_window"))


def _attention_call_without_window():
    return m.Call(func=m.Name("Attention"),
                  args=[m.ZeroOrMore(m.Arg(keyword=m.DoesNotMatch(m.Name("per_layer_sliding_window"))))])


ATTN_020 = Site(
    function=ATTN_INIT,
    anchor="`def __init__(..., attn_type: str = ...)` and `self.attn = Attention(...)` without "
           "`per_layer_sliding_window`",
    unfixed=any_of(_def("__init__"), _attention_call_without_window),
    fixed=_per_layer_window_kwarg,
    rewrite=rules_rewrite(
        (_def("__init__"), lambda fn: _with_param(fn, "sliding_window: int | None = None", kwonly=False)),
        (_attention_call_without_window, lambda call: _with_arg(call, "per_layer_sliding_window=sliding_window")),
    ),
    expect=2,
)


def _layer_call():  # DFlashQwen3DecoderLayer(...) in the list comprehension of DFlashQwen3Model.__init__
    return m.Call(func=m.Name("DFlashQwen3DecoderLayer"),
                  args=[m.ZeroOrMore(m.Arg(keyword=m.DoesNotMatch(m.Name("layer_idx"))))])


MODEL_020 = Site(
    function=MODEL_INIT,
    anchor="`DFlashQwen3DecoderLayer(...)` without `layer_idx=` (list comprehension over layer_idx)",
    unfixed=_layer_call,
    fixed=lambda: m.Call(func=m.Name("DFlashQwen3DecoderLayer"),
                         args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("layer_idx")), m.ZeroOrMore()]),
    rewrite=rules_rewrite((_layer_call, lambda call: _with_arg(call, "layer_idx=layer_idx"))),
)


def _self_attn_line():  # self.self_attn = DFlashQwen3Attention(...)
    return m.SimpleStatementLine(body=[m.Assign(
        targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name("self_attn")))],
        value=m.Call(func=m.Name("DFlashQwen3Attention")))])


MISSING = ("ddtree-patch: this vLLM is patched with dflash-sliding-window, whose runtime "
           "ddtree_patcher.runtime.swa cannot be imported: install ddtree-patch in this environment or run "
           "`ddtree-patch revert`")
IMPORT = f"""\
try:  {MARK}
    from ddtree_patcher.runtime import swa as _ddtree_swa  {MARK}
except ImportError as _ddtree_err:  {MARK}
    raise RuntimeError({MISSING!r}) from _ddtree_err  {MARK}
"""
RESOLVE_LINE = (f"sliding_window, causal = _ddtree_swa.resolve_layer_attention(config, layer_idx, "
                f"swa_abi={SWA_ABI})  {MARK}\n")
FINISH_LINE = (f"_ddtree_swa.finish_draft_layer(config, layer_idx, self.self_attn.attn, causal, "
               f"swa_abi={SWA_ABI})  {MARK}\n")


def _around_self_attn(resolve: bool):
    """The ``self.self_attn = ...`` line with the runtime import (and, before 0.25, the
    resolution) before it and ``finish_draft_layer`` after it."""

    def action(line):
        before = cst.parse_module(IMPORT + (RESOLVE_LINE if resolve else "")).body
        if resolve:
            assign = line.body[0]
            line = line.with_changes(body=[assign.with_changes(
                value=_with_arg(assign.value, "sliding_window=sliding_window"))])
        first = before[0].with_changes(leading_lines=line.leading_lines)
        line = line.with_changes(leading_lines=())
        return cst.FlattenSentinel([first, *before[1:], line, cst.parse_statement(FINISH_LINE)])

    return action


def _layer_def_without_layer_idx():  # 0.20.0-0.24.0: def __init__(self, vllm_config, *, config, ...)
    return m.FunctionDef(name=m.Name("__init__"), params=m.Parameters(
        kwonly_params=[m.ZeroOrMore(m.Param(name=m.DoesNotMatch(m.Name("layer_idx"))))]))


# No ``fixed`` matcher here: on 0.25.0+ (``layer_idx`` present) this variant must not match at all.
LAYER_020 = Site(
    function=LAYER_INIT,
    anchor="`def __init__(self, vllm_config, *, config, ...)` without `layer_idx` and "
           "`self.self_attn = DFlashQwen3Attention(...)`",
    unfixed=any_of(_layer_def_without_layer_idx, _self_attn_line),
    rewrite=rules_rewrite(
        (_layer_def_without_layer_idx, lambda fn: _with_param(fn, "layer_idx: int = 0", kwonly=True)),
        (_self_attn_line, _around_self_attn(resolve=True)),
    ),
    expect=2,
)

LAYER_025 = Site(
    function=LAYER_INIT,
    anchor="`sliding_window, causal = _resolve_layer_attention(config, layer_idx)` then "
           "`self.self_attn = DFlashQwen3Attention(...)`",
    unfixed=_self_attn_line,
    rewrite=rules_rewrite((_self_attn_line, _around_self_attn(resolve=False))),
)


def _mixed_guard():  # if <mixed drafter ...>: raise NotImplementedError(...)
    return m.If(body=m.IndentedBlock(body=[m.ZeroOrMore(), m.SimpleStatementLine(body=[
        m.Raise(exc=m.Call(func=m.Name("NotImplementedError")))])]))


CHECK_MIXED = f"""\
from ddtree_patcher.runtime.swa import check_mixed_drafter as _ddtree_check_mixed  {MARK}
_ddtree_check_mixed(swa_abi={SWA_ABI})  {MARK} (V1 runs mixed drafters; a V2 runner that cannot is refused)
"""


def _check_instead_of_raise(node):
    """The guard's ``raise NotImplementedError(...)`` becomes ``ddtree_patcher.runtime.swa.check_mixed_drafter``:
    V1 runs mixed drafters (full KV storage, per-layer windows); a V2 runner that cannot run them
    (0.25.0) refuses them with a named error. (0.26.0+ reach the guard on V1 only.)"""
    *head, raise_line = node.body.body
    check = list(cst.parse_module(CHECK_MIXED).body)
    check[0] = check[0].with_changes(leading_lines=raise_line.leading_lines)
    return node.with_changes(body=node.body.with_changes(body=[*head, *check]))


GUARD_025 = Site(
    function=RESOLVE,
    anchor="`if <mixed sliding/full>: raise NotImplementedError(...)` (0.25: always; 0.26+: unless V2)",
    unfixed=_mixed_guard,
    rewrite=rules_rewrite((_mixed_guard, _check_instead_of_raise)),
)


def _resolves_mixed_unguarded():
    """0.34.0+: ``_resolve_layer_attention`` resolves each layer from ``layer_types[layer_idx]`` and
    raises ``NotImplementedError`` for no drafter (the V1 runner, which could not run mixed drafters,
    is gone; the V2 runner runs them since #47914)."""
    raise_nie = m.Raise(exc=m.Call(func=m.Name("NotImplementedError")))
    per_layer = m.Subscript(value=m.Name("layer_types"), slice=[m.SubscriptElement(m.Index(m.Name("layer_idx")))])
    return m.FunctionDef(name=m.Name(RESOLVE), body=m.MatchIfTrue(
        lambda body: bool(m.findall(body, per_layer)) and not m.findall(body, raise_nie)))


RESOLVED_034 = Site(
    function=RESOLVE,
    anchor="`_resolve_layer_attention` resolving `layer_types[layer_idx]` with no `raise NotImplementedError` "
           "(0.34.0+: mixed drafters resolved by upstream, V2 only)",
    unfixed=never,
    fixed=_resolves_mixed_unguarded,
    fixed_by="vllm#47914: mixed sliding/full drafters on the V2 runner; 0.34.0 removed the V1 runner and its guard",
    rewrite=rules_rewrite(),
)


# ---- llm_base_proposer.py: draft attention groups per (backend, window) ---------------------
def _backend_key_line():  # backend_key = attn_backend.full_cls_name()
    return m.SimpleStatementLine(body=[m.Assign(
        targets=[m.AssignTarget(target=m.Name("backend_key"))],
        value=m.Call(func=m.Attribute(value=m.Name("attn_backend"), attr=m.Name("full_cls_name")), args=[]))])


def _windowed_key(line):
    value = cst.parse_expression(
        '(attn_backend.full_cls_name(), getattr(all_attn_layers[layer_name], "sliding_window", None))')
    return _mark_line(line.with_changes(body=[line.body[0].with_changes(value=value)]))


def _group_spec_kwarg():  # AttentionGroup(..., kv_cache_spec=layer_kv_cache_spec, ...)
    return m.Arg(keyword=m.Name("kv_cache_spec"), value=m.Name("layer_kv_cache_spec"))


def _windowed_spec(arg):
    value = cst.parse_expression(
        'layer_kv_cache_spec if backend_key[1] is None or not hasattr(layer_kv_cache_spec, "sliding_window") '
        'else __import__("dataclasses").replace(layer_kv_cache_spec, sliding_window=backend_key[1])')
    return _mark_comma(arg.with_changes(value=value))


PROPOSER = Site(
    function=PROPOSER_FN,
    anchor="`backend_key = attn_backend.full_cls_name()` and `kv_cache_spec=layer_kv_cache_spec` in "
           "AttentionGroup(...)",
    unfixed=any_of(_backend_key_line, _group_spec_kwarg),
    rewrite=rules_rewrite((_backend_key_line, _windowed_key), (_group_spec_kwarg, _windowed_spec)),
    expect=2,
)


# ---- dflash.py: per-group causality on V1 ----------------------------------------------------
def _return_groups():  # return per_group, per_layer
    return m.SimpleStatementLine(body=[m.Return(value=m.Tuple(elements=[
        m.Element(m.Name("per_group")), m.Element(m.Name("per_layer"))]))])


CAUSAL_GROUPS = f"""\
from ddtree_patcher.runtime.swa import causal_draft_groups as _ddtree_causal_groups  {MARK}
per_group, per_layer = _ddtree_causal_groups(self, cad, draft_index, per_group, per_layer, swa_abi={SWA_ABI})  {MARK}
"""


def _causal_groups_before_return(line):
    added = cst.parse_module(CAUSAL_GROUPS).body
    first = added[0].with_changes(leading_lines=line.leading_lines)
    return cst.FlattenSentinel([first, *added[1:], line.with_changes(leading_lines=())])


METADATA = Site(
    function=METADATA_FN,
    anchor="`return per_group, per_layer` (after the non-causal assertion)",
    unfixed=_return_groups,
    rewrite=rules_rewrite((_return_groups, _causal_groups_before_return)),
)


# ---- gpu_model_runner.py: the runner's AttentionGroupKey carries the window -----------------
def _group_key_class():
    return m.ClassDef(name=m.Name("AttentionGroupKey"))


def _with_window_field(cls):
    field = _mark_line(cst.parse_statement("sliding_window: int | None = None"))
    body = cls.body
    return cls.with_changes(body=body.with_changes(body=(*body.body, field)))


def _dedup_key_line():  # key = (full_cls_name, layer_kv_cache_spec[, num_heads_q])
    return m.SimpleStatementLine(body=[m.Assign(
        targets=[m.AssignTarget(target=m.Name("key"))],
        value=m.Tuple(elements=[m.Element(m.Name("full_cls_name")), m.Element(m.Name("layer_kv_cache_spec")),
                                m.ZeroOrMore()]))])


def _windowed_dedup_key(line):
    tup = line.body[0].value
    elements = [*tup.elements[:-1], tup.elements[-1].with_changes(comma=cst.Comma(
        whitespace_after=cst.SimpleWhitespace(" "))), cst.Element(cst.parse_expression(LAYER_WINDOW))]
    return _mark_line(line.with_changes(body=[line.body[0].with_changes(value=tup.with_changes(elements=elements))]))


def _group_key_line():  # attn_backends[key] = AttentionGroupKey(attn_backend, layer_kv_cache_spec[, ...])
    return m.SimpleStatementLine(body=[m.Assign(value=m.Call(func=m.Name("AttentionGroupKey")))])


def _windowed_group_key(line):
    """``AttentionGroupKey(a, b[, c])`` (on one line or between lines of their own) gains
    ``sliding_window=...`` after its last argument, on that argument's line."""
    call = line.body[0].value
    *head, last = call.args
    new = _arg(f"sliding_window={LAYER_WINDOW}").with_changes(
        whitespace_after_arg=last.whitespace_after_arg, comma=last.comma)
    last = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")),
                             whitespace_after_arg=cst.SimpleWhitespace(""))
    ws = new.whitespace_after_arg
    if isinstance(ws, cst.ParenthesizedWhitespace):  # the argument line ends before ")": mark it
        new = new.with_changes(whitespace_after_arg=ws.with_changes(first_line=_marked(ws.first_line)))
    line = line.with_changes(body=[line.body[0].with_changes(value=call.with_changes(args=[*head, last, new]))])
    return line if isinstance(ws, cst.ParenthesizedWhitespace) else _mark_line(line)


# 0.20.0-0.22.1 unpack the key in two: ``for (attn_backend, kv_cache_spec), layer_names in ...``
# (0.23.0+ read ``key.attn_backend``: upstream's own fix when the key gained ``num_heads_q``).
def _two_field_unpack():
    return m.For(target=m.Tuple(elements=[
        m.Element(m.Tuple(elements=[m.Element(m.Name("attn_backend")), m.Element(m.Name("kv_cache_spec"))])),
        m.Element(m.Name("layer_names"))]))


def _key_attribute_loop():  # 0.23.0+: for key, layer_names in attn_backends_map.items(): ... key.attn_backend
    return m.For(target=m.Tuple(elements=[m.Element(m.Name("key")), m.Element(m.Name("layer_names"))]))


def _three_field_unpack(node):
    inner = node.target.elements[0].value
    *head, last = inner.elements
    elements = [*head, last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                cst.Element(cst.Name("_ddtree_window"))]
    target = node.target.with_changes(elements=[node.target.elements[0].with_changes(
        value=inner.with_changes(elements=elements)), *node.target.elements[1:]])
    from ddtree_patcher.rewriters import marked

    return node.with_changes(target=target, body=node.body.with_changes(header=marked(node.body.header, ID)))


UNPACK = Site(
    function=CREATE_GROUPS_FN,
    anchor="`for (attn_backend, kv_cache_spec), layer_names in attn_backends_map.items():`",
    unfixed=_two_field_unpack,
    fixed=_key_attribute_loop,
    rewrite=rules_rewrite((_two_field_unpack, _three_field_unpack)),
)

RUNNER = Site(
    function=RUNNER_FN,
    anchor="`class AttentionGroupKey(NamedTuple)`, `key = (full_cls_name, layer_kv_cache_spec, ...)` and "
           "`... = AttentionGroupKey(...)`",
    unfixed=any_of(_group_key_class, _dedup_key_line, _group_key_line),
    rewrite=rules_rewrite((_group_key_class, _with_window_field), (_dedup_key_line, _windowed_dedup_key),
                           (_group_key_line, _windowed_group_key)),
    expect=3,
)


# ---- config/vllm.py (0.29.0+): mixed drafters are not an unsupported V1 feature ---------------
def _unsupported_entry():  # if self._dflash_needs_multi_kv_group(): unsupported.append("mixed ...")
    return m.If(test=m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("_dflash_needs_multi_kv_group"))))


UNSUPPORTED = Site(
    function=UNSUPPORTED_FN,
    anchor='`if self._dflash_needs_multi_kv_group(): unsupported.append("mixed sliding/full dflash drafts")`',
    unfixed=_unsupported_entry,
    rewrite=rules_rewrite((_unsupported_entry, lambda node: _pass_marked(
        node, "mixed sliding/full DFlash drafts run on V1 too"))),
)


_NO_UNSUPPORTED_LIST = absent_site(
    "VllmConfig", f"{UNSUPPORTED_FN} is absent (V1 is refused in qwen3_dflash.py only)", UNSUPPORTED_FN)


# ---- the patch --------------------------------------------------------------------------------
ON_020 = ("0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0")
ON_025 = ("0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")
ON_029 = ON_025[4:]
ON_034 = ("0.34.0",)

# Pristine cst shape hashes (ddtree_patcher.cst_helpers.shape_hash) from the official wheels.
SHAPES_020 = {
    ATTN_INIT: frozenset({"1731bfc4197e"}),  # 0.20.0-0.24.0
    LAYER_INIT: frozenset({"5c0474ff79d3"}),  # 0.20.0-0.24.0
    MODEL_INIT: frozenset({"078bc49a6d99", "4516ea30bcbd"}),  # 0.20.0-0.21.0, 0.22.0-0.24.0
}
SHAPES_025 = {
    RESOLVE: frozenset({"d381aab24927", "87ce7668b042"}),  # 0.25.0, 0.26.0-0.33.0
    # 0.25.0-0.27.0, 0.28.0, 0.29.0-0.30.0, 0.31.0-0.33.0
    LAYER_INIT: frozenset({"a32f9e65fc2c", "1cfdb5ae3451", "c559bdebc81f", "2366a0877c69"}),
}
# 0.20.0-0.26.0, 0.27.0-0.30.0, 0.31.0, 0.32.0-0.33.0
SHAPES_PROPOSER = {PROPOSER_FN: frozenset({"c2799219c7b3", "62d8f94dc29e", "e18973cf99e6", "dd991505e837"})}
# 0.20.0-0.22.1 (unconditional non-causal assertion), 0.23.0-0.33.0 (only when not dflash_causal)
SHAPES_METADATA = {METADATA_FN: frozenset({"e85be54c7241", "9762b9783ff8"})}
# 0.20.0-0.22.1, 0.23.0-0.30.0, 0.31.0-0.33.0
SHAPES_RUNNER = {RUNNER_FN: frozenset({"f3b11ba016ab", "2ec4bc1d017a", "888eafa2fdf9"})}
# 0.20.0-0.22.1 (pending), 0.23.0-0.33.0 (`key.attn_backend`: upstream)
SHAPES_UNPACK = {CREATE_GROUPS_FN: frozenset({"6dcfa185811c", "752b4bfc37b9"})}
SHAPES_034 = {RESOLVE: frozenset({"c6b7d25f50b3"})}  # 0.34.0 (upstream: the shape is informative only)
SHAPES_CONFIG = {UNSUPPORTED_FN: frozenset({"205518903fd1", "64e271cf2ff6", "675c586beb18"})}  # 0.29-0.30, 0.31-0.32, 0.33


def _runtime(site, python: str | None) -> str | None:
    """The rewritten drafter imports ``ddtree_patcher.runtime.swa`` in vLLM's interpreter (``--python``,
    else the one running ddtree-patch): it must be importable there and speak the call sites' ABI."""
    abi, where = runtime_abi("ddtree_patcher.runtime.swa", "SWA_ABI", python)
    if abi is None:
        return (f"{python} cannot import ddtree_patcher.runtime.swa ({where}): the patched vLLM would fail to build "
                "any DFlash drafter; install ddtree-patch in that environment or `ddtree-patch revert`")
    if abi != SWA_ABI:
        return (f"the call sites speak sliding-window ABI {SWA_ABI} but ddtree_patcher.runtime.swa in {where} speaks "
                f"{abi}: run `ddtree-patch revert && ddtree-patch apply` with the installed ddtree-patch")
    return None


PATCH = Patch(
    id=ID,
    summary="DFlash drafters with sliding-window layers: per-layer windows on 0.20-0.24, mixed "
            "sliding/full drafters on the V1 runner (full KV storage, per-window attention groups)",
    kind="fix",
    upstream=("vllm-project/vllm#40898", "vllm-project/vllm#46104", "vllm-project/vllm#47914",
              "vllm-project/vllm#50707", "vllm-project/vllm#51756"),
    requires=(DFLASH_PY,),
    doc="docs/patches/dflash-sliding-window.md",
    runtime=_runtime,
    files=(
        PatchFile(
            path=DFLASH_PY,
            variants=(
                # guard-0.25 first: resolve-0.20's upstream markers also match an applied 0.25+ file.
                Variant("guard-0.25", ON_025, (GUARD_025, LAYER_025), SHAPES_025),
                Variant("resolve-0.20", ON_020, (ATTN_020, LAYER_020, MODEL_020), SHAPES_020),
                # upstream only: recognises 0.34.0's resolver (no guard: never pending)
                Variant("resolved-0.34", ON_034, (RESOLVED_034,), SHAPES_034),
            ),
        ),
        PatchFile(path=PROPOSER_PY, gone_with=V1_DFLASH, variants=(Variant("groups-0.20", ON_020 + ON_025, (PROPOSER,), SHAPES_PROPOSER),)),
        PatchFile(path=DFLASH_PROPOSER_PY, gone_with=V1_DFLASH,
                  variants=(Variant("causal-groups-0.20", ON_020 + ON_025, (METADATA,), SHAPES_METADATA),)),
        PatchFile(path=RUNNER_PY, gone_with=V1_DFLASH, variants=(
            Variant("group-key-0.20", ON_020 + ON_025, (RUNNER, UNPACK), {**SHAPES_RUNNER, **SHAPES_UNPACK}),)),
        PatchFile(
            path=CONFIG_PY,
            variants=(
                Variant("v1-unsupported-0.29", ON_029, (UNSUPPORTED,), SHAPES_CONFIG),
                Variant("no-unsupported-list", ON_020 + ON_025[:4], (_NO_UNSUPPORTED_LIST,)),
            ),
        ),
    ),
)
