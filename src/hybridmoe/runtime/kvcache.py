"""Static KV cache: one preallocated [n_kv_head, slots, head_dim] buffer per layer, on its attention's device.

A layer caches every position of the context (slots = n_ctx), or, with a sliding window (gpt-oss's
alternating layers), a ring of window - 1 + ubatch slots: position p lives in slot p % slots, and the keys
a batch's queries can see are still there when the batch holds at most `ubatch` tokens.

The cache also records which token each position holds (`tokens`), so that a new prompt can start after the
longest prefix it shares with what the cache holds (llama-server's prompt cache): see `reusable_prefix`."""
from __future__ import annotations

import torch

from ..config import kv_slots
from ..errors import HybridMoeError
from ..quant.types import GGMLType

CACHE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class KVCache:
    def __init__(self, n_layer: int, n_ctx: int, n_head_kv: int, head_dim: int, devices: list,
                 type_k: str = "f16", type_v: str = "f16", head_dim_v: int | None = None,
                 windows: list[int] | None = None, ubatch: int = 512):
        self.n_ctx = n_ctx
        # per layer: the sliding window (0: none) and the slots it keeps
        self.windows = list(windows) if windows else [0] * n_layer
        self.ubatch = ubatch
        self.slots = [kv_slots(n_ctx, w, ubatch) for w in self.windows]
        self.type_k, self.type_v = type_k, type_v
        if "q8_0" in (type_k, type_v) and (head_dim % 32 or (head_dim if head_dim_v is None else head_dim_v) % 32):
            raise HybridMoeError(f"a q8_0 KV cache needs a head size that is a multiple of 32; this model's is "
                                 f"{head_dim}: use -ctk/-ctv f16, bf16 or f32")
        self.devs = devices                                  # Device per layer
        self.k = [self._alloc(type_k, n_head_kv, n, head_dim, d) for n, d in zip(self.slots, devices)]
        dv = head_dim if head_dim_v is None else head_dim_v                 # 0: no V (MLA's compressed cache)
        if not dv:
            self.type_v = "f16"                                             # an empty buffer; -ctv has no object
        self.v = [self._alloc(self.type_v, n_head_kv, n, dv, d) for n, d in zip(self.slots, devices)]
        self.tokens: list[int] = []     # the token whose keys and values each position 0.. holds
        # the model's static steps for this cache ("decode" / "prompt" -> (generation, step or None)): their
        # graphs read this cache's tensors, so they live and go with it (Model._step_for)
        self.static_steps: dict = {}
        self.hi = 0                      # 1 + the highest position written since position 0 was

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

    def plain(self, layer: int, ring: bool = False) -> bool:
        """Keys and values of this layer are 16-bit floats of one dtype at slots = positions (no q8_0; no ring,
        unless ring: then position p may be in slot p % slots, as the kernels that take windows read them):
        kernels may write and read them in place."""
        return self.type_k == self.type_v and self.type_k in ("f16", "bf16") and (
            ring or self.slots[layer] == self.n_ctx)

    def begin_write(self, pos0: int, n: int):
        """A forward is about to write n positions from pos0 on: what the cache held there is gone (also if
        the forward fails halfway)."""
        if pos0 <= len(self.tokens):
            del self.tokens[pos0:]
        else:                            # a gap: written by a caller that skipped positions; trust nothing
            self.tokens.clear()
        self.hi = max(0 if pos0 == 0 else self.hi, pos0 + n)

    def end_write(self, pos0: int, tokens: list[int]):
        """That forward wrote `tokens` at pos0..."""
        if pos0 == len(self.tokens):
            self.tokens.extend(tokens)

    def wrote(self, pos: int, token: int):
        """A decode step wrote `token` at pos: begin_write(pos, 1) and end_write(pos, [token]) in one call."""
        toks = self.tokens
        if pos < len(toks):
            del toks[pos:]
        elif pos > len(toks):
            toks.clear()
            self.hi = max(0 if pos == 0 else self.hi, pos + 1)
            return
        toks.append(token)
        self.hi = max(0 if pos == 0 else self.hi, pos + 1)

    def reusable_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` need not run again: the prefix this cache already holds, less at
        least the last token (its logits are wanted). With a sliding-window ring, a prefix is kept only if
        the keys the next query looks back on were not overwritten since; else 0."""
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        n = min(n, len(ids) - 1)
        for w, slots in zip(self.windows, self.slots):
            # position p of a ring holds p until position p + slots is written
            if n > 0 and slots < self.n_ctx and max(0, n - w + 1) + slots < self.hi:
                return 0
        return max(n, 0)

    def check_fits(self, pos0: int, n: int):
        if pos0 + n > self.n_ctx:
            raise HybridMoeError(f"context is full: {pos0 + n} tokens do not fit in -c {self.n_ctx}; raise -c")

    def check_rings(self, n: int, layers=None):
        """n tokens written by one forward fit each sliding-window ring (of these layers; default all): its slots
        hold them beside the window - 1 positions before them."""
        for i in range(len(self.slots)) if layers is None else layers:
            w, s = self.windows[i], self.slots[i]
            if w and s < self.n_ctx and n > s - w + 1:
                raise HybridMoeError(f"a batch of {n} tokens is more than this sliding-window cache was sized for "
                                     f"({s - w + 1}); raise -ub or give fewer tokens per forward")

    def update(self, layer: int, pos0: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [T, n_kv, D] at pos0..pos0+T; return keys, values [n_kv, pos0+T, D] as float."""
        keys, values, _ = self.update_window(layer, pos0, k, v)
        return keys, values

    def update_window(self, layer: int, pos0: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [T, n_kv, D] at pos0..pos0+T; return (keys, values, start): positions start..pos0+T-1,
        [n_kv, pos0+T-start, D], where start is 0, or for a sliding-window layer the first position any
        query of this batch can see."""
        T = k.shape[0]
        end = pos0 + T
        self.check_fits(pos0, T)
        self.check_rings(T, (layer,))
        w, n = self.windows[layer], self.slots[layer]
        start = max(0, pos0 + 1 - w) if w else 0
        ring = n < self.n_ctx
        put = torch.arange(pos0, end, device=k.device) % n if ring else slice(pos0, end)
        get = torch.arange(start, end, device=k.device) % n if ring else slice(start, end)
        out = []
        for buf, kind, x in ((self.k[layer], self.type_k, k), (self.v[layer], self.type_v, v)):
            x = x.transpose(0, 1)                            # [n_kv, T, D]
            if kind == "q8_0":
                from ..quant.dequant import dequantize
                from ..quant.ref import quantize
                buf[:, put] = quantize(x.float(), GGMLType.Q8_0)
                out.append(dequantize(buf[:, get], GGMLType.Q8_0, x.shape[-1]))
            else:
                buf[:, put] = x.to(buf.dtype)
                out.append(buf[:, get])
        return out[0], out[1], start

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # ---------------------------------------------------------------- saving and restoring (server slots)
    def _saved_slots(self, layer: int) -> int:
        """How many slots of a layer hold what `tokens` says: the positions, or a whole sliding-window ring."""
        return self.slots[layer] if self.slots[layer] < self.n_ctx else len(self.tokens)

    def layout(self) -> dict:
        """What a saved state must match to be restored here (besides the model)."""
        return {"n_ctx": self.n_ctx, "slots": self.slots, "windows": self.windows, "type_k": self.type_k,
                "type_v": self.type_v, "k": [list(t.shape) for t in self.k], "v": [list(t.shape) for t in self.v]}

    def save_state(self) -> tuple[dict[str, torch.Tensor], list[int], int]:
        """(tensors k.i / v.i on the CPU, tokens, hi): what the cache holds, for restore_state."""
        out = {}
        for i in range(len(self.k)):
            n = self._saved_slots(i)
            out[f"k.{i}"] = self.k[i][:, :n].cpu().contiguous()
            out[f"v.{i}"] = self.v[i][:, :n].cpu().contiguous()
        return out, list(self.tokens), self.hi

    def restore_state(self, get, tokens: list[int], hi: int):
        """Put back a saved state; get(name, shape) gives a saved tensor (and may refuse one of another shape
        before reading it). Every tensor is read and checked before any is copied in, so a bad file leaves
        the cache's contents as they were (and its token record empty)."""
        n = len(tokens)
        if not 0 < n <= self.n_ctx or not n <= hi <= self.n_ctx:
            raise HybridMoeError(f"the saved state holds {n} tokens (up to position {hi}); this cache holds "
                                 f"{self.n_ctx}")
        self.tokens = list(tokens)                       # so _saved_slots counts the saved positions
        try:
            loaded = []
            for i in range(len(self.k)):
                m = self._saved_slots(i)
                for name, buf in ((f"k.{i}", self.k[i]), (f"v.{i}", self.v[i])):
                    t = get(name, (buf.shape[0], m, buf.shape[2]))
                    if t.dtype != buf.dtype or tuple(t.shape) != (buf.shape[0], m, buf.shape[2]):
                        raise HybridMoeError(f"the saved state's {name} is {tuple(t.shape)} {t.dtype}, not "
                                             f"{(buf.shape[0], m, buf.shape[2])} {buf.dtype}")
                    loaded.append((buf, m, t))
        except BaseException:
            self.tokens.clear()
            raise
        for buf, m, t in loaded:
            buf[:, :m].copy_(t)
        self.hi = hi
