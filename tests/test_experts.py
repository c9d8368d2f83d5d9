"""The routed-expert compute paths against the plain per-expert reference (CPU; GPU ones: test_gpu_kernels)."""
import pytest
import torch

from hybridmoe.quant.ref import random_blocks
from hybridmoe.quant.types import GGMLType


def _experts(g, E, Fd, H):
    """Random Q8_0 gate/up/down expert QTensors on the CPU."""
    from hybridmoe.devices import Device
    from hybridmoe.runtime.weights import QTensor
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    dev = Device("CPU", "cpu", 0, 0, 0, torch.device("cpu"))
    return [QTensor(n, random_blocks(GGMLType.Q8_0, s, g), GGMLType.Q8_0, s, dev)
            for n, s in (("g", (E, Fd, H)), ("u", (E, Fd, H)), ("d", (E, H, Fd)))]


def test_grouped_expert_layout_matches_reference():
    """The padded grouped-GEMM layout of the prefill path (run on the CPU, where torch has _grouped_mm too):
    empty experts, uneven counts, repeated ids across tokens."""
    from hybridmoe.runtime import experts as X
    g = torch.Generator().manual_seed(3)
    E, Fd, H, k, T = 24, 64, 96, 3, 37
    ws = _experts(g, E, Fd, H)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E // 2, generator=g)[:k] for _ in range(T)])     # half the experts empty
    wts = torch.softmax(torch.randn(T, k, generator=g), -1)
    ref = X.reference_moe(x, ids, wts, *ws)
    got = X._grouped_moe(x, ids, wts, ws[0].raw, ws[1].raw, ws[2].raw, ws[0], ws[2])
    assert float((got - ref).norm() / ref.norm()) <= 2e-2                               # bf16 GEMMs


def test_grouped_expert_layout_with_gpt_oss_activation():
    """The same grouped layout with gpt-oss's biases and clamped SwiGLU (the GPU prefill path of its experts)
    against the C kernel's oai path in float64's reference."""
    from hybridmoe.kernels import cpu
    from hybridmoe.runtime import experts as X
    g = torch.Generator().manual_seed(4)
    E, Fd, H, k, T = 16, 64, 96, 4, 29
    ws = _experts(g, E, Fd, H)
    x = 40 * torch.randn(T, H, generator=g)                      # large enough for the clamps at 7 to act
    ids = torch.stack([torch.randperm(E // 2, generator=g)[:k] for _ in range(T)])
    wts = torch.softmax(torch.randn(T, k, generator=g), -1)
    oai = (torch.randn(E, Fd, generator=g), torch.randn(E, Fd, generator=g), torch.randn(E, H, generator=g), 1.702, 7.0)
    ref = cpu.reference_moe_ffn(x, ids, wts, ws[0].raw, ws[1].raw, ws[2].raw, GGMLType.Q8_0, GGMLType.Q8_0,
                                torch.float64, oai=oai)
    got = X._grouped_moe(x, ids, wts, ws[0].raw, ws[1].raw, ws[2].raw, ws[0], ws[2], oai=oai)
    assert float((got - ref).norm() / ref.norm()) <= 2e-2                               # bf16 GEMMs


def test_reference_loop_with_gpt_oss_activation():
    """The per-expert loop gpt-oss's experts take on a GPU for a few tokens, against float64."""
    from hybridmoe.kernels import cpu
    from hybridmoe.runtime import experts as X
    g = torch.Generator().manual_seed(5)
    E, Fd, H, k, T = 8, 64, 96, 4, 3
    ws = _experts(g, E, Fd, H)
    x = 40 * torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.softmax(torch.randn(T, k, generator=g), -1)
    oai = (torch.randn(E, Fd, generator=g), torch.randn(E, Fd, generator=g), torch.randn(E, H, generator=g), 1.702, 7.0)
    ref = cpu.reference_moe_ffn(x, ids, wts, ws[0].raw, ws[1].raw, ws[2].raw, GGMLType.Q8_0, GGMLType.Q8_0,
                                torch.float64, oai=oai)
    got = X.reference_moe(x, ids, wts, *ws, oai=oai)
    assert float((got - ref).norm() / ref.norm()) <= 1e-5


def test_gpu_moe_path_by_pairs(monkeypatch):
    """Q4_0/Q8_0 experts in split rows, batches of at most MMQ_MAX_TOKENS tokens: the per-pair GEMVs below
    MMQ_MIN_PAIRS (token, slot) pairs, the int8 tensor-core kernels from there (where Triton is); other experts:
    the per-pair GEMVs up to 64 pairs, the grouped GEMMs above (the grouped GEMVs only when named: they did not win
    on an H100); HYBRIDMOE_GPU_MOE names one for every call ("mmq" where it can't run: the GEMMs), and a wrong
    name is a one-line error."""
    from hybridmoe.errors import HybridMoeError
    from hybridmoe.kernels import gpu_mmq
    from hybridmoe.quant.types import GGMLType as G
    from hybridmoe.runtime import experts as X
    monkeypatch.delenv("HYBRIDMOE_GPU_MOE", raising=False)
    hi = X.GATHER_MAX_SLOTS
    assert X.gpu_moe_path(1, 8) == "pair" and X.gpu_moe_path(1, 4 * hi) == "pair"
    assert X.gpu_moe_path(8, hi) == "pair" and X.gpu_moe_path(9, hi + 8) == "gemm"
    assert [X.gpu_moe_path(b, 8 * b) for b in (1, 2, 4, 8, 16, 32, 64, 512)] == \
        ["pair", "pair", "pair", "pair", "gemm", "gemm", "gemm", "gemm"]
    q4, q8 = (G.Q4_0,) * 3, (G.Q8_0, G.Q8_0, G.Q4_0)
    mmq, mid = ("mmq", "pair") if gpu_mmq.available() else ("gemm", "gemm")
    assert [X.gpu_moe_path(b, 8 * b, q4, True) for b in (1, 8, 16, 32, 64, X.MMQ_MAX_TOKENS + 1)] == \
        ["pair", "pair", mid, mid, mmq, "gemm"]
    assert X.gpu_moe_path(64, 512, q8, True) == mmq and X.gpu_moe_path(32, 256, q8, True) == mid
    monkeypatch.setattr(X, "MMQ_MIN_PAIRS", 16)                      # the lower bound is one constant
    few = "mmq" if gpu_mmq.available() else "pair"
    assert [X.gpu_moe_path(b, 8 * b, q4, True) for b in (1, 2, 8)] == ["pair", few, few]
    assert X.gpu_moe_path(16, 128, q4, False) == "gemm" and X.gpu_moe_path(16, 128, (G.Q4_K,) * 3, True) == "gemm"
    for forced in ("pair", "grouped", "gemm", "mmq"):
        monkeypatch.setenv("HYBRIDMOE_GPU_MOE", forced)
        want = mmq if forced == "mmq" else forced
        assert X.gpu_moe_path(1, 8, q4, True) == want and X.gpu_moe_path(4096, 8 * 4096, q4, True) == want
    assert X.gpu_moe_path(16, 128, q4, False) == "gemm"
    monkeypatch.setenv("HYBRIDMOE_GPU_MOE", "fast")
    with pytest.raises(HybridMoeError, match="HYBRIDMOE_GPU_MOE='fast': give auto, pair, grouped, gemm or mmq"):
        X.gpu_moe_path(4, 32)


def test_kernel_variants_cover_every_prompt_size(monkeypatch):
    """A server's warm-up sizes: one prompt per GPU MoE kernel variant (path and the block height its compile
    fixes) for 2..-ub tokens; every size's variant is among them, each size the first of its own."""
    from hybridmoe.kernels import gpu_moe
    from hybridmoe.quant.types import GGMLType as G
    from hybridmoe.runtime import experts as X
    monkeypatch.delenv("HYBRIDMOE_GPU_MOE", raising=False)
    for ub, qt, split in ((512, None, False), (4096, (G.Q4_0,) * 3, True), (64, (G.Q8_0,) * 3, False)):
        sizes = X.kernel_variants(ub, 8, 128, qt, split)

        def key(T):
            path = X.gpu_moe_path(T, 8 * T, qt, split)
            return path, (gpu_moe.block_rows(8 * T, 128) if path == "gemm" else 0)
        assert sizes[0] == 2 and sizes == sorted(sizes) and max(sizes) <= ub
        firsts = {}
        for T in range(2, ub + 1):
            firsts.setdefault(key(T), T)
        if not (qt and split):                           # (mmq's own block heights where Triton is)
            assert sizes == sorted(firsts.values())
    assert len(X.kernel_variants(4096, 8, 128)) == 5     # the per-pair GEMVs, then GEMMs of 16 to 128 rows a block


def test_fused_gpu_kernels_of_new_types_can_be_turned_off(monkeypatch):
    """IQ4_XS, IQ4_KS, Q3_K and IQ2_KT experts take the fused GPU kernels (and the decode share) unless
    HYBRIDMOE_GPU_QDOT=0; the GGML types' kernels stay on either way."""
    from hybridmoe.kernels import gpu_decode as gd
    from hybridmoe.quant.types import GGMLType as G
    per = [768 * 1088, 768 * 1088, 2048 * 408]               # Qwen3-30B-A3B's experts in IQ4_XS: 16-byte runs
    monkeypatch.delenv("HYBRIDMOE_GPU_QDOT", raising=False)
    assert all(gd.fused(q) for q in (G.Q4_0, G.Q4_K, G.IQ4_XS, G.IQ4_KS, G.Q3_K, G.IQ2_KT))
    assert gd.share_layout_ok((G.IQ4_XS,) * 3, per)
    monkeypatch.setenv("HYBRIDMOE_GPU_QDOT", "0")
    assert gd.fused(G.Q4_0) and gd.fused(G.Q4_K)
    assert not any(gd.fused(q) for q in (G.IQ4_XS, G.IQ4_KS, G.Q3_K, G.IQ2_KT))
    assert not gd.share_layout_ok((G.IQ4_XS,) * 3, per)
