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


def _phases(tr, k0, k1):
    """A streaming kernel call split by its per-thread stamps (cpu.last_trace): us."""
    enter, s1, s2, end = tr.unbind(1)
    return dict(start=(enter.min() - k0) * 1e6, enter_spread=(enter.max() - enter.min()) * 1e6,
                stage1=(s1.max() - enter.min()) * 1e6, stage1_mean=(s1 - enter).mean() * 1e6,
                s1_imbalance=(s1.max() - s1.mean()) * 1e6, barrier=(s2.min() - s1.max()) * 1e6,
                stage2=(end.max() - s2.min()) * 1e6, stage2_mean=(end - s2).mean() * 1e6,
                s2_imbalance=(end.max() - end.mean()) * 1e6, ret=(k1 - end.max()) * 1e6)


def _report(name, rows, nb1, nb2):
    keys = rows[0].keys()
    mean = {key: sum(float(r[key]) for r in rows) / len(rows) for key in keys}
    print(f"{name}: {len(rows)} calls, us a layer (mean): " +
          ", ".join(f"{key} {v:.1f}" for key, v in mean.items()))
    call = sum(mean[key] for key in ("start", "stage1", "barrier", "stage2", "ret"))
    print(f"  stage 1 {nb1 / mean['stage1'] / 1e3:.1f} GB/s, stage 2 {nb2 / mean['stage2'] / 1e3:.1f} GB/s, "
          f"call {(nb1 + nb2) / call / 1e3:.1f} GB/s (kernel bytes over start + stages + barrier + return)")


def _stage_bytes(m):
    """Expert bytes a token reads in a CPU layer's stage 1 (gate, up) and stage 2 (down) (the CPU's part of
    the k experts, with the decode share: call after a first step)."""
    L0, k = m.decoder.layers[0], m.cfg.n_expert_used - m.decode_share()[0]
    return (k * (L0.ffn_gate_exps.raw[0].numel() + L0.ffn_up_exps.raw[0].numel()),
            k * L0.ffn_down_exps.raw[0].numel())


def handoff_poll(m, n=20):
    """The polled hand-off (graphs.StaticDecoder._step_polled): the step time, and per CPU-expert layer the
    kernel's phases; `gpu` runs from the CPU's last thread finishing one layer to the first thread starting
    the next: the GPU segment between them, both flag latencies and the thread start."""
    from hybridmoe.kernels import cpu
    steps(m, 4)
    nb1, nb2 = _stage_bytes(m)
    cpu.trace(True)
    rec = []
    make0 = cpu.handoff_call

    def make(*a, **kw):
        call = make0(*a, **kw)

        def timed(step):
            k0 = time.perf_counter()
            rc = call(step)
            rec.append((k0, time.perf_counter(), cpu.last_trace()))
            return rc
        return timed
    cpu.handoff_call = make
    try:
        dt = steps(m, n)
    finally:
        cpu.handoff_call = make0
        cpu.trace(False)
    per = len(rec) // (n + 2)                            # calls a step; steps() runs two untimed tokens first
    rec = rec[2 * per:]
    rows = []
    for i, (k0, k1, tr) in enumerate(rec):
        r = _phases(tr, k0, k1)                         # start: the wait for the GPU, then the threads' start
        if i % per:
            r["gpu"] = (tr[:, 0].min() - rec[i - 1][2][:, 3].max()) * 1e6
        rows.append(r)
    in_calls = sum(k1 - k0 for k0, k1, _ in rec) / n
    print(f"polled hand-off: decode step {dt * 1e3:.2f} ms/token, {per} CPU-expert layers; in their calls "
          f"{in_calls * 1e3:.2f} ms, the rest {(dt - in_calls) * 1e3:.2f} ms (the GPU before the first of them and "
          f"after the last, the step's host work)")
    gaps = [r.pop("gpu") for r in rows if "gpu" in r]
    _report("in the decode step", rows, nb1, nb2)
    print(f"  gpu (CPU done -> next layer's threads start) {sum(float(g) for g in gaps) / len(gaps):.1f} us a layer")
    s1 = torch.stack([r[2][:, 1] - r[2][:, 0] for r in rec]).mean(0) * 1e6
    s2 = torch.stack([r[2][:, 3] - r[2][:, 2] for r in rec]).mean(0) * 1e6
    print(f"  per thread, us: stage 1 {[round(float(v)) for v in s1]}, stage 2 {[round(float(v)) for v in s2]}")


def handoff(m, n=20):
    """Hybrid decode layer by layer with the synchronous hand-off (load with HYBRIDMOE_HANDOFF=sync): the
    graph replay's enqueue, the wait for the GPU segment (D2H), Python before the kernel, the kernel's
    phases from its per-thread stamps (thread start, gate/up, barrier, down, return), and what follows until
    the next replay; then the same kernel called back to back on the same layers (no GPU in between)."""
    from hybridmoe.kernels import cpu
    from hybridmoe.runtime.steps import gpu_decode as G
    nb1, nb2 = _stage_bytes(m)
    k = m.cfg.n_expert_used
    steps(m, 4)
    cpu.trace(True)
    rec, cur = [], {}
    run0, exp0, moe0 = G.StaticDecoder._run_segment, G.StaticDecoder._cpu_experts, cpu.moe_ffn

    def run_seg(self, s):
        t = time.perf_counter()
        if "c1" in cur:
            rec.append(dict(cur, nxt=t))
            cur.clear()
        run0(self, s)
        cur.update(r0=t, r1=time.perf_counter())

    def cpu_exp(self, b, st, src, dst):
        cur["c0"] = time.perf_counter()
        exp0(self, b, st, src, dst)
        cur["c1"] = time.perf_counter()

    def moe(*a, **kw):
        k0 = time.perf_counter()
        r = moe0(*a, **kw)
        cur.update(k0=k0, k1=time.perf_counter(), tr=cpu.last_trace())
        return r
    G.StaticDecoder._run_segment, G.StaticDecoder._cpu_experts, cpu.moe_ffn = run_seg, cpu_exp, moe
    try:
        dt = steps(m, n)
    finally:
        G.StaticDecoder._run_segment, G.StaticDecoder._cpu_experts, cpu.moe_ffn = run0, exp0, moe0
    rec = rec[len(rec) // (n + 2) * 2:]                 # steps() runs two untimed tokens first
    rows = [dict(enqueue=(r["r1"] - r["r0"]) * 1e6, d2h_wait=(r["c0"] - r["r1"]) * 1e6,
                 py_before=(r["k0"] - r["c0"]) * 1e6, **_phases(r["tr"], r["k0"], r["k1"]),
                 py_after=(r["c1"] - r["k1"]) * 1e6, to_next=(r["nxt"] - r["c1"]) * 1e6) for r in rec]
    serial = ("enqueue", "d2h_wait", "py_before", "start", "stage1", "barrier", "stage2", "ret", "py_after", "to_next")
    per_layer = sum(sum(float(r[key]) for key in serial) for r in rows) / len(rows)
    print(f"hybrid decode step {dt * 1e3:.2f} ms/token; per CPU-expert layer {per_layer:.1f} us accounted "
          f"(x {len(m.decoder.layers)} = {per_layer * len(m.decoder.layers) / 1e3:.2f} ms)")
    _report("in the decode step", rows, nb1, nb2)
    # the same layers back to back
    H = m.cfg.n_embd
    x, out = torch.randn(1, H), torch.empty(1, H)
    ws = [(L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps) for L in m.decoder.layers]
    back = []
    for _ in range(3):
        for g, u, d in ws:
            ids = torch.randperm(m.cfg.n_expert)[:k][None].to(torch.int32)
            w = torch.softmax(torch.randn(1, k), -1)
            k0 = time.perf_counter()
            cpu.moe_ffn(x, ids, w, g.raw, u.raw, d.raw, g.qtype, d.qtype, out=out)
            k1 = time.perf_counter()
            back.append(_phases(cpu.last_trace(), k0, k1))
    _report("back to back", back[len(ws):], nb1, nb2)
    cpu.trace(False)


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
    if what == "segkernels":                  # the static step's kernels one by one (no graph): GPU time each
        from hybridmoe.runtime.steps.gpu_decode import StaticDecoder
        m = hybridmoe.load(M, n_gpu_layers=99, ctx_size=256)
        print(f"all-GPU decode: graphs {steps(m, 20) * 1e3:.2f} ms/token")
        kv = m.new_cache(256)
        m.forward(torch.arange(1, 33), 0, kv)
        sd = StaticDecoder(m, kv, capture=False)
        for i in range(3):
            sd.step(5 + i, 32 + i)
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(4):
                sd.step(9 + i, 35 + i)
            torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
        print(f"{len(ev) / 4:.0f} kernels a step, GPU time {sum(e.device_time for e in ev) / 4 / 1e3:.2f} ms a step")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
        del m
    if what == "kalone":                      # the CPU kernel on the model's bytes against bench_kernels' copies
        m = hybridmoe.load(M, n_gpu_layers=99, override_tensor=["exps=CPU"], ctx_size=256)
        print(f"hybrid decode: graphs {steps(m, 20) * 1e3:.2f} ms/token")
        cpu_kernel_alone(m)
        print(f"hybrid decode: graphs {steps(m, 20) * 1e3:.2f} ms/token")
        del m
    if what == "handoff":                     # hybrid decode: where each layer's time goes
        os.environ["HYBRIDMOE_HANDOFF"] = "sync"
        m = hybridmoe.load(M, n_gpu_layers=99, override_tensor=["exps=CPU"], ctx_size=256)
        handoff(m)
        os.environ["HYBRIDMOE_HANDOFF"] = "poll"
        handoff_poll(m)
        sys.path.insert(0, os.path.dirname(__file__))
        import bench_kernels as bk
        print(f"RAM read (torch.sum, 4 GiB): {bk.read_bandwidth(torch.ones(1 << 30)):.1f} GB/s")
        del m
    if what == "handoff24":                   # the polled hand-off with --n-cpu-moe 24
        m = hybridmoe.load(M, n_gpu_layers=99, n_cpu_moe=24, ctx_size=256)
        handoff_poll(m)
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
