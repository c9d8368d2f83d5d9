"""The compute behind the scheduler's ops: dense linears and routed experts, by where the bytes are.

Host memory (the CPU, and fake GPUs, which are CPU-backed): the C kernels (kernels/cpu.py) when they
built, else dequantize + float32 matmul. So a fake GPU does the same arithmetic as the CPU, and placement
tests compare placements exactly. CUDA: Triton kernels that read the GGUF blocks themselves (GEMVs for a
few tokens, kernels/gpu_decode.py; grouped GEMMs for prompts, kernels/gpu_moe.py); types without them, and
gpt-oss's biased experts, dequantize to bf16 and run `torch._grouped_mm`.
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from .. import env
from ..errors import HybridMoeError
from ..kernels.cpu import swiglu_oai  # noqa: F401 - gpt-oss's activation, for the torch paths
from ..quant.ref import join_rows
from ..quant.types import GGMLType
from .weights import QTensor

_kernels = None


def kernels():
    """The CPU kernel module, or None where it can't be built (then the torch reference path runs)."""
    global _kernels
    if _kernels is None:
        try:
            from ..kernels import cpu as k
            _kernels = k if k.available() else False
        except ImportError:
            _kernels = False
    return _kernels or None


def _compute_dtype(t: torch.Tensor):
    return torch.bfloat16 if t.device.type == "cuda" else torch.float32


def linear_raw(x: torch.Tensor, raw: torch.Tensor, w: QTensor, dev, n_threads=None, f32: bool = True) -> torch.Tensor:
    """x [..., K] @ W[N, K]^T with W given as GGUF bytes `raw` on dev. Returns float32 [..., N] (f32=False: a
    GPU-resident weight's bf16 GEMM output as it is, for a consumer that reads bf16)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    k = kernels() if raw.device.type == "cpu" and not w.is_float else None
    if w.qtype == GGMLType.F32 and raw.device.type == "cpu":
        y = x2.float() @ raw.view(torch.float32).reshape(-1, w.shape[-1]).t()          # exact, MKL
    elif k is not None:
        y = k.qmatmul(x2.float().contiguous(), raw, w.qtype, w.shape[-1], n_threads=n_threads)
    elif raw is w.raw and raw.device.type == "cuda":
        # GPU-resident dense weights are dequantized to bf16 once and kept: HBM reads of bf16 beat
        # re-dequantizing every call, and non-expert matrices are a small share of an MoE model
        dt = torch.float32 if w.qtype == GGMLType.F32 else torch.bfloat16     # F32 (the router) stays exact
        y = x2.to(dt) @ w.cached(dt).t()
        y = y.float() if f32 else y
    else:
        x2 = x2.float()
        dt = _compute_dtype(raw)
        wt = QTensor(w.name, raw, w.qtype, w.shape, dev, w.split).dequant(dt)
        y = (x2.to(dt) @ wt.t()).float()
    return y.reshape(*lead, -1)


def route(ids: torch.Tensor, n_expert: int):
    """Sort the (token, slot) pairs by expert: returns order [T*k], counts per expert [E]."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_expert)
    return order, counts


def _mul_mat_id(x: torch.Tensor, ids: torch.Tensor, n_expert: int, n_out: int, rows) -> torch.Tensor:
    """MUL_MAT_ID's loop: x [T, K] (shared by the k slots) or [T, k, K]; rows(x_rows, e) -> float32
    [rows, n_out] for expert e. Returns float32 [T, k, n_out]."""
    T, k = ids.shape
    xs = x if x.dim() == 3 else x[:, None, :].expand(T, k, x.shape[-1])
    xs = xs.reshape(T * k, -1)
    order, counts = route(ids, n_expert)
    out = torch.empty(T * k, n_out, dtype=torch.float32, device=xs.device)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            sel = order[start:start + c]
            start += c
            out[sel] = rows(xs[sel], e)
    return out.view(T, k, -1)


def expert_matmul(x: torch.Tensor, ids: torch.Tensor, w: QTensor, n_threads=None) -> torch.Tensor:
    """MUL_MAT_ID: x [T, K] (shared by the k slots) or [T, k, K]; W [E, N, K]. Returns float32 [T, k, N].

    Each expert's rows go through linear_raw, so the arithmetic is that of the fused path's kernels.
    """
    meta = QTensor(w.name, w.raw[0], w.qtype, w.shape[1:], w.device, w.split)
    return _mul_mat_id(x.float(), ids, w.shape[0], w.shape[1],
                       lambda xe, e: linear_raw(xe, w.raw[e], meta, w.device, n_threads))


def reference_moe(x, ids, wts, gate: QTensor, up: QTensor, down: QTensor, graw=None, uraw=None, draw=None,
                  oai=None):
    """Plain per-expert loop in the device's compute dtype: the oracle and the fallback. oai = (bg, bu, bd,
    alpha, limit): gpt-oss's biases and clamped SwiGLU (the biases and activation in float32)."""
    graw = gate.raw if graw is None else graw
    dt = _compute_dtype(graw)
    uraw = up.raw if uraw is None else uraw
    draw = down.raw if draw is None else draw
    T, k = ids.shape
    order, counts = route(ids, graw.shape[0])
    w_flat = wts.reshape(-1).float()
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c == 0:
            continue
        pairs = order[start:start + c]                                    # flat (token, slot) indices
        start += c
        rows = pairs // k
        xe = x[rows].to(dt)
        g = xe @ _deq(graw, e, gate, dt).t()
        u = xe @ _deq(uraw, e, up, dt).t()
        if oai is None:
            y = ((F.silu(g) * u) @ _deq(draw, e, down, dt).t()).float()
        else:
            bg, bu, bd, alpha, limit = oai
            h = swiglu_oai(g.float() + bg[e], u.float() + bu[e], alpha, limit)
            y = (h.to(dt) @ _deq(draw, e, down, dt).t()).float() + bd[e]
        out.index_add_(0, rows, y * w_flat[pairs, None])
    return out


def _gguf(raw, w: QTensor):
    """raw (w's bytes or a copy of them) in GGUF rows, for the dequantizing fallbacks."""
    return join_rows(raw, w.qtype) if w.split else raw


def _deq(raw, e, meta: QTensor, dt):
    return QTensor(meta.name, raw[e], meta.qtype, meta.shape[1:], meta.device, meta.split).dequant(dt)


def _from_bytes(fast, x, ids, wts, graw, uraw, draw, gate: QTensor, up: QTensor, down: QTensor, **kw):
    """fast.moe (a gpu_kernels module) straight from the experts' bytes where it reads their types, else None (a
    kernel that fails to build on this GPU disables its types, and the caller's dequantizing path runs)."""
    if fast.supports(gate.qtype, up.qtype, down.qtype):
        try:
            return fast.moe(x, ids, wts, graw, uraw, draw, gate.qtype, down.qtype, **kw)
        except Exception as e:                          # noqa: BLE001 - a kernel this GPU can't build
            fast.disable(gate.qtype, down.qtype, e)
    return None


def moe(x, ids, wts, graw, uraw, draw, gate: QTensor, up: QTensor, down: QTensor, n_threads=None,
        stats=None) -> torch.Tensor:
    """Routed experts from raw bytes graw/uraw/draw [E', ...] (ids index into E'). Returns float32 [T, H]."""
    if graw.device.type == "cuda":
        few = ids.numel() <= GATHER_MAX_SLOTS
        fast = gpu_kernels(gpu_moe_path(ids.shape[0], ids.numel(), (gate.qtype, up.qtype, down.qtype),
                                         gate.split and down.split))
        y = _from_bytes(fast, x, ids, wts, graw, uraw, draw, gate, up, down, gate_split=gate.split,
                        down_split=down.split)
        if y is not None:
            return y
        if few or not hasattr(torch, "_grouped_mm"):
            return _gathered_moe(x, ids, wts, graw, uraw, draw, gate, down)
        return _grouped_moe(x, ids, wts, graw, uraw, draw, gate, down)
    k = kernels() if graw.device.type == "cpu" else None
    t0 = time.perf_counter()
    if k is None:
        y = reference_moe(x.float(), ids, wts, gate, up, down, graw, uraw, draw)
    else:
        y = k.moe_ffn(x.float().contiguous(), ids.to(torch.int32).contiguous(), wts.float().contiguous(),
                      graw, uraw, draw, gate.qtype, down.qtype, n_threads=n_threads)
    if stats is not None and gate.device.kind == "cpu":
        stats.cpu_expert_seconds += time.perf_counter() - t0
        n_active = ids.shape[1] if ids.shape[0] == 1 else int(torch.unique(ids).numel())   # top-k ids are distinct
        stats.cpu_expert_bytes += n_active * (graw[0].numel() + uraw[0].numel() + draw[0].numel())
    return y


_STREAM_RATES: dict = {}


def cpu_stream_rate(exps: list, k: int, n_threads=None, nbytes: int = 256 * 2**20) -> float | None:
    """The C expert kernel's rate on one token, in bytes of its experts a second: single-token calls of k distinct
    experts each, over these layers' (gate, up, down) in turn (those of the types and shapes most layers have),
    until about nbytes (beyond a last-level cache) were read after a few untimed calls; the fastest of three such
    passes (one pass is a few milliseconds: a moment's noise on the H100 VM once read a Q4_0 kernel as bound by
    its decoding, and the decode share took 5 experts of 8, a fifth slower than its 3). Measured once a process
    per types and shapes; None without the C kernels or experts (the decode share then takes the RAM's rate)."""
    kern = kernels()
    if kern is None or not exps or k < 1:
        return None
    kind = lambda e: (e[0].qtype, e[2].qtype, tuple(e[0].raw.shape), tuple(e[2].raw.shape))   # noqa: E731
    kinds = [kind(e) for e in exps]
    most = max(set(kinds), key=kinds.count)          # a mix's layers differ (its first, higher): the most layers'
    exps = [e for e, kd in zip(exps, kinds) if kd == most]
    g0, _, d0 = exps[0]
    key = (*most, k, n_threads)
    if key not in _STREAM_RATES:
        H, E = d0.raw.shape[1], g0.raw.shape[0]
        x = torch.randn(1, H, generator=torch.Generator().manual_seed(0))
        wts = torch.full((1, k), 1.0 / k)
        calls = [(g, u, d, torch.arange(e, e + k, dtype=torch.int32)[None])
                 for e in range(0, E - k + 1, k) for g, u, d in exps]
        per = k * sum(w.raw[0].numel() for w in exps[0])
        n = max(1, min(len(calls) - 4, nbytes // per))
        for g, u, d, ids in calls[-4:]:                  # untimed: threads up, code in cache
            kern.moe_ffn(x, ids, wts, g.raw, u.raw, d.raw, g.qtype, d.qtype, n_threads=n_threads)
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            for g, u, d, ids in calls[:n]:
                kern.moe_ffn(x, ids, wts, g.raw, u.raw, d.raw, g.qtype, d.qtype, n_threads=n_threads)
            best = min(best, time.perf_counter() - t0)
        _STREAM_RATES[key] = n * per / max(best, 1e-9)
    return _STREAM_RATES[key]


GATHER_MAX_SLOTS = 64      # token-expert pairs up to which each pair gets its own dequantized expert copy

# the GPU MoE kernels by (token, slot) pairs. Experts of Q4_0/Q8_0 in split rows, batches of 2 to MMQ_MAX_TOKENS
# tokens: the per-pair GEMVs below MMQ_MIN_PAIRS pairs, the int8 tensor-core kernels (gpu_mmq) from there (one
# layer of the 30B shape on an H100, the per-pair kernels on their one-warp tiles, us, per-pair / mmq / grouped
# GEMMs: B=8 74 / 165 / 203, B=16 127 / 231 / 283, B=32 224 / 285 / 369, B=64 420 / 356 / 400; bench_moe_decode.py
# --grouped, docs/benchmarks.md: the two cross near 384 pairs). Other types: the per-pair GEMVs up to
# GATHER_MAX_SLOTS pairs, the grouped GEMMs above. The grouped GEMVs run only when HYBRIDMOE_GPU_MOE=grouped (they
# won at no batch size on an H100).
_GPU_PATHS = ("pair", "grouped", "gemm", "mmq")
MMQ_MIN_PAIRS = 384
MMQ_MAX_TOKENS = 64


# gpt-oss's biased experts (GGUF rows, MXFP4 in its files): the per-pair GEMVs up to OAI_PAIR_MAX pairs, the grouped
# GEMMs above. One layer at gpt-oss-20b's shape on an H100 (bench_moe_decode.py --oai, us, per-pair / grouped GEMVs
# / grouped GEMMs): B=4 354 / 463 / 529, B=8 676 / 853 / 691, B=16 1323 / 1736 / 964, B=32 2608 / 3394 / 1014: the
# MXFP4 GEMVs are bound by decoding the weights, which every pair repeats (the grouped GEMVs too), the GEMMs decode
# each expert's once. The grouped GEMVs run only when HYBRIDMOE_GPU_MOE=grouped.
OAI_PAIR_MAX = 32


def oai_moe_path(n_tokens: int, n_pairs: int) -> str:
    """Which GPU MoE kernels run a call of gpt-oss's experts: "pair" or "gemm" (HYBRIDMOE_GPU_MOE names one of
    pair, grouped and gemm; "mmq" is taken as "gemm": its kernels read split rows only)."""
    forced = _forced_gpu_path()
    if forced is not None:
        return "gemm" if forced == "mmq" else forced
    return "pair" if n_tokens <= 1 or n_pairs <= OAI_PAIR_MAX else "gemm"


def _forced_gpu_path() -> str | None:
    """The path HYBRIDMOE_GPU_MOE names, or None for auto."""
    forced = env.get("HYBRIDMOE_GPU_MOE")
    if forced == "auto":
        return None
    if forced not in _GPU_PATHS:
        raise HybridMoeError(f"HYBRIDMOE_GPU_MOE={forced!r}: give auto, pair, grouped, gemm or mmq")
    return forced


def _mmq_ok(qtypes, split: bool) -> bool:
    if not split or qtypes is None:
        return False
    from ..kernels import gpu_mmq
    return gpu_mmq.supports(*qtypes)


def gpu_moe_path(n_tokens: int, n_pairs: int, qtypes=None, split: bool = False) -> str:
    """Which GPU MoE kernels run a call: "pair" (gpu_decode.moe), "grouped" (gpu_moe_grouped.moe), "mmq"
    (gpu_mmq.moe: experts of qtypes (gate, up, down) Q4_0/Q8_0 with split rows) or "gemm" (gpu_moe.moe);
    HYBRIDMOE_GPU_MOE names one for every call ("mmq" where it can't run: "gemm")."""
    forced = _forced_gpu_path()
    if forced is not None:
        return "gemm" if forced == "mmq" and not _mmq_ok(qtypes, split) else forced
    if 1 < n_tokens <= MMQ_MAX_TOKENS and _mmq_ok(qtypes, split):
        return "mmq" if n_pairs >= MMQ_MIN_PAIRS else "pair"
    return "pair" if n_tokens <= 1 or n_pairs <= GATHER_MAX_SLOTS else "gemm"


def kernel_variants(max_tokens: int, k: int, n_expert: int, qtypes=None, split: bool = False) -> list[int]:
    """The smallest token count of each GPU MoE kernel variant a call of 2..max_tokens tokens runs (gpu_moe_path's
    kernels and the block height their compile fixes: gpu_mmq's pairs, gpu_moe's rows a block): a warm-up that
    makes one call of each has compiled every one, so no request pays seconds of compiling later."""
    from ..kernels import gpu_mmq, gpu_moe
    seen, out = set(), []
    for T in range(2, max_tokens + 1):
        n = T * k
        path = gpu_moe_path(T, n, qtypes, split)
        key = (path, gpu_mmq.block_pairs(n, n_expert) if path == "mmq" else
               gpu_moe.block_rows(n, n_expert) if path == "gemm" else 0)
        if key not in seen:
            seen.add(key)
            out.append(T)
    return out


def gpu_kernels(path: str):
    """The kernel module of a gpu_moe_path choice (each has supports, moe and disable)."""
    if path == "pair":
        from ..kernels import gpu_decode as mod
    elif path == "grouped":
        from ..kernels import gpu_moe_grouped as mod
    elif path == "mmq":
        from ..kernels import gpu_mmq as mod
    else:
        from ..kernels import gpu_moe as mod
    return mod


def _gathered_moe(x, ids, wts, graw, uraw, draw, gate: QTensor, down: QTensor):
    """Few tokens (decode): dequantize each selected (token, expert) pair's weights and batch-multiply.

    No host sync and static shapes for a given T, so the step can be captured in a CUDA graph.
    """
    from ..kernels.gpu_dequant import dequantize_bf16 as dequantize
    T, k = ids.shape
    flat = ids.reshape(-1)
    wg = dequantize(_gguf(graw, gate), gate.qtype, gate.shape[-1], index=flat)           # [T*k, F, H]
    wu = dequantize(_gguf(uraw, gate), gate.qtype, gate.shape[-1], index=flat)
    wd = dequantize(_gguf(draw, down), down.qtype, down.shape[-1], index=flat)           # [T*k, H, F]
    xs = x.to(torch.bfloat16).repeat_interleave(k, dim=0)[:, None, :]                    # [T*k, 1, H]
    h = F.silu(torch.bmm(xs, wg.transpose(1, 2))) * torch.bmm(xs, wu.transpose(1, 2))  # [T*k, 1, F]
    y = torch.bmm(h, wd.transpose(1, 2))[:, 0].float()                                   # [T*k, H]
    return (y.view(T, k, -1) * wts.float()[..., None]).sum(1)


GROUP_ALIGN = 16     # rows per expert group are padded to this (and empty groups to one block of it)


def _grouped_moe(x, ids, wts, graw, uraw, draw, gate: QTensor, down: QTensor, oai=None):
    """Many tokens (prefill): every expert dequantized once (one Triton pass, ~0.1 ms a layer on an H200),
    then grouped GEMMs over the tokens sorted by expert.

    Each expert's rows are padded to a multiple of 16 and no group is empty, the layout grouped GEMM
    kernels are documented for; the buffer is sized for the worst case (T*k + 16*E rows), so nothing here
    waits for the GPU and Python runs ahead of the kernels. oai = (bg, bu, bd, alpha, limit): gpt-oss's
    biased experts and clamped SwiGLU (biases added to the real rows only; padding rows are never read).
    """
    from ..kernels.gpu_dequant import dequantize_bf16 as dequantize
    T, k = ids.shape
    E, H = graw.shape[0], x.shape[1]
    order, counts = route(ids, E)
    padded = torch.clamp((counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN, min=GROUP_ALIGN)
    offs = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts                              # unpadded start of each expert
    e_sorted = ids.reshape(-1)[order]
    dest = (offs - padded)[e_sorted] + torch.arange(order.numel(), device=x.device) - first[e_sorted]
    tok = order // k
    xs = torch.zeros(T * k + GROUP_ALIGN * E, H, dtype=torch.bfloat16, device=x.device)
    xs[dest] = x[tok].to(torch.bfloat16)
    offs = offs.to(torch.int32)
    wg = dequantize(_gguf(graw, gate), gate.qtype, gate.shape[-1])       # [E, F, H]
    wu = dequantize(_gguf(uraw, gate), gate.qtype, gate.shape[-1])
    wd = dequantize(_gguf(draw, down), down.qtype, down.shape[-1])       # [E, H, F]
    hg = torch._grouped_mm(xs, wg.transpose(-2, -1), offs=offs)          # [rows, F]
    hu = torch._grouped_mm(xs, wu.transpose(-2, -1), offs=offs)
    if oai is None:
        h = F.silu(hg) * hu
    else:
        bg, bu, bd, alpha, limit = oai
        hg, hu = hg.float().index_add_(0, dest, bg[e_sorted]), hu.float().index_add_(0, dest, bu[e_sorted])
        h = swiglu_oai(hg, hu, alpha, limit).to(torch.bfloat16)
    y = torch._grouped_mm(h, wd.transpose(-2, -1), offs=offs)[dest].float()   # [T*k, H] in expert order
    if oai is not None:
        y = y + bd[e_sorted]
    y = y * wts.reshape(-1)[order, None].float()
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y)
    return out


# -- gpt-oss: biased experts with the clamped SwiGLU ("swiglu_oai"). In host memory the C kernels take them
# (`oai=`); on a GPU prompts take the grouped GEMMs from the bytes (gpu_moe.moe(oai=), else dequantize +
# `_grouped_moe(oai=)`) and a few tokens the decode kernels from the bytes (gpu_decode.moe(oai=): MXFP4 and every
# type they read), else a per-expert dequantize + matmul loop.

def expert_matmul_dequant(x: torch.Tensor, ids: torch.Tensor, w: QTensor) -> torch.Tensor:
    """MUL_MAT_ID by dequantized experts: x [T, K] (shared by the k slots) or [T, k, K]; W [E, N, K].
    Returns float32 [T, k, N]."""
    dt = _compute_dtype(w.raw)
    return _mul_mat_id(x, ids, w.shape[0], w.shape[1], lambda xe, e: (xe.to(dt) @ _deq(w.raw, e, w, dt).t()).float())


def moe_biased(x, ids, wts, raws, ws, biases, alpha: float, limit: float, stats=None,
               n_threads=None) -> torch.Tensor:
    """Routed experts with biases from raw bytes `raws` (gate, up, down [E, ...]) on x's device; `biases`
    float32 [E, F], [E, F], [E, H] there. Returns float32 [T, H]: sum over slots of wts * expert(x).
    Bytes in host memory go through the C kernels (one call a layer); on a GPU prompts take the grouped
    GEMMs and a few tokens the decode kernels, from the bytes where they read the type (GGUF rows), else the
    dequantizing paths."""
    gate, up, down = ws
    graw, uraw, draw = raws
    oai = (*biases, alpha, limit)
    t0 = time.perf_counter()
    if graw.device.type == "cuda":
        many = ids.numel() > GATHER_MAX_SLOTS
        if not (gate.split or down.split):              # GGUF rows: oai_moe_path's kernels
            y = _from_bytes(gpu_kernels(oai_moe_path(ids.shape[0], ids.numel())), x, ids, wts, graw, uraw, draw,
                            gate, up, down, oai=oai)
            if y is not None:
                return y
        if many and hasattr(torch, "_grouped_mm"):
            return _grouped_moe(x, ids, wts, graw, uraw, draw, gate, down, oai=oai)
    kc = kernels() if graw.device.type == "cpu" else None
    if kc is not None and up.qtype == gate.qtype:
        out = kc.moe_ffn(x.float().contiguous(), ids.to(torch.int32).contiguous(), wts.float().contiguous(),
                         graw, uraw, draw, gate.qtype, down.qtype, n_threads=n_threads, oai=oai)
    else:
        out = reference_moe(x, ids, wts, gate, up, down, graw, uraw, draw, oai=oai)
    if stats is not None:
        stats.cpu_expert_seconds += time.perf_counter() - t0
        stats.cpu_expert_bytes += int(torch.unique(ids).numel()) * (graw[0].numel() + uraw[0].numel() +
                                                                  draw[0].numel())
    return out
