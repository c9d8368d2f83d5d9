"""Static KV cache: one preallocated [n_kv_head, n_ctx, head_dim] buffer per layer, on its attention's device."""
from __future__ import annotations

import torch

from ..errors import HybridMoeError
from ..quant.types import GGMLType

CACHE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class KVCache:
    def __init__(self, n_layer: int, n_ctx: int, n_head_kv: int, head_dim: int, devices: list,
                 type_k: str = "f16", type_v: str = "f16", head_dim_v: int | None = None):
        self.n_ctx = n_ctx
        self.type_k, self.type_v = type_k, type_v
        if "q8_0" in (type_k, type_v) and (head_dim % 32 or (head_dim if head_dim_v is None else head_dim_v) % 32):
            raise HybridMoeError(f"a q8_0 KV cache needs a head size that is a multiple of 32; this model's is "
                                 f"{head_dim}: use -ctk/-ctv f16, bf16 or f32")
        self.devs = devices                                  # Device per layer
        self.k = [self._alloc(type_k, n_head_kv, n_ctx, head_dim, d) for d in devices]
        dv = head_dim if head_dim_v is None else head_dim_v                 # 0: no V (MLA's compressed cache)
        if not dv:
            self.type_v = "f16"                                             # an empty buffer; -ctv has no object
        self.v = [self._alloc(self.type_v, n_head_kv, n_ctx, dv, d) for d in devices]
        self.n_past = 0

    @staticmethod
    def _alloc(kind, h, n, d, dev):
        if kind == "q8_0":
            # Stored as Q8_0 blocks along head_dim (34 bytes per 32 values), dequantized on read.
            return torch.zeros(h, n, d // 32 * 34, dtype=torch.uint8, device=dev.torch_device)
        if kind not in CACHE_DTYPES:
            raise HybridMoeError(f"cache type {kind!r} is not supported (use f16, bf16, f32 or q8_0)")
        return torch.zeros(h, n, d, dtype=CACHE_DTYPES[kind], device=dev.torch_device)

    def device(self, layer: int):
        return self.devs[layer]

    def update(self, layer: int, pos0: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [T, n_kv, D] at pos0..pos0+T; return keys, values [n_kv, pos0+T, D] as float."""
        T = k.shape[0]
        end = pos0 + T
        if end > self.n_ctx:
            raise HybridMoeError(f"context is full: {end} tokens do not fit in -c {self.n_ctx}; raise -c")
        out = []
        for buf, kind, x in ((self.k[layer], self.type_k, k), (self.v[layer], self.type_v, v)):
            x = x.transpose(0, 1)                            # [n_kv, T, D]
            if kind == "q8_0":
                from ..quant.ref import dequantize, quantize
                buf[:, pos0:end] = quantize(x.float(), GGMLType.Q8_0)
                out.append(dequantize(buf[:, :end], GGMLType.Q8_0, x.shape[-1]))
            else:
                buf[:, pos0:end] = x.to(buf.dtype)
                out.append(buf[:, :end])
        return out[0], out[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
