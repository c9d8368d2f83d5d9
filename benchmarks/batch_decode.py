"""Decode steps of several sequences at once (Model.forward_batch): aggregate and per-sequence tokens/s at each
batch size, the distinct experts a step activates, against one sequence decoding alone (Model.forward: the
static decode step where the placement has one).

Each sequence has its own cache holding a prompt of --prompt random tokens; a step gives every sequence one
greedy token. Usage (placement flags as `hybridmoe run` takes them):

    python3 benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99
    python3 benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 -ot exps=CPU --batch 1,2,4,8
    python3 benchmarks/batch_decode.py -m synth:tiny --loop          # also time a per-sequence loop

Columns: B; ms a step; aggregate tokens/s; per-sequence tokens/s; aggregate over the alone speed; distinct
experts a step (mean over MoE layers; the experts a step reads, against B x k for B sequences read apart);
decode_batch ms: a step by Model.decode_batch instead (the server's decode steps: lists in, the greedy tokens
out, the CPU step's records kept while the batch's caches stay the same; "-" where it is forward_batch's path);
--loop: the same B sequences decoded one forward at a time (what a server without batching does); step: the path
that ran the batch (CpuDecoder, BatchDecode[bucket graph|eager, moe KERNELS]: runtime/steps/gpu_batch.py, with
the MoE kernels its bucket ran: pair, grouped, mmq or gemm, runtime/experts.gpu_moe_path; or eager).
--no-graphs times the eager batched decoder instead. --kprofile N: after each batch size, the N GPU kernels with the
most time over --steps batched steps (torch.profiler; ms a step and share of the GPU's busy time).
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


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prefill(m, B, P, ctx, gen, chunk_tokens=2048):
    """B caches, each holding P random tokens, filled a few sequences per forward_batch; the next token of each."""
    kvs = [m.new_cache(ctx) for _ in range(B)]
    prompts = [torch.randint(0, m.cfg.n_vocab, (P,), generator=gen) for _ in range(B)]
    per = max(1, chunk_tokens // P)
    nxt = []
    for a in range(0, B, per):
        outs = m.forward_batch([(prompts[j], 0, kvs[j]) for j in range(a, min(B, a + per))])
        nxt += [int(o[-1].argmax()) for o in outs]
    return kvs, nxt


def _time_steps(m, kvs, toks, pos, steps, batched: bool | str, repeat: int):
    """Seconds per step of `steps` greedy decode steps of every sequence (after one untimed step), the best of
    `repeat` rounds (the machine may be shared); the mean distinct experts a step. batched: True for
    Model.forward_batch, "decode" for Model.decode_batch (the server's decode steps), False for a forward a
    sequence."""
    def one(pos):
        nonlocal toks
        if batched == "decode":
            toks = m.decode_batch(toks, [pos] * len(kvs), kvs, argmax=True)[1]
            return
        if batched:
            outs = m.forward_batch([(torch.tensor([t]), pos, kv) for t, kv in zip(toks, kvs)])
        else:
            outs = [m.forward(torch.tensor([t]), pos, kv, all_logits=False) for t, kv in zip(toks, kvs)]
        toks = [int(o[-1].argmax()) for o in outs]
    one(pos)
    pos += 1
    distinct, best = [], float("inf")
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        for s in range(steps):
            one(pos + s)
            if batched and m.stats.last_batch["distinct_experts"] is not None:
                distinct.append(m.stats.last_batch["distinct_experts"])
        _sync()
        best = min(best, (time.perf_counter() - t0) / steps)
        pos += steps
    return best, (sum(distinct) / len(distinct) if distinct else float("nan"))


def _step_name(m, B: int) -> str:
    """Which path ran B sequences' steps: the CPU batch step, the GPU one (its bucket, and whether a captured
    graph replayed), or the eager decoder; one sequence takes Model.forward's own step."""
    step = m._batch
    if B == 1 or not step:
        return "forward" if B == 1 else "eager"
    buckets = getattr(step, "buckets", None)
    if buckets is None:
        return type(step).__name__
    from hybridmoe.runtime.steps.gpu_batch import bucket
    b = bucket(min(B, 64))
    buf = buckets.get(b, {})
    moe = f", moe {buf['moe']}" if buf.get("moe") else ""
    return f"{type(step).__name__}[{b}{' graph' if buf.get('graph') is not None else ' eager'}{moe}]"


def _kernel_profile(fn, B, steps, top):
    """The GPU kernels that ran in fn (steps + 1 decode steps of B sequences), by their summed device time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    rows = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    total = sum(e.self_device_time_total for e in rows)
    print(f"B={B}: GPU busy {total / (steps + 1) / 1e3:.2f} ms a step; kernels by time (ms a step, share, calls "
          "a step):")
    for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"  {e.self_device_time_total / (steps + 1) / 1e3:8.3f} {e.self_device_time_total / total:6.1%} "
              f"{e.count / (steps + 1):7.1f}  {e.key[:90]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, model_default="synth:tiny")
    add_runtime_args(p)
    p.add_argument("--batch", default="1,2,4,8,16,32,64", help="batch sizes (default %(default)s)")
    p.add_argument("--prompt", type=int, default=128, help="tokens each cache holds before the steps")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per batch size")
    p.add_argument("--repeat", type=int, default=3, help="rounds of --steps; the best is reported")
    p.add_argument("--loop", action="store_true", help="also time the per-sequence loop at each batch size")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="after each batch size, the N functions with the most own time, then the most time with their calls, "
                        "over --steps batched steps "
                        "(Python's profiler, on stderr; decode_batch's steps where the model has them)")
    p.add_argument("--kprofile", type=int, default=0, metavar="N",
                   help="after each batch size, the N GPU kernels with the most time over --steps batched steps")
    args = p.parse_args()
    sizes = [int(b) for b in args.batch.split(",")]
    ctx = args.prompt + args.steps * args.repeat + 2
    kw = runtime_kwargs(args)
    kw["ctx_size"] = ctx
    m = hybridmoe.load(args.model, **kw)
    m.warmup()
    gen = torch.Generator().manual_seed(0)
    k = m.cfg.n_expert_used
    print(f"{args.model}, {m.cfg.n_layer} layers, {m.cfg.n_expert} experts ({k} a token); prompt {args.prompt}, "
          f"best of {args.repeat} x {args.steps} steps; devices: {', '.join(sorted(m.devices))}")
    kvs, toks = _prefill(m, 1, args.prompt, ctx, gen)
    alone, _ = _time_steps(m, kvs, toks, args.prompt, args.steps, batched=False, repeat=args.repeat)
    print(f"alone (Model.forward): {alone * 1e3:.2f} ms a step, {1 / alone:.1f} t/s")
    hdr = (f"{'B':>4} {'ms/step':>9} {'agg t/s':>9} {'seq t/s':>9} {'x alone':>8} {'distinct':>9} {'of B*k':>7} "
           f"{'decode_batch ms':>15}")
    print(hdr + (f" {'loop t/s':>9}" if args.loop else "") + "  step")
    for B in sizes:
        kvs, toks = _prefill(m, B, args.prompt, ctx, gen)
        dt, distinct = _time_steps(m, kvs, toks, args.prompt, args.steps, batched=True, repeat=args.repeat)
        dd = "-"                             # decode_batch has a path of its own only on the CPU batch step
        if B > 1 and hasattr(m._batch, "decode_batch"):
            kvs, toks = _prefill(m, B, args.prompt, ctx, gen)
            dd = f"{_time_steps(m, kvs, toks, args.prompt, args.steps, 'decode', args.repeat)[0] * 1e3:.3f}"
        line = (f"{B:>4} {dt * 1e3:>9.2f} {B / dt:>9.1f} {1 / dt:>9.1f} {B / dt * alone:>8.2f} {distinct:>9.1f} "
                f"{min(B * k, m.cfg.n_expert or 1):>7} {dd:>15}")
        if args.loop:
            kvs, toks = _prefill(m, B, args.prompt, ctx, gen)
            lt, _ = _time_steps(m, kvs, toks, args.prompt, args.steps, batched=False, repeat=args.repeat)
            line += f" {B / lt:>9.1f}"
        print(line + "  " + _step_name(m, B), flush=True)
        how = "decode" if dd != "-" else True          # the server's path where it has one
        if args.cprofile:
            kvs, toks = _prefill(m, B, args.prompt, ctx, gen)
            prof = cProfile.Profile()
            prof.enable()
            _time_steps(m, kvs, toks, args.prompt, args.steps, batched=how, repeat=1)
            prof.disable()
            print(f"B={B}:", file=sys.stderr)
            for key in ("tottime", "cumulative"):
                pstats.Stats(prof, stream=sys.stderr).sort_stats(key).print_stats(args.cprofile)
        if args.kprofile and torch.cuda.is_available():
            kvs, toks = _prefill(m, B, args.prompt, ctx, gen)
            _kernel_profile(lambda: _time_steps(m, kvs, toks, args.prompt, args.steps, batched=how, repeat=1),
                            B, args.steps, args.kprofile)


if __name__ == "__main__":
    main()
