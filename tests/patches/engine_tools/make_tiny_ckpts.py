"""(Copied from /work/shared/gpu/smoke/make_tiny_ckpts.py so that it travels with the repository.)
Write two tiny random-weight checkpoints (real safetensors + config.json), with no vLLM import:
  ROOT/target : Qwen3ForCausalLM, 4 layers, hidden 128, vocab 1024
  ROOT/dflash : DFlash draft (architectures DFlashDraftModel), 1 layer, reads target layers [1, 2]
                (env DRAFT_LAYER_TYPES="sliding_attention,full_attention" and DRAFT_WINDOW=4 give a
                drafter of one layer per entry with those layer_types and that sliding_window)
Weights use HF names. lm_head is scaled up so greedy argmax has wide margins (robust to bf16 batching noise).
Every embedding has a constant +3 in coordinate 0; target lm_head row X=7 reads only that coordinate (weight XW), so
the target emits 7 about half the time; the draft's lm_head row 7 reads it with weight 50, so the draft always
proposes 7: some drafts are accepted, some rejected (exercises both verification paths).
usage: python3 make_tiny_ckpts.py ROOT [dtype=bfloat16]"""
import json, os, sys
import torch
from safetensors.torch import save_file

root = sys.argv[1]
dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "bfloat16")
H, I, NH, NKV, HD, V = 128, 256, 2, 1, 64, 1024
base = dict(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD,
            vocab_size=V, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, tie_word_embeddings=False,
            torch_dtype=str(dtype).split(".")[-1], model_type="qwen3", hidden_act="silu",
            attention_bias=False, bos_token_id=None, eos_token_id=None)
g = torch.Generator().manual_seed(0)
def rnd(*shape, std=0.02):
    return (torch.randn(*shape, generator=g) * std).to(dtype)
def layer(prefix):
    return {
        f"{prefix}.input_layernorm.weight": torch.ones(H, dtype=dtype),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(H, dtype=dtype),
        f"{prefix}.self_attn.q_proj.weight": rnd(NH * HD, H, std=0.1),
        f"{prefix}.self_attn.k_proj.weight": rnd(NKV * HD, H, std=0.1),
        f"{prefix}.self_attn.v_proj.weight": rnd(NKV * HD, H, std=0.1),
        f"{prefix}.self_attn.o_proj.weight": rnd(H, NH * HD, std=0.1),
        f"{prefix}.self_attn.q_norm.weight": torch.ones(HD, dtype=dtype),
        f"{prefix}.self_attn.k_norm.weight": torch.ones(HD, dtype=dtype),
        f"{prefix}.mlp.gate_proj.weight": rnd(I, H, std=0.1),
        f"{prefix}.mlp.up_proj.weight": rnd(I, H, std=0.1),
        f"{prefix}.mlp.down_proj.weight": rnd(H, I, std=0.1),
    }

# target
os.makedirs(f"{root}/target", exist_ok=True)
json.dump(dict(base, architectures=["Qwen3ForCausalLM"], num_hidden_layers=4,
               layer_types=["full_attention"] * 4, use_sliding_window=False, sliding_window=None),
          open(f"{root}/target/config.json", "w"), indent=1)
X, XW = 7, float(os.environ.get("XW", "14.0"))
emb = torch.randn(V, H, generator=g); emb[:, 0] = 3.0; emb[X, 0] = float(os.environ.get("E7", "1.5"))
head = torch.randn(V, H, generator=g) * 0.5; head[X] = 0.0; head[X, 0] = XW
t = {"model.embed_tokens.weight": emb.to(dtype), "model.norm.weight": torch.ones(H, dtype=dtype),
     "lm_head.weight": head.to(dtype)}
for i in range(4):
    t.update(layer(f"model.layers.{i}"))
save_file(t, f"{root}/target/model.safetensors", metadata={"format": "pt"})

# DFlash draft: no embed_tokens (shared from target), own lm_head, fc over 2 target layers
os.makedirs(f"{root}/dflash", exist_ok=True)
layer_types = [t for t in os.environ.get("DRAFT_LAYER_TYPES", "").split(",") if t]
draft = dict(base, architectures=["DFlashDraftModel"], num_hidden_layers=len(layer_types) or 1, block_size=4,
             dflash_config={"mask_token_id": 1000, "target_layer_ids": [1, 2]})
if layer_types:
    draft.update(layer_types=layer_types, use_sliding_window=True, sliding_window=int(os.environ.get("DRAFT_WINDOW", "4")))
json.dump(draft, open(f"{root}/dflash/config.json", "w"), indent=1)
dhead = torch.randn(V, H, generator=g) * 0.5; dhead[X] = 0.0; dhead[X, 0] = 50.0
d = {"fc.weight": rnd(H, 2 * H, std=0.05), "hidden_norm.weight": torch.ones(H, dtype=dtype),
     "norm.weight": torch.ones(H, dtype=dtype), "lm_head.weight": dhead.to(dtype)}
for i in range(draft["num_hidden_layers"]):
    d.update(layer(f"layers.{i}"))
save_file(d, f"{root}/dflash/model.safetensors", metadata={"format": "pt"})
print("wrote", root, "target tensors", len(t), "draft tensors", len(d))
