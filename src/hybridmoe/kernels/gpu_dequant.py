"""GGUF blocks -> bf16 on the GPU in one pass (Triton), for the expert GEMMs.

The torch reference dequantizer makes several passes over the data; for prompt processing with a whole
layer's experts (hundreds of MB of blocks per layer) that pass count is the cost. One Triton program
per group of blocks reads each byte once and writes bf16 once. Types without a kernel here use
quant/ref.py. Each kernel is checked against the reference (tests/test_gpu_kernels.py).
"""
from __future__ import annotations

import torch

from ..quant.types import GGMLType, row_bytes

try:
    import triton
    import triton.language as tl
except ImportError:                                      # CPU-only installs
    triton = None

BLOCKS_PER_PROGRAM = 64

if triton is not None:
    @triton.jit
    def _src_block(b, idx, bpe, HAS_IDX: tl.constexpr):
        """Output block b -> source block: with an index, slab b // bpe comes from slab idx[b // bpe]."""
        b64 = b.to(tl.int64)
        if HAS_IDX:
            slab = tl.load(idx + b64 // bpe).to(tl.int64)
            return slab * bpe + b64 % bpe
        return b64

    @triton.jit
    def _q4_0_kernel(src, dst, n_blocks, idx, bpe, BB: tl.constexpr, HAS_IDX: tl.constexpr):
        pid = tl.program_id(0)
        b = pid * BB + tl.arange(0, BB)                                    # block ids [BB]
        bm = b < n_blocks
        base = _src_block(tl.where(bm, b, 0), idx, bpe, HAS_IDX) * 18
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
        pid = tl.program_id(0)
        b = pid * BB + tl.arange(0, BB)
        bm = b < n_blocks
        base = _src_block(tl.where(bm, b, 0), idx, bpe, HAS_IDX) * 34
        lo = tl.load(src + base, mask=bm, other=0).to(tl.uint16)
        hi = tl.load(src + base + 1, mask=bm, other=0).to(tl.uint16)
        d = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        e = tl.arange(0, 32)
        q = tl.load(src + base[:, None] + 2 + e[None, :], mask=bm[:, None], other=0).to(tl.int8, bitcast=True)
        val = d[:, None] * q.to(tl.float32)
        tl.store(dst + b.to(tl.int64)[:, None] * 32 + e[None, :], val.to(tl.bfloat16), mask=bm[:, None])

    _KERNELS = {GGMLType.Q4_0: _q4_0_kernel, GGMLType.Q8_0: _q8_0_kernel}
else:
    _KERNELS = {}


def has_kernel(qtype) -> bool:
    return qtype in _KERNELS


def dequantize_bf16(raw: torch.Tensor, qtype, n_cols: int, index: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [..., row_bytes] on CUDA -> bf16 [..., n_cols]; with `index`, the slabs raw[index] only
    ([len(index), ..., n_cols]), gathered inside the kernel (no copy of the selected bytes first)."""
    kern = _KERNELS.get(qtype) if raw.is_cuda else None
    if kern is None:
        from ..quant.ref import dequantize
        return dequantize(raw if index is None else raw.index_select(0, index), qtype, n_cols, dtype=torch.bfloat16)
    assert raw.shape[-1] == row_bytes(qtype, n_cols)
    raw = raw.contiguous()
    lead = raw.shape[:-1] if index is None else (index.numel(), *raw.shape[1:-1])
    out = torch.empty(*lead, n_cols, dtype=torch.bfloat16, device=raw.device)
    n_blocks = out.numel() // 32
    bpe = max(out[0].numel() // 32, 1) if index is not None and out.numel() else 1
    idx = index if index is not None else raw                             # any pointer when unused
    if n_blocks:
        with torch.cuda.device(raw.device):                               # Triton launches on the current GPU
            kern[(triton.cdiv(n_blocks, BLOCKS_PER_PROGRAM),)](raw, out, n_blocks, idx, bpe,
                                                               BB=BLOCKS_PER_PROGRAM, HAS_IDX=index is not None)
    return out
