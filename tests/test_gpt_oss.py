"""gpt-oss: logits against transformers' GptOssForCausalLM, cached decode, placements, bad files."""
import os

import pytest
import torch
from conftest import rel_l2, top1_agreement
from hf_oracle import convert, hf_logits, make_hf_model

import hybridmoe
from hybridmoe.errors import HybridMoeError, ModelFileError
from hybridmoe.formats.gguf import open_gguf
from hybridmoe.formats.gguf_write import write_gguf
from hybridmoe.quant.types import GGMLType
from hybridmoe.runtime.steps.gpu_decode_oai import GptOssStaticDecoder

IDS = [1, 17, 300, 42, 7, 7, 99, 511, 256, 3, 120, 64, 5, 480, 33, 2, 200, 201, 202, 10]
F32_CACHE = dict(cache_type_k="f32", cache_type_v="f32")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny random GptOssForCausalLM (sliding window 6 < 20 tokens, YaRN, sinks, biases, clamps that act)
    and its F32 GGUF."""
    d = tmp_path_factory.mktemp("hf-gpt-oss")
    model = make_hf_model("gpt-oss", str(d))
    path = convert(str(d), str(d / "gpt-oss-f32.gguf"), GGMLType.F32)
    return model, path, hf_logits(model, IDS)


def test_config_from_metadata(gpt_oss):
    m = hybridmoe.load(gpt_oss[1], ctx_size=64)
    cfg = m.cfg
    assert (cfg.arch, cfg.sliding_window, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp) == ("gpt-oss", 6, 8, 2, 32)
    assert [cfg.is_swa_layer(i) for i in range(cfg.n_layer)] == [True, False]      # transformers' layer_types
    assert cfg.rope_yarn["factor"] == 4.0 and cfg.rope_yarn["orig_ctx"] == 128 and not cfg.rope_yarn["truncate"]


@pytest.mark.parametrize("ub", [512, 4])
def test_matches_transformers(gpt_oss, ub):
    """F32 weights and cache: the same arithmetic as transformers up to float32 rounding (~3e-7 measured);
    -ub 4 makes the sliding window reach back across ubatches through the cache."""
    _, path, ref = gpt_oss
    ours = hybridmoe.load(path, ctx_size=64, ubatch_size=ub, **F32_CACHE).logits(IDS)
    assert ours.shape == ref.shape
    assert rel_l2(ours, ref) <= 1e-5
    f16 = hybridmoe.load(path, ctx_size=64, ubatch_size=ub).logits(IDS)                 # the default f16 cache
    assert rel_l2(f16, ref) <= 1e-3


@pytest.mark.parametrize("src", ["hf", "synth"])
def test_cached_decode_equals_full_forward(gpt_oss, src):
    path = gpt_oss[1] if src == "hf" else "synth:tiny-gpt-oss"                       # synth: Q4_0 / Q8_0
    m = hybridmoe.load(path, ctx_size=64, ubatch_size=4)
    full = m.logits(IDS)
    kv = m.new_cache(64)
    assert type(m._step_for("decode", kv)).__name__ == "CpuDecoder"                      # the C decode step
    m.forward(torch.tensor(IDS[:5]), 0, kv)
    steps = torch.stack([m.forward(torch.tensor([t]), 5 + i, kv)[0] for i, t in enumerate(IDS[5:])])
    assert rel_l2(steps, full[5:]) <= 1e-5


@pytest.mark.parametrize("opts,expert_dev", [
    (dict(n_gpu_layers=99), "CUDA0"),
    (dict(n_gpu_layers=99, override_tensor=["exps=CPU"]), "CPU"),
    (dict(n_gpu_layers=99, override_tensor=[r"ffn_down_exps\.=CPU"]), None),          # split experts: unfused
])
def test_placements_match_all_cpu(gpt_oss, monkeypatch, opts, expert_dev):
    path = gpt_oss[1]
    ref = hybridmoe.load(path, ctx_size=64).logits(IDS)
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    m = hybridmoe.load(path, ctx_size=64, **opts)
    assert m.placement.device_of["blk.0.attn_sinks.weight"] == "CUDA0"
    m.stats.reset()
    assert rel_l2(m.logits(IDS), ref) <= 1e-5
    ops = m.stats.ops
    if expert_dev is not None:
        assert ops[("moe_up_gate", expert_dev)][0] == m.cfg.n_layer
        assert m.placement.device_of["blk.1.ffn_up_exps.bias"] == expert_dev             # biases go with -ot exps
    else:
        assert ops[("mul_mat_id", "CPU")][0] == m.cfg.n_layer and ops[("mul_mat_id", "CUDA0")][0] == 2 * m.cfg.n_layer
    assert ops[("attention", "CUDA0")][0] == m.cfg.n_layer
    kv = m.new_cache(64)
    step = m._step_for("decode", kv)                                  # split experts: eager
    assert (step is None) == (expert_dev is None) and (step is None or isinstance(step, GptOssStaticDecoder))
    full = m.logits(IDS)
    m.forward(torch.tensor(IDS[:6]), 0, kv)
    steps = torch.cat([m.forward(torch.tensor([t]), 6 + i, kv) for i, t in enumerate(IDS[6:])])
    assert rel_l2(steps, full[6:]) <= _step_tol(step)


def _step_tol(step):
    """The static step's tolerance against the eager decoder: its torch attention is the eager arithmetic; the
    Triton kernels' (Triton's interpreter on a fake GPU) take q and the probabilities in the f16 cache's type."""
    return 1e-3 if step is not None and step.tri_attn else 1e-5


@pytest.mark.parametrize("opts", [dict(n_gpu_layers=99), dict(n_gpu_layers=99, override_tensor=["exps=CPU"])],
                         ids=["ngl99", "exps-cpu"])
def test_static_decode_step_matches_eager(gpt_oss, monkeypatch, opts):
    """gpt-oss's static decode step (runtime/steps/gpu_decode_oai.py), run eagerly on a fake GPU, gives the eager
    decoder's logits, through sliding-window rings that wrap (-ub 2: 6 - 1 + 2 slots for 20 positions)."""
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    outs = []
    for graphs in (True, False):
        m = hybridmoe.load(gpt_oss[1], ctx_size=64, ubatch_size=2, graphs=graphs, **opts)
        kv = m.new_cache(64)
        m.forward(torch.tensor(IDS[:4]), 0, kv)
        outs.append(torch.cat([m.forward(torch.tensor([t]), 4 + i, kv) for i, t in enumerate(IDS[4:])]))
        step = m._step_for("decode", kv)
        assert min(kv.slots) == 7                                    # the window's ring
        assert isinstance(step, GptOssStaticDecoder) and step.worked if graphs else step is None
        static = step if graphs else static
    assert rel_l2(outs[0], outs[1]) <= _step_tol(static)


@pytest.mark.parametrize("ub", [2, 512])
def test_cpu_decode_step_matches_eager(gpt_oss, tmp_path, ub):
    """All on the CPU gpt-oss decodes through the C step (runtime/steps/cpu_decode.py: the q/k/v, output and
    router biases, a sink logit per head, the window's ring (-ub 2: window - 1 + 2 slots, wrapping over 20
    positions), the top-k softmax router, the clamped SwiGLU with the experts' biases): the eager decoder's
    logits, for the F32 conversion of the transformers model and for MXFP4 experts with Q8_0 matrices."""
    from hybridmoe.runtime.steps.cpu_decode import CpuDecoder
    mx = str(tmp_path / "mx.gguf")
    _tiny_mxfp4(mx)
    for path, tol in ((gpt_oss[1], 1e-5), (mx, 1e-4)):
        outs = []
        for graphs in (True, False):
            # op_offload off: on a machine with a GPU, prompts would be the eager path's (a GPU may take their ops)
            m = hybridmoe.load(path, ctx_size=64, ubatch_size=ub, graphs=graphs, op_offload=False)
            kv = m.new_cache(64)
            m.forward(torch.tensor(IDS[:4]), 0, kv)
            outs.append(torch.cat([m.forward(torch.tensor([t]), 4 + i, kv) for i, t in enumerate(IDS[4:])]))
            step = m._step_for("decode", kv)
            assert (isinstance(step, CpuDecoder) and step.worked) if graphs else step is None
            assert isinstance(m._step_for("prompt", kv), CpuDecoder) if graphs else True    # its prompts in C too
        assert min(kv.slots) == min(64, m.cfg.sliding_window - 1 + ub)          # -ub 2: a ring that wraps
        assert rel_l2(outs[0], outs[1]) <= tol, path


def test_cpu_batch_step_is_each_sequence_alone(gpt_oss):
    """A server's batched decode all on the CPU (hm_decode_batch with gpt-oss's block): each sequence's logits bit
    for bit what its own decode steps give alone, through window rings that wrap (-ub 2), prompts of different
    lengths; a prompt chunk longer than the ring holds beside its window is refused with the reason."""
    m = hybridmoe.load(gpt_oss[1], ctx_size=64, ubatch_size=2, op_offload=False)     # the C steps with a GPU too
    alone, kvs = [], []
    for j in range(3):
        kv = m.new_cache(64)
        m.forward(torch.tensor(IDS[j:j + 4 + j]), 0, kv)
        alone.append(torch.cat([m.forward(torch.tensor([t]), 4 + j + i, kv) for i, t in enumerate(IDS[10:17])]))
        kvs.append(m.new_cache(64))
        m.forward(torch.tensor(IDS[j:j + 4 + j]), 0, kvs[-1])
    rows = [m.decode_batch([t] * 3, [4 + j + i for j in range(3)], kvs) for i, t in enumerate(IDS[10:17])]
    assert type(m._batch).__name__ == "CpuDecoder" and min(kvs[0].slots) < 4 + 2 + 7
    for j in range(3):
        assert torch.equal(torch.stack([r[j] for r in rows]), alone[j])
    with pytest.raises(HybridMoeError, match="sliding-window cache was sized for"):
        m._step_for("prompt", kvs[0]).forward(torch.tensor(IDS[:5]), 20, kvs[0])


def _rewrite(src: str, dst: str, drop_tensor: str | None = None, drop_key: str | None = None) -> str:
    f = open_gguf(src)
    md = {k: v for k, v in f.metadata.items() if k != drop_key and not k.startswith("GGUF.")}
    tensors = [(n, tuple(i.shape), i.qtype, (lambda i=i: f.raw(i))) for n, i in f.tensors.items() if n != drop_tensor]
    write_gguf(dst, "gpt-oss", md, tensors)
    return dst


def test_missing_tensor_or_key_is_a_clear_error(gpt_oss, tmp_path):
    path = gpt_oss[1]
    bad = _rewrite(path, str(tmp_path / "no-sinks.gguf"), drop_tensor="blk.1.attn_sinks.weight")
    with pytest.raises(HybridMoeError, match="tensor blk.1.attn_sinks.weight is missing for a gpt-oss model"):
        hybridmoe.load(bad, ctx_size=64)
    bad = _rewrite(path, str(tmp_path / "no-bias.gguf"), drop_tensor="blk.0.ffn_down_exps.bias")
    with pytest.raises(HybridMoeError, match="blk.0.ffn_down_exps.bias is missing"):
        hybridmoe.load(bad, ctx_size=64)
    bad = _rewrite(path, str(tmp_path / "no-swa.gguf"), drop_key="gpt-oss.attention.sliding_window")
    with pytest.raises(ModelFileError, match="gpt-oss.attention.sliding_window is missing"):
        hybridmoe.load(bad, ctx_size=64)


def _tiny_mxfp4(path: str, convert=None):
    """tiny-gpt-oss with MXFP4 experts (as gpt-oss files hold them) written to path, each tensor (name, shape, type,
    make) through convert where given (the same seed makes the same bytes: each tensor drawn in file order from one
    generator); its config."""
    from hybridmoe.models.synth import config_metadata, preset_config, synth_tensors
    from hybridmoe.text.builtin_vocab import builtin_vocab_metadata
    cfg, _, other = preset_config("tiny-gpt-oss")
    md = {"general.name": "mxfp4", **config_metadata(cfg), **builtin_vocab_metadata(cfg.n_vocab)}
    tensors = synth_tensors(cfg, GGMLType.MXFP4, other, seed=7)
    write_gguf(path, "gpt-oss", md, [convert(*t) for t in tensors] if convert else tensors)
    return cfg


def test_mxfp4_experts_match_their_f32_dequantization(tmp_path):
    """gpt-oss GGUFs ship MXFP4 experts: they load (for this architecture) and compute like the same experts
    dequantized to F32 by the gguf package."""
    import gguf
    import numpy as np

    _tiny_mxfp4(str(tmp_path / "mx.gguf"))

    def f32(name, shape, qt, make):
        data = make()                                  # every tensor, in file order: the generator's order
        if qt != GGMLType.MXFP4:
            return name, shape, qt, (lambda d=data: d)
        w = np.ascontiguousarray(gguf.quants.dequantize(data.numpy().reshape(*shape[:-1], -1), qt), dtype=np.float32)
        return name, shape, GGMLType.F32, (lambda w=w: torch.from_numpy(w).view(torch.uint8))
    _tiny_mxfp4(str(tmp_path / "f32.gguf"), f32)
    mx = hybridmoe.load(str(tmp_path / "mx.gguf"), ctx_size=64)
    assert mx.file.tensors["blk.0.ffn_up_exps.weight"].qtype == GGMLType.MXFP4
    ref = hybridmoe.load(str(tmp_path / "f32.gguf"), ctx_size=64).logits(IDS)
    assert rel_l2(mx.logits(IDS), ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("opts, share", [(dict(n_gpu_layers=99), None),
                                         (dict(n_gpu_layers=99, override_tensor=["exps=CPU"]), 0),
                                         (dict(n_gpu_layers=99, override_tensor=["exps=CPU"]), 1)],
                         ids=["ngl99", "exps-cpu", "exps-cpu-share1"])
def test_mxfp4_experts_on_a_real_gpu_match_all_cpu(tmp_path, monkeypatch, opts, share):
    """MXFP4 experts (as gpt-oss files hold them) on a GPU: prompts through the grouped GEMMs (their one-pass
    dequantizer), decode tokens through the captured step with gpu_decode's kernels from the bytes (biases and
    clamped SwiGLU); with -ot exps=CPU the C kernels in the step's polled hand-off, and with a decode share the
    GPU's copy of one of the k experts with its biases. Logits and decode steps within bf16 tolerance of
    all-CPU; the hand-off's last CPU row equals the C kernel's on the published row."""
    from hybridmoe.kernels import cpu
    from hybridmoe.kernels import gpu_decode as gd
    if share is not None:
        monkeypatch.setenv("HYBRIDMOE_DECODE_SHARE", str(share))
    path = str(tmp_path / "mx.gguf")
    cfg = _tiny_mxfp4(path)
    ids = IDS * 2                                      # 80 (token, expert) pairs: the grouped GEMMs' path
    ref = hybridmoe.load(path, ctx_size=64).logits(ids)
    m = hybridmoe.load(path, ctx_size=64, **opts)
    got = m.logits(ids)
    assert rel_l2(got, ref) <= 1e-2 and top1_agreement(got, ref) >= 0.95
    kv = m.new_cache(64)
    m.forward(torch.tensor(ids[:6]), 0, kv)
    calls = []
    moe = gd.moe
    monkeypatch.setattr(gd, "moe", lambda *a, **kw: calls.append(kw.get("oai") is not None) or moe(*a, **kw))
    steps = torch.cat([m.forward(torch.tensor([t]), 6 + i, kv) for i, t in enumerate(ids[6:])])
    assert rel_l2(steps, ref[6:]) <= 1e-2 and top1_agreement(steps, ref[6:]) >= 0.95
    step = m._step_for("decode", kv)                  # the captured step (its kernels launched while capturing)
    assert isinstance(step, GptOssStaticDecoder) and step.worked and step.graphs
    # gd.moe with the biases: every layer's experts all on the GPU, the share's copies with experts in RAM
    assert all(calls) and len(calls) >= (cfg.n_layer if share is None else 0) and bool(calls) == (share != 0)
    if share is None:
        return
    hk, H, k = step.hk, cfg.n_embd, cfg.n_expert_used
    assert hk is not None and hk.share == share and len(hk.calls) == cfg.n_layer
    j = len(hk.calls) - 1
    lay = step.layers[step.segments[max(hk.slot)].layer]
    g, u, d = lay["exps"]
    x, wts, ids = hk.packed[j:j + 1, :H], hk.packed[j:j + 1, H:H + k], hk.packed[j:j + 1, H + k:].int()
    mine = cpu.moe_ffn(x, ids[:, :k - share].contiguous(), wts[:, :k - share].contiguous(), g.raw, u.raw, d.raw,
                       g.qtype, d.qtype, n_threads=step.sched.n_threads,
                       oai=(*lay["exps_b"], cfg.swiglu_alpha, cfg.swiglu_limit))
    assert torch.equal(hk.out[j], mine[0])
    if share:
        gpus = cpu.moe_ffn(x, ids[:, k - share:].contiguous(), wts[:, k - share:].contiguous(), g.raw, u.raw, d.raw,
                           g.qtype, d.qtype, impl="torch", oai=(*lay["exps_b"], cfg.swiglu_alpha, cfg.swiglu_limit))
        assert rel_l2(hk.gout.sum(0, keepdim=True).cpu(), gpus) <= 1e-4


def _triton_gpu(monkeypatch) -> bool:
    """A real GPU (True), or a fake one whose Triton kernels run in Triton's interpreter (False); else a skip."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    return False


def test_gpu_prompt_step_matches_eager(tmp_path, monkeypatch):
    """gpt-oss all on one GPU: a prompt's ubatches through the captured prompt step (runtime/steps/gpu_prefill.py
    with its block: q/k/v, output and router biases, YaRN's tables and scale, sinks, the window layers' rings, the
    top-k softmax, the experts' grouped GEMMs with their biases and clamped SwiGLU), ubatches of 8 over rings of
    8 - 1 + 8 slots that wrap over 36 positions: the eager decoder's logits, every row's; then decode steps on
    the cache the step wrote."""
    from hybridmoe.runtime.steps.gpu_prefill import StaticPrefill
    real = _triton_gpu(monkeypatch)
    path = str(tmp_path / "mx.gguf")
    _tiny_mxfp4(path)
    ids = (IDS * 2)[:36]
    outs, steps = [], []
    for graphs in (True, False):
        m = hybridmoe.load(path, ctx_size=64, ubatch_size=8, graphs=graphs, n_gpu_layers=99)
        kv = m.new_cache(64)
        rows = torch.cat([m.forward(torch.tensor(ids[a:a + 8]), a, kv, all_logits=True) for a in range(0, 36, 8)])
        steps.append(m._step_for("prompt", kv))
        outs.append(torch.cat([rows, *(m.forward(torch.tensor([t]), 36 + i, kv) for i, t in enumerate(IDS[:6]))]))
        assert min(kv.slots) == 15
    assert isinstance(steps[0], StaticPrefill) and steps[0].worked and steps[1] is None
    if real:
        assert steps[0].graphs                                    # full ubatches replayed a graph
    assert rel_l2(outs[0], outs[1]) <= (1e-2 if real else 1e-4)
    assert top1_agreement(outs[0], outs[1]) >= (0.95 if real else 1.0)


@pytest.mark.parametrize("ot, share", [([], None), (["exps=CPU"], None), (["exps=CPU"], 1)],
                         ids=["ngl99", "exps-cpu", "exps-cpu-share1"])
def test_gpu_batch_step_is_each_sequence_alone(tmp_path, monkeypatch, ot, share):
    """A server's batches of gpt-oss on a GPU (runtime/steps/gpu_batch.py with its block; host experts through
    the C kernel's biases, on a real GPU by the polled hand-off, with a decode share: the GPU's pairs with their
    experts' biases gathered beside the staged experts): three sequences at their own positions, decode
    tokens and then a prompt chunk as rows beside them, through window rings that wrap (-ub 8: chunks of at most 8
    rows); each row's logits as the sequence's own forward gives them."""
    from hybridmoe.runtime.steps.gpu_batch import BatchDecode
    real = _triton_gpu(monkeypatch)
    if share is not None:
        if not real:
            pytest.skip("the decode share runs in the polled hand-off: a real GPU's")
        monkeypatch.setenv("HYBRIDMOE_DECODE_SHARE", str(share))
    path = str(tmp_path / "mx.gguf")
    _tiny_mxfp4(path)
    m = hybridmoe.load(path, ctx_size=64, ubatch_size=8, n_gpu_layers=99, override_tensor=ot)
    prompts = [IDS[:5], IDS[5:17], IDS[17:18]]
    alone, batched = [m.new_cache(64) for _ in prompts], [m.new_cache(64) for _ in prompts]
    for p, a, b in zip(prompts, alone, batched):
        for kv in (a, b):
            for s in range(0, len(p), 8):
                m.forward(torch.tensor(p[s:s + 8]), s, kv)
    pos = [len(p) for p in prompts]
    nxt = [IDS[10 + j] for j in range(3)]
    tol = 1e-2 if real else 1e-4
    for step in range(12):                       # past the 15-slot rings: positions up to 29
        want = [m.forward(torch.tensor([t]), p, kv) for t, p, kv in zip(nxt, pos, alone)]
        got = m.forward_batch([(torch.tensor([t]), p, kv) for t, p, kv in zip(nxt, pos, batched)])
        for g, w in zip(got, want):
            assert rel_l2(g, w) <= tol and torch.equal(g.argmax(-1), w.argmax(-1))
        nxt, pos = [int(w.argmax()) for w in want], [p + 1 for p in pos]
    assert isinstance(m._batch, BatchDecode)
    if share:
        assert m._batch.share_frac > 0 and m.stats.gpu_share_bytes > 0
    assert m.batch_rows(batched[0])[0] == 8          # chunks as rows: at most what the rings hold beside the window
    chunk = torch.tensor(IDS[2:8])                   # 6 rows of a prompt beside two decode tokens
    items = [(torch.tensor([nxt[0]]), pos[0]), (chunk, pos[1]), (torch.tensor([nxt[2]]), pos[2])]
    got = m.forward_batch([(t, p, kv) for (t, p), kv in zip(items, batched)], all_logits=True)
    want = [m.forward(t, p, kv, all_logits=True) for (t, p), kv in zip(items, alone)]
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel_l2(g, w) <= tol and torch.equal(g.argmax(-1), w.argmax(-1))
    assert m.stats.last_batch["tokens"] == 8


def test_convert_refuses_what_gguf_cannot_carry(gpt_oss):
    """llama.cpp fixes the SwiGLU constants and the layer pattern; a checkpoint that differs is refused."""
    from hybridmoe.models.convert import hf_config
    hf = gpt_oss[0].config.to_dict()
    assert hf_config(hf).sliding_window == 6
    for change in (dict(swiglu_limit=10.0), dict(layer_types=["full_attention", "sliding_attention"]),
                   dict(rope_parameters={**hf["rope_parameters"], "truncate": True})):
        with pytest.raises(ModelFileError, match="gpt-oss"):
            hf_config({**hf, **change})


def test_host_experts_offloaded_for_a_batch(gpt_oss, monkeypatch):
    """-op all,1: a batch of 32+ tokens uploads the host experts (and their biases) to the GPU and computes there,
    each layer's experts sent a layer ahead (the first while the first attention runs), as Qwen's are."""
    from hybridmoe.runtime.upload import Uploader
    path, ids = gpt_oss[1], (IDS * 2)[:40]
    ref = hybridmoe.load(path, ctx_size=64, offload_policy="all,0").logits(ids)   # all-CPU, also beside a real GPU
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    m = hybridmoe.load(path, ctx_size=64, n_gpu_layers=99, override_tensor=["exps=CPU"], offload_policy="all,1")
    m.stats.reset()
    ahead, prefetch = [], Uploader.prefetch_all
    monkeypatch.setattr(Uploader, "prefetch_all",
                        lambda self, layer, ws: (ahead.append(layer), prefetch(self, layer, ws)))
    assert rel_l2(m.logits(ids), ref) <= 1e-5
    assert m.stats.ops[("moe_up_gate", "CUDA0")][0] == m.cfg.n_layer and ("moe_up_gate", "CPU") not in m.stats.ops
    assert m.stats.uploads["count"] == 3 * m.cfg.n_layer
    assert ahead == list(range(m.cfg.n_layer))


def test_sliding_window_layers_keep_a_ring(gpt_oss):
    """Sliding-window layers cache window - 1 + ubatch slots (the plan counts the same bytes), and a batch
    longer than the ring was sized for is refused by the cache (Model.forward splits one itself)."""
    m = hybridmoe.load(gpt_oss[1], ctx_size=64, ubatch_size=4, **F32_CACHE)
    cfg, kv = m.cfg, m.new_cache(64)
    w = cfg.sliding_window
    assert kv.slots == [w - 1 + 4 if cfg.is_swa_layer(i) else 64 for i in range(cfg.n_layer)]
    assert any(kv.windows) and min(kv.slots) < 64
    per_layer = [kv.k[i].numel() * 4 + kv.v[i].numel() * 4 for i in range(cfg.n_layer)]
    assert per_layer == m.placement.kv_bytes_layer                      # plan = what is allocated
    k = torch.zeros(5, cfg.n_head_kv, cfg.head_dim)
    with pytest.raises(HybridMoeError, match="sliding-window"):
        kv.update_window(0, 0, k, k)
    # far past the ring's size: cached decode still equals the full forward (slots were reused)
    full = m.logits(IDS)
    kv = m.new_cache(64)
    m.forward(torch.tensor(IDS[:9]), 0, kv)                              # split into ubatches of 4
    steps = torch.stack([m.forward(torch.tensor([t]), 9 + i, kv)[0] for i, t in enumerate(IDS[9:])])
    assert rel_l2(steps, full[9:]) <= 1e-5


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_ring_cache_returns_the_window_in_order(kind):
    """A sliding-window layer's ring hands back exactly the positions a batch can see, oldest first, after
    many wrap-arounds (and the same in a q8_0 cache, to its rounding)."""
    from hybridmoe.devices import list_devices
    from hybridmoe.runtime.kvcache import KVCache
    cpu = list_devices()[0]
    kv = KVCache(2, 100, 2, 32, [cpu, cpu], kind, kind, windows=[5, 0], ubatch=3)
    assert kv.slots == [7, 100]
    hist = torch.randn(100, 2, 32, generator=torch.Generator().manual_seed(0))
    pos = 0
    for T in [3, 1, 2, 3, 1, 1, 3, 2, 3, 3, 1, 2] * 3:
        keys, values, start = kv.update_window(0, pos, hist[pos:pos + T], -hist[pos:pos + T])
        full, _, s0 = kv.update_window(1, pos, hist[pos:pos + T], hist[pos:pos + T])
        pos += T
        assert start == max(0, pos - T + 1 - 5) and s0 == 0 and keys.shape[1] == pos - start
        want = hist[start:pos].transpose(0, 1)
        tol = 1e-3 if kind == "f16" else 2e-2
        assert rel_l2(keys.float(), want) < tol and rel_l2(values.float(), -want) < tol
        assert rel_l2(full.float(), hist[:pos].transpose(0, 1)) < tol
