"""Random batched draft trees in the kernel's flat layout (docs/kernel.md, Layout)."""

from __future__ import annotations

import torch

SHAPES = ("random", "chain", "star", "deep", "ddtree")


def make_tree(n, shape, vocab, g, distinct=True, inert_p=0.0):
    """Return (tokens, parents) lists for one request with n nodes (local 1..n)."""
    par = []
    for j in range(1, n + 1):
        if shape == "chain":
            p = j - 1
        elif shape == "star":
            p = 0
        elif shape == "deep":
            p = max(0, j - 1 - int(torch.randint(0, 2, (1,), generator=g)))
        elif shape == "ddtree":  # mostly a spine with a few siblings near the top
            p = j - 1 if float(torch.rand(1, generator=g)) < 0.6 else int(torch.randint(0, j, (1,), generator=g)) // 2
        else:
            p = int(torch.randint(0, j, (1,), generator=g))
        par.append(p)
    tok, used = [], {}
    for j, p in enumerate(par, start=1):
        s = used.setdefault(p, set())
        t = int(torch.randint(0, vocab, (1,), generator=g))
        if distinct:
            tries = 0
            while t in s and tries < 4 * vocab:
                t = int(torch.randint(0, vocab, (1,), generator=g))
                tries += 1
        s.add(t)
        if inert_p and float(torch.rand(1, generator=g)) < inert_p:
            t = -1
        tok.append(t)
    return tok, par


def make_batch(B, max_n, vocab, g, shapes=SHAPES, distinct=True, inert_p=0.0, zero_p=0.1):
    toks, pars, ns, trees = [], [], [], []
    for _ in range(B):
        n = 0 if float(torch.rand(1, generator=g)) < zero_p else int(torch.randint(0, max_n + 1, (1,), generator=g))
        shape = shapes[int(torch.randint(0, len(shapes), (1,), generator=g))]
        t, p = make_tree(n, shape, vocab, g, distinct=distinct, inert_p=inert_p)
        toks += t
        pars += p
        ns.append(n)
        trees.append((t, p))
    cu = torch.cumsum(torch.tensor(ns, dtype=torch.int64), 0).to(torch.int32)
    return (torch.tensor(toks, dtype=torch.int32), torch.tensor(pars, dtype=torch.int32), cu, trees)


def children_tokens(trees):
    """Per target row (flat), the list of child tokens."""
    out = []
    for t, p in trees:
        kids = [[] for _ in range(len(t) + 1)]
        for j in range(1, len(t) + 1):
            kids[p[j - 1]].append(t[j - 1])
        out += kids
    return out


def make_argmax(trees, vocab, g, follow_p=0.8):
    am = []
    for row_kids in children_tokens(trees):
        valid = [t for t in row_kids if t >= 0]
        if valid and float(torch.rand(1, generator=g)) < follow_p:
            am.append(valid[int(torch.randint(0, len(valid), (1,), generator=g))])
        else:
            am.append(int(torch.randint(0, vocab, (1,), generator=g)))
    return torch.tensor(am, dtype=torch.int32)


def make_probs(trees, vocab, g, boost=3.0, topk_p=0.2, cover_p=0.05):
    """Target probs with mass pushed onto child tokens; some rows top-k truncated,
    some rows with all mass on the children (zero-residual guard)."""
    rows = []
    for row_kids in children_tokens(trees):
        logits = torch.randn(vocab, generator=g) * 1.5
        kids = [t for t in row_kids if 0 <= t < vocab]
        for t in kids:
            logits[t] += boost * float(torch.rand(1, generator=g))
        p = torch.softmax(logits, 0)
        u = float(torch.rand(1, generator=g))
        if kids and u < cover_p:
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[kids] = True
            p = torch.where(mask, p, torch.zeros_like(p))
        elif u < cover_p + topk_p:
            k = max(1, vocab // 4)
            thr = torch.topk(p, k).values[-1]
            p = torch.where(p >= thr, p, torch.zeros_like(p))
        p = p / p.sum()
        rows.append(p.to(torch.float32))
    return torch.stack(rows) if rows else torch.zeros(0, vocab)
