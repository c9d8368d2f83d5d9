"""Fused Triton kernels for the decode step: few launches per layer, and weights read once.

A decode step written as torch ops launches ~50 kernels per layer (norms, dtype casts, the pieces of
RoPE, a masked SDPA over the whole static cache, softmax/top-k, gathers, bmm...). Even replayed from a
CUDA graph each costs a few microseconds, and 48 layers of them cost more than the bytes the step must
read. Here a layer is about ten kernels:

  add_rms_norm   residual add + RMSNorm (writes the residual and the normed row, in the dtype asked)
  qk_rope_cache, attention, attention_prefill  RoPE with the cache write, flash-decoding and a prompt
                 chunk's flash attention (kernels/gpu_attention.py, re-exported here)
  router_topk    softmax, top-k, renormalisation (ids as int32, and as floats for the CPU hand-off); when
                 the experts are on the CPU it also writes the packed row and a flag into pinned host memory
                 (the next segment's add_rms_norm(wait=) polls the CPU's flag, reads its output from there)
  moe_gate_up    SiLU(gate) * up of each selected expert straight from its GGUF bytes (QTYPES)
  moe_down       down of each selected expert from its bytes, weighted (the next add_rms_norm sums them)

plus the dense projections (cuBLAS, bf16). Every kernel reads its position from device memory, so one
CUDA graph serves every step. Each kernel is checked against the torch path (tests/test_gpu_decode.py,
on a GPU or in Triton's interpreter).
"""
from __future__ import annotations

import os

import torch

from .. import env
from ..quant.types import GGMLType
from .gpu_attention import (ATTN_BLOCK, ATTN_CHUNK, _pow2, attention, attention_prefill,  # noqa: F401 (re-exported)
                            on_device, qk_rope_cache)

try:
    import triton
    import triton.language as tl

    from .gpu_dequant import f16_at, k4_scale_min, quant_blocks as _quant_blocks
    from .gpu_qdot import qdot_iq2_kt, qdot_iq4, qdot_mxfp4, qdot_q23_k
except ImportError:                                      # CPU-only installs
    triton = None

QTYPES = {GGMLType.Q4_0: 0, GGMLType.Q8_0: 1, GGMLType.Q4_K: 2, GGMLType.Q6_K: 3, GGMLType.Q5_K: 4,
          GGMLType.IQ4_XS: 5, GGMLType.IQ4_KS: 6, GGMLType.Q3_K: 7, GGMLType.IQ2_KT: 8,
          GGMLType.Q2_K: 9, GGMLType.MXFP4: 10}                                 # 5-10: kernels/gpu_qdot.py
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter: one tile, no inline PTX
AWAIT_MAX_POLLS = 1 << 26                                # add_rms_norm(wait=): ~1 us a poll over PCIe, ~a minute


def available() -> bool:
    return triton is not None


if triton is not None:
    # MoE GEMV tiles (rows per program, blocks of 32 per step, warps): moe_tile picks one by a rule
    # measured on H200 (benchmarks/bench_moe_decode.py --tiles); HYBRIDMOE_MOE_TUNE=1 has Triton's
    # autotuner time them all at the first call instead (seconds of compiling); the interpreter takes the first
    _MOE_TILES = [(4, 64, 4), (8, 32, 4), (16, 16, 4), (8, 64, 8), (2, 64, 2), (16, 32, 8)]
    if _INTERPRET:
        _MOE_TILES = _MOE_TILES[:1]
    _MOE_AUTOTUNE = env.get("HYBRIDMOE_MOE_TUNE") == "1" and len(_MOE_TILES) > 1
    _MOE_CONFIGS = [triton.Config({"BN": bn, "NB": nb}, num_warps=w) for bn, nb, w in _MOE_TILES]

    @triton.jit
    def _await_host(flag, step, err, max_polls):
        """Poll flag[0] (pinned host int32) until the host sets it to step[0]; after max_polls polls err[0] = 1."""
        want = tl.load(step)
        got = tl.load(flag, volatile=True)
        n = 0
        while (got != want) & (n < max_polls):
            got = tl.load(flag, volatile=True)
            n += 1
        if got != want:
            tl.store(err, 1)

    @triton.jit
    def _add_rms_norm_kernel(a, b, c, w, x_out, h_out, h2_out, H, h_stride, eps, b_rows, c_rows, q1, q2, xs, xc,
                             flag, step, err, max_polls, HAS_B: tl.constexpr, WRITE_X: tl.constexpr,
                             BH: tl.constexpr, Q8: tl.constexpr, H2: tl.constexpr, WAIT: tl.constexpr):
        """Q8: the normed row also in two int8 terms (_quant_blocks) for the split-row MoE kernels. H2: also in
        h2_out's dtype. WAIT: b is in pinned host memory, written by the host, which then sets flag[0] (pinned
        int32) to step[0]: poll the flag first, then read b fresh (after max_polls polls, err[0] = 1 and go
        on, so a host that never comes does not hang the GPU; the host checks err)."""
        t = tl.program_id(0)
        i = tl.arange(0, BH)
        m = i < H
        x = tl.load(a + t * H + i, mask=m, other=0).to(tl.float32)
        if WAIT:
            _await_host(flag, step, err, max_polls)
        if HAS_B:                                      # (from host memory, WAIT: read fresh)
            for j in range(b_rows):
                x += tl.load(b + (t * b_rows + j) * H + i, mask=m, other=0, volatile=WAIT).to(tl.float32)
        for j in range(c_rows):                        # device rows (the GPU's share of CPU experts)
            x += tl.load(c + (t * c_rows + j) * H + i, mask=m, other=0).to(tl.float32)
        if WRITE_X:
            tl.store(x_out + t * H + i, x, mask=m)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        wv = tl.load(w + i, mask=m, other=0).to(tl.float32)
        y = x * r * wv
        tl.store(h_out + t * h_stride + i, y.to(h_out.dtype.element_ty), mask=m)
        if H2:
            tl.store(h2_out + t * H + i, y.to(h2_out.dtype.element_ty), mask=m)
        if Q8:
            _quant_blocks(tl.reshape(y, [BH // 32, 32]), tl.arange(0, BH // 32), t, H, q1, q2, xs, xc)

    @triton.jit
    def _flag_after_writes(flag, step, EMU: tl.constexpr):
        """flag[0] = step[0] once the host can see every write this program made before: each thread fences
        its writes at system scope, the block syncs, then one store. Launch with num_warps=4 (one element
        a thread)."""
        z = tl.arange(0, 128)
        v = tl.load(step + z * 0)
        if not EMU:
            v = tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32,
                                          is_pure=False, pack=1)
        tl.debug_barrier()
        tl.store(flag + z * 0, v, mask=z == 0)

    @triton.jit
    def _router_topk_kernel(logits, wts, ids, packed, E, pk_stride, pk_off, dst, flag, step,
                            K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                            NORM: tl.constexpr, PACK: tl.constexpr, PUB: tl.constexpr, BN: tl.constexpr,
                            EMU: tl.constexpr):
        """PUB (one row, with PACK): then [packed row[:pk_off] | weights | ids as floats] into dst (pinned host
        memory) and flag[0] = step[0] once the host can see it: the CPU hand-off, in this launch."""
        t = tl.program_id(0)
        i = tl.arange(0, BE)
        m = i < E
        lg = tl.load(logits + t * E + i, mask=m, other=float("-inf")).to(tl.float32)
        e = tl.exp(lg - tl.max(lg, axis=0))
        p = tl.where(m, e / tl.sum(e, axis=0), -1.0)
        j = tl.arange(0, KP)
        wv = tl.zeros([KP], tl.float32)
        iv = tl.zeros([KP], tl.int32)
        for s in tl.static_range(K):
            mx = tl.max(p, axis=0)
            idx = tl.min(tl.where(p == mx, i, BE), axis=0)
            wv = tl.where(j == s, mx, wv)
            iv = tl.where(j == s, idx, iv)
            p = tl.where(i == idx, -2.0, p)
        if NORM:
            wv = wv / tl.sum(tl.where(j < K, wv, 0.0), axis=0)
        jm = j < K
        tl.store(wts + t * K + j, wv, mask=jm)
        tl.store(ids + t * K + j, iv, mask=jm)
        if PACK:                                       # [h | weights | ids as floats] for the CPU hand-off
            tl.store(packed + t * pk_stride + pk_off + j, wv, mask=jm)
            tl.store(packed + t * pk_stride + pk_off + K + j, iv.to(tl.float32), mask=jm)
            if PUB:
                o = tl.arange(0, BN)
                for i in range(0, pk_off, BN):
                    om = i + o < pk_off
                    tl.store(dst + i + o, tl.load(packed + i + o, mask=om), mask=om)
                tl.store(dst + pk_off + j, wv, mask=jm)
                tl.store(dst + pk_off + K + j, iv.to(tl.float32), mask=jm)
                _flag_after_writes(flag, step, EMU)

    @triton.jit
    def _qdot(wrow, row_stride, n, nm, xp, K, QT: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr):
        """[BN] dot products of rows n of a quantized matrix (GGUF blocks from wrow) with float x[K] at xp.

        Q4_0/Q8_0 blocks are read as 16-bit words (their 18 and 34 bytes keep them 2-byte aligned), half the
        loads of a byte-wise read. K-quants take NB // 8 blocks of 256 per step (the same elements per tile);
        IQ4_XS, IQ4_KS, Q3_K, IQ2_KT, Q2_K and MXFP4 (QT 5-10) are gpu_qdot's."""
        acc = tl.zeros([BN], tl.float32)
        if QT >= 5:
            if QT == 10:
                acc = qdot_mxfp4(wrow, row_stride, n, nm, xp, K, BN, NB)
            elif QT == 8:
                acc = qdot_iq2_kt(wrow, row_stride, n, nm, xp, K, BN, NB)
            elif QT == 7 or QT == 9:
                acc = qdot_q23_k(wrow, row_stride, n, nm, xp, K, QT == 9, BN, NB)
            else:
                acc = qdot_iq4(wrow, row_stride, n, nm, xp, K, QT == 6, BN, NB)
        elif QT <= 1:
            bi = tl.arange(0, NB)
            nblk = K // 32
            w16 = wrow.to(tl.pointer_type(tl.uint16))
            for kb in range(0, nblk, NB):
                b = kb + bi
                bm = b < nblk
                m2 = nm[:, None] & bm[None, :]
                xb = xp + b[:, None] * 32
                if QT == 0:                            # Q4_0: f16 scale, 8 words of 4 nibbles
                    blk = w16 + n.to(tl.int64)[:, None] * (row_stride // 2) + b[None, :] * 9
                    dsc = tl.load(blk, mask=m2, other=0).to(tl.float16, bitcast=True).to(tl.float32)
                    c = tl.arange(0, 8)
                    w = tl.load(blk[:, :, None] + 1 + c[None, None, :], mask=m2[:, :, None], other=0).to(tl.int32)
                    # word c holds bytes 2c, 2c+1: low nibbles are elements 2c, 2c+1; high ones 2c+16, 2c+17
                    x0 = tl.load(xb + 2 * c[None, :], mask=bm[:, None], other=0)[None, :, :]
                    x1 = tl.load(xb + 2 * c[None, :] + 1, mask=bm[:, None], other=0)[None, :, :]
                    x2 = tl.load(xb + 2 * c[None, :] + 16, mask=bm[:, None], other=0)[None, :, :]
                    x3 = tl.load(xb + 2 * c[None, :] + 17, mask=bm[:, None], other=0)[None, :, :]
                    s = ((w & 15) - 8).to(tl.float32) * x0 + (((w >> 8) & 15) - 8).to(tl.float32) * x1 + \
                        (((w >> 4) & 15) - 8).to(tl.float32) * x2 + (((w >> 12) & 15) - 8).to(tl.float32) * x3
                else:                                  # Q8_0: f16 scale, 16 words of 2 int8
                    blk = w16 + n.to(tl.int64)[:, None] * (row_stride // 2) + b[None, :] * 17
                    dsc = tl.load(blk, mask=m2, other=0).to(tl.float16, bitcast=True).to(tl.float32)
                    c = tl.arange(0, 16)
                    w = tl.load(blk[:, :, None] + 1 + c[None, None, :], mask=m2[:, :, None], other=0).to(tl.int32)
                    x0 = tl.load(xb + 2 * c[None, :], mask=bm[:, None], other=0)[None, :, :]
                    x1 = tl.load(xb + 2 * c[None, :] + 1, mask=bm[:, None], other=0)[None, :, :]
                    s = (((w & 255) ^ 128) - 128).to(tl.float32) * x0 + \
                        ((((w >> 8) & 255) ^ 128) - 128).to(tl.float32) * x1
                acc += tl.sum(tl.sum(s, axis=2) * dsc, axis=1)
        else:
            NBK: tl.constexpr = NB // 8
            bi = tl.arange(0, NBK)
            nblk = K // 256
            g = tl.arange(0, 4)
            for kb in range(0, nblk, NBK):
                b = kb + bi
                bm = b < nblk
                m2 = nm[:, None] & bm[None, :]
                m4 = m2[:, :, None, None]
                xb = xp + b[:, None, None] * 256                                            # [NBK, 1, 1]
                if QT == 2 or QT == 4:                 # Q4_K (144 bytes): d, dmin, 12 scale bytes, 4 x 32 bytes
                    # of nibbles; Q5_K (176): qh[32] before the nibbles, bit j of qh[c] the 5th bit of
                    # element c of sub-block j
                    BS: tl.constexpr = 144 if QT == 2 else 176
                    QS: tl.constexpr = 16 if QT == 2 else 48
                    blk = wrow + n.to(tl.int64)[:, None] * row_stride + b[None, :] * BS     # [BN, NBK]
                    d = f16_at(blk, m2)
                    dmin = f16_at(blk + 2, m2)
                    c = tl.arange(0, 32)
                    q = tl.load(blk[:, :, None, None] + QS + g[None, None, :, None] * 32 + c[None, None, None, :],
                                mask=m4, other=0).to(tl.int32)                              # [BN, NBK, 4, 32]
                    # group g: low nibbles are elements 64g + c (sub-block 2g), high ones 64g + 32 + c (2g+1)
                    xl = tl.load(xb + g[None, :, None] * 64 + c[None, None, :], mask=bm[:, None, None], other=0)
                    xh = tl.load(xb + g[None, :, None] * 64 + 32 + c[None, None, :], mask=bm[:, None, None], other=0)
                    ql = q & 15
                    qhi = q >> 4
                    if QT == 4:
                        hb = tl.load(blk[:, :, None, None] + 16 + c[None, None, None, :], mask=m4, other=0)
                        hb = hb.to(tl.int32)
                        ql = ql | (((hb >> (2 * g[None, None, :, None])) & 1) << 4)
                        qhi = qhi | (((hb >> (2 * g[None, None, :, None] + 1)) & 1) << 4)
                    sl = tl.sum(ql.to(tl.float32) * xl[None], axis=3)                      # [BN, NBK, 4]
                    sh = tl.sum(qhi.to(tl.float32) * xh[None], axis=3)
                    sp, m3 = (blk + 4)[:, :, None], m2[:, :, None]
                    scl, mnl = k4_scale_min(sp, (2 * g)[None, None, :], m3)
                    sch, mnh = k4_scale_min(sp, (2 * g + 1)[None, None, :], m3)
                    part = d[:, :, None] * (scl * sl + sch * sh) - \
                        dmin[:, :, None] * (mnl * tl.sum(xl, axis=2)[None] + mnh * tl.sum(xh, axis=2)[None])
                else:                                  # Q6_K: ql[128], qh[64], 16 int8 scales, d
                    blk = wrow + n.to(tl.int64)[:, None] * row_stride + b[None, :] * 210
                    d = f16_at(blk + 208, m2)
                    # row s of 4 = (half h = s // 2, l1 = s % 2); l = 16 l1 + l0 within the half
                    l0 = tl.arange(0, 16)
                    h = g // 2
                    l = (g % 2)[:, None] * 16 + l0[None, :]                                 # [4, 16]
                    qlo = tl.load(blk[:, :, None, None] + (64 * h[:, None] + l)[None, None], mask=m4, other=0)
                    qhi = tl.load(blk[:, :, None, None] + (64 * h[:, None] + l + 32)[None, None], mask=m4, other=0)
                    qh = tl.load(blk[:, :, None, None] + (128 + 32 * h[:, None] + l)[None, None], mask=m4,
                                 other=0).to(tl.int32)
                    qlo = qlo.to(tl.int32)
                    qhi = qhi.to(tl.int32)
                    e0 = (128 * h[:, None] + l)[None]                                        # [1, 4, 16]
                    part = tl.zeros([BN, NBK, 4], tl.float32)
                    for qq in tl.static_range(4):
                        if qq == 0:
                            v = (qlo & 15) | ((qh & 3) << 4)
                        elif qq == 1:
                            v = (qhi & 15) | (((qh >> 2) & 3) << 4)
                        elif qq == 2:
                            v = (qlo >> 4) | (((qh >> 4) & 3) << 4)
                        else:
                            v = (qhi >> 4) | (((qh >> 6) & 3) << 4)
                        xv = tl.load(xb + e0 + 32 * qq, mask=bm[:, None, None], other=0)      # [NBK, 4, 16]
                        sq = tl.sum((v - 32).to(tl.float32) * xv[None], axis=3)             # [BN, NBK, 4]
                        si = (8 * h + g % 2 + 2 * qq)[None, None, :]                         # scale index
                        sc = tl.load(blk[:, :, None] + 192 + si, mask=m2[:, :, None], other=0)
                        part += sc.to(tl.int8, bitcast=True).to(tl.float32) * sq
                    part = d[:, :, None] * part
                acc += tl.sum(tl.sum(part, axis=2), axis=1)
        return acc

    @triton.jit
    def _quant_x8_kernel(x, x_stride, q1, q2, xs, xc, K, NBQ: tl.constexpr):
        """NBQ 32-blocks of one row of x (program (row, chunk)): _quant_blocks."""
        r = tl.program_id(0)
        b = tl.program_id(1) * NBQ + tl.arange(0, NBQ)
        j = tl.arange(0, 32)
        v = tl.load(x + r * x_stride + b[:, None] * 32 + j[None, :], mask=(b < K // 32)[:, None], other=0)
        _quant_blocks(v.to(tl.float32), b, r, K, q1, q2, xs, xc)

    @triton.jit
    def _copy_words(src, dst, i, n):
        m = i < n
        tl.store(dst + i, tl.load(src + i, mask=m), mask=m)

    @triton.jit
    def _stage_experts_kernel(ids, j0, gs, us, ds, gdst, udst, ddst, n_gu, n_d, BLOCK: tl.constexpr):
        """Program (chunk c, slot j, matrix m): words [c BLOCK, (c + 1) BLOCK) of expert ids[j0 + j]'s gate
        (m 0), up (1) or down (2) matrix (n_gu, n_gu, n_d int32 words an expert), from host memory read over
        the bus in wide loads, into slot j of the device tensors; nothing for an id < 0 (an unused slot)."""
        c = tl.program_id(0)
        j = tl.program_id(1)
        m = tl.program_id(2)
        e = tl.load(ids + j0 + j).to(tl.int64)
        i = c * BLOCK + tl.arange(0, BLOCK)
        if e >= 0:
            if m == 0:
                _copy_words(gs + e * n_gu, gdst + j * n_gu, i, n_gu)
            elif m == 1:
                _copy_words(us + e * n_gu, udst + j * n_gu, i, n_gu)
            else:
                _copy_words(ds + e * n_d, ddst + j * n_d, i, n_d)

    @triton.jit
    def _dp4a(a, b, c, EMU: tl.constexpr):
        """c + the dot product of a's and b's four signed bytes (the dp4a instruction; EMU: plain integer
        ops, for Triton's interpreter)."""
        if EMU:
            s = c
            for i in tl.static_range(4):
                s += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
            return s
        else:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _qdot8(wrow, row_stride, n, nm, q1, q2, xs, xc, K, QT: tl.constexpr, BN: tl.constexpr,
               NB: tl.constexpr, EMU: tl.constexpr):
        """[BN] dot products of rows n of a Q4_0 (QT 0) or Q8_0 (1) matrix in split rows (quant.ref.split_rows)
        with one activation row quantized by _quant_x8_kernel (q1, q2 int8 [K]; xs, xc [K / 32]).

        Each (row, block) is one thread's: its quants are one or two 16-byte loads, and four dp4a per
        16 bytes give both int8 terms; the activations' words are loaded in the same shape (L1 hits), so
        nothing moves between threads until the final sum over blocks."""
        QB: tl.constexpr = 16 if QT == 0 else 32
        acc = tl.zeros([BN, NB], tl.float32)
        nblk = K // 32
        bi = tl.arange(0, NB)
        c = tl.arange(0, 4)
        rows = wrow + n.to(tl.int64)[:, None] * row_stride                                 # [BN, 1]
        zn = (n * 0)[:, None, None]                                                        # x words per row
        x1 = q1.to(tl.pointer_type(tl.int32)) + zn
        x2 = q2.to(tl.pointer_type(tl.int32)) + zn
        for kb in range(0, nblk, NB):
            b = kb + bi
            bm = b < nblk
            m2 = nm[:, None] & bm[None, :]
            m3 = m2[:, :, None]
            wp = (rows + b[None, :] * QB).to(tl.pointer_type(tl.int32))[:, :, None] + c[None, None, :]
            wa = tl.load(wp, mask=m3, other=0)
            if QT == 0:                                # byte i of word c: elements 4c + i (low), 4c + i + 16
                wb = (wa >> 4) & 0x0F0F0F0F
                wa = wa & 0x0F0F0F0F
            else:                                      # words c and c + 4: elements 4c + i, 4c + i + 16
                wb = tl.load(wp + 4, mask=m3, other=0)
            xo = (b * 8)[None, :, None] + c[None, None, :]
            xm = bm[None, :, None]
            a1 = _dp4a(wa, tl.load(x1 + xo, mask=xm, other=0), 0, EMU)                    # the q1 term
            a1 = _dp4a(wb, tl.load(x1 + xo + 4, mask=xm, other=0), a1, EMU)
            a2 = _dp4a(wa, tl.load(x2 + xo, mask=xm, other=0), 0, EMU)                    # the q2 term
            a2 = _dp4a(wb, tl.load(x2 + xo + 4, mask=xm, other=0), a2, EMU)
            dot = tl.sum((a1 << 8) + a2, axis=2)                                          # [BN, NB]
            if QT == 0:
                dot += tl.load(xc + b, mask=bm, other=0)[None, :]
            dw = tl.load((rows + nblk * QB).to(tl.pointer_type(tl.float16)) + b[None, :], mask=m2, other=0)
            acc += dot.to(tl.float32) * dw.to(tl.float32) * tl.load(xs + b, mask=bm, other=0)[None, :]
        return tl.sum(acc, axis=1)

    @triton.jit
    def _moe_gate_up8_kernel(q1, q2, xs, xc, ids, graw, uraw, out, K, F, k_used, sge, sgn, sue, sun,
                             QT: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, EMU: tl.constexpr):
        s = tl.program_id(0)                           # (token, slot) pair
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < F
        t = s // k_used
        e = tl.load(ids + s).to(tl.int64)
        xo, so = t * K, t * (K // 32)
        g = _qdot8(graw + e * sge, sgn, n, nm, q1 + xo, q2 + xo, xs + so, xc + so, K, QT, BN, NB, EMU)
        u = _qdot8(uraw + e * sue, sun, n, nm, q1 + xo, q2 + xo, xs + so, xc + so, K, QT, BN, NB, EMU)
        tl.store(out + s * F + n, g / (1.0 + tl.exp(-g)) * u, mask=nm)

    @triton.jit
    def _moe_down8_kernel(q1, q2, xs, xc, ids, wts, draw, out, K, N, sde, sdn,
                          QT: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, EMU: tl.constexpr):
        s = tl.program_id(0)                           # (token, slot) pair: its weighted down row
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < N
        e = tl.load(ids + s).to(tl.int64)
        xo, so = s * K, s * (K // 32)
        y = _qdot8(draw + e * sde, sdn, n, nm, q1 + xo, q2 + xo, xs + so, xc + so, K, QT, BN, NB, EMU)
        tl.store(out + s * N + n, tl.load(wts + s).to(tl.float32) * y, mask=nm)

    @triton.jit
    def _gemv8_kernel(q1, q2, xs, xc, w0, w1, w2, n1, n2, out, K, N, rs,
                      QT: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, EMU: tl.constexpr):
        """out[n] = W[n] . x for one activation row in two int8 terms, W in split rows: rows [0, n1) at w0,
        [n1, n2) at w1, [n2, N) at w2 (a fused QKV read from its three tensors; n1, n2 multiples of BN)."""
        n0 = tl.program_id(0) * BN
        if n0 < n1:
            w, first = w0, 0
        elif n0 < n2:
            w, first = w1, n1
        else:
            w, first = w2, n2
        n = n0 + tl.arange(0, BN)
        nm = n < N
        y = _qdot8(w, rs, n - first, nm, q1, q2, xs, xc, K, QT, BN, NB, EMU)
        tl.store(out + n, y.to(out.dtype.element_ty), mask=nm)

    @triton.autotune(configs=_MOE_CONFIGS, key=["K", "F"])
    @triton.jit
    def _moe_gate_up_kernel(x, ids, graw, uraw, out, K, F, k_used, sge, sgn, sue, sun, bg, bu, alpha, limit,
                            QT: tl.constexpr, OAI: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr):
        """SiLU(gate) * up of one (token, slot) pair's expert; OAI: gpt-oss's, biases bg, bu [E, F] float32 added
        and the clamped SwiGLU (swiglu_oai) taken instead."""
        s = tl.program_id(0)                           # (token, slot) pair
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < F
        t = s // k_used
        e = tl.load(ids + s).to(tl.int64)
        g = _qdot(graw + e * sge, sgn, n, nm, x + t * K, K, QT, BN, NB)
        u = _qdot(uraw + e * sue, sun, n, nm, x + t * K, K, QT, BN, NB)
        if OAI:
            g = tl.minimum(g + tl.load(bg + e * F + n, mask=nm, other=0), limit)
            u = tl.minimum(tl.maximum(u + tl.load(bu + e * F + n, mask=nm, other=0), -limit), limit)
            tl.store(out + s * F + n, g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0), mask=nm)
        else:
            tl.store(out + s * F + n, g / (1.0 + tl.exp(-g)) * u, mask=nm)

    @triton.autotune(configs=_MOE_CONFIGS, key=["K", "N"])
    @triton.jit
    def _moe_down_kernel(h, ids, wts, draw, out, K, N, sde, sdn, bd,
                         QT: tl.constexpr, OAI: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr):
        """One (token, slot) pair's weighted down row (OAI: plus its expert's bias, bd [E, N] float32)."""
        s = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < N
        e = tl.load(ids + s).to(tl.int64)
        y = _qdot(draw + e * sde, sdn, n, nm, h + s * K, K, QT, BN, NB)
        if OAI:
            y += tl.load(bd + e * N + n, mask=nm, other=0)
        tl.store(out + s * N + n, tl.load(wts + s).to(tl.float32) * y, mask=nm)


def add_rms_norm(a, w, eps, b=None, x_out=None, h_out=None, h_dtype=torch.float32, q8_out=None, h2_out=None,
                 wait=None, c=None):
    """x = a (+ b) (+ c); returns (x if x_out is given, RMSNorm(x) * w). Rows [T, H]; h_out may be a strided
    row view. b and c may hold several rows per row of a ([T * r, H], e.g. the k weighted expert outputs): all
    are added; c is on the GPU (with wait, b is in host memory and c e.g. the GPU's share of its experts).
    q8_out (x8_buffers(T, H)): the normed rows in two int8 terms too, as quant_x8 writes them. h2_out [T, H]:
    the normed rows once more, in its dtype (e.g. bf16 for the router's GEMV, saving a cast launch).
    wait = (flag, step, err): b lives in pinned host memory and is ready once the host sets flag[0] (pinned
    int32) to step[0] (device int32); the kernel polls for that first (the host side of the decode hand-off:
    cpu.handoff_call). err[0] (int32, pinned) becomes 1 if the host never came (after AWAIT_MAX_POLLS polls)."""
    T, H = a.shape
    if h_out is None:
        h_out = torch.empty(T, H, dtype=h_dtype, device=a.device)
    b_rows = b.shape[0] // T if b is not None else 0
    c_rows = c.shape[0] // T if c is not None else 0
    q8 = q8_out if q8_out is not None else (a,) * 4
    flag, step, err = wait if wait is not None else (a, a, a)
    with on_device(a):
        _add_rms_norm_kernel[(T,)](a, b if b is not None else a, c if c is not None else a, w,
                                   x_out if x_out is not None else a, h_out,
                                   h2_out if h2_out is not None else a, H, h_out.stride(0), eps, b_rows, c_rows, *q8,
                                   flag, step, err, AWAIT_MAX_POLLS, HAS_B=b is not None,
                                   WRITE_X=x_out is not None, BH=_pow2(H), Q8=q8_out is not None,
                                   H2=h2_out is not None, WAIT=wait is not None)
    return x_out, h_out


def router_topk(logits, k: int, norm: bool, packed=None, pack_offset: int = 0, publish=None):
    """Softmax + top-k (+ renormalisation) of logits [T, E]: (weights float32 [T, k], ids int32 [T, k]).
    With `packed`, also writes weights and ids (as floats) at packed[:, pack_offset:].
    publish=(dst, flag, step) (T = 1, with packed): then the whole packed row also goes to dst (pinned host
    memory) and flag[0] (pinned int32) becomes step[0] (device int32) once the host can see it: the
    router's launch hands the row to the CPU (cpu.handoff_call polls the flag)."""
    T, E = logits.shape
    wts = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int32, device=logits.device)
    if publish is not None and (packed is None or T != 1):
        raise ValueError("router_topk(publish=) takes one row and its packed buffer")
    dst, flag, step = publish if publish is not None else (wts, ids, ids)
    with on_device(logits):
        _router_topk_kernel[(T,)](logits, wts, ids, packed if packed is not None else wts, E,
                                  packed.stride(0) if packed is not None else 0, pack_offset, dst, flag, step,
                                  K=k, KP=_pow2(k), BE=_pow2(E), NORM=norm, PACK=packed is not None,
                                  PUB=publish is not None, BN=1024, EMU=_INTERPRET, num_warps=4)
    return wts, ids


STAGE_BLOCK = 2048       # int32 words a program: 48-50 GB/s over the H200's PCIe 5 (ram_share.py, 2026-11-25)


def stage_words(raw: torch.Tensor):
    """An expert tensor [E, rows, row bytes] as int32 words [E, n] for stage_experts, or None where its
    experts are not whole 16-byte runs (then the wide loads have nothing to stand on)."""
    per = raw[0].numel() if raw.dim() == 3 else 0
    if per == 0 or per % 16 or raw.data_ptr() % 16 or not raw.is_contiguous():
        return None
    return raw.view(raw.shape[0], per).view(torch.int32)


def stage_experts(ids, j0: int, srcs, dsts):
    """Copy the experts ids[0, j0:j0 + g] of srcs (gate, up, down as stage_words, in pinned host memory, read
    by the GPU over the bus) into dsts (the same three, [g, n] on the GPU), slots whose id is < 0 left as they
    are: one launch, no host work, so a CUDA graph can hold it with ids known only on the GPU."""
    g = dsts[0].shape[0]
    n_gu, n_d = dsts[0].shape[1], dsts[2].shape[1]
    with on_device(dsts[0]):
        _stage_experts_kernel[(triton.cdiv(max(n_gu, n_d), STAGE_BLOCK), g, 3)](
            ids, j0, *srcs, *dsts, n_gu, n_d, BLOCK=STAGE_BLOCK, num_warps=4)
    return dsts


_DISABLED: set = set()                                  # types whose MoE kernels failed to build on this GPU


def share_layout_ok(qtypes, expert_bytes) -> bool:
    """The decode share's static rule (the runtime's step and the planner both ask it): the GPU's decode
    kernels read the experts' types (gate and up alike) and each expert is whole 16-byte runs, so
    stage_experts can copy it with wide loads."""
    gate, up, down = qtypes
    return gate == up and all(fused(q) for q in (gate, down)) and all(b and b % 16 == 0 for b in expert_bytes)


# The users' types with fused kernels of their own (kernels/gpu_qdot.py); HYBRIDMOE_GPU_QDOT=0 dequantizes these
# experts first instead (runtime/experts.py), the path they took before those kernels
QDOT = frozenset({GGMLType.IQ4_XS, GGMLType.IQ4_KS, GGMLType.Q3_K, GGMLType.IQ2_KT, GGMLType.Q2_K, GGMLType.MXFP4})


def fused(qtype) -> bool:
    """Whether the fused kernels (these decode kernels, gpu_moe's prompt GEMMs) may read `qtype`'s bytes."""
    return qtype in QTYPES and (qtype not in QDOT or env.get("HYBRIDMOE_GPU_QDOT") != "0")


def supports(gate_qtype, up_qtype, down_qtype) -> bool:
    return triton is not None and gate_qtype == up_qtype and \
        all(fused(q) and q not in _DISABLED for q in (gate_qtype, down_qtype))


def disable(gate_qtype, down_qtype, err: Exception):
    """Stop using the MoE kernels for these types (they failed here); the dequantize + bmm path takes over."""
    from ..errors import warn_fallback
    _DISABLED.update((gate_qtype, down_qtype))
    warn_fallback(f"the fused MoE kernel for {GGMLType(gate_qtype).name}/{GGMLType(down_qtype).name}", err,
                  "using dequantize + bmm")


# (BN, NB, warps) of the split-row kernels per (type, gate/up kernel): the fastest at the Qwen3-30B-A3B
# expert shape on H100 over tiles of one to four warps (bench_moe_decode.py --split, 2026-11-26: Q4_0 gate/up
# 6.0 us against 6.5 for (4, 32, 2), down 4.4; Q8_0 gate/up 6.8 against 8.4, down 4.9); the interpreter takes
# one larger tile (fewer programs to step through)
_SPLIT_TILE_RULE = {
    (GGMLType.Q4_0, True): (4, 64, 1), (GGMLType.Q4_0, False): (16, 32, 1),
    (GGMLType.Q8_0, True): (2, 32, 1), (GGMLType.Q8_0, False): (8, 8, 4),
}
# from BATCH_PAIRS pairs (a batched step of 4 tokens and more) where they differ: the fastest at 128 pairs on
# H100 (bench_moe_decode.py --split-batch-16, 2026-11-26: one-warp programs, a 30B layer at 16 tokens 124.9 us
# against 147.6 for the two-warp (4, 16, 2) / (8, 8, 2))
BATCH_PAIRS = 32
_SPLIT_BATCH_TILE_RULE = {(GGMLType.Q4_0, True): (2, 16, 1), (GGMLType.Q4_0, False): (4, 8, 1)}


def split_tile(qtype, gate_up: bool, n_pairs: int = 1):
    """(BN, NB, warps) of a split-row MoE kernel for this type over n_pairs (token, expert) pairs."""
    if _INTERPRET:
        return (16, 8, 4)
    key = (GGMLType(qtype), gate_up)
    return _SPLIT_BATCH_TILE_RULE.get(key, _SPLIT_TILE_RULE[key]) if n_pairs >= BATCH_PAIRS else \
        _SPLIT_TILE_RULE[key]


def x8_buffers(R: int, K: int, device):
    """(q1, q2 int8 [R, K], xs float32 and xc int32 [R, K / 32]): rows in two int8 terms per 32-block."""
    q1 = torch.empty(R, K, dtype=torch.int8, device=device)
    return (q1, torch.empty_like(q1), torch.empty(R, K // 32, dtype=torch.float32, device=device),
            torch.empty(R, K // 32, dtype=torch.int32, device=device))


def quant_x8(x: torch.Tensor):
    """Rows of x [R, K] (K a multiple of 32) in two int8 terms per 32-block (x8_buffers; _quant_blocks)."""
    R, K = x.shape
    q1, q2, xs, xc = x8_buffers(R, K, x.device)
    _quant_x8_kernel[(R, triton.cdiv(K // 32, 8))](x, x.stride(0), q1, q2, xs, xc, K, NBQ=8)
    return q1, q2, xs, xc


def gemv8_tile(K: int):
    """(rows, blocks, warps) of gemv8's programs: the fastest on H100 at the Qwen3-30B-A3B shapes
    (bench_moe_decode.py --dense, Q8_0, 2026-11-26: QKV and head at K = 2048 (2, 16, 1), 4.2 / 108.7 us against
    4.5 / 110.1 for (4, 32, 2); the output projection at K = 4096 (2, 32, 4), 3.4 us against 4.0 for (4, 32, 8))."""
    return (16, 8, 4) if _INTERPRET else (2, 32, 4) if K >= 4096 else (2, 16, 1)


def gemv8(xq, ws, qtype, K: int, out: torch.Tensor):
    """out [N] (any float dtype) = x . W^T for one row x in two int8 terms (x8_buffers, from add_rms_norm's
    q8_out or quant_x8) and W [N, K] of `qtype` (Q4_0/Q8_0) in split rows, given as one to three row
    blocks `ws` (e.g. q, k, v: read where they are, no concatenated copy). Each block's rows must be a
    multiple of the tile's (can_gemv8)."""
    bn, nb, warps = gemv8_tile(K)
    n = [w.shape[0] for w in ws]
    w0, w1, w2 = (list(ws) + [ws[-1]] * 2)[:3]
    n1, n2 = n[0], sum(n[:2])
    N = sum(n)
    with on_device(out):
        _gemv8_kernel[(triton.cdiv(N, bn),)](*xq, w0, w1, w2, n1, n2, out, K, N,
                                             ws[0].stride(0), QT=QTYPES[qtype], BN=bn, NB=nb, EMU=_INTERPRET,
                                             num_warps=warps)
    return out


def can_gemv8(ws) -> bool:
    """Whether gemv8 takes these weights (QTensors): Q4_0/Q8_0 of one type and width, in split rows on one
    GPU, each block of rows a multiple of the tile's. HYBRIDMOE_GEMV8=0: never (bf16 GEMVs; for A/B runs)."""
    bn = gemv8_tile(ws[0].shape[-1])[0]
    return triton is not None and env.get("HYBRIDMOE_GEMV8") != "0" and all(   # split: Q4_0/Q8_0
        w.split and w.qtype == ws[0].qtype and w.shape[-1] == ws[0].shape[-1] and w.raw.device == ws[0].raw.device
        and w.raw.dim() == 2 and w.shape[0] % bn == 0 for w in ws)


def _launch(kernel, args, n_pairs: int, n_out: int, qtype, gate_up: bool, oai: bool):
    """A GGUF-row MoE kernel over (pair, column tile): moe_tile's tile, or the autotuner's (HYBRIDMOE_MOE_TUNE=1)."""
    if _MOE_AUTOTUNE:
        kernel[lambda meta: (n_pairs, triton.cdiv(n_out, meta["BN"]))](*args, QT=QTYPES[qtype], OAI=oai)
    else:
        bn, nb, w = moe_tile(qtype, gate_up)
        kernel.fn[(n_pairs, triton.cdiv(n_out, bn))](*args, QT=QTYPES[qtype], OAI=oai, BN=bn, NB=nb, num_warps=w)


def _launch8(kernel, args, n_pairs: int, n_out: int, qtype, gate_up: bool, tile=None):
    """A split-row (dp4a) MoE kernel over (pair, column tile): split_tile's tile unless one is given."""
    bn, nb, w = tile or split_tile(qtype, gate_up, n_pairs)
    kernel[(n_pairs, triton.cdiv(n_out, bn))](*args, QT=QTYPES[qtype], BN=bn, NB=nb, EMU=_INTERPRET, num_warps=w)


def oai_args(oai, split: bool, dummy):
    """The MoE kernels' (bg, bu, bd, alpha, limit): gpt-oss's oai, biases in float32 (GGUF rows), or dummies."""
    if oai is not None and split:
        raise ValueError("gpt-oss's biased experts take GGUF rows, not split ones")
    bg, bu, bd, alpha, limit = oai if oai is not None else (dummy, dummy, dummy, 0.0, 0.0)
    return (*(b.float().contiguous() for b in (bg, bu, bd)), alpha, limit)


def moe(x, ids, wts, graw, uraw, draw, gate_qtype, down_qtype, reduce: bool = True, gate_split: bool = False,
        down_split: bool = False, tiles8=None, xq=None, out=None, oai=None):
    """Routed experts for a few tokens straight from GGUF bytes: x [T, H] float32, ids [T, k] (int), wts
    [T, k]; graw/uraw [E, F, row bytes], draw [E, H, row bytes]. Returns float32 [T, H]; with reduce=False
    the k weighted expert outputs per token [T * k, H] (add_rms_norm sums them into the residual).

    gate_split / down_split: those rows are Q4_0/Q8_0 in the split layout (quant.ref.split_rows, as
    GPU-resident experts are kept): their kernel takes int8 activations (quant_x8, or xq: x already in
    them, from add_rms_norm) and dp4a; tiles8 (gate/up and down (BN, NB, warps)) instead of split_tile's.
    out: the [T * k, H] float32 buffer for the expert rows (reduce=False). oai = (bg, bu, bd, alpha, limit):
    gpt-oss's experts, float32 biases bg, bu [E, F] and bd [E, H] on the GPU and the clamped SwiGLU (GGUF rows
    only, not split ones)."""
    T, H = x.shape
    k = ids.shape[1]
    F = graw.shape[1]
    x = x.float().contiguous()
    ids = ids.to(torch.int32).contiguous()
    wts = wts.float().contiguous()
    h = torch.empty(T * k, F, dtype=torch.float32, device=x.device)
    if out is None:
        out = torch.empty(T * k, H, dtype=torch.float32, device=x.device)
    strides = (graw.stride(0), graw.stride(1), uraw.stride(0), uraw.stride(1))
    tiles8 = tiles8 or (None, None)
    bg, bu, bd, alpha, limit = oai_args(oai, gate_split or down_split, h)
    with on_device(x):
        if gate_split:
            _launch8(_moe_gate_up8_kernel, (*(xq or quant_x8(x)), ids, graw, uraw, h, H, F, k, *strides), T * k, F,
                     gate_qtype, True, tiles8[0])
        else:
            _launch(_moe_gate_up_kernel, (x, ids, graw, uraw, h, H, F, k, *strides, bg, bu, float(alpha),
                                          float(limit)), T * k, F, gate_qtype, True, oai is not None)
        if down_split:
            _launch8(_moe_down8_kernel, (*quant_x8(h), ids, wts, draw, out, F, H, draw.stride(0), draw.stride(1)),
                     T * k, H, down_qtype, False, tiles8[1])
        else:
            _launch(_moe_down_kernel, (h, ids, wts, draw, out, F, H, draw.stride(0), draw.stride(1), bd), T * k, H,
                    down_qtype, False, oai is not None)
    return out.view(T, k, H).sum(1) if reduce else out


# the fastest of _MOE_TILES per (type, gate/up kernel) at the Qwen3-30B-A3B expert shape (bench_moe_decode.py
# --tiles; us a call in docs/benchmarks.md: H200 for the GGML types, H100 for gpu_qdot's): (BN, NB, warps)
_MOE_TILE_RULE = {
    (GGMLType.Q4_0, True): (16, 16, 4), (GGMLType.Q4_0, False): (8, 32, 4),
    (GGMLType.Q8_0, True): (16, 16, 4), (GGMLType.Q8_0, False): (16, 16, 4),
    (GGMLType.Q4_K, True): (8, 64, 8), (GGMLType.Q4_K, False): (4, 64, 4),
    (GGMLType.Q5_K, True): (8, 64, 8), (GGMLType.Q5_K, False): (16, 32, 8),
    (GGMLType.Q6_K, True): (4, 64, 4), (GGMLType.Q6_K, False): (16, 16, 4),
    (GGMLType.IQ4_XS, True): (16, 16, 4), (GGMLType.IQ4_XS, False): (16, 16, 4),
    (GGMLType.IQ4_KS, True): (16, 16, 4), (GGMLType.IQ4_KS, False): (16, 16, 4),
    (GGMLType.Q3_K, True): (8, 32, 4), (GGMLType.Q3_K, False): (16, 16, 4),
    (GGMLType.Q2_K, True): (8, 64, 8), (GGMLType.Q2_K, False): (16, 32, 8),
    (GGMLType.MXFP4, True): (16, 16, 4), (GGMLType.MXFP4, False): (16, 32, 8),      # at gpt-oss-20b's shape
}


def moe_tile(qtype, gate_up: bool):
    """The tile of the gate/up or the down decode kernel for this type (see _MOE_TILES)."""
    if len(_MOE_TILES) == 1:
        return _MOE_TILES[0]
    return _MOE_TILE_RULE.get((GGMLType(qtype), gate_up), _MOE_TILES[0])
