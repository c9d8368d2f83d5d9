"""Batched decode MoE on a GPU: each expert a batch routes to is read once per block of its tokens.

The per-pair decode kernels (gpu_decode.moe) run one program set per (token, slot) pair, so B tokens routed to
one expert read its bytes B times; the prompt's grouped GEMMs (gpu_moe.moe) read them once but pad every
expert to 16+ rows of tensor-core tiles and dequantize to bf16. Here, between the two:

  align     the step's pairs sorted by expert into blocks of BM rows (gpu_moe.align: on the GPU, no host
            sync, the worst-case block count, so the shapes are fixed per batch bucket and a CUDA graph
            holds them)
  gate/up   per (block, column tile): the block's expert's gate and up rows, SiLU(gate) * up for each of
            the block's pairs, written to the pair's row
  down      per (block, column tile): the same from the down rows, times the router weight

On split rows (quant.ref.split_rows: how GPU-resident Q4_0/Q8_0 experts are kept) a K step's weight words are
loaded once and meet the BM rows' int8 activations (two terms, gpu_decode.quant_x8) in dp4a: [BM, BN, NB, 4]
products, the same integer sums per row as the per-pair kernel. GGUF rows (every type gpu_decode.moe reads)
take the per-pair kernel's dot product (gpu_decode._qdot) once per row of the block: the weights come from
HBM once and from L1/L2 for the block's other rows, decoded again each time.

Which of the three runs is runtime/experts.gpu_moe_path's choice, by the number of pairs.
Checked against float64 on a GPU and in Triton's interpreter (tests/test_gpu_moe_grouped.py).
"""
from __future__ import annotations

import torch

from ..quant.types import GGMLType
from . import gpu_decode as gd
from .gpu_decode import _INTERPRET, QTYPES, on_device
from .gpu_moe import block_height

try:
    import triton
    import triton.language as tl

    from .gpu_decode import _dp4a, _qdot
    from .gpu_moe import align
except ImportError:                                      # CPU-only installs
    triton = None


if triton is not None:
    @triton.jit
    def _qdot8_rows(wrow, row_stride, n, nm, q1, q2, xs, xc, xr, xv, K, QT: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, NB: tl.constexpr, EMU: tl.constexpr):
        """[BM, BN] dot products of rows n of a split-row Q4_0 (QT 0) / Q8_0 (1) matrix with BM activation rows
        in two int8 terms (rows xr of q1, q2 [., K] and xs, xc [., K / 32]; rows where xv is False give 0).
        Each K step loads the weights once for all BM rows; per row the sums are gpu_decode._qdot8's."""
        QB: tl.constexpr = 16 if QT == 0 else 32
        acc = tl.zeros([BM, BN, NB], tl.float32)
        nblk = K // 32
        bi = tl.arange(0, NB)
        c = tl.arange(0, 4)
        rows = wrow + n.to(tl.int64)[:, None] * row_stride                                 # [BN, 1]
        xr64 = xr.to(tl.int64)
        x1 = q1.to(tl.pointer_type(tl.int32)) + (xr64 * (K // 4))[:, None, None]          # [BM, 1, 1]
        x2 = q2.to(tl.pointer_type(tl.int32)) + (xr64 * (K // 4))[:, None, None]
        xsr = xs + (xr64 * nblk)[:, None]                                                  # [BM, 1]
        xcr = xc + (xr64 * nblk)[:, None]
        for kb in range(0, nblk, NB):
            b = kb + bi
            bm = b < nblk
            m2 = nm[:, None] & bm[None, :]                                                 # [BN, NB]
            m3 = m2[:, :, None]
            wp = (rows + b[None, :] * QB).to(tl.pointer_type(tl.int32))[:, :, None] + c[None, None, :]
            wa = tl.load(wp, mask=m3, other=0)                                             # [BN, NB, 4]
            if QT == 0:                                # byte i of word c: elements 4c + i (low), 4c + i + 16
                wb = (wa >> 4) & 0x0F0F0F0F
                wa = wa & 0x0F0F0F0F
            else:                                      # words c and c + 4: elements 4c + i, 4c + i + 16
                wb = tl.load(wp + 4, mask=m3, other=0)
            xo = ((b * 8)[:, None] + c[None, :])[None]                                     # [1, NB, 4]
            xm = xv[:, None, None] & bm[None, :, None]                                     # [BM, NB, 1]
            wa4 = tl.broadcast_to(wa[None], [BM, BN, NB, 4])
            wb4 = tl.broadcast_to(wb[None], [BM, BN, NB, 4])
            a1 = _dp4a(wa4, tl.broadcast_to(tl.load(x1 + xo, mask=xm, other=0)[:, None], [BM, BN, NB, 4]), 0, EMU)
            a1 = _dp4a(wb4, tl.broadcast_to(tl.load(x1 + xo + 4, mask=xm, other=0)[:, None], [BM, BN, NB, 4]), a1, EMU)
            a2 = _dp4a(wa4, tl.broadcast_to(tl.load(x2 + xo, mask=xm, other=0)[:, None], [BM, BN, NB, 4]), 0, EMU)
            a2 = _dp4a(wb4, tl.broadcast_to(tl.load(x2 + xo + 4, mask=xm, other=0)[:, None], [BM, BN, NB, 4]), a2, EMU)
            dot = tl.sum((a1 << 8) + a2, axis=3)                                           # [BM, BN, NB]
            xbm = xv[:, None] & bm[None, :]                                                # [BM, NB]
            if QT == 0:
                dot += tl.load(xcr + b[None, :], mask=xbm, other=0)[:, None, :]
            dw = tl.load((rows + nblk * QB).to(tl.pointer_type(tl.float16)) + b[None, :], mask=m2, other=0)
            acc += dot.to(tl.float32) * dw.to(tl.float32)[None] * \
                tl.load(xsr + b[None, :], mask=xbm, other=0)[:, None, :]
        return tl.sum(acc, axis=2)

    @triton.jit
    def _gate_up8_kernel(q1, q2, xs, xc, pairs, blk_e, n_pairs, graw, uraw, out, K, F, k_used, sge, sgn, sue, sun,
                         QT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                         EMU: tl.constexpr):
        blk = tl.program_id(0)                         # (block of one expert's pairs, column tile)
        e = tl.load(blk_e + blk)
        if e >= 0:                                     # blocks past the routed pairs are -1
            pair = tl.load(pairs + blk * BM + tl.arange(0, BM))
            valid = pair < n_pairs
            t = tl.where(valid, pair // k_used, 0)
            n = tl.program_id(1) * BN + tl.arange(0, BN)
            nm = n < F
            e64 = e.to(tl.int64)
            g = _qdot8_rows(graw + e64 * sge, sgn, n, nm, q1, q2, xs, xc, t, valid, K, QT, BM, BN, NB, EMU)
            u = _qdot8_rows(uraw + e64 * sue, sun, n, nm, q1, q2, xs, xc, t, valid, K, QT, BM, BN, NB, EMU)
            tl.store(out + pair.to(tl.int64)[:, None] * F + n[None, :], g / (1.0 + tl.exp(-g)) * u,
                     mask=valid[:, None] & nm[None, :])

    @triton.jit
    def _down8_kernel(q1, q2, xs, xc, pairs, blk_e, n_pairs, wts, draw, out, K, N, sde, sdn,
                      QT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, EMU: tl.constexpr):
        blk = tl.program_id(0)                         # the block's pairs' weighted down rows
        e = tl.load(blk_e + blk)
        if e >= 0:
            pair = tl.load(pairs + blk * BM + tl.arange(0, BM))
            valid = pair < n_pairs
            p = tl.where(valid, pair, 0)
            n = tl.program_id(1) * BN + tl.arange(0, BN)
            nm = n < N
            y = _qdot8_rows(draw + e.to(tl.int64) * sde, sdn, n, nm, q1, q2, xs, xc, p, valid, K, QT, BM, BN, NB,
                            EMU)
            w = tl.load(wts + p, mask=valid, other=0).to(tl.float32)
            tl.store(out + p.to(tl.int64)[:, None] * N + n[None, :], w[:, None] * y,
                     mask=valid[:, None] & nm[None, :])

    @triton.jit
    def _gate_up_kernel(x, pairs, blk_e, n_pairs, graw, uraw, out, K, F, k_used, sge, sgn, sue, sun, bg, bu, alpha,
                        limit, QT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                        OAI: tl.constexpr):
        """GGUF rows: the block's pairs one after another, the weights from HBM for the first (L1/L2 after). OAI:
        gpt-oss's experts, biases bg, bu [E, F] added and the clamped SwiGLU (gpu_decode._moe_gate_up_kernel's)."""
        blk = tl.program_id(0)
        e = tl.load(blk_e + blk)
        if e >= 0:
            n = tl.program_id(1) * BN + tl.arange(0, BN)
            nm = n < F
            gp = graw + e.to(tl.int64) * sge
            up = uraw + e.to(tl.int64) * sue
            for r in range(BM):
                s = tl.load(pairs + blk * BM + r)
                if s < n_pairs:
                    xp = x + (s // k_used).to(tl.int64) * K
                    g = _qdot(gp, sgn, n, nm, xp, K, QT, BN, NB)
                    u = _qdot(up, sun, n, nm, xp, K, QT, BN, NB)
                    if OAI:
                        e64 = e.to(tl.int64)
                        g = tl.minimum(g + tl.load(bg + e64 * F + n, mask=nm, other=0), limit)
                        u = tl.minimum(tl.maximum(u + tl.load(bu + e64 * F + n, mask=nm, other=0), -limit), limit)
                        a = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
                    else:
                        a = g / (1.0 + tl.exp(-g)) * u
                    tl.store(out + s.to(tl.int64) * F + n, a, mask=nm)

    @triton.jit
    def _down_kernel(h, pairs, blk_e, n_pairs, wts, draw, out, K, N, sde, sdn, bd,
                     QT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, OAI: tl.constexpr):
        blk = tl.program_id(0)
        e = tl.load(blk_e + blk)
        if e >= 0:
            n = tl.program_id(1) * BN + tl.arange(0, BN)
            nm = n < N
            dp = draw + e.to(tl.int64) * sde
            for r in range(BM):
                s = tl.load(pairs + blk * BM + r)
                if s < n_pairs:
                    s64 = s.to(tl.int64)
                    y = _qdot(dp, sdn, n, nm, h + s64 * K, K, QT, BN, NB)
                    if OAI:                        # plus the expert's bias bd [E, N]
                        y += tl.load(bd + e.to(tl.int64) * N + n, mask=nm, other=0)
                    tl.store(out + s64 * N + n, tl.load(wts + s).to(tl.float32) * y, mask=nm)


def available() -> bool:
    return triton is not None


_DISABLED: set = set()                                  # type pairs whose kernels failed to build on this GPU


def supports(gate_qtype, up_qtype, down_qtype) -> bool:
    """The types of gpu_decode.moe (its kernels' dot products are these kernels' too)."""
    return gd.supports(gate_qtype, up_qtype, down_qtype) and (gate_qtype, down_qtype) not in _DISABLED


def disable(gate_qtype, down_qtype, err: Exception):
    """Stop using these kernels for this type pair (they failed here); the caller's fallback takes over."""
    from ..errors import warn_fallback
    _DISABLED.add((gate_qtype, down_qtype))
    warn_fallback(f"the grouped decode MoE kernel for {GGMLType(gate_qtype).name}/{GGMLType(down_qtype).name}",
                  err, "dequantizing the experts first")


def block_rows(n_pairs: int, n_expert: int) -> int:
    """Pairs per block (BM), 2 to 16 (gpu_moe.block_height): an empty row costs a row's dp4a work on split
    rows."""
    return block_height(n_pairs, n_expert, 2, 16)


# (BN, NB, warps) of the split-row kernels for gate/up and down at BM pairs a block: BM x BN x NB x 4 products a
# K step. NB does not change with BM, so a row's sums group alike in every bucket. Not yet measured on a GPU
# (bench_moe_decode.py --grouped-tiles times a grid); the interpreter takes one larger tile (fewer programs).
def grouped_tile(qtype, gate_up: bool, bm: int):
    if _INTERPRET:
        return 16, 8, 4
    return (4, 16, 4 if bm <= 4 else 8) if gate_up else (8, 8, 4 if bm <= 4 else 8)


def moe(x, ids, wts, graw, uraw, draw, gate_qtype, down_qtype, reduce: bool = True, gate_split: bool = False,
        down_split: bool = False, bm: int | None = None, tiles8=None, xq=None, out=None, oai=None):
    """Routed experts for a batch of decode tokens from GGUF bytes, each expert's bytes read once per block of
    its pairs: x [T, H] float32, ids [T, k] (int), wts [T, k]; graw/uraw [E, F, row bytes], draw [E, H, row
    bytes] (split rows where *_split). Returns float32 [T, H]; reduce=False: the k weighted rows per token
    [T * k, H] (into out where given). bm: pairs per block instead of block_rows'; tiles8: (gate/up, down)
    (BN, NB, warps) of the split-row kernels instead of grouped_tile's; xq: x already in int8 terms. oai =
    (bg, bu, bd, alpha, limit): gpt-oss's experts (GGUF rows), as gpu_decode.moe takes them."""
    T, H = x.shape
    k = ids.shape[1]
    E, F = graw.shape[0], graw.shape[1]
    n = T * k
    bm = bm or block_rows(n, E)
    x = x.float().contiguous()
    wf = wts.reshape(-1).float().contiguous()
    h = torch.empty(n, F, dtype=torch.float32, device=x.device)
    if out is None:
        out = torch.empty(n, H, dtype=torch.float32, device=x.device)
    tiles8 = tiles8 or (grouped_tile(gate_qtype, True, bm), grouped_tile(down_qtype, False, bm))
    bg, bu, bd, alpha, limit = gd.oai_args(oai, gate_split or down_split, h)
    with on_device(x):
        pairs, blk_e = align(ids, E, bm)
        nb = blk_e.numel()
        gs = (graw.stride(0), graw.stride(1), uraw.stride(0), uraw.stride(1))
        if gate_split:
            bn, nbk, w = tiles8[0]
            _gate_up8_kernel[(nb, triton.cdiv(F, bn))](*(xq or gd.quant_x8(x)), pairs, blk_e, n, graw, uraw, h, H,
                                                      F, k, *gs, QT=QTYPES[gate_qtype], BM=bm, BN=bn, NB=nbk,
                                                      EMU=_INTERPRET, num_warps=w)
        else:
            bn, nbk, w = gd.moe_tile(gate_qtype, True)
            _gate_up_kernel[(nb, triton.cdiv(F, bn))](x, pairs, blk_e, n, graw, uraw, h, H, F, k, *gs, bg, bu,
                                                     float(alpha), float(limit), QT=QTYPES[gate_qtype], BM=bm, BN=bn,
                                                     NB=nbk, OAI=oai is not None, num_warps=w)
        ds = (draw.stride(0), draw.stride(1))
        if down_split:
            bn, nbk, w = tiles8[1]
            _down8_kernel[(nb, triton.cdiv(H, bn))](*gd.quant_x8(h), pairs, blk_e, n, wf, draw, out, F, H, *ds,
                                                   QT=QTYPES[down_qtype], BM=bm, BN=bn, NB=nbk, EMU=_INTERPRET,
                                                   num_warps=w)
        else:
            bn, nbk, w = gd.moe_tile(down_qtype, False)
            _down_kernel[(nb, triton.cdiv(H, bn))](h, pairs, blk_e, n, wf, draw, out, F, H, *ds, bd,
                                                  QT=QTYPES[down_qtype], BM=bm, BN=bn, NB=nbk, OAI=oai is not None,
                                                  num_warps=w)
    return out.view(T, k, H).sum(1) if reduce else out
