"""The decoder shared by llama, qwen3, qwen3moe and deepseek2 (gpt-oss's block: gpt_oss.py): RMSNorm, RoPE,
GQA attention, SwiGLU FFN or MoE.

Module attributes carry GGUF tensor names (`blk.{i}.attn_q`), so a GGUF loads with no renaming table.
Every op that has weights goes through the scheduler, which decides where it runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from .. import env
from ..config import ModelConfig
from ..runtime.kvcache import KVCache
from ..runtime.ops import (
    apply_rope,
    context_rope_tables,
    cpu_has,
    gpu_batch_kernels,
    gpu_kernels,
    rms_norm,
    rope_tables,
    yarn_key,
    yarn_softmax_mscale,
)
from ..runtime.scheduler import Scheduler
from ..runtime.weights import QTensor


def fuse_rows(name: str, ws) -> QTensor | None:
    """One weight whose rows are those of `ws` (same device and type), so one matmul does the work of
    several; the parts become views of it, so nothing is held twice. None where the parts differ."""
    first = ws[0]
    if any(w.device.name != first.device.name or w.qtype != first.qtype or w.shape[1:] != first.shape[1:]
           or w.split != first.split for w in ws):
        return None
    fused = torch.cat([w.raw for w in ws])
    start = 0
    for w in ws:
        w.raw = fused[start:start + w.raw.shape[0]]
        start += w.raw.shape[0]
    return QTensor(name, fused, first.qtype, (fused.shape[0], *first.shape[1:]), first.device, first.split)


class Layer:
    def __init__(self, cfg: ModelConfig, i: int, w: dict[str, QTensor]):
        p = f"blk.{i}."
        self.i = i
        self.attn_norm = w[p + "attn_norm.weight"]
        self.attn_output = w[p + "attn_output.weight"]
        self.mla = p + "attn_kv_a_mqa.weight" in w
        if self.mla:                                                       # deepseek2
            self.attn_q = w.get(p + "attn_q.weight")
            self.attn_q_a, self.attn_q_a_norm = w.get(p + "attn_q_a.weight"), w.get(p + "attn_q_a_norm.weight")
            self.attn_q_b = w.get(p + "attn_q_b.weight")
            self.attn_kv_a_mqa, self.attn_kv_a_norm = w[p + "attn_kv_a_mqa.weight"], w[p + "attn_kv_a_norm.weight"]
            self.attn_kv_b = w[p + "attn_kv_b.weight"]
            self.attn_qkv = None
        else:
            self.attn_q, self.attn_k, self.attn_v = (w[p + "attn_q.weight"], w[p + "attn_k.weight"],
                                                     w[p + "attn_v.weight"])
            self.attn_qkv = fuse_rows(p + "attn_qkv", (self.attn_q, self.attn_k, self.attn_v))
        self.attn_q_norm = w.get(p + "attn_q_norm.weight")
        self.attn_k_norm = w.get(p + "attn_k_norm.weight")
        self.ffn_norm = w[p + "ffn_norm.weight"]
        self.ffn_gate_inp = w.get(p + "ffn_gate_inp.weight")
        if self.ffn_gate_inp is not None:
            self.ffn_gate_exps = w[p + "ffn_gate_exps.weight"]
            self.ffn_up_exps = w[p + "ffn_up_exps.weight"]
            self.ffn_down_exps = w[p + "ffn_down_exps.weight"]
            self.exp_probs_b = w.get(p + "exp_probs_b.bias")
            self.ffn_gate_shexp = w.get(p + "ffn_gate_shexp.weight")
            if self.ffn_gate_shexp is not None:
                self.ffn_up_shexp, self.ffn_down_shexp = w[p + "ffn_up_shexp.weight"], w[p + "ffn_down_shexp.weight"]
        else:
            self.ffn_gate, self.ffn_up, self.ffn_down = (w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"],
                                                         w[p + "ffn_down.weight"])


class Decoder:
    layer_class = Layer

    def __init__(self, cfg: ModelConfig, weights: dict[str, QTensor], sched: Scheduler):
        self.cfg, self.w, self.sched = cfg, weights, sched
        self.token_embd = weights["token_embd.weight"]
        self.layers = [self.layer_class(cfg, i, weights) for i in range(cfg.n_layer)]
        self.output_norm = weights["output_norm.weight"]
        # Tied embeddings: models without output.weight reuse token_embd (as llama.cpp does).
        self.output = weights.get("output.weight", self.token_embd)
        self._mla = {}                                                        # (layer, device) -> (W_UK, W_UV)
        sched.set_expert_layers(self.expert_layers(), cfg.n_expert_used)

    def expert_layers(self) -> dict:
        """layer -> (gate, up, down) expert tensors, for the uploader to send a layer ahead."""
        return {L.i: (L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps) for L in self.layers
                if L.ffn_gate_inp is not None}

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings on the first layer's device, there before begin_forward queues the first
        experts' upload: a copy queued behind that upload would wait for it, and the host with it, while the first
        attention could have run."""
        return self.sched.embed(self.token_embd, tokens, self.layers[0].attn_norm.device if self.layers else None)

    def forward(self, tokens: torch.Tensor, pos0: int, kv: KVCache, all_logits: bool = True,
                watch=None) -> torch.Tensor:
        """tokens [T] -> logits [T, n_vocab] float32 (or [1, n_vocab] for the last position only).
        watch(where, x): sees the hidden state after the embeddings (where = -1) and after each layer (its
        index); Model's diagnostic pass for non-finite logits raises there."""
        cfg, s = self.cfg, self.sched
        x = self._embed(tokens)                                               # [T, H]
        if watch is not None:
            watch(-1, x)
        T = tokens.shape[0]
        s.begin_forward(T)
        positions = torch.arange(pos0, pos0 + T)
        rope = {}                                                             # device -> (cos, sin), once per forward
        for layer in self.layers:
            x = s.add(x, self.attention(layer, x, positions, kv, rope))
            x = s.add(x, self.ffn(layer, x))
            if watch is not None:
                watch(layer.i, x)
        if not all_logits:
            x = x[-1:]
        x = s.norm(x, self.output_norm, cfg.rms_eps)
        return s.linear(x, self.output).float()

    def forward_batch(self, items, all_logits: bool = False) -> torch.Tensor:
        """items [(tokens [T_i], pos0_i, kv_i)] -> logits of every item's tokens, item after item ([sum T_i,
        n_vocab]), or of each item's last token ([B, n_vocab]), float32, where the output layer ran. The layer
        loop runs over the items' tokens laid end to end: the norms, projections and experts see one batch (the
        scheduler decides offloads from its size and routing); attention runs per item on its own cache at its
        own positions."""
        cfg, s = self.cfg, self.sched
        sizes = [int(t.shape[0]) for t, _, _ in items]
        x = self._embed(torch.cat([t for t, _, _ in items]))                # [sum T, H]
        s.begin_forward(sum(sizes))
        positions = [torch.arange(p, p + T) for (_, p, _), T in zip(items, sizes)]
        starts = [0, *torch.tensor(sizes).cumsum(0).tolist()]                # item j: rows starts[j]..starts[j+1]
        kvs = [kv for _, _, kv in items]
        ropes = [{} for _ in items]                                         # per item: device -> (cos, sin)
        rope = {}                                                           # the same for all tokens together
        for layer in self.layers:
            x = s.add(x, self.attention_batch(layer, x, starts, positions, kvs, ropes, rope))
            x = s.add(x, self.ffn(layer, x))
        if not all_logits:
            x = s.tag(x[torch.tensor(starts[1:], device=x.device) - 1], s.dev_of(x))   # each item's last token
        x = s.norm(x, self.output_norm, cfg.rms_eps)
        return s.linear(x, self.output).float()

    def attention_batch(self, L: Layer, x, starts, positions, kvs, ropes, rope):
        """attention() of the items whose rows x holds in turn: q/k/v, their norms and RoPE (each token at its
        own position) and the output projection once for all rows, the cache write and attention per item.
        Items run one by one through attention() where it has its own path (MLA, a GPU prompt's fused kernel,
        another architecture's attention)."""
        cfg, s = self.cfg, self.sched
        dev = kvs[0].device(L.i)
        gpu_prompt = dev.torch_device.type == "cuda" and L.attn_qkv is not None and gpu_kernels() is not None \
            and any(len(p) > 1 and kv.plain(L.i) for p, kv in zip(positions, kvs))      # attention_gpu's case
        per_item = (len(kvs) == 1 or L.mla or type(self).attention is not Decoder.attention or gpu_prompt
                    or any(kv.device(L.i).name != dev.name for kv in kvs))
        if not per_item and all(len(p) == 1 for p in positions):
            ga = gpu_batch_kernels(dev)
            if ga is not None and all(kv.slots[L.i] == kv.n_ctx for kv in kvs) and \
                    ga.batch_caches_ok([kv.k[L.i] for kv in kvs], [kv.v[L.i] for kv in kvs]):
                return self.attention_decode_batch(L, x, positions, kvs, rope, ga)
        xd = s.dev_of(x)
        if per_item:
            outs = [self.attention(L, s.tag(x[a:b], xd), pos, kv, r)
                    for a, b, pos, kv, r in zip(starts, starts[1:], positions, kvs, ropes)]
            odev = s.dev_of(outs[0])
            return s.tag(torch.cat([s.move(o, odev) for o in outs]), odev)
        q, k, v, dev = self.qkv(L, x, kvs[0])
        if L.attn_q_norm is not None:
            q = rms_norm(q, s.small(L.attn_q_norm, dev), cfg.rms_eps)
            k = rms_norm(k, s.small(L.attn_k_norm, dev), cfg.rms_eps)
        cos, sin = self.rope_for(rope, dev, torch.cat(positions), yarn=cfg.rope_yarn)
        q, k = apply_rope(q, cos, sin, cfg.rope_neox), apply_rope(k, cos, sin, cfg.rope_neox)
        outs = []
        with s.stats.op("attention", dev):
            for a, b, pos, kv in zip(starts, starts[1:], positions, kvs):
                keys, values = kv.update(L.i, int(pos[0]), k[a:b], v[a:b])  # [n_kv, P+T, D]
                if keys.is_cuda and keys.dtype in (torch.float16, torch.bfloat16):
                    # SDPA on the cache's own dtype: attend() would copy every key and value to bf16 first
                    outs.append(attend_gpu(q[a:b].transpose(0, 1).to(keys.dtype), keys, values, int(pos[0])))
                else:
                    outs.append(attend(q[a:b], keys, values, int(pos[0])))
        return s.linear(s.tag(torch.cat(outs), dev), L.attn_output)

    def attention_decode_batch(self, L: Layer, x, positions, kvs, rope: dict, ga):
        """attention_batch() of B single tokens on a GPU: the qkv projection for all rows, then one launch for
        q/k norms, RoPE and every sequence's cache write, and two for the attention of each row over its own
        cache (kernels/gpu_batch_attention.py; was a few launches per sequence)."""
        cfg, s = self.cfg, self.sched
        dev = kvs[0].device(L.i)
        h = s.norm(x, L.attn_norm, cfg.rms_eps)
        bias = lambda w: getattr(L, w + "_b", None)                          # noqa: E731
        if L.attn_qkv is not None:
            rows = s.move(s.linear(h, L.attn_qkv, bias("attn_qkv"), f32=False), dev)
        else:
            rows = torch.cat([s.move(s.linear(h, getattr(L, w), bias(w)), dev)
                              for w in ("attn_q", "attn_k", "attn_v")], -1)
        key = ("batch", dev.name)
        if key not in rope:
            # once per forward and device: positions, rope tables, and every layer's cache offsets (k then v
            # of each sequence) from one anchor, the first of those layers' key caches
            td = dev.torch_device
            pos = torch.tensor([int(p[0]) for p in positions], dtype=torch.int64).to(td, non_blocking=True)
            cos, sin = context_rope_tables(kvs[0].n_ctx, cfg.head_dim, cfg.rope_base, cfg.rope_neox, td,
                                           yarn_key(cfg.rope_yarn))
            here = [i for i in range(cfg.n_layer) if kvs[0].device(i).name == dev.name]
            anchor = kvs[0].k[here[0]]
            table = [ga.cache_offsets(anchor, [kv.k[i] for kv in kvs] + [kv.v[i] for kv in kvs]) for i in here]
            offs = torch.tensor(table, dtype=torch.int64).to(td, non_blocking=True)     # [layers here, 2B]
            rope[key] = (pos, cos, sin, max(int(p[0]) for p in positions) + 1, anchor,
                         {i: offs[r] for r, i in enumerate(here)})
        pos, cos, sin, n_keys, anchor, offs = rope[key]
        offs = offs[L.i]
        vcs = [kv.v[L.i] for kv in kvs]
        B = len(kvs)
        qn, kn = ((s.small(L.attn_q_norm, dev), s.small(L.attn_k_norm, dev)) if L.attn_q_norm is not None
                  else (None, None))
        real = dev.torch_device.type == "cuda"
        with s.stats.op("attention", dev):
            kshape = kvs[0].k[L.i].shape
            q = ga.qk_rope_cache_batch(rows, qn, kn, cos, sin, pos, anchor, offs[:B], offs[B:], kshape,
                                       vcs[0].shape, cfg.n_head, cfg.rms_eps, cfg.rope_neox, q_dtype=anchor.dtype)
            o = ga.attention_batch(q, anchor, offs[:B], offs[B:], pos, kshape, vcs[0].shape,
                                   cfg.head_dim ** -0.5, n_keys, out_dtype=torch.bfloat16 if real else torch.float32)
        return s.linear(s.tag(o, dev), L.attn_output)

    def qkv(self, L, x, kv: KVCache):
        """The attention input of layer L: normed x projected to q [T, n_head, D] and k, v [T, n_kv, D] on
        the layer's KV device (with the projections' biases where the layer has them), and that device."""
        cfg, s = self.cfg, self.sched
        T, D = x.shape[0], cfg.head_dim
        h = s.norm(x, L.attn_norm, cfg.rms_eps)
        dev = kv.device(L.i)
        nq, nkv = cfg.n_head * D, cfg.n_head_kv * D
        bias = lambda w: getattr(L, w + "_b", None)                          # noqa: E731
        if L.attn_qkv is not None:
            q, k, v = s.move(s.linear(h, L.attn_qkv, bias("attn_qkv")), dev).split((nq, nkv, nkv), dim=-1)
        else:
            q, k, v = (s.move(s.linear(h, getattr(L, w), bias(w)), dev) for w in ("attn_q", "attn_k", "attn_v"))
        return q.reshape(T, cfg.n_head, D), k.reshape(T, cfg.n_head_kv, D), v.reshape(T, cfg.n_head_kv, D), dev

    def rope_for(self, rope: dict, dev, positions, dim: int | None = None, yarn: dict | None = None):
        """This forward's cos/sin tables on device `dev` (rope: device name -> tables), made by the first
        layer there."""
        if dev.name not in rope:
            cfg = self.cfg
            rope[dev.name] = rope_tables(positions.to(dev.torch_device), dim or cfg.head_dim, cfg.rope_base,
                                         cfg.rope_neox, yarn)
        return rope[dev.name]

    def attention(self, L: Layer, x, positions, kv: KVCache, rope: dict):
        if L.mla:
            return self.attention_mla(L, x, positions, kv, rope)
        cfg, s = self.cfg, self.sched
        if kv.device(L.i).torch_device.type == "cuda" and L.attn_qkv is not None and kv.plain(L.i) and \
                positions.shape[0] > 1 and gpu_kernels() is not None:
            return self.attention_gpu(L, x, positions, kv, rope, gpu_kernels())
        q, k, v, dev = self.qkv(L, x, kv)
        if L.attn_q_norm is not None:
            q = rms_norm(q, s.small(L.attn_q_norm, dev), cfg.rms_eps)
            k = rms_norm(k, s.small(L.attn_k_norm, dev), cfg.rms_eps)
        cos, sin = self.rope_for(rope, dev, positions, yarn=cfg.rope_yarn)
        q, k = apply_rope(q, cos, sin, cfg.rope_neox), apply_rope(k, cos, sin, cfg.rope_neox)
        keys, values = kv.update(L.i, int(positions[0]), k, v)              # [n_kv, P+T, D]
        with s.stats.op("attention", dev):
            o = s.tag(attend(q, keys, values, int(positions[0])), dev)      # [T, n_head*D]
        return s.linear(o, L.attn_output)

    def attention_gpu(self, L: Layer, x, positions, kv: KVCache, rope: dict, gd):
        """A prompt's attention on a GPU in a few launches: the qkv GEMM (bf16 out); q/k norm + RoPE + the
        cache write (one Triton kernel, q written in the cache's dtype, heads first); SDPA on the cache; its
        output transposed into bf16 rows; the output GEMM (was ~20 torch ops, and prefill on a GPU is bound
        by the host's launches)."""
        cfg, s = self.cfg, self.sched
        D, pos0, T = cfg.head_dim, int(positions[0]), positions.shape[0]
        dev = kv.device(L.i)
        kv.check_fits(pos0, T)
        h = s.norm(x, L.attn_norm, cfg.rms_eps)
        rows = s.move(s.linear(h, L.attn_qkv, getattr(L, "attn_qkv_b", None), f32=False), dev)
        cos, sin = self.rope_for(rope, dev, positions, yarn=cfg.rope_yarn)
        kc, vc = kv.k[L.i], kv.v[L.i]
        qn, kn = ((s.small(L.attn_q_norm, dev), s.small(L.attn_k_norm, dev)) if L.attn_q_norm is not None
                  else (None, None))
        with s.stats.op("attention", dev):
            q = gd.qk_rope_cache(rows, qn, kn, cos[:, 0], sin[:, 0], pos0, kc, vc, cfg.n_head, cfg.n_head_kv, D,
                                 cfg.rms_eps, cfg.rope_neox, q_dtype=kc.dtype, cos_first=pos0)
            o = s.tag(attend_gpu(q, kc[:, :pos0 + T], vc[:, :pos0 + T], pos0, out_dtype=torch.bfloat16), dev)
        return s.linear(o, L.attn_output)

    def attention_mla(self, L: Layer, x, positions, kv: KVCache, rope: dict):
        """DeepSeek's multi-head latent attention with the compressed cache: per token only the normed latent
        c (kv_lora_rank) and the roped shared k_pe (rope_dim) are stored; attn_kv_b is absorbed into the
        query (k_nope = W_UK c) and the output (v = W_UV c), so K and V are never expanded per head."""
        cfg, s = self.cfg, self.sched
        T, nh, Dk, R, Dv, C = x.shape[0], cfg.n_head, cfg.head_dim, cfg.rope_dim, cfg.v_head_dim, cfg.kv_lora_rank
        Dn, eps, pos0 = Dk - R, cfg.rms_eps, int(positions[0])
        h = s.norm(x, L.attn_norm, eps)
        if L.attn_q_a is not None:
            q = s.linear(s.norm(s.linear(h, L.attn_q_a), L.attn_q_a_norm, eps), L.attn_q_b)
        else:
            q = s.linear(h, L.attn_q)
        ckv = s.linear(h, L.attn_kv_a_mqa)                                  # [T, C + R]
        c = s.norm(s.tag(ckv[:, :C], s.dev_of(ckv)), L.attn_kv_a_norm, eps)
        dev = kv.device(L.i)
        q = s.move(q, dev).reshape(T, nh, Dk)
        c, k_pe = s.move(c, dev), s.move(s.tag(ckv[:, C:], s.dev_of(ckv)), dev).reshape(T, 1, R)
        cos, sin = self.rope_for(rope, dev, positions, R, cfg.rope_yarn)
        q_nope, q_pe = q.split((Dn, R), dim=-1)
        q_pe = apply_rope(q_pe, cos, sin, cfg.rope_neox)                    # [T, nh, R]
        entry = torch.cat((c.float(), apply_rope(k_pe, cos, sin, cfg.rope_neox)[:, 0]), dim=-1)[:, None, :]
        lat, _ = kv.update(L.i, pos0, entry, entry[..., :0])               # [1, P, C + R]
        lat = lat[0].float()
        w_uk, w_uv = self._mla_weights(L, dev)                               # [nh, Dn, C], [nh, Dv, C]
        with s.stats.op("attention", dev):
            q_lat = torch.einsum("thd,hdc->htc", q_nope.to(w_uk.dtype), w_uk).float()      # [nh, T, C]
            scores = q_lat @ lat[:, :C].t() + q_pe.transpose(0, 1).float() @ lat[:, C:].t()  # [nh, T, P]
            scores = scores * (Dk ** -0.5 * yarn_softmax_mscale(cfg.rope_yarn))
            P = lat.shape[0]
            if T > 1:
                future = torch.arange(P, device=q.device)[None, :] > torch.arange(pos0, pos0 + T, device=q.device)[:, None]
                scores = scores.masked_fill(future, float("-inf"))
            o_lat = torch.softmax(scores, -1) @ lat[:, :C]                   # [nh, T, C]
            o = torch.einsum("htc,hvc->thv", o_lat.to(w_uv.dtype), w_uv).float().reshape(T, nh * Dv)
        return s.linear(s.tag(o, dev), L.attn_output)

    def _mla_weights(self, L: Layer, dev):
        """attn_kv_b split per head into W_UK [nh, Dn, C] and W_UV [nh, Dv, C], dequantized once per device
        (bf16 on a GPU, float32 on the CPU)."""
        key = (L.i, dev.name)
        w = self._mla.get(key)
        if w is None:
            cfg = self.cfg
            dt = torch.bfloat16 if dev.torch_device.type == "cuda" else torch.float32
            kvb = L.attn_kv_b.dequant(torch.float32).to(dev.torch_device)
            kvb = kvb.view(cfg.n_head, cfg.head_dim - cfg.rope_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            w_uk, w_uv = kvb.split((cfg.head_dim - cfg.rope_dim, cfg.v_head_dim), dim=1)
            w = self._mla[key] = (w_uk.to(dt).contiguous(), w_uv.to(dt).contiguous())
        return w

    def ffn(self, L: Layer, x):
        cfg, s = self.cfg, self.sched
        h = s.norm(x, L.ffn_norm, cfg.rms_eps)
        if L.ffn_gate_inp is None:
            return s.dense_ffn(h, L.ffn_gate, L.ffn_up, L.ffn_down)
        logits = s.linear(h, L.ffn_gate_inp).float()                        # [T, E]
        k = cfg.n_expert_used
        if cfg.expert_gating == "sigmoid":
            # DeepSeek V3: sigmoid scores; the bias and the group limit steer the choice, not the weights
            scores = torch.sigmoid(logits)
            choice = scores if L.exp_probs_b is None else scores + s.small(L.exp_probs_b, s.dev_of(logits))
            if cfg.n_expert_groups > 1:
                g = choice.view(-1, cfg.n_expert_groups, cfg.n_expert // cfg.n_expert_groups)
                top_groups = g.topk(2, dim=-1)[0].sum(-1).topk(cfg.n_group_used, dim=-1)[1]
                keep = torch.zeros_like(g[..., 0], dtype=torch.bool).scatter_(1, top_groups, True)
                choice = g.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
            ids = torch.topk(choice, k, dim=-1)[1]
            wts = scores.gather(1, ids)
            if cfg.norm_topk_prob:
                wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        elif logits.is_cuda and gpu_kernels() is not None:
            wts, ids = gpu_kernels().router_topk(logits.contiguous(), k, cfg.norm_topk_prob)  # one launch, not 4
        else:
            wts, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)  # [T, k]
            if cfg.norm_topk_prob:
                wts = wts / wts.sum(-1, keepdim=True)
        if cfg.expert_weights_scale != 1.0:
            wts = wts * cfg.expert_weights_scale
        y = s.moe(h, ids, wts, L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps, layer=L.i)
        if L.ffn_gate_shexp is not None:
            y = s.add(y, s.dense_ffn(h, L.ffn_gate_shexp, L.ffn_up_shexp, L.ffn_down_shexp))
        return y


def _cpu_attn_dtype() -> torch.dtype:
    """Prompt attention on the CPU: bf16 SDPA where the CPU multiplies bf16 in AMX tiles (3.8-4.6x float32's
    speed at Qwen3-30B-A3B's heads on the H200 VM's Sapphire Rapids, relative error 3.7e-3:
    benchmarks/bench_attention_cpu.py), else float32 (1.0-1.35x on the AVX512-BF16 dev VM: not worth the
    error). HYBRIDMOE_CPU_ATTN=fp32|bf16 forces one."""
    forced = env.get("HYBRIDMOE_CPU_ATTN")
    if forced in ("fp32", "bf16"):
        return torch.bfloat16 if forced == "bf16" else torch.float32
    return torch.bfloat16 if cpu_has("amx_bf16") else torch.float32


_CPU_ATTN_DTYPE = _cpu_attn_dtype()


def attend(q, keys, values, pos0: int, scale: float | None = None) -> torch.Tensor:
    """q [T, n_head, D]; keys/values [n_kv, P, D] (P = pos0 + T). Causal GQA attention, [T, n_head*D].

    GPU: bf16 SDPA on the flash (or memory-efficient) kernels: 4-D inputs, K/V expanded to the query
    heads, causal from the bottom right for a chunk after cached positions (grouped or 3-D inputs, or a
    dense mask, fall to SDPA's math kernel, which materializes fp32 [heads, T, P] scores: 60% of a
    4096-token prefill's GPU time). CPU: float32 with the query heads of a KV head batched together, so
    K and V are read once and never repeated per query head (SDPA's GQA path on the CPU copies them
    n_head/n_kv times).
    """
    T, nh, D = q.shape
    P = keys.shape[1]
    if q.is_cuda:
        return attend_gpu(q.transpose(0, 1).to(torch.bfloat16), keys.to(torch.bfloat16), values.to(torch.bfloat16),
                          pos0, scale)
    nkv = keys.shape[0]
    g = nh // nkv
    if T >= 192 or (T > 1 and P == T):
        # long prompt chunks: SDPA's fused CPU kernel (no [T, P] scores in memory). float32 on K/V expanded to
        # the query heads: the expansion is a copy of P keys, worth it once T is large (measured on the 2-vCPU
        # VM, Qwen3-30B-A3B heads: T=512 P=512 24 vs 46 ms, T=256 P=4096 139 vs 174, T=128 P=4096 93 vs 89).
        # bf16 (_cpu_attn_dtype) with enable_gqa: 1.6-2.7x faster again than expanded bf16 on AMX
        dt = _CPU_ATTN_DTYPE
        mask = None if P == T else causal_lower_right(T, P)
        kf, vf, gqa = keys.to(dt)[None], values.to(dt)[None], True
        if dt == torch.float32:
            kf, vf, gqa = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1), False
        o = F.scaled_dot_product_attention(q.to(dt).transpose(0, 1)[None], kf, vf, attn_mask=mask, is_causal=P == T,
                                           scale=scale, enable_gqa=gqa)[0]
        return o.transpose(0, 1).reshape(T, -1).float()
    qg = q.float().view(T, nkv, g, D).permute(1, 2, 0, 3).reshape(nkv, g * T, D)   # [n_kv, g*T, D]
    scores = torch.bmm(qg, keys.float().transpose(1, 2)).mul_(scale or D ** -0.5)  # [n_kv, g*T, P]
    if T > 1:
        qpos = torch.arange(pos0, pos0 + T)[:, None]
        future = torch.arange(P)[None, :] > qpos                                     # [T, P]
        scores.view(nkv, g, T, P).masked_fill_(future, float("-inf"))
    o = torch.bmm(torch.softmax(scores, -1), values.float())                         # [n_kv, g*T, Dv]
    Dv = values.shape[-1]
    return o.view(nkv, g, T, Dv).permute(2, 0, 1, 3).reshape(T, nh * Dv)


_GPU_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend_gpu(qh, keys, values, pos0: int, scale: float | None = None, out_dtype=torch.float32) -> torch.Tensor:
    """attend() on a GPU: qh [n_head, T, D], keys/values [n_kv, P, D], one 16-bit dtype. [T, n_head*Dv]."""
    nh, T, _ = qh.shape
    P = keys.shape[1]
    if T == 1:                                                              # eager decode: one row
        o = F.scaled_dot_product_attention(qh, keys, values, enable_gqa=keys.shape[0] != nh, scale=scale)
    else:
        if keys.shape[0] != nh:
            keys = keys.repeat_interleave(nh // keys.shape[0], 0)
            values = values.repeat_interleave(nh // values.shape[0], 0)
        mask = None if P == T else causal_lower_right(T, P)                 # query i sees keys <= pos0 + i
        # not cuDNN's kernel: on torch 2.11 / H100 it failed ("mha_graph.execute ... is_good()") on chunks after
        # cached positions (gpu_fuzz seeds 625311, 625315)
        with sdpa_kernel(_GPU_SDPA):
            o = F.scaled_dot_product_attention(qh[None], keys[None], values[None], attn_mask=mask,
                                               is_causal=P == T, scale=scale)[0]
    out = torch.empty(T, nh * o.shape[-1], dtype=out_dtype, device=o.device)
    out.view(T, nh, -1).copy_(o.transpose(0, 1))                            # one launch: transpose and cast
    return out
