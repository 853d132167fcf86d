"""What the rewritten vLLM files (``patches/*``, written by the offline engine) and the runtime they
call (``ddtree_patcher.runtime``) must agree on, in one place: the ABI number each patch writes into
its call sites (``hook_abi=N``, ...; the runtime refuses another with the fix, ``revert && apply``),
the marker every rewritten line carries, the attribute names the call sites and the runtime share,
and the environment variables the call sites gate on (their parsing: :mod:`.switches`).

Torch-free and vLLM-free: the patch modules import it in the offline engine. Bump an ABI on any
incompatible change of its call sites or of the runtime functions they call."""

from __future__ import annotations

from .switches import ENV_CHAIN, ENV_ENABLE  # noqa: F401 - the names the call sites gate on

MARK_PREFIX = "# ddtree-patch: "

HOOK_ABI = 2  # tree-walk-hook -> runtime.hook
SWA_ABI = 2  # dflash-sliding-window -> runtime.swa
DDTREE_ABI = 1  # ddtree-proposer -> runtime.ddtree
TREE_STEP_ABI = 4  # ddtree-tree-step -> runtime.tree_step
# (TREE_STEP_ABI 2: the FlashAttention site moved before the forward's causal call and returns when
# fa_attention() handled the layer; 3: a capture_model site binds the tree step before CUDA graph
# capture, for FULL decode graphs; 4: the V2 runner's sites, check_v2_runner instead of refuse_v2)

TREE_STEP_ATTR = "ddtree_tree_step"  # on the runner, its V2 speculator and the target layers' attention impls
CONFIG_ATTR = "ddtree_patch"  # the record ddtree-proposer's config site leaves on the SpeculativeConfig


def abi_mismatch(patch_id: str, call_sites_abi: int, runtime_abi: int) -> str:
    """The refusal text when a vLLM's call sites of ``patch_id`` speak another ABI than this runtime."""
    return (f"ddtree-patch: this vLLM's {patch_id} call sites speak ABI {call_sites_abi}, the installed "
            f"ddtree_patcher speaks ABI {runtime_abi}: re-apply with the installed tool "
            "(`ddtree-patch revert && ddtree-patch apply`, then restart vLLM)")


def mark(patch_id: str) -> str:
    """The comment every line a patch writes ends with (how ``verify`` and ``revert`` find them)."""
    return MARK_PREFIX + patch_id
