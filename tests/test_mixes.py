"""models/mixes.py: per-tensor type mixes of the files users run, as catalog records (planning) and as synthetic
models that load and compute: each tiny mix preset's logits match its F32-dequantized copy on every
placement of the invariance tests (all CPU and fake GPUs)."""
import math

import pytest
import torch

import hybridmoe
from hybridmoe.errors import HybridMoeError
from hybridmoe.formats.gguf import open_gguf
from hybridmoe.formats.gguf_write import write_gguf
from hybridmoe.models.catalog import catalog_model
from hybridmoe.models.mixes import MIXES, mix_type
from hybridmoe.models.synth import PRESETS, ensure_synth, preset_config, preset_mix
from hybridmoe.quant.dequant import dequantize
from hybridmoe.quant.types import GGMLType as T

TINY_MIXES = ("tiny-iq4_ks", "tiny-q3_k_mix", "tiny-iq2_kt", "tiny-iq4_xs", "tiny-q2_k_mix", "tiny-deepseek2-iq4_ks_r4")
IDS = [(7 * i + 3) % 1000 + 1 for i in range(24)]
PLACEMENTS = {
    "cpu": {},
    "ngl99": dict(n_gpu_layers=99),
    "ngl99-exps-cpu": dict(n_gpu_layers=99, override_tensor=[r"exps=CPU"]),
    "forced-offload-active": dict(n_gpu_layers=99, override_tensor=[r"exps=CPU"], offload_policy="all,1",
                                  offload_only_active_experts="1"),
    "split-gpus": dict(n_gpu_layers=99, tensor_split="1,1"),
}


def _bytes(tensors) -> int:
    return sum(t.nbytes for t in tensors.values())


def _bpw(tensors) -> float:
    return 8 * _bytes(tensors) / sum(math.prod(t.shape) for t in tensors.values())


def test_deepseek_r1_mixes_match_the_published_files():
    # unsloth's DeepSeek-R1-0528 UD-Q2_K_XL: 251 GB; ubergarm's DeepSeek-R1-0528 IQ4_KS_R4: 4.701 BPW
    _, q2 = catalog_model("deepseek-r1:UD-Q2_K_XL")
    assert 0.97 < _bytes(q2) / 251e9 < 1.03
    t = {n: i.qtype for n, i in q2.items()}
    assert (t["blk.3.ffn_down_exps.weight"], t["blk.10.ffn_down_exps.weight"], t["blk.10.ffn_up_exps.weight"]) == \
        (T.Q4_K, T.Q3_K, T.Q2_K)
    assert (t["blk.0.ffn_down.weight"], t["blk.10.ffn_gate_shexp.weight"], t["blk.10.attn_kv_b.weight"]) == \
        (T.Q6_K, T.Q4_K, T.Q6_K)
    assert t["blk.10.exp_probs_b.bias"] == t["blk.10.ffn_gate_inp.weight"] == t["output_norm.weight"] == T.F32
    _, r4 = catalog_model("deepseek-r1:iq4_ks_r4")
    assert abs(_bpw(r4) - 4.701) < 0.03
    t = {n: i.qtype for n, i in r4.items()}
    assert (t["blk.7.ffn_gate_exps.weight"], t["blk.7.ffn_down_exps.weight"], t["blk.7.attn_q_b.weight"]) == \
        (T.IQ4_KS_R4, T.IQ5_KS_R4, T.Q8_0)


def test_catalog_types_still_work():
    _, t = catalog_model("deepseek-r1:Q3_K")
    assert t["blk.5.ffn_up_exps.weight"].qtype == T.Q3_K and t["blk.5.attn_q_b.weight"].qtype == T.Q8_0
    _, t = catalog_model("qwen3-30b-a3b:iq4_ks:q6_k")
    assert t["blk.5.ffn_up_exps.weight"].qtype == T.IQ4_KS and t["blk.5.attn_q.weight"].qtype == T.Q6_K
    _, t = catalog_model("qwen3-30b-a3b:q3_k_xl")
    assert t["blk.0.ffn_down_exps.weight"].qtype == T.Q5_K and t["blk.9.ffn_down_exps.weight"].qtype == T.Q4_K
    with pytest.raises(HybridMoeError, match="unknown ggml type 'q9_z'.*ud-q2_k_xl"):
        catalog_model("deepseek-r1:q9_z")


def test_every_mix_types_every_tensor_of_its_models():
    for name in ("qwen3-30b-a3b", "deepseek-r1"):
        for mix in MIXES:
            _, t = catalog_model(f"{name}:{mix}")
            exps = {i.qtype for n, i in t.items() if "_exps." in n}
            assert exps and T.F32 not in exps and T.Q8_0 not in exps, (name, mix)
    with pytest.raises(HybridMoeError, match="unknown type mix"):
        mix_type("q1_zz", "blk.0.attn_q.weight", (4, 4))


def test_mix_presets():
    for p in PRESETS:
        if preset_mix(p):
            cfg, et, _ = preset_config(p)
            assert et != T.Q4_0 and cfg.n_embd % 256 == 0 and cfg.n_ff_exp % 256 == 0, p
    assert preset_config("qwen3-30b-a3b-iq2_kt")[1:] == (T.IQ2_KT, T.Q8_0)


def _f32_copy(src: str, dst: str) -> None:
    g = open_gguf(src)
    tensors = []
    for name, info in g.tensors.items():
        def make(info=info):
            raw = g.raw(info).view(*info.shape[:-1], -1)
            return dequantize(raw, info.qtype, info.shape[-1]).contiguous().view(torch.uint8)
        tensors.append((name, info.shape, T.F32, make))
    write_gguf(dst, g.metadata["general.architecture"], g.metadata, tensors)


def _logits(path, opts):
    # one thread: the reference dequantizer's small torch ops crawl when two threads share a busy machine
    return hybridmoe.load(str(path), ctx_size=64, ubatch_size=8, threads=1, **opts).logits(IDS)


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
@pytest.mark.parametrize("preset", TINY_MIXES)
def test_tiny_mix_matches_its_f32_copy_on_every_placement(preset, tmp_path, monkeypatch, keep_threads):
    src = ensure_synth(preset)
    mix = preset_mix(preset)
    types = {i.qtype for i in open_gguf(src).tensors.values()}
    assert {mix_type(mix, "blk.1.ffn_up_exps.weight", (2, 2)), mix_type(mix, "blk.1.ffn_down_exps.weight", (2, 2))} \
        <= types
    dst = str(tmp_path / "f32.gguf")
    _f32_copy(src, dst)
    ref = _logits(dst, {})
    assert torch.isfinite(ref).all() and ref.std() > 0.1          # random weights of a sane magnitude
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "2x1GiB")
    for name, opts in PLACEMENTS.items():
        got = _logits(src, opts)
        rel = float((got - ref).norm() / ref.norm())
        print(f"{preset} {name} rel {rel:.2e}")
        assert rel <= 1e-2, (preset, name, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", TINY_MIXES)
def test_tiny_mix_on_a_real_gpu(preset, tmp_path):
    """GPU-resident weights of these types (file bytes in VRAM, dequantized by the one-pass kernels) and CPU
    experts uploaded and dequantized on the GPU, against the F32 copy all on the CPU (the GPU multiplies in
    bf16: ik's 1-layer files give 1.2e-2..4.8e-2 this way, bound 6e-2)."""
    src = ensure_synth(preset)
    dst = str(tmp_path / "f32.gguf")
    _f32_copy(src, dst)
    ref = hybridmoe.load(dst, ctx_size=64, ubatch_size=8, n_gpu_layers=0).logits(IDS)
    for name in ("ngl99", "ngl99-exps-cpu", "forced-offload-active"):
        got = hybridmoe.load(src, ctx_size=64, ubatch_size=8, **PLACEMENTS[name]).logits(IDS)
        rel = float((got - ref).norm() / ref.norm())
        print(f"{preset} {name} rel {rel:.2e}")
        assert rel <= 6e-2, (preset, name, rel)


def test_slow_tensors_are_named(monkeypatch, keep_threads):
    # a type without a CPU kernel (IQ2_KT taken out of the kernels' types): its 6 expert tensors are named (fake
    # GPUs run no GPU kernel, so there too)
    from hybridmoe.kernels import cpu
    monkeypatch.setattr(cpu, "KERNEL_TYPES", cpu.KERNEL_TYPES - {int(T.IQ2_KT)})
    src = ensure_synth("tiny-iq2_kt")
    m = hybridmoe.load(src, ctx_size=64, threads=1)
    assert m.slow_tensors() == {"IQ2_KT": [f"blk.{i}.ffn_{w}_exps.weight" for i in (0, 1)
                                           for w in ("gate", "up", "down")]}
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    m = hybridmoe.load(src, ctx_size=64, threads=1, n_gpu_layers=99)
    assert len(m.slow_tensors()["IQ2_KT"]) == 6
    assert m.slow_tensors().keys() == {"IQ2_KT"}
