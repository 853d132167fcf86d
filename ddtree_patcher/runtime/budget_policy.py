"""The budget policy of ``DDTREE_PATCH_BUDGET=auto`` (issue 35, item 2): which node budget the next step
verifies, chosen on the host from numbers the host already has. Pure Python: no torch, no vLLM, no
device (the integration plan and the vLLM sites it needs: docs/notebook/budget-auto-study.md).

**Candidates.** A small set of budgets ``b`` (verify nodes per request), one of them the **chain**: the
spine-only tree of ``s = L_eff`` nodes, which costs what DFlash's chain costs (``1 + s`` rows per
request). The others are the budgets with CUDA graphs (e.g. 15 / 31 / 63), at most the configured N.

**Inputs, per step or per interval** (all host numbers; the device counters reach the host lagged,
through the accounting's pinned copy: no synchronisation is needed to decide):

* ``B``, the decode requests of the step being scheduled (:meth:`BudgetPolicy.pick`);
* the **step cost** per (budget, B), in seconds: measured points (:meth:`set_cost`, e.g. timed at graph
  capture) and online measurements (:meth:`observe_cost`, an EWMA on the point of that B); between
  measured batch sizes the cost is interpolated linearly, below the smallest it is the smallest's,
  above the largest it follows the last segment's slope (one point: flat). A budget without a cost is
  never picked nor explored;
* the **acceptance** per budget: accepted draft tokens over request-steps (:meth:`observe`). From one
  walk at budget N the runtime can count, for every prefix budget b ≤ N, what that prefix would have
  accepted (exact for greedy; the study, section 2), and the spine count is the chain's acceptance:
  feed them all. Estimates decay with a half-life in steps (``half_life``) and carry a standard error
  (the spread of the observed means per request, floored at ``var_floor``, over the decayed
  request-steps); a fast estimate (an eighth of the half-life) replaces the slow one when they differ
  by more than ``change_z`` joint standard errors (a workload change: forgotten in tens of steps, not
  half-lives), once it holds ``change_min`` request-steps; the budgets above the exploited one, known
  only from old explorations, are then forgotten (explored again).

**Output**: the budget maximising the expected tokens per second ``B * (1 + a_b) / cost(b, B)``, with

* the **chain rule**: a budget other than the chain is taken only when its expected tokens/s, with
  its acceptance lowered by ``z`` standard errors and its cost raised by ``cost_noise``, is at least the
  chain's (a budget with no acceptance data, or stale data whose weight has decayed, fails it), and it
  is left as soon as its upper bound (acceptance plus, cost minus the same margins) falls below the
  chain's expected tokens/s: what the policy exploits is never below the chain beyond noise; online
  costs carry their own standard error (EWMA variance per point, :meth:`cost_se`);
* **hysteresis**: the current budget is kept unless another eligible one is better by more than
  ``hysteresis`` (relative) and beyond noise, and not before ``min_dwell`` steps since the last switch;
  a current budget that stops being eligible is left at once;
* **exploration**: a budget above the exploited one whose last acceptance data is older than
  ``explore_period`` steps is tried for one step, the largest such one when ``counterfactual`` (its walk
  measures every smaller prefix too), else the stalest; the extra time of exploration steps is kept
  within ``explore_fraction`` of the estimated time of all steps, plus ``warmup`` tries (default: one
  per candidate above the chain) of budgets never observed or never timed (online costs: a budget's
  step time is known once it ran). Exploration steps are the only steps whose pick may be below the chain; they are
  bounded by that fraction.

Deterministic (no random numbers): the same inputs give the same picks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class _Acceptance:
    """Decayed sums of one budget's acceptance observations (weights: request-steps): a slow estimate
    (the policy's half-life) and a fast one (an eighth of it) that replaces it when the two disagree
    beyond noise (a workload change)."""
    w: float = 0.0  # request-steps
    s: float = 0.0  # accepted draft tokens
    q: float = 0.0  # sum of requests * (mean of the observation) ** 2
    fw: float = 0.0  # the fast estimate's sums
    fs: float = 0.0
    fq: float = 0.0
    t: int = 0  # the policy's step at the last decay
    seen: int | None = None  # step of the last observation
    resets: int = 0  # changes detected

    def decay(self, now: int, half_life: float) -> None:
        if now > self.t:
            f = 0.5 ** ((now - self.t) / half_life)
            g = f ** 8
            self.w, self.s, self.q = self.w * f, self.s * f, self.q * f
            self.fw, self.fs, self.fq = self.fw * g, self.fs * g, self.fq * g
            self.t = now

    @staticmethod
    def stats(w: float, s: float, q: float, var_floor: float) -> tuple[float, float]:
        mean = s / w
        return mean, max(q / w - mean * mean, var_floor) / w  # mean, its variance

    def add(self, r: float, accepted: float, change_z: float, var_floor: float, min_fast: float) -> bool:
        m = accepted / r
        self.w, self.s, self.q = self.w + r, self.s + accepted, self.q + r * m * m
        self.fw, self.fs, self.fq = self.fw + r, self.fs + accepted, self.fq + r * m * m
        if self.fw >= min_fast and self.w > self.fw * 1.5:
            m0, v0 = self.stats(self.w, self.s, self.q, var_floor)
            m1, v1 = self.stats(self.fw, self.fs, self.fq, var_floor)
            if abs(m1 - m0) > change_z * math.sqrt(v0 + v1):
                self.w, self.s, self.q = self.fw, self.fs, self.fq
                self.resets += 1
                return True
        return False


@dataclass(frozen=True)
class Decision:
    """One pick: the budget, whether it is an exploration step, why, and the expected tokens/s of each
    candidate at this B (None: no cost or no acceptance)."""
    budget: int
    explore: bool
    reason: str
    rates: dict = field(default_factory=dict)


class BudgetPolicy:
    """Per engine: picks the next step's node budget among ``budgets`` (``chain`` among them)."""

    def __init__(self, budgets, chain: int, *, max_budget: int | None = None, z: float = 2.0,
                 hysteresis: float = 0.03, min_dwell: int = 16, explore_period: int = 32,
                 explore_fraction: float = 0.02, warmup: int | None = None, half_life: float = 128.0,
                 cost_noise: float = 0.01, var_floor: float = 0.25, cost_alpha: float = 0.1,
                 counterfactual: bool = True, change_z: float = 4.0, change_min: float = 16.0):
        chain = int(chain)
        cands = {int(b) for b in budgets} | {chain}
        if max_budget is not None:
            cands = {b for b in cands if b <= int(max_budget) or b == chain}
        if any(b < 1 for b in cands):
            raise ValueError(f"budgets must be >= 1: {sorted(cands)}")
        if max_budget is not None and chain > int(max_budget):
            raise ValueError(f"the chain's budget {chain} exceeds the largest budget {max_budget}")
        if half_life <= 0 or not 0 <= explore_fraction < 1 or z < 0 or hysteresis < 0:
            raise ValueError("half_life > 0, 0 <= explore_fraction < 1, z >= 0, hysteresis >= 0")
        self.chain = chain
        self.candidates = tuple(sorted(cands))
        self.z, self.hysteresis, self.min_dwell = float(z), float(hysteresis), int(min_dwell)
        self.explore_period, self.explore_fraction = int(explore_period), float(explore_fraction)
        self.warmup = len(self.candidates) - 1 if warmup is None else int(warmup)
        self.half_life = float(half_life)
        self.cost_noise, self.var_floor, self.cost_alpha = float(cost_noise), float(var_floor), float(cost_alpha)
        self.counterfactual = bool(counterfactual)
        self.change_z, self.change_min = float(change_z), float(change_min)
        self._cost: dict[int, dict[int, float]] = {b: {} for b in self.candidates}
        self._cost_var: dict[int, dict[int, tuple[float, int]]] = {b: {} for b in self.candidates}  # online
        self._acc: dict[int, _Acceptance] = {b: _Acceptance() for b in self.candidates}
        self.step = 0  # picks made
        self.current: int | None = None  # the exploited budget
        self._since_switch = 0
        self.switches = 0  # changes of the exploited budget
        self.explorations = 0
        self._warm_used = 0
        self._time = 0.0  # estimated seconds of every step picked
        self._explore_extra = 0.0  # estimated extra seconds of exploration steps
        self.last: Decision | None = None

    # ---- costs --------------------------------------------------------------------------------
    def _check(self, budget: int) -> int:
        b = int(budget)
        if b not in self._cost:
            raise KeyError(f"budget {b} is not a candidate ({', '.join(map(str, self.candidates))})")
        return b

    def set_cost(self, budget: int, B: int, seconds: float) -> None:
        """A measured step time of ``budget`` at ``B`` requests (replaces that point)."""
        if not seconds > 0:
            raise ValueError(f"a step time must be > 0, got {seconds}")
        self._cost[self._check(budget)][int(B)] = float(seconds)
        self._cost_var[int(budget)].pop(int(B), None)

    def observe_cost(self, budget: int, B: int, seconds: float) -> None:
        """An online step time: EWMA into the point of (budget, B) (the first one sets it)."""
        if not seconds > 0:
            return
        b, B, x = self._check(budget), int(B), float(seconds)
        pts, var = self._cost[b], self._cost_var[b]
        old = pts.get(B)
        if old is None:
            pts[B], var[B] = x, (0.0, 1)
            return
        v, n = var.get(B, (0.0, 0))
        pts[B] = old + self.cost_alpha * (x - old)
        var[B] = ((1 - self.cost_alpha) * (v + self.cost_alpha * (x - old) ** 2), n + 1)

    def cost_se(self, budget: int, B: int) -> float:
        """The relative standard error of :meth:`cost` at ``B``, from the online measurements of the
        nearest measured batch size (EWMA variance; fewer than 4 measurements: 5 %; points set by
        :meth:`set_cost`: 0)."""
        pts = self._cost.get(int(budget))
        if not pts:
            return 0.0
        x = min(pts, key=lambda k: (abs(k - B), k))
        if x not in self._cost_var[int(budget)]:
            return 0.0
        v, n = self._cost_var[int(budget)][x]
        if n < 4:
            return 0.05
        a = self.cost_alpha
        return math.sqrt(v * a / (2 - a)) / pts[x]

    def cost(self, budget: int, B: int) -> float | None:
        """The step time of ``budget`` at ``B`` (interpolated in B), or None (never measured)."""
        pts = self._cost.get(int(budget))
        if not pts:
            return None
        if B in pts:
            return pts[B]
        xs = sorted(pts)
        if len(xs) == 1 or B <= xs[0]:
            return pts[xs[0]] if B <= xs[0] else pts[xs[-1]]
        if B >= xs[-1]:
            x0, x1 = xs[-2], xs[-1]
            slope = max(0.0, (pts[x1] - pts[x0]) / (x1 - x0))
            return pts[x1] + slope * (B - x1)
        for x0, x1 in zip(xs, xs[1:]):
            if x0 <= B <= x1:
                return pts[x0] + (pts[x1] - pts[x0]) * (B - x0) / (x1 - x0)
        return None  # unreachable

    # ---- acceptance ---------------------------------------------------------------------------
    def observe(self, budget: int, requests: int, accepted: float) -> None:
        """``accepted`` draft tokens over ``requests`` request-steps verified (or, for a prefix budget
        or the spine, counted) at ``budget``."""
        r = float(requests)
        if r <= 0:
            return
        a = self._acc[self._check(budget)]
        a.decay(self.step, self.half_life)
        changed = a.add(r, float(accepted), self.change_z, self.var_floor, self.change_min)
        a.seen = self.step
        if changed:  # the budgets above the exploited one, known only from old explorations: try again
            top = max(int(budget), self.current or 0)
            for c in self.candidates:
                if c > top:
                    self._acc[c] = _Acceptance(t=self.step)

    def acceptance(self, budget: int) -> tuple[float, float, float] | None:
        """(mean accepted draft tokens per request-step, its standard error, decayed weight), or None."""
        a = self._acc[self._check(budget)]
        a.decay(self.step, self.half_life)
        if a.w <= 1e-9 or a.seen is None:
            return None
        mean, var = a.stats(a.w, a.s, a.q, self.var_floor)
        return mean, math.sqrt(var), a.w

    def rate(self, budget: int, B: int, *, lower: bool = False, upper: bool = False) -> float | None:
        """Expected tokens per second at ``B``, or None. ``lower`` / ``upper``: the bounds beyond noise
        (acceptance -/+ z standard errors, cost +/- cost_noise and z relative standard errors)."""
        c = self.cost(budget, B)
        acc = self.acceptance(budget)
        if c is None or acc is None or B <= 0:
            return None
        mean, se, _ = acc
        if lower:
            return B * (1.0 + max(0.0, mean - self.z * se)) / (c * (1.0 + self.cost_noise + self.z * self.cost_se(budget, B)))
        if upper:
            slack = max(1e-3, 1.0 - self.cost_noise - self.z * self.cost_se(budget, B))
            return B * (1.0 + mean + self.z * se) / (c * slack)
        return B * (1.0 + mean) / c

    # ---- the decision -------------------------------------------------------------------------
    def _eligible(self, B: int, chain_rate: float | None) -> dict[int, float]:
        """Candidates the chain rule admits at B -> expected tokens/s: the chain (when its cost is
        known), a budget whose lower bound is at least the chain's rate, and the current budget while
        its upper bound is (the exit side of the band: left once it is below the chain beyond noise)."""
        out = {}
        if self.cost(self.chain, B) is not None:
            out[self.chain] = chain_rate if chain_rate is not None else 0.0
        if chain_rate is None:
            return out  # nothing is known to beat a chain whose acceptance is unknown
        for b in self.candidates:
            if b == self.chain:
                continue
            mean = self.rate(b, B)
            if mean is None:
                continue
            if self.rate(b, B, lower=True) >= chain_rate or (b == self.current and self.rate(b, B, upper=True) >= chain_rate):
                out[b] = mean
        return out

    def _stale(self, b: int) -> bool:
        seen = self._acc[b].seen
        return seen is None or self.step - seen >= self.explore_period

    def decide(self, B: int) -> Decision:
        """The budget of the next step for ``B`` decode requests (advances the policy's step)."""
        B = int(B)
        chain_rate = self.rate(self.chain, B)
        rates = {b: self.rate(b, B) for b in self.candidates}
        elig = self._eligible(B, chain_rate)
        if chain_rate is None or not elig or B <= 0:  # the chain's rate unknown: the chain (measured first)
            exploit, why = (self.current if self.current in elig else self.chain), "no data"
        else:
            best = max(elig, key=lambda b: (elig[b], -b))
            cur = self.current
            if cur is None or cur not in elig:
                exploit, why = best, ("first pick" if cur is None else f"{cur} no longer beats the chain")
            elif best != cur and self._since_switch >= self.min_dwell and self._better(best, cur, B, elig):
                exploit, why = best, f"{best} beats {cur} by more than {self.hysteresis:.0%}"
            else:
                exploit, why = cur, "kept"
        if exploit != self.current:
            if self.current is not None:
                self.switches += 1
            self.current, self._since_switch = exploit, 0
        if why == "no data":  # a pick made blind holds no dwell: the first informed pick may leave it
            self._since_switch = self.min_dwell
        pick, explore = exploit, False
        target = self._exploration(B, exploit)
        if target is not None:
            pick, explore, why = target, True, f"exploring {target} (data {self._age(target)})"
        c = self.cost(pick, B)
        if c is not None:
            self._time += c
            if explore:
                self._explore_extra += max(0.0, c - (self.cost(exploit, B) or 0.0))
        if explore:
            self.explorations += 1
        self.step += 1
        self._since_switch += 1
        self.last = Decision(pick, explore, why, rates)
        return self.last

    def pick(self, B: int) -> int:
        """:meth:`decide`'s budget."""
        return self.decide(B).budget

    def _better(self, new: int, cur: int, B: int, elig: dict[int, float]) -> bool:
        """Switch only for a gain beyond the hysteresis margin and beyond noise."""
        if elig[new] < elig[cur] * (1.0 + self.hysteresis):
            return False
        lo = self.rate(new, B, lower=True)
        return lo is not None and lo > elig[cur]

    def _age(self, b: int) -> str:
        seen = self._acc[b].seen
        return "none" if seen is None else f"{self.step - seen} steps old"

    def _exploration(self, B: int, exploit: int) -> int | None:
        """A budget above ``exploit`` to try this step, within the exploration allowance, or None. A
        budget never observed or never timed (no cost at any B) is tried once, as a warm-up try."""
        stale = [b for b in self.candidates if b > exploit and self._stale(b)]
        if not stale or B <= 0:
            return None
        fresh = [b for b in stale if self._acc[b].seen is None or not self._cost[b]]
        if fresh and self._warm_used < self.warmup:
            self._warm_used += 1
            return max(fresh)
        costed = [b for b in stale if self.cost(b, B) is not None]
        if not costed:
            return None
        if self.counterfactual:
            target = max(costed)
        else:
            target = min(costed, key=lambda b: (-1 if self._acc[b].seen is None else self._acc[b].seen, -b))
        extra = max(0.0, self.cost(target, B) - (self.cost(exploit, B) or 0.0))
        if self._explore_extra + extra <= self.explore_fraction * (self._time + self.cost(target, B)):
            return target
        return None

    def summary(self) -> dict:
        """Counters and estimates (for a log line or a test)."""
        acc = {}
        for b in self.candidates:
            a = self.acceptance(b)
            acc[b] = None if a is None else {"accepted": round(a[0], 4), "se": round(a[1], 4), "weight": round(a[2], 1)}
        return {"step": self.step, "current": self.current, "switches": self.switches,
                "explorations": self.explorations, "changes": sum(a.resets for a in self._acc.values()),
                "explore_share": round(self._explore_extra / self._time, 4) if self._time else 0.0,
                "acceptance": acc}
