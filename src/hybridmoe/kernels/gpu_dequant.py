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
    def _q4_0_kernel(src, dst, n_blocks, BB: tl.constexpr):
        pid = tl.program_id(0)
        b = pid * BB + tl.arange(0, BB)                                    # block ids [BB]
        bm = b < n_blocks
        base = b.to(tl.int64) * 18
        lo = tl.load(src + base, mask=bm, other=0).to(tl.uint16)
        hi = tl.load(src + base + 1, mask=bm, other=0).to(tl.uint16)
        d = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)   # [BB]
        e = tl.arange(0, 32)                                               # element in block
        byte = tl.load(src + base[:, None] + 2 + (e[None, :] % 16), mask=bm[:, None], other=0)
        q = ((byte >> ((e[None, :] // 16) * 4).to(tl.uint8)) & 15).to(tl.int32) - 8
        val = d[:, None] * q.to(tl.float32)
        tl.store(dst + b.to(tl.int64)[:, None] * 32 + e[None, :], val.to(tl.bfloat16), mask=bm[:, None])

    @triton.jit
    def _q8_0_kernel(src, dst, n_blocks, BB: tl.constexpr):
        pid = tl.program_id(0)
        b = pid * BB + tl.arange(0, BB)
        bm = b < n_blocks
        base = b.to(tl.int64) * 34
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


def dequantize_bf16(raw: torch.Tensor, qtype, n_cols: int) -> torch.Tensor:
    """uint8 [..., row_bytes] on CUDA -> bf16 [..., n_cols]."""
    kern = _KERNELS.get(qtype) if raw.is_cuda else None
    if kern is None:
        from ..quant.ref import dequantize
        return dequantize(raw, qtype, n_cols, dtype=torch.bfloat16)
    assert raw.shape[-1] == row_bytes(qtype, n_cols)
    raw = raw.contiguous()
    out = torch.empty(*raw.shape[:-1], n_cols, dtype=torch.bfloat16, device=raw.device)
    n_blocks = out.numel() // 32
    if n_blocks:
        kern[(triton.cdiv(n_blocks, BLOCKS_PER_PROGRAM),)](raw, out, n_blocks, BB=BLOCKS_PER_PROGRAM)
    return out
