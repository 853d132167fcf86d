"""The ``DDTREE_PATCH_*`` environment variables a patched vLLM process reads, and their parsing.

Torch-free and vLLM-free: the boot guard, the tree-walk hook, the DDTree proposer and the tree step
all read the switches through this module, so every process parses them the same way.

* ``DDTREE_PATCH_ENABLE``, ``DDTREE_PATCH_CHAIN_AS_TREE``, ``DDTREE_PATCH_TREE_STREAM``: switches.
  Exactly ``0`` or ``1``; unset or empty is the default (0, except ``TREE_STREAM``: 1). Any other
  value (``true``, ``false``, ``yes``, ``off``, `` 1``, ...) is refused with
  :class:`DDTreeConfigError` naming the variable: an operator who wrote ``false`` must not get
  DDTree switched on (it was, before this module: any value but ``""`` and ``"0"`` enabled it).
* ``DDTREE_PATCH_BUDGET``: an integer node budget in [1, 2047], default 63 (:func:`budget_from_env`);
  the V1 runner takes at most 128 (``runtime.ddtree.bind_v1`` refuses more at start). ``auto`` or
  ``auto:N`` (issue 35.2; :func:`budget_auto`): the budget of each step is chosen among the spine-only
  chain and the budgets 15 / 31 / 63 up to N (default 63) by ``runtime.budget_policy``; vLLM is sized
  for N; each step's pick reaches vLLM through the scheduler's budget site (``runtime.budget_site``).
  Where it runs: ``runtime.ddtree_config.refuse_auto`` (V1 0.24.0-0.33.0, V2 0.32.0-0.34.0, one process).
* ``DDTREE_PATCH_AUTO_CYCLE`` (diagnostic, tests): with ``auto``, a comma-separated list of budgets the
  steps take in turn instead of the policy's picks (:func:`auto_cycle`), e.g. ``8,3,5``.
* ``DDTREE_PATCH_ON_DRIFT``: ``warn`` or ``error`` (unset or empty: ``error``).

The rewritten vLLM files gate on ``os.environ.get(NAME, "0") not in ("", "0")`` (one lookup, no
import, when DDTree is off); a value that passes that gate reaches the runtime, which parses it here
and refuses a bad one, so a bad value stops vLLM at start (the boot guard, :func:`check_all`, runs in
every vLLM process before any model is built), never turns DDTree on by accident.

``DDTREE_PATCH_CACHE`` and ``DDTREE_PATCH_CRASH_AT`` belong to the command-line tool and its tests,
not to a vLLM process; any other ``DDTREE_PATCH_*`` name is logged as unknown (a typo such as
``DDTREE_PATCH_BUGDET`` would otherwise be silently ignored).
"""

from __future__ import annotations

import logging
import os

ENV_ENABLE = "DDTREE_PATCH_ENABLE"
ENV_CHAIN = "DDTREE_PATCH_CHAIN_AS_TREE"
ENV_BUDGET = "DDTREE_PATCH_BUDGET"
ENV_ON_DRIFT = "DDTREE_PATCH_ON_DRIFT"
ENV_TREE_STREAM = "DDTREE_PATCH_TREE_STREAM"
ENV_AUTO_CYCLE = "DDTREE_PATCH_AUTO_CYCLE"
AUTO = "auto"

SWITCH_DEFAULTS = {ENV_ENABLE: False, ENV_CHAIN: False, ENV_TREE_STREAM: True}
ON_DRIFT_VALUES = ("error", "warn")
# The verify forward runs B * (1 + N) tokens, and budgets with 1 + N a multiple of 16 are the cheap
# ones (GEMM tiles): on one H200 (docs/ddtree.md, "Which budget") N = 63 was 5-11 % faster than
# N = 64 on V1 and V2 wherever the step was not host bound.
DEFAULT_BUDGET = 63
MAX_BUDGET = 2047  # == ddtree_patcher.kernels.tree_reference.MAX_BUDGET (the builder's limit)
TOOL_ONLY = ("DDTREE_PATCH_CACHE", "DDTREE_PATCH_CRASH_AT")  # the CLI's and the tests', not vLLM's
KNOWN = (*SWITCH_DEFAULTS, ENV_BUDGET, ENV_ON_DRIFT, ENV_AUTO_CYCLE, *TOOL_ONLY)

logger = logging.getLogger("vllm.ddtree_patch")


class DDTreeConfigError(ValueError):
    """DDTree cannot run with this configuration (a bad switch value or budget, a conflicting vLLM
    option, or processes that disagree about the switch)."""


def switch(name: str) -> bool:
    """The switch ``name``: ``"1"`` -> True, ``"0"`` -> False, unset or ``""`` -> its default;
    anything else raises :class:`DDTreeConfigError`."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return SWITCH_DEFAULTS[name]
    if raw in ("0", "1"):
        return raw == "1"
    raise DDTreeConfigError(
        f"ddtree-patch: {name}={raw!r} is not a switch value: expected 0 or 1 (unset or empty means "
        f"{int(SWITCH_DEFAULTS[name])}); nothing else is accepted, so that a value such as 'false' "
        "cannot turn DDTree on")


def _budget_int(raw: str, shown: str) -> int:
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= MAX_BUDGET:
        raise DDTreeConfigError(
            f"ddtree-patch: {ENV_BUDGET}={shown!r} is not a node budget: expected an integer in "
            f"[1, {MAX_BUDGET}] (verify nodes per request; default {DEFAULT_BUDGET}), or {AUTO} / {AUTO}:N")
    return value


def budget_spec() -> tuple[int, bool]:
    """``DDTREE_PATCH_BUDGET`` as (N, auto): an int in [1, MAX_BUDGET] (unset or blank:
    DEFAULT_BUDGET), or ``auto`` (N = DEFAULT_BUDGET) / ``auto:N`` (N the largest budget a step may
    take; vLLM is sized for it)."""
    raw = os.environ.get(ENV_BUDGET)
    if raw is None or not raw.strip():
        return DEFAULT_BUDGET, False
    text = raw.strip()
    if text == AUTO:
        return DEFAULT_BUDGET, True
    if text.startswith(AUTO + ":"):
        return _budget_int(text[len(AUTO) + 1:], raw), True
    return _budget_int(text, raw), False


def budget_from_env() -> int:
    """``DDTREE_PATCH_BUDGET`` as an int in [1, MAX_BUDGET] (unset or blank: DEFAULT_BUDGET; ``auto``:
    the largest budget, what vLLM is sized for). The runner may refuse a budget this accepts (vLLM's
    V1 rejection sampler verifies at most 128 tokens per request: ``runtime.ddtree.bind_v1``)."""
    return budget_spec()[0]


def budget_auto() -> bool:
    """``DDTREE_PATCH_BUDGET=auto`` or ``auto:N``: the budget of each step chosen per step."""
    return budget_spec()[1]


def auto_cycle() -> tuple[int, ...] | None:
    """``DDTREE_PATCH_AUTO_CYCLE`` (diagnostic): the budgets the steps take in turn, or None (unset)."""
    raw = os.environ.get(ENV_AUTO_CYCLE)
    if raw is None or not raw.strip():
        return None
    out = []
    for part in raw.split(","):
        try:
            value = int(part.strip(), 10)
        except ValueError:
            value = 0
        if not 1 <= value <= MAX_BUDGET:
            raise DDTreeConfigError(f"ddtree-patch: {ENV_AUTO_CYCLE}={raw!r}: expected comma-separated budgets "
                                    f"in [1, {MAX_BUDGET}]")
        out.append(value)
    return tuple(out)


def on_drift() -> str:
    """``DDTREE_PATCH_ON_DRIFT``: ``error`` (default) or ``warn``."""
    raw = os.environ.get(ENV_ON_DRIFT)
    if raw is None or raw == "":
        return "error"
    if raw in ON_DRIFT_VALUES:
        return raw
    raise DDTreeConfigError(f"ddtree-patch: {ENV_ON_DRIFT}={raw!r}: expected one of "
                            f"{', '.join(ON_DRIFT_VALUES)} (unset or empty means error)")


def check_all() -> None:
    """Parse every ``DDTREE_PATCH_*`` variable of this process (the boot guard, at start): raises
    :class:`DDTreeConfigError` on the first bad value; logs names it does not know."""
    for name in SWITCH_DEFAULTS:
        switch(name)
    on_drift()
    budget_from_env()
    auto_cycle()
    unknown = sorted(k for k in os.environ if k.startswith("DDTREE_PATCH_") and k not in KNOWN)
    if unknown:
        logger.warning("ddtree-patch: unknown variables ignored: %s (known: %s)", ", ".join(unknown),
                       ", ".join(KNOWN))
