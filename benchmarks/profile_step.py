"""A model's decode step on the GPU machine: ms a step (its captured graphs replayed, from a 32-token prompt on), then
torch.profiler's top kernels over 8 steps (kernels inside replayed graphs included) by their GPU time, and the
host's top ops. Usage:

    python3 benchmarks/profile_step.py MODEL [-ot REGEX=DEV ...] [--n-cpu-moe N] [--no-graphs] [--rows 25]
"""
import argparse
import time

import torch

import hybridmoe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("-ot", action="append", default=[])
    ap.add_argument("--n-cpu-moe", type=int, default=0)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--rows", type=int, default=25)
    a = ap.parse_args()
    m = hybridmoe.load(a.model, n_gpu_layers=99, ctx_size=256, override_tensor=a.ot, n_cpu_moe=a.n_cpu_moe,
                       graphs=not a.no_graphs)
    kv = m.new_cache(256)
    m.forward(torch.arange(1, 33), 0, kv)
    pos = 32
    for _ in range(3):                                  # the step built, captured, warm
        m.forward(torch.tensor([5]), pos, kv)
        pos += 1
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(32):
        m.forward(torch.tensor([9]), pos, kv)
        pos += 1
    torch.cuda.synchronize()
    step = m.static_step("decode")
    print(f"{a.model}: {(time.perf_counter() - t0) / 32 * 1e3:.3f} ms a decode step "
          f"({type(step).__name__ if step is not None else 'eager'})")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            m.forward(torch.tensor([9]), pos, kv)
            pos += 1
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=a.rows, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    main()
