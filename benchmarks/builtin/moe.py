"""A compact qwen3moe in plain torch, for training the built-in model, and its export to GGUF.

The arithmetic is hybridmoe's qwen3moe (models/decoder.py): RMSNorm (weight times the normalized x), per-head
RMSNorm of q and k before NeoX RoPE, grouped-query attention (q head h reads kv head h // (n_head / n_head_kv)),
a softmax router whose top-k probabilities are renormalized (expert_weights_norm), SiLU-gated experts
down(silu(gate x) * up x), and an output head tied to the embedding (the GGUF has no output.weight, which
hybridmoe and llama.cpp read as tied).

Training runs every expert densely on every token and weights each by its router weight, zero for the experts
not chosen: two large GEMMs a layer instead of a gather per expert. The result and the gradients are those of
the sparse top-k layer (an expert that is not chosen gets weight 0, hence no output and no gradient); only
the FLOPs differ, which at 8-16 experts of this size cost less than the sparse bookkeeping.

`export_gguf(model, tokenizer_json, path, qtype)` writes the file through hybridmoe's own writer.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))


@dataclass
class MoEConfig:
    n_vocab: int = 8192
    n_embd: int = 256
    n_layer: int = 6
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 256
    n_ctx: int = 1024
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    dropout: float = 0.0          # training only, on the residual branches (not part of the exported model)

    def n_params(self) -> int:
        H, D, E, Fe = self.n_embd, self.head_dim, self.n_expert, self.n_ff_exp
        attn = H * D * (2 * self.n_head + 2 * self.n_head_kv) + 2 * D + H
        ffn = E * H + 3 * E * H * Fe + H
        return self.n_vocab * H + self.n_layer * (attn + ffn) + H


def rope_cos_sin(T: int, D: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX tables [T, D] (the angle repeated over both halves), computed in float64 as hybridmoe does."""
    inv = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64, device=device) / D))
    ang = torch.arange(T, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), -1)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, nh, T, D]; NeoX: rotate the two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: MoEConfig):
        super().__init__()
        self.c = c
        H, D = c.n_embd, c.head_dim
        self.q = nn.Linear(H, c.n_head * D, bias=False)
        self.k = nn.Linear(H, c.n_head_kv * D, bias=False)
        self.v = nn.Linear(H, c.n_head_kv * D, bias=False)
        self.o = nn.Linear(c.n_head * D, H, bias=False)
        self.q_norm = RMSNorm(D, c.rms_eps)
        self.k_norm = RMSNorm(D, c.rms_eps)

    def forward(self, x, cos, sin):
        c = self.c
        B, T, _ = x.shape
        q = self.q_norm(self.q(x).view(B, T, c.n_head, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(B, T, c.n_head_kv, c.head_dim)).transpose(1, 2)
        v = self.v(x).view(B, T, c.n_head_kv, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype)
        if c.n_head_kv != c.n_head:
            g = c.n_head // c.n_head_kv
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(B, T, c.n_head * c.head_dim))


class MoE(nn.Module):
    """Experts stored as GGUF lays them out: gate, up [E, F, H]; down [E, H, F]."""

    def __init__(self, c: MoEConfig):
        super().__init__()
        self.c = c
        E, H, Fe = c.n_expert, c.n_embd, c.n_ff_exp
        self.router = nn.Linear(H, E, bias=False)
        self.gate = nn.Parameter(torch.empty(E, Fe, H))
        self.up = nn.Parameter(torch.empty(E, Fe, H))
        self.down = nn.Parameter(torch.empty(E, H, Fe))

    def route(self, x):
        """Top-k experts and weights of x [N, H], as hybridmoe routes them (softmax, top-k, renormalize)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)                      # [N, E]
        w, ids = torch.topk(probs, self.c.n_expert_used, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        return probs, w, ids

    def forward(self, x, with_aux: bool = False):
        """y, and with `with_aux` the Switch-style load-balancing loss E * sum_e (share of picks) * (mean prob)."""
        c = self.c
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                               # [N, H]
        N, E, Fe = x.shape[0], c.n_expert, c.n_ff_exp
        probs, w, ids = self.route(x)
        comb = torch.zeros_like(probs).scatter(1, ids, w)                          # [N, E], 0 off the top-k
        g = (x @ self.gate.reshape(E * Fe, -1).t()).view(N, E, Fe)
        u = (x @ self.up.reshape(E * Fe, -1).t()).view(N, E, Fe)
        a = F.silu(g) * u * comb.to(g.dtype)[:, :, None]                          # [N, E, F]
        y = a.reshape(N, E * Fe) @ self.down.permute(0, 2, 1).reshape(E * Fe, -1)  # [N, H]
        y = y.view(shape)
        if not with_aux:
            return y
        frac = torch.zeros_like(probs).scatter(1, ids, 1.0).mean(0) / c.n_expert_used
        return y, E * (frac * probs.mean(0)).sum()


class Block(nn.Module):
    def __init__(self, c: MoEConfig):
        super().__init__()
        self.attn_norm = RMSNorm(c.n_embd, c.rms_eps)
        self.attn = Attention(c)
        self.ffn_norm = RMSNorm(c.n_embd, c.rms_eps)
        self.moe = MoE(c)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x, cos, sin):
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin))
        y, aux = self.moe(self.ffn_norm(x), with_aux=True)
        return x + self.drop(y), aux


class TinyQwen3Moe(nn.Module):
    def __init__(self, c: MoEConfig):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.n_vocab, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.norm = RMSNorm(c.n_embd, c.rms_eps)
        cos, sin = rope_cos_sin(c.n_ctx, c.head_dim, c.rope_base, "cpu")
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02):
        out_std = std / math.sqrt(2 * self.c.n_layer)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("o.weight", "down")):
                nn.init.normal_(p, std=out_std)
            else:
                nn.init.normal_(p, std=std)

    def forward(self, tokens, with_aux: bool = False):
        """tokens [B, T] -> logits [B, T, V] (float32); with `with_aux` also the layers' mean balancing loss."""
        T = tokens.shape[1]
        if T > self.c.n_ctx:
            raise ValueError(f"{T} tokens, more than the context {self.c.n_ctx}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(tokens)
        aux = []
        for b in self.blocks:
            x, a = b(x, cos, sin)
            aux.append(a)
        x = self.norm(x)
        logits = (x @ self.embed.weight.t().to(x.dtype)).float()
        return (logits, torch.stack(aux).mean()) if with_aux else logits


# ---------------------------------------------------------------------------------------------- export

def hm_config(c: MoEConfig, name: str = "hybridmoe-builtin"):
    from hybridmoe.config import ModelConfig
    return ModelConfig(arch="qwen3moe", n_layer=c.n_layer, n_embd=c.n_embd, n_head=c.n_head,
                       n_head_kv=c.n_head_kv, head_dim=c.head_dim, n_vocab=c.n_vocab, n_ctx_train=c.n_ctx,
                       rms_eps=c.rms_eps, rope_base=c.rope_base, n_expert=c.n_expert,
                       n_expert_used=c.n_expert_used, n_ff_exp=c.n_ff_exp, norm_topk_prob=True, rope_neox=True,
                       qk_norm=True, name=name)


def gguf_tensors(model: TinyQwen3Moe) -> dict[str, torch.Tensor]:
    """Every tensor under its GGUF name, float32 on the CPU (no output.weight: tied to token_embd)."""
    out = {"token_embd.weight": model.embed.weight, "output_norm.weight": model.norm.weight}
    for i, b in enumerate(model.blocks):
        p = f"blk.{i}."
        out.update({
            p + "attn_norm.weight": b.attn_norm.weight, p + "attn_q.weight": b.attn.q.weight,
            p + "attn_k.weight": b.attn.k.weight, p + "attn_v.weight": b.attn.v.weight,
            p + "attn_output.weight": b.attn.o.weight, p + "attn_q_norm.weight": b.attn.q_norm.weight,
            p + "attn_k_norm.weight": b.attn.k_norm.weight, p + "ffn_norm.weight": b.ffn_norm.weight,
            p + "ffn_gate_inp.weight": b.moe.router.weight, p + "ffn_gate_exps.weight": b.moe.gate,
            p + "ffn_up_exps.weight": b.moe.up, p + "ffn_down_exps.weight": b.moe.down,
        })
    return {k: v.detach().float().cpu().contiguous() for k, v in out.items()}


def gguf_metadata(c: MoEConfig, tokenizer_json: str, name: str = "hybridmoe-builtin", extra: dict | None = None):
    from hybridmoe.models.synth import config_metadata
    from hybridmoe.text.builtin_vocab import hf_tokenizer_to_metadata
    from hybridmoe.text.chat import CHATML_TEMPLATE
    cfg = hm_config(c, name)
    vocab = hf_tokenizer_to_metadata(tokenizer_json, n_vocab=c.n_vocab, pre="qwen2", chat_template=CHATML_TEMPLATE,
                                     bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>", add_bos_token=False)
    md = {"general.name": name, "general.type": "model", **config_metadata(cfg),
          "qwen3moe.expert_weights_norm": True, **vocab}
    md.update(extra or {})
    return md


def export_gguf(model: TinyQwen3Moe, tokenizer_json: str, path: str, qtype: str = "Q8_0",
                expert_qtype: str | None = None, name: str = "hybridmoe-builtin", extra_md: dict | None = None,
                split: int = 1) -> list[str]:
    """Write the model as a GGUF file (atomically: a .part file renamed at the end). Norms and the router stay
    F32 (default_qtype's rule); the other matrices get `qtype` (experts `expert_qtype`, default the same).
    split > 1 writes gguf-split parts PATH-0000i-of-0000n.gguf instead. Returns the paths written."""
    from hybridmoe.formats.gguf_write import write_gguf, write_split
    from hybridmoe.models.tensors import default_qtype, tensor_shapes
    from hybridmoe.quant.ref import quantize
    from hybridmoe.quant.types import GGMLType
    c = model.c
    cfg = hm_config(c, name)
    ot, et = GGMLType[qtype.upper()], GGMLType[(expert_qtype or qtype).upper()]
    ts = gguf_tensors(model)
    plan = []
    for tname, shape in tensor_shapes(cfg):
        if tname == "output.weight":
            continue
        t = ts[tname]
        assert tuple(t.shape) == tuple(shape), (tname, t.shape, shape)
        qt = default_qtype(tname, shape, et, ot)
        plan.append((tname, shape, qt, (lambda t=t, qt=qt: quantize(t, qt))))
    md = gguf_metadata(c, tokenizer_json, name, extra_md)
    tmp = path + ".part"
    write_gguf(tmp, "qwen3moe", md, plan)
    if split > 1:
        prefix = path.removesuffix(".gguf")
        try:
            return write_split(tmp, split, prefix)
        finally:
            os.unlink(tmp)
    os.replace(tmp, path)
    return [path]


def config_dict(c: MoEConfig) -> dict:
    return asdict(c)
