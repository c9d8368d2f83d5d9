"""All-CPU decode, hybridmoe against llama.cpp's CPU build on the same file, side by side (issue 24, point 4).

Runs `llama-bench -m F -p 0 -n N -t T -r R` and `hybridmoe bench -m F -ngl 0 -p 0 -n N -t T -r R` interleaved
(for each round, each expert type, each vector path: llama.cpp then hybridmoe, so that load from other
programs falls on all of them), prints each run's t/s, then a markdown table: per type and path the median
t/s of each side, hybridmoe's GB/s (weight bytes a token reads x t/s) and the median of the rounds' ratios.

    python benchmarks/vs_llamacpp_cpu.py [--types Q4_0,Q2_K,...] [--paths native,avx512,avx2] [-t 2] [-n 64]
        [-r 3] [--rounds 3] [--cpu-time 16] [--llama-bench BIN] [--llama-lib [PATH=]DIR ...]
        [--hm NAME=SRC_DIR ...] [-m FILE] [--json OUT]

Files: for each type, a 4-layer slice of the Qwen3-30B-A3B shape with a 32000-token vocabulary (benchmarks/
slices.py): experts of that type, the rest Q8_0, written once into the hybridmoe cache (-m FILE: one given
file instead). --types all: Q4_0 and every type of issue 24 that llama.cpp also has, plus Q4_K/Q5_K/Q6_K/Q8_0.

Vector paths (--paths, hybridmoe's kernels built with HYBRIDMOE_KERNEL_CFLAGS, llama.cpp's libggml-cpu.so
from --llama-lib PATH=DIR, put first on llama-bench's library path):
  native  this CPU's best (-march=native), llama.cpp's own build (--llama-bench).
  avx512  AVX-512 without AMX, as Zen 4 has it: -march=native less AMX, AVX-VNNI and AVX512-FP16; llama.cpp
          `cmake -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON
          -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON` (default DIR /tmp/lcpp-avx512/bin).
  avx2    AVX2 only (Zen 2/3, older Intel): less AVX-512 too; llama.cpp the same cmake with -DGGML_AVX512=OFF
          (default DIR /tmp/lcpp-avx2/bin).
  Build one with `cmake --build B --target ggml-cpu`. Where a path's DIR is missing, llama.cpp runs its
  native build in that row, flagged "llama.cpp native" in the table.
Types hybridmoe's C kernels do not read run through its slow path (dequantize into tiles); they are flagged
and run with --slow-n tokens, --slow-reps repetitions on both sides, in the first --slow-rounds rounds.
Before each type's runs the script reads its file, so that both tools find it in the page cache.
--hm NAME=SRC adds a hybridmoe column run from another source tree (PYTHONPATH=SRC), e.g. before=/tmp/base/src.
--cpu-time N0 also runs each tool with -n N0 and gives the CPU ms a generated token costs: (CPU of the -n N run
- CPU of the -n N0 run) / ((N - N0) x reps); at -t 1 it does not depend on how much of a core other programs
leave (at -t > 1 it counts spinning workers too). The 1-minute load average is printed before every run.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

from slices import bytes_per_token, qwen3_slice

# the types of issue 24 point 1 that llama.cpp also has, Q4_0 first, then the common K types as context
ALL_TYPES = ("Q4_0,Q2_K,Q3_K,IQ4_XS,IQ4_NL,IQ3_XXS,IQ3_S,IQ2_XXS,IQ2_XS,IQ1_S,IQ1_M,"
             "Q4_K,Q5_K,Q6_K,Q8_0")
# hybridmoe's kernels built as a CPU of each path builds them: -march=native (this machine) less the rest
PATH_CFLAGS = {
    "native": "",
    "avx512": "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -mno-avxvnni -mno-avx512fp16",
    "avx2": "-mno-avx512f -mno-avxvnni -mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
}
LLAMA_LIB = {"avx512": "/tmp/lcpp-avx512/bin", "avx2": "/tmp/lcpp-avx2/bin"}
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_ts(cmd: list[str], env: dict) -> tuple[float, float]:
    """Mean t/s of one bench run (llama-bench's and hybridmoe's json both give avg_ts), and the CPU seconds
    it used (user + system, all its threads)."""
    c0 = _children_cpu()
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return float(json.loads(r.stdout)[0]["avg_ts"]), _children_cpu() - c0


def with_n(cmd: list[str], n: int) -> list[str]:
    i = cmd.index("-n")
    return cmd[:i + 1] + [str(n)] + cmd[i + 2:]


def read_file(path: str) -> None:
    """Read the file once, so that it is in the page cache for every tool of a round (the slices of all the
    types together may not fit in RAM; the first tool would otherwise pay the disk reads)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 24):
            pass


def has_kernel(src: str, qtype: str) -> bool:
    """Whether the hybridmoe tree at `src` has C kernels for `qtype` (else its slow path runs it)."""
    code = ("import sys; from hybridmoe.kernels.cpu import kernel_type; from hybridmoe.quant.types import GGMLType;"
            f" sys.exit(0 if kernel_type(GGMLType['{qtype}']) is not None else 3)")
    env = dict(os.environ, PYTHONPATH=src)
    return subprocess.run([sys.executable, "-c", code], check=False, env=env).returncode == 0


def llama_libs(specs: list[str], paths: list[str]) -> dict:
    """{path: DIR or None}: --llama-lib PATH=DIR, a plain DIR for the one non-native path, else the default
    DIR where it exists."""
    libs = {p: (LLAMA_LIB[p] if os.path.isdir(LLAMA_LIB.get(p, "")) else None) for p in paths if p != "native"}
    for s in specs:
        p, d = s.split("=", 1) if "=" in s else (None, s)
        if p is None:
            others = [q for q in paths if q != "native"]
            if len(others) != 1:
                raise SystemExit(f"--llama-lib {s}: name the path (PATH=DIR) when --paths has {len(others)} "
                                 "non-native paths")
            p = others[0]
        if p not in libs:
            raise SystemExit(f"--llama-lib {s}: path {p!r} is not in --paths {','.join(paths)}")
        if not os.path.isdir(d):
            raise SystemExit(f"--llama-lib {s}: {d} is not a directory")
        libs[p] = d
    return libs


def table(results: list[dict], names: list[str], cpu_time: bool) -> str:
    hm = [n for n in names if n != "llama.cpp"]
    head = (["type", "path", "MiB a token", "llama.cpp t/s"] + [f"{n} t/s" for n in hm] + [f"{hm[0]} GB/s"] +
            [f"{n} / llama.cpp" for n in hm] + (["CPU ms a token, llama.cpp / " + hm[0]] if cpu_time else []) +
            ["load avg", "note"])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " if i < 2 or i == len(head) - 1 else " ---: "
                                                          for i in range(len(head))) + "|"]
    for r in results:
        ts = {n: statistics.median(x[n] for x in r["rounds"]) for n in names}
        ratio = {n: statistics.median(x[n] / x["llama.cpp"] for x in r["rounds"]) for n in hm}
        cells = [r["type"], r["path"], f"{r['bytes_per_token'] / 2**20:.0f}", f"{ts['llama.cpp']:.1f}"]
        cells += [f"{ts[n]:.1f}" for n in hm] + [f"{ts[hm[0]] * r['bytes_per_token'] / 1e9:.1f}"]
        cells += [f"**{ratio[n]:.2f}x**" if ratio[n] < 1.0 else f"{ratio[n]:.2f}x" for n in hm]
        if cpu_time and r["cpu_ms"]["llama.cpp"]:
            c = {n: statistics.median(r["cpu_ms"][n]) for n in ("llama.cpp", hm[0])}
            cells.append(f"{c['llama.cpp']:.1f} / {c[hm[0]]:.1f} = {c['llama.cpp'] / c[hm[0]]:.2f}x")
        elif cpu_time:
            cells.append("")
        cells.append(f"{min(r['load']):.1f}-{max(r['load']):.1f}")
        cells.append("; ".join(r["notes"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", default="/tmp/lcpp/build/bin/llama-bench", help="llama.cpp's CPU llama-bench")
    ap.add_argument("--llama-lib", action="append", default=[], metavar="[PATH=]DIR",
                    help="llama.cpp's libggml-cpu.so for a vector path (repeatable)")
    ap.add_argument("-m", "--model", default=None, help="one GGUF file (default: the 4-layer slice of each type)")
    ap.add_argument("--types", default="Q4_0", help=f"expert types, comma-separated, or all ({ALL_TYPES})")
    ap.add_argument("--paths", default="native", help="vector paths, comma-separated: native, avx512, avx2")
    ap.add_argument("--simd", default=None, choices=["avx2"], help="the same as --paths avx2")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-n", type=int, default=64, help="tokens generated per repetition (default 64)")
    ap.add_argument("-r", "--reps", type=int, default=3, help="repetitions per run (default 3)")
    ap.add_argument("--slow-n", type=int, default=8, help="-n of the types on hybridmoe's slow path (default 8)")
    ap.add_argument("--slow-reps", type=int, default=1, help="-r of the types on hybridmoe's slow path")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--slow-rounds", type=int, default=1, help="rounds of the slow-path types (default 1)")
    ap.add_argument("--hm", action="append", default=[], metavar="NAME=SRC",
                    help="also run hybridmoe from this source tree (repeatable)")
    ap.add_argument("--cpu-time", type=int, default=0, metavar="N0", help="also give the CPU ms a token costs")
    ap.add_argument("--json", default=None, help="write every run's t/s here")
    args = ap.parse_args()
    paths = ["avx2"] if args.simd else [p.strip() for p in args.paths.split(",")]
    bad = [p for p in paths if p not in PATH_CFLAGS]
    if bad:
        raise SystemExit(f"--paths: unknown path {bad[0]!r} (native, avx512, avx2)")
    types = [t.strip().upper() for t in (ALL_TYPES if args.types == "all" else args.types).split(",")]
    from hybridmoe.quant.types import GGMLType
    bad = [t for t in types if t not in GGMLType.__members__]
    if bad:
        raise SystemExit(f"--types: unknown type {bad[0]!r}")
    libs = llama_libs(args.llama_lib, paths)
    trees = [("hybridmoe", os.path.abspath(SRC))] + [tuple(v.split("=", 1)) for v in args.hm]
    names = ["llama.cpp"] + [n for n, _ in trees]
    if args.model:
        files = {t: args.model for t in types[:1]}
    else:
        files = {t: qwen3_slice(t) for t in types}
    base = dict(os.environ)
    jobs = []
    for t, f in files.items():
        slow = [n for n, src in trees if not has_kernel(src, t)]
        n, reps = (args.slow_n, args.slow_reps) if slow else (args.n, args.reps)
        common = ["-m", f, "-p", "0", "-n", str(n), "-r", str(reps), "-t", str(args.threads), "-o", "json"]
        for p in paths:
            notes = [f"slow path ({', '.join(slow)}; -n {n} -r {reps})"] if slow else []
            lenv = dict(base)
            if p != "native" and libs[p]:
                lenv["LD_LIBRARY_PATH"] = libs[p] + os.pathsep + base.get("LD_LIBRARY_PATH", "")
            elif p != "native":
                notes.append("llama.cpp native")
            tools = [("llama.cpp", [args.llama_bench, *common], lenv)]
            for name, src in trees:
                e = dict(base, PYTHONPATH=src)
                fl = (base.get("HYBRIDMOE_KERNEL_CFLAGS", "") + " " + PATH_CFLAGS[p]).strip()
                if fl:
                    e["HYBRIDMOE_KERNEL_CFLAGS"] = fl
                tools.append((name, [sys.executable, "-m", "hybridmoe", "bench", "-ngl", "0", *common,
                                     "--no-progress"], e))
            jobs.append({"type": t, "path": p, "model": f, "bytes_per_token": bytes_per_token(f), "tools": tools,
                         "n": n, "notes": notes, "slow": bool(slow), "rounds": [],
                         "cpu_ms": {nm: [] for nm in names}, "load": []})
    print(f"-t {args.threads}; types {','.join(files)}; paths {','.join(paths)}; llama.cpp libraries "
          + ", ".join(f"{p} {d or 'native build'}" for p, d in libs.items()), flush=True)
    for rnd in range(args.rounds):
        for j in jobs:
            if j["slow"] and rnd >= args.slow_rounds:
                continue
            read_file(j["model"])
            ts = {}
            j["load"].append(os.getloadavg()[0])
            for name, cmd, e in j["tools"]:
                ts[name], cpu_s = run_ts(cmd, e)
                if args.cpu_time and args.cpu_time < j["n"]:
                    j["cpu_ms"][name].append(1e3 * (cpu_s - run_ts(with_n(cmd, args.cpu_time), e)[1]) /
                                             ((j["n"] - args.cpu_time) * int(cmd[cmd.index("-r") + 1])))
            j["rounds"].append(ts)
            print(f"round {rnd} {j['type']} {j['path']} (load {j['load'][-1]:.1f}): " +
                  ", ".join(f"{n} {v:.1f}" for n, v in ts.items()) + "  ratio " +
                  ", ".join(f"{n} {v / ts['llama.cpp']:.2f}x" for n, v in ts.items() if n != "llama.cpp"),
                  flush=True)
    cpu = any(j["cpu_ms"]["llama.cpp"] for j in jobs)
    print(f"\nmedians over {args.rounds} rounds, -t {args.threads}:\n")
    print(table(jobs, names, cpu))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "n": args.n, "reps": args.reps,
                       "runs": [{k: v for k, v in j.items() if k != "tools"} for j in jobs]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
