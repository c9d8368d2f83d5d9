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
    if cfg.arch == "deepseek2":
        return deepseek2_shapes(cfg)
    if cfg.arch == "gpt-oss":
        return gpt_oss_shapes(cfg)
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


def deepseek2_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """DeepSeek V2/V3 as llama.cpp names them: MLA attention, dense leading layers, shared experts."""
    H, nh, Dk = cfg.n_embd, cfg.n_head, cfg.head_dim
    Dv, R, C = cfg.v_head_dim, cfg.rope_dim, cfg.kv_lora_rank
    out = [("token_embd.weight", (cfg.n_vocab, H))]
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", (H,)))
        if cfg.q_lora_rank:
            out += [(b + "attn_q_a.weight", (cfg.q_lora_rank, H)), (b + "attn_q_a_norm.weight", (cfg.q_lora_rank,)),
                    (b + "attn_q_b.weight", (nh * Dk, cfg.q_lora_rank))]
        else:
            out.append((b + "attn_q.weight", (nh * Dk, H)))
        out += [(b + "attn_kv_a_mqa.weight", (C + R, H)), (b + "attn_kv_a_norm.weight", (C,)),
                (b + "attn_kv_b.weight", (nh * (Dk - R + Dv), C)), (b + "attn_output.weight", (H, nh * Dv)),
                (b + "ffn_norm.weight", (H,))]
        if i < cfg.n_layer_dense_lead:
            out += [(b + "ffn_gate.weight", (cfg.n_ff, H)), (b + "ffn_up.weight", (cfg.n_ff, H)),
                    (b + "ffn_down.weight", (H, cfg.n_ff))]
            continue
        E, F, S = cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_exp * cfg.n_expert_shared
        out.append((b + "ffn_gate_inp.weight", (E, H)))
        if cfg.expert_gating == "sigmoid":
            out.append((b + "exp_probs_b.bias", (E,)))
        out += [(b + "ffn_gate_exps.weight", (E, F, H)), (b + "ffn_up_exps.weight", (E, F, H)),
                (b + "ffn_down_exps.weight", (E, H, F))]
        if S:
            out += [(b + "ffn_gate_shexp.weight", (S, H)), (b + "ffn_up_shexp.weight", (S, H)),
                    (b + "ffn_down_shexp.weight", (H, S))]
    out += [("output_norm.weight", (H,)), ("output.weight", (cfg.n_vocab, H))]
    return out


def gpt_oss_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """gpt-oss as llama.cpp names it: biased q/k/v/output, per-head sinks, post_attention_norm as the FFN's
    pre-norm, a biased router and biased experts (gate and up split, as llama.cpp's converter writes them)."""
    H, D, nh, nkv = cfg.n_embd, cfg.head_dim, cfg.n_head, cfg.n_head_kv
    E, F = cfg.n_expert, cfg.n_ff_exp
    out = [("token_embd.weight", (cfg.n_vocab, H))]
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (H,)),
                (b + "attn_q.weight", (nh * D, H)), (b + "attn_q.bias", (nh * D,)),
                (b + "attn_k.weight", (nkv * D, H)), (b + "attn_k.bias", (nkv * D,)),
                (b + "attn_v.weight", (nkv * D, H)), (b + "attn_v.bias", (nkv * D,)),
                (b + "attn_output.weight", (H, nh * D)), (b + "attn_output.bias", (H,)),
                (b + "attn_sinks.weight", (nh,)),
                (b + "post_attention_norm.weight", (H,)),
                (b + "ffn_gate_inp.weight", (E, H)), (b + "ffn_gate_inp.bias", (E,)),
                (b + "ffn_gate_exps.weight", (E, F, H)), (b + "ffn_gate_exps.bias", (E, F)),
                (b + "ffn_up_exps.weight", (E, F, H)), (b + "ffn_up_exps.bias", (E, F)),
                (b + "ffn_down_exps.weight", (E, H, F)), (b + "ffn_down_exps.bias", (E, H))]
    out += [("output_norm.weight", (H,)), ("output.weight", (cfg.n_vocab, H))]
    return out


def default_qtype(name: str, shape, expert_type: GGMLType, other_type: GGMLType) -> GGMLType:
    """Norms, 1-D tensors, biases and the router stay F32 (llama.cpp's quantize keeps them so); the rest get
    their types."""
    if len(shape) == 1 or "ffn_gate_inp" in name or name.endswith(".bias"):
        return GGMLType.F32
    if "_exps." in name:
        return expert_type
    return other_type
