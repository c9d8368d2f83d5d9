"""Reference (pure torch) codecs for ik_llama.cpp's row-interleaved types (_R4 / _R8 / _R16).

An interleaved tensor stores its rows in groups of R (4, 8 or 16) consecutive rows. A group holds the R
rows' per-row headers first (R x header bytes: a float32 scale for IQ4_KS_R4 / IQ5_KS_R4 / IQ2_BN_R4 /
Q8_KV_R8, an fp16 one for IQ1_S_R4 / IQ1_M_R4), then, for every block index b, one interleaved block
holding block b of all R rows: the same bytes as R base blocks, reshuffled so that SIMD code loads R rows
at once. A row's share of a group is the base row's size (IQ1_S_R4 / IQ1_M_R4 / Q8_K_R8 / Q8_KV_R8 aside).

The reshuffle is a permutation of bits within the interleaved block (whole bytes, nibbles, 2-bit fields,
single bits). ref_interleaved_packs writes each one once, as PACKS[name]: R base blocks -> one
interleaved block, like ik_llama.cpp's repack_* functions. Its inverse is derived here: PACKS[name] is
run on ~15 probe inputs whose bit patterns spell each input bit's index, which gives the permutation
(checked to be one, and checked on random bytes); deinterleaving gathers the bits back, whole bytes at a
time where the permutation moves whole bytes. Dequantizing is deinterleave + the base type's reference
dequantizer (ref.py, ref_mainline.py, ref_ik.py), except where noted.

The deinterleaved ("intermediate") rows are not always the base type's bytes:
  * IQ2_XXS_R4 / IQ3_XXS_R4 / IQ2_XS_R4 store each 7-bit sign code s (bit i = sign of value i, the 8th
    sign is the parity) as its prefix XOR t (t_j = s_0 ^ ... ^ s_j): RECODE undoes it.
  * IQ1_S_R4 / IQ1_M_R4 are not repacks but own formats: 32-value blocks, one fp16 scale per row.
    IQ1_S_R4 rows of a multiple of 256 values map onto IQ1_S (the row scale copied into each block);
    IQ1_M_R4 has 4-bit block scales (IQ1_M: odd 3-bit ones), so it has no base type.
  * Q8_K_R8 keeps Q8_K's scale as fp16 and drops its bsums; Q8_KV_R8 drops Q8_KV's int32 row sum.
    Deinterleaving restores them (f16 -> f32 exactly, sums recomputed).
Dequantized directly (same arithmetic as ik's dequantize_row_*_r4, bit for bit): IQ1_S_R4, IQ1_M_R4,
Q8_K_R8, Q8_KV_R8, IQ2_BN_R4 (d * (q - 1); ik's own IQ2_BN to_float ignores the row scale), and
Q5_0_R4 / Q6_0_R4 (d * q - 16 d / - 32 d: a zero comes out +0 where Q5_0's (q - 16) * d gives -0).
Left out: Q8_K_R16 (runtime-only; its bytes depend on the build: AVX512 builds XOR them with 0x80).
BF16_R16 is included, although ggml's to_float for it returns the interleaved order unchanged.
Every function is vectorized and uses only torch ops (CPU or CUDA).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .ref_interleaved_packs import (
    PACKS,
    RECODE,
    le_int,
    q5_0_values,
    q6_0_values,
    scramble,
    unscramble,
)

QK_K = 256

# ------------------------------------------------------------- intermediate <-> base conversions

def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _iq1s_to_base(rows, n_cols):        # [n, 2 + n/32 * 6] -> IQ1_S [n, n/256 * 50]
    if n_cols % QK_K:
        raise ValueError(f"IQ1_S_R4 -> IQ1_S needs a multiple of 256 columns, got {n_cols}")
    n, nb = rows.shape[0], n_cols // QK_K
    blk = rows[:, 2:].reshape(n, nb, 8, 6)
    d = rows[:, None, 0:2].expand(n, nb, 2)
    return torch.cat([d, blk[..., 0:4].reshape(n, nb, 32), blk[..., 4:6].reshape(n, nb, 16)], -1).reshape(n, -1)


def _iq1s_from_base(rows, n_cols):
    n, nb = rows.shape[0], n_cols // QK_K
    blk = rows.reshape(n, nb, 50)
    if not torch.equal(blk[:, :, 0:2], blk[:, :1, 0:2].expand_as(blk[:, :, 0:2])):
        raise ValueError("IQ1_S -> IQ1_S_R4: every block of a row must have the same scale d")
    body = torch.cat([blk[..., 2:34].reshape(n, nb, 8, 4), blk[..., 34:50].reshape(n, nb, 8, 2)], -1)
    return torch.cat([blk[:, 0, 0:2], body.reshape(n, -1)], -1)


def _q8k_to_base(rows, n_cols):         # [n, nb * 258] (f16 d, int8 q) -> Q8_K [n, nb * 292]
    n, nb = rows.shape[0], n_cols // QK_K
    blk = rows.reshape(n, nb, 258)
    d = blk[..., 0:2].contiguous().view(torch.float16).float().contiguous().view(torch.uint8)
    q = blk[..., 2:].contiguous().view(torch.int8)
    bsums = q.reshape(n, nb, 16, 16).sum(-1, dtype=torch.int16).contiguous().view(torch.uint8)
    return torch.cat([d, blk[..., 2:], bsums], -1).reshape(n, -1)


def _q8k_from_base(rows, n_cols):
    n, nb = rows.shape[0], n_cols // QK_K
    blk = rows.reshape(n, nb, 292)
    d = _f16_bytes(blk[..., 0:4].contiguous().view(torch.float32).squeeze(-1))
    return torch.cat([d, blk[..., 4:260]], -1).reshape(n, -1)


def _q8kv_to_base(rows, n_cols):        # [n, 4 + n_cols] -> Q8_KV [n, 8 + n_cols] (int32 sum of q)
    s = rows[:, 4:].contiguous().view(torch.int8).sum(-1, dtype=torch.int32)
    return torch.cat([rows[:, 0:4], s.reshape(-1, 1).contiguous().view(torch.uint8), rows[:, 4:]], -1)


def _q8kv_from_base(rows, n_cols):
    return torch.cat([rows[:, 0:4], rows[:, 8:]], -1)


# ------------------------------------------------- direct dequantization of intermediate rows

def _f32(b):
    return b.contiguous().view(torch.float32)


def _dq_q8_k(rows, n_cols):
    blk = rows.reshape(rows.shape[0], -1, 258)
    d = blk[..., 0:2].contiguous().view(torch.float16).float()
    return (d * blk[..., 2:].contiguous().view(torch.int8).float()).reshape(rows.shape[0], n_cols)


def _affine(vals, bias):
    """Q5_0_R4 / Q6_0_R4 compute d * q + (-bias * d): as Q5_0 / Q6_0 except that a zero is always +0."""
    def dq(rows, n_cols):
        b = rows.reshape(rows.shape[0], -1, 26 if bias == 32 else 22)
        d = b[..., 0:2].contiguous().view(torch.float16).float()
        return (d * vals(b).float() + (-bias) * d).reshape(rows.shape[0], n_cols)
    return dq


def _dq_q8_kv(rows, n_cols):
    return _f32(rows[:, 0:4]) * rows[:, 4:].contiguous().view(torch.int8).float()


def _dq_iq2_bn(rows, n_cols):
    n = rows.shape[0]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=rows.device).view(4, 1)
    q = (rows[:, 4:].reshape(n, -1, 1, 16) >> shifts) & 3
    return _f32(rows[:, 0:4]) * (q.float() - 1).reshape(n, n_cols)


_GRID: dict = {}


def _iq1_grid(device) -> torch.Tensor:
    g = _GRID.get(device)
    if g is None:
        from gguf.quants import (
            IQ1_S,  # the IQ1_S / IQ1_M lattice, 2048 x 8 values in {-1, 0, 1}
        )
        IQ1_S.init_grid()
        g = _GRID[device] = torch.from_numpy(IQ1_S.grid.reshape(2048, 8).copy()).float().to(device)
    return g


def _dq_iq1_s(rows, n_cols):            # per 32: 4 index bytes, u16: 4 x 3 high bits, scale, delta sign
    n = rows.shape[0]
    d = rows[:, 0:2].contiguous().view(torch.float16).float().view(n, 1, 1)
    blk = rows[:, 2:].reshape(n, -1, 6)
    qh = le_int(blk[..., 4:6]).unsqueeze(-1)                                     # [n, nb, 1]
    idx = blk[..., 0:4].long() | (((qh >> (3 * torch.arange(4, device=rows.device))) & 7) << 8)
    dl = d * (2 * ((qh >> 12) & 7) + 1).float()
    delta = torch.where(((qh >> 15) & 1) == 1, -0.125, 0.125).float()
    y = dl.unsqueeze(-1) * (_iq1_grid(rows.device)[idx] + delta.unsqueeze(-1))
    return y.reshape(n, n_cols)


def _dq_iq1_m(rows, n_cols):            # per 32: 4 index bytes, 2 qh bytes (nibble per 8), scale byte
    n = rows.shape[0]
    d = rows[:, 0:2].contiguous().view(torch.float16).float().view(n, 1, 1)
    blk = rows[:, 2:].reshape(n, -1, 7).to(torch.int32)
    h = torch.stack([blk[..., 4:6] & 15, blk[..., 4:6] >> 4], -1).reshape(*blk.shape[:2], 4)
    idx = (blk[..., 0:4] | ((h & 7) << 8)).long()
    delta = torch.where((h >> 3) == 1, -0.125, 0.125).float()
    sc = torch.stack([blk[..., 6] & 15, blk[..., 6] >> 4], -1).float()        # per 16 values
    dl = (d * sc).repeat_interleave(2, -1)
    y = dl.unsqueeze(-1) * (_iq1_grid(rows.device)[idx] + delta.unsqueeze(-1))
    return y.reshape(n, n_cols)


# ----------------------------------------------------------------------------------- layouts

@dataclass(frozen=True)
class Layout:
    base: str | None        # the base type the deinterleaved rows are (None: no byte-level base)
    rows: int               # interleave
    block: int              # values per block (per row)
    bb: int                 # bytes per block per row, in the intermediate (deinterleaved) rows
    hdr: int                # per-row header bytes
    to_base: Callable | None = None     # intermediate rows -> base rows, when they differ
    from_base: Callable | None = None
    direct: Callable | None = None      # dequantizer of intermediate rows (else the base type's)


LAYOUTS: dict[str, Layout] = {
    "Q4_0_R8": Layout("Q4_0", 8, 32, 18, 0),
    "MXFP4_R8": Layout("MXFP4", 8, 32, 17, 0),
    "Q8_0_R8": Layout("Q8_0", 8, 32, 34, 0),
    "Q5_0_R4": Layout("Q5_0", 4, 32, 22, 0, direct=_affine(q5_0_values, 16)),
    "Q6_0_R4": Layout("Q6_0", 4, 32, 26, 0, direct=_affine(q6_0_values, 32)),
    "IQ4_NL_R4": Layout("IQ4_NL", 4, 32, 18, 0),
    "Q2_K_R4": Layout("Q2_K", 4, QK_K, 84, 0),
    "Q3_K_R4": Layout("Q3_K", 4, QK_K, 110, 0),
    "Q4_K_R4": Layout("Q4_K", 4, QK_K, 144, 0),
    "Q5_K_R4": Layout("Q5_K", 4, QK_K, 176, 0),
    "Q6_K_R4": Layout("Q6_K", 4, QK_K, 210, 0),
    "IQ4_XS_R8": Layout("IQ4_XS", 8, QK_K, 136, 0),
    "IQ4_KS_R4": Layout("IQ4_KS", 4, QK_K, 136, 4),
    "IQ5_KS_R4": Layout("IQ5_KS", 4, QK_K, 168, 4),
    "IQ2_K_R4": Layout("IQ2_K", 4, QK_K, 76, 0),
    "IQ3_K_R4": Layout("IQ3_K", 4, QK_K, 110, 0),
    "IQ4_K_R4": Layout("IQ4_K", 4, QK_K, 144, 0),
    "IQ5_K_R4": Layout("IQ5_K", 4, QK_K, 176, 0),
    "IQ2_XXS_R4": Layout("IQ2_XXS", 4, QK_K, 66, 0),
    "IQ3_XXS_R4": Layout("IQ3_XXS", 4, QK_K, 98, 0),
    "IQ2_XS_R4": Layout("IQ2_XS", 4, QK_K, 74, 0),
    "IQ2_S_R4": Layout("IQ2_S", 4, QK_K, 82, 0),
    "IQ3_S_R4": Layout("IQ3_S", 4, QK_K, 110, 0),
    "IQ1_S_R4": Layout("IQ1_S", 4, 32, 6, 2, _iq1s_to_base, _iq1s_from_base, _dq_iq1_s),
    "IQ1_M_R4": Layout(None, 4, 32, 7, 2, direct=_dq_iq1_m),
    "IQ2_BN_R4": Layout("IQ2_BN", 4, 64, 16, 4, direct=_dq_iq2_bn),
    "Q8_K_R8": Layout("Q8_K", 8, QK_K, 258, 0, _q8k_to_base, _q8k_from_base, _dq_q8_k),
    "Q8_KV_R8": Layout("Q8_KV", 8, 16, 16, 4, _q8kv_to_base, _q8kv_from_base, _dq_q8_kv),
    "BF16_R16": Layout("BF16", 16, 2, 4, 0),
}


def row_bytes(name: str, n_cols: int) -> int:
    """Bytes per row (the group's bytes / interleave), header included."""
    lay = LAYOUTS[name]
    if n_cols % lay.block:
        raise ValueError(f"{name}: row length {n_cols} is not a multiple of {lay.block}")
    return lay.hdr + n_cols // lay.block * lay.bb


# ------------------------------------------------------------------ the derived bit permutation

_PERMS: dict = {}


def _perm(name: str, device) -> tuple:
    """Gather tables (see _gather_bits) that undo PACKS[name], built on the CPU once per device."""
    key = (name, str(device))
    if key in _PERMS:
        return _PERMS[key]
    lay = LAYOUTS[name]
    n = lay.rows * lay.bb
    # probe s sets the input bits whose index has bit s set; an output bit's pattern over the probes
    # spells its source index (pack moves bits, checked below on random input).
    nprobe = (8 * n - 1).bit_length()
    ids = torch.arange(8 * n)
    x = ((ids.view(1, n, 8) >> torch.arange(nprobe).view(-1, 1, 1)) & 1) << torch.arange(8)
    y = PACKS[name](x.sum(-1).to(torch.uint8).view(nprobe, lay.rows, lay.bb))
    ybits = (y.to(torch.int32).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1      # [probe, n, 8]
    src_of = (ybits.long() << torch.arange(nprobe).view(-1, 1, 1)).sum(0).flatten()
    dst_of = torch.full((8 * n,), -1, dtype=torch.long)
    dst_of[src_of] = ids
    if (dst_of < 0).any():
        raise AssertionError(f"{name}: pack is not a bit permutation")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, lay.rows, lay.bb), dtype=torch.uint8, generator=g)
    tables = _tables(dst_of.view(n, 8))
    if not torch.equal(_gather_bits(PACKS[name](x), *tables), x.reshape(4, -1)):
        raise AssertionError(f"{name}: pack is not linear in the bits")
    _PERMS[key] = tuple(t.to(device) for t in tables)
    return _PERMS[key]


def _tables(where: torch.Tensor):
    """where [n, 8]: the input bit that gives bit t of output byte j -> gather tables, output bytes that
    are whole input bytes kept apart as plain copies."""
    sb, st = where // 8, where % 8
    whole = (sb == sb[:, :1]).all(1) & (st == torch.arange(8)).all(1)
    cj = whole.nonzero().flatten()
    bj = (~whole).nonzero().flatten()
    return cj, sb[cj, 0], bj, sb[bj], st[bj]


def _gather_bits(x, cj, cs, bj, bsrc, bsh):
    """x [M, n] bytes -> [M, n]: out[:, cj] = x[:, cs], and bit t of out[:, bj[u]] is bit bsh[u, t] of
    x[:, bsrc[u, t]]."""
    out = torch.empty_like(x)
    out[:, cj] = x[:, cs]
    if len(bj):
        acc = torch.zeros(x.shape[0], len(bj), dtype=torch.uint8, device=x.device)
        for t in range(8):
            acc |= ((x[:, bsrc[:, t]] >> bsh[:, t].to(torch.uint8)) & 1) << t
        out[:, bj] = acc
    return out


# ---------------------------------------------------------------------------- the public codecs

def _check(name: str, raw: torch.Tensor, n_cols: int) -> Layout:
    lay = LAYOUTS[name]
    rb = row_bytes(name, n_cols)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != rb or raw.shape[0] % lay.rows:
        raise ValueError(f"{name}: expected uint8 [k * {lay.rows}, {rb}], got {raw.dtype} {tuple(raw.shape)}")
    return lay


def _to_intermediate(name: str, raw: torch.Tensor, n_cols: int) -> torch.Tensor:
    lay = _check(name, raw, n_cols)
    R, nb, n = lay.rows, n_cols // lay.block, raw.shape[0]
    grp = raw.contiguous().reshape(n // R, R * row_bytes(name, n_cols))
    blk = _gather_bits(grp[:, R * lay.hdr:].reshape(-1, R * lay.bb), *_perm(name, raw.device))
    blk = blk.reshape(n // R, nb, R, lay.bb).transpose(1, 2).reshape(n, nb * lay.bb)
    rows = torch.cat([grp[:, :R * lay.hdr].reshape(n, lay.hdr), blk], -1)
    return RECODE[name](rows, lay.bb, lay.hdr, unscramble) if name in RECODE else rows


def _deinterleave_fn(name: str):
    lay = LAYOUTS[name]

    def deinterleave(raw: torch.Tensor, n_cols: int) -> torch.Tensor:
        """Interleaved rows [n, row_bytes] -> the base type's rows, in row order."""
        rows = _to_intermediate(name, raw, n_cols)
        return lay.to_base(rows, n_cols) if lay.to_base else rows
    deinterleave.__name__ = f"deinterleave_{name.lower()}"
    return deinterleave


def _interleave_fn(name: str):
    lay = LAYOUTS[name]

    def interleave(base: torch.Tensor, n_cols: int) -> torch.Tensor:
        """Base-type rows [n, base row bytes] (n a multiple of the interleave) -> interleaved rows."""
        rows = lay.from_base(base, n_cols) if lay.from_base else base
        if name in RECODE:
            rows = RECODE[name](rows, lay.bb, lay.hdr, scramble)
        R, nb, n = lay.rows, n_cols // lay.block, rows.shape[0]
        if rows.shape[1] != row_bytes(name, n_cols) or n % R:
            raise ValueError(f"{name}: bad base rows {tuple(base.shape)} for {n_cols} columns")
        blk = rows[:, lay.hdr:].reshape(n // R, R, nb, lay.bb).transpose(1, 2).reshape(-1, R, lay.bb)
        out = torch.cat([rows[:, :lay.hdr].reshape(n // R, R * lay.hdr), PACKS[name](blk).reshape(n // R, -1)], -1)
        return out.reshape(n, -1)
    interleave.__name__ = f"interleave_{name.lower()}"
    return interleave


def _base_dequantizer(base: str):
    from . import ref
    from .types import GGMLType
    t = GGMLType.__members__.get(base)
    if t is not None and t in ref.REF_TYPES:
        return lambda raw, n_cols: ref.dequantize(raw, t, n_cols)
    for mod in ("ref_mainline", "ref_ik", "ref_trellis"):
        try:
            table = importlib.import_module(f".{mod}", __package__).DEQUANTIZERS
        except ImportError:
            continue
        if base in table:
            return table[base]
    raise NotImplementedError(f"no reference dequantizer for the base type {base}")


def _dequantize_fn(name: str):
    lay = LAYOUTS[name]

    def dequantize(raw: torch.Tensor, n_cols: int) -> torch.Tensor:
        """Interleaved rows [n, row_bytes] -> float32 [n, n_cols], in row order."""
        rows = _to_intermediate(name, raw, n_cols)
        if lay.direct:
            return lay.direct(rows, n_cols)
        if lay.to_base:
            rows = lay.to_base(rows, n_cols)
        return _base_dequantizer(lay.base)(rows, n_cols).float()
    dequantize.__name__ = f"dequantize_{name.lower()}"
    return dequantize


DEQUANTIZERS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {k: _dequantize_fn(k) for k in LAYOUTS}
DEINTERLEAVE: dict[str, tuple[str, Callable]] = {
    k: (v.base, _deinterleave_fn(k)) for k, v in LAYOUTS.items() if v.base is not None}
INTERLEAVE: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    k: _interleave_fn(k) for k, v in LAYOUTS.items() if v.base is not None}
