"""Every HYBRIDMOE_* environment switch: one table, read through `get` (at call time, so tests can set them).

Most are for experiments and benchmarks; a user needs none of them. docs/design.md lists this table."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import HybridMoeError


@dataclass(frozen=True)
class Switch:
    default: str
    doc: str


SWITCHES = {
    "HYBRIDMOE_CACHE": Switch("", "folder for built kernels, synthetic models and calibrations (default "
                                  "~/.cache/hybridmoe)"),
    "HYBRIDMOE_FAKE_GPUS": Switch("", "CUDA0..N stand for the CPU with these sizes: 2, 2x24GiB, 24GiB,8GiB "
                                      "(tests and dry runs)"),
    "HYBRIDMOE_API_KEY": Switch("", "serve: the API key when --api-key is not given"),
    "HYBRIDMOE_PROFILE": Switch("0", "1: every load() profiles as --profile does"),
    "HYBRIDMOE_CPU_KERNELS": Switch("", "torch (or 0, off, ref): the plain torch reference instead of the C kernels"),
    "HYBRIDMOE_KERNEL_CFLAGS": Switch("", "extra C compiler flags for the CPU kernels (part of their cache key)"),
    "HYBRIDMOE_CPU_GEMM_MIN_T": Switch("", "tokens from which CPU experts take the tile GEMM instead of the "
                                           "streaming kernel (default by CPU: 64 AMX, 160 AVX512-BF16, else 224)"),
    "HYBRIDMOE_CPU_QMM_MIN_T": Switch("12", "tokens from which CPU dense products take the tile products"),
    "HYBRIDMOE_CPU_QMM_TILE_MAX_T": Switch("256", "tokens from which CPU dense products dequantize + torch.mm"),
    "HYBRIDMOE_CPU_ATTN": Switch("auto", "fp32 | bf16: the CPU prompt attention's dtype (auto: bf16 with AMX)"),
    "HYBRIDMOE_CPU_PROMPT": Switch("exact", "exact: CPU prompts compute every token as decode does (split-invariant; "
                                            "int8 AMX tiles); bf16: the bf16 tiles (faster, ~1e-2, batch-dependent)"),
    "HYBRIDMOE_CPU_ACT_TERMS": Switch("", "1 or 2: the CPU integer path's activations in that many int8 terms "
                                          "for every weight type (1: ggml's q8_0, ~1e-2 a layer; 2: ~15 bits) "
                                          "instead of the per-type rule (docs/cpu-kernels.md)"),
    "HYBRIDMOE_HOST_ARENA": Switch("", "1: CPU experts go to the pinned arena without a GPU too; 0: never"),
    "HYBRIDMOE_SPLIT_ROWS": Switch("1", "0: GPU Q4_0/Q8_0 tensors keep GGUF rows instead of the split layout"),
    "HYBRIDMOE_DECODE_SHARE": Switch("", "experts of each CPU layer's k the GPU runs in a decode step, and in a "
                                         "batch's step that share of its distinct experts (0: off; default: the "
                                         "cost model's)"),
    "HYBRIDMOE_HANDOFF": Switch("poll", "sync: CPU/GPU decode hand-offs through synchronizing copies, not polled "
                                        "flags"),
    "HYBRIDMOE_OAI_ATTN": Switch("triton", "torch: gpt-oss's captured decode step computes attention with torch ops "
                                           "instead of gpu_attention's kernels (to compare)"),
    "HYBRIDMOE_GEMV8": Switch("1", "0: GPU decode projections in bf16 instead of the int8 (dp4a) GEMV"),
    "HYBRIDMOE_GPU_MOE": Switch("auto", "pair, grouped, gemm or mmq: the GPU MoE kernels for every call (auto: by "
                                        "the (token, slot) pairs, runtime/experts.gpu_moe_path)"),
    "HYBRIDMOE_GPU_QDOT": Switch("1", "0: GPU experts of IQ4_XS, IQ4_KS, Q3_K and IQ2_KT are dequantized first, no "
                                      "decode share (1: the fused kernels of kernels/gpu_qdot.py)"),
    "HYBRIDMOE_MOE_TUNE": Switch("0", "1: Triton autotunes the GPU MoE kernels' tiles at their first call"),
}


def get(name: str) -> str:
    """The switch's value, or its default when unset or empty."""
    sw = SWITCHES[name]
    return os.environ.get(name, "").strip() or sw.default


def get_int(name: str, default: int | None = None) -> int | None:
    """An integer switch; `default` where unset. A value that is not an integer is a clear error."""
    v = get(name)
    if not v:
        return default
    try:
        return int(v)
    except ValueError:
        raise HybridMoeError(f"{name}={v!r} is not an integer ({SWITCHES[name].doc})") from None


def cache_dir() -> Path:
    """The folder of hybridmoe's caches: $HYBRIDMOE_CACHE, else ~/.cache/hybridmoe."""
    root = get("HYBRIDMOE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "hybridmoe"


def table() -> str:
    """The switches as a markdown table (docs/design.md)."""
    rows = ["| switch | default | what |", "| --- | --- | --- |"]
    rows += [f"| `{n}` | {s.default or '(unset)'} | {s.doc} |" for n, s in SWITCHES.items()]
    return "\n".join(rows)
