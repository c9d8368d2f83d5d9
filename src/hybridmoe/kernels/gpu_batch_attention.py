"""Batched decode attention: B single-token queries, each over its own sequence's KV cache up to its own
position, in three launches for the whole batch (not a few per sequence).

Each sequence has its own cache tensors (one KVCache per server slot). The kernels reach them through one
anchor tensor and per-sequence element offsets from it (`cache_offsets`), so a CUDA graph that holds the
anchor serves any set of caches: only the offsets and the positions (device tensors) change between replays.
A position of -1 marks a padded row (a batch padded up to its bucket): it writes nothing and outputs zeros.

- qk_rope_cache_batch: q/k RMSNorm (optional) + RoPE at each row's position, the k/v cache writes.
- attention_batch: flash-decoding splits per (sequence, KV head), then a merge per (sequence, query head).
Checked against torch's attention per sequence in tests/test_gpu_batch.py."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from .gpu_attention import _rope_rows
except ImportError:                                      # CPU-only installs
    triton = None

from .gpu_attention import ATTN_BLOCK, ATTN_CHUNK, _pow2, on_device

ALIGN = 16                                               # offsets are multiples of this (allocations are 512 B)

if triton is not None:
    @triton.jit
    def _qk_rope_cache_batch_kernel(qkv, qkv_stride, qn_w, kn_w, cos, sin, pos, anchor, koff, voff, q_out,
                                    skh, skn, svh, svn, nh, nkv, eps, n_slots, D: tl.constexpr, NEOX: tl.constexpr,
                                    HAS_NORM: tl.constexpr):
        """Row b's head hd: q heads normed, roped, stored as q_out[b, hd]; k heads normed, roped and written
        with v to sequence b's cache at its position's slot, p % n_slots (cos/sin rows indexed by the position)."""
        hd = tl.program_id(0)                          # q heads, then k heads
        b = tl.program_id(1)
        p = tl.load(pos + b).to(tl.int64)
        if p >= 0:
            d = tl.arange(0, D)
            one = tl.arange(0, 1)
            rm = one[:, None] < 1
            row = qkv + b.to(tl.int64) * qkv_stride + one[:, None] * 0
            cos_p, sin_p = cos + p * D, sin + p * D
            if hd < nh:
                y = _rope_rows(row + hd * D, qn_w, cos_p, sin_p, d, rm, eps, D, NEOX, HAS_NORM)
                tl.store(q_out + (b * nh + hd).to(tl.int64) * D + one[:, None] * 0 + d[None, :],
                         y.to(q_out.dtype.element_ty))
            else:
                hk = hd - nh
                ko = tl.multiple_of(tl.load(koff + b), 16)
                vo = tl.multiple_of(tl.load(voff + b), 16)
                y = _rope_rows(row + hd * D, kn_w, cos_p, sin_p, d, rm, eps, D, NEOX, HAS_NORM)
                sl = p % n_slots
                tl.store(anchor + ko + hk * skh + sl * skn + one[:, None] * 0 + d[None, :],
                         y.to(anchor.dtype.element_ty))
                v = tl.load(row + (nh + nkv + hk) * D + d[None, :])
                tl.store(anchor + vo + hk * svh + sl * svn + one[:, None] * 0 + d[None, :],
                         v.to(anchor.dtype.element_ty))

    @triton.jit
    def _attn_batch_partial_kernel(q, anchor, koff, voff, pos, o_part, m_part, l_part, chunk, n_split, scale,
                                   skh, skn, svh, svn, nkv, n_slots, window, G: tl.constexpr, GP: tl.constexpr,
                                   D: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr, WIN: tl.constexpr):
        """Split s of KV head h of sequence b: the G query heads of h over slots s*chunk.. of b's cache (those
        in use at its position p), unnormalized, with the running max and sum for the merge. WIN: slots holding
        a position at or before p - window are left out (slot n holds p - (p - n) mod n_slots, or a later row's
        position of the same prompt chunk, which the window hides as well: kvcache.KVCache.check_rings)."""
        h = tl.program_id(0)
        s = tl.program_id(1)
        b = tl.program_id(2)
        p = tl.load(pos + b).to(tl.int32)
        L = tl.minimum(p + 1, n_slots)                 # a padded row (-1) has no keys
        lo = s * chunk
        hi = tl.minimum(lo + chunk, L)
        if lo < hi:
            g = tl.arange(0, GP)
            gm = g < G
            d = tl.arange(0, D)
            nh = nkv * G
            qv = tl.load(q + ((b * nh + h * G + g).to(tl.int64))[:, None] * D + d[None, :], mask=gm[:, None],
                         other=0)
            qv = (qv.to(tl.float32) * scale).to(anchor.dtype.element_ty)
            kbase = anchor + tl.multiple_of(tl.load(koff + b), 16) + h * skh
            vbase = anchor + tl.multiple_of(tl.load(voff + b), 16) + h * svh
            m_i = tl.full([GP], float("-inf"), tl.float32)
            l_i = tl.zeros([GP], tl.float32)
            acc = tl.zeros([GP, D], tl.float32)
            for start in range(lo, hi, BN):
                n = start + tl.arange(0, BN)
                nm = n < hi
                kt = tl.load(kbase + n.to(tl.int64)[:, None] * skn + d[None, :], mask=nm[:, None], other=0)
                if IEEE:
                    sc = tl.dot(qv, tl.trans(kt), input_precision="ieee")             # [GP, BN]
                else:
                    sc = tl.dot(qv, tl.trans(kt))
                if WIN:
                    nm = nm & ((p - n) % n_slots < window)
                sc = tl.where(nm[None, :], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, axis=1))
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)     # every key so far hidden: no NaN
                alpha = tl.exp(m_i - m_sub)
                pr = tl.exp(sc - m_sub[:, None])
                l_i = l_i * alpha + tl.sum(pr, axis=1)
                vt = tl.load(vbase + n.to(tl.int64)[:, None] * svn + d[None, :], mask=nm[:, None], other=0)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(pr.to(vt.dtype), vt, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(pr.to(vt.dtype), vt)
                m_i = m_new
            row = ((b * nkv + h) * n_split + s) * G + g
            tl.store(o_part + row.to(tl.int64)[:, None] * D + d[None, :], acc, mask=gm[:, None])
            tl.store(m_part + row, m_i, mask=gm)
            tl.store(l_part + row, l_i, mask=gm)

    @triton.jit
    def _attn_batch_merge_kernel(o_part, m_part, l_part, pos, out, out_stride, chunk, n_split, nkv, n_slots, sinks,
                                 G: tl.constexpr, D: tl.constexpr, SB: tl.constexpr, SINK: tl.constexpr):
        """Query head qh of sequence b from its splits (zeros for a padded row); SINK: its sink logit sinks[qh]
        joins the softmax's denominator."""
        qh = tl.program_id(0)
        b = tl.program_id(1)
        h = qh // G
        g = qh % G
        L = tl.minimum(tl.load(pos + b).to(tl.int32) + 1, n_slots)
        n_valid = tl.minimum((L + chunk - 1) // chunk, n_split)
        sb = tl.arange(0, SB)
        d = tl.arange(0, D)
        base = (b * nkv + h) * n_split
        M = tl.full([SB], float("-inf"), tl.float32)
        for s0 in range(0, n_valid, SB):
            sm = s0 + sb < n_valid
            M = tl.maximum(M, tl.load(m_part + (base + s0 + sb) * G + g, mask=sm, other=float("-inf")))
        Mx = tl.max(M, axis=0)
        if SINK:
            sink = tl.load(sinks + qh).to(tl.float32)
            Mx = tl.where(n_valid > 0, tl.maximum(Mx, sink), Mx)
        acc = tl.zeros([D], tl.float32)
        lsum = tl.zeros([SB], tl.float32)
        for s0 in range(0, n_valid, SB):
            sm = s0 + sb < n_valid
            row = (base + s0 + sb) * G + g
            w = tl.exp(tl.load(m_part + row, mask=sm, other=float("-inf")) - Mx)
            lsum += tl.where(sm, w * tl.load(l_part + row, mask=sm, other=0), 0.0)
            o = tl.load(o_part + row.to(tl.int64)[:, None] * D + d[None, :], mask=sm[:, None], other=0)
            acc += tl.sum(tl.where(sm[:, None], w[:, None] * o, 0.0), axis=0)
        tot = tl.sum(lsum, axis=0)
        if SINK:
            tot += tl.exp(sink - Mx)
        v = tl.where(n_valid > 0, acc / tl.where(n_valid > 0, tot, 1.0), 0.0)
        tl.store(out + b.to(tl.int64) * out_stride + qh * D + d, v.to(out.dtype.element_ty))


def available() -> bool:
    return triton is not None


def batch_caches_ok(kcs, vcs) -> bool:
    """Whether one launch can serve these caches: one dtype (f16, bf16 or f32) and one shape for all keys and
    values, one device, contiguous (as KVCache allocates them)."""
    k0 = kcs[0]
    return (k0.dtype in (torch.float16, torch.bfloat16, torch.float32) and k0.is_contiguous()
            and all(t.dtype == k0.dtype and t.shape[:2] == k0.shape[:2] and t.device == k0.device
                    and t.is_contiguous() for t in (*kcs, *vcs))
            and all(t.shape == k0.shape for t in (*kcs, *vcs)))


def cache_offsets(anchor: torch.Tensor, tensors) -> list[int]:
    """Each tensor's start as an element offset from anchor's (same dtype and device)."""
    es = anchor.element_size()
    offs = []
    for t in tensors:
        delta = t.data_ptr() - anchor.data_ptr()
        if delta % (es * ALIGN):
            raise ValueError("a cache tensor is not aligned to 16 elements from the anchor")
        offs.append(delta // es)
    return offs


def n_splits(n_keys: int) -> tuple[int, int]:
    """(keys per split, splits) for attention over at most n_keys keys (as kernels/gpu_attention.attention)."""
    chunk = ATTN_CHUNK
    if n_keys > 512 * ATTN_CHUNK:
        chunk = -(-n_keys // (512 * ATTN_BLOCK)) * ATTN_BLOCK
    return chunk, -(-n_keys // chunk)


def qk_rope_cache_batch(qkv, q_norm, k_norm, cos, sin, pos, anchor, koff, voff, kshape, vshape, n_head, eps, neox,
                        q_dtype=torch.float32, q_out=None):
    """qkv [B, (nh + 2 nkv) D] (rows may be strided): one token per sequence, at positions pos [B] (int64
    device tensor; -1: a padded row). Returns q [B, nh, D] in q_dtype, normed and roped; k (normed, roped) and
    v are written to each sequence's cache: anchor + koff[b] / voff[b] (element offsets, int64 [B] on the
    device) hold [nkv, n, D] tensors of anchor's dtype (kshape, vshape; position p in slot p % n). cos/sin
    [n_ctx, D] float32."""
    B = qkv.shape[0]
    nkv, n_ctx, D = kshape
    q = q_out if q_out is not None else torch.empty(B, n_head, D, dtype=q_dtype, device=qkv.device)
    has_norm = q_norm is not None
    with on_device(qkv):
        _qk_rope_cache_batch_kernel[(n_head + nkv, B)](
            qkv, qkv.stride(0), q_norm if has_norm else cos, k_norm if has_norm else cos, cos, sin, pos, anchor,
            koff, voff, q, n_ctx * D, D, vshape[1] * vshape[2], vshape[2], n_head, nkv, eps, n_ctx,
            D=D, NEOX=neox, HAS_NORM=has_norm)
    return q


def attention_batch(q, anchor, koff, voff, pos, kshape, vshape, scale, n_keys: int, out=None,
                    out_dtype=torch.bfloat16, parts=None, sinks=None, window: int = 0):
    """q [B, nh, D]: sequence b's query at position pos[b] over its cache's positions 0..pos[b] (anchor +
    koff[b], voff[b]: [nkv, n, D], position p in slot p % n); n_keys bounds every pos[b] + 1 (the context, for
    a captured step; the longest sequence, eagerly). Returns out [B, nh * Dv] (zeros for a padded row). parts:
    the split buffers (split_buffers), for a captured step's fixed addresses. sinks: float32 [nh], one more
    logit per head in the softmax (gpt-oss); window > 0: the keys of positions pos[b] - window + 1..pos[b]
    only (a ring's slots)."""
    B, nh, D = q.shape
    nkv, n_ctx, _ = kshape
    Dv = vshape[2]
    G = nh // nkv
    chunk, n_split = n_splits(min(n_keys, n_ctx))
    if parts is None:
        parts = split_buffers(B, nh, Dv, n_split, q.device)
    o_part, m_part, l_part = parts
    if out is None:
        out = torch.empty(B, nh * Dv, dtype=out_dtype, device=q.device)
    with on_device(q):
        _attn_batch_partial_kernel[(nkv, n_split, B)](
            q, anchor, koff, voff, pos, o_part, m_part, l_part, chunk, n_split, scale,
            n_ctx * D, D, vshape[1] * Dv, Dv, nkv, n_ctx, int(window), G=G, GP=max(16, _pow2(G)), D=D,
            BN=ATTN_BLOCK, IEEE=anchor.dtype == torch.float32, WIN=window > 0)
        _attn_batch_merge_kernel[(nh, B)](o_part, m_part, l_part, pos, out, out.stride(0), chunk, n_split, nkv,
                                          n_ctx, sinks if sinks is not None else m_part,
                                          G=G, D=Dv, SB=16, SINK=sinks is not None)
    return out


def split_bytes(B: int, nh: int, Dv: int, n_split: int) -> int:
    """The bytes split_buffers allocates for these sizes."""
    return B * nh * n_split * (Dv + 2) * 4


def split_buffers(B: int, nh: int, Dv: int, n_split: int, device):
    """The partial results' buffers of attention_batch for B sequences and n_split splits."""
    o_part = torch.empty(B * nh * n_split, Dv, dtype=torch.float32, device=device)
    m_part = torch.empty(B * nh * n_split, dtype=torch.float32, device=device)
    return o_part, m_part, torch.empty_like(m_part)
