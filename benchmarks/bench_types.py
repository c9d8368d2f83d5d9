"""Per weight type: the CPU expert kernel on one layer of Qwen3-30B-A3B experts (128 experts, 8 active,
hidden 2048, expert width 768, random valid blocks), as a markdown table.

- decode at T=1 and T=8 (random routing, tokens may share experts): GB/s of the type's own bytes read (distinct
  active experts x gate+up+down bytes) and its share of the RAM read bandwidth, measured (perf/calibrate's
  probe) right before and after each row; the target is >= 75% at T=1;
- the prompt rate at T=512 (GFLOP/s of the expert products), and its ratio to Q4_0's in the same run.

Layers of expert tensors are rotated so the weights come from RAM, not cache. --cpu-time (one thread, timed by
its CPU time) is for shared machines, where other programs' load makes wall-clock rates and the read probe noise:
the GB/s it gives are a core's, to hold against a core's share of the read bandwidth.

    python benchmarks/bench_types.py [--types Q4_0,IQ4_XS,Q3_K,Q2_K | issue24] [--threads N] [--layers L]
        [--repeat R] [--batches 1,8,512] [--simd avx2|generic] [--fp32] [--cpu-time]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from hybridmoe.kernels import cpu
from hybridmoe.perf.calibrate import ram_read_now
from hybridmoe.quant.random_blocks import random_blocks
from hybridmoe.quant.types import GGMLType, row_bytes

E, K_USED, H, F = 128, 8, 2048, 768
TYPES = "Q4_0,Q4_K,Q6_K,IQ4_XS,Q3_K,Q2_K"
# --types issue24: every type of issue 24's point 1
ISSUE24 = ("Q2_K,Q3_K,IQ4_XS,IQ4_NL,IQ3_XXS,IQ3_S,IQ2_XXS,IQ2_XS,IQ1_S,IQ1_M,IQ2_K,IQ3_K,IQ4_K,IQ5_K,IQ2_KS,IQ4_KS,"
           "IQ2_KL,IQ2_KT,IQ3_KT,IQ4_KT")


def layer(q: GGMLType, g: torch.Generator):
    """gate, up [E, F, rb(H)], down [E, H, rb(F)]."""
    return (random_blocks(q, E * F, H, g).view(E, F, -1), random_blocks(q, E * F, H, g).view(E, F, -1),
            random_blocks(q, E * H, F, g).view(E, H, -1))


def routes(T: int, g: torch.Generator, n: int = 8):
    out = []
    for _ in range(n):
        ids = torch.stack([torch.randperm(E, generator=g)[:K_USED] for _ in range(T)]).to(torch.int32)
        out.append((ids, torch.softmax(torch.randn(T, K_USED, generator=g), -1)))
    return out


def time_layer(layers, q, T, g, nth, calls, clock=time.perf_counter):
    """Seconds per call (best of 3 rounds) and the weight bytes a call reads."""
    x = torch.randn(T, H, generator=g)
    rs = routes(T, g)
    out = torch.empty(T, H)
    per_expert = 2 * F * row_bytes(q, H) + H * row_bytes(q, F)
    nbytes = statistics.mean(len(torch.unique(r[0])) for r in rs) * per_expert
    cpu.moe_ffn(x, *rs[0], *layers[0], q, q, nth, out)
    best = float("inf")
    for _ in range(3):
        t = clock()
        for i in range(calls):
            ids, w = rs[i % len(rs)]
            cpu.moe_ffn(x, ids, w, *layers[i % len(layers)], q, q, nth, out)
        best = min(best, (clock() - t) / calls)
    return best, nbytes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=TYPES, help="comma-separated, or issue24 (every type of its point 1)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--layers", type=int, default=6, help="copies of the layer to rotate through (RAM, not cache)")
    ap.add_argument("--batches", default="1,8,512")
    ap.add_argument("--repeat", type=int, default=1, help="bracketed attempts per row; the best share is kept")
    ap.add_argument("--simd", default=None, choices=["avx2", "generic"], help="run a lower vector path")
    ap.add_argument("--fp32", action="store_true", help="fp32 activations only (integer path off)")
    ap.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time (shared machines)")
    a = ap.parse_args(argv)
    if a.cpu_time:
        a.threads = 1
    clock = time.thread_time if a.cpu_time else time.perf_counter
    torch.set_num_threads(a.threads)
    if a.simd:
        cpu.set_simd(a.simd)
    if a.fp32:
        cpu.set_int8(False)
    types = [GGMLType[t.strip()] for t in (ISSUE24 if a.types == "issue24" else a.types).split(",")]
    if GGMLType.Q4_0 not in types and "512" in a.batches.split(","):
        types.insert(0, GGMLType.Q4_0)                 # the prompt rate's reference
    batches = [int(b) for b in a.batches.split(",")]
    print(f"kernel: {cpu.simd()}{' (fp32 activations)' if a.fp32 else ''}, tile products: {cpu.tile_mode()}, "
          f"threads {a.threads}, layers {a.layers}{', CPU time' if a.cpu_time else ''}")
    g = torch.Generator().manual_seed(0)
    res = {}
    for q in types:
        base = layer(q, g)
        layers = [tuple(t.clone() for t in base) for _ in range(a.layers)]
        del base
        for T in batches:
            calls = {1: 200, 8: 40}.get(T, 2)
            best = None
            for _ in range(a.repeat):
                bw0 = ram_read_now(2)
                dt, nbytes = time_layer(layers, q, T, g, a.threads, calls, clock)
                bw = (bw0 + ram_read_now(2)) / 2
                if best is None or nbytes / dt / bw > best[1] / best[0] / best[2]:
                    best = (dt, nbytes, bw)
            res[q, T] = best
            dt, nbytes, bw = best
            print(f"  {q.name} T={T}: {dt * 1e3:.3f} ms, {nbytes / dt / 1e9:.1f} GB/s of {bw / 1e9:.1f} read, "
                  f"{2 * T * K_USED * 3 * H * F / dt / 1e9:.0f} GFLOP/s", flush=True)
        del layers
    head = ["type", "bits/weight", "path (T=1)"]
    for T in batches:
        head += [f"T={T} GFLOP/s", "vs Q4_0"] if T >= 64 else [f"T={T} GB/s", "share of read BW"]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for q in types:
        cells = [q.name, f"{8 * row_bytes(q, 256) / 256:.3f}", "integer" if cpu.int8_path(q) else "fp32"]
        for T in batches:
            dt, nbytes, bw = res[q, T]
            if T >= 64:
                rate, base = 1 / dt, 1 / res[GGMLType.Q4_0, T][0]
                cells += [f"{2 * T * K_USED * 3 * H * F * rate / 1e9:.0f}", f"{rate / base:.2f}"]
            else:
                cells += [f"{nbytes / dt / 1e9:.1f}", f"{nbytes / dt / bw * 100:.0f}%"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
