"""Patch modules, one per patch. ``SERIES`` is the order in which they are applied
(quilt's ``series`` written as a tuple): a later patch sees the earlier ones' output."""

from ddtree_patcher.patches import (
    ddtree_proposer, ddtree_tree_step, dflash_layer_offset, dflash_prefix_cache_drop, dflash_sliding_window, tree_walk_hook,
)

SERIES = (dflash_layer_offset.PATCH, dflash_prefix_cache_drop.PATCH, dflash_sliding_window.PATCH,
          tree_walk_hook.PATCH, ddtree_proposer.PATCH,
          ddtree_tree_step.PATCH)
