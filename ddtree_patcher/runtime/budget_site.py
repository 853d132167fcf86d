"""``DDTREE_PATCH_BUDGET=auto``'s scheduler side (issue 35.2): vLLM's ``Scheduler.schedule`` decides, every
step, how many draft tokens per request the next step verifies: ``num_spec_tokens_to_schedule``, the count
vLLM's own dynamic speculative decoding sets (vLLM 0.24.0-0.34.0). The runner drafts that many (the V1
runner's ``propose(num_speculative_tokens=...)``; the V2 runner's from 0.32.0), the async scheduler's
placeholders are that many, and the next step schedules that many: the same count on every path, sync and
async. The ddtree-proposer call site there (right after vLLM's dynamic-SD lookup) calls
:func:`bind_scheduler` once per scheduler and :meth:`ScheduledBudget.pick` every step; the pick is the DDTree
drafter's policy (``DDTreeDrafter.next_budget``, fed by the verify side's accounting), found in this process
(the engine core with vLLM's in-process executor: one GPU, where DFlash runs).

Torch-free and vLLM-free."""

from __future__ import annotations

import weakref

from .ddtree_config import check_abi
from .switches import DDTreeConfigError, budget_auto

_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # the DDTree drafters of this process (runtime.ddtree)


def register_drafter(drafter) -> None:
    """Called by every ``DDTreeDrafter`` when it is built."""
    _LIVE.add(drafter)


def live_drafters() -> list:
    return list(_LIVE)


def policy_summaries() -> list:
    """``DDTREE_PATCH_BUDGET=auto``: each live drafter's policy summary (``BudgetPolicy.summary``: the budget
    it holds, steps, switches, explorations, acceptance per budget); empty without auto."""
    return [d.policy.summary() for d in live_drafters() if getattr(d, "policy", None) is not None]


def bind_scheduler(scheduler, *, ddtree_abi: int) -> "ScheduledBudget | None":
    """The scheduler call site's bind (its first ``schedule()`` with DDTree on): None unless the budget is
    ``auto`` (a pinned budget: vLLM's count, N, every step)."""
    check_abi(ddtree_abi)
    if not budget_auto():
        return None
    return ScheduledBudget(int(scheduler.num_spec_tokens))


class ScheduledBudget:
    """The scheduler's budget source: the DDTree drafter of this process, found at the first pick (vLLM
    builds the worker, and with it the drafter, before the scheduler)."""

    def __init__(self, max_budget: int):
        self.max_budget = max_budget
        self.drafter = None
        self.picks = 0

    def pick(self, num_requests: int) -> int:
        """The budget of the drafts this step produces (verified by the next step): host only."""
        dd = self.drafter or self._find()
        self.picks += 1
        b = dd.scheduled_budget(num_requests)
        return min(max(int(b), 1), self.max_budget)

    def _find(self):
        found = [d for d in live_drafters() if d.auto]
        if len(found) != 1:
            raise DDTreeConfigError(
                f"ddtree-patch: DDTREE_PATCH_BUDGET=auto: the scheduler found {len(found)} DDTree drafters in "
                "its process, expected one: the budget policy runs where the scheduler and the drafter share a "
                "process (one GPU: vLLM's in-process executor); pin a budget (DDTREE_PATCH_BUDGET=31) elsewhere")
        if found[0].budget != self.max_budget:
            raise DDTreeConfigError(
                f"ddtree-patch: DDTREE_PATCH_BUDGET=auto: the scheduler schedules at most {self.max_budget} draft "
                f"tokens, the drafter's budget is {found[0].budget}")
        self.drafter = found[0]
        return self.drafter
