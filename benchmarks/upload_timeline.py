"""Where a prompt's time goes when host experts are uploaded (GPU machine): one prompt, as `bench` runs it (after
warm-ups), under torch.profiler; from its trace: wall time, the copy engine's busy time and GB/s, the kernels'
busy time, how much of the copies overlapped kernels, the copy stream's longest idle gaps (and the host calls
that ran during them), and the host's longest CUDA runtime calls (a synchronous copy from pageable memory shows
as a cudaMemcpyAsync as long as the copy).

    python3 benchmarks/upload_timeline.py MODEL [-ot REGEX=DEV ...] [--n-cpu-moe N] [-p 512] [-r 3] [--profiled 1]
        [--trace FILE] [--like-bench]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

import hybridmoe
from hybridmoe.commands import bench
from hybridmoe.commands.common import freeze_heap


def union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(iv) -> float:
    return sum(b - a for a, b in iv)


def intersect(xs, ys) -> float:
    i = j = 0
    tot = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        tot += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return tot


def gpu_work(events: list[dict]) -> list[dict]:
    """The trace's GPU events: kernels, copies, memsets."""
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


def report(events: list[dict], wall_ms: float):
    gpu = gpu_work(events)
    h2d = [e for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]]
    kern = [e for e in gpu if e["cat"] == "kernel"]
    rt = [e for e in events if e.get("cat") == "cuda_runtime" and "dur" in e]
    if not gpu:
        print(f"wall {wall_ms:.1f} ms; no GPU activity in the trace")
        return
    t0 = min(e["ts"] for e in gpu + rt)
    cu = union([(e["ts"] - t0, e["ts"] - t0 + e["dur"]) for e in h2d])
    ku = union([(e["ts"] - t0, e["ts"] - t0 + e["dur"]) for e in kern])
    nbytes = sum(e.get("args", {}).get("bytes", 0) for e in h2d)
    print(f"wall {wall_ms:.1f} ms; trace span {(max(e['ts'] + e['dur'] for e in gpu) - t0) / 1e3:.1f} ms")
    print(f"HtoD copies: {len(h2d)}, {nbytes / 1e9:.2f} GB, busy {length(cu) / 1e3:.1f} ms "
          f"({nbytes / max(length(cu), 1e-9) / 1e3:.1f} GB/s while busy)")
    big = [e for e in h2d if e.get("args", {}).get("bytes", 0) >= 1 << 20]
    if big:
        rates = sorted(e["args"]["bytes"] / e["dur"] / 1e3 for e in big)
        print(f"  copies >= 1 MiB: {len(big)}, GB/s min {rates[0]:.1f} median {rates[len(rates) // 2]:.1f} "
              f"max {rates[-1]:.1f}; kinds {sorted({e['name'] for e in big})}")
    print(f"kernels: {len(kern)}, busy {length(ku) / 1e3:.1f} ms; overlap with copies {intersect(cu, ku) / 1e3:.1f} ms")
    gaps = sorted(((b[0] - a[1], a[1], b[0]) for a, b in zip(cu, cu[1:])), reverse=True)[:8]
    print("copy engine's longest idle gaps (ms at, length, host runtime calls inside > 50 us):")
    for g, a, b in gaps:
        inside = [e for e in rt if a <= e["ts"] - t0 <= b and e["dur"] > 50]
        calls = ", ".join(f"{e['name']} {e['dur'] / 1e3:.2f}" for e in inside[:4])
        kb = intersect([(a, b)], ku)
        print(f"  at {a / 1e3:7.2f}: {g / 1e3:6.2f} ms (kernels busy {kb / 1e3:.2f}) {calls}")
    print("host's longest CUDA runtime calls:")
    by: dict[str, list[float]] = {}
    for e in rt:
        by.setdefault(e["name"], []).append(e["dur"])
    for name, ds in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"  {name}: {len(ds)} calls, {sum(ds) / 1e3:.2f} ms, longest {max(ds) / 1e3:.2f} ms")


def idle_report(events: list[dict], rep: dict, label: str):
    """One repetition (its record_function event): wall, and each stretch over 2 ms where the GPU did nothing
    (no kernel, no copy), with the outermost CPU ops that ran in it."""
    a0, a1 = rep["ts"], rep["ts"] + rep["dur"]
    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in gpu_work(events) if e["ts"] < a1 and e["ts"] + e["dur"] > a0])
    idle, t = [], a0
    for b0, b1 in busy + [(a1, a1)]:
        if b0 - t > 2000:
            idle.append((t, min(b0, a1)))
        t = max(t, b1)
    ops = [e for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation") and "dur" in e
           and e.get("name") != "rep"]
    print(f"{label}: wall {rep['dur'] / 1e3:.1f} ms, GPU busy {length(busy) / 1e3:.1f} ms; idle stretches > 2 ms:"
          + ("" if idle else " none"))
    for i0, i1 in idle:
        inside = [e for e in ops if e["ts"] < i1 and e["ts"] + e["dur"] > i0]
        outer = [e for e in inside if not any(o is not e and o["ts"] <= e["ts"] and
                                              o["ts"] + o["dur"] >= e["ts"] + e["dur"] for o in inside)]
        names = ", ".join(f"{e['name']} {e['dur'] / 1e3:.2f}" for e in sorted(outer, key=lambda e: -e["dur"])[:5])
        print(f"  at {(i0 - a0) / 1e3:7.2f} ms: {(i1 - i0) / 1e3:6.2f} ms; host: {names or '(no op recorded)'}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("-ot", action="append", default=[])
    ap.add_argument("--n-cpu-moe", type=int, default=0)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-r", type=int, default=3, help="unprofiled repetitions (after two warm-ups)")
    ap.add_argument("--trace", help="also write the chrome trace here")
    ap.add_argument("--profiled", type=int, default=1, help="profiled repetitions (default 1)")
    ap.add_argument("--like-bench", action="store_true", help="load and run the model as `bench` does")
    a = ap.parse_args()
    if a.like_bench:
        # as `bench -m MODEL -ngl 99 [-ot ..] [-ncmoe N] -p P -n 0` loads and runs it
        bp = argparse.ArgumentParser()
        bench.setup_arg_parser(bp)
        bargs = bp.parse_args(["-m", a.model, "-ngl", "99", "-p", str(a.p), "-n", "0", "-ncmoe", str(a.n_cpu_moe)]
                              + [x for ot in a.ot for x in ("-ot", ot)])
        p = bench.parameter_sets(bargs)[0][0]
        m = hybridmoe.load(a.model, **bench.load_kwargs([p], a.p))
        freeze_heap()
        threads = torch.get_num_threads()
        bench.apply_runtime(m, p, threads)
    else:
        m = hybridmoe.load(a.model, n_gpu_layers=99, ctx_size=a.p + 16, override_tensor=a.ot, n_cpu_moe=a.n_cpu_moe)
    once = bench.prepare_test(m, a.p, 0, 0, 1234 if a.like_bench else 1)
    for _ in range(2):
        once(0)
    times = []
    for _ in range(a.r):
        if a.like_bench:
            bench.apply_runtime(m, p, threads)
        t = time.perf_counter()
        once(0)
        times.append((time.perf_counter() - t) * 1e3)
    med = sorted(times)[len(times) // 2]
    print(f"{a.model} {' '.join(a.ot)} n_cpu_moe={a.n_cpu_moe}: pp{a.p} median {med:.1f} ms ({a.p / med * 1e3:.0f} "
          f"t/s) unprofiled, each {' '.join(f'{t:.1f}' for t in times)}; uploads {m.stats.uploads}")
    from torch.profiler import ProfilerActivity, profile, record_function
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.profiled):
            t = time.perf_counter()
            with record_function("rep"):
                once(0)
            walls.append((time.perf_counter() - t) * 1e3)
    path = a.trace or tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    # the host's record of each repetition (the trace also holds GPU-side copies of the annotation)
    reps = sorted((e for e in events if e.get("name") == "rep" and e.get("cat") == "user_annotation" and "dur" in e),
                  key=lambda e: e["ts"])[:len(walls)]
    slow = max(range(len(reps)), key=lambda i: reps[i]["dur"]) if reps else 0
    for i, r in enumerate(reps):
        idle_report(events, r, f"profiled rep {i + 1}")
    if reps:
        a0, a1 = reps[slow]["ts"], reps[slow]["ts"] + reps[slow]["dur"]
        print(f"the slowest profiled rep ({slow + 1}):")
        report([e for e in events if "ts" in e and a0 <= e["ts"] <= a1], walls[slow])
    if not a.trace:
        os.unlink(path)


if __name__ == "__main__":
    main()
