"""Planner: where each tensor should go on a rig, as llama.cpp flags, with predicted TG and PP.

`suggest()` searches placements that llama.cpp's flags can express and ranks them by predict.py's model:
- Layout: `-ngl` (all layers plus output when they fit, else fewer) and `-ts` with exact layer counts, so each
  GPU holds a contiguous range of layers with their attention, norms, router, shared experts and KV cache.
  Inside a GPU's range, a layer is *full* (its routed experts on that GPU too) or *host* (its experts in RAM:
  `--n-cpu-moe N` when those layers are a prefix, else one `-ot "blk\\.(..)\\.ffn_(up|down|gate)_exps=CPU"`).
  gate/up/down of a layer always move together, so no fused pair is split (ik_llama.cpp issue 521).
- Search: for each ubatch size, upload choice (op offload on/off) and host GPU h (where host layers' attention
  sits; with op offload it also holds the upload staging buffers), start with every expert layer hosted on h,
  spread host layers over other GPUs until every GPU fits, then turn host layers into full layers, filling the
  GPUs fastest first (by measured or declared memory bandwidth) while everything fits. Memory is counted as
  placement.py counts it (weights, KV cache, compute buffers, upload staging), then each candidate is
  re-planned from its own flags, which must give the same device map and fit.
- Prediction (`predict.predict`, also for any given placement): the runtime's decode and prompt steps mirrored
  term by term on the calibrated rates and costs (perf/costs.py); uncalibrated, the roofline.
Objectives: "tg" (decode t/s), "pp" (prefill t/s), "balanced" (least time for a request of `workload`
prompt and generated tokens).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from ..config import ModelConfig
from ..devices import Device
from ..errors import PlacementError
from ..formats.gguf import TensorInfo
from ..formats.names import layer_of, layers_regex
from .core import (
    Placement,
    PlacementOptions,
    add_placement_args,
    dense_copy_bytes,
    options_from_args,
    plan_placement,
)
from .predict import EXPERT_SHORTS, Prediction, predict

OBJECTIVES = ("tg", "pp", "balanced")
UB_CHOICES = (512, 1024, 2048, 4096)          # ubatch sizes tried at or above the one asked for
EXPS_OT = r"\.ffn_(up|down|gate)_exps"
DEFAULTS = PlacementOptions()


# ----------------------------------------------------------------------------------------- suggestions

@dataclass
class DeviceUse:
    name: str
    description: str
    weights: int
    kv: int
    compute: int
    free: int
    expert_bytes: int              # routed-expert weights held there
    expert_layers: list[int]

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute


@dataclass
class Suggestion:
    flags: str                     # llama.cpp command-line flags, shell-quoted
    argv: list[str]                # the same, as arguments
    options: PlacementOptions
    placement: Placement
    prediction: Prediction
    memory: list[DeviceUse]        # CPU first, then each GPU: use vs free
    label: str = ""                # "best TG", "best PP", ...
    note: str = ""                 # how it differs from the first suggestion
    estimate: list[int] = field(default_factory=list)   # the search's own bytes per GPU (placement.py's
    #                                count unless the two drifted; the search then corrects by re-planning)
    layout: "_Layout | None" = field(default=None, repr=False)   # what the search built it from
    slack: list[int] = field(default_factory=list, repr=False)     # bytes it kept free per GPU

    @property
    def tg(self) -> float:
        return self.prediction.tg

    @property
    def pp(self) -> float:
        return self.prediction.pp

    @property
    def gpu_expert_layers(self) -> dict[str, list[int]]:
        return {m.name: m.expert_layers for m in self.memory if m.name != "CPU"}

    @property
    def cpu_expert_layers(self) -> list[int]:
        return self.memory[0].expert_layers


@dataclass
class _Layout:
    P: int                         # the first P layers stay entirely on the CPU (-ngl n_layer - P)
    a: list[int]                   # per GPU: host layers (attention there, experts in RAM)
    k: list[int]                   # per GPU: full layers (experts there too)
    op: bool                       # op offload (upload staging buffers, PP uploads)
    ub: int
    ranges: list = field(default_factory=list)


class _Search:
    """Per-layer bytes of one model on one set of devices, the memory estimate of a layout, and the search."""

    def __init__(self, tensors, cfg, opts: PlacementOptions, devices: list[Device], rates):
        self.tensors, self.cfg, self.opts, self.devices, self.rates = tensors, cfg, opts, devices, rates
        self.gpus = [d for d in devices if d.is_gpu]
        n = cfg.n_layer
        self.dense, self.exps = [0] * n, [0] * n
        self.has_attn, self.ffn_dense, self.ffn_exps = [False] * n, [False] * n, [False] * n
        self.width = [0] * n
        self.out_bytes = 0
        for name, t in tensors.items():
            il = layer_of(name)
            if il is None:
                if name.startswith("output"):
                    self.out_bytes += t.nbytes + dense_copy_bytes(name, t)
                continue
            if il >= n:
                continue
            short = name.split(".")[2]
            if short.endswith("_exps"):
                self.exps[il] += t.nbytes
                self.ffn_exps[il] = True
            else:
                self.dense[il] += t.nbytes + dense_copy_bytes(name, t)
                self.has_attn[il] |= short.startswith("attn_")
                self.ffn_dense[il] |= short.startswith("ffn_") and not short.endswith("norm")
            if name.endswith(".bias"):
                continue                                           # gpt-oss: biases add no width
            if short == "ffn_up_exps":
                self.width[il] += cfg.n_expert_used * t.shape[-2]
            elif short in ("ffn_up_shexp", "ffn_up"):
                self.width[il] += t.shape[0]
        self.has_logits = "output.weight" in tensors
        self.moe = any(self.exps)
        base = plan_placement(tensors, cfg, opts.replace(n_gpu_layers=0, override_tensor=[], cpu_moe=False,
                                                         n_cpu_moe=0, tensor_split=None), devices)
        self.kv = list(base.kv_bytes_layer)
        self.speed_order = sorted(range(len(self.gpus)), key=lambda g: (-rates.read_bw(self.gpus[g].name), g))
        self.n_prompt, self.n_gen = 4096, 128                  # what predictions are made for (suggest sets them)

    # --- layout -> layers per GPU -> memory -------------------------------------------------------
    def is_unit(self, il: int) -> bool:
        return self.exps[il] > 0 or not self.moe

    def ranges(self, lay: _Layout) -> list[list[tuple[int, bool]]]:
        """Per GPU, in device order: (layer, full) for its contiguous range; host layers come first."""
        seq, pos, out = list(range(lay.P, self.cfg.n_layer)), 0, []
        for g in range(len(self.gpus)):
            na, nk, rng = lay.a[g], lay.k[g], []
            while (na or nk) and pos < len(seq):
                il = seq[pos]
                pos += 1
                if not self.is_unit(il):
                    rng.append((il, True))
                elif na:
                    rng.append((il, False))
                    na -= 1
                else:
                    rng.append((il, True))
                    nk -= 1
            out.append(rng)
        if pos < len(seq):                      # layers without experts after the last expert layer
            last = max((g for g in range(len(out)) if out[g]), default=0)
            out[last] += [(il, True) for il in seq[pos:]]
        return out

    def out_gpu(self, lay: _Layout, ranges) -> int | None:
        if lay.P:
            return None
        return max((g for g in range(len(ranges)) if ranges[g]), default=None)

    def estimate(self, lay: _Layout) -> list[int]:
        """Bytes each GPU needs, as placement.py counts them (weights + KV + activations/logits/staging)."""
        o, cfg = self.opts, self.cfg
        ub = lay.ub
        ctx = o.ctx_size or cfg.n_ctx_train
        hidden = ub * cfg.n_embd * 4 * 8
        scores = 0 if o.flash_attn else ub * ctx * cfg.n_head * 4
        ranges = lay.ranges = self.ranges(lay)
        out = self.out_gpu(lay, ranges)
        totals = []
        for g, rng in enumerate(ranges):
            w = kv = act = stg = 0
            for il, full in rng:
                w += self.dense[il] + (self.exps[il] if full else 0)
                kv += 0 if o.no_kv_offload else self.kv[il]
                ffn_here = self.ffn_dense[il] or (full and self.ffn_exps[il])
                per = hidden + scores if self.has_attn[il] else 0
                if ffn_here:
                    per = (per or hidden) + ub * 4 * (3 * self.width[il] + cfg.n_expert)
                act = max(act, per)
                if lay.op and not full and self.exps[il]:
                    stg = max(stg, 2 * self.exps[il])
            if lay.op and lay.P and g == o.main_gpu:          # CPU layers' experts stage on -mg
                stg = max([stg] + [2 * self.exps[il] for il in range(lay.P)])
            logits = 0
            if g == out:
                w += self.out_bytes
                logits = ub * cfg.n_vocab * 4 if self.has_logits else 0
            totals.append(w + kv + act + logits + stg)
        return totals

    def fits(self, lay: _Layout, slack: list[int]) -> bool:
        return all(t <= d.free_bytes - s for t, d, s in zip(self.estimate(lay), self.gpus, slack))

    # --- search -------------------------------------------------------------------------------------
    def layout(self, P: int, h: int, op: bool, ub: int, slack: list[int], rebalance: bool = True) -> _Layout | None:
        """Every unit hosted on GPU h, spread until it fits, then filled fastest GPU first, then (rebalance) host
        layers moved off GPUs that can take one more full layer without them; None if it can't fit."""
        G = len(self.gpus)
        units = sum(1 for il in range(P, self.cfg.n_layer) if self.is_unit(il))
        a, k = [0] * G, [0] * G
        a[h] = units
        lay = _Layout(P, a, k, op, ub)
        for _ in range(units * G + 1):              # spread host layers off GPUs that are over
            totals = self.estimate(lay)
            over = [g for g in range(G) if totals[g] > self.gpus[g].free_bytes - slack[g]]
            if not over:
                break
            g = max(over, key=lambda x: totals[x] - self.gpus[x].free_bytes + slack[x])
            if not a[g]:
                return None
            room = sorted((x for x in range(G) if x != g), key=lambda x: totals[x] - self.gpus[x].free_bytes + slack[x])
            for x in room:
                a[g] -= 1
                a[x] += 1
                t2 = self.estimate(lay)
                if t2[x] <= self.gpus[x].free_bytes - slack[x]:
                    break
                a[g] += 1
                a[x] -= 1
            else:
                return None
        else:
            return None
        grown = True
        while grown:                                # fill: host layers become full layers, fastest GPU first;
            grown = False                           # again while any grew (a GPU that gave up host layers
            for g in self.speed_order:              # has room it lacked on the first pass)
                while any(a):
                    for src in self._sources(lay, g, h):
                        a[src] -= 1
                        k[g] += 1
                        if self.fits(lay, slack):
                            grown = True
                            break
                        a[src] += 1
                        k[g] -= 1
                    else:
                        break
        while rebalance and self._rebalance(lay, h, slack):
            pass
        self.estimate(lay)                          # refresh lay.ranges
        return lay

    def _rebalance(self, lay: _Layout, h: int, slack: list[int]) -> bool:
        """Give one GPU room for one more full layer by moving host layers (their attention) to GPUs with
        room to spare; True if some GPU gained a full layer."""
        a, k, G = lay.a, lay.k, len(lay.a)
        for g in self.speed_order:
            if not a[g]:
                continue
            moved = []
            while a[g]:
                totals = self.estimate(lay)
                room = sorted((x for x in range(G) if x != g),
                              key=lambda x: totals[x] - self.gpus[x].free_bytes + slack[x])
                for x in room:
                    a[g] -= 1
                    a[x] += 1
                    if self.fits(lay, slack):
                        moved.append(x)
                        break
                    a[g] += 1
                    a[x] -= 1
                else:
                    break
                for src in self._sources(lay, g, h):
                    a[src] -= 1
                    k[g] += 1
                    if self.fits(lay, slack):
                        return True
                    a[src] += 1
                    k[g] -= 1
            for x in moved:                         # no gain: undo the moves
                a[x] -= 1
                a[g] += 1
        return False

    def _sources(self, lay: _Layout, g: int, h: int) -> list[int]:
        """Which GPU gives up a host layer when g takes a full one: g itself, then the GPUs with the fewest
        host layers (emptying one drops its staging buffer), the host GPU h last."""
        others = sorted((x for x in range(len(lay.a)) if lay.a[x] and x not in (g, h)), key=lambda x: lay.a[x])
        return ([g] if lay.a[g] else []) + others + ([h] if h != g and lay.a[h] else [])

    def argv(self, lay: _Layout) -> list[str]:
        o, n = self.opts, self.cfg.n_layer
        ranges = lay.ranges
        out = self.out_gpu(lay, ranges)
        ngl = n - lay.P if lay.P else (99 if n < 99 else n + 1)
        argv = ["-ngl", str(ngl)]
        if len(self.gpus) > 1 and lay.P < n:                   # -ngl 0: no layer to split
            counts = [len(r) + (1 if g == out else 0) for g, r in enumerate(ranges)]
            argv += ["-ts", ",".join(str(c) for c in counts)]
        host = sorted(il for r in ranges for il, full in r if not full and self.exps[il])
        if host:
            on_cpu = sorted(set(host) | {il for il in range(lay.P) if self.exps[il]})
            end = on_cpu[-1] + 1
            if on_cpu == [il for il in range(end) if self.exps[il]]:
                argv += ["--n-cpu-moe", str(end)]
            else:
                argv += ["-ot", rf"blk\.{layers_regex(host)}{EXPS_OT}=CPU"]
        if o.main_gpu:
            argv += ["-mg", str(o.main_gpu)]
        argv += ["-c", str(o.ctx_size), "-ub", str(lay.ub)]
        b = max(o.batch_size, lay.ub)
        if b != DEFAULTS.batch_size:
            argv += ["-b", str(b)]
        if o.cache_type_k != DEFAULTS.cache_type_k:
            argv += ["-ctk", o.cache_type_k]
        if o.cache_type_v != DEFAULTS.cache_type_v:
            argv += ["-ctv", o.cache_type_v]
        if not o.flash_attn:
            argv += ["-fa", "off"]
        if o.no_kv_offload:
            argv.append("-nkvo")
        if not lay.op and (host or lay.P):
            argv.append("--no-op-offload")
        return argv


def _quote(arg: str) -> str:
    return f'"{arg}"' if any(c in arg for c in "\\()[]|*?{} ") else arg


def options_from_argv(argv: list[str]) -> PlacementOptions:
    """Placement options from llama.cpp flags, through the same argparse definitions the commands use."""
    parser = argparse.ArgumentParser(add_help=False)
    add_placement_args(parser)
    return options_from_args(parser.parse_args(argv))


def _memory(p: Placement) -> list[DeviceUse]:
    out = []
    for d in p.devices:
        t = p.totals[d.name]
        layers = sorted({layer_of(n) for n, dev in p.device_of.items() if dev == d.name and "_exps." in n
                         and layer_of(n) is not None})
        eb = sum(p.tensors[n].nbytes for n, dev in p.device_of.items() if dev == d.name and "_exps." in n)
        out.append(DeviceUse(d.name, d.description, t.weights, t.kv, t.compute, t.free, eb, layers))
    return out


def _score(pred: Prediction, objective: str, workload: tuple[int, int]) -> float:
    if objective == "tg":
        return pred.tg
    if objective == "pp":
        return pred.pp
    return 1.0 / pred.request_seconds(*workload)


SECONDARY = {"tg": "pp", "pp": "tg", "balanced": "tg"}
MIN_GAP = 0.05                     # suggestions differ by at least this share in the objective's prediction


def _rank_key(s: Suggestion, objective: str, workload) -> tuple:
    # values within 0.2% tie; then the other objective (within 2%), the smaller ubatch, the shorter command line
    def bucket(obj, rel):
        return -round(math.log(max(_score(s.prediction, obj, workload), 1e-12)) / math.log(1 + rel))
    return (bucket(objective, 0.002), bucket(SECONDARY[objective], 0.02), s.options.ubatch_size, len(s.argv),
            s.flags)


def suggest(tensors: dict[str, TensorInfo] | list[TensorInfo], cfg: ModelConfig, devices: list[Device], rates,
            opts: PlacementOptions | None = None, objective: str = "tg", count: int = 3, n_prompt: int = 4096,
            n_gen: int = 128, workload: tuple[int, int] = (4096, 512), headroom: int = 0,
            min_gap: float = MIN_GAP) -> list[Suggestion]:
    """The `count` best placements that fit, ranked by `objective` ("tg", "pp" or "balanced"), each predicted at
    least `min_gap` (a share) apart in that objective from every one ranked above it, so that the ranking is
    one a benchmark can check. Candidates: for each ubatch size (opts' -ub and 1024..4096 above it) and upload
    choice (op offload on / off), the layout with the most expert layers on GPUs; then, from the best of those,
    fewer expert layers on GPUs (down to none: every layer's experts in RAM) and the first layers entirely on the
    CPU (-ngl below the layer count, down to -ngl 0). Predictions are for tg{n_gen} and pp{n_prompt}. opts gives
    -c, -ub (the smallest tried), -b, cache types, -fa, -nkvo and --no-op-offload; -ngl/-ot/-ts/--n-cpu-moe are
    what the planner decides. headroom: bytes left free on every GPU beyond what placement.py counts."""
    if objective not in OBJECTIVES:
        raise PlacementError(f"objective {objective!r}: use one of {', '.join(OBJECTIVES)}")
    if count < 1:
        raise PlacementError(f"{count} suggestions: ask for at least one")
    if not 0 <= min_gap < 1:
        raise PlacementError(f"gap {min_gap:g} between suggestions: give a share in [0, 1)")
    if not isinstance(tensors, dict):
        tensors = {t.name: t for t in tensors}
    opts = (opts or PlacementOptions()).replace(split_mode="layer")
    s = _Search(tensors, cfg, opts, devices, rates)
    s.n_prompt, s.n_gen = n_prompt, n_gen
    key = lambda c: _rank_key(c, objective, workload)       # noqa: E731
    cands = _candidates(s, opts, headroom, key)
    if not cands:
        raise PlacementError("no placement fits: even with every layer on the CPU some GPU is over (compute "
                             "buffers); lower -ub or -c")
    picked: list[Suggestion] = []
    for c in sorted(cands, key=key):    # greedy down the ranking, so a longer list starts with the shorter one
        if len(picked) >= count:
            break
        if all(_apart(c, q, objective, workload, min_gap) for q in picked):
            picked.append(c)
    name = _name(objective)
    for i, c in enumerate(picked):
        c.label = f"best {name}" if i == 0 else f"next by {name}"
        c.note = _difference(picked[0], c) if i else ""
    return picked


def _apart(a: Suggestion, b: Suggestion, objective: str, workload, gap: float) -> bool:
    """a's prediction for the objective differs from b's by at least the share `gap` (of the larger), and the
    two are not predicted alike in both TG and PP (a larger -ub that changes nothing for this test)."""
    x, y = _score(a.prediction, objective, workload), _score(b.prediction, objective, workload)
    same = _rank_key(a, objective, workload)[:2] == _rank_key(b, objective, workload)[:2]
    return abs(x - y) >= gap * max(x, y) and not same


def _name(objective: str) -> str:
    return objective if objective == "balanced" else objective.upper()


def _candidates(s: _Search, opts: PlacementOptions, headroom: int = 0, key=None) -> list[Suggestion]:
    """Every candidate, by distinct flags: the fullest layouts (the search), then, from the best of them (by
    `key`) for each ubatch size and upload choice, fewer expert layers on GPUs and the first layers entirely on
    the CPU."""
    G, n = len(s.gpus), s.cfg.n_layer
    ubs = sorted({opts.ubatch_size} | {u for u in UB_CHOICES if u > opts.ubatch_size})
    seen: dict[str, Suggestion] = {}

    def add(c: Suggestion | None):
        if c is not None and c.flags not in seen:
            seen[c.flags] = c

    P0 = 0
    for P0 in range(0, n + 1):
        for ub in ubs:
            ops = [False] + ([True] if opts.op_offload and G and s.moe else [])
            for op in ops:
                for h in (range(G) if G else [None]):
                    # op offload pins host experts for prompt uploads and, on one GPU, the decode share: with
                    # several GPUs and no upload that pays it only costs the staging buffers
                    if op and G > 1 and not _uploads_pay(s, h, ub):
                        continue
                    for rebalance in (True, False):     # without: host layers stay together (simpler -ot)
                        add(_candidate(s, P0, h, op, ub, headroom, rebalance))
        if seen or not G:
            break
    if not G:
        return list(seen.values())
    best: dict[tuple, Suggestion] = {}
    for c in seen.values():
        k = (c.options.ubatch_size, c.options.op_offload)
        if k not in best or (key is not None and key(c) < key(best[k])):
            best[k] = c
    for c in best.values():
        lay = c.layout
        for fewer in _fewer_full(s, lay):
            add(_from_layout(s, fewer, c.slack))
        h = next((g for g in range(G) if lay.a[g]), s.speed_order[0])
        for P in sorted({min(P0 + d, n) for d in (n // 8, n // 4, n // 2)} | {n} - {P0}):
            part = s.layout(P, h, lay.op, lay.ub, c.slack)
            if part is not None:
                add(_from_layout(s, part, c.slack))
    return list(seen.values())


def _fewer_full(s: _Search, lay: _Layout) -> list[_Layout]:
    """The layout with 1, 2, 3, 4, 6, 8, 12, ... and finally all of its full layers turned into host layers
    (their experts to RAM, their attention where it was), taken from the slowest GPU first."""
    total = sum(lay.k)
    steps = sorted({d for d in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128) if d < total} | {total} - {0})
    out = []
    for d in steps:
        a, k = list(lay.a), list(lay.k)
        for _ in range(d):
            g = next(g for g in reversed(s.speed_order) if k[g])
            k[g] -= 1
            a[g] += 1
        out.append(_Layout(lay.P, a, k, lay.op, lay.ub))
    return out


def _from_layout(s: _Search, lay: _Layout, slack: list[int]) -> Suggestion | None:
    """The suggestion for a layout built outside the search's fill, or None where it does not fit with the
    slack of the layout it came from, by the search's estimate or by placement.py's count."""
    if not s.fits(lay, slack):
        return None
    argv = s.argv(lay)
    o = options_from_argv(argv)
    p = plan_placement(s.tensors, s.cfg, o, s.devices)
    if any(p.totals[d.name].over > 0 for d in s.gpus):
        return None
    _check_layout(s, lay, p)
    return Suggestion(" ".join(_quote(a) for a in argv), argv, o, p, predict(p, s.rates, s.n_prompt, s.n_gen),
                      _memory(p), estimate=s.estimate(lay), layout=lay, slack=list(slack))


def _uploads_pay(s: _Search, h: int, ub: int) -> bool:
    units = [il for il in range(s.cfg.n_layer) if s.exps[il]]
    if not units:
        return False
    il = units[len(units) // 2]
    n_params = sum(t.n_elements for name, t in s.tensors.items() if layer_of(name) == il and "_exps." in name)
    return s.rates.offload_pays("moe_up_gate", ub, s.exps[il], s.cfg.n_expert, s.cfg.n_expert_used,
                                gpu=s.gpus[h].name, n_params=n_params)


def _candidate(s: _Search, P: int, h: int | None, op: bool, ub: int, headroom: int = 0,
               rebalance: bool = True) -> Suggestion | None:
    """Build the layout, re-plan it from its own flags, and if placement.py counts more than the estimate
    (it owns the accounting), tighten that GPU by the difference and build again."""
    G = len(s.gpus)
    slack = [headroom] * G
    for _ in range(4):
        lay = None
        if G:
            lay = s.layout(P, h, op, ub, slack, rebalance)
            if lay is None:
                return None
            argv = s.argv(lay)
        else:                                     # no GPU: everything on the CPU
            argv = ["-ngl", "0", "-c", str(s.opts.ctx_size), "-ub", str(ub)]
            if max(s.opts.batch_size, ub) != DEFAULTS.batch_size:
                argv += ["-b", str(max(s.opts.batch_size, ub))]
        o = options_from_argv(argv)
        p = plan_placement(s.tensors, s.cfg, o, s.devices)
        over = {d.name: p.totals[d.name].over for d in s.gpus if p.totals[d.name].over > 0}
        if not over:
            if lay is not None:
                _check_layout(s, lay, p)
            pred = predict(p, s.rates, s.n_prompt, s.n_gen)
            return Suggestion(" ".join(_quote(a) for a in argv), argv, o, p, pred, _memory(p),
                              estimate=s.estimate(lay) if lay is not None else [], layout=lay, slack=list(slack))
        for g, d in enumerate(s.gpus):
            slack[g] += over.get(d.name, 0)
    return None


def _check_layout(s: _Search, lay: _Layout, p: Placement) -> None:
    """The flags must reproduce the layout: each layer's attention and experts where the search put them."""
    for g, rng in enumerate(lay.ranges):
        for il, full in rng:
            want_attn = s.gpus[g].name
            if p.attn_device(il) != want_attn:
                raise PlacementError(f"planner bug: blk.{il} attention on {p.attn_device(il)}, expected {want_attn}")
            for short in EXPERT_SHORTS:
                n = p.layer_tensor(il, short)
                if n is not None and p.device_of[n] != (want_attn if full else "CPU"):
                    raise PlacementError(f"planner bug: {n} on {p.device_of[n]}")


def _difference(a: Suggestion, b: Suggestion) -> str:
    """How b differs from a, in words: expert layers on GPUs, ubatch, uploads, and the predicted change."""
    ea = sum(len(v) for v in a.gpu_expert_layers.values())
    eb = sum(len(v) for v in b.gpu_expert_layers.values())
    parts = []
    if eb != ea:
        parts.append(f"{eb - ea:+d} expert layers on GPUs")
    if b.options.ubatch_size != a.options.ubatch_size:
        parts.append(f"-ub {b.options.ubatch_size}")
    if b.options.op_offload != a.options.op_offload:
        parts.append("uploads host experts for PP" if b.options.op_offload else "no uploads (--no-op-offload)")
    parts.append(f"TG {_pct(b.tg, a.tg)}, PP {_pct(b.pp, a.pp)}")
    return "; ".join(parts)


def _pct(x: float, ref: float) -> str:
    if ref <= 0:
        return "n/a"
    r = x / ref
    return f"x{r:.2f}" if r >= 1.995 or r <= 0.5 else f"{(r - 1) * 100:+.0f}%"
