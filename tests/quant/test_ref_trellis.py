"""hybridmoe.quant.ref_trellis against ik_llama.cpp's own dequantization (bit-exact).

Two sources of ground truth:
- shared/testdata/quant-vectors/IQ*_KT.npz (256-column rows). Their raw0/raw1 arrays hold 16 x the gguf
  package's row size, which leaves out the 4-byte per-row float header, so they cover only the first
  14 (IQ1_KT) or 15 rows completely; those rows are compared.
- tests/quant/data/ik_trellis_vectors.npz: 8 rows of 512 columns (two 256-blocks per row), quantized
  and dequantized by ik_llama.cpp (commit 8337e4c) built from source; stored as the raw rows plus the
  SHA-256 of ggml's float32 output.
"""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridmoe.quant.ref_trellis import DEQUANTIZERS, row_bytes, trellis_values

VECTORS = Path(__file__).resolve().parents[3] / "shared/testdata/quant-vectors"
LOCAL = Path(__file__).resolve().parent / "data/ik_trellis_vectors.npz"
TYPES = ["IQ1_KT", "IQ2_KT", "IQ3_KT", "IQ4_KT"]


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("which", [0, 1])
def test_shared_vectors(name, which):
    path = VECTORS / f"{name}.npz"
    if not path.exists():
        pytest.skip(f"no test vectors at {path}")
    z = np.load(path)
    raw, deq = z[f"raw{which}"], z[f"deq{which}"]
    rb = row_bytes(name, 256)
    n = raw.size // rb
    assert n >= 14
    got = DEQUANTIZERS[name](torch.from_numpy(raw[:n * rb].reshape(n, rb).copy()), 256)
    assert got.dtype == torch.float32 and got.shape == (n, 256)
    assert torch.equal(got, torch.from_numpy(deq[:n].copy()))


@pytest.mark.parametrize("name", TYPES)
def test_multi_block_rows(name):
    z = np.load(LOCAL)
    meta = json.loads(str(z["meta"]))[name]
    n_cols = meta["n_cols"]
    raw = torch.from_numpy(z[name].copy())
    assert raw.shape[1] == meta["row_bytes"] == row_bytes(name, n_cols)
    got = DEQUANTIZERS[name](raw, n_cols)
    assert got.shape == (raw.shape[0], n_cols)
    assert got.abs().max().item() == meta["deq_absmax"]
    assert hashlib.sha256(got.numpy().astype("<f4").tobytes()).hexdigest() == meta["deq_sha256"]


def test_generator_matches_uint32_arithmetic():
    # every 16-bit index (and IQ4_KT's second offset), against numpy's native wrapping uint32 math
    idx = torch.arange(1 << 16)
    for offset, group in ((4096, 8), (4096 + 32768, 4)):
        x = idx.numpy().astype(np.uint32) + np.uint32(offset)
        want = []
        for _ in range(group):
            x = x * np.uint32(0xCBAC1FED)
            s = x & np.uint32(0x3F3F3F3F)
            want.append((s & 255) + ((s >> 8) & 255) + ((s >> 16) & 255) + (s >> 24))
        want = torch.from_numpy(np.stack(want, -1).astype(np.int64)) - 126
        assert torch.equal(trellis_values(idx, group, offset), want)


def test_rows_are_independent_and_shapes_checked():
    z = np.load(LOCAL)
    raw = torch.from_numpy(z["IQ2_KT"].copy())
    full = DEQUANTIZERS["IQ2_KT"](raw, 512)
    assert torch.equal(DEQUANTIZERS["IQ2_KT"](raw[3:5], 512), full[3:5])
    with pytest.raises(ValueError):
        DEQUANTIZERS["IQ2_KT"](raw[:, :-4], 512)
