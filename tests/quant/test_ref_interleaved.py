"""hybridmoe.quant.ref_interleaved: ik_llama.cpp's _R4 / _R8 / _R16 row-interleaved layouts.

Ground truth, bit-exact:
- shared/testdata/quant-vectors/*_R4.npz / *_R8.npz (16 rows of 256 columns; for IQ4_KS_R4, whose rows
  carry a float header that the stored byte count leaves out, the first 3 complete groups of 4 rows);
- tests/quant/data/ik_interleaved_vectors.npz: every interleaved type that ik_llama.cpp's quantizer
  writes (except BF16_R16), 8 rows of 512 columns quantized by ik_llama.cpp (commit 8337e4c, built
  from source, with an importance matrix so IQ1_S_R4 .. IQ2_S_R4 exist too), stored as raw rows plus
  the SHA-256 of ggml's float32 to_float output. ik's dequantize_row_mxfp4_r8 overruns its buffers
  (it loops over 8x the blocks); the MXFP4_R8 reference was made with that loop bound fixed.
Plus random-byte round trips: interleave(deinterleave(x)) == x, deinterleave(interleave(b)) == b, and
dequantize(interleave(b)) == the base type's dequantization of b.
"""
import hashlib
import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridmoe.quant import ref_interleaved as ri

VECTORS = Path(__file__).resolve().parents[3] / "shared/testdata/quant-vectors"
LOCAL = Path(__file__).resolve().parent / "data/ik_interleaved_vectors.npz"
SHARED = ["Q4_0_R8", "Q8_0_R8", "Q4_K_R4", "Q6_K_R4", "Q8_K_R8", "IQ4_XS_R8", "IQ4_NL_R4", "IQ3_XXS_R4",
          "IQ2_K_R4", "IQ3_K_R4", "IQ4_K_R4", "IQ5_K_R4", "IQ4_KS_R4"]
# base types whose (de)interleave loses nothing, so random base bytes round-trip exactly
LOSSLESS = [k for k, v in ri.LAYOUTS.items() if v.base and not v.from_base]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exactly equal floats, NaN matching NaN (random bytes make some scales NaN or inf)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _rand(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("name", SHARED)
@pytest.mark.parametrize("which", [0, 1])
def test_shared_vectors(name, which):
    path = VECTORS / f"{name}.npz"
    if not path.exists():
        pytest.skip(f"no test vectors at {path}")
    z = np.load(path)
    raw, deq = z[f"raw{which}"], z[f"deq{which}"]
    rb, R = ri.row_bytes(name, 256), ri.LAYOUTS[name].rows
    n = raw.size // (rb * R) * R
    assert n >= 12
    got = ri.DEQUANTIZERS[name](torch.from_numpy(raw[:n * rb].reshape(n, rb).copy()), 256)
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(deq[:n].copy()))


def _local():
    z = np.load(LOCAL)
    return z, json.loads(str(z["meta"]))


@pytest.mark.parametrize("name", sorted(_local()[1]))
def test_ik_vectors(name):
    z, meta = _local()
    m = meta[name]
    raw = torch.from_numpy(z[name].copy())
    assert raw.shape[1] == m["row_bytes"] == ri.row_bytes(name, m["n_cols"])
    got = ri.DEQUANTIZERS[name](raw, m["n_cols"])
    assert got.dtype == torch.float32 and got.shape == (raw.shape[0], m["n_cols"])
    assert got.abs().max().item() == m["deq_absmax"]
    assert hashlib.sha256(got.numpy().astype("<f4").tobytes()).hexdigest() == m["deq_sha256"]
    if name in ri.DEINTERLEAVE:     # the base route gives the same floats and the same bytes back
        base_name, deinterleave = ri.DEINTERLEAVE[name]
        base = deinterleave(raw, m["n_cols"])
        assert torch.equal(ri.INTERLEAVE[name](base, m["n_cols"]), raw)
        try:
            via_base = ri._base_dequantizer(base_name)(base, m["n_cols"])
        except NotImplementedError:
            return
        assert torch.equal(via_base, got)


def test_every_layout_is_covered():
    assert set(_local()[1]) == set(ri.LAYOUTS) - {"BF16_R16"}
    assert set(SHARED) <= set(ri.LAYOUTS)


@pytest.mark.parametrize("name", sorted(ri.LAYOUTS))
def test_random_interleaved_bytes_round_trip(name):
    lay = ri.LAYOUTS[name]
    n_cols = 512
    raw = _rand((2 * lay.rows, ri.row_bytes(name, n_cols)), zlib.crc32(name.encode()))
    if name == "Q8_K_R8":       # fp16 scales: keep them finite (f16 sNaN -> f32 -> f16 is not the identity)
        raw.view(-1, 2064)[:, 1:16:2] &= 0x3F
    if name in ri.DEINTERLEAVE:
        base = ri.DEINTERLEAVE[name][1](raw, n_cols)
        assert torch.equal(ri.INTERLEAVE[name](base, n_cols), raw)
        try:
            want = ri._base_dequantizer(lay.base)(base, n_cols)
        except NotImplementedError:
            return
        assert _same(ri.DEQUANTIZERS[name](raw, n_cols), want)


@pytest.mark.parametrize("name", LOSSLESS)
def test_random_base_blocks(name):
    lay = ri.LAYOUTS[name]
    n_cols = 512
    n_rows = 2 * lay.rows
    base = _rand((n_rows, ri.row_bytes(name, n_cols)), 7 + zlib.crc32(name.encode()))
    il = ri.INTERLEAVE[name](base, n_cols)
    assert il.shape == base.shape and torch.equal(ri.DEINTERLEAVE[name][1](il, n_cols), base)
    try:
        want = ri._base_dequantizer(lay.base)(base, n_cols)
    except NotImplementedError:
        pytest.skip(f"no base dequantizer for {lay.base}")
    assert _same(ri.DEQUANTIZERS[name](il, n_cols), want)


def test_bf16_r16_layout():
    # repack_bf16: value (row k, column 2 i + j) of a 16-row group is bf16 number 32 i + 2 k + j
    x = torch.randn(32, 64).to(torch.bfloat16)
    il = x.view(2, 16, 32, 2).permute(0, 2, 1, 3).reshape(32, 64)
    raw = il.contiguous().view(torch.uint8)
    assert torch.equal(ri.DEQUANTIZERS["BF16_R16"](raw, 64), x.float())
    assert torch.equal(ri.INTERLEAVE["BF16_R16"](x.view(torch.uint8), 64), raw)


def test_iq1_s_r4_to_iq1_s():
    z, _ = _local()
    raw = torch.from_numpy(z["IQ1_S_R4"].copy())
    base = ri.DEINTERLEAVE["IQ1_S_R4"][1](raw, 512)
    assert base.shape == (8, 2 * 50)        # IQ1_S: 50 bytes per 256, the row scale in each block
    with pytest.raises(ValueError):
        ri.DEINTERLEAVE["IQ1_S_R4"][1](raw[:, :2 + 3 * 6], 96)
    bad = base.clone()
    bad[0, 50] ^= 1                         # IQ1_S rows whose blocks differ in d cannot be interleaved
    with pytest.raises(ValueError):
        ri.INTERLEAVE["IQ1_S_R4"](bad, 512)


def test_q8_k_r8_base_rows():
    z, _ = _local()
    raw = torch.from_numpy(z["Q8_K_R8"].copy())
    base = ri.DEINTERLEAVE["Q8_K_R8"][1](raw, 512).view(8, 2, 292)
    q = base[..., 4:260].contiguous().view(torch.int8).long()
    bsums = base[..., 260:].contiguous().view(torch.int16).long()
    assert torch.equal(bsums, q.view(8, 2, 16, 16).sum(-1))


def test_shapes_checked():
    raw = _rand((6, ri.row_bytes("Q4_K_R4", 256)), 0)
    with pytest.raises(ValueError):         # 6 rows: not whole groups of 4
        ri.DEQUANTIZERS["Q4_K_R4"](raw, 256)
    with pytest.raises(ValueError):
        ri.DEQUANTIZERS["Q4_K_R4"](raw[:4, :-1], 256)
