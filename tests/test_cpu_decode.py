"""The CPU decode step (runtime/steps/cpu_decode.py: one C call a token) against the eager decoder (--no-graphs),
which the transformers tests check: same logits, same KV cache, for every cache type, dense and MoE
blocks, the portable and AVX-512 kernels, and contexts long enough to split attention into many runs."""
import pytest
import torch
from conftest import rel_l2

import hybridmoe
from hybridmoe.kernels import cpu
from hybridmoe.runtime.steps.cpu_decode import CpuDecoder

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the CPU kernels")

# The eager reference's prompt attention in float32 (on AMX CPUs it runs in bf16 by default): the static steps'
# prompt (hm_prompt_step) and decode attention are float32, and layer 2's cached keys depend on layer 1's.
# Measured then (2026-11-27, AVX-512 VNNI + AMX): logits 1e-6 to 1e-5 apart, the larger ones where rows run on
# the integer path (Q8_0 and Q4_0 here), whose activation rounding turns the paths' last-bit differences (torch's
# norms and attention against the C step's) into quantization steps; 5e-7 with fp32 activations.
LOGITS_TOL = 3e-5


@pytest.fixture(autouse=True)
def _f32_prompt_attention(monkeypatch):
    import hybridmoe.models.decoder as dec
    monkeypatch.setattr(dec, "_CPU_ATTN_DTYPE", torch.float32)


def _decode(name, graphs, n_prompt=5, n_steps=40, ctx=128, **opts):
    """Greedy decode after an eager prefill: (logits of every step [n_steps, V], the model, its cache)."""
    m = hybridmoe.load(name, ctx_size=ctx, graphs=graphs, **opts)
    kv = m.new_cache()
    prompt = torch.tensor([(i * 37 + 11) % 1000 + 3 for i in range(n_prompt)])
    out = [m.forward(prompt, 0, kv, all_logits=False)]
    for p in range(n_prompt, n_prompt + n_steps):
        out.append(m.forward(torch.tensor([int(out[-1][-1].argmax())]), p, kv))
    return torch.cat(out[1:]), m, kv


@pytest.mark.parametrize("name", ["synth:tiny", "synth:tiny-dense", "synth:tiny-wide"])
@pytest.mark.parametrize("cache", ["f16", "bf16", "f32"])
def test_cpu_decode_step_matches_eager(name, cache):
    got, m, kv = _decode(name, True, cache_type_k=cache, cache_type_v=cache)
    assert isinstance(m._step_for("decode", kv), CpuDecoder)
    ref, m_ref, kv_ref = _decode(name, False, cache_type_k=cache, cache_type_v=cache)
    assert m_ref._step_for("decode", kv_ref) is None
    assert rel_l2(got, ref) <= LOGITS_TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    n = 5 + 40
    for a, b in zip(kv.k + kv.v, kv_ref.k + kv_ref.v):     # the cache the step wrote (to one 16-bit ulp)
        assert rel_l2(a[:, :n].float(), b[:, :n].float()) <= (1e-5 if cache == "f32" else 1e-3)
        assert not a[:, n:].any()


def test_cpu_decode_step_at_long_context():
    """2100 cached positions: attention in 33 runs of 64 per KV head (at most 64 runs, of 32 x 2^s positions),
    merged."""
    got, m, _ = _decode("synth:tiny", True, n_prompt=2100, n_steps=3, ctx=2112)
    ref, _, _ = _decode("synth:tiny", False, n_prompt=2100, n_steps=3, ctx=2112)
    assert rel_l2(got, ref) <= LOGITS_TOL


@pytest.mark.parametrize("path", ["avx2", "generic"])
def test_cpu_decode_step_lower_simd_paths(path):
    """Without AVX-512 (the AVX2 or portable C paths of every kernel the step calls), the same logits."""
    prev = cpu.set_simd(path)
    try:
        if cpu.simd().split("-")[0] != path:
            pytest.skip(f"this build has no {path} path")
        got, _, _ = _decode("synth:tiny-wide", True, n_steps=12)
        ref, _, _ = _decode("synth:tiny-wide", False, n_steps=12)
    finally:
        cpu.set_simd(prev)
    assert rel_l2(got, ref) <= LOGITS_TOL


def test_cpu_decode_step_not_taken_where_it_does_not_apply(monkeypatch):
    m = hybridmoe.load("synth:tiny-wide", ctx_size=64, cache_type_k="q8_0", cache_type_v="q8_0")
    assert m._step_for("decode", m.new_cache()) is None                    # q8_0 cache: eager
    m = hybridmoe.load("synth:tiny-deepseek2", ctx_size=64)
    assert m._step_for("decode", m.new_cache()) is None                    # MLA: eager
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    m = hybridmoe.load("synth:tiny", ctx_size=64, n_gpu_layers=99, override_tensor=["exps=CPU"])
    assert not isinstance(m._step_for("decode", m.new_cache()), CpuDecoder)


def test_cpu_decode_step_profile(capsys):
    m = hybridmoe.load("synth:tiny", ctx_size=64, profile=True)
    "".join(m.generate([5, 6, 7], max_tokens=8, temperature=0))
    report = m.stats.format()
    rows = {line.split()[0]: line.split() for line in report.splitlines()[2:] if line.split()[1:2] == ["CPU"]}
    for op in ("mul_mat", "attention", "moe_up_gate"):
        assert float(rows[op][3]) > 0, report
    assert m.stats.cpu_expert_bytes > 0 and m.stats.tokens >= 7


def test_cpu_decode_step_rejects_a_token_outside_the_vocabulary():
    m = hybridmoe.load("synth:tiny", ctx_size=64)
    kv = m.new_cache()
    m.forward(torch.tensor([5]), 0, kv)
    sd = m._step_for("decode", kv)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        sd.step(m.cfg.n_vocab + 3, 1)
