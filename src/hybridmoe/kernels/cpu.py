"""CPU expert kernels: one grouped call per MoE layer, weights in GGUF blocks in host RAM.

`moe_ffn` and `qmatmul` run the C kernel in cpu_moe.c and its pieces cpu_*.h (built at first use by cpu_build with
`-O3 -march=native -fopenmp`, loaded through ctypes) for small batches, where the work is bound
by RAM bandwidth, and a dequantize-to-bf16 + torch.mm path for large batches, where it is bound
by matmul throughput (oneDNN; AMX on Sapphire Rapids). Without a compiler (or with
HYBRIDMOE_CPU_KERNELS=torch) everything falls back to the plain torch reference, with one
warning. See docs/cpu-kernels.md for the design and measurements.
"""
from __future__ import annotations

import ctypes
import functools
import threading

import torch
import torch.nn.functional as Fn

from .. import env
from ..errors import HybridMoeError, warn
from ..quant import ref_interleaved
from ..quant.dequant import DEINTERLEAVE, dequantize, deinterleave
from ..quant.types import GGMLType, row_bytes
from .cpu_build import build, cpu_flags

# Types the C kernel handles (ggml ids); others go to the torch reference.
KERNEL_TYPES = frozenset(int(t) for t in (
    GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K,
    GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_NL, GGMLType.MXFP4, GGMLType.IQ4_XS, GGMLType.Q3_K,
    GGMLType.Q2_K, GGMLType.IQ4_KS, GGMLType.IQ4_K, GGMLType.IQ3_K, GGMLType.IQ2_K, GGMLType.IQ5_K, GGMLType.IQ2_KS,
    GGMLType.IQ2_KL, GGMLType.IQ3_XXS, GGMLType.IQ3_S, GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ1_S,
    GGMLType.IQ1_M, GGMLType.IQ2_KT, GGMLType.IQ3_KT, GGMLType.IQ4_KT))


def kernel_type(qtype) -> GGMLType | None:
    """The type whose kernels compute rows of `qtype` on the CPU: itself where the C kernels read it, the base
    type of an _R4 / _R8 type whose base they read (plain_rows repacks it at load), else None (the reference
    dequantizer: slow)."""
    q = GGMLType(qtype)
    if int(q) in KERNEL_TYPES:
        return q
    base = DEINTERLEAVE.get(q)
    return base[0] if base and int(base[0]) in KERNEL_TYPES else None


def kernel_names() -> str:
    """The types the CPU kernels read, for messages."""
    return ", ".join(GGMLType(t).name for t in sorted(KERNEL_TYPES)) + " (and their _R4 / _R8 forms)"


def plain_rows(raw: torch.Tensor, qtype, n_cols: int, n_threads=None) -> tuple[torch.Tensor, GGMLType]:
    """Rows [..., row_bytes] of an _R4 / _R8 type whose base type has CPU kernels, repacked into the base type's
    rows (new memory; the inverse of ik_llama.cpp's -rtr), and that type; other tensors as they are."""
    q = GGMLType(qtype)
    base = kernel_type(q)
    if base is None or base == q:
        return raw, q
    lay = ref_interleaved.LAYOUTS[q.name]
    lib = _load()
    if lib is None or lay.to_base or q.name in ref_interleaved.RECODE:
        return deinterleave(raw, q, n_cols)
    flat = raw.contiguous().view(-1, raw.shape[-1])
    if flat.dtype != torch.uint8 or flat.shape[0] % lay.rows or flat.shape[1] != row_bytes(q, n_cols):
        raise ValueError(f"{q.name}: expected uint8 [k * {lay.rows}, {row_bytes(q, n_cols)}], got {tuple(raw.shape)}")
    cj, cs, seg = _repack_tables(q.name)
    out = torch.empty(raw.shape[:-1] + (row_bytes(base, n_cols),), dtype=torch.uint8)
    rc = lib.hm_deinterleave(flat.data_ptr(), out.data_ptr(), flat.shape[0] // lay.rows, lay.rows,
                             n_cols // lay.block, lay.bb, lay.hdr, cj.data_ptr(), cs.data_ptr(), cj.numel(),
                             seg.data_ptr(), seg.shape[0], _threads(n_threads))
    if rc:
        raise MemoryError(f"repacking {q.name} rows failed ({rc})")
    return out, base


@functools.lru_cache(maxsize=None)
def _repack_tables(name: str):
    """ref_interleaved's gather tables of `name`, the bit gathers merged into runs: (cj, cs, seg [n, 5]) for
    hm_deinterleave (a nibble moved is one run, not four bits)."""
    cj, cs, bj, bsrc, bsh = (t.tolist() for t in ref_interleaved._perm(name, "cpu"))
    seg = []
    for d, srcs, shs in zip(bj, bsrc, bsh):
        t = 0
        while t < 8:
            n = 1
            while t + n < 8 and srcs[t + n] == srcs[t] and shs[t + n] == shs[t] + n:
                n += 1
            seg.append((d, srcs[t], shs[t], (1 << n) - 1, t))
            t += n
    return (torch.tensor(cj, dtype=torch.int64), torch.tensor(cs, dtype=torch.int64),
            torch.tensor(seg, dtype=torch.int64).view(-1, 5))


# Batch sizes from which the large-batch path beats the streaming kernel, measured
# (docs/cpu-kernels.md): the grouped tile kernel from ~T=64 with AMX (16-core Sapphire Rapids) and from
# ~T=128-192 with AVX512-BF16 (2-core Zen 5 VM); dequantize + torch.mm (CPUs without either) ~T=224;
# dense qmatmul ~T=8-16. Override with HYBRIDMOE_CPU_GEMM_MIN_T / HYBRIDMOE_CPU_QMM_MIN_T.
_FLAGS = cpu_flags().split()
GEMM_MIN_T = env.get_int("HYBRIDMOE_CPU_GEMM_MIN_T",
                         64 if "amx_bf16" in _FLAGS else 160 if "avx512_bf16" in _FLAGS else 224)
QMM_GEMM_MIN_T = env.get_int("HYBRIDMOE_CPU_QMM_MIN_T")
# qmatmul from QMM_GEMM_MIN_T tokens to below this runs the tile products (where AMX or AVX512-BF16 runs them);
# from here on dequantize + torch.mm. Measured on the 2-vCPU dev VM (AMX), K=2048/4096, N=5120/2048, Q8_0
# and Q4_0: tile 2.6-3.2x faster at 12-64 tokens, 1.1-1.9x at 128-256, 0.75-0.97x at 512 (docs/cpu-kernels.md)
QMM_TILE_MAX_T = env.get_int("HYBRIDMOE_CPU_QMM_TILE_MAX_T")

_lock = threading.Lock()
_lib = None          # the loaded CDLL, or False after a failed build
_moe = _qmm = _deq = None
_rb_cache: dict = {}


# ----------------------------------------------------------------- load

def _load():
    """The kernel library, built once per process (thread-safe); None if unavailable."""
    global _lib, _moe, _qmm, _deq
    if _lib is not None:
        return _lib or None
    with _lock:
        if _lib is not None:
            return _lib or None
        if env.get("HYBRIDMOE_CPU_KERNELS").lower() in ("torch", "0", "off", "ref"):
            _lib = False
            return None
        try:
            lib = ctypes.CDLL(str(build()))
        except Exception as e:  # noqa: BLE001 - any build/load problem means: use the fallback
            warn(f"CPU expert kernel unavailable ({e}); using the slow torch reference path")
            _lib = False
            return None
        vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.hm_moe_ffn.argtypes = [vp, i64, i64, vp, vp, i64, vp, vp, i32, i64, i64, vp, i32, vp, i32]
        lib.hm_qmatmul.argtypes = [vp, i64, i64, vp, i32, i64, vp, i32]
        lib.hm_tile_mm.argtypes = lib.hm_qmatmul.argtypes
        lib.hm_qdot_ref.argtypes = [vp, i64, i64, vp, i32, i64, vp]
        lib.hm_dequant.argtypes = [vp, vp, i32, i64, i64, vp, i64, i32, i32]
        lib.hm_set_simd.argtypes = [i32]
        lib.hm_dp256_test.argtypes = [vp, vp, i64, i32, vp]
        lib.hm_set_int8.argtypes = [vp, i32]
        lib.hm_int8_type.argtypes = [i32]
        lib.hm_silu_mul_bf16.argtypes = [vp, i64, i64, vp, i32]
        lib.hm_combine_bf16.argtypes = [vp, vp, vp, i64, i64, i64, vp, i32]
        lib.hm_moe_tile.argtypes = lib.hm_moe_ffn.argtypes
        lib.hm_moe_oai.argtypes = lib.hm_moe_ffn.argtypes + [vp, vp, vp, ctypes.c_float, ctypes.c_float, i32]
        lib.hm_tile_mode.argtypes = [i32]
        lib.hm_set_act_terms.argtypes = [i32]
        lib.hm_set_exact.argtypes = [i32]
        lib.hm_trace.argtypes, lib.hm_trace_get.argtypes = [i32], [vp]
        lib.hm_moe_handoff.argtypes = [vp, vp, ctypes.c_double, vp, i64, i64, i64, vp, vp, i32, i64, i64, vp, i32,
                                       vp, i32, i32]
        lib.hm_moe_handoff_oai.argtypes = lib.hm_moe_handoff.argtypes[:-1] + [vp, vp, vp, ctypes.c_float,
                                                                              ctypes.c_float, i32]
        lib.hm_moe_handoff_rows.argtypes = [vp, vp, ctypes.c_double, vp, i64, i64, i64, i64, vp, vp, i32, i64, i64,
                                            vp, i32, vp, i32, i32]
        lib.hm_moe_handoff_rows_oai.argtypes = lib.hm_moe_handoff_rows.argtypes[:-1] + [
            vp, vp, vp, ctypes.c_float, ctypes.c_float, i32]
        lib.hm_deinterleave.argtypes = [vp, vp, i64, i32, i64, i32, i32, vp, vp, i64, vp, i64, i32]
        lib.hm_simd.restype = ctypes.c_char_p
        for f in (lib.hm_moe_ffn, lib.hm_moe_tile, lib.hm_moe_oai, lib.hm_moe_handoff, lib.hm_moe_handoff_oai,
                  lib.hm_moe_handoff_rows, lib.hm_moe_handoff_rows_oai,
                  lib.hm_tile_mode,
                  lib.hm_qmatmul, lib.hm_tile_mm, lib.hm_dequant, lib.hm_set_simd, lib.hm_set_int8,
                  lib.hm_int8_type, lib.hm_qdot_ref, lib.hm_dp256_test, lib.hm_set_act_terms, lib.hm_act_terms,
                  lib.hm_set_exact, lib.hm_deinterleave):
            f.restype = i32
        lib.hm_set_exact(0 if env.get("HYBRIDMOE_CPU_PROMPT").lower() == "bf16" else 1)
        lib.hm_set_act_terms(_act_terms_env())
        _moe, _qmm, _deq = lib.hm_moe_ffn, lib.hm_qmatmul, lib.hm_dequant
        _lib = lib
        return lib


def _act_terms_env() -> int:
    """HYBRIDMOE_CPU_ACT_TERMS as hm_set_act_terms takes it: 0 (unset: the per-type rule), 1 or 2."""
    v = env.get("HYBRIDMOE_CPU_ACT_TERMS").strip()
    if v not in ("", "1", "2"):
        warn(f"HYBRIDMOE_CPU_ACT_TERMS={v!r} is not 1 or 2: the per-type rule stays")
        return 0
    return int(v or 0)


def available() -> bool:
    """True when the C kernel is built and loaded (else the torch fallback runs)."""
    return _load() is not None


def simd() -> str:
    """The vector kernels in use: 'avx512-vnni', 'avx2-vnni' or 'avx2-int8' (with the integer path; the last
    without AVX-VNNI: vpmaddubsw), 'avx512', 'generic' (portable C), or 'torch' when the kernel is unavailable."""
    lib = _load()
    return lib.hm_simd().decode() if lib else "torch"


def dp256_test(u: torch.Tensor, s: torch.Tensor, big: bool) -> torch.Tensor | None:
    """Tests: the int32 sums of each 4 products u.s (u uint8, s int8, lengths a multiple of 32) by the AVX2
    integer path's vpmaddubsw form (BIG: u above 128 too); None without the kernel or AVX2."""
    lib = _load()
    out = torch.empty(u.numel() // 4, dtype=torch.int32)
    if not lib or lib.hm_dp256_test(u.data_ptr(), s.data_ptr(), u.numel(), int(big), out.data_ptr()) != 0:
        return None
    return out


_SIMD_LEVELS = {"generic": 0, "avx2": 1, "avx2-vnni": 1, "avx2-int8": 1, "avx512": 2, "avx512-vnni": 2}


def set_simd(name: str | None) -> str:
    """Use a lower vector path than this CPU's best ('avx2' or 'generic'; None: the best), for tests and
    benchmarks of what CPUs without AVX-512 run. A path the build lacks gives the best it has. Returns
    the previous path's name, to pass back."""
    prev = simd()
    lib = _load()
    if lib:
        lib.hm_set_simd(_SIMD_LEVELS[name] if name else -1)
    return prev


_TILE_NAMES = {1: "c", 2: "avx512-bf16", 3: "amx"}


def tile_mode(mode: str | None = None) -> str:
    """The tile products of the grouped large-batch kernel (`impl="tile"`): 'amx', 'avx512-bf16', or 'c'
    (portable and slow: large batches then take dequantize + torch.mm instead); 'torch' without the
    kernel. `mode` forces one of them (tests, benchmarks; one the CPU lacks is ignored). Returns the
    mode in use."""
    lib = _load()
    if lib is None:
        return "torch"
    code = {v: k for k, v in _TILE_NAMES.items()}.get(mode, -1) if mode else -1
    return _TILE_NAMES[lib.hm_tile_mode(code)]


def _large_impl() -> str:
    return "tile" if tile_mode() in ("amx", "avx512-bf16") else "gemm"


_FLOAT_TYPES = frozenset(int(t) for t in (GGMLType.F32, GGMLType.F16, GGMLType.BF16))


def canonical(qtype) -> bool:
    """Whether every batch size computes rows of `qtype` bit for bit alike (docs/cpu-kernels.md, "prompts as
    precise as decode"): float weights where the AVX-512 kernels run (the AVX2 and portable fp32 kernels sum
    one token's row and a batch's rows in different orders: equal to fp32 rounding, not bit for bit), and
    types on the integer path where the AVX-512 VNNI kernels run (the canonical integer products; int8 AMX
    tiles for many tokens)."""
    q = int(qtype)
    return _exact_path(q) and (q not in _FLOAT_TYPES or simd().startswith("avx512"))


def _exact_path(q: int) -> bool:
    """Whether large batches of q keep single tokens' precision: float weights (fp32 products on every vector
    path) and the canonical integer products; False with HYBRIDMOE_CPU_PROMPT=bf16 (set_exact(False))."""
    lib = _load()
    if not lib or not lib.hm_set_exact(-1):
        return False
    return q in _FLOAT_TYPES or (simd() == "avx512-vnni" and int8_path(q))


def set_exact(on: bool) -> bool:
    """Large batches exact (the default: as single tokens compute them, split-invariant) or on the earlier bf16
    tile paths (HYBRIDMOE_CPU_PROMPT=bf16). Returns the previous setting."""
    lib = _load()
    return bool(lib.hm_set_exact(int(bool(on)))) if lib else False


def _impl_for(q: int, T: int, min_t: int, rows_ok: bool = True) -> str:
    """The path for T tokens of weight type q (impl=None): the streaming kernel below min_t tokens; above,
    float weights keep it (fp32 products, as precise as the weights), canonical types take the int8 AMX
    tiles where this CPU has them (else the streaming kernel, the same values), others the bf16 large-batch
    path."""
    if T < min_t:
        return "kernel"
    if not _exact_path(q):
        return _large_impl()
    if q in _FLOAT_TYPES:
        return "kernel"
    return "tile" if tile_mode() == "amx" and rows_ok else "kernel"


_int8_setting = True


def set_int8(types=True):
    """Which types run single-token rows on the integer (VNNI) path: True = the measured default of the
    path in use (AVX-512 VNNI: every quantized type; the 256-bit paths: Q4_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL,
    Q2_K, Q3_K, IQ4_XS and the grid types IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ1_S, IQ1_M), False = none
    (fp32 activations everywhere), or an iterable of types. Returns the previous setting, to pass back."""
    global _int8_setting
    lib = _load()
    prev = _int8_setting
    if lib:
        if types is True:
            lib.hm_set_int8(None, -1)
        else:
            ids = [int(t) for t in (types or ())]
            arr = (ctypes.c_int * max(1, len(ids)))(*ids)
            lib.hm_set_int8(arr, len(ids))
    _int8_setting = types
    return prev


def set_act_terms(n: int | None = None) -> int | None:
    """The integer path's activations: 0 the per-type rule (the default; docs/cpu-kernels.md, "Activation terms
    per weight type": one int8 term for the types whose own quantization error dwarfs it, two elsewhere), or 1
    (plain int8, as ggml's q8_0) or 2 (two terms, about 15 bits) for every type. Every batch size follows the
    setting alike, so prompts stay split-invariant either way. None: no change. Returns the previous setting
    (None without the C kernels)."""
    if n is not None and n not in (0, 1, 2):
        raise HybridMoeError(f"set_act_terms({n!r}): give 0 (the per-type rule), 1 or 2")
    lib = _load()
    return lib.hm_set_act_terms(-1 if n is None else int(n)) if lib else None


def act_terms(qtype) -> int:
    """The int8 terms the activations of `qtype` rows take on the integer path now (1 or 2; the rule or the
    forced setting). Only meaningful where int8_path(qtype) holds."""
    lib = _load()
    return lib.hm_act_terms(int(qtype)) if lib else 2


def int8_path(qtype) -> bool:
    """Whether rows of `qtype` used by a single token run on the integer path now (by this CPU, the vector
    path in use and set_int8): their results carry its ~3e-5 rounding."""
    lib = _load()
    return bool(lib and lib.hm_int8_type(int(qtype)))


def trace(on: bool = True) -> None:
    """Profiling: the streaming MoE kernel stamps each thread's phases per call (see last_trace)."""
    lib = _load()
    if lib:
        lib.hm_trace(int(on))


def last_trace() -> torch.Tensor:
    """The last streaming `moe_ffn` call's per-thread stamps while trace() is on: float64 [threads, 4] =
    entered the parallel region, finished stage 1 (gate/up), left the barrier, finished stage 2 (down),
    in seconds of CLOCK_MONOTONIC (the clock of time.perf_counter on Linux)."""
    lib = _load()
    if not lib:
        return torch.zeros(0, 4, dtype=torch.float64)
    buf = torch.zeros(256, 4, dtype=torch.float64)
    return buf[:lib.hm_trace_get(buf.data_ptr())].clone()


def _rb(qtype: int, n: int) -> int:
    key = (qtype, n)
    v = _rb_cache.get(key)
    if v is None:
        v = _rb_cache[key] = row_bytes(GGMLType(qtype), n)
    return v


def _experts_ok(gate_raw, up_raw, down_raw, gq: int, dq: int, H: int) -> bool:
    """A layer's experts as the C kernels take them: contiguous uint8 GGUF rows, gate and up [E, F,
    row_bytes(gq, H)], down [E, H, row_bytes(dq, F)]."""
    E, F = gate_raw.shape[0], gate_raw.shape[1]
    return (gate_raw.shape == up_raw.shape and gate_raw.shape[2] == _rb(gq, H)
            and tuple(down_raw.shape) == (E, H, _rb(dq, F))
            and all(t.dtype is torch.uint8 and t.is_contiguous() for t in (gate_raw, up_raw, down_raw)))


def _threads(n_threads):
    return n_threads if n_threads else torch.get_num_threads()


# ----------------------------------------------------------------- references

def swiglu_oai(g, u, alpha: float, limit: float):
    """gpt-oss's expert activation: gate clamped from above, up on both sides, g sigmoid(alpha g) (u + 1)."""
    g = g.clamp(max=limit)
    return g * torch.sigmoid(alpha * g) * (u.clamp(-limit, limit) + 1)


def reference_moe_ffn(x, ids, weights, gate_raw, up_raw, down_raw, gate_qtype, down_qtype,
                      dtype=torch.float32, out=None, oai=None) -> torch.Tensor:
    """Plain torch MoE FFN via dequantize, computed in `dtype` (float32 or float64).
    ids < 0 contribute nothing. Returns [T, H] in `dtype` (or writes `out`). oai = (bg, bu, bd, alpha,
    limit): gpt-oss's biased experts and clamped SwiGLU instead of silu(gate) * up."""
    T, H = x.shape
    F = gate_raw.shape[1]
    xd = x.to(dtype)
    res = torch.zeros(T, H, dtype=dtype)
    flat = ids.reshape(-1).long()
    wflat = weights.reshape(-1).to(dtype)
    k = ids.shape[1]
    for e in torch.unique(flat[flat >= 0]).tolist():
        pairs = (flat == e).nonzero().reshape(-1)
        tok = pairs // k
        g = dequantize(gate_raw[e], gate_qtype, H, dtype)
        u = dequantize(up_raw[e], gate_qtype, H, dtype)
        d = dequantize(down_raw[e], down_qtype, F, dtype)
        xe = xd[tok]
        if oai is None:
            y = (Fn.silu(xe @ g.T) * (xe @ u.T)) @ d.T
        else:
            bg, bu, bd, alpha, limit = oai
            h = swiglu_oai(xe @ g.T + bg[e].to(dtype), xe @ u.T + bu[e].to(dtype), alpha, limit)
            y = h @ d.T + bd[e].to(dtype)
        res.index_add_(0, tok, y * wflat[pairs, None])
    if out is not None:
        out.copy_(res)
        return out
    return res


def reference_qmatmul(x, w_raw, qtype, n_cols, dtype=torch.float32) -> torch.Tensor:
    """x [T, K] @ dequantize(W).T in `dtype`."""
    return x.to(dtype) @ dequantize(w_raw, qtype, n_cols, dtype).T


# ----------------------------------------------------------------- public API

def moe_ffn(x, ids, weights, gate_raw, up_raw, down_raw, gate_qtype, down_qtype,
            n_threads=None, out=None, impl=None, oai=None) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j].

    x: float32 [T, H]; ids: int32 [T, k] (int64 accepted; ids < 0 are skipped); weights:
    float32 [T, k]; gate_raw, up_raw: uint8 [E, F, row_bytes(gate_qtype, H)]; down_raw: uint8
    [E, H, row_bytes(down_qtype, F)], all contiguous CPU tensors (mmapped ones are fine: the
    weights are read in place, never copied). `out`: optional preallocated float32 [T, H].
    impl: None (by batch size), "kernel" (C streaming kernel), "tile" (C grouped bf16 tile GEMM: AMX or
    AVX512-BF16), "gemm" (dequantize to bf16 + torch.mm) or "torch" (reference, float32).
    oai = (bg, bu, bd, alpha, limit): gpt-oss's experts, with float32 biases bg, bu [E, F] and bd [E, H]
    and the clamped SwiGLU (the C kernels; "gemm" then runs the streaming kernel)."""
    lib = _lib if _lib else _load()
    T = x.shape[0]
    gq, dq = int(gate_qtype), int(down_qtype)
    if impl is None:
        a, b = _impl_for(gq, T, GEMM_MIN_T), _impl_for(dq, T, GEMM_MIN_T)
        impl = a if a == b else "kernel"
    if lib is None or impl == "torch" or gq not in KERNEL_TYPES or dq not in KERNEL_TYPES:
        return reference_moe_ffn(x, ids, weights, gate_raw, up_raw, down_raw, gate_qtype, down_qtype,
                                 torch.float32, out, oai)
    H = x.shape[1]
    E, F = gate_raw.shape[0], gate_raw.shape[1]
    if ids.dtype is not torch.int32:
        ids = ids.to(torch.int32)
    if weights.dtype is not torch.float32:
        weights = weights.float()
    ids, weights = ids.contiguous(), weights.contiguous()
    if x.dtype is not torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    if not _experts_ok(gate_raw, up_raw, down_raw, gq, dq, H) or ids.shape != weights.shape or ids.shape[0] != T:
        raise ValueError(
            f"moe_ffn: bad shapes: x {tuple(x.shape)}, ids {tuple(ids.shape)}, weights {tuple(weights.shape)}, "
            f"gate {tuple(gate_raw.shape)} {gate_raw.dtype}, up {tuple(up_raw.shape)}, down {tuple(down_raw.shape)} "
            f"{down_raw.dtype} (expected gate/up [E, F, {_rb(gq, H)}], down [E, {H}, {_rb(dq, F)}], contiguous uint8)")
    if out is None:
        out = torch.empty(T, H, dtype=torch.float32)
    args = (x.data_ptr(), T, H, ids.data_ptr(), weights.data_ptr(), ids.shape[1], gate_raw.data_ptr(),
            up_raw.data_ptr(), gq, F, E, down_raw.data_ptr(), dq, out.data_ptr(), n_threads or torch.get_num_threads())
    if oai is not None:
        bg, bu, bd, alpha, limit = oai
        bg, bu, bd = (b.float().contiguous() for b in (bg, bu, bd))
        if bg.shape != (E, F) or bu.shape != (E, F) or bd.shape != (E, H):
            raise ValueError(f"moe_ffn: biases {tuple(bg.shape)}, {tuple(bu.shape)}, {tuple(bd.shape)}; "
                             f"expected [{E}, {F}], [{E}, {F}], [{E}, {H}]")
        rc = lib.hm_moe_oai(*args, bg.data_ptr(), bu.data_ptr(), bd.data_ptr(), alpha, limit, int(impl == "tile"))
    elif impl == "gemm":
        return _moe_ffn_gemm(x, ids, weights, gate_raw, up_raw, down_raw, gq, dq, _threads(n_threads), out)
    else:
        rc = (lib.hm_moe_tile if impl == "tile" else _moe)(*args)
    if rc:
        raise ValueError(f"moe_ffn: kernel rejected the call (rc={rc}): an expert id >= E={E}, or "
                         f"H={H} / F={F} not a multiple of the block size of the types")
    return out


def _handoff_checked(what, gate_raw, up_raw, down_raw, gate_qtype, down_qtype, H: int, k: int, ok: bool,
                     more: str = ""):
    """(lib, gate type, down type, experts, F) for a hand-off call, or ValueError where the C kernel can't take
    these experts, k slots or the caller's buffers (ok)."""
    lib = _load()
    gq, dq = int(gate_qtype), int(down_qtype)
    if (lib is None or gq not in KERNEL_TYPES or dq not in KERNEL_TYPES
            or not _experts_ok(gate_raw, up_raw, down_raw, gq, dq, H) or not 1 <= k <= 64 or not ok):
        raise ValueError(f"{what}: no kernel for gate {tuple(gate_raw.shape)} {GGMLType(gq).name}, "
                         f"down {tuple(down_raw.shape)} {GGMLType(dq).name}, H={H}, k={k}{more}")
    return lib, gq, dq, gate_raw.shape[0], gate_raw.shape[1]


def _oai_ok(oai, gate_raw, H: int) -> bool:
    """gpt-oss's (bg, bu, bd, alpha, limit) as the C kernels take them (or None): float32 [E, F], [E, F], [E, H],
    contiguous, in host memory."""
    if oai is None:
        return True
    E, F = gate_raw.shape[:2] if gate_raw.dim() == 3 else (0, 0)
    return all(b.dtype == torch.float32 and b.is_contiguous() and b.device.type == "cpu" and tuple(b.shape) == s
               for b, s in zip(oai[:3], ((E, F), (E, F), (E, H))))


def handoff_call(gate_raw, up_raw, down_raw, gate_qtype, down_qtype, packed, out, ready, done,
                 n_threads=None, timeout_s: float = 30.0, n_cpu: int | None = None, oai=None):
    """One layer's side of the decode hand-off with a GPU (graphs.py), as a function of the step number.

    Calling it with `step` waits until ready[0] == step (the GPU has written one token's [x | router
    weights | expert ids as floats] to `packed`), runs the experts into `out` (as moe_ffn), then sets
    done[0] = step, also after an error, so that the GPU never waits forever. It returns 0, -1 for an id
    that is not an expert, or -3 when the GPU did not come within timeout_s. packed float32 [H + 2k] and
    out float32 [H] (pinned), ready and done int32 (pinned), all CPU tensors that outlive the function.
    n_cpu: run only the experts of the first n_cpu of the k slots (the GPU takes the others); default all.
    oai = (bg, bu, bd, alpha, limit): gpt-oss's experts, as moe_ffn takes them (the biases must outlive the
    function too)."""
    H = out.numel()
    k = (packed.numel() - H) // 2
    kc = k if n_cpu is None else int(n_cpu)
    ok = packed.numel() == H + 2 * k and 1 <= kc <= k and _oai_ok(oai, gate_raw, H)
    lib, gq, dq, E, F = _handoff_checked("handoff_call", gate_raw, up_raw, down_raw, gate_qtype, down_qtype, H, k,
                                         ok, "" if oai is None else ", with gpt-oss's float32 biases")
    args = (ready.data_ptr(), done.data_ptr(), timeout_s, packed.data_ptr(), H, k, kc, gate_raw.data_ptr(),
            up_raw.data_ptr(), gq, F, E, down_raw.data_ptr(), dq, out.data_ptr(), _threads(n_threads))
    if oai is None:
        return functools.partial(lib.hm_moe_handoff, *args)
    bg, bu, bd, alpha, limit = oai
    return functools.partial(lib.hm_moe_handoff_oai, *args, bg.data_ptr(), bu.data_ptr(), bd.data_ptr(),
                             float(alpha), float(limit))


def handoff_rows_call(gate_raw, up_raw, down_raw, gate_qtype, down_qtype, packed, out, ready, done,
                      n_threads=None, timeout_s: float = 30.0, oai=None):
    """handoff_call for a batch of rows: calling it with (step, T) waits until ready[0] == step, then runs the k
    experts of the first T rows of packed float32 [Tp, H + 2k] (pinned; an id of -1 is a pair the GPU runs itself,
    skipped here) into out float32 [Tp, H] (pinned; the rows after T become zeros), and sets done[0] = step, also
    after an error. Returns as handoff_call's. oai: gpt-oss's experts, as handoff_call's (held by the call)."""
    Tp, H = out.shape
    k = (packed.shape[1] - H) // 2
    ok = packed.shape == (Tp, H + 2 * k) and 1 <= Tp <= 64 and _oai_ok(oai, gate_raw, H)
    lib, gq, dq, E, F = _handoff_checked("handoff_rows_call", gate_raw, up_raw, down_raw, gate_qtype, down_qtype, H,
                                         k, ok, f", rows={Tp}" + ("" if oai is None else ", with gpt-oss's biases"))
    nth = _threads(n_threads)
    args = (ready.data_ptr(), done.data_ptr(), timeout_s, packed.data_ptr())
    tail = (H, k, gate_raw.data_ptr(), up_raw.data_ptr(), gq, F, E, down_raw.data_ptr(), dq, out.data_ptr(), nth)
    if oai is not None:
        bias = (*(b.data_ptr() for b in oai[:3]), float(oai[3]), float(oai[4]))

    def call(step: int, T: int) -> int:
        if oai is None:
            return lib.hm_moe_handoff_rows(*args, T, Tp, *tail, step)
        return lib.hm_moe_handoff_rows_oai(*args, T, Tp, *tail, *bias, step)
    return call


def qmatmul(x, w_raw, qtype, n_cols, n_threads=None, out=None, impl=None) -> torch.Tensor:
    """x float32 [T, K] @ W.T, W uint8 GGUF rows [N, row_bytes(qtype, K)] -> float32 [T, N].
    n_cols is K. impl as in moe_ffn: "kernel" (the streaming kernel, few tokens), "tile" (the grouped tile
    products, N % 32 == 0; the default for many tokens where AMX or AVX512-BF16 runs them), "gemm"
    (dequantize + torch.mm), "torch" (the reference)."""
    lib = _lib if _lib else _load()
    q = int(qtype)
    T, K = x.shape
    if K != n_cols:
        raise ValueError(f"qmatmul: x has {K} columns, the weight rows {n_cols}")
    if impl is None:
        if _exact_path(q):
            impl = _impl_for(q, T, QMM_GEMM_MIN_T, w_raw.shape[0] % 32 == 0)
        else:
            impl = ("kernel" if T < QMM_GEMM_MIN_T else
                    _large_impl() if T < QMM_TILE_MAX_T and w_raw.shape[0] % 32 == 0 else "gemm")
    if lib is None or impl == "torch" or q not in KERNEL_TYPES:
        r = reference_qmatmul(x, w_raw, qtype, n_cols, torch.float32)
        return out.copy_(r) if out is not None else r
    if x.dtype is not torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    N = w_raw.shape[0]
    if w_raw.dim() != 2 or w_raw.shape[1] != _rb(q, K) or w_raw.dtype is not torch.uint8 or not w_raw.is_contiguous():
        raise ValueError(f"qmatmul: weight {tuple(w_raw.shape)} {w_raw.dtype}: expected contiguous uint8 "
                         f"[N, {_rb(q, K)}] for {GGMLType(q).name} rows of {K}")
    if out is None:
        out = torch.empty(T, N, dtype=torch.float32)
    nth = n_threads or torch.get_num_threads()
    if impl == "gemm":
        return _qmatmul_gemm(x, w_raw, q, K, nth, out)
    if impl == "tile" and T and N % 32 == 0:
        if lib.hm_tile_mm(x.data_ptr(), T, K, w_raw.data_ptr(), q, N, out.data_ptr(), nth):
            raise ValueError(f"qmatmul: tile kernel rejected K={K} for {GGMLType(q).name}")
        return out
    if _qmm(x.data_ptr(), T, K, w_raw.data_ptr(), q, N, out.data_ptr(), nth):
        raise ValueError(f"qmatmul: kernel rejected K={K} for {GGMLType(q).name}")
    return out


def dequant(w_raw, qtype, n_cols, dtype=torch.bfloat16, n_threads=None, out=None) -> torch.Tensor:
    """GGUF rows [N, row_bytes] -> [N, n_cols] bf16 or float32 with the C kernel (threaded)."""
    if _load() is None:
        r = dequantize(w_raw, qtype, n_cols, dtype)
        return out.copy_(r) if out is not None else r
    n = w_raw.shape[0]
    if w_raw.dim() != 2 or w_raw.shape[1] != _rb(int(qtype), n_cols) or not w_raw.is_contiguous():
        raise ValueError(f"dequant: expected contiguous uint8 [N, {_rb(int(qtype), n_cols)}], got {tuple(w_raw.shape)}")
    if out is None:
        out = torch.empty(n, n_cols, dtype=dtype)
    _dequant_into(w_raw.data_ptr(), None, int(qtype), n, n_cols, out, _threads(n_threads))
    return out


def _dequant_into(src, src2, q, nrows, K, dst, nth):
    if _deq(src, src2, q, nrows, K, dst.data_ptr(), dst.stride(0), int(dst.dtype is torch.bfloat16), nth):
        raise ValueError(f"dequant: bad arguments for {GGMLType(q).name} rows of {K}")


# ----------------------------------------------------------------- large-batch path

def _moe_ffn_gemm(x, ids, weights, gate_raw, up_raw, down_raw, gq, dq, nth, out):
    """Pairs grouped by expert; each active expert's gate+up (then down) weights dequantized
    to bf16 into a reused, cache-resident buffer and multiplied with torch.mm (oneDNN)."""
    T, H = x.shape
    E, F = gate_raw.shape[0], gate_raw.shape[1]
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    if flat.numel() and int(flat.max()) >= E:
        raise ValueError(f"moe_ffn: expert id {int(flat.max())} >= E={E}")
    order = torch.argsort(flat, stable=True)                 # pairs by expert, then token
    nskip = int((flat < 0).sum())
    order = order[nskip:]
    P = order.numel()
    counts = torch.bincount(flat.index_select(0, order), minlength=E).tolist()
    # each expert's rows padded to a multiple of 16: few distinct GEMM shapes, so oneDNN
    # builds (JITs) a handful of kernels instead of one per token count
    cnt = torch.tensor(counts)
    padded = (cnt + 15) // 16 * 16
    start = torch.cumsum(padded, 0) - padded                  # padded start of each expert
    first = torch.cumsum(cnt, 0) - cnt                        # unpadded start
    sorted_e = flat.index_select(0, order)
    row = start.index_select(0, sorted_e) + torch.arange(P) - first.index_select(0, sorted_e)
    Pp = int(padded.sum())
    slot = torch.full((T * k,), -1, dtype=torch.int64)
    slot[order] = row
    xs = torch.zeros(Pp, H, dtype=torch.bfloat16)
    xs[row] = x.to(torch.bfloat16).index_select(0, order // k)
    gu = torch.empty(Pp, 2 * F, dtype=torch.bfloat16)
    h = torch.empty(Pp, F, dtype=torch.bfloat16)
    y = torch.empty(Pp, H, dtype=torch.bfloat16)
    wgu = torch.empty(2 * F, H, dtype=torch.bfloat16)
    wd = torch.empty(H, F, dtype=torch.bfloat16)
    gstep, dstep = F * gate_raw.shape[2], H * down_raw.shape[2]
    gp, upp, dp = gate_raw.data_ptr(), up_raw.data_ptr(), down_raw.data_ptr()
    spans = []
    s = 0
    for e, c in enumerate(counts):
        if c:
            c = (c + 15) // 16 * 16
            _dequant_into(gp + e * gstep, upp + e * gstep, gq, F, H, wgu, nth)
            torch.mm(xs[s:s + c], wgu.t(), out=gu[s:s + c])
            spans.append((e, s, c))
            s += c
    _lib.hm_silu_mul_bf16(gu.data_ptr(), Pp, F, h.data_ptr(), nth)
    for e, s, c in spans:
        _dequant_into(dp + e * dstep, None, dq, H, F, wd, nth)
        torch.mm(h[s:s + c], wd.t(), out=y[s:s + c])
    _lib.hm_combine_bf16(y.data_ptr(), slot.data_ptr(), weights.data_ptr(), T, k, H, out.data_ptr(), nth)
    return out


def _qmatmul_gemm(x, w_raw, q, K, nth, out):
    N = w_raw.shape[0]
    rb = w_raw.shape[1]
    xb = x.to(torch.bfloat16)
    step = max(1, min(N, (8 << 20) // (2 * K)))     # ~8 MiB of bf16 weights per chunk
    wb = torch.empty(step, K, dtype=torch.bfloat16)
    base = w_raw.data_ptr()
    for n0 in range(0, N, step):
        n = min(step, N - n0)
        _dequant_into(base + n0 * rb, None, q, n, K, wb, nth)
        out[:, n0:n0 + n] = torch.mm(xb, wb[:n].t())
    return out
