"""Token generation with static shapes, GPU segments captured as CUDA graphs.

Python launching ~40 small kernels per layer costs more than the GPU work of a decode step. Here one
step is: the GPU runs layers up to the next layer whose experts live in host RAM (one graph replay),
hands the normed hidden state and the router's choice to the CPU in one copy, the CPU kernel computes
the experts, one copy brings the result back, and the next graph continues. With all experts on the GPU
the whole step is one replay.

Static shapes: the position is a device tensor; the KV cache is written with index_copy_ and attention
reads the whole cache under a mask, so the same graph serves every position.
`StaticDecoder(capture=False)` runs the same code eagerly: that is how CI checks it on fake GPUs.
"""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from ..kernels import gpu_decode as gd
from ..quant.types import GGMLType
from . import experts as X
from .ops import apply_rope, rms_norm, rope_tables


class NotApplicable(Exception):
    """The placement has no static decode path (mixed GPUs, q8_0 cache, ...); the eager path runs."""


class StaticDecoder:
    def __init__(self, model, kv, capture: bool = True):
        dec, cfg, sched = model.decoder, model.cfg, model.sched
        self.model, self.cfg, self.kv, self.sched = model, cfg, kv, sched
        if any(L.mla for L in dec.layers):
            raise NotApplicable("multi-head latent attention (deepseek2) decodes eagerly")
        devs = {L.attn_q.device.name for L in dec.layers} | {dec.output.device.name, dec.output_norm.device.name}
        devs |= {kv.device(i).name for i in range(cfg.n_layer)}
        if len(devs) != 1:
            raise NotApplicable(f"attention, KV cache and output span {sorted(devs)}")
        self.dev = dec.output.device
        if self.dev.kind != "cuda":
            raise NotApplicable("no GPU holds the attention")
        if kv.type_k == "q8_0" or kv.type_v == "q8_0":
            raise NotApplicable("q8_0 KV cache")
        td = self.dev.torch_device
        self.capture = capture and not self.dev.fake
        self.cdt = torch.bfloat16 if not self.dev.fake else torch.float32        # matmul dtype
        # the fused Triton kernels (kernels/gpu_decode.py) on a GPU; on fake GPUs in Triton's interpreter
        # (how they are checked against this file's torch path without a GPU)
        D = cfg.head_dim
        self.fast = gd.available() and D >= 16 and D & (D - 1) == 0 and \
            (not self.dev.fake or os.environ.get("TRITON_INTERPRET") == "1")
        small = lambda w: sched.small(w, self.dev)                                # noqa: E731
        wq = lambda w: w.cached(self.cdt) if w.device.name == self.dev.name else None   # noqa: E731
        self.layers = []
        for L in dec.layers:
            for w in (L.attn_q, L.attn_k, L.attn_v, L.attn_output, L.attn_norm, L.ffn_norm):
                if w.device.name != self.dev.name:
                    raise NotApplicable(f"{w.name} is on {w.device.name}")
            lay = dict(attn_norm=small(L.attn_norm), ffn_norm=small(L.ffn_norm),
                       wqkv=wq(L.attn_qkv) if L.attn_qkv is not None else
                       torch.cat((wq(L.attn_q), wq(L.attn_k), wq(L.attn_v))), wo=wq(L.attn_output),
                       q_norm=small(L.attn_q_norm) if L.attn_q_norm is not None else None,
                       k_norm=small(L.attn_k_norm) if L.attn_k_norm is not None else None)
            if L.ffn_gate_inp is None:
                if not all(w.device.name == self.dev.name for w in (L.ffn_gate, L.ffn_up, L.ffn_down)):
                    raise NotApplicable("dense FFN off the GPU")
                lay.update(dense=(wq(L.ffn_gate), wq(L.ffn_up), wq(L.ffn_down)))
            else:
                exps = (L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps)
                where = {w.device.name for w in exps}
                if L.ffn_gate_inp.device.name != self.dev.name or len(where) != 1 or \
                        where not in ({self.dev.name}, {"CPU"}):
                    raise NotApplicable(f"layer {L.i}: router or experts split across devices")
                lay.update(router=L.ffn_gate_inp.cached(torch.float32 if L.ffn_gate_inp.qtype == GGMLType.F32
                                                        else self.cdt),
                           exps=exps, cpu_experts=exps[0].device.kind == "cpu")
            self.layers.append(lay)
        self.out_norm, self.w_out = small(dec.output_norm), wq(dec.output)
        # rope tables for every position of the cache
        cos, sin = rope_tables(torch.arange(kv.n_ctx), cfg.head_dim, cfg.rope_base, cfg.rope_neox)
        self.cos, self.sin = cos[:, 0].to(td), sin[:, 0].to(td)                # [n_ctx, D]
        self.kpos = torch.arange(kv.n_ctx, device=td)
        # static buffers
        H, k = cfg.n_embd, cfg.n_expert_used
        self.pos = torch.zeros(1, dtype=torch.long, device=td)
        self.x_in = torch.zeros(1, H, device=td)
        self.resid = torch.zeros(1, H, device=td)
        self.moe_in = torch.zeros(1, H, device=td)
        self.packed = torch.zeros(1, H + 2 * k, device=td)
        self.logits = torch.zeros(1, cfg.n_vocab, device=td)
        pin = not self.dev.fake
        self.h_packed = torch.zeros(1, H + 2 * k, pin_memory=pin)
        self.h_moe = torch.zeros(1, H, pin_memory=pin)
        self.h_logits = torch.zeros(1, cfg.n_vocab, pin_memory=pin)
        self.h_ids = torch.zeros(1, k, dtype=torch.int32)
        # segments: runs of layers that end at a CPU-expert layer (or at the output)
        self.segments, start = [], 0
        for i, lay in enumerate(self.layers):
            if lay.get("cpu_experts"):
                self.segments.append((start, i))
                start = i + 1
        self.segments.append((start, cfg.n_layer))                    # last: up to the logits
        self.graphs = None

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
    def _layer_fast(self, i, lay, x, addend):
        """Layer i on x (+ addend: rows to add first, the CPU experts' output or the k weighted GPU expert
        rows). Returns (x, addend for the next layer, whether the CPU takes the experts from self.packed,
        with the residual in self.resid)."""
        cfg = self.cfg
        eps, H, k = cfg.rms_eps, cfg.n_embd, cfg.n_expert_used
        x_sum = torch.empty_like(x) if addend is not None else None
        xs, hb = gd.add_rms_norm(x, lay["attn_norm"], eps, b=addend, x_out=x_sum, h_dtype=self.cdt)
        if addend is not None:
            x = xs
        qkv = hb @ lay["wqkv"].t()
        kc, vc = self.kv.k[i], self.kv.v[i]
        q = gd.qk_rope_cache(qkv, lay["q_norm"], lay["k_norm"], self.cos, self.sin, self.pos, kc, vc,
                             cfg.n_head, cfg.n_head_kv, cfg.head_dim, eps, cfg.rope_neox)
        o = gd.attention(q, kc, vc, self.pos, cfg.head_dim ** -0.5, out_dtype=self.cdt)
        cpu = bool(lay.get("cpu_experts"))
        x2 = self.resid if cpu else torch.empty_like(x)
        _, h = gd.add_rms_norm(x, lay["ffn_norm"], eps, b=o @ lay["wo"].t(), x_out=x2,
                               h_out=self.packed[:, :H] if cpu else None)
        if "dense" in lay:
            g, u, d = lay["dense"]
            hc = h.to(self.cdt)
            return x2, ((F.silu(hc @ g.t()) * (hc @ u.t())) @ d.t()).float(), False
        router = lay["router"]
        logits = (h.to(router.dtype) @ router.t()).float()
        wts, ids = gd.router_topk(logits, k, cfg.norm_topk_prob, packed=self.packed if cpu else None, pack_offset=H)
        if cpu:
            return x2, None, True
        g, u, d = lay["exps"]
        if gd.supports(g.qtype, d.qtype) and u.qtype == g.qtype:
            return x2, gd.moe(h, ids, wts, g.raw, u.raw, d.raw, g.qtype, d.qtype, reduce=False), False
        return x2, X.moe(h, ids, wts, g.raw, u.raw, d.raw, g, u, d), False

    def _segment_fast(self, s: int):
        a, b = self.segments[s]
        x, addend = (self.x_in, None) if a == 0 else (self.resid, self.moe_in)
        for i in range(a, min(b + 1, self.cfg.n_layer)):
            x, addend, to_cpu = self._layer_fast(i, self.layers[i], x, addend)
            if to_cpu:
                return
        _, hb = gd.add_rms_norm(x, self.out_norm, self.cfg.rms_eps, b=addend, h_dtype=self.cdt)
        self.logits.copy_((hb @ self.w_out.t()).float())

    def _segment(self, s: int):
        if self.fast:
            return self._segment_fast(s)
        a, b = self.segments[s]
        x = self.x_in if a == 0 else self.resid + self.moe_in
        for i in range(a, min(b + 1, self.cfg.n_layer)):
            lay = self.layers[i]
            x = x + self._attention(i, lay, x)
            x, packed = self._ffn(lay, x)
            if packed is not None:
                self.packed.copy_(packed)
                self.resid.copy_(x)
                return
        self.logits.copy_((rms_norm(x, self.out_norm, self.cfg.rms_eps).to(self.cdt) @ self.w_out.t()).float())

    # -- running ----------------------------------------------------------------------------------------
    def _capture(self):
        stream = torch.cuda.Stream(self.dev.torch_device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for s in range(len(self.segments)):
                self._segment(s)                                          # warm-up: lazy inits outside capture
        torch.cuda.current_stream().wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        self.graphs = []
        for s in range(len(self.segments)):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._segment(s)
            self.graphs.append(g)

    def _cpu_experts(self, b: int, st):
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
                             n_threads=self.sched.n_threads, out=self.h_moe)
            else:
                self.h_moe.copy_(X.moe(hp[:, :H], self.h_ids.long(), hp[:, H:H + k], g.raw, u.raw, d.raw,
                                       g, u, d, self.sched.n_threads))
        st.cpu_expert_seconds += time.perf_counter() - t0
        st.cpu_expert_bytes += k * (g.raw[0].numel() + u.raw[0].numel() + d.raw[0].numel())
        st.copy(self.dev.name, "CPU", hp.numel() * 4)
        st.copy("CPU", self.dev.name, H * 4)

    def step(self, token: int, pos: int) -> torch.Tensor:
        """One decode step; returns logits [1, n_vocab] on the CPU."""
        st = self.sched.stats
        dec = self.model.decoder
        emb = dec.token_embd.dequant(torch.float32, index=torch.tensor([token]))
        self.x_in.copy_(emb, non_blocking=False)
        self.pos.fill_(pos)
        if self.capture and self.graphs is None:
            self._capture()
        st.forwards += 1
        st.tokens += 1
        st.copy("CPU", self.dev.name, emb.numel() * 4)
        for s, (a, b) in enumerate(self.segments):
            if self.graphs:
                self.graphs[s].replay()
            else:
                self._segment(s)
            if b < self.cfg.n_layer:                                      # layer b's experts on the CPU
                self.h_packed.copy_(self.packed)                          # D2H waits for the segment
                self._cpu_experts(b, st)
                self.moe_in.copy_(self.h_moe, non_blocking=True)
        self.h_logits.copy_(self.logits)
        return self.h_logits.clone()
