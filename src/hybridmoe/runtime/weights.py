"""Weights at run time: GGUF block bytes on their device, dequantized per use.

Each tensor is read once, straight from the file mapping to the device the placement chose. Quantized
tensors keep their GGUF bytes so that CPU kernels read them as they are and an upload is a plain copy.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

import torch

from .. import env
from ..devices import Device
from ..errors import progress
from ..quant.ref import can_split, join_rows, split_rows
from ..quant.types import GGMLType, interleave, row_bytes
from . import hostmem

PROGRESS_BYTES = 1 << 30       # a load that copies this much or more shows a progress bar (on a terminal)
FLOAT_DTYPES = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}


@dataclass(eq=False)
class QTensor:
    """A weight: raw GGUF bytes [..., row_bytes] on `device`, logical shape `shape`. split: each row's
    bytes are in the split layout (quant.ref.split_rows: GPU-resident Q4_0/Q8_0 experts, attention
    projections and output head), in raw and in every copy made of it."""
    name: str
    raw: torch.Tensor
    qtype: GGMLType
    shape: tuple[int, ...]
    device: Device
    split: bool = False
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def is_float(self) -> bool:
        return self.qtype in FLOAT_DTYPES

    def dequant(self, dtype=torch.float32, index=None) -> torch.Tensor:
        """Dequantized weights (optionally rows `index` of the outermost dim, e.g. selected experts)."""
        r = interleave(self.qtype)
        if index is not None and r > 1 and self.raw.dim() == 2:
            # rows of an _R4 / _R8 matrix (embedding lookups) are stored in groups: dequantize their groups
            groups = self.raw.view(-1, r, self.raw.shape[-1])[index // r]
            rows = QTensor(self.name, groups.reshape(-1, self.raw.shape[-1]), self.qtype, self.shape, self.device,
                           self.split).dequant(dtype).view(-1, r, self.shape[-1])
            return rows[torch.arange(rows.shape[0], device=rows.device), (index % r).to(rows.device)]
        raw = self.raw if index is None else self.raw[index]
        if self.split:
            raw = join_rows(raw, self.qtype)
        if self.is_float:
            return raw.view(FLOAT_DTYPES[self.qtype]).to(dtype)
        if raw.is_cuda and dtype == torch.bfloat16:
            from ..kernels.gpu_dequant import dequantize_bf16
            return dequantize_bf16(raw, self.qtype, self.shape[-1])
        from ..quant.dequant import dequantize
        return dequantize(raw, self.qtype, self.shape[-1], dtype=dtype)

    def cached(self, dtype=torch.float32) -> torch.Tensor:
        """Dequantized once and kept (small tensors: norms, biases)."""
        t = self._cache.get(dtype)
        if t is None:
            t = self._cache[dtype] = self.dequant(dtype)
        return t



# 2-D weights kept in split rows on a GPU, next to the experts: what the static decode step's gemv8 reads
_DENSE_SPLIT = re.compile(r"(^|\.)(attn_(q|k|v|qkv|output)|output)\.weight$")


def byte_shape(shape: tuple[int, ...], qtype: GGMLType) -> tuple[int, ...]:
    return (*shape[:-1], row_bytes(qtype, shape[-1]))


def load_weights(model, placement, devices: dict[str, Device], pin_host: bool | None = None,
                 host_arena: bool | None = None) -> dict[str, QTensor]:
    """Read each tensor once and put it on the device the placement chose.

    CPU tensors stay memory-mapped (as llama.cpp's mmap). With a real GPU that may receive uploads, CPU
    experts are copied into one pinned arena (runtime/hostmem.py: anonymous memory on 2 MiB pages,
    registered with CUDA) so uploads run at full PCIe speed (~54 vs ~21 GB/s pageable), only while that
    copy fits in 80% of the available RAM: pinned pages can't be reclaimed, the mapping's can.
    HYBRIDMOE_HOST_ARENA=1 copies CPU experts into the arena without a GPU too, =0 never (per-tensor
    pin_memory() then, as before the arena): bench_kernels.py --alloc compares the memory kinds.

    Q4_0/Q8_0 experts on a GPU are kept in the split row layout (quant.ref.split_rows; same bytes, quants
    first): the GPU kernels read them as 16-byte vectors (bench_moe_decode.py --split). So are the attention
    projections and the output head, which the static decode step multiplies with dp4a (gpu_decode.gemv8).
    HYBRIDMOE_SPLIT_ROWS=0 keeps GGUF rows.
    """
    split_ok = env.get("HYBRIDMOE_SPLIT_ROWS") != "0"
    has_cuda = any(d.kind == "cuda" and not d.fake for d in devices.values())
    host_exps = [n for n in model.tensors if "_exps." in n and devices[placement.device_of[n]].kind == "cpu"]
    fits = sum(model.tensors[n].nbytes for n in host_exps) < 0.8 * next(
        d for d in devices.values() if d.kind == "cpu").free_bytes
    if pin_host is None:
        pin_host = has_cuda and placement.opts.op_offload and fits
    if host_arena is None:
        arena_env = env.get("HYBRIDMOE_HOST_ARENA")
        host_arena = fits and arena_env != "0" and (pin_host or arena_env == "1")
    arena = None
    if host_arena and host_exps:
        arena = hostmem.Arena(hostmem.arena_size(model.raw(model.tensors[n]) for n in host_exps))
    out = {}

    def copied(name: str) -> bool:              # read at load (else the mapping is read when first used)
        dev = devices[placement.device_of[name]]
        return (dev.kind == "cpu" and "_exps." in name and (arena is not None or pin_host)) or \
            (dev.kind != "cpu" and not dev.fake)
    total = sum(info.nbytes for name, info in model.tensors.items() if copied(name))
    with progress("loading weights", total, "bytes", enabled=None if total >= PROGRESS_BYTES else False) as bar:
        for name, info in model.tensors.items():
            dev = devices[placement.device_of[name]]
            raw = model.raw(info).view(byte_shape(info.shape, info.qtype))
            split, qtype = False, info.qtype
            if dev.kind == "cpu":
                if interleave(qtype) > 1 and len(info.shape) > 1:
                    # _R4 / _R8 rows repacked into their base type's where the CPU kernels read that
                    from ..kernels.cpu import plain_rows
                    raw, qtype = plain_rows(raw, qtype, info.shape[-1])
                if arena is not None and "_exps." in name:
                    raw = arena.take(raw)
                elif pin_host and "_exps." in name:
                    raw = raw.pin_memory()
            elif not dev.fake:
                raw = raw.to(dev.torch_device)
                if split_ok and (("_exps." in name and len(info.shape) == 3) or _DENSE_SPLIT.search(name)) \
                        and can_split(info.qtype, info.shape[-1]):
                    raw, split = split_rows(raw, info.qtype), True
            out[name] = QTensor(name, raw, qtype, info.shape, dev, split)
            if copied(name):
                bar.advance(info.nbytes)
    if arena is not None and pin_host and not arena.pin():
        print("hybridmoe: cudaHostRegister refused the expert arena (locked-memory limit?): uploads of CPU "
              "experts run from pageable memory, at about half the PCIe speed", file=sys.stderr)
    return out
