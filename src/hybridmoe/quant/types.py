"""ggml tensor types: block sizes and which ones hybridmoe computes with."""
from __future__ import annotations

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGMLType

# Types with a reference dequantizer (quant/ref.py) and therefore loadable.
SUPPORTED = (
    GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0,
    GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
)
SUPPORTED_NAMES = ", ".join(t.name for t in SUPPORTED)


def block_size(qtype: GGMLType) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def type_size(qtype: GGMLType) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[qtype][1]


def row_bytes(qtype: GGMLType, n: int) -> int:
    """Bytes of one row of n elements (n must be a multiple of the block size)."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    return n // bs * ts


def bits_per_weight(qtype: GGMLType) -> float:
    bs, ts = GGML_QUANT_SIZES[qtype]
    return ts * 8 / bs


def type_from_id(type_id: int) -> GGMLType | None:
    try:
        t = GGMLType(type_id)
    except ValueError:
        return None
    return t if t in GGML_QUANT_SIZES else None
