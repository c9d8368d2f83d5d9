from .types import (  # noqa: F401
    GGMLType,
    bits_per_weight,
    block_size,
    row_bytes,
    type_size,
)
