"""The MoE decode kernels (kernels/gpu_decode.py) alone, per tile configuration, at the Qwen3-30B-A3B expert
shape (E=128, k=8, H=2048, F=768), one token: microseconds and GB/s of expert bytes read, against a device
copy's bandwidth. For choosing gpu_decode._MOE_TILES. Usage (GPU machine):

    python3 benchmarks/bench_moe_decode.py [Q4_0,Q8_0,Q4_K]
    python3 benchmarks/bench_moe_decode.py --tiles [Q4_0,Q8_0,Q4_K,Q6_K,IQ4_XS,IQ4_KS,Q3_K]
    python3 benchmarks/bench_moe_decode.py --split [Q4_0,Q8_0]

--tiles times only gpu_decode._MOE_TILES on each kernel: the measurements behind gpu_decode.moe_tile.
--split times GGUF rows against split rows (quant.ref.split_rows) over a grid of tiles, each kernel replayed
from a CUDA graph (as decode runs it: no launch overhead in the figure).

    python3 benchmarks/bench_moe_decode.py --grouped [Q4_0,Q8_0]
    python3 benchmarks/bench_moe_decode.py --grouped-tiles [Q4_0,Q8_0]

    python3 benchmarks/bench_moe_decode.py --mmq-tiles [Q4_0,Q8_0]

    python3 benchmarks/bench_moe_decode.py --grouped-rows [Q4_0]
    python3 benchmarks/bench_moe_decode.py --oai [MXFP4]

--grouped: one MoE layer of B = 1..64 decode tokens (the batch step's buckets) by the per-pair GEMVs, the
grouped GEMVs (kernels/gpu_moe_grouped.py), the prompt's grouped GEMMs and the int8 tensor-core kernels
(kernels/gpu_mmq.py), graph-replayed, in GB/s of the distinct experts' bytes; --grouped-tiles: the grouped GEMVs
over block heights and tiles; --mmq-tiles: gpu_mmq's two kernels over a grid of tiles (for gpu_mmq.TILES), one
and two int8 terms, and the rule's whole layer against the best tiles'; --grouped-rows: the same as --grouped at
64 to 256 rows (the batch step's row buckets all on the GPU); --oai: gpt-oss's biased experts at gpt-oss-20b's
shape by the per-pair GEMVs, the grouped GEMVs and the grouped GEMMs.
"""
import itertools
import sys

import torch
import triton

from hybridmoe.kernels import gpu_decode as gd
from hybridmoe.quant.random_blocks import random_tensor
from hybridmoe.quant.ref import dequantize, random_blocks as _random_blocks, split_rows
from hybridmoe.quant.types import GGMLType, row_bytes

E, K_USED, H, F = 128, 8, 2048, 768


def random_blocks(q, shape, g):
    """Random GGUF rows of q on the GPU: quant.ref's generator where it has the type, else random_tensor's
    (IQ4_XS, IQ4_KS, Q3_K, ...; made on the CPU)."""
    try:
        return _random_blocks(q, shape, g)
    except NotImplementedError:
        return random_tensor(q, shape, torch.Generator().manual_seed(int(q))).cuda()


def tile_grid():
    """(BN, NB, warps) tiles of the dp4a kernels: BN rows, NB 32-blocks a K step. Where NB covers the program's
    threads (NB >= 32 x warps) a thread holds one block of all BN rows, so the activations' words are loaded once
    a program, not once a row: the tiles up to NB 64 and one warp hold those."""
    return [(bn, nb, w) for bn in (2, 4, 8, 16) for nb in (8, 16, 32, 64) for w in (1, 2, 4)]


def timed(fn, reps=200):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1e-3


def main(types):
    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_bw = 2 * big.numel() / timed(lambda: big.clone(), 10)
    del big
    print(f"device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    for name in types:
        q = GGMLType[name]
        graw, uraw = (random_blocks(q, (E, F, H), g) for _ in range(2))
        draw = random_blocks(q, (E, H, F), g)
        x = torch.randn(1, H, device="cuda", generator=g)
        ids = torch.randperm(E, device="cuda", generator=g)[:K_USED][None].to(torch.int32)
        wts = torch.softmax(torch.randn(1, K_USED, device="cuda", generator=g), -1)
        h = torch.empty(K_USED, F, device="cuda")
        out = torch.empty(K_USED, H, device="cuda")
        gu_bytes = 2 * K_USED * F * row_bytes(q, H)
        d_bytes = K_USED * H * row_bytes(q, F)
        qt = gd.QTYPES[q]
        auto = timed(lambda: gd.moe(x, ids, wts, graw, uraw, draw, q, q))
        print(f"\n{name}: autotuned gd.moe (both kernels + sum): {auto * 1e6:.1f} us, "
              f"{(gu_bytes + d_bytes) / auto / 1e9:.0f} GB/s")
        rows = []
        for bn, nb, w in itertools.product((1, 2, 4, 8, 16, 32), (8, 16, 32, 64), (1, 2, 4, 8)):
            if bn * nb > 512 or (qt >= 2 and nb < 8):
                continue
            try:
                t_gu = timed(lambda: gd._moe_gate_up_kernel.fn[(K_USED, triton.cdiv(F, bn))](
                    x, ids, graw, uraw, h, H, F, K_USED, graw.stride(0), graw.stride(1), uraw.stride(0),
                    uraw.stride(1), h, h, 0.0, 0.0, QT=qt, OAI=False, BN=bn, NB=nb, num_warps=w))
                t_d = timed(lambda: gd._moe_down_kernel.fn[(K_USED, triton.cdiv(H, bn))](
                    h, ids, wts, draw, out, F, H, draw.stride(0), draw.stride(1), h, QT=qt, OAI=False, BN=bn,
                    NB=nb, num_warps=w))
            except Exception as e:                      # noqa: BLE001 - a config this GPU can't build
                print(f"  BN={bn} NB={nb} warps={w}: {type(e).__name__}")
                continue
            rows.append((t_gu, t_d, bn, nb, w))
        for key, label, nbytes in ((0, "gate/up", gu_bytes), (1, "down", d_bytes)):
            print(f"  {label}: best configs (BN, NB, warps): us, GB/s")
            for r in sorted(rows, key=lambda r: r[key])[:6]:
                print(f"    {r[2:]}: {r[key] * 1e6:.1f} us, {nbytes / r[key] / 1e9:.0f} GB/s")


def tiles(types):
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| type | kernel | " + " | ".join(str(t) for t in gd._MOE_TILES) + " | rule's pick |")
    print("|---|---|" + "---:|" * (len(gd._MOE_TILES) + 1))
    for name in types:
        q = GGMLType[name]
        qt = gd.QTYPES[q]
        # each type at its models' expert shape: MXFP4 is gpt-oss's (gpt-oss-20b: 32 experts of 2880 x 2880)
        E_, F_, H_ = (32, 2880, 2880) if q == GGMLType.MXFP4 else (E, F, H)
        graw, uraw = (random_blocks(q, (E_, F_, H_), g) for _ in range(2))
        draw = random_blocks(q, (E_, H_, F_), g)
        x = torch.randn(1, H_, device="cuda", generator=g)
        ids = torch.randperm(E_, device="cuda", generator=g)[:K_USED][None].to(torch.int32)
        wts = torch.softmax(torch.randn(1, K_USED, device="cuda", generator=g), -1)
        h, out = torch.empty(K_USED, F_, device="cuda"), torch.empty(K_USED, H_, device="cuda")
        nbytes = {"gate/up": 2 * K_USED * graw[0].numel(), "down": K_USED * draw[0].numel()}
        for label, run in (
                ("gate/up", lambda bn, nb, w: gd._moe_gate_up_kernel.fn[(K_USED, triton.cdiv(F_, bn))](
                    x, ids, graw, uraw, h, H_, F_, K_USED, graw.stride(0), graw.stride(1), uraw.stride(0),
                    uraw.stride(1), h, h, 0.0, 0.0, QT=qt, OAI=False, BN=bn, NB=nb, num_warps=w)),
                ("down", lambda bn, nb, w: gd._moe_down_kernel.fn[(K_USED, triton.cdiv(H_, bn))](
                    h, ids, wts, draw, out, F_, H_, draw.stride(0), draw.stride(1), h, QT=qt, OAI=False, BN=bn,
                    NB=nb, num_warps=w))):
            us = [timed(lambda t=t: run(*t)) * 1e6 for t in gd._MOE_TILES]
            pick = gd.moe_tile(q, label == "gate/up")
            best = min(us)
            print(f"| {name} | {label} | " + " | ".join(f"{u:.1f}" for u in us) +
                  f" | {pick} ({us[gd._MOE_TILES.index(pick)] / best:.2f}x best; best "
                  f"{nbytes[label] / best / 1e3:.0f} GB/s) |")


def graph_timed(fn, n=20, reps=20):
    """Seconds a call of fn, n calls captured in one CUDA graph and replayed (no host launch cost)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr, stream=s):
            for _ in range(n):
                fn()
    gr.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        gr.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps / n * 1e-3


def split(types):
    """GGUF rows (fp32 activations) against split rows (int8 activations, dp4a): the whole gd.moe and each
    kernel over a grid of tiles, replayed from CUDA graphs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    grid = tile_grid()
    for name in types:
        q = GGMLType[name]
        qt = gd.QTYPES[q]
        graw, uraw = (random_blocks(q, (E, F, H), g) for _ in range(2))
        draw = random_blocks(q, (E, H, F), g)
        gs, us, ds = (split_rows(t, q) for t in (graw, uraw, draw))
        x = torch.randn(1, H, device="cuda", generator=g)
        ids = torch.randperm(E, device="cuda", generator=g)[:K_USED][None].to(torch.int32)
        wts = torch.softmax(torch.randn(1, K_USED, device="cuda", generator=g), -1)
        h, out = torch.empty(K_USED, F, device="cuda"), torch.empty(K_USED, H, device="cuda")
        gu_bytes = 2 * K_USED * F * row_bytes(q, H)
        d_bytes = K_USED * H * row_bytes(q, F)
        old = graph_timed(lambda: gd.moe(x, ids, wts, graw, uraw, draw, q, q, reduce=False))
        new = graph_timed(lambda: gd.moe(x, ids, wts, gs, us, ds, q, q, reduce=False, gate_split=True,
                                         down_split=True))
        print(f"{name}: gd.moe GGUF rows {old * 1e6:.1f} us, split rows {new * 1e6:.1f} us "
              f"(tiles {gd.split_tile(q, True)}, {gd.split_tile(q, False)}; {(gu_bytes + d_bytes) / new / 1e9:.0f} GB/s), {old / new:.2f}x")
        xq, hq = gd.quant_x8(x), gd.quant_x8(h)
        print(f"  quant_x8: x {graph_timed(lambda: gd.quant_x8(x)) * 1e6:.1f} us, "
              f"h {graph_timed(lambda: gd.quant_x8(h)) * 1e6:.1f} us")
        res = {"gate/up": [], "down": []}
        for bn, nb, w in grid:
            res["gate/up"].append((graph_timed(lambda: gd._moe_gate_up8_kernel[(K_USED, triton.cdiv(F, bn))](
                *xq, ids, gs, us, h, H, F, K_USED, gs.stride(0), gs.stride(1), us.stride(0), us.stride(1),
                QT=qt, BN=bn, NB=nb, EMU=False, num_warps=w)), (bn, nb, w)))
            res["down"].append((graph_timed(lambda: gd._moe_down8_kernel[(K_USED, triton.cdiv(H, bn))](
                *hq, ids, wts, ds, out, F, H, ds.stride(0), ds.stride(1), QT=qt, BN=bn, NB=nb, EMU=False,
                num_warps=w)), (bn, nb, w)))
        for label, nbytes in (("gate/up", gu_bytes), ("down", d_bytes)):
            best = sorted(res[label])[:5]
            print(f"  {label}: " + ", ".join(f"{c} {t * 1e6:.1f} us ({nbytes / t / 1e9:.0f} GB/s)" for t, c in best))


def dense(types):
    """The static decode step's dense GEMVs (Qwen3-30B-A3B: QKV, output projection, head) from split rows with
    dp4a (gpu_decode.gemv8) against cuBLAS on bf16 weights, and gemv8 over a grid of tiles, replayed from
    CUDA graphs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    grid = tile_grid()
    for name in types:
        q = GGMLType[name]
        for label, N, K in (("qkv", 5120, 2048), ("output", 2048, 4096), ("head", 151936, 2048)):
            raw = random_blocks(q, (N, K), g)
            ws = [split_rows(raw, q)]
            wb = dequantize(raw, q, K).to(torch.bfloat16)
            x = torch.randn(1, K, device="cuda", generator=g)
            xb, xq = x.to(torch.bfloat16), gd.quant_x8(x)
            out = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
            nbytes = raw.numel()
            t_bf = graph_timed(lambda: xb @ wb.t())
            t_q8 = graph_timed(lambda: gd.gemv8(xq, ws, q, K, out))
            t_qx = graph_timed(lambda: gd.quant_x8(x))
            res = []
            for bn, nb, w in grid:
                res.append((graph_timed(lambda: gd._gemv8_kernel[(triton.cdiv(N, bn),)](
                    *xq, ws[0], ws[0], ws[0], N, N, out, K, N, ws[0].stride(0), QT=gd.QTYPES[q], BN=bn, NB=nb,
                    EMU=False, num_warps=w)), (bn, nb, w)))
            best = sorted(res)[:4]
            print(f"{name} {label} [{N}, {K}]: cuBLAS bf16 {t_bf * 1e6:.1f} us ({2 * N * K / t_bf / 1e9:.0f} GB/s), "
                  f"gemv8 {gd.gemv8_tile(K)} {t_q8 * 1e6:.1f} us ({nbytes / t_q8 / 1e9:.0f} GB/s), {t_bf / t_q8:.2f}x; "
                  f"quant_x8 {t_qx * 1e6:.1f} us")
            print("  best tiles: " + ", ".join(f"{c} {t * 1e6:.1f} us ({nbytes / t / 1e9:.0f} GB/s)" for t, c in best))


def _tile_report(head: str, res, pick):
    """Print the picked tile's time and the five fastest of res (sorted [(seconds, tile)]); the fastest tile."""
    t_pick = next((s for s, t in res if t == pick), float("nan"))
    print(f"{head} {pick} {t_pick * 1e6:.1f} us; best: " + ", ".join(f"{t} {s * 1e6:.1f} us" for s, t in res[:5]),
          flush=True)
    return res[0][1]


def split_batch(types, sizes=(4, 16, 32)):
    """The per-pair split-row kernels (the batched step's below 129 pairs) over a grid of tiles at B tokens' pairs
    (_batch_case's routing), each replayed from CUDA graphs: the rule's tile (split_tile, chosen at one token) and
    the five fastest per kernel, then the whole gd.moe on the rule's tiles and on the best ones."""
    g = torch.Generator(device="cuda").manual_seed(0)
    grid = tile_grid()
    for name in types:
        q = GGMLType[name]
        qt = gd.QTYPES[q]
        for B in sizes:
            x, ids, wts, gs, us, ds, nbytes = _batch_case(q, B, g)
            n = B * K_USED
            h, out = torch.randn(n, F, device="cuda", generator=g), torch.empty(n, H, device="cuda")
            xq, hq = gd.quant_x8(x), gd.quant_x8(h)
            best = {}
            for gate_up in (True, False):
                def run(t, gate_up=gate_up):
                    bn, nb, w = t
                    if gate_up:
                        gd._moe_gate_up8_kernel[(n, triton.cdiv(F, bn))](
                            *xq, ids, gs, us, h, H, F, K_USED, gs.stride(0), gs.stride(1), us.stride(0),
                            us.stride(1), QT=qt, BN=bn, NB=nb, EMU=False, num_warps=w)
                    else:
                        gd._moe_down8_kernel[(n, triton.cdiv(H, bn))](
                            *hq, ids, wts, ds, out, F, H, ds.stride(0), ds.stride(1), QT=qt, BN=bn, NB=nb, EMU=False,
                            num_warps=w)
                res = sorted((graph_timed(lambda: run(t), n=10, reps=10), t) for t in grid)
                best[gate_up] = _tile_report(f"{name} B={B} ({n} pairs) {'gate/up' if gate_up else 'down'}: rule", res,
                                             gd.split_tile(q, gate_up, n))
            kw = dict(gate_split=True, down_split=True)
            rule = graph_timed(lambda: gd.moe(x, ids, wts, gs, us, ds, q, q, **kw), n=10, reps=10)
            tb = (best[True], best[False])
            top = graph_timed(lambda: gd.moe(x, ids, wts, gs, us, ds, q, q, tiles8=tb, **kw), n=10, reps=10)
            print(f"{name} B={B} layer: rule {rule * 1e6:.1f} us ({nbytes / rule / 1e9:.0f} GB/s of the distinct "
                  f"experts), best tiles {tb} {top * 1e6:.1f} us ({nbytes / top / 1e9:.0f} GB/s)", flush=True)


def _batch_case(q, B, g):
    """The 30B layer's experts in split rows (as the GPU keeps them) and B tokens' routing: each token's k
    experts uniformly at random (a real router is skewed: fewer distinct experts, more pairs each); and the
    bytes of the distinct experts the batch reads."""
    graw, uraw = (split_rows(random_blocks(q, (E, F, H), g), q) for _ in range(2))
    draw = split_rows(random_blocks(q, (E, H, F), g), q)
    x = torch.randn(B, H, device="cuda", generator=g)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K_USED] for _ in range(B)]).to(torch.int32)
    wts = torch.softmax(torch.randn(B, K_USED, device="cuda", generator=g), -1)
    nbytes = int(torch.unique(ids).numel()) * (2 * F * row_bytes(q, H) + H * row_bytes(q, F))
    return x, ids, wts, graw, uraw, draw, nbytes


def grouped(types, sizes=(1, 2, 4, 8, 16, 32, 64)):
    """Per-pair GEMVs (gpu_decode.moe), the grouped GEMVs (gpu_moe_grouped.moe), the grouped GEMMs (gpu_moe.moe,
    bf16) and the int8 tensor-core kernels (gpu_mmq.moe) on one MoE layer of B tokens, each replayed from a CUDA
    graph: us a layer, GB/s of the distinct experts' bytes (what a step must read), which
    runtime/experts.gpu_moe_path picks, gemm's time over mmq's, and each result's distance from the grouped
    GEMVs' (the same two int8 terms as mmq's and the per-pair kernels')."""
    from hybridmoe.kernels import gpu_mmq as mq
    from hybridmoe.kernels import gpu_moe as gm
    from hybridmoe.kernels import gpu_moe_grouped as gg
    from hybridmoe.runtime.experts import gpu_moe_path
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| type | B | distinct experts | MB read | per-pair us (GB/s) | grouped us (GB/s) | gemm us (GB/s) | "
          "mmq us (GB/s) | auto picks | gemm / mmq | rel diff pair, gemm, mmq |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for name in types:
        q = GGMLType[name]
        for B in sizes:
            x, ids, wts, gs, us, ds, nbytes = _batch_case(q, B, g)
            kw = dict(gate_split=True, down_split=True)
            runs = {"pair": lambda: gd.moe(x, ids, wts, gs, us, ds, q, q, **kw),
                    "grouped": lambda: gg.moe(x, ids, wts, gs, us, ds, q, q, **kw),
                    "gemm": lambda: gm.moe(x, ids, wts, gs, us, ds, q, q, **kw),
                    "mmq": lambda: mq.moe(x, ids, wts, gs, us, ds, q, q, **kw)}
            t = {k: graph_timed(f, n=10, reps=10) for k, f in runs.items()}
            ref = runs["grouped"]()
            diff = [float((runs[k]() - ref).norm() / ref.norm()) for k in ("pair", "gemm", "mmq")]
            cell = " | ".join(f"{t[k] * 1e6:.1f} ({nbytes / t[k] / 1e9:.0f})" for k in runs)
            auto = gpu_moe_path(B, B * K_USED, (q,) * 3, True)
            print(f"| {name} | {B} | {torch.unique(ids).numel()} | {nbytes / 1e6:.0f} | {cell} | {auto} | "
                  f"{t['gemm'] / t['mmq']:.2f} | {', '.join(f'{d:.1e}' for d in diff)} |", flush=True)


def oai(types, sizes=(1, 2, 4, 8, 16, 32, 64)):
    """gpt-oss's biased experts (GGUF rows; MXFP4 in its files) at gpt-oss-20b's shape (32 experts of 2880 x 2880,
    4 a token) on one MoE layer of B tokens: the per-pair GEMVs, the grouped GEMVs and the grouped GEMMs, each
    replayed from a CUDA graph: us a layer, GB/s of the distinct experts' bytes, runtime/experts.oai_moe_path's
    pick, and each result's distance from the per-pair kernels'."""
    from hybridmoe.kernels import gpu_moe as gm
    from hybridmoe.kernels import gpu_moe_grouped as gg
    from hybridmoe.runtime.experts import oai_moe_path
    E_, k, H_, F_ = 32, 4, 2880, 2880
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| type | B | distinct experts | MB read | per-pair us (GB/s) | grouped us (GB/s) | gemm us (GB/s) | "
          "auto picks | rel diff grouped, gemm |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for name in types:
        q = GGMLType[name]
        gs, us = (random_blocks(q, (E_, F_, H_), g) for _ in range(2))
        ds = random_blocks(q, (E_, H_, F_), g)
        biases = (torch.randn(E_, F_, device="cuda", generator=g), torch.randn(E_, F_, device="cuda", generator=g),
                  torch.randn(E_, H_, device="cuda", generator=g), 1.702, 7.0)
        for B in sizes:
            x = torch.randn(B, H_, device="cuda", generator=g)
            ids = torch.stack([torch.randperm(E_, device="cuda", generator=g)[:k] for _ in range(B)]).to(torch.int32)
            wts = torch.softmax(torch.randn(B, k, device="cuda", generator=g), -1)
            nbytes = int(torch.unique(ids).numel()) * (2 * F_ * row_bytes(q, H_) + H_ * row_bytes(q, F_))
            runs = {"pair": lambda: gd.moe(x, ids, wts, gs, us, ds, q, q, oai=biases),
                    "grouped": lambda: gg.moe(x, ids, wts, gs, us, ds, q, q, oai=biases),
                    "gemm": lambda: gm.moe(x, ids, wts, gs, us, ds, q, q, oai=biases)}
            t = {kk: graph_timed(f, n=10, reps=10) for kk, f in runs.items()}
            ref = runs["pair"]()
            diff = [float((runs[kk]() - ref).norm() / ref.norm()) for kk in ("grouped", "gemm")]
            cell = " | ".join(f"{t[kk] * 1e6:.1f} ({nbytes / t[kk] / 1e9:.0f})" for kk in runs)
            print(f"| {name} | {B} | {torch.unique(ids).numel()} | {nbytes / 1e6:.0f} | {cell} | "
                  f"{oai_moe_path(B, B * k)} | {', '.join(f'{d:.1e}' for d in diff)} |", flush=True)


def grouped_tiles(types, sizes=(16, 64), bms=(2, 4, 8, 16), warps=(4, 8)):
    """The grouped GEMVs over block heights and tiles (gate/up and down alike), graph-replayed: the five
    fastest per (type, B), against the rule's (block_rows, grouped_tile) and the per-pair kernels' on the same
    routing."""
    from hybridmoe.kernels import gpu_moe_grouped as gg
    g = torch.Generator(device="cuda").manual_seed(1)
    grid = [(bn, nb, w) for bn in (2, 4, 8, 16) for nb in (8, 16, 32) for w in warps]
    for name in types:
        q = GGMLType[name]
        for B in sizes:
            x, ids, wts, gs, us, ds, nbytes = _batch_case(q, B, g)
            rule = graph_timed(lambda: gg.moe(x, ids, wts, gs, us, ds, q, q, gate_split=True, down_split=True),
                               n=10, reps=10)
            pair = graph_timed(lambda: gd.moe(x, ids, wts, gs, us, ds, q, q, gate_split=True, down_split=True),
                               n=10, reps=10)
            print(f"{name} B={B}: per-pair {pair * 1e6:.1f} us ({nbytes / pair / 1e9:.0f} GB/s)", flush=True)
            res = []
            for bm in bms:
                for tile in grid:
                    if bm * tile[0] * tile[1] > 2048:
                        continue
                    try:
                        res.append((graph_timed(lambda: gg.moe(x, ids, wts, gs, us, ds, q, q, gate_split=True,
                                                               down_split=True, bm=bm, tiles8=(tile, tile)),
                                                n=10, reps=5), bm, tile))
                    except Exception as e:          # noqa: BLE001 - a config this GPU can't build
                        print(f"  BM={bm} {tile}: {type(e).__name__}")
            best = sorted(res)[:5]
            print(f"{name} B={B}: rule (BM {gg.block_rows(B * K_USED, E)}) {rule * 1e6:.1f} us "
                  f"({nbytes / rule / 1e9:.0f} GB/s); best: " +
                  ", ".join(f"BM {bm} {tile} {t * 1e6:.1f} us" for t, bm, tile in best), flush=True)


def mmq_tiles(types, sizes=(16, 64)):
    """gpu_mmq's gate/up and down kernels apart, over a grid of (BN, NB, warps, stages), graph-replayed at the
    rule's pairs a block: the five fastest of each against gpu_mmq.TILES' pick; then the whole layer with the
    rule's tiles, the best ones, and at the best tiles one int8 term instead of two, and half and twice the
    rule's pairs a block."""
    from hybridmoe.kernels import gpu_mmq as mq
    from hybridmoe.kernels.gpu_moe import align
    g = torch.Generator(device="cuda").manual_seed(1)
    grid = [(bn, nb, 4, 3) for bn in (32, 64, 128) for nb in (2, 4)] + \
        [(64, 8, 4, 2), (64, 4, 4, 2), (64, 2, 4, 4), (128, 4, 8, 3), (32, 4, 2, 3)]
    for name in types:
        q = GGMLType[name]
        perm = q == GGMLType.Q4_0
        for B in sizes:
            x, ids, wts, gs, us, ds, nbytes = _batch_case(q, B, g)
            n = B * K_USED
            bp = mq.block_pairs(n, E)
            pairs, blk_e = align(ids, E, bp)
            wf = wts.reshape(-1).float().contiguous()
            h = torch.randn(n, F, device="cuda", generator=g)
            out = torch.empty(n, H, device="cuda")
            xq, hq, h8 = mq.quant(x, perm), mq.quant(h, perm), mq._x8(n, F, "cuda")
            best = {}
            for gate_up in (True, False):
                def run(t, gate_up=gate_up):
                    if gate_up:                 # int8 output as moe() has it where BN allows
                        o = h8 if t[0] % 32 == 0 else h
                        mq._launch(xq, pairs, blk_e, n, K_USED, gs, us, wf, o, H, F, q, True, bp, mq.TERMS, t, perm)
                    else:
                        mq._launch(hq, pairs, blk_e, n, K_USED, ds, ds, wf, out, F, H, q, False, bp, mq.TERMS, t)
                res = []
                for t in grid:
                    try:
                        res.append((graph_timed(lambda: run(t), n=10, reps=5), t))
                    except Exception as e:          # noqa: BLE001 - a config this GPU can't build
                        print(f"  {t}: {type(e).__name__}: {str(e)[:120]}")
                res.sort()
                best[gate_up] = _tile_report(f"{name} B={B} BP={bp} {'gate/up' if gate_up else 'down'}: TILES'", res,
                                             mq.TILES[gate_up])
            kw = dict(gate_split=True, down_split=True)
            rule = graph_timed(lambda: mq.moe(x, ids, wts, gs, us, ds, q, q, **kw), n=10, reps=10)
            tb = (best[True], best[False])
            top = graph_timed(lambda: mq.moe(x, ids, wts, gs, us, ds, q, q, tiles=tb, **kw), n=10, reps=10)
            one = graph_timed(lambda: mq.moe(x, ids, wts, gs, us, ds, q, q, tiles=tb, terms=1, **kw), n=10, reps=10)
            other = {b: graph_timed(lambda: mq.moe(x, ids, wts, gs, us, ds, q, q, tiles=tb, bp=b, **kw), n=10, reps=10)
                     for b in (bp // 2, bp * 2) if 2 <= b <= 16}
            print(f"{name} B={B} layer: rule {rule * 1e6:.1f} us ({nbytes / rule / 1e9:.0f} GB/s), best tiles {tb} "
                  f"{top * 1e6:.1f} us ({nbytes / top / 1e9:.0f} GB/s), one term {one * 1e6:.1f} us, " +
                  ", ".join(f"BP {b} {t * 1e6:.1f} us" for b, t in other.items()), flush=True)


def ncu_case(types, B=16):
    """One MoE layer of B tokens by the per-pair GEMVs, the grouped GEMVs and mmq, each called eagerly three
    times (the first compiles): a short program for Nsight Compute to profile those kernels, e.g.
    ncu --clock-control none -k regex:"gate_up8|down8|mmq" --section SpeedOfLight ... bench_moe_decode.py --ncu"""
    from hybridmoe.kernels import gpu_mmq as mq
    from hybridmoe.kernels import gpu_moe_grouped as gg
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in types:
        q = GGMLType[name]
        x, ids, wts, gs, us, ds, nbytes = _batch_case(q, B, g)
        kw = dict(gate_split=True, down_split=True)
        for mod in (gd, gg, mq):
            for _ in range(3):
                mod.moe(x, ids, wts, gs, us, ds, q, q, **kw)
            torch.cuda.synchronize()
        print(f"{name} B={B}: {torch.unique(ids).numel()} distinct experts, {nbytes / 1e6:.0f} MB", flush=True)


if __name__ == "__main__":
    # --option [TYPES]: (function, default types); no option: main over its default types
    modes = {"--mmq-tiles": (mmq_tiles, "Q4_0,Q8_0"),
             "--mmq-tiles-64": (lambda t: mmq_tiles(t, (64,)), "Q4_0"), "--grouped": (grouped, "Q4_0,Q8_0"), "--oai": (oai, "MXFP4"),
             "--grouped-rows": (lambda t: grouped(t, (64, 128, 192, 256)), "Q4_0"),
             "--grouped-tiles": (grouped_tiles, "Q4_0,Q8_0"), "--dense": (dense, "Q8_0,Q4_0"),
             "--split": (split, "Q4_0,Q8_0"),
             "--split-batch": (split_batch, "Q4_0"),
             "--split-batch-16": (lambda t: split_batch(t, (16,)), "Q4_0"),
             "--split-batch-4-32": (lambda t: split_batch(t, (4, 32)), "Q4_0"), "--ncu": (ncu_case, "Q4_0"),
             "--grouped-tiles-16": (lambda t: grouped_tiles(t, (16,), (2, 4), (1, 2)), "Q4_0"), "--tiles": (tiles, "Q4_0,Q8_0,Q4_K,Q6_K")}
    if sys.argv[1:2] and sys.argv[1] in modes:
        fn, default = modes[sys.argv[1]]
        fn((sys.argv[2] if len(sys.argv) > 2 else default).split(","))
    else:
        main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["Q4_0", "Q8_0", "Q4_K"])
