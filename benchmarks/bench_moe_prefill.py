"""Prompt-processing MoE on the GPU, one layer at the Qwen3-30B-A3B expert shape (E=128, k=8, H=2048, F=768),
spread routing: the fused kernels from GGUF bytes (kernels/gpu_moe.py) against dequantize-to-bf16 +
torch._grouped_mm (runtime/experts._grouped_moe), in one run. Reports ms a layer, TFLOP/s, GB/s of the expert
bytes the batch touches, the same run's bf16 GEMM rate and device copy bandwidth, and the relative
difference of the two paths. Usage (GPU machine):

    python3 benchmarks/bench_moe_prefill.py [Q4_0,Q8_0] [128,512,2048,4096]     (also Q4_K, Q6_K, IQ4_XS, ...)
    python3 benchmarks/bench_moe_prefill.py --tiles [Q4_0,Q8_0] [64,128,512,2048,4096]

--tiles times each of gpu_moe.TILES on the gate/up and the down kernel separately (us a call, rows per
block from block_rows), the measurements behind gpu_moe.pick_tile's rule; --tiles-split the same on split
rows (quant.ref.split_rows, the layout GPU-resident experts are kept in).
"""
import sys

import torch

from hybridmoe.devices import Device
from hybridmoe.kernels import gpu_moe
from hybridmoe.quant.random_blocks import random_tensor
from hybridmoe.quant.ref import random_blocks, split_rows
from hybridmoe.quant.types import GGMLType, row_bytes
from hybridmoe.runtime import experts as X
from hybridmoe.runtime.weights import QTensor

E, K_USED, H, F = 128, 8, 2048, 768


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / reps * 1e-3)
    return best


def expert_raw(q, shape, g):
    """Random experts of type q on the GPU: ref's generator where it has the type (the Q4_0 / Q8_0 rows measured
    before), every other type's else."""
    if q in (GGMLType.Q4_0, GGMLType.Q8_0):
        return random_blocks(q, shape, g)
    return random_tensor(q, shape, torch.Generator().manual_seed(0)).cuda()


def main(types, batches):
    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_bw = 2 * big.numel() / timed(lambda: big.clone(), 5)
    del big
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = 2 * 8192 ** 3 / timed(lambda: a @ a, 5)
    del a
    print(f"device copy {copy_bw / 1e9:.0f} GB/s (read + write), bf16 GEMM {mm / 1e12:.0f} TFLOP/s")
    dev = Device("CUDA0", "cuda", 0, 0, 0, torch.device("cuda"))
    print("| type | T | fused ms | TFLOP/s | expert GB/s | dequant + grouped_mm ms | speed-up | rel. diff | "
          "fused on split rows ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in types:
        q = GGMLType[name]
        ws = [QTensor(n, expert_raw(q, s, g), q, s, dev) for n, s in (("g", (E, F, H)), ("u", (E, F, H)),
                                                                      ("d", (E, H, F)))]
        raws = [w.raw for w in ws]
        sraws = [split_rows(r, q) for r in raws] if q in (GGMLType.Q4_0, GGMLType.Q8_0) else None
        nbytes = 2 * E * F * row_bytes(q, H) + E * H * row_bytes(q, F)
        for T in batches:
            x = torch.randn(T, H, device="cuda", generator=g)
            ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K_USED] for _ in range(T)])
            wts = torch.softmax(torch.randn(T, K_USED, device="cuda", generator=g), -1)
            touched = int(torch.unique(ids).numel()) / E
            fused = timed(lambda: gpu_moe.moe(x, ids, wts, *raws, q, q))
            fsplit = sraws and timed(lambda: gpu_moe.moe(x, ids, wts, *sraws, q, q, gate_split=True, down_split=True))
            ref = timed(lambda: X._grouped_moe(x, ids, wts, *raws, ws[0], ws[2]))
            y1 = gpu_moe.moe(x, ids, wts, *raws, q, q)
            y2 = X._grouped_moe(x, ids, wts, *raws, ws[0], ws[2])
            diff = float((y1 - y2).norm() / y2.norm())
            flops = 2 * 3 * T * K_USED * H * F
            print(f"| {name} | {T} | {fused * 1e3:.3f} | {flops / fused / 1e12:.1f} | "
                  f"{nbytes * touched / fused / 1e9:.0f} | {ref * 1e3:.3f} | {ref / fused:.2f} | {diff:.1e} | "
                  f"{f'{fsplit * 1e3:.3f}' if sraws else ''} |")
            if T == 512 and name == "Q4_0":                 # rows per block around block_rows' choice
                for bm in (16, 32, 64, 128):
                    t = timed(lambda: gpu_moe.moe(x, ids, wts, *raws, q, q, bm=bm))
                    print(f"|   BM={bm} | {T} | {t * 1e3:.3f} | {flops / t / 1e12:.1f} | | | | |")
    print("autotuner's choices (K, N, BM, type, gate/up, permuted out, ...): config")
    for key, cfg in gpu_moe._moe_gemm_kernel.cache.items():
        print(f"  {key[:6]}: {cfg.kwargs} warps={cfg.num_warps} stages={cfg.num_stages}")


def tiles(types, batches, split=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| type | T | BM | kernel | " + " | ".join(str(t) for t in gpu_moe.TILES) + " | rule's pick |")
    print("|---|---:|---:|---|" + "---:|" * (len(gpu_moe.TILES) + 1))
    for name in types:
        q = GGMLType[name]
        gr, ur, dr = (expert_raw(q, s, g) for s in ((E, F, H), (E, F, H), (E, H, F)))
        if split:
            gr, ur, dr = (split_rows(r, q) for r in (gr, ur, dr))
        for T in batches:
            x = torch.randn(T, H, device="cuda", generator=g)
            ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K_USED] for _ in range(T)])
            wf = torch.softmax(torch.randn(T, K_USED, device="cuda", generator=g), -1).reshape(-1)
            n = T * K_USED
            bm = gpu_moe.block_rows(n, E)
            pairs, blk_e = gpu_moe.align(ids, E, bm)
            a = x.to(torch.bfloat16)
            q4 = q in gpu_moe._Q4_ORDER
            a = a[:, gpu_moe.q4_0_order(H, x.device)] if q4 else a
            h = torch.randn(pairs.numel(), F, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(n, H, device="cuda")
            for label, args in (("gate/up", (a, gr, ur, h, pairs, blk_e, wf, n, K_USED, H, F, q, bm, True, q4,
                                              split)),
                                ("down", (h, dr, dr, out, pairs, blk_e, wf, n, K_USED, F, H, q, bm, False, False,
                                          split))):
                us = [timed(lambda t=t: gpu_moe._gemm(*args, t)) * 1e6 for t in gpu_moe.TILES]
                pick = gpu_moe.pick_tile(bm, args[13], q, split)
                print(f"| {name} | {T} | {bm} | {label} | " + " | ".join(f"{u:.0f}" for u in us) +
                      f" | {pick} ({us[gpu_moe.TILES.index(pick)] / min(us):.2f}x best) |")


if __name__ == "__main__":
    if sys.argv[1:2] in (["--tiles"], ["--tiles-split"]):
        tiles(sys.argv[2].split(",") if len(sys.argv) > 2 else ["Q4_0", "Q8_0"],
              [int(t) for t in sys.argv[3].split(",")] if len(sys.argv) > 3 else [64, 128, 512, 2048, 4096],
              split=sys.argv[1] == "--tiles-split")
        sys.exit()
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["Q4_0", "Q8_0"],
         [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else [128, 512, 2048, 4096])
