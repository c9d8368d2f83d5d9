"""What a prompt length seen for the first time costs: a server's prompts (and, with the prompt cache, the new
tokens of each turn) come in every length, so a cost paid per new length is paid per request. Runs ubatches of
several sizes twice each, in one process, and prints the time of each and how many kernels Triton compiled
for it (files added to its cache directory).

    python3 benchmarks/shape_costs.py [-m MODEL] [--sizes 201,203,150,333,64,17] [-- PLACEMENT ...]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-shapes-"))

import torch  # noqa: E402

import hybridmoe  # noqa: E402
from prompt_cache import placement  # noqa: E402


def n_compiled() -> int:
    return sum(len(f) for _, _, f in os.walk(os.environ["TRITON_CACHE_DIR"]))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", default="synth:qwen3-30b-a3b")
    ap.add_argument("--sizes", default="512,201,203,150,333,64,17,2")
    ap.add_argument("placements", nargs="*", default=["-ngl 99 -ot exps=CPU"])
    a = ap.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    for spec in a.placements:
        m = hybridmoe.load(a.m, ctx_size=4096, **placement(spec))
        kv = m.new_cache()
        g = torch.Generator().manual_seed(0)
        print(f"\n{a.m}, {spec}: tokens | first ms | second ms | Triton files added by the first")
        for T in sizes:
            ids = torch.randint(0, m.cfg.n_vocab, (T,), generator=g)
            row = []
            for _ in range(2):
                c0 = n_compiled()
                t0 = time.perf_counter()
                m.forward(ids, 1000, kv, all_logits=False)
                m.sync()
                row.append(((time.perf_counter() - t0) * 1e3, n_compiled() - c0))
            print(f"{T} | {row[0][0]:.1f} | {row[1][0]:.1f} | {row[0][1]}", flush=True)
        del m, kv


if __name__ == "__main__":
    main()
