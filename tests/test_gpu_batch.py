"""Batched decode attention (kernels/gpu_batch_attention.py) against torch per sequence, and the batched GPU
decode through the model against each sequence decoded alone.

They run on a GPU, or on the CPU in Triton's interpreter (`TRITON_INTERPRET=1 PYTHONPATH=src:/tmp/tritonpkg
python -m pytest tests/test_gpu_batch.py`, with triton importable); otherwise they are skipped (CI has neither)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_l2, top1_agreement, triton_test_device

from hybridmoe.runtime.ops import apply_rope, rope_tables

ga = pytest.importorskip("hybridmoe.kernels.gpu_batch_attention")
if not ga.available():
    pytest.skip("triton is not installed", allow_module_level=True)
DEV = triton_test_device()


def _caches(n, nkv, n_ctx, D, dt, g):
    """n caches of their own (as n KVCaches hold them), random contents."""
    kcs = [torch.randn(nkv, n_ctx, D, generator=g, device=DEV).to(dt) for _ in range(n)]
    vcs = [torch.randn(nkv, n_ctx, D, generator=g, device=DEV).to(dt) for _ in range(n)]
    return kcs, vcs


def _offsets(anchor, ts):
    return torch.tensor(ga.cache_offsets(anchor, ts), dtype=torch.int64, device=DEV)


def _ref_attention(q, kc, vc, pos):
    """q [nh, D] over kc/vc [nkv, :pos+1, D], float32: [nh * D]."""
    nh, D = q.shape
    rep = nh // kc.shape[0]
    k, v = kc[:, :pos + 1].float().repeat_interleave(rep, 0), vc[:, :pos + 1].float().repeat_interleave(rep, 0)
    s = torch.einsum("hd,hpd->hp", q.float(), k) * D ** -0.5
    return torch.einsum("hp,hpd->hd", torch.softmax(s, -1), v).reshape(-1)


@pytest.mark.parametrize("nh,nkv,n_ctx,pos,dt", [
    (8, 2, 40, [0, 5, 39], torch.float16),
    (4, 4, 300, [299, 1, 256, 255], torch.float32),
    (16, 1, 1100, [1030, 3], torch.float16),
    (8, 2, 700, [600, 17, 300], torch.bfloat16),
])
def test_batch_attention_per_sequence(nh, nkv, n_ctx, pos, dt):
    """Each row attends to its own cache up to its own position (split boundaries included); a padded row
    (position -1) gives zeros and reads nothing."""
    if dt == torch.bfloat16 and DEV == "cpu":
        pytest.skip("Triton's interpreter gets bf16 tl.dot wrong (fine on GPUs)")
    D, B = 64, len(pos) + 1
    g = torch.Generator(device=DEV).manual_seed(n_ctx)
    kcs, vcs = _caches(len(pos), nkv, n_ctx, D, dt, g)
    q = torch.randn(B, nh, D, generator=g, device=DEV)
    p = torch.tensor([*pos, -1], dtype=torch.int64, device=DEV)
    anchor = kcs[1]                                         # any of them: offsets may be negative
    out = ga.attention_batch(q, anchor, _offsets(anchor, kcs), _offsets(anchor, vcs), p, kcs[0].shape,
                             vcs[0].shape, D ** -0.5, n_ctx, out_dtype=torch.float32)
    for b, pb in enumerate(pos):
        assert rel_l2(out[b], _ref_attention(q[b], kcs[b], vcs[b], pb)) < (2e-3 if dt == torch.float32 else 1e-2)
    assert not out[-1].any()
    # bounding the splits by the longest sequence (the eager path) gives the same rows
    short = ga.attention_batch(q, anchor, _offsets(anchor, kcs), _offsets(anchor, vcs), p, kcs[0].shape,
                               vcs[0].shape, D ** -0.5, max(pos) + 1, out_dtype=torch.float32)
    assert torch.allclose(short, out, atol=1e-6)


@pytest.mark.parametrize("window,slots,pos", [(8, 10, [5, 9, 27, 300]), (128, 639, [900, 100, 638, 639]),
                                              (0, 300, [270, 0, 299])])
def test_batch_attention_with_sinks_and_window_rings(window, slots, pos):
    """gpt-oss's batched decode attention: each row over its own ring (position p in slot p % slots, before and
    after it wraps; only the last `window` positions count), a sink logit per head in the softmax; as the
    reference over each sequence's keys in position order. A padded row gives zeros; the key a row writes goes to
    its position's slot."""
    from hybridmoe.models.gpt_oss import attend_sinks
    nh, nkv, D, B = 8, 2, 64, len(pos) + 1
    g = torch.Generator(device=DEV).manual_seed(slots + window)
    keys = [torch.randn(nkv, p + 1, D, generator=g, device=DEV).half() for p in pos]
    vals = [torch.randn(nkv, p + 1, D, generator=g, device=DEV).half() for p in pos]
    kcs, vcs = _caches(len(pos), nkv, slots, D, torch.float16, g)
    for kc, vc, k, v, pb in zip(kcs, vcs, keys, vals, pos):
        for p in range(pb + 1):
            kc[:, p % slots], vc[:, p % slots] = k[:, p], v[:, p]
    q = torch.randn(B, nh, D, generator=g, device=DEV)
    sinks = torch.randn(nh, generator=g, device=DEV) + 5
    p = torch.tensor([*pos, -1], dtype=torch.int64, device=DEV)
    anchor, scale = kcs[0], D ** -0.5 * 1.3
    run = lambda **kw: ga.attention_batch(q, anchor, _offsets(anchor, kcs), _offsets(anchor, vcs), p,  # noqa: E731
                                          kcs[0].shape, vcs[0].shape, scale, 1024, out_dtype=torch.float32, **kw)
    out = run(sinks=sinks, window=window)
    for b, pb in enumerate(pos):
        ref = attend_sinks(q[b][None], keys[b], vals[b], pb, sinks, scale, window=window)
        assert rel_l2(out[b], ref[0]) < 1e-2
    assert not out[-1].any()
    assert rel_l2(out[:-1], run(window=window)[:-1]) > 1e-2               # the sinks count
    # the cache write: row b's key and value at its position's slot
    n_ctx = max(pos) + 1
    cos, sin = rope_tables(torch.arange(n_ctx), D, 10000.0, True)
    cos, sin = cos[:, 0].to(DEV), sin[:, 0].to(DEV)
    qkv = torch.randn(B, (nh + 2 * nkv) * D, generator=g, device=DEV)
    before = [v.clone() for v in vcs]
    ga.qk_rope_cache_batch(qkv, None, None, cos, sin, p, anchor, _offsets(anchor, kcs), _offsets(anchor, vcs),
                           kcs[0].shape, vcs[0].shape, nh, 1e-6, True)
    for b, pb in enumerate(pos):
        assert torch.equal(vcs[b][:, pb % slots], qkv[b, (nh + nkv) * D:].view(nkv, D).half())
        before[b][:, pb % slots] = vcs[b][:, pb % slots]
        assert torch.equal(before[b], vcs[b])


@pytest.mark.parametrize("neox,norm", [(True, True), (False, False)])
def test_qk_rope_cache_batch(neox, norm):
    """Row b: q normed and roped at its own position; k and v written to its own cache there and nowhere else;
    a padded row writes nothing."""
    nh, nkv, D, n_ctx = 8, 2, 64, 50
    pos = [29, 0, 49, -1]
    g = torch.Generator(device=DEV).manual_seed(7)
    wide = torch.randn(len(pos), (nh + 2 * nkv) * D + 8, generator=g, device=DEV)
    qkv = wide[:, 8:]                                       # strided rows
    qn, kn = (torch.rand(D, generator=g, device=DEV) + 0.5 for _ in range(2))
    cos, sin = rope_tables(torch.arange(n_ctx), D, 10000.0, neox)
    cos, sin = cos[:, 0].to(DEV), sin[:, 0].to(DEV)
    kcs = [torch.zeros(nkv, n_ctx, D, dtype=torch.float16, device=DEV) for _ in pos]
    vcs = [torch.zeros_like(k) for k in kcs]
    anchor = kcs[0]
    q = ga.qk_rope_cache_batch(qkv, qn if norm else None, kn if norm else None, cos, sin,
                               torch.tensor(pos, device=DEV), anchor, _offsets(anchor, kcs), _offsets(anchor, vcs),
                               kcs[0].shape, vcs[0].shape, nh, 1e-6, neox)
    x = qkv.reshape(len(pos), nh + 2 * nkv, D)
    for b, p in enumerate(pos):
        if p < 0:
            assert not kcs[b].any() and not vcs[b].any()
            continue
        rq, rk, rv = x[b, :nh], x[b, nh:nh + nkv], x[b, nh + nkv:]
        if norm:
            rq, rk = F.rms_norm(rq, (D,), qn, 1e-6), F.rms_norm(rk, (D,), kn, 1e-6)
        rq, rk = apply_rope(rq, cos[p], sin[p], neox), apply_rope(rk, cos[p], sin[p], neox)
        assert rel_l2(q[b], rq) < 1e-6
        assert rel_l2(kcs[b][:, p].float(), rk) < 1e-3 and torch.equal(vcs[b][:, p], rv.half())
        kcs[b][:, p] = 0
        vcs[b][:, p] = 0
        assert not kcs[b].any() and not vcs[b].any()


def _fake_gpu_or_real(monkeypatch) -> bool:
    if DEV == "cuda":
        return True
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    return False


IDS = [(i * 37 + 11) % 1000 + 3 for i in range(40)]


def _alone_and_batched(m, n_steps: int, before_batch=None):
    """Three sequences (prompts of 5, 12 and 1 tokens), each on two caches of its own: per greedy decode step
    (step, each sequence's logits alone by forward, the same by one forward_batch of the three); the next
    tokens are the alone logits' argmax."""
    prompts = [IDS[:5], IDS[5:17], IDS[17:18]]
    alone, batched = [m.new_cache(64) for _ in prompts], [m.new_cache(64) for _ in prompts]
    for p, a, b in zip(prompts, alone, batched):
        m.forward(torch.tensor(p), 0, a)
        m.forward(torch.tensor(p), 0, b)
    nxt = [IDS[20 + j] for j in range(3)]
    for step in range(n_steps):
        want = [m.forward(torch.tensor([t]), len(p) + step, kv, all_logits=False)
                for t, p, kv in zip(nxt, prompts, alone)]
        if before_batch is not None:
            before_batch()
        got = m.forward_batch([(torch.tensor([t]), len(p) + step, kv) for t, p, kv in zip(nxt, prompts, batched)])
        yield step, want, got
        nxt = [int(w.argmax()) for w in want]


@pytest.mark.parametrize("ctk", ["f32", "f16"])
def test_model_batch_decode_matches_alone(ctk, monkeypatch):
    """synth:tiny all on one GPU: three sequences with prompts of different lengths decode together through
    forward_batch (the batched attention kernels, one launch each for the batch) and give each sequence's logits
    as forward gives them alone on its own cache."""
    import hybridmoe
    from hybridmoe.kernels import gpu_batch_attention as ga_mod
    real = _fake_gpu_or_real(monkeypatch)
    calls = []
    orig = ga_mod.attention_batch
    monkeypatch.setattr(ga_mod, "attention_batch", lambda q, *a, **k: calls.append(q.shape[0]) or orig(q, *a, **k))
    m = hybridmoe.load("synth:tiny", ctx_size=64, graphs=False, n_gpu_layers=99, cache_type_k=ctk,
                       cache_type_v=ctk)
    for step, want, got in _alone_and_batched(m, 4):
        for w, g in zip(want, got):
            print(f"{ctk} cache, step {step}: rel L2 batched vs alone {rel_l2(g, w):.2e}")
            tol = 1e-2 if real else (1e-5 if ctk == "f32" else 1e-4)   # f16: q rounded to the cache dtype
            assert rel_l2(g, w) < tol
            assert int(g.argmax()) == int(w.argmax())
    assert calls and set(calls) == {3}          # the batch kernel ran, once per layer per step, for all rows


def test_batch_decode_step_matches_eager(monkeypatch):
    """synth:tiny all on one GPU: the batched decode step (runtime/steps/gpu_batch.py; captured per bucket on a
    real GPU, its kernels run eagerly on a fake one) against the eager batched path: 3 sequences (bucket 4, one
    padded row), then 2 of them (bucket 2), each at its own position, then each sequence alone; every other
    batched step through Model.decode_batch (the server's: argmax and expert counts taken on the GPU; once with the
    logits left on the GPU)."""

    import hybridmoe
    from hybridmoe.errors import HybridMoeError
    from hybridmoe.runtime.steps.gpu_batch import BatchDecode
    real = _fake_gpu_or_real(monkeypatch)
    prompts = [IDS[:5], IDS[5:17], IDS[17:18]]
    outs, steps = [], []
    for graphs in (True, False):
        m = hybridmoe.load("synth:tiny", ctx_size=64, graphs=graphs, n_gpu_layers=99)
        kvs = [m.new_cache(64) for _ in prompts]
        for p, kv in zip(prompts, kvs):
            m.forward(torch.tensor(p), 0, kv)
        pos = [len(p) for p in prompts]
        nxt = [IDS[20 + j] for j in range(3)]
        got = []
        for step in range(5):
            live = [0, 1, 2] if step < 3 else [0, 2]
            if step % 2:                          # the server's path: lists in, the argmax taken on the GPU
                out, top = m.decode_batch([nxt[j] for j in live], [pos[j] for j in live], [kvs[j] for j in live],
                                          argmax=True, host_logits=step != 3)
                assert out.is_cuda == (real and graphs and step == 3)     # step 3: the logits left on the GPU
                out = out.cpu()
                assert top == out.argmax(-1).tolist()
                rows = list(out.split(1))
            else:
                rows = m.forward_batch([(torch.tensor([nxt[j]]), pos[j], kvs[j]) for j in live])
            got.append(torch.cat(rows))
            assert m.stats.last_batch["sequences"] == len(live)
            assert 1 <= m.stats.last_batch["distinct_experts"] <= min(m.cfg.n_expert, len(live) * m.cfg.n_expert_used)
            for j, r in zip(live, rows):
                nxt[j], pos[j] = int(r.argmax()), pos[j] + 1
        if graphs:                                # the same caches as the last step, a position past -c: refused
            with pytest.raises(HybridMoeError, match="context is full"):
                m.decode_batch([nxt[0], nxt[2]], [64, pos[2]], [kvs[0], kvs[2]])
        got.append(torch.cat([m.forward(torch.tensor([nxt[j]]), pos[j], kvs[j]) for j in range(3)]))
        outs.append(torch.cat(got))
        steps.append(m._batch)
    assert isinstance(steps[0], BatchDecode) and sorted(steps[0].buckets) == [2, 4]
    assert not isinstance(steps[1], BatchDecode)
    print(f"batched decode step vs eager batch: rel L2 {rel_l2(outs[0], outs[1]):.2e}")
    if real:                                     # each bucket's second batch replayed its captured graph
        assert all(b["graph"] is not None for b in steps[0].buckets.values())
        assert rel_l2(outs[0], outs[1]) <= 1e-2 and top1_agreement(outs[0], outs[1]) >= 0.9
    else:
        assert rel_l2(outs[0], outs[1]) <= 1e-4          # q rounded to the f16 cache dtype in the kernel


@pytest.mark.parametrize("ot", [[], ["exps=CPU"]], ids=["ngl99", "exps-cpu"])
def test_mixed_batch_runs_the_decode_step(ot, monkeypatch):
    """A server step with decode tokens and a prompt chunk: the chunk's tokens are rows of the batched decode
    step next to the decode tokens (1 + 6 + 1 rows: bucket 8), not one eager pass; each row as forward gives it
    alone (the chunk's rows attend causally to each other through the cache)."""
    import hybridmoe
    from hybridmoe.runtime.steps.gpu_batch import BatchDecode
    real = _fake_gpu_or_real(monkeypatch)
    m = hybridmoe.load("synth:tiny", ctx_size=64, n_gpu_layers=99, override_tensor=ot)
    prompts = [IDS[:5], IDS[5:17], IDS[17:18]]
    kb, kr = [m.new_cache(64) for _ in prompts], [m.new_cache(64) for _ in prompts]
    for p, a, b in zip(prompts, kb, kr):
        m.forward(torch.tensor(p), 0, a)
        m.forward(torch.tensor(p), 0, b)
    pieces = [torch.tensor([IDS[20]]), torch.tensor(IDS[21:27]), torch.tensor([IDS[27]])]
    for rnd in range(2):                          # the second replays the bucket's graph on a GPU
        items = lambda kvs: [(t, len(p), kv) for t, p, kv in zip(pieces, prompts, kvs)]   # noqa: E731
        got = m.forward_batch(items(kb), all_logits=True)
        want = [m.forward(t, pos, kv, all_logits=True) for t, pos, kv in items(kr)]
        for g, w in zip(got, want):
            assert g.shape == w.shape
            assert rel_l2(g, w) < (1e-2 if real else 1e-4)
            assert torch.equal(g.argmax(-1), w.argmax(-1))
        assert m.stats.last_batch["sequences"] == 3 and m.stats.last_batch["tokens"] == 8
        prompts = [p + t.tolist() for p, t in zip(prompts, pieces)]
    assert isinstance(m._batch, BatchDecode) and sorted(m._batch.buckets) == [8]


@pytest.mark.parametrize("ot", [[], ["exps=CPU"]], ids=["ngl99", "exps-cpu"])
def test_batch_rows_over_steps_and_long_chunks(ot, monkeypatch):
    """A step with a decode token, a chunk longer than the batch step's max_chunk and two shorter ones: the long
    one runs apart (its cache's prompt step; with host experts the eager pass), the rest as rows, 71 of them: all
    on the GPU in one step of bucket 128, with host experts over two batch steps (64 + 7, one chunk's rows in
    both: the second step's rows attend to the keys the first wrote); each item's logits, every row's and the
    last only, as forward gives them alone."""
    import hybridmoe
    from hybridmoe.runtime.steps.gpu_batch import BatchDecode
    real = _fake_gpu_or_real(monkeypatch)
    m = hybridmoe.load("synth:tiny", ctx_size=192, n_gpu_layers=99, override_tensor=ot)
    ids = [(i * 53 + 7) % 1000 + 3 for i in range(200)]
    pieces = [torch.tensor(ids[:1]), torch.tensor(ids[1:71]), torch.tensor(ids[71:111]), torch.tensor(ids[111:141])]
    starts = [9, 0, 3, 0]
    for all_logits in (False, True):
        kb, kr = [m.new_cache(192) for _ in pieces], [m.new_cache(192) for _ in pieces]
        for p0, a, b in zip(starts, kb, kr):
            if p0:
                m.forward(torch.tensor(ids[150:150 + p0]), 0, a)
                m.forward(torch.tensor(ids[150:150 + p0]), 0, b)
        got = m.forward_batch([(t, p0, kv) for t, p0, kv in zip(pieces, starts, kb)], all_logits=all_logits)
        want = [m.forward(t, p0, kv, all_logits=all_logits) for t, p0, kv in zip(pieces, starts, kr)]
        for g, w in zip(got, want):
            assert g.shape == w.shape
            assert rel_l2(g, w) < (1e-2 if real else 1e-4)
            assert torch.equal(g.argmax(-1), w.argmax(-1)) if not real else top1_agreement(g, w) >= 0.9
        assert [len(kv.tokens) for kv in kb] == [p0 + t.shape[0] for t, p0 in zip(pieces, starts)]
    assert isinstance(m._batch, BatchDecode) and sorted(m._batch.buckets) == ([8, 64] if ot else [128])


@pytest.mark.parametrize("ot,share", [(["exps=CPU"], "0"), (["exps=CPU"], "3"), ([r"blk\.1\.ffn_.*_exps=CPU"], "1")],
                         ids=["exps-cpu", "exps-cpu-share", "one-layer-cpu-share"])
def test_batch_decode_with_host_experts(ot, share, monkeypatch):
    """-ngl 99 with experts in host RAM (all layers', or one layer's): the batched decode step runs its kernels
    with each host-expert layer's real rows handed to the scheduler's expert op (the C kernel, B rows in one
    call), padded rows left out, and gives each sequence what it decodes alone on its own cache; on a GPU the
    later steps replay the bucket's chain of graphs, the host part run between them, and with the decode share
    (forced: share of the k experts) the GPU runs that share of the distinct experts' pairs itself."""
    import hybridmoe
    from hybridmoe.runtime.steps.gpu_batch import BatchDecode
    real = _fake_gpu_or_real(monkeypatch)
    monkeypatch.setenv("HYBRIDMOE_DECODE_SHARE", share)
    m = hybridmoe.load("synth:tiny", ctx_size=64, n_gpu_layers=99, override_tensor=ot)
    shared = 0
    for _, want, got in _alone_and_batched(m, 3, before_batch=m.stats.reset):
        assert m.stats.cpu_expert_seconds > 0                    # the host layers' experts ran on the CPU
        shared += m.stats.gpu_share_bytes
        for w, g in zip(want, got):
            assert rel_l2(g, w) < (1e-2 if real else 1e-4)
            assert int(g.argmax()) == int(w.argmax())
    step = m._batch
    assert isinstance(step, BatchDecode) and step.host and sorted(step.buckets) == [4]
    pieces = step.buckets[4]["graph"]
    if real:                # captured after the first batch: a graph up to each host-expert layer, and the rest
        assert [h for _, h in pieces] == [i for i, lay in enumerate(step.layers) if lay.get("host")] + [None]
        assert (step.share_frac > 0) == (share != "0") and (shared > 0) == (share != "0")
    else:
        assert pieces is None                                    # fake GPUs: kernels in the interpreter, eagerly


@pytest.mark.parametrize("path", ["grouped", "pair", "mmq"])
def test_batch_step_moe_kernels_match_alone(path, monkeypatch):
    """The batched decode step with its MoE on the grouped kernels (each active expert read once per block of
    its pairs: dp4a GEMVs, or int8 tensor-core MMA where mmq) or the per-pair ones (HYBRIDMOE_GPU_MOE): 5
    sequences (bucket 8, 3 padded rows) at their own positions give each sequence's greedy tokens as its
    static decode step gives them alone (per-pair kernels). On a GPU synth:tiny-wide (split rows: the dp4a
    kernels), in the interpreter synth:tiny (GGUF rows; mmq reads split rows only, so it runs on a GPU)."""
    import hybridmoe
    from hybridmoe.kernels import gpu_decode, gpu_mmq, gpu_moe_grouped
    from hybridmoe.runtime.steps.gpu_batch import BatchDecode
    real = _fake_gpu_or_real(monkeypatch)
    if path == "mmq" and not real:
        pytest.skip("mmq reads split rows; the interpreter's model has GGUF rows")
    monkeypatch.setenv("HYBRIDMOE_GPU_MOE", path)
    calls = []
    mod = {"grouped": gpu_moe_grouped, "pair": gpu_decode, "mmq": gpu_mmq}[path]
    orig = mod.moe
    monkeypatch.setattr(mod, "moe", lambda x, ids, *a, **k: calls.append(tuple(ids.shape)) or orig(x, ids, *a, **k))
    m = hybridmoe.load("synth:tiny-wide" if real else "synth:tiny", ctx_size=48, graphs=True, n_gpu_layers=99)
    prompts = [IDS[:5], IDS[5:17], IDS[17:18], IDS[18:21], IDS[21:29]]
    alone, batched = [m.new_cache(48) for _ in prompts], [m.new_cache(48) for _ in prompts]
    for p, a, b in zip(prompts, alone, batched):
        m.forward(torch.tensor(p), 0, a)
        m.forward(torch.tensor(p), 0, b)
    nxt = [IDS[30 + j] for j in range(len(prompts))]
    seen = []
    for step in range(2):
        calls.clear()
        got = m.forward_batch([(torch.tensor([t]), len(p) + step, kv) for t, p, kv in zip(nxt, prompts, batched)])
        seen += calls
        want = [m.forward(torch.tensor([t]), len(p) + step, kv, all_logits=False)
                for t, p, kv in zip(nxt, prompts, alone)]
        for w, g in zip(want, got):
            print(f"{path}, step {step}: rel L2 batched vs alone {rel_l2(g, w):.2e}")
            if real:             # bf16 GEMMs batched, dp4a GEMVs alone: a near-tie may go either way
                assert rel_l2(g, w) < 1e-2 and top1_agreement(g, w) == 1.0
            else:
                assert rel_l2(g, w) < 1e-5 and int(g.argmax()) == int(w.argmax())
        nxt = [int(w.argmax()) for w in want]
    # the bucket's rows went through the kernels at every layer (eagerly, and into the graph on a GPU)
    assert isinstance(m._batch, BatchDecode) and m._batch.buckets[8]["moe"] == path
    assert seen and set(seen) == {(8, m.cfg.n_expert_used)} and len(seen) % m.cfg.n_layer == 0


@pytest.mark.parametrize("n_slots,ctx,buckets", [(1, 16, [2, 4, 8, 16]), (2, 80, [2, 4, 8, 16, 32, 64, 128])],
                         ids=["one-slot", "two-slots"])
def test_warm_slots_builds_the_row_buckets(n_slots, ctx, buckets, monkeypatch):
    """serve's slot warm-up all on a GPU: short prompts take the batched step's rows, so the warm-up runs each
    bucket a step's rows can reach (one slot: up to its context; two slots of 40: 80 rows, bucket 128, two chunks)
    and leaves the caches empty."""
    import hybridmoe
    from hybridmoe.runtime.steps.gpu_batch import BatchDecode
    from hybridmoe.serve.batching import Batcher
    _fake_gpu_or_real(monkeypatch)
    m = hybridmoe.load("synth:tiny", ctx_size=ctx, n_gpu_layers=99)
    b = Batcher(m, n_slots, ctx)
    try:
        assert b.warm_slots() > 0
        assert isinstance(m._batch, BatchDecode) and sorted(m._batch.buckets) == buckets
        assert all(s.cache(m).tokens == [] for s in b.slots)
    finally:
        b.close()


def _serve(m, prompts, max_tokens: int, stops, queue: bool):
    """Greedy jobs on a Batcher of len(prompts) slots, all at once: each one's (text, completion tokens,
    finish reason), and the batcher. queue=False: no decode step is queued ahead (_queue_next off)."""
    import asyncio

    from hybridmoe.serve.batching import Batcher
    from hybridmoe.serve.jobs import Job
    from hybridmoe.serve.requests import GenParams
    b = Batcher(m, len(prompts), len(prompts) * 48)
    queued = []
    if queue:
        inner = b._queue_next
        b._queue_next = lambda items, top: queued.append(inner(items, top)) or queued[-1]
    else:
        b._queue_next = lambda items, top: None

    async def drive():
        loop = asyncio.get_running_loop()

        async def one(p, stop):
            body = {"prompt": "x", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "cache_prompt": False, **({"stop": [stop]} if stop else {})}
            job = Job(loop, list(p), max_tokens, GenParams(body, chat=False))
            b.submit(job)
            text = []
            while True:
                item = await job.queue.get()
                if item[0] == "end":
                    return "".join(text), item[1]["usage"]["completion_tokens"], item[1]["finish_reason"]
                assert item[0] != "error", item
                if item[0] == "text":
                    text.append(item[1])
        return await asyncio.gather(*[one(p, s) for p, s in zip(prompts, stops)])
    try:
        return asyncio.run(drive()), b, sum(q is not None for q in queued)
    finally:
        b.close()
        b.thread.join()


def test_server_queues_the_next_decode_step(monkeypatch):
    """The server's batcher queues a greedy decode step on the GPU before the last step's jobs advance
    (Batcher._queue_next, Model.decode_batch_async): three concurrent jobs give the same replies as with no step
    queued, and so does a job that a stop string ends while its next row was queued (the row unused), the other
    jobs going on; the slots then answer again alike."""
    pytest.importorskip("fastapi")                       # the server's (not on the GPU machine's bare image)
    import hybridmoe
    _fake_gpu_or_real(monkeypatch)
    m = hybridmoe.load("synth:tiny", ctx_size=144, n_gpu_layers=99)
    prompts = [IDS[:5], IDS[5:17], IDS[17:20]]
    plain, b0, n0 = _serve(m, prompts, 12, [None] * 3, queue=False)
    assert n0 == 0 and all(n == 12 for _, n, _ in plain)
    got, b1, n1 = _serve(m, prompts, 12, [None] * 3, queue=True)
    assert n1 > 0 and got == plain
    assert b1.counts["batch_sequences"] == b0.counts["batch_sequences"]
    text = plain[1][0]
    cut = next(i for i in range(len(text) // 3, len(text)) if text[i:i + 2].strip() == text[i:i + 2])
    stop = text[cut:cut + 2]                     # ends job 1 a few tokens before its limit
    stops = [None, stop, None]
    want, _, _ = _serve(m, prompts, 12, stops, queue=False)
    got, _, n2 = _serve(m, prompts, 12, stops, queue=True)
    assert want[1][2] == "stop" and want[1][1] < 12 and n2 > 0
    assert got == want and got[0] == plain[0] and got[2] == plain[2]
