"""Reference (pure torch) dequantizers for the mainline llama.cpp block types that ref.py lacks.

Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q8_K and the i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
IQ3_S, IQ4_XS. Each `_dq_xxx(b)` maps uint8 blocks [N, block_bytes] to float32 [N, block_elems],
vectorized over blocks, and multiplies in ggml's order (left to right, in float32), so the results are
bit-exact with ggml's to_float and with gguf.quants. Only torch ops: the same code runs on CUDA tensors.

The i-quant lattices (grids of 4 or 8 small integers per index) come from the gguf package's tables
(checked against ik_llama.cpp's ggml-common.h) and are cached as float32 tensors per device.

Layouts (byte offsets in a block; a "group" is 8 consecutive values, 4 for the IQ3 grids):
  Q4_1     20 B / 32:  d f16 | m f16 | 16 B nibbles (low: values 0..15, high: 16..31).  x = q*d + m
  Q5_0     22 B / 32:  d | qh u32 (bit j = 5th bit of value j) | 16 B nibbles.         x = (q-16)*d
  Q5_1     24 B / 32:  d | m | qh u32 | 16 B nibbles.                                 x = q*d + m
  Q2_K     84 B / 256: 16 B scales (low nibble: scale, high: min, per 16 values) | 64 B 2-bit quants |
                       d | dmin.  Each 32-byte half holds 128 values: bit pair k of byte l -> value 32k+l.
  Q3_K    110 B / 256: 32 B high-bit mask | 64 B 2-bit quants (as Q2_K) | 12 B of 16 6-bit scales | d.
                       A clear mask bit subtracts 4; mask bit 4*half+k of byte l goes with value 32k+l.
  Q8_K    292 B / 256: d f32 | 256 int8 | 16 int16 group sums (mainline; ik_llama.cpp's block has a
                       float `sum` after d, 296 B: both are read, told apart by the row length).
  IQ2_XXS  66 B / 256: d | 8 x (4 grid indices u8, u32: four 7-bit sign codes + 4-bit scale on top).
  IQ2_XS   74 B / 256: d | 32 u16 (9-bit grid index, 7-bit sign code) | 8 B of 4-bit scales per 16.
  IQ2_S    82 B / 256: d | 32 B grid index low bits | 32 B sign bytes | 8 B: 2 high index bits per
                       group | 8 B of 4-bit scales per 16.  10-bit indices into a 1024 x 8 grid.
  IQ3_XXS  98 B / 256: d | 64 B grid indices (4 values each) | 8 u32 as IQ2_XXS's (scale, signs).
  IQ3_S   110 B / 256: d | 64 B index low bits | 8 B 9th index bits | 32 B sign bytes | 4 B 4-bit
                       scales per 32.  Scale factor 1 + 2s.
  IQ1_S    50 B / 256: d | 32 B index low bits | 8 u16: 4 x 3 high index bits, 3-bit scale at bit 12,
                       delta sign at bit 15.  x = dl * (grid + delta), delta = +-1/8.
  IQ1_M    56 B / 256: 32 B index low bits | 16 B nibbles (3 high index bits + delta sign per group) |
                       4 u16 of 3-bit scales per 16 values, whose top nibbles together are the f16 d.
  IQ4_XS  136 B / 256: d | u16 high 2 bits of 8 scales | 4 B low scale nibbles | 128 B IQ4_NL nibbles.
A 7-bit sign code c stands for the sign byte c | parity(c) << 7 (an even number of negatives); bit j of a
sign byte negates value j of its group.
"""
from __future__ import annotations

from typing import Callable

import torch

from .ref import _KV_IQ4NL, QK_K, _f16, _nibbles

BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q8_K": (QK_K, 292),
    "IQ2_XXS": (QK_K, 66), "IQ2_XS": (QK_K, 74), "IQ2_S": (QK_K, 82),
    "IQ3_XXS": (QK_K, 98), "IQ3_S": (QK_K, 110),
    "IQ1_S": (QK_K, 50), "IQ1_M": (QK_K, 56), "IQ4_XS": (QK_K, 136),
}
Q8_K_IK_BYTES = 296  # ik_llama.cpp's block_q8_K: d, sum (f32 each), 256 int8, 16 int16

IQ1_DELTA = 0.125

# ------------------------------------------------------------------ tables

_tables: dict[tuple[str, object], torch.Tensor] = {}


def _host_table(name: str) -> torch.Tensor:
    if name == "IQ4_NL":
        return torch.tensor(_KV_IQ4NL, dtype=torch.float32)
    from gguf import (
        quants,  # grid classes: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S
    )
    cls = getattr(quants, name)
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape).astype("float32"))


def _table(name: str, device: torch.device) -> torch.Tensor:
    """float32 table `name` on `device` ([n_indices, 8 or 4] for grids), built once per device."""
    t = _tables.get((name, device))
    if t is None:
        host = _tables.get((name, None))
        if host is None:
            host = _tables[(name, None)] = _host_table(name)
        t = _tables[(name, device)] = host.to(device)
    return t


# ----------------------------------------------------------------- helpers

def _steps(start: int, step: int, count: int, like: torch.Tensor) -> torch.Tensor:
    """Shift amounts start, start+step, ... as a 1-D tensor of like's dtype and device."""
    return torch.arange(start, start + step * count, step, dtype=like.dtype, device=like.device)


def _bits(x: torch.Tensor, n: int = 8) -> torch.Tensor:
    """Integer tensor [...] -> [..., n]: its bits 0..n-1."""
    return (x.unsqueeze(-1) >> _steps(0, 1, n, x)) & 1


def _sign(bits: torch.Tensor) -> torch.Tensor:
    """0/1 bits -> float +1/-1."""
    return 1.0 - 2.0 * bits.float()


def _ksign_bits(code: torch.Tensor) -> torch.Tensor:
    """7-bit sign codes [...] (int32) -> sign bits [..., 8]: the code's bits, then its parity."""
    p = code ^ (code >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return _bits(code | ((p & 1) << 7), 8)


def _u16(b: torch.Tensor, off: int, n: int) -> torch.Tensor:
    """n little-endian uint16 fields from byte `off` -> int32 [N, n] (0..65535)."""
    return b[:, off:off + 2 * n].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def _u32(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 4k] -> int32 [..., k] (the uint32 bit patterns; mask after right shifts)."""
    return b.contiguous().view(torch.int32)


def _nib_pairs(x: torch.Tensor) -> torch.Tensor:
    """[N, k] bytes -> [N, 2k] nibbles in the order low(0), high(0), low(1), high(1), ..."""
    return torch.stack([x & 0xF, x >> 4], dim=-1).reshape(x.shape[0], -1)


# ------------------------------------------------------------ legacy 32s

def _q5(b: torch.Tensor, off: int) -> torch.Tensor:
    """Q5_0/Q5_1 quants 0..31 [N, 32] from qh (4 B at off) and the nibbles after it."""
    hi = _bits(b[:, off:off + 4]).reshape(-1, 32)
    return _nibbles(b[:, off + 4:off + 20]) | (hi << 4)


def _dq_q4_1(b):
    return _nibbles(b[:, 4:20]).float() * _f16(b, 0) + _f16(b, 2)


def _dq_q5_0(b):
    return (_q5(b, 2).float() - 16) * _f16(b, 0)


def _dq_q5_1(b):
    return _q5(b, 4).float() * _f16(b, 0) + _f16(b, 2)


# ---------------------------------------------------------------- k-quants

def _two_bit(qs: torch.Tensor) -> torch.Tensor:
    """[N, 64] bytes of 2-bit quants -> [N, 2, 4, 32] (half, bit pair, byte): value 128h + 32k + l."""
    n = qs.shape[0]
    return (qs.reshape(n, 2, 1, 32) >> _steps(0, 2, 4, qs).view(1, 1, 4, 1)) & 3


def _dq_q2_k(b):
    n = b.shape[0]
    sc = b[:, :16]
    dl = (_f16(b, 80) * (sc & 0xF).float()).unsqueeze(-1)
    ml = (_f16(b, 82) * (sc >> 4).float()).unsqueeze(-1)
    q = _two_bit(b[:, 16:80]).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _dq_q3_k(b):
    n = b.shape[0]
    s = b[:, 96:108]
    lo = torch.cat([s[:, :8] & 0xF, s[:, :8] >> 4], dim=-1)
    # scale i takes bits 2*(i // 4) .. +1 of byte 8 + i % 4 as its bits 4, 5
    hi = (s[:, 8:12].reshape(n, 1, 4) >> _steps(0, 2, 4, s).view(1, 4, 1)) & 3
    sc = (lo | (hi.reshape(n, 16) << 4)).float() - 32
    dl = (_f16(b, 108) * sc).unsqueeze(-1)
    m = b[:, :32]
    h = (m.reshape(n, 1, 1, 32) >> _steps(0, 1, 8, m).view(1, 2, 4, 1)) & 1
    q = _two_bit(b[:, 32:96]).float() - ((h ^ 1) << 2).float()
    return (dl * q.reshape(n, 16, 16)).reshape(n, QK_K)


def _q8_k_at(off: int):
    def dq(b):
        d = b[:, :4].contiguous().view(torch.float32)
        return d * b[:, off:off + QK_K].contiguous().view(torch.int8).float()
    return dq


_dq_q8_k = _q8_k_at(4)
_dq_q8_k_ik = _q8_k_at(8)


# ----------------------------------------------------------------- i-quants

def _dq_iq2_xxs(b):
    n = b.shape[0]
    g = b[:, 2:66].reshape(n, 8, 8)
    aux = _u32(g[:, :, 4:]).reshape(n, 8, 1)
    db = _f16(b, 0).view(n, 1, 1) * (((aux >> 28) & 15).float() + 0.5) * 0.25
    sgn = _sign(_ksign_bits((aux >> _steps(0, 7, 4, aux)) & 127))              # [n, 8, 4, 8]
    grid = _table("IQ2_XXS", b.device)[g[:, :, :4].long()]                       # [n, 8, 4, 8]
    return (db.unsqueeze(-1) * grid * sgn).reshape(n, QK_K)


def _iq2_scales(b, off):
    """IQ2_XS/IQ2_S: d * (0.5 + s) * 0.25 per 16 values -> [n, 16, 1, 1]."""
    n = b.shape[0]
    s = _nib_pairs(b[:, off:off + 8]).float()
    return (_f16(b, 0) * (s + 0.5) * 0.25).view(n, 16, 1, 1)


def _dq_iq2_xs(b):
    n = b.shape[0]
    q = _u16(b, 2, 32)
    grid = _table("IQ2_XS", b.device)[(q & 511).long()].view(n, 16, 2, 8)
    sgn = _sign(_ksign_bits(q >> 9)).view(n, 16, 2, 8)
    return (_iq2_scales(b, 66) * grid * sgn).reshape(n, QK_K)


def _dq_iq2_s(b):
    n = b.shape[0]
    qh = b[:, 66:74]
    hi = ((qh.unsqueeze(-1) >> _steps(0, 2, 4, qh)) & 3).reshape(n, 32)
    idx = b[:, 2:34].long() | (hi.long() << 8)
    grid = _table("IQ2_S", b.device)[idx].view(n, 16, 2, 8)
    sgn = _sign(_bits(b[:, 34:66])).view(n, 16, 2, 8)
    return (_iq2_scales(b, 74) * grid * sgn).reshape(n, QK_K)


def _dq_iq3_xxs(b):
    n = b.shape[0]
    aux = _u32(b[:, 66:98]).reshape(n, 8, 1)
    db = _f16(b, 0).view(n, 1, 1) * (((aux >> 28) & 15).float() + 0.5) * 0.5
    sgn = _sign(_ksign_bits((aux >> _steps(0, 7, 4, aux)) & 127))              # [n, 8, 4, 8]
    grid = _table("IQ3_XXS", b.device)[b[:, 2:66].long()].view(n, 8, 4, 8)
    return (db.unsqueeze(-1) * grid * sgn).reshape(n, QK_K)


def _dq_iq3_s(b):
    n = b.shape[0]
    hi = _bits(b[:, 66:74]).reshape(n, 64)  # 9th bit of index k: bit k % 8 of byte k // 8
    idx = b[:, 2:66].long() | (hi.long() << 8)
    grid = _table("IQ3_S", b.device)[idx].view(n, 8, 4, 8)
    sgn = _sign(_bits(b[:, 74:106])).view(n, 8, 4, 8)
    db = _f16(b, 0) * (1 + 2 * _nib_pairs(b[:, 106:110]).int()).float()        # [n, 8]
    return (db.view(n, 8, 1, 1) * grid * sgn).reshape(n, QK_K)


def _delta(neg: torch.Tensor) -> torch.Tensor:
    return torch.where(neg, -IQ1_DELTA, IQ1_DELTA).to(torch.float32)


def _dq_iq1_s(b):
    n = b.shape[0]
    qh = _u16(b, 34, 8)                                                          # [n, 8]
    dl = _f16(b, 0) * (2 * ((qh >> 12) & 7) + 1).float()
    hi = (qh.unsqueeze(-1) >> _steps(0, 3, 4, qh)) & 7                           # [n, 8, 4]
    idx = b[:, 2:34].view(n, 8, 4).long() | (hi.long() << 8)
    grid = _table("IQ1_S", b.device)[idx]                                        # [n, 8, 4, 8]
    delta = _delta((qh & 0x8000) != 0).view(n, 8, 1, 1)
    return (dl.view(n, 8, 1, 1) * (grid + delta)).reshape(n, QK_K)


def _dq_iq1_m(b):
    n = b.shape[0]
    sc = _u16(b, 48, 4)                                                          # [n, 4]
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
    d = ((bits ^ 0x8000) - 0x8000).to(torch.int16).view(torch.float16).float().view(n, 1)
    f = ((sc.unsqueeze(-1) >> _steps(0, 3, 4, sc)) & 7).reshape(n, 16)         # scale per 16 values
    dl = d * (2 * f + 1).float()
    nib = _nib_pairs(b[:, 32:48])                                                # [n, 32]: one per group
    idx = b[:, :32].long() | ((nib & 7).long() << 8)
    grid = _table("IQ1_S", b.device)[idx].view(n, 16, 2, 8)
    delta = _delta((nib & 8) != 0).view(n, 16, 2, 1)
    return (dl.view(n, 16, 1, 1) * (grid + delta)).reshape(n, QK_K)


def _dq_iq4_xs(b):
    n = b.shape[0]
    sh = _u16(b, 2, 1)
    ls = _nib_pairs(b[:, 4:8]).int() | (((sh >> _steps(0, 2, 8, sh)) & 3) << 4)  # [n, 8]
    dl = (_f16(b, 0) * (ls - 32).float()).unsqueeze(-1)
    q = _nibbles(b[:, 8:136].reshape(n * 8, 16)).view(n, 8, 32)
    return (dl * _table("IQ4_NL", b.device)[q.long()]).reshape(n, QK_K)


# ------------------------------------------------------------------- rows

_BLOCK_FNS = {
    "Q4_1": _dq_q4_1, "Q5_0": _dq_q5_0, "Q5_1": _dq_q5_1,
    "Q2_K": _dq_q2_k, "Q3_K": _dq_q3_k, "Q8_K": _dq_q8_k,
    "IQ2_XXS": _dq_iq2_xxs, "IQ2_XS": _dq_iq2_xs, "IQ2_S": _dq_iq2_s,
    "IQ3_XXS": _dq_iq3_xxs, "IQ3_S": _dq_iq3_s,
    "IQ1_S": _dq_iq1_s, "IQ1_M": _dq_iq1_m, "IQ4_XS": _dq_iq4_xs,
}


def _rows(name: str) -> Callable[[torch.Tensor, int], torch.Tensor]:
    bs, ts = BLOCKS[name]
    fn = _BLOCK_FNS[name]

    def dequantize(raw: torch.Tensor, n_cols: int) -> torch.Tensor:
        """uint8 rows [..., row_bytes] -> float32 [..., n_cols]."""
        if n_cols % bs:
            raise ValueError(f"{name}: row length {n_cols} is not a multiple of {bs}")
        nb = n_cols // bs
        width = raw.shape[-1] if raw.dim() else -1
        f, size = fn, ts
        if name == "Q8_K" and width == nb * Q8_K_IK_BYTES:
            f, size = _dq_q8_k_ik, Q8_K_IK_BYTES
        if raw.dtype != torch.uint8 or width != nb * size:
            raise ValueError(f"{name}: expected uint8 [..., {nb * ts}] for {n_cols} columns, "
                             f"got {raw.dtype} {tuple(raw.shape)}")
        lead = raw.shape[:-1]
        return f(raw.contiguous().reshape(-1, size)).reshape(*lead, n_cols)

    dequantize.__name__ = f"dequantize_{name.lower()}"
    return dequantize


DEQUANTIZERS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {name: _rows(name) for name in BLOCKS}
