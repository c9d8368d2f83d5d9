"""Host memory for CPU-resident expert weights: one anonymous arena, 2 MiB-aligned, pinned for uploads.

With a GPU that uploads CPU experts, their bytes must be page-locked for full-speed asynchronous copies.
One arena registered once with cudaHostRegister replaces a cudaHostAlloc per tensor, and its pages are
advised MADV_HUGEPAGE before first touch (Linux transparent huge pages in `madvise` or `always` mode), so
the ~1 GB a token the CPU expert kernel streams crosses a TLB entry every 2 MiB instead of every 4 KiB.
On the GPU machine that made no difference beyond the VMs' noise (bench_kernels.py --alloc, 2026-11-24:
T=1 Q4_0 at 75-92% of the read bandwidth on every kind of memory, docs/benchmarks.md), so without a GPU
the weights stay memory-mapped unless HYBRIDMOE_HOST_ARENA=1 (weights.load_weights).
"""
from __future__ import annotations

import mmap
import weakref

import torch

HUGE = 2 << 20
ALIGN = 4096          # each tensor starts on its own 4 KiB page: rows stay aligned for the kernels
_REGISTERED: dict[int, int] = {}      # start -> end of every arena registered with CUDA (and still alive)


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (always / madvise / never), or 'unknown'."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else "unknown"


def is_pinned(t: torch.Tensor) -> bool:
    """Whether t's bytes are page-locked for the GPU (readable by it over the bus): pinned by torch, or in a
    registered arena. (Tensor.is_pinned asks about the storage's first byte: an arena's mapping starts
    before its registered, 2 MiB-aligned part.)"""
    if t.is_cuda:
        return False
    p = t.data_ptr()
    if any(a <= p and p + t.numel() * t.element_size() <= b for a, b in _REGISTERED.items()):
        return True
    return t.is_pinned()


def _unregister(ptr: int) -> None:
    _REGISTERED.pop(ptr, None)
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:   # interpreter shutdown, CUDA already torn down: nothing left to release
        pass


class Arena:
    """`nbytes` of host memory handed out by `take`; the views it returns keep the mapping (and its
    CUDA registration) alive, the Arena object itself need not be kept."""

    def __init__(self, nbytes: int, huge: bool = True):
        self.nbytes = max(int(nbytes), 1)
        self._mm = mmap.mmap(-1, self.nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge = False
        if huge and hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise"):
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE)
                self.huge = True
            except OSError:
                pass
        whole = torch.frombuffer(self._mm, dtype=torch.uint8)
        off = (-whole.data_ptr()) % HUGE
        self.buf = whole[off:off + self.nbytes]
        self.used = 0
        self.pinned = False

    def take(self, src: torch.Tensor) -> torch.Tensor:
        """A copy of the CPU tensor `src` (any dtype, made contiguous) placed in the arena."""
        n = src.numel() * src.element_size()
        start = -(-self.used // ALIGN) * ALIGN
        if start + n > self.nbytes:
            raise ValueError(f"arena of {self.nbytes} bytes is full ({start} used, {n} asked)")
        self.used = start + n
        dst = self.buf[start:start + n].view(src.dtype).view(src.shape)
        dst.copy_(src)
        return dst

    def pin(self) -> bool:
        """Register the arena with CUDA (page-locked: full-speed, asynchronous uploads). False if refused."""
        if self.pinned:
            return True
        ptr = self.buf.data_ptr()
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, 0)
        if int(err) != 0:
            return False
        self.pinned = True
        _REGISTERED[ptr] = ptr + self.nbytes
        weakref.finalize(self._mm, _unregister, ptr)   # when the last view of the mapping is gone
        return True


def arena_size(tensors) -> int:
    """Bytes an arena needs to `take` each of `tensors` (page-aligned starts)."""
    return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)
