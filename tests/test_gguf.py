"""GGUF reading: records, split files, and every kind of bad file gives one clear line."""
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import hybridmoe
from hybridmoe.errors import HybridMoeError, ModelFileError
from hybridmoe.formats.gguf import open_gguf
from hybridmoe.formats.gguf_write import write_gguf
from hybridmoe.models.synth import ensure_synth
from hybridmoe.quant.types import GGMLType


@pytest.fixture(scope="module")
def tiny():
    return ensure_synth("tiny")


def test_records_of_tiny(tiny):
    f = open_gguf(tiny)
    t = f.tensors["blk.1.ffn_up_exps.weight"]
    assert t.shape == (8, 32, 64) and t.qtype == GGMLType.Q4_0
    assert t.nbytes == 8 * 32 * 64 // 32 * 18
    assert f.tensors["blk.0.attn_norm.weight"].qtype == GGMLType.F32
    assert f.metadata["general.architecture"] == "qwen3moe"
    assert f.metadata["qwen3moe.expert_count"] == 8
    # offsets are absolute and in bounds, bytes readable
    assert f.raw(t).numel() == t.nbytes
    assert all(i.offset + i.nbytes <= os.path.getsize(tiny) for i in f.tensors.values())


def _copy_bytes(src, dst, data=None, cut=None):
    b = bytearray(open(src, "rb").read())
    if cut is not None:
        b = b[:cut]
    if data:
        for off, val in data:
            b[off:off + len(val)] = val
    open(dst, "wb").write(bytes(b))
    return str(dst)


def test_truncated_file(tiny, tmp_path):
    size = os.path.getsize(tiny)
    p = _copy_bytes(tiny, tmp_path / "t.gguf", cut=size - 1000)
    with pytest.raises(ModelFileError, match="runs past the end of the file"):
        open_gguf(p)
    p = _copy_bytes(tiny, tmp_path / "h.gguf", cut=200)
    with pytest.raises(ModelFileError, match="truncated"):
        open_gguf(p)


def test_wrong_magic(tiny, tmp_path):
    p = _copy_bytes(tiny, tmp_path / "m.gguf", data=[(0, b"GGML")])
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        open_gguf(p)


def test_huge_counts_do_not_allocate(tiny, tmp_path):
    # tensor count field at byte 8: claim 2**40 tensors
    p = _copy_bytes(tiny, tmp_path / "c.gguf", data=[(8, struct.pack("<Q", 2**40))])
    with pytest.raises(ModelFileError, match="corrupt"):
        open_gguf(p)


def _write(tmp_path, name, md, tensors):
    p = str(tmp_path / name)
    write_gguf(p, md.get("general.architecture", "qwen3moe"), md, tensors)
    return p


def test_unknown_architecture(tmp_path):
    t = [("token_embd.weight", (4, 32), GGMLType.F32, lambda: np.ones((4, 32), np.float32))]
    p = _write(tmp_path, "a.gguf", {"general.architecture": "mamba9"}, t)
    with pytest.raises(HybridMoeError, match="architecture 'mamba9' is not supported.*supported: qwen3moe"):
        hybridmoe.load(p)


def test_unknown_tensor_type(tmp_path):
    t = [("token_embd.weight", (4, 256), GGMLType.TQ1_0, lambda: np.ones((4, 54), np.uint8))]
    p = _write(tmp_path, "q.gguf", {}, t)
    assert open_gguf(p).tensors["token_embd.weight"].qtype == GGMLType.TQ1_0  # inspect/plan can still read it
    with pytest.raises(HybridMoeError, match="type TQ1_0.*supported: F32"):
        hybridmoe.load(p)
    bad = bytearray(open(p, "rb").read())
    i = bad.index(b"token_embd.weight") + len("token_embd.weight") + 4 + 16     # name, n_dims, 2 dims
    bad[i:i + 4] = struct.pack("<I", 999)
    open(p, "wb").write(bytes(bad))
    with pytest.raises(ModelFileError, match="unknown ggml type id 999"):
        open_gguf(p)


def test_missing_metadata_key(tiny, tmp_path):
    f = open_gguf(tiny)
    md = {k: v for k, v in f.metadata.items() if k != "qwen3moe.embedding_length"}
    tensors = [(n, i.shape, i.qtype, (lambda i=i: f.raw(i))) for n, i in f.tensors.items()]
    p = _write(tmp_path, "k.gguf", md, tensors)
    with pytest.raises(ModelFileError, match="qwen3moe.embedding_length is missing"):
        hybridmoe.load(p)


def test_missing_split_part(tiny, tmp_path):
    from hybridmoe.formats.gguf_write import write_split
    parts = write_split(tiny, 2, str(tmp_path / "s"))
    os.unlink(parts[1])
    with pytest.raises(ModelFileError, match="missing"):
        open_gguf(parts[0])


def test_cli_prints_one_line_not_a_traceback(tiny, tmp_path):
    p = _copy_bytes(tiny, tmp_path / "bad.gguf", cut=os.path.getsize(tiny) // 2)
    r = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "run", "-m", p, "-n", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("error: ") and "bad.gguf" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
