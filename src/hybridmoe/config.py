"""ModelConfig: the architecture's dimensions, read from GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ModelFileError

ARCHITECTURES = ("qwen3moe", "qwen3", "llama", "deepseek2", "gpt-oss")


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
    rope_yarn: dict | None = None  # YaRN: factor, orig_ctx, beta_fast, beta_slow, mscale_all_dim[, truncate]
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
        arch = md.get("general.architecture")
        if arch is None:
            raise ModelFileError(path, "metadata key general.architecture is missing", "the file is not a model")
        arch = str(arch)
        if arch not in ARCHITECTURES:
            raise ModelFileError(path, f"architecture {arch!r} is not supported",
                                 f"supported: {', '.join(ARCHITECTURES)}")

        def get(key, default=None, required=True):
            full = f"{arch}.{key}"
            if full in md:
                return md[full]
            if required and default is None:
                raise ModelFileError(path, f"metadata key {full} is missing", f"a {arch} GGUF must have it")
            return default

        n_embd = int(get("embedding_length"))
        n_head = int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", n_embd // n_head))
        if n_vocab is None:
            toks = md.get("tokenizer.ggml.tokens")
            n_vocab = int(get("vocab_size", len(toks) if toks is not None else None))
        cfg = cls(
            arch=arch,
            n_layer=int(get("block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(get("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=int(get("context_length", 4096)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_base=float(get("rope.freq_base", 10000.0)),
            n_ff=int(get("feed_forward_length", 0)),
            n_expert=int(get("expert_count", 0)),
            n_expert_used=int(get("expert_used_count", 0)),
            n_ff_exp=int(get("expert_feed_forward_length", 0)),
            norm_topk_prob=bool(get("expert_weights_norm", True)),
            rope_neox=arch in ("qwen3moe", "qwen3"),
            qk_norm=arch in ("qwen3moe", "qwen3"),
            name=str(md.get("general.name", arch)),
        )
        if arch == "deepseek2":
            cfg.n_head_kv = cfg.n_head
            cfg.head_dim = int(get("attention.key_length"))
            cfg.v_head_dim = int(get("attention.value_length"))
            cfg.rope_dim = int(get("rope.dimension_count"))
            cfg.q_lora_rank = int(get("attention.q_lora_rank", 0, required=False))
            cfg.kv_lora_rank = int(get("attention.kv_lora_rank"))
            cfg.n_layer_dense_lead = int(get("leading_dense_block_count", 0, required=False))
            cfg.n_expert_shared = int(get("expert_shared_count", 0, required=False))
            cfg.expert_gating = "sigmoid" if int(get("expert_gating_func", 1, required=False)) == 2 else "softmax"
            cfg.expert_weights_scale = float(get("expert_weights_scale", 1.0, required=False))
            cfg.norm_topk_prob = bool(get("expert_weights_norm", False, required=False))
            cfg.n_expert_groups = int(get("expert_group_count", 1, required=False)) or 1
            cfg.n_group_used = int(get("expert_group_used_count", 1, required=False)) or 1
        if arch == "gpt-oss":
            # llama.cpp's openai-moe: NeoX RoPE with YaRN, every other layer (the even ones) slides over
            # attention.sliding_window positions; SwiGLU constants are fixed there (no metadata key)
            cfg.rope_neox = True
            cfg.n_ff = 0                                  # feed_forward_length repeats the expert width
            cfg.head_dim = int(get("attention.key_length", n_embd // n_head))
            if int(get("attention.value_length", cfg.head_dim, required=False)) != cfg.head_dim:
                raise ModelFileError(path, "gpt-oss with value_length != key_length is not supported")
            cfg.sliding_window = int(get("attention.sliding_window"))
            cfg.swa_pattern = 2
            cfg.expert_gating = "softmax_topk"
            cfg.norm_topk_prob = False
        if arch in ("deepseek2", "gpt-oss"):
            scaling = str(md.get(f"{arch}.rope.scaling.type", "none"))
            if scaling == "yarn":
                cfg.rope_yarn = dict(
                    factor=float(get("rope.scaling.factor")),
                    orig_ctx=int(get("rope.scaling.original_context_length")),
                    beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0, required=False)),
                    beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0, required=False)),
                    # llama.cpp stores 0.1 * mscale_all_dim as the log multiplier
                    mscale_all_dim=float(get("rope.scaling.yarn_log_multiplier", 0.0, required=False)) / 0.1)
                if arch == "gpt-oss":
                    # OpenAI's reference (and transformers' config, truncate=False) keeps the correction
                    # range unrounded
                    cfg.rope_yarn["truncate"] = False
            elif scaling not in ("none", ""):
                raise ModelFileError(path, f"RoPE scaling {scaling!r} is not supported yet",
                                     "supported: none, yarn; plan and inspect work")
        if arch in ("qwen3moe", "gpt-oss") and not (cfg.n_expert and cfg.n_expert_used and cfg.n_ff_exp):
            raise ModelFileError(path, f"{arch} metadata lacks expert_count, expert_used_count or "
                                 "expert_feed_forward_length", "the file is incomplete")
        if cfg.n_head % cfg.n_head_kv:
            raise ModelFileError(path, f"head_count {cfg.n_head} is not a multiple of head_count_kv {cfg.n_head_kv}")
        return cfg
