"""Triton attention kernels of the decode and prompt steps: q/k RMSNorm + RoPE with the cache write
(qk_rope_cache), flash-decoding over the cache up to the position held in device memory (attention: splits,
then one merge that can also write the output in int8 terms), and a prompt chunk's causal flash attention
(attention_prefill). Checked against torch in tests/test_gpu_decode.py.

A cache of n slots holds position p in slot p % n: the whole context where n exceeds every position, a sliding
window's ring (kvcache.update_window's layout) where it does not. Decode attention takes gpt-oss's block too: a
window (keys p - window + 1..p only) over such a ring, and one sink logit per head in the softmax's denominator;
so does a prompt chunk's attention."""
from __future__ import annotations

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl

    from .gpu_dequant import quant_blocks as _quant_blocks
except ImportError:                                      # CPU-only installs
    triton = None

ATTN_BLOCK = 32                                          # keys per inner step
ATTN_CHUNK = 256                                         # keys per split (programs past the position exit)
# the decode attention with RoPE fused in computes wrong values (NaN at position 0) for 16-wide heads on an H100,
# though right in Triton's interpreter (test_attention_with_rope_fused; the roped query tile feeds the dot
# directly there, the cause is not known): narrower heads take qk_rope_cache, then the attention
FUSED_ROPE_MIN_D = 32
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter: one tile, no inline PTX

if triton is not None:
    @triton.jit
    def _qk_rope_cache_kernel(qkv, qkv_stride, qn_w, kn_w, cos, sin, pos, pos0, cos_first, q_out, q_stride, kc, vc,
                              skh, skn, svh, svn, n_slots, T, nh, nkv, eps, D: tl.constexpr, NEOX: tl.constexpr,
                              HAS_NORM: tl.constexpr, POS_PTR: tl.constexpr, BT: tl.constexpr):
        """Tokens t of a block (positions p0 + t, p0 read from pos or given) of head hd: q heads are normed,
        roped and stored as q_out[hd, t]; k heads normed, roped and written to the cache with v (slot p % n_slots)."""
        hd = tl.program_id(0)                          # q heads, then k heads
        t = tl.program_id(1) * BT + tl.arange(0, BT)
        tm = t < T
        # pos0 + a zero: Triton passes an int argument of value 1 as a constant, which has no .to()
        p0 = tl.load(pos).to(tl.int64) if POS_PTR else pos0 + tl.zeros([], tl.int64)
        p = p0 + t
        i = tl.arange(0, D)
        row = qkv + t.to(tl.int64)[:, None] * qkv_stride
        crow = (p - cos_first)[:, None] * D            # cos/sin rows hold positions cos_first..
        rm = tm[:, None]
        if hd < nh:
            y = _rope_rows(row + hd * D, qn_w, cos + crow, sin + crow, i, rm, eps, D, NEOX, HAS_NORM)
            tl.store(q_out + hd * q_stride + t[:, None] * D + i[None, :], y.to(q_out.dtype.element_ty), mask=rm)
        else:
            y = _rope_rows(row + hd * D, kn_w, cos + crow, sin + crow, i, rm, eps, D, NEOX, HAS_NORM)
            hk = hd - nh
            sl = (p % n_slots)[:, None]                # the slot of each position (a ring's, or the position)
            tl.store(kc + hk * skh + sl * skn + i[None, :], y.to(kc.dtype.element_ty), mask=rm)
            v = tl.load(row + (nh + nkv + hk) * D + i[None, :], mask=rm, other=0)
            tl.store(vc + hk * svh + sl * svn + i[None, :], v.to(vc.dtype.element_ty), mask=rm)

    @triton.jit
    def _rope_rows(src, w, cos_p, sin_p, d, rm, eps, D: tl.constexpr, NEOX: tl.constexpr, HAS_NORM: tl.constexpr):
        """Rows [R, D] at src (row offsets already applied, masked by rm): RMSNorm with w (optional), then
        RoPE with cos/sin rows at cos_p/sin_p (one position's, or [R, 1] pointers: each row's own); float32."""
        if NEOX:
            partner = (d + D // 2) % D
            sign = tl.where(d < D // 2, -1.0, 1.0)
        else:
            partner = d ^ 1
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
        x = tl.load(src + d[None, :], mask=rm, other=0).to(tl.float32)
        xp = tl.load(src + partner[None, :], mask=rm, other=0).to(tl.float32)
        if HAS_NORM:
            r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
            x = x * r[:, None] * tl.load(w + d)[None, :]
            xp = xp * r[:, None] * tl.load(w + partner)[None, :]
        # masked: the rows past the last token of a block have no cos/sin row (past the table's end)
        c = tl.load(cos_p + d[None, :], mask=rm, other=0)
        s = tl.load(sin_p + d[None, :], mask=rm, other=0)
        return x * c + sign[None, :] * xp * s

    @triton.jit
    def _attn_partial_kernel(q, kc, vc, pos, o_part, m_part, l_part, chunk, n_split, scale,
                             skh, skn, svh, svn, qn_w, kn_w, cos, sin, nh, nkv, eps, n_slots, window,
                             G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                             ROPE: tl.constexpr, NEOX: tl.constexpr, HAS_NORM: tl.constexpr, WIN: tl.constexpr):
        """Flash-decoding split s of KV head h over the slots filled so far. ROPE: q is the fused qkv row; this
        program norms and ropes its query heads itself, and the split holding the position's slot computes the
        new key/value from qkv, uses them for that slot and writes them to the cache (no other split reads it this
        step). WIN: slots holding a position at or before p - window are left out (each slot's position from the
        ring's layout)."""
        h = tl.program_id(0)                           # KV head
        s = tl.program_id(1)                           # split of the cache
        p = tl.load(pos).to(tl.int32)
        L = tl.minimum(p + 1, n_slots)                 # slots in use
        sp = p % n_slots                               # the position's slot
        lo = s * chunk
        hi = tl.minimum(lo + chunk, L)
        if lo < hi:
            g = tl.arange(0, GP)
            gm = g < G
            d = tl.arange(0, D)
            if ROPE:
                cos_p, sin_p = cos + p.to(tl.int64) * D, sin + p.to(tl.int64) * D
                qv = _rope_rows(q + (h * G + g)[:, None] * D, qn_w, cos_p, sin_p, d, gm[:, None], eps,
                                D, NEOX, HAS_NORM)
                one = tl.arange(0, 1)
                knew = _rope_rows(q + (nh + h + one)[:, None] * D, kn_w, cos_p, sin_p, d, one[:, None] < 1, eps,
                                  D, NEOX, HAS_NORM).to(kc.dtype.element_ty)                 # [1, D]
                vnew = tl.load(q + (nh + nkv + h) * D + d[None, :] + one[:, None] * 0).to(vc.dtype.element_ty)
                if (lo <= sp) & (sp < hi):             # this split holds the position's slot: write the cache
                    tl.store(kc + h * skh + sp.to(tl.int64) * skn + d[None, :] + one[:, None] * 0, knew)
                    tl.store(vc + h * svh + sp.to(tl.int64) * svn + d[None, :] + one[:, None] * 0, vnew)
            else:
                qv = tl.load(q + (h * G + g)[:, None] * D + d[None, :], mask=gm[:, None], other=0)
            qv = (qv * scale).to(kc.dtype.element_ty)
            m_i = tl.full([GP], float("-inf"), tl.float32)
            l_i = tl.zeros([GP], tl.float32)
            acc = tl.zeros([GP, D], tl.float32)
            for start in range(lo, hi, BN):
                n = start + tl.arange(0, BN)
                nm = n < hi
                kt = tl.load(kc + h * skh + n.to(tl.int64)[:, None] * skn + d[None, :], mask=nm[:, None], other=0)
                if ROPE:
                    kt = tl.where((n == sp)[:, None], knew, kt)
                sc = tl.dot(qv, tl.trans(kt))                                  # [GP, BN]
                if WIN:                                # slot n holds position p - (p - n) mod n_slots
                    nm = nm & ((p - n) % n_slots < window)
                sc = tl.where(nm[None, :], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, axis=1))
                # a window can hide every key so far (m_new -inf): then alpha and pr are 0, not exp(-inf + inf)
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_sub)
                pr = tl.exp(sc - m_sub[:, None])
                l_i = l_i * alpha + tl.sum(pr, axis=1)
                vt = tl.load(vc + h * svh + n.to(tl.int64)[:, None] * svn + d[None, :], mask=nm[:, None], other=0)
                if ROPE:
                    vt = tl.where((n == sp)[:, None], vnew, vt)
                acc = acc * alpha[:, None] + tl.dot(pr.to(vt.dtype), vt)
                m_i = m_new
            row = (h * n_split + s) * G + g
            tl.store(o_part + row[:, None] * D + d[None, :], acc, mask=gm[:, None])
            tl.store(m_part + row, m_i, mask=gm)
            tl.store(l_part + row, l_i, mask=gm)

    @triton.jit
    def _attn_prefill_kernel(q, kc, vc, pos, out, T, scale, skh, skn, svh, svn, so, n_slots, window, sinks,
                             G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             WIN: tl.constexpr, SINK: tl.constexpr):
        """Causal attention of BM query rows of head qh (positions p0 + t, p0 read from pos) over the cache up to
        each row's position: flash attention with the online softmax, K/V read in blocks of BN key positions
        (position n in slot n % n_slots). WIN: a row at position p sees keys p - window + 1..p only; SINK: the
        head's sink logit sinks[qh] joins each row's softmax denominator."""
        mb = tl.program_id(0)
        qh = tl.program_id(1)
        h = qh // G
        p0 = tl.load(pos).to(tl.int32)
        t = mb * BM + tl.arange(0, BM)
        tm = t < T
        d = tl.arange(0, D)
        qv = tl.load(q + (qh * T + t.to(tl.int64))[:, None] * D + d[None, :], mask=tm[:, None], other=0)
        qv = (qv * scale).to(q.dtype.element_ty)
        qpos = p0 + t
        hi = p0 + tl.minimum(mb * BM + BM, T)          # keys 0..hi-1: the block's last row sees them all
        lo = 0
        if WIN:                                        # the block's first row sees nothing before this
            lo = tl.maximum(p0 + mb * BM - window + 1, 0)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for start in range(lo, hi, BN):
            n = start + tl.arange(0, BN)
            nm = n < hi
            sl = (n % n_slots).to(tl.int64)
            kt = tl.load(kc + h * skh + sl[:, None] * skn + d[None, :], mask=nm[:, None], other=0)
            sc = tl.dot(qv, tl.trans(kt.to(qv.dtype)))                         # [BM, BN]
            seen = (n[None, :] <= qpos[:, None]) & nm[None, :]
            if WIN:
                seen = seen & (n[None, :] > qpos[:, None] - window)
            sc = tl.where(seen, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            # a window can hide every key of a block from a row (m_new -inf): alpha and pr 0, not exp(-inf + inf)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_sub)
            pr = tl.exp(sc - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            vt = tl.load(vc + h * svh + sl[:, None] * svn + d[None, :], mask=nm[:, None], other=0)
            acc = acc * alpha[:, None] + tl.dot(pr.to(qv.dtype), vt.to(qv.dtype))
            m_i = m_new
        if SINK:                                       # one more logit in the denominator, of no value
            sink = tl.load(sinks + qh).to(tl.float32)
            mx = tl.maximum(m_i, sink)
            c = tl.exp(m_i - mx)
            o = acc * c[:, None] / (l_i * c + tl.exp(sink - mx))[:, None]
        else:
            o = acc / l_i[:, None]
        tl.store(out + t.to(tl.int64)[:, None] * so + qh * D + d[None, :],
                 o.to(out.dtype.element_ty), mask=tm[:, None])

    @triton.jit
    def _attn_merge_kernel(o_part, m_part, l_part, pos, out, chunk, n_split, q1, q2, xs, xc, K, n_slots, sinks,
                           G: tl.constexpr, D: tl.constexpr, SB: tl.constexpr, Q8: tl.constexpr,
                           SINK: tl.constexpr):
        """Query head qh's output from its splits; SINK: its sink logit sinks[qh] joins the softmax's denominator
        (a key of no value); Q8: also in two int8 terms (_quant_blocks), as the output projection's gemv8 reads it
        (one quant_x8 launch less)."""
        qh = tl.program_id(0)
        h = qh // G
        g = qh % G
        L = tl.minimum(tl.load(pos).to(tl.int32) + 1, n_slots)
        n_valid = (L + chunk - 1) // chunk
        sb = tl.arange(0, SB)
        d = tl.arange(0, D)
        M = tl.full([SB], float("-inf"), tl.float32)
        for s0 in range(0, n_valid, SB):
            sm = s0 + sb < n_valid
            M = tl.maximum(M, tl.load(m_part + (h * n_split + s0 + sb) * G + g, mask=sm, other=float("-inf")))
        Mx = tl.max(M, axis=0)
        if SINK:
            sink = tl.load(sinks + qh).to(tl.float32)
            Mx = tl.maximum(Mx, sink)
        acc = tl.zeros([D], tl.float32)
        lsum = tl.zeros([SB], tl.float32)
        for s0 in range(0, n_valid, SB):
            sm = s0 + sb < n_valid
            row = (h * n_split + s0 + sb) * G + g
            w = tl.exp(tl.load(m_part + row, mask=sm, other=float("-inf")) - Mx)
            lsum += w * tl.load(l_part + row, mask=sm, other=0)
            o = tl.load(o_part + row[:, None] * D + d[None, :], mask=sm[:, None], other=0)
            acc += tl.sum(w[:, None] * o, axis=0)
        den = tl.sum(lsum, axis=0)
        if SINK:
            den += tl.exp(sink - Mx)
        v = acc / den
        tl.store(out + qh * D + d, v.to(out.dtype.element_ty))
        if Q8:
            _quant_blocks(tl.reshape(v, (D // 32, 32)), qh * (D // 32) + tl.arange(0, D // 32), 0, K,
                          q1, q2, xs, xc)


def on_device(t: torch.Tensor):
    """Launch Triton kernels on t's GPU (Triton launches on the current device, which may be another)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def qk_rope_cache(qkv, q_norm, k_norm, cos, sin, pos, kc, vc, n_head, n_head_kv, head_dim, eps, neox,
                  q_dtype=torch.float32, cos_first: int = 0):
    """qkv [T, (nh + 2 nkv) * D] (rows may be strided) -> q [nh, T, D] in q_dtype (normed, roped); k (normed,
    roped) and v are written to kc/vc [nkv, n, D] at positions pos.. (pos: an int, or a 1-element device
    tensor, as the static decode step holds it; position p in slot p % n). cos/sin [n, D] float32 hold positions
    cos_first.. ."""
    T = qkv.shape[0]
    q = torch.empty(n_head, T, head_dim, dtype=q_dtype, device=qkv.device)
    has_norm = q_norm is not None
    on_dev = isinstance(pos, torch.Tensor)
    bt = min(32, _pow2(T))
    with on_device(qkv):
        _qk_rope_cache_kernel[(n_head + n_head_kv, triton.cdiv(T, bt))](
            qkv, qkv.stride(0), q_norm if has_norm else cos, k_norm if has_norm else cos, cos, sin,
            pos if on_dev else cos, 0 if on_dev else pos, cos_first, q, q.stride(0), kc, vc,
            kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), kc.shape[1], T, n_head, n_head_kv, eps,
            D=head_dim, NEOX=neox, HAS_NORM=has_norm, POS_PTR=on_dev, BT=bt)
    return q


def attention(q, kc, vc, pos, scale, out_dtype=torch.bfloat16, rope=None, q8_out=None, sinks=None,
              window: int = 0):
    """Decode attention of q [nh, D] over cache positions 0..pos of kc/vc [nkv, n, D] (position p in slot
    p % n): [1, nh * D].

    rope=(qkv, q_norm, k_norm, cos, sin, n_head, eps, neox): q is None and the query comes from the fused
    qkv row [1, (nh + 2 nkv) D], normed and roped here, and this position's key/value are computed and
    written to the cache by the same launch (qk_rope_cache + attention in one kernel less).
    q8_out (x8_buffers(1, nh * D), D a multiple of 32): the output in two int8 terms too, as quant_x8.
    sinks: float32 [nh], one more logit per head in the softmax (gpt-oss); window > 0: only the keys of
    positions pos - window + 1..pos."""
    nkv, n_ctx, D = kc.shape
    if rope is not None and D < FUSED_ROPE_MIN_D:
        qkv, qn, kn, cos, sin, nh, eps, neox = rope
        q = qk_rope_cache(qkv, qn, kn, cos, sin, pos, kc, vc, nh, nkv, D, eps, neox)
        rope = None
    nh = q.shape[0] if rope is None else rope[5]
    G = nh // nkv
    chunk = ATTN_CHUNK                                   # at most 512 splits: longer caches get longer ones
    if n_ctx > 512 * ATTN_CHUNK:
        chunk = -(-n_ctx // (512 * ATTN_BLOCK)) * ATTN_BLOCK
    n_split = -(-n_ctx // chunk)
    dev = kc.device
    o_part = torch.empty(nkv * n_split * G, D, dtype=torch.float32, device=dev)
    m_part = torch.empty(nkv * n_split * G, dtype=torch.float32, device=dev)
    l_part = torch.empty_like(m_part)
    if rope is None:
        src, qn, kn, cos, sin, eps, neox, has_norm = q, q, q, q, q, 0.0, False, False
    else:
        src, qn, kn, cos, sin, _, eps, neox = rope
        has_norm = qn is not None
        qn, kn = (qn, kn) if has_norm else (cos, cos)
    with on_device(kc):
        _attn_partial_kernel[(nkv, n_split)](src, kc, vc, pos, o_part, m_part, l_part, chunk, n_split, scale,
                                             kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
                                             qn, kn, cos, sin, nh, nkv, eps, n_ctx, int(window),
                                             G=G, GP=max(16, _pow2(G)), D=D, BN=ATTN_BLOCK,
                                             ROPE=rope is not None, NEOX=neox, HAS_NORM=has_norm, WIN=window > 0)
    out = torch.empty(1, nh * D, dtype=out_dtype, device=dev)
    with on_device(kc):
        _attn_merge_kernel[(nh,)](o_part, m_part, l_part, pos, out, chunk, n_split,
                                  *(q8_out if q8_out is not None else (out,) * 4), nh * D, n_ctx,
                                  sinks if sinks is not None else m_part,
                                  G=G, D=D, SB=16, Q8=q8_out is not None, SINK=sinks is not None)
    return out


def attention_prefill(q, kc, vc, pos, scale, out_dtype=torch.bfloat16, sinks=None, window: int = 0):
    """Causal attention of a prompt's chunk: q [nh, T, D] (qk_rope_cache's output) at positions pos.. (pos: a
    1-element device tensor, so one CUDA graph serves a chunk of T tokens at any position) over kc/vc
    [nkv, n, D] (position p in slot p % n), where the chunk's keys and values are already written. Returns
    [T, nh * D]. sinks: float32 [nh], one more logit per head in the softmax (gpt-oss); window > 0: a query at
    position p sees the keys of positions p - window + 1..p only (a ring of n slots must hold the chunk beside
    the window - 1 positions before it: kvcache.KVCache.check_rings)."""
    nh, T, D = q.shape
    nkv, n_slots = kc.shape[:2]
    out = torch.empty(T, nh * D, dtype=out_dtype, device=q.device)
    bm = 16 if _INTERPRET else 64
    with on_device(q):
        _attn_prefill_kernel[(triton.cdiv(T, bm), nh)](q, kc, vc, pos, out, T, scale, kc.stride(0), kc.stride(1),
                                                       vc.stride(0), vc.stride(1), out.stride(0), n_slots,
                                                       int(window), sinks if sinks is not None else q,
                                                       G=nh // nkv, D=D, BM=bm, BN=bm, WIN=window > 0,
                                                       SINK=sinks is not None, num_warps=4)
    return out
