"""The grouped decode MoE kernels (kernels/gpu_moe_grouped.py) against float64 and the per-pair kernels.

They run on a GPU, or on the CPU in Triton's interpreter (`TRITON_INTERPRET=1 PYTHONPATH=src:/tmp/tritonpkg
python -m pytest tests/test_gpu_moe_grouped.py`, with triton importable); otherwise they are skipped (CI has
neither)."""
import pytest
import torch
from conftest import moe_ref_f64, rel_l2, triton_test_device

from hybridmoe.quant.ref import random_blocks, split_rows
from hybridmoe.quant.types import GGMLType

gg = pytest.importorskip("hybridmoe.kernels.gpu_moe_grouped")
gd = pytest.importorskip("hybridmoe.kernels.gpu_decode")
if not gg.available():
    pytest.skip("triton is not installed", allow_module_level=True)

DEV = triton_test_device()

# 5 tokens, 3 slots, 8 experts: expert 1 has every token (several blocks at BM 2 and 4), 0/2/4/5 two each,
# 6 and 7 one, 3 none
IDS = [[1, 2, 0], [1, 4, 5], [1, 6, 2], [1, 5, 7], [1, 0, 4]]


def _case(gq, dq, H, Fd, seed, pad=0):
    """Experts, rows and routing of IDS; pad: zero rows after them routed to experts 0..k-1 (what the router
    picks for a batch bucket's padded rows)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    E, k = 8, 3
    graw, uraw = random_blocks(gq, (E, Fd, H), g), random_blocks(gq, (E, Fd, H), g)
    draw = random_blocks(dq, (E, H, Fd), g)
    x = torch.randn(len(IDS), H, generator=g, device=DEV)
    ids = torch.tensor(IDS + [list(range(k))] * pad, dtype=torch.int32, device=DEV)
    x = torch.cat([x, torch.zeros(pad, H, device=DEV)])
    wts = torch.softmax(torch.randn(ids.shape[0], k, generator=g, device=DEV), -1)
    return x, ids, wts, graw, uraw, draw


@pytest.mark.parametrize("gq,dq,pad", [(GGMLType.Q4_0, GGMLType.Q8_0, 3), (GGMLType.Q8_0, GGMLType.Q4_0, 0)])
def test_grouped_moe_split_rows(gq, dq, pad):
    """Split rows (dp4a over a block's rows): 0, 1, 2 and 5 tokens an expert, blocks of 2 and 16 rows (an
    expert over several blocks; most rows of a block empty), 5 tokens (a bucket of 8 with 3 zero rows where
    pad), a partial last K step (9 blocks of 32, 8 a step): within 1e-4 of float64 (gpu_decode's split-row
    kernels' bound), and a zero padded row gives zeros."""
    x, ids, wts, graw, uraw, draw = _case(gq, dq, 768, 256, int(gq) + pad)
    gs, us, ds = split_rows(graw, gq), split_rows(uraw, gq), split_rows(draw, dq)
    ref = moe_ref_f64(x, ids, wts, graw, uraw, draw, gq, dq)
    for bm in (2, 16):
        out = gg.moe(x, ids, wts, gs, us, ds, gq, dq, gate_split=True, down_split=True, bm=bm)
        assert out.shape == x.shape and out.dtype == torch.float32
        assert rel_l2(out.double(), ref) < 1e-4, bm
        if pad:
            assert not out[len(IDS):].any()


@pytest.mark.parametrize("gq,dq,H,Fd", [(GGMLType.Q4_0, GGMLType.Q8_0, 96, 64),
                                        (GGMLType.Q4_K, GGMLType.Q6_K, 256, 256)])
def test_grouped_moe_gguf_rows(gq, dq, H, Fd):
    """GGUF rows (every type the per-pair kernels read), 4 rows a block: each pair's weighted row (reduce=False,
    written into out) is the per-pair kernel's, whatever block it sits in, and their sum is float64's."""
    x, ids, wts, graw, uraw, draw = _case(gq, dq, H, Fd, int(gq))
    pairs = gd.moe(x, ids, wts, graw, uraw, draw, gq, dq, reduce=False)
    out = torch.full((ids.numel(), H), float("nan"), device=DEV)
    got = gg.moe(x, ids, wts, graw, uraw, draw, gq, dq, reduce=False, bm=4, out=out)
    assert got is out and rel_l2(got, pairs) < 1e-6
    ref = moe_ref_f64(x, ids, wts, graw, uraw, draw, gq, dq)
    assert rel_l2(got.view(*ids.shape, H).sum(1).double(), ref) < 1e-5


def test_grouped_moe_gpt_oss_biases():
    """gpt-oss's experts (MXFP4 rows, biases, the clamped SwiGLU with a limit the values reach): each pair's
    weighted row is the per-pair kernel's with the same biases, at 2 and 4 rows a block; without the biases the
    rows differ."""
    gq = GGMLType.MXFP4
    x, ids, wts, graw, uraw, draw = _case(gq, gq, 64, 64, 5)
    g = torch.Generator(device=DEV).manual_seed(9)
    oai = (torch.randn(8, 64, generator=g, device=DEV), torch.randn(8, 64, generator=g, device=DEV),
           torch.randn(8, 64, generator=g, device=DEV), 1.702, 1.5)
    pairs = gd.moe(x, ids, wts, graw, uraw, draw, gq, gq, reduce=False, oai=oai)
    for bm in (2, 4):
        got = gg.moe(x, ids, wts, graw, uraw, draw, gq, gq, reduce=False, bm=bm, oai=oai)
        assert rel_l2(got, pairs) < 1e-6, bm
    assert rel_l2(gg.moe(x, ids, wts, graw, uraw, draw, gq, gq, reduce=False), pairs) > 1e-2


def test_block_rows_and_tiles():
    """Blocks of 2 to 16 rows by the mean pairs an expert (the 30B shape's buckets: 128 experts, k = 8), and
    a tile for every block height."""
    assert [gg.block_rows(8 * b, 128) for b in (1, 2, 4, 8, 16, 32, 64)] == [2, 2, 2, 2, 2, 4, 8]
    assert gg.block_rows(4096, 8) == 16
    for q in (GGMLType.Q4_0, GGMLType.Q8_0):
        for bm in (2, 4, 8, 16):
            for gate_up in (True, False):
                bn, nb, w = gg.grouped_tile(q, gate_up, bm)
                assert bn & (bn - 1) == 0 and nb & (nb - 1) == 0 and w in (2, 4, 8)
