"""quant/ref_mainline.py: the mainline llama.cpp types' dequantizers are bit-exact with ggml's own
dequantization (ik_llama.cpp's test vectors) and with gguf.quants on random blocks."""
import json
import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hybridmoe.quant.ref_mainline import BLOCKS, DEQUANTIZERS, Q8_K_IK_BYTES

VECTORS = Path(__file__).resolve().parents[3] / "shared/testdata/quant-vectors"

# The types of BLOCKS that have vectors. IQ1_S, IQ2_XXS, IQ2_XS and IQ2_S have none (ik_llama.cpp's
# quantizer refuses them without an importance matrix); Q8_K is not a storage type.
WITH_VECTORS = ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ1_M", "IQ3_XXS", "IQ3_S", "IQ4_XS")

# Byte offsets of each type's f16 scale fields (IQ1_M's d is spread over four nibbles, Q8_K's is f32).
F16_FIELDS = {
    "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
    "IQ1_S": (0,), "IQ1_M": (), "IQ4_XS": (0,), "Q8_K": (),
}


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same float32 bit patterns (stricter than torch.equal: tells -0.0 from 0.0)."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    diff = got.view(torch.int32) != want.view(torch.int32)
    if diff.any():
        i = diff.nonzero()[0].tolist()
        pytest.fail(f"{int(diff.sum())} of {diff.numel()} values differ, first at {i}: "
                    f"{got[tuple(i)].item()!r} != {want[tuple(i)].item()!r}")


def random_rows(name: str, n_rows: int, n_cols: int, seed: int, block_bytes: int | None = None) -> np.ndarray:
    """Random bytes as uint8 [n_rows, row_bytes], with finite scales: f16 of either sign, 1e-7..1
    (fp16 subnormals included) and some zeros."""
    bs, ts = BLOCKS[name]
    ts = block_bytes or ts
    rng = np.random.default_rng(seed)
    nb = n_rows * n_cols // bs
    b = rng.integers(0, 256, (nb, ts), dtype=np.uint8)

    def scales(dtype):
        v = rng.choice([-1.0, 1.0], nb) * 10.0 ** rng.uniform(-7, 0, nb)
        v[rng.random(nb) < 0.03] = 0.0
        return v.astype(dtype).reshape(nb, 1).view(np.uint8)

    for off in F16_FIELDS[name]:
        b[:, off:off + 2] = scales(np.float16)
    if name == "IQ1_M":  # nibble k of d is the top nibble of the k-th u16 of the scales (bytes 48..55)
        d = scales(np.float16).view(np.uint16)[:, 0]
        for k in range(4):
            b[:, 49 + 2 * k] = (b[:, 49 + 2 * k] & 0x0F) | (((d >> (4 * k)) & 0xF) << 4).astype(np.uint8)
    if name == "Q8_K":
        b[:, 0:4] = scales(np.float32)
    return b.reshape(n_rows, -1)


def oracle(name: str, rows: np.ndarray, n_cols: int) -> torch.Tensor:
    if name == "Q8_K":  # not in gguf.quants: x = d * q for each block, d an f32 ahead of the quants
        off = 8 if rows.shape[1] * 256 // n_cols == Q8_K_IK_BYTES else 4
        blk = rows.reshape(-1, rows.shape[1] * 256 // n_cols)
        d = blk[:, :4].copy().view(np.float32)
        out = d * blk[:, off:off + 256].view(np.int8).astype(np.float32)
    else:
        out = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[name])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(rows.shape[0], n_cols))


# ------------------------------------------------------------------ vectors

def _vectors(name: str):
    if not VECTORS.is_dir():
        pytest.skip(f"no test vectors at {VECTORS}")
    return np.load(VECTORS / f"{name}.npz")


def test_vector_coverage():
    if not VECTORS.is_dir():
        pytest.skip(f"no test vectors at {VECTORS}")
    assert sorted(t for t in BLOCKS if (VECTORS / f"{t}.npz").exists()) == sorted(WITH_VECTORS)


@pytest.mark.parametrize("name", WITH_VECTORS)
def test_matches_ggml_vectors(name):
    z = _vectors(name)
    meta = json.loads(str(z["meta"]))
    for i, (tensor, m) in enumerate(meta.items()):
        assert m["type"] == name and m["row_bytes"] == BLOCKS[name][1] * m["ne0"] // BLOCKS[name][0], tensor
        raw = torch.from_numpy(z[f"raw{i}"].reshape(16, m["row_bytes"]))
        want = torch.from_numpy(z[f"deq{i}"])
        assert_bits_equal(DEQUANTIZERS[name](raw, m["ne0"]), want)


# ------------------------------------------------------------ random blocks

@pytest.mark.parametrize("shape", [(3, 768), (32, 1024)])
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_matches_gguf_on_random_blocks(name, shape):
    n_rows, n_cols = shape
    rows = random_rows(name, n_rows, n_cols, seed=zlib.crc32(f"{name} {shape}".encode()))
    got = DEQUANTIZERS[name](torch.from_numpy(rows), n_cols)
    assert_bits_equal(got, oracle(name, rows, n_cols))


def test_q8_k_ik_layout():
    # ik_llama.cpp's block_q8_K has a float `sum` between d and the quants (296 bytes, not 292)
    rows = random_rows("Q8_K", 4, 512, seed=5, block_bytes=Q8_K_IK_BYTES)
    assert rows.shape == (4, 2 * Q8_K_IK_BYTES)
    assert_bits_equal(DEQUANTIZERS["Q8_K"](torch.from_numpy(rows), 512), oracle("Q8_K", rows, 512))


def test_leading_dims_and_errors():
    rows = random_rows("IQ4_XS", 6, 512, seed=1)
    flat = DEQUANTIZERS["IQ4_XS"](torch.from_numpy(rows), 512)
    stacked = DEQUANTIZERS["IQ4_XS"](torch.from_numpy(rows).reshape(2, 3, -1), 512)
    assert stacked.shape == (2, 3, 512) and torch.equal(stacked.reshape(6, 512), flat)
    assert DEQUANTIZERS["Q4_1"](torch.zeros(0, 20, dtype=torch.uint8), 32).shape == (0, 32)
    with pytest.raises(ValueError):
        DEQUANTIZERS["Q3_K"](torch.from_numpy(rows), 512)  # IQ4_XS rows are too wide for Q3_K
    with pytest.raises(ValueError):
        DEQUANTIZERS["Q5_0"](torch.zeros(2, 22, dtype=torch.uint8), 48)
    with pytest.raises(ValueError):
        DEQUANTIZERS["Q5_0"](torch.zeros(2, 22, dtype=torch.int8), 32)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_cuda_matches_cpu(name):
    rows = torch.from_numpy(random_rows(name, 16, 1024, seed=7))
    assert_bits_equal(DEQUANTIZERS[name](rows.cuda(), 1024).cpu(), DEQUANTIZERS[name](rows, 1024))
