"""The int8 tensor-core MoE kernels (kernels/gpu_mmq.py) against float64.

They run on a GPU, or on the CPU in Triton's interpreter (`TRITON_INTERPRET=1 PYTHONPATH=src:/tmp/tritonpkg
python -m pytest tests/test_gpu_mmq.py`, with triton importable); otherwise they are skipped (CI has neither).
The 30B-shape cases need a GPU."""
import pytest
import torch
from conftest import moe_ref_f64, rel_l2, triton_test_device

from hybridmoe.errors import HybridMoeError
from hybridmoe.quant.ref import random_blocks, split_rows
from hybridmoe.quant.types import GGMLType

mq = pytest.importorskip("hybridmoe.kernels.gpu_mmq")
if not mq.available():
    pytest.skip("triton is not installed", allow_module_level=True)

DEV = triton_test_device()
Q4, Q8 = GGMLType.Q4_0, GGMLType.Q8_0
# 5 tokens, 3 slots, 8 experts: expert 1 has every token, 0/2/4/5 two each, 6 and 7 one, 3 none
IDS = [[1, 2, 0], [1, 4, 5], [1, 6, 2], [1, 5, 7], [1, 0, 4]]
TWO_TERMS = 1e-4        # gpu_decode's split-row kernels' bound: the same two int8 terms per activation
ONE_TERM = 3e-2         # q1 alone (llama.cpp's q8_1): ~1e-2 measured at both shapes


def _experts(gq, dq, E, H, Fd, g):
    graw, uraw = random_blocks(gq, (E, Fd, H), g), random_blocks(gq, (E, Fd, H), g)
    return graw, uraw, random_blocks(dq, (E, H, Fd), g)


def _ref(x, ids, wts, graw, uraw, draw, gq, dq):
    """float64 over only the routed experts (the 30B shape's 128 experts in float64 would take 5 GB)."""
    used, local = torch.unique(ids, return_inverse=True)
    return moe_ref_f64(x, local, wts, graw[used], uraw[used], draw[used], gq, dq)


@pytest.mark.parametrize("gq,dq,pad", [(Q4, Q8, 3), (Q8, Q4, 0)])
def test_mmq_odd_shape(gq, dq, pad):
    """H 96 (3 blocks of 32), F 160 (5): 0, 1, 2 and 5 tokens an expert, 2 and 16 pairs a block (an expert over
    three blocks; most columns of a block empty), 5 tokens (a bucket of 8 with 3 zero rows where pad): within 1e-4
    of float64 with two int8 terms, ~1e-2 with one; a zero padded row gives zeros; the same bits with the down
    kernel's activations quantized apart (fuse=False); reduce=False writes each pair's weighted row into out,
    summing to the same."""
    g = torch.Generator(device=DEV).manual_seed(int(gq) + pad)
    E, k, H, Fd = 8, 3, 96, 160
    graw, uraw, draw = _experts(gq, dq, E, H, Fd, g)
    x = torch.cat([torch.randn(len(IDS), H, generator=g, device=DEV), torch.zeros(pad, H, device=DEV)])
    ids = torch.tensor(IDS + [list(range(k))] * pad, dtype=torch.int32, device=DEV)
    wts = torch.softmax(torch.randn(ids.shape[0], k, generator=g, device=DEV), -1)
    ref = moe_ref_f64(x, ids, wts, graw, uraw, draw, gq, dq)
    gs, us, ds = split_rows(graw, gq), split_rows(uraw, gq), split_rows(draw, dq)
    for terms, bp, bound in ((2, 2, TWO_TERMS), (2, 16, TWO_TERMS), (1, 4, ONE_TERM)):
        out = mq.moe(x, ids, wts, gs, us, ds, gq, dq, terms=terms, bp=bp)
        assert out.shape == x.shape and out.dtype == torch.float32
        err = rel_l2(out, ref)
        print(f"{gq.name}/{dq.name} terms {terms} BP {bp}: rel L2 {err:.2e}")
        assert err < bound, (terms, bp)
        if pad:
            assert not out[len(IDS):].any()
    # the gate/up kernel's int8 output (down's activations in Q4_0's order where dq is Q4_0) is quant()'s
    assert torch.equal(mq.moe(x, ids, wts, gs, us, ds, gq, dq, fuse=False), mq.moe(x, ids, wts, gs, us, ds, gq, dq))
    rows = torch.full((ids.numel(), H), float("nan"), device=DEV)
    got = mq.moe(x, ids, wts, gs, us, ds, gq, dq, reduce=False, out=rows)
    assert got is rows and rel_l2(got.view(*ids.shape, H).sum(1), ref) < TWO_TERMS


def _routing(kind, B, E, k, g):
    if kind == "random":
        return torch.stack([torch.randperm(E, device=DEV, generator=g)[:k] for _ in range(B)]).to(torch.int32)
    # "skewed": every token on experts 0..k-2 (B pairs each: several blocks of BP), its last slot spread
    last = torch.randint(k - 1, E, (B, 1), device=DEV, generator=g)
    return torch.cat([torch.arange(k - 1, device=DEV).expand(B, k - 1), last], 1).to(torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 3, 16, 64])
@pytest.mark.parametrize("kind", ["random", "skewed"])
def test_mmq_30b_shape(B, kind):
    """Qwen3-30B-A3B's experts (128 of 768 x 2048, 8 a token), Q4_0 gate/up with Q8_0 down and the reverse,
    B = 1, 3, 16, 64 tokens routed at random or with 7 of each token's 8 slots on the same experts (B rows on
    one expert), at the rule's block size and at 16 pairs a block: within 1e-4 of float64 (two terms),
    ~1e-2 (one)."""
    g = torch.Generator(device=DEV).manual_seed(B)
    E, k, H, Fd = 128, 8, 2048, 768
    for gq, dq in ((Q4, Q8), (Q8, Q4)):
        graw, uraw, draw = _experts(gq, dq, E, H, Fd, g)
        gs, us, ds = split_rows(graw, gq), split_rows(uraw, gq), split_rows(draw, dq)
        x = torch.randn(B, H, generator=g, device=DEV)
        ids = _routing(kind, B, E, k, g)
        wts = torch.softmax(torch.randn(B, k, generator=g, device=DEV), -1)
        ref = _ref(x, ids, wts, graw, uraw, draw, gq, dq)
        for terms, bp, bound in ((2, None, TWO_TERMS), (2, 16, TWO_TERMS), (1, None, ONE_TERM)):
            err = rel_l2(mq.moe(x, ids, wts, gs, us, ds, gq, dq, terms=terms, bp=bp), ref)
            print(f"{gq.name}/{dq.name} B {B} {kind} terms {terms} BP {bp}: rel L2 {err:.2e}")
            assert err < bound, (gq, terms, bp)


@pytest.mark.gpu
def test_mmq_in_a_cuda_graph():
    """Captured in a CUDA graph and replayed on new rows and routing (as the batched decode step runs it):
    the same result as eagerly."""
    g = torch.Generator(device=DEV).manual_seed(5)
    E, k, H, Fd, B = 16, 4, 256, 128, 16
    graw, uraw, draw = (split_rows(t, Q4) for t in _experts(Q4, Q4, E, H, Fd, g))
    x = torch.randn(B, H, generator=g, device=DEV)
    ids = _routing("random", B, E, k, g)
    wts = torch.softmax(torch.randn(B, k, generator=g, device=DEV), -1)
    mq.moe(x, ids, wts, graw, uraw, draw, Q4, Q4)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mq.moe(x, ids, wts, graw, uraw, draw, Q4, Q4)
    x.copy_(torch.randn(B, H, generator=g, device=DEV))
    ids.copy_(_routing("skewed", B, E, k, g))
    graph.replay()
    assert rel_l2(out, mq.moe(x, ids, wts, graw, uraw, draw, Q4, Q4)) < 1e-6


def test_block_pairs_tiles_and_errors():
    """2 to 16 pairs a block by the mean pairs an expert (the 30B shape's buckets: 128 experts, k = 8); a tile
    for both kernels; GGUF rows or a third term are one-line errors."""
    assert [mq.block_pairs(8 * b, 128) for b in (1, 8, 16, 32, 64, 128, 512)] == [2, 2, 2, 4, 8, 16, 16]
    assert mq.block_pairs(4096, 8) == 16
    for gate_up in (True, False):
        bn, nb, w, st = mq.tile(gate_up)
        assert bn >= 16 and bn & (bn - 1) == 0 and nb >= 1 and w in (1, 2, 4, 8) and st >= 1
    x = torch.zeros(2, 64, device=DEV)
    ids = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    w = torch.zeros(2, 32, 72, dtype=torch.uint8, device=DEV)
    with pytest.raises(HybridMoeError, match="reads split rows"):
        mq.moe(x, ids, ids.float(), w, w, w, Q4, Q4, gate_split=False)
    with pytest.raises(HybridMoeError, match="terms=3: give 1 or 2"):
        mq.moe(x, ids, ids.float(), w, w, w, Q4, Q4, terms=3)
