"""GGUF blocks -> bf16 on the GPU in one pass (Triton), for the expert GEMMs.

The torch reference dequantizer makes several passes over the data; for prompt processing with a whole
layer's experts (hundreds of MB of blocks per layer) that pass count is the cost. One Triton program
per group of blocks reads each byte once and writes bf16 once: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, and the types of
the files users run (models/mixes.py): Q2_K, Q3_K, IQ4_NL, IQ4_XS, gpt-oss's MXFP4, ik_llama.cpp's IQ4_K, IQ5_K,
IQ4_KS, IQ5_KS and the trellis IQ2_KT, IQ3_KT, IQ4_KT (the _KS / _KT rows start with a float32 scale, so a block's
bytes are found from its row). The row-interleaved _R4 / _R8 layouts of these are deinterleaved with torch ops
and then take their base type's kernel. Types without a kernel here (or whose kernel fails to build on a
GPU) use quant/dequant.py's reference. Each kernel is checked against the
reference, bit for bit on a GPU (tests/test_gpu_kernels.py, tests/test_gpu_decode.py) and within one bf16
step in Triton's interpreter.
"""
from __future__ import annotations

import contextlib
import os

import torch

from ..quant.ref import _KV_IQ4NL, _KV_MXFP4
from ..quant.ref_ik import _IQ4K, _IQ5NL
from ..quant.types import GGMLType, interleave, row_bytes

try:
    import triton
    import triton.language as tl
except ImportError:                                      # CPU-only installs
    triton = None

BLOCKS_PER_PROGRAM = 64
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"             # tests on the CPU in Triton's interpreter

if triton is not None:
    @triton.jit
    def quant_blocks(v, b, r, K, q1, q2, xs, xc):
        """Blocks b (v: their [NB, 32] float32 values) of row r of a K-column activation in two int8 terms,
        as the CPU kernel's integer path (cpu_moe.c): x ~ d / 256 * (256 q1 + q2), d = max|x| / 127;
        xs = d / 256 and xc = -8 (256 sum q1 + sum q2), the term a Q4_0 block's offset of 8 contributes."""
        nblk = K // 32
        bm = b < nblk
        j = tl.arange(0, 32)
        amax = tl.max(tl.abs(v), axis=1)
        t = v * (127.0 / tl.maximum(amax, 1e-30))[:, None]          # all-zero blocks stay 0
        a = tl.floor(t + 0.5)
        c = tl.minimum(tl.floor((t - a) * 256.0 + 0.5), 127.0)
        o = r * K + b[:, None] * 32 + j[None, :]
        tl.store(q1 + o, a.to(tl.int8), mask=bm[:, None])
        tl.store(q2 + o, c.to(tl.int8), mask=bm[:, None])
        tl.store(xs + r * nblk + b, amax * (1.0 / (127.0 * 256.0)), mask=bm)
        tl.store(xc + r * nblk + b, (-8.0 * (256.0 * tl.sum(a, axis=1) + tl.sum(c, axis=1))).to(tl.int32), mask=bm)

    @triton.jit
    def _src_block(b, idx, bpe, HAS_IDX: tl.constexpr):
        """Output block b -> source block: with an index, slab b // bpe comes from slab idx[b // bpe]."""
        b64 = b.to(tl.int64)
        if HAS_IDX:
            slab = tl.load(idx + b64 // bpe).to(tl.int64)
            return slab * bpe + b64 % bpe
        return b64

    @triton.jit
    def _blocks(n_blocks, idx, bpe, BB: tl.constexpr, HAS_IDX: tl.constexpr, BS: tl.constexpr):
        """This program's output block ids [BB], which are real, and their source byte offsets (BS bytes each)."""
        b = tl.program_id(0) * BB + tl.arange(0, BB)
        bm = b < n_blocks
        return b, bm, _src_block(tl.where(bm, b, 0), idx, bpe, HAS_IDX) * BS

    @triton.jit
    def _q4_0_kernel(src, dst, n_blocks, idx, bpe, BB: tl.constexpr, HAS_IDX: tl.constexpr):
        b, bm, base = _blocks(n_blocks, idx, bpe, BB, HAS_IDX, 18)
        lo = tl.load(src + base, mask=bm, other=0).to(tl.uint16)
        hi = tl.load(src + base + 1, mask=bm, other=0).to(tl.uint16)
        d = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)   # [BB]
        e = tl.arange(0, 32)                                               # element in block
        byte = tl.load(src + base[:, None] + 2 + (e[None, :] % 16), mask=bm[:, None], other=0)
        q = ((byte >> ((e[None, :] // 16) * 4).to(tl.uint8)) & 15).to(tl.int32) - 8
        val = d[:, None] * q.to(tl.float32)
        tl.store(dst + b.to(tl.int64)[:, None] * 32 + e[None, :], val.to(tl.bfloat16), mask=bm[:, None])

    @triton.jit
    def _q8_0_kernel(src, dst, n_blocks, idx, bpe, BB: tl.constexpr, HAS_IDX: tl.constexpr):
        b, bm, base = _blocks(n_blocks, idx, bpe, BB, HAS_IDX, 34)
        lo = tl.load(src + base, mask=bm, other=0).to(tl.uint16)
        hi = tl.load(src + base + 1, mask=bm, other=0).to(tl.uint16)
        d = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        e = tl.arange(0, 32)
        q = tl.load(src + base[:, None] + 2 + e[None, :], mask=bm[:, None], other=0).to(tl.int8, bitcast=True)
        val = d[:, None] * q.to(tl.float32)
        tl.store(dst + b.to(tl.int64)[:, None] * 32 + e[None, :], val.to(tl.bfloat16), mask=bm[:, None])

    @triton.jit
    def f16_at(p, mask):
        """The little-endian f16 at byte pointers p, as float32."""
        lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def k4_scale_min(sp, j, mask):
        """Q4_K/Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 scale bytes at sp
        (sp, j and mask broadcast together)."""
        a = tl.load(sp + j, mask=mask, other=0).to(tl.int32)                              # q[j]
        b = tl.load(sp + (j + 4) % 12, mask=mask, other=0).to(tl.int32)                 # q[j+4]
        c = tl.load(sp + tl.where(j >= 4, j - 4, j), mask=mask, other=0).to(tl.int32)   # q[j-4]
        sc = tl.where(j < 4, a & 63, (b & 15) | ((c >> 6) << 4)).to(tl.float32)
        mn = tl.where(j < 4, b & 63, (b >> 4) | ((a >> 6) << 4)).to(tl.float32)
        return sc, mn

    @triton.jit
    def _q45_k_kernel(src, dst, n_blocks, idx, bpe, BB: tl.constexpr, HAS_IDX: tl.constexpr, Q5: tl.constexpr):
        """256-element super-blocks: d, dmin, 12 bytes of 6-bit scales/mins, then (Q5_K) qh[32], whose bit j
        of qh[l] is the 5th bit of element l of sub-block j, then 4 x 32 bytes of nibbles (group g: low
        nibbles sub-block 2g, high 2g+1). Q4_K: 144 bytes, Q5_K: 176."""
        BS: tl.constexpr = 176 if Q5 else 144
        QS: tl.constexpr = 48 if Q5 else 16
        b, bm, base = _blocks(n_blocks, idx, bpe, BB, HAS_IDX, BS)
        d = f16_at(src + base, bm)[:, None]
        dmin = f16_at(src + base + 2, bm)[:, None]
        e = tl.arange(0, 256)[None, :]
        j = e // 32                                                        # sub-block 0..7
        m2 = bm[:, None]
        byte = tl.load(src + base[:, None] + QS + (j // 2) * 32 + e % 32, mask=m2, other=0).to(tl.int32)
        q = (byte >> (4 * (j % 2))) & 15
        if Q5:
            qh = tl.load(src + base[:, None] + 16 + e % 32, mask=m2, other=0).to(tl.int32)
            q = q | (((qh >> j) & 1) << 4)
        sc, mn = k4_scale_min(src + base[:, None] + 4, j, m2)
        val = (d * sc) * q.to(tl.float32) - dmin * mn                     # the reference's order of ops
        tl.store(dst + b.to(tl.int64)[:, None] * 256 + e, val.to(tl.bfloat16), mask=m2)

    @triton.jit
    def _q6_k_kernel(src, dst, n_blocks, idx, bpe, BB: tl.constexpr, HAS_IDX: tl.constexpr):
        """256-element super-blocks of 210 bytes: ql[128], qh[64], 16 int8 scales, d."""
        b, bm, base = _blocks(n_blocks, idx, bpe, BB, HAS_IDX, 210)
        d = f16_at(src + base + 208, bm)[:, None]
        e = tl.arange(0, 256)[None, :]
        h = e // 128                                                       # half
        r = e % 128
        quarter = r // 32                                                  # 0..3: ql lo/hi nibble, qh bit pair
        l = r % 32
        m2 = bm[:, None]
        ql = tl.load(src + base[:, None] + 64 * h + l + 32 * (quarter % 2), mask=m2, other=0).to(tl.int32)
        qh = tl.load(src + base[:, None] + 128 + 32 * h + l, mask=m2, other=0).to(tl.int32)
        lo = tl.where(quarter >= 2, ql >> 4, ql & 15)
        q = (lo | (((qh >> (2 * quarter)) & 3) << 4)) - 32
        sc = tl.load(src + base[:, None] + 192 + e // 16, mask=m2, other=0).to(tl.int8, bitcast=True)
        val = (d * sc.to(tl.float32)) * q.to(tl.float32)
        tl.store(dst + b.to(tl.int64)[:, None] * 256 + e, val.to(tl.bfloat16), mask=m2)

    @triton.jit
    def e8m0_half(e):
        """Half the scale of e8m0 exponent bytes e, 2^(e - 128), as float32 (e < 2 denormal: ggml's
        e8m0_to_fp32_half, bit for bit)."""
        e = e.to(tl.int32)
        return tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def f32_at(p, mask):
        """The little-endian float32 at byte pointers p."""
        w = tl.load(p, mask=mask, other=0).to(tl.uint32)
        w = w | (tl.load(p + 1, mask=mask, other=0).to(tl.uint32) << 8)
        w = w | (tl.load(p + 2, mask=mask, other=0).to(tl.uint32) << 16)
        w = w | (tl.load(p + 3, mask=mask, other=0).to(tl.uint32) << 24)
        return w.to(tl.float32, bitcast=True)

    @triton.jit
    def _row_blocks(n_blocks, idx, bpe, nbr, BB: tl.constexpr, HAS_IDX: tl.constexpr, BS: tl.constexpr,
                    HDR: tl.constexpr):
        """As _blocks, for rows of nbr blocks behind a HDR-byte header: (block ids, mask, the blocks' byte
        offsets, their rows' byte offsets)."""
        b = tl.program_id(0) * BB + tl.arange(0, BB)
        bm = b < n_blocks
        src = _src_block(tl.where(bm, b, 0), idx, bpe, HAS_IDX)
        row = (src // nbr) * (HDR + nbr * BS)
        return b, bm, row + HDR + (src % nbr) * BS, row

    @triton.jit
    def _q2_k_kernel(src, dst, n_blocks, idx, bpe, nbr, tab, tab2, BB: tl.constexpr, HAS_IDX: tl.constexpr):
        """84 bytes: 16 scale bytes (low nibble scale, high nibble min of each 16), qs[64] (element
        128h + 32k + l: bits 2k of qs[32h + l]), d, dmin."""
        b, bm, base, _ = _row_blocks(n_blocks, idx, bpe, nbr, BB, HAS_IDX, 84, 0)
        m2 = bm[:, None]
        e = tl.arange(0, 256)[None, :]
        d = f16_at(src + base + 80, bm)[:, None]
        dmin = f16_at(src + base + 82, bm)[:, None]
        sc = tl.load(src + base[:, None] + e // 16, mask=m2, other=0).to(tl.int32)
        q = (tl.load(src + base[:, None] + 16 + 32 * (e // 128) + e % 32, mask=m2, other=0).to(tl.int32)
             >> (2 * ((e % 128) // 32))) & 3
        val = (d * (sc & 15).to(tl.float32)) * q.to(tl.float32) - dmin * (sc >> 4).to(tl.float32)
        tl.store(dst + b.to(tl.int64)[:, None] * 256 + e, val.to(tl.bfloat16), mask=m2)

    @triton.jit
    def _q3_k_kernel(src, dst, n_blocks, idx, bpe, nbr, tab, tab2, BB: tl.constexpr, HAS_IDX: tl.constexpr):
        """110 bytes: hmask[32] (bit 4h + k of hmask[l] set: no -4), qs[64] as Q2_K's, 12 bytes of 6-bit
        scales (low 4 bits: nibble i // 8 of byte i % 8; high 2: bits 2 (i // 4) of byte 8 + i % 4), d."""
        b, bm, base, _ = _row_blocks(n_blocks, idx, bpe, nbr, BB, HAS_IDX, 110, 0)
        m2 = bm[:, None]
        e = tl.arange(0, 256)[None, :]
        h, k, l, i = e // 128, (e % 128) // 32, e % 32, e // 16
        d = f16_at(src + base + 108, bm)[:, None]
        hm = (tl.load(src + base[:, None] + l, mask=m2, other=0).to(tl.int32) >> (4 * h + k)) & 1
        q = (tl.load(src + base[:, None] + 32 + 32 * h + l, mask=m2, other=0).to(tl.int32) >> (2 * k)) & 3
        q = q - ((hm ^ 1) << 2)
        lo = (tl.load(src + base[:, None] + 96 + i % 8, mask=m2, other=0).to(tl.int32) >> (4 * (i // 8))) & 15
        hi = (tl.load(src + base[:, None] + 104 + i % 4, mask=m2, other=0).to(tl.int32) >> (2 * (i // 4))) & 3
        val = (d * ((lo | (hi << 4)) - 32).to(tl.float32)) * q.to(tl.float32)
        tl.store(dst + b.to(tl.int64)[:, None] * 256 + e, val.to(tl.bfloat16), mask=m2)

    @triton.jit
    def _iq4_xs_kernel(src, dst, n_blocks, idx, bpe, nbr, tab, tab2, BB: tl.constexpr, HAS_IDX: tl.constexpr):
        """136 bytes: d, scales_h (u16: bits 2s of sub-block s's scale), scales_l[4] (nibble s % 2 of byte
        s // 2), then 16 bytes of nibbles per 32 (element j: nibble j // 16 of byte j % 16) into IQ4_NL's
        table (tab)."""
        b, bm, base, _ = _row_blocks(n_blocks, idx, bpe, nbr, BB, HAS_IDX, 136, 0)
        m2 = bm[:, None]
        e = tl.arange(0, 256)[None, :]
        s, j = e // 32, e % 32
        d = f16_at(src + base, bm)[:, None]
        sh = tl.load(src + base[:, None] + 2 + s // 4, mask=m2, other=0).to(tl.int32)   # byte of scales_h
        hi = (sh >> (2 * (s % 4))) & 3
        lo = (tl.load(src + base[:, None] + 4 + s // 2, mask=m2, other=0).to(tl.int32) >> (4 * (s % 2))) & 15
        q = (tl.load(src + base[:, None] + 8 + 16 * s + j % 16, mask=m2, other=0).to(tl.int32) >> (4 * (j // 16))) & 15
        v = tl.load(tab + q)
        val = (d * ((lo | (hi << 4)) - 32).to(tl.float32)) * v
        tl.store(dst + b.to(tl.int64)[:, None] * 256 + e, val.to(tl.bfloat16), mask=m2)

    @triton.jit
    def _iq4_ks_kernel(src, dst, n_blocks, idx, bpe, nbr, tab, tab2, BB: tl.constexpr, HAS_IDX: tl.constexpr):
        """Rows: float32 d, then 136-byte blocks: 8 scale bytes ((x & 254) - 127, bit 0 picks the second
        half of the IQ4_K table, tab), then nibbles laid out as IQ4_XS's."""
        b, bm, base, row = _row_blocks(n_blocks, idx, bpe, nbr, BB, HAS_IDX, 136, 4)
        m2 = bm[:, None]
        e = tl.arange(0, 256)[None, :]
        s, j = e // 32, e % 32
        d = f32_at(src + row, bm)[:, None]
        sc = tl.load(src + base[:, None] + s, mask=m2, other=0).to(tl.int32)
        q = (tl.load(src + base[:, None] + 8 + 16 * s + j % 16, mask=m2, other=0).to(tl.int32) >> (4 * (j // 16))) & 15
        v = tl.load(tab + q + 16 * (sc & 1))
        val = (d * ((sc & 254) - 127).to(tl.float32)) * v
        tl.store(dst + b.to(tl.int64)[:, None] * 256 + e, val.to(tl.bfloat16), mask=m2)

    @triton.jit
    def _iq2_kt_kernel(src, dst, n_blocks, idx, bpe, nbr, tab, tab2, BB: tl.constexpr, HAS_IDX: tl.constexpr):
        """Rows: float32 d, then 68-byte blocks: 4 bytes of scale nibbles (sub-block s: nibble s // 4 of
        byte s % 4, into IQ4_NL's table, tab), then 32 u16 trellis indices, one per 8 values: value k of
        index i is the byte sum of ((i + 4096) * ka^(k+1) mod 2^32) & 0x3F3F3F3F, minus 126 (tab2: ka^(k+1))."""
        b, bm, base, row = _row_blocks(n_blocks, idx, bpe, nbr, BB, HAS_IDX, 68, 4)
        m2 = bm[:, None]
        e = tl.arange(0, 256)[None, :]
        s, g = e // 32, e // 8
        d = f32_at(src + row, bm)[:, None]
        nib = (tl.load(src + base[:, None] + s % 4, mask=m2, other=0).to(tl.int32) >> (4 * (s // 4))) & 15
        code = tl.load(tab + nib)
        i = tl.load(src + base[:, None] + 4 + 2 * g, mask=m2, other=0).to(tl.uint32)
        i = i | (tl.load(src + base[:, None] + 5 + 2 * g, mask=m2, other=0).to(tl.uint32) << 8)
        x = (i + 4096) * tl.load(tab2 + e % 8).to(tl.uint32, bitcast=True)
        x = x & 0x3F3F3F3F
        v = ((x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)).to(tl.int32) - 126
        val = (d * code) * v.to(tl.float32)
        tl.store(dst + b.to(tl.int64)[:, None] * 256 + e, val.to(tl.bfloat16), mask=m2)

    @triton.jit
    def _mxfp4_kernel(src, dst, n_blocks, idx, bpe, nbr, tab, tab2, BB: tl.constexpr, HAS_IDX: tl.constexpr):
        """17 bytes a 32: an e8m0 exponent (e8m0_half: tab holds the doubled e2m1 values), then Q4_0's nibbles
        into tab."""
        b, bm, base, _ = _row_blocks(n_blocks, idx, bpe, nbr, BB, HAS_IDX, 17, 0)
        m2 = bm[:, None]
        e = tl.arange(0, 32)[None, :]
        d = e8m0_half(tl.load(src + base, mask=bm, other=0))[:, None]
        q = (tl.load(src + base[:, None] + 1 + e % 16, mask=m2, other=0).to(tl.int32) >> (4 * (e // 16))) & 15
        val = d * tl.load(tab + q)
        tl.store(dst + b.to(tl.int64)[:, None] * 32 + e, val.to(tl.bfloat16), mask=m2)

    @triton.jit
    def _iq4_nl_kernel(src, dst, n_blocks, idx, bpe, nbr, tab, tab2, BB: tl.constexpr, HAS_IDX: tl.constexpr):
        """18 bytes a 32: d, then Q4_0's nibbles into IQ4_NL's table (tab)."""
        b, bm, base, _ = _row_blocks(n_blocks, idx, bpe, nbr, BB, HAS_IDX, 18, 0)
        m2 = bm[:, None]
        e = tl.arange(0, 32)[None, :]
        d = f16_at(src + base, bm)[:, None]
        q = (tl.load(src + base[:, None] + 2 + e % 16, mask=m2, other=0).to(tl.int32) >> (4 * (e // 16))) & 15
        val = d * tl.load(tab + q)
        tl.store(dst + b.to(tl.int64)[:, None] * 32 + e, val.to(tl.bfloat16), mask=m2)

    @triton.jit
    def _k16_scale(sp, e, m2):
        """IQ4_K / IQ5_K: the 6-bit scale of 16-element sub-block i = e // 16: low 4 bits nibble i % 2 of
        scales_l[i // 2] (at sp + 4), high 2 bits bits 2 (i % 4) of scales_h[i // 4] (at sp)."""
        i = e // 16
        lo = (tl.load(sp + 4 + i // 2, mask=m2, other=0).to(tl.int32) >> (4 * (i % 2))) & 15
        hi = (tl.load(sp + i // 4, mask=m2, other=0).to(tl.int32) >> (2 * (i % 4))) & 3
        return lo | (hi << 4)

    @triton.jit
    def _iq45_k_kernel(src, dst, n_blocks, idx, bpe, nbr, tab, tab2, BB: tl.constexpr, HAS_IDX: tl.constexpr,
                       Q5: tl.constexpr):
        """d, extra (u16: bit i picks the second half of the table for sub-block i of 16), scales_h[4],
        scales_l[8], then IQ4_K: nibbles as IQ4_XS's (144 bytes); IQ5_K: per 64 elements 32 bytes, low
        nibbles then high, and bit e // 32 of qh[e % 32] on top (176 bytes)."""
        BS: tl.constexpr = 176 if Q5 else 144
        b, bm, base, _ = _row_blocks(n_blocks, idx, bpe, nbr, BB, HAS_IDX, BS, 0)
        m2 = bm[:, None]
        e = tl.arange(0, 256)[None, :]
        d = f16_at(src + base, bm)[:, None]
        i = e // 16
        extra = (tl.load(src + base[:, None] + 2 + i // 8, mask=m2, other=0).to(tl.int32) >> (i % 8)) & 1
        ls = _k16_scale(src + base[:, None] + 4, e, m2)
        if Q5:
            q = (tl.load(src + base[:, None] + 16 + 32 * (e // 64) + e % 32, mask=m2, other=0).to(tl.int32)
                 >> (4 * ((e % 64) // 32))) & 15
            q = q | (((tl.load(src + base[:, None] + 144 + e % 32, mask=m2, other=0).to(tl.int32) >> (e // 32)) & 1) << 4)
            v = tl.load(tab + q + 32 * extra)
        else:
            q = (tl.load(src + base[:, None] + 16 + 16 * (e // 32) + e % 16, mask=m2, other=0).to(tl.int32)
                 >> (4 * ((e % 32) // 16))) & 15
            v = tl.load(tab + q + 16 * extra)
        val = (d * (ls - 32).to(tl.float32)) * v
        tl.store(dst + b.to(tl.int64)[:, None] * 256 + e, val.to(tl.bfloat16), mask=m2)

    @triton.jit
    def _iq5_ks_kernel(src, dst, n_blocks, idx, bpe, nbr, tab, tab2, BB: tl.constexpr, HAS_IDX: tl.constexpr):
        """Rows: float32 d, then 168-byte blocks: 8 scale bytes as IQ4_KS's, quants as IQ5_K's (qh at 136)."""
        b, bm, base, row = _row_blocks(n_blocks, idx, bpe, nbr, BB, HAS_IDX, 168, 4)
        m2 = bm[:, None]
        e = tl.arange(0, 256)[None, :]
        d = f32_at(src + row, bm)[:, None]
        sc = tl.load(src + base[:, None] + e // 32, mask=m2, other=0).to(tl.int32)
        q = (tl.load(src + base[:, None] + 8 + 32 * (e // 64) + e % 32, mask=m2, other=0).to(tl.int32)
             >> (4 * ((e % 64) // 32))) & 15
        q = q | (((tl.load(src + base[:, None] + 136 + e % 32, mask=m2, other=0).to(tl.int32) >> (e // 32)) & 1) << 4)
        v = tl.load(tab + q + 32 * (sc & 1))
        val = (d * ((sc & 254) - 127).to(tl.float32)) * v
        tl.store(dst + b.to(tl.int64)[:, None] * 256 + e, val.to(tl.bfloat16), mask=m2)

    @triton.jit
    def _trellis(i, k, tab2):
        """The trellis generator's value k (0-based) of index words i (uint32, offset already added)."""
        x = (i * tl.load(tab2 + k).to(tl.uint32, bitcast=True)) & 0x3F3F3F3F
        return ((x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)).to(tl.int32) - 126

    @triton.jit
    def _iq3_kt_kernel(src, dst, n_blocks, idx, bpe, nbr, tab, tab2, BB: tl.constexpr, HAS_IDX: tl.constexpr):
        """Rows: float32 d, then 100-byte blocks: 4 bytes of unsigned scale nibbles (as IQ2_KT's), 32 u16
        trellis indices (|value|), then signs: element e is negative when bit e // 32 of qh[e % 32] is set."""
        b, bm, base, row = _row_blocks(n_blocks, idx, bpe, nbr, BB, HAS_IDX, 100, 4)
        m2 = bm[:, None]
        e = tl.arange(0, 256)[None, :]
        s, g = e // 32, e // 8
        d = f32_at(src + row, bm)[:, None]
        code = ((tl.load(src + base[:, None] + s % 4, mask=m2, other=0).to(tl.int32) >> (4 * (s // 4))) & 15)
        i = tl.load(src + base[:, None] + 4 + 2 * g, mask=m2, other=0).to(tl.uint32)
        i = i | (tl.load(src + base[:, None] + 5 + 2 * g, mask=m2, other=0).to(tl.uint32) << 8)
        v = tl.abs(_trellis(i + 4096, e % 8, tab2))
        y = (d * code.to(tl.float32)) * v.to(tl.float32)
        neg = (tl.load(src + base[:, None] + 68 + e % 32, mask=m2, other=0).to(tl.int32) >> s) & 1
        val = tl.where(neg == 1, -y, y)
        tl.store(dst + b.to(tl.int64)[:, None] * 256 + e, val.to(tl.bfloat16), mask=m2)

    @triton.jit
    def _iq4_kt_kernel(src, dst, n_blocks, idx, bpe, nbr, tab, tab2, BB: tl.constexpr, HAS_IDX: tl.constexpr):
        """Rows: float32 d, then 128-byte blocks: 8 u32 (per 32: bit 0 offset flag, bits 1-7 scale + 64, bits
        8 + 3t.. the 3 top bits of its group t's index), ql[64], qh[32] (group j: nibble j // 32 of
        qh[j % 32]); one 15-bit index per 4 values."""
        b, bm, base, row = _row_blocks(n_blocks, idx, bpe, nbr, BB, HAS_IDX, 128, 4)
        m2 = bm[:, None]
        e = tl.arange(0, 256)[None, :]
        s, j = e // 32, e // 4
        d = f32_at(src + row, bm)[:, None]
        w = tl.load(src + base[:, None] + 4 * s, mask=m2, other=0).to(tl.uint32)
        w = w | (tl.load(src + base[:, None] + 4 * s + 1, mask=m2, other=0).to(tl.uint32) << 8)
        w = w | (tl.load(src + base[:, None] + 4 * s + 2, mask=m2, other=0).to(tl.uint32) << 16)
        w = w | (tl.load(src + base[:, None] + 4 * s + 3, mask=m2, other=0).to(tl.uint32) << 24)
        ql = tl.load(src + base[:, None] + 32 + j, mask=m2, other=0).to(tl.uint32)
        qh = (tl.load(src + base[:, None] + 96 + j % 32, mask=m2, other=0).to(tl.uint32) >> (4 * (j // 32))) & 15
        top = (w >> (8 + 3 * (j % 8))) & 7
        i = ql | (qh << 8) | (top << 12)
        v = _trellis(i + 4096 + 32768 * (w & 1), e % 4, tab2)
        code = (((w & 255) >> 1).to(tl.int32) - 64).to(tl.float32)
        val = (d * code) * v.to(tl.float32)
        tl.store(dst + b.to(tl.int64)[:, None] * 256 + e, val.to(tl.bfloat16), mask=m2)

    _KERNELS = {GGMLType.Q4_0: (_q4_0_kernel, {}), GGMLType.Q8_0: (_q8_0_kernel, {}),
                GGMLType.Q4_K: (_q45_k_kernel, {"Q5": False}), GGMLType.Q5_K: (_q45_k_kernel, {"Q5": True}),
                GGMLType.Q6_K: (_q6_k_kernel, {})}
    # kernels that take (nbr, tab, tab2): blocks per row and value tables
    _ROW_KERNELS = {GGMLType.Q2_K: (_q2_k_kernel, {}), GGMLType.Q3_K: (_q3_k_kernel, {}),
                    GGMLType.IQ4_XS: (_iq4_xs_kernel, {}), GGMLType.IQ4_NL: (_iq4_nl_kernel, {}),
                    GGMLType.MXFP4: (_mxfp4_kernel, {}),
                    GGMLType.IQ4_K: (_iq45_k_kernel, {"Q5": False}), GGMLType.IQ5_K: (_iq45_k_kernel, {"Q5": True}),
                    GGMLType.IQ4_KS: (_iq4_ks_kernel, {}), GGMLType.IQ5_KS: (_iq5_ks_kernel, {}),
                    GGMLType.IQ2_KT: (_iq2_kt_kernel, {}), GGMLType.IQ3_KT: (_iq3_kt_kernel, {}),
                    GGMLType.IQ4_KT: (_iq4_kt_kernel, {})}
    _KERNELS.update({t: (fn, {**c, "ROW": True}) for t, (fn, c) in _ROW_KERNELS.items()})
    _BLOCK = {t: (32 if t in (GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.IQ4_NL, GGMLType.MXFP4) else 256)
              for t in _KERNELS}
else:
    _KERNELS, _BLOCK = {}, {}

# value tables of the row kernels (tab): the IQ4_K and IQ5_K grids for their families, else IQ4_NL's
_TABLE_OF = {GGMLType.IQ4_K: _IQ4K, GGMLType.IQ4_KS: _IQ4K, GGMLType.IQ5_K: _IQ5NL, GGMLType.IQ5_KS: _IQ5NL,
             GGMLType.MXFP4: _KV_MXFP4}
_TABLES: dict = {}


def _powers() -> list[int]:
    """ka^1 .. ka^8 mod 2^32 (the trellis generator's multiplier), as int32 bit patterns."""
    out, p = [], 1
    for _ in range(8):
        p = p * 0xCBAC1FED & 0xFFFFFFFF
        out.append(p - (1 << 32) if p >= 1 << 31 else p)
    return out


def _tables(qtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tab, tab2) of a row kernel on `device`, made once per device."""
    key = (int(qtype), str(device))
    t = _TABLES.get(key)
    if t is None:
        vals = _TABLE_OF.get(GGMLType(qtype), _KV_IQ4NL)
        tab = torch.tensor(vals, dtype=torch.float32, device=device)
        tab2 = torch.tensor(_powers(), dtype=torch.int32, device=device)
        t = _TABLES[key] = (tab, tab2)
    return t


def _lossless_bases() -> dict:
    """Interleaved type -> its base type, where the reference dequantizes the deinterleaved rows as the base
    type's (not the _R4 layouts with their own arithmetic or block conversion)."""
    from ..quant.ref_interleaved import LAYOUTS
    return {GGMLType[n]: GGMLType[v.base] for n, v in LAYOUTS.items()
            if v.base and not v.direct and not v.to_base and n in GGMLType.__members__}


_LOSSLESS_BASE = _lossless_bases()


def has_kernel(qtype) -> bool:
    """A one-pass kernel reads this type (interleaved types go through torch's deinterleaving first: not
    one pass, so not counted)."""
    return qtype in _KERNELS


def kernel_types() -> list[GGMLType]:
    """The types with a one-pass kernel here (none without triton)."""
    return sorted(_KERNELS)


def dequantize_bf16(raw: torch.Tensor, qtype, n_cols: int, index: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [..., row_bytes] on CUDA -> bf16 [..., n_cols]; with `index`, the slabs raw[index] only
    ([len(index), ..., n_cols]), gathered inside the kernel (no copy of the selected bytes first)."""
    gpu = raw.is_cuda or _INTERPRET
    base = _LOSSLESS_BASE.get(GGMLType(qtype)) if gpu else None
    if base is not None and base in _KERNELS and raw.dim() >= 2 and raw.shape[-2] % interleave(qtype) == 0:
        # an _R4 / _R8 matrix: its rows as the base type's (a bit permutation), then the base type's kernel
        from ..quant.dequant import deinterleave
        raw = raw if index is None else raw.index_select(0, index)
        rows, base = deinterleave(raw.reshape(-1, raw.shape[-1]), qtype, n_cols)
        return dequantize_bf16(rows, base, n_cols).reshape(*raw.shape[:-1], n_cols)
    kern = _KERNELS.get(qtype) if gpu else None
    if kern is not None:
        try:
            return _launch(kern, raw, qtype, n_cols, index)
        except Exception as e:                          # noqa: BLE001 - a kernel this GPU can't build
            from ..errors import warn_fallback
            _KERNELS.pop(qtype, None)
            warn_fallback(f"the one-pass {GGMLType(qtype).name} dequantizer", e, "using the reference")
    from ..quant.dequant import dequantize
    return dequantize(raw if index is None else raw.index_select(0, index), qtype, n_cols, dtype=torch.bfloat16)


def _launch(kern, raw, qtype, n_cols, index):
    assert raw.shape[-1] == row_bytes(qtype, n_cols)
    raw = raw.contiguous()
    lead = raw.shape[:-1] if index is None else (index.numel(), *raw.shape[1:-1])
    out = torch.empty(*lead, n_cols, dtype=torch.bfloat16, device=raw.device)
    qk = _BLOCK[qtype]
    n_blocks = out.numel() // qk
    bpe = max(out[0].numel() // qk, 1) if index is not None and out.numel() else 1
    idx = index if index is not None else raw                             # any pointer when unused
    bb = BLOCKS_PER_PROGRAM if qk == 32 else BLOCKS_PER_PROGRAM // 8      # ~2048 elements a program
    if n_blocks:
        with torch.cuda.device(raw.device) if raw.is_cuda else contextlib.nullcontext():   # Triton launches on
            fn, consts = kern                                                           # the current GPU otherwise
            if consts.get("ROW"):
                tab, tab2 = _tables(qtype, raw.device)
                fn[(triton.cdiv(n_blocks, bb),)](raw, out, n_blocks, idx, bpe, n_cols // qk, tab, tab2,
                                                 BB=bb, HAS_IDX=index is not None, enable_fp_fusion=False,
                                                 **{k: v for k, v in consts.items() if k != "ROW"})
            else:
                fn[(triton.cdiv(n_blocks, bb),)](raw, out, n_blocks, idx, bpe,
                                                 BB=bb, HAS_IDX=index is not None, **consts,
                                                 enable_fp_fusion=False)     # the reference's rounding, bit for bit
    return out
