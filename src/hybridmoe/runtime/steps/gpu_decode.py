"""Token generation with static shapes, GPU segments captured as CUDA graphs.

Python launching ~50 small kernels per layer costs more than the GPU work of a decode step. Here one
step is: the GPU runs layers up to the next layer whose experts live in host RAM or up to the next part
that runs on another GPU (one graph replay), hands the normed hidden state and the router's choice to the
CPU in one copy (or the residual to the next GPU), the CPU kernel computes the experts, one copy brings the
result back, and the next graph continues. With all experts on one GPU the whole step is one replay.

A layer is two parts: attention on its attention's GPU, the FFN (norm, router, experts) where its experts
or dense FFN weights are (kernels/decode_layout.py), so experts placed per GPU with -ot (llama.cpp users'
`blk.N.ffn.=CUDAk` rules) run in the graphs too; the residual crosses GPUs inside the layer there.

Static shapes: the position is a device tensor, read by the kernels. Two versions of a layer: the fused
Triton kernels (kernels/gpu_decode.py, ~10 launches; attention reads the cache up to the position), and
plain torch ops (the KV cache written with index_copy_, attention over the whole cache under a mask) where
Triton is missing. `StaticDecoder(capture=False)` runs the same code eagerly: that is how CI checks the
torch version on fake GPUs, and the fused one in Triton's interpreter.
"""
from __future__ import annotations

import contextlib
import gc
import os
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ... import env
from ...errors import HybridMoeError, warn, warn_fallback
from ...kernels import decode_layout as dl
from ...kernels import gpu_decode as gd
from ...perf.roofline import batch_share_fraction, decode_share
from ...quant.types import GGMLType
from .. import experts as X
from ..hostmem import is_pinned
from ..ops import apply_rope, context_rope_tables, rms_norm, yarn_key
from .base import NotApplicable


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collection off for a while (nested: a no-op). A collection during a capture may
    run a finalizer that calls CUDA (an earlier model's pinned arena unregistering itself, runtime/hostmem.py),
    which a capture forbids, and the capture fails. No collection first: one takes 0.1-0.2 s with a big model's
    objects alive, which a server slot's first decode step would pay (the garbage waits for the next one)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def capturing(graph, device, stream, pool=None):
    """A capture into `graph` on `stream` of `device` (torch.cuda.graph's, without the garbage collection and
    the emptying of the allocators' caches it may do first), with garbage collection paused (gc_paused)."""
    with gc_paused(), torch.cuda.device(device):
        torch.cuda.synchronize(device)
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                yield
            finally:
                graph.capture_end()


def forced_share(k: int) -> int | None:
    """HYBRIDMOE_DECODE_SHARE's count of a layer's k experts for the GPU (at most k - 1), None where unset."""
    forced = env.get("HYBRIDMOE_DECODE_SHARE")
    if not forced:
        return None
    if not forced.isdigit():
        raise HybridMoeError(f"HYBRIDMOE_DECODE_SHARE={forced!r}: give how many of each CPU layer's {k} experts "
                             f"the GPU runs in a decode step (0 turns the share off), or unset it")
    return min(int(forced), k - 1)


def _share_rates(sched, dev, k: int, exps: list):
    """(HYBRIDMOE_DECODE_SHARE's count or None, the rates to balance on, the CPU expert kernel's own one-token rate
    on these types: experts.cpu_stream_rate) for the decode share of these CPU-expert layers' (gate, up, down), or
    None where there is none: the experts are not pinned or a type has no GPU kernel, k < 2, or the rates could
    not be measured."""
    if k < 2 or not exps or not all(gd.supports(g.qtype, u.qtype, d.qtype) and gd.share_layout_ok(
            (g.qtype, u.qtype, d.qtype), [w.raw[0].numel() for w in (g, u, d)]) and all(
            is_pinned(w.raw) and gd.stage_words(w.raw) is not None for w in (g, u, d)) for g, u, d in exps):
        return None
    forced = forced_share(k)
    if forced is not None:
        return forced, None, None
    rates = sched.rates
    if rates is None:                      # no cached calibration: the two rates it needs, measured now
        try:
            from ...perf.calibrate import quick_link_rates
            rates = quick_link_rates(dev)
        except Exception as e:             # noqa: BLE001 - a failed probe must not stop decoding
            warn_fallback("measuring the RAM and PCIe rates for the decode share", e, "the CPU runs all experts")
            return None
    return None, rates, X.cpu_stream_rate(exps, k, sched.n_threads)


def share_count(sched, dev, k: int, exps: list) -> int:
    """The decode share (docs/design.md): how many of a CPU-expert layer's k active experts the GPU runs itself
    during a decode step, while the CPU streams the others from RAM; the GPU reads its own over the bus (zero-copy
    from the pinned arena, gd.stage_experts). exps: each CPU-expert layer's (gate, up, down). 0 where there is
    none (_share_rates) or HYBRIDMOE_DECODE_SHARE=0; that variable also forces a count. Otherwise the count that
    balances the two sides at the calibrated rates and the CPU kernel's own on these types (roofline.decode_share:
    a type whose kernel is bound by its decoding leaves more experts to the GPU)."""
    got = _share_rates(sched, dev, k, exps)
    if got is None:
        return 0
    forced, rates, kernel_bw = got
    if forced is not None:
        return forced
    per = sum(w.raw[0].numel() for e in exps for w in e) / len(exps)       # bytes of one expert, mean
    return decode_share(k, per, rates, dev.name, kernel_bw)


def share_fraction(sched, dev, k: int, exps: list) -> float:
    """The batched decode step's share: the fraction of a CPU-expert layer's distinct experts the GPU runs (a
    forced HYBRIDMOE_DECODE_SHARE count of k as that fraction of them; roofline.batch_share_fraction)."""
    got = _share_rates(sched, dev, k, exps)
    if got is None:
        return 0.0
    forced, rates, kernel_bw = got
    return forced / k if forced is not None else batch_share_fraction(rates, dev.name, kernel_bw)


_FLOAT = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
_WARNED: set[str] = set()              # graph_blocker reasons already told the user (once a process each)


def graph_blocker(model) -> str | None:
    """Why a decode step of this placement can't be captured as CUDA graphs, or None where it can.

    GPU-resident experts that neither the fused MoE kernels (gd.supports) nor a one-pass Triton dequantizer
    (gpu_dequant.has_kernel) read go through the torch reference dequantizers inside the step, and those build
    their lookup tables and shift vectors with torch.tensor on the host: a copy from pageable memory, which a
    capture refuses ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor
    is pinned"). Float experts (F32, F16, BF16) are views: no copy. Experts on the CPU run outside the graphs."""
    from ...kernels.gpu_dequant import has_kernel
    for L in model.decoder.layers:
        if L.ffn_gate_inp is None:
            continue
        exps = (L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps)
        on = sorted({w.device.name for w in exps if w.device.kind == "cuda"})
        if not on or gd.supports(*(w.qtype for w in exps)):
            continue
        slow = sorted({w.qtype.name for w in exps if w.device.kind == "cuda" and w.qtype not in _FLOAT
                       and not has_kernel(w.qtype)})
        if slow:
            return (f"layer {L.i}: experts of {'/'.join(slow)} on {', '.join(on)} have no GPU kernel; their reference "
                    f"dequantizer copies tables from host memory, which a CUDA graph can't capture")
    return None


def expert_shapes(exps) -> tuple:
    """(rows, row bytes) of one expert of each of gate, up and down."""
    return tuple(tuple(w.raw.shape[1:]) for w in exps)


def stage_buffers(layers_exps, n: int, device) -> dict:
    """The decode share's device copies of the experts the GPU takes: n experts of each expert shape these layers'
    (gate, up, down) have, one buffer set per shape (used layer by layer), zeroed."""
    stage = {}
    for exps in layers_exps:
        key = expert_shapes(exps)
        if key not in stage:
            stage[key] = [torch.zeros(n, *shape, dtype=torch.uint8, device=device) for shape in key]
    return stage


def handoff_failure(layer: int, rc: int) -> str:
    """Why a CPU-expert layer's polled hand-off call returned rc (hm_moe_handoff's codes)."""
    if rc == -1:
        return f"layer {layer}: the router chose an expert id that is not an expert (a NaN in the hidden state?)"
    if rc == -3:
        return f"layer {layer}: the GPU did not hand over the CPU experts' input in 30 s"
    return f"layer {layer}: the CPU expert kernel failed ({rc})"


class _Seg:
    """Parts a..b-1 on one device (part u: layer u // 2's attention if u is even, its FFN if odd); kind: "cpu"
    (the experts of `layer`, the last one, go to the CPU), "move" (part b runs on another GPU) or "out" (the
    output head follows)."""
    def __init__(self, a, b, dev, kind):
        self.a, self.b, self.dev, self.kind = a, b, dev, kind
        self.layer = (b - 1) // 2


class StaticDecoder:
    fused = True                     # the fused kernels where Triton runs (a subclass whose block they lack: False)
    torch_polled = False             # the torch version of the layer runs the polled hand-off too (a subclass's)

    def __init__(self, model, kv, capture: bool = True):
        dec, cfg, sched = model.decoder, model.cfg, model.sched
        self.model, self.cfg, self.kv, self.sched = model, cfg, kv, sched
        if any(L.mla for L in dec.layers):
            raise NotApplicable("multi-head latent attention (deepseek2) decodes eagerly")
        if kv.type_k == "q8_0" or kv.type_v == "q8_0":
            raise NotApplicable("q8_0 KV cache")
        # each layer's attention and KV cache on one GPU, its FFN part on one GPU (or its experts on the CPU, with
        # the router on the attention's GPU); the output head on a GPU too
        self.ldev = [L.attn_q.device for L in dec.layers]
        self.out_dev = dec.output.device
        self.fdev = [self._ffn_device(L, d) for L, d in zip(dec.layers, self.ldev)]    # each layer's FFN part
        devs = {d.name: d for d in self.ldev + self.fdev + [self.out_dev]}
        if any(d.kind != "cuda" for d in devs.values()):
            raise NotApplicable("a layer's attention or the output is not on a GPU")
        self.dev = self.out_dev
        fake = any(d.fake for d in devs.values())
        self.capture = capture and not fake
        self.cdt = torch.bfloat16 if not fake else torch.float32                 # matmul dtype
        # the fused Triton kernels (kernels/gpu_decode.py) on a GPU; on fake GPUs in Triton's interpreter
        # (how they are checked against this file's torch path without a GPU)
        D = cfg.head_dim
        self.triton = gd.available() and (not fake or os.environ.get("TRITON_INTERPRET") == "1")
        self.fast = self.fused and self.triton and D >= 16 and D & (D - 1) == 0
        if len(devs) > 1 and not self.fast:
            raise NotApplicable(f"layers on {sorted(devs)} need the fused kernels (triton)")
        if dec.output_norm.device.name != self.out_dev.name:
            raise NotApplicable("output norm and output on different devices")
        self.layers = []
        for i, L in enumerate(dec.layers):
            dev = self.ldev[i]
            for w in (L.attn_q, L.attn_k, L.attn_v, L.attn_output):
                if w.device.name != dev.name:
                    raise NotApplicable(f"{w.name} is on {w.device.name}, its layer's attention on {dev.name}")
            if kv.device(i).name != dev.name:
                raise NotApplicable(f"layer {i}: KV cache on {kv.device(i).name}, attention on {dev.name}")
            if getattr(L, "ffn_gate_shexp", None) is not None:
                raise NotApplicable("shared experts decode eagerly")
            fdev = self.fdev[i]
            small = lambda w, d: sched.small(w, d) if w is not None else None                   # noqa: E731
            lay = dict(attn_norm=small(L.attn_norm, dev), ffn_norm=small(L.ffn_norm, fdev),
                       q_norm=small(L.attn_q_norm, dev), k_norm=small(L.attn_k_norm, dev))
            qkv = [L.attn_qkv] if L.attn_qkv is not None else [L.attn_q, L.attn_k, L.attn_v]
            if self.fast and gd.can_gemv8(qkv) and gd.can_gemv8([L.attn_output]):   # dp4a from the Q8_0/Q4_0
                lay.update(qkv8=[w.raw for w in qkv], o8=[L.attn_output.raw],         # bytes (split rows): half
                           nqkv=sum(w.shape[0] for w in qkv), q8type=(qkv[0].qtype, L.attn_output.qtype))
            else:                                                                 # the bytes of bf16
                lay.update(wqkv=qkv[0].cached(self.cdt) if len(qkv) == 1 else
                           torch.cat([w.cached(self.cdt) for w in qkv]), wo=L.attn_output.cached(self.cdt))
            if L.ffn_gate_inp is None:
                lay.update(dense=tuple(w.cached(self.cdt) for w in (L.ffn_gate, L.ffn_up, L.ffn_down)))
            else:
                exps = (L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps)
                r, rdt = L.ffn_gate_inp, torch.float32 if L.ffn_gate_inp.qtype == GGMLType.F32 else self.cdt
                # the router is small (n_expert rows): copied once to the FFN part's GPU when it is elsewhere
                lay.update(router=r.cached(rdt) if r.device.name == fdev.name else r.dequant(rdt).to(fdev.torch_device),
                           exps=exps, cpu_experts=exps[0].device.kind == "cpu")
            self._extend_layer(L, lay)
            self.layers.append(lay)
        if self.capture:
            why = graph_blocker(model)
            if why is not None:                         # refused up front: a capture would fail at run time
                if why not in _WARNED:
                    _WARNED.add(why)
                    warn(f"decode steps run without CUDA graphs: {why}")
                raise NotApplicable(why)
        self.out_norm = sched.small(dec.output_norm, self.out_dev)
        self.out8 = self.fast and gd.can_gemv8([dec.output])                 # the head by dp4a too
        self.w_out = dec.output.raw if self.out8 else dec.output.cached(self.cdt)
        # per GPU: the position, rope tables for every position of the cache (where attention runs), and the
        # hand-off buffers
        H, k = cfg.n_embd, cfg.n_expert_used
        self.ds, attn_gpus = {}, {d.name for d in self.ldev}
        for name, d in devs.items():
            td = d.torch_device
            z = lambda *shape, td=td: torch.zeros(*shape, device=td)                             # noqa: E731
            cos, sin = context_rope_tables(kv.n_ctx, cfg.head_dim, cfg.rope_base, cfg.rope_neox, td,
                                           yarn_key(cfg.rope_yarn)) \
                if name in attn_gpus else (None, None)
            self.ds[name] = SimpleNamespace(
                pos=torch.zeros(1, dtype=torch.long, device=td), cos=cos, sin=sin,
                kpos=torch.arange(kv.n_ctx, device=td) if name in attn_gpus else None,
                resid=z(1, H), moe_in=z(1, H), packed=z(1, H + 2 * k), xin=z(1, H), xmove=z(1, H))
        first = self.ds[self.ldev[0].name]
        self.x_in = first.xin
        self.logits = torch.zeros(1, cfg.n_vocab, device=self.out_dev.torch_device)
        one = self.ds[self.dev.name]                         # the single-GPU torch path's buffers
        self.pos, self.cos, self.sin, self.kpos = one.pos, one.cos, one.sin, one.kpos
        self.resid, self.moe_in, self.packed = one.resid, one.moe_in, one.packed
        pin = not fake
        self.h_packed = torch.zeros(1, H + 2 * k, pin_memory=pin)
        self.h_moe = torch.zeros(1, H, pin_memory=pin)
        self.h_logits = torch.zeros(1, cfg.n_vocab, pin_memory=pin)
        self.h_ids = torch.zeros(1, k, dtype=torch.int32)
        # segments: runs of parts (unit u: layer u // 2's attention for even u, its FFN for odd u) on one GPU that
        # end at a CPU-expert layer, a change of GPU (between layers or inside one), or the output
        udev = [d for pair in zip(self.ldev, self.fdev) for d in pair]
        self.segments, a = [], 0
        for u, dev in enumerate(udev):
            nxt = udev[u + 1] if u + 1 < len(udev) else self.out_dev
            if u % 2 and self.layers[u // 2].get("cpu_experts"):
                self.segments.append(_Seg(a, u + 1, dev, "cpu"))
                a = u + 1
            elif nxt.name != dev.name:
                self.segments.append(_Seg(a, u + 1, dev, "move"))
                a = u + 1
        self.segments.append(_Seg(a, len(udev), self.out_dev, "out"))
        self.hk = self._handoff(len(devs))
        self.graphs = None
        self.worked = False                             # a step has run (the model falls back before that)

    def _extend_layer(self, L, lay: dict):
        """What a subclass's block adds to layer L's tensors (lay), before the hand-off is built; none here."""

    @staticmethod
    def _ffn_device(L, attn):
        """The device of layer L's FFN part (kernels/decode_layout.py, the rule the planner warns by): the GPU of
        its experts or dense FFN, or its attention's GPU where the experts are in host RAM (the CPU hand-off)."""
        big = dl.EXPS if L.ffn_gate_inp is not None else dl.DENSE
        ws = {n: getattr(L, n, None) for n in big + dl.SHEXP}
        dev, why = dl.ffn_part_device({n: w.device.name for n, w in ws.items() if w is not None}, attn.name)
        if dev is None:
            raise NotApplicable(f"layer {L.i}: {why}")
        return attn if dev == "CPU" else ws[big[0]].device

    def _handoff(self, n_devices: int):
        """Pinned buffers, flags and per-layer C calls for the polled hand-off of experts to the CPU (step), or
        None where the synchronous one runs: several GPUs, no graphs or fused kernels, --profile (it times
        each segment with a sync), a type without the C kernel, or HYBRIDMOE_HANDOFF=sync."""
        cpu_segs = [s for s, seg in enumerate(self.segments) if seg.kind == "cpu"]
        kern = X.kernels()
        polled = self.fast or (self.torch_polled and self.triton)
        if not cpu_segs or not (self.capture and polled) or n_devices > 1 or kern is None or \
                self.sched.stats.profile or env.get("HYBRIDMOE_HANDOFF") == "sync":
            return None
        H, k, n, td = self.cfg.n_embd, self.cfg.n_expert_used, len(cpu_segs), self.dev.torch_device
        pin = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype, pin_memory=True)  # noqa: E731
        hk = SimpleNamespace(packed=pin(n, H + 2 * k), out=pin(n, H), ready=pin(n, 16, dtype=torch.int32),
                             done=pin(n, 16, dtype=torch.int32), err=pin(1, dtype=torch.int32),   # a flag a line
                             step=torch.zeros(1, dtype=torch.int32, device=td), n=0, slot={}, calls=[], bytes=0,
                             share=self._decode_share(cpu_segs), share_bytes=0)
        for j, s in enumerate(cpu_segs):
            g, u, d = self.layers[self.segments[s].layer]["exps"]
            try:
                hk.calls.append(kern.handoff_call(g.raw, u.raw, d.raw, g.qtype, d.qtype, hk.packed[j], hk.out[j],
                                                  hk.ready[j], hk.done[j], self.sched.n_threads,
                                                  n_cpu=k - hk.share, oai=self._host_oai(self.segments[s].layer)))
            except ValueError:                          # a type or shape the C kernel lacks
                return None
            hk.slot[s] = j
            per = g.raw[0].numel() + u.raw[0].numel() + d.raw[0].numel()
            hk.bytes += (k - hk.share) * per
            hk.share_bytes += hk.share * per
        if hk.share:             # the GPU's copies of its experts
            hk.stage = stage_buffers([self.layers[self.segments[s].layer]["exps"] for s in cpu_segs], hk.share, td)
            hk.lids = torch.arange(hk.share, dtype=torch.int32, device=td)[None]
            hk.gout = torch.zeros(hk.share, H, device=td)
        return hk

    def _decode_share(self, cpu_segs) -> int:
        """How many of each CPU-expert layer's k experts the GPU runs itself during a decode step (share_count)."""
        return share_count(self.sched, self.dev, self.cfg.n_expert_used,
                           [self.layers[self.segments[s].layer]["exps"] for s in cpu_segs])

    def _inputs(self, s: int):
        """(x, rows to add to x first) at the start of segment s, on its GPU."""
        if s == 0:
            return self.x_in, None
        prev, here = self.segments[s - 1], self.ds[self.segments[s].dev.name]
        if prev.kind == "cpu":
            same = prev.dev.name == self.segments[s].dev.name
            return (here.resid if same else here.xin), here.moe_in
        return here.xin, None

    # -- the step, as plain torch ops ------------------------------------------------------------------
    def _attention(self, i, lay, x):
        cfg = self.cfg
        D, nh, nkv = cfg.head_dim, cfg.n_head, cfg.n_head_kv
        h = rms_norm(x, lay["attn_norm"], cfg.rms_eps)
        qkv = (h.to(self.cdt) @ lay["wqkv"].t()).float()
        q, k, v = qkv.split((nh * D, nkv * D, nkv * D), dim=-1)
        q, k, v = q.view(nh, D), k.view(nkv, D), v.view(nkv, D)
        if lay["q_norm"] is not None:
            q, k = rms_norm(q, lay["q_norm"], cfg.rms_eps), rms_norm(k, lay["k_norm"], cfg.rms_eps)
        cos, sin = self.cos.index_select(0, self.pos), self.sin.index_select(0, self.pos)   # [1, D]
        q, k = apply_rope(q, cos, sin, cfg.rope_neox), apply_rope(k, cos, sin, cfg.rope_neox)
        kc, vc = self.kv.k[i], self.kv.v[i]                               # [nkv, n_ctx, D]
        kc.index_copy_(1, self.pos, k[:, None, :].to(kc.dtype))
        vc.index_copy_(1, self.pos, v[:, None, :].to(vc.dtype))
        mask = (self.kpos <= self.pos)[None, :]                           # [1, n_ctx]
        adt = kc.dtype if self.capture else torch.float32                 # fake GPUs: the eager path's f32
        o = F.scaled_dot_product_attention(q[:, None, :].to(adt), kc.to(adt), vc.to(adt), attn_mask=mask,
                                           enable_gqa=nh != nkv)          # [nh, 1, D]
        o = o.reshape(1, nh * D)
        return (o.to(self.cdt) @ lay["wo"].t()).float()

    def _ffn(self, lay, x):
        """Returns (x after the FFN, None), or (x, packed router output) when the experts are on the CPU."""
        cfg = self.cfg
        h = rms_norm(x, lay["ffn_norm"], cfg.rms_eps)
        if "dense" in lay:
            g, u, d = lay["dense"]
            hc = h.to(self.cdt)
            return x + ((F.silu(hc @ g.t()) * (hc @ u.t())) @ d.t()).float(), None
        logits = (h.to(lay["router"].dtype) @ lay["router"].t()).float()
        wts, ids = torch.topk(torch.softmax(logits, -1), cfg.n_expert_used, dim=-1)
        if cfg.norm_topk_prob:
            wts = wts / wts.sum(-1, keepdim=True)
        if lay["cpu_experts"]:
            return x, torch.cat((h, wts, ids.float()), dim=1)
        g, u, d = lay["exps"]
        return x + X.moe(h, ids, wts, g.raw, u.raw, d.raw, g, u, d), None

    # -- the step with the fused kernels: ~10 launches a layer ------------------------------------------
    def _attn_fast(self, i, lay, x, addend, wait=None, extra=None):
        """Layer i's attention part on x (+ addend: rows to add first, the CPU experts' output or the k weighted
        GPU expert rows; wait: addend is in pinned memory, ready when the host sets a flag, see add_rms_norm;
        extra: rows on the GPU to add as well, its decode share of the CPU layer before). Returns (x, the
        attention output row to add to it)."""
        cfg = self.cfg
        eps, H = cfg.rms_eps, cfg.n_embd
        ds = self.ds[self.ldev[i].name]
        x_sum = torch.empty_like(x) if addend is not None else None
        xq = gd.x8_buffers(x.shape[0], H, x.device) if "qkv8" in lay else None
        xs, hb = gd.add_rms_norm(x, lay["attn_norm"], eps, b=addend, x_out=x_sum, h_dtype=self.cdt, wait=wait,
                                 q8_out=xq, c=extra)
        if addend is not None:
            x = xs
        if xq is not None:
            qkv = gd.gemv8(xq, lay["qkv8"], lay["q8type"][0], H, hb.new_empty(1, lay["nqkv"]))
        else:
            qkv = hb @ lay["wqkv"].t()
        kc, vc = self.kv.k[i], self.kv.v[i]
        # the output projection's int8 activations: from the attention merge (whole 32-blocks a head) or quant_x8
        merge8 = "o8" in lay and cfg.head_dim % 32 == 0
        oq = gd.x8_buffers(1, cfg.n_head * cfg.head_dim, x.device) if merge8 else None
        o = gd.attention(None, kc, vc, ds.pos, cfg.head_dim ** -0.5, out_dtype=self.cdt,   # q/k norm + RoPE +
                         rope=(qkv, lay["q_norm"], lay["k_norm"], ds.cos, ds.sin, cfg.n_head, eps,  # KV write
                               cfg.rope_neox), q8_out=oq)                                         # fused in
        if "o8" in lay:
            return x, gd.gemv8(oq if merge8 else gd.quant_x8(o), lay["o8"], lay["q8type"][1], o.shape[1],
                               hb.new_empty(1, H))
        return x, o @ lay["wo"].t()

    def _ffn_fast(self, i, lay, x, ob, publish=None):
        """Layer i's FFN part on x (+ ob: the attention's output row; None where the residual came from another
        GPU with it added). Returns (x, addend for the next part, whether the CPU takes the experts from the
        GPU's packed buffer, with the residual in its resid buffer). publish: (host row, flag, step) where the
        router hands that buffer to the CPU itself (the polled hand-off)."""
        cfg = self.cfg
        eps, H, k = cfg.rms_eps, cfg.n_embd, cfg.n_expert_used
        ds = self.ds[self.fdev[i].name]
        cpu = bool(lay.get("cpu_experts"))
        x2 = ds.resid if cpu else torch.empty_like(x) if ob is not None else None
        exps = None if cpu or "dense" in lay else lay["exps"]
        xq = gd.x8_buffers(x.shape[0], H, x.device) if exps and exps[0].split else None   # the MoE's int8 x
        router = lay.get("router")
        h2 = torch.empty_like(x, dtype=router.dtype) if router is not None and router.dtype != x.dtype else None
        _, h = gd.add_rms_norm(x, lay["ffn_norm"], eps, b=ob, x_out=x2,
                               h_out=ds.packed[:, :H] if cpu else None, q8_out=xq, h2_out=h2)
        x2 = x if x2 is None else x2
        if "dense" in lay:
            g, u, d = lay["dense"]
            hc = h.to(self.cdt)
            return x2, ((F.silu(hc @ g.t()) * (hc @ u.t())) @ d.t()).float(), False
        logits = (h2 if h2 is not None else h) @ router.t()                # top-k reads bf16 logits as they are
        wts, ids = gd.router_topk(logits, k, cfg.norm_topk_prob, packed=ds.packed if cpu else None, pack_offset=H,
                                  publish=publish if cpu else None)
        if cpu:
            if publish is not None and self.hk.share:
                self._gpu_share(lay, h, wts, ids)
            return x2, None, True
        g, u, d = exps
        if gd.supports(g.qtype, u.qtype, d.qtype):
            return x2, gd.moe(h, ids, wts, g.raw, u.raw, d.raw, g.qtype, d.qtype, reduce=False,
                              gate_split=g.split, down_split=d.split, xq=xq), False
        return x2, X.moe(h, ids, wts, g.raw, u.raw, d.raw, g, u, d), False

    def _gpu_share(self, lay, h, wts, ids):
        """The GPU's decode share of a CPU-expert layer: the last hk.share of the router's k experts (the CPU
        runs the others) are copied from host memory over the bus and run here, into hk.gout, while the CPU
        works; the next segment adds them with the CPU's rows."""
        hk = self.hk
        g, u, d = lay["exps"]
        j0 = self.cfg.n_expert_used - hk.share
        stage = hk.stage[expert_shapes(lay["exps"])]
        gd.stage_experts(ids, j0, [gd.stage_words(w.raw) for w in (g, u, d)], [gd.stage_words(w) for w in stage])
        gd.moe(h, hk.lids, wts[:, j0:], *stage, g.qtype, d.qtype, reduce=False, gate_split=g.split,
               down_split=d.split, out=hk.gout, oai=self._share_oai(lay, ids, j0))

    def _share_oai(self, lay, ids, j0: int):
        """gd.moe's oai option for the decode share's staged experts (gpt-oss's subclass), None here."""
        return None

    def _segment_fast(self, s: int):
        seg, hk = self.segments[s], self.hk
        x, addend = self._inputs(s)
        wait = extra = None
        if hk is not None and s - 1 in hk.slot:         # the first kernel waits for the CPU experts' output
            j = hk.slot[s - 1]
            addend, wait = hk.out[j:j + 1], (hk.done[j], hk.step, hk.err)
            extra = hk.gout if hk.share else None
        # the polled hand-off: the router of the segment's last layer writes [h | weights | ids] for the CPU
        pub = (hk.packed[hk.slot[s]], hk.ready[hk.slot[s]], hk.step) if hk is not None and s in hk.slot else None
        for u in range(seg.a, seg.b):
            i, lay = u // 2, self.layers[u // 2]
            if u % 2 == 0:
                x, addend = self._attn_fast(i, lay, x, addend, wait, extra)
            else:
                x, addend, to_cpu = self._ffn_fast(i, lay, x, addend, pub if u == seg.b - 1 else None)
                if to_cpu:
                    return
            wait = extra = None
        if seg.kind == "move":                        # the residual (with the last part's output rows) leaves
            xmove = self.ds[seg.dev.name].xmove
            if addend is None:
                xmove.copy_(x)
            else:
                torch.add(x, addend.sum(0, keepdim=True), out=xmove)
            return
        # addend: the last layer's FFN rows or CPU experts, when no layer follows them
        xq = gd.x8_buffers(1, self.cfg.n_embd, x.device) if self.out8 else None
        _, hb = gd.add_rms_norm(x, self.out_norm, self.cfg.rms_eps, b=addend, h_dtype=self.cdt, wait=wait,
                                q8_out=xq, c=extra)
        if self.out8:
            gd.gemv8(xq, [self.w_out], self.model.decoder.output.qtype, self.cfg.n_embd, self.logits)
        else:
            self.logits.copy_((hb @ self.w_out.t()).float())

    def _segment(self, s: int):
        if self.fast:
            return self._segment_fast(s)
        seg = self.segments[s]                                            # single GPU (checked in __init__)
        x = self.x_in if seg.a == 0 else self.resid + self.moe_in
        for u in range(seg.a, seg.b):
            lay = self.layers[u // 2]
            if u % 2 == 0:
                x = x + self._attention(u // 2, lay, x)
                continue
            x, packed = self._ffn(lay, x)
            if packed is not None:
                self.packed.copy_(packed)
                self.resid.copy_(x)
                return
        self.logits.copy_((rms_norm(x, self.out_norm, self.cfg.rms_eps).to(self.cdt) @ self.w_out.t()).float())

    # -- running ----------------------------------------------------------------------------------------
    def _capture(self):
        """One CUDA graph per segment, captured on its GPU (after one eager warm-up: lazy inits, autotuning)."""
        side = {n: torch.cuda.Stream(d.torch_device) for n, d in
                {sg.dev.name: sg.dev for sg in self.segments}.items()}
        for n, st in side.items():
            st.wait_stream(torch.cuda.current_stream(st.device))
        for s, seg in enumerate(self.segments):
            with torch.cuda.stream(side[seg.dev.name]):
                self._segment(s)
        for n, st in side.items():
            torch.cuda.current_stream(st.device).wait_stream(st)
        pools = {n: torch.cuda.graph_pool_handle() for n in side}
        self.graphs = []
        with gc_paused():                               # one collection for all the segments' captures
            for s, seg in enumerate(self.segments):
                g = torch.cuda.CUDAGraph()
                # a capture stream on the segment's GPU (torch's default one lives on the first GPU used)
                with capturing(g, seg.dev.torch_device, side[seg.dev.name], pools[seg.dev.name]):
                    self._segment(s)
                self.graphs.append(g)

    def _cpu_experts(self, b: int, st, src: str, dst: str):
        """Layer b's experts on the CPU from the packed [h | weights | ids] row, into the pinned h_moe."""
        H, k = self.cfg.n_embd, self.cfg.n_expert_used
        hp = self.h_packed
        self.h_ids.copy_(hp[:, H + k:])                                   # float ids -> int32, exact
        g, u, d = self.layers[b]["exps"]
        t0 = time.perf_counter()
        with st.op("moe_up_gate", g.device):
            kern = X.kernels()
            if kern is not None:
                kern.moe_ffn(hp[:, :H], self.h_ids, hp[:, H:H + k], g.raw, u.raw, d.raw, g.qtype, d.qtype,
                             n_threads=self.sched.n_threads, out=self.h_moe, oai=self._host_oai(b))
            else:
                self.h_moe.copy_(X.moe(hp[:, :H], self.h_ids.long(), hp[:, H:H + k], g.raw, u.raw, d.raw,
                                       g, u, d, self.sched.n_threads))
        st.cpu_expert_seconds += time.perf_counter() - t0
        st.cpu_expert_bytes += k * (g.raw[0].numel() + u.raw[0].numel() + d.raw[0].numel())
        st.copy(src, "CPU", hp.numel() * 4)
        st.copy("CPU", dst, H * 4)

    def _host_oai(self, b: int):
        """The C expert kernel's oai option for layer b's experts (gpt-oss's subclass), None here."""
        return None

    def _run_segment(self, s: int):
        if self.graphs:
            self.graphs[s].replay()
        else:
            self._segment(s)

    def _step_polled(self, st):
        """The segments of one step on one GPU with every hand-off polled in pinned memory: the GPU publishes
        a CPU-expert layer's [h | weights | ids] and a flag (gd.router_topk(publish=)), the C kernel spins on
        the flag, runs the experts, and sets a flag of its own, which the next segment's first kernel spins on
        (gd.add_rms_norm(wait=)). Segment s + 1 is enqueued before the CPU works on segment s, so no Python,
        launch or synchronization sits between the two devices; both flags carry the step's number."""
        hk = self.hk
        hk.n = hk.n % (1 << 30) + 1
        hk.step.fill_(hk.n)
        self.graphs[0].replay()
        try:
            for s in range(len(self.segments) - 1):    # one GPU: each segment but the last ends at a CPU layer
                self.graphs[s + 1].replay()            # waits on the GPU for the call below
                rc = hk.calls[hk.slot[s]](hk.n)
                if rc:
                    raise RuntimeError(handoff_failure(self.segments[s].layer, rc))
        except BaseException:
            hk.done[:, 0].fill_(hk.n)                   # let every waiting GPU segment go on
            raise
        n = len(hk.calls)
        st.ops[("moe_up_gate", "CPU")][0] += n
        st.cpu_expert_bytes += hk.bytes
        st.gpu_share_bytes += hk.share_bytes
        st.copy(self.dev.name, "CPU", hk.packed[0].numel() * 4, n)
        st.copy("CPU", self.dev.name, hk.out[0].numel() * 4, n)

    def step(self, token: int, pos: int) -> torch.Tensor:
        """One decode step; returns logits [1, n_vocab] on the CPU."""
        st = self.sched.stats
        dec = self.model.decoder
        emb = dec.token_embd.dequant(torch.float32, index=torch.tensor([token]))
        self.x_in.copy_(emb, non_blocking=False)
        for ds in self.ds.values():
            ds.pos.fill_(pos)
        if self.capture and self.graphs is None:
            try:
                self._capture()
            except RuntimeError as e:                   # a driver or op that can't be captured: run eagerly
                self.capture, self.graphs, self.hk = False, None, None
                torch.cuda.synchronize()
                warn_fallback("CUDA graph capture", e, "decoding without graphs")
        st.forwards += 1
        st.tokens += 1
        st.copy("CPU", self.ldev[0].name, emb.numel() * 4)
        if self.hk is not None and self.graphs:
            self._step_polled(st)
            self.h_logits.copy_(self.logits)
            if self.hk.err[0]:
                self.hk.err.zero_()
                raise RuntimeError("the GPU waited more than a minute for the CPU experts of a decode step")
            return self.h_logits.clone()
        H = self.cfg.n_embd
        for s, seg in enumerate(self.segments):
            # --profile: each segment timed to its end on the GPU (a sync each), as "decode graph" (replayed)
            # or "decode step" (run op by op); the CPU experts time themselves; the rest is hand-offs + Python
            if st.profile:
                real = seg.dev.kind == "cuda" and not seg.dev.fake
                sync = (lambda d=seg.dev.torch_device: torch.cuda.synchronize(d)) if real else None
                with st.op("decode graph" if self.graphs else "decode step", seg.dev, sync):
                    self._run_segment(s)
            else:
                self._run_segment(s)
            if seg.kind == "out":
                break
            here, nxt = self.ds[seg.dev.name], self.segments[s + 1].dev
            there = self.ds[nxt.name]
            if seg.kind == "cpu":                                         # layer b-1's experts on the CPU
                self.h_packed.copy_(here.packed)                          # D2H waits for the segment
                self._cpu_experts(seg.layer, st, seg.dev.name, nxt.name)
                there.moe_in.copy_(self.h_moe, non_blocking=True)
                if nxt.name != seg.dev.name:
                    there.xin.copy_(here.resid, non_blocking=True)
                    st.copy(seg.dev.name, nxt.name, H * 4)
            else:                                                         # the next layer is on another GPU
                there.xin.copy_(here.xmove, non_blocking=True)
                st.copy(seg.dev.name, nxt.name, H * 4)
        self.h_logits.copy_(self.logits)
        return self.h_logits.clone()
