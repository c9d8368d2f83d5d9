"""All-CPU decode, hybridmoe against llama.cpp's CPU build on the same file, side by side (issue 24, point 4).

Runs `llama-bench -m F -p 0 -n N -t T -r R` and `hybridmoe bench -m F -ngl 0 -p 0 -n N -t T -r R` interleaved
(A B A B ..., several rounds, so that load from other programs falls on both), prints each round's t/s and
the ratio hybridmoe / llama.cpp, and the median ratio over the rounds.

    python benchmarks/vs_llamacpp_cpu.py [--llama-bench /tmp/lcpp/build/bin/llama-bench] [--type Q4_0]
        [-m FILE] [-t 2] [-n 64] [-r 3] [--rounds 5] [--simd avx2] [--llama-lib DIR]
        [--hm NAME=SRC_DIR ...] [--json OUT]

Without -m it writes (once, into the hybridmoe cache) a 4-layer slice of the Qwen3-30B-A3B shape with a
32000-token vocabulary: experts of --type (Q4_0 by default), the rest Q8_0. --simd avx2 builds hybridmoe's
kernels as a CPU with AVX2 and without AVX-512, AVX-VNNI or AMX builds them (HYBRIDMOE_KERNEL_CFLAGS, e.g.
Zen 2/3); --llama-lib DIR puts DIR first on llama-bench's library path, e.g. the libggml-cpu.so of
`cmake -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
-DGGML_AVX512=OFF` (`cmake --build B --target ggml-cpu`; llama-bench finds it first through LD_LIBRARY_PATH).
--hm NAME=SRC adds a hybridmoe row run from another source tree (PYTHONPATH=SRC), e.g. before=/path/main/src,
so that a change is measured against its base in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

from slices import bytes_per_token, slice_model

# what an AVX2 CPU without AVX-512 / AVX-VNNI / AMX compiles: -march=native less those
AVX2_CFLAGS = "-mno-avx512f -mno-avxvnni -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_ts(cmd: list[str], env: dict) -> tuple[float, float]:
    """Mean t/s of one bench run (llama-bench's and hybridmoe's json both give avg_ts), and the CPU seconds
    it used (user + system, all its threads)."""
    c0 = _children_cpu()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return float(json.loads(r.stdout)[0]["avg_ts"]), _children_cpu() - c0


def with_n(cmd: list[str], n: int) -> list[str]:
    i = cmd.index("-n")
    return cmd[:i + 1] + [str(n)] + cmd[i + 2:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", default="/tmp/lcpp/build/bin/llama-bench", help="llama.cpp's CPU llama-bench")
    ap.add_argument("--llama-lib", default=None, metavar="DIR", help="put DIR first on llama-bench's library path")
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the 4-layer slice of --type)")
    ap.add_argument("--type", default="Q4_0", help="expert type of the default slice (Q4_0, Q8_0, Q4_K, Q6_K, ...)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-n", type=int, default=64, help="tokens generated per repetition (default 64)")
    ap.add_argument("-r", "--reps", type=int, default=3, help="repetitions per run (default 3)")
    ap.add_argument("--rounds", type=int, default=5, help="A B rounds (default 5)")
    ap.add_argument("--simd", default=None, choices=["avx2"], help="hybridmoe's kernels built for AVX2 only")
    ap.add_argument("--hm", action="append", default=[], metavar="NAME=SRC",
                    help="also run hybridmoe from this source tree (repeatable)")
    ap.add_argument("--cpu-time", type=int, default=0, metavar="N0",
                    help="also run each tool with -n N0 and give the CPU ms a generated token costs: (CPU of the "
                         "-n N run - CPU of the -n N0 run) / ((N - N0) x reps); at -t 1 it does not depend on how "
                         "much of a core other programs leave (at -t > 1 it counts the workers' spinning too)")
    ap.add_argument("--json", default=None, help="write every round's t/s here")
    args = ap.parse_args()
    if args.model is None:
        from hybridmoe.env import cache_dir
        d = cache_dir() / "models"
        d.mkdir(parents=True, exist_ok=True)
        args.model = slice_model(str(d / f"qwen3-30b-a3b-4l-{args.type.lower()}.gguf"), 32000,
                                 f"qwen3-30b-a3b-4l-{args.type.lower()}", args.type)
    bpt = bytes_per_token(args.model)

    base = dict(os.environ)
    lenv = dict(base)
    if args.llama_lib:
        lenv["LD_LIBRARY_PATH"] = args.llama_lib + os.pathsep + base.get("LD_LIBRARY_PATH", "")
    common = ["-m", args.model, "-p", "0", "-n", str(args.n), "-r", str(args.reps), "-t", str(args.threads),
              "-o", "json"]
    tools = [("llama.cpp", [args.llama_bench, *common], lenv)]
    hm_cmd = [sys.executable, "-m", "hybridmoe", "bench", "-ngl", "0", *common, "--no-progress"]
    for name, src in [("hybridmoe", os.path.abspath(SRC))] + [v.split("=", 1) for v in args.hm]:
        e = dict(base, PYTHONPATH=src)
        if args.simd:
            e["HYBRIDMOE_KERNEL_CFLAGS"] = (base.get("HYBRIDMOE_KERNEL_CFLAGS", "") + " " + AVX2_CFLAGS).strip()
        tools.append((name, hm_cmd, e))
    print(f"model {args.model}: {bpt / 2**20:.1f} MiB of weights read a token; -t {args.threads}"
          f"{', hybridmoe simd ' + args.simd if args.simd else ''}", flush=True)
    rows = []
    cpu_ms = {name: [] for name, _, _ in tools}
    for rnd in range(args.rounds):
        ts = {}
        for name, cmd, e in tools:
            ts[name], cpu_s = run_ts(cmd, e)
            if args.cpu_time:
                cpu_ms[name].append(1e3 * (cpu_s - run_ts(with_n(cmd, args.cpu_time), e)[1]) /
                                    ((args.n - args.cpu_time) * args.reps))
        rows.append(ts)
        print(f"round {rnd}: " + ", ".join(f"{n} {v:.1f}" for n, v in ts.items()) + "  ratio " +
              ", ".join(f"{n} {v / ts['llama.cpp']:.2f}x" for n, v in ts.items() if n != "llama.cpp") +
              ("  CPU ms/token " + ", ".join(f"{n} {v[-1]:.2f}" for n, v in cpu_ms.items()) if args.cpu_time else ""),
              flush=True)
    print("median t/s: " + ", ".join(f"{n} {statistics.median(r[n] for r in rows):.1f} "
                                     f"({statistics.median(r[n] for r in rows) * bpt / 1e9:.1f} GB/s)"
                                     for n, _, _ in tools))
    print("median ratio: " + ", ".join(f"{n} {statistics.median(r[n] / r['llama.cpp'] for r in rows):.2f}x"
                                       for n, _, _ in tools[1:]))
    if args.cpu_time:
        med = {n: statistics.median(v) for n, v in cpu_ms.items()}
        print("median CPU ms a token: " + ", ".join(f"{n} {v:.2f}" for n, v in med.items()) + "; llama.cpp's / "
              + ", ".join(f"{n}'s {med['llama.cpp'] / v:.2f}x" for n, v in med.items() if n != "llama.cpp"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, bytes_per_token=bpt, threads=args.threads, simd=args.simd,
                           rounds=rows, cpu_ms=cpu_ms if args.cpu_time else None), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
