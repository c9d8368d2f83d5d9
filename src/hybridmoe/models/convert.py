"""HF safetensors (qwen3_moe, qwen3, llama, deepseek_v3, gpt_oss) -> GGUF, with GGUF's canonical names and
llama.cpp's layouts."""
from __future__ import annotations

import argparse
import json
import os
import re

import torch
from safetensors import safe_open

from ..config import ModelConfig, yarn_attn_factor
from ..errors import ModelFileError, progress
from ..formats.gguf_write import PROGRESS_BYTES, write_gguf
from ..quant.types import GGMLType
from .synth import config_metadata
from .tensors import default_qtype, tensor_shapes

HF_ARCH = {"qwen3_moe": "qwen3moe", "qwen3": "qwen3", "llama": "llama", "deepseek_v3": "deepseek2",
           "gpt_oss": "gpt-oss"}

# HF name (after model.layers.N.) -> GGUF name (after blk.N.)
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    # deepseek (MLA, shared experts)
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def hf_config(hf: dict) -> ModelConfig:
    mt = hf.get("model_type")
    if mt not in HF_ARCH:
        raise ModelFileError("config.json", f"model_type {mt!r} is not supported", f"supported: {', '.join(HF_ARCH)}")
    arch = HF_ARCH[mt]
    rope = hf.get("rope_parameters") or {}
    n_head = hf["num_attention_heads"]
    if arch == "gpt-oss":
        return gpt_oss_config(hf)
    if arch == "deepseek2":
        yarn = None
        if rope.get("rope_type", "default") == "yarn":
            if rope.get("mscale", 0) != rope.get("mscale_all_dim", 0) or rope.get("attention_factor"):
                raise ModelFileError("config.json", "YaRN with mscale != mscale_all_dim is not supported")
            yarn = dict(factor=rope["factor"], orig_ctx=rope["original_max_position_embeddings"],
                        beta_fast=rope.get("beta_fast") or 32, beta_slow=rope.get("beta_slow") or 1,
                        mscale_all_dim=rope.get("mscale_all_dim") or 0.0)
        elif rope.get("rope_type", "default") != "default":
            raise ModelFileError("config.json", f"RoPE scaling {rope.get('rope_type')!r} is not supported yet")
        nope, R = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        return ModelConfig(
            arch=arch, n_layer=hf["num_hidden_layers"], n_embd=hf["hidden_size"], n_head=n_head, n_head_kv=n_head,
            head_dim=nope + R, n_vocab=hf["vocab_size"], n_ctx_train=hf.get("max_position_embeddings", 4096),
            rms_eps=hf.get("rms_norm_eps", 1e-6), rope_base=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            n_ff=hf["intermediate_size"], n_expert=hf["n_routed_experts"], n_expert_used=hf["num_experts_per_tok"],
            n_ff_exp=hf["moe_intermediate_size"], norm_topk_prob=hf.get("norm_topk_prob", True), rope_neox=False,
            name=hf.get("_name_or_path") or "deepseek", q_lora_rank=hf.get("q_lora_rank") or 0,
            kv_lora_rank=hf["kv_lora_rank"], rope_dim=R, v_head_dim=hf["v_head_dim"],
            n_layer_dense_lead=hf.get("first_k_dense_replace", 0), n_expert_shared=hf.get("n_shared_experts", 0),
            expert_gating="sigmoid", expert_weights_scale=hf.get("routed_scaling_factor", 1.0),
            n_expert_groups=hf.get("n_group", 1), n_group_used=hf.get("topk_group", 1), rope_yarn=yarn)
    yarn = None
    scaling = rope if rope.get("rope_type") else hf.get("rope_scaling") or {}     # (older configs: rope_scaling)
    if (scaling.get("rope_type") or scaling.get("type")) == "yarn":   # llama.cpp's YaRN: rounded range, magnitude
        if scaling.get("attention_factor") or scaling.get("mscale") or scaling.get("mscale_all_dim") or \
                scaling.get("truncate", True) is False:
            raise ModelFileError("config.json", "YaRN with attention_factor, mscale or truncate=false is not "
                                 f"supported for {mt}", "GGUF carries the factor and the original context only")
        yarn = dict(factor=scaling["factor"], orig_ctx=scaling.get("original_max_position_embeddings") or
                    hf.get("max_position_embeddings", 4096), beta_fast=scaling.get("beta_fast") or 32,
                    beta_slow=scaling.get("beta_slow") or 1, mscale_all_dim=0.0,
                    attn_factor=yarn_attn_factor(scaling["factor"]))
    elif (scaling.get("rope_type") or scaling.get("type")) == "linear":
        yarn = dict(type="linear", factor=scaling["factor"])
    elif (scaling.get("rope_type") or scaling.get("type") or "default") != "default":
        raise ModelFileError("config.json", f"RoPE scaling {scaling.get('rope_type') or scaling.get('type')!r} is not "
                             f"supported for {mt}", "supported: none, linear, yarn")
    return ModelConfig(
        arch=arch, n_layer=hf["num_hidden_layers"], n_embd=hf["hidden_size"], n_head=n_head,
        n_head_kv=hf.get("num_key_value_heads", n_head),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head, n_vocab=hf["vocab_size"],
        n_ctx_train=hf.get("max_position_embeddings", 4096), rms_eps=hf.get("rms_norm_eps", 1e-6),
        rope_base=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        n_ff=hf.get("intermediate_size", 0) if arch != "qwen3moe" else 0,
        n_expert=hf.get("num_experts", hf.get("num_local_experts", 0)) if arch == "qwen3moe" else 0,
        n_expert_used=hf.get("num_experts_per_tok", 0) if arch == "qwen3moe" else 0,
        n_ff_exp=hf.get("moe_intermediate_size", 0) if arch == "qwen3moe" else 0,
        norm_topk_prob=hf.get("norm_topk_prob", True), rope_neox=arch != "llama",
        qk_norm=arch != "llama", name=hf.get("_name_or_path") or mt, rope_yarn=yarn,
    )


def gpt_oss_config(hf: dict) -> ModelConfig:
    """gpt-oss as llama.cpp runs it: what it fixes (SwiGLU constants, alternating sliding layers starting
    with a sliding one, YaRN from the attention factor's default) must hold, else the file would lie."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    n_layer, n_head = hf["num_hidden_layers"], hf["num_attention_heads"]
    if (hf.get("swiglu_alpha", 1.702), hf.get("swiglu_limit", 7.0)) != (1.702, 7.0):
        raise ModelFileError("config.json", "gpt-oss with swiglu_alpha/swiglu_limit other than 1.702/7.0",
                             "llama.cpp fixes those constants; GGUF has no key for them")
    swa = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]
    if hf.get("layer_types", swa) != swa:
        raise ModelFileError("config.json", "gpt-oss layer_types other than alternating sliding/full")
    if not hf.get("attention_bias", True):
        raise ModelFileError("config.json", "gpt-oss without attention biases is not supported")
    yarn = None
    if rope.get("rope_type", "default") == "yarn":
        if rope.get("attention_factor") or rope.get("mscale") or rope.get("mscale_all_dim") or \
                rope.get("truncate", True):
            raise ModelFileError("config.json", "gpt-oss YaRN with attention_factor, mscale or truncate=True "
                                 "is not supported")
        yarn = dict(factor=rope["factor"], orig_ctx=rope["original_max_position_embeddings"],
                    beta_fast=rope.get("beta_fast") or 32, beta_slow=rope.get("beta_slow") or 1,
                    mscale_all_dim=0.0, truncate=False)
    elif rope.get("rope_type", "default") != "default":
        raise ModelFileError("config.json", f"RoPE scaling {rope.get('rope_type')!r} is not supported yet")
    return ModelConfig(
        arch="gpt-oss", n_layer=n_layer, n_embd=hf["hidden_size"], n_head=n_head,
        n_head_kv=hf.get("num_key_value_heads", n_head), head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
        n_vocab=hf["vocab_size"], n_ctx_train=hf.get("max_position_embeddings", 4096),
        rms_eps=hf.get("rms_norm_eps", 1e-5), rope_base=rope.get("rope_theta", hf.get("rope_theta", 150000.0)),
        n_expert=hf["num_local_experts"], n_expert_used=hf["num_experts_per_tok"], n_ff_exp=hf["intermediate_size"],
        norm_topk_prob=False, rope_neox=True, name=hf.get("_name_or_path") or "gpt-oss",
        sliding_window=hf.get("sliding_window") or 0, swa_pattern=2, expert_gating="softmax_topk", rope_yarn=yarn)


_GPT_OSS_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}


def gpt_oss_tensor(key: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One transformers gpt-oss tensor under llama.cpp's names, in its layout: experts [E, out, in] with the
    interleaved gate_up split into gate (even columns) and up (odd), as llama.cpp's converter splits them."""
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", key)
    if m is None:
        return [(TOP_NAMES[key], t)] if key in TOP_NAMES else []
    b, rest = f"blk.{m[1]}.", m[2]
    if (a := re.match(r"^self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$", rest)):
        return [(f"{b}{_GPT_OSS_ATTN[a[1]]}.{a[2]}", t)]
    simple = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight":
              "post_attention_norm.weight", "self_attn.sinks": "attn_sinks.weight",
              "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
              "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}
    if rest in simple:
        return [(b + simple[rest], t)]
    if rest == "mlp.experts.down_proj":                                  # [E, F, H] -> [E, H, F]
        return [(b + "ffn_down_exps.weight", t.transpose(1, 2).contiguous())]
    if rest == "mlp.experts.gate_up_proj":                               # [E, H, 2F], gate/up interleaved
        return [(b + "ffn_gate_exps.weight", t[..., ::2].transpose(1, 2).contiguous()),
                (b + "ffn_up_exps.weight", t[..., 1::2].transpose(1, 2).contiguous())]
    if rest == "mlp.experts.gate_up_proj_bias":                          # [E, 2F]
        return [(b + "ffn_gate_exps.bias", t[..., ::2].contiguous()),
                (b + "ffn_up_exps.bias", t[..., 1::2].contiguous())]
    return []


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's rotate-half q/k rows -> GGUF's interleaved-pair layout (as llama.cpp's converter does)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_hf_tensors(hf_dir: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors under GGUF names, float32, experts stacked [E, out, in]."""
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        raise ModelFileError(hf_dir, "no .safetensors files", "save the model with save_pretrained")
    out, experts = {}, {}
    total = sum(os.path.getsize(os.path.join(hf_dir, fn)) for fn in files)
    with progress(f"reading {os.path.basename(os.path.normpath(hf_dir))}", total, "bytes",
                  enabled=None if total >= PROGRESS_BYTES else False) as bar:
        for fn in files:
            with safe_open(os.path.join(hf_dir, fn), "pt") as f:
                for k in f.keys():
                    t = f.get_tensor(k)
                    bar.advance(t.numel() * t.element_size())
                    t = t.float()
                    if cfg.arch == "gpt-oss":
                        named = gpt_oss_tensor(k, t)
                        if not named:
                            raise ModelFileError(fn, f"tensor {k!r} has no GGUF name", "the checkpoint is not a "
                                                 "plain gpt-oss model (MXFP4 blocks: dequantize it first)")
                        out.update(named)
                    elif m := _EXPERT_RE.match(k):
                        experts[(int(m[1]), m[3], int(m[2]))] = t
                    elif k in TOP_NAMES:
                        out[TOP_NAMES[k]] = t
                    elif (m := _LAYER_RE.match(k)) and m[2] in LAYER_NAMES:
                        out[f"blk.{m[1]}.{LAYER_NAMES[m[2]]}.weight"] = t
                    elif k.endswith(".mlp.gate.e_score_correction_bias"):
                        out[f"blk.{k.split('.')[2]}.exp_probs_b.bias"] = t
                    elif k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
                        i = int(k.split(".")[2])
                        if k.endswith("gate_up_proj"):                # fused [E, 2F, H] (transformers' in-memory form)
                            g, u = t.chunk(2, dim=1)
                            out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = g, u
                        else:
                            out[f"blk.{i}.ffn_down_exps.weight"] = t
                    else:
                        raise ModelFileError(fn, f"tensor {k!r} has no GGUF name", "the checkpoint is not a plain "
                                             f"{cfg.arch} model")
    for i in range(cfg.n_layer):
        for proj in ("gate", "up", "down"):
            parts = [experts.get((i, proj, e)) for e in range(cfg.n_expert)]
            if all(p is not None for p in parts) and parts:
                out[f"blk.{i}.ffn_{proj}_exps.weight"] = torch.stack(parts)
    if cfg.arch == "llama":
        for i in range(cfg.n_layer):
            q, k = f"blk.{i}.attn_q.weight", f"blk.{i}.attn_k.weight"
            out[q] = llama_permute(out[q], cfg.n_head)
            out[k] = llama_permute(out[k], cfg.n_head_kv)
    return out


def convert_hf(hf_dir: str, out_path: str, expert_type=GGMLType.F32, other_type=GGMLType.F32):
    from ..quant.ref import quantize
    from ..text.builtin_vocab import builtin_vocab_metadata, hf_tokenizer_to_metadata
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    cfg = hf_config(hf)
    tensors = read_hf_tensors(hf_dir, cfg)
    tok_json = os.path.join(hf_dir, "tokenizer.json")
    vocab = hf_tokenizer_to_metadata(tok_json, n_vocab=cfg.n_vocab) if os.path.exists(tok_json) else builtin_vocab_metadata(cfg.n_vocab)
    md = {"general.name": cfg.name, "general.type": "model", **config_metadata(cfg), **vocab}
    if cfg.is_moe and cfg.arch not in ("deepseek2", "gpt-oss"):
        md[f"{cfg.arch}.expert_weights_norm"] = bool(cfg.norm_topk_prob)
    plan = []
    for name, shape in tensor_shapes(cfg):
        if name not in tensors:
            if name == "output.weight":
                continue                                              # tied embeddings
            raise ModelFileError(hf_dir, f"tensor for {name} is missing")
        t = tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise ModelFileError(hf_dir, f"{name} has shape {list(t.shape)}, expected {list(shape)}")
        qt = default_qtype(name, shape, expert_type, other_type)
        plan.append((name, shape, qt, (lambda t=t, qt=qt: quantize(t, qt))))
    write_gguf(out_path, cfg.arch, md, plan)
    return cfg


def requantize(src: str, dst: str, qtype) -> str:
    """A copy of a GGUF file with every matrix re-quantized to `qtype` through float32 (llama-quantize's job, with
    the quantizers quant/ref.py has: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K); 1-D tensors are kept."""
    from ..formats.gguf import open_gguf
    from ..quant.dequant import dequantize
    from ..quant.ref import quantize
    from ..quant.types import row_bytes
    m = open_gguf(src)
    plan = []
    for name, info in m.tensors.items():
        if len(info.shape) < 2:
            plan.append((name, info.shape, info.qtype, lambda info=info: m.raw(info)))
            continue

        def make(info=info):
            rows = m.raw(info).view(-1, row_bytes(info.qtype, info.shape[-1]))
            return quantize(dequantize(rows, info.qtype, info.shape[-1]).reshape(info.shape), qtype)
        plan.append((name, info.shape, qtype, make))
    md = {k: v for k, v in m.metadata.items() if not k.startswith("split.")}   # one file, whatever the source
    write_gguf(dst, str(m.metadata["general.architecture"]), md, plan)
    return dst


def setup_arg_parser(p: argparse.ArgumentParser):
    p.add_argument("hf_dir", help="folder with config.json and *.safetensors")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--type", default="F32", help="type of experts and other matrices (F32, F16, BF16, Q8_0, Q4_0, Q4_K, ...)")
    p.add_argument("--expert-type", default=None, help="type of the experts (default: --type)")


def main(args) -> int:
    from ..errors import HybridMoeError
    try:
        other = GGMLType[args.type.upper()]
        expert = GGMLType[(args.expert_type or args.type).upper()]
    except KeyError as e:
        raise HybridMoeError(f"unknown type {e.args[0]}") from None
    convert_hf(args.hf_dir, args.output, expert, other)
    print(args.output)
    return 0
