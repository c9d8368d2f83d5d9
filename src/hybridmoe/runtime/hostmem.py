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

import ctypes
import mmap
import os
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


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _release(base: int, size: int, ptr: int) -> None:
    """An arena's end, when the last view of it is gone: its CUDA registration (where pin made one) first, then
    its pages (a range unmapped while registered stays registered, and the next mapping there can't be)."""
    if _REGISTERED.pop(ptr, None) is not None:
        try:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        except Exception:   # noqa: BLE001 - CUDA torn down: nothing left to release
            pass
    _libc.munmap(base, size)


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a call that failed on purpose-free grounds (a refused
    registration): left set, torch's next kernel-launch check would raise it as its own."""
    try:
        with open("/proc/self/maps") as f:
            path = next((ln.split()[-1] for ln in f if "libcudart.so" in ln), None)
        if path:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass


class Arena:
    """`nbytes` of host memory handed out by `take`; the views it returns keep the mapping (and its
    CUDA registration) alive, the Arena object itself need not be kept."""

    def __init__(self, nbytes: int, huge: bool = True):
        self.nbytes = max(int(nbytes), 1)
        size = self.nbytes + HUGE
        base = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                          -1, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise MemoryError(f"could not map {size} bytes of host memory ({os.strerror(ctypes.get_errno())})")
        self.huge = False
        if huge and hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise"):
            self.huge = _libc.madvise(base, size, mmap.MADV_HUGEPAGE) == 0
        off = (-base) % HUGE
        mem = (ctypes.c_uint8 * self.nbytes).from_address(base + off)
        # when the last view is gone; not at interpreter exit, where a daemon thread may still read the weights
        # (the process's end releases both)
        weakref.finalize(mem, _release, base, size, base + off).atexit = False
        self._mem = mem
        self.buf = torch.frombuffer(mem, dtype=torch.uint8)
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
            _clear_cuda_error()
            return False
        self.pinned = True
        _REGISTERED[ptr] = ptr + self.nbytes
        return True


def arena_size(tensors) -> int:
    """Bytes an arena needs to `take` each of `tensors` (page-aligned starts)."""
    return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)
