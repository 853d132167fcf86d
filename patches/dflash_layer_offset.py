"""dflash-layer-offset: DFlash ``target_layer_ids`` mean "output of layer L", vLLM's aux-layer
capture is EAGLE-indexed ("input of layer L"), so the V1 runner must add 1 (upstream #40727).

Before the fix (0.20.0–0.21.0) the drafter gets every context feature from the layer below the
one it was trained on: nothing crashes, acceptance drops. Speculators-format configs carry
EAGLE-indexed ``eagle_aux_hidden_state_layer_ids``, which take precedence and stay unchanged;
``update_dflash`` maps them back to DFlash semantics (``i - 1``) so the two stay consistent.
Upstream from 0.22.0; not applicable before 0.20.0 (no DFlash). From 0.34.0 the V1 runner is gone (its
file is not applicable) and the V2 runner adds the 1 itself (``eagle3_utils.py``): upstream.
"""

from __future__ import annotations

from ddtree_patcher.patchlib import DFLASH_MODEL, V1_DFLASH, Patch, PatchFile, Site, Variant, cst, m, replace_and_mark

ID = "dflash-layer-offset"
RUNNER_FN = "GPUModelRunner._get_eagle3_aux_layers_from_config"


# ---- A: GPUModelRunner._get_eagle3_aux_layers_from_config (V1 runner) ----------------------
def _raw_target_ids():  # layer_ids = dflash_config.get("target_layer_ids")
    return m.Assign(
        targets=[m.AssignTarget(target=m.Name("layer_ids"))],
        value=m.Call(
            func=m.Attribute(value=m.Name("dflash_config"), attr=m.Name("get")),
            args=[m.Arg(value=m.SimpleString('"target_layer_ids"'))],
        ),
    )


def _plus_one():  # upstream: layer_ids = [i + 1 for i in (dflash_config.get("target_layer_ids") or [])]
    return m.ListComp(elt=m.BinaryOperation(left=m.Name("i"), operator=m.Add(), right=m.Integer("1")))


def _add_one(node):
    return node.with_changes(
        value=cst.parse_expression('[i + 1 for i in (dflash_config.get("target_layer_ids") or [])]')
    )


RUNNER = Site(
    function=RUNNER_FN,
    anchor='`layer_ids = dflash_config.get("target_layer_ids")`',
    unfixed=_raw_target_ids,
    fixed=_plus_one,
    fixed_by="vllm#40727",
    rewrite=replace_and_mark(_raw_target_ids, _add_one),
    applies=lambda module, node: "dflash_config" in module.code_for_node(node),
)


# ---- B: update_dflash (speculators config -> DFlash config) --------------------------------
def _raw_dict_entry():  # "target_layer_ids": aux_layer_ids
    return m.DictElement(key=m.SimpleString('"target_layer_ids"'), value=m.Name("aux_layer_ids"))


def _minus_one():  # upstream: "target_layer_ids": [i - 1 for i in aux_layer_ids]
    return m.DictElement(
        key=m.SimpleString('"target_layer_ids"'),
        value=m.ListComp(elt=m.BinaryOperation(left=m.Name("i"), operator=m.Subtract(), right=m.Integer("1"))),
    )


def _sub_one(node):
    return node.with_changes(value=cst.parse_expression("[i - 1 for i in aux_layer_ids]"))


SPECULATORS = Site(
    function="update_dflash",
    anchor='`"target_layer_ids": aux_layer_ids` in the dflash_config dict',
    unfixed=_raw_dict_entry,
    fixed=_minus_one,
    fixed_by="vllm#40727",
    rewrite=replace_and_mark(_raw_dict_entry, _sub_one),
)

VERIFIED_ON = ("0.20.0", "0.20.1", "0.20.2", "0.21.0")

PATCH = Patch(
    id=ID,
    summary="Add 1 to DFlash target_layer_ids for EAGLE-indexed aux-layer capture (V1 runner)",
    kind="fix",
    upstream=("vllm-project/vllm#40727",),
    requires=(DFLASH_MODEL,),
    files=(
        PatchFile(
            path="vllm/v1/worker/gpu_model_runner.py",
            gone_with=V1_DFLASH,  # 0.34.0+: no V1 runner (V2 derives the +1 itself, eagle3_utils.py)
            variants=(
                Variant("v1-runner-0.20", VERIFIED_ON, (RUNNER,), {RUNNER_FN: frozenset({"7f35ddab7485"})}),
            ),
        ),
        PatchFile(
            path="vllm/transformers_utils/configs/speculators/algos.py",
            variants=(
                Variant("speculators-0.20", VERIFIED_ON, (SPECULATORS,), {"update_dflash": frozenset({"d4966fa86652"})}),
            ),
        ),
    ),
)
