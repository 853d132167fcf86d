"""Runtime of the ``dflash-sliding-window`` patch: what the rewritten ``DFlashQwen3DecoderLayer``
calls while the drafter is built (once per layer, never per step). Imports nothing heavy.

* :func:`resolve_layer_attention` is vLLM 0.28's ``_resolve_layer_attention`` (#46104, #47914)
  without the V1 guard; the 0.20.0-0.24.0 call sites use it (those releases have no resolver).
* :func:`finish_draft_layer` runs after the layer's ``Attention`` exists, on every release:

  - in a *mixed* drafter (sliding and full layers) a sliding layer reports full KV storage
    (``get_kv_cache_spec`` as if it had no window), so every draft layer stays in one KV cache
    group (V1's proposer asserts one) and the context K/V the target pass wrote is never evicted;
    it still *computes* with its window (the attention impl keeps ``sliding_window``). The
    rewritten proposer then gives each window its own draft attention group, whose spec carries
    the window (``FullAttentionSpec.sliding_window``: "full storage, windowed compute");
  - a non-causal sliding layer gets a symmetric FlashAttention window ``(w-1, w-1)`` instead of
    ``(w-1, 0)`` (0.20.0-0.24.0 never symmetrise; later releases do it themselves);
  - the layer's causality is written on it (``attn.ddtree_causal``) for :func:`causal_draft_groups`.

* :func:`causal_draft_groups` runs in V1's ``DFlashProposer.build_per_group_and_layer_attn_metadata``
  (each draft step): V1 builds one draft metadata with the drafter-wide causality (non-causal as
  soon as one layer is), so the draft attention groups whose layers are all causal (the sliding
  layers of a z-lab drafter) get their metadata rebuilt as causal, as V2 does per KV group.

* :func:`check_mixed_drafter` runs where a mixed drafter is resolved (0.25.0+: in place of
  upstream's ``raise NotImplementedError``; 0.20.0-0.24.0: in :func:`resolve_layer_attention`):
  a V2 runner that cannot run mixed drafters (0.24.0-0.25.0: one draft attention group for every
  layer, drafter-wide causality) refuses them with :class:`MixedDrafterOnV2Error`, a named
  ``NotImplementedError``, instead of running their sliding layers with full attention.

Which runner builds the drafter (:func:`draft_runner`) is vLLM's own decision
(``VllmConfig.use_v2_model_runner``, the property the worker builds its runner from).

All-sliding and all-full drafters keep upstream behaviour (nothing is changed for them here), and
so do mixed drafters built for a V2 runner that supports them (0.26.0+).
"""

from __future__ import annotations

from typing import Any

from .contract import SWA_ABI  # noqa: F401 - written into every call site as ``swa_abi=N``

SLIDING = "sliding_attention"


class SlidingWindowRuntimeError(RuntimeError):
    pass


class MixedDrafterOnV2Error(NotImplementedError):
    """A mixed sliding/full DFlash drafter built for a V2 runner that cannot run it."""


V1, V2, V2_MIXED = "v1", "v2", "v2-mixed"  # see draft_runner()


def _check_abi(swa_abi: int) -> None:
    if swa_abi != SWA_ABI:
        raise SlidingWindowRuntimeError(
            f"ddtree-patch: the dflash-sliding-window call sites speak ABI {swa_abi} but the installed "
            f"ddtree_patcher.runtime.swa speaks {SWA_ABI}: run `ddtree-patch revert && ddtree-patch apply` with "
            "the installed ddtree-patch")


def _dflash_config(config: Any) -> dict:
    return getattr(config, "dflash_config", None) or {}


def layer_causal(config: Any, layer_idx: int) -> bool:
    """vLLM 0.28's ``_dflash_layer_causal``: ``is_causal``, else ``dflash_config.causal``, else
    causal exactly for the sliding layers of ``layer_types`` (the z-lab convention)."""
    is_causal = getattr(config, "is_causal", None)
    if is_causal is not None:
        return bool(is_causal)
    override = _dflash_config(config).get("causal")
    if override is not None:
        return bool(override)
    layer_types = getattr(config, "layer_types", None)
    return bool(layer_types) and layer_types[layer_idx] == SLIDING


def layer_window(config: Any, layer_idx: int) -> int | None:
    """The layer's sliding window (None: full attention), as vLLM 0.25-0.33 resolve it."""
    dflash_config = _dflash_config(config)
    layer_types = getattr(config, "layer_types", None)
    use_swa = dflash_config.get("use_swa", False)
    any_sliding = layer_types is not None and any(lt == SLIDING for lt in layer_types)
    # ``use_swa`` forces SWA on every layer, even an all-full ``layer_types``.
    if layer_types is None or (use_swa and not any_sliding):
        is_sliding = bool(use_swa)
    else:
        is_sliding = layer_types[layer_idx] == SLIDING
    if not is_sliding:
        return None
    window = dflash_config.get("swa_window_size", getattr(config, "sliding_window", None))
    if window is None:
        raise ValueError("DFlash sliding attention requires a window size configured in "
                         "dflash_config.swa_window_size or the top-level sliding_window.")
    return int(window)


def resolve_layer_attention(config: Any, layer_idx: int, *, swa_abi: int) -> tuple[int | None, bool]:
    """``(sliding_window, causal)`` for one DFlash draft layer (0.20.0-0.24.0, which have no
    resolver); a mixed drafter is checked against the runner that builds it."""
    _check_abi(swa_abi)
    if is_mixed(config):
        check_mixed_drafter(swa_abi=swa_abi)
    return layer_window(config, layer_idx), layer_causal(config, layer_idx)


def is_mixed(config: Any) -> bool:
    """Whether the drafter has both sliding-window and full-attention layers."""
    windows = [layer_window(config, i) for i in range(config.num_hidden_layers)]
    return any(w is None for w in windows) and any(w is not None for w in windows)


def keep_full_kv_storage(attn: Any) -> None:
    """Make ``attn`` report the KV cache spec of a full-attention layer (full storage) while its
    impl keeps computing with ``attn.sliding_window``."""
    original = attn.get_kv_cache_spec

    def get_kv_cache_spec(*args, **kwargs):
        window = attn.sliding_window
        attn.sliding_window = None
        try:
            return original(*args, **kwargs)
        finally:
            attn.sliding_window = window

    attn.get_kv_cache_spec = get_kv_cache_spec
    attn.ddtree_full_kv_storage = True


def symmetrize_window(attn: Any) -> None:
    """FlashAttention-style impl windows ``(left, 0)`` become ``(left, left)`` (non-causal)."""
    impl = getattr(attn, "impl", None)
    window = getattr(impl, "sliding_window", None)
    if isinstance(window, tuple) and len(window) == 2 and window[0] >= 0 and window[1] == 0:
        impl.sliding_window = (window[0], window[0])


def draft_runner() -> str:
    """Which model runner this drafter is being built for, as vLLM decides it:

    * ``"v1"``: the V1 runner (``VllmConfig.use_v2_model_runner`` false);
    * ``"v2-mixed"``: a V2 runner that runs mixed drafters itself (multiple KV cache groups,
      per-group causality: 0.26.0+, recognised by ``VllmConfig._dflash_needs_multi_kv_group``);
    * ``"v2"``: a V2 runner that does not (0.24.0-0.25.0).

    Releases without the property (0.20.0-0.21.0), and a drafter built with no current vLLM config
    (0.28.0+ raise there, older releases warn and return a default one), read
    ``VLLM_USE_V2_MODEL_RUNNER`` as their worker does."""
    try:
        from vllm.config import VllmConfig, get_current_vllm_config
    except ImportError:
        return V1
    try:
        config = get_current_vllm_config()
    except AssertionError:  # 0.28.0+: no config set (a drafter built outside vLLM's engine)
        config = None
    use_v2 = getattr(config, "use_v2_model_runner", None)
    if use_v2 is None:
        import vllm.envs as envs

        use_v2 = getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", False)
    if not use_v2:
        return V1
    return V2_MIXED if hasattr(VllmConfig, "_dflash_needs_multi_kv_group") else V2


MIXED_ON_V2 = (
    "ddtree-patch (dflash-sliding-window): this DFlash drafter mixes sliding-window and full-attention "
    "layers, and the V2 model runner of this vLLM cannot run it: it builds one draft attention group for "
    "every layer, so the sliding layers would attend to the whole context (upstream runs mixed drafters "
    "on V2 from vLLM 0.26.0). Relaunch with VLLM_USE_V2_MODEL_RUNNER=0: the patched V1 runner runs it.")


def check_mixed_drafter(*, swa_abi: int, runner: str | None = None) -> None:
    """Called where a mixed sliding/full drafter is resolved: refuses it on a V2 runner that
    cannot run it (``runner``: see :func:`draft_runner`; None: ask vLLM)."""
    _check_abi(swa_abi)
    if (runner or draft_runner()) == V2:
        raise MixedDrafterOnV2Error(MIXED_ON_V2)


def finish_draft_layer(config: Any, layer_idx: int, attn: Any, causal: bool, *, swa_abi: int,
                       runner: str | None = None) -> None:
    """Called once per draft layer, right after its ``Attention`` is built. ``runner``: see
    :func:`draft_runner` (None: ask vLLM); only the V1 runner gets full KV storage."""
    _check_abi(swa_abi)
    attn.ddtree_causal = bool(causal)
    if getattr(attn, "sliding_window", None) is None:
        return
    if is_mixed(config):
        if (runner or draft_runner()) == V1:
            keep_full_kv_storage(attn)
    if not causal:
        symmetrize_window(attn)


def causal_draft_groups(proposer: Any, cad: Any, draft_index: int, per_group: list, per_layer: dict, *,
                        swa_abi: int) -> tuple[list, dict]:
    """``(per_group, per_layer)`` with the metadata of every all-causal draft attention group
    rebuilt as causal when the step's common metadata is non-causal. Which groups are causal is
    decided once per proposer (``proposer.ddtree_causal_groups``); a drafter without such groups
    costs one dict lookup and a comparison per step."""
    groups = proposer.__dict__.get("ddtree_causal_groups")
    if groups is None:
        _check_abi(swa_abi)
        layers = proposer.vllm_config.compilation_config.static_forward_context
        groups = proposer.ddtree_causal_groups = [
            i for i, g in enumerate(proposer.draft_attn_groups)
            if g.layer_names and all(getattr(layers.get(n), "ddtree_causal", False) for n in g.layer_names)]
    if not groups or getattr(cad, "causal", None) is not False:
        return per_group, per_layer
    import dataclasses

    causal_cad = dataclasses.replace(cad, causal=True)
    per_group, per_layer = list(per_group), dict(per_layer)
    for i in groups:
        group = proposer.draft_attn_groups[i]
        metadata = group.get_metadata_builder().build_for_drafting(common_attn_metadata=causal_cad,
                                                                    draft_index=draft_index)
        per_group[i] = metadata
        for name in group.layer_names:
            per_layer[name] = metadata
    return per_group, per_layer
