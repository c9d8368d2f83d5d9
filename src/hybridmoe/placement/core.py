"""Placement: which device holds each tensor, decided from tensor records alone (no bytes read).

The rules are llama.cpp's (and ik_llama.cpp's), so pasted command lines mean what they meant there:
- `-ngl N` offloads the last N repeating layers; N > n_layer also offloads the output layer
  (output.weight, output_norm). token_embd (the input layer) stays on the CPU.
- Offloaded layers are split over the GPUs in contiguous ranges, in device order, by `-ts`
  proportions (default: free memory); `-sm none` puts them all on `-mg`.
- `-ot REGEX=DEV`: `re.search` on the canonical GGUF name; the first matching rule wins and beats -ngl.
  `--cpu-moe` and `--n-cpu-moe N` add llama.cpp's expert rules after the user's -ot rules.
- Each layer's KV cache lives with its attention (the device of attn_k / attn_kv_a_mqa), or on the
  CPU with -nkvo.

Memory per device = weights + KV cache + compute buffers. The compute estimate is deliberately simple
(ggml reuses one layer's buffers for the next, so it is a max over layers, not a sum):
  per layer on D:  ub*n_embd*4 * 8               residual stream, norms, q/k/v, attention and FFN outputs
                 + ub*ctx*n_head*4                attention scores, only without flash attention
                 + ub*4 * (3*ffn_width + n_expert) FFN gate/up/product (ffn_width = used experts x expert
                                                  FFN + shared FFN, or the dense FFN) and router logits
  plus ub*n_vocab*4 of logits on output.weight's device, ub*n_embd*4 on token_embd's device, and on a
  GPU that may receive host-resident experts for prompt processing (the GPU of that layer's attention,
  else -mg) a staging buffer of 2x one layer's host-resident experts (double buffering).
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from ..config import ModelConfig, kv_bytes_per_position, kv_slots
from ..devices import Device, get_device, list_devices
from ..errors import PlacementError
from ..formats.gguf import TensorInfo
from ..formats.names import (
    ATTN_MAIN,
    EXPS_REGEX,
    FUSED_PAIRS,
    gib,
    layer_of,
    layers_regex,
    layers_text,
    tensor_kind,
)
from ..quant.types import GGMLType
from .options import (  # noqa: F401 (re-exported)
    KV_TYPE_BYTES,
    PlacementOptions,
    add_placement_args,
    options_from_args,
    parse_tensor_split,
)


@dataclass(frozen=True)
class Rule:
    pattern: str
    device: str          # canonical device name
    source: str          # "-ot #3", "--cpu-moe", "--n-cpu-moe 24"
    regex: re.Pattern

    @property
    def is_user(self) -> bool:
        return self.source.startswith("-ot")


@dataclass
class DeviceTotals:
    weights: int = 0
    kv: int = 0
    compute: int = 0
    free: int = 0
    compute_parts: dict = field(default_factory=dict)   # activations / logits / input / staging

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    @property
    def over(self) -> int:
        return self.total - self.free


def _split_commas(text: str) -> list[str]:
    """Split an -ot value on commas outside (), [] and {} (so `x{1,2}=CPU` survives); unbalanced: plain split."""
    parts, depth, cur, i = [], 0, "", 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            cur += text[i:i + 2]
            i += 2
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
        i += 1
    parts.append(cur)
    return parts if depth == 0 else text.split(",")


def parse_rules(opts: PlacementOptions, devices: list[Device], n_layer: int) -> list[Rule]:
    """The -ot rules in order, then the --cpu-moe / --n-cpu-moe rules."""
    rules = []
    for ot in opts.override_tensor:
        for item in _split_commas(ot):
            item = item.strip()
            if "=" not in item:
                raise PlacementError(f"-ot `{item}`: missing '=' (write REGEX=DEVICE, e.g. exps=CPU)")
            pattern, _, dev = item.rpartition("=")
            if not pattern:
                raise PlacementError(f"-ot `{item}`: the regex before '=' is empty")
            try:
                regex = re.compile(pattern)
            except re.error as e:
                raise PlacementError(f"regex `{pattern}` is invalid: {e.msg} at position {e.pos}") from None
            rules.append(Rule(pattern, get_device(dev, devices).name, f"-ot #{len(rules) + 1}", regex))
    if opts.cpu_moe:
        rules.append(Rule(EXPS_REGEX, "CPU", "--cpu-moe", re.compile(EXPS_REGEX)))
    for i in range(min(opts.n_cpu_moe, n_layer)):
        pat = rf"blk\.{i}{EXPS_REGEX}"
        rules.append(Rule(pat, "CPU", f"--n-cpu-moe {opts.n_cpu_moe}", re.compile(pat)))
    return rules


def _layer_split(n_layer: int, opts: PlacementOptions, gpus: list[Device], warnings: list[str]):
    """The -ngl device of layers 0..n_layer (index n_layer is the output layer), as llama.cpp computes it."""
    cpu = ["CPU"] * (n_layer + 1)
    if not gpus:
        if opts.n_gpu_layers > 0:
            warnings.append(f"-ngl {opts.n_gpu_layers}: no GPU is visible (a CPU-only torch, no CUDA driver, or "
                            "CUDA_VISIBLE_DEVICES hides them), so every layer runs on the CPU; install a CUDA build "
                            "of torch to use a GPU, or drop -ngl")
        return cpu, "no GPU"
    if opts.split_mode == "none":
        weights = [1.0 if i == opts.main_gpu else 0.0 for i in range(len(gpus))]
        how = f"-sm none: all on -mg {opts.main_gpu}"
    elif opts.tensor_split and any(opts.tensor_split):
        ts = list(opts.tensor_split)
        if len(ts) > len(gpus):
            warnings.append(f"-ts {','.join(f'{x:g}' for x in ts)} gives {len(ts)} values but there are "
                            f"{len(gpus)} GPUs; the extra values are ignored")
        weights = (ts + [0.0] * len(gpus))[:len(gpus)]
        if not any(weights):
            raise PlacementError(f"-ts {','.join(f'{x:g}' for x in ts)} gives no share to any of the "
                                 f"{len(gpus)} visible GPUs")
        how = "split by -ts " + ",".join(f"{x:g}" for x in weights)
    else:
        weights = [float(g.free_bytes) for g in gpus]
        how = "split by free memory"
    total, cum = sum(weights), []
    for w in weights:
        cum.append((cum[-1] if cum else 0.0) + w)
    cum = [c / total for c in cum]
    start = max(n_layer - opts.n_gpu_layers, 0)
    act = min(opts.n_gpu_layers, n_layer + 1)
    out = list(cpu)
    for il in range(n_layer + 1):
        if il >= start and il - start < act:
            gi = min(bisect.bisect_right(cum, (il - start) / act), len(gpus) - 1)
            out[il] = gpus[gi].name
    return out, how


def dense_copy_bytes(name: str, info) -> int:
    """A GPU-resident dense matrix is also kept dequantized for the GEMMs (bf16; F32 ones as F32): its
    bytes. Experts (read from their GGUF bytes) and token_embd (rows gathered) have none."""
    if len(info.shape) < 2 or "_exps" in name or name == "token_embd.weight":
        return 0
    return info.n_elements * (4 if info.qtype == GGMLType.F32 else 2)


def kv_token_bytes(cfg: ModelConfig, opts: PlacementOptions) -> float:
    """KV cache bytes per token of one layer (config.kv_bytes_per_position at the cache types asked)."""
    return kv_bytes_per_position(cfg, opts.cache_type_k, opts.cache_type_v)


def _kv_bytes_per_layer(cfg: ModelConfig, opts: PlacementOptions, layer: int) -> int:
    """KV cache bytes of one layer (a sliding-window layer keeps a ring: config.kv_slots)."""
    slots = kv_slots(opts.ctx_size or cfg.n_ctx_train, cfg.window(layer), min(opts.ubatch_size, opts.batch_size))
    return int(slots * kv_token_bytes(cfg, opts))


class Placement:
    """The device of every tensor, each layer's attention/KV device, memory per device, warnings."""

    def __init__(self, tensors, cfg, opts, devices, rules, device_of, reasons, layer_device, split_how):
        self.tensors: dict[str, TensorInfo] = tensors
        self.cfg, self.opts, self.devices, self.rules = cfg, opts, devices, rules
        self.device_of: dict[str, str] = device_of
        self.reasons: dict[str, str] = reasons
        self.layer_device: list[str] = layer_device[:cfg.n_layer]   # the -ngl device of each layer
        self.output_device: str = layer_device[cfg.n_layer]
        self.split_how = split_how
        self.warnings: list[str] = []
        self._by_layer: dict[int, dict[str, str]] = {}
        for name in tensors:
            li = layer_of(name)
            if li is not None:
                layer = self._by_layer.setdefault(li, {})
                short = name.split(".")[2]
                if short not in layer or name.endswith(".weight"):   # a bias never stands for its matrix
                    layer[short] = name
        self.kv_bytes_layer = [_kv_bytes_per_layer(cfg, opts, i) for i in range(cfg.n_layer)]
        self.totals: dict[str, DeviceTotals] = {}
        self._compute_totals()

    # --- queries -------------------------------------------------------------------------------
    def device(self, name: str) -> Device:
        return get_device(name, self.devices)

    @property
    def gpus(self) -> list[Device]:
        return [d for d in self.devices if d.is_gpu]

    def layer_tensor(self, layer: int, short: str) -> str | None:
        return self._by_layer.get(layer, {}).get(short)

    def attn_device(self, layer: int) -> str:
        for short in ATTN_MAIN:
            name = self.layer_tensor(layer, short)
            if name is not None:
                return self.device_of[name]
        return self.layer_device[layer]

    def kv_device(self, layer: int) -> str:
        return "CPU" if self.opts.no_kv_offload else self.attn_device(layer)

    def explain(self, name: str) -> str:
        if name not in self.device_of:
            raise PlacementError(f"no tensor named {name!r} in this model (see `hybridmoe inspect`)")
        return f"{name} -> {self.device_of[name]}: {self.reasons[name]}"

    def over_budget(self) -> list[tuple[str, int, int]]:
        """(gpu, needed, free) for each GPU whose total exceeds its free memory."""
        return [(d.name, self.totals[d.name].total, self.totals[d.name].free) for d in self.gpus
                if self.totals[d.name].over > 0]

    @property
    def fits(self) -> bool:
        return not self.over_budget()

    def check_fits(self) -> None:
        """Raise PlacementError naming each GPU that is over, with a verified fix (--n-cpu-moe, -ngl or -c)."""
        over = self.over_budget()
        if not over:
            return
        parts = [f"{n} needs {gib(need)} but has {gib(free)} free ({gib(need - free)} over)" for n, need, free in over]
        raise PlacementError(", ".join(parts) + "; " + self.suggest_fix())

    def ram_shortfall(self) -> str | None:
        """One line when the CPU side is over the available RAM (it still runs, paged from disk through mmap):
        by how much, and what to do; None when it fits."""
        t = self.totals.get("CPU")
        if t is None or t.over <= 0:
            return None
        todo = ("put more on the GPUs (-ngl 99, a smaller --n-cpu-moe, fewer -ot ...=CPU rules), use a smaller quant, "
                "or add GPUs or RAM") if self.gpus else \
            "use a smaller quant, or a machine with more RAM or with GPUs (none is visible here)"
        return (f"CPU needs {gib(t.total)} but {gib(t.free)} of RAM is available ({gib(t.over)} over): the weights "
                f"would be paged from disk through mmap, at disk speed; {todo}")

    # --- memory ------------------------------------------------------------------------------
    def _compute_totals(self):
        cfg, o = self.cfg, self.opts
        ub, ctx = o.ubatch_size, o.ctx_size or cfg.n_ctx_train
        tot = {d.name: DeviceTotals(free=d.free_bytes) for d in self.devices}
        for name, dev in self.device_of.items():
            tot[dev].weights += self.tensors[name].nbytes
        for il in range(cfg.n_layer):
            tot[self.kv_device(il)].kv += self.kv_bytes_layer[il]
        act: dict[str, int] = {}
        hidden = ub * cfg.n_embd * 4 * 8
        scores = 0 if o.flash_attn else ub * ctx * cfg.n_head * 4
        staging: dict[str, int] = {}
        gpus = self.gpus
        upload_gpu = gpus[o.main_gpu].name if gpus and o.op_offload and o.main_gpu < len(gpus) else None
        for il in range(cfg.n_layer):
            layer = self._by_layer.get(il, {})
            per: dict[str, int] = {}
            attn_dev = self.attn_device(il)
            if any(s.startswith("attn_") for s in layer):
                per[attn_dev] = hidden + scores
            ffn_devs = {self.device_of[n] for s, n in layer.items() if s.startswith("ffn_") and tensor_kind(n) != "norms"}
            ffn = ub * 4 * (3 * self._ffn_width(il) + cfg.n_expert)
            for d in ffn_devs:
                per[d] = per.get(d, hidden) + ffn
            for d, b in per.items():
                act[d] = max(act.get(d, 0), b)
            host_exps = sum(self.tensors[n].nbytes for s, n in layer.items()
                            if s.endswith("_exps") and self.device_of[n] == "CPU")
            if host_exps and upload_gpu:
                target = attn_dev if attn_dev != "CPU" else upload_gpu
                staging[target] = max(staging.get(target, 0), 2 * host_exps)
        for d, b in act.items():
            tot[d].compute_parts["activations"] = b
        if "token_embd.weight" in self.device_of:
            p = tot[self.device_of["token_embd.weight"]].compute_parts
            p["input"] = ub * cfg.n_embd * 4
        if "output.weight" in self.device_of:
            tot[self.device_of["output.weight"]].compute_parts["logits"] = ub * cfg.n_vocab * 4
        for d, b in staging.items():
            tot[d].compute_parts["upload staging"] = b
        for name, dev in self.device_of.items():
            extra = dense_copy_bytes(name, self.tensors[name]) if dev != "CPU" else 0
            if extra:
                parts = tot[dev].compute_parts
                parts["dense bf16 copies"] = parts.get("dense bf16 copies", 0) + extra
        for t in tot.values():
            t.compute = sum(t.compute_parts.values())
        self.totals = tot

    def _ffn_width(self, il: int) -> int:
        layer = self._by_layer.get(il, {})
        width = 0
        if "ffn_up_exps" in layer:
            width += self.cfg.n_expert_used * self.tensors[layer["ffn_up_exps"]].shape[-2]
        if "ffn_up_shexp" in layer:
            width += self.tensors[layer["ffn_up_shexp"]].shape[0]
        if "ffn_up" in layer:
            width += self.tensors[layer["ffn_up"]].shape[0]
        return width

    # --- fixes -------------------------------------------------------------------------------
    def _fits_with(self, **changes) -> bool:
        return plan_placement(self.tensors, self.cfg, self.opts.replace(**changes), self.devices).fits

    def suggest_fix(self) -> str:
        """The smallest --n-cpu-moe, else the largest -ngl, else a smaller -c that makes every GPU fit."""
        o, n_layer = self.opts, self.cfg.n_layer
        memo: dict = {}

        def ok(key, **ch):
            if key not in memo:
                memo[key] = self._fits_with(**ch)
            return memo[key]
        has_exps = any(s.endswith("_exps") for layer in self._by_layer.values() for s in layer)
        if has_exps and not o.cpu_moe and o.n_cpu_moe < n_layer and ok(("m", n_layer), n_cpu_moe=n_layer):
            lo, hi = o.n_cpu_moe + 1, n_layer
            while lo < hi:
                mid = (lo + hi) // 2
                if ok(("m", mid), n_cpu_moe=mid):
                    hi = mid
                else:
                    lo = mid + 1
            while lo - 1 > o.n_cpu_moe and ok(("m", lo - 1), n_cpu_moe=lo - 1):
                lo -= 1      # fits is not strictly monotone (staging buffers), so look one step below
            return f"try --n-cpu-moe {lo}"
        eff = min(o.n_gpu_layers, n_layer + 1)
        if eff > 0 and ok(("g", 0), n_gpu_layers=0):
            lo, hi = 0, eff - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if ok(("g", mid), n_gpu_layers=mid):
                    lo = mid
                else:
                    hi = mid - 1
            return f"try -ngl {lo}"
        ctx = (o.ctx_size or self.cfg.n_ctx_train) // 2
        while ctx >= 512:
            if ok(("c", ctx), ctx_size=ctx):
                return f"try -c {ctx}"
            ctx //= 2
        if o.op_offload and any("upload staging" in self.totals[n].compute_parts for n, _, _ in self.over_budget()) \
                and ok(("o",), op_offload=False):
            return "try --no-op-offload (no staging buffers for uploaded experts; the CPU computes them in PP too)"
        pinned: dict[str, int] = {}
        for name, dev in self.device_of.items():
            if self.reasons[name].startswith("-ot"):
                pinned[dev] = pinned.get(dev, 0) + self.tensors[name].nbytes
        worst = [(n, pinned.get(n, 0)) for n, _, _ in self.over_budget() if pinned.get(n, 0)]
        if worst:
            which = ", ".join(f"{gib(b)} on {n}" for n, b in worst)
            return f"no --n-cpu-moe, -ngl or -c value makes it fit: -ot rules pin {which}; move some of those to CPU"
        return "no --n-cpu-moe, -ngl or -c value makes it fit; lower -ub or move tensors to CPU with -ot"


def plan_placement(tensors: dict[str, TensorInfo] | list[TensorInfo], cfg: ModelConfig,
                   opts: PlacementOptions | None = None, devices: list[Device] | None = None) -> Placement:
    """Place every tensor record on a device by llama.cpp's rules (see the module docstring)."""
    if not isinstance(tensors, dict):
        tensors = {t.name: t for t in tensors}
    opts = opts or PlacementOptions()
    devices = list_devices() if devices is None else list(devices)
    gpus = [d for d in devices if d.is_gpu]
    warnings: list[str] = []
    if gpus and opts.main_gpu >= len(gpus):
        raise PlacementError(f"-mg {opts.main_gpu}: there are {len(gpus)} GPUs "
                             f"({', '.join(g.name for g in gpus)}); use -mg 0..{len(gpus) - 1}")
    if opts.split_mode == "row":
        warnings.append("-sm row is treated as -sm layer (row split is not supported)")
    n_layer = cfg.n_layer
    rules = parse_rules(opts, devices, n_layer)
    layer_dev, split_how = _layer_split(n_layer, opts, gpus, warnings)
    ngl, n_off = opts.n_gpu_layers, min(opts.n_gpu_layers, n_layer)

    device_of, reasons, wins = {}, {}, [0] * len(rules)
    for name in tensors:
        for i, r in enumerate(rules):
            if r.regex.search(name):
                device_of[name], reasons[name] = r.device, f"{r.source} `{r.pattern}={r.device}`"
                wins[i] += 1
                break
        else:
            il = layer_of(name)
            if il is not None and il < n_layer:
                dev = layer_dev[il]
                why = (f"-ngl {ngl}: layer {il} is offloaded ({split_how})" if dev != "CPU" else
                       f"-ngl {ngl}: layer {il} is not offloaded (the last {n_off} of {n_layer} layers are)")
            elif il is not None:
                dev, why = "CPU", f"block {il} is beyond the model's {n_layer} layers (not used)"
            elif name.startswith("output"):
                dev = layer_dev[n_layer]
                why = (f"-ngl {ngl} > {n_layer} layers offloads the output layer ({split_how})" if dev != "CPU"
                       else f"the output layer is offloaded only when -ngl exceeds the {n_layer} layers")
            else:
                dev, why = "CPU", "the input layer stays on the CPU, as in llama.cpp"
            device_of[name], reasons[name] = dev, why

    p = Placement(tensors, cfg, opts, devices, rules, device_of, reasons, layer_dev, split_how)
    p.warnings = warnings + _rule_warnings(rules, wins, tensors) + _split_pair_warnings(p) + _expert_device_warnings(p) + \
        _memory_warnings(p)
    return p


def _rule_warnings(rules: list[Rule], wins: list[int], tensors) -> list[str]:
    out = []
    for r, w in zip(rules, wins):
        if w or not r.is_user:
            continue
        hits = sum(1 for n in tensors if r.regex.search(n))
        if hits == 0:
            example = next((n for n in tensors if "_exps" in n), next(iter(tensors), ""))
            out.append(f"{r.source} `{r.pattern}={r.device}` matches no tensor of this model "
                       f"(names look like {example}; see `hybridmoe inspect`)")
        else:
            out.append(f"{r.source} `{r.pattern}={r.device}` matches {hits} tensors but earlier rules place all "
                       "of them (the first matching rule wins)")
    auto = [(r, w) for r, w in zip(rules, wins) if not r.is_user]
    for src in dict.fromkeys(r.source for r, _ in auto):
        got = sum(w for r, w in auto if r.source == src)
        if got == 0:
            out.append(f"{src} changes nothing: " + ("the model has no experts" if not any(
                "_exps" in n for n in tensors) else "-ot rules already place those experts"))
    return out


def _split_pair_warnings(p: Placement) -> list[str]:
    """ffn_gate/ffn_up of one layer on two devices: the fused up/gate op then crosses devices every token."""
    groups: dict[tuple, list[int]] = {}
    for il in sorted(p._by_layer):
        for gate, up, down, suffix in FUSED_PAIRS:
            g, u = p.layer_tensor(il, gate), p.layer_tensor(il, up)
            if g is None or u is None or p.device_of[g] == p.device_of[u]:
                continue
            dn = p.layer_tensor(il, down)
            target = p.device_of[dn] if dn is not None else p.device_of[u]
            groups.setdefault((gate, up, suffix, p.device_of[g], p.device_of[u], target), []).append(il)
    out = []
    for (gate, up, suffix, gd, ud, target), layers in groups.items():
        fix = rf"blk\.{layers_regex(layers)}\.ffn_(gate|up){suffix}={target}"
        out.append(f"blk {layers_text(layers)}: {gate} is on {gd} but {up} is on {ud}; the fused up/gate matmul "
                   "then crosses devices on every token and TG gets slow (ik_llama.cpp issue 521: 5x slower, "
                   f"8.7 -> 1.6 t/s). Keep the pair together: add -ot \"{fix}\" before the other -ot rules")
    return out


def _expert_device_warnings(p: Placement) -> list[str]:
    """A layer's experts on a GPU other than its attention's device: the captured decode step (one CUDA graph
    per run of layers on one GPU, runtime/steps/gpu_decode.py) runs a layer's experts on its attention's GPU or
    on the CPU, so such a layout decodes eagerly, every op a launch and every hand-off synchronous."""
    groups: dict[tuple, list[int]] = {}
    for il in sorted(p._by_layer):
        exps = [p.layer_tensor(il, n) for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
        devs = {p.device_of[n] for n in exps if n is not None}
        attn = p.attn_device(il)
        if len(devs) == 1 and (ed := next(iter(devs))) != "CPU" and ed != attn:
            groups.setdefault((ed, attn), []).append(il)
    out = []
    for (ed, attn), layers in groups.items():
        out.append(f"blk {layers_text(layers)}: experts on {ed}, attention on {attn}; decode cannot use the captured "
                   f"step and runs eagerly (measured on two H100s with the other experts on the CPU: 3.8 t/s "
                   f"against 49.5 with every expert on the CPU). Put these layers on {ed} (-ts) or their experts "
                   f"on {attn} or the CPU")
    return out


def _memory_warnings(p: Placement) -> list[str]:
    msg = p.ram_shortfall()
    return [msg] if msg else []
