"""formats/gguf_write.py writes every tensor type (ik_llama.cpp's too): read back by formats/gguf.py with the
same shapes, type ids and bytes, and ik_llama.cpp's own files rewrite to the same tensors."""
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridmoe.formats.gguf import open_gguf
from hybridmoe.formats.gguf_write import write_gguf
from hybridmoe.quant.dequant import SUPPORTED
from hybridmoe.quant.random_blocks import random_tensor
from hybridmoe.quant.types import GGMLType, row_bytes

FILES = Path(__file__).resolve().parents[2] / "shared/testdata/quant-vectors/files"


def test_every_type_round_trips(tmp_path):
    g = torch.Generator().manual_seed(4)
    made = {}
    tensors = []
    for i, t in enumerate(SUPPORTED):
        shape = (2, 16, 512) if i % 2 else (16, 512)
        made[t] = random_tensor(t, shape, g)
        tensors.append((f"t.{t.name}", shape, t, lambda t=t: made[t]))
    path = str(tmp_path / "all.gguf")
    write_gguf(path, "qwen3moe", {"general.name": "types"}, tensors)
    f = open_gguf(path)
    assert len(f.tensors) == len(SUPPORTED)
    for name, shape, t, _ in tensors:
        info = f.tensors[name]
        assert info.qtype == t and info.shape == shape and info.nbytes == made[t].numel()
        assert torch.equal(f.raw(info).view(*shape[:-1], -1), made[t]), t.name


@pytest.mark.parametrize("name", ["q-IQ4_KS", "q-IQ2_KT", "q-IQ4_K_R4", "q-IQ5_KS", "q-IQ2_KL"])
def test_ik_files_rewrite_to_the_same_tensors(name, tmp_path):
    src = FILES / f"{name}.gguf"
    if not src.exists():
        pytest.skip(f"no test file at {src}")
    a = open_gguf(str(src))
    dst = str(tmp_path / "copy.gguf")
    write_gguf(dst, a.metadata["general.architecture"], a.metadata,
               [(n, i.shape, i.qtype, lambda i=i: a.raw(i)) for n, i in a.tensors.items()])
    b = open_gguf(dst)
    assert list(b.tensors) == list(a.tensors)
    for n, i in a.tensors.items():
        j = b.tensors[n]
        assert (j.shape, j.qtype, j.nbytes) == (i.shape, i.qtype, i.nbytes)
        assert torch.equal(b.raw(j), a.raw(i)), n


def test_bad_tensors_are_refused(tmp_path):
    p = str(tmp_path / "bad.gguf")
    rb = row_bytes(GGMLType.IQ4_KS, 256)
    with pytest.raises(ValueError, match="made for IQ4_KS"):
        write_gguf(p, "qwen3moe", {}, [("w", (4, 256), GGMLType.IQ4_KS, lambda: np.zeros(3 * rb, np.uint8))])
    with pytest.raises(ValueError, match="groups of 4, got 6 rows"):
        write_gguf(p, "qwen3moe", {}, [("w", (6, 256), GGMLType.IQ4_KS_R4, lambda: None)])
    with pytest.raises(ValueError, match="multiple of 256 columns"):
        write_gguf(p, "qwen3moe", {}, [("w", (4, 100), GGMLType.IQ2_KT, lambda: None)])
