"""The routed-expert compute paths against the plain per-expert reference (CPU; GPU ones: test_gpu_kernels)."""
import pytest
import torch

from hybridmoe.quant.ref import random_blocks
from hybridmoe.quant.types import GGMLType


def test_grouped_expert_layout_matches_reference():
    """The padded grouped-GEMM layout of the prefill path (run on the CPU, where torch has _grouped_mm too):
    empty experts, uneven counts, repeated ids across tokens."""
    from hybridmoe.devices import Device
    from hybridmoe.runtime import experts as X
    from hybridmoe.weights import QTensor
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    g = torch.Generator().manual_seed(3)
    E, Fd, H, k, T = 24, 64, 96, 3, 37
    dev = Device("CPU", "cpu", 0, 0, 0, torch.device("cpu"))
    ws = [QTensor(n, random_blocks(GGMLType.Q8_0, s, g), GGMLType.Q8_0, s, dev)
          for n, s in (("g", (E, Fd, H)), ("u", (E, Fd, H)), ("d", (E, H, Fd)))]
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E // 2, generator=g)[:k] for _ in range(T)])     # half the experts empty
    wts = torch.softmax(torch.randn(T, k, generator=g), -1)
    ref = X.reference_moe(x, ids, wts, *ws)
    got = X._grouped_moe(x, ids, wts, ws[0].raw, ws[1].raw, ws[2].raw, ws[0], ws[2])
    assert float((got - ref).norm() / ref.norm()) <= 2e-2                               # bf16 GEMMs
