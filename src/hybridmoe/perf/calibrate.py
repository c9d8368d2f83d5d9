"""Short measurements of this machine's rates, for the roofline (bench --roofline) and the planner.

Measured with torch, the same library the runtime computes with:
- ram_read_bw: bytes/s of `torch.sum` over a float32 tensor far larger than L3 (min(4 GiB, RAM/8); quick:
  min(1 GiB, RAM/16), which a large L3 inflates),
  best of a few, with the thread count in use (bandwidth depends on it, so the cache keeps one entry
  per thread count).
- cpu_bf16_flops: FLOP/s of a bf16 [512 x 2048] @ [2048 x 8192] matmul.
- per CUDA GPU: h2d_bw (pinned host -> device copy), gpu_bw (device copy, read + write bytes per second),
  gpu_bf16_flops (square bf16 matmul) and sync_latency (a 4-byte H2D + D2H round trip, seconds).

All bandwidths are bytes per second. Cached as JSON in `$HYBRIDMOE_CACHE/calibration-<hostname>.json`
(default folder `~/.cache/hybridmoe`). A device without measured GPU rates (a fake GPU from
HYBRIDMOE_FAKE_GPUS is backed by host RAM) is given the CPU's rates by the lookup methods.
"""
from __future__ import annotations

import json
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

from .. import env
from ..errors import progress
from .rates import Rates

CACHE_VERSION = 5            # 5: the CPU expert kernel's FLOP rates on a whole layer of 128 experts
GiB, MiB = 1 << 30, 1 << 20


# ---------------------------------------------------------------------------------- measurements

def _best(fn, reps: int, sync=None) -> float:
    """Fastest of `reps` timed calls (after one untimed call), in seconds."""
    fn()
    if sync:
        sync()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_name() -> str:
    import platform
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _host_ram() -> tuple[int, int]:
    from ..devices import _host_memory
    return _host_memory()


def measure_ram_read_bw(nbytes: int, reps: int = 5) -> float:
    x = torch.empty(nbytes // 4, dtype=torch.float32)
    x.fill_(1.0)                                                   # touch every page before timing
    dt = _best(lambda: x.sum(), reps)
    n = x.numel() * 4
    del x
    return n / dt


def ram_read_now(reps: int = 3) -> float:
    """The RAM's read bandwidth now (bytes/s), as calibrate measures it, on a probe of at most a quarter
    of the memory available (a loaded model holds the rest): bench --roofline brackets each test with it."""
    total, avail = _host_ram()
    return measure_ram_read_bw(max(min(4 * GiB, total // 8, avail // 4), 64 * MiB), reps)


def quick_link_rates(device) -> Rates:
    """The RAM's read rate and one GPU's pinned H2D rate only (a 64-512 MiB probe and a 64 MiB copy: a tenth
    of a second or so), for what must choose without a cached calibration (the decode share's count)."""
    _, avail = _host_ram()
    ram = measure_ram_read_bw(max(min(512 * MiB, avail // 4), 64 * MiB), 3)
    dev = device.torch_device
    with torch.cuda.device(dev):
        host = torch.ones(64 * MiB, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(host.numel(), dtype=torch.uint8, device=dev)
        h2d = host.numel() / _best(lambda: dst.copy_(host, non_blocking=True), 3, lambda: torch.cuda.synchronize(dev))
        del host, dst
    return Rates(ram_read_bw=ram, cpu_bf16_flops=0.0, threads=torch.get_num_threads(), h2d_bw={device.name: h2d},
                 quick=True)


def measure_cpu_bf16_flops(m: int = 512, k: int = 2048, n: int = 8192, reps: int = 5) -> float:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(torch.bfloat16)
    b = torch.randn(k, n, generator=g).to(torch.bfloat16)
    dt = _best(lambda: torch.mm(a, b), reps)
    return 2.0 * m * k * n / dt


def measure_cpu_moe_flops(quick: bool = False) -> dict[str, float]:
    """FLOP/s of the CPU expert kernel (kernels/cpu.py) on a Qwen3-30B-A3B Q4_0 expert layer (128 experts of
    768 x 2048, 340 MB, 8 used; quick: 32 of them), at 32 tokens (its streaming path) and 512 (its GEMM path),
    each token routed to 8 random experts. The whole layer's 128 experts, not a slice: 512 tokens give each
    expert 32 rows as a prompt's ubatch does, where 32 experts' 128 rows each ran 1.2x the rate (2.03 against
    1.65-1.67 TFLOP/s on the H100 VM, whose layer of experts in RAM without uploads took 30-36 ms of a pp512
    ubatch: 19 predicted from the slice). Empty without the kernel."""
    try:
        from ..kernels import cpu as k
        if not k.available():
            return {}
    except ImportError:
        return {}
    from ..quant.ref import random_blocks
    from ..quant.types import GGMLType
    E, F, H, used = 32 if quick else 128, 768, 2048, 8
    g = torch.Generator().manual_seed(0)
    gate, up = random_blocks(GGMLType.Q4_0, (E, F, H), g), random_blocks(GGMLType.Q4_0, (E, F, H), g)
    down = random_blocks(GGMLType.Q4_0, (E, H, F), g)
    out = {}
    for T in (32, 512):
        x = torch.randn(T, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:used] for _ in range(T)]).to(torch.int32)
        wts = torch.full((T, used), 1.0 / used)
        dt = _best(lambda: k.moe_ffn(x, ids, wts, gate, up, down, GGMLType.Q4_0, GGMLType.Q4_0), 2 if quick else 3)
        out[str(T)] = 2.0 * T * used * 3 * F * H / dt
    return out


def measure_gpu(index: int, quick: bool = False) -> dict[str, float]:
    dev = torch.device("cuda", index)
    sync = lambda: torch.cuda.synchronize(dev)    # noqa: E731
    reps = 3 if quick else 5
    size = (256 if quick else 1024) * MiB
    out = {}
    with torch.cuda.device(dev):
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host.fill_(1)
        dst = torch.empty(size, dtype=torch.uint8, device=dev)
        out["h2d_bw"] = size / _best(lambda: dst.copy_(host, non_blocking=True), reps, sync)
        del host
        src = torch.ones(size, dtype=torch.uint8, device=dev)
        out["gpu_bw"] = 2 * size / _best(lambda: dst.copy_(src), reps, sync)
        del src, dst
        n = 4096 if quick else 8192
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        out["gpu_bf16_flops"] = 2.0 * n ** 3 / _best(lambda: torch.mm(a, b), reps, sync)
        del a, b
        tiny = torch.zeros(1, dtype=torch.float32, pin_memory=True)
        times = []
        for _ in range(10 if quick else 50):
            t0 = time.perf_counter()
            tiny.to(dev, non_blocking=True).to("cpu")                   # the D2H into pageable memory waits
            times.append(time.perf_counter() - t0)
        out["sync_latency"] = statistics.median(times[1:])
        torch.cuda.empty_cache()
    return out


def calibrate(quick: bool = False, save: bool = True) -> Rates:
    """Measure this machine's rates (a few seconds; quick: under a second or two, less exact) and cache them."""
    # MemTotal, not MemAvailable: on VMs whose memory grows as it is used, the latter reads far too low
    total, _ = _host_ram()
    probe = max(min(1 * GiB, total // 16) if quick else min(4 * GiB, total // 8), 64 * MiB)
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with progress("calibrating", 3 + n_gpu) as bar:      # on a terminal; the bar redraws 4 times a second
        bar.describe("RAM read bandwidth")
        ram = measure_ram_read_bw(probe, reps=3 if quick else 5)
        bar.advance()
        bar.describe("CPU bf16 matmul")
        flops = measure_cpu_bf16_flops(reps=3 if quick else 5)
        bar.advance()
        bar.describe("CPU expert kernel")
        moe = measure_cpu_moe_flops(quick)
        bar.advance()
        rates = Rates(ram_read_bw=ram, cpu_bf16_flops=flops, threads=torch.get_num_threads(), ram_probe_bytes=probe,
                      cpu_moe_flops=moe, host=socket.gethostname(), quick=quick,
                      measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        for i in range(n_gpu):
            name = f"CUDA{i}"
            bar.describe(f"{name}: PCIe upload, copies, matmul, sync")
            r = measure_gpu(i, quick)
            rates.h2d_bw[name], rates.gpu_bw[name] = r["h2d_bw"], r["gpu_bw"]
            rates.gpu_bf16_flops[name], rates.sync_latency[name] = r["gpu_bf16_flops"], r["sync_latency"]
            rates.gpu_names[name] = torch.cuda.get_device_properties(i).name
            bar.advance()
    if save:
        save_rates(rates)
    return rates


# ---------------------------------------------------------------------------------- cache

def cache_path() -> Path:
    return env.cache_dir() / f"calibration-{socket.gethostname()}.json"


def _gpu_signature() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).name for i in range(torch.cuda.device_count())]


def _read_cache() -> dict:
    try:
        with open(cache_path(), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    return data


def save_rates(rates: Rates) -> Path:
    """Store `rates` as the entry for its thread count (other thread counts' entries are kept; a quick
    measurement never replaces a full one)."""
    path = cache_path()
    data = _read_cache()
    entries = data.get("by_threads", {}) if data.get("gpus") == _gpu_signature() else {}
    old = entries.get(str(rates.threads))
    if rates.quick and isinstance(old, dict) and not old.get("quick", True):
        return path                                   # a full measurement is worth more than a quick one
    if not rates.costs and isinstance(old, dict) and old.get("costs"):
        rates.costs = old["costs"]                    # rates alone (bench --roofline) keep the measured costs
    entries[str(rates.threads)] = rates.to_dict()
    data = {"version": CACHE_VERSION, "host": rates.host, "gpus": _gpu_signature(), "by_threads": entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_cached(threads: int | None = None) -> Rates | None:
    """The cached rates for `threads` (default: torch's current count) on this GPU set, or None."""
    data = _read_cache()
    if not data or data.get("gpus") != _gpu_signature():
        return None
    entry = data.get("by_threads", {}).get(str(threads or torch.get_num_threads()))
    if not isinstance(entry, dict):
        return None
    try:
        rates = Rates.from_dict(entry)
    except TypeError:
        return None
    ok = all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0
             for v in (rates.ram_read_bw, rates.cpu_bf16_flops))
    return rates if ok else None


def calibrate_isolated(threads: int, quick: bool = False) -> Rates:
    """Calibrate in a child process with `threads` threads, so its large buffers never count toward this
    process's peak RSS (bench reports it). The child writes the cache; this reads it back."""
    import subprocess

    from ..errors import HybridMoeError
    code = ("import torch; torch.set_num_threads(%d); from hybridmoe.perf.calibrate import calibrate; "
            "calibrate(quick=%r)" % (threads, bool(quick)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    rates = load_cached(threads) if r.returncode == 0 else None
    if rates is None:
        raise HybridMoeError(f"calibration with {threads} threads failed: {r.stderr.strip()[-800:]}")
    return rates


def load_or_calibrate(quick: bool = False, verbose: bool = True, threads: int | None = None,
                      isolated: bool = False) -> Rates:
    """Cached rates for `threads` (default: torch's current count), or a fresh calibration, cached."""
    threads = threads or torch.get_num_threads()
    rates = load_cached(threads)
    if rates is not None:
        return rates
    if verbose:
        print(f"calibrating this machine ({threads} threads{', quick' if quick else ''}); "
              f"cached in {cache_path()}", file=sys.stderr)
    if isolated:
        return calibrate_isolated(threads, quick)
    if threads != torch.get_num_threads():
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return calibrate(quick=quick)
        finally:
            torch.set_num_threads(old)
    return calibrate(quick=quick)
