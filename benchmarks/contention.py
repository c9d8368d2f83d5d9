"""All-CPU decode when other programs keep cores busy (issue 25, point 4: "thread collapse"), hybridmoe against
llama.cpp's CPU build on the same file.

On the 2-core dev VM with other programs busy, decode at the default thread count once fell to 4% of the RAM's
bandwidth and swung 100x between runs, while -t 1 was steady: OpenMP workers that spin while their core is
taken. This runs `hybridmoe bench -p 0 -n N -t T` and `llama-bench -p 0 -n N -t T` (the same tg test), idle and
with busy loops on half the cores (bounded by a deadline, killed at the end), and prints one table: t/s median
and range over the repetitions, the swing (max / min), and the share of the idle RAM read bandwidth that the
median reaches (bytes a token reads: the non-expert weights, k/E of the experts, one embedding row).

    python benchmarks/contention.py --llama-bench /tmp/lcpp/build/bin/llama-bench [-m FILE] [-n 64] [-r 5]
        [--threads 1,2] [--hm-variant GOMP_SPINCOUNT=300000] [--rounds 2] [--json OUT]

Without -m it writes (once, into the hybridmoe cache) a 4-layer slice of the Qwen3-30B-A3B shape with an
8192-token vocabulary (1.4 GiB; experts Q4_0, the rest Q8_0): big enough that decode streams from RAM.
--hm-variant KEY=VALUE[,KEY=VALUE] adds hybridmoe rows run with that environment (GOMP_SPINCOUNT=300000:
libgomp's default spin, as before hybridmoe set its own). --rounds repeats the whole idle/busy sequence. Each
row also gives the CPU that other programs used during its runs (in cores, from /proc/stat less this script's
children): on a shared machine "idle" is only as idle as the others leave it.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from slices import bytes_per_token, slice_model

BUSY = "import time\nend = time.time() + {secs}\nwhile time.time() < end:\n    pass\n"


def ram_bw() -> float:
    from hybridmoe.perf.calibrate import ram_read_now
    return ram_read_now(reps=5)


def _cpu_busy() -> tuple[int, int]:
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)                    # busy and all jiffies (idle, iowait excluded)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_json(cmd: list[str], env: dict) -> tuple[list[float], float]:
    """The samples (t/s) of one bench run, and the cores' worth of CPU that other programs used meanwhile."""
    b0, a0 = _cpu_busy()
    c0 = _children_cpu()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    b1, a1 = _cpu_busy()
    ours = (_children_cpu() - c0) * os.sysconf("SC_CLK_TCK")
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    doc = json.loads(r.stdout)
    others = max(0.0, (b1 - b0 - ours) / max(a1 - a0, 1) * (os.cpu_count() or 1))
    return [float(x) for x in doc[0]["samples_ts"]], others


def hybridmoe_cmd(model, n, reps, threads):
    return [sys.executable, "-m", "hybridmoe", "bench", "-m", model, "-p", "0", "-n", str(n), "-r", str(reps),
            "-t", str(threads), "-o", "json", "--no-progress"]


def llama_cmd(exe, model, n, reps, threads):
    return [exe, "-m", model, "-p", "0", "-n", str(n), "-r", str(reps), "-t", str(threads), "-o", "json"]


class Busy:
    """`n` busy-loop processes, each ending by itself after `secs`; stop() kills the ones still running."""

    def __init__(self, n: int, secs: float):
        self.procs = [subprocess.Popen([sys.executable, "-c", BUSY.format(secs=secs)]) for _ in range(n)]

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def table(rows, threads, tools, bpt, bw) -> str:
    """Markdown: per load, threads and tool, t/s over every repetition, and the weight bytes read a second."""
    out = ["| load | tool | -t | t/s median | min - max | swing | weights read, GB/s (share of RAM bw) | "
           "others used (cores) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for load in ("idle", "busy"):
        for t in threads:
            for name in tools:
                sel = [r for r in rows if (r["load"], r["tool"], r["threads"]) == (load, name, t)]
                if not sel:
                    continue
                s = [x for r in sel for x in r["samples"]]
                med, oth = statistics.median(s), [r["others"] for r in sel]
                out.append(f"| {load} | {name} | {t} | {med:.1f} | {min(s):.1f} - {max(s):.1f} | "
                           f"{max(s) / max(min(s), 1e-9):.1f}x | {med * bpt / 1e9:.1f} ({100 * med * bpt / bw:.0f}%) | "
                           f"{min(oth):.2f} - {max(oth):.2f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench (CPU build); without it only hybridmoe runs")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-n", type=int, default=64, help="tokens generated per repetition (default 64)")
    ap.add_argument("-r", "--reps", type=int, default=5, help="repetitions per run (default 5)")
    ap.add_argument("--threads", default=None, help="comma list (default: 1 and the number of cores)")
    ap.add_argument("--busy", type=int, default=None, help="busy loops in the busy phase (default: half the cores)")
    ap.add_argument("--hm-variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="also run hybridmoe with this environment (repeatable)")
    ap.add_argument("--rounds", type=int, default=1, help="idle/busy sequences (default 1)")
    ap.add_argument("--json", default=None, help="write every sample here")
    ap.add_argument("--ram-bw", type=float, default=None, metavar="GB/S",
                    help="the RAM read bandwidth the share is of (default: measured now, which a busy machine lowers)")
    ap.add_argument("--table", default=None, metavar="JSON", help="only print the table of a saved --json run")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            d = json.load(f)
        bw = args.ram_bw * 1e9 if args.ram_bw else d["ram_bw"]
        threads = d.get("threads") or sorted({r["threads"] for r in d["rows"]})
        tools = d.get("tools") or list(dict.fromkeys(r["tool"] for r in d["rows"]))
        print(table(d["rows"], threads, tools, d["bytes_per_token"], bw))
        return 0

    cores = os.cpu_count() or 1
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, cores})
    n_busy = args.busy if args.busy is not None else max(1, cores // 2)
    if args.model is None:
        from hybridmoe.env import cache_dir
        d = cache_dir() / "models"
        d.mkdir(parents=True, exist_ok=True)
        args.model = str(d / "contention-4l.gguf")
        slice_model(args.model, 8192, "contention-4l")
    bpt = bytes_per_token(args.model)
    env = dict(os.environ)
    bw = args.ram_bw * 1e9 if args.ram_bw else ram_bw()
    print(f"model {args.model}: {bpt / 2**20:.1f} MiB read a token; idle RAM read {bw / 1e9:.1f} GB/s; "
          f"{cores} cores, busy loops: {n_busy}", file=sys.stderr)
    tools = [("hybridmoe", lambda t: (hybridmoe_cmd(args.model, args.n, args.reps, t), env))]
    for var in args.hm_variant:
        e = dict(env, **dict(kv.split("=", 1) for kv in var.split(",")))
        tools.append((f"hybridmoe {var}", lambda t, e=e: (hybridmoe_cmd(args.model, args.n, args.reps, t), e)))
    if args.llama_bench:
        tools.append(("llama.cpp", lambda t: (llama_cmd(args.llama_bench, args.model, args.n, args.reps, t), env)))
    rows = []
    for rnd in range(args.rounds):
        for load in ("idle", "busy"):
            busy = Busy(n_busy, 1800) if load == "busy" else None
            try:
                time.sleep(0.5 if busy else 0)
                for t in threads:
                    for name, make in tools:
                        cmd, e = make(t)
                        samples, others = run_json(cmd, e)
                        rows.append(dict(round=rnd, load=load, tool=name, threads=t, samples=samples, others=others))
                        print(f"  {load} {name} -t {t}: {[round(s, 1) for s in samples]} (others used "
                              f"{others:.2f} cores)", file=sys.stderr, flush=True)
            finally:
                if busy:
                    busy.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, bytes_per_token=bpt, ram_bw=bw, cores=cores, busy=n_busy,
                           threads=threads, tools=[n for n, _ in tools], variants=args.hm_variant, rows=rows), f,
                      indent=1)
    print(table(rows, threads, [n for n, _ in tools], bpt, bw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
