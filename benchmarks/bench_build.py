"""Compile time of the CPU kernels (kernels/cpu_build.py), into a fresh temporary cache (--keep DIR: into DIR, kept
for later runs, e.g. the tests' HYBRIDMOE_CACHE; a build already there is not timed):

- the build as the first use runs it: every unit of cpu_moe.c compiled in parallel, as many at once as there are
  cores (--jobs N: pinned to N of them), then the link; its wall time and the compilers' CPU time;
- --units: each unit alone, one at a time (so that they do not share cores): its compiler's CPU time (what
  balances the units: wall times follow the machine's load), wall time and code size, costliest first; the
  build's wall time on as many free cores as units is about the costliest one's plus the link.

    python benchmarks/bench_build.py [--units] [--jobs N] [--keep DIR]
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def text_bytes(obj: Path) -> int:
    out = subprocess.run(["size", str(obj)], capture_output=True, text=True, check=True).stdout.splitlines()
    return int(out[1].split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", action="store_true", help="also time each unit alone, one at a time")
    ap.add_argument("--jobs", type=int, default=0, help="run the build on this many cores (default: all)")
    ap.add_argument("--keep", default="", help="build into this cache folder and keep it")
    args = ap.parse_args()
    if args.jobs:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.jobs])
    with tempfile.TemporaryDirectory(prefix="hm-bench-build-") as d:
        os.environ["HYBRIDMOE_CACHE"] = args.keep or d
        from hybridmoe.kernels import cpu_build
        src = cpu_build.source()
        n = int(cpu_build._UNITS.search(src).group(1))
        cc, flags = os.environ.get("CC", "gcc"), cpu_build.cflags()
        print(f"{cc} {' '.join(flags)}; {n} units; {len(os.sched_getaffinity(0))} cores; "
              f"load {os.getloadavg()[0]:.2f} before")
        there = set(cpu_build.cache_dir().glob("*.so"))
        c0, t0 = child_cpu(), time.perf_counter()
        so = cpu_build.build()
        wall, cpu = time.perf_counter() - t0, child_cpu() - c0
        if so in there:
            print(f"build: {so} was there already")
        else:
            print(f"build: {wall:.1f} s wall, {cpu:.1f} s CPU (compilers), {so.stat().st_size / 2**20:.1f} MiB; "
                  f"load {os.getloadavg()[0]:.2f} after")
        if not args.units:
            return
        csrc = Path(d) / "cpu_moe.c"
        csrc.write_bytes(src)
        rows = []
        for i in range(n):
            obj = Path(d) / f"unit{i}.o"
            c0, t0 = child_cpu(), time.perf_counter()
            subprocess.run([cc, *flags, "-c", f"-DHM_UNIT={i}", "-o", str(obj), str(csrc)], check=True)
            rows.append((child_cpu() - c0, time.perf_counter() - t0, i, text_bytes(obj)))
        print("| unit | CPU s | wall s | code KiB |\n| --- | --- | --- | --- |")
        for cpu, wall, i, size in sorted(rows, reverse=True):
            print(f"| {i} | {cpu:.1f} | {wall:.1f} | {size / 1024:.0f} |")
        print(f"sum {sum(r[0] for r in rows):.1f} s CPU; costliest {max(rows)[0]:.1f} s; load "
              f"{os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
