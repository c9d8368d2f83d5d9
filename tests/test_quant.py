"""hybridmoe.quant.ref vs gguf.quants (the python port of ggml's reference code)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants as gq

from hybridmoe.quant.ref import (
    REF_TYPES,
    can_split,
    dequantize,
    join_rows,
    quantize,
    random_blocks,
    split_rows,
)
from hybridmoe.quant.types import GGMLType, row_bytes

T = GGMLType
SHAPES = [(1, 256), (7, 512), (3, 5, 768), (4, 6, 1024)]  # last: [E, rows, cols]
# byte offsets of the fp16 scale fields in one block
F16_FIELDS = {
    T.Q8_0: (0,), T.Q4_0: (0,), T.IQ4_NL: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.MXFP4: (),
}
TS = {T.Q8_0: 34, T.Q4_0: 18, T.IQ4_NL: 18, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210, T.MXFP4: 17}


def gguf_dequant(raw: torch.Tensor, qtype) -> torch.Tensor:
    with np.errstate(over="ignore"):  # MXFP4 with exponent byte 255 overflows to inf
        out = gq.dequantize(raw.numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor):
    assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
    assert torch.equal(a, b)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # also the sign of zeros


def finite_random_bytes(qtype, shape, g) -> torch.Tensor:
    """Fully random bytes, with every float field made finite (exponent not all-ones)."""
    rb = row_bytes(qtype, shape[-1])
    raw = torch.randint(0, 256, (*shape[:-1], rb), dtype=torch.uint8, generator=g)
    if qtype in (T.F32, T.BF16):  # top byte of each element: clear one exponent bit when it's all-ones
        w = 4 if qtype == T.F32 else 2
        v = raw.view(-1, w)
        nonfinite = ((v[:, -1] & 0x7F) == 0x7F) & (v[:, -2] >= 0x80)
        v[:, -1] = torch.where(nonfinite, v[:, -1] & 0xBF, v[:, -1])
        return raw
    offsets = (0,) if qtype == T.F16 else F16_FIELDS[qtype]
    v = raw.view(-1, 2 if qtype == T.F16 else TS[qtype])
    for off in offsets:
        hi = v[:, off + 1]
        v[:, off + 1] = torch.where((hi & 0x7C) == 0x7C, hi & 0xBF, hi)
    return raw


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", REF_TYPES, ids=lambda t: t.name)
def test_dequant_random_blocks_bit_exact(qtype, shape):
    g = torch.Generator().manual_seed(hash((int(qtype), shape)) % 2**31)
    raw = random_blocks(qtype, shape, g)
    assert raw.dtype == torch.uint8 and raw.shape == (*shape[:-1], row_bytes(qtype, shape[-1]))
    out = dequantize(raw, qtype, shape[-1])
    assert out.shape == shape
    assert_bit_equal(out, gguf_dequant(raw, qtype))


@pytest.mark.parametrize("qtype", REF_TYPES, ids=lambda t: t.name)
def test_dequant_raw_random_bytes_bit_exact(qtype):
    g = torch.Generator().manual_seed(1000 + int(qtype))
    for shape in [(5, 512), (2, 3, 1024)]:
        raw = finite_random_bytes(qtype, shape, g)
        out = dequantize(raw, qtype, shape[-1])
        ref = gguf_dequant(raw, qtype)
        if qtype != T.MXFP4:  # MXFP4 exponent 255 legitimately overflows to inf
            assert torch.isfinite(out).all()
        assert_bit_equal(out, ref)


@pytest.mark.parametrize("qtype", REF_TYPES, ids=lambda t: t.name)
def test_dequant_bf16_output(qtype):
    g = torch.Generator().manual_seed(7)
    raw = random_blocks(qtype, (3, 512), g)
    f32 = dequantize(raw, qtype, 512)
    bf = dequantize(raw, qtype, 512, dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and bf.shape == (3, 512)
    assert torch.equal(bf, f32.to(torch.bfloat16))


def test_dequant_noncontiguous_and_bad_shape():
    g = torch.Generator().manual_seed(3)
    raw = random_blocks(T.Q4_K, (6, 512), g)
    assert_bit_equal(dequantize(raw[::2], T.Q4_K, 512), gguf_dequant(raw[::2].contiguous(), T.Q4_K))
    with pytest.raises(ValueError):
        dequantize(raw[:, :-1], T.Q4_K, 512)
    with pytest.raises(ValueError):
        dequantize(raw, T.Q4_K, 500)


def quant_inputs():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 1024, generator=g)
    x[0] = 0.0                                   # all-zero blocks
    x[1, :32] = 1e-6                             # tiny values (fp16 d underflow)
    x[2] = torch.randint(-8, 9, (1024,), generator=g).float() * 0.25  # exact ties / rounding halves
    x[3] *= 1000.0
    x[4, ::2] = -x[4, 1::2]                      # +-max ties for argmax
    return [x, x.reshape(4, 16, 1024) * 0.01, torch.randn(3, 5, 32, generator=g)]


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0], ids=lambda t: t.name)
def test_quantize_bit_exact(qtype):
    for x in quant_inputs():
        if x.shape[-1] % 32:
            continue
        q = quantize(x, qtype)
        assert q.dtype == torch.uint8 and q.shape == (*x.shape[:-1], row_bytes(qtype, x.shape[-1]))
        ref = np.ascontiguousarray(gq.quantize(x.numpy(), qtype)).view(np.uint8)
        assert np.array_equal(q.numpy(), ref.reshape(q.shape))


def test_quantize_bf16_special_values():
    bits = torch.randint(-2**31, 2**31, (4096,), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32).reshape(4, 1024)  # incl. NaNs, infs, denormals
    ref = gq.quantize(x.numpy(), T.BF16)
    assert np.array_equal(quantize(x, T.BF16).numpy(), ref)


# measured ~0.0173 / 0.0357 / 0.0710 (llama.cpp-like); bounds leave ~10-15% margin
K_BOUNDS = {T.Q6_K: 0.020, T.Q5_K: 0.040, T.Q4_K: 0.080}
OUTLIER_TOL = {T.Q6_K: 0.4, T.Q5_K: 0.5, T.Q4_K: 1.0}


@pytest.mark.parametrize("qtype", list(K_BOUNDS), ids=lambda t: t.name)
def test_k_quant_round_trip(qtype):
    g = torch.Generator().manual_seed(21)
    n = 1024
    for x in [torch.randn(256, n, generator=g),
              torch.randn(8, 32, n, generator=g) * torch.rand(8, 32, 1, generator=g) * 0.05]:
        q = quantize(x, qtype)
        assert q.shape == (*x.shape[:-1], row_bytes(qtype, n))
        y = dequantize(q, qtype, n)
        assert_bit_equal(y, gguf_dequant(q, qtype))  # our packing is valid ggml layout
        rel = ((y - x).norm() / x.norm()).item()
        assert rel < K_BOUNDS[qtype], (qtype.name, rel)
    # all-zero input stays exactly zero, outliers survive
    z = torch.zeros(2, 256)
    assert torch.equal(dequantize(quantize(z, qtype), qtype, 256), z)
    x = torch.randn(4, 256, generator=g)
    x[:, 7] = 20.0
    y = dequantize(quantize(x, qtype), qtype, 256)
    # within about half a quantization step of a 32-group spanning [-3, 20]
    assert torch.isfinite(y).all() and (y[:, 7] - 20.0).abs().max() < OUTLIER_TOL[qtype]


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q8_0])
def test_split_rows_keep_the_bytes(qtype):
    """The split row layout (GPU-resident experts): quants first as 16-byte-aligned runs, then the scales;
    join_rows restores the GGUF rows, and a QTensor marked split dequantizes to the same values."""
    from hybridmoe.devices import Device
    from hybridmoe.runtime.weights import QTensor
    g = torch.Generator().manual_seed(int(qtype))
    raw = random_blocks(qtype, (3, 4, 512), g)
    s = split_rows(raw, qtype)
    bs = 18 if qtype == GGMLType.Q4_0 else 34
    assert s.shape == raw.shape and s.dtype == torch.uint8
    assert torch.equal(s[..., :bs - 2], raw[..., 2:bs])                  # block 0's quants lead the row
    assert torch.equal(s[..., -2:], raw[..., -bs:-bs + 2])               # the last block's scale ends it
    assert torch.equal(join_rows(s, qtype), raw)
    assert torch.equal(join_rows(s[1], qtype), raw[1])
    cpu = Device("CPU", "cpu", 0, 1 << 30, 1 << 30, torch.device("cpu"))
    qs = QTensor("blk.0.ffn_up_exps.weight", s, qtype, (3, 4, 512), cpu, split=True)
    assert torch.equal(qs.dequant(), dequantize(raw, qtype, 512))
    assert torch.equal(qs.dequant(index=torch.tensor([2, 0])), dequantize(raw[[2, 0]], qtype, 512))
    assert can_split(qtype, 512) and not can_split(qtype, 160) and not can_split(GGMLType.Q4_K, 512)


def test_quantize_rejects_bad_row_length():
    with pytest.raises(ValueError):
        quantize(torch.randn(2, 100), T.Q4_K)


@pytest.mark.parametrize("qtype", REF_TYPES, ids=lambda t: t.name)
def test_random_blocks_stats(qtype):
    scale = 0.02
    shape = (16, 64, 512)
    raw = random_blocks(qtype, shape, torch.Generator().manual_seed(99), scale=scale)
    again = random_blocks(qtype, shape, torch.Generator().manual_seed(99), scale=scale)
    assert torch.equal(raw, again)  # deterministic per seed
    x = dequantize(raw, qtype, shape[-1])
    assert torch.isfinite(x).all()
    std, mean = x.std().item(), x.mean().item()
    assert 0.75 * scale < std < 1.33 * scale, std
    assert abs(mean) < 0.15 * scale, mean
    # every 32-element group has non-zero values (block scales are never zero)
    assert (x.reshape(-1, 32).abs().amax(-1) > 0).all()
    # 10x scale -> ~10x std
    big = dequantize(random_blocks(qtype, (4, 512), torch.Generator().manual_seed(1), scale=0.2), qtype, 512)
    assert 0.1 < big.std().item() < 0.3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("qtype", REF_TYPES, ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype):
    g = torch.Generator(device="cuda").manual_seed(5)
    raw = random_blocks(qtype, (4, 8, 512), g)
    assert raw.is_cuda
    out = dequantize(raw, qtype, 512)
    assert out.is_cuda
    assert_bit_equal(out.cpu(), dequantize(raw.cpu(), qtype, 512))
    cpu_raw = finite_random_bytes(qtype, (4, 512), torch.Generator().manual_seed(6))
    assert_bit_equal(dequantize(cpu_raw.cuda(), qtype, 512).cpu(), dequantize(cpu_raw, qtype, 512))
    if qtype in (T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K):
        x = torch.randn(8, 512)
        qc = quantize(x.cuda(), qtype).cpu()
        if qtype in (T.F16, T.BF16, T.Q8_0, T.Q4_0):
            assert torch.equal(qc, quantize(x, qtype))
        else:  # K-quant search may differ in last-ulp sums; check quality only
            y = dequantize(qc, qtype, 512)
            assert ((y - x).norm() / x.norm()).item() < K_BOUNDS[qtype]

