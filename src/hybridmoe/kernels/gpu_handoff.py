"""Flags in pinned host memory between a GPU stream and the CPU, as kernels a CUDA graph can hold: the batched
decode step's polled hand-off of host-expert layers (runtime/steps/gpu_batch.py, cpu.handoff_rows_call).

  publish(flag, step)         flag[0] = step[0] once the host can see every write enqueued before it (the rows'
                              copy to pinned memory ends before this kernel starts; the kernel fences at
                              system scope before its store)
  await_flag(flag, step, err) the stream waits until the host sets flag[0] to step[0] (the host's rows are then
                              in pinned memory); after AWAIT_MAX_POLLS polls err[0] = 1 and the stream goes on,
                              so a host that never comes does not hang the GPU (the host checks err)

step is a device int32 tensor written before the graphs replay, so one captured graph serves every step.
"""
from __future__ import annotations

import torch

from .gpu_attention import on_device
from .gpu_decode import _INTERPRET, AWAIT_MAX_POLLS

try:
    import triton
    import triton.language as tl

    from .gpu_decode import _await_host, _flag_after_writes
except ImportError:                                      # CPU-only installs
    triton = None

if triton is not None:
    @triton.jit
    def _publish_kernel(flag, step, EMU: tl.constexpr):
        _flag_after_writes(flag, step, EMU)

    @triton.jit
    def _await_kernel(flag, step, err, max_polls):
        _await_host(flag, step, err, max_polls)


def publish(flag: torch.Tensor, step: torch.Tensor):
    with on_device(step):
        _publish_kernel[(1,)](flag, step, EMU=_INTERPRET, num_warps=4)


def await_flag(flag: torch.Tensor, step: torch.Tensor, err: torch.Tensor):
    with on_device(step):
        _await_kernel[(1,)](flag, step, err, AWAIT_MAX_POLLS, num_warps=1)
