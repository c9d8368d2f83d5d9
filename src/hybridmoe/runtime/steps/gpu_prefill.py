"""A prompt's ubatch as one CUDA graph when every weight is on one GPU (`-ngl 99`, experts included).

With the whole model on a GPU, prompt processing was bound by the host: the GPU worked ~37 ms on a 512-token
ubatch of the Qwen3-30B-A3B shape, while Python enqueued the ~25 launches of each of 48 layers in 55-111 ms
(docs/benchmarks.md). Here a ubatch is the fused kernels of the static decode step, sized for T rows
(add_rms_norm, qkv GEMM, qk_rope_cache, attention_prefill, output GEMM, add_rms_norm, router GEMM,
router_topk, the grouped MoE kernels), all reading the position from a device tensor. So a graph captured
for T tokens serves every ubatch of T tokens at any position: a prompt's full ubatches and a benchmark's
repetitions replay it.

The first ubatch of a size runs these kernels eagerly (it compiles them). A full ubatch (-ub tokens) is
captured right after, since full ubatches recur: every prompt longer than one is made of them. Other sizes
(a prompt's last ubatch, the new tokens after a cached prefix) always run eagerly: they come in every size,
a capture costs 200-250 ms against 35-80 ms for running one eagerly (docs/benchmarks.md, "captured prefill"), and
eager and replayed ubatches measured alike there (34 ms for 333 tokens eagerly, 37 ms for a 512-token
replay).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ...errors import warn_fallback
from ...kernels import gpu_decode as gd
from ...kernels import gpu_moe as gm
from ...quant.types import GGMLType
from .. import experts as X
from ..ops import context_rope_tables, yarn_key
from .base import NotApplicable
from .gpu_decode import capturing


class StaticPrefill:
    host_experts = False                 # whether layers with their experts in host RAM are taken (_host_moe)

    def __init__(self, model, kv):
        dec, cfg, sched = model.decoder, model.cfg, model.sched
        self.model, self.cfg, self.kv, self.sched = model, cfg, kv, sched
        if not gd.available():
            raise NotApplicable("triton is not installed")
        if any(L.mla for L in dec.layers) or cfg.expert_gating not in ("softmax", "softmax_topk") or \
                cfg.n_expert_shared:
            raise NotApplicable("MLA, sigmoid routing or shared experts")
        dev = dec.output.device
        if dev.kind != "cuda":
            raise NotApplicable("the output is not on a GPU")
        D = cfg.head_dim
        if D < 16 or D & (D - 1):
            raise NotApplicable(f"head size {D} (the attention kernel takes powers of two)")
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        if dev.fake and not interp:
            raise NotApplicable("fake GPUs run the kernels only in Triton's interpreter")
        here = lambda *ws: all(w is None or w.device.name == dev.name for w in ws)   # noqa: E731
        if not here(dec.output_norm):
            raise NotApplicable("output norm and output on different devices")
        self.dev, self.capture = dev, not dev.fake
        self.cdt = torch.bfloat16 if not dev.fake else torch.float32
        cached = lambda w: w.cached(torch.float32 if w.qtype == GGMLType.F32 else self.cdt)   # noqa: E731
        self.oai = cfg.arch == "gpt-oss"         # gpt-oss's block: biases, sinks, window rings, clamped SwiGLU
        small = lambda w: sched.small(w, dev) if w is not None else None              # noqa: E731
        self.layers = []
        for i, L in enumerate(dec.layers):
            if L.attn_qkv is None:
                raise NotApplicable(f"layer {i}: q, k and v are not one fused matrix")
            if kv.device(i).name != dev.name or not kv.plain(i, ring=self.oai):
                raise NotApplicable(f"layer {i}: KV cache not a plain 16-bit cache on {dev.name}")
            biases = tuple(getattr(L, n, None) for n in ("attn_qkv_b", "attn_output_b", "attn_sinks"))
            if not here(L.attn_norm, L.attn_qkv, L.attn_output, L.attn_q_norm, L.attn_k_norm, L.ffn_norm, *biases):
                raise NotApplicable(f"layer {i}: attention off {dev.name}")
            lay = dict(attn_norm=small(L.attn_norm), ffn_norm=small(L.ffn_norm), q_norm=small(L.attn_q_norm),
                       k_norm=small(L.attn_k_norm), wqkv=L.attn_qkv, wo=L.attn_output, qkv_b=small(biases[0]),
                       o_b=small(biases[1]), sinks=small(biases[2]), window=getattr(L, "window", 0))
            if L.ffn_gate_inp is None:
                if not here(L.ffn_gate, L.ffn_up, L.ffn_down):
                    raise NotApplicable(f"layer {i}: FFN off {dev.name}")
                lay["dense"] = (L.ffn_gate, L.ffn_up, L.ffn_down)
            else:
                exps = (L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps)
                host = self.host_experts and all(w.device.kind == "cpu" for w in exps)
                router_b = getattr(L, "ffn_gate_inp_b", None)
                exps_b = tuple(getattr(L, n + "_b", None) for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
                if not here(L.ffn_gate_inp, router_b, *(() if host else exps + exps_b)) or \
                        getattr(L, "exp_probs_b", None) is not None:
                    raise NotApplicable(f"layer {i}: router or experts off {dev.name}")
                # other types take dequantize + grouped GEMMs, whose expert counts wait for the GPU
                if not host and (not gm.supports(*(w.qtype for w in exps)) or
                                 exps_b[0] is not None and any(w.split for w in exps)):
                    raise NotApplicable(f"layer {i}: experts of {exps[0].qtype.name} / {exps[2].qtype.name} "
                                        "have no fused prefill kernel")
                lay.update(router=L.ffn_gate_inp, router_b=small(router_b), exps=exps, host=host,
                           exps_b=None if host or exps_b[0] is None else tuple(small(b) for b in exps_b))
            self.layers.append(lay)
        # weights as the eager path multiplies them (dequantized once, kept): made at the first forward
        self._cached = cached
        self.out_norm = sched.small(dec.output_norm, dev)
        self.cos, self.sin = context_rope_tables(kv.n_ctx, D, cfg.rope_base, cfg.rope_neox, dev.torch_device,
                                                 yarn_key(cfg.rope_yarn))
        self.scale = getattr(dec, "scale", D ** -0.5)      # gpt-oss's has YaRN's magnitude factor in it
        self.pos = torch.zeros(1, dtype=torch.long, device=dev.torch_device)
        self.graphs = {}                 # (ubatch, all_logits) -> (graph, input rows, logits)
        self.worked = False

    # -- one ubatch, as kernels ----------------------------------------------------------------------------
    def _forward(self, x, all_logits: bool):
        """x [T, H] float32 on the GPU (the embeddings) -> logits [T or 1, n_vocab] float32."""
        cfg, cdt, w = self.cfg, self.cdt, self._cached
        eps, k = cfg.rms_eps, cfg.n_expert_used

        def mm(h, t, b=None):            # h @ W^T in W's dtype (F32 weights stay float32), back in h's dtype;
            wt = w(t)                    # with a bias: + b in float32, as the scheduler's linear
            y = (h.to(wt.dtype) @ wt.t()).to(h.dtype)
            return y if b is None else y.float() + b
        addend = None                    # the previous layer's FFN output, added by the next norm
        for i, lay in enumerate(self.layers):
            xs, h = gd.add_rms_norm(x, lay["attn_norm"], eps, b=addend,
                                    x_out=torch.empty_like(x) if addend is not None else None, h_dtype=cdt)
            x = xs if addend is not None else x
            qkv = mm(h, lay["wqkv"], lay["qkv_b"])
            o = self._attention(i, lay, qkv)
            x, h = gd.add_rms_norm(x, lay["ffn_norm"], eps, b=mm(o, lay["wo"], lay["o_b"]), x_out=torch.empty_like(x))
            if "dense" in lay:
                g, u, d = lay["dense"]
                hc = h.to(cdt)
                addend = mm(F.silu(mm(hc, g)) * mm(hc, u), d).float()
                continue
            logits = mm(h.to(w(lay["router"]).dtype), lay["router"], lay["router_b"])
            # softmax_topk (gpt-oss): softmax over the top k logits, the renormalised softmax over all of them
            wts, ids = gd.router_topk(logits, k, cfg.norm_topk_prob or cfg.expert_gating == "softmax_topk")
            self._routed(i, ids)
            if cfg.expert_weights_scale != 1.0:
                wts = wts * cfg.expert_weights_scale
            addend = self._host_moe(i, h, ids, wts) if lay["host"] else self._experts(h, ids, wts, lay["exps"],
                                                                                     lay["exps_b"])
        if not all_logits:
            x, addend = x[-1:], addend[-1:]
        _, h = gd.add_rms_norm(x, self.out_norm, eps, b=addend, h_dtype=cdt)
        head = w(self.model.decoder.output)
        return (h.to(head.dtype) @ head.t()).float()

    def _attention(self, i: int, lay: dict, qkv):
        """Layer i's attention of the rows' fused qkv [T, (nh + 2 nkv) D]: q/k norms, RoPE, the cache write and
        causal attention at positions pos.. -> [T, nh * D] in the compute dtype (runtime/steps/gpu_batch.py
        replaces it with one sequence per row)."""
        cfg, cdt, kc, vc = self.cfg, self.cdt, self.kv.k[i], self.kv.v[i]
        q = gd.qk_rope_cache(qkv, lay["q_norm"], lay["k_norm"], self.cos, self.sin, self.pos, kc, vc, cfg.n_head,
                             cfg.n_head_kv, cfg.head_dim, cfg.rms_eps, cfg.rope_neox,
                             q_dtype=kc.dtype if cdt != torch.float32 else cdt)
        return gd.attention_prefill(q, kc, vc, self.pos, self.scale, out_dtype=cdt, sinks=lay["sinks"],
                                    window=lay["window"])

    def _experts(self, h, ids, wts, exps, biases=None):
        """The routed experts of rows h [T, H] -> float32 [T, H] (runtime/experts.moe: the grouped GEMMs for a
        ubatch; the batch step picks its kernels by bucket). biases: gpt-oss's (gate, up, down) on this GPU,
        with its clamped SwiGLU (runtime/experts.moe_biased)."""
        g, u, d = exps
        if biases is not None:
            cfg = self.cfg
            return X.moe_biased(h, ids, wts, [t.raw for t in exps], exps, biases, cfg.swiglu_alpha, cfg.swiglu_limit)
        return X.moe(h, ids, wts, g.raw, u.raw, d.raw, g, u, d, self.sched.n_threads)

    def _routed(self, i: int, ids):
        """Sees layer i's router choice [T, k] (the batch step keeps it, to count the experts a batch reads)."""

    # -- running ---------------------------------------------------------------------------------------
    def _capture(self, key):
        x_in = torch.empty(key[0], self.cfg.n_embd, device=self.dev.torch_device)
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(self.dev.torch_device)
        side.wait_stream(torch.cuda.current_stream(self.dev.torch_device))
        try:
            with capturing(g, self.dev.torch_device, side):
                logits = self._forward(x_in, key[1])
        except RuntimeError as e:                          # a driver or op that can't be captured
            torch.cuda.synchronize(self.dev.torch_device)
            self.capture, self.graphs = False, {}
            warn_fallback("CUDA graph capture of the prompt", e, "prompt processing without graphs")
            return
        self.graphs[key] = (g, x_in, logits)

    def forward(self, tokens: torch.Tensor, pos0: int, all_logits: bool) -> torch.Tensor:
        """One ubatch of tokens at positions pos0..: logits [T or 1, n_vocab] on the CPU."""
        T = tokens.shape[0]
        self.kv.check_fits(pos0, T)
        self.kv.check_rings(T)
        st, dev = self.sched.stats, self.dev
        x = self.sched.embed(self.model.decoder.token_embd, tokens, dev)     # counts the forward and its copy
        self.pos.fill_(pos0)
        real = not dev.fake
        sync = (lambda: torch.cuda.synchronize(dev.torch_device)) if real and st.profile else None
        key = (T, all_logits)                                # (ubatch, False) and (ubatch, True) at most
        entry = self.graphs.get(key) if self.capture else None
        with st.op("prefill graph" if entry else "prefill step", dev, sync):
            if entry is None:
                logits = self._forward(x, all_logits)
                if self.capture and T == self.kv.ubatch:     # full ubatches recur: capture now, for the next one
                    self._capture(key)
            else:
                g, x_in, logits = entry
                x_in.copy_(x)
                g.replay()
            out = logits.to("cpu")
        st.copy(dev.name, "CPU", out.numel() * 4)
        return out
