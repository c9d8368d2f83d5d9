"""Small shared ops of the decoder, written with as few torch calls as possible: in decode every call is
dispatch overhead (~10 us each on the GPU machine's CPU) and, on a GPU, one kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 RMSNorm over the last dim, one fused op."""
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps)


def rope_tables(positions: torch.Tensor, head_dim: int, base: float, neox: bool):
    """cos, sin [T, 1, D] laid out to match rotate() for the model's RoPE style, in float32."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]                 # [T, D/2]
    ang = torch.cat((ang, ang), -1) if neox else ang.repeat_interleave(2, -1)
    return ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x [T, n_head, D]. NeoX rotates the two halves; llama's GGUF layout rotates adjacent pairs."""
    if neox:
        x1, x2 = x.chunk(2, dim=-1)
        rot = torch.cat((-x2, x1), dim=-1)
    else:
        rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return torch.addcmul(x * cos, rot, sin)
