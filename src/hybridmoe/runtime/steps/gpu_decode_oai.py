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
  for host experts.

Host experts take StaticDecoder's polled hand-off where Triton runs (the router's top-k kernel publishes the
row, the next segment's first kernel waits for the CPU's; softmax over the top k logits is the renormalised
softmax over all of them) and its decode share (the staged experts' biases gathered beside them); else the
synchronous one. Attention takes gpu_attention's kernels where Triton runs (sinks, window rings, RoPE and the
cache write fused in: two launches), else the torch ops above (HYBRIDMOE_OAI_ATTN=torch: those on a GPU too, to
compare). The fused Triton layer has none of gpt-oss's block, so this step is `fused = False`: a graph of torch
ops and these kernels, replayed instead of the eager decoder's Python.
"""
from __future__ import annotations

import torch

from ... import env
from ...kernels import gpu_decode as gd
from .. import experts as X
from ..ops import apply_rope, rms_norm, rope_tables
from .base import NotApplicable
from .gpu_decode import StaticDecoder


class GptOssStaticDecoder(StaticDecoder):
    fused = False
    torch_polled = True

    def __init__(self, model, kv, capture: bool = True):
        super().__init__(model, kv, capture)
        cfg, td = self.cfg, self.dev.torch_device
        cos, sin = rope_tables(torch.arange(kv.n_ctx, device=td), cfg.head_dim, cfg.rope_base, cfg.rope_neox,
                               cfg.rope_yarn)
        self.cos, self.sin = cos[:, 0], sin[:, 0]
        self.scale = model.decoder.scale
        D = cfg.head_dim                        # gpu_attention's kernels: sinks, window rings, RoPE fused in
        self.tri_attn = self.triton and D >= 16 and D & (D - 1) == 0 and env.get("HYBRIDMOE_OAI_ATTN") != "torch"

    def _extend_layer(self, L, lay: dict):
        sched, dev = self.sched, self.ldev[L.i]
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

    def _handoff(self, n_devices: int):
        hk = super()._handoff(n_devices)
        if hk is not None and hk.share:      # the biases of the GPU's share: all of them here, the share's staged
            td, H = self.dev.torch_device, self.cfg.n_embd
            F = self.layers[self.segments[min(hk.slot)].layer]["exps_b"][0].shape[1]
            for s in hk.slot:
                lay = self.layers[self.segments[s].layer]
                lay["share_b"] = tuple(b.to(td) for b in lay["exps_b"])
            hk.stage_b = tuple(torch.zeros(hk.share, n, device=td) for n in (F, F, H))
        return hk

    def _share_oai(self, lay, ids, j0: int):
        sel = ids[0, j0:].long()
        for src, dst in zip(lay["share_b"], self.hk.stage_b):
            torch.index_select(src, 0, sel, out=dst)
        return (*self.hk.stage_b, self.cfg.swiglu_alpha, self.cfg.swiglu_limit)

    def _segment(self, s: int):
        """Segment s as torch ops (StaticDecoder._segment's torch path), with the polled hand-off's two ends
        where it runs: the first op waits for the CPU experts' row (and adds the GPU's share), the router of a
        CPU-expert layer publishes its row."""
        self._step_tabs = {}                   # what the segment's layers share, made by the first that needs it
        seg, hk, cfg = self.segments[s], self.hk, self.cfg
        x, h = self.x_in, None
        if seg.a and hk is not None:           # after a CPU-expert layer: x = resid + its experts (+ the share)
            j = hk.slot[s - 1]
            w = self.layers[seg.a // 2]["attn_norm"] if seg.a < seg.b else self.out_norm
            x, h = gd.add_rms_norm(self.resid, w, cfg.rms_eps, b=hk.out[j:j + 1], x_out=torch.empty_like(self.resid),
                                   wait=(hk.done[j], hk.step, hk.err), c=hk.gout if hk.share else None)
        elif seg.a:
            x = self.resid + self.moe_in
        pub = (hk.packed[hk.slot[s]], hk.ready[hk.slot[s]], hk.step) if hk is not None and s in hk.slot else None
        for u in range(seg.a, seg.b):
            lay = self.layers[u // 2]
            if u % 2 == 0:
                x = x + self._attention(u // 2, lay, x, h)
                h = None
                continue
            x, packed = self._ffn(lay, x, pub)
            if packed is not None:
                if pub is None:
                    self.packed.copy_(packed)
                self.resid.copy_(x)
                return
        h = rms_norm(x, self.out_norm, cfg.rms_eps) if h is None else h
        self.logits.copy_((h.to(self.cdt) @ self.w_out.t()).float())

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

    def _attention(self, i, lay, x, h=None):
        cfg = self.cfg
        D, nh, nkv = cfg.head_dim, cfg.n_head, cfg.n_head_kv
        h = rms_norm(x, lay["attn_norm"], cfg.rms_eps) if h is None else h
        qkv = (h.to(self.cdt) @ lay["wqkv"].t()).float() + lay["qkv_b"]
        kc, vc = self.kv.k[i], self.kv.v[i]                                  # [nkv, slots, D]
        if self.tri_attn:                     # two launches: the split attention (RoPE, cache write) and the merge
            o = gd.attention(None, kc, vc, self.pos, self.scale, out_dtype=self.cdt, sinks=lay["sinks"],
                             window=lay["window"], rope=(qkv, None, None, self.cos, self.sin, nh, 0.0, cfg.rope_neox))
            return (o @ lay["wo"].t()).float() + lay["o_b"]
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

    def _ffn(self, lay, x, pub=None):
        """(x after the FFN, None), or (x, the packed [h | weights | ids] row) for host experts, which pub (the
        polled hand-off's host row, flag and step) has published already."""
        cfg = self.cfg
        H, k = cfg.n_embd, cfg.n_expert_used
        h = rms_norm(x, lay["ffn_norm"], cfg.rms_eps)
        logits = (h.to(lay["router"].dtype) @ lay["router"].t()).float() + lay["router_b"]
        if lay["cpu_experts"] and pub is not None:
            self.packed[:, :H].copy_(h)
            wts, ids = gd.router_topk(logits, k, True, packed=self.packed, pack_offset=H, publish=pub)
            if self.hk.share:
                self._gpu_share(lay, h, wts, ids)
            return x, self.packed
        top, ids = torch.topk(logits, k, dim=-1)
        wts = torch.softmax(top, dim=-1)                                  # over the k chosen logits only
        if lay["cpu_experts"]:
            return x, torch.cat((h, wts, ids.float()), dim=1)
        exps = lay["exps"]
        y = X.moe_biased(h, ids, wts, [w.raw for w in exps], exps, lay["exps_b"], cfg.swiglu_alpha,
                         cfg.swiglu_limit)
        return x + y, None

    def _host_oai(self, b: int):
        return (*self.layers[b]["exps_b"], self.cfg.swiglu_alpha, self.cfg.swiglu_limit)
