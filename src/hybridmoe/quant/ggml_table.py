"""Every ggml tensor type id that llama.cpp (mainline) or ik_llama.cpp knows, with its storage geometry.

Sources: ik_llama.cpp (commit 8337e4c) ggml/include/ggml.h (ids), ggml/src/ggml.c type_traits (blck_size,
type_size, row_meta_size) and ggml/src/ggml-common.h (block structs); mainline llama.cpp ggml.h for the
ids ik_llama.cpp lacks. ik_llama.cpp keeps every mainline id it shares, so the two never disagree on a
type both write.

A row of n elements takes  row_header_bytes + (n / block_size) * block_bytes  bytes: ik's *_KS, *_KT,
IQ2_KL, IQ*_BN, IQ1_*_R4 and Q8_KV* rows start with a per-row scale (ggml's row_meta_size; a float32,
or an fp16 for IQ2_KS / IQ3_KS / IQ2_KL / IQ1_BN / IQ1_S_R4 / IQ1_M_R4). Note that the gguf package's
GGML_QUANT_SIZES (and so test vectors' MANIFEST row_bytes) leave this header out.

interleave > 1 (the _R4 / _R8 / _R16 types, and mainline's old Q4_0_4_4 / Q4_0_4_8 / Q4_0_8_8) means the
bytes of groups of that many consecutive rows are stored interleaved block by block: a tensor's row count
is a multiple of it, and one row cannot be read alone. row_bytes() is then the per-row share of a group
(for _R4 types with a header, the group's headers come first, interleave x header bytes together).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QType:
    id: int
    name: str
    block_size: int         # elements per block
    block_bytes: int        # bytes per block
    row_header_bytes: int   # per-row meta before the blocks (ggml.c row_meta_size)
    interleave: int = 1     # rows stored interleaved in groups of this many


# (id, name, block_size, block_bytes, row_header_bytes, interleave)
_ROWS = (
    # ---- shared by mainline and ik_llama.cpp
    (0, "F32", 1, 4, 0, 1),
    (1, "F16", 1, 2, 0, 1),
    (2, "Q4_0", 32, 18, 0, 1),
    (3, "Q4_1", 32, 20, 0, 1),
    (6, "Q5_0", 32, 22, 0, 1),
    (7, "Q5_1", 32, 24, 0, 1),
    (8, "Q8_0", 32, 34, 0, 1),
    (9, "Q8_1", 32, 36, 0, 1),            # activations only
    (10, "Q2_K", 256, 84, 0, 1),
    (11, "Q3_K", 256, 110, 0, 1),
    (12, "Q4_K", 256, 144, 0, 1),
    (13, "Q5_K", 256, 176, 0, 1),
    (14, "Q6_K", 256, 210, 0, 1),
    (15, "Q8_K", 256, 296, 0, 1),         # activations only; ik's block has 2 floats (mainline: 292)
    (16, "IQ2_XXS", 256, 66, 0, 1),
    (17, "IQ2_XS", 256, 74, 0, 1),
    (18, "IQ3_XXS", 256, 98, 0, 1),
    (19, "IQ1_S", 256, 50, 0, 1),
    (20, "IQ4_NL", 32, 18, 0, 1),
    (21, "IQ3_S", 256, 110, 0, 1),
    (22, "IQ2_S", 256, 82, 0, 1),
    (23, "IQ4_XS", 256, 136, 0, 1),
    (24, "I8", 1, 1, 0, 1),
    (25, "I16", 1, 2, 0, 1),
    (26, "I32", 1, 4, 0, 1),
    (27, "I64", 1, 8, 0, 1),
    (28, "F64", 1, 8, 0, 1),
    (29, "IQ1_M", 256, 56, 0, 1),
    (30, "BF16", 1, 2, 0, 1),
    (31, "Q4_0_4_4", 32, 18, 0, 4),       # mainline removed 31-33 from gguf files; ik still has them
    (32, "Q4_0_4_8", 32, 18, 0, 4),
    (33, "Q4_0_8_8", 32, 18, 0, 8),
    (39, "MXFP4", 32, 17, 0, 1),
    (41, "Q1_0", 128, 18, 0, 1),          # ik: Q1_0_G128 (same layout: fp16 d + 128 sign bits)
    # ---- mainline only (ik_llama.cpp has no such id)
    (34, "TQ1_0", 256, 54, 0, 1),
    (35, "TQ2_0", 256, 66, 0, 1),
    (40, "NVFP4", 64, 36, 0, 1),
    (42, "Q2_0", 64, 18, 0, 1),
    # ---- ik_llama.cpp only
    (36, "I2_S", 1, 1, 0, 1),             # MS BitNet: 2 bits/weight, whole tensor n/4 + 32 bytes (not per row);
                                          # mainline's removed IQ4_NL_4_4 had this id
    (97, "Q8_0_X4", 32, 34, 0, 1),        # 97-99: activations only
    (98, "Q8_1_X4", 32, 36, 0, 1),
    (99, "Q8_2_X4", 32, 36, 0, 1),
    (133, "Q6_0", 32, 26, 0, 1),
    (134, "IQ1_BN", 64, 13, 2, 1),
    (135, "IQ2_BN", 64, 16, 4, 1),
    (136, "Q8_K64", 64, 68, 0, 1),        # activations only
    (137, "IQ2_K", 256, 76, 0, 1),
    (138, "IQ3_K", 256, 110, 0, 1),
    (139, "IQ4_K", 256, 144, 0, 1),
    (140, "IQ5_K", 256, 176, 0, 1),
    (141, "IQ6_K", 256, 212, 0, 1),
    (144, "IQ4_KS", 256, 136, 4, 1),
    (145, "IQ2_KS", 256, 70, 2, 1),
    (146, "IQ4_KSS", 256, 128, 4, 1),
    (147, "Q8_K16", 64, 64, 20, 1),       # 147-150: activations only
    (148, "Q8_K32", 256, 296, 0, 1),
    (149, "Q8_KR8", 256, 296, 0, 1),
    (150, "Q8_K128", 128, 140, 0, 1),
    (151, "Q8_KV", 32, 32, 8, 1),
    (152, "IQ5_KS", 256, 168, 4, 1),
    (153, "IQ2_KT", 256, 68, 4, 1),
    (154, "IQ3_KT", 256, 100, 4, 1),
    (155, "IQ4_KT", 256, 128, 4, 1),
    (156, "IQ3_KS", 256, 102, 2, 1),
    (157, "IQ2_KL", 256, 86, 2, 1),
    (158, "IQ1_KT", 256, 56, 4, 1),
    (202, "Q4_0_R8", 32, 18, 0, 8),
    (206, "Q5_0_R4", 32, 22, 0, 4),
    (208, "Q8_0_R8", 32, 34, 0, 8),
    (210, "Q2_K_R4", 256, 84, 0, 4),
    (211, "Q3_K_R4", 256, 110, 0, 4),
    (212, "Q4_K_R4", 256, 144, 0, 4),
    (213, "Q5_K_R4", 256, 176, 0, 4),
    (214, "Q6_K_R4", 256, 210, 0, 4),
    (216, "IQ2_XXS_R4", 256, 66, 0, 4),
    (217, "IQ2_XS_R4", 256, 74, 0, 4),
    (218, "IQ3_XXS_R4", 256, 98, 0, 4),
    (219, "IQ1_S_R4", 32, 6, 2, 4),
    (220, "IQ4_NL_R4", 32, 18, 0, 4),
    (221, "IQ3_S_R4", 256, 110, 0, 4),
    (222, "IQ2_S_R4", 256, 82, 0, 4),
    (223, "IQ4_XS_R8", 256, 136, 0, 8),
    (229, "IQ1_M_R4", 32, 7, 2, 4),
    (230, "BF16_R16", 1, 2, 0, 16),
    (233, "Q6_0_R4", 32, 26, 0, 4),
    (335, "IQ2_BN_R4", 64, 16, 4, 4),
    (337, "IQ2_K_R4", 256, 76, 0, 4),
    (338, "IQ3_K_R4", 256, 110, 0, 4),
    (339, "IQ4_K_R4", 256, 144, 0, 4),
    (340, "IQ5_K_R4", 256, 176, 0, 4),
    (344, "IQ4_KS_R4", 256, 136, 4, 4),
    (352, "IQ5_KS_R4", 256, 168, 4, 4),
    (353, "MXFP4_R8", 32, 17, 0, 8),
    (397, "Q8_K_R16", 256, 258, 0, 16),
    (398, "Q8_KV_R8", 32, 32, 4, 8),
    (399, "Q8_K_R8", 256, 258, 0, 8),
)

BY_ID: dict[int, QType] = {r[0]: QType(*r) for r in _ROWS}
BY_NAME: dict[str, QType] = {q.name: q for q in BY_ID.values()}
BY_NAME["Q1_0_G128"] = BY_ID[41]  # ik_llama.cpp's name for id 41

# Ids only mainline writes / only ik_llama.cpp writes (everything else is common).
MAINLINE_ONLY = frozenset((34, 35, 40, 42))
IK_ONLY = frozenset(i for i in BY_ID if i == 36 or i > 41)
# Ids used for activations / intermediate buffers, never for weights in a GGUF file.
ACTIVATION_ONLY = frozenset((9, 15, 97, 98, 99, 136, 147, 148, 149, 150))


def from_id(type_id: int) -> QType | None:
    return BY_ID.get(int(type_id))


def row_bytes(qtype: QType | int | str, n_cols: int) -> int:
    """Bytes of one row of n_cols elements, per-row header included."""
    if not isinstance(qtype, QType):
        qtype = BY_NAME[qtype] if isinstance(qtype, str) else BY_ID[int(qtype)]
    if n_cols % qtype.block_size:
        raise ValueError(f"{qtype.name}: {n_cols} columns is not a multiple of {qtype.block_size}")
    return qtype.row_header_bytes + n_cols // qtype.block_size * qtype.block_bytes


def tensor_bytes(qtype: QType | int | str, n_cols: int, n_rows: int) -> int:
    return row_bytes(qtype, n_cols) * n_rows
