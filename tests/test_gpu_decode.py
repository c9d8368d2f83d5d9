"""The fused decode kernels (kernels/gpu_decode.py) against plain torch.

They run on a GPU, or on the CPU in Triton's interpreter (`TRITON_INTERPRET=1 python -m pytest
tests/test_gpu_decode.py`, with triton installed); otherwise they are skipped (CI has neither)."""
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import moe_ref_f64, rel_l2, triton_test_device

from hybridmoe.quant.ref import dequantize, random_blocks, split_rows
from hybridmoe.quant.types import GGMLType
from hybridmoe.runtime.ops import apply_rope, rope_tables

gd = pytest.importorskip("hybridmoe.kernels.gpu_decode")
if not gd.available():
    pytest.skip("triton is not installed", allow_module_level=True)
DEV = triton_test_device()


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


@pytest.mark.parametrize("H", [96, 2048])
def test_int8_rows(H):
    """quant_x8's two int8 terms reconstruct a row to ~15 bits of each block's max, an all-zero block
    stays zero, and add_rms_norm's q8_out writes exactly what quant_x8 writes for the normed row."""
    g = _gen(H + 1)
    a = torch.randn(2, H, generator=g, device=DEV) * torch.logspace(-3, 2, H, device=DEV)
    a[1, :32] = 0
    q1, q2, xs, xc = gd.quant_x8(a)
    back = (q1.float() * 256 + q2.float()).view(2, H // 32, 32) * xs[..., None]
    blk_max = a.view(2, H // 32, 32).abs().amax(-1, keepdim=True)
    assert ((back - a.view(2, H // 32, 32)).abs() <= blk_max * 2 ** -15).all()
    assert not q1[1, :32].any() and not q2[1, :32].any() and xs[1, 0] == 0
    assert torch.equal(xc, -8 * (256 * q1.view(2, -1, 32).int().sum(-1) + q2.view(2, -1, 32).int().sum(-1)))
    w = torch.rand(H, generator=g, device=DEV) + 0.5
    bufs = gd.x8_buffers(2, H, DEV)
    _, h = gd.add_rms_norm(a, w, 1e-6, q8_out=bufs)
    for got, want in zip(bufs, gd.quant_x8(h)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("H,has_b", [(256, True), (200, False), (2048, True)])
def test_add_rms_norm(H, has_b):
    g = _gen(H)
    a, b = torch.randn(2, H, generator=g, device=DEV), torch.randn(2, H, generator=g, device=DEV)
    w = torch.rand(H, generator=g, device=DEV) + 0.5
    x_out = torch.empty_like(a)
    packed = torch.zeros(2, H + 5, device=DEV)
    h2 = torch.empty(2, H, dtype=torch.bfloat16, device=DEV)
    _, h = gd.add_rms_norm(a, w, 1e-6, b=b if has_b else None, x_out=x_out, h_out=packed[:, :H], h2_out=h2)
    x = a + b if has_b else a
    assert torch.allclose(x_out, x)
    assert rel_l2(packed[:, :H], F.rms_norm(x, (H,), w, 1e-6)) < 1e-6
    assert not packed[:, H:].any()
    assert ((h2.float() - packed[:, :H]).abs() <= packed[:, :H].abs() * 2 ** -7).all()   # the row in bf16
    _, hb = gd.add_rms_norm(a, w, 1e-6, h_dtype=torch.bfloat16)
    assert hb.dtype == torch.bfloat16 and rel_l2(hb.float(), F.rms_norm(a, (H,), w, 1e-6)) < 1e-2


@pytest.mark.parametrize("neox,norm", [(True, True), (False, False), (False, True)])
def test_qk_rope_cache(neox, norm):
    nh, nkv, D, n_ctx, pos = 8, 2, 64, 40, 29
    g = _gen(3)
    qkv = torch.randn(1, (nh + 2 * nkv) * D, generator=g, device=DEV).to(torch.bfloat16)
    qn, kn = (torch.rand(D, generator=g, device=DEV) + 0.5 for _ in range(2))
    cos, sin = rope_tables(torch.arange(n_ctx), D, 10000.0, neox)
    cos, sin = cos[:, 0].to(DEV), sin[:, 0].to(DEV)
    kc = torch.zeros(nkv, n_ctx, D, dtype=torch.float16, device=DEV)
    vc = torch.zeros_like(kc)
    q = gd.qk_rope_cache(qkv, qn if norm else None, kn if norm else None, cos, sin,
                         torch.tensor([pos], device=DEV), kc, vc, nh, nkv, D, 1e-6, neox)
    x = qkv.float()
    rq, rk, rv = x[0, :nh * D].view(nh, D), x[0, nh * D:(nh + nkv) * D].view(nkv, D), x[0, (nh + nkv) * D:].view(nkv, D)
    if norm:
        rq, rk = F.rms_norm(rq, (D,), qn, 1e-6), F.rms_norm(rk, (D,), kn, 1e-6)
    rq, rk = apply_rope(rq, cos[pos], sin[pos], neox), apply_rope(rk, cos[pos], sin[pos], neox)
    assert rel_l2(q[:, 0], rq) < 1e-6
    assert rel_l2(kc[:, pos].float(), rk) < 1e-3 and torch.equal(vc[:, pos], rv.half())
    kc[:, pos] = 0
    vc[:, pos] = 0
    assert not kc.any() and not vc.any()                     # nothing written elsewhere


@pytest.mark.parametrize("neox,norm,T,pos0", [(True, True, 37, 5), (False, False, 64, 0), (False, True, 1, 20),
                                             (True, True, 25, 1)])   # pos0 1: Triton passes it as a constant
def test_qk_rope_cache_tokens(neox, norm, T, pos0):
    """A prompt's tokens at once (the eager prefill): q [nh, T, D] in the cache's dtype from strided qkv rows,
    rope tables holding the batch's positions only, keys and values written at pos0.. and nowhere else."""
    nh, nkv, D, n_ctx = 4, 2, 64, 120
    g = _gen(T)
    wide = torch.randn(T, (nh + 2 * nkv) * D + 8, generator=g, device=DEV)
    qkv = wide[:, 8:]                                         # rows with a stride (a view of a wider output)
    qn, kn = (torch.rand(D, generator=g, device=DEV) + 0.5 for _ in range(2))
    cos, sin = rope_tables(torch.arange(pos0, pos0 + T), D, 10000.0, neox)
    cos, sin = cos[:, 0].to(DEV), sin[:, 0].to(DEV)
    kc = torch.zeros(nkv, n_ctx, D, dtype=torch.float16, device=DEV)
    vc = torch.zeros_like(kc)
    q = gd.qk_rope_cache(qkv, qn if norm else None, kn if norm else None, cos, sin, pos0, kc, vc, nh, nkv, D,
                         1e-6, neox, q_dtype=torch.float16, cos_first=pos0)
    x = qkv.reshape(T, nh + 2 * nkv, D)
    rq, rk, rv = x[:, :nh], x[:, nh:nh + nkv], x[:, nh + nkv:]
    if norm:
        rq, rk = F.rms_norm(rq, (D,), qn, 1e-6), F.rms_norm(rk, (D,), kn, 1e-6)
    c, s_ = cos[:, None], sin[:, None]
    rq, rk = apply_rope(rq, c, s_, neox), apply_rope(rk, c, s_, neox)
    assert q.shape == (nh, T, D) and q.dtype == torch.float16
    assert rel_l2(q.float(), rq.transpose(0, 1)) < 1e-3
    assert rel_l2(kc[:, pos0:pos0 + T].float(), rk.transpose(0, 1)) < 1e-3
    assert torch.equal(vc[:, pos0:pos0 + T], rv.transpose(0, 1).half())
    kc[:, pos0:pos0 + T] = 0
    vc[:, pos0:pos0 + T] = 0
    assert not kc.any() and not vc.any()


@pytest.mark.parametrize("nh,nkv,n_ctx,pos,dt", [(8, 2, 40, 0, torch.float16), (8, 2, 700, 600, torch.bfloat16),
                                                  (4, 4, 300, 299, torch.float32), (16, 1, 1100, 1030, torch.float16)])
def test_decode_attention(nh, nkv, n_ctx, pos, dt):
    if dt == torch.bfloat16 and DEV == "cpu":
        pytest.skip("Triton's interpreter gets bf16 tl.dot wrong (fine on GPUs)")
    D = 64
    g = _gen(pos)
    q = torch.randn(nh, D, generator=g, device=DEV)
    kc = torch.randn(nkv, n_ctx, D, generator=g, device=DEV).to(dt)
    vc = torch.randn(nkv, n_ctx, D, generator=g, device=DEV).to(dt)
    out = gd.attention(q, kc, vc, torch.tensor([pos], device=DEV), D ** -0.5, out_dtype=torch.float32)
    k, v = kc[:, :pos + 1].float(), vc[:, :pos + 1].float()
    rep = nh // nkv
    s = torch.einsum("hd,hpd->hp", q, k.repeat_interleave(rep, 0)) * D ** -0.5
    ref = torch.einsum("hp,hpd->hd", torch.softmax(s, -1), v.repeat_interleave(rep, 0)).reshape(1, -1)
    assert rel_l2(out, ref) < (2e-3 if dt == torch.float32 else 1e-2)


@pytest.mark.parametrize("nh,nkv,T,pos0,dt", [(8, 2, 40, 0, torch.float16), (4, 4, 7, 300, torch.float32),
                                               (16, 1, 100, 1030, torch.float16), (8, 2, 130, 65, torch.bfloat16)])
def test_prefill_attention(nh, nkv, T, pos0, dt):
    """A chunk of T queries at positions pos0.. (from a device tensor) over the cache: each sees the keys up to
    its own position, never the garbage the cache holds past the chunk."""
    if dt == torch.bfloat16 and DEV == "cpu":
        pytest.skip("Triton's interpreter gets bf16 tl.dot wrong (fine on GPUs)")
    D, n_ctx = 64, pos0 + T + 50
    g = _gen(T + pos0)
    q = torch.randn(nh, T, D, generator=g, device=DEV).to(dt)
    kc = torch.randn(nkv, n_ctx, D, generator=g, device=DEV).to(dt)
    vc = torch.randn(nkv, n_ctx, D, generator=g, device=DEV).to(dt)
    kc[:, pos0 + T:] = 1e4                                    # past the chunk: must not be read
    out = gd.attention_prefill(q, kc, vc, torch.tensor([pos0], device=DEV), D ** -0.5, out_dtype=torch.float32)
    rep = nh // nkv
    k, v = (c[:, :pos0 + T].float().repeat_interleave(rep, 0) for c in (kc, vc))
    s = torch.einsum("htd,hpd->htp", q.float(), k) * D ** -0.5
    future = torch.arange(pos0 + T, device=DEV)[None, :] > torch.arange(pos0, pos0 + T, device=DEV)[:, None]
    s = s.masked_fill(future, float("-inf"))
    ref = torch.einsum("htp,hpd->thd", torch.softmax(s, -1), v).reshape(T, nh * D)
    assert out.shape == (T, nh * D)
    assert rel_l2(out, ref) < (2e-3 if dt == torch.float32 else 1e-2)


def test_attention_writes_its_output_in_int8_terms():
    """attention(q8_out=) = quant_x8 of its output (computed from the float32 values, not the bf16 ones)."""
    nh, nkv, D, n_ctx, pos = 8, 2, 64, 300, 270
    g = _gen(11)
    q = torch.randn(nh, D, generator=g, device=DEV)
    kc, vc = (torch.randn(nkv, n_ctx, D, generator=g, device=DEV).half() for _ in range(2))
    p = torch.tensor([pos], device=DEV)
    xq = gd.x8_buffers(1, nh * D, DEV)
    out = gd.attention(q, kc, vc, p, D ** -0.5, out_dtype=torch.float32, q8_out=xq)
    assert torch.equal(out, gd.attention(q, kc, vc, p, D ** -0.5, out_dtype=torch.float32))
    for got, want in zip(xq, gd.quant_x8(out)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("neox,norm,n_ctx,pos,D", [(True, True, 40, 29, 64), (False, False, 300, 256, 64),
                                                    (False, True, 600, 511, 64), (True, True, 40, 0, 64),
                                                    (True, True, 64, 0, 16), (True, True, 64, 5, 16),
                                                    (True, True, 300, 130, 16), (False, True, 64, 0, 32),
                                                    (True, True, 300, 130, 32), (True, False, 300, 257, 32),
                                                    (True, True, 64, 1, 128)])
def test_attention_with_rope_fused(neox, norm, n_ctx, pos, D):
    """attention(rope=...) = qk_rope_cache then attention: the same output, and the same key/value written
    at the position and nowhere else (positions at and after a split's edge included; head sizes 16 to 128)."""
    nh, nkv = 8, 2
    g = _gen(pos + 7)
    qkv = torch.randn(1, (nh + 2 * nkv) * D, generator=g, device=DEV).to(torch.bfloat16)
    qn, kn = (torch.rand(D, generator=g, device=DEV) + 0.5 for _ in range(2))
    cos, sin = rope_tables(torch.arange(n_ctx), D, 10000.0, neox)
    cos, sin = cos[:, 0].to(DEV), sin[:, 0].to(DEV)
    kc = torch.randn(nkv, n_ctx, D, generator=g, device=DEV).half()
    vc = torch.randn(nkv, n_ctx, D, generator=g, device=DEV).half()
    kc2, vc2 = kc.clone(), vc.clone()
    p = torch.tensor([pos], device=DEV)
    norms = (qn, kn) if norm else (None, None)
    q = gd.qk_rope_cache(qkv, *norms, cos, sin, p, kc, vc, nh, nkv, D, 1e-6, neox)
    ref = gd.attention(q, kc, vc, p, D ** -0.5, out_dtype=torch.float32)
    out = gd.attention(None, kc2, vc2, p, D ** -0.5, out_dtype=torch.float32,
                       rope=(qkv, *norms, cos, sin, nh, 1e-6, neox))
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    assert rel_l2(out, ref) < 1e-5


@pytest.mark.parametrize("window,slots,pos,D", [(8, 10, 5, 64), (8, 10, 9, 64), (8, 10, 27, 64), (0, 300, 270, 64),
                                                  (8, 300, 100, 64), (8, 519, 40, 16), (128, 639, 900, 64),
                                                  (128, 130, 700, 64), (8, 10, 23, 16), (0, 64, 40, 16)])
def test_attention_with_sinks_and_window_rings(window, slots, pos, D):
    """gpt-oss's decode attention: a sink logit per head in the softmax, and on window layers a ring of slots
    (position p in slot p % slots, before and after it wraps) of which only the last `window` positions count;
    the same as the reference (models/gpt_oss.attend_sinks over the keys in position order). With the rope fused,
    the new key and value go to the position's slot and nowhere else."""
    from hybridmoe.models.gpt_oss import attend_sinks
    nh, nkv = 8, 2
    g = _gen(pos + window)
    keys, vals = (torch.randn(nkv, pos + 1, D, generator=g, device=DEV).half() for _ in range(2))
    kc, vc = (torch.randn(nkv, slots, D, generator=g, device=DEV).half() for _ in range(2))
    for p in range(pos + 1):                                  # the ring as decoding fills it
        kc[:, p % slots], vc[:, p % slots] = keys[:, p], vals[:, p]
    q = torch.randn(nh, D, generator=g, device=DEV)
    sinks = torch.randn(nh, generator=g, device=DEV) + 5       # mass enough to show over 700 keys
    scale = D ** -0.5 * 1.3
    pt = torch.tensor([pos], device=DEV)
    out = gd.attention(q, kc, vc, pt, scale, out_dtype=torch.float32, sinks=sinks, window=window)
    ref = attend_sinks(q[None], keys, vals, pos, sinks, scale, window=window)
    assert rel_l2(out, ref) < 1e-2
    plain = gd.attention(q, kc, vc, pt, scale, out_dtype=torch.float32, window=window)
    assert rel_l2(out, plain) > 1e-2                          # the sinks count
    # the fused rope: the position's key and value written to its slot, the output as qk_rope_cache's + attention
    qkv = torch.randn(1, (nh + 2 * nkv) * D, generator=g, device=DEV)
    cos, sin = rope_tables(torch.arange(pos + 1), D, 10000.0, True)
    cos, sin = cos[:, 0].to(DEV), sin[:, 0].to(DEV)
    kc2, vc2 = kc.clone(), vc.clone()
    qr = gd.qk_rope_cache(qkv, None, None, cos, sin, pt, kc, vc, nh, nkv, D, 1e-6, True)
    want = gd.attention(qr[:, 0], kc, vc, pt, scale, out_dtype=torch.float32, sinks=sinks, window=window)
    got = gd.attention(None, kc2, vc2, pt, scale, out_dtype=torch.float32, sinks=sinks, window=window,
                       rope=(qkv, None, None, cos, sin, nh, 1e-6, True))
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    assert rel_l2(got, want) < 1e-5
    assert torch.equal(vc[:, pos % slots], qkv[0, (nh + nkv) * D:].view(nkv, D).half())


@pytest.mark.parametrize("window,slots,pos0,T,D", [(8, 12, 0, 5, 64), (8, 12, 30, 5, 64), (8, 47, 70, 40, 64),
                                                    (0, 200, 60, 70, 64), (128, 255, 600, 128, 64),
                                                    (6, 7, 17, 2, 16), (5, 40, 3, 36, 32)])
def test_attention_prefill_with_sinks_and_window_rings(window, slots, pos0, T, D):
    """gpt-oss's prompt attention: a chunk of T queries at positions pos0.. over a ring of slots that holds the
    chunk beside the window - 1 positions before it (window - 1 + T <= slots: kvcache's sizing, tight in some
    cases), the chunk's keys written; with sinks, as the reference over the keys in position order. Rows whose
    window hides whole blocks of keys (window 5-8 against blocks of 16 or 64) come out finite."""
    from hybridmoe.models.gpt_oss import attend_sinks
    nh, nkv = 8, 2
    g = _gen(pos0 + T + window)
    P = pos0 + T
    keys, vals = (torch.randn(nkv, P, D, generator=g, device=DEV).half() for _ in range(2))
    kc, vc = (torch.randn(nkv, slots, D, generator=g, device=DEV).half() for _ in range(2))
    for p in range(P):                                          # the ring as prompts and decoding fill it
        kc[:, p % slots], vc[:, p % slots] = keys[:, p], vals[:, p]
    q = torch.randn(nh, T, D, generator=g, device=DEV).half()
    sinks = torch.randn(nh, generator=g, device=DEV) + 3
    scale = D ** -0.5 * 1.3
    pt = torch.tensor([pos0], device=DEV)
    out = gd.attention_prefill(q, kc, vc, pt, scale, out_dtype=torch.float32, sinks=sinks, window=window)
    ref = attend_sinks(q.transpose(0, 1), keys, vals, pos0, sinks, scale, window=window)
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) < 1e-2
    plain = gd.attention_prefill(q, kc, vc, pt, scale, out_dtype=torch.float32, window=window)
    assert rel_l2(out, plain) > 1e-2                            # the sinks count
    if window and P > window:                                   # and the window
        wide = gd.attention_prefill(q, kc, vc, pt, scale, out_dtype=torch.float32, sinks=sinks)
        assert not torch.isfinite(wide).all() or rel_l2(out, wide) > 1e-2


def test_handoff_kernels(monkeypatch):
    """router_topk(publish=) copies the packed row [h | weights | ids] into pinned host memory, then sets a
    host flag to the step. add_rms_norm(wait=) adds a row from pinned host memory once the host's flag
    equals the step (on a GPU: it really waits), and sets err after too many polls instead of hanging."""
    cuda = DEV == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def host(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, pin_memory=cuda)
    H, E, k = 3000, 16, 4                               # three blocks of the row's copy loop
    packed = torch.randn(1, H + 2 * k, generator=_gen(3), device=DEV)
    logits = torch.randn(1, E, generator=_gen(6), device=DEV)
    dst, flag, err = host(H + 2 * k), host(16, dtype=torch.int32), host(1, dtype=torch.int32)
    step = torch.full((1,), 5, dtype=torch.int32, device=DEV)
    wts, ids = gd.router_topk(logits, k, True, packed=packed, pack_offset=H, publish=(dst, flag, step))
    sync()
    assert int(flag[0]) == 5 and torch.equal(dst, packed[0].cpu())
    assert torch.equal(dst[H:H + k], wts[0].cpu()) and torch.equal(dst[H + k:], ids[0].float().cpu())
    src = packed[0, :H]
    dst = dst[:H]
    a, w = torch.randn(1, H, generator=_gen(4), device=DEV), torch.rand(H, generator=_gen(5), device=DEV) + 0.5
    x_out = torch.empty_like(a)

    def norm(b):
        return gd.add_rms_norm(a, w, 1e-6, b=b, x_out=x_out, wait=(flag, step, err))[1]
    want = gd.add_rms_norm(a, w, 1e-6, b=src[None])[1]
    h = norm(dst[None])
    sync()
    assert torch.equal(h, want) and torch.equal(x_out, a + src) and int(err[0]) == 0
    if cuda:                                            # the GPU spins until the host's flag says 6
        step.fill_(6)
        h = norm(dst[None])
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.05)
        assert not done.query()
        dst.mul_(2)
        flag[0] = 6
        done.synchronize()
        assert torch.equal(x_out, a + 2 * src) and int(err[0]) == 0
    monkeypatch.setattr(gd, "AWAIT_MAX_POLLS", 3)
    step.fill_(7)
    norm(dst[None])                                     # the flag stays at 6
    sync()
    assert int(err[0]) == 1


def test_batch_handoff_flags(monkeypatch):
    """The batched step's hand-off kernels (kernels/gpu_handoff.py): publish sets the host flag to the step once
    the rows copied before it are there; await_flag holds the stream until the host's flag equals the step (on
    a GPU: it really waits), and sets err after too many polls instead of hanging."""
    from hybridmoe.kernels import gpu_handoff as gh
    cuda = DEV == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    flag, err = (torch.zeros(n, dtype=torch.int32, pin_memory=cuda) for n in (16, 1))
    rows = torch.zeros(4, 8, pin_memory=cuda)
    src = torch.randn(4, 8, generator=_gen(8), device=DEV)
    step = torch.full((1,), 3, dtype=torch.int32, device=DEV)
    rows.copy_(src, non_blocking=True)
    gh.publish(flag, step)
    sync()
    assert int(flag[0]) == 3 and torch.equal(rows, src.cpu())
    gh.await_flag(flag, step, err)                      # already there: goes on at once
    sync()
    assert int(err[0]) == 0
    if cuda:
        step.fill_(4)
        gh.await_flag(flag, step, err)
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.05)
        assert not done.query()
        flag[0] = 4
        done.synchronize()
        assert int(err[0]) == 0
    monkeypatch.setattr(gh, "AWAIT_MAX_POLLS", 3)
    step.fill_(9)
    gh.await_flag(flag, step, err)                      # the host never sets 9
    sync()
    assert int(err[0]) == 1


def test_stage_experts_and_a_second_addend():
    """The decode share's two kernels: stage_experts copies the experts named by ids[0, j0:] from host memory
    (pinned on a GPU, read over the bus) into its slots, byte for byte; add_rms_norm adds the device rows c
    as well as b."""
    q, E, H, F = GGMLType.Q4_0, 16, 256, 128
    g = torch.Generator().manual_seed(7)
    host = [random_blocks(q, shape, g) for shape in ((E, F, H), (E, F, H), (E, H, F))]
    if DEV == "cuda":
        host = [t.pin_memory() for t in host]
    ids = torch.tensor([[3, 9, 14, 0]], dtype=torch.int32, device=DEV)
    stage = [torch.full((2, *t.shape[1:]), 7, dtype=torch.uint8, device=DEV) for t in host]
    gd.stage_experts(ids, 2, [gd.stage_words(t) for t in host], [gd.stage_words(t) for t in stage])
    for got, t in zip(stage, host):
        assert torch.equal(got.cpu(), t[[14, 0]])
    gd.stage_experts(torch.tensor([[5, -1]], dtype=torch.int32, device=DEV), 0, [gd.stage_words(t) for t in host],
                     [gd.stage_words(t) for t in stage])             # an id < 0: its slot left as it was
    for got, t in zip(stage, host):
        assert torch.equal(got.cpu(), t[[5, 0]])
    assert gd.stage_words(torch.zeros(4, 3, 6, dtype=torch.uint8)) is None      # 18-byte experts: no wide loads
    a, b, w = (torch.randn(1, H, generator=_gen(i), device=DEV) for i in range(3))
    c = torch.randn(3, H, generator=_gen(3), device=DEV)
    x_out = torch.empty_like(a)
    _, h = gd.add_rms_norm(a, w, 1e-6, b=b, c=c, x_out=x_out)
    want = a + b + c.sum(0, keepdim=True)
    assert torch.allclose(x_out, want, atol=1e-5)
    assert torch.allclose(h, gd.add_rms_norm(want, w, 1e-6)[1], atol=1e-5)


@pytest.mark.parametrize("E,k,norm", [(128, 8, True), (60, 4, False), (8, 2, True)])
def test_router_topk(E, k, norm):
    g = _gen(E)
    logits = torch.randn(3, E, generator=g, device=DEV) * 3
    packed = torch.zeros(3, 10 + 2 * k, device=DEV)
    wts, ids = gd.router_topk(logits, k, norm, packed=packed, pack_offset=10)
    rw, ri = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    if norm:
        rw = rw / rw.sum(-1, keepdim=True)
    assert torch.equal(ids.long(), ri) and rel_l2(wts, rw) < 1e-6
    assert torch.equal(packed[:, 10:10 + k], wts) and torch.equal(packed[:, 10 + k:], ri.float())
    assert not packed[:, :10].any()


@pytest.mark.parametrize("gq,dq", [(GGMLType.Q4_0, GGMLType.Q4_0), (GGMLType.Q8_0, GGMLType.Q4_0),
                                   (GGMLType.Q4_0, GGMLType.Q8_0), (GGMLType.Q4_K, GGMLType.Q6_K),
                                   (GGMLType.Q6_K, GGMLType.Q4_K), (GGMLType.Q5_K, GGMLType.Q5_K)])
@pytest.mark.parametrize("T", [1, 3])
def test_moe_from_bytes(gq, dq, T):
    kq = bool({gq, dq} & {GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K})
    E, k, H, Fd = 16, 4, (512 if kq else 256), (256 if kq else 96)          # K-quants: rows of 256s
    g = _gen(T)
    graw, uraw = random_blocks(gq, (E, Fd, H), g), random_blocks(gq, (E, Fd, H), g)
    draw = random_blocks(dq, (E, H, Fd), g)
    x = torch.randn(T, H, generator=g, device=DEV)
    ids = torch.stack([torch.randperm(E, generator=g, device=DEV)[:k] for _ in range(T)])
    ids[-1, 0] = ids[0, 1]                                   # shared experts across tokens
    wts = torch.softmax(torch.randn(T, k, generator=g, device=DEV), -1)
    res = torch.randn(T, H, generator=g, device=DEV)
    out = gd.moe(x, ids, wts, graw, uraw, draw, gq, dq) + res
    parts = gd.moe(x, ids, wts, graw, uraw, draw, gq, dq, reduce=False)
    x_sum = torch.empty_like(res)
    gd.add_rms_norm(res, torch.ones(H, device=DEV), 1e-6, b=parts, x_out=x_sum)
    assert rel_l2(x_sum, out) < 1e-6
    wg, wu = dequantize(graw, gq, H).double(), dequantize(uraw, gq, H).double()
    wd = dequantize(draw, dq, Fd).double()
    ref = res.double().clone()
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            hh = F.silu(wg[e] @ x[t].double()) * (wu[e] @ x[t].double())
            ref[t] += wts[t, j].double() * (wd[e] @ hh)
    assert rel_l2(out.double(), ref) < 1e-5


@pytest.mark.parametrize("gq,dq", [(GGMLType.Q4_0, GGMLType.Q4_0), (GGMLType.Q8_0, GGMLType.Q4_0),
                                   (GGMLType.Q4_0, GGMLType.Q8_0), (GGMLType.Q8_0, GGMLType.Q8_0)])
@pytest.mark.parametrize("T", [1, 2])
def test_moe_from_split_rows(gq, dq, T):
    """The dp4a kernels on rows in the split layout (quant.ref.split_rows: how GPU-resident Q4_0/Q8_0 experts
    are kept), with two-term int8 activations, against float64 on the GGUF rows: within 1e-4 (the CPU
    integer path measures 3-5e-5). A K of 768 with 16 blocks a step has a partial last step."""
    E, k, H, Fd = 8, 3, 768, 256
    g = _gen(7 + T)
    graw, uraw = random_blocks(gq, (E, Fd, H), g), random_blocks(gq, (E, Fd, H), g)
    draw = random_blocks(dq, (E, H, Fd), g)
    x = torch.randn(T, H, generator=g, device=DEV)
    ids = torch.stack([torch.randperm(E, generator=g, device=DEV)[:k] for _ in range(T)])
    wts = torch.softmax(torch.randn(T, k, generator=g, device=DEV), -1)
    ref = moe_ref_f64(x, ids, wts, graw, uraw, draw, gq, dq)
    out = gd.moe(x, ids, wts, split_rows(graw, gq), split_rows(uraw, gq), split_rows(draw, dq), gq, dq,
                 gate_split=True, down_split=True)
    assert rel_l2(out.double(), ref) < 1e-4
    half = gd.moe(x, ids, wts, split_rows(graw, gq), split_rows(uraw, gq), draw, gq, dq, gate_split=True)
    assert rel_l2(half.double(), ref) < 1e-4


@pytest.mark.parametrize("q", [GGMLType.Q4_0, GGMLType.Q8_0])
@pytest.mark.parametrize("blocks,K", [((48,), 768), ((32, 16, 16), 768), ((32,), 4096)])
def test_gemv8_from_split_rows(q, blocks, K):
    """A dense GEMV from split rows with two-term int8 x (the static decode step's QKV, output projection
    and head), over one weight or three row blocks read in place (q, k, v), against float64: within 1e-4.
    K = 4096 takes the other tile (gemv8_tile)."""
    g = _gen(20 + len(blocks))
    ws = [random_blocks(q, (n, K), g) for n in blocks]
    x = torch.randn(1, K, generator=g, device=DEV)
    ref = x.double() @ torch.cat([dequantize(w, q, K) for w in ws]).double().t()
    out = torch.empty(sum(blocks), dtype=torch.float32, device=DEV)
    gd.gemv8(gd.quant_x8(x), [split_rows(w, q) for w in ws], q, K, out)
    assert rel_l2(out.double(), ref[0]) < 1e-4
    bf = gd.gemv8(gd.quant_x8(x), [split_rows(w, q) for w in ws], q, K,
                  torch.empty(sum(blocks), dtype=torch.bfloat16, device=DEV))
    assert rel_l2(bf.double(), ref[0]) < 1e-2


@pytest.mark.parametrize("gq,dq", [(GGMLType.Q4_0, GGMLType.Q4_0), (GGMLType.Q8_0, GGMLType.Q4_0),
                                   (GGMLType.Q4_0, GGMLType.Q8_0), (GGMLType.Q8_0, GGMLType.Q8_0)])
@pytest.mark.parametrize("T,E", [(5, 16), (40, 16), (70, 8)])
def test_prefill_moe_from_bytes(gq, dq, T, E):
    """kernels/gpu_moe.py: sorted, padded blocks (empty experts, experts over several blocks, a partial last
    K step and column tile) against float64. bf16 operands on a GPU, float32 in the interpreter."""
    from hybridmoe.kernels import gpu_moe
    k, H, Fd = 4, 160, 96
    g = _gen(T + E)
    graw, uraw = random_blocks(gq, (E, Fd, H), g), random_blocks(gq, (E, Fd, H), g)
    draw = random_blocks(dq, (E, H, Fd), g)
    x = torch.randn(T, H, generator=g, device=DEV)
    ids = torch.stack([torch.randperm(E, generator=g, device=DEV)[:k] for _ in range(T)])
    ids[: T // 2, 0] = 1                                      # one expert with many rows
    ids[ids == 3] = 2 if E > 8 else ids[ids == 3]             # an expert no token picked (when E allows)
    wts = torch.softmax(torch.randn(T, k, generator=g, device=DEV), -1)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    out = gpu_moe.moe(x, ids, wts, graw, uraw, draw, gq, dq, dtype=dt)
    assert out.shape == (T, H) and out.dtype == torch.float32
    assert rel_l2(out.double(), moe_ref_f64(x, ids, wts, graw, uraw, draw, gq, dq)) < (1e-2 if DEV == "cuda" else 1e-5)


@pytest.mark.parametrize("gq,dq", [(GGMLType.Q4_0, GGMLType.Q8_0), (GGMLType.Q8_0, GGMLType.Q4_0)])
def test_prefill_moe_from_split_rows(gq, dq):
    """The prefill kernels on split rows (as GPU-resident experts are kept) compute what they compute on
    the GGUF rows."""
    from hybridmoe.kernels import gpu_moe
    E, k, T, H, Fd = 8, 2, 24, 512, 256
    g = _gen(int(gq) + 3)
    graw, uraw = random_blocks(gq, (E, Fd, H), g), random_blocks(gq, (E, Fd, H), g)
    draw = random_blocks(dq, (E, H, Fd), g)
    x = torch.randn(T, H, generator=g, device=DEV)
    ids = torch.stack([torch.randperm(E, generator=g, device=DEV)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g, device=DEV)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    ref = gpu_moe.moe(x, ids, wts, graw, uraw, draw, gq, dq, dtype=dt)
    out = gpu_moe.moe(x, ids, wts, split_rows(graw, gq), split_rows(uraw, gq), split_rows(draw, dq), gq, dq,
                      dtype=dt, gate_split=True, down_split=True)
    assert rel_l2(out, ref) < 1e-5


@pytest.mark.parametrize("q", [GGMLType.Q4_0, GGMLType.Q8_0])
def test_prefill_moe_every_tile(q):
    """Each tile configuration (pick_tile's rule or the autotuner may take any), and each block height,
    computes the same function (float64 reference)."""
    from hybridmoe.kernels import gpu_moe
    E, k, T, H, Fd = 8, 2, 24, 512, 352
    g = _gen(int(q))
    graw, uraw = random_blocks(q, (E, Fd, H), g), random_blocks(q, (E, Fd, H), g)
    draw = random_blocks(q, (E, H, Fd), g)
    x = torch.randn(T, H, generator=g, device=DEV)
    ids = torch.stack([torch.randperm(E, generator=g, device=DEV)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g, device=DEV)
    ref = moe_ref_f64(x, ids, wts, graw, uraw, draw, q, q)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    for tile in gpu_moe.TILES:
        for bm in (16, 64, 128):
            out = gpu_moe.moe(x, ids, wts, graw, uraw, draw, q, q, dtype=dt, tile=tile, bm=bm)
            assert rel_l2(out.double(), ref) < (1e-2 if DEV == "cuda" else 1e-5), (tile, bm)


def test_tile_rules_name_known_tiles():
    """The measured tile rules only name tiles of the lists the kernels are tested with (on a GPU; the
    interpreter has a single tile)."""
    from hybridmoe.kernels import gpu_moe
    for q in gd.QTYPES:
        for gate_up in (True, False):
            assert gd.moe_tile(q, gate_up) in gd._MOE_TILES
            for bm in (16, 32, 64, 128):
                if q in gpu_moe.QTYPES:
                    assert gpu_moe.pick_tile(bm, gate_up, q) in gpu_moe.TILES
                    assert gpu_moe.pick_tile(bm, gate_up, q, split=True) in gpu_moe.TILES
    if DEV == "cuda":
        assert {gd.moe_tile(q, g) for q in gd.QTYPES for g in (True, False)} - {gd._MOE_TILES[0]}


@pytest.mark.gpu
@pytest.mark.parametrize("q", [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K])
def test_decode_moe_every_tile(q, monkeypatch):
    """Each decode tile gives the same result as the reference, whichever the rule picks."""
    E, k, H, Fd = 16, 4, 512, 256
    g = _gen(int(q) + 7)
    graw, uraw = random_blocks(q, (E, Fd, H), g), random_blocks(q, (E, Fd, H), g)
    draw = random_blocks(q, (E, H, Fd), g)
    x = torch.randn(2, H, generator=g, device=DEV)
    ids = torch.stack([torch.randperm(E, generator=g, device=DEV)[:k] for _ in range(2)])
    wts = torch.rand(2, k, generator=g, device=DEV)
    ref = moe_ref_f64(x, ids, wts, graw, uraw, draw, q, q)
    for tile in gd._MOE_TILES:
        monkeypatch.setattr(gd, "moe_tile", lambda *_, t=tile: t)
        assert rel_l2(gd.moe(x, ids, wts, graw, uraw, draw, q, q).double(), ref) < 1e-3, tile


def test_prefill_moe_align():
    """Every pair lands once, in its expert's blocks, experts in order; padding and spare blocks are marked."""
    from hybridmoe.kernels import gpu_moe
    g = _gen(11)
    E, T, k, bm = 8, 37, 3, 16
    ids = torch.stack([torch.randperm(E, generator=g, device=DEV)[:k] for _ in range(T)])
    pairs, blk_e = gpu_moe.align(ids, E, bm)
    flat = ids.reshape(-1)
    seen = []
    for b, e in enumerate(blk_e.tolist()):
        rows = pairs[b * bm:(b + 1) * bm].tolist()
        real = [p for p in rows if p < T * k]
        if e < 0:
            assert not real
            continue
        assert real and all(int(flat[p]) == e for p in real)
        assert rows[:len(real)] == real                       # padding only at the end of an expert's run
        seen += real
    assert sorted(seen) == list(range(T * k))
    es = blk_e.tolist()
    used = [e for e in es if e >= 0]
    assert used == sorted(used) and es[:len(used)] == used    # experts in order, spare blocks last
    counts = torch.bincount(flat, minlength=E).tolist()
    assert all(used.count(e) == -(-c // bm) for e, c in enumerate(counts))


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K])
def test_one_pass_dequantize_is_the_reference(qtype):
    """kernels/gpu_dequant.py (prefill's per-ubatch expert dequantization) equals quant/ref.py bit for bit."""
    from hybridmoe.kernels.gpu_dequant import dequantize_bf16, has_kernel
    assert has_kernel(qtype)
    shape = (3, 5, 512)
    raw = random_blocks(qtype, shape, _gen(int(qtype)))
    ref32 = dequantize(raw, qtype, 512, dtype=torch.float32)
    idx = torch.tensor([2, 0, 2], device=DEV)
    for got, want in ((dequantize_bf16(raw, qtype, 512), ref32),
                      (dequantize_bf16(raw, qtype, 512, index=idx), ref32[idx])):
        if DEV == "cuda":
            assert torch.equal(got, want.to(torch.bfloat16))
        else:       # the interpreter rounds to bf16 its own way: within one bf16 step of the float32 value
            assert ((got.float() - want).abs() <= want.abs() * 2 ** -7 + 1e-30).all()
