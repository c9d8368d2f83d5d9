"""Decode speed on the main thread against a worker thread (as `serve` runs its steps), the same loaded model
and cache: tells whether a server's slow single stream comes from running the steps off the main thread or from
the server around them.

    python3 benchmarks/thread_decode.py -m synth:qwen3-30b-a3b -ngl 99 -ot exps=CPU [-n 64]
"""
from __future__ import annotations

import argparse
import asyncio
import threading
import time

import hybridmoe
from hybridmoe.commands.bench import prepare_test
from hybridmoe.commands.common import add_model_args, add_runtime_args, runtime_kwargs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, model_default="synth:tiny")
    add_runtime_args(ap)
    ap.add_argument("-n", type=int, default=64, help="decode steps a run")
    args = ap.parse_args()
    kw = runtime_kwargs(args)
    kw["ctx_size"] = max(kw.get("ctx_size") or 0, 64 + 4 * args.n)
    m = hybridmoe.load(args.model, **kw)
    once = prepare_test(m, 32, args.n, 0, 1)
    once(2)

    def rate() -> float:
        t0 = time.perf_counter()
        once(args.n)
        return (32 + args.n) / (time.perf_counter() - t0)

    def in_thread() -> float:
        out = []
        t = threading.Thread(target=lambda: out.append(rate()))
        t.start()
        t.join()
        return out[0]

    def beside_loop() -> float:
        """A worker thread while the main thread runs an asyncio loop (idle but for a 1 ms timer), as serve's."""
        async def main_loop():
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(None, rate)
            while not fut.done():
                await asyncio.sleep(0.001)
            return fut.result()
        return asyncio.run(main_loop())
    for label, fn in (("main thread", rate), ("worker thread", in_thread), ("worker beside a loop", beside_loop),
                      ("main thread again", rate)):
        print(f"{label:24s} {fn():8.2f} t/s (pp32 + tg{args.n})", flush=True)


if __name__ == "__main__":
    main()
