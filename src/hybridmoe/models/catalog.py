"""Tensor records of well-known MoE models that are not on disk, for planning and dry runs.

`catalog_model("qwen3-235b-a22b")` gives a config and {name: TensorInfo} with the real GGUF names and
shapes, typed like a Q4_K_M quant as llama.cpp writes it (gpt-oss: as ggml-org ships it, experts MXFP4,
the other matrices Q8_0):
  experts Q4_K, with ffn_down_exps Q6_K on llama.cpp's "more bits" layers (first and last eighth, every
  third in between); attention and shared experts Q8_0; dense FFN Q4_K (down Q6_K on the same layers);
  token_embd Q4_K; output Q6_K; norms, biases and the router (ffn_gate_inp) F32.
`with_types` (or "NAME:EXPERT_TYPE[:OTHER_TYPE]") retypes experts and/or the other matrices;
"NAME:MIX" types every tensor by one of models/mixes.py's per-tensor recipes of published files
(e.g. deepseek-r1:UD-Q2_K_XL, deepseek-r1:IQ4_KS_R4, qwen3-30b-a3b:Q3_K_XL).

deepseek2 is not an architecture ModelConfig can run, so its config is a PlanConfig: a ModelConfig with
the extra fields placement needs (MLA's kv_lora_rank and rope dims size its KV cache).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ARCHITECTURES, ModelConfig
from ..errors import HybridMoeError
from ..formats.gguf import TensorInfo, tensor_info_from_shape
from ..quant.types import GGMLType, block_size
from .mixes import find_mix, mix_names, mix_type
from .tensors import tensor_shapes

T = GGMLType


@dataclass
class PlanConfig(ModelConfig):
    """ModelConfig plus what placement needs for architectures hybridmoe can plan but not run (yet)."""
    kv_lora_rank: int = 0          # MLA: the cache holds kv_lora_rank + rope_dim values per token (K only)
    q_lora_rank: int = 0
    rope_dim: int = 0
    n_layer_dense_lead: int = 0    # deepseek2: the first N layers have a dense FFN
    n_expert_shared: int = 0
    n_ff_shexp: int = 0


def _qwen3moe(name, n_layer, n_embd, n_head, n_head_kv, n_expert, n_used, n_ff_exp, n_ff):
    return ModelConfig(arch="qwen3moe", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                       head_dim=128, n_vocab=151936, n_ctx_train=40960, rms_eps=1e-6, rope_base=1e6, n_ff=n_ff,
                       n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp, norm_topk_prob=True,
                       rope_neox=True, qk_norm=True, name=name)


def _gpt_oss(name, n_layer, n_expert):
    return ModelConfig(arch="gpt-oss", n_layer=n_layer, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64,
                       n_vocab=201088, n_ctx_train=131072, rms_eps=1e-5, rope_base=150000.0, n_expert=n_expert,
                       n_expert_used=4, n_ff_exp=2880, norm_topk_prob=False, rope_neox=True, qk_norm=False,
                       sliding_window=128, swa_pattern=2, expert_gating="softmax_topk",
                       rope_yarn=dict(factor=32.0, orig_ctx=4096, beta_fast=32.0, beta_slow=1.0,
                                      mscale_all_dim=0.0, truncate=False), name=name)


def gpt_oss_type(name: str, shape: tuple[int, ...]) -> GGMLType:
    """The types of ggml-org's gpt-oss GGUFs: experts MXFP4 (as OpenAI ships them), the other matrices
    Q8_0; norms, biases, sinks and the router F32."""
    if len(shape) == 1 or ".ffn_gate_inp." in name:
        return T.F32
    return T.MXFP4 if "_exps." in name else T.Q8_0


def _deepseek_r1() -> PlanConfig:
    return PlanConfig(arch="deepseek2", n_layer=61, n_embd=7168, n_head=128, n_head_kv=128, head_dim=192,
                      n_vocab=129280, n_ctx_train=163840, rms_eps=1e-6, rope_base=10000.0, n_ff=18432,
                      n_expert=256, n_expert_used=8, n_ff_exp=2048, norm_topk_prob=True, rope_neox=False,
                      qk_norm=False, name="DeepSeek-R1", kv_lora_rank=512, q_lora_rank=1536, rope_dim=64,
                      n_layer_dense_lead=3, n_expert_shared=1, n_ff_shexp=2048)


def deepseek2_shapes(cfg: PlanConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, torch-order shape) of every tensor of a deepseek2 (DeepSeek-V3/R1) GGUF, in file order."""
    H, nh = cfg.n_embd, cfg.n_head
    qk_nope = cfg.head_dim - cfg.rope_dim          # 128
    v_dim = qk_nope                                # DeepSeek-V3: v_head_dim 128
    out = [("token_embd.weight", (cfg.n_vocab, H))]
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (H,)),
            (b + "attn_q_a_norm.weight", (cfg.q_lora_rank,)),
            (b + "attn_kv_a_norm.weight", (cfg.kv_lora_rank,)),
            (b + "attn_q_a.weight", (cfg.q_lora_rank, H)),
            (b + "attn_q_b.weight", (nh * cfg.head_dim, cfg.q_lora_rank)),
            (b + "attn_kv_a_mqa.weight", (cfg.kv_lora_rank + cfg.rope_dim, H)),
            (b + "attn_kv_b.weight", (nh * (qk_nope + v_dim), cfg.kv_lora_rank)),
            (b + "attn_output.weight", (H, nh * v_dim)),
            (b + "ffn_norm.weight", (H,)),
        ]
        if i < cfg.n_layer_dense_lead:
            out += [(b + "ffn_gate.weight", (cfg.n_ff, H)), (b + "ffn_up.weight", (cfg.n_ff, H)),
                    (b + "ffn_down.weight", (H, cfg.n_ff))]
            continue
        E, F, S = cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp * cfg.n_expert_shared
        out += [
            (b + "ffn_gate_inp.weight", (E, H)),
            (b + "exp_probs_b.bias", (E,)),
            (b + "ffn_gate_exps.weight", (E, F, H)),
            (b + "ffn_up_exps.weight", (E, F, H)),
            (b + "ffn_down_exps.weight", (E, H, F)),
            (b + "ffn_gate_shexp.weight", (S, H)),
            (b + "ffn_up_shexp.weight", (S, H)),
            (b + "ffn_down_shexp.weight", (H, S)),
        ]
    out += [("output_norm.weight", (H,)), ("output.weight", (cfg.n_vocab, H))]
    return out


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: first and last eighth of the layers, and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(name: str, shape: tuple[int, ...], n_layer: int) -> GGMLType:
    """The type a Q4_K_M-style quant gives a tensor (see the module docstring)."""
    if len(shape) == 1 or ".ffn_gate_inp." in name:
        return T.F32
    if name.startswith("token_embd"):
        return T.Q4_K
    if name.startswith("output"):
        return T.Q6_K
    short = name.split(".")[2]
    layer = int(name.split(".")[1])
    if short in ("ffn_down_exps", "ffn_down"):
        return T.Q6_K if _more_bits(layer, n_layer) else T.Q4_K
    if short.endswith("_exps") or short in ("ffn_gate", "ffn_up"):
        return T.Q4_K
    return T.Q8_0     # attention, shared experts


def _record(name: str, shape: tuple[int, ...], qtype: GGMLType) -> TensorInfo:
    bs = block_size(qtype)
    if shape[-1] % bs:
        raise HybridMoeError(f"{name}: row length {shape[-1]} is not a multiple of {qtype.name}'s block size {bs}; "
                             "pick another type")
    return tensor_info_from_shape(name, tuple(shape), qtype)


def _type(t) -> GGMLType | None:
    if t is None or isinstance(t, GGMLType):
        return t
    try:
        return GGMLType[str(t).upper()]
    except KeyError:
        raise HybridMoeError(f"unknown ggml type {t!r} (e.g. Q4_K, Q6_K, Q8_0, Q4_0, BF16; or a mix: "
                             f"{', '.join(mix_names())})") from None


def with_types(tensors: dict[str, TensorInfo], expert=None, other=None) -> dict[str, TensorInfo]:
    """Retype the experts (ffn_*_exps) and/or every other matrix; norms, biases and the router stay F32."""
    expert, other = _type(expert), _type(other)
    out = {}
    for name, t in tensors.items():
        q = t.qtype
        if len(t.shape) > 1 and ".ffn_gate_inp." not in name:
            if "_exps." in name:
                q = expert or q
            else:
                q = other or q
        out[name] = t if q == t.qtype else _record(name, t.shape, q)
    return out


CATALOG = {
    "qwen3-30b-a3b": lambda: _qwen3moe("Qwen3-30B-A3B", 48, 2048, 32, 4, 128, 8, 768, 6144),
    "qwen3-235b-a22b": lambda: _qwen3moe("Qwen3-235B-A22B", 94, 4096, 64, 4, 128, 8, 1536, 12288),
    "deepseek-r1": _deepseek_r1,
    "gpt-oss-20b": lambda: _gpt_oss("gpt-oss-20b", 24, 32),
    "gpt-oss-120b": lambda: _gpt_oss("gpt-oss-120b", 36, 128),
}
ALIASES = {"deepseek-v3": "deepseek-r1", "deepseek-r1-0528": "deepseek-r1"}


def catalog_names() -> list[str]:
    return list(CATALOG)


def catalog_model(name: str, expert=None, other=None) -> tuple[ModelConfig, dict[str, TensorInfo]]:
    """(config, tensor records) of a catalog model; `name` may carry types, 'deepseek-r1:Q3_K[:Q8_0]', or a
    mix, 'deepseek-r1:UD-Q2_K_XL'."""
    key, *types = name.strip().lower().split(":")
    if len(types) > 2:
        raise HybridMoeError(f"catalog model {name!r}: write NAME[:EXPERT_TYPE[:OTHER_TYPE]] or NAME:MIX")
    key = ALIASES.get(key, key)
    if key not in CATALOG:
        raise HybridMoeError(f"no catalog model {key!r}; known: {', '.join(CATALOG)}")
    mix = find_mix(types[0]) if len(types) == 1 and not expert and not other else None
    if not mix:
        expert = expert or (types[0] if types else None)
        other = other or (types[1] if len(types) > 1 else None)
    cfg = CATALOG[key]()
    shapes = deepseek2_shapes(cfg) if cfg.arch == "deepseek2" else tensor_shapes(cfg)
    if mix:
        typed = (lambda n, s: mix_type(mix, n, s))
    else:
        typed = gpt_oss_type if cfg.arch == "gpt-oss" else (lambda n, s: q4_k_m_type(n, s, cfg.n_layer))
    tensors = {n: _record(n, s, typed(n, s)) for n, s in shapes}
    if expert or other:
        tensors = with_types(tensors, expert, other)
    return cfg, tensors


def config_for_planning(md: dict, path: str, tensors: dict[str, TensorInfo]) -> ModelConfig:
    """ModelConfig of a GGUF file; for architectures hybridmoe can't run, a PlanConfig from generic keys. Every
    key is read through formats.validate.Meta (typed, in range), and a supported architecture's tensors are
    checked against its metadata (validate.check_tensors), as load() checks them."""
    from ..formats import validate as v
    arch = v.architecture(md, path)
    if arch in ARCHITECTURES and arch != "deepseek2":
        cfg = ModelConfig.from_metadata(md, path)
        v.check_layer_count(tensors, cfg.n_layer, f"{arch}.block_count", path)
        v.check_tensors(tensors, tensor_shapes(cfg), arch, cfg.n_layer, path)
        return cfg
    # deepseek2 runs now, but planning keeps the generic reader: it sizes the KV cache as MLA stores it
    m = v.Meta(md, path, arch + ".")

    def count(key, default=v.MISSING, lo=1, hi=v.MAX_FF):
        return m.count(key, default, lo=lo, hi=hi, per_layer=True)     # per-layer arrays: the largest
    n_embd, n_head = count("embedding_length", hi=v.MAX_EMBD), count("attention.head_count", hi=v.MAX_HEADS)
    emb = tensors.get("token_embd.weight")
    if "tokenizer.ggml.tokens" in md:
        n_vocab = len(v.Meta(md, path).str_array("tokenizer.ggml.tokens"))
    elif emb is not None:
        n_vocab = emb.shape[0]
    else:
        n_vocab = count("vocab_size", hi=v.MAX_VOCAB)
    n_shared = count("expert_shared_count", 0, lo=0, hi=v.MAX_EXPERTS)
    kv_lora = count("attention.kv_lora_rank", 0, lo=0, hi=v.MAX_EMBD)
    n_expert = count("expert_count", 0, lo=0, hi=v.MAX_EXPERTS)
    n_layer = count("block_count", hi=v.MAX_LAYERS)
    v.check_layer_count(tensors, n_layer, f"{arch}.block_count", path)
    cfg = PlanConfig(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=count("attention.head_count_kv", n_head, hi=v.MAX_HEADS),
        head_dim=count("attention.key_length", n_embd // n_head or 1, hi=v.MAX_HEAD_DIM), n_vocab=n_vocab,
        n_ctx_train=count("context_length", 4096, hi=v.MAX_CTX),
        rms_eps=m.real("attention.layer_norm_rms_epsilon", 1e-6, lo=0.0, hi=1.0),
        rope_base=m.real("rope.freq_base", 10000.0, lo=0.0, lo_open=True),
        n_ff=count("feed_forward_length", 0, lo=0),
        n_expert=n_expert, n_expert_used=count("expert_used_count", 0, lo=0, hi=max(n_expert, 0)),
        n_ff_exp=count("expert_feed_forward_length", 0, lo=0), name=v.model_name(md, arch),
        kv_lora_rank=kv_lora, q_lora_rank=count("attention.q_lora_rank", 0, lo=0, hi=v.MAX_EMBD),
        rope_dim=count("rope.dimension_count", 0, lo=0, hi=v.MAX_HEAD_DIM) if kv_lora else 0,
        n_layer_dense_lead=count("leading_dense_block_count", 0, lo=0, hi=n_layer), n_expert_shared=n_shared,
        n_ff_shexp=count("expert_feed_forward_length", 0, lo=0) if n_shared else 0)
    if cfg.n_head % cfg.n_head_kv:
        raise m.fail("attention.head_count_kv", f"found {cfg.n_head_kv}, expected a divisor of head_count {cfg.n_head}")
    if n_expert and not 1 <= cfg.n_expert_used <= n_expert:
        raise m.fail("expert_used_count", f"found {cfg.n_expert_used}, expected 1..expert_count ({n_expert})")
    return cfg
