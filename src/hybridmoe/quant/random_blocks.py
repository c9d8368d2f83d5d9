"""random_blocks(): valid random GGUF rows of every type quant/dequant.py reads, for synthetic models,
benchmarks and kernel tests.

The quant codes (indices, signs, sub-block scales, trellis seeds) are random bytes; every float field (a
block's fp16 d and min, a row's f32 or fp16 header, MXFP4's e8m0 exponent, IQ1_M's d spread over four
nibbles) is set to a per-block magnitude (log-normal, sigma 0.25, like a trained layer's spread of block
scales) times one factor, found by dequantizing a sample of the rows, so that the values' RMS is `scale`.
Min fields are set relative to d so that blocks are centred on zero (Q4_1 / Q5_1 / Q2_K / Q4_K / Q5_K).
The interleaved _R4 / _R8 types are made as their base type's rows, then interleaved (as ik_llama.cpp's
repacking does), except IQ1_M_R4 and IQ2_BN_R4 (no byte-level base): random bytes and random row headers.
The types that quant/ref.py can also quantize keep its generator (ref.random_blocks), so the bytes of the
existing synthetic models do not change.
"""
from __future__ import annotations

import math

import torch

from . import ref, ref_interleaved
from .dequant import SUPPORTED, dequantize
from .ggml_table import BY_NAME
from .types import GGMLType, interleave, row_bytes

F16, F32, E8M0, IQ1M = "f16", "f32", "e8m0", "iq1m"

# Float fields inside each block of the types with no row header: (byte offset, format, value / the block's d).
_BLOCK_FIELDS = {
    "Q4_0": ((0, F16, 1.0),), "Q5_0": ((0, F16, 1.0),), "Q8_0": ((0, F16, 1.0),), "Q6_0": ((0, F16, 1.0),),
    "Q4_1": ((0, F16, 1.0), (2, F16, -7.5)),          # x = d q + m, q in 0..15: m = -7.5 d centres the block
    "Q5_1": ((0, F16, 1.0), (2, F16, -15.5)),
    "Q2_K": ((80, F16, 1.0), (82, F16, 1.5)),         # x = d sc q - dmin m: E[sc q] = 1.5 E[m]
    "Q3_K": ((108, F16, 1.0),),
    "Q4_K": ((0, F16, 1.0), (2, F16, 7.5)),
    "Q5_K": ((0, F16, 1.0), (2, F16, 15.5)),
    "Q6_K": ((208, F16, 1.0),),
    "Q8_K": ((0, F32, 1.0),),
    "IQ2_XXS": ((0, F16, 1.0),), "IQ2_XS": ((0, F16, 1.0),), "IQ2_S": ((0, F16, 1.0),),
    "IQ3_XXS": ((0, F16, 1.0),), "IQ3_S": ((0, F16, 1.0),), "IQ1_S": ((0, F16, 1.0),),
    "IQ4_NL": ((0, F16, 1.0),), "IQ4_XS": ((0, F16, 1.0),),
    "IQ1_M": ((48, IQ1M, 1.0),),                      # fp16 d: top nibbles of the scales' four u16
    "MXFP4": ((0, E8M0, 1.0),),
    "IQ2_K": ((0, F16, 1.0),), "IQ3_K": ((0, F16, 1.0),), "IQ4_K": ((0, F16, 1.0),),
    "IQ5_K": ((0, F16, 1.0),), "IQ6_K": ((0, F16, 1.0),),
}
# Row header formats (ik's _KS / _KT / _KL types; Q8_KV's header is f32 d + an int32 the base never reads).
_HEADER = {2: F16, 4: F32, 8: F32}
# Base rows whose geometry differs from ggml_table's: the mainline Q8_K block that Q8_K_R8 repacks.
_BASE_GEOMETRY = {"Q8_K_R8": (256, 292, 0)}
_FLOATS = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}
_FLOATS_BY_NAME = {t.name: dt for t, dt in _FLOATS.items()}
_SAMPLE_VALUES = 1 << 16          # values dequantized to find the factor


def _rand_bytes(shape: tuple, g: torch.Generator) -> torch.Tensor:
    n = math.prod(shape)
    words = torch.empty((n + 7) // 8, dtype=torch.int64, device=g.device)
    return words.random_(-(2 ** 63), None, generator=g).view(torch.uint8)[:n].reshape(shape)


def _field_bytes(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 values [N] -> their bytes [N, k] in the field's format."""
    if fmt == F16:
        return v.clamp(-6e4, 6e4).to(torch.float16).reshape(-1, 1).view(torch.uint8)
    if fmt == F32:
        return v.float().reshape(-1, 1).view(torch.uint8)
    if fmt == E8M0:                 # 2^(e - 127)
        e = torch.round(torch.log2(v.abs().clamp_min(1e-30))) + 127
        return e.clamp(2, 254).to(torch.uint8).reshape(-1, 1)
    raise AssertionError(fmt)


class _Layout:
    """Random codes of one tensor plus where its float fields are: build(f) writes the fields (magnitude x f)."""

    def __init__(self, name: str, n_rows: int, n_cols: int, g: torch.Generator, per_row: bool, geometry=None):
        q = BY_NAME[name]
        self.name, self.n_rows, self.n_cols = name, n_rows, n_cols
        bs, bb, hdr = geometry or (q.block_size, q.block_bytes, q.row_header_bytes)
        self.nb, self.bb, self.hdr = n_cols // bs, bb, hdr
        self.codes = _rand_bytes((n_rows, hdr + self.nb * bb), g)
        shape = (n_rows, 1) if per_row or hdr else (n_rows, self.nb)
        self.mag = torch.exp(0.25 * torch.randn(shape, generator=g, device=g.device))
        if not hdr and name not in _BLOCK_FIELDS:
            raise NotImplementedError(f"no random blocks for {name}")

    def build(self, f: float, k: int | None = None) -> torch.Tensor:
        """The first k rows (all by default) with the float fields set."""
        k = self.n_rows if k is None else k
        raw = self.codes[:k].clone()
        if self.hdr:
            raw[:, :self.hdr] = 0
            b = _field_bytes(self.mag[:k, 0] * f, _HEADER[self.hdr])
            raw[:, :b.shape[1]] = b
            return raw
        blocks = raw.view(k, self.nb, self.bb)
        mag = self.mag[:k].expand(k, self.nb).reshape(-1)
        for off, fmt, rel in _BLOCK_FIELDS[self.name]:
            if fmt == IQ1M:
                bits = _field_bytes(mag * rel * f, F16).view(torch.int16).reshape(k, self.nb).int()
                for j in range(4):
                    hi = blocks[..., off + 1 + 2 * j]
                    blocks[..., off + 1 + 2 * j] = (hi & 0x0F) | (((bits >> (4 * j)) & 0xF) << 4).to(torch.uint8)
            else:
                b = _field_bytes(mag * rel * f, fmt)
                blocks[..., off:off + b.shape[1]] = b.reshape(k, self.nb, -1)
        return raw


def _interleaved_build(qtype: GGMLType, n_rows: int, n_cols: int, g: torch.Generator):
    name = qtype.name
    lay = ref_interleaved.LAYOUTS[name]
    inter = ref_interleaved.INTERLEAVE.get(name)
    if lay.base in _FLOATS_BY_NAME:
        x = torch.randn((n_rows, n_cols), generator=g, device=g.device)
        return lambda f, k=None: inter((x[:k] * f).to(_FLOATS_BY_NAME[lay.base]).view(torch.uint8), n_cols)
    if lay.base is not None:
        base = _Layout(lay.base, n_rows, n_cols, g, per_row=True, geometry=_BASE_GEOMETRY.get(name))
        return lambda f, k=None: inter(base.build(f, k), n_cols)
    # no byte-level base: random group bytes, then each row's header (a group's R headers come first)
    R, hdr, rb = lay.rows, lay.hdr, ref_interleaved.row_bytes(name, n_cols)
    codes = _rand_bytes((n_rows // R, R * rb), g)
    mag = torch.exp(0.25 * torch.randn(n_rows, generator=g, device=g.device))

    def build(f: float, k: int | None = None) -> torch.Tensor:
        k = n_rows if k is None else k
        raw = codes[:k // R].clone()
        raw[:, :R * hdr] = _field_bytes(mag[:k] * f, _HEADER[hdr]).reshape(k // R, R * hdr)
        return raw.reshape(k, rb)
    return build


def _rms(raw: torch.Tensor, qtype: GGMLType, n_cols: int) -> float:
    x = dequantize(raw, qtype, n_cols).double()
    return float(x.pow(2).mean().sqrt())


def random_blocks(qtype, n_rows: int, n_cols: int, generator: torch.Generator,
                  scale: float = 0.02) -> torch.Tensor:
    """uint8 [n_rows, row_bytes(qtype, n_cols)] of valid random rows of `qtype` on the generator's device:
    dequantized (quant/dequant.py) they are finite, with RMS ~ `scale` (MXFP4: within its power-of-two
    steps). Deterministic given the generator's state. Interleaved types need n_rows a multiple of theirs."""
    qtype = GGMLType(qtype)
    g = generator
    if qtype not in SUPPORTED:
        raise NotImplementedError(f"no random blocks for {qtype.name}: it has no dequantizer")
    n_cols, n_rows = int(n_cols), int(n_rows)
    row_bytes(qtype, n_cols)                                  # checks the row length
    if n_rows % interleave(qtype):
        raise ValueError(f"{qtype.name}: {n_rows} rows is not a multiple of {interleave(qtype)}")
    if qtype in _FLOATS:
        x = torch.randn((n_rows, n_cols), generator=g, device=g.device) * scale
        return x.to(_FLOATS[qtype]).view(torch.uint8)
    if qtype in ref.REF_TYPES:
        return ref.random_blocks(qtype, (n_rows, n_cols), g, scale=scale)
    if interleave(qtype) > 1:
        build = _interleaved_build(qtype, n_rows, n_cols, g)
        step = interleave(qtype)
    else:
        build = _Layout(qtype.name, n_rows, n_cols, g, per_row=False).build
        step = 1
    # the factor from a sample of whole rows (whole interleave groups), refined once for the fields' rounding
    k = min(n_rows, max(step, -(-_SAMPLE_VALUES // n_cols // step) * step))
    f = 1.0
    for _ in range(2):
        r = _rms(build(f, k), qtype, n_cols)
        f *= scale / r if r > 0 else 1.0
    return build(f)


def random_tensor(qtype, shape: tuple, generator: torch.Generator, scale: float = 0.02) -> torch.Tensor:
    """random_blocks for a tensor of `shape` (last dim = columns): uint8 [*shape[:-1], row_bytes]."""
    shape = tuple(int(s) for s in shape)
    raw = random_blocks(qtype, math.prod(shape[:-1]), shape[-1], generator, scale=scale)
    return raw.reshape(*shape[:-1], raw.shape[-1])
