"""The tensor list of each architecture: canonical GGUF names and torch-order shapes.

Used by the synthetic model writer, the HF converter and the planner (which needs records of models
that are not on disk), so one table says what a model of a given config holds.
"""
from __future__ import annotations

from ..config import ModelConfig
from ..quant.types import GGMLType


def tensor_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) for every tensor of a qwen3moe / qwen3 / llama model, in GGUF file order."""
    H, D = cfg.n_embd, cfg.head_dim
    out = [("token_embd.weight", (cfg.n_vocab, H))]
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (H,)),
            (b + "attn_q.weight", (cfg.n_head * D, H)),
            (b + "attn_k.weight", (cfg.n_head_kv * D, H)),
            (b + "attn_v.weight", (cfg.n_head_kv * D, H)),
            (b + "attn_output.weight", (H, cfg.n_head * D)),
        ]
        if cfg.qk_norm:
            out += [(b + "attn_q_norm.weight", (D,)), (b + "attn_k_norm.weight", (D,))]
        out.append((b + "ffn_norm.weight", (H,)))
        if cfg.is_moe:
            E, F = cfg.n_expert, cfg.n_ff_exp
            out += [
                (b + "ffn_gate_inp.weight", (E, H)),
                (b + "ffn_gate_exps.weight", (E, F, H)),
                (b + "ffn_up_exps.weight", (E, F, H)),
                (b + "ffn_down_exps.weight", (E, H, F)),
            ]
        else:
            out += [
                (b + "ffn_gate.weight", (cfg.n_ff, H)),
                (b + "ffn_up.weight", (cfg.n_ff, H)),
                (b + "ffn_down.weight", (H, cfg.n_ff)),
            ]
    out += [("output_norm.weight", (H,)), ("output.weight", (cfg.n_vocab, H))]
    return out


def default_qtype(name: str, shape, expert_type: GGMLType, other_type: GGMLType) -> GGMLType:
    """Norms, 1-D tensors and the router stay F32 (llama.cpp's quantize keeps them so); the rest get their types."""
    if len(shape) == 1 or "ffn_gate_inp" in name:
        return GGMLType.F32
    if "_exps." in name:
        return expert_type
    return other_type
