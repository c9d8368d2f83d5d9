from .types import GGMLType, SUPPORTED, block_size, type_size, row_bytes, bits_per_weight  # noqa: F401
