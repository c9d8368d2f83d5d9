"""The server's generation thread alone: `serve`'s Batcher and Jobs on the model, no HTTP and no clients.
`--concurrency` jobs are kept in flight (a finished one is replaced at once, as a client sends its next
request), each greedy with `ignore_eos` on a fixed prompt of `--prompt-tokens`, until `--requests` have run.
It prints, per concurrency, the generation thread's CPU time a step and a generated token, the sequences a
step, and its CPU time a request beyond its decode steps (job setup, the prompt's step, the end), which is what
a step of one sequence and of several cost without the HTTP side; --cprofile prints cProfile's top functions of
the thread; --trace times the model's calls by kind (batched decode steps by size, batches with prompt chunks,
single prompts and decode tokens, eager passes, static steps built, graphs captured), wall time inclusive.

    python benchmarks/serve_steps.py -m synth:tiny --concurrency 1,8
    python benchmarks/serve_steps.py -m synth:tiny --concurrency 8 --cprofile
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import pstats
import time

import hybridmoe
from hybridmoe.commands.common import add_model_args, add_runtime_args, runtime_kwargs
from hybridmoe.serve.batching import Batcher
from hybridmoe.serve.jobs import Job
from hybridmoe.serve.requests import GenParams


def run(model, conc: int, n_req: int, max_tokens: int, prompt: list[int], profile: bool, slots: int = 0,
        n_ctx_slot: int = 0) -> dict:
    """n_req jobs, conc at a time, on a fresh Batcher of `slots` slots (default conc) of n_ctx_slot positions
    each (default: the jobs' length); the generation thread's CPU use."""
    n_slots = slots or conc
    batcher = Batcher(model, n_slots, n_slots * (n_ctx_slot or len(prompt) + max_tokens + 8))
    clock: dict = {}
    prof = cProfile.Profile() if profile else None
    loop_fn = batcher._loop

    def timed_loop():
        t0 = time.thread_time()
        try:
            if prof is not None:
                prof.runcall(loop_fn)
            else:
                loop_fn()
        finally:
            clock["cpu"] = time.thread_time() - t0
    batcher._loop = timed_loop

    async def drive():
        loop = asyncio.get_running_loop()
        params = GenParams({"prompt": "x", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                            "cache_prompt": False}, chat=False)
        left = n_req
        tokens = 0

        async def client():
            nonlocal left, tokens
            while left > 0:
                left -= 1
                job = Job(loop, list(prompt), max_tokens, params)
                batcher.submit(job)
                while True:
                    item = await job.queue.get()
                    if item[0] == "end":
                        tokens += item[1]["usage"]["completion_tokens"]
                        break
                    if item[0] == "error":
                        raise RuntimeError(item[1])
        t0 = time.perf_counter()
        await asyncio.gather(*[client() for _ in range(conc)])
        return tokens, time.perf_counter() - t0

    tokens, wall = asyncio.run(drive())
    batcher.close()
    batcher.thread.join()
    c = batcher.counts
    steps = c["decodes"]
    out = {"conc": conc, "tokens": tokens, "wall": wall, "cpu": clock["cpu"], "steps": steps,
           "seqs": c["batch_sequences"] / steps if steps else 0.0}
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        out["profile"] = s.getvalue()
    return out


class Trace:
    """Wall time and calls of the model's entry points and of what they build, keyed by kind; wraps them in place
    (the calls return host tensors, so each timing includes the GPU's work)."""

    def __init__(self, model):
        self.t: dict[str, list] = {}
        from hybridmoe.runtime.steps import gpu_batch
        dec = model.decoder
        self._wrap(model, "decode_batch", lambda a, kw: f"decode_batch B={len(a[0])}")
        self._wrap(model, "forward_batch", lambda a, kw: self._items(a[0]))
        self._wrap(model, "forward", lambda a, kw: "forward T=1" if a[0].shape[0] == 1 else "forward prompt")
        self._wrap(dec, "forward_batch", lambda a, kw: "  eager decoder.forward_batch")
        self._wrap(dec, "forward", lambda a, kw: "  eager decoder.forward")
        self._wrap(model, "_step_for", lambda a, kw: f"  static {a[0]} step looked up (built at first use)")
        self._wrap(gpu_batch.BatchDecode, "_capture_bucket", lambda a, kw: "  batch bucket captured", cls=True)

    @staticmethod
    def _items(items):
        sizes = [int(t.shape[0]) for t, _, _ in items]
        n1 = sum(1 for n in sizes if n == 1)
        return f"forward_batch {n1} decode + {len(sizes) - n1} prompt chunks"

    def _wrap(self, obj, name, key, cls=False):
        fn = getattr(obj, name)
        rec = self.t

        def timed(*a, **kw):
            k = key(a[1:] if cls else a, kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                r = rec.setdefault(k, [0, 0.0])
                r[0] += 1
                r[1] += time.perf_counter() - t0
        setattr(obj, name, timed)

    def report(self) -> str:
        rows = sorted(self.t.items(), key=lambda kv: -kv[1][1])
        lines = [f"{'call':<58} {'calls':>6} {'ms total':>9} {'ms each':>8}"]
        lines += [f"{k:<58} {n:>6} {1e3 * s:>9.1f} {1e3 * s / n:>8.2f}" for k, (n, s) in rows]
        self.t.clear()
        return "\n".join(lines)


class GcClock:
    """The interpreter's garbage collections while a level runs: count and seconds per generation (gc.callbacks)."""

    def __init__(self):
        self.t = {}
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            r = self.t.setdefault(info["generation"], [0, 0.0])
            r[0] += 1
            r[1] += time.perf_counter() - self._t0

    def report(self) -> str:
        out = ", ".join(f"gen {g}: {n} in {1e3 * s:.1f} ms" for g, (n, s) in sorted(self.t.items())) or "none"
        self.t.clear()
        return "  garbage collections: " + out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, model_default="synth:tiny")
    add_runtime_args(p)
    p.add_argument("--concurrency", default="1,8", help="jobs in flight, comma-separated (default %(default)s)")
    p.add_argument("--requests", type=int, default=64, help="jobs a concurrency runs (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens a job generates (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=12, help="prompt length (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="rounds a concurrency; the lowest CPU time is reported")
    p.add_argument("--cprofile", action="store_true", help="print cProfile's top functions of the thread")
    p.add_argument("--slots", type=int, default=0, help="the server's slots (default: the concurrency)")
    p.add_argument("--trace", action="store_true", help="time the model's calls by kind (wall, inclusive)")
    p.add_argument("--freeze", action="store_true",
                   help="after the warm-up, gc.freeze() the objects alive (as `serve` does before it listens)")
    args = p.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    kw = runtime_kwargs(args)
    kw["ctx_size"] = max(levels + [args.slots]) * (args.prompt_tokens + args.max_tokens + 8)
    m = hybridmoe.load(args.model, **kw)
    m.warmup()
    if args.freeze:
        gc.collect()
        gc.freeze()
    clock = GcClock()
    prompt = [(7 * i + 3) % m.cfg.n_vocab for i in range(args.prompt_tokens)]
    print(f"{args.model}: {args.requests} jobs of {args.max_tokens} greedy tokens a concurrency, prompt "
          f"{args.prompt_tokens} tokens; the generation thread's CPU time, best of {args.repeat}")
    print(f"{'jobs':>5} {'seqs/step':>10} {'us/step':>8} {'us/token':>9} {'us/request':>11} {'CPU/wall':>9} "
          f"{'tok/s':>8}")
    n_ctx_slot = args.prompt_tokens + args.max_tokens + 8
    trace = None
    for conc in levels:
        run(m, conc, conc, min(8, args.max_tokens), prompt, False, args.slots, n_ctx_slot)     # warm-up
        clock.t.clear()
        if args.trace and trace is None:
            trace = Trace(m)
        best = None
        for _ in range(args.repeat if not args.cprofile else 1):
            r = run(m, conc, max(args.requests, conc), args.max_tokens, prompt, args.cprofile, args.slots,
                    n_ctx_slot)
            if best is None or r["cpu"] < best["cpu"]:
                best = r
        r = best
        us_step = 1e6 * r["cpu"] / r["steps"]
        n_req = max(args.requests, conc)
        per_req = 1e6 * r["cpu"] / n_req
        print(f"{conc:>5} {r['seqs']:>10.2f} {us_step:>8.1f} {1e6 * r['cpu'] / r['tokens']:>9.1f} {per_req:>11.0f} "
              f"{r['cpu'] / r['wall']:>9.2f} {r['tokens'] / r['wall']:>8.1f}", flush=True)
        print(clock.report())
        if args.cprofile:
            print(r["profile"])
        if trace is not None:
            print(trace.report())


if __name__ == "__main__":
    main()
