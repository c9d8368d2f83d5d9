"""Prompt-processing MoE on a GPU straight from GGUF bytes: grouped GEMMs that dequantize in registers.

The (token, slot) pairs are sorted by expert and each expert's run is padded to whole blocks of BM rows
(`align`, on the GPU: no host sync, so Python runs ahead of the kernels). Then two launches a layer:

  gate/up   per (row block, column tile): the block's expert's gate and up rows are read from their
            blocks, dequantized to bf16 in registers and multiplied on the tensor cores (two accumulators
            sharing the activation tile); the epilogue writes SiLU(gate) * up in bf16
  down      per (row block, column tile): the same from the down blocks, scaled by the router weight and
            written to the pair's row; the k rows of a token are summed after

Every weight byte is read once per row block (once per layer when an expert's tokens fit in one block) and
nothing is written to memory in bf16 but activations: the one-pass dequantization this replaces wrote every
expert of a layer out as bf16 (2.4 GB a layer for Qwen3-30B-A3B) before `torch._grouped_mm` read it back.

Q4_0 blocks are read as 16-bit words; their nibbles come out of the word in the order low nibbles of byte
pairs first, so the kernel's K axis is that of the block's elements interleaved: position p of a 32-block
holds element p // 2 + 16 (p % 2); IQ4_XS / IQ4_KS and MXFP4 32-blocks hold their nibbles as Q4_0 does, so they
are read in the same order (gpu_qdot.iq4_tile, mx_tile). The activations are permuted the same way (once per layer
for gate/up; the gate/up epilogue writes its output permuted for a Q4_0 down), and a dot product doesn't care about
the order of its terms. Q8_0 words give the natural order, and so do the K-quants Q2_K to Q6_K, each
32 elements of a 256-element block read as 8 words or 16 halfwords (gpu_qdot.k_tile; a first version that
gathered their blocks byte by byte ran at 0.74x of dequantize + grouped GEMM, this one 1.3-2.2x faster than it),
and IQ2_KT, whose values the tile computes from its trellis indices (gpu_qdot.kt_tile). Other types take that
path. gpt-oss's experts add their biases and take the clamped SwiGLU in the two epilogues (moe(oai=)).

Checked against float64 on the GPU and in Triton's interpreter (tests/test_gpu_decode.py, and test_gpu_qdot.py for
the IQ4, K-quant, IQ2_KT and MXFP4 tiles and gpt-oss's epilogues).
"""
from __future__ import annotations

import os

import torch

from .. import env
from ..quant.types import GGMLType
from .gpu_decode import fused, on_device

try:
    import triton
    import triton.language as tl

    from .gpu_qdot import iq4_tile, k_tile, kt_tile, mx_tile
except ImportError:                                      # CPU-only installs
    triton = None

QTYPES = {GGMLType.Q4_0: 0, GGMLType.Q8_0: 1, GGMLType.Q4_K: 2, GGMLType.Q6_K: 3, GGMLType.Q5_K: 4,
          GGMLType.IQ4_XS: 5, GGMLType.IQ4_KS: 6, GGMLType.Q3_K: 7, GGMLType.IQ2_KT: 8,
          GGMLType.Q2_K: 9, GGMLType.MXFP4: 10}          # gpu_decode's codes
# types whose 32-blocks hold Q4_0's nibble layout: the kernel's K order is Q4_0's interleaved one
_Q4_ORDER = (GGMLType.Q4_0, GGMLType.IQ4_XS, GGMLType.IQ4_KS, GGMLType.MXFP4)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:
    # (columns per program, 32-blocks per K step, warps, stages). pick_tile chooses one per call by a rule
    # measured on H200 (benchmarks/bench_moe_prefill.py --tiles); HYBRIDMOE_MOE_TUNE=1 lets Triton's
    # autotuner time them all instead, at each new shape's first call: ~30 s of compiling on a fresh
    # machine and ~2 s of timing every process, for a first prompt (tests: test_prefill_moe_every_tile)
    TILES = [(64, 2, 4, 3), (128, 2, 4, 3), (128, 4, 8, 3), (64, 4, 4, 4), (32, 4, 4, 3)]
    if _INTERPRET:
        TILES = [(32, 2, 4, 1)]
    _AUTOTUNE = env.get("HYBRIDMOE_MOE_TUNE") == "1" and not _INTERPRET
    _CONFIGS = [triton.Config({"BN": bn, "NBK": nbk}, num_warps=w, num_stages=st) for bn, nbk, w, st in TILES]


    _ALIGN_CHUNK = 256

    @triton.jit
    def _count_kernel(ids, counts, rank, n, CH: tl.constexpr):
        """Pairs per expert, and each pair's rank among its expert's (the counter's value before it)."""
        i = tl.program_id(0) * CH + tl.arange(0, CH)
        m = i < n
        e = tl.load(ids + i, mask=m, other=0).to(tl.int32)
        tl.store(rank + i, tl.atomic_add(counts + e, 1, mask=m), mask=m)

    @triton.jit
    def _place_kernel(ids, counts, rank, pairs, blk_e, n, E, n_blocks, BM: tl.constexpr, EP: tl.constexpr,
                      CH: tl.constexpr):
        """Each pair to its expert's blocks (experts in order, each padded to whole blocks); the expert of
        each block. Every program sums the counts itself (E is small)."""
        j = tl.arange(0, EP)
        c = tl.load(counts + j, mask=j < E, other=0)
        nblk = (c + BM - 1) // BM
        end = tl.cumsum(nblk, 0)                                           # blocks up to each expert's last
        i = tl.program_id(0) * CH + tl.arange(0, CH)
        m = i < n
        e = tl.load(ids + i, mask=m, other=0).to(tl.int32)
        start = tl.sum(tl.where(j[None, :] < e[:, None], nblk[None, :], 0), axis=1)   # blocks before e's
        tl.store(pairs + start * BM + tl.load(rank + i, mask=m, other=0), i, mask=m)
        b = i                                                              # this program's blocks
        be = tl.sum(((end[None, :] <= b[:, None]) & (j[None, :] < E)).to(tl.int32), axis=1)
        tl.store(blk_e + b, tl.where(be < E, be, -1), mask=b < n_blocks)

    @triton.jit
    def _w_tile(wp, rs, n64, nm, kb, nblk, QT: tl.constexpr, BN: tl.constexpr, NBK: tl.constexpr,
                SPLIT: tl.constexpr):
        """Weights [BN, NBK * 32] (float32) of rows n64 of one expert (rows of rs bytes from wp: GGUF, or the
        split layout of quant.ref.split_rows), blocks kb.. of nblk (Q4_0: in the interleaved order, see the
        module docstring; the split layout's 32-bit words give the same order)."""
        b = kb + tl.arange(0, NBK)
        bm = nm[:, None] & (b < nblk)[None, :]                                 # [BN, NBK]
        if QT == 5 or QT == 6:                       # IQ4_XS / IQ4_KS: 32-blocks of 256-element blocks
            v = iq4_tile(wp, rs, n64, nm, b, bm, QT == 6, BN, NBK)
        elif QT == 10:                               # MXFP4: Q4_0's nibbles, e8m0 scales
            v = mx_tile(wp, rs, n64, nm, b, bm, BN, NBK)
        elif QT == 8:                                # IQ2_KT: trellis values, natural order
            v = kt_tile(wp, rs, n64, nm, b, bm, BN, NBK)
        elif QT >= 2:                                # K-quants: the same, in natural order
            v = k_tile(wp, rs, n64, nm, b, bm, QT, BN, NBK)
        elif SPLIT:                                    # quants as 16-byte vectors, then the f16 scales
            QB: tl.constexpr = 16 if QT == 0 else 32
            rows = wp + n64[:, None] * rs
            d = tl.load((rows + nblk * QB).to(tl.pointer_type(tl.float16)) + b[None, :], mask=bm, other=0)
            d = d.to(tl.float32)
            c = tl.arange(0, QB // 4)
            w = tl.load((rows + b[None, :] * QB).to(tl.pointer_type(tl.int32))[:, :, None] + c[None, None, :],
                        mask=bm[:, :, None], other=0)                          # [BN, NBK, QB / 4]
            if QT == 0:                              # byte i of word c: elements 4c + i (low), 4c + i + 16
                lo = tl.reshape(tl.join(tl.join(w & 15, (w >> 16) & 15), tl.join((w >> 8) & 15, (w >> 24) & 15)),
                                [BN, NBK, 16])
                hi = tl.reshape(tl.join(tl.join((w >> 4) & 15, (w >> 20) & 15),
                                        tl.join((w >> 12) & 15, (w >> 28) & 15)), [BN, NBK, 16])
                v = (tl.join(lo, hi) - 8).to(tl.float32) * d[:, :, None, None]
            else:                                    # byte i of word c: element 4c + i
                v = tl.join(tl.join((w << 24) >> 24, (w << 8) >> 24), tl.join((w << 16) >> 24, w >> 24))
                v = v.to(tl.float32) * d[:, :, None, None, None]
        elif QT == 0:                                # f16 scale, then 8 words of 4 nibbles
            blk = wp.to(tl.pointer_type(tl.uint16)) + n64[:, None] * (rs // 2) + b[None, :] * 9
            d = tl.load(blk, mask=bm, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            c = tl.arange(0, 8)
            w = tl.load(blk[:, :, None] + 1 + c[None, None, :], mask=bm[:, :, None], other=0).to(tl.int32)
            # word c: bytes 2c, 2c+1; low nibbles elements 2c, 2c+1, high ones 2c+16, 2c+17
            lo = tl.reshape(tl.join(w & 15, (w >> 8) & 15), [BN, NBK, 16])             # elements 0..15
            hi = tl.reshape(tl.join((w >> 4) & 15, (w >> 12) & 15), [BN, NBK, 16])      # elements 16..31
            v = (tl.join(lo, hi) - 8).to(tl.float32) * d[:, :, None, None]
        else:                                        # f16 scale, then 16 words of 2 int8: natural order
            blk = wp.to(tl.pointer_type(tl.uint16)) + n64[:, None] * (rs // 2) + b[None, :] * 17
            d = tl.load(blk, mask=bm, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            c = tl.arange(0, 16)
            w = tl.load(blk[:, :, None] + 1 + c[None, None, :], mask=bm[:, :, None], other=0).to(tl.int32)
            v = tl.join(((w & 255) ^ 128) - 128, (((w >> 8) & 255) ^ 128) - 128).to(tl.float32)
            v = v * d[:, :, None, None]
        return tl.reshape(v, [BN, NBK * 32])

    @triton.jit
    def _perm32(n):
        """Where natural column n sits in Q4_0's interleaved order."""
        j = n % 32
        return n - j + 2 * (j % 16) + j // 16


    @triton.autotune(configs=_CONFIGS, key=["K", "N", "BM", "QT", "GATE_UP", "PERM_OUT", "SPLIT", "OAI"])
    @triton.jit
    def _moe_gemm_kernel(a, a_stride, w1, w2, sw_e, sw_n, out, out_stride, pairs, blk_e, wts, n_pairs, k_used,
                         K, N, b1, b2, alpha, limit, QT: tl.constexpr, BM: tl.constexpr, GATE_UP: tl.constexpr,
                         PERM_OUT: tl.constexpr, SPLIT: tl.constexpr, OAI: tl.constexpr, BN: tl.constexpr,
                         NBK: tl.constexpr):
        """One (row block, column tile); the tensor cores take a's dtype (bf16, or float32 in Triton's
        interpreter). a's columns are in the kernel's K order (contiguous loads: a version that gathered
        float32 columns in Q4_0's order in here ran 1.5x slower than the torch gather it saved). OAI: gpt-oss's
        experts, float32 biases b1 (gate), b2 (up) [E, N] or b1 (down) [E, N] added and the clamped SwiGLU."""
        n_nt = tl.cdiv(N, BN)
        pid_m = tl.program_id(0) // n_nt
        pid_n = tl.program_id(0) % n_nt
        e = tl.load(blk_e + pid_m)
        if e >= 0:                                   # blocks past the routed rows are -1
            r = pid_m * BM + tl.arange(0, BM)
            pair = tl.load(pairs + r)
            valid = pair < n_pairs
            arow = (pair // k_used) if GATE_UP else r
            a_rows = a + arow.to(tl.int64)[:, None] * a_stride
            n = pid_n * BN + tl.arange(0, BN)
            nm = n < N
            n64 = n.to(tl.int64)
            wp1 = w1 + e.to(tl.int64) * sw_e
            wp2 = w2 + e.to(tl.int64) * sw_e
            BK: tl.constexpr = NBK * 32
            nblk = K // 32
            acc1 = tl.zeros([BM, BN], tl.float32)
            acc2 = tl.zeros([BM, BN], tl.float32)
            for k0 in range(0, K, BK):
                kk = k0 + tl.arange(0, BK)
                at = tl.load(a_rows + kk[None, :], mask=valid[:, None] & (kk < K)[None, :], other=0)
                wt = _w_tile(wp1, sw_n, n64, nm, k0 // 32, nblk, QT, BN, NBK, SPLIT).to(at.dtype)
                acc1 = tl.dot(at, tl.trans(wt), acc1)
                if GATE_UP:
                    wt2 = _w_tile(wp2, sw_n, n64, nm, k0 // 32, nblk, QT, BN, NBK, SPLIT).to(at.dtype)
                    acc2 = tl.dot(at, tl.trans(wt2), acc2)
            if GATE_UP and OAI:                      # gpt-oss's clamped SwiGLU of the biased gate and up
                g = tl.minimum(acc1 + tl.load(b1 + e.to(tl.int64) * N + n, mask=nm, other=0)[None, :], limit)
                u = acc2 + tl.load(b2 + e.to(tl.int64) * N + n, mask=nm, other=0)[None, :]
                u = tl.minimum(tl.maximum(u, -limit), limit)
                h = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
            elif GATE_UP:                            # SiLU(gate) * up for every row of the block (padding: 0)
                h = acc1 / (1.0 + tl.exp(-acc1)) * acc2
            if GATE_UP:
                col = _perm32(n) if PERM_OUT else n
                tl.store(out + r.to(tl.int64)[:, None] * out_stride + col[None, :], h.to(out.dtype.element_ty),
                         mask=nm[None, :])
            else:                                    # the pair's weighted row
                wv = tl.load(wts + pair, mask=valid, other=0)
                if OAI:
                    acc1 += tl.load(b1 + e.to(tl.int64) * N + n, mask=nm, other=0)[None, :]
                tl.store(out + pair.to(tl.int64)[:, None] * out_stride + n[None, :], acc1 * wv[:, None],
                         mask=valid[:, None] & nm[None, :])


def available() -> bool:
    return triton is not None


_DISABLED: set = set()                                  # type pairs whose kernels failed to build on this GPU


def supports(gate_qtype, up_qtype, down_qtype) -> bool:
    return (triton is not None and gate_qtype == up_qtype and gate_qtype in QTYPES and down_qtype in QTYPES
            and fused(gate_qtype) and fused(down_qtype) and (gate_qtype, down_qtype) not in _DISABLED)


def disable(gate_qtype, down_qtype, err: Exception):
    """Stop using these kernels for this type pair (they failed here); dequantize + grouped GEMM takes over."""
    from ..errors import warn_fallback
    _DISABLED.add((gate_qtype, down_qtype))
    warn_fallback(f"the fused prefill MoE kernel for {GGMLType(gate_qtype).name}/{GGMLType(down_qtype).name}",
                  err, "dequantizing the experts to bf16 first")


def block_height(n_pairs: int, n_expert: int, lo: int, hi: int) -> int:
    """Pairs per block of align(): a power of two from lo to hi of at least 1.5x the mean pairs per expert, so
    most experts' pairs fit one block (their bytes read once) without many empty rows."""
    mean = n_pairs / max(n_expert, 1)
    b = lo
    while b < hi and b < 1.5 * mean:
        b *= 2
    return b


def block_rows(n_pairs: int, n_expert: int) -> int:
    """Rows per block (BM) of the grouped GEMMs: 16 (the tensor cores' tile) to 128; a block's cost is its
    dequantization, so fewer, fuller blocks pay."""
    return block_height(n_pairs, n_expert, 16, 128)


def align(ids: torch.Tensor, n_expert: int, bm: int):
    """(token, slot) pairs grouped by expert, each expert's run padded to whole blocks of bm rows.

    Returns pairs int32 [n_blocks * bm] (the flat pair index t * k + j, or T * k for padding) and the
    expert of each block int32 [n_blocks] (-1 for blocks past the last routed row). n_blocks is the worst
    case for any routing, so nothing waits for the GPU. Four launches (a prompt's layer is host-bound):
    the pairs' ranks within their experts come from atomic counters, so the order of an expert's rows
    varies from run to run; each row's result doesn't depend on it."""
    flat = ids.reshape(-1)
    n = flat.numel()
    n_blocks = -(-n // bm) + min(n_expert, n)
    counts = torch.zeros(n_expert, dtype=torch.int32, device=flat.device)
    rank = torch.empty(n, dtype=torch.int32, device=flat.device)
    pairs = torch.full((n_blocks * bm,), n, dtype=torch.int32, device=flat.device)
    blk_e = torch.empty(n_blocks, dtype=torch.int32, device=flat.device)
    ep = max(16, 1 << (n_expert - 1).bit_length())
    grid = (triton.cdiv(max(n, n_blocks), _ALIGN_CHUNK),)
    _count_kernel[grid](flat, counts, rank, n, CH=_ALIGN_CHUNK)
    _place_kernel[grid](flat, counts, rank, pairs, blk_e, n, n_expert, n_blocks, BM=bm, EP=ep, CH=_ALIGN_CHUNK)
    return pairs, blk_e


_ORDERS: dict = {}


def q4_0_order(n_cols: int, device) -> torch.Tensor:
    """The natural column at each position of Q4_0's interleaved K order (see the module docstring)."""
    key = (n_cols, str(device))
    if key not in _ORDERS:
        p = torch.arange(n_cols, device=device)
        j = p % 32
        _ORDERS[key] = p - j + j // 2 + 16 * (j % 2)
    return _ORDERS[key]


def pick_tile(bm: int, gate_up: bool, qtype, split: bool = False):
    """The tile for one of the two grouped GEMMs (see TILES), by the rule measured on H200 at the Qwen3-30B-A3B
    shape (bench_moe_prefill.py --tiles, 2026-11-24): gate/up takes 64 columns a program except at 32-64
    rows per block, where 128 won (Q8_0 at BM 64: 455 vs 704 us; at BM 128 it lost 1.5-2.2x); down takes
    128 columns, except Q8_0 at >= 64 rows per block (64: 228 vs 267 us). Within 3% of the best of TILES
    at every type and T measured (64 to 4096 tokens). On split rows (--tiles-split) gate/up takes 64
    columns at every block height (BM 64: 351 vs 397 us Q4_0, 287 vs 343 us Q8_0) and down 64 for Q8_0,
    128 for Q4_0: the best of TILES at each type and T measured (128, 512, 4096 tokens) but one within 1%. IQ2_KT's
    down takes 64 columns (H100, 2026-11-27: 184 vs 189 us at BM 64, 363 vs 389 at BM 128; its gate/up within 4%
    of the best by the common rule)."""
    if _INTERPRET:
        return TILES[0]
    if split:
        return TILES[0] if gate_up or qtype == GGMLType.Q8_0 else TILES[1]
    if gate_up:
        return TILES[1] if 32 <= bm <= 64 else TILES[0]
    return TILES[0] if (qtype == GGMLType.Q8_0 and bm >= 64) or qtype == GGMLType.IQ2_KT else TILES[1]


def _gemm(a, w1, w2, out, pairs, blk_e, wts, n_pairs, k_used, K, N, qtype, bm, gate_up, perm_out, split, tile,
          bias=None):
    """One of the two grouped GEMMs; bias = (b1, b2, alpha, limit): gpt-oss's (b2 unread by the down GEMM)."""
    b1, b2, alpha, limit = bias if bias is not None else (wts, wts, 0.0, 0.0)        # (unread without OAI)
    args = (a, a.stride(0), w1, w2, w1.stride(0), w1.stride(1), out, out.stride(0), pairs, blk_e, wts, n_pairs,
            k_used, K, N, b1, b2, float(alpha), float(limit))
    kw = dict(QT=QTYPES[qtype], BM=bm, GATE_UP=gate_up, PERM_OUT=perm_out, SPLIT=split, OAI=bias is not None)
    if tile is None and _AUTOTUNE:
        _moe_gemm_kernel[lambda meta: (blk_e.numel() * triton.cdiv(N, meta["BN"]),)](*args, **kw)
    else:
        bn, nbk, warps, stages = tile or pick_tile(bm, gate_up, qtype, split)
        _moe_gemm_kernel.fn[(blk_e.numel() * triton.cdiv(N, bn),)](*args, **kw, BN=bn, NBK=nbk, num_warps=warps,
                                                                    num_stages=stages)


def moe(x, ids, wts, graw, uraw, draw, gate_qtype, down_qtype, dtype=torch.bfloat16, tile=None,
        bm=None, gate_split: bool = False, down_split: bool = False, oai=None) -> torch.Tensor:
    """Routed experts for a batch of tokens from GGUF bytes: x [T, H], ids [T, k] (int), wts [T, k];
    graw/uraw [E, F, row bytes], draw [E, H, row bytes] on one GPU (rows in the split layout where
    *_split, quant.ref.split_rows). Returns float32 [T, H].

    dtype: the tensor cores' operand type (bf16; float32 for Triton's interpreter, whose bf16 dot is wrong).
    tile: one of TILES for both kernels instead of the autotuner's choice; bm: rows per block instead of
    block_rows' (tests, benchmarks). oai = (bg, bu, bd, alpha, limit): gpt-oss's experts, float32 biases [E, F],
    [E, F], [E, H] on the GPU, and the clamped SwiGLU."""
    T, H = x.shape
    k = ids.shape[1]
    E, F = graw.shape[0], graw.shape[1]
    n_pairs = T * k
    bm = bm or block_rows(n_pairs, E)
    with on_device(x):
        pairs, blk_e = align(ids, E, bm)
        a = x.to(dtype)
        a = a[:, q4_0_order(H, x.device)] if gate_qtype in _Q4_ORDER else a.contiguous()
        h = torch.empty(pairs.numel(), F, dtype=dtype, device=x.device)
        wf = wts.reshape(-1).float().contiguous()
        bg, bu, bd = (None,) * 3 if oai is None else (b.float().contiguous() for b in oai[:3])
        _gemm(a, graw, uraw, h, pairs, blk_e, wf, n_pairs, k, H, F, gate_qtype, bm, True,
              down_qtype in _Q4_ORDER, gate_split, tile, None if oai is None else (bg, bu, *oai[3:]))
        out = torch.empty(n_pairs, H, dtype=torch.float32, device=x.device)
        _gemm(h, draw, draw, out, pairs, blk_e, wf, n_pairs, k, F, H, down_qtype, bm, False, False, down_split, tile,
              None if oai is None else (bd, bd, *oai[3:]))
    return out.view(T, k, H).sum(1)
