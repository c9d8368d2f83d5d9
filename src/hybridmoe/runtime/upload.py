"""Uploads of host-resident experts to a GPU: GGUF bytes, pinned source, copy stream, double buffering.

For prompt processing with experts in RAM, layer i+1's experts upload on a copy stream while layer i
computes (two staging slots per GPU). Only-active uploads copy each run of consecutive selected experts
in one copy, so the bytes moved are exactly the selected experts' bytes.
"""
from __future__ import annotations

import torch


def runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted expert ids -> [(start, stop)) runs of consecutive ids: one copy each."""
    out = []
    for e in ids:
        if out and out[-1][1] == e:
            out[-1][1] = e + 1
        else:
            out.append([e, e + 1])
    return [tuple(r) for r in out]


class _Slot:
    def __init__(self):
        self.bufs = None          # [gate, up, down] device byte tensors
        self.key = None           # (layer, "all") for a prefetched full layer
        self.ready = None         # event: copy done
        self.free = None          # event: compute that read the slot done
        self.fresh = False        # bufs just allocated on the compute stream


class Uploader:
    """Per-GPU staging buffers and a copy stream. Fake GPUs (CPU-backed) get plain copies, same accounting."""

    def __init__(self, dev, stats):
        self.dev, self.stats = dev, stats
        self.real = dev.kind == "cuda" and not dev.fake
        self.stream = torch.cuda.Stream(dev.torch_device) if self.real else None
        self.slots = [_Slot(), _Slot()]
        self.turn = 0

    def _slot_for(self, ws) -> _Slot:
        slot = self.slots[self.turn]
        self.turn ^= 1
        need = [w.raw.shape for w in ws]
        if slot.bufs is None or any(b.shape[1:] != s[1:] or b.shape[0] < s[0] for b, s in zip(slot.bufs, need)):
            slot.bufs = [torch.empty(s, dtype=torch.uint8, device=self.dev.torch_device) for s in need]
            slot.fresh = True
        return slot

    def _copy(self, slot: _Slot, ws, spans, n_experts: int, key):
        """Copy spans [(src_start, src_stop)] of each tensor to the slot, packed from row 0."""
        slot.key = key
        if not self.real:
            for buf, w in zip(slot.bufs, ws):
                j = 0
                for a, b in spans:
                    buf[j:j + b - a].copy_(w.raw[a:b])
                    j += b - a
        else:
            if slot.fresh:
                # new buffers come from the compute stream's pool, maybe from tensors its queued kernels still
                # read: the copy waits for them (once; later reuse is ordered by slot.free)
                self.stream.wait_stream(torch.cuda.current_stream(self.dev.torch_device))
                slot.fresh = False
            with torch.cuda.stream(self.stream):
                if slot.free is not None:
                    self.stream.wait_event(slot.free)          # the compute that read this slot is done
                for buf, w in zip(slot.bufs, ws):
                    j = 0
                    for a, b in spans:
                        buf[j:j + b - a].copy_(w.raw[a:b], non_blocking=True)
                        j += b - a
                    buf.record_stream(self.stream)                # a regrown slot frees it only after the copy
                slot.ready = torch.cuda.Event()
                slot.ready.record(self.stream)
        nbytes = sum(w.raw[0].numel() for w in ws) * n_experts
        self.stats.upload(nbytes, n_experts)
        self.stats.uploads["count"] += len(spans) * len(ws) - 1    # copies, not calls

    def prefetch_all(self, layer: int, ws):
        """Start uploading all experts of `layer` (the next layer) now."""
        if any(s.key == (layer, "all") for s in self.slots):
            return
        slot = self._slot_for(ws)
        self._copy(slot, ws, [(0, ws[0].shape[0])], ws[0].shape[0], (layer, "all"))

    def forget(self):
        """Drop what the slots hold (a policy change): the next use uploads again."""
        for s in self.slots:
            s.key = None

    def has_all(self, layer: int) -> bool:
        """Are all of `layer`'s experts here or on their way (prefetched)?"""
        return any(s.key == (layer, "all") for s in self.slots)

    def get_all(self, layer: int, ws) -> list[torch.Tensor]:
        for s in self.slots:
            if s.key == (layer, "all"):
                return self._use(s)
        slot = self._slot_for(ws)
        self._copy(slot, ws, [(0, ws[0].shape[0])], ws[0].shape[0], (layer, "all"))
        return self._use(slot)

    def get_active(self, layer: int, ws, active: list[int]) -> list[torch.Tensor]:
        slot = self._slot_for(ws)
        self._copy(slot, ws, runs(active), len(active), (layer, "active"))
        return [b[:len(active)] for b in self._use(slot)]

    def _use(self, slot: _Slot) -> list[torch.Tensor]:
        if self.real and slot.ready is not None:
            torch.cuda.current_stream(self.dev.torch_device).wait_event(slot.ready)
        return slot.bufs

    def release(self, bufs):
        """Mark the slot holding `bufs` as read by the compute queued so far."""
        for s in self.slots:
            if s.bufs is not None and s.bufs[0].data_ptr() == bufs[0].data_ptr():
                if self.real:
                    s.free = torch.cuda.Event()
                    s.free.record(torch.cuda.current_stream(self.dev.torch_device))
                if s.key and s.key[1] == "active":
                    s.key = None
