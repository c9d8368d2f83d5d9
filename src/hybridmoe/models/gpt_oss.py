"""gpt-oss (llama.cpp's "gpt-oss" / openai-moe): its block differs enough from decoder.py's to get a file.

- attention: q/k/v/output with biases, NeoX RoPE with YaRN, GQA with one learned sink logit per head in the
  softmax denominator, a sliding window on the even layers (transformers' "sliding_attention") and full
  causal attention on the odd ones;
- FFN: post_attention_norm (the pre-FFN norm, llama.cpp's name for transformers' post_attention_layernorm),
  a biased router whose top-k logits are softmaxed, and biased experts with the clamped SwiGLU
  (gate <= limit, -limit <= up <= limit, gate * sigmoid(alpha * gate) * (up + 1)).

The residual stream, embeddings and output head are decoder.py's (Decoder.forward). Every weighted op goes
through the scheduler; the experts take Scheduler.moe_biased (dequantized experts and torch matmuls), since
the fused kernels and the static decode step assume silu(gate) * up without biases.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..quant.types import GGMLType
from ..runtime.kvcache import KVCache
from ..runtime.ops import apply_rope, yarn_rope_mscale
from ..runtime.scheduler import Scheduler
from ..runtime.weights import QTensor
from .decoder import Decoder, fuse_rows


class GptOssLayer:
    def __init__(self, cfg: ModelConfig, i: int, w: dict[str, QTensor]):
        p = f"blk.{i}."
        self.i = i
        self.mla = False
        self.attn_norm = w[p + "attn_norm.weight"]
        self.attn_q, self.attn_k, self.attn_v = (w[p + "attn_q.weight"], w[p + "attn_k.weight"],
                                                 w[p + "attn_v.weight"])
        self.attn_q_b, self.attn_k_b, self.attn_v_b = (w[p + "attn_q.bias"], w[p + "attn_k.bias"],
                                                       w[p + "attn_v.bias"])
        self.attn_output, self.attn_output_b = w[p + "attn_output.weight"], w[p + "attn_output.bias"]
        self.attn_sinks = w[p + "attn_sinks.weight"]
        self.attn_qkv, self.attn_qkv_b = None, None
        biases = (self.attn_q_b, self.attn_k_b, self.attn_v_b)
        if all(b.qtype == GGMLType.F32 and b.device.name == self.attn_q.device.name for b in biases):
            self.attn_qkv = fuse_rows(p + "attn_qkv", (self.attn_q, self.attn_k, self.attn_v))
            if self.attn_qkv is not None:
                raw = torch.cat([b.raw for b in biases])
                self.attn_qkv_b = QTensor(p + "attn_qkv.bias", raw, GGMLType.F32, (raw.numel() // 4,),
                                          self.attn_q_b.device)
        self.attn_q_norm = self.attn_k_norm = None
        self.ffn_norm = w[p + "post_attention_norm.weight"]
        self.ffn_gate_inp, self.ffn_gate_inp_b = w[p + "ffn_gate_inp.weight"], w[p + "ffn_gate_inp.bias"]
        self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps = (
            w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"], w[p + "ffn_down_exps.weight"])
        self.ffn_gate_exps_b, self.ffn_up_exps_b, self.ffn_down_exps_b = (
            w[p + "ffn_gate_exps.bias"], w[p + "ffn_up_exps.bias"], w[p + "ffn_down_exps.bias"])
        self.window = cfg.window(i)


class GptOssDecoder(Decoder):
    layer_class = GptOssLayer

    def __init__(self, cfg: ModelConfig, weights: dict[str, QTensor], sched: Scheduler):
        super().__init__(cfg, weights, sched)
        m = yarn_rope_mscale(cfg.rope_yarn)
        self.scale = cfg.head_dim ** -0.5 * m * m        # YaRN's cos/sin factor, on both q and k

    def attention(self, L: GptOssLayer, x, positions, kv: KVCache, rope: dict):
        cfg, s = self.cfg, self.sched
        q, k, v, dev = self.qkv(L, x, kv)
        cos, sin = self.rope_for(rope, dev, positions, yarn=cfg.rope_yarn)
        q, k = apply_rope(q, cos, sin, cfg.rope_neox), apply_rope(k, cos, sin, cfg.rope_neox)
        pos0 = int(positions[0])
        keys, values, start = kv.update_window(L.i, pos0, k, v)           # positions start..P+T-1
        sinks = s.small(L.attn_sinks, dev)
        with s.stats.op("attention", dev):
            o = s.tag(attend_sinks(q, keys, values, pos0, sinks, self.scale, L.window, start), dev)
        return s.linear(o, L.attn_output, L.attn_output_b)

    def ffn(self, L: GptOssLayer, x):
        cfg, s = self.cfg, self.sched
        h = s.norm(x, L.ffn_norm, cfg.rms_eps)
        logits = s.linear(h, L.ffn_gate_inp, L.ffn_gate_inp_b).float()    # [T, E]
        top, ids = torch.topk(logits, cfg.n_expert_used, dim=-1)
        wts = torch.softmax(top, dim=-1)                                   # over the k chosen logits only
        return s.moe_biased(h, ids, wts, (L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps),
                            (L.ffn_gate_exps_b, L.ffn_up_exps_b, L.ffn_down_exps_b),
                            cfg.swiglu_alpha, cfg.swiglu_limit, layer=L.i)


def attend_sinks(q, keys, values, pos0: int, sinks: torch.Tensor, scale: float, window: int = 0,
                 start: int = 0) -> torch.Tensor:
    """q [T, n_head, D]; keys/values [n_kv, P - start, D] for positions start..P-1 (P = pos0 + T); sinks
    [n_head]. Causal GQA attention whose softmax has one more logit per head (its sink, which takes
    probability mass and returns no value); window > 0 lets query position p see keys p-window+1..p only.
    float32 on q's device; [T, n_head*D]."""
    T, nh, D = q.shape
    nkv, P = keys.shape[0], start + keys.shape[1]
    g = nh // nkv
    keys, values = keys.float(), values.float()
    dev = q.device
    qg = q.float().view(T, nkv, g, D).permute(1, 2, 0, 3).reshape(nkv, g * T, D)          # [n_kv, g*T, D]
    scores = torch.bmm(qg, keys.transpose(1, 2)).mul_(scale)                               # [n_kv, g*T, P']
    qpos = torch.arange(pos0, pos0 + T, device=dev)[:, None]
    kpos = torch.arange(start, P, device=dev)[None, :]
    hidden = kpos > qpos
    if window:
        hidden |= kpos <= qpos - window
    scores.view(nkv, g, T, -1).masked_fill_(hidden, float("-inf"))
    sink = sinks.float().to(dev).view(nkv, g, 1, 1).expand(nkv, g, T, 1).reshape(nkv, g * T, 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    o = torch.bmm(probs, values)                                                           # [n_kv, g*T, D]
    return o.view(nkv, g, T, D).permute(2, 0, 1, 3).reshape(T, nh * D)
