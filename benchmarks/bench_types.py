"""Per weight type: the CPU expert kernel on one layer of Qwen3-30B-A3B experts (128 experts, 8 active,
hidden 2048, expert width 768, random valid blocks), as a markdown table.

- decode at T=1 and T=8 (random routing, tokens may share experts): GB/s of the type's own bytes read (distinct
  active experts x gate+up+down bytes) and its share of the RAM read bandwidth, measured (perf/calibrate's
  probe) right before and after each row; the target is >= 75% at T=1;
- the prompt rate at T=512 (GFLOP/s of the expert products), and its ratio to Q4_0's in the same run.

Layers of expert tensors are rotated so the weights come from RAM, not cache. --cpu-time (one thread, timed by
its CPU time) is for shared machines, where other programs' load makes wall-clock rates and the read probe noise:
the GB/s it gives are a core's, to hold against a core's share of the read bandwidth (no probe runs; the table
gives each type's rate against Q4_0's instead).

    python benchmarks/bench_types.py [--types Q4_0,IQ4_XS,Q3_K,Q2_K | issue24] [--threads N] [--layers L]
        [--repeat R] [--batches 1,8,512] [--simd avx2|generic] [--fp32] [--cpu-time] [--act-terms 2,1]

--act-terms 2,1 runs every row once per forced activation-term count (cpu.set_act_terms; 0: the per-type rule),
alternating in the same process on the same layers, and adds each count's columns (the default: the rule only).
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
    ap.add_argument("--types", default=TYPES, help="comma-separated; issue24 stands for every type of its point 1")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--layers", type=int, default=6, help="copies of the layer to rotate through (RAM, not cache)")
    ap.add_argument("--batches", default="1,8,512")
    ap.add_argument("--repeat", type=int, default=1, help="bracketed attempts per row; the best share is kept")
    ap.add_argument("--simd", default=None, choices=["avx2", "generic"], help="run a lower vector path")
    ap.add_argument("--fp32", action="store_true", help="fp32 activations only (integer path off)")
    ap.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time (shared machines)")
    ap.add_argument("--act-terms", default="", help="e.g. 2,0: each row under each activation-term count "
                                                    "(1, 2 forced; 0 the per-type rule)")
    a = ap.parse_args(argv)
    if a.cpu_time:
        a.threads = 1
    clock = time.thread_time if a.cpu_time else time.perf_counter
    torch.set_num_threads(a.threads)
    if a.simd:
        cpu.set_simd(a.simd)
    if a.fp32:
        cpu.set_int8(False)
    names = [t.strip() for t in a.types.replace("issue24", ISSUE24).split(",")]
    if bad := [t for t in names if t not in GGMLType.__members__]:
        ap.error(f"--types: unknown type(s) {', '.join(bad)}")
    types = list(dict.fromkeys(GGMLType[t] for t in names))
    if GGMLType.Q4_0 not in types and "512" in a.batches.split(","):
        types.insert(0, GGMLType.Q4_0)                 # the prompt rate's reference
    batches = [int(b) for b in a.batches.split(",")]
    terms = [int(n) for n in a.act_terms.split(",") if n] or [0]      # 0: the per-type rule
    if any(n not in (0, 1, 2) for n in terms):
        ap.error(f"--act-terms {a.act_terms}: give 1, 2 or both (1,2)")
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
            best = {}
            for _ in range(a.repeat):
                for n in terms:                          # alternated, so drifts in load hit every count alike
                    prev = cpu.set_act_terms(n) if n else None
                    try:
                        probe = (lambda: float("nan")) if a.cpu_time else (lambda: ram_read_now(2))
                        bw0 = probe()
                        dt, nbytes = time_layer(layers, q, T, g, a.threads, calls, clock)
                        bw = (bw0 + probe()) / 2
                    finally:
                        if n:
                            cpu.set_act_terms(prev)
                    b = best.get(n)
                    # a core's CPU time needs no probe: the fastest repeat; wall time: the best share of the probe
                    if b is None or (dt < b[0] if a.cpu_time else nbytes / dt / bw > b[1] / b[0] / b[2]):
                        best[n] = (dt, nbytes, bw)
            for n in terms:
                res[q, T, n] = dt, nbytes, bw = best[n]
                tag = (f" terms={n}" if n else " rule") if len(terms) > 1 else ""
                read = "" if a.cpu_time else f" of {bw / 1e9:.1f} read"
                print(f"  {q.name} T={T}{tag}: {dt * 1e3:.3f} ms, {nbytes / dt / 1e9:.1f} GB/s{read}, "
                      f"{2 * T * K_USED * 3 * H * F / dt / 1e9:.0f} GFLOP/s", flush=True)
        del layers
    head = ["type", "bits/weight", "path (T=1)"]
    for T in batches:
        for n in terms:
            tag = (f", {n} term{'s' * (n > 1)}" if n else ", rule") if len(terms) > 1 else ""
            head += ([f"T={T}{tag} GFLOP/s", "vs Q4_0"] if T >= 64 else
                     [f"T={T}{tag} GB/s", "vs Q4_0" if a.cpu_time else "share of read BW"])
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for q in types:
        cells = [q.name, f"{8 * row_bytes(q, 256) / 256:.3f}", "integer" if cpu.int8_path(q) else "fp32"]
        for T in batches:
            for n in terms:
                dt, nbytes, bw = res[q, T, n]
                q40 = res.get((GGMLType.Q4_0, T, n))
                if T >= 64:
                    rate, base = 1 / dt, 1 / q40[0]
                    cells += [f"{2 * T * K_USED * 3 * H * F * rate / 1e9:.0f}", f"{rate / base:.2f}"]
                elif a.cpu_time:                         # a core's rate: held against Q4_0's, not the probe
                    cells += [f"{nbytes / dt / 1e9:.2f}", f"{nbytes / dt / (q40[1] / q40[0]):.2f}" if q40 else ""]
                else:
                    cells += [f"{nbytes / dt / 1e9:.1f}", f"{nbytes / dt / bw * 100:.0f}%"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
