"""A machine's measured rates (bandwidths, FLOP/s, latencies) and the lookups the cost model makes on them.

Plain data, no torch: measured by perf/calibrate.py, read from a rig file by perf/rigs, cached as JSON.
All bandwidths are bytes per second."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

GiB = 1 << 30


@dataclass
class Rates:
    ram_read_bw: float                      # bytes/s, torch.sum over a tensor far larger than L3
    cpu_bf16_flops: float                   # FLOP/s, bf16 matmul
    threads: int                            # torch threads the CPU rates were measured with
    h2d_bw: dict[str, float] = field(default_factory=dict)          # GPU name -> bytes/s, pinned
    gpu_bw: dict[str, float] = field(default_factory=dict)          # GPU name -> bytes/s (read + write)
    gpu_bf16_flops: dict[str, float] = field(default_factory=dict)  # GPU name -> FLOP/s
    sync_latency: dict[str, float] = field(default_factory=dict)    # GPU name -> seconds per round trip
    gpu_names: dict[str, str] = field(default_factory=dict)         # "CUDA0" -> "NVIDIA H200"
    cpu_moe_flops: dict[str, float] = field(default_factory=dict)   # "32"/"512" tokens -> FLOP/s, CPU expert kernel
    costs: dict = field(default_factory=dict)  # what the runtime spends beyond bandwidth (perf/costs.py)
    ram_probe_bytes: int = 0                # size of the tensor ram_read_bw was read from
    host: str = ""
    quick: bool = False
    measured_at: str = ""

    # -- lookups with the CPU fallback (fake GPUs live in host RAM) -----------------------------
    def read_bw(self, device: str) -> float:
        return self.gpu_bw.get(device, self.ram_read_bw) if device != "CPU" else self.ram_read_bw

    def flops(self, device: str) -> float:
        return self.gpu_bf16_flops.get(device, self.cpu_bf16_flops) if device != "CPU" else self.cpu_bf16_flops

    def cpu_expert_flops(self, n_tokens: int) -> float:
        """FLOP/s of the CPU expert kernel for a batch: its streaming path (few tokens) or GEMM path, as
        measured; unmeasured: 40% of the bf16 matmul rate."""
        from .roofline import CPU_GEMM_EFFICIENCY
        if not self.cpu_moe_flops:
            return CPU_GEMM_EFFICIENCY * self.cpu_bf16_flops
        from ..kernels.cpu import GEMM_MIN_T
        key = "512" if n_tokens >= GEMM_MIN_T else "32"
        return self.cpu_moe_flops.get(key) or CPU_GEMM_EFFICIENCY * self.cpu_bf16_flops

    def h2d(self, device: str) -> float:
        """Host -> device copy rate; a device without a measured link is a memcpy (read + write) in RAM."""
        return self.h2d_bw.get(device, self.ram_read_bw / 2)

    def sync(self, device: str) -> float:
        return self.sync_latency.get(device, 0.0)

    def offload_pays(self, kind: str, n_tokens: int, nbytes: int, n_expert: int = 1, n_used: int = 1,
                     gpu: str | None = None, n_params: int | None = None, n_active: int | None = None,
                     prefetched: bool = False) -> bool:
        """Is uploading `nbytes` of host weights and computing on a GPU faster than the CPU? (roofline estimate;
        never below OFFLOAD_MIN_BATCH tokens, as the scheduler decides)"""
        from .roofline import OFFLOAD_MIN_BATCH, offload_times
        if n_tokens < OFFLOAD_MIN_BATCH:
            return False
        gpus = [gpu] if gpu else list(self.h2d_bw)
        if not gpus:
            return n_tokens >= 32 * n_expert // max(n_used, 1)     # no measured GPU: ik_llama.cpp's rule
        cpu_s, gpu_s = offload_times(self, gpus[0], n_tokens, nbytes, n_expert, n_used, n_params, n_active,
                                     prefetched)
        return gpu_s < cpu_s

    def with_ram_read(self, now: float, stream: float | None = None) -> "Rates":
        """These rates on RAM that reads at `now` bytes/s (a VM's rate moves between calls): the probe's rate
        `now`, and the C kernel's streaming rate `stream` where it was measured too (else scaled by now /
        ram_read_bw); compute rates, links and the other costs as they are."""
        f = now / self.ram_read_bw if self.ram_read_bw > 0 else 1.0
        costs = {k: dict(v) if isinstance(v, dict) else v for k, v in self.costs.items()}
        if "stream_bw" in costs.get("cpu", {}):
            costs["cpu"]["stream_bw"] = stream if stream else costs["cpu"]["stream_bw"] * f
        return dataclasses.replace(self, ram_read_bw=self.ram_read_bw * f, costs=costs)

    # -- (de)serialization ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Rates":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def format(self) -> str:
        q = ", quick" if self.quick else ""
        lines = [f"calibration of {self.host} ({self.threads} threads{q}, {self.measured_at})",
                 f"  CPU  RAM read (torch.sum)  {self.ram_read_bw / 1e9:9.1f} GB/s "
                 f"({self.ram_probe_bytes / GiB:.2f} GiB tensor)",
                 f"  CPU  bf16 matmul           {self.cpu_bf16_flops / 1e12:9.3f} TFLOP/s"]
        if self.cpu_moe_flops:
            lines.append("  CPU  expert kernel (Q4_0)  " + ", ".join(
                f"{v / 1e12:.3f} TFLOP/s at {t} tokens" for t, v in sorted(self.cpu_moe_flops.items(), key=lambda kv: int(kv[0]))))
        for g in self.h2d_bw:
            lines.append(f"  {g} ({self.gpu_names.get(g, '?')}): H2D pinned {self.h2d_bw[g] / 1e9:.1f} GB/s, "
                         f"device copy {self.gpu_bw[g] / 1e9:.0f} GB/s, bf16 {self.gpu_bf16_flops[g] / 1e12:.0f} "
                         f"TFLOP/s, sync round trip {self.sync_latency[g] * 1e6:.1f} us")
        if self.costs:
            from .costs import format_costs
            lines += format_costs(self.costs)
        return "\n".join(lines)
