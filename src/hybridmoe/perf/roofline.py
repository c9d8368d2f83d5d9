"""Roofline bounds: the fastest a test could run given the bytes it must move and the FLOPs it must do.

Pure functions of tensor records (name -> TensorInfo), a placement (name -> device name), the model
config and measured rates (perf/rates.py `Rates`), so the planner can use them on models that
are not loaded. Conventions:
- decode (tg) reads, per token, every non-expert matrix once, n_expert_used/n_expert of each expert
  tensor (the active experts' rows), one row of token_embd, and the KV cache up to the position.
  Devices run one after another (layer order), so their times add.
- prompt processing (pp), per ubatch of T tokens: each device does 2 x (active params) x T FLOPs plus
  attention, bounded by its bf16 matmul rate or by the bytes it reads (experts: the share an ubatch
  touches), whichever is slower; devices add. Host experts uploaded to a GPU cost their GGUF bytes over
  PCIe per ubatch (times `pcie_scale`, the share really sent), which can overlap with compute:
  t(ubatch) = max(PCIe, sum of device times).
`model_bound` at the end applies them to a loaded model, with what its scheduler did (bench --roofline).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import kv_bytes_per_position  # noqa: F401 (re-exported: the planner and bench use it)
from ..formats.names import layer_of



def is_expert(name: str) -> bool:
    return "_exps." in name


def is_matrix(info) -> bool:
    return len(info.shape) >= 2


def touched_fraction(n_tokens: int, n_expert: int, n_used: int) -> float:
    """Expected share of experts a batch of n_tokens routes to (uniform routing)."""
    if n_expert <= 0:
        return 1.0
    return 1.0 - (1.0 - n_used / n_expert) ** max(n_tokens, 0)


@dataclass
class Work:
    """Per device: what one token or one ubatch needs from it."""
    decode_bytes: dict = field(default_factory=dict)   # weight bytes read per decoded token
    params: dict = field(default_factory=dict)         # matmul weights per token computed there
    dense_bytes: dict = field(default_factory=dict)    # non-expert matrix bytes living there
    expert_bytes: dict = field(default_factory=dict)   # expert bytes living there and computed there
    pcie_bytes: dict = field(default_factory=dict)     # GPU -> host expert bytes uploaded per ubatch

    @staticmethod
    def _add(d, k, v):
        d[k] = d.get(k, 0.0) + v


def model_work(tensors: dict, device_of: dict, cfg, upload_to: dict | None = None) -> Work:
    """Bytes and params per device. upload_to: tensor name -> GPU that computes it after an upload (pp only)."""
    upload_to = upload_to or {}
    E, k = cfg.n_expert, cfg.n_expert_used
    tied = "output.weight" not in tensors
    w = Work()
    for name, info in tensors.items():
        if not is_matrix(info):
            continue
        dev = device_of[name]
        share = k / E if is_expert(name) and E else 1.0
        if name == "token_embd.weight" and not tied:
            Work._add(w.decode_bytes, dev, info.nbytes / info.shape[0])      # one row per token
            continue
        Work._add(w.decode_bytes, dev, info.nbytes * share)
        run = upload_to.get(name, dev)
        Work._add(w.params, run, info.n_elements * share)
        if run != dev:
            Work._add(w.pcie_bytes, run, info.nbytes)
        elif is_expert(name):
            Work._add(w.expert_bytes, dev, info.nbytes)
        else:
            Work._add(w.dense_bytes, dev, info.nbytes)
    return w


def kv_layers(kv_devices: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in kv_devices:
        out[d] = out.get(d, 0) + 1
    return out


@dataclass
class Bound:
    seconds: float                 # lower bound on the time of the test
    tokens: int
    limit: str                     # the largest term: "CPU read", "CPU bf16", "PCIe CUDA0", ...
    terms: dict                    # term -> seconds

    @property
    def ts(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.inf

    def detail(self) -> str:
        tot = sum(self.terms.values()) or 1.0
        return ", ".join(f"{k} {v / tot:.0%}" for k, v in sorted(self.terms.items(), key=lambda kv: -kv[1]))


def _merge(a: Bound, b: Bound) -> Bound:
    terms = dict(a.terms)
    for k, v in b.terms.items():
        terms[k] = terms.get(k, 0.0) + v
    return Bound(a.seconds + b.seconds, a.tokens + b.tokens, max(terms, key=terms.get), terms)


# what the two sides of the decode share stream while both run, as shares of their calibrated rates
# (benchmarks/ram_share.py on nvidia-h200, 2026-11-25: the CPU expert kernel at 82-95 GB/s against a
# 94-96 GB/s alone / ~100 GB/s probe, the GPU's staging kernel at 45-47 GB/s against a 55 GB/s H2D copy),
# and the rate of the GPU's GGUF-row MoE kernels on the staged experts (latency-bound: 33.5 us for 8
# Qwen3-30B-A3B experts, 21.2 MB, on H200: docs/benchmarks.md, MoE decode kernels)
SHARE_CPU_EFFICIENCY = 0.88
SHARE_BUS_EFFICIENCY = 0.84
SHARE_GPU_KERNEL_BW = 630e9


# A CPU expert kernel reading less than this share of the RAM probe's rate on one token is bound by its decoding,
# not by RAM (Q4_0's reads 79-85%; the 1-3-bit types' 19-52%: docs/benchmarks.md, issue 24's table); the share
# then takes the CPU at its own rate, as a memory-bound kernel's is to the RAM's (KERNEL_RAM_SHARE, Q4_0's)
SHARE_COMPUTE_BOUND = 0.6
KERNEL_RAM_SHARE = 0.8


def share_cpu_rate(ram: float, kernel_bw: float | None = None) -> float:
    """The CPU side's rate in the decode share: SHARE_CPU_EFFICIENCY of the RAM's read rate, or where the expert
    type's kernel (kernel_bw: its one-token rate in its own bytes, measured alone) is bound by its decoding, that
    rate scaled as a memory-bound kernel's would be (so the GPU takes more of such a layer's experts)."""
    cpu = SHARE_CPU_EFFICIENCY * ram
    if kernel_bw and kernel_bw < SHARE_COMPUTE_BOUND * ram:
        cpu = min(cpu, kernel_bw * SHARE_CPU_EFFICIENCY / KERNEL_RAM_SHARE)
    return cpu


def _share_sides(rates, gpu: str, kernel_bw: float | None) -> tuple[float, float]:
    """(the CPU side's rate, the pinned H2D rate) a decode share balances; uncalibrated, RAM at 80 GB/s and the link
    at half of it, as Rates.h2d takes an unmeasured one."""
    ram = rates.ram_read_bw if rates is not None else 80e9
    return share_cpu_rate(ram, kernel_bw), (rates.h2d(gpu) if rates is not None else ram / 2)


def decode_share(k: int, expert_bytes: int, rates, gpu: str, kernel_bw: float | None = None) -> int:
    """Of a CPU-expert layer's k active experts in a decode step (expert_bytes each), how many its GPU reads
    over the bus from the pinned host copy and runs itself (the decode share, runtime/steps/gpu_decode.py) while the CPU
    streams the others from RAM: the count whose slower side is fastest, the CPU at its share of the RAM read
    rate (or its kernel's own, share_cpu_rate), the GPU at its share of the pinned H2D rate plus its kernels on
    the copies (the two paths out of RAM add up: ram_share.py). Never all k; ties go to fewer. Uncalibrated, the
    link is taken to read at half the RAM's rate, as Rates.h2d does for an unmeasured one (RAM at 80 GB/s then)."""
    cpu, h2d = _share_sides(rates, gpu, kernel_bw)
    gpu_s = expert_bytes / (SHARE_BUS_EFFICIENCY * h2d) + expert_bytes / SHARE_GPU_KERNEL_BW
    return min(range(k), key=lambda g: (max((k - g) * expert_bytes / cpu, g * gpu_s), g))


# The bus's share of the pinned H2D rate in a batch's decode share, where the GPU copies tens of experts a layer
# while the CPU streams the rest (benchmarks/batch_decode.py, B = 16 with experts in RAM on an H100 VM, the GPU's
# count forced: 2 of 8 fastest, 3 slower than none; docs/benchmarks.md): lower than one token's few experts get.
SHARE_BATCH_BUS_EFFICIENCY = 0.64


def batch_share_fraction(rates, gpu: str, kernel_bw: float | None = None) -> float:
    """For a batch's decode step: the fraction of a CPU-expert layer's distinct experts (tens of them) its GPU
    reads over the bus and runs while the CPU streams the others, the one at which both sides take as long (the
    counts of decode_share, continuous)."""
    cpu, h2d = _share_sides(rates, gpu, kernel_bw)
    gpu_s = 1 / (SHARE_BATCH_BUS_EFFICIENCY * h2d) + 1 / SHARE_GPU_KERNEL_BW
    return (1 / cpu) / (1 / cpu + gpu_s)


def tg_bound(work: Work, cfg, kv_devices: list[str], rates, n_gen: int, n_depth: int = 0,
             kv_bytes_pos: float | None = None) -> Bound:
    """Decode n_gen tokens after n_depth: every device's bytes / its read bandwidth, summed."""
    kvb = kv_bytes_per_position(cfg) if kv_bytes_pos is None else kv_bytes_pos
    positions = n_gen * n_depth + n_gen * (n_gen + 1) / 2          # keys read, summed over the tokens
    per_dev = dict(work.decode_bytes)
    terms = {f"{d} read": n_gen * b / rates.read_bw(d) for d, b in per_dev.items()}
    for d, n in kv_layers(kv_devices).items():
        key = f"{d} read"
        terms[key] = terms.get(key, 0.0) + n * kvb * positions / rates.read_bw(d)
    secs = sum(terms.values())
    return Bound(secs, n_gen, max(terms, key=terms.get) if terms else "", terms)


def pp_bound(work: Work, cfg, kv_devices: list[str], rates, n_prompt: int, ubatch: int, n_depth: int = 0,
             kv_bytes_pos: float | None = None, pcie_scale: float = 1.0) -> Bound:
    """Prefill n_prompt tokens after n_depth in ubatches: max(PCIe, sum over devices of max(FLOPs, bytes)).

    pcie_scale: the share of the host experts' bytes really uploaded per ubatch (below 1 when only the
    routed experts are uploaded, as -ooae does; bench measures it)."""
    kvb = kv_bytes_per_position(cfg) if kv_bytes_pos is None else kv_bytes_pos
    layers = kv_layers(kv_devices)
    attn_per_pos = 4.0 * cfg.n_head * cfg.head_dim                 # QK^T and PV FLOPs per key per query per layer
    devs = set(work.params) | set(work.dense_bytes) | set(work.expert_bytes) | set(layers)
    terms: dict[str, float] = {}
    secs, done = 0.0, 0
    while done < n_prompt:
        T = min(ubatch, n_prompt - done)
        p0 = n_depth + done
        keys = T * p0 + T * (T + 1) / 2                             # keys attended, summed over the T queries
        frac = touched_fraction(T, cfg.n_expert, cfg.n_expert_used)
        compute = 0.0
        for d in devs:
            flops = 2.0 * work.params.get(d, 0.0) * T + attn_per_pos * keys * layers.get(d, 0)
            nbytes = (work.dense_bytes.get(d, 0.0) + work.expert_bytes.get(d, 0.0) * frac
                      + layers.get(d, 0) * kvb * (p0 + T))
            t_f, t_b = flops / rates.flops(d), nbytes / rates.read_bw(d)
            key = f"{d} bf16" if t_f >= t_b else f"{d} read"
            terms[key] = terms.get(key, 0.0) + max(t_f, t_b)
            compute += max(t_f, t_b)
        pcie = {g: b * pcie_scale / rates.h2d(g) for g, b in work.pcie_bytes.items()}
        link = max(pcie.values(), default=0.0)
        if link > compute:
            g = max(pcie, key=pcie.get)
            terms[f"PCIe {g}"] = terms.get(f"PCIe {g}", 0.0) + link
        secs += max(link, compute)
        done += T
    return Bound(secs, n_prompt, max(terms, key=terms.get) if terms else "", terms)


def bench_bound(work_tg: Work, work_pp: Work, cfg, kv_devices, rates, n_prompt: int, n_gen: int, n_depth: int,
                ubatch: int, kv_bytes_pos: float | None = None, pcie_scale: float = 1.0) -> Bound:
    """The bound of a llama-bench test: pp, tg or pp+tg, at depth n_depth."""
    parts = []
    if n_prompt:
        parts.append(pp_bound(work_pp, cfg, kv_devices, rates, n_prompt, ubatch, n_depth, kv_bytes_pos, pcie_scale))
    if n_gen:
        parts.append(tg_bound(work_tg, cfg, kv_devices, rates, n_gen, n_depth + n_prompt, kv_bytes_pos))
    out = parts[0]
    for p in parts[1:]:
        out = _merge(out, p)
    return out


def upload_targets(tensors: dict, device_of: dict, attn_device, main_gpu: str | None) -> dict:
    """Host-resident expert tensor -> the GPU it is uploaded to for prompt processing (its layer's attention
    GPU, else the main GPU), as the scheduler sends it."""
    if main_gpu is None:
        return {}
    out = {}
    for name in tensors:
        if is_expert(name) and device_of[name] == "CPU":
            li = layer_of(name)
            a = attn_device(li) if li is not None else "CPU"
            out[name] = a if a != "CPU" else main_gpu
    return out


OFFLOAD_MIN_BATCH = 32     # no op uploads host weights for fewer tokens (llama.cpp, ik_llama.cpp): decode never
CPU_GEMM_EFFICIENCY = 0.4
CPU_STREAM_EFFICIENCY = 0.5


def offload_times(rates, gpu: str, n_tokens: int, nbytes: int, n_expert: int = 1, n_used: int = 1,
                  n_params: float | None = None, n_active: int | None = None,
                  prefetched: bool = False) -> tuple[float, float]:
    """(CPU seconds, upload + GPU seconds) for an op over `nbytes` of host weights and n_tokens.

    n_params defaults to nbytes x 2 (4 bits per weight, the common expert quantization). n_active: the
    experts this batch routes to, when known (else the uniform-routing expectation); only-active upload
    sends just their bytes when they are at most half (as the scheduler does). prefetched: the weights are
    already on their way (uploaded a layer ahead), so only the GPU compute remains."""
    params = float(n_params if n_params is not None else 2 * nbytes)
    share = n_used / n_expert if n_expert else 1.0
    flops = 2.0 * params * share * n_tokens
    touched = n_active / n_expert if n_active is not None and n_expert else \
        touched_fraction(n_tokens, n_expert, n_used)
    # The CPU side: expert ops at the rate their kernel reached in calibration (else ~40% of the bf16
    # matmul peak, what the H200 machine's CPU reached at ubatch 32-512), and never faster than reading
    # the touched bytes at half the read bandwidth.
    rate = rates.cpu_expert_flops(n_tokens) if n_expert > 1 else CPU_GEMM_EFFICIENCY * rates.flops("CPU")
    cpu = max(flops / rate, nbytes * touched / (CPU_STREAM_EFFICIENCY * rates.read_bw("CPU")))
    up = 0.0 if prefetched else nbytes * (touched if n_active is not None and n_active <= n_expert // 2 else 1.0)
    gpu_s = up / rates.h2d(gpu) + flops / rates.flops(gpu) + rates.sync(gpu)
    return cpu, gpu_s


def param_counts(tensors: dict, cfg) -> tuple[int, int]:
    """(all weights, weights used per token): experts count n_expert_used/n_expert, token_embd counts fully."""
    total = active = 0
    E, k = cfg.n_expert, cfg.n_expert_used
    for name, info in tensors.items():
        n = info.n_elements
        total += n
        active += n * k // E if is_expert(name) and E else n
    return total, active


def main_qtype(tensors: dict) -> str:
    """The type holding the most bytes among the matrices (what names a quantization: Q4_0, Q8_0, ...)."""
    by: dict[str, int] = {}
    for info in tensors.values():
        if is_matrix(info):
            by[info.qtype.name] = by.get(info.qtype.name, 0) + info.nbytes
    return max(by, key=by.get) if by else "?"


# -- a loaded model (bench): its placement, and what its scheduler does with a batch

def model_bound(model, rates, n_prompt: int, n_gen: int, n_depth: int, uploaded: float) -> Bound:
    """The bound of a test on a loaded model (bench); `uploaded`: bytes the scheduler uploaded to GPUs per
    repetition, measured (only the routed experts move with -ooae, and staged layers can be reused)."""
    cfg, pl, tensors = model.cfg, model.placement, model.file.tensors
    ub = model.options.ubatch_size
    kv_devices = [pl.kv_device(i) for i in range(cfg.n_layer)]
    targets, scale = {}, 1.0
    if n_prompt and scheduler_uploads(model, min(ub, n_prompt)):
        targets = upload_targets(tensors, pl.device_of, pl.attn_device, model.sched.main_gpu.name)
    work_tg = model_work(tensors, pl.device_of, cfg)
    work_pp = model_work(tensors, pl.device_of, cfg, targets)
    static = sum(work_pp.pcie_bytes.values()) * math.ceil(n_prompt / ub)
    if static:
        scale = uploaded / static                      # the bytes that really moved
    kvb = kv_bytes_per_position(cfg, model.options.cache_type_k, model.options.cache_type_v)
    return bench_bound(work_tg, work_pp, cfg, kv_devices, rates, n_prompt, n_gen, n_depth, ub, kvb, scale)


def scheduler_uploads(model, n_tokens: int) -> bool:
    """Does the scheduler run host-resident experts on a GPU for a batch of n_tokens?"""
    sched, cfg = model.sched, model.cfg
    host = [n for n, d in model.placement.device_of.items() if "_exps." in n and d == "CPU"]
    if not host or sched.main_gpu is None or not cfg.is_moe or not getattr(sched, "fused_moe", True):
        return False
    nbytes = sum(model.file.tensors[n].nbytes for n in host) * 3 // len(host)     # one layer's experts
    return all(sched.wants_offload(k, model.devices["CPU"], n_tokens, cfg.n_expert, cfg.n_expert_used, nbytes)
               for k in ("moe_up_gate", "mul_mat_id"))
