"""kernels/gpu_dequant.py's one-pass kernels for the types of the files users run (Q2_K, Q3_K, IQ4_NL, IQ4_XS,
MXFP4, IQ4_K, IQ5_K, IQ4_KS, IQ5_KS, IQ2_KT, IQ3_KT, IQ4_KT) against the reference dequantizer (quant/dequant.py), on
whole tensors and on selected experts.

They run on a GPU (bf16 equal to the reference's float32 rounded to nearest) or on the CPU in Triton's
interpreter (`TRITON_INTERPRET=1 python -m pytest tests/test_gpu_dequant_types.py`, with triton installed),
whose float32 -> bf16 conversion truncates: there the kernel's bf16 equals the reference truncated, which
also shows the float32 values are the same bits. Skipped otherwise (CI has neither)."""

import pytest
import torch
from conftest import triton_test_device

from hybridmoe.quant.dequant import dequantize
from hybridmoe.quant.random_blocks import random_tensor
from hybridmoe.quant.types import GGMLType as T

gdq = pytest.importorskip("hybridmoe.kernels.gpu_dequant")
if gdq.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)
DEV = triton_test_device()

TYPES = [T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.IQ4_K, T.IQ5_K, T.IQ4_KS, T.IQ5_KS, T.IQ2_KT, T.IQ3_KT, T.IQ4_KT]
SHAPES = [(1, 256), (3, 7, 512), (129, 256), (4, 32, 768)] + ([(5, 768, 2048)] if DEV == "cuda" else [])


def _as_kernel_rounds(x: torch.Tensor) -> torch.Tensor:
    """float32 reference -> the bf16 values the kernel writes on this device."""
    if DEV == "cuda":
        return x.to(torch.bfloat16)
    return (x.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_equals_reference(qtype, shape):
    assert gdq.has_kernel(qtype)
    raw = random_tensor(qtype, shape, torch.Generator().manual_seed(len(shape) + shape[-1])).to(DEV)
    got = gdq.dequantize_bf16(raw, qtype, shape[-1])
    want = _as_kernel_rounds(dequantize(raw, qtype, shape[-1]))
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_selected_experts(qtype):
    E, F, H = 6, 32, 512
    raw = random_tensor(qtype, (E, F, H), torch.Generator().manual_seed(9)).to(DEV)
    index = torch.tensor([4, 0, 4, 5], device=DEV)
    got = gdq.dequantize_bf16(raw, qtype, H, index=index)
    assert torch.equal(got, gdq.dequantize_bf16(raw, qtype, H)[index])


def test_zero_and_extreme_scales():
    # a zero row header, and fp16 scales at the top of their range, stay exact
    raw = random_tensor(T.IQ4_KS, (8, 256), torch.Generator().manual_seed(2))
    raw[0, :4] = 0
    raw[1, :4] = torch.tensor([3e38], dtype=torch.float32).view(torch.uint8)
    q3 = random_tensor(T.Q3_K, (8, 256), torch.Generator().manual_seed(3))
    q3[:, 108:110] = torch.tensor([6.5e4], dtype=torch.float16).view(torch.uint8)
    # MXFP4 exponents at both ends: 0 and 1 give denormal scales (on a GPU only: the interpreter's float32 ->
    # bf16 conversion garbles denormals), 254 and 255 the largest
    mx = random_tensor(T.MXFP4, (8, 256), torch.Generator().manual_seed(4))
    mx[:, 0:17 * 5:17] = torch.tensor([0 if DEV == "cuda" else 2, 1 if DEV == "cuda" else 3, 2, 254, 255],
                                      dtype=torch.uint8)
    for qtype, r in ((T.IQ4_KS, raw), (T.Q3_K, q3), (T.MXFP4, mx)):
        r = r.to(DEV)
        got = gdq.dequantize_bf16(r, qtype, 256)
        assert torch.equal(got, _as_kernel_rounds(dequantize(r, qtype, 256)))


@pytest.mark.parametrize("qtype", [T.IQ4_KS_R4, T.IQ4_K_R4, T.Q4_K_R4, T.IQ4_XS_R8, T.Q4_0_R8, T.IQ5_KS_R4, T.MXFP4_R8],
                         ids=lambda t: t.name)
def test_interleaved_through_the_base_kernel(qtype):
    # _R4 / _R8 rows are deinterleaved (torch) and then dequantized by their base type's kernel
    raw = random_tensor(qtype, (3, 16, 512), torch.Generator().manual_seed(5)).to(DEV)
    got = gdq.dequantize_bf16(raw, qtype, 512)
    assert torch.equal(got, _as_kernel_rounds(dequantize(raw, qtype, 512)))
    index = torch.tensor([2, 0], device=DEV)
    assert torch.equal(gdq.dequantize_bf16(raw, qtype, 512, index=index), got[index])
