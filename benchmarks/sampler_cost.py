"""The sampler's host time a token (generate.Sampler on a vocabulary's float32 logits on the CPU, as `run` and the
server's single sequences sample them): llama.cpp's default chain (temperature 0.8, top-k 40, top-p 0.95, min-p
0.05) and greedy. Before / after a change: run it with each tree's src first on PYTHONPATH.

    python benchmarks/sampler_cost.py [--vocab 151936] [-n 400] [--label after]
"""
from __future__ import annotations

import argparse
import time

import torch

from hybridmoe.generate import Sampler, SamplerSettings


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("-n", type=int, default=400)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    x = torch.randn(a.vocab, generator=torch.Generator().manual_seed(0)) * 3

    def per_call(f) -> float:
        for _ in range(20):
            f()
        t = time.perf_counter()
        for _ in range(a.n):
            f()
        return (time.perf_counter() - t) / a.n * 1e6
    s, g = Sampler(SamplerSettings(seed=1)), Sampler(SamplerSettings(temperature=0))
    print(f"{a.label or 'sampler'}: vocabulary {a.vocab}, {torch.get_num_threads()} torch threads: default chain "
          f"{per_call(lambda: s(x)):.0f} us a token, greedy {per_call(lambda: g(x)):.0f} us")


if __name__ == "__main__":
    main()
