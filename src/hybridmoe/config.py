"""ModelConfig: the architecture's dimensions, read from GGUF metadata."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ModelFileError, printable

ARCHITECTURES = ("qwen3moe", "qwen3", "llama", "deepseek2", "gpt-oss")


def yarn_attn_factor(factor: float) -> float:
    """YaRN's magnitude on cos/sin for a context stretched by `factor` (transformers' get_mscale, llama.cpp's
    rope): 0.1 ln(factor) + 1."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def _rope_scaling(m, arch: str, n_ctx_train: int, path: str) -> dict | None:
    """The file's RoPE scaling as ModelConfig.rope_yarn holds it (m: its validate.Meta), or None. YaRN for every
    architecture here; linear (position interpolation: every frequency over the factor, llama.cpp's freq_scale =
    1 / it) for the llama family. The llama family's YaRN (Qwen3's long-context files, e.g. 128K with factor 4
    over 32768) has llama.cpp's defaults: the original context is the training context where not given, and the
    magnitude 0.1 ln(factor) + 1 goes on cos/sin (llama.cpp's rope mscale, transformers' attention_factor);
    DeepSeek's and gpt-oss's come with their log multiplier."""
    from .formats import validate as v
    llama = arch in ("qwen3moe", "qwen3", "llama")
    scaling = m.text("rope.scaling.type", "none", limit=64)
    if scaling in ("none", ""):
        return None
    if scaling == "linear" and llama:
        return dict(type="linear", factor=m.real("rope.scaling.factor", lo=1.0, hi=1e6))
    if scaling != "yarn":
        raise ModelFileError(path, f"RoPE scaling {printable(scaling)} is not supported " +
                             (f"for {arch}" if llama else "yet"),
                             f"supported: none, {'linear, ' if llama else ''}yarn; plan and inspect work")
    factor = m.real("rope.scaling.factor", lo=1.0, hi=1e6)
    yarn = dict(factor=factor,
                orig_ctx=m.count("rope.scaling.original_context_length", *((n_ctx_train,) if llama else ()),
                                 hi=v.MAX_CTX),
                beta_fast=m.real("rope.scaling.yarn_beta_fast", 32.0, lo=0.0, hi=1e6, lo_open=True),
                beta_slow=m.real("rope.scaling.yarn_beta_slow", 1.0, lo=0.0, hi=1e6, lo_open=True))
    if llama:
        return {**yarn, "mscale_all_dim": 0.0, "attn_factor": yarn_attn_factor(factor)}
    # llama.cpp stores 0.1 * mscale_all_dim as the log multiplier
    yarn["mscale_all_dim"] = m.real("rope.scaling.yarn_log_multiplier", 0.0, lo=-100.0, hi=100.0) / 0.1
    if arch == "gpt-oss":
        # OpenAI's reference (and transformers' config, truncate=False) keeps the correction range unrounded
        yarn["truncate"] = False
    return yarn


def kv_slots(n_ctx: int, window: int, ubatch: int) -> int:
    """Token slots a layer's KV cache keeps: the whole context, or with a sliding window a ring of
    window - 1 + ubatch (every key a batch of up to `ubatch` tokens can see)."""
    return min(n_ctx, window - 1 + ubatch) if window else n_ctx


@dataclass
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    n_ff: int = 0                 # dense FFN (dense archs)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    norm_topk_prob: bool = True
    rope_neox: bool = True        # qwen: NeoX (rotate halves); llama: GPT-J style pairs in GGUF's permuted layout
    qk_norm: bool = False
    name: str = ""
    # deepseek2 (DeepSeek V2/V3/R1): multi-head latent attention, shared experts, sigmoid routing in groups
    q_lora_rank: int = 0          # 0: plain attn_q
    kv_lora_rank: int = 0
    rope_dim: int = 0             # the roped part of each q/k head (head_dim = nope + rope)
    v_head_dim: int = 0           # 0: head_dim
    n_layer_dense_lead: int = 0   # the first layers have a dense FFN
    n_expert_shared: int = 0
    expert_gating: str = "softmax"
    expert_weights_scale: float = 1.0
    n_expert_groups: int = 1
    n_group_used: int = 1
    # RoPE scaling, which every RoPE table takes (runtime/ops.rope_tables): YaRN's factor, orig_ctx, beta_fast,
    # beta_slow, mscale_all_dim[, truncate, attn_factor], or {"type": "linear", "factor": f}
    rope_yarn: dict | None = None
    # gpt-oss: biased attention with per-head sinks, sliding window on every swa_pattern-th layer pair,
    # router softmax over the top-k logits, clamped SwiGLU experts with biases
    sliding_window: int = 0       # 0: no sliding-window layers
    swa_pattern: int = 0          # layer i slides when i % swa_pattern < swa_pattern - 1 (llama.cpp's rule)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def is_swa_layer(self, i: int) -> bool:
        return bool(self.sliding_window and self.swa_pattern and i % self.swa_pattern < self.swa_pattern - 1)

    def window(self, i: int) -> int:
        """Layer i's sliding window, 0 for full attention."""
        return self.sliding_window if self.is_swa_layer(i) else 0

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @classmethod
    def from_metadata(cls, md: dict, path: str = "model", n_vocab: int | None = None) -> "ModelConfig":
        """The config a GGUF's metadata describes, every key read through formats.validate.Meta (typed, in
        range) and the keys checked against each other: a bad file is one ModelFileError."""
        from .formats import validate as v
        arch = v.architecture(md, path, ARCHITECTURES)
        m = v.Meta(md, path, arch + ".")
        n_embd = m.count("embedding_length", hi=v.MAX_EMBD)
        n_head = m.count("attention.head_count", hi=v.MAX_HEADS)
        head_dim = m.count("attention.key_length", n_embd // n_head or 1, hi=v.MAX_HEAD_DIM)
        if n_vocab is None:
            if m.has("vocab_size"):
                n_vocab = m.count("vocab_size", hi=v.MAX_VOCAB)
            else:
                n_vocab = len(v.Meta(md, path).str_array("tokenizer.ggml.tokens"))
        n_expert = m.count("expert_count", 0, lo=0, hi=v.MAX_EXPERTS)
        cfg = cls(
            arch=arch,
            n_layer=m.count("block_count", hi=v.MAX_LAYERS),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=m.count("attention.head_count_kv", n_head, hi=n_head),
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=m.count("context_length", 4096, hi=v.MAX_CTX),
            rms_eps=m.real("attention.layer_norm_rms_epsilon", 1e-6, lo=0.0, hi=1.0),
            rope_base=m.real("rope.freq_base", 10000.0, lo=0.0, lo_open=True),
            n_ff=m.count("feed_forward_length", 0, lo=0, hi=v.MAX_FF),
            n_expert=n_expert,
            n_expert_used=m.count("expert_used_count", 0, lo=0 if not n_expert else 1, hi=max(n_expert, 0)),
            n_ff_exp=m.count("expert_feed_forward_length", 0, lo=0, hi=v.MAX_FF),
            norm_topk_prob=m.flag("expert_weights_norm", True),
            rope_neox=arch in ("qwen3moe", "qwen3"),
            qk_norm=arch in ("qwen3moe", "qwen3"),
            name=v.model_name(md, arch),
        )
        if arch in ("qwen3", "llama") and not n_expert and cfg.n_ff < 1:
            raise m.fail("feed_forward_length", "is missing or 0", "a dense model needs its FFN width")
        if arch == "deepseek2":
            cfg.n_head_kv = cfg.n_head
            cfg.head_dim = m.count("attention.key_length", hi=v.MAX_HEAD_DIM)
            cfg.v_head_dim = m.count("attention.value_length", hi=v.MAX_HEAD_DIM)
            cfg.rope_dim = m.count("rope.dimension_count", hi=v.MAX_HEAD_DIM)
            cfg.q_lora_rank = m.count("attention.q_lora_rank", 0, lo=0, hi=v.MAX_EMBD)
            cfg.kv_lora_rank = m.count("attention.kv_lora_rank", hi=v.MAX_EMBD)
            cfg.n_layer_dense_lead = m.count("leading_dense_block_count", 0, lo=0, hi=cfg.n_layer)
            cfg.n_expert_shared = m.count("expert_shared_count", 0, lo=0, hi=v.MAX_EXPERTS)
            cfg.expert_gating = "sigmoid" if m.count("expert_gating_func", 1, lo=0, hi=3) == 2 else "softmax"
            cfg.expert_weights_scale = m.real("expert_weights_scale", 1.0, lo=0.0, hi=1e6, lo_open=True)
            cfg.norm_topk_prob = m.flag("expert_weights_norm", False)
            cfg.n_expert_groups = m.count("expert_group_count", 1, lo=0, hi=max(n_expert, 1)) or 1
            cfg.n_group_used = m.count("expert_group_used_count", 1, lo=0, hi=max(n_expert, 1)) or 1
            if not n_expert or cfg.n_layer_dense_lead == cfg.n_layer:
                if cfg.n_ff < 1:
                    raise m.fail("feed_forward_length", "is missing or 0", "dense layers need their FFN width")
            if cfg.n_layer_dense_lead and cfg.n_ff < 1:
                raise m.fail("feed_forward_length", "is missing or 0", "the leading dense layers need their FFN width")
        if arch == "gpt-oss":
            # llama.cpp's openai-moe: NeoX RoPE with YaRN, every other layer (the even ones) slides over
            # attention.sliding_window positions; SwiGLU constants are fixed there (no metadata key)
            cfg.rope_neox = True
            cfg.n_ff = 0                                  # feed_forward_length repeats the expert width
            cfg.head_dim = m.count("attention.key_length", n_embd // n_head or 1, hi=v.MAX_HEAD_DIM)
            if m.count("attention.value_length", cfg.head_dim, hi=v.MAX_HEAD_DIM) != cfg.head_dim:
                raise ModelFileError(path, "gpt-oss with value_length != key_length is not supported")
            cfg.sliding_window = m.count("attention.sliding_window", hi=v.MAX_CTX)
            cfg.swa_pattern = 2
            cfg.expert_gating = "softmax_topk"
            cfg.norm_topk_prob = False
        if arch in ("deepseek2", "gpt-oss", "qwen3moe", "qwen3", "llama"):
            cfg.rope_yarn = _rope_scaling(m, arch, cfg.n_ctx_train, path)
        if arch in ("qwen3moe", "gpt-oss") and not (cfg.n_expert and cfg.n_expert_used and cfg.n_ff_exp):
            raise ModelFileError(path, f"{arch} metadata lacks expert_count, expert_used_count or "
                                 "expert_feed_forward_length", "the file is incomplete")
        v.check_config(cfg, path)
        return cfg


# bytes per cached value of each KV cache type (-ctk / -ctv)
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}


def kv_bytes_per_position(cfg: ModelConfig, type_k: str = "f16", type_v: str = "f16") -> float:
    """KV cache bytes one layer stores per position. MLA (deepseek2) caches kv_lora_rank + the rope dims,
    K only; other attention K and V of every KV head."""
    if cfg.kv_lora_rank:
        return (cfg.kv_lora_rank + cfg.rope_dim) * KV_TYPE_BYTES[type_k]
    return cfg.n_head_kv * cfg.head_dim * (KV_TYPE_BYTES[type_k] + KV_TYPE_BYTES[type_v])
