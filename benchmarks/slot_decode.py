"""A server slot's cache against the model's own: where a slot's first request goes and whether its steady decode
runs at the model's rate. For each cache (the model's own, then two made by new_cache as `serve -np N` makes its
slots): the cache's creation, a 32-token prompt, the first decode step (each the first use of the cache's static
prompt / decode step: built and captured then), then n decode steps' rate, and the static steps used.

    python3 benchmarks/slot_decode.py -m synth:qwen3-30b-a3b -ngl 99 -ot exps=CPU [-n 64]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

import hybridmoe
from hybridmoe.commands.common import add_model_args, add_runtime_args, runtime_kwargs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, model_default="synth:tiny")
    add_runtime_args(ap)
    ap.add_argument("-n", type=int, default=64, help="decode steps a run")
    ap.add_argument("--profile-first", type=int, default=0, metavar="N",
                    help="print the N functions with the most cumulative time in new_cache 1's first decode step")
    args = ap.parse_args()
    kw = runtime_kwargs(args)
    kw["ctx_size"] = max(kw.get("ctx_size") or 0, 64 + 4 * args.n)
    t0 = time.perf_counter()
    m = hybridmoe.load(args.model, **kw)
    print(f"loaded in {time.perf_counter() - t0:.1f} s; warm-up {m.warmup():.2f} s", flush=True)
    prompt = torch.randint(0, m.cfg.n_vocab, (32,))

    def timed(fn):
        t = time.perf_counter()
        r = fn()
        m.sync()
        return r, time.perf_counter() - t

    caches: dict = {}
    print("| cache | create s | prompt 32 s | first decode s | decode t/s | decode step | prompt step |")
    print("|---|---:|---:|---:|---:|---|---|")
    for label in ("model's own", "new_cache 1", "new_cache 2", "model's own again", "new_cache 1 again"):
        if label.startswith("model"):
            kv, t_new = m.take_cache(), 0.0
            m.return_cache(kv)
        elif label.endswith("again"):
            kv, t_new = caches[label.split(" again")[0]], 0.0
        else:
            kv, t_new = timed(m.new_cache)
            caches[label] = kv
        kv.tokens.clear()
        _, t_p = timed(lambda: m.forward(prompt, 0, kv, all_logits=False))
        prof = cProfile.Profile() if args.profile_first and label == "new_cache 1" else None
        if prof is not None:
            prof.enable()
        _, t_d = timed(lambda: m.forward(torch.tensor([1]), 32, kv, all_logits=False))
        if prof is not None:
            prof.disable()
            pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(args.profile_first)
        _, t_n = timed(lambda: [m.forward(torch.tensor([1]), 33 + i, kv, all_logits=False) for i in range(args.n)])
        names = [type(m.static_step(w)).__name__ for w in ("decode", "prompt")]
        print(f"| {label} | {t_new:.2f} | {t_p:.3f} | {t_d:.3f} | {args.n / t_n:.1f} | {names[0]} | {names[1]} |",
              flush=True)


if __name__ == "__main__":
    main()
