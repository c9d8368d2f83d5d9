"""The static steps: a layer loop specialised to one placement, built once per KV cache, that replaces the eager
decoder (models/) where it applies.

- `gpu_decode.StaticDecoder`: a decode step as CUDA graphs between the CPU-expert hand-offs;
- `cpu_decode.CpuDecoder`: a decode step on the CPU as one C call a token;
- `gpu_prefill.StaticPrefill`: a prompt ubatch as one CUDA graph when every weight is on one GPU.

A constructor that finds the model or placement outside what its step covers raises NotApplicable, and the
eager decoder runs instead."""
from __future__ import annotations

import math
from typing import Protocol

import torch


class NonFinite(ValueError):
    """decode_batch's step ran (the caches written) but some logits are not finite: out [B, n_vocab], distinct."""

    def __init__(self, out: torch.Tensor, distinct: list[int]):
        super().__init__("some logits are not finite")
        self.out, self.distinct = out, distinct


def all_finite(x: torch.Tensor) -> bool:
    """Whether every value of x is finite. Its sum is finite when they all are (NaN and inf carry through a sum),
    unless finite values overflow it: then the exact test decides. The sum reads x once, where torch.isfinite
    (a bool tensor, then all()) costs ~35x as much on the CPU (~1 ms for a 152k vocabulary's logits)."""
    return math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all())


class NotApplicable(Exception):
    """This static step does not cover the model or placement; the eager decoder runs."""


class DecodeStep(Protocol):
    def step(self, token: int, pos: int) -> torch.Tensor:
        """Logits of `token` at position `pos`, its keys and values written to the cache."""


class PromptStep(Protocol):
    def forward(self, tokens: torch.Tensor, pos0: int, all_logits: bool) -> torch.Tensor:
        """Logits of a prompt chunk that starts at pos0 (every row, or the last only)."""
