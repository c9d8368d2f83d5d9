"""Model.forward_batch: several sequences, each on its own cache, in one pass (issue 27, points 3 and 4).

All-CPU, the batch runs hm_batch_step, whose every token is computed as the decode step computes it alone: a
sequence's logits are bit-identical batched or alone, whatever runs next to it (prompt chunks, decode tokens,
other positions). Elsewhere the eager decoder runs the batch; on fake GPUs it matches each item's own forward
within the placement-invariance tolerance (FAKE_TOL, test_placement_runtime.py); on a real GPU the bf16 GEMMs
depend on the batch size: the GPU test prints by how much (docs/server.md).
"""
from __future__ import annotations

import pytest
import torch
from conftest import rel_l2, top1_agreement

import hybridmoe
from hybridmoe.errors import HybridMoeError
from hybridmoe.kernels import cpu
from hybridmoe.quant.types import GGMLType as G

FAKE_TOL = 1e-4

needs_c = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the CPU kernels")


def _synth(tmp_path, preset: str, et, ot) -> str:
    """The synth preset with every expert of type et and every other matrix of type ot."""
    from hybridmoe.formats.gguf_write import write_gguf
    from hybridmoe.models.synth import config_metadata, preset_config, synth_tensors
    from hybridmoe.text.builtin_vocab import builtin_vocab_metadata
    cfg, _, _ = preset_config(preset)
    path = str(tmp_path / f"{preset}-{et.name}-{ot.name}.gguf")
    md = {"general.name": cfg.name, "general.type": "model", **config_metadata(cfg),
          **builtin_vocab_metadata(cfg.n_vocab)}
    write_gguf(path, cfg.arch, md, synth_tensors(cfg, et, ot, seed=99))
    return path


def _prompts(lengths, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _alone(m, prompt, n_new, ctx):
    """A sequence on its own: the whole prompt in one forward, then greedy decode step by step. Returns the logits
    of every position and the generated tokens."""
    kv = m.new_cache(ctx)
    rows = [m.forward(prompt, 0, kv, all_logits=True)]
    toks = []
    for i in range(n_new):
        toks.append(int(rows[-1][-1].argmax()))
        rows.append(m.forward(torch.tensor([toks[-1]]), prompt.shape[0] + i, kv))
    return torch.cat(rows), toks


def _served(m, prompts, starts, chunk, n_new, ctx):
    """The sequences as a continuous-batching server runs them: sequence j joins at step starts[j], its prompt
    in chunks of `chunk[j]` tokens, then a greedy token a step; every step one forward_batch over the sequences
    that have work, prompt chunks next to decode tokens. Returns per sequence its logits and its tokens."""
    kvs = [m.new_cache(ctx) for _ in prompts]
    rows = [[] for _ in prompts]
    toks = [[] for _ in prompts]
    done = [0] * len(prompts)                          # positions written
    step = 0
    while any(len(t) < n_new for t in toks):
        items, who = [], []
        for j, p in enumerate(prompts):
            if step < starts[j] or len(toks[j]) >= n_new:
                continue
            if done[j] < p.shape[0]:
                piece = p[done[j]:done[j] + chunk[j]]
            else:
                piece = torch.tensor([toks[j][-1]])
            items.append((piece, done[j], kvs[j]))
            who.append(j)
        outs = m.forward_batch(items, all_logits=True)
        for j, (piece, _, _), out in zip(who, items, outs):
            assert out.shape == (piece.shape[0], m.cfg.n_vocab)
            done[j] += piece.shape[0]
            rows[j].append(out)
            if done[j] >= prompts[j].shape[0]:
                toks[j].append(int(out[-1].argmax()))
        step += 1
    for kv, p, t in zip(kvs, prompts, toks):             # each cache records its own tokens (the prompt cache)
        assert kv.tokens == p.tolist() + t[:-1]
    # the alone run computes the last generated token's logits too; the server stops before it
    return [torch.cat(r) for r in rows], toks


@needs_c
@pytest.mark.parametrize("types", [(G.Q4_0, G.Q8_0), (G.Q8_0, G.Q8_0), (G.F32, G.F32)],
                         ids=["q4_0-q8_0", "q8_0", "f32"])
def test_cpu_batch_is_bit_identical_to_each_sequence_alone(types, tmp_path):
    if not all(cpu.canonical(q) for q in types):
        pytest.skip(f"{types[0].name}/{types[1].name} rows are not computed alike at every batch size on this CPU")
    path = "synth:tiny" if types == (G.Q4_0, G.Q8_0) else _synth(tmp_path, "tiny", *types)
    m = hybridmoe.load(path, ctx_size=256)
    prompts = _prompts([5, 17, 40, 1, 9, 70])
    starts, chunk, n_new = [0, 0, 2, 3, 3, 1], [16, 5, 64, 1, 3, 32], 8
    got_rows, got_toks = _served(m, prompts, starts, chunk, n_new, 256)
    assert m._batch                                          # the C batch step ran
    for j, p in enumerate(prompts):
        ref_rows, ref_toks = _alone(m, p, n_new, 256)
        assert got_toks[j] == ref_toks
        assert torch.equal(got_rows[j], ref_rows[:got_rows[j].shape[0]]), f"sequence {j}"


@needs_c
@pytest.mark.slow
def test_cpu_batch_many_sequences_and_long_contexts():
    """20 sequences decoding together (their attention partials take two waves), one of them past 2,048
    positions (runs of 64 positions, not 32): each bit-identical to its own decode steps."""
    if not (cpu.canonical(G.Q4_0) and cpu.canonical(G.Q8_0)):
        pytest.skip("Q4_0/Q8_0 rows are not computed alike at every batch size on this CPU")
    m = hybridmoe.load("synth:tiny", ctx_size=2200)
    prompts = _prompts([3 + 7 * j for j in range(19)] + [2100], seed=3)
    kvs = [m.new_cache(2200) for _ in prompts]
    last = m.forward_batch([(p, 0, kv) for p, kv in zip(prompts, kvs)])
    for i in range(3):
        toks = [int(o.argmax()) for o in last]
        last = m.forward_batch([(torch.tensor([t]), p.shape[0] + i, kv) for t, p, kv in zip(toks, prompts, kvs)])
        assert m.stats.last_batch["sequences"] == 20 and m.stats.last_batch["tokens"] == 20
        for j in (0, 7, 19):
            kv = m.new_cache(2200)
            kv_ref = m.forward(prompts[j], 0, kv, all_logits=False)
            assert kv_ref.shape == (1, m.cfg.n_vocab)
            ref = None
            tok = int(kv_ref.argmax())
            for s in range(i + 1):
                ref = m.forward(torch.tensor([tok]), prompts[j].shape[0] + s, kv)
                tok = int(ref.argmax())
            assert torch.equal(last[j], ref), (i, j)


@needs_c
def test_cpu_batch_distinct_experts_match_the_routing():
    """stats.last_batch's distinct experts per layer from the C step equal the eager decoder's count of the same
    batch's routing (torch.unique of its router choice)."""
    prompts = _prompts([1] * 6 + [12], seed=5)
    seen = []
    for graphs in (True, False):
        m = hybridmoe.load("synth:tiny", ctx_size=64, graphs=graphs)
        m.forward_batch([(p, 0, m.new_cache(64)) for p in prompts])
        seen.append(m.stats.last_batch)
    c, eager = seen
    assert c["distinct_per_layer"] == eager["distinct_per_layer"]
    assert set(c["distinct_per_layer"]) == {0, 1}                         # synth:tiny: both layers MoE
    assert all(2 <= n <= 8 for n in c["distinct_per_layer"].values())
    assert c["distinct_experts"] == sum(c["distinct_per_layer"].values()) / 2


def _per_item(m, items, all_logits):
    return [m.forward(t, p, kv, all_logits) for t, p, kv in items]


def _check_eager_batch(m, ctx=128, tol=None):
    """A prompt batch of mixed lengths, then mixed decode tokens and a prompt chunk: forward_batch against each
    item's forward on twin caches. Within FAKE_TOL where the CPU computes Q4_0/Q8_0 rows alike at every batch
    size; on AVX2-only CPUs one token's rows take the int8 path and a batch's fp32 (~3e-3 apart)."""
    if tol is None:
        tol = FAKE_TOL if cpu.canonical(G.Q4_0) and cpu.canonical(G.Q8_0) else 1e-2
    prompts = _prompts([7, 1, 20, 3], seed=11)
    kb, kr = [m.new_cache(ctx) for _ in prompts], [m.new_cache(ctx) for _ in prompts]
    for all_logits in (True, False):
        got = m.forward_batch([(p, 0, kv) for p, kv in zip(prompts, kb)], all_logits)
        ref = _per_item(m, [(p, 0, kv) for p, kv in zip(prompts, kr)], all_logits)
        for g, r in zip(got, ref):
            assert g.shape == r.shape and g.dtype == torch.float32 and g.device.type == "cpu"
            assert rel_l2(g, r) <= tol
    extra = _prompts([5], seed=12)[0]
    pieces = [torch.tensor([int(r[-1].argmax())]) for r in ref]
    pieces[2] = extra                                   # a prompt chunk next to decode tokens

    def items(kvs):
        return [(t, p.shape[0], kv) for t, p, kv in zip(pieces, prompts, kvs)]
    got = m.forward_batch(items(kb), True)
    ref = _per_item(m, items(kr), True)
    for g, r in zip(got, ref):
        assert rel_l2(g, r) <= tol
    assert m.stats.last_batch["sequences"] == 4 and m.stats.last_batch["tokens"] == 8
    return got


PLACEMENTS = {
    "ngl99": dict(n_gpu_layers=99),
    "ngl99-exps-cpu": dict(n_gpu_layers=99, override_tensor=[r"exps=CPU"]),
    "experts-split": dict(n_gpu_layers=99, override_tensor=[r"blk\.0\.ffn_.*_exps=CUDA1", r"blk\.1\.ffn_.*_exps=CPU"]),
    "forced-offload-active": dict(n_gpu_layers=99, override_tensor=[r"exps=CPU"], offload_policy="all,1",
                                  offload_only_active_experts="1"),
    "ngl1": dict(n_gpu_layers=1),
    "layers-ts": dict(n_gpu_layers=99, tensor_split=[1, 1]),
}


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_eager_batch_matches_each_item_on_fake_gpus(name, monkeypatch):
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "2x1GiB")
    m = hybridmoe.load("synth:tiny", ctx_size=128, **PLACEMENTS[name])
    _check_eager_batch(m)
    assert m.stats.crossings > 0
    assert not m._batch                                  # GPU caches: never the CPU batch step


def test_mixed_batch_splits_decode_from_prompt(monkeypatch):
    """-ngl 0 with a GPU (here a fake one): a prompt chunk may be offloaded, so a batch of decode tokens and a prompt
    chunk runs as two: the decode tokens through the CPU batch step, the chunk through the prompt path; every row is
    what forward gives alone (bit for bit: the CPU decode rows are row-independent), the step's distinct experts
    those both parts read."""
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    m = hybridmoe.load("synth:tiny", ctx_size=128, n_gpu_layers=0)
    prompts = _prompts([7, 3, 9], seed=21)
    kb, kr = [m.new_cache(128) for _ in prompts], [m.new_cache(128) for _ in prompts]
    for p, a, b in zip(prompts, kb, kr):
        m.forward(p, 0, a)
        m.forward(p, 0, b)
    pieces = [torch.tensor([5]), _prompts([6], seed=22)[0], torch.tensor([9])]
    split = []
    orig = m._forward_split
    monkeypatch.setattr(m, "_forward_split", lambda *a: split.append(1) or orig(*a))
    for all_logits in (True, False):
        items = lambda kvs: [(t, p.shape[0], kv) for t, p, kv in zip(pieces, prompts, kvs)]   # noqa: E731
        got = m.forward_batch(items(kb), all_logits)
        ref = _per_item(m, items(kr), all_logits)
        for g, r in zip(got, ref):
            assert g.shape == r.shape and torch.equal(g, r)
        assert m._batch and not getattr(m._batch, "max_chunk", 0)      # the CPU batch step ran the decode
        lb = m.stats.last_batch
        assert lb["sequences"] == 3 and lb["tokens"] == 8
        assert lb["distinct_experts"] >= m.cfg.n_expert_used
        prompts = [torch.cat([p, t]) for p, t in zip(prompts, pieces)]
    assert len(split) == 2
    # one decode token next to a chunk: it splits off to its cache's static decode step (the CPU step here)
    def two(kvs):
        return [(torch.tensor([7]), prompts[0].shape[0], kvs[0]), (pieces[1], prompts[1].shape[0], kvs[1])]
    for g, r in zip(m.forward_batch(two(kb), True), _per_item(m, two(kr), True)):
        assert torch.equal(g, r)
    assert len(split) == 3


@pytest.mark.parametrize("preset", ["tiny-deepseek2", "tiny-gpt-oss", "tiny-dense"])
def test_eager_batch_other_architectures(preset):
    """MLA (deepseek2) attends per item; gpt-oss (sinks, sliding windows) and the dense qwen3 take the C step."""
    m = hybridmoe.load(f"synth:{preset}", ctx_size=128)
    _check_eager_batch(m)
    if preset == "tiny-deepseek2":
        assert not m._batch


def test_eager_batch_without_the_c_step():
    m = hybridmoe.load("synth:tiny", ctx_size=128, graphs=False)
    _check_eager_batch(m)


def test_batch_offload_decides_from_the_batch(monkeypatch):
    """-ot exps=CPU with forced only-active offload: 8 decode tokens stay under the offload batch and upload
    nothing; 40 sequences' decode tokens together form a batch that uploads, each layer exactly the distinct
    experts the batch routed to."""
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    m = hybridmoe.load("synth:tiny", ctx_size=64, n_gpu_layers=99, override_tensor=["exps=CPU"],
                       offload_policy="all,1", offload_only_active_experts="1")
    for B, uploads in ((8, False), (40, True)):
        prompts = _prompts([1] * B, seed=B)
        m.stats.reset()
        m.forward_batch([(p, 0, m.new_cache(64)) for p in prompts])
        lb = m.stats.last_batch
        assert lb["tokens"] == B
        if uploads:
            assert m.stats.uploads["experts"] == sum(lb["distinct_per_layer"].values())
            per = [m.decoder.layers[i].ffn_gate_exps for i in lb["distinct_per_layer"]]
            assert m.stats.uploads["bytes"] == sum(
                n * 3 * w.raw[0].numel() for n, w in zip(lb["distinct_per_layer"].values(), per))
        else:
            assert m.stats.uploads["bytes"] == 0


def test_batch_refuses_bad_items_before_touching_a_cache():
    m = hybridmoe.load("synth:tiny", ctx_size=32)
    a, b = m.new_cache(32), m.new_cache(16)
    m.forward(torch.tensor([1, 2, 3]), 0, a)
    assert a.tokens == [1, 2, 3]
    for items, msg in (
            ([(torch.tensor([4]), 3, a), (torch.tensor([5]), 3, a)], "its own KV cache"),
            ([(torch.tensor([4]), 3, a), (torch.arange(10), 10, b)], "context is full"),
            ([(torch.tensor([4]), 3, a), (torch.tensor([5000]), 0, b)], "not in the vocabulary"),
            ([(torch.tensor([4]), 3, a), (torch.tensor([], dtype=torch.long), 0, b)], "non-empty"),
            ([(torch.tensor([4]), 3, a), (torch.tensor([1.0]), 0, b)], "integer"),
            ([(torch.tensor([4]), 3, a), (torch.tensor([1]), -1, b)], "negative")):
        with pytest.raises(HybridMoeError, match=msg):
            m.forward_batch(items)
        assert a.tokens == [1, 2, 3]
    assert m.forward_batch([]) == []


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [dict(n_gpu_layers=99), dict(n_gpu_layers=99, override_tensor=["exps=CPU"])],
                         ids=["ngl99", "exps-cpu"])
def test_gpu_batch_against_each_sequence_alone(opts, capsys):
    """On a real GPU the batch's GEMMs see more rows than one sequence's, so the logits differ by the bf16
    GEMMs' batch dependence: bounded here, and printed (docs/server.md's table)."""
    m = hybridmoe.load("synth:tiny-wide", ctx_size=256, **opts)
    prompts = _prompts([30, 12, 50, 7, 25, 40, 3, 18], seed=21)
    kb, kr = [m.new_cache(256) for _ in prompts], [m.new_cache(256) for _ in prompts]
    got = m.forward_batch([(p, 0, kv) for p, kv in zip(prompts, kb)], True)
    ref = _per_item(m, [(p, 0, kv) for p, kv in zip(prompts, kr)], True)
    worst = max(float((g - r).abs().max()) for g, r in zip(got, ref))
    dec_worst, agree = 0.0, []
    toks = [int(r[-1].argmax()) for r in ref]
    for i in range(8):
        g = m.forward_batch([(torch.tensor([t]), p.shape[0] + i, kv) for t, p, kv in zip(toks, prompts, kb)])
        r = _per_item(m, [(torch.tensor([t]), p.shape[0] + i, kv) for t, p, kv in zip(toks, prompts, kr)], False)
        dec_worst = max(dec_worst, max(float((a - b).abs().max()) for a, b in zip(g, r)))
        agree.append(top1_agreement(torch.cat(g), torch.cat(r)))
        for a, b in zip(g, r):
            assert rel_l2(a, b) <= 1e-2
        toks = [int(b.argmax()) for b in r]
    with capsys.disabled():
        print(f"\n{opts}: max |logit diff| batch of 8 vs alone: prompts {worst:.3g}, decode {dec_worst:.3g}; "
              f"top-1 agreement {min(agree):.3f}")
    assert min(agree) >= 0.85
