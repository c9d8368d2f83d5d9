"""The byte layouts of ik_llama.cpp's row-interleaved types, as `pack` functions (used by ref_interleaved).

Each `_p_xxx(b)` takes R base blocks, uint8 [N, R, block bytes] (block j of R consecutive rows), and
returns the one interleaved block [N, R * block bytes] that ik_llama.cpp's repack_xxx writes for them
(iqk_quantize.cpp). They only move bits (shifts, masks, disjoint ORs), so ref_interleaved can invert
them by probing. The exception, the sign-code scrambling of IQ2_XXS_R4 / IQ3_XXS_R4 / IQ2_XS_R4, is
kept apart in `recode` transforms applied to the base rows before packing (and after unpacking).

Notation: in a 256-block, ib is the index of a 32-value sub-block; k is the row within the group; i < 4
the position within a run of 4 bytes (the unit SIMD code loads per row).
"""
from __future__ import annotations

import torch

QK_K = 256
_A4 = ((0, 8), (16, 24), (4, 12), (20, 28))        # nibble pairs (lo, hi) per 16-byte quarter
_Q2 = ((0, 4, 8, 12), (16, 20, 24, 28))             # 2-bit quads per 16-byte half
_Q1 = ((0, 4, 8, 12, 16, 20, 24, 28),)              # 1-bit octets


# ------------------------------------------------------------------------------------- bit helpers

def _i(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32)


def _ar(vals, like: torch.Tensor, *shape) -> torch.Tensor:
    t = torch.tensor(vals, dtype=torch.int32, device=like.device)
    return t.view(*shape) if shape else t


def _cat(parts) -> torch.Tensor:
    return torch.cat([p.reshape(p.shape[0], -1).to(torch.uint8) for p in parts], dim=-1)


def _rows(b: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Field bytes [lo, hi) of the R rows, row after row (e.g. the R fp16 scales d[R])."""
    return b[:, :, lo:hi]


def _by_unit(b: torch.Tensor, lo: int, hi: int, n_units: int) -> torch.Tensor:
    """Field [lo, hi) split in n_units equal units; output unit u of row 0, of row 1, ... then u + 1."""
    N, R = b.shape[:2]
    return b[:, :, lo:hi].reshape(N, R, n_units, -1).transpose(1, 2)


def _strided(f: torch.Tensor, w: int) -> torch.Tensor:
    """[N, F] w-bit fields -> bytes: field f goes to byte f % nbytes, at bit w * (f // nbytes)."""
    N, F = f.shape
    nbytes = F * w // 8
    f = _i(f).reshape(N, 8 // w, nbytes) << _ar([w * t for t in range(8 // w)], f, 1, -1, 1)
    return f.sum(1)


def _quads(L: torch.Tensor, pattern, w: int, sub: int = 32) -> torch.Tensor:
    """Per-row values L [N, R, n] -> bytes ordered (sub-block s, part m, row k, i < 4), each byte the OR
    over t of L[k, s * sub + pattern[m][t] + i] << (w * t)."""
    n = L.shape[2]
    off = _ar(pattern, L, len(pattern), len(pattern[0])).long()
    idx = (off.view(1, *off.shape, 1) + sub * torch.arange(n // sub, device=L.device).view(-1, 1, 1, 1)
           + torch.arange(4, device=L.device).view(1, 1, 1, 4))
    v = L[:, :, idx] << _ar([w * t for t in range(off.shape[1])], L, 1, 1, 1, 1, -1, 1)
    return v.sum(4).permute(0, 2, 3, 1, 4)


def _nib32(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16 * j] bytes -> [..., 32 * j] 4-bit values: per 16 bytes, low nibbles then high nibbles."""
    q = _i(qs).reshape(*qs.shape[:-1], -1, 16)
    return torch.cat([q & 15, q >> 4], -1).flatten(-2)


def _nib_fields(s: torch.Tensor) -> torch.Tensor:
    """[N, R, n] bytes -> [N, n * 2 * R] nibbles ordered (byte, lo/hi, row): ik's 8*ib + 4*j + k fields."""
    s = _i(s)
    return torch.stack([s & 15, s >> 4], -1).permute(0, 2, 3, 1).flatten(1)


def le_int(b: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> little-endian integer (int64)."""
    return sum(b[..., j].long() << (8 * j) for j in range(b.shape[-1]))


def _two_bit(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K-style 2-bit quants [N, R, 64] -> [N, R, 256]: value 128h + 32j + l = bits 2j of byte 32h + l."""
    N, R = qs.shape[:2]
    return ((_i(qs).view(N, R, 2, 1, 32) >> _ar([0, 2, 4, 6], qs, 1, 1, 1, 4, 1)) & 3).reshape(N, R, 256)


def _hbit(qh: torch.Tensor, L: torch.Tensor, pos: int) -> torch.Tensor:
    """OR bit ib of qh[l] (qh [N, R, 32]) into bit `pos` of value 32 ib + l."""
    N, R = qh.shape[:2]
    h = (_i(qh).view(N, R, 1, 32) >> _ar(list(range(8)), qh, 1, 1, 8, 1)) & 1
    return L | (h.reshape(N, R, 256) << pos)


def _k45(qs: torch.Tensor, qh: torch.Tensor | None) -> torch.Tensor:
    """Q4_K / Q5_K / IQ5_K values: value 64c + 32h + e = nibble h of qs[32c + e] (+ bit 2c + h of qh[e])."""
    N, R = qs.shape[:2]
    L = (_i(qs).view(N, R, 4, 1, 32) >> _ar([0, 4], qs, 1, 1, 1, 2, 1)) & 15
    if qh is not None:
        L = L | (((_i(qh).view(N, R, 1, 1, 32) >> _ar(list(range(8)), qh, 1, 1, 4, 2, 1)) & 1) << 4)
    return L.reshape(N, R, 256)


def _kscales(s: torch.Tensor):
    """Q4_K / Q5_K 12 scale bytes [N, R, 12] -> (scales, mins), each [N, R, 8] 6-bit."""
    a, m, hi = _i(s[..., 0:4]), _i(s[..., 4:8]), _i(s[..., 8:12])
    return (torch.cat([a & 63, (hi & 15) | ((a >> 2) & 48)], -1),
            torch.cat([m & 63, (hi >> 4) | ((m >> 2) & 48)], -1))


def _extra(b: torch.Tensor, off: int) -> torch.Tensor:
    """IQ*_K `extra` (u16, bit 2 ib + j) -> 8 bytes: byte 4 j + k holds row k's bits j, as bit ib."""
    e = le_int(b[:, :, off:off + 2])
    bits = (e.unsqueeze(-1) >> torch.arange(16, device=b.device)) & 1          # [N, R, 16]: 2 ib + j
    bits = bits.view(*e.shape, 8, 2) << torch.arange(8, device=b.device).view(8, 1)
    return bits.sum(2).transpose(1, 2)                                         # [N, j, k]


def _bit_fields(b: torch.Tensor, off: int, nbytes: int, w: int) -> torch.Tensor:
    """Consecutive w-bit fields of a little-endian word -> [N, R, 8 * nbytes / w]."""
    v = le_int(b[:, :, off:off + nbytes]).unsqueeze(-1)
    return (v >> (w * torch.arange(8 * nbytes // w, device=b.device))) & ((1 << w) - 1)


def _sas(aux: torch.Tensor) -> torch.Tensor:
    """IQ2_XXS / IQ3_XXS u32 [N, R, nb] (4 x 7-bit sign codes, scale on top) -> 4 bytes each:
    byte j = code_j << 1 | scale bit j. Output ordered (ib, row, byte)."""
    j = torch.arange(4, device=aux.device)
    a = aux.unsqueeze(-1)
    return ((((a >> (7 * j)) & 127) << 1) | ((a >> (28 + j)) & 1)).transpose(1, 2)


# -------------------------------------------------------------------------- the packs (repack_*)

def _p_q4_0(b):   # Q4_0 (18 B) x 8 / MXFP4 (17 B): scales, then 4-byte units of 8 rows
    h = b.shape[2] - 16
    return _cat([_rows(b, 0, h), _by_unit(b, h, h + 16, 4)])


def _p_q8_0(b):
    return _cat([_rows(b, 0, 2), _by_unit(b, 2, 34, 8)])


def _p_iq4_nl(b):
    return _cat([_rows(b, 0, 2), _quads(_nib32(b[:, :, 2:18]), _A4, 4)])


def q5_0_values(b):
    return _nib32(b[:, :, 6:22]) | (((le_int(b[:, :, 2:6]).unsqueeze(-1) >> torch.arange(32, device=b.device)) & 1) << 4)


def q6_0_values(b):
    N, R = b.shape[:2]
    sh = _ar([[0, 4], [2, 6]], b, 1, 1, 2, 2, 1)                               # [half, j // 8]
    h = ((_i(b[:, :, 2:10]).view(N, R, 1, 1, 8) >> sh) & 3).reshape(N, R, 32)
    return _nib32(b[:, :, 10:26]) | (h << 4)


def _p_q5_0(b):
    L = q5_0_values(b)
    return _cat([_rows(b, 0, 2), _quads(L >> 4, ((0, 16, 4, 20, 8, 24, 12, 28),), 1), _quads(L & 15, _A4, 4)])


def _p_q6_0(b):
    L = q6_0_values(b)
    return _cat([_rows(b, 0, 2), _quads(L >> 4, _Q2, 2), _quads(L & 15, _A4, 4)])


def _p_q2_k(b):
    return _cat([_rows(b, 80, 82), _rows(b, 82, 84), _by_unit(b, 0, 16, 16), _quads(_two_bit(b[:, :, 16:80]), _Q2, 2)])


def _p_q3_k(b):
    N, R = b.shape[:2]
    s = _i(b[:, :, 96:108])
    hi = (s[..., 8:12].unsqueeze(-2) >> _ar([0, 2, 4, 6], b, 4, 1)) & 3       # [N, R, j // 4, j % 4]
    ld = torch.cat([s[..., 0:8] & 15, s[..., 0:8] >> 4], -1) | (hi.reshape(N, R, 16) << 4)
    f = ld.view(N, R, 8, 2).permute(0, 2, 3, 1).reshape(N, 64)
    L = _hbit(b[:, :, 0:32], _two_bit(b[:, :, 32:96]), 2)
    return _cat([_rows(b, 108, 110), _strided(f >> 4, 2), _strided(f & 15, 4),
                 _quads(L >> 2, _Q1, 1), _quads(L & 3, _Q2, 2)])


def _k_head(b):
    N = b.shape[0]
    sc, mn = _kscales(b[:, :, 4:16])
    h = ((sc >> 4) | ((mn >> 4) << 2)).transpose(1, 2).reshape(N, -1)
    return [_rows(b, 0, 2), _rows(b, 2, 4), _strided(h, 4), ((sc & 15) | ((mn & 15) << 4)).transpose(1, 2)]


def _p_q4_k(b):
    return _cat(_k_head(b) + [_quads(_k45(b[:, :, 16:144], None), _A4, 4)])


def _p_q5_k(b):
    L = _k45(b[:, :, 48:176], b[:, :, 16:48])
    return _cat(_k_head(b) + [_quads(L >> 4, ((0, 8, 4, 12, 16, 24, 20, 28),), 1), _quads(L & 15, _A4, 4)])


def _p_q6_k(b):
    N, R = b.shape[:2]
    ql = _i(b[:, :, 0:128]).view(N, R, 2, 1, 2, 32)
    ql = torch.cat([ql & 15, ql >> 4], 3).reshape(N, R, 2, 4, 32)              # t = 2 * nibble + half
    qh = (_i(b[:, :, 128:192]).view(N, R, 2, 1, 32) >> _ar([0, 2, 4, 6], b, 1, 1, 1, 4, 1)) & 3
    L = (ql | (qh << 4)).reshape(N, R, 256)
    sc = b[:, :, 192:208].reshape(N, R, 8, 2).permute(0, 2, 3, 1)
    return _cat([_rows(b, 208, 210), sc, _quads(L >> 4, ((0, 8, 4, 12), (16, 24, 20, 28)), 2), _quads(L & 15, _A4, 4)])


def _p_iq4_xs(b):
    N, R = b.shape[:2]
    lo = _nib_fields(b[:, :, 4:8]).view(N, 4, 2, R).reshape(N, 8, R)        # (ib, k): ib = 2 byte + nibble
    hi = _bit_fields(b, 2, 2, 2).transpose(1, 2)
    return _cat([_rows(b, 0, 2), _strided(hi.reshape(N, -1), 2), _strided(lo.reshape(N, -1), 4),
                 _quads(_nib32(b[:, :, 8:136]), ((0, 4), (8, 12), (16, 20), (24, 28)), 4)])


def _p_iq4_ks(b):
    return _cat([_by_unit(b, 0, 8, 8), _quads(_nib32(b[:, :, 8:136]), _A4, 4)])


def _p_iq5_ks(b):
    L = _k45(b[:, :, 8:136], b[:, :, 136:168])
    return _cat([_by_unit(b, 0, 8, 8), _quads(L & 15, _A4, 4), _quads(L >> 4, ((0, 8, 16, 24, 4, 12, 20, 28),), 1)])


def _p_iq2_k(b):
    return _cat([_rows(b, 0, 2), _extra(b, 2), _strided(_nib_fields(b[:, :, 4:12]), 4),
                 _quads(_two_bit(b[:, :, 12:76]), _Q2, 2)])


def _p_iq3_k(b):
    N = b.shape[0]
    sh = _bit_fields(b, 4, 2, 1).view(N, -1, 8, 2).permute(0, 2, 3, 1).reshape(N, -1)
    L = _hbit(b[:, :, 78:110], _two_bit(b[:, :, 14:78]), 2)
    return _cat([_rows(b, 0, 2), _extra(b, 2), _strided(sh, 1), _strided(_nib_fields(b[:, :, 6:14]), 4),
                 _quads(L & 3, _Q2, 2), _quads(L >> 2, _Q1, 1)])


def _iq45_head(b):
    N = b.shape[0]
    sh = _bit_fields(b, 4, 4, 2).view(N, -1, 8, 2).permute(0, 2, 3, 1).reshape(N, -1)
    return [_rows(b, 0, 2), _extra(b, 2), _strided(sh, 2), _strided(_nib_fields(b[:, :, 8:16]), 4)]


def _p_iq4_k(b):
    return _cat(_iq45_head(b) + [_quads(_nib32(b[:, :, 16:144]), _A4, 4)])


def _p_iq5_k(b):
    L = _k45(b[:, :, 16:144], b[:, :, 144:176])
    return _cat(_iq45_head(b) + [_quads(L & 15, _A4, 4), _quads(L >> 4, ((0, 8, 16, 24, 4, 12, 20, 28),), 1)])


def _p_iq2_xxs(b):      # (after sign scrambling) grid bytes then sas, per 32-group
    N, R = b.shape[:2]
    g = b[:, :, 2:66].reshape(N, R, 8, 8)
    return _cat([_rows(b, 0, 2), _sas(le_int(g[..., 4:8])), g[..., 0:4].transpose(1, 2)])


def _p_iq3_xxs(b):
    N, R = b.shape[:2]
    return _cat([_rows(b, 0, 2), _sas(le_int(b[:, :, 66:98].reshape(N, R, 8, 4))), _by_unit(b, 2, 66, 8)])


def _p_iq2_xs(b):
    return _cat([_rows(b, 0, 2), _by_unit(b, 2, 66, 8), _by_unit(b, 66, 74, 8)])


def _p_iq2_s(b):
    return _cat([_rows(b, 0, 2), _by_unit(b, 2, 34, 8), _by_unit(b, 66, 74, 8), _by_unit(b, 34, 66, 8),
                 _by_unit(b, 74, 82, 8)])


def _p_iq3_s(b):
    N, R = b.shape[:2]
    qs = b[:, :, 2:66].reshape(N, R, 8, 2, 4).permute(0, 2, 4, 3, 1)          # (ib, i, h, k)
    s = _i(b[:, :, 74:106]).view(N, R, 8, 4, 1, 1) >> _ar([[0, 1, 2, 3], [4, 5, 6, 7]], b, 1, 1, 1, 1, 2, 4)
    s = ((s & 1) << _ar([[0, 2, 4, 6], [1, 3, 5, 7]], b, 1, 1, 1, 2, 4).transpose(-1, -2).unsqueeze(-1)).sum((3, 4))
    return _cat([_rows(b, 0, 2), qs, _by_unit(b, 66, 74, 8), s.transpose(1, 2),
                 _strided(_nib_fields(b[:, :, 106:110]), 4)])


def _p_iq1_s(b):        # intermediate IQ1_S_R4 rows: per 32 values 4 index bytes + u16
    return _cat([b[:, :, 0:4].transpose(1, 2), b[:, :, 4:6]])


def _p_iq1_m(b):        # intermediate IQ1_M_R4 rows: per 32 values 4 index bytes, 2 qh bytes, scale byte
    N, R = b.shape[:2]
    return _cat([b[:, :, 0:4].reshape(N, R, 2, 2).permute(0, 2, 3, 1), b[:, :, 4:6].transpose(1, 2), b[:, :, 6:7]])


def _p_iq2_bn(b):
    N, R = b.shape[:2]
    L = ((_i(b).view(N, R, 1, 16) >> _ar([0, 2, 4, 6], b, 1, 1, 4, 1)) & 3).reshape(N, R, 64)
    return _cat([_quads(L, tuple(tuple(16 * l + 4 * t for t in range(4)) for l in range(4)), 2, sub=64)])


def _p_q8_k(b):         # intermediate rows: fp16 d + 256 int8 per block
    return _cat([_rows(b, 0, 2), _by_unit(b, 2, 258, 64)])


def _p_q8_kv(b):        # 16 int8 per block
    return _cat([_by_unit(b, 0, 16, 4)])


def _p_bf16(b):
    return _cat([b])


# ------------------------------------------------------------------------ sign-code scrambling

def scramble(c: torch.Tensor) -> torch.Tensor:
    """7-bit sign code -> its prefix XOR (bit j = XOR of bits 0..j)."""
    t = c
    for s in range(1, 7):
        t = t ^ (c << s)
    return t & 127


def unscramble(t: torch.Tensor) -> torch.Tensor:
    return (t ^ (t << 1)) & 127


def _recode(width: int, spans, shifts):
    """A transform of intermediate rows that maps the 7-bit codes at bit `shifts` of the `width`-byte
    little-endian words starting at each offset in `spans` (per block) through fn."""
    def apply(rows: torch.Tensor, bb: int, hdr: int, fn) -> torch.Tensor:
        n = rows.shape[0]
        blk = rows[:, hdr:].reshape(n, -1, bb).clone()
        for off in spans:
            w = le_int(blk[..., off:off + width])
            for s in shifts:
                w = (w & ~(127 << s)) | (fn((w >> s) & 127) << s)
            blk[..., off:off + width] = ((w.unsqueeze(-1) >> (8 * torch.arange(width, device=w.device))) & 255).to(torch.uint8)
        return torch.cat([rows[:, :hdr], blk.reshape(n, -1)], -1)
    return apply


_IQ2XXS_CODES = _recode(4, [2 + 8 * ib + 4 for ib in range(8)], (0, 7, 14, 21))
_IQ3XXS_CODES = _recode(4, [66 + 4 * ib for ib in range(8)], (0, 7, 14, 21))
_IQ2XS_CODES = _recode(2, [2 + 2 * j for j in range(32)], (9,))


PACKS = {
    "Q4_0_R8": _p_q4_0, "MXFP4_R8": _p_q4_0, "Q8_0_R8": _p_q8_0, "Q5_0_R4": _p_q5_0, "Q6_0_R4": _p_q6_0,
    "IQ4_NL_R4": _p_iq4_nl, "Q2_K_R4": _p_q2_k, "Q3_K_R4": _p_q3_k, "Q4_K_R4": _p_q4_k, "Q5_K_R4": _p_q5_k,
    "Q6_K_R4": _p_q6_k, "IQ4_XS_R8": _p_iq4_xs, "IQ4_KS_R4": _p_iq4_ks, "IQ5_KS_R4": _p_iq5_ks,
    "IQ2_K_R4": _p_iq2_k, "IQ3_K_R4": _p_iq3_k, "IQ4_K_R4": _p_iq4_k, "IQ5_K_R4": _p_iq5_k,
    "IQ2_XXS_R4": _p_iq2_xxs, "IQ3_XXS_R4": _p_iq3_xxs, "IQ2_XS_R4": _p_iq2_xs, "IQ2_S_R4": _p_iq2_s,
    "IQ3_S_R4": _p_iq3_s, "IQ1_S_R4": _p_iq1_s, "IQ1_M_R4": _p_iq1_m, "IQ2_BN_R4": _p_iq2_bn,
    "Q8_K_R8": _p_q8_k, "Q8_KV_R8": _p_q8_kv, "BF16_R16": _p_bf16,
}
RECODE = {"IQ2_XXS_R4": _IQ2XXS_CODES, "IQ3_XXS_R4": _IQ3XXS_CODES, "IQ2_XS_R4": _IQ2XS_CODES}
