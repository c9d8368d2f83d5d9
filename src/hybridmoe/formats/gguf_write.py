"""Writing GGUF files (synthetic models, converted HF models, split files) through gguf.GGUFWriter.

Every type of quant/ggml_table.py is written, ik_llama.cpp's included: the gguf package knows only
mainline's types (its byte-shape -> element-shape conversion raises KeyError on the others), so each tensor
info is given its element shape and type id directly and the writer's byte counts come from our table
(per-row headers included)."""
from __future__ import annotations

import math
import os

import gguf
import numpy as np
import torch

from ..errors import progress
from ..quant.ggml_table import BY_ID
from ..quant.types import row_bytes
from .gguf import GGUFModel

_ARRAY_TYPES = {np.dtype(np.int32): gguf.GGUFValueType.INT32, np.dtype(np.float32): gguf.GGUFValueType.FLOAT32,
                np.dtype(np.uint32): gguf.GGUFValueType.UINT32}
_SKIP = {"general.architecture", "general.alignment"}
PROGRESS_BYTES = 256 << 20          # files from this size on show a progress bar while written (on a terminal)


def add_kv(w: gguf.GGUFWriter, k: str, v):
    """One metadata value, typed as llama.cpp's converter types it."""
    if isinstance(v, bool):
        w.add_bool(k, v)
    elif isinstance(v, (int, np.integer)):
        v = int(v)
        w.add_uint32(k, v) if 0 <= v < 2**32 else w.add_int64(k, v)
    elif isinstance(v, (float, np.floating)):
        w.add_float32(k, float(v))
    elif isinstance(v, str):
        w.add_string(k, v)
    elif isinstance(v, np.ndarray):
        vt = _ARRAY_TYPES.get(v.dtype)
        if vt is None:
            w.add_array(k, v.tolist())
        else:
            w.add_key_value(k, v.tolist(), gguf.GGUFValueType.ARRAY, sub_type=vt)
    elif isinstance(v, (list, tuple)):
        w.add_array(k, list(v))
    else:
        raise TypeError(f"metadata {k}: unsupported value {type(v)}")


def _nbytes(shape, qtype) -> int:
    return math.prod(shape[:-1]) * row_bytes(qtype, shape[-1])


def _check_tensor(name: str, shape, qtype) -> None:
    q = BY_ID.get(int(qtype))
    if q is None:
        raise ValueError(f"{name}: unknown tensor type id {int(qtype)}")
    if shape[-1] % q.block_size:
        raise ValueError(f"{name}: {q.name} rows need a multiple of {q.block_size} columns, got {shape[-1]}")
    if q.interleave > 1 and math.prod(shape[:-1]) % q.interleave:
        raise ValueError(f"{name}: {q.name} stores rows in groups of {q.interleave}, got {math.prod(shape[:-1])} rows")


def write_gguf(path: str, arch: str, metadata: dict, tensors):
    """Stream a GGUF file. `tensors`: (name, shape, qtype, make) with make() -> uint8 tensor of the bytes.

    Tensor infos go first, then each tensor's bytes are made and written one at a time, so a model
    larger than RAM can be written.
    """
    w = gguf.GGUFWriter(path, arch=arch)
    for k, v in metadata.items():
        if k not in _SKIP:
            add_kv(w, k, v)
    for name, shape, qtype, _ in tensors:
        _check_tensor(name, shape, qtype)
        # a non-uint8 dtype keeps the package from converting the shape with its own (mainline) table
        w.add_tensor_info(name, tuple(int(s) for s in shape), np.dtype(np.float32), _nbytes(shape, qtype),
                          raw_dtype=int(qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(_nbytes(shape, qtype) for _, shape, qtype, _ in tensors)
    with progress(f"writing {os.path.basename(path)}", total, "bytes", enabled=None if total >= PROGRESS_BYTES
                  else False) as bar:
        for name, shape, qtype, make in tensors:
            data = make()
            if isinstance(data, torch.Tensor):
                data = data.contiguous().view(torch.uint8).numpy()
            data = np.ascontiguousarray(data).view(np.uint8)
            if data.nbytes != _nbytes(shape, qtype):
                raise ValueError(f"{name}: {data.nbytes} bytes made for {BY_ID[int(qtype)].name} {tuple(shape)}, "
                                 f"which takes {_nbytes(shape, qtype)}")
            w.write_tensor_data(data)
            bar.advance(data.nbytes)
    w.close()


def write_split(src: str, n_parts: int, out_prefix: str) -> list[str]:
    """Split a GGUF file into n parts with gguf-split's naming and split.* metadata."""
    model = GGUFModel(src)
    names = list(model.tensors)
    per = math.ceil(len(names) / n_parts)
    arch = str(model.metadata["general.architecture"])
    paths = []
    for i in range(n_parts):
        p = f"{out_prefix}-{i + 1:05d}-of-{n_parts:05d}.gguf"
        md = dict(model.metadata) if i == 0 else {}
        md = {k: v for k, v in md.items() if not k.startswith("split.")}
        md.update({"split.no": i, "split.count": n_parts, "split.tensors.count": len(names)})
        part = [(n, model.tensors[n].shape, model.tensors[n].qtype, (lambda info=model.tensors[n]: model.raw(info)))
                for n in names[i * per:(i + 1) * per]]
        write_gguf(p, arch, md, part)
        paths.append(p)
    return paths
