"""quant/ref_ik.py (ik_llama.cpp's own types) is bit-exact with ik_llama.cpp's to_float, and
quant/ggml_table.py agrees with the test vectors' MANIFEST, the gguf package and real ik GGUF files."""
import json
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hybridmoe.quant.ggml_table import BY_ID, BY_NAME, MAINLINE_ONLY, from_id, row_bytes
from hybridmoe.quant.ref_ik import DEQUANTIZERS

VECTORS = Path(__file__).resolve().parents[3] / "shared/testdata/quant-vectors"
pytestmark = pytest.mark.skipif(not VECTORS.is_dir(), reason=f"no test vectors at {VECTORS}")

TYPES = sorted(DEQUANTIZERS)
HEADER_TYPES = [t for t in TYPES if BY_NAME[t].row_header_bytes]
PLAIN_TYPES = [t for t in TYPES if not BY_NAME[t].row_header_bytes]
WITH_FILE = ("IQ4_KS", "IQ2_KL", "IQ5_KS")  # header types with a whole GGUF in files/


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    diff = got.view(torch.int32) != want.view(torch.int32)
    if diff.any():
        i = diff.nonzero()[0].tolist()
        pytest.fail(f"{int(diff.sum())} of {diff.numel()} values differ, first at {i}: "
                    f"{got[tuple(i)].item()!r} != {want[tuple(i)].item()!r}")


def load(name: str, i: int):
    z = np.load(VECTORS / f"{name}.npz")
    return z[f"raw{i}"], torch.from_numpy(z[f"deq{i}"])


def whole_rows(raw: np.ndarray, name: str, n: int | None = None) -> torch.Tensor:
    """The vectors' raw bytes as rows of the file's true length (header included)."""
    rb = row_bytes(BY_NAME[name], 256)
    n = len(raw) // rb if n is None else n
    return torch.from_numpy(raw[:n * rb].copy()).reshape(n, rb)


# ------------------------------------------------------------------ vectors

@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("i", [0, 1])
def test_vectors(name, i):
    # The vectors hold 16 x MANIFEST row_bytes bytes, and MANIFEST's row_bytes leaves out the per-row
    # header: for header types that is 15 whole rows and part of a 16th.
    raw, deq = load(name, i)
    rows = whole_rows(raw, name)
    assert rows.shape[0] == (15 if name in HEADER_TYPES else 16)
    assert_bits_equal(DEQUANTIZERS[name](rows, 256), deq[:rows.shape[0]])


@pytest.mark.parametrize("name", WITH_FILE)
@pytest.mark.parametrize("i", [0, 1])
def test_vectors_all_rows_from_file(name, i):
    # the full 16 rows, read from the whole GGUF the vectors came from
    raw, deq = load(name, i)
    data = (VECTORS / f"files/q-{name}.gguf").read_bytes()
    at = data.find(raw.tobytes())
    assert at > 0
    rb = row_bytes(BY_NAME[name], 256)
    rows = torch.frombuffer(bytearray(data[at:at + 16 * rb]), dtype=torch.uint8).reshape(16, rb)
    assert_bits_equal(DEQUANTIZERS[name](rows, 256), deq)


@pytest.mark.parametrize("name", PLAIN_TYPES)
def test_multi_block_rows(name):
    raw, deq = load(name, 0)
    rows = whole_rows(raw, name)
    # rows 4k..4k+3 joined into one 1024-column row, with a leading batch dim: [2, 2, 4 super-blocks]
    joined = rows.reshape(2, 2, -1)
    got = DEQUANTIZERS[name](joined, 1024)
    assert_bits_equal(got, deq.reshape(2, 2, 1024))


@pytest.mark.parametrize("name", HEADER_TYPES)
def test_multi_block_rows_with_header(name):
    # one header is shared by all super-blocks of a row: header of row r + blocks of rows r, r, s
    raw, deq = load(name, 1)
    rows = whole_rows(raw, name)
    h = BY_NAME[name].row_header_bytes
    fn = DEQUANTIZERS[name]
    other = rows.roll(1, 0)
    joined = torch.cat([rows, rows[:, h:], other[:, h:]], 1)
    got = fn(joined, 768)
    n = rows.shape[0]
    assert_bits_equal(got[:, :512], torch.cat([deq[:n], deq[:n]], 1))
    assert_bits_equal(got[:, 512:], fn(torch.cat([rows[:, :h], other[:, h:]], 1), 256))


def test_row_length_checked():
    with pytest.raises(ValueError):
        DEQUANTIZERS["IQ4_KS"](torch.zeros(2, 136, dtype=torch.uint8), 256)  # header missing
    with pytest.raises(ValueError):
        DEQUANTIZERS["Q6_0"](torch.zeros(2, 26, dtype=torch.uint8), 48)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("name", TYPES)
def test_cuda_matches_cpu(name):
    raw, _ = load(name, 0)
    rows = whole_rows(raw, name)
    cpu = DEQUANTIZERS[name](rows, 256)
    assert_bits_equal(DEQUANTIZERS[name](rows.cuda(), 256).cpu(), cpu)


# -------------------------------------------------------------------- table

def test_table_matches_manifest():
    manifest = json.loads((VECTORS / "MANIFEST.json").read_text())
    assert len(manifest) == 45
    for name, m in manifest.items():
        qt = from_id(m["type_id"])
        assert qt is not None and qt.name == name and BY_NAME[name] is qt
        # MANIFEST row_bytes (like gguf-py's sizes) count no per-row header
        assert row_bytes(qt, m["ne0"]) - qt.row_header_bytes == m["row_bytes"], name


def test_table_matches_gguf_package():
    for t in gguf.GGMLQuantizationType:
        qt = from_id(t.value)
        assert qt is not None, t.name
        # activation-only Q8_1 / Q8_K: the C structs are 36 / 296 (ik) bytes, gguf-py says 40 / 292
        if t in gguf.GGML_QUANT_SIZES and t.name not in ("Q8_1", "Q8_K"):
            assert (qt.block_size, qt.block_bytes) == gguf.GGML_QUANT_SIZES[t], t.name
    assert from_id(1000) is None and {34, 35, 40} <= MAINLINE_ONLY
    assert all(q.interleave in (1, 4, 8, 16) for q in BY_ID.values())
    assert BY_NAME["IQ4_K_R4"].interleave == 4 and BY_NAME["IQ4_XS_R8"].interleave == 8


def _gguf_tensors(path: Path):
    """(name, type id, dims, byte span) of each tensor, from the GGUF header; spans include padding."""
    b = path.read_bytes()
    o = 8
    n_tensors, n_kv = struct.unpack_from("<QQ", b, o)
    o += 16
    fixed = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip_value(t):
        nonlocal o
        if t == 8:
            o += 8 + struct.unpack_from("<Q", b, o)[0]
        elif t == 9:
            at, n = struct.unpack_from("<IQ", b, o)
            o += 12
            for _ in range(n):
                skip_value(at)
        else:
            o += fixed[t]

    def string():
        nonlocal o
        n = struct.unpack_from("<Q", b, o)[0]
        o += 8 + n
        return b[o - n:o].decode()

    align = 32
    for _ in range(n_kv):
        key = string()
        t = struct.unpack_from("<I", b, o)[0]
        o += 4
        if key == "general.alignment":
            align = struct.unpack_from("<I", b, o)[0]
        skip_value(t)
    infos = []
    for _ in range(n_tensors):
        name = string()
        nd = struct.unpack_from("<I", b, o)[0]
        dims = struct.unpack_from(f"<{nd}Q", b, o + 4)
        o += 4 + 8 * nd
        t, off = struct.unpack_from("<IQ", b, o)
        o += 12
        infos.append([name, t, dims, off])
    data_len = len(b) - (o + align - 1) // align * align
    infos.sort(key=lambda r: r[3])
    ends = [r[3] for r in infos[1:]] + [data_len]
    return [(n, t, d, end - off) for (n, t, d, off), end in zip(infos, ends)], align


def test_table_row_bytes_match_ik_files():
    # the per-row header is really there: every tensor of ik_llama.cpp's own GGUFs spans exactly
    # n_rows x row_bytes (up to alignment padding)
    files = sorted((VECTORS / "files").glob("q-*.gguf"))
    assert files
    for path in files:
        tensors, align = _gguf_tensors(path)
        for name, t, dims, span in tensors:
            qt = from_id(t)
            assert qt is not None, (path.name, name, t)
            size = row_bytes(qt, dims[0]) * int(np.prod(dims[1:]))
            assert size <= span < size + align, (path.name, name, qt.name, size, span)
