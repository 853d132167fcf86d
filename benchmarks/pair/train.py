"""Train a small Qwen3 target and a DFlash drafter for it (issue 36), seeded, on the Python standard
library of the interpreter that runs this script, and write both as checkpoints vLLM loads as they
are (``DIR/target``: Qwen3ForCausalLM + tokenizer; ``DIR/dflash``: DFlashDraftModel for
``method: dflash``), the held-out prompts (``DIR/heldout.json``) and a report
(``DIR/train_report.json``: loss curves, the target's held-out perplexity and next-token entropy,
the drafter's held-out per-slot top-1/2/3 accuracy, an offline chain/tree acceptance estimate).

Corpus: ``sysconfig.get_paths()["stdlib"]/**/*.py`` minus test packages (``test``, ``tests``,
``idle_test``) and any ``site-packages``/``dist-packages``; split by file: a file is held out when
the first byte of sha256(its path relative to the stdlib) is below ``--heldout-frac`` * 256.

Tokenizer: byte-level BPE (``tokenizers``), trained on the train files only; specials
``<|endoftext|>`` (0, separates files; the config's eos) and ``<|mask|>`` (1, DFlash's
``mask_token_id``; never in the data).

Target: trained as a causal LM on windows of the train files (AdamW, cosine), evaluated on the
held-out files every ``--eval-every`` steps; the state with the best held-out loss is kept (the
corpus is small: early stopping instead of overtraining it).

Drafter (the DFlash objective): the target frozen; for each training window, ``--anchors`` random
anchor positions a; block = [x_a, MASK x 15] at positions a..a+15, attending to the target's
features (layers ``target_layer_ids``) of positions < a and to its own block in both directions;
slot k >= 1 predicts the token at a+k with weight exp(-(k-1)/gamma), gamma 7. Labels
(``--labels``): ``soft`` (default: KL to the target's distribution at a+k-1, i.e. distillation of
what verification accepts), ``argmax`` (the target's greedy token there) or ``data`` (the corpus
token x_{a+k}, SpecForge's cross-entropy).

usage: python train.py --out DIR [--device cuda|cpu] [--minutes M] [--seed S] [--tiny]
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import heapq
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import Drafter, Shape, Target, dflash_loss, position_weights  # noqa: E402

EOS, MASK = "<|endoftext|>", "<|mask|>"
BLOCK = 16
T0 = time.time()  # main() restarts it: the wall budget counts from the run, not from the import


def log(*a) -> None:
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


# ---- corpus ------------------------------------------------------------------------------------
def stdlib_files() -> tuple[str, list[str]]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        rel = os.path.relpath(f, root)
        parts = rel.split(os.sep)
        if any(p in ("site-packages", "dist-packages", "test", "tests", "idle_test") for p in parts[:-1]):
            continue
        out.append(rel)
    return root, sorted(out)


def is_heldout(rel: str, frac: float) -> bool:
    return hashlib.sha256(rel.encode()).digest()[0] < frac * 256


def read(root: str, rel: str) -> str:
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
        return fh.read()


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS, MASK], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(MASK) == 1
    return tok


def save_tokenizer(tok, d: str) -> None:
    tok.save(os.path.join(d, "tokenizer.json"))
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS, "bos_token": None,
               "unk_token": None, "model_max_length": 2048, "clean_up_tokenization_spaces": False,
               "add_bos_token": False, "add_eos_token": False},
              open(os.path.join(d, "tokenizer_config.json"), "w"), indent=1)
    json.dump({"eos_token": EOS, "pad_token": EOS}, open(os.path.join(d, "special_tokens_map.json"), "w"), indent=1)


def encode(tok, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(texts)]


def windows(stream: torch.Tensor, T: int) -> torch.Tensor:
    """Non-overlapping windows [n, T] of a 1-D token stream."""
    n = (stream.numel()) // T
    return stream[: n * T].view(n, T)


# ---- target ------------------------------------------------------------------------------------
def lr_at(step: int, total: int, peak: float, warm: int) -> float:
    if step < warm:
        return peak * (step + 1) / warm
    p = min(1.0, (step - warm) / max(1, total - warm))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def autocast(dev):
    return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)


@torch.no_grad()
def eval_target(model, held: torch.Tensor, dev, bs: int) -> dict:
    model.eval()
    nll = ent = top1 = n = 0.0
    for i in range(0, held.shape[0], bs):
        x = held[i:i + bs].to(dev)
        with autocast(dev):
            logits, _ = model(x[:, :-1])
        lp = logits.float().log_softmax(-1)
        y = x[:, 1:]
        nll += -lp.gather(-1, y[..., None]).sum().item()
        ent += -(lp.exp() * lp).sum(-1).sum().item()
        top1 += (lp.argmax(-1) == y).sum().item()
        n += y.numel()
    model.train()
    return {"loss": nll / n, "ppl": math.exp(nll / n), "entropy_nats": ent / n, "top1": top1 / n, "tokens": int(n)}


def train_target(a, shape, train_w, held_w, dev, deadline) -> tuple[Target, dict]:
    g = torch.Generator().manual_seed(a.seed)
    model = Target(shape, dropout=a.dropout).to(dev)
    nparams = sum(p.numel() for p in model.parameters())
    steps_per_epoch = max(1, train_w.shape[0] // a.batch)
    total = int(a.epochs * steps_per_epoch)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": other, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), **({"fused": True} if dev.type == "cuda" else {}))
    log(f"target: {nparams / 1e6:.2f} M params, {train_w.shape[0]} windows of {train_w.shape[1]}, "
        f"{steps_per_epoch} steps/epoch, {total} steps planned")
    curve, evals, best, best_state = [], [], None, None
    order = torch.randperm(train_w.shape[0], generator=g)
    pos, step, stopped = 0, 0, "steps"
    t_start = time.time()
    while step < total:
        if time.time() > deadline:
            stopped = "time"
            break
        if pos + a.batch > order.numel():
            order, pos = torch.randperm(train_w.shape[0], generator=g), 0
        x = train_w[order[pos:pos + a.batch]].to(dev, non_blocking=True)
        pos += a.batch
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, total, a.lr, a.warmup)
        with autocast(dev):
            logits, _ = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, shape.vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % a.log_every == 0 or step == 1:
            curve.append([step, round(loss.item(), 4)])
        if step % a.eval_every == 0 or step == total:
            ev = eval_target(model, held_w[:a.eval_windows], dev, a.batch)
            ev["step"] = step
            evals.append(ev)
            log(f"target step {step}/{total} train {loss.item():.3f} held-out {ev['loss']:.3f} "
                f"(ppl {ev['ppl']:.2f}, entropy {ev['entropy_nats']:.3f} nats)")
            if best is None or ev["loss"] < best["loss"]:
                best = ev
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if best is None or (evals and evals[-1]["step"] != step):
        ev = eval_target(model, held_w[:a.eval_windows], dev, a.batch)
        ev["step"] = step
        evals.append(ev)
        if best is None or ev["loss"] < best["loss"]:
            best, best_state = ev, {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    best = {**eval_target(model, held_w, dev, a.batch), "step": best["step"]}  # the kept state on all of held-out
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    rep = {"params": nparams, "steps": step, "planned_steps": total, "stopped_by": stopped,
           "epochs": round(step / steps_per_epoch, 2), "seconds": round(time.time() - t_start, 1),
           "train_curve": curve, "heldout_curve": evals, "best": best}
    log(f"target kept step {best['step']}: held-out ppl {best['ppl']:.2f}, entropy {best['entropy_nats']:.3f} nats, "
        f"top-1 {best['top1']:.3f}")
    return model, rep


# ---- drafter -----------------------------------------------------------------------------------
def sample_anchors(b: int, T: int, m: int, g: torch.Generator) -> torch.Tensor:
    """[b, m] anchor positions in 1 .. T-BLOCK (each block's labels a+1 .. a+15 inside the window), sorted."""
    hi = T - BLOCK  # a + BLOCK - 1 <= T - 1
    m = min(m, hi)
    r = torch.rand(b, hi, generator=g).argsort(-1)[:, :m] + 1
    return r.sort(-1).values


def drafter_batch(target, x, anchors, layer_ids, label_mode):
    """Features, anchor tokens, labels [b, m, B] and soft targets for one batch of windows x [b, T]."""
    dev = x.device
    with autocast(dev), torch.no_grad():
        logits, aux = target(x, aux_layers=tuple(layer_ids))
    feats = torch.cat(aux, -1)
    B = BLOCK
    idx = (anchors[:, :, None] + torch.arange(B, device=dev)).clamp(max=x.shape[1] - 1)  # a .. a+15
    tok_at = torch.gather(x, 1, idx.view(x.shape[0], -1)).view_as(idx)  # x_{a+k}
    prev = (idx - 1).clamp(min=0)  # the target's distribution of x_{a+k} sits at a+k-1
    tl = torch.gather(logits, 1, prev.view(x.shape[0], -1, 1).expand(-1, -1, logits.shape[-1]))
    tl = tl.view(*idx.shape, -1).float()
    soft = None
    if label_mode == "data":
        labels = tok_at
    elif label_mode == "argmax":
        labels = tl.argmax(-1)
    else:
        labels = tl.argmax(-1)
        soft = tl.log_softmax(-1)
    return feats, tok_at[:, :, 0], labels, soft, tl.argmax(-1), tok_at


@torch.no_grad()
def eval_drafter(drafter, target, held_w, layer_ids, dev, a, seed=1234) -> dict:
    """Held-out per-slot (k = 1..15) top-1/2/3 accuracy against the target's greedy token at a+k
    (given the true prefix) and against the data token."""
    drafter.eval()
    g = torch.Generator().manual_seed(seed)
    B = BLOCK
    hits = {k: torch.zeros(B) for k in ("t1", "t2", "t3", "d1")}
    n = 0
    for i in range(0, min(held_w.shape[0], a.eval_windows), a.dbatch):
        x = held_w[i:i + a.dbatch].to(dev)
        anchors = sample_anchors(x.shape[0], x.shape[1], a.anchors, g).to(dev)
        feats, atok, labels, _, targ, tok_at = drafter_batch(target, x, anchors, layer_ids, "argmax")
        with autocast(dev):
            h = drafter(feats, atok, anchors, target.model.embed_tokens)
            logits = target.lm_head(h)
        top = logits.float().topk(3, -1).indices  # [b, m, B, 3]
        for k, kk in (("t1", 1), ("t2", 2), ("t3", 3)):
            hits[k] += (top[..., :kk] == targ[..., None]).any(-1).float().sum((0, 1)).cpu()
        hits["d1"] += (top[..., 0] == tok_at).float().sum((0, 1)).cpu()
        n += anchors.numel()
    drafter.train()
    r = lambda v: [round(float(z) / max(1, n), 4) for z in v[1:]]  # noqa: E731
    return {"top1": r(hits["t1"]), "top2": r(hits["t2"]), "top3": r(hits["t3"]), "top1_vs_data": r(hits["d1"]),
            "blocks": n}


def train_drafter(a, target, dshape, layer_ids, mask_id, train_w, held_w, dev, deadline, regen=None):
    g = torch.Generator().manual_seed(a.seed + 1)
    torch.manual_seed(a.seed + 1)
    drafter = Drafter(dshape, len(layer_ids), BLOCK, mask_id).to(dev)
    nparams = sum(p.numel() for p in drafter.parameters())
    opt = torch.optim.AdamW(drafter.parameters(), lr=a.dlr, betas=(0.9, 0.95), weight_decay=0.0,
                            **({"fused": True} if dev.type == "cuda" else {}))
    w = position_weights(BLOCK, a.gamma, dev)
    total = a.dsteps
    log(f"drafter: {nparams / 1e6:.2f} M params (+ the target's embedding and lm_head, shared), layers "
        f"{dshape.layers}, target_layer_ids {layer_ids}, labels {a.labels}, {total} steps planned")
    curve, evals, step, stopped = [], [], 0, "steps"
    t_start = time.time()
    while step < total:
        if time.time() > deadline:
            stopped = "time"
            break
        use_regen = regen is not None and torch.rand((), generator=g).item() < a.regen_frac
        pool = regen if use_regen else train_w
        rows = torch.randint(0, pool.shape[0], (a.dbatch,), generator=g)
        x = pool[rows].to(dev, non_blocking=True)
        anchors = sample_anchors(x.shape[0], x.shape[1], a.anchors, g).to(dev)
        feats, atok, labels, soft, _, _ = drafter_batch(target, x, anchors, layer_ids, a.labels)
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, total, a.dlr, max(1, total // 25))
        with autocast(dev):
            h = drafter(feats, atok, anchors, target.model.embed_tokens)
            logits = target.lm_head(h)
        loss = dflash_loss(logits, labels, w, soft)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        if step % a.log_every == 0 or step == 1:
            curve.append([step, round(loss.item(), 4)])
        if step % a.deval_every == 0:
            ev = eval_drafter(drafter, target, held_w, layer_ids, dev, a)
            ev["step"] = step
            evals.append(ev)
            log(f"drafter step {step}/{total} loss {loss.item():.3f} held-out top-1 k=1..4 {ev['top1'][:4]}")
    ev = eval_drafter(drafter, target, held_w, layer_ids, dev, a)
    ev["step"] = step
    evals.append(ev)
    drafter.eval()
    rep = {"params": nparams, "steps": step, "planned_steps": total, "stopped_by": stopped,
           "seconds": round(time.time() - t_start, 1), "train_curve": curve, "heldout_curve": evals, "final": ev}
    log(f"drafter final held-out top-1 {ev['top1']}\n   top-2 {ev['top2']}\n   top-3 {ev['top3']}")
    return drafter, rep


# ---- offline acceptance (greedy): chain and best-first tree on the target's own continuations ----
@torch.no_grad()
def greedy_generate(target, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """[b, P] -> [b, P + n] (KV cache)."""
    return target.generate(prompts, n, autocast=autocast(prompts.device))


@torch.no_grad()
def regenerate(target, train_w, a, dev) -> torch.Tensor | None:
    """Windows whose first ``--regen-prefix`` tokens are train text and the rest the target's own
    continuation (SpecForge trains its drafters on target-regenerated responses): half greedy, half
    sampled at temperature 1 (``--regen-temps``), ``--regen-windows`` in all."""
    if not a.regen_frac or not a.regen_windows:
        return None
    g = torch.Generator(device=dev).manual_seed(a.seed + 2)
    rows = torch.randperm(train_w.shape[0], generator=torch.Generator().manual_seed(a.seed + 2))[:a.regen_windows]
    temps = [float(t) for t in a.regen_temps.split(",")]
    out = []
    chunk = 256 if dev.type == "cuda" else 16
    for i in range(0, rows.numel(), chunk):
        x = train_w[rows[i:i + chunk], :a.regen_prefix].to(dev)
        temp = temps[(i // chunk) % len(temps)]
        out.append(target.generate(x, a.seq - a.regen_prefix, temperature=temp, generator=g,
                                   autocast=autocast(dev)).cpu())
    return torch.cat(out)


def tree_accept(logq, truth: list[int], budget: int, top=None) -> int:
    """Accepted depth of a best-first tree of ``budget`` nodes over per-depth log-probabilities
    logq [D, V] (DDTree: a path's score is the sum of its depths' log q), given the target's
    greedy tokens ``truth`` [D]: the longest prefix of truth that is a node of the tree.
    ``top``: (values, indices) [D, K] of logq's top K, instead of logq (K = 8 by default)."""
    if top is None:
        top = logq.topk(min(8, logq.shape[1]), -1)
    top_v, top_i = top[0].tolist(), top[1].tolist()
    D, K = len(top_v), len(top_v[0])
    # node: tuple of ranks; heap of (-score, ranks)
    heap = [(-top_v[0][0], (0,))]
    inside = set()
    while heap and len(inside) < budget:
        negs, ranks = heapq.heappop(heap)
        inside.add(tuple(top_i[d][r] for d, r in enumerate(ranks)))
        d = len(ranks)
        if ranks[-1] + 1 < K:  # next sibling
            heapq.heappush(heap, (negs + top_v[d - 1][ranks[-1]] - top_v[d - 1][ranks[-1] + 1], ranks[:-1] + (ranks[-1] + 1,)))
        if d < D:  # first child
            heapq.heappush(heap, (negs - top_v[d][0], ranks + (0,)))
    k = 0
    while k < D and tuple(truth[:k + 1]) in inside:
        k += 1
    return k


@torch.no_grad()
def offline_acceptance(target, drafter, prompts, layer_ids, dev, gen: int, budgets=(15, 31, 63)) -> dict:
    """Greedy: tokens per target step (incl. the bonus) of the DFlash chain (K = 15) and of a best-first
    tree of N nodes, walking each prompt's greedy continuation as vLLM would (the anchor is the
    token the target just emitted; the drafter sees the features of everything before it)."""
    seqs = greedy_generate(target, prompts.to(dev), gen)
    P = prompts.shape[1]
    b, L = seqs.shape
    # every anchor position in the generated part at once: a = P .. L-2 (labels past the end are cut)
    anchors = torch.arange(P, L - 1, device=dev)[None].expand(b, -1).contiguous()
    parts = []
    for c in range(0, b, 4):  # a few prompts at a time: [4, m, 16, V] log-probabilities
        with autocast(dev):
            _, aux = target(seqs[c:c + 4], aux_layers=tuple(layer_ids))
            h = drafter(torch.cat(aux, -1), seqs[c:c + 4].gather(1, anchors[c:c + 4]), anchors[c:c + 4],
                        target.model.embed_tokens)
            t = target.lm_head(h).float().log_softmax(-1).topk(8, -1)
            parts.append((t.values.cpu(), t.indices.cpu()))
    top_v = torch.cat([v for v, _ in parts])  # [b, m, B, 8]: the drafter's top 8 per slot
    top_i = torch.cat([i for _, i in parts])
    res = {"chain": [], **{f"tree{n}": [] for n in budgets}}
    for i in range(b):
        s = seqs[i].tolist()
        for key in res:
            p, steps, toks = P, 0, 0
            while p < L - 1:
                j = p - P
                depth = min(BLOCK - 1, L - 1 - p)
                truth = s[p + 1:p + 1 + depth]
                tv, ti = top_v[i, j, 1:1 + depth], top_i[i, j, 1:1 + depth]
                if key == "chain":
                    guess = ti[:, 0].tolist()
                    k = 0
                    while k < depth and guess[k] == truth[k]:
                        k += 1
                else:
                    k = tree_accept(None, truth, int(key[4:]), top=(tv, ti))
                steps += 1
                toks += k + 1
                p += k + 1
            res[key].append(toks / steps)
    return {key: round(sum(v) / len(v), 4) for key, v in res.items()} | {"prompts": b, "generated": gen}


# ---- export ------------------------------------------------------------------------------------
def save_pair(out, target, drafter, shape, dshape, layer_ids, mask_id, tok, dtype) -> None:
    from safetensors.torch import save_file

    td, dd = os.path.join(out, "target"), os.path.join(out, "dflash")
    os.makedirs(td, exist_ok=True)
    os.makedirs(dd, exist_ok=True)
    dt = getattr(torch, dtype)
    cfg = dict(shape.hf_config(dtype), architectures=["Qwen3ForCausalLM"], bos_token_id=None, eos_token_id=0,
               pad_token_id=0)
    json.dump(cfg, open(os.path.join(td, "config.json"), "w"), indent=1)
    json.dump({"eos_token_id": 0, "pad_token_id": 0, "do_sample": False},
              open(os.path.join(td, "generation_config.json"), "w"), indent=1)
    save_file({k: v.detach().to(dt).contiguous().cpu() for k, v in target.state_dict().items()},
              os.path.join(td, "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(tok, td)
    dcfg = dict(dshape.hf_config(dtype), architectures=["DFlashDraftModel"], bos_token_id=None, eos_token_id=0,
                block_size=BLOCK, dflash_config={"mask_token_id": mask_id, "target_layer_ids": list(layer_ids)})
    json.dump(dcfg, open(os.path.join(dd, "config.json"), "w"), indent=1)
    sd = {k: v.detach().to(dt).contiguous().cpu() for k, v in drafter.state_dict().items()}
    sd["lm_head.weight"] = target.lm_head.weight.detach().to(dt).contiguous().cpu()  # identical: vLLM shares it
    save_file(sd, os.path.join(dd, "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(tok, dd)


def layer_ids_for(L: int, n: int) -> list[int]:
    """n target layers spread over 1 .. L-3 (SpecForge's picker; never the last layer)."""
    hi = max(1, L - 3)
    if n == 1:
        return [1]
    return sorted({round(1 + i * (hi - 1) / (n - 1)) for i in range(n)})


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=7.0, help="wall budget of the whole script (caps both loops)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="CPU test size: seconds")
    p.add_argument("--heldout-frac", type=float, default=0.12)
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq", type=int, help="training window (tokens)")
    p.add_argument("--epochs", type=float, help="target epochs (the best held-out state is kept)")
    p.add_argument("--batch", type=int)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--dropout", type=float)
    p.add_argument("--warmup", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--draft-layers", type=int)
    p.add_argument("--n-features", type=int, default=3, help="how many target layers the drafter reads")
    p.add_argument("--dsteps", type=int, help="drafter steps")
    p.add_argument("--dbatch", type=int)
    p.add_argument("--dlr", type=float, default=6e-4)
    p.add_argument("--anchors", type=int, help="anchors per window")
    p.add_argument("--gamma", type=float, default=7.0)
    p.add_argument("--labels", choices=("soft", "argmax", "data"), default="soft")
    p.add_argument("--deval-every", type=int)
    p.add_argument("--regen-frac", type=float, default=0.5,
                   help="share of drafter batches from target-regenerated windows (0: train text only)")
    p.add_argument("--regen-windows", type=int, help="regenerated windows (prefix of train text + the target's)")
    p.add_argument("--regen-prefix", type=int, help="train-text tokens before the target's continuation")
    p.add_argument("--regen-temps", default="0,1", help="generation temperatures, alternating by chunk")
    p.add_argument("--eval-windows", type=int)
    p.add_argument("--prompts", type=int, default=64, help="held-out prompts written for measure.py")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--offline-prompts", type=int, help="prompts of the offline acceptance estimate (0: skip)")
    p.add_argument("--offline-gen", type=int, default=128)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--dtype", help="checkpoint dtype (default bfloat16 on cuda, float32 on cpu)")
    a = p.parse_args(argv)
    global T0
    T0 = time.time()
    if a.device == "cpu" and a.tiny:
        torch.set_num_threads(1)  # the shared 2-core machine: one thread each
    tiny = a.tiny
    defaults = dict(vocab=512 if tiny else 8192, seq=64 if tiny else 512, epochs=0.5 if tiny else 8,
                    batch=16 if tiny else 64, dropout=0.0 if tiny else 0.1, warmup=10 if tiny else 100,
                    eval_every=30 if tiny else 100, draft_layers=1 if tiny else 2, dsteps=40 if tiny else 3000,
                    dbatch=8 if tiny else 32, anchors=8 if tiny else 32, deval_every=1000 if tiny else 500,
                    eval_windows=16 if tiny else 256, offline_prompts=4 if tiny else 64,
                    regen_windows=32 if tiny else 4096)
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.regen_prefix is None:
        a.regen_prefix = a.seq // 4
    if tiny:
        a.prompt_len = min(a.prompt_len, 48)
        a.offline_gen = min(a.offline_gen, 16)
        a.prompts = min(a.prompts, 8)
    dev = torch.device(a.device)
    a.dtype = a.dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    deadline_all = T0 + a.minutes * 60
    os.makedirs(a.out, exist_ok=True)

    root, files = stdlib_files()
    held_files = [f for f in files if is_heldout(f, a.heldout_frac)]
    train_files = [f for f in files if not is_heldout(f, a.heldout_frac)]
    if tiny:  # a slice: seconds on two cores
        train_files, held_files = train_files[:12], held_files[:6]
    train_txt = [read(root, f) for f in train_files]
    held_txt = [read(root, f) for f in held_files]
    log(f"corpus {root}: {len(train_files)} train files ({sum(map(len, train_txt)) / 1e6:.2f} MB), "
        f"{len(held_files)} held-out ({sum(map(len, held_txt)) / 1e6:.2f} MB)")
    tok = train_tokenizer(train_txt, a.vocab)
    vocab = -(-tok.get_vocab_size() // 64) * 64
    train_ids, held_ids = encode(tok, train_txt), encode(tok, held_txt)
    stream = lambda ids: torch.tensor([t for d in ids for t in d + [0]], dtype=torch.long)  # noqa: E731
    train_s, held_s = stream(train_ids), stream(held_ids)
    log(f"tokenizer: {tok.get_vocab_size()} tokens (config vocab {vocab}); train {train_s.numel()} tokens, "
        f"held-out {held_s.numel()} tokens")
    train_w, held_w = windows(train_s, a.seq + 1), windows(held_s, a.seq + 1)

    if tiny:
        shape = Shape(vocab=vocab, hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, inter=128, max_pos=1024)
    else:
        shape = Shape(vocab=vocab)
    layer_ids = [1, 2] if tiny else layer_ids_for(shape.layers, a.n_features)
    dshape = Shape(**{**shape.asdict(), "layers": a.draft_layers})

    # budget: the target gets up to 45 % of the wall, the drafter what is left minus evaluation/export
    target, trep = train_target(a, shape, train_w, held_w, dev, T0 + a.minutes * 60 * 0.45)
    t_regen = time.time()
    regen = regenerate(target, train_w[:, :a.seq], a, dev)
    t_regen = round(time.time() - t_regen, 1)
    if regen is not None:
        log(f"regenerated {regen.shape[0]} windows ({a.regen_prefix} train tokens + {a.seq - a.regen_prefix} of the "
            f"target's, temperatures {a.regen_temps}) in {t_regen} s")
    drafter, drep = train_drafter(a, target, dshape, layer_ids, 1, train_w[:, :a.seq], held_w[:, :a.seq], dev,
                                  deadline_all - (20 if tiny else 45), regen)
    drep["regen"] = {"windows": 0 if regen is None else regen.shape[0], "prefix": a.regen_prefix,
                     "temps": a.regen_temps, "frac": a.regen_frac, "seconds": t_regen}

    # held-out prompts for measure.py: the first prompt_len tokens of held-out files (files long enough),
    # then further windows of the longest files
    prompts = [d[:a.prompt_len] for d in held_ids if len(d) >= a.prompt_len]
    off = a.prompt_len
    while len(prompts) < a.prompts and off < max(map(len, held_ids)):
        prompts += [d[off:off + a.prompt_len] for d in held_ids if len(d) >= off + a.prompt_len]
        off += 4 * a.prompt_len
    prompts = prompts[:a.prompts]
    json.dump({"prompts": prompts, "prompt_len": a.prompt_len, "heldout_files": held_files,
               "corpus": root, "python": sys.version.split()[0]}, open(os.path.join(a.out, "heldout.json"), "w"))
    offline = None
    if a.offline_prompts and time.time() < deadline_all - 5:
        pt = torch.tensor(prompts[:a.offline_prompts], dtype=torch.long)
        offline = offline_acceptance(target, drafter, pt, layer_ids, dev, a.offline_gen)
        log(f"offline greedy acceptance (tokens/step incl. bonus): {offline}")
    save_pair(a.out, target, drafter, shape, dshape, layer_ids, 1, tok, a.dtype)
    report = {"args": vars(a), "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "python": sys.version.split()[0], "corpus": root,
              "files": {"train": len(train_files), "heldout": len(held_files)},
              "tokens": {"train": train_s.numel(), "heldout": held_s.numel(), "tokenizer_vocab": tok.get_vocab_size(),
                         "config_vocab": vocab},
              "target_shape": shape.asdict(), "drafter_shape": dshape.asdict(), "target_layer_ids": layer_ids,
              "mask_token_id": 1, "block_size": BLOCK, "target": trep, "drafter": drep, "offline_acceptance": offline,
              "prompts": len(prompts), "wall_s": round(time.time() - T0, 1)}
    json.dump(report, open(os.path.join(a.out, "train_report.json"), "w"), indent=1)
    log(f"wrote {a.out}: target ppl {trep['best']['ppl']:.2f}, entropy {trep['best']['entropy_nats']:.3f} nats; "
        f"drafter top-1 k=1 {drep['final']['top1'][0]}; wall {report['wall_s']} s")
    return report


if __name__ == "__main__":
    main()
