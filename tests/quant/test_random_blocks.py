"""quant/random_blocks.py: valid random rows of every type quant/dequant.py reads."""
import pytest
import torch

from hybridmoe.quant.dequant import SUPPORTED, dequantize
from hybridmoe.quant.random_blocks import random_blocks, random_tensor
from hybridmoe.quant.types import GGMLType, block_size, interleave, row_bytes

# MXFP4's scales are powers of two: its RMS lands within a step of the asked one
TOL = {GGMLType.MXFP4: 1.42, GGMLType.MXFP4_R8: 1.42}


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
@pytest.mark.parametrize("scale", [0.02, 0.05])
def test_finite_values_of_the_asked_magnitude(qtype, scale):
    n_rows, n_cols = 32, 512
    raw = random_blocks(qtype, n_rows, n_cols, torch.Generator().manual_seed(3), scale=scale)
    assert raw.dtype == torch.uint8 and raw.shape == (n_rows, row_bytes(qtype, n_cols))
    x = dequantize(raw, qtype, n_cols).double()
    assert torch.isfinite(x).all()
    tol = TOL.get(qtype, 1.1)
    rms = x.pow(2).mean().sqrt().item()
    assert scale / tol < rms < scale * tol, rms
    assert abs(x.mean().item()) < 0.4 * scale
    # every row alike: a float field left random (a wrong offset) makes some rows 1e3x off or inf
    row = x.pow(2).mean(-1).sqrt()
    assert row.min() > 0.3 * row.median() and row.max() < 3.0 * row.median()


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_deterministic_given_the_generator(qtype):
    a = random_blocks(qtype, 16, 256, torch.Generator().manual_seed(11))
    b = random_blocks(qtype, 16, 256, torch.Generator().manual_seed(11))
    c = random_blocks(qtype, 16, 256, torch.Generator().manual_seed(12))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_a_single_block_dequantizes(qtype):
    """One block alone (a one-row embedding lookup of a 256-wide model): its fields would be views at odd byte
    offsets; the values are the block's in a larger tensor."""
    n, k = block_size(qtype), interleave(qtype)
    if n == 1 or qtype == GGMLType.IQ1_S_R4:          # rows of these are wider than one block
        pytest.skip(f"{qtype.name}: a row is never one block")
    raw = random_blocks(qtype, 2 * k, n, torch.Generator().manual_seed(5))
    both = dequantize(raw, qtype, n)
    assert torch.equal(dequantize(raw[:k].clone(), qtype, n), both[:k])


def test_large_tensors_calibrate_on_a_sample():
    # 4096 rows: the factor comes from the first rows only, and holds for the rest
    raw = random_blocks(GGMLType.IQ4_KS, 4096, 256, torch.Generator().manual_seed(0), scale=0.03)
    x = dequantize(raw[2048:], GGMLType.IQ4_KS, 256)
    assert 0.027 < x.pow(2).mean().sqrt().item() < 0.033


def test_shapes_and_errors():
    g = torch.Generator().manual_seed(0)
    t = random_tensor(GGMLType.IQ2_KT, (3, 8, 512), g)
    assert t.shape == (3, 8, row_bytes(GGMLType.IQ2_KT, 512))
    with pytest.raises(ValueError, match="multiple of 4"):
        random_blocks(GGMLType.IQ4_KS_R4, 6, 256, g)
    assert interleave(GGMLType.IQ4_KS_R4) == 4
    with pytest.raises(ValueError, match="multiple of 256"):
        random_blocks(GGMLType.Q3_K, 4, 300, g)
    with pytest.raises(NotImplementedError, match="Q8_1"):
        random_blocks(GGMLType.Q8_1, 4, 256, g)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("qtype", [GGMLType.IQ4_KS, GGMLType.Q3_K, GGMLType.IQ2_KT, GGMLType.IQ4_XS],
                         ids=lambda t: t.name)
def test_on_a_cuda_generator(qtype):
    raw = random_blocks(qtype, 16, 512, torch.Generator(device="cuda").manual_seed(1), scale=0.03)
    assert raw.is_cuda
    x = dequantize(raw, qtype, 512)
    assert torch.isfinite(x).all() and 0.027 < x.pow(2).mean().sqrt().item() < 0.033
