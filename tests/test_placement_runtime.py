"""Placement invariance: every placement gives the logits of all-CPU, on fake GPUs (CI) and real GPUs.

Fake GPUs are CPU-backed, so the arithmetic is nearly the same; a real GPU runs bf16 GEMMs, so it gets 1e-2 and
top-1 agreement. Nearly: rows the CPU kernels run on their integer path (Q4_0 and Q8_0 here: activations rounded
to ~15 bits, docs/cpu-kernels.md) turn the paths' last-bit differences (all-CPU prompts run hm_prompt_step, with
float32 attention and C norms; a fake GPU's static decode step dequantizes Q8_0 rows for torch) into quantization
steps: 1.7e-5 to 3.9e-5 measured (2026-11-25), so FAKE_TOL = 1e-4.
"""
import os
import time

import pytest
import torch
from conftest import rel_l2, top1_agreement

import hybridmoe

IDS = [(i * 37 + 11) % 1000 + 3 for i in range(40)]
FAKE_TOL = 1e-4

PLACEMENTS = {
    "ngl99": dict(n_gpu_layers=99),
    "ngl99-exps-cpu": dict(n_gpu_layers=99, override_tensor=[r"exps=CPU"]),
    "experts-split": dict(n_gpu_layers=99, override_tensor=[r"blk\.0\.ffn_.*_exps=CUDA1", r"blk\.1\.ffn_.*_exps=CPU"]),
    "forced-offload": dict(n_gpu_layers=99, override_tensor=[r"exps=CPU"], offload_policy="all,1",
                           offload_only_active_experts="0"),
    "forced-offload-active": dict(n_gpu_layers=99, override_tensor=[r"exps=CPU"], offload_policy="all,1",
                                  offload_only_active_experts="1"),
    "gate-up-split": dict(n_gpu_layers=99, override_tensor=[r"blk\.1\.ffn_up_exps=CPU"]),
    "ngl1": dict(n_gpu_layers=1),
    "layers-ts": dict(n_gpu_layers=99, tensor_split=[1, 1]),
}


def _run(opts, ids=IDS, ub=16):
    m = hybridmoe.load("synth:tiny", ctx_size=128, ubatch_size=ub, **opts)
    prompt = m.logits(ids)                                     # prompt batches of 16
    kv = m.new_cache(128)
    m.forward(torch.tensor(ids[:30]), 0, kv)
    decode = torch.cat([m.forward(torch.tensor([t]), 30 + i, kv) for i, t in enumerate(ids[30:])])
    return m, prompt, decode


@pytest.fixture(scope="module")
def reference():
    _, p, d = _run({})
    return p, d


@pytest.fixture
def fake_gpus(monkeypatch):
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "2x1GiB")


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_fake_gpu_placements_match_all_cpu(name, reference, fake_gpus):
    m, p, d = _run(PLACEMENTS[name])
    assert rel_l2(p, reference[0]) <= FAKE_TOL
    assert rel_l2(d, reference[1]) <= FAKE_TOL
    assert m.stats.crossings > 0


def test_forced_offload_uploads_exactly_the_selected_experts(fake_gpus):
    m = hybridmoe.load("synth:tiny", ctx_size=128, ubatch_size=64, n_gpu_layers=99, override_tensor=["exps=CPU"],
                       offload_policy="all,1", offload_only_active_experts="1")
    ids_seen = []
    orig = m.sched._moe_uploaded

    def spy(x, ids, wts, ws, *args, **kw):
        ids_seen.append((*ws, torch.unique(ids).numel()))
        return orig(x, ids, wts, ws, *args, **kw)
    m.sched._moe_uploaded = spy
    m.logits(IDS)
    expect = sum(n * (g.raw[0].numel() + u.raw[0].numel() + d.raw[0].numel()) for g, u, d, n in ids_seen)
    assert len(ids_seen) == 2                                 # one upload per MoE layer of the single ubatch
    assert m.stats.uploads["bytes"] == expect
    assert m.stats.uploads["experts"] == sum(n for *_, n in ids_seen)


def test_token_generation_uploads_no_expert_bytes(fake_gpus):
    m = hybridmoe.load("synth:tiny", ctx_size=128, n_gpu_layers=99, override_tensor=["exps=CPU"],
                       offload_policy="all,1")
    kv = m.new_cache(128)
    m.forward(torch.tensor(IDS[:4]), 0, kv)                   # a 4-token batch: below any offload threshold
    for i in range(5):
        m.forward(torch.tensor([IDS[i]]), 4 + i, kv)
    assert m.stats.uploads["bytes"] == 0


def test_split_count_matches_placement(monkeypatch):
    """-ngl 99 -ot exps=CPU: per layer the hidden state goes to the CPU experts (with the router's choice, in
    one copy) and comes back; the embeddings start on the CPU and the logits come home."""
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    m = hybridmoe.load("synth:tiny", ctx_size=128, n_gpu_layers=99, override_tensor=["exps=CPU"])
    kv = m.new_cache(128)
    m.forward(torch.tensor([5]), 0, kv)
    n_layer = m.cfg.n_layer
    # embeddings CPU->GPU, per layer GPU->CPU and CPU->GPU, nothing else (logits stay on GPU in the count)
    assert m.stats.crossings == 1 + 2 * n_layer
    assert m.stats.copies[("CUDA0", "CPU")][0] == n_layer


def test_all_on_one_gpu_has_one_crossing(monkeypatch):
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    m = hybridmoe.load("synth:tiny", ctx_size=128, n_gpu_layers=99)
    kv = m.new_cache(128)
    m.forward(torch.tensor([5]), 0, kv)
    assert m.stats.crossings == 1                             # the embeddings rows, CPU -> CUDA0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ngl99", "ngl99-exps-cpu", "forced-offload", "forced-offload-active",
                                  "gate-up-split", "ngl1"])
def test_real_gpu_placements_match_all_cpu(name, reference):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    opts = dict(PLACEMENTS[name])
    opts["override_tensor"] = [r.replace("CUDA1", "CUDA0") for r in opts.get("override_tensor", [])]
    m, p, d = _run(opts)
    for got, ref in ((p, reference[0]), (d, reference[1])):
        assert rel_l2(got, ref) <= 1e-2
        assert top1_agreement(got, ref) >= 0.98
    # one 40-token ubatch: 80 (token, expert) pairs take the grouped GEMM path instead of the gathered one
    _, p40, _ = _run(opts, ub=40)
    assert rel_l2(p40, reference[0]) <= 1e-2


def _prompt_cache_logits(opts):
    """A prompt that shares 33 tokens with what the cache holds: (its logits run from there, from scratch)."""
    from hybridmoe.generate import prefill
    m = hybridmoe.load("synth:tiny", ctx_size=128, ubatch_size=16, **opts)
    kv = m.take_cache()
    prefill(m, kv, IDS)                                        # 40 tokens in ubatches of 16
    b = IDS[:33] + [7, 8, 9]
    n = kv.reusable_prefix(b)
    assert n == 33
    return prefill(m, kv, b[n:], n), m.logits(b)[-1]


@pytest.mark.parametrize("name", ["ngl99", "ngl99-exps-cpu", "layers-ts"])
def test_prompt_cache_on_fake_gpus(name, fake_gpus):
    got, ref = _prompt_cache_logits(PLACEMENTS[name])
    assert rel_l2(got, ref) <= 1e-2                             # 3 tokens after the cache vs a 36-token batch


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ngl99", "ngl99-exps-cpu", "forced-offload"])
def test_prompt_cache_on_a_real_gpu(name):
    """The static prompt and decode steps (CUDA graphs) start at the cached position."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    got, ref = _prompt_cache_logits(PLACEMENTS[name])
    assert rel_l2(got, ref) <= 2e-2 and top1_agreement(got[None], ref[None]) == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["experts-split", "layers-ts", "layers-ts-exps-cpu"])
def test_two_real_gpus_match_all_cpu(name, reference):
    """nvidia-h200-x2: layers split by -ts, experts on the second GPU and the CPU; activations move GPU to
    GPU. Logits within bf16 tolerance of all-CPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    opts = dict(PLACEMENTS["layers-ts"], override_tensor=[r"blk\.1\.ffn_.*_exps=CPU"]) \
        if name == "layers-ts-exps-cpu" else PLACEMENTS[name]
    m, p, d = _run(opts)
    assert {dev.name for dev in m.devices.values()} >= {"CUDA0", "CUDA1"}
    for got, ref in ((p, reference[0]), (d, reference[1])):
        assert rel_l2(got, ref) <= 1e-2
        assert top1_agreement(got, ref) >= 0.98
    _, p40, _ = _run(opts, ub=40)
    assert rel_l2(p40, reference[0]) <= 1e-2


@pytest.mark.parametrize("name", ["ngl99", "ngl99-exps-cpu"])
def test_static_decode_step_matches_eager(name, monkeypatch):
    """The static (CUDA-graph) decode step, run eagerly on a fake GPU, equals the eager decoder."""
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    outs = []
    for graphs in (True, False):
        m = hybridmoe.load("synth:tiny", ctx_size=64, graphs=graphs, **PLACEMENTS[name])
        kv = m.new_cache(64)
        m.forward(torch.tensor(IDS[:7]), 0, kv)
        outs.append(torch.cat([m.forward(torch.tensor([t]), 7 + i, kv) for i, t in enumerate(IDS[7:20])]))
        if graphs:
            from hybridmoe.runtime.steps.gpu_decode import StaticDecoder
            assert isinstance(m._step_for("decode", kv), StaticDecoder)
            n_cpu = sum(1 for seg in m._step_for("decode", kv).segments if seg.kind == "cpu")
            assert n_cpu == (m.cfg.n_layer if "exps-cpu" in name else 0)
    assert rel_l2(outs[0], outs[1]) <= FAKE_TOL


def _gpus_or_interpreter(n: int, monkeypatch) -> bool:
    """True with n real GPUs; else n fake ones, for the fused kernels in Triton's interpreter (False), or a skip."""
    from hybridmoe.kernels import gpu_decode as gd
    if torch.cuda.device_count() >= n:
        return True
    if not (gd.available() and os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip(f"needs {n} GPU(s), or triton with TRITON_INTERPRET=1")
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", f"{n}x1GiB")
    return False


# (-ts, -ot, preset): layers per GPU; then a layer's FFN on the other GPU than its attention (its experts only,
# the router copied over; with CPU experts elsewhere; issue 521's whole `blk.N.ffn.=CUDAk` rules, with the rest
# of the FFNs in RAM; a dense model's FFN)
TWO_GPUS = [([1, 3], [], "tiny"), ([1, 3], [r"blk\.0\.ffn_.*_exps=CPU"], "tiny"), ([1, 1], ["exps=CPU"], "tiny"),
            ([1, 0], [r"blk\.1\.ffn_.*_exps=CUDA1"], "tiny"),
            ([1, 1], [r"blk\.0\.ffn_.*_exps=CUDA1", "exps=CPU"], "tiny"),
            ([1, 1], [r"blk\.0\.ffn.=CUDA1", r"blk\.1\.ffn.=CUDA0"], "tiny"),
            ([1, 1], [r"blk\.0\.ffn.=CUDA1", "ffn.*=CPU"], "tiny"),
            ([1, 0], [r"blk\.0\.ffn.=CUDA1"], "tiny-dense")]


def _ffn_elsewhere(sd) -> list[int]:
    """Layers whose FFN part runs on another GPU than their attention."""
    return [i for i, (a, f) in enumerate(zip(sd.ldev, sd.fdev)) if a.name != f.name]


@pytest.mark.parametrize("ts,ot,preset", TWO_GPUS)
def test_static_decode_over_two_gpus_matches_eager(ts, ot, preset, monkeypatch):
    """Segments per GPU, the residual handed GPU to GPU between graphs (between layers, or inside a layer whose
    FFN is on another GPU): on two real GPUs (x2 machine), or on two fake ones with the fused kernels in
    Triton's interpreter (TRITON_INTERPRET=1)."""
    from hybridmoe.runtime.steps.gpu_decode import StaticDecoder
    real = _gpus_or_interpreter(2, monkeypatch)
    outs = []
    for graphs in (True, False):
        m = hybridmoe.load(f"synth:{preset}", ctx_size=64, graphs=graphs, n_gpu_layers=99, tensor_split=ts,
                           override_tensor=ot)
        kv = m.new_cache(64)
        m.forward(torch.tensor(IDS[:7]), 0, kv)
        outs.append(torch.cat([m.forward(torch.tensor([t]), 7 + i, kv) for i, t in enumerate(IDS[7:20])]))
        if graphs:
            sd = m._step_for("decode", kv)
            assert isinstance(sd, StaticDecoder) and sd.worked and len({seg.dev.name for seg in sd.segments}) == 2
            assert bool(_ffn_elsewhere(sd)) == any("CUDA" in rule for rule in ot)
            if real:
                assert sd.graphs is not None and len(sd.graphs) == len(sd.segments)
    if real:
        assert rel_l2(outs[0], outs[1]) <= 1e-2 and top1_agreement(outs[0], outs[1]) >= 0.9
    else:               # (the fused path reads the Q8_0 projections with two-term int8 activations: ~2e-5)
        assert rel_l2(outs[0], outs[1]) <= 1e-4


@pytest.mark.parametrize("ot,why,warning", [
    ([r"blk\.0\.ffn_gate_exps=CUDA0", r"blk\.0\.ffn_(up|down)_exps=CUDA1", "exps=CPU"],
     "blk 0: experts split across devices (gate on CUDA0, up on CUDA1, down on CUDA1)", "issue 521"),
    ([r"blk\.1\.ffn_down_exps=CUDA0", "exps=CPU"],
     "blk 1: experts split across devices (gate on CPU, up on CPU, down on CUDA0)", "runs eagerly"),
    ([r"blk\.1\.ffn_.*_exps=CUDA0"], "", ""), ([r"blk\.0\.ffn.=CUDA1", "ffn.*=CPU"], "", "")])
def test_two_gpus_plan_warns_where_the_static_decode_step_refuses(ot, why, warning, monkeypatch):
    """plan's warning (placement/core.py) and the step (kernels/decode_layout.py's rule) agree: the layout the
    step refuses, for that reason, is the one plan warns about; issue 521's gate/up split is refused too and
    has a warning of its own."""
    from hybridmoe.runtime.steps import NotApplicable
    from hybridmoe.runtime.steps.gpu_decode import StaticDecoder
    _gpus_or_interpreter(2, monkeypatch)
    m = hybridmoe.load("synth:tiny", ctx_size=64, n_gpu_layers=99, tensor_split=[1, 1], override_tensor=ot)
    try:
        StaticDecoder(m, m.new_cache(64), capture=False)
        refused = ""
    except NotApplicable as e:
        refused = str(e)
    assert refused.replace("layer ", "blk ").startswith(why) if why else refused == ""
    warned = [w for w in m.placement.warnings if "runs eagerly" in w or "issue 521" in w]
    assert [warning in w for w in warned] == ([True] if why else [])
    if warning == "runs eagerly":
        assert warned[0].startswith(why)


@pytest.mark.parametrize("preset", ["tiny", "tiny-dense"])
def test_captured_prompt_step_matches_eager(preset, monkeypatch):
    """Every weight on one GPU: a prompt's ubatches run as one captured graph per ubatch size (real GPU), or
    the same kernels eagerly in Triton's interpreter (fake GPU). Three full 10-token ubatches at positions 0, 10,
    20 (the graph's position comes from a device tensor), a shorter last one, all logits or the last, then
    decoding from the cache it wrote: all as the eager path."""
    from hybridmoe.runtime.steps.gpu_prefill import StaticPrefill
    real = _gpus_or_interpreter(1, monkeypatch)
    outs = []
    for graphs in (True, False):
        m = hybridmoe.load(f"synth:{preset}", ctx_size=64, graphs=graphs, n_gpu_layers=99, ubatch_size=10)
        kv = m.new_cache(64)
        # (10 tokens: the eager path's CPU products on a fake GPU stay float32 below 12, as the kernels here)
        got = [m.forward(torch.tensor(IDS[i:i + 10]), i, kv, all_logits=i < 10) for i in (0, 10, 20)]
        got.append(m.forward(torch.tensor(IDS[30:34]), 30, kv, all_logits=False))
        got.append(torch.cat([m.forward(torch.tensor([t]), 34 + j, kv) for j, t in enumerate(IDS[:5])]))
        outs.append(torch.cat(got))
        if graphs:
            sp = m._step_for("prompt", kv)
            assert isinstance(sp, StaticPrefill) and sp.worked
            assert m.stats.forwards == 9 and m.stats.tokens == 39
            if real:                             # full ubatches: captured right after their first, eager, run
                assert sp.graphs[(10, False)] is not None and sp.graphs[(10, True)] is not None
                m.forward(torch.tensor(IDS[30:34]), 30, kv, all_logits=False)
                assert (4, False) not in sp.graphs                   # a shorter one: eager, even when it recurs
    if real:
        assert rel_l2(outs[0], outs[1]) <= 1e-2 and top1_agreement(outs[0], outs[1]) >= 0.9
    else:
        assert rel_l2(outs[0], outs[1]) <= 1e-4


def test_captured_prompt_step_not_for_split_placements(monkeypatch):
    """Experts in RAM, or layers on the CPU: the eager path (uploads, the CPU kernels) runs prompts."""
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for opts in (PLACEMENTS["ngl99-exps-cpu"], PLACEMENTS["ngl1"], dict(n_gpu_layers=99, graphs=False)):
        m = hybridmoe.load("synth:tiny", ctx_size=64, **opts)
        assert m._step_for("prompt", m.new_cache(64)) is None
    from hybridmoe.kernels import gpu_decode as gd
    if gd.available():                                        # (and all on the GPU: it is there)
        m = hybridmoe.load("synth:tiny", ctx_size=64, n_gpu_layers=99)
        assert m._step_for("prompt", m.new_cache(64)) is not None


def test_profile_times_the_static_decode_step(monkeypatch, capsys):
    """--profile keeps the static step (what decode really runs) and splits its time: segments, CPU experts,
    and the rest (hand-offs, Python) per token."""
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    from hybridmoe.cli import main as cli
    rc = cli(["run", "-m", "synth:tiny", "-ngl", "99", "-ot", "exps=CPU", "-p", "hello world", "-n", "6",
              "--temp", "0", "--profile", "-t", "1"])
    err = capsys.readouterr().err
    assert rc == 0
    # "  decode step  CUDA0  calls  ms": 5 decode steps (the first token comes from the prompt), each 3
    # segments (2 layers with CPU experts, then the output)
    seg = [ln.split() for ln in err.splitlines() if ln.strip().startswith("decode step")]
    assert len(seg) == 1 and seg[0][2] == "CUDA0" and int(seg[0][3]) == 5 * 3
    cpu = [ln.split() for ln in err.splitlines() if ln.strip().startswith("moe_up_gate") and "CPU" in ln]
    assert int(cpu[0][2]) >= 5 * 2
    assert "ms per token" in err and "CPU experts:" in err


def test_static_step_failing_at_first_falls_back_to_eager(monkeypatch, capsys):
    """A static step that cannot run here (say, a GPU Triton cannot compile for) must not stop decoding."""
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)    # both prompts eager (no interpreted prompt step)
    from hybridmoe.runtime.steps.gpu_decode import StaticDecoder
    ref = hybridmoe.load("synth:tiny", ctx_size=64, graphs=False, n_gpu_layers=99)
    kv = ref.new_cache(64)
    ref.forward(torch.tensor(IDS[:7]), 0, kv)
    want = ref.forward(torch.tensor([IDS[7]]), 7, kv)

    def broken(self, token, pos):
        raise RuntimeError("no kernel image is available for execution on the device")
    monkeypatch.setattr(StaticDecoder, "step", broken)
    m = hybridmoe.load("synth:tiny", ctx_size=64, graphs=True, n_gpu_layers=99)
    kv = m.new_cache(64)
    m.forward(torch.tensor(IDS[:7]), 0, kv)
    got = m.forward(torch.tensor([IDS[7]]), 7, kv)
    assert torch.equal(got, want)
    assert "static decode step failed (RuntimeError: no kernel image" in capsys.readouterr().err
    assert m._step_for("decode", kv) is None                      # eager from then on, for this cache


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    for opts in (PLACEMENTS["ngl99"], PLACEMENTS["ngl99-exps-cpu"]):
        outs = []
        for graphs in (True, False):
            m = hybridmoe.load("synth:tiny", ctx_size=64, graphs=graphs, **opts)
            kv = m.new_cache(64)
            m.forward(torch.tensor(IDS[:7]), 0, kv)
            outs.append(torch.cat([m.forward(torch.tensor([t]), 7 + i, kv) for i, t in enumerate(IDS[7:20])]))
        assert rel_l2(outs[0], outs[1]) <= 1e-2
        assert top1_agreement(outs[0], outs[1]) >= 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ngl99", "ngl99-exps-cpu"])
def test_split_row_kernels_match_all_cpu(name):
    """synth:tiny-wide (rows 256 wide): on a GPU its Q4_0/Q8_0 experts, attention projections and head are
    kept in split rows and the static decode step multiplies them with dp4a (gpu_decode.gemv8, the MoE
    kernels); prompt and decode logits match all-CPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")

    def run(opts):
        m = hybridmoe.load("synth:tiny-wide", ctx_size=64, **opts)
        kv = m.new_cache(64)
        prompt = m.forward(torch.tensor(IDS[:12]), 0, kv)
        decode = torch.cat([m.forward(torch.tensor([t]), 12 + i, kv) for i, t in enumerate(IDS[12:24])])
        return m, kv, prompt, decode
    _, _, p_ref, d_ref = run({})
    m, kv, p, d = run(PLACEMENTS[name])
    sd = m._step_for("decode", kv)
    assert sd.out8 and all("qkv8" in lay and "o8" in lay for lay in sd.layers)
    assert m.decoder.layers[0].attn_qkv.split and (m.decoder.layers[0].ffn_up_exps.split == (name == "ngl99"))
    for got, ref in ((p, p_ref), (d, d_ref)):
        assert rel_l2(got, ref) <= 1e-2
        assert top1_agreement(got, ref) >= 0.98


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [PLACEMENTS["ngl99-exps-cpu"], dict(n_gpu_layers=99, n_cpu_moe=1)],
                         ids=["exps-cpu", "n-cpu-moe-1"])
def test_polled_handoff_matches_the_synchronous_one(opts, monkeypatch):
    """Experts on the CPU during CUDA-graph decode: the hand-off polled in pinned memory gives the logits of
    the synchronous one (within the bf16 GPU tolerance: two loads of the same placement differ by that
    much), each side read exactly what the other wrote, and an error on the CPU side raises without
    leaving the GPU waiting."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from hybridmoe.kernels import cpu
    monkeypatch.setenv("HYBRIDMOE_DECODE_SHARE", "0")          # the CPU runs all k (the share: below)
    outs = []
    for mode in ("poll", "sync"):
        monkeypatch.setenv("HYBRIDMOE_HANDOFF", mode)
        m = hybridmoe.load("synth:tiny", ctx_size=64, **opts, split_mode="none")
        kv = m.new_cache(64)
        m.forward(torch.tensor(IDS[:7]), 0, kv)
        outs.append(torch.cat([m.forward(torch.tensor([t]), 7 + i, kv) for i, t in enumerate(IDS[7:20])]))
        sd = m._step_for("decode", kv)
        assert (sd.hk is not None) == (mode == "poll")
        if mode == "poll":                                    # the last CPU layer of the last step
            hk, ds, H = sd.hk, sd.ds["CUDA0"], m.cfg.n_embd
            j, b = len(hk.calls) - 1, max(hk.slot)
            assert torch.equal(hk.packed[j], ds.packed[0].cpu())                 # what the CPU read
            g, u, d = sd.layers[sd.segments[b].layer]["exps"]
            k = m.cfg.n_expert_used
            again = cpu.moe_ffn(hk.packed[j:j + 1, :H], hk.packed[j:j + 1, H + k:].int(),
                                hk.packed[j:j + 1, H:H + k], g.raw, u.raw, d.raw, g.qtype, d.qtype,
                                n_threads=sd.sched.n_threads)
            assert torch.equal(hk.out[j], again[0])                              # from a whole row
    assert rel_l2(outs[0], outs[1]) <= 1e-2
    assert top1_agreement(outs[0], outs[1]) >= 0.9
    monkeypatch.setenv("HYBRIDMOE_HANDOFF", "poll")
    m = hybridmoe.load("synth:tiny", ctx_size=64, **opts, split_mode="none")
    kv = m.new_cache(64)
    m.forward(torch.tensor(IDS[:7]), 0, kv)
    m.forward(torch.tensor([IDS[7]]), 7, kv)                 # a first step (a failing one falls back to eager)
    sd = m._step_for("decode", kv)

    def boom(step):
        raise RuntimeError("boom")
    sd.hk.calls[0] = boom
    with pytest.raises(RuntimeError, match="boom"):
        m.forward(torch.tensor([IDS[8]]), 8, kv)
    t0 = time.perf_counter()
    torch.cuda.synchronize()                                  # nothing left spinning on the GPU
    assert time.perf_counter() - t0 < 5 and int(sd.hk.err[0]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["q4_0", "mixed-types", "q4_k"])
def test_decode_share_matches_the_cpu_alone(kind, monkeypatch, tmp_path):
    """The decode share: the GPU runs the last of each CPU layer's k experts from their host bytes, read over
    the bus, while the CPU runs the others. The logits match the CPU running all k (within the bf16 GPU
    tolerance); the CPU's output is moe_ffn over its slots exactly, and the GPU's row is its expert's. Mixed:
    layer 1's down experts are Q8_0 (as Q4_K_M files mix types), so the layers stage through two buffers;
    q4_k: Q4_K experts (256-wide rows: synth:tiny-wide's shape)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from hybridmoe.formats.gguf_write import write_gguf
    from hybridmoe.kernels import cpu
    from hybridmoe.models.synth import config_metadata, preset_config, synth_tensors
    from hybridmoe.quant.ref import random_blocks
    from hybridmoe.quant.types import GGMLType
    from hybridmoe.text.builtin_vocab import builtin_vocab_metadata
    path, mixed = "synth:tiny", kind == "mixed-types"
    if kind == "q4_k":
        cfg, _, ot = preset_config("tiny-wide")
        md = {"general.name": "q4k", **config_metadata(cfg), **builtin_vocab_metadata(cfg.n_vocab)}
        path = str(tmp_path / "q4k.gguf")
        write_gguf(path, cfg.arch, md, synth_tensors(cfg, GGMLType.Q4_K, ot, seed=3))
    if mixed:
        cfg, et, ot = preset_config("tiny")
        md = {"general.name": "mixed", **config_metadata(cfg), **builtin_vocab_metadata(cfg.n_vocab)}
        path = str(tmp_path / "mixed.gguf")
        q8 = lambda sh: (lambda: random_blocks(GGMLType.Q8_0, sh, torch.Generator().manual_seed(5)))  # noqa: E731
        write_gguf(path, cfg.arch, md, [(n, sh, GGMLType.Q8_0, q8(sh)) if n == "blk.1.ffn_down_exps.weight" else
                                        (n, sh, q, mk) for n, sh, q, mk in synth_tensors(cfg, et, ot, seed=3)])
    outs = []
    for share in (0, 1):
        monkeypatch.setenv("HYBRIDMOE_DECODE_SHARE", str(share))
        m = hybridmoe.load(path, ctx_size=64, **PLACEMENTS["ngl99-exps-cpu"], split_mode="none")
        kv = m.new_cache(64)
        m.forward(torch.tensor(IDS[:7]), 0, kv)
        outs.append(torch.cat([m.forward(torch.tensor([t]), 7 + i, kv) for i, t in enumerate(IDS[7:20])]))
        sd = m._step_for("decode", kv)
        assert sd.hk is not None and sd.hk.share == share
    assert len(sd.hk.stage) == (2 if mixed else 1)
    hk, H, k = sd.hk, m.cfg.n_embd, m.cfg.n_expert_used
    j, b = len(hk.calls) - 1, max(hk.slot)
    g, u, d = sd.layers[sd.segments[b].layer]["exps"]
    x, wts, ids = hk.packed[j:j + 1, :H], hk.packed[j:j + 1, H:H + k], hk.packed[j:j + 1, H + k:].int()
    mine = cpu.moe_ffn(x, ids[:, :k - 1].contiguous(), wts[:, :k - 1].contiguous(), g.raw, u.raw, d.raw,
                       g.qtype, d.qtype, n_threads=sd.sched.n_threads)
    assert torch.equal(hk.out[j], mine[0])
    gpus = cpu.moe_ffn(x, ids[:, k - 1:].contiguous(), wts[:, k - 1:].contiguous(), g.raw, u.raw, d.raw,
                       g.qtype, d.qtype, impl="torch")
    assert rel_l2(hk.gout.cpu(), gpus) <= 1e-4
    assert rel_l2(outs[1], outs[0]) <= 1e-2
    assert top1_agreement(outs[1], outs[0]) >= 0.9


@pytest.mark.gpu
def test_quick_link_rates_for_an_uncalibrated_share():
    """Without a cached calibration the decode share measures the two rates it balances, quickly."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from hybridmoe.devices import list_devices
    from hybridmoe.perf.calibrate import quick_link_rates
    gpu = next(d for d in list_devices() if d.kind == "cuda")
    t0 = time.perf_counter()
    r = quick_link_rates(gpu)
    assert time.perf_counter() - t0 < 5
    assert r.ram_read_bw > 1e9 and r.h2d(gpu.name) > 1e9 and r.quick


def test_split_gate_up_costs_one_extra_crossing(monkeypatch):
    """Issue 521: gate on the GPU, up and down on the CPU. The unfused path adds one crossing per layer."""
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    counts = {}
    for name, ot in (("fused", [r"ffn_(up|down|gate)_exps=CPU"]), ("split", [r"ffn_(up|down)_exps=CPU"])):
        m = hybridmoe.load("synth:tiny", ctx_size=64, n_gpu_layers=99, override_tensor=ot, graphs=False,
                           split_mode="none")
        kv = m.new_cache(64)
        m.forward(torch.tensor([5]), 0, kv)
        counts[name] = m.stats.crossings
    assert counts["split"] == counts["fused"] + m.cfg.n_layer


def test_no_op_offload_never_uploads(fake_gpus):
    m = hybridmoe.load("synth:tiny", ctx_size=128, ubatch_size=64, n_gpu_layers=99, override_tensor=["exps=CPU"],
                       op_offload=False, offload_policy="all,1")
    m.logits(IDS)
    assert m.stats.uploads["bytes"] == 0
    forced = hybridmoe.load("synth:tiny", ctx_size=128, ubatch_size=64, n_gpu_layers=99,
                            override_tensor=["exps=CPU"], offload_policy="all,1")
    forced.logits(IDS)
    assert forced.stats.uploads["bytes"] > 0


def test_host_arena_holds_copies_and_frees_its_mapping():
    import gc
    import weakref

    from hybridmoe.runtime import hostmem

    g = torch.Generator().manual_seed(3)
    srcs = [torch.randint(0, 256, (5, 999), dtype=torch.uint8, generator=g), torch.randn(7, 3, generator=g)]
    arena = hostmem.Arena(hostmem.arena_size(srcs))
    views = [arena.take(s) for s in srcs]
    for s, v in zip(srcs, views):
        assert torch.equal(s, v) and v.dtype == s.dtype and v.data_ptr() % hostmem.ALIGN == 0
    assert arena.buf.data_ptr() % hostmem.HUGE == 0
    with pytest.raises(ValueError, match="full"):
        arena.take(srcs[0])
    mm, start = weakref.ref(arena._mem), arena.buf.data_ptr()

    def mapped():
        with open("/proc/self/maps") as f:
            return any(int(a, 16) <= start < int(b, 16) for a, b in (ln.split()[0].split("-") for ln in f))
    del arena
    gc.collect()
    assert mm() is not None and mapped(), "the views must keep the mapping alive"
    views[0].add_(1)                       # still writable memory
    del views, v                           # (v: the loop variable above)
    gc.collect()
    assert mm() is None and not mapped()   # unmapped once the last view is gone


def test_cpu_experts_live_in_the_arena(monkeypatch):
    def mapped(m, name):       # the tensor's bytes are the file mapping's
        return m.weights[name].raw.data_ptr() == m.file.raw(m.file.tensors[name]).data_ptr()

    monkeypatch.setenv("HYBRIDMOE_HOST_ARENA", "1")              # (without it: only when pinned for a GPU)
    m = hybridmoe.load("synth:tiny", ctx_size=128)
    exps = [n for n in m.weights if "_exps." in n]
    assert exps and not any(mapped(m, n) for n in exps)
    assert all(m.weights[n].raw.data_ptr() % 4096 == 0 for n in exps)
    assert mapped(m, "token_embd.weight")
    monkeypatch.setenv("HYBRIDMOE_HOST_ARENA", "0")
    m0 = hybridmoe.load("synth:tiny", ctx_size=128)
    assert all(mapped(m0, n) or m0.weights[n].raw.is_pinned() for n in exps)   # pinned copies with a GPU
    ids = torch.tensor(IDS[:12])
    assert torch.equal(m.logits(ids), m0.logits(ids))


@pytest.mark.gpu
def test_pinned_arena_uploads_asynchronously():
    from hybridmoe.runtime import hostmem

    src = torch.randint(0, 256, (1 << 22,), dtype=torch.uint8)
    arena = hostmem.Arena(src.numel())
    v = arena.take(src)
    assert arena.pin() and v.is_pinned()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        d = v.to("cuda", non_blocking=True)
    s.synchronize()
    assert torch.equal(d.cpu(), src)


def test_prompt_embeddings_dequantized_on_the_first_layers_gpu(reference, fake_gpus):
    """A prompt ubatch of 16 tokens or more for a GPU takes its embedding rows there in their file bytes (the
    scheduler's embed); a shorter one, and a decode token, dequantizes them on the CPU; the logits as all-CPU."""
    m, p, d = _run(PLACEMENTS["ngl99"])
    assert m.stats.ops[("get_rows", "CUDA0")][0] >= 2           # the ubatches of 16, the prompt of 30
    assert m.stats.ops[("get_rows", "CPU")][0] >= 1             # the last ubatch (8 tokens)
    assert rel_l2(p, reference[0]) <= FAKE_TOL and rel_l2(d, reference[1]) <= FAKE_TOL
