"""Reference (pure torch) GGUF block (de)quantization.

Uses only torch ops, so it runs on CPU or GPU. dequantize() follows ggml's block
layouts and computes in float32 in the same operation order as
gguf.quants, so results are bit-exact with it.
"""
from __future__ import annotations

import math

import torch

from .types import GGMLType, block_size, row_bytes, type_size

QK_K = 256

# Doubled e2m1 values (MXFP4 scales are stored "halved" to match).
_KV_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_KV_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

_FLOAT = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}

REF_TYPES = (
    GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0,
    GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.MXFP4, GGMLType.IQ4_NL,
)
QUANTIZE_TYPES = (
    GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0,
    GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
)


# ----------------------------------------------------------------- helpers

def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """fp16 field at byte `off` of each block row -> float32 [N, 1]."""
    return b[:, off:off + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, 16] bytes -> [N, 32]: low nibbles are elements 0..15, high ones 16..31."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack Q4_K/Q5_K 12-byte scales -> (sc, min), each [N, 8] of 6-bit values."""
    a, m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([a & 63, (hi & 0xF) | ((a >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 63, (hi >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _pack_k_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Inverse of _k_scales: two [N, 8] uint8 (0..63) -> [N, 12] bytes."""
    lo_s, hi_s, lo_m, hi_m = sc[:, :4], sc[:, 4:], mn[:, :4], mn[:, 4:]
    return torch.cat([
        lo_s | ((hi_s >> 4) << 6),
        lo_m | ((hi_m >> 4) << 6),
        (hi_s & 0xF) | ((hi_m & 0xF) << 4),
    ], dim=-1)


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float [N] -> fp16 bytes [N, 2]."""
    return v.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _check(qtype: GGMLType, n_cols: int) -> None:
    if n_cols % block_size(qtype):
        raise ValueError(f"{qtype.name}: row length {n_cols} is not a multiple of {block_size(qtype)}")


# ------------------------------------------------------------- dequantize

def _dq_q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _dq_q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _dq_iq4_nl(b):
    kv = torch.tensor(_KV_IQ4NL, dtype=torch.float32, device=b.device)
    return _f16(b, 0) * kv[_nibbles(b[:, 2:]).long()]


def _dq_mxfp4(b):
    # e8m0 exponent -> 2^(e-128) (half of the scale, because kvalues are doubled);
    # e < 2 are denormals, built from bits exactly like ggml_e8m0_to_fp32_half.
    e = b[:, 0:1].to(torch.int32)
    d = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)
    kv = torch.tensor(_KV_MXFP4, dtype=torch.float32, device=b.device)
    return d * kv[_nibbles(b[:, 1:]).long()]


def _dq_q4_k(b):
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    dm = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    # 4 chunks of 32 bytes: low nibbles -> sub-block 2c, high -> 2c+1
    q = b[:, 16:].reshape(n, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8, device=b.device).view(1, 1, 2, 1)
    q = (q & 0xF).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def _dq_q5_k(b):
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    dm = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    ql = b[:, 48:].reshape(n, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8, device=b.device).view(1, 1, 2, 1)
    ql = (ql & 0xF).reshape(n, 8, 32)
    # bit i of qh[l] is the 5th bit of element l of sub-block i
    qh = b[:, 16:48].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    q = (ql | ((qh & 1) << 4)).float()
    return (d * q - dm).reshape(n, QK_K)


def _dq_q6_k(b):
    n = b.shape[0]
    dev = b.device
    # two halves of 128; within a half, ql[l] / ql[l+32] low nibbles -> elements l / l+32,
    # high nibbles -> l+64 / l+96; qh[l] bit pairs 0,2,4,6 -> l, l+32, l+64, l+96.
    ql = b[:, :128].reshape(n, 2, 1, 2, 32) >> torch.tensor([0, 4], dtype=torch.uint8, device=dev).view(1, 1, 2, 1, 1)
    ql = (ql & 0xF).reshape(n, QK_K)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=dev).view(1, 1, 4, 1)
    qh = (qh & 3).reshape(n, QK_K)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).float().reshape(n, 16, 16)
    d = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
    return (d * q).reshape(n, QK_K)


_DEQUANT = {
    GGMLType.Q8_0: _dq_q8_0, GGMLType.Q4_0: _dq_q4_0, GGMLType.IQ4_NL: _dq_iq4_nl,
    GGMLType.MXFP4: _dq_mxfp4, GGMLType.Q4_K: _dq_q4_k, GGMLType.Q5_K: _dq_q5_k,
    GGMLType.Q6_K: _dq_q6_k,
}


def dequantize(raw: torch.Tensor, qtype: GGMLType, n_cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 GGUF rows [..., row_bytes(qtype, n_cols)] -> [..., n_cols] in `dtype`."""
    qtype = GGMLType(qtype)
    _check(qtype, n_cols)
    if raw.dtype != torch.uint8 or raw.shape[-1] != row_bytes(qtype, n_cols):
        raise ValueError(f"{qtype.name}: expected uint8 [..., {row_bytes(qtype, n_cols)}], "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    lead = raw.shape[:-1]
    raw = raw.contiguous()
    if qtype in _FLOAT:
        return raw.view(_FLOAT[qtype]).to(dtype).reshape(*lead, n_cols)
    fn = _DEQUANT.get(qtype)
    if fn is None:
        raise NotImplementedError(f"no reference dequantizer for {qtype.name}")
    out = fn(raw.reshape(-1, type_size(qtype)))
    return out.to(dtype).reshape(*lead, n_cols)


# The "split" row layout of Q4_0 / Q8_0 for GPU-resident experts: each row's block quants first (16 or 32
# bytes a block, so 16-byte aligned when the row is), then its f16 scales. Same bytes, reordered within the
# row, so GPU kernels load the quants as 16-byte vectors instead of the 2-byte words an 18- or 34-byte block
# allows. Rows of a multiple of 256 columns only (their byte length, 18 or 34 x 8k, keeps every row aligned).
SPLIT_TYPES = (GGMLType.Q4_0, GGMLType.Q8_0)


def can_split(qtype, n_cols: int) -> bool:
    return GGMLType(qtype) in SPLIT_TYPES and n_cols % 256 == 0


def split_rows(raw: torch.Tensor, qtype: GGMLType) -> torch.Tensor:
    """GGUF rows [..., row_bytes] -> the split layout (a new tensor, same shape and device)."""
    bs = type_size(GGMLType(qtype))
    blk = raw.reshape(*raw.shape[:-1], -1, bs)
    return torch.cat([blk[..., 2:].flatten(-2), blk[..., :2].flatten(-2)], -1)


def join_rows(raw: torch.Tensor, qtype: GGMLType) -> torch.Tensor:
    """The split layout back to GGUF rows (for the dequantizing fallbacks, which read GGUF rows)."""
    bs = type_size(GGMLType(qtype))
    nblk = raw.shape[-1] // bs
    qs = raw[..., :nblk * (bs - 2)].reshape(*raw.shape[:-1], nblk, bs - 2)
    d = raw[..., nblk * (bs - 2):].reshape(*raw.shape[:-1], nblk, 2)
    return torch.cat([d, qs], -1).flatten(-2)


# --------------------------------------------------------------- quantize

def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C roundf (half away from zero), exact: no +0.5 rounding error."""
    a = v.abs()
    f = a.floor()
    return torch.copysign(torch.where(a - f >= 0.5, f + 1, f), v)


def _q_bf16(x):
    # ggml_compute_fp32_to_bf16: NaNs become quiet NaNs (sign kept), the rest round to
    # nearest even. int32 math cannot overflow here; only the low 16 bits are kept.
    n = x.contiguous().view(torch.int32)
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    r = torch.where(nan, (n >> 16) | 64, (n + 0x7FFF + ((n >> 16) & 1)) >> 16)
    r = ((r & 0xFFFF) ^ 0x8000) - 0x8000  # low 16 bits as a signed int16 value
    return r.to(torch.int16).view(torch.uint8)


def _q_q8_0(x):
    d = x.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(x * inv).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], dim=-1)


def _q_q4_0(x):
    # d maps the signed max-|x| element to -8 (ggml quantize_row_q4_0_ref)
    mx = x.gather(-1, x.abs().argmax(-1, keepdim=True))
    d = mx / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(x * inv + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), q[:, :16] | (q[:, 16:] << 4)], dim=-1)


def _safe_inv(v):
    return torch.where(v != 0, 1 / torch.where(v != 0, v, torch.ones_like(v)), torch.zeros_like(v))


def _lsq_asym(x, q, fallback_scale, fallback_lo):
    """Least-squares (scale, lo) for x ~ scale*q + lo with lo <= 0, per row [M, 1]."""
    n = x.shape[-1]
    sx, sq = x.sum(-1, keepdim=True), q.sum(-1, keepdim=True)
    sqq, sqx = (q * q).sum(-1, keepdim=True), (q * x).sum(-1, keepdim=True)
    det = n * sqq - sq * sq
    ok = det > 0
    scale = torch.where(ok, (n * sqx - sq * sx) / torch.where(ok, det, torch.ones_like(det)), fallback_scale)
    lo = torch.where(ok, (sx - scale * sq) / n, fallback_lo)
    # min must stay <= 0 (it is stored as a non-negative m): refit scale alone if clamped
    scale = torch.where(lo > 0, sqx * _safe_inv(sqq), scale).clamp(min=0)
    return scale, lo.clamp(max=0)


def _fit_asym(x, nmax, n_refine=2):
    """x [M, 32] ~ scale*q - m with q in [0, nmax], m >= 0. Like ggml's make_qkx2_quants:
    try 21 stretches of the min/max grid, least-squares fit each, keep the best;
    then a few rounding/refit iterations. Returns (scale, m), each [M, 1]."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    rng_inv = _safe_inv(x.amax(-1, keepdim=True) - lo)
    best = None
    for i in range(21 + n_refine):
        if i < 21:
            iscale = (nmax - 1 + 0.1 * i) * rng_inv
            q = torch.round((x - lo) * iscale).clamp(0, nmax)
            s, l = _lsq_asym(x, q, _safe_inv(iscale), lo)
        else:  # requantize on the best grid so far
            q = torch.round((x - bl) * _safe_inv(bs)).clamp(0, nmax)
            s, l = _lsq_asym(x, q, bs, bl)
        err = ((s * q + l - x) ** 2).sum(-1, keepdim=True)
        if best is None:
            best, bs, bl = err, s, l
        else:
            better = err < best
            best, bs, bl = torch.where(better, err, best), torch.where(better, s, bs), torch.where(better, l, bl)
    return bs, -bl


def _q_k_asym(x, nmax):
    """Shared Q4_K/Q5_K quantizer: x [N, 256] -> (d, dmin, sc, mn, q[N, 8, 32])."""
    n = x.shape[0]
    xs = x.reshape(n * 8, 32)
    scale, m = _fit_asym(xs, nmax)
    scale, m = scale.reshape(n, 8), m.reshape(n, 8)
    # 6-bit sub-block scales/mins relative to fp16 super-block d/dmin
    d = (scale.amax(-1, keepdim=True) / 63).half().float()
    dmin = (m.amax(-1, keepdim=True) / 63).half().float()
    sc = torch.round(scale * _safe_inv(d)).clamp(0, 63)
    mn = torch.round(m * _safe_inv(dmin)).clamp(0, 63)
    ds, dm = (d * sc).unsqueeze(-1), (dmin * mn).unsqueeze(-1)
    q = torch.round((x.reshape(n, 8, 32) + dm) * _safe_inv(ds)).clamp(0, nmax).to(torch.uint8)
    return d, dmin, sc.to(torch.uint8), mn.to(torch.uint8), q


def _q_q4_k(x):
    n = x.shape[0]
    d, dmin, sc, mn, q = _q_k_asym(x, 15)
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qs], dim=-1)


def _q_q5_k(x):
    n = x.shape[0]
    d, dmin, sc, mn, q = _q_k_asym(x, 31)
    lo = (q & 0xF).reshape(n, 4, 2, 32)
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
    shifts = torch.arange(8, device=x.device).view(1, 8, 1)
    qh = ((q >> 4).long() << shifts).sum(1).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qh, qs], dim=-1)


def _signed_absmax(v):
    return v.gather(-1, v.abs().argmax(-1, keepdim=True))


def _q_q6_k(x):
    n = x.shape[0]
    xs = x.reshape(n * 16, 16)
    # per 16, like ggml's make_qx_quants: grids mapping the signed max-|x| near -32,
    # least-squares scale for each; keep the one with the largest sum(qx)^2/sum(qq)
    # (= smallest squared error)
    inv_max = _safe_inv(_signed_absmax(xs))
    best = None
    for i in range(-9, 10):
        q = torch.round(xs * (-(32 + 0.1 * i) * inv_max)).clamp(-32, 31)
        sqx, sqq = (q * xs).sum(-1), (q * q).sum(-1)
        s, gain = sqx * _safe_inv(sqq), sqx * sqx * _safe_inv(sqq)
        if best is None:
            best, scale = gain, s
        else:
            better = gain > best
            best, scale = torch.where(better, gain, best), torch.where(better, s, scale)
    scale = scale.reshape(n, 16)
    # int8 sub-block scales relative to fp16 d (signed max scale -> -128)
    d = (_signed_absmax(scale) / -128).half().float()
    sc = torch.round(scale * _safe_inv(d)).clamp(-128, 127)
    ds = (d * sc).unsqueeze(-1)
    q = (torch.round(x.reshape(n, 16, 16) * _safe_inv(ds)).clamp(-32, 31) + 32).to(torch.uint8)
    q = q.reshape(n, 2, 2, 2, 32)  # [half, nibble, ql 32-group, l]
    ql = ((q[:, :, 0] & 0xF) | (q[:, :, 1] << 4)).reshape(n, 128)
    hi = (q >> 4).reshape(n, 2, 4, 32).long() << (2 * torch.arange(4, device=x.device)).view(1, 1, 4, 1)
    qh = hi.sum(2).to(torch.uint8).reshape(n, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)], dim=-1)


_QUANT = {GGMLType.Q8_0: _q_q8_0, GGMLType.Q4_0: _q_q4_0, GGMLType.Q4_K: _q_q4_k,
          GGMLType.Q5_K: _q_q5_k, GGMLType.Q6_K: _q_q6_k}


def quantize(x: torch.Tensor, qtype: GGMLType) -> torch.Tensor:
    """float [..., n] -> uint8 GGUF rows [..., row_bytes(qtype, n)].

    F16/BF16/Q8_0/Q4_0 match ggml's reference quantizers (and gguf.quants)
    bit-exactly; Q4_K/Q5_K/Q6_K use a simpler (non-identical) scale search."""
    qtype = GGMLType(qtype)
    n = x.shape[-1]
    _check(qtype, n)
    lead = x.shape[:-1]
    x = x.float().contiguous()
    if qtype == GGMLType.F32:
        out = x.view(torch.uint8)
    elif qtype == GGMLType.F16:
        out = x.half().view(torch.uint8)
    elif qtype == GGMLType.BF16:
        out = _q_bf16(x)
    elif qtype in _QUANT:
        out = _QUANT[qtype](x.reshape(-1, block_size(qtype)))
    else:
        raise NotImplementedError(f"no reference quantizer for {qtype.name}")
    return out.reshape(*lead, row_bytes(qtype, n))


# ----------------------------------------------------------- random blocks

def _rms(vals) -> float:
    return math.sqrt(sum(v * v for v in vals) / len(vals))


def _rand_bytes(nbytes: int, g: torch.Generator) -> torch.Tensor:
    # full-range int64 fill is ~4x faster than a uint8 randint
    words = torch.empty((nbytes + 7) // 8, dtype=torch.int64, device=g.device)
    return words.random_(-(2 ** 63), None, generator=g).view(torch.uint8)[:nbytes]


def _uniform(n: int, lo: float, hi: float, g: torch.Generator) -> torch.Tensor:
    return torch.rand(n, generator=g, device=g.device) * (hi - lo) + lo


def _randint(n: int, lo: int, hi: int, g: torch.Generator) -> torch.Tensor:
    """uint8 in [lo, hi]."""
    return torch.randint(lo, hi + 1, (n,), generator=g, device=g.device).to(torch.uint8)


def random_blocks(qtype: GGMLType, shape: tuple, generator: torch.Generator, scale: float = 0.02) -> torch.Tensor:
    """Valid random GGUF rows for a tensor of `shape` (last dim = n_cols) on the
    generator's device: uint8 [..., row_bytes]. Dequantized values are finite,
    roughly zero-mean with std ~ `scale` (block scales are never zero)."""
    qtype = GGMLType(qtype)
    shape = tuple(int(s) for s in shape)
    g = generator
    n_cols = shape[-1]
    _check(qtype, n_cols)
    if qtype in _FLOAT:
        x = torch.randn(shape, generator=g, device=g.device) * scale
        return x.to(_FLOAT[qtype]).view(torch.uint8)  # no NaNs/denormals: plain cast is exact
    if qtype not in _DEQUANT:
        raise NotImplementedError(f"no random blocks for {qtype.name}")
    ts = type_size(qtype)
    nb = math.prod(shape[:-1]) * (n_cols // block_size(qtype))
    b = _rand_bytes(nb * ts, g).reshape(nb, ts)
    # per-block multiplier u in [0.5, 1.5]: d = u * scale / rms(q * sub-scale)
    u = _uniform(nb, 0.5, 1.5, g) * (scale / math.sqrt(13 / 12))  # E[u^2] = 13/12
    if qtype == GGMLType.Q8_0:
        b[:, 0:2] = _f16_bytes(u / _rms(range(-128, 128)))
    elif qtype == GGMLType.Q4_0:
        b[:, 0:2] = _f16_bytes(u / _rms(range(-8, 8)))
    elif qtype == GGMLType.IQ4_NL:
        b[:, 0:2] = _f16_bytes(u / _rms(_KV_IQ4NL))
    elif qtype == GGMLType.MXFP4:
        # power-of-two scale: mix exponents a and a+1 so that E[d^2] matches the target
        t = scale / _rms(_KV_MXFP4)
        a = math.floor(math.log2(t))
        p = (t * t / 4.0 ** a - 1) / 3
        e = 128 + a + (torch.rand(nb, generator=g, device=g.device) < p).to(torch.int64)
        b[:, 0] = e.clamp(2, 254).to(torch.uint8)
    elif qtype in (GGMLType.Q4_K, GGMLType.Q5_K):
        # sub-block scales in [16, 63] and mins equal to them, with dmin = d * mean(q):
        # each sub-block is centred on zero
        nmax = 15 if qtype == GGMLType.Q4_K else 31
        sc = _randint(nb * 8, 16, 63, g).reshape(nb, 8)
        d = u / (_rms(range(16, 64)) * _rms([q - nmax / 2 for q in range(nmax + 1)]))
        b[:, 0:2] = _f16_bytes(d)
        b[:, 2:4] = _f16_bytes(d * (nmax / 2))
        b[:, 4:16] = _pack_k_scales(sc, sc)
    elif qtype == GGMLType.Q6_K:
        sc = _randint(nb * 16, 16, 127, g).reshape(nb, 16)
        b[:, 192:208] = sc
        b[:, 208:210] = _f16_bytes(u / (_rms(range(16, 128)) * _rms(range(-32, 32))))
    return b.reshape(*shape[:-1], row_bytes(qtype, n_cols))
