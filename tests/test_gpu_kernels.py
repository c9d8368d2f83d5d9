"""GPU kernels against their references (run on the GPU machine; skipped without CUDA)."""
import pytest
import torch
from conftest import rel_l2

from hybridmoe.quant.ref import dequantize, random_blocks
from hybridmoe.quant.types import GGMLType

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K])
@pytest.mark.parametrize("shape", [(1, 32), (3, 7, 64), (5, 768, 2048), (129, 256), (12, 3, 256)])
def test_dequantize_bf16_equals_reference(qtype, shape):
    from hybridmoe.kernels.gpu_dequant import dequantize_bf16
    if shape[-1] % 256 and qtype in (GGMLType.Q4_K, GGMLType.Q6_K):
        pytest.skip("K-quants need rows of 256")
    g = torch.Generator(device="cuda").manual_seed(7)
    raw = random_blocks(qtype, shape, g)
    out = torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    out.copy_(dequantize_bf16(raw, qtype, shape[-1]))
    ref = dequantize(raw, qtype, shape[-1], dtype=torch.float32).to(torch.bfloat16)
    assert not out.isnan().any()
    assert torch.equal(out, ref)
    # the gathering form: selected slabs, repeats allowed
    idx = torch.tensor([shape[0] - 1, 0, shape[0] - 1], device="cuda")
    got = dequantize_bf16(raw, qtype, shape[-1], index=idx)
    assert torch.equal(got, ref[idx])


@pytest.mark.parametrize("T,E", [(1, 16), (3, 16), (8, 16), (40, 16), (300, 16), (20, 128), (70, 128)])
def test_gpu_expert_paths_match_reference(T, E):
    """Gathered (decode) and grouped (prefill, with empty groups when E is large) paths vs float32."""
    from hybridmoe.devices import Device
    from hybridmoe.runtime import experts as X
    from hybridmoe.runtime.weights import QTensor
    F, H, k = 64, 128, 4
    g = torch.Generator(device="cuda").manual_seed(T)
    dev = Device("CUDA0", "cuda", 0, 0, 0, torch.device("cuda"))
    ws = [QTensor(n, random_blocks(GGMLType.Q4_0, s, g), GGMLType.Q4_0, s, dev)
          for n, s in (("g", (E, F, H)), ("u", (E, F, H)), ("d", (E, H, F)))]
    x = torch.randn(T, H, device="cuda")
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    wts = torch.softmax(torch.randn(T, k, device="cuda"), -1)
    ref = X.reference_moe(x.cpu(), ids.cpu(), wts.cpu(),
                          *[QTensor(w.name, w.raw.cpu(), w.qtype, w.shape, dev) for w in ws])
    got = X.moe(x, ids, wts, ws[0].raw, ws[1].raw, ws[2].raw, *ws)
    assert rel_l2(got.cpu(), ref) <= 1e-2
