"""Tiny random HF models and their GGUF conversions: the transformers oracle for our forward pass."""
from __future__ import annotations

import os

import gguf
import numpy as np
import torch

from hybridmoe.formats.gguf import open_gguf
from hybridmoe.models.convert import LAYER_NAMES, TOP_NAMES, convert_hf, llama_permute
from hybridmoe.quant.types import GGMLType


def make_hf_model(kind: str, out_dir: str, seed: int = 0):
    import transformers as tf
    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.08)
    if kind in ("qwen3moe", "qwen3moe-yarn"):
        # -yarn: Qwen3's long-context setting (factor 4 over a short original context, so that the interpolated
        # frequencies and the magnitude matter at 20 tokens)
        rope = dict(rope_theta=1e6) if kind == "qwen3moe" else dict(rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16})
        cfg = tf.Qwen3MoeConfig(**common, head_dim=32, intermediate_size=128, moe_intermediate_size=64,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, **rope)
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32, intermediate_size=128, rope_theta=1e6)
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind in ("llama", "llama-linear"):
        # -linear: position interpolation (every frequency over the factor), as older long-context fine-tunes
        rope = dict(rope_theta=10000.0) if kind == "llama" else dict(rope_parameters={
            "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
        cfg = tf.LlamaConfig(**common, intermediate_size=128, **rope)
        model = tf.LlamaForCausalLM(cfg)
    elif kind in ("deepseek2", "deepseek2-yarn"):
        rope = dict(rope_theta=10000.0)
        if kind == "deepseek2-yarn":
            rope = dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 128, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
        cfg = tf.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                                  num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                  first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                  q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                  v_head_dim=16, **rope)
        model = tf.DeepseekV3ForCausalLM(cfg)
    elif kind == "gpt-oss":
        # YaRN with a short original context, so the interpolated frequencies matter at 20 tokens; a window
        # of 6 (shorter than the test prompts) on layer 0
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 128}
        cfg = tf.GptOssConfig(**{**common, "rms_norm_eps": 1e-5}, head_dim=16, intermediate_size=32,
                              num_local_experts=8, num_experts_per_tok=2, sliding_window=6, rope_parameters=rope)
        cfg._attn_implementation = "eager"
        model = tf.GptOssForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # norms start at exactly 1 in HF; perturb them so a wrong norm weight would show
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):                      # deepseek's routing bias
                b.copy_(0.05 * torch.randn_like(b))
        if kind == "gpt-oss":
            for n, p in model.named_parameters():
                if n.endswith("_proj_bias"):                                # expert biases start at 0
                    p.copy_(0.1 * torch.randn_like(p))
                elif n.endswith("sinks"):
                    p.copy_(torch.randn_like(p))
                elif n.endswith("experts.gate_up_proj"):                    # large enough for the clamps to act
                    p.mul_(8.0)
    model.eval()
    model.save_pretrained(out_dir)
    return model


def make_long_prompt_moe(d: str) -> str:
    """The long-prompt oracle of tests/test_prompt_precision.py (and benchmarks/llamacpp_precision.py): a tiny
    random Qwen3-MoE with 256-wide rows (so the K-quants apply), 2,048 positions, norms perturbed from 1, saved
    in d; returns d."""
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-6,
                            tie_word_embeddings=False, initializer_range=0.08, intermediate_size=256,
                            moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                            rope_theta=1e6)
    model = tf.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:                      # norms start at 1 in HF: perturb them
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(d)
    return d


def hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def load_dequantized_into_hf(model, gguf_path: str):
    """Replace the HF weights by the GGUF file's weights, dequantized by the gguf package (an independent oracle)."""
    f = open_gguf(gguf_path)
    arch = f.metadata["general.architecture"]
    n_head, n_kv = model.config.num_attention_heads, model.config.num_key_value_heads
    inv_top = {v: k for k, v in TOP_NAMES.items()}
    inv_layer = {v: k for k, v in LAYER_NAMES.items()}
    sd = model.state_dict()
    new, experts = {}, {}
    for name, info in f.tensors.items():
        raw = f.raw(info).numpy().reshape(*info.shape[:-1], -1)
        w = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, info.qtype))).reshape(info.shape)
        if name in inv_top:
            new[inv_top[name]] = w
            continue
        _, i, base, _ = name.split(".")
        if base.endswith("_exps"):
            # transformers holds experts fused in memory: gate_up_proj [E, 2F, H] (gate first), down_proj [E, H, F]
            proj = base[len("ffn_"):-len("_exps")]
            experts.setdefault(i, {})[proj] = w
            continue
        if arch == "llama" and base in ("attn_q", "attn_k"):
            w = _unpermute(w, n_head if base == "attn_q" else n_kv)
        new[f"model.layers.{i}.{inv_layer[base]}.weight"] = w
    for i, d in experts.items():
        new[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat((d["gate"], d["up"]), dim=1)
        new[f"model.layers.{i}.mlp.experts.down_proj"] = d["down"]
    missing = set(sd) - set(new)
    if "lm_head.weight" in missing and model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    assert not missing, missing
    model.load_state_dict({k: v.to(sd[k].dtype) for k, v in new.items()}, strict=False)
    return model


def _unpermute(w, n_head):
    out = w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(llama_permute(out, n_head), w)
    return out


def convert(hf_dir: str, out: str, qtype: GGMLType) -> str:
    if not os.path.exists(out):
        convert_hf(hf_dir, out, expert_type=qtype, other_type=qtype)
    return out
