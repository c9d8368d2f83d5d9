"""Dot products of GGUF rows with a float activation for the types of the files users run: IQ4_XS, IQ4_KS, Q3_K,
Q2_K, the trellis IQ2_KT and gpt-oss's MXFP4, decoded in registers from their file bytes (gpu_decode._qdot's QT codes
5 to 10 call these), and the weight tiles of gpu_moe's grouped prompt GEMMs for IQ4_XS / IQ4_KS (iq4_tile), the K-quants
Q2_K to Q6_K (k_tile), IQ2_KT (kt_tile) and MXFP4 (mx_tile).

Same block formats as gpu_dequant.py's _iq4_xs_kernel / _iq4_ks_kernel / _q3_k_kernel / _iq2_kt_kernel and
quant/ref.py's Q2_K (read those for the byte layouts). Each step takes NB // 8 blocks of 256 of BN rows, so a tile
holds as many elements as gpu_decode's Q4_0 and K-quant steps; sums are taken per sub-block and scaled once, not
per element.
IQ4_NL's 16-value table lives in four int32 constants (byte q % 4 of word q // 4 is value q), so a lookup is two
selects and a shift in 32-bit integers, not a load; IQ4_KS's second table is IQ4_NL's plus 4 (quant/ref_ik.py
_IQ4K), added per sub-block. MXFP4's values come from their bits (_mx).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gpu_dequant import e8m0_half, f16_at, f32_at, k4_scale_min


def _pack(vals) -> int:
    """Four signed bytes, value i in byte i, as one signed int32."""
    u = sum((v & 255) << (8 * i) for i, v in enumerate(vals))
    return u - (1 << 32) if u >= 1 << 31 else u


_NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)   # quant/ref.py _KV_IQ4NL
_NL0, _NL1, _NL2, _NL3 = (tl.constexpr(_pack(_NL[i:i + 4])) for i in range(0, 16, 4))
_KT_KA = tl.constexpr(0xCBAC1FED - (1 << 32))     # the trellis generator's multiplier (quant/ref_trellis.py), as int32


@triton.jit
def _nl(q):
    """IQ4_NL's value of nibbles q (int32), as float32: byte q % 4 of word q // 4, sign-extended by the shifts."""
    w = tl.where(q < 8, tl.where(q < 4, _NL0, _NL1), tl.where(q < 12, _NL2, _NL3))
    return ((w << (24 - 8 * (q & 3))) >> 24).to(tl.float32)


@triton.jit
def _mx(q):
    """MXFP4's doubled e2m1 value of nibbles q (int32), as float32, by bits instead of a table: the sign (bit 3)
    goes to a float16's sign and the magnitude's exponent and mantissa bits (e1 e0 m) to its exponent's low two
    bits and its mantissa's top bit, a float16 of 2^-15 times the doubled value (e = 0: the subnormal 0 or 2^-15);
    the conversion is exact and 2^15 a power of two: quant/ref.py's _KV_MXFP4 doubled, without a lookup."""
    h = ((q & 8) << 12) | ((q & 7) << 9)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 32768.0


@triton.jit
def qdot_mxfp4(wrow, row_stride, n, nm, xp, K, BN: tl.constexpr, NB: tl.constexpr):
    """MXFP4 (gpt-oss's experts): 17-byte blocks of 32, an e8m0 exponent (e8m0_half: the values are doubled),
    then Q4_0's nibbles (byte i: elements i and i + 16). A block's 16 nibble bytes keep no alignment: they are
    read as the two aligned int32 words around each of their 4 words and shifted into place (as fast as byte
    loads on the H100: the nibbles' table lookups bound this GEMV, not its loads); the last word may read up to
    3 bytes past a block (the next block's, or past a tensor's end within its allocation's rounding)."""
    bi = tl.arange(0, NB)
    nblk = K // 32
    c = tl.arange(0, 4)
    rows = wrow + n.to(tl.int64)[:, None] * row_stride                               # [BN, 1]
    acc = tl.zeros([BN], tl.float32)
    for kb in range(0, nblk, NB):
        b = kb + bi
        bm = b < nblk
        m2 = nm[:, None] & bm[None, :]
        blk = rows + b[None, :] * 17                                                  # [BN, NB]
        off = (blk + 1).to(tl.int64) & 3                                              # the nibbles' misalignment
        wp = (blk + 1 - off).to(tl.pointer_type(tl.int32))[:, :, None] + c[None, None, :]
        m3 = m2[:, :, None]
        lo = tl.load(wp, mask=m3, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        hi = tl.load(wp + 1, mask=m3 & (off[:, :, None] > 0), other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        w = (((hi << 32) | lo) >> (8 * off)[:, :, None].to(tl.uint64)).to(tl.uint32).to(tl.int32, bitcast=True)
        # byte i of word c: elements 4c + i (low nibble) and 4c + i + 16 (high)
        xb = xp + b[:, None] * 32 + 4 * c[None, :]                                    # [NB, 4]
        sq = tl.zeros([BN, NB, 4], tl.float32)
        for i in tl.static_range(4):
            xl = tl.load(xb + i, mask=bm[:, None], other=0)
            xh = tl.load(xb + i + 16, mask=bm[:, None], other=0)
            sq += _mx((w >> (8 * i)) & 15) * xl[None] + _mx((w >> (8 * i + 4)) & 15) * xh[None]
        acc += tl.sum(tl.sum(sq, axis=2) * e8m0_half(tl.load(blk, mask=m2, other=0)), axis=1)
    return acc


@triton.jit
def qdot_iq4(wrow, row_stride, n, nm, xp, K, KS: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr):
    """IQ4_XS (KS False: 136-byte blocks, f16 d and 6-bit scales) or IQ4_KS (a float32 d per row, then
    136-byte blocks of 8 scale bytes): both have 8 sub-blocks of 32 whose 16 bytes of nibbles start at byte
    8 + 16 s, read here as 4 int32 words (blocks and rows are multiples of 4 bytes): byte i of word c holds
    elements 4c + i (low nibble) and 4c + i + 16 (high)."""
    NBK: tl.constexpr = NB // 8
    bi = tl.arange(0, NBK)
    nblk = K // 256
    s = tl.arange(0, 8)
    c = tl.arange(0, 4)
    row = wrow + n.to(tl.int64) * row_stride                                          # [BN]
    if KS:
        dr = f32_at(row, nm)
        row = row + 4
    rows = row[:, None]
    acc = tl.zeros([BN, NBK, 8], tl.float32)
    for kb in range(0, nblk, NBK):
        b = kb + bi
        bm = b < nblk
        m2 = nm[:, None] & bm[None, :]
        m3 = m2[:, :, None]
        blk = rows + b[None, :] * 136                                                 # [BN, NBK]
        wp = (blk[:, :, None, None] + 8 + 16 * s[None, None, :, None]).to(tl.pointer_type(tl.int32)) + \
            c[None, None, None, :]
        w = tl.load(wp, mask=m3[:, :, :, None], other=0)                              # [BN, NBK, 8, 4]
        xb = xp + b[:, None, None] * 256 + 32 * s[None, :, None] + 4 * c[None, None, :]   # [NBK, 8, 4]
        xm = bm[:, None, None]
        sq = tl.zeros([BN, NBK, 8], tl.float32)
        sx = tl.zeros([NBK, 8], tl.float32)
        for i in tl.static_range(4):
            xl = tl.load(xb + i, mask=xm, other=0)
            xh = tl.load(xb + i + 16, mask=xm, other=0)
            sq += tl.sum(_nl((w >> (8 * i)) & 15) * xl[None] + _nl((w >> (8 * i + 4)) & 15) * xh[None], axis=3)
            if KS:
                sx += tl.sum(xl + xh, axis=2)
        if KS:                                     # scale byte: (x & 254) - 127, bit 0 adds 4 to every value
            sc = tl.load(blk[:, :, None] + s[None, None, :], mask=m3, other=0).to(tl.int32)
            acc += ((sc & 254) - 127).to(tl.float32) * (sq + 4.0 * (sc & 1).to(tl.float32) * sx[None])
        else:                                      # scale s: nibble s % 2 of byte 4 + s // 2, high bits of the u16 at 2
            hi = (tl.load(blk[:, :, None] + 2 + s[None, None, :] // 4, mask=m3, other=0).to(tl.int32)
                  >> (2 * (s % 4))[None, None, :]) & 3
            lo = (tl.load(blk[:, :, None] + 4 + s[None, None, :] // 2, mask=m3, other=0).to(tl.int32)
                  >> (4 * (s % 2))[None, None, :]) & 15
            acc += f16_at(blk, m2)[:, :, None] * ((lo | (hi << 4)) - 32).to(tl.float32) * sq
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if KS:
        out = dr * out
    return out


@triton.jit
def qdot_q23_k(wrow, row_stride, n, nm, xp, K, Q2: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr):
    """Q3_K (Q2 False; 110 bytes: hmask[32], qs[64], 12 scale bytes, f16 d) or Q2_K (84 bytes: 16 scale bytes,
    qs[64], f16 d, f16 dmin). Element 128 h + 32 k + l is bits 2k of qs[32 h + l]; Q3_K: minus 4 unless bit
    4h + k of hmask[l] is set, sub-block i = e // 16 has scale i (6 bits); Q2_K: sub-block i has scale byte i,
    d (its low nibble) q - dmin (its high nibble). Row r of the [4, 16] tile is (h = r // 2, l = 16 (r % 2) +
    l0); step k of 4 takes one sub-block a row."""
    BS: tl.constexpr = 84 if Q2 else 110
    QS: tl.constexpr = 16 if Q2 else 32
    NBK: tl.constexpr = NB // 8
    bi = tl.arange(0, NBK)
    nblk = K // 256
    r = tl.arange(0, 4)
    h = r // 2
    l = (r % 2)[:, None] * 16 + tl.arange(0, 16)[None, :]                             # [4, 16]
    acc = tl.zeros([BN, NBK, 4], tl.float32)
    for kb in range(0, nblk, NBK):
        b = kb + bi
        bm = b < nblk
        m2 = nm[:, None] & bm[None, :]
        m3 = m2[:, :, None]
        m4 = m3[:, :, :, None]
        blk = wrow + n.to(tl.int64)[:, None] * row_stride + b[None, :] * BS              # [BN, NBK]
        bp = blk[:, :, None, None]
        qs = tl.load(bp + (QS + 32 * h[:, None] + l)[None, None], mask=m4, other=0).to(tl.int32)   # [BN, NBK, 4, 16]
        if Q2:
            hm = qs
        else:
            hm = tl.load(bp + l[None, None], mask=m4, other=0).to(tl.int32)
        xb = xp + b[:, None, None] * 256 + (128 * h[:, None] + l)[None]                  # [NBK, 4, 16]
        part = tl.zeros([BN, NBK, 4], tl.float32)
        mins = tl.zeros([BN, NBK, 4], tl.float32)
        for k in tl.static_range(4):
            xv = tl.load(xb + 32 * k, mask=bm[:, None, None], other=0)
            i = (8 * h + 2 * k + r % 2)[None, None, :]                                   # scale index
            if Q2:
                sq = tl.sum(((qs >> (2 * k)) & 3).to(tl.float32) * xv[None], axis=3)     # [BN, NBK, 4]
                sc = tl.load(blk[:, :, None] + i, mask=m3, other=0).to(tl.int32)
                part += (sc & 15).to(tl.float32) * sq
                mins += (sc >> 4).to(tl.float32) * tl.sum(xv, axis=2)[None]
            else:
                q = ((qs >> (2 * k)) & 3) - ((((hm >> (4 * h[:, None] + k)[None, None]) & 1) ^ 1) << 2)
                sq = tl.sum(q.to(tl.float32) * xv[None], axis=3)
                lo = (tl.load(blk[:, :, None] + 96 + i % 8, mask=m3, other=0).to(tl.int32) >> (4 * (i // 8))) & 15
                hi = (tl.load(blk[:, :, None] + 104 + i % 4, mask=m3, other=0).to(tl.int32) >> (2 * (i // 4))) & 3
                part += ((lo | (hi << 4)) - 32).to(tl.float32) * sq
        if Q2:
            acc += f16_at(blk + 80, m2)[:, :, None] * part - f16_at(blk + 82, m2)[:, :, None] * mins
        else:
            acc += f16_at(blk + 108, m2)[:, :, None] * part
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def qdot_iq2_kt(wrow, row_stride, n, nm, xp, K, BN: tl.constexpr, NB: tl.constexpr):
    """IQ2_KT: a float32 d per row, then 68-byte blocks of 256: 4 bytes of scale nibbles (sub-block s of 32:
    nibble s // 4 of byte s % 4, into IQ4_NL's table), then 32 u16 trellis indices, one per group of 8
    values: value k of index i is the byte sum of ((i + 4096) * ka^(k+1) mod 2^32) & 0x3F3F3F3F, minus 126.
    The 8 values of a group come from one running product, x *= ka, a step each."""
    NBK: tl.constexpr = NB // 8
    bi = tl.arange(0, NBK)
    nblk = K // 256
    g = tl.arange(0, 32)
    row = wrow + n.to(tl.int64) * row_stride                                          # [BN]
    dr = f32_at(row, nm)
    rows = (row + 4)[:, None]
    ka = tl.full([1, 1, 1], _KT_KA, tl.int32).to(tl.uint32, bitcast=True)
    acc = tl.zeros([BN, NBK, 32], tl.float32)
    for kb in range(0, nblk, NBK):
        b = kb + bi
        bm = b < nblk
        m3 = (nm[:, None] & bm[None, :])[:, :, None]
        blk = (rows + b[None, :] * 68)[:, :, None]                                    # [BN, NBK, 1]
        x = tl.load((blk + 4 + 2 * g[None, None, :]).to(tl.pointer_type(tl.uint16)), mask=m3, other=0)
        x = x.to(tl.uint32) + 4096                                                    # [BN, NBK, 32]
        s = g // 4
        nib = tl.load(blk + (s % 4)[None, None, :], mask=m3, other=0).to(tl.int32)
        nib = (nib >> (4 * (s // 4))[None, None, :]) & 15
        xb = xp + b[:, None] * 256 + 8 * g[None, :]                                  # [NBK, 32]
        sq = tl.zeros([BN, NBK, 32], tl.float32)
        for k in tl.static_range(8):
            x = x * ka
            v = (((x & 0x3F3F3F3F) * 0x01010101) >> 24).to(tl.int32) - 126                 # kt_tile's byte sum
            sq += v.to(tl.float32) * tl.load(xb + k, mask=bm[:, None], other=0)[None]
        acc += _nl(nib) * sq
    return dr * tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def iq4_tile(wp, rs, n64, nm, b, bm, KS: tl.constexpr, BN: tl.constexpr, NBK: tl.constexpr):
    """Weights [BN, NBK, 16, 2] (float32) of rows n64 (rs bytes each, from wp; real where nm) of an IQ4_XS
    (KS False) or IQ4_KS matrix, 32-blocks b (sub-block b % 8 of block b // 8; real where bm [BN, NBK]), in
    the order of gpu_moe's Q4_0 tiles: [.., j, h] is element j + 16 h of its 32-block (nibbles as Q4_0's)."""
    row = wp + n64 * rs
    if KS:
        dr = f32_at(row, nm)                                                          # [BN]
        row = row + 4
    s = b % 8
    blk = row[:, None] + (b // 8)[None, :] * 136                                       # [BN, NBK]
    c = tl.arange(0, 4)
    w = tl.load((blk + 8 + 16 * s[None, :]).to(tl.pointer_type(tl.int32))[:, :, None] + c[None, None, :],
                mask=bm[:, :, None], other=0)                                          # [BN, NBK, 4]
    # byte i of word c: elements 4c + i (low nibble), 4c + i + 16 (high)
    lo = tl.reshape(tl.join(tl.join(w & 15, (w >> 16) & 15), tl.join((w >> 8) & 15, (w >> 24) & 15)),
                    [BN, NBK, 16])
    hi = tl.reshape(tl.join(tl.join((w >> 4) & 15, (w >> 20) & 15), tl.join((w >> 12) & 15, (w >> 28) & 15)),
                    [BN, NBK, 16])
    v = _nl(tl.join(lo, hi))                                                           # [BN, NBK, 16, 2]
    if KS:
        sc = tl.load(blk + s[None, :], mask=bm, other=0).to(tl.int32)
        v = v + 4.0 * (sc & 1).to(tl.float32)[:, :, None, None]
        dl = dr[:, None] * ((sc & 254) - 127).to(tl.float32)
    else:
        hb = (tl.load(blk + 2 + s[None, :] // 4, mask=bm, other=0).to(tl.int32) >> (2 * (s % 4))[None, :]) & 3
        lb = (tl.load(blk + 4 + s[None, :] // 2, mask=bm, other=0).to(tl.int32) >> (4 * (s % 2))[None, :]) & 15
        dl = f16_at(blk, bm) * ((lb | (hb << 4)) - 32).to(tl.float32)
    return v * dl[:, :, None, None]


@triton.jit
def mx_tile(wp, rs, n64, nm, b, bm, BN: tl.constexpr, NBK: tl.constexpr):
    """Weights [BN, NBK, 16, 2] (float32) of rows n64 (rs bytes each, from wp; real where nm) of an MXFP4 matrix,
    32-blocks b (real where bm [BN, NBK]) in Q4_0's interleaved order (its nibbles are Q4_0's: [.., i, h] is
    element i + 16 h), read byte by byte (17-byte blocks keep no wider alignment; a GEMM tile's bytes are read
    once for BM rows)."""
    blk = wp + n64[:, None] * rs + b[None, :] * 17                                   # [BN, NBK]
    q = tl.load(blk[:, :, None] + 1 + tl.arange(0, 16)[None, None, :], mask=bm[:, :, None], other=0).to(tl.int32)
    d = e8m0_half(tl.load(blk, mask=bm, other=0))
    return _mx(tl.join(q & 15, q >> 4)) * d[:, :, None, None]


@triton.jit
def _bytes32(p, m, W: tl.constexpr, BN: tl.constexpr, NBK: tl.constexpr):
    """The 32 bytes at byte pointers p [BN, NBK] (real where m), as int32 [BN, NBK, 32] in order: read as 8
    int32 words (W 4: p a multiple of 4) or 16 halfwords (W 2)."""
    if W == 4:
        c = tl.arange(0, 8)
        w = tl.load(p.to(tl.pointer_type(tl.int32))[:, :, None] + c[None, None, :], mask=m[:, :, None], other=0)
        # byte i of word c: element 4c + i
        v = tl.join(tl.join(w & 255, (w >> 16) & 255), tl.join((w >> 8) & 255, (w >> 24) & 255))
    else:
        c = tl.arange(0, 16)
        w = tl.load(p.to(tl.pointer_type(tl.uint16))[:, :, None] + c[None, None, :], mask=m[:, :, None],
                    other=0).to(tl.int32)
        v = tl.join(w & 255, w >> 8)
    return tl.reshape(v, [BN, NBK, 32])


@triton.jit
def k_tile(wp, rs, n64, nm, b, bm, QT: tl.constexpr, BN: tl.constexpr, NBK: tl.constexpr):
    """Weights [BN, NBK, 32] (float32) of rows n64 (rs bytes each, from wp; real where nm) of a Q4_K (QT 2),
    Q6_K (3), Q5_K (4), Q3_K (7) or Q2_K (9) matrix, 32-blocks b (sub-block s = b % 8 of super-block b // 8, or its two
    16-element sub-blocks; real where bm [BN, NBK]), elements in their natural order. Q4_K's, Q5_K's and Q2_K's
    144-, 176- and 84-byte blocks are read as int32 words, Q6_K's 210 and Q3_K's 110 bytes as halfwords (the
    layouts: gpu_dequant.py's kernels of these types, qdot_q23_k)."""
    row = wp + n64 * rs
    s = b % 8
    if QT == 2 or QT == 4:           # d, dmin, 12 scale bytes, (Q5_K: qh[32]), 4 x 32 bytes of nibbles
        BS: tl.constexpr = 144 if QT == 2 else 176
        QS: tl.constexpr = 16 if QT == 2 else 48
        blk = row[:, None] + (b // 8)[None, :] * BS                                    # [BN, NBK]
        # sub-block s: the low (s even) or high nibbles of the 32 bytes of group s // 2
        q = (_bytes32(blk + QS + (32 * (s // 2))[None, :], bm, 4, BN, NBK) >> (4 * (s % 2))[None, :, None]) & 15
        if QT == 4:                  # bit s of qh[l]: the 5th bit of element l
            q = q | (((_bytes32(blk + 16, bm, 4, BN, NBK) >> s[None, :, None]) & 1) << 4)
        sc, mn = k4_scale_min(blk + 4, s[None, :], bm)
        v = (f16_at(blk, bm) * sc)[:, :, None] * q.to(tl.float32) - (f16_at(blk + 2, bm) * mn)[:, :, None]
    else:                            # element 128 h + 32 k + l of a block: h = s // 4, k = s % 4
        h = s // 4
        k = s % 4
        i = (8 * h + 2 * k)[None, :, None] + tl.arange(0, 2)[None, None, :]            # [1, NBK, 2]: the 16s' scales
        m3 = bm[:, :, None]
        dm = tl.zeros([BN, NBK, 2], tl.float32)                                            # the mins' term
        if QT == 9:                  # Q2_K: 16 scale bytes (scale | min << 4), qs[64], f16 d, f16 dmin
            blk = row[:, None] + (b // 8)[None, :] * 84
            q = (_bytes32(blk + (16 + 32 * h)[None, :], bm, 4, BN, NBK) >> (2 * k)[None, :, None]) & 3
            sb = tl.load(blk[:, :, None] + i, mask=m3, other=0).to(tl.int32)
            sc = (sb & 15).to(tl.float32)
            d = f16_at(blk + 80, bm)
            dm = f16_at(blk + 82, bm)[:, :, None] * (sb >> 4).to(tl.float32)
        elif QT == 3:                # Q6_K: ql[128], qh[64], 16 int8 scales, f16 d
            blk = row[:, None] + (b // 8)[None, :] * 210
            ql = _bytes32(blk + (64 * h + 32 * (k % 2))[None, :], bm, 2, BN, NBK)
            qh = _bytes32(blk + (128 + 32 * h)[None, :], bm, 2, BN, NBK)
            q = ((ql >> (4 * (k // 2))[None, :, None]) & 15) | (((qh >> (2 * k)[None, :, None]) & 3) << 4)
            q = q - 32
            sc = tl.load(blk[:, :, None] + 192 + i, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            d = f16_at(blk + 208, bm)
        else:                        # Q3_K: hmask[32], qs[64], 12 scale bytes, f16 d; bit 4h + k of hmask[l]
            blk = row[:, None] + (b // 8)[None, :] * 110
            qs = _bytes32(blk + (32 + 32 * h)[None, :], bm, 2, BN, NBK)
            hm = _bytes32(blk, bm, 2, BN, NBK)
            q = ((qs >> (2 * k)[None, :, None]) & 3) - ((((hm >> (4 * h + k)[None, :, None]) & 1) ^ 1) << 2)
            lo = (tl.load(blk[:, :, None] + 96 + i % 8, mask=m3, other=0).to(tl.int32) >> (4 * (i // 8))) & 15
            hi = (tl.load(blk[:, :, None] + 104 + i % 4, mask=m3, other=0).to(tl.int32) >> (2 * (i // 4))) & 3
            sc = ((lo | (hi << 4)) - 32).to(tl.float32)
            d = f16_at(blk + 108, bm)
        v = tl.reshape(q.to(tl.float32), [BN, NBK, 2, 16]) * (d[:, :, None] * sc)[:, :, :, None] - dm[:, :, :, None]
    return v


@triton.jit
def kt_tile(wp, rs, n64, nm, b, bm, BN: tl.constexpr, NBK: tl.constexpr):
    """Weights [BN, NBK, 4, 8] (float32) of rows n64 (rs bytes each, from wp; real where nm) of an IQ2_KT matrix,
    32-blocks b (sub-block s = b % 8 of super-block b // 8; real where bm [BN, NBK]), in natural order: [.., j, k]
    is value k of the sub-block's index j, (index + 4096) * ka^(k+1) taken at once for the 8 values (powers of
    ka made here, not a running product), their 4-byte sums as the top byte of a multiply by 0x01010101 (each
    byte <= 63: no carries into it). Layout: qdot_iq2_kt."""
    row = wp + n64 * rs
    dr = f32_at(row, nm)                                                              # [BN]
    s = b % 8
    blk = row[:, None] + 4 + (b // 8)[None, :] * 68                                   # [BN, NBK]
    j = tl.arange(0, 4)
    i = tl.load((blk + 4 + 8 * s[None, :]).to(tl.pointer_type(tl.uint16))[:, :, None] + j[None, None, :],
                mask=bm[:, :, None], other=0).to(tl.uint32) + 4096                     # [BN, NBK, 4]
    k = tl.arange(0, 8)
    pw = tl.full([8], 1, tl.uint32)
    ka = tl.full([8], _KT_KA, tl.int32).to(tl.uint32, bitcast=True)
    for step in tl.static_range(8):
        pw = tl.where(k >= step, pw * ka, pw)                                         # ka^(k+1)
    t = (i[:, :, :, None] * pw[None, None, None, :]) & 0x3F3F3F3F
    v = ((t * 0x01010101) >> 24).to(tl.int32) - 126                                  # [BN, NBK, 4, 8]
    nib = (tl.load(blk + s[None, :] % 4, mask=bm, other=0).to(tl.int32) >> (4 * (s // 4))[None, :]) & 15
    return v.to(tl.float32) * (dr[:, None] * _nl(nib))[:, :, None, None]
