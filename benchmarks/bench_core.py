"""Where the T=1 CPU expert kernel's rate comes from: its stage rates (GB/s of expert bytes, from the
kernel's own per-thread stamps, so no call overhead) with the weights hot in L3 or in RAM,
for 1 thread and for all threads. If a type streams no faster from L3 than from RAM, the kernel is
bound by its instructions, not the memory.

    python benchmarks/bench_core.py [--types Q4_0,Q8_0,Q4_K] [--threads 1,16] [--fp32]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from hybridmoe.kernels import cpu
from hybridmoe.quant.ref import random_blocks
from hybridmoe.quant.types import GGMLType

K_USED = 8


def stage_rates(q, H, F, n_layers, nth, calls=200, seed=0):
    """Median GB/s of stage 1 (gate, up) and stage 2 (down) over `calls` T=1 calls, all K_USED of
    K_USED experts active, rotating over n_layers copies."""
    g = torch.Generator().manual_seed(seed)
    layers = [(random_blocks(q, (K_USED, F, H), g), random_blocks(q, (K_USED, F, H), g),
               random_blocks(q, (K_USED, H, F), g)) for _ in range(n_layers)]
    x, out = torch.randn(1, H, generator=g), torch.empty(1, H)
    ids = torch.arange(K_USED, dtype=torch.int32)[None]
    w = torch.full((1, K_USED), 1.0 / K_USED)
    nb1 = sum(t.numel() for t in layers[0][:2])
    nb2 = layers[0][2].numel()
    for gl, ul, dl in layers:
        cpu.moe_ffn(x, ids, w, gl, ul, dl, q, q, nth, out, impl="kernel")
    cpu.trace(True)
    r1, r2 = [], []
    try:
        for i in range(calls):
            gl, ul, dl = layers[i % n_layers]
            cpu.moe_ffn(x, ids, w, gl, ul, dl, q, q, nth, out, impl="kernel")
            enter, s1, s2, end = cpu.last_trace().unbind(1)
            r1.append(nb1 / float(s1.max() - enter.min()) / 1e9)
            r2.append(nb2 / float(end.max() - s2.min()) / 1e9)
    finally:
        cpu.trace(False)
    return statistics.median(r1), statistics.median(r2), (nb1 + nb2) * n_layers


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K")
    ap.add_argument("--threads", default=f"1,{torch.get_num_threads()}")
    ap.add_argument("--fp32", action="store_true", help="fp32 activations (integer path off)")
    a = ap.parse_args(argv)
    if a.fp32:
        cpu.set_int8(False)
    print("| type | threads | where | working set MiB | gate/up GB/s | GB/s a thread | down GB/s | GB/s a thread |")
    print("|---|---|---|---|---|---|---|---|")
    for name in a.types.split(","):
        q = GGMLType[name]
        for nth in (int(t) for t in a.threads.split(",")):
            # L3: one Qwen3-30B-A3B layer's 8 active experts (~21 MB at Q4_0). RAM: 24 such layers.
            for where, L in (("L3", 1), ("RAM", 24)):
                H, F = 2048, 768
                g1, g2, ws = stage_rates(q, H, F, L, nth)
                print(f"| {name} | {nth} | {where} | {ws / 2**20:.1f} | {g1:.1f} | {g1 / nth:.2f} | {g2:.1f} | "
                      f"{g2 / nth:.2f} |", flush=True)


if __name__ == "__main__":
    main()
