"""The architectures hybridmoe runs, and the decoder each one gets."""
from __future__ import annotations

from ..config import ModelConfig
from ..runtime.scheduler import Scheduler
from ..runtime.weights import QTensor
from .decoder import Decoder
from .gpt_oss import GptOssDecoder


def build_decoder(cfg: ModelConfig, weights: dict[str, QTensor], sched: Scheduler) -> Decoder:
    """llama, qwen3, qwen3moe and deepseek2 share models/decoder.py; gpt-oss has a block of its own."""
    if cfg.arch == "gpt-oss":
        return GptOssDecoder(cfg, weights, sched)
    return Decoder(cfg, weights, sched)
