"""dequantize(): GGUF rows of any type hybridmoe reads -> floats, with torch ops only (CPU or GPU).

The oracle of every fast path, and the path of every type without one. Dispatches to the reference
dequantizers: ref.py (the types the fast kernels read, plus their quantizers), ref_mainline.py (llama.cpp's
other types), ref_ik.py (ik_llama.cpp's IQ*_K / _KS / _KSS / _KL), ref_trellis.py (the _KT types), ref_interleaved.py (the
row-interleaved _R4 / _R8 layouts)."""
from __future__ import annotations

import torch

from . import ref, ref_ik, ref_interleaved, ref_mainline, ref_trellis
from .types import GGMLType, block_size, interleave, row_bytes


def _rows_table() -> dict:
    out = {}
    for mod in (ref_mainline, ref_ik, ref_trellis):
        for name, fn in mod.DEQUANTIZERS.items():
            t = GGMLType.__members__.get(name)
            if t is not None and t not in ref.REF_TYPES:
                out[t] = fn
    return out


_ROWS = _rows_table()
# interleaved type -> (base type, rows of the base type from a group-interleaved block of rows)
DEINTERLEAVE = {GGMLType[n]: (GGMLType[b], fn) for n, (b, fn) in ref_interleaved.DEINTERLEAVE.items()
                if n in GGMLType.__members__ and b in GGMLType.__members__}
# the interleaved types' own dequantizers (deinterleave + the base type's where that is exact, else direct)
_INTERLEAVED = {GGMLType[n]: fn for n, fn in ref_interleaved.DEQUANTIZERS.items() if n in GGMLType.__members__}
# Every type with a dequantizer, and so loadable on every placement.
SUPPORTED = tuple(sorted({*ref.REF_TYPES, *_ROWS, *_INTERLEAVED}, key=int))
SUPPORTED_NAMES = ", ".join(t.name for t in SUPPORTED)


def deinterleave(raw: torch.Tensor, qtype, n_cols: int) -> tuple[torch.Tensor, GGMLType]:
    """An _R4 / _R8 tensor's rows [..., rows, row_bytes] as its base type's rows (same shape but the row bytes);
    other types are returned as they are."""
    qtype = GGMLType(qtype)
    entry = DEINTERLEAVE.get(qtype)
    if entry is None:
        return raw, qtype
    base, fn = entry
    lead = raw.shape[:-1]
    out = fn(raw.contiguous().reshape(-1, raw.shape[-1]), n_cols)
    return out.reshape(*lead, row_bytes(base, n_cols)), base


def dequantize(raw: torch.Tensor, qtype, n_cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 GGUF rows [..., row_bytes(qtype, n_cols)] -> [..., n_cols] in `dtype`. Interleaved types need whole
    groups of rows (the row count a multiple of the interleave)."""
    qtype = GGMLType(qtype)
    if qtype in ref.REF_TYPES:
        return ref.dequantize(raw, qtype, n_cols, dtype)
    if raw.dtype != torch.uint8 or raw.shape[-1] != row_bytes(qtype, n_cols):
        raise ValueError(f"{qtype.name}: expected uint8 [..., {row_bytes(qtype, n_cols)}], "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    lead = raw.shape[:-1]
    rows = raw.contiguous().reshape(-1, raw.shape[-1])
    fn = _ROWS.get(qtype) or _INTERLEAVED.get(qtype)
    if fn is None:
        raise NotImplementedError(f"no reference dequantizer for {qtype.name}")
    if rows.shape[0] % interleave(qtype):
        raise ValueError(f"{qtype.name}: {rows.shape[0]} rows is not a multiple of {interleave(qtype)}")
    if n_cols == block_size(qtype) and rows.shape[0] == interleave(qtype):
        # a single block: its fields, sliced, would be contiguous views at odd byte offsets, which can't be
        # viewed as 16- or 32-bit values; two copies make every slice a copy
        return fn(rows.repeat(2, 1), n_cols)[:rows.shape[0]].to(dtype).reshape(*lead, n_cols)
    return fn(rows, n_cols).to(dtype).reshape(*lead, n_cols)
