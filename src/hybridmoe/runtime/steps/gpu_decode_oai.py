"""gpt-oss's decode step with static shapes: every layer on one GPU (its experts there or in host RAM), each run of
layers up to a CPU-expert layer one CUDA graph, as StaticDecoder's torch version of a layer with gpt-oss's block
(models/gpt_oss.py):

- attention: q/k/v and output biases, NeoX RoPE from YaRN's tables (its magnitude factor in the softmax scale, as
  the eager decoder has it), one sink logit per head in the softmax denominator, and on the sliding-window layers
  a ring cache (slot p % slots holds position p, kvcache.update_window's layout): each slot's position is found
  on the GPU from the step's position, so one graph serves every step. Scores, softmax and values in float32
  over the cache's slots under a mask, as attend_sinks computes them;
- FFN: a biased router whose top-k logits are softmaxed, and biased experts with the clamped SwiGLU, through
  experts.moe_biased (gpu_decode's kernels from the bytes with the biases on a GPU) or the C kernel's oai option
  for host experts (the synchronous hand-off).

The fused Triton layer (attention kernels, polled hand-off, decode share) has none of these, so this step is
`fused = False`: about twenty launches a layer, replayed from a graph instead of the eager decoder's Python.
"""
from __future__ import annotations

import torch

from ...kernels import gpu_decode as gd
from .. import experts as X
from ..ops import apply_rope, rms_norm, rope_tables
from .base import NotApplicable
from .gpu_decode import StaticDecoder


class GptOssStaticDecoder(StaticDecoder):
    fused = False

    def __init__(self, model, kv, capture: bool = True):
        super().__init__(model, kv, capture)
        dec, cfg, sched = model.decoder, self.cfg, self.sched
        td = self.dev.torch_device
        for L, lay in zip(dec.layers, self.layers):
            dev = self.ldev[L.i]
            exps = lay["exps"]
            host = lay["cpu_experts"]
            if host and X.kernels() is None:
                raise NotApplicable("host experts of gpt-oss need the C kernels in a static step")
            if not host and exps[0].device.kind == "cuda" and not exps[0].device.fake and not (
                    gd.supports(*(w.qtype for w in exps)) and not any(w.split for w in exps)):
                raise NotApplicable(f"layer {L.i}: experts of {exps[0].qtype.name} / {exps[2].qtype.name} have no "
                                    "fused GPU kernel with gpt-oss's biases")
            bdev = exps[0].device
            lay.update(qkv_b=torch.cat([sched.small(b, dev) for b in (L.attn_q_b, L.attn_k_b, L.attn_v_b)]),
                       o_b=sched.small(L.attn_output_b, dev), sinks=sched.small(L.attn_sinks, dev),
                       router_b=sched.small(L.ffn_gate_inp_b, self.fdev[L.i]), window=L.window,
                       exps_b=tuple(sched.small(b, bdev) for b in (L.ffn_gate_exps_b, L.ffn_up_exps_b,
                                                                   L.ffn_down_exps_b)))
        cos, sin = rope_tables(torch.arange(kv.n_ctx, device=td), cfg.head_dim, cfg.rope_base, cfg.rope_neox,
                               cfg.rope_yarn)
        self.cos, self.sin = cos[:, 0], sin[:, 0]
        self.scale = dec.scale

    def _segment(self, s: int):
        self._step_tabs = {}                   # what the segment's layers share, made by the first that needs it
        return super()._segment(s)

    def _tabs(self, n: int, window: int):
        """(cos, sin [1, D] of the step's position, the slot to write and the slots hidden from its query) of a
        cache layer of n slots and this window (0: none), made once a segment."""
        key = (n, window)
        if key not in self._step_tabs:
            if "rope" not in self._step_tabs:
                self._step_tabs["rope"] = (self.cos.index_select(0, self.pos), self.sin.index_select(0, self.pos))
            held = self.pos - (self.pos - torch.arange(n, device=self.pos.device)) % n     # each slot's position
            hidden = (held < 0) | (held <= self.pos - window) if window else held < 0
            self._step_tabs[key] = (*self._step_tabs["rope"], self.pos % n, hidden)
        return self._step_tabs[key]

    def _attention(self, i, lay, x):
        cfg = self.cfg
        D, nh, nkv = cfg.head_dim, cfg.n_head, cfg.n_head_kv
        h = rms_norm(x, lay["attn_norm"], cfg.rms_eps)
        qkv = (h.to(self.cdt) @ lay["wqkv"].t()).float() + lay["qkv_b"]
        kc, vc = self.kv.k[i], self.kv.v[i]                                  # [nkv, slots, D]
        cos, sin, slot, hidden = self._tabs(kc.shape[1], lay["window"])
        qk = apply_rope(qkv[:, :(nh + nkv) * D].view(nh + nkv, D), cos, sin, cfg.rope_neox)   # q and k at once
        kc.index_copy_(1, slot, qk[nh:, None, :].to(kc.dtype))
        vc.index_copy_(1, slot, qkv[:, (nh + nkv) * D:].view(nkv, 1, D).to(vc.dtype))
        qg = qk[:nh].view(nkv, nh // nkv, D)
        scores = torch.matmul(qg, kc.float().transpose(1, 2)).mul_(self.scale).masked_fill_(hidden, float("-inf"))
        sink = lay["sinks"].view(nkv, nh // nkv, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        o = torch.matmul(probs, vc.float()).reshape(1, nh * D)
        return (o.to(self.cdt) @ lay["wo"].t()).float() + lay["o_b"]

    def _ffn(self, lay, x):
        cfg = self.cfg
        h = rms_norm(x, lay["ffn_norm"], cfg.rms_eps)
        logits = (h.to(lay["router"].dtype) @ lay["router"].t()).float() + lay["router_b"]
        top, ids = torch.topk(logits, cfg.n_expert_used, dim=-1)
        wts = torch.softmax(top, dim=-1)                                  # over the k chosen logits only
        if lay["cpu_experts"]:
            return x, torch.cat((h, wts, ids.float()), dim=1)
        exps = lay["exps"]
        y = X.moe_biased(h, ids, wts, [w.raw for w in exps], exps, lay["exps_b"], cfg.swiglu_alpha,
                         cfg.swiglu_limit)
        return x + y, None

    def _host_oai(self, b: int):
        return (*self.layers[b]["exps_b"], self.cfg.swiglu_alpha, self.cfg.swiglu_limit)
