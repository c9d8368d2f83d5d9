"""Load test of `hybridmoe serve`: starts the server (every flag after `--` goes to it: model, placement, -np,
-c, ...), drives it with the real `openai` client at several concurrencies (a process a client), and prints a
markdown table of aggregate tokens/s, latency (p50 / p99) and each stream's tokens/s (the server's
`timings.predicted_per_second` of each request, decode only), with the batching the server's /metrics saw
(sequences and distinct experts per step) and the server's CPU time a generated token (every thread of its
process, Linux; on a shared machine it says more than the wall-clock rates). Requests are greedy, with fixed
prompts and `ignore_eos`, so every request generates exactly --max-tokens tokens.

    python benchmarks/serve_load.py -- -m synth:tiny
    python benchmarks/serve_load.py --concurrency 1,8 --max-tokens 64 -- -m synth:tiny -t 1
    python benchmarks/serve_load.py -- -m synth:qwen3-30b-a3b -ngl 99 --n-cpu-moe 24

Without -np among the server flags the server gets as many slots as the largest concurrency, and without -c
a context of slots x (prompt + max tokens + 64).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

PROMPTS = ["Tell me a story about a dragon who lives in a cave by the sea.", "Name three rivers and where they flow.",
           "What is the capital of France, and why?", "Write a poem about the sea and the wind over it.",
           "Count from one to twenty in words.", "Why is the sky blue? Explain it to a child.",
           "Describe a cat to someone who has never seen one.", "List five colours, five animals and five cities."]


def start_server(flags: list[str], timeout: float) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "hybridmoe", "serve", "--port", "0", "--metrics", "--log-level", "warning", *flags]
    print("server:", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    found: list[str] = []

    def read():
        for line in p.stdout:
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                found.append(m.group(1))
                return
    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    if not found:
        p.kill()
        sys.exit(f"the server did not start within {timeout:.0f} s (exit code {p.poll()}); see its stderr above")
    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()   # keep its pipe drained
    return p, found[0]


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+:\w+) (\S+)$", text, re.M)}


def cpu_seconds(pid: int | None) -> float | None:
    """CPU seconds (user + system, every thread) process pid has used so far; None off Linux or without a pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return None


def thread_cpu_seconds(pid: int | None) -> dict[int, float]:
    """{thread id: CPU seconds so far} of every thread of process pid (Linux; {} elsewhere)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (OSError, TypeError):
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
    return out


def machine_busy() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine so far, every core (/proc/stat); None off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v) - idle) / hz, sum(v) / hz


def _client(url: str, k: int, conc: int, max_tokens: int, cache_prompt: bool, left, start, out):
    """Client k: requests one after another while `left` (a shared count) lasts; then one message to `out`:
    ("done", CPU seconds this client used from the start on (its process's, or its thread's when the clients are
    threads), its results: ("ok", latency s, tokens, the server's per-stream tok/s) or ("error", text) each).
    The results go in one message at the end: a message a request would wake the queue's feeder thread each time,
    CPU that competes with the server on a small machine. The answer's JSON is read as the raw response, without
    the client's typed models (openai's `with_raw_response`: the same HTTP request)."""
    import json

    import openai
    clock = time.process_time if multiprocessing.parent_process() is not None else time.thread_time
    results = []
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600) as c:
        out.put(("ready",))
        start.wait()
        cpu0 = clock()
        i = k
        while True:
            with left.get_lock():
                if left.value <= 0:
                    break
                left.value -= 1
            t0 = time.perf_counter()
            try:
                raw = c.completions.with_raw_response.create(
                    model="m", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, temperature=0,
                    extra_body={"ignore_eos": True, "cache_prompt": cache_prompt})
                r = json.loads(raw.http_response.content)
            except Exception as e:          # noqa: BLE001 - counted and shown
                results.append(("error", f"{type(e).__name__}: {e}"))
                continue
            results.append(("ok", time.perf_counter() - t0, r["usage"]["completion_tokens"],
                            r["timings"]["predicted_per_second"]))
            i += conc
        cpu = clock() - cpu0
    out.put(("done", cpu, results))


class _Count:
    """multiprocessing.Value's interface for the clients as threads."""

    def __init__(self, n: int):
        self.value, self._lock = n, threading.Lock()

    def get_lock(self):
        return self._lock


def run_level(url: str, conc: int, n_req: int, max_tokens: int, cache_prompt: bool, pid: int | None = None,
              threads: bool = False) -> dict:
    """conc clients, each sending requests one after another until n_req have been sent in all; pid: the
    server's process, whose CPU time the level is charged. Each client is a process of its own, as separate
    users are (the openai client's own Python, 1-2 ms a request, would otherwise queue on one GIL: 8 threads
    of one process sent fewer requests a second than one); `threads`: threads of this process instead."""
    if threads:
        import queue
        mk = threading.Thread
        left, start, out = _Count(n_req), threading.Event(), queue.Queue()
    else:
        # fork: a client starts at once with openai imported (spawn where there is no fork)
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        mk = ctx.Process
        left, start, out = ctx.Value("i", n_req), ctx.Event(), ctx.Queue()
    workers = [mk(target=_client, args=(url, k, conc, max_tokens, cache_prompt, left, start, out), daemon=True)
               for k in range(conc)]
    for w in workers:
        w.start()
    for _ in workers:                        # every client has imported openai and made its client
        assert out.get(timeout=300)[0] == "ready"
    lat, per_stream, tokens, errors = [], [], [], []
    before = metrics(url)
    cpu0, threads0, busy0 = cpu_seconds(pid), thread_cpu_seconds(pid), machine_busy()
    t0 = time.perf_counter()
    start.set()
    done, client_cpu, results = 0, 0.0, []
    while done < conc:
        item = out.get()
        done += 1
        client_cpu += item[1]
        results += item[2]
    wall = time.perf_counter() - t0
    cpu1, threads1, busy1 = cpu_seconds(pid), thread_cpu_seconds(pid), machine_busy()
    after = metrics(url)
    for w in workers:
        w.join()
    for res in results:
        if res[0] == "error":
            errors.append(res[1])
        else:
            lat.append(res[1])
            tokens.append(res[2])
            per_stream.append(res[3])

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)
    steps = delta("llamacpp:n_decode_total")
    lat.sort()
    # the server's threads by CPU used in this level: the busiest is the generation thread (a batched step of
    # every stream), the process's main thread the event loop (HTTP, JSON, tokenizing)
    used = sorted(((threads1.get(t, 0.0) - threads0.get(t, 0.0), t) for t in threads1), reverse=True)
    gen = next((c for c, t in used if t != pid), 0.0)
    loop_cpu = next((c for c, t in used if t == pid), 0.0)
    ncpu = os.cpu_count() or 1
    return {"conc": conc, "requests": len(lat), "errors": errors, "tokens": sum(tokens), "wall": wall,
            "agg": sum(tokens) / wall, "p50": statistics.median(lat) if lat else 0.0,
            "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0,
            "stream_p50": statistics.median(per_stream) if per_stream else 0.0,
            "stream_min": min(per_stream) if per_stream else 0.0,
            "seq_per_step": delta("hybridmoe:batch_sequences_total") / steps if steps else 0.0,
            "cpu_ms_tok": 1e3 * (cpu1 - cpu0) / sum(tokens) if cpu0 is not None and cpu1 is not None and tokens
            else None,
            "cpu": {"gen": gen / wall, "loop": loop_cpu / wall,
                    "server_other": max(0.0, (cpu1 - cpu0) - gen - loop_cpu) / wall if cpu0 is not None else 0.0,
                    "clients": client_cpu / wall,
                    "machine": (busy1[0] - busy0[0]) / wall if busy0 and busy1 else None, "ncpu": ncpu,
                    "client_ms_req": 1e3 * client_cpu / len(lat) if lat else 0.0,
                    "gen_us_step": 1e6 * gen / steps if steps else 0.0},
            "experts_per_step": (delta("hybridmoe:distinct_experts_total") / delta("hybridmoe:expert_steps_total")
                                 if delta("hybridmoe:expert_steps_total") else None)}


def main():
    argv = sys.argv[1:]
    flags = []
    if "--" in argv:
        i = argv.index("--")
        argv, flags = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="serve_load.py [options] -- SERVER FLAGS (-m MODEL ...)")
    ap.add_argument("--concurrency", default="1,4,16,64", help="client counts, comma-separated (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="requests per client at each concurrency (at least 8 requests a level; default: %(default)s)")
    ap.add_argument("--cache-prompt", action="store_true",
                    help="let requests reuse a slot's cached prompt (default: every request runs its prompt)")
    ap.add_argument("--start-timeout", type=float, default=1800, help="seconds to wait for the server to load")
    ap.add_argument("--url", default=None, help="drive a server already running there instead of starting one")
    ap.add_argument("--client-threads", action="store_true",
                    help="run the clients as threads of this process (default: a process each)")
    a = ap.parse_args(argv)
    try:
        import openai  # noqa: F401
    except ImportError:
        sys.exit("serve_load.py needs the openai package (pip install openai)")
    levels = [int(x) for x in a.concurrency.split(",")]
    if not flags and a.url is None:
        sys.exit("give the server's flags after --, e.g. serve_load.py -- -m synth:tiny")
    if "-np" not in flags and "--parallel" not in flags:
        flags += ["-np", str(max(levels))]
    np_ = int(flags[flags.index("-np" if "-np" in flags else "--parallel") + 1]) if flags else max(levels)
    if "-c" not in flags and "--ctx-size" not in flags:
        flags += ["-c", str(np_ * (128 + a.max_tokens + 64))]
    proc = None
    url = a.url
    if url is None:
        proc, url = start_server(flags, a.start_timeout)
    try:
        # every slot once, all at once (each takes a free slot): its cache and static steps are built at its
        # first request (on a GPU a capture), which a level's timed requests would otherwise pay, one slot each
        t0 = time.perf_counter()
        run_level(url, 1, 1, min(8, a.max_tokens), a.cache_prompt, threads=a.client_threads)
        t1 = time.perf_counter()
        run_level(url, np_, np_, min(8, a.max_tokens), a.cache_prompt, threads=a.client_threads)
        print(f"slot warm-up: one slot's first request {t1 - t0:.2f} s; then all {np_} slots at once "
              f"{time.perf_counter() - t1:.2f} s", file=sys.stderr, flush=True)
        rows = []
        for conc in levels:
            run_level(url, conc, conc, min(8, a.max_tokens), a.cache_prompt,        # warm-up: this batch size
                      threads=a.client_threads)
            r = run_level(url, conc, max(8, conc * a.rounds), a.max_tokens, a.cache_prompt,
                          proc.pid if proc is not None else None, a.client_threads)
            rows.append(r)
            print(f"concurrency {conc}: {r['agg']:.1f} tok/s aggregate, {len(r['errors'])} errors", file=sys.stderr,
                  flush=True)
            for e in r["errors"][:3]:
                print("  ", e, file=sys.stderr)
        base = rows[0]["agg"] if rows else 0.0
        print(f"\n`serve_load.py` -- {' '.join(flags)}; {a.max_tokens} tokens a request, greedy, "
              f"{'prompt cache on' if a.cache_prompt else 'every prompt run'}\n")
        print("| clients | requests | errors | aggregate tok/s | vs 1st row | p50 latency s | p99 latency s | "
              "stream tok/s p50 | stream tok/s min | seqs/step | experts/step | server CPU ms/tok |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            ex = f"{r['experts_per_step']:.1f}" if r["experts_per_step"] is not None else "-"
            cpu = f"{r['cpu_ms_tok']:.3f}" if r["cpu_ms_tok"] is not None else "-"
            print(f"| {r['conc']} | {r['requests']} | {len(r['errors'])} | {r['agg']:.1f} | "
                  f"{r['agg'] / base if base else 0:.2f}x | {r['p50']:.3f} | {r['p99']:.3f} | {r['stream_p50']:.1f} | "
                  f"{r['stream_min']:.1f} | {r['seq_per_step']:.2f} | {ex} | {cpu} |")
        print("\nWhere the CPU went, in cores busy over each level's wall time (the generation thread, the event loop's "
              "thread, the server's other threads, the client processes, every process on the machine):\n")
        print("| clients | generation thread | event loop | server, other | clients | machine, all | cores | "
              "client CPU ms/request | generation thread us/step |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            c = r["cpu"]
            mach = f"{c['machine']:.2f}" if c["machine"] is not None else "-"
            print(f"| {r['conc']} | {c['gen']:.2f} | {c['loop']:.2f} | {c['server_other']:.2f} | {c['clients']:.2f} | "
                  f"{mach} | {c['ncpu']} | {c['client_ms_req']:.2f} | {c['gen_us_step']:.0f} |")
    finally:
        if proc is not None:
            proc.send_signal(2)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # `timeout` sends SIGTERM: exit through main's `finally`, which stops the server (and frees its GPU memory)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
