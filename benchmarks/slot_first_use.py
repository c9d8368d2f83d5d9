"""What a server slot's first use costs: several caches (as `serve -np N` keeps one a slot), each given a prompt
and then decode steps one sequence at a time; per cache the prompt's time, its first decode step's (where the
cache's static decode step is built and captured) and the mean of the next ones. Then the same caches decoded
together (Model.decode_batch, the server's batched step) for comparison with a single sequence's steps.

    python3 benchmarks/slot_first_use.py -m synth:qwen3-30b-a3b -ngl 99 --caches 3
    python3 benchmarks/slot_first_use.py -m synth:qwen3-30b-a3b -ngl 99 -ot exps=CPU --cprofile 25
    python3 benchmarks/slot_first_use.py -m synth:qwen3-30b-a3b -ngl 99 --caches 6 --prompt 40,41,48,64,100,300

--prompt: the prompt's tokens, or a list taken in turn by the caches (what a new prompt size costs the first time).

--cprofile N: the N functions with the most cumulative time in the second cache's first decode step.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import hybridmoe
from hybridmoe.commands.common import add_model_args, add_runtime_args, runtime_kwargs


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, model_default="synth:tiny")
    add_runtime_args(p)
    p.add_argument("--caches", type=int, default=3, help="caches (slots) to use one after another")
    p.add_argument("--prompt", default="40", help="prompt tokens per cache, or a comma-separated list taken in turn")
    p.add_argument("--steps", type=int, default=8, help="decode steps per cache after the first")
    p.add_argument("--cprofile", type=int, default=0, metavar="N")
    a = p.parse_args()
    t0 = time.perf_counter()
    sizes = [int(n) for n in a.prompt.split(",")]
    ctx = max(sizes) + a.steps + 8
    kw = runtime_kwargs(a)
    kw["ctx_size"] = ctx
    m = hybridmoe.load(a.model, **kw)
    print(f"loaded in {time.perf_counter() - t0:.2f} s; warm-up {m.warmup():.2f} s")
    gen = torch.Generator().manual_seed(0)
    print("| cache | prompt tokens | prompt s | first decode step s | next steps ms (mean) |")
    print("|---:|---:|---:|---:|---:|")
    kvs, toks = [], []
    for c in range(a.caches):
        kv = m.new_cache(ctx)
        n = sizes[c % len(sizes)]
        prompt = torch.randint(0, m.cfg.n_vocab, (n,), generator=gen)
        tp, out = _timed(lambda: m.forward(prompt, 0, kv, all_logits=False))
        tok, pos = int(out[-1].argmax()), n
        prof = cProfile.Profile() if a.cprofile and c == 1 else None
        if prof:
            prof.enable()
        t1, out = _timed(lambda: m.forward(torch.tensor([tok]), pos, kv, all_logits=False))
        if prof:
            prof.disable()
        tok, pos = int(out[-1].argmax()), pos + 1
        tn = 0.0
        for _ in range(a.steps):
            dt, out = _timed(lambda: m.forward(torch.tensor([tok]), pos, kv, all_logits=False))
            tn += dt
            tok, pos = int(out[-1].argmax()), pos + 1
        print(f"| {c} | {n} | {tp:.3f} | {t1:.3f} | {tn / a.steps * 1e3:.2f} |")
        kvs.append((kv, pos))
        toks.append(tok)
        if prof:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(a.cprofile)
    if len(kvs) > 1:
        for r in range(3):
            dt, (out, top) = _timed(lambda: m.decode_batch(toks, [q for _, q in kvs], [kv for kv, _ in kvs],
                                                           argmax=True))
            toks = top
            kvs = [(kv, q + 1) for kv, q in kvs]
            print(f"decode_batch of {len(kvs)} (step {r}): {dt * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
