"""ggml tensor types: every id llama.cpp and ik_llama.cpp write (quant/ggml_table.py), their geometry, and
which ones hybridmoe computes with."""
from __future__ import annotations

from enum import IntEnum

from .ggml_table import BY_ID, QType

# Every type id of either project, by its ggml name (ik_llama.cpp's names for its own types: IQ4_KS, IQ2_KT,
# IQ4_K_R4...). An IntEnum, so members compare and hash as their ids.
GGMLType = IntEnum("GGMLType", [(q.name, q.id) for q in sorted(BY_ID.values(), key=lambda q: q.id)])


def _info(qtype) -> QType:
    return BY_ID[int(qtype)]


def block_size(qtype) -> int:
    return _info(qtype).block_size


def type_size(qtype) -> int:
    """Bytes per block."""
    return _info(qtype).block_bytes


def row_header_bytes(qtype) -> int:
    """Bytes before a row's blocks (the per-row scale of ik_llama.cpp's _KS / _KT types), else 0."""
    return _info(qtype).row_header_bytes


def interleave(qtype) -> int:
    """Rows stored interleaved together (4 or 8 for the _R4 / _R8 types), else 1."""
    return _info(qtype).interleave


def row_bytes(qtype, n: int) -> int:
    """Bytes of one row of n elements, per-row header included (n must be a multiple of the block size)."""
    q = _info(qtype)
    return q.row_header_bytes + n // q.block_size * q.block_bytes


def bits_per_weight(qtype) -> float:
    q = _info(qtype)
    return q.block_bytes * 8 / q.block_size


def type_from_id(type_id: int) -> GGMLType | None:
    """The type of an id either project writes, or None."""
    try:
        return GGMLType(int(type_id))
    except ValueError:
        return None
