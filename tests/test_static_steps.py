"""Which static step runs where (runtime/steps/).

The static decode step refuses, up front, placements whose CUDA graph capture would fail at run time.

On an H100 the GPU fuzzer (benchmarks/gpu_fuzz.py) saw "CUDA graph capture failed (Cannot copy between CPU and
CUDA tensors during CUDA graph capture unless the CPU tensor is pinned)" in 10 cases: every one had GPU-resident
experts of a type with no GPU kernel then (IQ4_KS, IQ2_KT, ...), whose torch reference dequantizer copies its
tables from host memory inside the step. gpu_decode.graph_blocker names such placements; StaticDecoder raises
NotApplicable for them (with one warning), so the eager decoder runs and no capture is tried.

All-CPU placements run prompts in the C step only where no GPU may take their ops (op offload)."""
from pathlib import Path

import pytest
import torch

import hybridmoe
from hybridmoe.kernels import gpu_decode as gd
from hybridmoe.models.convert import requantize
from hybridmoe.models.synth import ensure_synth
from hybridmoe.quant.types import GGMLType
from hybridmoe.runtime.steps.gpu_decode import graph_blocker

FILES = Path(__file__).resolve().parents[2] / "shared/testdata/quant-vectors/files"
# ik_llama.cpp's own 1-layer qwen3moe files, every matrix of one type (tests/quant/test_quant_files.py)
IK_TYPES = ("IQ3_XXS", "IQ2_KL", "IQ4_K_R4", "IQ4_XS", "IQ4_KS", "IQ2_KT", "Q3_K", "Q2_K", "IQ5_KS")


def _ik_file(name: str) -> str:
    path = FILES / f"q-{name}.gguf"
    if not path.exists():
        pytest.skip(f"{path} is missing (the test data lives beside the repository in shared/)")
    return str(path)


def _no_gpu_kernel() -> str:
    """One of IK_TYPES that no GPU kernel reads here (neither the fused MoE kernels nor a one-pass dequantizer)."""
    from hybridmoe.kernels.gpu_dequant import has_kernel
    for name in IK_TYPES:
        q = GGMLType[name]
        if not has_kernel(q) and not gd.supports(q, q, q):
            return name
    pytest.skip("every type of the test files has a GPU kernel here")


def test_experts_without_a_gpu_kernel_block_graphs(monkeypatch):
    """Experts of a type no GPU kernel reads, on a (fake) GPU: blocked, naming the layer, type and GPU; the same
    file with its experts on the CPU, or all on the CPU: not blocked."""
    name = _no_gpu_kernel()
    path = _ik_file(name)
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    why = graph_blocker(hybridmoe.load(path, n_gpu_layers=99, ctx_size=64))
    assert why is not None and why.startswith(f"layer 0: experts of {name} on CUDA0 have no GPU kernel"), why
    assert graph_blocker(hybridmoe.load(path, n_gpu_layers=99, override_tensor=["exps=CPU"], ctx_size=64)) is None
    assert graph_blocker(hybridmoe.load(path, n_gpu_layers=0, ctx_size=64)) is None


@pytest.mark.parametrize("qtype", [GGMLType.F16, GGMLType.Q4_0])
def test_experts_with_a_gpu_path_keep_graphs(qtype, tmp_path, monkeypatch):
    """Float experts (views, no table) never block; Q4_0 ones only where triton (its GPU kernels) is missing."""
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    path = requantize(ensure_synth("tiny-wide"), str(tmp_path / f"{qtype.name}.gguf"), qtype)
    why = graph_blocker(hybridmoe.load(path, n_gpu_layers=99, ctx_size=64))
    if qtype in (GGMLType.F16,) or gd.available():
        assert why is None, why
    else:
        assert why is not None and "experts of Q4_0 on CUDA0" in why


@pytest.mark.gpu
@pytest.mark.parametrize("name", IK_TYPES)
def test_no_capture_fails_on_a_gpu(name, caplog):
    """On a real GPU, every ik file all on the GPU: the decode step is the static one exactly where graph_blocker
    finds nothing, no capture fails (a refused placement decodes eagerly, with one warning at most), and the
    logits match the all-CPU ones."""
    path = _ik_file(name)
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    ids = [(7 * i + 3) % 500 + 1 for i in range(24)]

    def run(**opts):
        m = hybridmoe.load(path, ctx_size=64, **opts)
        kv = m.new_cache(64)
        out = [m.forward(torch.tensor(ids[:16]), 0, kv)]
        out += [m.forward(torch.tensor([t]), 16 + j, kv) for j, t in enumerate(ids[16:])]
        return m, torch.cat(out)
    with caplog.at_level("WARNING", logger="hybridmoe"):
        m, gpu = run(n_gpu_layers=99)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "CUDA graph capture" not in text, text        # warn_fallback's "CUDA graph capture ... failed"
    blocked = graph_blocker(m) is not None
    assert (m._steps["decode"][1] is None) == blocked, (name, graph_blocker(m))
    from hybridmoe.kernels import cpu as cpu_kernels
    was = cpu_kernels.set_act_terms(2)          # the CPU's activations in two int8 terms for every type
    try:
        _, cpu = run(n_gpu_layers=0)
    finally:
        cpu_kernels.set_act_terms(was)
    # bf16 activations and dequantized weights on the GPU against the CPU's float32 / two-term int8 paths (the ik
    # files on a real GPU: up to 4.8e-2, tests/quant/test_quant_files.py; the 1-3.5-bit types' one int8 term, as
    # ggml's q8_0 / q8_K, puts IQ2_KL at 8.6e-2)
    assert float((gpu - cpu).norm() / cpu.norm()) < 6e-2


@pytest.mark.gpu
def test_captured_prompt_step_takes_float32_matrices(tmp_path, caplog):
    """On a real GPU, Q4_0 experts with F32 attention, output and embedding, all on the GPU: the static prompt
    step multiplies each F32 matrix in float32 (its input rows cast to it) instead of failing at its first use
    on bf16 rows against float32 weights; full ubatches replay their graph; the logits match the CPU's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from hybridmoe.formats.gguf_write import write_gguf
    from hybridmoe.models.synth import config_metadata, preset_config, synth_tensors
    from hybridmoe.runtime.steps.gpu_prefill import StaticPrefill
    from hybridmoe.text.builtin_vocab import builtin_vocab_metadata
    cfg, _, _ = preset_config("tiny-wide")
    path = str(tmp_path / "q4_0-f32.gguf")
    md = {"general.name": "q4_0 experts, f32 others", "general.type": "model", **config_metadata(cfg),
          **builtin_vocab_metadata(cfg.n_vocab)}
    write_gguf(path, cfg.arch, md, synth_tensors(cfg, GGMLType.Q4_0, GGMLType.F32, seed=3))
    ids = [(13 * i + 5) % 1000 for i in range(48)]
    with caplog.at_level("WARNING", logger="hybridmoe"):
        m = hybridmoe.load(path, n_gpu_layers=99, ctx_size=64, ubatch_size=16, split_mode="none")   # one GPU
        gpu = m.logits(ids)
    assert "static prompt step" not in "\n".join(r.getMessage() for r in caplog.records)
    step = m._steps["prompt"][1]
    assert isinstance(step, StaticPrefill) and step.worked and (16, True) in step.graphs
    cpu = hybridmoe.load(path, n_gpu_layers=0, ctx_size=64).logits(ids)
    assert float((gpu - cpu).norm() / cpu.norm()) < 3e-2


@pytest.mark.parametrize("op_offload", [True, False])
def test_all_cpu_prompts_leave_op_offload_to_a_gpu(op_offload, monkeypatch):
    """-ngl 0 with a (fake) GPU: as in llama.cpp, a large batch's host weights may run on the GPU (here forced by
    -op all,1), so prompts take the eager decoder and upload; with --no-op-offload, or no GPU, the C prompt step
    (hm_prompt_step) runs them on the CPU. Decode steps are all-CPU either way."""
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    m = hybridmoe.load("synth:tiny", n_gpu_layers=0, ctx_size=128, offload_policy="all,1", op_offload=op_offload)
    kv = m.new_cache(128)
    m.forward(torch.arange(3, 67), 0, kv)
    m.forward(torch.tensor([5]), 64, kv)
    prompt, decode = m._steps["prompt"][1], m._steps["decode"][1]
    assert type(decode).__name__ == "CpuDecoder"
    if op_offload:
        assert prompt is None and m.stats.uploads["bytes"] > 0
    else:
        assert type(prompt).__name__ == "CpuDecoder" and m.stats.uploads["bytes"] == 0
    m.set_policy("all,0")                                # no op left to a GPU: the C prompt step again
    m.forward(torch.arange(3, 40), 65, kv)
    assert type(m._steps["prompt"][1]).__name__ == "CpuDecoder"


def test_all_cpu_prompts_without_a_gpu_take_the_c_step(monkeypatch):
    monkeypatch.delenv("HYBRIDMOE_FAKE_GPUS", raising=False)
    m = hybridmoe.load("synth:tiny", ctx_size=128)
    if m.sched.main_gpu is not None:
        pytest.skip("a GPU is present")
    m.forward(torch.arange(3, 67), 0, m.new_cache(128))
    assert type(m._steps["prompt"][1]).__name__ == "CpuDecoder"


def test_each_cache_keeps_its_static_steps(monkeypatch):
    """Two caches in turn (a server's slots): each keeps the static decode and prompt steps built at its first
    use, so switching back does not build (and on a GPU capture) them again; a changed offload policy makes every
    cache build its prompt step again, and a cache that is dropped frees its steps with it."""
    import gc
    import weakref
    monkeypatch.delenv("HYBRIDMOE_FAKE_GPUS", raising=False)
    m = hybridmoe.load("synth:tiny", n_gpu_layers=0, ctx_size=128)
    caches = [m.new_cache(128), m.new_cache(128)]
    seen = []
    for kv in caches + caches:
        m.forward(torch.arange(3, 20), 0, kv)
        m.forward(torch.tensor([5]), 17, kv)
        seen.append((kv.static_steps["prompt"][1], kv.static_steps["decode"][1]))
        assert m.static_step("decode") is seen[-1][1] is not None
    assert seen[0][0] is seen[2][0] and seen[0][1] is seen[2][1] and seen[1][1] is seen[3][1]
    assert seen[0][1] is not seen[1][1]
    m.set_policy("all,0")                                  # a changed policy: prompt steps again, decode steps kept
    m.forward(torch.arange(3, 20), 0, caches[0])
    assert caches[0].static_steps["prompt"][1] is not seen[0][0]
    m.forward(torch.tensor([5]), 17, caches[0])
    assert caches[0].static_steps["decode"][1] is seen[0][1]
    gone = weakref.ref(seen[1][1])
    del caches[1], seen[:], kv
    m.forward(torch.tensor([6]), 18, caches[0])            # the model now holds only the first cache's steps
    gc.collect()
    assert gone() is None


def test_gc_paused_collects_nothing_for_many_captures():
    """A step of many graphs (one per CPU-expert layer) pays no garbage collection (~0.1-0.2 s each with a big
    model's objects alive: 49 of them made a slot's first decode step take 9 s, one a server slot's first decode
    step 0.2 s), and leaves collection as it found it."""
    import gc

    from hybridmoe.runtime.steps.gpu_decode import gc_paused
    runs = []

    def note(phase, info):
        if phase == "start":
            runs.append(info["generation"])
    gc.callbacks.append(note)
    try:
        assert gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
            for _ in range(5):
                with gc_paused():                 # what capturing() does for each graph
                    assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()
        assert not runs
        with pytest.raises(ValueError):
            with gc_paused():
                raise ValueError
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(note)
