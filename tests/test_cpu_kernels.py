"""CPU expert kernels (kernels/cpu.py + cpu_moe.c) against a float64 dequantize + matmul oracle.

Error bands, relative L2 over the whole output, by what rounds:
- fp32 path (activations stay fp32; weights decode to the exact dequantized values; fp32
  accumulation over K <= 512 terms): ~1e-7 measured, band 2e-5.
- integer path (Q4_0/Q4_K/Q5_K rows used by one token, on AVX512-VNNI): activations rounded per 32-block to
  two int8 terms, x ~ d/256 (256 q1 + q2) with d = max|x|/127, so each element carries an
  error of at most d/512 (~1.5e-5 of the block max; ~3e-5 rel measured), band 2e-4; for the weight types that
  take one term (cpu.act_terms, docs/cpu-kernels.md "Activation terms per weight type") at most d/2 (~1e-2 rel
  measured a layer), band 3e-2.
- large-batch paths (dequantize + bf16 GEMM, and the grouped bf16 tile kernel): x, weights and h
  (and the GEMM path's products) are rounded to bf16 (8-bit mantissa, 2^-9 relative): ~4-5e-3
  measured, band 1.5e-2.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from hybridmoe.kernels import cpu, cpu_build
from hybridmoe.quant.ref import dequantize, random_blocks
from hybridmoe.quant.types import GGMLType as G
from hybridmoe.quant.types import block_size

TYPES = [G.F32, G.F16, G.BF16, G.Q4_0, G.Q8_0, G.Q4_K, G.Q5_K, G.Q6_K, G.IQ4_NL, G.MXFP4]
BAND = {"fp32": 2e-5, "int": 2e-4, "int1": 3e-2, "gemm": 1.5e-2}


def int_band(*qs):
    """The integer path's band for rows of these types: one activation term for any of them, the wider one."""
    return BAND["int1"] if any(cpu.act_terms(q) == 1 for q in qs) else BAND["int"]



@pytest.fixture(autouse=True)
def _needs_kernel(request):
    if "fallback" not in request.node.name and not cpu.available():
        pytest.skip("the C kernel could not be built here (fallback tests still run)")


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def band(q, impl):
    if impl in ("gemm", "tile"):
        return BAND["gemm"]
    return int_band(q) if cpu.int8_path(q) else BAND["fp32"]


_weights: dict = {}


def experts(q, E, H, F):
    """Random GGUF expert tensors gate, up [E, F, rb(H)], down [E, H, rb(F)] (cached)."""
    key = (q, E, H, F)
    if key not in _weights:
        g = torch.Generator().manual_seed(hash(key) % (1 << 31))
        _weights[key] = (random_blocks(q, (E, F, H), g), random_blocks(q, (E, F, H), g),
                         random_blocks(q, (E, H, F), g))
    return _weights[key]


def routing(T, E, k, g):
    """Top-k distinct experts per token; tokens share experts (E small)."""
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, generator=g) + 0.1
    return ids, w / w.sum(-1, keepdim=True)


def shapes(q, T):
    bs = max(block_size(q), 64)
    if T >= 512:
        return 16, bs if bs >= 256 else 128, 256 if bs >= 256 else 128
    return 16, max(2 * bs, 256) if bs < 256 else 512, 256


CASES = [(q, T, impl) for q in TYPES for T, impl in
         [(1, "kernel"), (2, "kernel"), (7, "kernel"), (64, "kernel"), (64, "gemm"), (64, "tile"), (512, "kernel"),
          (512, None)]]


@pytest.mark.parametrize("q,T,impl", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_moe_ffn_matches_float64(q, T, impl):
    E, H, F = shapes(q, T)
    k = 8
    gate, up, down = experts(q, E, H, F)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    ids, w = routing(T, E, k, g)
    ref = cpu.reference_moe_ffn(x, ids, w, gate, up, down, q, q, torch.float64)
    out = torch.full((T, H), float("nan"))
    res = cpu.moe_ffn(x, ids, w, gate, up, down, q, q, out=out, impl=impl)
    assert res.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all(), "output not fully written"
    used = impl or ("kernel" if T < cpu.GEMM_MIN_T else cpu._large_impl())
    assert rel_l2(out, ref) < band(q, used)


@pytest.mark.parametrize("q", TYPES, ids=lambda v: v.name)
@pytest.mark.parametrize("T", [1, 2, 7, 64])
def test_qmatmul_matches_float64(q, T, tile_modes):
    K = max(block_size(q), 64) * 2
    N = 37                                   # not a multiple of the 4-row tiles
    g = torch.Generator().manual_seed(100 + T)
    wr = random_blocks(q, (N, K), g)
    x = torch.randn(T, K, generator=g)
    ref = x.double() @ dequantize(wr, q, K, torch.float64).T
    for impl in ("kernel", "gemm"):
        out = torch.full((T, N), float("nan"))
        cpu.qmatmul(x, wr, q, K, out=out, impl=impl)
        assert torch.isfinite(out).all()
        assert rel_l2(out, ref) < band(q, impl), impl
    # the tile products take rows 32 at a time (N % 32 == 0), every tile mode this CPU has
    wr = random_blocks(q, (96, K), g)
    ref = x.double() @ dequantize(wr, q, K, torch.float64).T
    for mode in tile_modes():
        out = torch.full((T, 96), float("nan"))
        cpu.qmatmul(x, wr, q, K, out=out, impl="tile")
        assert torch.isfinite(out).all() and rel_l2(out, ref) < band(q, "tile"), mode


@pytest.mark.parametrize("q", [G.Q8_0, G.Q4_K], ids=lambda v: v.name)
def test_qmatmul_tile_over_several_passes(q):
    """K beyond one tile pass (TILE_KC = 2048 elements): the passes add up, a short last one included."""
    g = torch.Generator().manual_seed(3)
    wr, x = random_blocks(q, (64, 2304), g), torch.randn(40, 2304, generator=g)
    ref = x.double() @ dequantize(wr, q, 2304, torch.float64).T
    assert rel_l2(cpu.qmatmul(x, wr, q, 2304, impl="tile"), ref) < band(q, "tile")


@pytest.mark.parametrize("path", [None, "avx2", "generic"], ids=["best", "avx2", "generic"])
@pytest.mark.parametrize("q", [G.F32, G.F16, G.BF16, G.Q4_0, G.Q8_0], ids=lambda v: v.name)
def test_canonical_types_compute_rows_alike_at_every_batch_size(q, path):
    """What canonical() promises (the server's batches bit for bit as each sequence alone, tests/test_batch.py)
    holds on the vector path in use: 9 tokens at once, one at a time and 4 + 5 give the same bits, in qmatmul
    and moe_ffn. (On the AVX2 path the fp32 kernels sum a batch's rows in another order than one token's:
    canonical() says False there, for float weights too.)"""
    prev = cpu.set_simd(path)
    try:
        if path and cpu.simd().split("-")[0] != path:
            pytest.skip(f"this build has no {path} path")
        if not cpu.canonical(q):
            pytest.skip(f"{q.name} is not canonical on the {cpu.simd()} path")
        E, H, F = shapes(q, 9)
        gate, up, down = experts(q, E, H, F)
        g = torch.Generator().manual_seed(9)
        x = torch.randn(9, H, generator=g)
        ids, w = routing(9, E, 2, g)
        def qmm(a, b):
            return cpu.qmatmul(x[a:b], gate[0], q, H, impl="kernel")
        full = qmm(0, 9)
        assert torch.equal(full, torch.cat([qmm(i, i + 1) for i in range(9)]))
        assert torch.equal(full, torch.cat([qmm(0, 4), qmm(4, 9)]))
        y = cpu.moe_ffn(x, ids, w, gate, up, down, q, q, impl="kernel")
        assert torch.equal(y, torch.cat([cpu.moe_ffn(x[i:i + 1], ids[i:i + 1], w[i:i + 1], gate, up, down, q, q,
                                                     impl="kernel") for i in range(9)]))
    finally:
        cpu.set_simd(prev)


@pytest.mark.parametrize("path", ["avx2", "generic"])
@pytest.mark.parametrize("q", TYPES, ids=lambda v: v.name)
def test_lower_simd_paths(q, path):
    """The kernels CPUs without AVX-512 run: AVX2 intrinsics, or the portable C path (forced here)."""
    E, H, F = shapes(q, 7)
    gate, up, down = experts(q, E, H, F)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, H, generator=g)
    ids, w = routing(7, E, 4, g)
    ref = cpu.reference_moe_ffn(x, ids, w, gate, up, down, q, q, torch.float64)
    prev = cpu.set_simd(path)
    try:
        if cpu.simd().split("-")[0] != path:
            pytest.skip(f"this build has no {path} path")
        # AVX-VNNI: rows of one token take the two-term int8 path (Q4_0, Q4_K)
        tol = int_band(q) if cpu.int8_path(q) else BAND["fp32"]
        out = cpu.moe_ffn(x, ids, w, gate, up, down, q, q, impl="kernel")
        one = cpu.moe_ffn(x[:1], ids[:1], w[:1], gate, up, down, q, q, impl="kernel")
        qm = cpu.qmatmul(x, gate[0], q, H, impl="kernel")
        deq = cpu.dequant(gate[0], q, H, torch.float32)
        deq16 = cpu.dequant(gate[0], q, H, torch.bfloat16)
    finally:
        cpu.set_simd(prev)
    assert rel_l2(out, ref) < tol
    assert rel_l2(one, ref[:1]) < tol
    assert rel_l2(qm, x.double() @ dequantize(gate[0], q, H, torch.float64).T) < BAND["fp32"]
    assert torch.equal(deq16, dequantize(gate[0], q, H).to(torch.bfloat16))
    assert torch.equal(deq, dequantize(gate[0], q, H))   # same float ops as ggml: bit-exact


@pytest.mark.parametrize("q", [G.Q4_0, G.Q4_K, G.Q5_K, G.Q6_K, G.IQ4_NL, G.MXFP4], ids=lambda v: v.name)
def test_activation_precision_setting(q):
    """set_int8: False keeps fp32 activations (fp32 band); [q] puts q's single-token rows on the
    integer path (its band, and a visibly different rounding)."""
    E, H, F = shapes(q, 1)
    gate, up, down = experts(q, E, H, F)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, H, generator=g)
    ids, w = routing(1, E, 8, g)
    ref = cpu.reference_moe_ffn(x, ids, w, gate, up, down, q, q, torch.float64)
    qref = x.double() @ dequantize(gate[0], q, H, torch.float64).T
    prev = cpu.set_int8(False)
    try:
        f32 = cpu.moe_ffn(x, ids, w, gate, up, down, q, q)
        cpu.set_int8([q])
        i8 = cpu.moe_ffn(x, ids, w, gate, up, down, q, q)
        qm = cpu.qmatmul(x, gate[0], q, H)
    finally:
        cpu.set_int8(prev)
    assert rel_l2(f32, ref) < BAND["fp32"]
    assert rel_l2(i8, ref) < int_band(q) and rel_l2(qm, qref) < int_band(q)
    if cpu.int8_path(q):                  # the integer path exists here: its rounding shows
        assert rel_l2(i8, ref) > 20 * rel_l2(f32, ref)


@pytest.mark.parametrize("q", [G.Q4_0, G.Q4_K, G.Q6_K, G.BF16], ids=lambda v: v.name)
def test_dequant(q):
    K = 512
    g = torch.Generator().manual_seed(7)
    wr = random_blocks(q, (19, K), g)
    ref = dequantize(wr, q, K)
    f32 = cpu.dequant(wr, q, K, torch.float32)
    assert float((f32 - ref).abs().max()) <= 1e-6 * float(ref.abs().max())   # one rounding apart at most
    b16 = cpu.dequant(wr, q, K, torch.bfloat16)
    assert float((b16.float() - ref).abs().max()) <= 2 ** -8 * float(ref.abs().max())


def test_mixed_types_repeats_and_skips():
    """Q4_K gate/up with a Q6_K down; one token routed to the same expert as all others;
    ids < 0 are skipped; an id >= E is an error."""
    E, H, F = 16, 512, 256
    gate, up, _ = experts(G.Q4_K, E, H, F)
    down = experts(G.Q6_K, E, H, F)[2]
    g = torch.Generator().manual_seed(8)
    x = torch.randn(9, H, generator=g)
    ids, w = routing(9, E, 6, g)
    ids[:, 0] = 3                        # expert 3 shared by every token
    ids[2, 1] = -1
    ids[4] = -1                          # a token with no experts: output 0
    ref = cpu.reference_moe_ffn(x, ids, w, gate, up, down, G.Q4_K, G.Q6_K, torch.float64)
    for impl in ("kernel", "gemm"):
        out = torch.full((9, H), float("nan"))
        cpu.moe_ffn(x, ids, w, gate, up, down, G.Q4_K, G.Q6_K, out=out, impl=impl)
        assert torch.isfinite(out).all()
        assert float(out[4].abs().max()) == 0.0
        assert rel_l2(out, ref) < (BAND["gemm"] if impl == "gemm" else int_band(G.Q4_K, G.Q6_K)), impl
    bad = ids.clone()
    bad[0, 0] = E
    for impl in ("kernel", "gemm"):
        with pytest.raises(ValueError):
            cpu.moe_ffn(x, bad, w, gate, up, down, G.Q4_K, G.Q6_K, impl=impl)


@pytest.fixture
def tile_modes():
    """Iterates over the tile-product implementations this CPU has (AMX, AVX512-BF16, portable C), setting
    each in turn; the best one is set again after the test, failed or not."""
    best = cpu.tile_mode()
    order = ["amx", "avx512-bf16", "c"]

    def each():
        for mode in order[order.index(best):]:
            assert cpu.tile_mode(mode) == mode
            yield mode
    yield each
    cpu.tile_mode(best)


@pytest.mark.parametrize("q,dq", [(G.Q4_0, G.Q4_0), (G.Q8_0, G.Q8_0), (G.Q4_K, G.Q6_K), (G.Q5_K, G.Q5_K),
                                  (G.BF16, G.F16), (G.MXFP4, G.IQ4_NL)], ids=lambda v: v.name)
def test_tile_kernel_every_mode(q, dq, tile_modes):
    """The grouped tile kernel with every tile-product implementation this CPU has (AMX on Sapphire
    Rapids, AVX512-BF16, portable C), against float64: an expert shared by every token (3 token blocks,
    the last one partial), repeated ids, skipped slots, a token with no experts, gate and down types
    that differ; bitwise the same for any thread count."""
    E, H, F = shapes(q, 40)
    gate, up, _ = experts(q, E, H, F)
    down = experts(dq, E, H, F)[2]
    g = torch.Generator().manual_seed(21)
    T = 40
    x = torch.randn(T, H, generator=g)
    ids, w = routing(T, E, 4, g)
    ids[:, 0] = 3
    ids[5, 1] = ids[5, 2]                     # the same expert twice for one token
    ids[2, 3] = -1
    ids[7] = -1
    ref = cpu.reference_moe_ffn(x, ids, w, gate, up, down, q, dq, torch.float64)
    for mode in tile_modes():
        outs = []
        for nth in (1, 3):
            out = torch.full((T, H), float("nan"))
            cpu.moe_ffn(x, ids, w, gate, up, down, q, dq, n_threads=nth, out=out, impl="tile")
            outs.append(out)
        assert torch.isfinite(outs[0]).all(), mode
        assert float(outs[0][7].abs().max()) == 0.0
        assert rel_l2(outs[0], ref) < BAND["gemm"], mode
        assert torch.equal(outs[0], outs[1]), mode
    bad = ids.clone()
    bad[0, 0] = E
    with pytest.raises(ValueError):
        cpu.moe_ffn(x, bad, w, gate, up, down, q, dq, impl="tile")


@pytest.mark.parametrize("q,E,H,F,k", [(G.Q8_0, 6, 96, 352, 3), (G.Q8_0, 2, 2112, 2080, 1), (G.Q4_K, 2, 2304, 256, 1)],
                         ids=["small", "long-rows", "long-rows-Q4_K"])
def test_tile_kernel_uneven_units(q, E, H, F, k, tile_modes):
    """The tile kernel's work at shapes that do not divide evenly: F of 22 sixteen-row steps (units of 8, 8
    and 6), H of 3 x 32 rows; rows longer than one pass of the products (2048), so a pass adds to the
    last one's sums. Every mode this CPU has, against float64."""
    gate, up, down = experts(q, E, H, F)
    g = torch.Generator().manual_seed(5)
    T = 40
    x = torch.randn(T, H, generator=g)
    ids, w = routing(T, E, k, g)
    ref = cpu.reference_moe_ffn(x, ids, w, gate, up, down, q, q, torch.float64)
    for mode in tile_modes():
        out = torch.full((T, H), float("nan"))
        cpu.moe_ffn(x, ids, w, gate, up, down, q, q, n_threads=3, out=out, impl="tile")
        assert rel_l2(out, ref) < BAND["gemm"], mode


@pytest.mark.parametrize("q", [G.MXFP4, G.Q4_0, G.Q8_0], ids=lambda v: v.name)
@pytest.mark.parametrize("T,impl", [(1, "kernel"), (7, "kernel"), (40, "tile")])
def test_gpt_oss_experts(q, T, impl, tile_modes):
    """gpt-oss's experts (biases, clamped SwiGLU) in the C kernels against float64; inputs large enough that
    the clamps at 7 act on a good share of gate and up values."""
    E, H, F = shapes(q, T)
    gate, up, down = experts(q, E, H, F)
    g = torch.Generator().manual_seed(30 + T)
    x = 60 * torch.randn(T, H, generator=g)
    ids, w = routing(T, E, 4, g)
    oai = (torch.randn(E, F, generator=g), torch.randn(E, F, generator=g), torch.randn(E, H, generator=g),
           1.702, 7.0)
    ref = cpu.reference_moe_ffn(x, ids, w, gate, up, down, q, q, torch.float64, oai=oai)
    gd = x.double() @ dequantize(gate[int(ids[0, 0])], q, H, torch.float64).T
    assert 0.05 < float((gd.abs() > 7).double().mean()) < 0.95          # the clamps matter here
    for mode in (tile_modes() if impl == "tile" else [cpu.tile_mode()]):
        out = torch.full((T, H), float("nan"))
        cpu.moe_ffn(x, ids, w, gate, up, down, q, q, out=out, impl=impl, oai=oai)
        assert torch.isfinite(out).all()
        assert rel_l2(out, ref) < (BAND["gemm"] if impl == "tile" else int_band(q)), mode


def test_deterministic_across_thread_counts():
    q = G.Q4_0
    E, H, F = shapes(q, 7)
    gate, up, down = experts(q, E, H, F)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(7, H, generator=g)
    ids, w = routing(7, E, 8, g)
    a = cpu.moe_ffn(x, ids, w, gate, up, down, q, q, n_threads=1)
    b = cpu.moe_ffn(x, ids, w, gate, up, down, q, q, n_threads=2)
    c = cpu.moe_ffn(x, ids, w, gate, up, down, q, q, n_threads=3)   # more threads than cores
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("q", [G.Q4_0, G.Q4_K], ids=lambda v: v.name)
def test_single_token_same_for_any_schedule(q):
    """T=1, the integer path: stage 1 quantizes each 64-row block of h when the chunk that covers it ends,
    and stage 2 reads the quantized h. Any thread count gives the same bits; a block left unquantized
    would keep the previous call's values, so a call on other inputs runs in between."""
    E, H, F = 8, 256, 768
    gate, up, down = experts(q, E, H, F)
    g = torch.Generator().manual_seed(5)
    x, x_other = torch.randn(1, H, generator=g), torch.randn(1, H, generator=g)
    ids, w = routing(1, E, 8, g)
    a = cpu.moe_ffn(x, ids, w, gate, up, down, q, q, n_threads=1)
    for nth in (2, 3, 5, 16):
        cpu.moe_ffn(x_other, ids, w, gate, up, down, q, q, n_threads=nth)
        assert torch.equal(cpu.moe_ffn(x, ids, w, gate, up, down, q, q, n_threads=nth), a), nth
    ref = cpu.moe_ffn(x, ids, w, gate, up, down, q, q, impl="torch")
    assert rel_l2(a, ref) < band(q, "kernel")


def test_coexists_with_torch_threads():
    """Interleave torch's OpenMP ops with kernel calls, from the main thread and a worker."""
    q = G.Q8_0
    E, H, F = shapes(q, 2)
    gate, up, down = experts(q, E, H, F)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, H, generator=g)
    ids, w = routing(2, E, 4, g)
    nt = torch.get_num_threads()
    want = cpu.moe_ffn(x, ids, w, gate, up, down, q, q, n_threads=3)
    assert torch.get_num_threads() == nt          # the kernel never touches torch's setting
    a = torch.randn(256, 256, generator=g)
    results = []

    def work():
        for _ in range(20):
            a @ a
            results.append(cpu.moe_ffn(x, ids, w, gate, up, down, q, q, n_threads=2))

    t = threading.Thread(target=work)
    t.start()
    for _ in range(20):
        torch.nn.functional.silu(a @ a).sum()
        results.append(cpu.moe_ffn(x, ids, w, gate, up, down, q, q))
    t.join(timeout=60)
    assert not t.is_alive()
    assert len(results) == 40 and all(torch.equal(r, want) for r in results)


def _handoff_layer(q=G.Q4_0, k=8):
    E, H, F = shapes(q, 1)
    gate, up, down = experts(q, E, H, F)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, H, generator=g)
    ids, w = routing(1, E, k, g)
    packed = torch.cat((x[0], w[0], ids[0].float()))
    bufs = dict(packed=packed, out=torch.full((H,), float("nan")), ready=torch.zeros(16, dtype=torch.int32),
                done=torch.zeros(16, dtype=torch.int32))
    want = cpu.moe_ffn(x, ids, w, gate, up, down, q, q)[0]
    return (gate, up, down, q, q), bufs, want


def test_handoff_waits_for_the_flag_then_runs_the_experts():
    """The CPU side of the polled GPU hand-off: the call spins until another thread (the GPU's stand-in)
    sets the ready flag to the step, computes exactly what moe_ffn does, then sets the done flag."""
    w, b, want = _handoff_layer()
    call = cpu.handoff_call(*w, b["packed"], b["out"], b["ready"], b["done"], timeout_s=30.0)
    publisher = threading.Timer(0.05, lambda: b["ready"].fill_(7))
    publisher.start()
    assert call(7) == 0                                # ctypes drops the GIL while the kernel spins
    publisher.join()
    assert torch.equal(b["out"], want) and int(b["done"][0]) == 7
    b["out"].fill_(float("nan"))
    b["ready"][0] = 8                                  # already there: no wait
    assert call(8) == 0 and torch.equal(b["out"], want) and int(b["done"][0]) == 8


def test_handoff_runs_only_the_first_n_cpu_slots():
    """With the decode share, the CPU runs the experts of the first n_cpu slots and the GPU the rest: the
    CPU's output is moe_ffn over those slots alone, and an id in a GPU slot is still checked."""
    w, b, _ = _handoff_layer()
    H, k = b["out"].numel(), 8
    x, wts, ids = b["packed"][None, :H], b["packed"][None, H:H + k], b["packed"][None, H + k:].int()
    for n_cpu in (1, 5, 8):
        call = cpu.handoff_call(*w, b["packed"], b["out"], b["ready"], b["done"], n_cpu=n_cpu)
        b["ready"][0] = n_cpu
        assert call(n_cpu) == 0
        want = cpu.moe_ffn(x, ids[:, :n_cpu].contiguous(), wts[:, :n_cpu].contiguous(), *w)[0]
        assert torch.equal(b["out"], want)
    call = cpu.handoff_call(*w, b["packed"], b["out"], b["ready"], b["done"], timeout_s=0.05, n_cpu=5)
    b["packed"][H + 2 * k - 1] = -2.0                  # the last slot is the GPU's, still an expert id
    b["ready"][0] = 9
    assert call(9) == -1 and int(b["done"][0]) == 9
    for bad in (0, 9):
        with pytest.raises(ValueError, match="no kernel"):
            cpu.handoff_call(*w, b["packed"], b["out"], b["ready"], b["done"], n_cpu=bad)


def test_handoff_with_gpt_oss_biases():
    """gpt-oss's host experts in the polled hand-off: MXFP4 with its biases and clamped SwiGLU, the first n_cpu
    slots exactly what moe_ffn(oai=) computes for them; biases of the wrong shape or dtype are refused."""
    w, b, _ = _handoff_layer(G.MXFP4)
    E, F = w[0].shape[:2]
    H, k = b["out"].numel(), 8
    g = torch.Generator().manual_seed(5)
    oai = (torch.randn(E, F, generator=g), torch.randn(E, F, generator=g), torch.randn(E, H, generator=g), 1.702, 0.5)
    x, wts, ids = b["packed"][None, :H], b["packed"][None, H:H + k], b["packed"][None, H + k:].int()
    for n_cpu in (8, 3):
        call = cpu.handoff_call(*w, b["packed"], b["out"], b["ready"], b["done"], n_cpu=n_cpu, oai=oai)
        b["ready"][0] = 20 + n_cpu
        assert call(20 + n_cpu) == 0 and int(b["done"][0]) == 20 + n_cpu
        want = cpu.moe_ffn(x, ids[:, :n_cpu].contiguous(), wts[:, :n_cpu].contiguous(), *w, oai=oai)[0]
        plain = cpu.moe_ffn(x, ids[:, :n_cpu].contiguous(), wts[:, :n_cpu].contiguous(), *w)[0]
        assert torch.equal(b["out"], want) and not torch.allclose(want, plain)
    for bad in ((oai[0][:, :-1], *oai[1:]), (oai[0].double(), *oai[1:])):
        with pytest.raises(ValueError, match="gpt-oss's float32 biases"):
            cpu.handoff_call(*w, b["packed"], b["out"], b["ready"], b["done"], oai=bad)


def test_handoff_errors_still_release_the_gpu():
    w, b, _ = _handoff_layer()
    call = cpu.handoff_call(*w, b["packed"], b["out"], b["ready"], b["done"], timeout_s=0.05)
    assert call(3) == -3 and int(b["done"][0]) == 3    # the GPU never came: a timeout, not a hang
    H = b["out"].numel()
    for bad in (float("nan"), 1e9, -2.0):              # an id that is not an expert (-1: the GPU's pair)
        b["packed"][H + 8] = bad
        b["ready"][0] = 4
        assert call(4) == -1 and int(b["done"][0]) == 4
        b["done"][0] = 0
    with pytest.raises(ValueError, match="no kernel"):
        cpu.handoff_call(*w[:3], G.Q2_K, G.Q4_0, b["packed"], b["out"], b["ready"], b["done"])


def test_handoff_rows_runs_the_first_rows_and_zeros_the_rest():
    """The batched decode step's hand-off: the first T of Tp packed rows [x | weights | ids] through the experts,
    each row what moe_ffn gives it in a call over those rows, the padding rows' outputs zero, pairs of id -1 (the
    GPU's) skipped; a bad id in a real row is refused (done still set), one in a padding row is never read."""
    q, k = G.Q4_0, 8
    E, H, F = shapes(q, 1)
    w = (*experts(q, E, H, F), q, q)
    g = torch.Generator().manual_seed(12)
    Tp = 8
    x = torch.randn(Tp, H, generator=g)
    ids, wts = routing(Tp, E, k, g)
    packed = torch.cat((x, wts, ids.float()), 1)
    out = torch.full((Tp, H), float("nan"))
    ready, done = torch.zeros(16, dtype=torch.int32), torch.zeros(16, dtype=torch.int32)
    call = cpu.handoff_rows_call(*w, packed, out, ready, done, timeout_s=0.05)
    for step, T in enumerate((5, 1, 8), 1):
        ready[0] = step
        packed[:, H + k:] = ids.float()
        packed[T:, H + k] = float("nan")                 # padding rows: never read
        assert call(step, T) == 0 and int(done[0]) == step
        assert torch.equal(out[:T], cpu.moe_ffn(x[:T], ids[:T], wts[:T], *w))
        assert not out[T:].any()
    gpu = ids.clone()
    gpu[:, ::3] = -1                                     # the pairs the GPU runs itself (the decode share): skipped
    packed[:, H + k:] = gpu.float()
    ready[0] = 4
    assert call(4, 6) == 0 and torch.equal(out[:6], cpu.moe_ffn(x[:6], gpu[:6], wts[:6], *w))
    packed[2, H + k] = float(E)
    ready[0] = 9
    assert call(9, 4) == -1 and int(done[0]) == 9
    assert call(10, 4) == -3 and int(done[0]) == 10    # the GPU never came: a timeout, not a hang
    with pytest.raises(ValueError, match="no kernel"):
        cpu.handoff_rows_call(*w, packed[:, 1:], out, ready, done)
    # gpt-oss's experts (biases, the clamped SwiGLU): as moe_ffn(oai=) over the same rows
    oai = (torch.randn(E, F, generator=g), torch.randn(E, F, generator=g), torch.randn(E, H, generator=g), 1.702, 0.5)
    call = cpu.handoff_rows_call(*w, packed, out, ready, done, timeout_s=0.05, oai=oai)
    packed[:, H + k:] = ids.float()
    ready[0] = 11
    assert call(11, 5) == 0 and int(done[0]) == 11
    want = cpu.moe_ffn(x[:5], ids[:5], wts[:5], *w, oai=oai)
    assert torch.equal(out[:5], want) and not out[5:].any()
    assert not torch.allclose(want, cpu.moe_ffn(x[:5], ids[:5], wts[:5], *w))
    with pytest.raises(ValueError, match="biases"):
        cpu.handoff_rows_call(*w, packed, out, ready, done, oai=(oai[0][1:], *oai[1:]))


def test_torch_fallback():
    q = G.Q4_K
    E, H, F = shapes(q, 3)
    gate, up, down = experts(q, E, H, F)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, H, generator=g)
    ids, w = routing(3, E, 4, g)
    ref = cpu.reference_moe_ffn(x, ids, w, gate, up, down, q, q, torch.float64)
    out = torch.full((3, H), float("nan"))
    cpu.moe_ffn(x, ids, w, gate, up, down, q, q, out=out, impl="torch")
    assert rel_l2(out, ref) < BAND["fp32"]


SUBPROCESS = r"""
import logging, os, sys, torch
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from hybridmoe.kernels import cpu
from hybridmoe.quant.ref import random_blocks
from hybridmoe.quant.types import GGMLType as G
g = torch.Generator().manual_seed(0)
gate, up, down = (random_blocks(G.Q8_0, s, g) for s in ((4, 64, 64), (4, 64, 64), (4, 64, 64)))
x = torch.randn(2, 64, generator=g)
ids = torch.tensor([[0, 1], [1, 3]], dtype=torch.int32)
w = torch.tensor([[0.6, 0.4], [0.5, 0.5]])
ref = cpu.reference_moe_ffn(x, ids, w, gate, up, down, G.Q8_0, G.Q8_0, torch.float64)
for _ in range(2):
    out = cpu.moe_ffn(x, ids, w, gate, up, down, G.Q8_0, G.Q8_0)
    q = cpu.qmatmul(x, gate[0], G.Q8_0, 64)
err = float((out.double() - ref).norm() / ref.norm())
print("available", cpu.available(), "err", err)
"""


@pytest.mark.parametrize("env", [{"HYBRIDMOE_CPU_KERNELS": "torch"}, {"CC": "no-such-compiler-hm"}],
                         ids=["env-forced", "no-compiler"])
def test_fallback_without_kernel(env, tmp_path):
    """Forced off, or no compiler (fresh cache): available() is False, results still right,
    and a failed build logs exactly one warning."""
    e = dict(os.environ, HYBRIDMOE_CACHE=str(tmp_path), **env)
    r = subprocess.run([sys.executable, "-c", SUBPROCESS], env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    assert words[:2] == ["available", "False"]
    assert float(words[3]) < BAND["fp32"]
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == (1 if "CC" in env else 0), r.stderr


def test_source_is_every_piece_once(tmp_path):
    """cpu_build.source() (what is compiled and hashed) holds cpu_moe.c's every piece, each once; an edit to a
    piece changes it (so the cached build is not reused); no piece over ~800 lines; the compiler's messages name
    the piece and its line."""
    kdir = cpu_build.SRC.parent
    pieces = sorted(p.name for p in kdir.glob("cpu_*.h"))
    src = cpu_build.source()
    assert pieces and all(src.count(b'#line 1 "%s"' % n.encode()) == 1 for n in pieces)
    assert b'#include "' not in src
    long = {n: k for n in pieces + ["cpu_moe.c"] if (k := len((kdir / n).read_text().splitlines())) > 800}
    assert long == {}
    for n in pieces + ["cpu_moe.c"]:
        (tmp_path / n).write_bytes((kdir / n).read_bytes())
    assert cpu_build.source(tmp_path / "cpu_moe.c") == src
    last = tmp_path / "cpu_batch.h"                   # included last, by the main unit
    last.write_bytes(last.read_bytes() + b"\n#error the last line of a piece\n")
    edited = cpu_build.source(tmp_path / "cpu_moe.c")
    assert edited != src
    r = subprocess.run(["gcc", "-fsyntax-only", "-x", "c", "-"], input=edited, capture_output=True, timeout=120,
                       check=False)
    n = len(last.read_text().splitlines())
    assert f"cpu_batch.h:{n}:" in r.stderr.decode(), r.stderr.decode()[-500:]


def test_cpu_stream_rate_tells_a_decoding_bound_type():
    """The decode share's probe of the CPU kernel on one token (experts.cpu_stream_rate): a positive rate in the
    type's own bytes, measured once per types and shapes; IQ2_KT's kernel, bound by its trellis decoding, reads
    its bytes at well under Q4_0's rate (0.24-0.34 of it a core: docs/cpu-kernels.md)."""
    from types import SimpleNamespace

    from hybridmoe.quant.random_blocks import random_tensor
    from hybridmoe.runtime import experts as X
    rates = {}
    gen = torch.Generator().manual_seed(5)
    for q in (G.Q4_0, G.IQ2_KT):
        g, u, d = (SimpleNamespace(raw=random_tensor(q, shape, gen), qtype=q)
                   for shape in ((32, 768, 2048), (32, 768, 2048), (32, 2048, 768)))
        rates[q] = X.cpu_stream_rate([(g, u, d)], 4, n_threads=1, nbytes=24 * 2**20)
        assert rates[q] > 0 and X.cpu_stream_rate([(g, u, d)], 4, n_threads=1) == rates[q]   # once a process
    assert rates[G.IQ2_KT] < 0.8 * rates[G.Q4_0]
