"""Where decode and prefill time goes on the GPU machine: step times with/without graphs, top CUDA kernels,
and the CPU expert kernel alone (bytes/s) for the hybrid placement. Usage: python3 benchmarks/profile_decode.py"""
import os
import sys
import time

import torch

import hybridmoe
from hybridmoe.quant.types import GGMLType

M = "synth:qwen3-30b-a3b"


def steps(m, n, graphs=True, pos0=32, ctx=256):
    m.runtime.graphs = graphs
    kv = m.new_cache(ctx)
    m.forward(torch.arange(1, pos0 + 1), 0, kv)
    m.forward(torch.tensor([5]), pos0, kv)
    m.forward(torch.tensor([6]), pos0 + 1, kv)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        m.forward(torch.tensor([7 + i]), pos0 + 2 + i, kv)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def top_kernels(fn, n=15):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=n, max_name_column_width=50))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))


def _kernel_rate(layers, H, k, E, reps=3):
    """Bytes/s of the CPU expert kernel at T=1 over `layers` [(gate, up, down) raw], routes drawn up front."""
    from hybridmoe.kernels import cpu
    x, out = torch.randn(1, H), torch.empty(1, H)
    routes = [(torch.randperm(E)[:k][None].to(torch.int32), torch.softmax(torch.randn(1, k), -1)) for _ in layers]
    nbytes = sum(k * (g[0].numel() + u[0].numel() + d[0].numel()) for g, u, d in layers)
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        for (g, u, d), (ids, w) in zip(layers, routes):
            cpu.moe_ffn(x, ids, w, g, u, d, GGMLType.Q4_0, GGMLType.Q4_0, out=out)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best, best


def cpu_kernel_alone(m, reps=3):
    """The CPU expert kernel at T=1 on the model's own expert bytes, on the first 8 layers of them, and on
    8 layers of bench_kernels.py's copies (torch's allocator, and hostmem's arena): one VM, one process."""
    sys.path.insert(0, os.path.dirname(__file__))
    import bench_kernels as bk
    from hybridmoe.runtime import hostmem
    H, k, E = m.cfg.n_embd, m.cfg.n_expert_used, m.cfg.n_expert
    ws = [(L.ffn_gate_exps.raw, L.ffn_up_exps.raw, L.ffn_down_exps.raw) for L in m.decoder.layers]
    probe = torch.ones(1 << 30)
    print(f"RAM read (torch.sum, 4 GiB): {bk.read_bandwidth(probe):.1f} GB/s; THP {hostmem.thp_mode()}, "
          f"process AnonHugePages {bk.anon_huge_mib():.0f} MiB")
    bw, dt = _kernel_rate(ws, H, k, E, reps)
    print(f"CPU expert kernel alone, T=1, {len(ws)} layers (the model's): {dt * 1e3:.2f} ms, {bw / 1e9:.1f} GB/s")
    print(f"  first 8 of them: {_kernel_rate(ws[:8] * 6, H, k, E, reps)[0] / 1e9:.1f} GB/s")
    g = torch.Generator().manual_seed(0)
    for alloc in ("torch", "huge"):
        lay = bk.make_layers(GGMLType.Q4_0, 8, g, alloc)
        print(f"  bench_kernels' 8 layers ({alloc}): {_kernel_rate(lay * 6, H, k, E, reps)[0] / 1e9:.1f} GB/s")
        del lay
    print(f"RAM read again: {bk.read_bandwidth(probe):.1f} GB/s")


def prefill(m, T, label):
    """Wall time of a T-token prefill from an empty cache (after a warm-up), then its top kernels and ops."""
    kv = m.new_cache(T + 8)
    toks = torch.randint(0, 1000, (T,))
    m.forward(toks, 0, kv, all_logits=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    m.forward(toks, 0, kv, all_logits=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"{label}: {dt * 1e3:.1f} ms = {T / dt:.0f} t/s")
    top_kernels(lambda: m.forward(toks, 0, kv, all_logits=False))


def all_gpu_pp512(warm=3):
    """The all-GPU model, a cache and a 512-token prompt, after `warm` forwards (compiles, caches)."""
    m = hybridmoe.load(M, n_gpu_layers=99, ctx_size=600)
    kv = m.new_cache(600)
    toks = torch.randint(0, 1000, (512,))
    for _ in range(warm):
        m.forward(toks, 0, kv, all_logits=False)
    torch.cuda.synchronize()
    return m, kv, toks


for what in sys.argv[1:]:
    if what == "pp4096":                      # hybrid prefill at -ub 4096: what bounds it
        m = hybridmoe.load(M, n_gpu_layers=99, override_tensor=["exps=CPU"], ctx_size=4200, ubatch_size=4096,
                           batch_size=4096)
        prefill(m, 4096, "hybrid pp4096 forward (-ub 4096)")
        del m
        m = hybridmoe.load(M, n_gpu_layers=99, override_tensor=["exps=CPU"], ctx_size=4200, ubatch_size=4096,
                           batch_size=4096, profile=True)
        kv = m.new_cache(4200)
        toks = torch.randint(0, 1000, (4096,))
        m.forward(toks, 0, kv, all_logits=False)
        m.stats.reset()
        m.forward(toks, 0, kv, all_logits=False)
        print(m.stats.format())
        del m
    if what == "pp512":                       # all-GPU prefill: host enqueue time against the GPU's
        m, kv, toks = all_gpu_pp512()
        t0 = time.perf_counter()
        m.forward(toks, 0, kv, all_logits=False)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"all-GPU pp512 forward: {(t2 - t0) * 1e3:.1f} ms ({512 / (t2 - t0):.0f} t/s), "
              f"of which the host enqueued for {(t1 - t0) * 1e3:.1f} ms")
        top_kernels(lambda: m.forward(toks, 0, kv, all_logits=False), 25)
        import warnings                       # where the forward waits for the GPU (the host can't run ahead)
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m.forward(toks, 0, kv, all_logits=False)
        torch.cuda.set_sync_debug_mode("default")
        sites = {}
        for w in caught:
            site = f"{str(w.message)[:80]} @ {w.filename}:{w.lineno}"
            sites[site] = sites.get(site, 0) + 1
        print(f"synchronizing calls in one forward: {len(caught)}")
        for site, n in sorted(sites.items(), key=lambda kv: -kv[1])[:10]:
            print(f"  {n} x {site}")
        del m
    if what == "pyprof":                      # all-GPU prefill: where the host's Python time goes
        import cProfile
        import pstats
        m, kv, toks = all_gpu_pp512()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(4):
            m.forward(toks, 0, kv, all_logits=False)
        torch.cuda.synchronize()
        pr.disable()
        st = pstats.Stats(pr)
        st.sort_stats("tottime").print_stats(28)
        st.sort_stats("cumulative").print_stats(30)
        del m
    if what == "gpu":
        m = hybridmoe.load(M, n_gpu_layers=99, ctx_size=256)
        print(f"all-GPU decode: graphs {steps(m, 20) * 1e3:.2f} ms/token, eager {steps(m, 10, False) * 1e3:.2f} ms/token")
        print(f"all-GPU decode, 4096-token cache: graphs {steps(m, 20, ctx=4096) * 1e3:.2f} ms/token")
        top_kernels(lambda: steps(m, 3, False))
        kv = m.new_cache(600)
        toks = torch.randint(0, 1000, (512,))
        m.forward(toks, 0, kv, all_logits=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter(); m.forward(toks, 0, kv, all_logits=False); torch.cuda.synchronize()
        print(f"all-GPU pp512 forward: {(time.perf_counter() - t0) * 1e3:.1f} ms")
        top_kernels(lambda: m.forward(toks, 0, kv, all_logits=False))
        del m
    if what == "kalone":                      # the CPU kernel on the model's bytes against bench_kernels' copies
        m = hybridmoe.load(M, n_gpu_layers=99, override_tensor=["exps=CPU"], ctx_size=256)
        print(f"hybrid decode: graphs {steps(m, 20) * 1e3:.2f} ms/token")
        cpu_kernel_alone(m)
        print(f"hybrid decode: graphs {steps(m, 20) * 1e3:.2f} ms/token")
        del m
    if what == "hybrid":
        m = hybridmoe.load(M, n_gpu_layers=99, override_tensor=["exps=CPU"], ctx_size=256)
        print(f"hybrid decode: graphs {steps(m, 20) * 1e3:.2f} ms/token, eager {steps(m, 10, False) * 1e3:.2f} ms/token")
        print(f"hybrid decode, 4096-token cache: graphs {steps(m, 20, ctx=4096) * 1e3:.2f} ms/token")
        cpu_kernel_alone(m)
        torch.set_num_threads(16)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            steps(m, 3)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
