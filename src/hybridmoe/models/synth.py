"""Synthetic models: a real architecture with random weights, written as GGUF (no download needed).

`-m synth:PRESET` anywhere makes the file once in the cache folder and reuses it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import torch

from .. import env
from ..config import ModelConfig
from ..errors import HybridMoeError
from ..formats.gguf_write import write_gguf
from ..quant.types import GGMLType
from .mixes import mix_type
from .tensors import default_qtype, tensor_shapes

SYNTH_VERSION = 3

_QWEN3_30B = dict(arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_vocab=151936,
                  n_ctx_train=40960, rms_eps=1e-6, rope_base=1e6, n_expert=128, n_expert_used=8, n_ff_exp=768)
_TINY_256 = dict(arch="qwen3moe", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_vocab=1024,
                 n_ctx_train=4096, rms_eps=1e-6, rope_base=1e6, n_expert=8, n_expert_used=2, n_ff_exp=256)


def _catalog_fields(name: str) -> dict:
    """A catalog model's config (models/catalog.py) as a preset's fields."""
    from .catalog import CATALOG
    cfg = CATALOG[name]()
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)
            if f.name not in ("qk_norm", "rope_neox", "name") and getattr(cfg, f.name) != f.default}


# preset mix names -> models/mixes.py's
_MIX = {"q3_k_mix": "q3_k_xl", "q2_k_mix": "ud-q2_k_xl"}

PRESETS = {
    # a few MB: qwen3moe with 8 experts, 2 used; shapes keep every row a multiple of 32 for Q4_0/Q8_0
    "tiny": dict(arch="qwen3moe", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_vocab=1024,
                 n_ctx_train=4096, rms_eps=1e-6, rope_base=1e6, n_expert=8, n_expert_used=2, n_ff_exp=32,
                 expert_type=GGMLType.Q4_0, other_type=GGMLType.Q8_0),
    # tiny too, but every row 256 wide: GPU-resident Q4_0/Q8_0 weights take the split-row (dp4a) kernels
    "tiny-wide": dict(arch="qwen3moe", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_vocab=1024,
                      n_ctx_train=4096, rms_eps=1e-6, rope_base=1e6, n_expert=8, n_expert_used=2, n_ff_exp=256,
                      expert_type=GGMLType.Q4_0, other_type=GGMLType.Q8_0),
    # Qwen3-30B-A3B's shape: experts Q4_0, the rest Q8_0: 16.75 GiB
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                          n_vocab=151936, n_ctx_train=40960, rms_eps=1e-6, rope_base=1e6, n_expert=128,
                          n_expert_used=8, n_ff_exp=768, expert_type=GGMLType.Q4_0, other_type=GGMLType.Q8_0),
    # the same shape with K-quant experts (Q4_K, what Q4_K_M files hold; 4.5 bits too), the rest Q8_0: 16.75 GiB
    "qwen3-30b-a3b-q4_k": dict(arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                               n_vocab=151936, n_ctx_train=40960, rms_eps=1e-6, rope_base=1e6, n_expert=128,
                               n_expert_used=8, n_ff_exp=768, expert_type=GGMLType.Q4_K,
                               other_type=GGMLType.Q8_0),
    # the same shape in the per-tensor mixes of the files users run (models/mixes.py says what each holds):
    # IQ4_KS (ik_llama.cpp; 15.99 GiB), a UD-Q3_K_XL-like K-quant mix (14.03 GiB), IQ2_KT (trellis; 8.81 GiB),
    # IQ4_XS (mainline; 15.90 GiB), a UD-Q2_K_XL-like one (experts gate/up Q2_K, down Q3_K; 10.77 GiB)
    **{f"qwen3-30b-a3b-{m}": dict(_QWEN3_30B, mix=m) for m in ("iq4_ks", "q3_k_mix", "iq2_kt", "iq4_xs", "q2_k_mix")},
    # and tiny, with every row a multiple of 256 (the block of these types)
    **{f"tiny-{m}": dict(_TINY_256, mix=m) for m in ("iq4_ks", "q3_k_mix", "iq2_kt", "iq4_xs", "q2_k_mix")},
    # DeepSeek V3's layout, tiny: MLA, a dense first layer, shared expert, sigmoid routing in 2 groups
    "tiny-deepseek2": dict(arch="deepseek2", n_layer=2, n_embd=64, n_head=4, n_head_kv=4, head_dim=64,
                           n_vocab=1024, n_ctx_train=4096, rms_eps=1e-6, rope_base=1e4, n_ff=128, n_expert=8,
                           n_expert_used=2, n_ff_exp=32, q_lora_rank=32, kv_lora_rank=32, rope_dim=32,
                           v_head_dim=32, n_layer_dense_lead=1, n_expert_shared=1, expert_gating="sigmoid",
                           expert_weights_scale=2.5, n_expert_groups=2, n_group_used=1,
                           expert_type=GGMLType.Q4_0, other_type=GGMLType.Q8_0),
    # the same with rows of 256 for the experts, in ubergarm's DeepSeek-R1 IQ4_KS_R4 mix (interleaved experts)
    "tiny-deepseek2-iq4_ks_r4": dict(arch="deepseek2", n_layer=2, n_embd=256, n_head=4, n_head_kv=4, head_dim=64,
                                     n_vocab=1024, n_ctx_train=4096, rms_eps=1e-6, rope_base=1e4, n_ff=128,
                                     n_expert=8, n_expert_used=2, n_ff_exp=256, q_lora_rank=32, kv_lora_rank=32,
                                     rope_dim=32, v_head_dim=32, n_layer_dense_lead=1, n_expert_shared=1,
                                     expert_gating="sigmoid", expert_weights_scale=2.5, n_expert_groups=2,
                                     n_group_used=1, mix="iq4_ks_r4"),
    # gpt-oss's layout, tiny: biased attention with sinks, a sliding window of 8 on the even layers, YaRN,
    # a biased router (softmax over the top-k) and biased clamped-SwiGLU experts
    "tiny-gpt-oss": dict(arch="gpt-oss", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_vocab=1024,
                         n_ctx_train=4096, rms_eps=1e-5, rope_base=150000.0, n_expert=8, n_expert_used=2,
                         n_ff_exp=32, sliding_window=8, swa_pattern=2, expert_gating="softmax_topk",
                         norm_topk_prob=False,
                         rope_yarn=dict(factor=4.0, orig_ctx=1024, beta_fast=32.0, beta_slow=1.0,
                                        mscale_all_dim=0.0, truncate=False),
                         expert_type=GGMLType.Q4_0, other_type=GGMLType.Q8_0),
    # gpt-oss-20b's shape (models/catalog.py: 24 layers of 32 experts, 4 used, 2880 x 2880; a 128-token window on
    # every other layer) in ggml-org's types: experts MXFP4, the rest Q8_0: 11.3 GiB
    "gpt-oss-20b": dict(_catalog_fields("gpt-oss-20b"), expert_type=GGMLType.MXFP4, other_type=GGMLType.Q8_0),
    # dense qwen3, small: exercises the dense path
    "tiny-dense": dict(arch="qwen3", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_vocab=1024,
                       n_ctx_train=4096, rms_eps=1e-6, rope_base=1e6, n_ff=128,
                       expert_type=GGMLType.Q4_0, other_type=GGMLType.Q8_0),
}


def cache_dir() -> str:
    return str(env.cache_dir() / "models")


def preset_mix(name: str) -> str | None:
    """The per-tensor type mix (models/mixes.py) of a preset, or None (experts one type, the rest another)."""
    m = PRESETS[name].get("mix") if name in PRESETS else None
    return _MIX.get(m, m)


def preset_config(name: str) -> tuple[ModelConfig, GGMLType, GGMLType]:
    """(config, expert type, other type); for a mix preset, the types its mix gives blk.1's ffn_up_exps and
    attn_q (the mix itself: preset_mix)."""
    if name not in PRESETS:
        raise HybridMoeError(f"unknown synthetic preset {name!r}; presets: {', '.join(PRESETS)}")
    p = dict(PRESETS[name])
    mix = preset_mix(name)
    p.pop("mix", None)
    if mix:
        et, ot = mix_type(mix, "blk.1.ffn_up_exps.weight", (2, 2)), mix_type(mix, "blk.1.attn_q.weight", (2, 2))
    else:
        et, ot = p.pop("expert_type"), p.pop("other_type")
    qwen = p["arch"] in ("qwen3", "qwen3moe")
    cfg = ModelConfig(**p, qk_norm=qwen, rope_neox=qwen or p["arch"] == "gpt-oss", name=f"synth-{name}")
    return cfg, et, ot


def config_metadata(cfg: ModelConfig) -> dict:
    """The GGUF metadata keys llama.cpp writes for this config (arch-prefixed)."""
    a = cfg.arch
    md = {
        f"{a}.block_count": cfg.n_layer, f"{a}.context_length": cfg.n_ctx_train,
        f"{a}.embedding_length": cfg.n_embd, f"{a}.attention.head_count": cfg.n_head,
        f"{a}.attention.head_count_kv": cfg.n_head_kv, f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim, f"{a}.rope.freq_base": float(cfg.rope_base),
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_eps),
    }
    if cfg.n_ff:
        md[f"{a}.feed_forward_length"] = cfg.n_ff
    if cfg.is_moe:
        md.update({f"{a}.expert_count": cfg.n_expert, f"{a}.expert_used_count": cfg.n_expert_used,
                   f"{a}.expert_feed_forward_length": cfg.n_ff_exp})
    if a == "deepseek2":
        md.update({f"{a}.attention.value_length": cfg.v_head_dim, f"{a}.rope.dimension_count": cfg.rope_dim,
                   f"{a}.attention.kv_lora_rank": cfg.kv_lora_rank,
                   f"{a}.leading_dense_block_count": cfg.n_layer_dense_lead,
                   f"{a}.expert_shared_count": cfg.n_expert_shared,
                   f"{a}.expert_gating_func": 2 if cfg.expert_gating == "sigmoid" else 1,
                   f"{a}.expert_weights_scale": float(cfg.expert_weights_scale),
                   f"{a}.expert_weights_norm": bool(cfg.norm_topk_prob),
                   f"{a}.expert_group_count": cfg.n_expert_groups, f"{a}.expert_group_used_count": cfg.n_group_used})
        if cfg.q_lora_rank:
            md[f"{a}.attention.q_lora_rank"] = cfg.q_lora_rank
    if a == "gpt-oss":
        md[f"{a}.attention.sliding_window"] = cfg.sliding_window
    if cfg.rope_yarn and cfg.rope_yarn.get("type") == "linear":
        md.update({f"{a}.rope.scaling.type": "linear", f"{a}.rope.scaling.factor": float(cfg.rope_yarn["factor"])})
    elif cfg.rope_yarn:
        y = cfg.rope_yarn
        md.update({f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": float(y["factor"]),
                   f"{a}.rope.scaling.original_context_length": int(y["orig_ctx"]),
                   f"{a}.rope.scaling.yarn_beta_fast": float(y["beta_fast"]),
                   f"{a}.rope.scaling.yarn_beta_slow": float(y["beta_slow"]),
                   f"{a}.rope.scaling.yarn_log_multiplier": 0.1 * float(y["mscale_all_dim"])})
    return md


def synth_tensors(cfg: ModelConfig, expert_type, other_type, seed: int, mix: str | None = None,
                  depth: int | None = None):
    """(name, shape, type, make) of every tensor: types from `mix` (models/mixes.py) when given, else experts
    `expert_type` and the other matrices `other_type`; random weights of a trained layer's magnitude. depth:
    the stack whose residual scaling the layers take (default cfg.n_layer; calibrate's few-layer models take
    the 48-layer model's, so that each of their layers routes as one of its layers does)."""
    from ..quant.random_blocks import random_tensor
    gen = torch.Generator().manual_seed(seed)
    depth = depth or cfg.n_layer
    out = []
    for name, shape in tensor_shapes(cfg):
        qt = mix_type(mix, name, shape) if mix else default_qtype(name, shape, expert_type, other_type)
        if name.endswith(".bias") or "attn_sinks" in name:
            # biases small around 0; sinks of order 1, so that they take a visible share of the softmax
            sc = 0.5 if "attn_sinks" in name else 0.02
            make = (lambda s=shape, sc=sc: (sc * torch.randn(s, generator=gen)).float().view(torch.uint8))
        elif len(shape) == 1:
            # norms: around 1, never zero
            make = (lambda s=shape: (1.0 + 0.1 * torch.randn(s, generator=gen)).float().view(torch.uint8))
        else:
            scale = 1.0 if "token_embd" in name else 0.02
            if depth > 8 and ("attn_output" in name or "ffn_down" in name):
                # deep stacks: the residual branches' outputs scaled by 1 / n_layer. At 0.02 their sum over
                # 48 random layers grows a component shared by all tokens, and the deep layers routed a
                # 512-token prompt to 8-30 of 128 experts (a trained router spreads it over all of them);
                # at 0.02 / 48 every layer keeps all 128 busy (measured on the qwen3-30b-a3b shape)
                scale /= depth
            make = (lambda s=shape, q=qt, sc=scale: random_tensor(q, s, gen, scale=sc))
        out.append((name, shape, qt, make))
    return out


def write_synth(name: str, path: str):
    from ..text.builtin_vocab import builtin_vocab_metadata
    cfg, et, ot = preset_config(name)
    md = {"general.name": cfg.name, "general.type": "model", **config_metadata(cfg),
          **builtin_vocab_metadata(cfg.n_vocab)}
    write_gguf(path, cfg.arch, md, synth_tensors(cfg, et, ot, seed=1234, mix=preset_mix(name)))


def ensure_synth(name: str) -> str:
    """Path of the synthetic model `name`, written once into the cache folder."""
    preset_config(name)
    d = cache_dir()
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"synth-{name}-v{SYNTH_VERSION}.gguf")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".part")
        os.close(fd)
        try:
            write_synth(name, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def setup_arg_parser(p: argparse.ArgumentParser):
    p.add_argument("preset", choices=sorted(PRESETS), help="which synthetic model")
    p.add_argument("-o", "--output", help="file to write (default: the cache folder, as -m synth:PRESET uses)")


def main(args) -> int:
    if args.output:
        write_synth(args.preset, args.output)
        path = args.output
    else:
        path = ensure_synth(args.preset)
    print(path)
    return 0
