"""`hybridmoe sweep-bench`: ik_llama.cpp's llama-sweep-bench. PP and TG speed as the context fills.

For N_KV = 0, UB, 2*UB, ... while a UB batch still fits in -c: decode TG tokens at depth N_KV (timed),
then drop them (the KV cache is addressed by position, so the next write at N_KV overwrites them) and
process a PP batch of UB random tokens at depth N_KV (timed). The PP batch stays in the cache, so the next
step starts at N_KV + UB. This is the order of ik_llama.cpp's tool: both rows' speeds are at depth N_KV.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager

import torch

from ..errors import progress
from .common import add_model_args, add_runtime_args, freeze_heap, runtime_kwargs

HEADER = ("PP", "TG", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s")


def random_tokens(gen: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist() if n else []


@contextmanager
def progress_bar(enabled: bool, total: int, title: str):
    """A transient rich progress bar on stderr (stdout keeps only the results), or a no-op; bars of the work
    inside (loading a model) stay hidden under it."""
    with progress(title, total, enabled=enabled) as bar:
        yield bar


def memory_report():
    """Peak host RSS and peak allocated memory per GPU, on stderr."""
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024
    parts = [f"peak RSS {rss_bytes / 2**20:.1f} MiB"]
    if torch.cuda.is_available():
        parts += [f"CUDA{i} peak {torch.cuda.max_memory_allocated(i) / 2**20:.1f} MiB allocated"
                  for i in range(torch.cuda.device_count())]
    print("memory: " + ", ".join(parts), file=sys.stderr)


def setup_arg_parser(p):
    add_model_args(p)
    p.add_argument("-n", "--n-predict", type=int, default=0, help="TG tokens per step (default: ubatch / 4)")
    p.add_argument("--output-format", choices=["md", "jsonl"], default="md",
                   help="md: ik_llama.cpp's table (default); jsonl: one JSON object per step")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show progress on stderr (default: when stderr is a terminal)")
    add_runtime_args(p)


def table_header() -> str:
    return ("|%6s | %6s | %6s | %8s | %8s | %8s | %8s |\n" % HEADER
            + "|%6s-|-%6s-|-%6s-|-%8s-|-%8s-|-%8s-|-%8s-|" % tuple("-" * w for w in (6, 6, 6, 8, 8, 8, 8)))


def table_row(r: dict) -> str:
    return "|%6d | %6d | %6d | %8.3f | %8.2f | %8.3f | %8.2f |" % (
        r["pp"], r["tg"], r["n_kv"], r["t_pp"], r["speed_pp"], r["t_tg"], r["speed_tg"])


def sweep(model, n_ctx: int, pp: int, tg: int, seed: int = 1234, on_row=None, bar=None) -> list[dict]:
    """The sweep's rows (dicts with ik's keys pp, tg, n_kv, t_pp, speed_pp, t_tg, speed_tg)."""
    from ..errors import HybridMoeError
    if pp > n_ctx or tg > n_ctx:
        raise HybridMoeError(f"-c {n_ctx} is smaller than one PP batch ({pp}) or TG run ({tg}); raise -c")
    kv = model.new_cache(n_ctx)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.cfg.n_vocab

    def batch(n):
        return torch.tensor(random_tokens(gen, vocab, n), dtype=torch.long)

    # warm-up (not timed): one PP batch and a decode step, so no timing includes first-call setup
    model.forward(batch(1), 0, kv, all_logits=False)
    model.forward(batch(pp), 0, kv, all_logits=False)
    model.sync()
    rows = []
    n_kv = 0
    while n_kv + pp <= n_ctx and n_kv + tg <= n_ctx:
        toks = [batch(1) for _ in range(tg)]
        t0 = time.perf_counter()
        for i, t in enumerate(toks):
            model.forward(t, n_kv + i, kv, all_logits=False)
        model.sync()
        t_tg = time.perf_counter() - t0
        prompt = batch(pp)
        t0 = time.perf_counter()
        model.forward(prompt, n_kv, kv, all_logits=False)
        model.sync()
        t_pp = time.perf_counter() - t0
        row = dict(pp=pp, tg=tg, n_kv=n_kv, t_pp=t_pp, speed_pp=pp / t_pp,
                   t_tg=t_tg, speed_tg=tg / t_tg if tg else 0.0)
        rows.append(row)
        if on_row:
            on_row(row)
        if bar:
            bar.advance()
        n_kv += pp
    return rows


def main(args) -> int:
    import hybridmoe

    from ..errors import HybridMoeError
    kw = runtime_kwargs(args)
    model = hybridmoe.load(args.model, **kw)                # load() says the placement's warnings
    freeze_heap()
    o = model.options
    n_ctx = o.ctx_size or model.cfg.n_ctx_train
    pp = o.ubatch_size
    tg = args.n_predict if args.n_predict > 0 else pp // 4
    if pp < 1:
        raise HybridMoeError("-ub must be at least 1")
    threads = args.threads or torch.get_num_threads()
    settings = dict(n_kv_max=n_ctx, n_batch=o.batch_size, n_ubatch=pp, flash_attn=int(o.flash_attn),
                    n_gpu_layers=o.n_gpu_layers, n_threads=threads, n_threads_batch=threads)
    jsonl = args.output_format == "jsonl"
    if not jsonl:
        print()
        print("main: " + ", ".join(f"{k} = {v}" for k, v in settings.items()))
        print()
        print(table_header(), flush=True)

    def on_row(row):
        if jsonl:
            print(json.dumps({**settings, **row}), flush=True)
        else:
            print(table_row(row), flush=True)

    steps = max(0, min((n_ctx - pp) // pp + 1, (n_ctx - tg) // pp + 1)) if pp <= n_ctx else 0
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    try:
        with progress_bar(show, steps, "sweep-bench") as bar:
            bar.describe(f"ubatch {pp}, TG {tg}, up to {n_ctx} tokens")
            sweep(model, n_ctx, pp, tg, on_row=on_row, bar=bar)
    finally:
        memory_report()
    return 0
