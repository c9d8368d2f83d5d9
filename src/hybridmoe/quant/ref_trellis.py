"""Reference (pure torch) dequantizers for ik_llama.cpp's trellis types IQ1_KT .. IQ4_KT.

Format (ik_llama.cpp since PR #529, 2025-06-18, the "integer trellis"): a row is a float32 header `d`
followed by 256-element blocks. Every group of 8 (IQ4_KT: 4) weights is one 13..16-bit index `i`;
the group's values come from the generator

    x = i + offset                       (uint32; offset 4096, or 4096 + 32768 for some IQ4_KT blocks)
    repeat per value:  x = x * 0xCBAC1FED  (mod 2^32)
                       v = (sum of the 4 bytes of x & 0x3F3F3F3F) - 126      (an integer in -126..126)

and a weight is float32(block_scale) * v, with block_scale = d * (a per-32 block code). IQ3_KT uses |v|
and a separate sign bit per weight. All arithmetic is exact integer math except the two float32
products (d * code, then * v), which are done in that order, so results are bit-exact with
ik_llama.cpp's dequantize_row_iq*_kt. Files quantized before PR #529 used a different (fp16) trellis
and decode to different values; they cannot be told apart by type id.

uint32 arithmetic is emulated in int64: products are split into 16-bit halves so no intermediate
exceeds 2^49, then masked to 32 bits. Pure torch ops: runs on CPU and CUDA.
"""
from __future__ import annotations

import torch

QK_K = 256
_KA = 0xCBAC1FED
_M32 = 0xFFFFFFFF
_IQ4K_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# bytes of one 256-block (the row adds a 4-byte float header in front of all blocks)
BLOCK_BYTES = {"IQ1_KT": 56, "IQ2_KT": 68, "IQ3_KT": 100, "IQ4_KT": 128}
ROW_HEADER_BYTES = 4


def row_bytes(name: str, n_cols: int) -> int:
    """Bytes of one row of `n_cols` weights, header included (what the GGUF file stores)."""
    if n_cols % QK_K:
        raise ValueError(f"{name}: row length {n_cols} is not a multiple of {QK_K}")
    return ROW_HEADER_BYTES + n_cols // QK_K * BLOCK_BYTES[name]


def _mul32(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding uint32 values, without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _powers(n: int, device) -> torch.Tensor:
    """[ka^1, ..., ka^n] mod 2^32 as int64: x_k = ka^k * x_0, so all n steps run in parallel."""
    p, out = 1, []
    for _ in range(n):
        p = (p * _KA) & _M32
        out.append(p)
    return torch.tensor(out, dtype=torch.int64, device=device)


def trellis_values(idx: torch.Tensor, group: int, offset: torch.Tensor | int = 4096) -> torch.Tensor:
    """Generator output for trellis indices: int tensor [...] -> int64 [..., group], values -126..126."""
    x0 = idx.to(torch.int64) + offset
    x = _mul32(x0.unsqueeze(-1), _powers(group, idx.device))
    s = x & 0x3F3F3F3F
    return (s & 0xFF) + ((s >> 8) & 0xFF) + ((s >> 16) & 0xFF) + (s >> 24) - 126


def _u16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2k] bytes -> [..., k] little-endian uint16 values as int64."""
    b = b.to(torch.int64)
    return b[..., 0::2] | (b[..., 1::2] << 8)


def _u32(b: torch.Tensor) -> torch.Tensor:
    b = b.to(torch.int64)
    return b[..., 0::4] | (b[..., 1::4] << 8) | (b[..., 2::4] << 16) | (b[..., 3::4] << 24)


def _split(raw: torch.Tensor, name: str, n_cols: int):
    """raw rows -> (d float32 [R, 1, 1], blocks uint8 [R, nb, block_bytes])."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(name, n_cols):
        raise ValueError(f"{name}: expected uint8 [rows, {row_bytes(name, n_cols)}], "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    raw = raw.contiguous()
    d = raw[:, :4].contiguous().view(torch.float32).reshape(-1, 1, 1)
    return d, raw[:, 4:].reshape(raw.shape[0], n_cols // QK_K, BLOCK_BYTES[name])


def _iq4k_table(device) -> torch.Tensor:
    return torch.tensor(_IQ4K_VALUES, dtype=torch.float32, device=device)


def _nib_scales(sc: torch.Tensor) -> torch.Tensor:
    """[R, nb, 4] bytes -> [R, nb, 8] nibbles: blocks 0..3 are low nibbles, blocks 4..7 high ones."""
    return torch.cat([sc & 0xF, sc >> 4], dim=-1).long()


def _finish(d, code, vals, group):
    """d [R,1,1] * code [R,nb,8] (float32) -> per-block scale, times the values [R,nb,32/group,group]."""
    R, nb = code.shape[:2]
    scale = (d * code).reshape(R, nb, 8, 1, 1)
    return (scale * vals.float().reshape(R, nb, 8, 32 // group, group)).reshape(R, nb * QK_K)


def dequantize_iq1_kt(raw: torch.Tensor, n_cols: int) -> torch.Tensor:
    d, b = _split(raw, "IQ1_KT", n_cols)
    sh = b[..., 0:8].long()              # per 32-block: low nibble scale code, bits 4..7 = 13th index bits
    ql = b[..., 8:40].long()             # low 8 bits of the 32 group indices
    qh = b[..., 40:56].long()            # bits 8..11: group j uses nibble j // 16 of qh[j % 16]
    hi = torch.cat([qh & 0xF, qh >> 4], dim=-1)
    bit12 = (sh.unsqueeze(-1) >> torch.arange(4, 8, device=b.device)) & 1      # [R, nb, 8, 4]
    idx = ql | (hi << 8) | (bit12.flatten(-2) << 12)
    vals = trellis_values(idx, 8)
    code = _iq4k_table(b.device)[sh & 0xF]
    return _finish(d, code, vals, 8)


def dequantize_iq2_kt(raw: torch.Tensor, n_cols: int) -> torch.Tensor:
    d, b = _split(raw, "IQ2_KT", n_cols)
    code = _iq4k_table(b.device)[_nib_scales(b[..., 0:4])]
    vals = trellis_values(_u16(b[..., 4:68]), 8)          # 32 uint16 indices, in output order
    return _finish(d, code, vals, 8)


def dequantize_iq3_kt(raw: torch.Tensor, n_cols: int) -> torch.Tensor:
    d, b = _split(raw, "IQ3_KT", n_cols)
    code = _nib_scales(b[..., 0:4]).float()                # unsigned 4-bit scales
    vals = trellis_values(_u16(b[..., 4:68]), 8).abs()
    y = _finish(d, code, vals, 8)
    # sign of element k of 32-block j: bit j of qh[k]
    qh = b[..., 68:100]
    neg = (qh.unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(8, 1)) & 1
    neg = neg.reshape(y.shape).bool()
    return torch.where(neg, -y, y)


def dequantize_iq4_kt(raw: torch.Tensor, n_cols: int) -> torch.Tensor:
    d, b = _split(raw, "IQ4_KT", n_cols)
    shb = _u32(b[..., 0:32])                              # per 32-block: scale, offset flag, high idx bits
    ql = b[..., 32:96].long()                             # low 8 bits of 64 group indices (4 values each)
    qh = b[..., 96:128].long()                            # bits 8..11: group j -> nibble j // 32 of qh[j % 32]
    hi = torch.cat([qh & 0xF, qh >> 4], dim=-1)
    top = (shb.unsqueeze(-1) >> (8 + 3 * torch.arange(8, device=b.device))) & 7   # [R, nb, 8, 8]
    idx = ql | (hi << 8) | (top.flatten(-2) << 12)
    offset = 4096 + 32768 * (shb & 1)
    vals = trellis_values(idx, 4, offset.repeat_interleave(8, dim=-1))
    code = (((shb & 0xFF) >> 1) - 64).float()
    return _finish(d, code, vals, 4)


DEQUANTIZERS = {
    "IQ1_KT": dequantize_iq1_kt,
    "IQ2_KT": dequantize_iq2_kt,
    "IQ3_KT": dequantize_iq3_kt,
    "IQ4_KT": dequantize_iq4_kt,
}
