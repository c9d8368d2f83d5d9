"""Decode-batch MoE on the int8 tensor cores (MMQ, as llama.cpp's CUDA mmq): each routed expert's Q4_0 / Q8_0
split rows (quant.ref.split_rows, how GPU-resident experts are kept) read once per block of its pairs, with
no float conversion of a weight.

  quant     the activations in int8 per 32-block: x ~ s (256 q1 + q2), s = max|x| / (127 * 256), as the
            CPU kernel's integer path and gpu_decode.quant_x8, plus each term's Q4_0 offset c = -8 sum q
  align     the step's pairs sorted by expert into blocks of BP (gpu_moe.align: on the GPU, no host sync,
            the worst-case block count, so a batch bucket's CUDA graph holds fixed shapes)
  gate/up   per (block, column tile), per 32-block: one int8 MMA [BN, 32] x [32, R] -> int32 for the gate
            rows and one for the up rows, then acc += (i32 + c) * d[n] * s[r] in float32; the epilogue
            writes SiLU(gate) * up for each pair, already in the two int8 terms the down kernel reads
  down      the same from the down rows, times the router weight, to each pair's row

The weight rows are the MMA's M side (its 16-row minimum filled by BN >= 16 rows of one expert) and the block's
few activation rows its N side (R = BP x TERMS columns, padded by Triton to the MMA's 8): a decode block of 1-2
pairs costs the MMA's smallest shape, and the per-block float rescaling runs over BN x R results, not over a
16-row tile of mostly empty rows. With two terms (TERMS=2) columns 0..BP-1 hold q1 and BP..2BP-1 q2 of the
same pairs, summed once after the K loop; TERMS=1 (q1 alone, llama.cpp's q8_1) halves R at ~1e-2 of float64.

Weights: a Q8_0 block's 32 quants are its 32 bytes, given to the MMA as they are. A Q4_0 block's 16 bytes
become 32 int8 by two bit operations on whole 32-bit words (low nibbles: w & 0x0F0F0F0F; high ones:
(w >> 4) & 0x0F0F0F0F), unsigned, the -8 carried by the activations' c. Their order is byte j's low nibble,
then its high one: position p of the 32-block holds element p // 2 + 16 (p % 2), and the activations are
quantized in that order too (a dot product does not care about the order of its terms).

Checked against float64 on a GPU and in Triton's interpreter (tests/test_gpu_mmq.py).
"""
from __future__ import annotations

import torch

from ..errors import HybridMoeError
from ..quant.types import GGMLType
from .gpu_decode import _INTERPRET, on_device
from .gpu_moe import block_height

try:
    import triton
    import triton.language as tl

    from .gpu_moe import align
except ImportError:                                      # CPU-only installs
    triton = None

QTYPES = {GGMLType.Q4_0: 0, GGMLType.Q8_0: 1}
TERMS = 2           # int8 terms per activation (1: ~1e-2 from float64, 2: within 1e-4, as gpu_decode's kernels)


if triton is not None:
    @triton.jit
    def _two_terms(v, AXIS: tl.constexpr):
        """Values v in two int8 terms per 32 along AXIS (as float): q1, q2 and the 32's max |v|."""
        amax = tl.max(tl.abs(v), axis=AXIS)
        t = v * tl.expand_dims(127.0 / tl.maximum(amax, 1e-30), AXIS)           # all-zero blocks stay 0
        a = tl.floor(t + 0.5)
        return a, tl.minimum(tl.floor((t - a) * 256.0 + 0.5), 127.0), amax

    @triton.jit
    def _quant_kernel(x, x_stride, qq, xs, cc, R, K, NBQ: tl.constexpr, PERM: tl.constexpr):
        """NBQ 32-blocks of row r of x (program (r, chunk)) in two int8 terms: qq [2, R, K] (q1, q2), xs [R, K / 32]
        (s), cc [2, R, K / 32] (-8 sum q1, -8 sum q2). PERM: each block's columns in Q4_0's nibble order."""
        r = tl.program_id(0)
        nblk = K // 32
        b = tl.program_id(1) * NBQ + tl.arange(0, NBQ)
        bm = b < nblk
        j = tl.arange(0, 32)
        src = j
        if PERM:
            src = j // 2 + 16 * (j % 2)
        v = tl.load(x + r * x_stride + b[:, None] * 32 + src[None, :], mask=bm[:, None], other=0).to(tl.float32)
        a, c, amax = _two_terms(v, 1)
        o = r * K + b[:, None] * 32 + j[None, :]
        tl.store(qq + o, a.to(tl.int8), mask=bm[:, None])
        tl.store(qq + R * K + o, c.to(tl.int8), mask=bm[:, None])
        ob = r * nblk + b
        tl.store(xs + ob, amax * (1.0 / (127.0 * 256.0)), mask=bm)
        tl.store(cc + ob, (-8.0 * tl.sum(a, axis=1)).to(tl.int32), mask=bm)
        tl.store(cc + R * nblk + ob, (-8.0 * tl.sum(c, axis=1)).to(tl.int32), mask=bm)

    @triton.jit
    def _nibbles(w, EMU: tl.constexpr):
        """Bytes w (uint8) -> their low and high nibbles as int8 0..15, four bytes an instruction."""
        if EMU:
            lo, hi = w & 15, w >> 4
        else:
            lo = tl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [w], dtype=tl.uint8,
                                           is_pure=True, pack=4)
            hi = tl.inline_asm_elementwise("shr.b32 $0, $1, 4;\n\tand.b32 $0, $0, 0x0F0F0F0F;", "=r,r", [w],
                                           dtype=tl.uint8, is_pure=True, pack=4)
        return lo.to(tl.int8, bitcast=True), hi.to(tl.int8, bitcast=True)

    @triton.jit
    def _w_block(rows, scales, nm, b, bmask, QT: tl.constexpr, BN: tl.constexpr, EMU: tl.constexpr):
        """32-block b of rows [BN, 1] (byte pointers into split rows; scales [BN]: their f16 scales') as int8
        [BN, 32] (Q4_0: unsigned, in the nibble order), and the block's scales float32 [BN]."""
        m = nm & bmask
        if QT == 0:
            w = tl.load(rows + b * 16 + tl.arange(0, 16)[None, :], mask=m[:, None], other=0)      # [BN, 16]
            lo, hi = _nibbles(w, EMU)
            q = tl.reshape(tl.join(lo, hi), [BN, 32])
        else:
            q = tl.load(rows + b * 32 + tl.arange(0, 32)[None, :], mask=m[:, None], other=0).to(tl.int8, bitcast=True)
        d = tl.load((scales + b * 2).to(tl.pointer_type(tl.float16)), mask=m, other=0)
        return q, d.to(tl.float32)

    @triton.jit
    def _mmq(w1, w2, rs, n, nm, qq, RK, xs, cc, RB, arow, valid, term, K, QT: tl.constexpr, R: tl.constexpr,
             BN: tl.constexpr, NB: tl.constexpr, TWO: tl.constexpr, EMU: tl.constexpr):
        """[BN, R] float32 products of rows n of one expert's split-row matrix (w2's too where TWO) with R
        activation rows: column r is term term[r] of quantized row arow[r] (columns where valid is False give 0).
        The weights are the MMA's M side (16+ rows) and the few activation rows its N side."""
        QB: tl.constexpr = 16 if QT == 0 else 32
        nblk = K // 32
        n64 = n.to(tl.int64)
        s1 = w1 + n64 * rs + nblk * QB                                                # [BN]: the f16 scales
        s2 = w2 + n64 * rs + nblk * QB
        r1 = (w1 + n64 * rs)[:, None]                                                 # [BN, 1]: the quants
        r2 = (w2 + n64 * rs)[:, None]
        a64 = arow.to(tl.int64)
        ap = qq + term.to(tl.int64) * RK + a64 * K                                    # [R]
        sp = xs + a64 * nblk
        cp = cc + term.to(tl.int64) * RB + a64 * nblk
        tmul = tl.where(term == 0, 256.0, 1.0)                                        # q1's weight
        j = tl.arange(0, 32)
        acc1 = tl.zeros([BN, R], tl.float32)
        acc2 = tl.zeros([BN, R], tl.float32)
        for kb in range(0, nblk, NB):
            for i in tl.static_range(NB):
                b = kb + i
                bmask = b < nblk
                a = tl.load(ap[None, :] + b * 32 + j[:, None], mask=valid[None, :] & bmask, other=0)   # [32, R]
                sa = tl.load(sp + b, mask=valid & bmask, other=0) * tmul                              # [R]
                if QT == 0:
                    corr = tl.load(cp + b, mask=valid & bmask, other=0)[None, :]
                q, d = _w_block(r1, s1, nm, b, bmask, QT, BN, EMU)
                i32 = tl.dot(q, a, out_dtype=tl.int32)                                               # [BN, R]
                if QT == 0:
                    i32 += corr
                acc1 += i32.to(tl.float32) * d[:, None] * sa[None, :]
                if TWO:
                    q, d = _w_block(r2, s2, nm, b, bmask, QT, BN, EMU)
                    i32 = tl.dot(q, a, out_dtype=tl.int32)
                    if QT == 0:
                        i32 += corr
                    acc2 += i32.to(tl.float32) * d[:, None] * sa[None, :]
        return acc1, acc2

    @triton.jit
    def _sum_terms(acc, BP: tl.constexpr, BN: tl.constexpr, TERMS: tl.constexpr):
        """[BN, TERMS * BP] -> [BN, BP]: each pair's two term columns added."""
        if TERMS == 2:
            r = tl.sum(tl.reshape(acc, [BN, 2, BP]), axis=1)
        else:
            r = acc
        return r

    @triton.jit
    def _mmq_kernel(qq, RK, xs, cc, RB, pairs, blk_e, n_pairs, k_used, w1, w2, wts, out, oxs, occ, ORK, ORB, K, N,
                    se, sn, QT: tl.constexpr, GATE_UP: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                    NB: tl.constexpr, TERMS: tl.constexpr, QOUT: tl.constexpr, PERM_OUT: tl.constexpr,
                    EMU: tl.constexpr):
        """Program (block of one expert's pairs, column tile). GATE_UP: rows of w1 (gate) and w2 (up), the
        activations the tokens' rows, out [pairs, N] = SiLU(gate) * up; else rows of w1 (down), the
        activations the pairs' rows, out [pairs, N] = the router weight times the product. QOUT (BN a multiple
        of 32): out in two int8 terms as _quant_kernel writes them (out, out + ORK: q1, q2; oxs; occ, occ + ORB),
        in Q4_0's nibble order where PERM_OUT: the down kernel's activations, with no float copy."""
        blk = tl.program_id(0)
        e = tl.load(blk_e + blk)
        if e >= 0:                                     # blocks past the routed pairs are -1
            R: tl.constexpr = BP * TERMS
            i = tl.arange(0, R)
            pair = tl.load(pairs + blk * BP + i % BP)
            valid = pair < n_pairs
            arow = tl.where(valid, pair, 0)
            if GATE_UP:
                arow = arow // k_used
            term = i // BP
            n = tl.program_id(1) * BN + tl.arange(0, BN)
            nm = n < N
            e64 = e.to(tl.int64)
            acc1, acc2 = _mmq(w1 + e64 * se, w2 + e64 * se, sn, n, nm, qq, RK, xs, cc, RB, arow, valid, term, K,
                              QT, R, BN, NB, GATE_UP, EMU)
            p = tl.load(pairs + blk * BP + tl.arange(0, BP))
            pm = p < n_pairs
            g = _sum_terms(acc1, BP, BN, TERMS)                                       # [BN, BP]
            if GATE_UP:
                u = _sum_terms(acc2, BP, BN, TERMS)
                y = g / (1.0 + tl.exp(-g)) * u
            else:
                y = g * tl.load(wts + p, mask=pm, other=0).to(tl.float32)[None, :]
            p64 = p.to(tl.int64)
            if QOUT:
                NQ: tl.constexpr = BN // 32
                a, c, amax = _two_terms(tl.reshape(y, [NQ, 32, BP]), 1)               # [NQ, 32, BP], [NQ, BP]
                e32 = tl.arange(0, 32)
                pos = e32
                if PERM_OUT:                           # element e of a 32-block sits at 2 (e % 16) + e // 16
                    pos = 2 * (e32 % 16) + e32 // 16
                blk32 = tl.program_id(1) * NQ + tl.arange(0, NQ)
                col = (blk32 * 32)[:, None] + pos[None, :]                                 # [NQ, 32]
                o = p64[None, None, :] * N + col[:, :, None]
                m = pm[None, None, :] & (col < N)[:, :, None]
                tl.store(out + o, a.to(tl.int8), mask=m)
                tl.store(out + ORK + o, c.to(tl.int8), mask=m)
                ob = p64[None, :] * (N // 32) + blk32[:, None]                             # [NQ, BP]
                mb = pm[None, :] & (blk32 < N // 32)[:, None]
                tl.store(oxs + ob, amax * (1.0 / (127.0 * 256.0)), mask=mb)
                tl.store(occ + ob, (-8.0 * tl.sum(a, axis=1)).to(tl.int32), mask=mb)
                tl.store(occ + ORB + ob, (-8.0 * tl.sum(c, axis=1)).to(tl.int32), mask=mb)
            else:
                tl.store(out + p64[None, :] * N + n[:, None], y, mask=nm[:, None] & pm[None, :])


def available() -> bool:
    return triton is not None


_DISABLED: set = set()                                  # type pairs whose kernels failed to build on this GPU


def supports(gate_qtype, up_qtype, down_qtype) -> bool:
    """Q4_0 / Q8_0 experts (in split rows: the caller's part, runtime/experts.gpu_moe_path)."""
    return (triton is not None and gate_qtype == up_qtype and gate_qtype in QTYPES and down_qtype in QTYPES
            and (gate_qtype, down_qtype) not in _DISABLED)


def disable(gate_qtype, down_qtype, err: Exception):
    """Stop using these kernels for this type pair (they failed here); the caller's fallback takes over."""
    from ..errors import warn_fallback
    _DISABLED.add((gate_qtype, down_qtype))
    warn_fallback(f"the int8 tensor-core MoE kernel for {GGMLType(gate_qtype).name}/{GGMLType(down_qtype).name}",
                  err, "the bf16 grouped GEMMs")


def block_pairs(n_pairs: int, n_expert: int) -> int:
    """Pairs per block (BP), 2 to 16 (gpu_moe.block_height): the MMA's N side."""
    return block_height(n_pairs, n_expert, 2, 16)


# (BN, NB, warps, stages) of the gate/up (True) and the down kernel: BN columns a program, NB 32-blocks a K step.
# The fastest of bench_moe_decode.py --mmq-tiles' grid at 64 tokens on H100 (2026-11-26: a 30B layer 305.3 us
# against 353.6 for (64, 4, 4, 3)); the interpreter takes one small tile (fewer programs to step through).
TILES = {True: (128, 2, 4, 3), False: (128, 2, 4, 3)}


def tile(gate_up: bool):
    return (32, 1, 4, 1) if _INTERPRET else TILES[gate_up]


def _x8(R: int, K: int, device):
    """Buffers for R rows of K columns in two int8 terms: (qq [2, R, K] int8, xs [R, K / 32], cc [2, R, K / 32])."""
    return (torch.empty(2, R, K, dtype=torch.int8, device=device),
            torch.empty(R, K // 32, dtype=torch.float32, device=device),
            torch.empty(2, R, K // 32, dtype=torch.int32, device=device))


def quant(x: torch.Tensor, perm: bool):
    """Rows of x [R, K] (K a multiple of 32) in two int8 terms per 32-block (see _quant_kernel): (qq [2, R, K]
    int8, xs [R, K / 32] float32, cc [2, R, K / 32] int32); perm: in Q4_0's nibble order."""
    R, K = x.shape
    qq, xs, cc = _x8(R, K, x.device)
    _quant_kernel[(R, triton.cdiv(K // 32, 8))](x, x.stride(0), qq, xs, cc, R, K, NBQ=8, PERM=perm)
    return qq, xs, cc


def _launch(xq, pairs, blk_e, n_pairs, k, w1, w2, wts, out, K, N, qtype, gate_up, bp, terms, t, perm_out=None):
    """One of the two kernels; out: a float32 [pairs, N] tensor, or _x8's buffers (the quantized result, in Q4_0's
    nibble order where perm_out; the gate/up kernel at a BN that is a multiple of 32)."""
    qq, xs, cc = xq
    bn, nb, warps, stages = t
    qout = isinstance(out, tuple)
    oq, oxs, occ = out if qout else (out, xs, cc)
    _mmq_kernel[(blk_e.numel(), triton.cdiv(N, bn))](
        qq, qq[0].numel(), xs, cc, cc[0].numel(), pairs, blk_e, n_pairs, k, w1, w2, wts, oq, oxs, occ,
        oq[0].numel() if qout else 0, occ[0].numel() if qout else 0, K, N, w1.stride(0), w1.stride(1),
        QT=QTYPES[qtype], GATE_UP=gate_up, BP=bp, BN=bn, NB=nb, TERMS=terms, QOUT=qout, PERM_OUT=bool(perm_out),
        EMU=_INTERPRET, num_warps=warps, num_stages=stages)


def moe(x, ids, wts, graw, uraw, draw, gate_qtype, down_qtype, reduce: bool = True, gate_split: bool = True,
        down_split: bool = True, bp: int | None = None, terms: int = TERMS, tiles=None, out=None, fuse=True):
    """Routed experts for a batch of decode tokens: x [T, H] (float), ids [T, k] (int), wts [T, k]; graw/uraw
    [E, F, row bytes], draw [E, H, row bytes] of Q4_0 / Q8_0 in split rows. Returns float32 [T, H];
    reduce=False: the k weighted rows per token [T * k, H] (into out where given). bp: pairs per block
    instead of block_pairs'; terms: int8 terms per activation (1 or 2); tiles: (gate/up, down) (BN, NB, warps,
    stages) instead of tile()'s; fuse: the gate/up kernel writes the down kernel's int8 activations itself
    (where its BN is a multiple of 32; else, or fuse=False, a float32 copy that quant() then reads)."""
    if not (gate_split and down_split):
        raise HybridMoeError("the int8 tensor-core MoE kernel reads split rows (quant.ref.split_rows) only")
    if terms not in (1, 2):
        raise HybridMoeError(f"terms={terms}: give 1 or 2")
    T, H = x.shape
    k = ids.shape[1]
    E, F = graw.shape[0], graw.shape[1]
    n = T * k
    bp = bp or block_pairs(n, E)
    tiles = tiles or (tile(True), tile(False))
    fuse = fuse and tiles[0][0] % 32 == 0
    perm = down_qtype == GGMLType.Q4_0
    wf = wts.reshape(-1).float().contiguous()
    if out is None:
        out = torch.empty(n, H, dtype=torch.float32, device=x.device)
    with on_device(x):
        pairs, blk_e = align(ids, E, bp)
        xq = quant(x.contiguous(), gate_qtype == GGMLType.Q4_0)
        h = _x8(n, F, x.device) if fuse else torch.empty(n, F, dtype=torch.float32, device=x.device)
        _launch(xq, pairs, blk_e, n, k, graw, uraw, wf, h, H, F, gate_qtype, True, bp, terms, tiles[0], perm)
        hq = h if fuse else quant(h, perm)
        _launch(hq, pairs, blk_e, n, k, draw, draw, wf, out, F, H, down_qtype, False, bp, terms, tiles[1])
    return out.view(T, k, H).sum(1) if reduce else out
