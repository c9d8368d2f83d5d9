"""CPU prompt attention: torch SDPA in float32 vs bf16 (oneDNN/AMX where the CPU has it), Qwen3-30B-A3B heads
(32 query heads, 4 KV heads, D = 128), causal from the bottom right for a chunk after cached positions.

    python benchmarks/bench_attention_cpu.py [--threads N]
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def timed(f, n=3):
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    nh, nkv, D = 32, 4, 128
    g = torch.Generator().manual_seed(0)
    print(f"threads {a.threads}, cpu capability {torch.backends.cpu.get_cpu_capability()}")
    print("| T | P | fp32 (K/V expanded) ms | bf16 (expanded) ms | bf16 enable_gqa ms | fp32 / bf16 "
          "| bf16 rel. error |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for T, P in ((512, 512), (512, 1024), (512, 2048), (1024, 4096)):
        q = torch.randn(1, nh, T, D, generator=g)
        k, v = torch.randn(1, nkv, P, D, generator=g), torch.randn(1, nkv, P, D, generator=g)
        mask = None if P == T else causal_lower_right(T, P)

        def run(dt, gqa):
            qq, kk, vv = q.to(dt), k.to(dt), v.to(dt)
            if not gqa:
                kk, vv = kk.repeat_interleave(nh // nkv, 1), vv.repeat_interleave(nh // nkv, 1)
            return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=P == T, enable_gqa=gqa)
        ref = run(torch.float32, False)
        err = float((run(torch.bfloat16, False).float() - ref).norm() / ref.norm())
        t32, t16, t16g = (timed(lambda dt=dt, gq=gq: run(dt, gq)) * 1e3 for dt, gq in
                          ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)))
        print(f"| {T} | {P} | {t32:.1f} | {t16:.1f} | {t16g:.1f} | {t32 / min(t16, t16g):.2f}x | {err:.1e} |")


if __name__ == "__main__":
    main()
