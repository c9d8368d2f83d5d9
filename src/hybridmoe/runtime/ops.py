"""Small shared ops of the decoder, written with as few torch calls as possible: in decode every call is
dispatch overhead (~10 us each on the GPU machine's CPU) and, on a GPU, one kernel."""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from ..config import yarn_attn_factor


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 RMSNorm over the last dim, one fused op."""
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps)


def rope_tables(positions: torch.Tensor, head_dim: int, base: float, neox: bool, yarn: dict | None = None):
    """cos, sin [T, 1, D] laid out to match rotate() for the model's RoPE style, in float32. yarn (the config's
    rope_yarn): YaRN's frequencies, and its "attn_factor" (where the config sets one) on both tables, so q.k
    grows by its square; or linear scaling, every frequency divided by the factor."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    if yarn and yarn.get("type") == "linear":
        inv = inv / yarn["factor"]
    elif yarn:
        inv = yarn_inv_freq(inv, head_dim, base, yarn)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]                 # [T, D/2]
    ang = torch.cat((ang, ang), -1) if neox else ang.repeat_interleave(2, -1)
    m = yarn.get("attn_factor", 1.0) if yarn else 1.0    # YaRN's magnitude on cos/sin (llama.cpp's rope mscale)
    return (ang.cos() * m).float()[:, None, :], (ang.sin() * m).float()[:, None, :]


@functools.lru_cache(maxsize=4)
def context_rope_tables(n_ctx: int, head_dim: int, base: float, neox: bool, device: torch.device,
                        yarn: tuple | None = None):
    """cos, sin [n_ctx, D] of every position of a context, on `device`: what the static decode and prompt
    steps index with the position they read from device memory (built once for both; the last four kept).
    yarn: yarn_key of the config's YaRN parameters."""
    cos, sin = rope_tables(torch.arange(n_ctx), head_dim, base, neox, dict(yarn) if yarn else None)
    return cos[:, 0].to(device), sin[:, 0].to(device)


def yarn_key(yarn: dict | None) -> tuple | None:
    """YaRN's parameters as a hashable key (context_rope_tables caches by its arguments)."""
    return tuple(sorted(yarn.items())) if yarn else None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x [T, n_head, D]. NeoX rotates the two halves; llama's GGUF layout rotates adjacent pairs."""
    if neox:
        x1, x2 = x.chunk(2, dim=-1)
        rot = torch.cat((-x2, x1), dim=-1)
    else:
        rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return torch.addcmul(x * cos, rot, sin)


def yarn_inv_freq(inv: torch.Tensor, dim: int, base: float, yarn: dict) -> torch.Tensor:
    """YaRN: interpolated frequencies (divided by the factor) for the slow dimensions, the original ones
    for the fast, a linear ramp between (the YaRN paper; DeepSeek V2/V3 use it)."""
    def corr_dim(rot):
        return dim * math.log(yarn["orig_ctx"] / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = corr_dim(yarn["beta_fast"]), corr_dim(yarn["beta_slow"])
    if yarn.get("truncate", True):                   # gpt-oss keeps the range unrounded (truncate=False)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device=inv.device) - low) / max(high - low, 1e-3)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv / yarn["factor"] * (1 - extrapolate) + inv * extrapolate


def yarn_rope_mscale(yarn: dict | None) -> float:
    """YaRN's magnitude factor on cos/sin when no mscale_all_dim is given (gpt-oss): 0.1 ln(factor) + 1,
    so q.k grows by its square (transformers' attention_factor, llama.cpp's rope mscale)."""
    if not yarn or yarn["factor"] <= 1 or yarn.get("mscale_all_dim"):
        return 1.0
    return yarn_attn_factor(yarn["factor"])


def yarn_softmax_mscale(yarn: dict | None) -> float:
    """The attention-logit multiplier YaRN asks for (mscale_all_dim squared, as DeepSeek applies it)."""
    if not yarn or yarn["factor"] <= 1 or not yarn.get("mscale_all_dim"):
        return 1.0
    m = 0.1 * yarn["mscale_all_dim"] * math.log(yarn["factor"]) + 1.0
    return m * m


def gpu_kernels():
    """kernels/gpu_decode.py where Triton is installed, else None (imported at first use: importing Triton
    is slow, and CPU-only runs never need it)."""
    from ..kernels import gpu_decode as gd
    return gd if gd.available() else None


def gpu_batch_kernels(dev):
    """kernels/gpu_batch_attention.py where its kernels can run on Device dev: a GPU with Triton installed, or
    a fake GPU under Triton's interpreter (TRITON_INTERPRET=1); else None."""
    if not dev.is_gpu or (dev.fake and os.environ.get("TRITON_INTERPRET") != "1"):
        return None
    from ..kernels import gpu_batch_attention as ga
    return ga if ga.available() else None


def cpu_has(flag: str) -> bool:
    """Whether this machine's CPU has an instruction-set flag of /proc/cpuinfo's (e.g. amx_bf16)."""
    from ..kernels.cpu import _FLAGS
    return flag in _FLAGS
