"""What `bench` would measure for a placement: the runtime's steps mirrored term by term, on calibrated rates
and costs (perf/costs.py).

The runtime (read, not imported: placement/ never imports runtime/) runs a placement one of three ways, for
decode and for prompts alike:
- "cpu": every weight and the KV cache in RAM (`-ngl 0`, no GPU): one C call a token or a ubatch
  (runtime/steps/cpu_decode.py);
- "graph": decode with every layer's attention, router and KV cache on a GPU and the output head on a GPU,
  experts there or in RAM (runtime/steps/gpu_decode.py: GPU segments as CUDA graphs, a hand-off to the C
  kernel per CPU-expert layer, polled in pinned memory on one GPU); prompts with every weight on one GPU
  (runtime/steps/gpu_prefill.py);
- "eager": everything else, op by op through runtime/scheduler.py: a prompt's host experts are uploaded to
  a GPU when `Rates.offload_pays` says so (the scheduler asks the same function), all of them a layer ahead,
  or only the routed ones (`-ooae auto`: when at most half the experts are routed, with no prefetch); a layer
  whose attention is in RAM (-ngl 0 with a GPU, or below a partial -ngl) also copies its activations to and from
  the GPU that takes its matrices and experts, at the pageable copy rates (offload_copies).

Each prediction is a sum of named terms (seconds over the whole test), so a miss says which term is off:
bytes at the calibrated bandwidths, FLOPs at the calibrated rates, and the calibrated costs that are not
bandwidth (per layer, per call, per hand-off, per step, per ubatch). Uncalibrated, those are 0 and the
prediction is the roofline (the `tg_bound` / `pp_bound` kept beside it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import env
from ..perf.costs import Costs
from ..perf.roofline import (
    OFFLOAD_MIN_BATCH,
    SHARE_BUS_EFFICIENCY,
    SHARE_CPU_EFFICIENCY,
    SHARE_GPU_KERNEL_BW,
    Bound,
    decode_share,
    model_work,
    pp_bound,
    tg_bound,
    touched_fraction,
    upload_targets,
)
from .core import Placement, kv_token_bytes

EXPERT_SHORTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass
class Prediction:
    tg: float                  # decoded tokens/s at depth 0 (tg{n_gen})
    pp: float                  # prompt tokens/s for n_prompt tokens in ubatches of `ubatch` (pp{n_prompt})
    tg_bound: Bound            # the roofline of the same tests (bytes and FLOPs only)
    pp_bound: Bound
    n_gen: int
    n_prompt: int
    ubatch: int
    uploaded_layers: list[int]     # layers whose host experts are uploaded to a GPU during prompt processing
    crossings: int                 # device changes per decoded token
    share: tuple | None = None     # (g, k): the decode step's GPU reads g of each CPU layer's k experts
    tg_terms: dict = field(default_factory=dict)   # term -> seconds over the tg test
    pp_terms: dict = field(default_factory=dict)   # term -> seconds over the pp test
    decode_kind: str = ""          # "cpu" | "graph" | "eager"
    prompt_kind: str = ""
    only_active: bool = False      # uploads send only the routed experts (-ooae auto's choice)
    uploaded_bytes: float = 0.0    # host expert bytes uploaded over the pp test
    calibrated: bool = False       # the rates carry calibrated costs

    def request_seconds(self, n_prompt: int, n_gen: int) -> float:
        return n_prompt / self.pp + n_gen / self.tg

    @property
    def tg_limit(self) -> str:
        return max(self.tg_terms, key=self.tg_terms.get) if self.tg_terms else self.tg_bound.limit

    @property
    def pp_limit(self) -> str:
        return max(self.pp_terms, key=self.pp_terms.get) if self.pp_terms else self.pp_bound.limit

    def line(self) -> str:
        up = f"; host experts of {len(self.uploaded_layers)} layers uploaded" if self.uploaded_layers else ""
        sh = f"; decode share: {self.share[0]} of {self.share[1]} experts over PCIe" if self.share else ""
        return (f"TG {self.tg:.1f} t/s (tg{self.n_gen}, {self.decode_kind} step, most time: {self.tg_limit}{sh}), "
                f"PP {self.pp:.0f} t/s (pp{self.n_prompt} at -ub {self.ubatch}, {self.prompt_kind} step, most "
                f"time: {self.pp_limit}{up})")


class _Terms(dict):
    def add(self, key: str, secs: float):
        if secs:
            self[key] = self.get(key, 0.0) + secs


# ----------------------------------------------------------------------------------------- the layers

@dataclass
class _Layer:
    il: int
    attn: str                  # device of its attention (and KV cache, unless -nkvo)
    kv: str
    exps: str | None           # device of its routed experts; "split" when gate/up/down differ; None: no experts
    dense: dict                # device -> bytes of its other matrices
    params: dict               # device -> weights of its other matrices
    exp_bytes: int = 0         # all E experts of gate, up and down
    exp_params: int = 0
    qtypes: tuple = ()
    per_expert: tuple = ()     # bytes of one expert of gate, up, down


def _layers(p: Placement) -> list[_Layer]:
    out = []
    for il in range(p.cfg.n_layer):
        names = [p.layer_tensor(il, s) for s in EXPERT_SHORTS]
        L = _Layer(il, p.attn_device(il), p.kv_device(il), None, {}, {})
        if all(n is not None for n in names):
            devs = {p.device_of[n] for n in names}
            L.exps = devs.pop() if len(devs) == 1 else "split"
            infos = [p.tensors[n] for n in names]
            L.exp_bytes = sum(t.nbytes for t in infos)
            L.exp_params = sum(t.n_elements for t in infos)
            L.qtypes = tuple(t.qtype for t in infos)
            L.per_expert = tuple(t.nbytes // max(p.cfg.n_expert, 1) for t in infos)
        for short, name in p._by_layer.get(il, {}).items():
            t = p.tensors[name]
            if short in EXPERT_SHORTS or len(t.shape) < 2:
                continue
            d = p.device_of[name]
            L.dense[d] = L.dense.get(d, 0) + t.nbytes
            L.params[d] = L.params.get(d, 0) + t.n_elements
        out.append(L)
    return out


def _head(p: Placement) -> tuple[str, int, int]:
    """(device, bytes, weights) of the output head (the tied embedding where there is no output.weight)."""
    name = "output.weight" if "output.weight" in p.tensors else "token_embd.weight"
    t = p.tensors.get(name)
    if t is None:
        return "CPU", 0, 0
    return p.device_of.get(name, "CPU"), t.nbytes, t.n_elements


def _plain_kv(p: Placement) -> bool:
    return p.opts.cache_type_k == p.opts.cache_type_v and p.opts.cache_type_k in ("f32", "f16", "bf16")


def _static_model(p: Placement) -> bool:
    """The static steps cover the model (the steps' own checks): no MLA, softmax routing, or gpt-oss (its own
    GPU decode step, runtime/steps/gpu_decode_oai.py, and the C steps)."""
    cfg = p.cfg
    return cfg.arch == "gpt-oss" or (cfg.arch != "deepseek2" and
                                     getattr(cfg, "expert_gating", "softmax") == "softmax")


def decode_kind(p: Placement, layers: list[_Layer], graphs: bool = True) -> str:
    """Which decode step the runtime builds (runtime/steps/__init__.build_step), by its constructors' checks;
    graphs=False (the runtime's `graphs` option off): none, the eager decoder runs."""
    if not graphs:
        return "eager"
    head_dev = _head(p)[0]
    devs = {d for n, d in p.device_of.items() if n != "token_embd.weight" or "output.weight" not in p.tensors}
    if not _static_model(p):
        return "eager"
    oai = p.cfg.arch == "gpt-oss"                  # its graph step: one GPU (runtime/steps/gpu_decode_oai.py)
    if devs == {"CPU"} and all(L.kv == "CPU" for L in layers) and _plain_kv(p):
        return "cpu"
    if oai and len(devs - {"CPU"}) > 1:
        return "eager"
    if p.opts.cache_type_k == "q8_0" or p.opts.cache_type_v == "q8_0" or head_dev == "CPU":
        return "eager"
    for L in layers:
        if L.attn == "CPU" or L.kv != L.attn or any(d != L.attn for d in L.dense):
            return "eager"
        if L.exps is not None and L.exps not in (L.attn, "CPU"):
            return "eager"
    return "graph"


def prompt_kind(p: Placement, layers: list[_Layer], graphs: bool = True) -> str:
    """"cpu" (hm_prompt_step), "graph" (every weight on one GPU: StaticPrefill) or "eager"."""
    kind = decode_kind(p, layers, graphs)
    if kind == "cpu":
        # as build_step: with a GPU that may take a batch's ops (op offload), the prompt runs the eager path,
        # whose scheduler uploads the host weights where that pays (llama.cpp's -ngl 0 with a GPU)
        return "eager" if p.gpus and p.opts.op_offload else "cpu"
    devs = {d for n, d in p.device_of.items() if n != "token_embd.weight" or "output.weight" not in p.tensors}
    cfg = p.cfg
    if kind == "graph" and len(devs) == 1 and "CPU" not in devs and \
            not getattr(cfg, "n_expert_shared", 0) \
            and cfg.head_dim >= 16 and cfg.head_dim & (cfg.head_dim - 1) == 0 and _plain_kv(p) \
            and all(L.exps in (None, L.attn) for L in layers):
        return "graph"
    return "eager"


# ----------------------------------------------------------------------------------------- crossings

def _crossing_seconds(rates, a: str, b: str, nbytes: float) -> float:
    """A copy from device a to b: each GPU end pays half a sync round trip and its PCIe link (GPU to GPU goes
    through the host)."""
    return sum(rates.sync(d) / 2 + nbytes / rates.h2d(d) for d in (a, b) if d != "CPU")


def _token_path(p: Placement, expert_dev: dict[int, str], apart: dict | None = None) -> tuple[list[str], int]:
    """Devices one token's activations visit in order (input, each layer's ops, logits back to the host), and
    the extra crossings of split gate/up pairs. expert_dev: layer -> GPU its host experts run on (uploaded);
    apart: layer -> the device its residual ends on, for layers whose copies are counted apart (offload_copies):
    the path only passes through that device."""
    dev = p.device_of
    path = [dev.get("token_embd.weight", "CPU")]
    extra = 0
    for il in range(p.cfg.n_layer):
        if apart and il in apart:
            path.append(apart[il])
            continue
        def at(short):
            n = p.layer_tensor(il, short)
            return None if n is None else dev[n]
        seq = [at("attn_norm"), p.attn_device(il), at("ffn_norm"), at("ffn_gate_inp")]
        exps = [at(s) for s in EXPERT_SHORTS]
        if il in expert_dev:
            exps = [expert_dev[il] if e is not None else None for e in exps]
        elif exps[0] is not None and exps[1] is not None and exps[0] != exps[1]:
            extra += 1                  # the gate output moves to down's device for the SiLU product
        seq += exps + [at("ffn_up_shexp"), at("ffn_up")]
        seq = [d for d in seq if d is not None]
        residual = at("ffn_norm") or p.attn_device(il)
        seq.append(residual if residual != "CPU" else seq[-1])     # the residual add runs on a GPU side
        path += seq
    out = dev.get("output.weight", dev.get("token_embd.weight", "CPU"))
    path += [out, "CPU"]
    return [d for i, d in enumerate(path) if i == 0 or d != path[i - 1]], extra


def _path_seconds(p: Placement, rates, n_tokens: int, expert_dev: dict[int, str],
                  apart: dict | None = None) -> tuple[float, int]:
    path, extra = _token_path(p, expert_dev, apart)
    nb = n_tokens * p.cfg.n_embd * 4
    secs = sum(_crossing_seconds(rates, a, b, nb) for a, b in zip(path, path[1:]))
    if extra:
        gpu = next((d for d in path if d != "CPU"), "CPU")
        secs += extra * _crossing_seconds(rates, gpu, "CPU", nb)
    return secs, len(path) - 1 + extra


# ----------------------------------------------------------------------------------------- decode

def _share(p: Placement, layers: list[_Layer], rates, kind: str) -> tuple[int, int] | None:
    """(g, k) where the decode step runs the decode share: the captured step on one GPU with the polled
    hand-off, host experts pinned (op offload on) in a layout its kernels read (gpu_decode.share_layout_ok); g as
    the step picks it (HYBRIDMOE_DECODE_SHARE, else roofline.decode_share on the same rates)."""
    from ..kernels.gpu_decode import share_layout_ok
    k, E = p.cfg.n_expert_used, p.cfg.n_expert
    gpus = {L.attn for L in layers} | {_head(p)[0]}
    cpu_layers = [L for L in layers if L.exps == "CPU"]
    if kind != "graph" or len(gpus) != 1 or not p.opts.op_offload or not cpu_layers or not E or k < 2:
        return None
    if not all(share_layout_ok(list(L.qtypes), list(L.per_expert)) for L in cpu_layers):
        return None
    forced = env.get("HYBRIDMOE_DECODE_SHARE")
    if forced.isdigit():
        g = min(int(forced), k - 1)
    else:
        per = sum(sum(L.per_expert) for L in cpu_layers) / len(cpu_layers)
        g = decode_share(k, per, rates, next(iter(gpus)))
    return (g, k) if g else None


def decode_terms(p: Placement, layers: list[_Layer], rates, n_gen: int, n_depth: int = 0, graphs: bool = True,
                 share_rates=None):
    """(seconds per token, terms per token, kind, share) of a decode step at the mean position of the test."""
    c, cfg = Costs(rates), p.cfg
    k = cfg.n_expert_used
    kind = decode_kind(p, layers, graphs)
    share = _share(p, layers, share_rates or rates, kind)
    g = share[0] if share else 0
    kvb = kv_token_bytes(cfg, p.opts) if cfg.n_layer else 0.0
    pos = n_depth + (n_gen + 1) / 2                                # keys read, mean over the test
    head_dev, head_bytes, _ = _head(p)
    t = _Terms()

    def read(dev, nbytes, cpu_rate=None):
        return nbytes / (cpu_rate or c.cpu("stream_bw")) if dev == "CPU" else nbytes / rates.read_bw(dev)

    if kind == "cpu":
        t.add("CPU step overhead", c.cpu("decode_token_s"))
        t.add("CPU weights", read("CPU", head_bytes))
        for L in layers:
            t.add("CPU layer floors", c.cpu("decode_layer_s"))
            t.add("CPU weights", read("CPU", sum(L.dense.values())))
            t.add("CPU experts", read("CPU", k * sum(L.per_expert)))
            t.add("KV cache", read("CPU", kvb * pos))
        return sum(t.values()), t, kind, share
    gpus = sorted({L.attn for L in layers if L.attn != "CPU"} | ({head_dev} - {"CPU"}))
    polled = kind == "graph" and len(gpus) == 1
    main = gpus[0] if gpus else "CPU"
    oai = "oai_" if cfg.arch == "gpt-oss" else ""          # gpt-oss's step: its own floors (gpu_decode_oai.py)
    if kind == "graph":
        t.add("step overhead", c.gpu(head_dev, oai + "decode_token_s"))
    else:
        t.add("step overhead", c.gpu(main, "eager_token_s") if gpus else c.cpu("decode_token_s"))
        cross, _ = _path_seconds(p, rates, 1, {})
        t.add("crossings", cross)
    t.add("GPU weights" if head_dev != "CPU" else "CPU weights", read(head_dev, head_bytes))
    prev = None
    for L in layers:
        A = L.attn
        if kind == "graph":
            # a layer whose experts are in RAM ends a GPU segment: its floor is in the hand-off's cost (the
            # segment's graph, the router's row to the CPU kernel and its result back), measured together
            if L.exps != "CPU":
                t.add("GPU layer floors", c.gpu(A, oai + "decode_layer_s"))
            if prev is not None and prev != A:
                t.add("crossings", _crossing_seconds(rates, prev, A, cfg.n_embd * 4))
            prev = A
        else:
            floor = c.gpu(A, "eager_decode_layer_s") if A != "CPU" else \
                (c.gpu(main, "eager_decode_layer_s") if gpus else c.cpu("decode_layer_s"))
            t.add("layer floors (eager)", floor)
        for d, b in L.dense.items():
            t.add("GPU weights" if d != "CPU" else "CPU weights", read(d, b))
        t.add("KV cache", read(L.kv, kvb * pos))
        if L.exps is None:
            continue
        e = sum(L.per_expert)
        if L.exps == "CPU":
            t.add("CPU kernel calls", c.cpu("call_s"))
            if kind == "graph":
                t.add("hand-offs", c.gpu(A, "handoff_s") + (0.0 if polled else rates.sync(A)))   # segment + hand-off
            if g:
                cpu_s = (k - g) * e / (SHARE_CPU_EFFICIENCY * c.cpu("stream_bw"))
                gpu_s = g * e / (SHARE_BUS_EFFICIENCY * rates.h2d(A)) + g * e / SHARE_GPU_KERNEL_BW
                t.add("CPU experts", cpu_s)
                t.add("decode share (GPU side longer)", max(gpu_s - cpu_s, 0.0))
            else:
                t.add("CPU experts", read("CPU", k * e))
        elif L.exps == "split":
            t.add("GPU experts", sum(k * b / rates.read_bw(p.device_of[p.layer_tensor(L.il, s)])
                                     for s, b in zip(EXPERT_SHORTS, L.per_expert)))
        else:
            t.add("GPU experts", read(L.exps, k * e))
    return sum(t.values()), t, kind, share


# ----------------------------------------------------------------------------------------- prompts

def _flops(L: _Layer, cfg, T: int, p0: int) -> tuple[dict, float, float]:
    """(dense FLOPs per device, attention score FLOPs, routed-expert FLOPs) of a ubatch of T tokens at p0."""
    keys = T * p0 + T * (T + 1) / 2
    dense = {d: 2.0 * n * T for d, n in L.params.items()}
    attn = 4.0 * cfg.n_head * cfg.head_dim * keys
    exp = 2.0 * L.exp_params * (cfg.n_expert_used / cfg.n_expert) * T if cfg.n_expert else 0.0
    return dense, attn, exp


def _gpu_compute(rates, dev: str, dense_flops: float, dense_bytes: float) -> float:
    return max(dense_flops / rates.flops(dev), dense_bytes / rates.read_bw(dev))


def _cpu_compute(c: Costs, rates, T: int, flops: float, exp_flops: float, nbytes: float) -> float:
    work = flops / rates.cpu_bf16_flops + (exp_flops / rates.cpu_expert_flops(T) if exp_flops else 0.0)
    return max(c.cpu("prompt_scale") * work, nbytes / c.cpu("stream_bw"))


def _attention(c: Costs, dev: str, flops: float, kind: str, oai: str = "") -> tuple[str, float]:
    """(term, seconds) of a ubatch's attention scores at the rate calibrated for the step that runs them (oai:
    "oai_" for gpt-oss's steps, its own block)."""
    if dev == "CPU":
        return "CPU attention", flops / c.cpu("attn_flops")
    return "GPU attention", flops / c.gpu(dev, oai + ("attn_flops" if kind == "graph" else "eager_attn_flops"))


def _upload_plan(p: Placement, L: _Layer, rates, T: int, x_dev: str, prefetched: bool):
    """Mirror of Scheduler.moe for a CPU-expert layer in a ubatch of T tokens: (GPU it runs on or None, bytes
    uploaded, whether the upload ran a layer ahead (overlapped), whether the routing is concentrated (at most
    half the experts: only those move unless the layer was prefetched, and the next layer is not prefetched))."""
    E, k = p.cfg.n_expert, p.cfg.n_expert_used
    run = _offload_gpu(p, x_dev, T)
    if run is None:
        return None, 0, False, False
    n_active = max(1, min(E, round(E * touched_fraction(T, E, k))))
    # -ooae auto (runtime/scheduler._use_only_active); gpt-oss's biased experts always go whole (moe_biased)
    only = p.cfg.arch != "gpt-oss"
    few = only and n_active <= E // 2
    if not rates.offload_pays("moe_up_gate", T, L.exp_bytes, E, k, gpu=run, n_params=L.exp_params,
                              n_active=n_active if only else None, prefetched=prefetched):
        return None, 0, False, False
    if prefetched:                             # sent whole a layer ahead; a concentrated routing still stops
        return run, L.exp_bytes, True, few     # the next layer's prefetch
    return run, L.exp_bytes * (n_active / E if few else 1.0), False, few


def offload_copies(cfg, T: int, x_gpu: bool, dense_gpu: bool, experts_gpu: bool) -> tuple[float, float, int]:
    """(bytes up, bytes down, synchronizing copies) of the activations of a layer whose attention and KV cache
    are in RAM, on the eager path with op offload, as Decoder.attention / ffn and the Scheduler move them (every
    norm runs with its weight in RAM, so the residual comes back before each). x_gpu: the residual arrives on
    a GPU; dense_gpu: the layer's host matrices (qkv, output, router) run there; experts_gpu: its experts are
    uploaded. Float32 rows of T tokens; each copy down waits for the GPU's queue (a sync), and so does the
    router's choice (or the experts' counts) the upload decision reads. The residual's own move onto a GPU
    (the first such layer) is the token path's crossing."""
    H, q, kv, k = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.n_expert_used
    up = down = syncs = 0
    if x_gpu:
        down, syncs = down + H, syncs + 1         # the residual to attn_norm
    if dense_gpu:
        up += H                                   # the normed rows to the qkv product
        down, syncs = down + q + 2 * kv, syncs + 1   # q, k, v back to the KV cache
        up += q                                   # the attention's output to attn_output
    elif x_gpu:
        up += H                                   # the attention's output to the residual on the GPU
    if x_gpu or dense_gpu:
        down, syncs = down + H, syncs + 1         # the residual (on the GPU now) to ffn_norm
    if experts_gpu:
        if dense_gpu:
            up += H                               # the normed rows to the router
        up += H + 2 * k                           # rows, weights and ids in one copy to the experts
        syncs += 1                                # the choice back to the host (ids or the experts' counts)
    return 4.0 * T * up, 4.0 * T * down, syncs


def _offload_gpu(p: Placement, x_dev: str, T: int) -> str | None:
    """The GPU a host-weight op of T tokens may run on (Scheduler._offload_target), None where none may."""
    gpus, o = p.gpus, p.opts
    if not o.op_offload or not gpus or T < OFFLOAD_MIN_BATCH:
        return None
    if x_dev != "CPU":
        return x_dev
    return gpus[o.main_gpu].name if o.main_gpu < len(gpus) else gpus[0].name


def prompt_terms(p: Placement, layers: list[_Layer], rates, n_prompt: int, ub: int, n_depth: int = 0,
                 graphs: bool = True):
    """(seconds, terms, kind, uploaded layers, only-active) of a prompt of n_prompt tokens in ubatches of ub."""
    c, cfg = Costs(rates), p.cfg
    kind = prompt_kind(p, layers, graphs)
    # gpt-oss's prompt steps (captured and eager) run its own block (biases, sinks, windows) and its MXFP4 GEMMs:
    # its own calibrated floors and rates (costs.py falls back to the others' where they were not calibrated)
    oai = "oai_" if cfg.arch == "gpt-oss" else ""
    kvb = kv_token_bytes(cfg, p.opts) if cfg.n_layer else 0.0
    t = _Terms()
    uploaded: set[int] = set()
    few_any, moved = False, 0.0
    first_moe = min((L.il for L in layers if L.exps is not None), default=-1)
    gpus = [d.name for d in p.gpus]
    main = gpus[p.opts.main_gpu] if gpus and p.opts.main_gpu < len(gpus) else (gpus[0] if gpus else "CPU")
    # layers whose attention is in RAM, on the eager path with a GPU that may take their ops (-ngl 0, or the
    # layers -ngl leaves on the CPU): the path's own calibrated floor and CPU attention (torch SDPA)
    offload = kind == "eager" and bool(gpus) and p.opts.op_offload
    all_cpu = all(L.attn == "CPU" for L in layers)
    paths: dict = {}
    done = 0
    while done < n_prompt:
        T = min(ub, n_prompt - done)
        p0 = n_depth + done
        if kind == "cpu":
            t.add("CPU ubatch overhead", c.cpu("prompt_ubatch_s"))
        elif kind == "graph":
            t.add("ubatch overhead", c.gpu(main, oai + "prompt_ubatch_s"))
        elif offload and all_cpu:
            t.add("ubatch overhead (offload)", c.gpu(main, "offload_ubatch_s"))
        else:
            t.add("ubatch overhead (eager)", c.gpu(main, oai + "eager_ubatch_s") if gpus else c.cpu("prompt_ubatch_s"))
        prefetch, prev_il = False, -2
        ups: dict[int, str] = {}
        dense_gpu: dict[int, str] = {}
        for L in layers:
            layer_start = sum(t.values())
            dense, attn, exp = _flops(L, cfg, T, p0)
            kv_bytes = kvb * (p0 + T)
            frac = touched_fraction(T, cfg.n_expert, cfg.n_expert_used) if cfg.n_expert else 1.0
            if kind == "cpu":
                t.add("CPU layer floors", c.cpu("prompt_layer_s"))
                t.add("CPU compute", _cpu_compute(c, rates, T, sum(dense.values()), exp,
                                                  sum(L.dense.values()) + L.exp_bytes * frac + kv_bytes))
                t.add(*_attention(c, "CPU", attn, kind))
                continue
            A = L.attn
            if kind == "graph":
                t.add("GPU layer floors", c.gpu(A, oai + "prompt_layer_s"))
            elif A != "CPU":
                t.add("layer floors (eager)", c.gpu(A, oai + "eager_prompt_layer_s"))
            elif offload:
                t.add("CPU layer floors (offload)", c.gpu(main, "offload_prompt_layer_s"))
            else:
                t.add("CPU layer floors", c.cpu("prompt_layer_s"))
            if A == "CPU" and offload:
                t.add("CPU attention (eager)", attn / c.gpu(main, "offload_attn_flops"))
            else:
                t.add(*_attention(c, A, attn, kind, oai))
            for d, fl in dense.items():
                nb = L.dense.get(d, 0) + (kv_bytes if d == L.kv else 0)
                if d != "CPU":
                    t.add("GPU compute", _gpu_compute(rates, d, fl, nb))
                    continue
                # host matrices (a layer -ngl left on the CPU): the scheduler uploads them for a batch when the
                # upload and the GPU's matmul beat the CPU (Scheduler.linear: one decision per matrix; here for
                # the layer's matrices together)
                gpu = _offload_gpu(p, A, T)
                if gpu is not None and rates.offload_pays("mul_mat", T, L.dense[d], n_params=L.params[d], gpu=gpu):
                    # host matrices stay memory-mapped (only experts go to the pinned arena): a pageable copy
                    t.add("PCIe uploads", L.dense[d] / c.gpu(gpu, "pageable_h2d_bw"))
                    dense_gpu[L.il] = gpu
                    t.add("GPU compute", _gpu_compute(rates, gpu, fl, L.dense[d]))
                    moved += L.dense[d]
                else:
                    t.add("CPU compute", _cpu_compute(c, rates, T, fl, 0.0, nb))
            if L.exps is None:
                continue
            if L.exps not in ("CPU", "split"):
                t.add("GPU experts", max(exp / c.gpu(L.exps, oai + "moe_flops"),
                                         L.exp_bytes * frac / rates.read_bw(L.exps)))
                continue
            if L.exps == "split":
                t.add("CPU compute", _cpu_compute(c, rates, T, 0.0, exp, L.exp_bytes * frac))
                continue
            if prev_il != L.il - 1:
                prefetch = False                     # the scheduler prefetches only the next layer
            if L.il == first_moe:                    # begin_forward: the first MoE layer's upload is decided
                gpu0 = _offload_gpu(p, A, T)         # without its routing, and starts before attention
                prefetch = gpu0 is not None and rates.offload_pays(
                    "moe_up_gate", T, L.exp_bytes, cfg.n_expert, cfg.n_expert_used, gpu=gpu0,
                    n_params=L.exp_params)
            run, up, pre, few = _upload_plan(p, L, rates, T, A, prefetch)
            prev_il = L.il
            prefetch = run is not None and not few
            if run is None:
                t.add("CPU kernel calls", c.cpu("call_s"))
                t.add("CPU experts", _cpu_compute(c, rates, T, 0.0, exp, L.exp_bytes * frac))
                continue
            ups[L.il] = run
            uploaded.add(L.il)
            few_any |= few and not pre
            moved += up
            u = up / rates.h2d(run)
            comp = exp / c.gpu(run, oai + "moe_flops")
            # a prefetched upload runs on the copy stream while the previous layer's experts and this layer's
            # attention, dense matrices and router run (their GPU time and their launches alike): it hides
            # behind the layer's other work (the layers are alike, so this layer's stands for the span)
            rest = sum(t.values()) - layer_start + comp
            hidden = c.gpu(run, "upload_overlap") * min(u, rest) if pre else 0.0
            t.add("PCIe uploads", u - hidden)
            t.add("GPU experts", comp)
            t.add("upload overhead", c.gpu(run, "upload_layer_s"))
        apart: dict[int, str] = {}
        if offload:
            x_gpu = p.device_of.get("token_embd.weight", "CPU") != "CPU"
            for L in layers:
                if L.attn != "CPU":
                    x_gpu = True                        # the residual is added on the layer's GPU
                    continue
                gpu = dense_gpu.get(L.il) or ups.get(L.il) or main
                nup, ndown, syncs = offload_copies(cfg, T, x_gpu, L.il in dense_gpu, L.il in ups)
                t.add("activation copies (offload)", nup / c.gpu(gpu, "pageable_h2d_bw") +
                      ndown / c.gpu(gpu, "d2h_bw") + syncs * rates.sync(gpu))
                x_gpu = x_gpu or L.il in dense_gpu or L.il in ups
                apart[L.il] = gpu if x_gpu else "CPU"
        if kind == "eager":
            key = (T, tuple(sorted(ups.items())), tuple(sorted(apart.items())))     # alike for every full ubatch
            if key not in paths:
                paths[key] = _path_seconds(p, rates, T, ups, apart)[0]
            t.add("crossings", paths[key])
        done += T
    return sum(t.values()), t, kind, sorted(uploaded), few_any, moved


# ----------------------------------------------------------------------------------------- predict

def predict(placement: Placement, rates, n_prompt: int = 4096, n_gen: int = 128, ubatch: int | None = None,
            n_depth: int = 0, graphs: bool = True, share_rates=None) -> Prediction:
    """TG (n_gen tokens at depth n_depth) and PP (n_prompt tokens in ubatches of `ubatch`, default the
    placement's -ub) as the runtime would run them on these rates; graphs=False: with its static steps off.
    share_rates: the rates the runtime picks the decode share's count on (its cached calibration), where the
    times are predicted on others (plan --check's RAM rate probed now)."""
    p, cfg = placement, placement.cfg
    ub = ubatch or p.opts.ubatch_size
    layers = _layers(p)
    kv_devices = [p.kv_device(i) for i in range(cfg.n_layer)]
    kvb = kv_token_bytes(cfg, p.opts) if cfg.n_layer else 0.0
    tgb = tg_bound(model_work(p.tensors, p.device_of, cfg), cfg, kv_devices, rates, max(n_gen, 1), n_depth, kvb)
    up_targets = upload_targets(p.tensors, p.device_of, p.attn_device,
                                p.gpus[p.opts.main_gpu].name if p.gpus and p.opts.main_gpu < len(p.gpus) else None)
    per_tok, tg_t, dkind, share = decode_terms(p, layers, rates, max(n_gen, 1), n_depth, graphs, share_rates)
    pp_s, pp_t, pkind, ups, few, moved = prompt_terms(p, layers, rates, max(n_prompt, 1), ub, n_depth, graphs)
    targets = {n: g for n, g in up_targets.items() if _layer_index(n) in ups}
    ppb = pp_bound(model_work(p.tensors, p.device_of, cfg, targets), cfg, kv_devices, rates, max(n_prompt, 1), ub,
                   n_depth, kvb)
    n = max(n_gen, 1)
    tg_terms = {k: v * n for k, v in tg_t.items()}
    path, extra = _token_path(p, {})
    crossings = len(path) - 1 + extra
    return Prediction(n / (per_tok * n) if per_tok > 0 else math.inf, max(n_prompt, 1) / pp_s if pp_s > 0 else math.inf,
                      tgb, ppb, n_gen, n_prompt, ub, ups, crossings, share, tg_terms, dict(pp_t), dkind, pkind, few,
                      moved, Costs(rates).calibrated)


def _layer_index(name: str) -> int | None:
    from ..formats.names import layer_of
    return layer_of(name)
