"""Where an all-CPU decode token's time goes (hm_decode_step, runtime/steps/cpu_decode.py), part by part.

Loads the model with every weight on the CPU and decodes N tokens three ways: `model.forward` (what `bench`
runs), `CpuDecoder.step` (less the scheduler) and the bare C call (less the Python/ctypes of the step); the
differences are the Python per token. The C step's own timers split it into matrix-vector products,
attention, routed experts and the rest (norms, RoPE, routing, residuals, entering and leaving parallel
regions). Then each part alone, on the model's own weights, as many times as a token runs it: the dense
products per kind (q/k/v, output, router, the head) through the same kernels, and the experts (k routed at
random a layer), each with its bytes, GB/s and share of the RAM read rate measured now. Wall time and the
process's CPU time are both given: on a loaded machine, CPU time / wall shows how much the threads ran.

    python benchmarks/profile_cpu_decode.py [-m FILE | --type Q4_0] [-t 2] [-n 64] [--reps 20] [--against SRC [--rounds 40]]

--against SRC: instead, an A/B of the C step in one process: this tree's kernel library and the one built from
another source tree (e.g. the commit before a change, `git archive BASE src | tar -x -C /tmp/base`), both
called on the same model structs and cache, alternating every -n tokens for --rounds rounds; the median
ratio of their times is robust to load that changes over seconds (both see it), unlike separate runs.

Default file: the 4-layer Qwen3-30B-A3B slice of benchmarks/vs_llamacpp_cpu.py, experts --type (Q4_0).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def timed(fn, reps):
    """Median wall and process-CPU seconds of fn() over reps calls (after one untimed)."""
    fn()
    w, c = [], []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        w.append(time.perf_counter() - t0)
        c.append(time.process_time() - c0)
    return statistics.median(w), statistics.median(c)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--type", default="Q4_0", help="expert type of the default file (default Q4_0)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-n", type=int, default=64, help="decode steps per measurement (default 64)")
    ap.add_argument("--reps", type=int, default=20, help="calls per part measured alone (default 20)")
    ap.add_argument("--against", default=None, metavar="SRC", help="A/B the C step against SRC's kernel library")
    ap.add_argument("--rounds", type=int, default=40, help="A/B rounds (default 40)")
    args = ap.parse_args()
    import hybridmoe
    from hybridmoe.kernels import cpu
    from hybridmoe.perf.calibrate import ram_read_now
    from hybridmoe.runtime.steps.cpu_decode import CpuDecoder
    if args.model is None:
        from slices import qwen3_slice
        args.model = qwen3_slice(args.type)
    T = args.threads
    torch.set_num_threads(T)
    m = hybridmoe.load(args.model, n_gpu_layers=0, threads=T)
    cfg, layers = m.cfg, m.decoder.layers
    kv = m.new_cache(args.n + 64)
    dec = CpuDecoder(m, kv)
    if args.against:
        return ab(dec, args)
    bw = ram_read_now(reps=3)
    print(f"{args.model}: {cfg.n_layer} layers, -t {T}, kernels {cpu.simd()}; RAM read now {bw / 1e9:.1f} GB/s")

    # the whole step, three ways: at positions 32.. of a 32-token prompt
    m.forward(torch.arange(1, 33), 0, kv, all_logits=False)
    pos = [32]

    def via_forward():
        for i in range(args.n):
            m.forward(torch.tensor([7 + i]), 32 + i, kv, all_logits=False)

    def via_step():
        for i in range(args.n):
            dec.step(7 + i, 32 + i)

    times = (ctypes.c_double * 3)()
    out = torch.empty(1, dec.n_vocab)

    def via_c():
        for i in range(args.n):
            cos, sin = dec._cos_sin(32 + i)
            dec.lib.hm_decode_step(dec.mp, 7 + i, 32 + i, cos.data_ptr(), sin.data_ptr(), out.data_ptr(), times)

    del pos
    rows = []
    for name, fn in (("model.forward", via_forward), ("CpuDecoder.step", via_step), ("hm_decode_step", via_c)):
        for i in range(3):
            times[i] = 0.0
        w, c = timed(fn, 3)
        rows.append((name, w / args.n, c / args.n))
    c_parts = [times[i] / 4 / args.n for i in range(3)]       # timed() ran via_c 4 times
    step_s = rows[2][1]
    print(f"\nthe step, {args.n} tokens at positions 32..{31 + args.n} (median of 3):")
    for name, w, c in rows:
        print(f"  {name:16s} {w * 1e3:7.3f} ms/token ({1 / w:6.1f} t/s), CPU {c * 1e3:7.3f} ms ({c / w:.2f} cores)")
    print(f"  Python a token: {1e3 * (rows[0][1] - rows[2][1]):.3f} ms (forward - C call), of which the step's own "
          f"{1e3 * (rows[1][1] - rows[2][1]):.3f} ms")
    rest = step_s - sum(c_parts)
    for name, v in zip(("dense products", "attention", "routed experts", "rest (norms, RoPE, routing, regions)"),
                       c_parts + [rest]):
        print(f"  in the C step: {name:38s} {v * 1e3:7.3f} ms ({100 * v / step_s:4.1f}%)")

    # each part alone, as often as a token runs it
    H, k, E = cfg.n_embd, cfg.n_expert_used, cfg.n_expert
    x = torch.randn(1, max(H, cfg.n_head * cfg.head_dim))
    kinds = {"q/k/v": [w for L in layers for w in (L.attn_q, L.attn_k, L.attn_v)],
             "attn output": [L.attn_output for L in layers],
             "router": [L.ffn_gate_inp for L in layers if L.ffn_gate_inp is not None],
             "head": [m.decoder.output]}
    print(f"\neach part alone (median of {args.reps}), bytes a token, GB/s, share of {bw / 1e9:.1f} GB/s:")
    total_b = total_s = 0.0
    for name, ws in kinds.items():
        nb = sum(w.raw.numel() for w in ws)

        def run(ws=ws):
            for w in ws:
                cpu.qmatmul(x[:, :w.shape[-1]], w.raw, int(w.qtype), w.shape[-1], n_threads=T)
        s, c = timed(run, args.reps)
        total_b, total_s = total_b + nb, total_s + s
        print(f"  {name:12s} {nb / 2**20:7.1f} MiB  {s * 1e3:7.3f} ms  {nb / s / 1e9:6.1f} GB/s ({100 * nb / s / bw:3.0f}%)"
              f"  CPU {c / s:.2f} cores")
    ek = [L for L in layers if L.ffn_gate_inp is not None]
    g = torch.Generator().manual_seed(0)
    routes = [(torch.randperm(E, generator=g)[:k][None].to(torch.int32), torch.softmax(torch.randn(1, k), -1))
              for _ in range(64)]
    nb = sum(k * (L.ffn_gate_exps.raw.numel() + L.ffn_up_exps.raw.numel() + L.ffn_down_exps.raw.numel()) // E
             for L in ek)
    it = iter(range(1 << 30))
    xo = torch.empty(1, H)

    def experts():
        j = next(it)
        for i, L in enumerate(ek):
            ids, wts = routes[(j * len(ek) + i) % len(routes)]
            cpu.moe_ffn(x[:, :H], ids, wts, L.ffn_gate_exps.raw, L.ffn_up_exps.raw, L.ffn_down_exps.raw,
                        int(L.ffn_gate_exps.qtype), int(L.ffn_down_exps.qtype), n_threads=T, out=xo)
    s, c = timed(experts, args.reps)
    total_b, total_s = total_b + nb, total_s + s
    print(f"  {'experts':12s} {nb / 2**20:7.1f} MiB  {s * 1e3:7.3f} ms  {nb / s / 1e9:6.1f} GB/s ({100 * nb / s / bw:3.0f}%)"
          f"  CPU {c / s:.2f} cores")
    print(f"  parts alone: {total_b / 2**20:.1f} MiB in {total_s * 1e3:.3f} ms ({total_b / total_s / 1e9:.1f} GB/s); "
          f"the C step {step_s * 1e3:.3f} ms ({total_b / step_s / 1e9:.1f} GB/s)")
    return 0


def other_lib(src: str):
    """The kernel library of the source tree src (built, or found in the kernel cache, by its own cpu.py)."""
    import subprocess
    # older trees name it cpu._build
    build = "from hybridmoe.kernels import cpu; print((getattr(cpu, '_build', None) or cpu.build)())"
    r = subprocess.run([sys.executable, "-c", build],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=src), check=True)
    lib = ctypes.CDLL(r.stdout.strip().splitlines()[-1])
    lib.hm_decode_step.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 4
    lib.hm_decode_step.restype = ctypes.c_int32
    return lib


def ab(dec, args) -> int:
    """This tree's hm_decode_step against another tree's, alternating on the same structs and cache."""
    other = other_lib(args.against)
    out = torch.empty(1, dec.n_vocab)
    times = (ctypes.c_double * 3)()
    m = dec.model
    kv = dec.kv
    m.forward(torch.arange(1, 33), 0, kv, all_logits=False)

    def run(lib):
        t0 = time.perf_counter()
        for i in range(args.n):
            cos, sin = dec._cos_sin(32 + i)
            if lib.hm_decode_step(dec.mp, 7 + i, 32 + i, cos.data_ptr(), sin.data_ptr(), out.data_ptr(), times):
                raise RuntimeError("hm_decode_step failed")
        return (time.perf_counter() - t0) / args.n
    ratios, a_t, b_t = [], [], []
    for r in range(args.rounds):
        pair = [(dec.lib, a_t), (other, b_t)]
        for lib, acc in (pair if r % 2 else pair[::-1]):
            acc.append(run(lib))
        ratios.append(b_t[-1] / a_t[-1])
    med = statistics.median
    print(f"A/B of hm_decode_step, -t {args.threads}, {args.rounds} rounds of {args.n} tokens (positions 32..): "
          f"this tree {1e3 * med(a_t):.3f} ms/token ({1 / med(a_t):.1f} t/s), {args.against} {1e3 * med(b_t):.3f} ms "
          f"({1 / med(b_t):.1f} t/s); median of the rounds' ratios (theirs / ours) {med(ratios):.3f}, "
          f"quartiles {statistics.quantiles(ratios, n=4)[0]:.3f} - {statistics.quantiles(ratios, n=4)[2]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
