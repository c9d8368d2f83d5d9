"""The CPU kernels of the types added for users' files (issue 24): IQ4_XS, Q3_K, Q2_K, ik's IQ*_K / _KS / _KL and
the grid i-quants (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ1_S, IQ1_M), on every vector path
this CPU has (AVX-512 with the integer path, AVX2, portable C), against the reference dequantizers
(quant/dequant.py, bit-exact with ik_llama.cpp) and a float64 product.

Bands as tests/test_cpu_kernels.py: fp32 path 2e-5, integer path 2e-4 with two-term int8 activations and 3e-2
for the types that take one (cpu.act_terms), bf16 tiles / GEMM 1.5e-2.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import rel_l2

from hybridmoe.kernels import cpu, cpu_build
from hybridmoe.quant.dequant import dequantize
from hybridmoe.quant.random_blocks import random_blocks
from hybridmoe.quant.types import GGMLType as G
from hybridmoe.quant.types import row_bytes

NEW = [G.IQ4_XS, G.Q3_K, G.Q2_K, G.IQ4_KS, G.IQ4_K, G.IQ3_K, G.IQ2_K, G.IQ5_K, G.IQ2_KS, G.IQ2_KL, G.IQ3_XXS,
       G.IQ3_S, G.IQ2_XXS, G.IQ2_XS, G.IQ1_S, G.IQ1_M, G.IQ2_KT, G.IQ3_KT, G.IQ4_KT]
# the CI suite runs these; the rest are marked slow (-m "not gpu" without slow skips them)
FAST = {G.IQ4_XS, G.Q2_K, G.IQ4_KS}
BAND = {"fp32": 2e-5, "int": 2e-4, "int1": 3e-2, "tile": 1.5e-2}
VECTORS = Path("/work/shared/testdata/quant-vectors")

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the CPU kernels")
ids_ = dict(ids=lambda v: getattr(v, "name", str(v)))


def rows(q, shape, g):
    """Random valid rows of q shaped [*shape[:-1], row_bytes]."""
    *lead, K = shape
    n = int(np.prod(lead)) if lead else 1
    return random_blocks(q, n, K, g).reshape(*lead, row_bytes(q, K))


@pytest.fixture(params=["best", "avx2", "generic"])
def simd(request):
    """Each vector path this build has (set_simd lowers it), the best one set again afterwards."""
    prev = cpu.set_simd(None if request.param == "best" else request.param)
    try:
        if request.param != "best" and cpu.simd().split("-")[0] != request.param:
            pytest.skip(f"this build has no {request.param} path")
        yield cpu.simd()
    finally:
        cpu.set_simd(prev)


def sweep(types):
    """types as parameters, those outside FAST marked slow"""
    return [q if q in FAST else pytest.param(q, marks=pytest.mark.slow, id=q.name) for q in types]


def band(q):
    return (BAND["int1"] if cpu.act_terms(q) == 1 else BAND["int"]) if cpu.int8_path(q) else BAND["fp32"]


@pytest.mark.parametrize("q", NEW, **ids_)
def test_dequant_is_bit_exact(q, simd):
    g = torch.Generator().manual_seed(int(q))
    w = rows(q, (19, 1024), g)
    ref = dequantize(w, q, 1024)
    assert torch.equal(cpu.dequant(w, q, 1024, torch.float32), ref)
    assert torch.equal(cpu.dequant(w, q, 1024, torch.bfloat16), ref.to(torch.bfloat16))


@pytest.mark.parametrize("q", NEW, **ids_)
def test_ik_llama_vectors(q):
    """Rows that ik_llama.cpp's quantizer wrote, dequantized by the kernels: ggml's floats, bit for bit."""
    f = VECTORS / f"{q.name}.npz"
    if not f.exists():
        pytest.skip(f"no test vectors at {f}")
    z = np.load(f)
    rb = row_bytes(q, 256)
    for i in (0, 1):
        # the vectors hold 16 rows without their headers (MANIFEST's row_bytes): whole rows are fewer there
        raw = z[f"raw{i}"]
        n = len(raw) // rb
        rows_ = torch.from_numpy(raw[:n * rb].copy()).reshape(n, rb)
        assert torch.equal(cpu.dequant(rows_, q, 256, torch.float32), torch.from_numpy(z[f"deq{i}"][:n])), q.name


@pytest.mark.parametrize("q", NEW, **ids_)
@pytest.mark.parametrize("T", [1, 2, 7])
def test_qmatmul(q, T, simd):
    K, N = 768, 37
    g = torch.Generator().manual_seed(100 + T)
    w, x = rows(q, (N, K), g), torch.randn(T, K, generator=g)
    ref = x.double() @ dequantize(w, q, K, torch.float64).T
    assert rel_l2(cpu.qmatmul(x, w, q, K, impl="kernel"), ref) < band(q)


def experts(q, E, H, F, g):
    return rows(q, (E, F, H), g), rows(q, (E, F, H), g), rows(q, (E, H, F), g)


@pytest.mark.parametrize("q,dq", [(G.IQ4_XS, G.IQ4_XS), (G.Q3_K, G.Q2_K), (G.Q2_K, G.Q3_K), (G.Q3_K, G.Q6_K)],
                         **ids_)
@pytest.mark.parametrize("T", [1, 7])
def test_moe_ffn(q, dq, T, simd):
    """Gate/up and down of different types, tokens sharing experts, a skipped slot."""
    E, H, F = 8, 512, 256
    g = torch.Generator().manual_seed(T)
    gate, up, down = experts(q, E, H, F, g)
    down = experts(dq, E, H, F, g)[2]
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, 4, generator=g)
    ids[0, 1] = -1
    ref = cpu.reference_moe_ffn(x, ids, w, gate, up, down, q, dq, torch.float64)
    out = cpu.moe_ffn(x, ids, w, gate, up, down, q, dq, impl="kernel")
    assert rel_l2(out, ref) < max(band(q), band(dq))


@pytest.mark.parametrize("q", sweep([G.IQ4_XS, G.Q3_K, G.Q2_K, G.IQ4_KS, G.IQ5_K]), **ids_)
def test_large_batches(q):
    """The large-batch paths (bf16 tiles, dequantize + GEMM, or the canonical products), one type of each
    layout (nibbles, crumbs with a bit plane, crumbs with mins, a row header, 5 bits)."""
    E, H, F, T = 8, 512, 256, 64
    g = torch.Generator().manual_seed(3)
    gate, up, down = experts(q, E, H, F, g)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, 4, generator=g)
    ref = cpu.reference_moe_ffn(x, ids, w, gate, up, down, q, q, torch.float64)
    for impl in ("tile", "gemm", None):
        assert rel_l2(cpu.moe_ffn(x, ids, w, gate, up, down, q, q, impl=impl), ref) < BAND["tile"], impl
    wq = rows(q, (96, H), g)
    ref = x.double() @ dequantize(wq, q, H, torch.float64).T
    for impl in ("tile", "gemm", None):
        assert rel_l2(cpu.qmatmul(x, wq, q, H, impl=impl), ref) < BAND["tile"], impl


@pytest.mark.parametrize("q", sweep(NEW), **ids_)
def test_any_batch_gives_the_same_bits(q):
    """Where the canonical integer products run (AVX-512 VNNI): 40 tokens, 7 at a time and one at a time give
    the same bits as the scalar reference of the canonical form; moe_ffn likewise for 80 tokens split 33 + 47."""
    if not cpu.canonical(q):
        pytest.skip(f"{q.name} rows are not computed alike at every batch size on this CPU ({cpu.simd()})")
    K = 512
    g = torch.Generator().manual_seed(int(q))
    w, x = rows(q, (96, K), g), torch.randn(40, K, generator=g)
    full = cpu.qmatmul(x, w, q, K)
    assert torch.equal(full, torch.cat([cpu.qmatmul(x[i:i + 7], w, q, K) for i in range(0, 40, 7)]))
    assert torch.equal(full, torch.cat([cpu.qmatmul(x[i:i + 1], w, q, K) for i in range(40)]))
    ref = torch.empty(40, 96)
    assert cpu._load().hm_qdot_ref(x.data_ptr(), 40, K, w.data_ptr(), int(q), 96, ref.data_ptr()) == 0
    assert torch.equal(full, ref)
    E, H, F, T = 8, 512, 256, 80
    gate, up, down = experts(q, E, H, F, g)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(T)]).to(torch.int32)
    wt = torch.rand(T, 4, generator=g)
    full = cpu.moe_ffn(x, ids, wt, gate, up, down, q, q)
    parts = [cpu.moe_ffn(x[a:b], ids[a:b], wt[a:b], gate, up, down, q, q) for a, b in ((0, 33), (33, 80))]
    assert torch.equal(full, torch.cat(parts))
    assert rel_l2(full, cpu.reference_moe_ffn(x, ids, wt, gate, up, down, q, q, torch.float64)) < band(q)


def test_activation_terms_follow_the_weight_type():
    """The integer path's activations take the count of int8 terms of the weight type that reads them
    (cpu.act_terms): one for Q3_K, whose own quantization error on a layer is ~25x the one-term error, two for Q6_K
    (3x). A type's rows give what forcing its count gives (set_act_terms, HYBRIDMOE_CPU_ACT_TERMS), and not
    what the other count gives, at 1 and (where the products are canonical) 40 tokens; moe_ffn with Q3_K gate/up and a Q6_K down quantizes x with
    one term and h with two (its result moves when either count is forced to the other)."""
    if not (cpu.int8_path(G.Q3_K) and cpu.int8_path(G.Q6_K)):
        pytest.skip(f"no integer path for Q3_K and Q6_K on this CPU ({cpu.simd()})")
    assert cpu.set_act_terms() == 0 and (cpu.act_terms(G.Q3_K), cpu.act_terms(G.Q6_K)) == (1, 2)
    K, g = 512, torch.Generator().manual_seed(11)

    def forced(n, f):
        prev = cpu.set_act_terms(n)
        try:
            return f()
        finally:
            cpu.set_act_terms(prev)

    for q, n in ((G.Q3_K, 1), (G.Q6_K, 2)):
        w = rows(q, (64, K), g)
        for T in (1, 40) if cpu.canonical(q) else (1,):     # elsewhere rows of several tokens keep fp32
            x = torch.randn(T, K, generator=g)
            rule = cpu.qmatmul(x, w, q, K)
            assert torch.equal(rule, forced(n, lambda: cpu.qmatmul(x, w, q, K))), (q.name, T)
            assert not torch.equal(rule, forced(3 - n, lambda: cpu.qmatmul(x, w, q, K))), (q.name, T)
    assert forced(2, lambda: cpu.act_terms(G.Q3_K)) == 2 and forced(1, lambda: cpu.act_terms(G.Q6_K)) == 1
    E, H, F = 8, 512, 256
    gate, up = rows(G.Q3_K, (E, F, H), g), rows(G.Q3_K, (E, F, H), g)
    down = rows(G.Q6_K, (E, H, F), g)
    x = torch.randn(1, H, generator=g)
    ids, w = torch.randperm(E, generator=g)[:4].to(torch.int32)[None], torch.rand(1, 4, generator=g)
    run = lambda: cpu.moe_ffn(x, ids, w, gate, up, down, G.Q3_K, G.Q6_K, impl="kernel")   # noqa: E731
    rule = run()
    assert not torch.equal(rule, forced(1, run)) and not torch.equal(rule, forced(2, run))
    ref = cpu.reference_moe_ffn(x, ids, w, gate, up, down, G.Q3_K, G.Q6_K, torch.float64)
    assert rel_l2(rule, ref) < BAND["int1"]


@pytest.mark.parametrize("q", [G.IQ4_KS, G.Q2_K], **ids_)
def test_tile_passes_with_row_headers(q):
    """Rows longer than one tile pass (2048): the passes past the first start mid-row, after IQ4_KS's header."""
    g = torch.Generator().manual_seed(4)
    w, x = rows(q, (64, 2304), g), torch.randn(40, 2304, generator=g)
    ref = x.double() @ dequantize(w, q, 2304, torch.float64).T
    prev = cpu.set_exact(False)                  # the bf16 tiles, not the canonical products
    try:
        assert rel_l2(cpu.qmatmul(x, w, q, 2304, impl="tile"), ref) < BAND["tile"]
    finally:
        cpu.set_exact(prev)


@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_interleaved_rows_repack_to_their_base_type(every):
    """_R4 / _R8 rows whose base type has kernels are repacked (hm_deinterleave) exactly as the reference
    deinterleaves them; the kernels then read them as the base type."""
    from hybridmoe.quant.dequant import SUPPORTED, deinterleave
    g = torch.Generator().manual_seed(9)
    done = []
    for q in SUPPORTED:
        base = cpu.kernel_type(q)
        if base is None or base == q or not (every or q.name in ("IQ4_KS_R4", "IQ4_K_R4", "IQ4_XS_R8", "Q3_K_R4")):
            continue
        w = random_blocks(q, 16, 512, g)
        got, gt = cpu.plain_rows(w, q, 512)
        ref, rt = deinterleave(w, q, 512)
        assert gt == rt and torch.equal(got, ref), q.name
        done.append(q.name)
    assert {"IQ4_KS_R4", "IQ4_K_R4", "IQ4_XS_R8", "Q3_K_R4"} <= set(done)


def test_ik_files_have_no_slow_tensors():
    """ik_llama.cpp's files of these types (IQ4_K_R4 repacked at load) leave nothing on the slow path, and an
    all-CPU model of each matches its file's reference dequantization (tests/quant/test_quant_files.py runs
    every placement)."""
    import hybridmoe
    files = VECTORS / "files"
    if not files.exists():
        pytest.skip(f"no ik_llama.cpp files at {files}")
    for name in ("IQ4_KS", "IQ4_K_R4", "Q3_K", "Q2_K", "IQ4_XS", "IQ2_KL", "IQ3_XXS", "IQ2_KT"):
        m = hybridmoe.load(str(files / f"q-{name}.gguf"), ctx_size=64)
        assert m.slow_tensors() == {}, name


def test_grids_are_ggmls():
    """cpu_grids.h holds ggml's grids (the gguf package's, which the reference dequantizers read), every entry: the
    kernel tests' random blocks reach only some of IQ1_S's 2048."""
    from gguf import quants
    text = cpu_build.SRC.with_name("cpu_grids.h").read_text()
    for name, q, width, as_u in (("IQ3XXS_GRID", "IQ3_XXS", 4, 1), ("IQ3S_GRID", "IQ3_S", 4, 1),
                                 ("IQ2XXS_GRID", "IQ2_XXS", 8, 1), ("IQ2XS_GRID", "IQ2_XS", 8, 1),
                                 ("IQ1S_GRID", "IQ1_S", 8, 8)):
        body = re.search(name + r"\[\d+\][^{]*\{(.*?)\};", text, re.DOTALL).group(1)
        got = np.array([[(int(v, 16) >> 8 * j) & 0xFF for j in range(width)] for v in re.findall(r"0x[0-9a-f]+", body)])
        cls = getattr(quants, q)
        cls.init_grid()
        ref = cls.grid.reshape(cls.grid_shape).astype(np.int64)
        assert np.array_equal(got, ref if as_u == 1 else 64 + 8 * ref), name
