"""Reference (pure torch) dequantizers for ik_llama.cpp's own tensor types.

Q6_0, IQ2_K .. IQ6_K, IQ2_KS, IQ3_KS, IQ4_KS, IQ5_KS, IQ4_KSS and IQ2_KL, written from the block
layouts in ik_llama.cpp's ggml-common.h and the scalar dequantize_row_* routines (iqk_quantize.cpp,
ggml-quants.c). Float32 math in the same order as that C code, so the results are bit-exact with
ik_llama.cpp's CPU to_float (checked against the test vectors in tests/quant/test_ref_ik.py).

Every function runs on whatever device `raw` is on. Rows of the *_KS types and IQ2_KL begin with one
per-row scale (float32 for IQ4_KS / IQ5_KS / IQ4_KSS, fp16 for IQ2_KS / IQ3_KS / IQ2_KL) that every
256-element super-block of the row shares.

Naming below: a "sub-block" is the unit that owns one scale (16 elements for IQ2_K..IQ6_K, 32 for the
*_KS types and IQ2_KL); `s` is its index inside the 256-element super-block.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

QK_K = 256

# Non-linear value grids (ggml-common.h). Each is two grids back to back; a per-sub-block bit picks one.
_IQ2NL = (-31, -13, 1, 17, -26, -8, 6, 22)
_IQ3NL = (-63, -40, -23, -10, 1, 13, 28, 47,
          -59, -36, -19, -6, 5, 17, 32, 51)
_IQ4K = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
         -123, -100, -79, -61, -45, -31, -18, -6, 5, 17, 29, 42, 57, 73, 93, 117)
_IQ5NL = (-126, -114, -103, -92, -83, -74, -65, -57, -50, -43, -36, -30, -24, -18, -12, -6,
          -1, 5, 11, 17, 23, 29, 36, 43, 51, 59, 68, 77, 87, 97, 109, 121,
          -124, -112, -101, -90, -81, -72, -63, -55, -48, -41, -34, -28, -22, -16, -10, -4,
          1, 7, 13, 19, 25, 31, 38, 45, 53, 61, 70, 79, 89, 99, 111, 123)
# IQ2_KL: 32 pairs of int8 values, packed little-endian into uint16 (low byte = first element).
_IQ2KL = (0xe9c1, 0x0dc1, 0xc1d8, 0xf6d8, 0x0dd8, 0x2fd8, 0xd8e9, 0xe9e9,
          0x01e9, 0x0de9, 0x1ce9, 0xc1f6, 0x01f6, 0x0df6, 0x2ff6, 0xe901,
          0xf601, 0x0101, 0x0d01, 0x1c01, 0xd80d, 0xe90d, 0xf60d, 0x010d,
          0x0d0d, 0xc11c, 0xe91c, 0x011c, 0x1c1c, 0x2f1c, 0xe92f, 0x0d2f)
# IQ6_K maps a 6-bit q through a cubic (coefficients are float32 literals), plus 1 when its extra bit is set.
_IQ6_A, _IQ6_B, _IQ6_C, _IQ6_D = -127.0, 6.2568, 0.11218, 0.0011972


# ----------------------------------------------------------------- helpers

def _tab(vals, dev) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float32, device=dev)


def _ar(vals, dev, *shape) -> torch.Tensor:
    """int32 constant tensor (shift amounts, bit positions) viewed to `shape`."""
    return torch.tensor(vals, dtype=torch.int32, device=dev).view(*shape)


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    return b[:, off:off + 2].contiguous().view(torch.float16).float()


def _u16(b: torch.Tensor, off: int) -> torch.Tensor:
    """little-endian uint16 field -> int32 [N, 1]."""
    return b[:, off:off + 1].int() | (b[:, off + 1:off + 2].int() << 8)


def _bits(word: torch.Tensor, n: int, first: int = 0) -> torch.Tensor:
    """bits first..first+n-1 of an int32 [N, 1] word -> int32 [N, n]."""
    return (word >> torch.arange(first, first + n, dtype=torch.int32, device=word.device)) & 1


def _nib(x: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 tensor -> int32 with a new axis at `dim`: [low nibble, high nibble]."""
    x = x.int()
    return torch.stack([x & 0xF, x >> 4], dim=dim)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """IQ2/IQ3 low bits: [N, 64] bytes as two 32-byte chunks, each holding 4 sub-blocks of 32 at shifts
    0, 2, 4, 6 -> int32 [N, 8, 32] (32-element sub-block 4*chunk + shift/2)."""
    n = qs.shape[0]
    q = qs.int().reshape(n, 2, 1, 32) >> _ar((0, 2, 4, 6), qs.device, 1, 1, 4, 1)
    return (q & 3).reshape(n, 8, 32)


def _bitplanes(qh: torch.Tensor, nplanes: int) -> torch.Tensor:
    """[N, L] bytes -> int32 [N, nplanes, L]: plane p is bit p of every byte."""
    n, ln = qh.shape
    return (qh.int().reshape(n, 1, ln) >> _ar(range(nplanes), qh.device, 1, nplanes, 1)) & 1


def _k16_scales(sl: torch.Tensor, sh: torch.Tensor) -> torch.Tensor:
    """IQ4_K/IQ5_K 6-bit scales of 16 sub-blocks: low 4 bits are nibble s%2 of sl[s/2], high 2 bits are
    bits 2*(s%4).. of sh[s/4] -> int32 [N, 16] (not yet offset)."""
    n = sl.shape[0]
    lo = _nib(sl, -1).reshape(n, 16)
    hi = (sh.int().reshape(n, 4, 1) >> _ar((0, 2, 4, 6), sl.device, 1, 1, 4)) & 3
    return lo | (hi.reshape(n, 16) << 4)


def _lookup(tab: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return tab[idx.long()]


def _rows(raw: torch.Tensor, n_cols: int, block: int, block_bytes: int, header: int):
    """uint8 rows [..., row_bytes] -> (blocks [n_rows*nb, block_bytes], per-block row scale or None, lead)."""
    if n_cols % block:
        raise ValueError(f"{n_cols} columns is not a multiple of {block}")
    nb = n_cols // block
    rb = header + nb * block_bytes
    if raw.dtype != torch.uint8 or raw.shape[-1] != rb:
        raise ValueError(f"expected uint8 [..., {rb}], got {raw.dtype} {tuple(raw.shape)}")
    lead = raw.shape[:-1]
    raw = raw.reshape(-1, rb)
    d = None
    if header == 4:
        d = raw[:, :4].contiguous().view(torch.float32)
    elif header == 2:
        d = raw[:, :2].contiguous().view(torch.float16).float()
    if d is not None:
        d = d.repeat_interleave(nb, dim=0)
    blocks = raw[:, header:].contiguous().reshape(-1, block_bytes)
    return blocks, d, lead


# --------------------------------------------------------- no row header

def _dq_q6_0(b):
    # d f16 | qh[8] | qs[16]. Low 4 bits: element j (j<16) in qs[j] low nibble, element j+16 in the high
    # nibble; bits 4-5: qh[j%8] at shift 4*(j/8) (+2 for element j+16).
    n = b.shape[0]
    lo = _nib(b[:, 10:26], 1).reshape(n, 32)
    hi = b[:, 2:10].int().reshape(n, 1, 1, 8) >> _ar((0, 4, 2, 6), b.device, 1, 2, 2, 1)
    q = lo | ((hi & 3).reshape(n, 32) << 4)
    return (q - 32).float() * _f16(b, 0)


def _dq_iq2_k(b):
    # d f16 | extra u16 | scales[8] (4-bit, -8) | qs[64]
    n = b.shape[0]
    q = _crumbs(b[:, 12:76]).reshape(n, 16, 16)
    ls = _nib(b[:, 4:12], -1).reshape(n, 16)
    v = _lookup(_tab(_IQ2NL, b.device), q + 4 * _bits(_u16(b, 2), 16).unsqueeze(-1))
    dl = _f16(b, 0) * (ls - 8).float()
    return (dl.unsqueeze(-1) * v).reshape(n, QK_K)


def _dq_iq3_k(b):
    # d f16 | extra u16 | scales_h u16 (sign bits) | scales_l[8] | qs[64] | qh[32]
    n = b.shape[0]
    q = _crumbs(b[:, 14:78]) | (_bitplanes(b[:, 78:110], 8) << 2)
    ls = _nib(b[:, 6:14], -1).reshape(n, 16)
    sign = 1 - 2 * _bits(_u16(b, 4), 16)
    v = _lookup(_tab(_IQ3NL, b.device), q.reshape(n, 16, 16) + 8 * _bits(_u16(b, 2), 16).unsqueeze(-1))
    dl = _f16(b, 0) * ((2 * ls + 1) * sign).float()
    return (dl.unsqueeze(-1) * v).reshape(n, QK_K)


def _dq_iq4_k(b):
    # d f16 | extra u16 | scales_h[4] | scales_l[8] | qs[128]; 32 elements take 16 qs bytes, low
    # nibbles first
    n = b.shape[0]
    q = _nib(b[:, 16:144].reshape(n, 8, 16), 2).reshape(n, 16, 16)
    ls = _k16_scales(b[:, 8:16], b[:, 4:8])
    v = _lookup(_tab(_IQ4K, b.device), q + 16 * _bits(_u16(b, 2), 16).unsqueeze(-1))
    dl = _f16(b, 0) * (ls - 32).float()
    return (dl.unsqueeze(-1) * v).reshape(n, QK_K)


def _lo_hi_64(qs: torch.Tensor, qh: torch.Tensor, hbits: int) -> torch.Tensor:
    """IQ5_K / IQ6_K quants -> int32 [N, 16, 16]. Per 64 elements, 32 qs bytes: low nibbles are elements
    0..31, high nibbles 32..63. qh (32 bytes, or 64 for IQ6_K) adds `hbits` high bits per element:
    element l (mod 32) of the k-th half-of-64 (k = 0..7) reads qh[l (+32 for IQ6_K's second 128)]
    at shift hbits*k (mod 8)."""
    n = qs.shape[0]
    lo = _nib(qs.reshape(n, 4, 32), 2)  # [N, 4, 2, 32]
    mask = (1 << hbits) - 1
    if hbits == 1:
        hi = _bitplanes(qh, 8).reshape(n, 4, 2, 32)
    else:
        hi = qh.int().reshape(n, 2, 1, 1, 32) >> _ar((0, 2, 4, 6), qh.device, 1, 1, 2, 2, 1)
        hi = (hi & mask).reshape(n, 4, 2, 32)
    return (lo | (hi << 4)).reshape(n, 16, 16)


def _dq_iq5_k(b):
    # d f16 | extra u16 | scales_h[4] | scales_l[8] | qs[128] | qh[32]
    n = b.shape[0]
    q = _lo_hi_64(b[:, 16:144], b[:, 144:176], 1)
    ls = _k16_scales(b[:, 8:16], b[:, 4:8])
    v = _lookup(_tab(_IQ5NL, b.device), q + 32 * _bits(_u16(b, 2), 16).unsqueeze(-1))
    dl = _f16(b, 0) * (ls - 32).float()
    return (dl.unsqueeze(-1) * v).reshape(n, QK_K)


def _iq6_values(dev) -> torch.Tensor:
    """The 128 IQ6_K levels: A + q*(B + q*(-C + q*D)), plus 1 for the second grid, in float32.

    The build of ik_llama.cpp that made the test vectors fused each Horner step into an fma (what GCC
    does by default on FMA hardware, -ffp-contract=fast); the vectors carry those roundings: 67 of the
    128 levels differ from unfused float32 math, by up to 1.5e-5 (an ulp of 127). Each step is done here as one float64 multiply-add rounded once to float32: with a
    6-bit q and 24-bit operands the float64 product and sum are exact, so this is fmaf (also checked
    against exact rational arithmetic for all 64 q)."""
    q = torch.arange(64, dtype=torch.float64, device=dev)
    c32 = [float(torch.tensor(x, dtype=torch.float32)) for x in (_IQ6_A, _IQ6_B, _IQ6_C, _IQ6_D)]
    a, bb, c, d = c32
    t = (q * d - c).float().double()
    t = (q * t + bb).float().double()
    p = (q * t + a).float()
    return torch.cat([p + 0.0, p + 1.0])


def _dq_iq6_k(b):
    # d f16 | extra u16 | scales int8[16] | qs[128] | qh[64]
    n = b.shape[0]
    q = _lo_hi_64(b[:, 20:148], b[:, 148:212], 2)
    v = _lookup(_iq6_values(b.device), q + 64 * _bits(_u16(b, 2), 16).unsqueeze(-1))
    dl = _f16(b, 0) * b[:, 4:20].contiguous().view(torch.int8).float()
    return (dl.unsqueeze(-1) * v).reshape(n, QK_K)


# ---------------------------------------------------------- row header d

def _dq_iq2_ks(b, d):
    # extra u16 (bits 0-7: grid of sub-block s, bits 8-15: scale bit 4) | scales[4] | qs[64]
    n = b.shape[0]
    extra = _u16(b, 0)
    ls = _nib(b[:, 2:6], -1).reshape(n, 8) | (_bits(extra, 8, 8) << 4)
    v = _lookup(_tab(_IQ2NL, b.device), _crumbs(b[:, 6:70]) + 4 * _bits(extra, 8).unsqueeze(-1))
    dl = d * (ls - 16).float()
    return (dl.unsqueeze(-1) * v).reshape(n, QK_K)


def _ks_scale_nibbles(sc: torch.Tensor) -> torch.Tensor:
    """IQ3_KS / IQ2_KL: 4 bytes holding 8 4-bit scales; sub-block s is nibble s/4 of byte s%4."""
    return _nib(sc, 1).reshape(sc.shape[0], 8)


def _dq_iq3_ks(b, d):
    # extra u16 (bits 0-7: scale bit 4 of sub-block s, bits 8-15: its grid) | scales[4] | qs[64] | qh[32]
    n = b.shape[0]
    extra = _u16(b, 0)
    ls = _ks_scale_nibbles(b[:, 2:6]) | (_bits(extra, 8) << 4)
    q = _crumbs(b[:, 6:70]) | (_bitplanes(b[:, 70:102], 8) << 2)
    v = _lookup(_tab(_IQ3NL, b.device), q + 8 * _bits(extra, 8, 8).unsqueeze(-1))
    dl = d * (ls - 16).float()
    return (dl.unsqueeze(-1) * v).reshape(n, QK_K)


def _dq_iq2_kl(b, d):
    # scales_h u16 (2 bits per sub-block) | scales_l[4] | qs[64] | qh[16]. Each 5-bit index (qs nibble +
    # one qh bit) picks a pair of consecutive values; 32 elements = 16 pairs = 16 qs bytes' low or high
    # nibbles: sub-block s uses qs[16*(s/2) ..] nibble s%2 and bit s of qh[0..15].
    n = b.shape[0]
    ls = _ks_scale_nibbles(b[:, 2:6]) | (((_u16(b, 0) >> _ar(range(0, 16, 2), b.device, 1, 8)) & 3) << 4)
    idx = _nib(b[:, 6:70].reshape(n, 4, 16), 2).reshape(n, 8, 16) | (_bitplanes(b[:, 70:86], 8) << 4)
    pairs = torch.tensor(_IQ2KL, dtype=torch.int32, device=b.device)
    grid = torch.stack([pairs & 0xFF, pairs >> 8], -1).to(torch.uint8).view(torch.int8).float()  # [32, 2]
    v = grid[idx.long()].reshape(n, 8, 32)
    dl = d * (ls - 32).float()
    return (dl.unsqueeze(-1) * v).reshape(n, QK_K)


def _ks_scale(sc: torch.Tensor):
    """IQ4_KS / IQ5_KS / IQ4_KSS scale byte: bits 1-7 scale (+1 bias trick: (x & 254) - 127), bit 0 grid."""
    sc = sc.int()
    return (sc & 254) - 127, sc & 1


def _dq_iq4_ks(b, d):
    # scales[8] | qs[128]
    n = b.shape[0]
    ls, g = _ks_scale(b[:, :8])
    q = _nib(b[:, 8:136].reshape(n, 8, 16), 2).reshape(n, 8, 32)
    v = _lookup(_tab(_IQ4K, b.device), q + 16 * g.unsqueeze(-1))
    return ((d * ls.float()).unsqueeze(-1) * v).reshape(n, QK_K)


def _dq_iq5_ks(b, d):
    # scales[8] | qs[128] | qh[32]; per 64 elements 32 qs bytes (low nibbles first), high bit s in qh
    n = b.shape[0]
    ls, g = _ks_scale(b[:, :8])
    q = _nib(b[:, 8:136].reshape(n, 4, 32), 2).reshape(n, 8, 32) | (_bitplanes(b[:, 136:168], 8) << 4)
    v = _lookup(_tab(_IQ5NL, b.device), q + 32 * g.unsqueeze(-1))
    return ((d * ls.float()).unsqueeze(-1) * v).reshape(n, QK_K)


def _dq_iq4_kss(b, d):
    # 8 sub-blocks x 8 little-endian uint16. Bit 0 of word k is bit k of the sub-block's IQ4_KS-style
    # scale byte; the other 15 bits w are stored as w ^ (w >> 1) (bit 0 cleared), giving two bytes of
    # nibbles: byte j low nibble = element j, high nibble = element j+16.
    n = b.shape[0]
    w = b.int().reshape(n, 8, 8, 2)
    w = w[..., 0] | (w[..., 1] << 8)  # [N, 8 sub-blocks, 8 words]
    sc = ((w & 1) << _ar(range(8), b.device, 1, 1, 8)).sum(-1)
    ls, g = _ks_scale(sc)
    a = w & 0xFFFE
    a = a ^ (a >> 1)
    qb = torch.stack([a & 0xFF, a >> 8], -1).reshape(n, 8, 16)
    q = torch.cat([qb & 0xF, qb >> 4], -1)
    v = _lookup(_tab(_IQ4K, b.device), q + 16 * g.unsqueeze(-1))
    return ((d * ls.float()).unsqueeze(-1) * v).reshape(n, QK_K)


# -------------------------------------------------------------- entry points

# name -> (fn, elements per block, bytes per block, row header bytes)
_SPECS = {
    "Q6_0": (_dq_q6_0, 32, 26, 0),
    "IQ2_K": (_dq_iq2_k, QK_K, 76, 0),
    "IQ3_K": (_dq_iq3_k, QK_K, 110, 0),
    "IQ4_K": (_dq_iq4_k, QK_K, 144, 0),
    "IQ5_K": (_dq_iq5_k, QK_K, 176, 0),
    "IQ6_K": (_dq_iq6_k, QK_K, 212, 0),
    "IQ2_KS": (_dq_iq2_ks, QK_K, 70, 2),
    "IQ3_KS": (_dq_iq3_ks, QK_K, 102, 2),
    "IQ2_KL": (_dq_iq2_kl, QK_K, 86, 2),
    "IQ4_KS": (_dq_iq4_ks, QK_K, 136, 4),
    "IQ5_KS": (_dq_iq5_ks, QK_K, 168, 4),
    "IQ4_KSS": (_dq_iq4_kss, QK_K, 128, 4),
}


def _make(name: str) -> Callable[[torch.Tensor, int], torch.Tensor]:
    fn, block, block_bytes, header = _SPECS[name]

    def dequant(raw: torch.Tensor, n_cols: int) -> torch.Tensor:
        blocks, d, lead = _rows(raw, n_cols, block, block_bytes, header)
        out = fn(blocks) if d is None else fn(blocks, d)
        return out.reshape(*lead, n_cols)

    dequant.__name__ = f"dequantize_{name.lower()}"
    dequant.__doc__ = f"uint8 {name} rows [..., row_bytes] (header included) -> float32 [..., n_cols]."
    return dequant


DEQUANTIZERS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {name: _make(name) for name in _SPECS}
