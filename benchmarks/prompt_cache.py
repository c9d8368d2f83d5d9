"""The prompt cache in a chat: each turn sends the whole conversation again, as chat clients do. Prompt time of
each turn with the cache (only the new tokens run) and without (`cache_prompt=False`), on one model and
placement.

    python3 benchmarks/prompt_cache.py [-m MODEL] [--turns 4] [--first 2000] [--msg 100] [-n 64] [-- PLACEMENT ...]

A placement is llama.cpp flags in one string, e.g. "-ngl 99 -ot exps=CPU". Tokens are random ids (the
synthetic models' text is meaningless anyway): turn i's prompt = turn i-1's prompt + its generated ids + `--msg`
new ids.
"""
from __future__ import annotations

import argparse
import random
import shlex

import hybridmoe
from hybridmoe.generate import Sampler, SamplerSettings, Timings, generate_ids


def placement(spec: str) -> dict:
    a = shlex.split(spec)
    opts = {}
    if "-ngl" in a:
        opts["n_gpu_layers"] = int(a[a.index("-ngl") + 1])
    if "-ot" in a:
        opts["override_tensor"] = [a[a.index("-ot") + 1]]
    if "--n-cpu-moe" in a:
        opts["n_cpu_moe"] = int(a[a.index("--n-cpu-moe") + 1])
    return opts


def turn(model, ids, n, cache):
    t = Timings()
    out = list(generate_ids(model, ids, n, Sampler(SamplerSettings(temperature=0)), t, cache_prompt=cache))
    return out, t


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", default="synth:qwen3-30b-a3b")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first", type=int, default=2000, help="tokens of the first prompt")
    ap.add_argument("--msg", type=int, default=100, help="new tokens per later turn")
    ap.add_argument("-n", type=int, default=64, help="tokens generated per turn")
    ap.add_argument("placements", nargs="*", default=["-ngl 99 -ot exps=CPU"])
    a = ap.parse_args(argv)
    for spec in a.placements:
        m = hybridmoe.load(a.m, ctx_size=a.first + a.turns * (a.msg + a.n) + 16, **placement(spec))
        V = m.cfg.n_vocab
        rng = random.Random(0)
        turn(m, [rng.randrange(V) for _ in range(64)], 4, False)             # warm-up: graphs, kernels
        print(f"\n{a.m}, {spec}: turn | prompt tokens | cached | ran | prompt ms (cache) | "
              f"prompt ms (no cache) | speedup")
        ids = [rng.randrange(V) for _ in range(a.first)]
        for i in range(a.turns):
            out, warm = turn(m, ids, a.n, True)           # the cache as the last turn left it
            _, cold = turn(m, ids, a.n, False)            # the whole conversation from an empty cache; it leaves
            #                                               the cache as `warm` did when the text is the same
            print(f"{i + 1} | {len(ids)} | {warm.n_cached} | {warm.n_prompt} | {warm.t_prompt * 1e3:.1f} | "
                  f"{cold.t_prompt * 1e3:.1f} | {cold.t_prompt / max(warm.t_prompt, 1e-9):.1f}x", flush=True)
            ids = ids + out + [rng.randrange(V) for _ in range(a.msg)]
        del m


if __name__ == "__main__":
    main()
