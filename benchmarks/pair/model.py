"""Plain-PyTorch twins of the two architectures vLLM loads here (no transformers import):

* :class:`Target` is Qwen3ForCausalLM: pre-norm decoder layers, per-head q/k RMSNorm before RoPE
  (neox layout, ``rope_theta``), GQA, SwiGLU, a final RMSNorm and an untied ``lm_head``;
  parameter names are the HF checkpoint's (``model.layers.{i}.self_attn.q_proj.weight``, ...).
* :class:`Drafter` is vLLM's ``qwen3_dflash`` (``DFlashDraftModel``,
  vllm/model_executor/models/qwen3_dflash.py): Qwen3 decoder layers whose attention is
  non-causal over the block, ``fc`` over the concatenated target features and ``hidden_norm``,
  a final ``norm``; the embedding and ``lm_head`` are the target's (frozen). The context K/V of
  every drafter layer come from ``hidden_norm(fc(features))`` through that layer's own
  ``k_proj``/``k_norm``/RoPE and ``v_proj`` with no ``input_layernorm`` (vLLM's
  ``precompute_and_store_context_kv``); the block's tokens go through the whole layer.

``Target.forward(ids, aux_layers=...)`` returns the residual stream after the given layers (before
the final norm), the features vLLM's runner captures for ``dflash_config.target_layer_ids``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Shape:
    vocab: int = 8192
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    inter: int = 1536
    eps: float = 1e-6
    theta: float = 10000.0
    max_pos: int = 2048

    def hf_config(self, dtype: str) -> dict:
        return dict(hidden_size=self.hidden, intermediate_size=self.inter, num_hidden_layers=self.layers,
                    num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                    vocab_size=self.vocab, max_position_embeddings=self.max_pos, rms_norm_eps=self.eps,
                    rope_theta=self.theta, rope_parameters={"rope_theta": self.theta, "rope_type": "default"},
                    tie_word_embeddings=False, torch_dtype=dtype, model_type="qwen3", hidden_act="silu",
                    attention_bias=False, attention_dropout=0.0, layer_types=["full_attention"] * self.layers,
                    use_sliding_window=False, sliding_window=None, max_window_layers=self.layers)

    def asdict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):  # in float32, as vLLM's and HF's RMSNorm
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dt)


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float):
    """cos, sin of shape [*pos.shape, head_dim] (neox layout: the half-frequencies repeated)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
    f = pos.float()[..., None] * inv
    emb = torch.cat([f, f], -1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x [b, heads, n, d]; cos/sin [b, n, d] (or [n, d])."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    d = x.shape[-1] // 2
    rot = torch.cat([-x[..., d:], x[..., :d]], -1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.eps)
        self.k_norm = RMSNorm(s.head_dim, s.eps)

    def heads(self, x, proj, norm, n):  # [b, t, H] -> [b, n, t, d]
        b, t, _ = x.shape
        y = proj(x).view(b, t, n, self.s.head_dim)
        if norm is not None:
            y = norm(y)
        return y.transpose(1, 2)

    def kv(self, x, cos, sin):
        k = apply_rope(self.heads(x, self.k_proj, self.k_norm, self.s.kv_heads), cos, sin)
        v = self.heads(x, self.v_proj, None, self.s.kv_heads)
        return k, v

    def attend(self, q, k, v, mask=None, causal=False, dropout=0.0):
        g = self.s.heads // self.s.kv_heads
        if g > 1:  # HF repeat_kv: kv head j serves query heads j*g .. j*g+g-1
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout)
        b, n, t, d = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, n * d))


class MLP(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.inter, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.inter, bias=False)
        self.down_proj = nn.Linear(s.inter, s.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.self_attn = Attention(s)
        self.mlp = MLP(s)


class Inner(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden, s.eps)


class Target(nn.Module):
    """Qwen3ForCausalLM (HF parameter names)."""

    def __init__(self, s: Shape, dropout: float = 0.0):
        super().__init__()
        self.s, self.dropout = s, dropout
        self.model = Inner(s)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        init_weights(self, s)

    def forward(self, ids, aux_layers=(), logits=True):
        """ids [b, t] -> (logits [b, t, V] or the final normed hidden, [aux features [b, t, H] each])."""
        b, t = ids.shape
        cos, sin = rope_cos_sin(torch.arange(t, device=ids.device), self.s.head_dim, self.s.theta)
        x = self.model.embed_tokens(ids)
        aux = []
        p = self.dropout if self.training else 0.0
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rope(a.heads(h, a.q_proj, a.q_norm, self.s.heads), cos, sin)
            k, v = a.kv(h, cos, sin)
            x = x + F.dropout(a.attend(q, k, v, causal=True), p, self.training)
            x = x + F.dropout(layer.mlp(layer.post_attention_layernorm(x)), p, self.training)
            if i in aux_layers:
                aux.append(x)
        h = self.model.norm(x)
        return (self.lm_head(h) if logits else h), aux

    @torch.no_grad()
    def generate(self, prompts, n: int, temperature: float = 0.0, generator=None, autocast=None):
        """[b, P] -> [b, P + n]: greedy (temperature 0) or sampled continuations, with a KV cache."""
        import contextlib

        ctx = autocast or contextlib.nullcontext()
        b, P = prompts.shape
        s, dev = self.s, prompts.device
        L = P + n
        cos, sin = rope_cos_sin(torch.arange(L, device=dev), s.head_dim, s.theta)
        cache = []

        def pick(logits):
            if temperature <= 0:
                return logits.float().argmax(-1)
            p = (logits.float() / temperature).softmax(-1)
            return torch.multinomial(p, 1, generator=generator).squeeze(-1)

        out = torch.empty(b, L, dtype=prompts.dtype, device=dev)
        out[:, :P] = prompts
        with ctx:
            x = self.model.embed_tokens(prompts)
            for layer in self.model.layers:
                a = layer.self_attn
                h = layer.input_layernorm(x)
                q = apply_rope(a.heads(h, a.q_proj, a.q_norm, s.heads), cos[:P], sin[:P])
                k, v = a.kv(h, cos[:P], sin[:P])
                kc = torch.empty(b, s.kv_heads, L, s.head_dim, dtype=k.dtype, device=dev)
                vc = torch.empty_like(kc)
                kc[:, :, :P], vc[:, :, :P] = k, v
                cache.append((kc, vc))
                x = x + a.attend(q, k, v, causal=True)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            out[:, P] = pick(self.lm_head(self.model.norm(x[:, -1])))
            for t in range(P, L - 1):
                x = self.model.embed_tokens(out[:, t:t + 1])
                for layer, (kc, vc) in zip(self.model.layers, cache):
                    a = layer.self_attn
                    h = layer.input_layernorm(x)
                    q = apply_rope(a.heads(h, a.q_proj, a.q_norm, s.heads), cos[t:t + 1], sin[t:t + 1])
                    k, v = a.kv(h, cos[t:t + 1], sin[t:t + 1])
                    kc[:, :, t:t + 1], vc[:, :, t:t + 1] = k, v
                    x = x + a.attend(q, kc[:, :, :t + 1], vc[:, :, :t + 1])
                    x = x + layer.mlp(layer.post_attention_layernorm(x))
                out[:, t + 1] = pick(self.lm_head(self.model.norm(x[:, -1])))
        return out

    def hf_state_dict(self) -> dict:
        return dict(self.state_dict())


def init_weights(m: nn.Module, s: Shape) -> None:
    std = 0.02
    for name, p in m.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=std / math.sqrt(2 * s.layers) if name.endswith(("o_proj.weight", "down_proj.weight"))
                            else std)


class Drafter(nn.Module):
    """vLLM's qwen3_dflash, trainable: the target's embedding and lm_head are passed in (frozen)."""

    def __init__(self, s: Shape, n_features: int, block: int, mask_id: int):
        super().__init__()
        self.s, self.block, self.mask_id = s, block, mask_id
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.layers))
        self.fc = nn.Linear(n_features * s.hidden, s.hidden, bias=False)
        self.hidden_norm = RMSNorm(s.hidden, s.eps)
        self.norm = RMSNorm(s.hidden, s.eps)
        init_weights(self, s)

    def forward(self, feats, anchors_tok, anchors, embed):
        """feats [b, T, F*H] (the target's features of the context positions 0..T-1); anchors [b, m]
        (positions a, each with 1 <= a <= T); anchors_tok [b, m] (the token at a). Returns the final
        hidden [b, m, B, H] of the blocks [x_a, MASK x (B-1)] at positions a .. a+B-1, where block j
        sees the context keys at positions < a_j and its own B keys (both directions)."""
        b, T, _ = feats.shape
        m, B, s = anchors.shape[1], self.block, self.s
        dev = feats.device
        ids = torch.full((b, m, B), self.mask_id, dtype=torch.long, device=dev)
        ids[:, :, 0] = anchors_tok
        x = embed(ids).view(b, m * B, s.hidden)
        qpos = (anchors[:, :, None] + torch.arange(B, device=dev)).view(b, m * B)
        qcos, qsin = rope_cos_sin(qpos, s.head_dim, s.theta)
        ccos, csin = rope_cos_sin(torch.arange(T, device=dev), s.head_dim, s.theta)
        ctx = self.hidden_norm(self.fc(feats))
        mask = block_mask(anchors, T, B)  # [b, 1, mB, T + mB]
        for layer in self.layers:
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rope(a.heads(h, a.q_proj, a.q_norm, s.heads), qcos, qsin)
            kb, vb = a.kv(h, qcos, qsin)
            kc, vc = a.kv(ctx, ccos, csin)  # context K/V: no input_layernorm (precompute_and_store_context_kv)
            x = x + a.attend(q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), mask=mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x).view(b, m, B, s.hidden)

    def hf_state_dict(self) -> dict:  # vLLM adds "model." itself
        return {k: v for k, v in self.state_dict().items()}


def block_mask(anchors: torch.Tensor, T: int, B: int) -> torch.Tensor:
    """Boolean attention mask [b, 1, m*B, T + m*B] (True = attend): block j's queries see context key
    t iff t < a_j, and block key (j', i) iff j' == j."""
    b, m = anchors.shape
    dev = anchors.device
    ctx = torch.arange(T, device=dev)[None, None, :] < anchors[:, :, None]  # [b, m, T]
    ctx = ctx[:, :, None, :].expand(b, m, B, T).reshape(b, m * B, T)
    blk = torch.arange(m, device=dev).repeat_interleave(B)
    own = (blk[:, None] == blk[None, :])[None].expand(b, m * B, m * B)
    return torch.cat([ctx, own], -1)[:, None]


def position_weights(B: int, gamma: float, device=None) -> torch.Tensor:
    """DFlash's loss weights over the block's slots: slot 0 (the anchor) 0, slot k >= 1 exp(-(k-1)/gamma)."""
    k = torch.arange(B, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def dflash_loss(logits, labels, weights, soft=None):
    """logits [b, m, B, V] (the drafter's, float); labels [b, m, B] (token at a+k; slot 0 unused);
    weights [B]; soft: optional [b, m, B, V] target log-probabilities of the token at a+k (the target's
    distribution at a+k-1): then the loss is KL(target || drafter) instead of cross-entropy on
    ``labels``. Weighted by slot, normalised by the total weight."""
    logp = logits.float().log_softmax(-1)
    if soft is None:
        per = -logp.gather(-1, labels[..., None]).squeeze(-1)
    else:
        per = (soft.exp() * (soft - logp)).sum(-1)
    w = weights.to(per.device).expand_as(per)
    return (per * w).sum() / w.sum()
