"""Does a GPU reading CPU-resident expert bytes over PCIe add to what the CPU expert kernel streams from RAM,
or take from it? The T=1 C kernel (all of a layer's 8 experts, rotating over 48 layers in a pinned arena)
runs alone, then while the GPU reads other layers' experts in the same arena: by the decode MoE kernel
straight from host memory (zero-copy, `gd.moe` on GGUF rows), or by the copy engine (H2D copies). GB/s of
each side alone and together. If the sum beats the CPU alone, the GPU taking some of a token's CPU experts
speeds hybrid decode up. Usage (GPU machine):

    python3 benchmarks/ram_share.py [--type Q4_0] [--seconds 1.5]
"""
from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl

from hybridmoe.kernels import cpu
from hybridmoe.kernels import gpu_decode as gd
from hybridmoe.quant.ref import random_blocks
from hybridmoe.quant.types import GGMLType
from hybridmoe.runtime.hostmem import Arena, arena_size

H, F, K_USED, LAYERS = 2048, 768, 8, 48


@triton.jit
def _stage_kernel(src, dst, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(dst + i, tl.load(src + i, mask=m), mask=m)


def host_layers(q, n, g, arena):
    out = []
    for _ in range(n):
        out.append(tuple(arena.take(random_blocks(q, shape, g)) for shape in ((K_USED, F, H), (K_USED, F, H),
                                                                               (K_USED, H, F))))
    return out


def cpu_loop(q, layers, seconds=None, until=None):
    """T=1 calls over the layers until `seconds` pass or until() is true: GB/s of expert bytes."""
    x, out = torch.randn(1, H), torch.empty(1, H)
    ids = torch.arange(K_USED, dtype=torch.int32)[None]
    w = torch.full((1, K_USED), 1.0 / K_USED)
    nb = sum(t.numel() for t in layers[0])
    n, t0 = 0, time.perf_counter()
    while True:
        gl, ul, dl = layers[n % len(layers)]
        cpu.moe_ffn(x, ids, w, gl, ul, dl, q, q, None, out, impl="kernel")
        n += 1
        dt = time.perf_counter() - t0
        if (seconds is not None and dt >= seconds) or (until is not None and until()):
            return n * nb / dt / 1e9


def gpu_work(q, layers, kg, mode):
    """A CUDA graph of one pass over the layers on the GPU, and the bytes it reads from host memory."""
    dev = torch.device("cuda")
    x = torch.randn(1, H, device=dev)
    ids = torch.arange(kg, dtype=torch.int32, device=dev)[None]
    wts = torch.full((1, kg), 1.0 / kg, device=dev)
    if mode == "zero-copy":
        def one(gl, ul, dl):
            gd.moe(x, ids, wts, gl, ul, dl, q, q)
        nb = kg * sum(t[0].numel() for t in layers[0])
    elif mode.startswith("stage"):                      # a kernel copies them to VRAM with wide loads
        _, block, warps = mode.split(":")
        stage = [torch.empty_like(t[:kg], device=dev) for t in layers[0]]

        def one(gl, ul, dl):
            for s, t in zip(stage, (gl, ul, dl)):
                n = s.numel() // 4
                _stage_kernel[(triton.cdiv(n, int(block)),)](t.view(torch.int32), s.view(torch.int32), n,
                                                             BLOCK=int(block), num_warps=int(warps))
        nb = kg * sum(t[0].numel() for t in layers[0])
    else:                                               # copy engine: kg experts' bytes a layer to VRAM
        stage = [torch.empty_like(t[:kg], device=dev) for t in layers[0]]

        def one(gl, ul, dl):
            for s, t in zip(stage, (gl, ul, dl)):
                s.copy_(t[:kg], non_blocking=True)
        nb = kg * sum(t[0].numel() for t in layers[0])
    for lay in layers[:2]:                               # compile, warm
        one(*lay)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for lay in layers:
            one(*lay)
    return graph, nb * len(layers)


def gpu_rate(graph, nbytes, reps):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    return a, b, lambda: nbytes * reps / (a.elapsed_time(b) * 1e-3) / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--type", default="Q4_0")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--kg", default="1,2,4,8", help="experts a layer the GPU reads")
    ap.add_argument("--modes", default="zero-copy,copy engine,stage:2048:4,stage:8192:8,stage:1024:4")
    a = ap.parse_args(argv)
    q = GGMLType[a.type]
    g = torch.Generator().manual_seed(0)
    shapes = [(K_USED, F, H), (K_USED, F, H), (K_USED, H, F)]
    probe = [random_blocks(q, s, g) for s in shapes]
    arena = Arena(2 * LAYERS * arena_size(probe))
    cpu_layers, gpu_layers = host_layers(q, LAYERS, g, arena), host_layers(q, LAYERS, g, arena)
    print(f"arena {arena.nbytes / 2**30:.2f} GiB, huge pages {arena.huge}, pinned {arena.pin()}, "
          f"threads {torch.get_num_threads()}")
    cpu_loop(q, cpu_layers, 0.3)
    alone = [cpu_loop(q, cpu_layers, a.seconds) for _ in range(2)]
    print(f"CPU kernel alone: {alone[0]:.1f}, {alone[1]:.1f} GB/s")
    print("| GPU reads by | experts a layer | GPU alone GB/s | CPU together | GPU together | sum | sum / CPU alone |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode in a.modes.split(","):
        for kg in [int(v) for v in a.kg.split(",")]:
            try:
                graph, nb = gpu_work(q, gpu_layers, kg, mode)
            except Exception as e:                      # noqa: BLE001 - report what this GPU refuses
                print(f"| {mode} | {kg} | {type(e).__name__}: {str(e)[:120]} | | | | |")
                continue
            graph.replay()
            torch.cuda.synchronize()
            s, e, rate = gpu_rate(graph, nb, 3)
            torch.cuda.synchronize()
            g_alone = rate()
            reps = max(2, int(a.seconds * g_alone * 1e9 / nb))
            cpu_before = cpu_loop(q, cpu_layers, a.seconds / 2)
            s, e, rate = gpu_rate(graph, nb, reps)
            c_tog = cpu_loop(q, cpu_layers, until=e.query)
            torch.cuda.synchronize()
            g_tog = rate()
            base = (cpu_before + alone[0]) / 2
            print(f"| {mode} | {kg} | {g_alone:.1f} | {c_tog:.1f} | {g_tog:.1f} | {c_tog + g_tog:.1f} | "
                  f"{(c_tog + g_tog) / base:.2f} (CPU just before: {cpu_before:.1f}) |")


if __name__ == "__main__":
    main()
