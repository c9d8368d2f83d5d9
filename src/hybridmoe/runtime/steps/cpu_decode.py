"""Token generation with every weight in host RAM: one C call a token (kernels/cpu_moe.c, hm_decode_step).

The eager path runs a decode step as ~25 torch ops and scheduler calls a layer: for Qwen3-30B-A3B's 48
layers that was ~18 ms of Python a token next to ~45 ms of kernels (docs/benchmarks.md, `cpuprof`). Here
the whole step, embedding to logits, is one ctypes call over structs built once: norms, RoPE, the cache
write and attention in C, the matrix-vector products and the experts by the same kernels the eager path
calls. It runs where the placement has every weight the step reads and the KV cache on the CPU (`-ngl 0`,
or no GPU), for the decoders of models/decoder.py without MLA; elsewhere the eager path (or the GPU's
static step, graphs.py) runs. gpt-oss's block (biases, a sink logit per head, window rings, the top-k softmax
router, the clamped SwiGLU) is in all three steps (a window layer's queries attend one by one, as in decode).
"""
from __future__ import annotations

import ctypes
import weakref

import torch

from ...kernels import cpu
from ...quant.types import GGMLType, block_size
from ..ops import rope_tables
from .base import NonFinite, NotApplicable

c_i64, c_i32, c_f32, c_vp = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class _Mat(ctypes.Structure):
    _fields_ = [("w", c_vp), ("rows", c_i64), ("type", c_i32), ("pad", c_i32)]


class _Layer(ctypes.Structure):
    _fields_ = [(n, c_vp) for n in ("attn_norm", "q_norm", "k_norm", "ffn_norm")] + \
               [(n, _Mat) for n in ("q", "k", "v", "o")] + [("kc", c_vp), ("vc", c_vp)] + \
               [(n, _Mat) for n in ("router", "gate_exps", "up_exps", "down_exps", "gate", "up", "down")] + \
               [(n, c_vp) for n in ("qkv_b", "o_b", "router_b", "sinks", "bg", "bu", "bd")] + \
               [("slots", c_i64), ("window", c_i64)]


class _Model(ctypes.Structure):
    _fields_ = [(n, c_i64) for n in ("n_layer", "H", "nh", "nkv", "D", "slots", "E", "k", "n_ff_exp", "n_ff")] + \
               [(n, c_i32) for n in ("kv_type", "neox", "norm_topk", "nthreads")] + \
               [(n, c_f32) for n in ("eps", "scale", "wscale", "pad")] + \
               [("out_norm", c_vp), ("embd", _Mat), ("head", _Mat), ("layers", ctypes.POINTER(_Layer)),
                ("scratch", c_vp), ("moe_tile_t", c_i32), ("mm_tile_t", c_i32), ("alpha", c_f32), ("limit", c_f32)]


class _Seq(ctypes.Structure):
    _fields_ = [("T", c_i64), ("pos0", c_i64), ("slots", c_i64), ("kc", c_vp), ("vc", c_vp)]


_KV_TYPES = {"f32": int(GGMLType.F32), "f16": int(GGMLType.F16), "bf16": int(GGMLType.BF16)}
_ROPE_BLOCK = 256                                   # positions per cached block of cos/sin
# a model whose token reads less than this of weights runs its steps on one thread unless -t says otherwise:
# its products are a few microseconds each, so threads mostly wait for each other at the kernels' barriers
# (synth:tiny, 0.2 MB, on the 2-core dev VM: steps of 1 and 8 sequences 1.8x and 1.3x faster on one thread
# than on two when the machine was idle, 8 sequences 10x when other work loaded it)
SMALL_TOKEN_BYTES = 1 << 20


def _lib():
    lib = cpu._load()
    if lib is None:
        raise NotApplicable("the C kernels are unavailable")
    if not getattr(lib, "_decode_ready", False):
        lib.hm_decode_scratch.argtypes = [ctypes.POINTER(_Model)]
        lib.hm_decode_scratch.restype = c_i64
        lib.hm_decode_step.argtypes = [ctypes.POINTER(_Model), c_i64, c_i64, c_vp, c_vp, c_vp, c_vp]
        lib.hm_decode_step.restype = c_i32
        lib.hm_prompt_scratch.argtypes = [ctypes.POINTER(_Model), c_i64]
        lib.hm_prompt_scratch.restype = c_i64
        lib.hm_prompt_step.argtypes = [ctypes.POINTER(_Model), c_vp, c_i64, c_i64, c_vp, c_vp, c_vp, c_i32, c_vp, c_vp]
        lib.hm_prompt_step.restype = c_i32
        lib.hm_batch_scratch.argtypes = [ctypes.POINTER(_Model), c_i64, c_i64]
        lib.hm_batch_scratch.restype = c_i64
        lib.hm_batch_step.argtypes = [ctypes.POINTER(_Model), c_vp, ctypes.POINTER(_Seq), c_i64, c_vp, c_vp, c_vp,
                                      c_i32, c_vp, c_vp, c_vp]
        lib.hm_batch_step.restype = c_i32
        lib.hm_decode_batch_scratch.argtypes = [ctypes.POINTER(_Model), c_i64]
        lib.hm_decode_batch_scratch.restype = c_i64
        lib.hm_decode_batch.argtypes = [ctypes.POINTER(_Model), c_vp, c_vp, c_vp, c_i64, c_vp, c_vp, c_i64, c_vp, c_vp,
                                        c_vp, c_vp, c_vp]
        lib.hm_decode_batch.restype = c_i32
        lib._decode_ready = True
    return lib


class CpuDecoder:
    """The static steps of an all-CPU placement: step(token, pos) -> logits [1, n_vocab] (decode),
    forward(tokens, pos0, all_logits) (a prompt chunk, hm_prompt_step) and forward_batch(items) (several
    sequences, each on its own cache, hm_batch_step): every token's values computed by the same arithmetic
    each way, so a prompt split anywhere, decoded token by token or batched with others gives the same logits."""

    def __init__(self, model, kv):
        dec, cfg, sched = model.decoder, model.cfg, model.sched
        self.oai = oai = cfg.arch == "gpt-oss"
        if any(L.mla for L in dec.layers):
            raise NotApplicable("multi-head latent attention (deepseek2) decodes eagerly")
        if cfg.expert_gating != ("softmax_topk" if oai else "softmax"):
            raise NotApplicable(f"{cfg.expert_gating} expert gating decodes eagerly")
        if kv.type_k != kv.type_v or kv.type_k not in _KV_TYPES:
            raise NotApplicable(f"a {kv.type_k}/{kv.type_v} KV cache decodes eagerly")
        if any(n != kv.n_ctx and not w for n, w in zip(kv.slots, kv.windows)) or \
                any(d.kind != "cpu" for d in kv.devs) or (any(kv.windows) and not oai):
            raise NotApplicable("a sliding-window or GPU KV cache")
        D, H = cfg.head_dim, cfg.n_embd
        if D > 256 or D % 2 or cfg.n_expert_used > 64:
            raise NotApplicable(f"head size {D} / {cfg.n_expert_used} experts a token")
        lib = _lib()
        self.model, self.cfg, self.kv, self.sched = model, cfg, kv, sched
        self.keep = []                                # every tensor the structs point into

        def mat(w, cols):
            if w is None:
                return _Mat(None, 0, 0, 0)
            self._check(w, cols)
            return _Mat(w.raw.data_ptr(), w.shape[0] if len(w.shape) == 2 else w.shape[0] * w.shape[1], int(w.qtype))

        def vec(w, n):
            if w is None:
                return None
            self._check(w, None)
            t = w.dequant(torch.float32).reshape(-1).contiguous()
            if t.numel() != n:
                raise NotApplicable(f"{w.name} has {t.numel()} values, not {n}")
            self.keep.append(t)
            return t.data_ptr()

        layers = (_Layer * cfg.n_layer)()
        n_ff = n_ff_exp = 0
        for i, L in enumerate(dec.layers):
            if getattr(L, "exp_probs_b", None) is not None or not oai and any(
                    getattr(L, b, None) is not None for b in ("attn_q_b", "attn_qkv_b", "attn_output_b")):
                raise NotApplicable(f"layer {i} has biases")
            S = layers[i]
            if oai:
                self._oai_layer(S, L, vec, kv.slots[i], kv.windows[i])
            S.attn_norm, S.ffn_norm = vec(L.attn_norm, H), vec(L.ffn_norm, H)
            S.q_norm, S.k_norm = vec(L.attn_q_norm, D), vec(L.attn_k_norm, D)
            S.q, S.k, S.v = mat(L.attn_q, H), mat(L.attn_k, H), mat(L.attn_v, H)
            S.o = mat(L.attn_output, cfg.n_head * D)
            if (S.q.rows, S.k.rows, S.v.rows, S.o.rows) != (cfg.n_head * D, cfg.n_head_kv * D, cfg.n_head_kv * D, H):
                raise NotApplicable(f"layer {i}: q/k/v/output rows {S.q.rows}/{S.k.rows}/{S.v.rows}/{S.o.rows}")
            S.kc, S.vc = kv.k[i].data_ptr(), kv.v[i].data_ptr()
            if L.ffn_gate_inp is not None:
                S.router = mat(L.ffn_gate_inp, H)
                S.gate_exps, S.up_exps, S.down_exps = (mat(L.ffn_gate_exps, H), mat(L.ffn_up_exps, H),
                                                       mat(L.ffn_down_exps, L.ffn_down_exps.shape[-1]))
                n_ff_exp = L.ffn_gate_exps.shape[1]
                if not cpu._experts_ok(L.ffn_gate_exps.raw, L.ffn_up_exps.raw, L.ffn_down_exps.raw,
                                       S.gate_exps.type, S.down_exps.type, H) or \
                        not L.ffn_gate_exps.shape[0] == S.router.rows == cfg.n_expert:
                    raise NotApplicable(f"layer {i}: expert tensors the kernel can't take")
                shared = (L.ffn_gate_shexp, L.ffn_up_shexp, L.ffn_down_shexp) \
                    if getattr(L, "ffn_gate_shexp", None) is not None else None
            else:
                shared = (L.ffn_gate, L.ffn_up, L.ffn_down)
            if shared is not None:
                g, u, d = shared
                S.gate, S.up, S.down = mat(g, H), mat(u, H), mat(d, g.shape[0])
                if S.up.rows != S.gate.rows or S.down.rows != H:
                    raise NotApplicable(f"layer {i}: FFN shapes {g.shape} {u.shape} {d.shape}")
                n_ff = max(n_ff, g.shape[0])
        m = self.m = _Model()
        m.n_layer, m.H, m.nh, m.nkv, m.D, m.slots = cfg.n_layer, H, cfg.n_head, cfg.n_head_kv, D, kv.n_ctx
        m.E, m.k, m.n_ff_exp, m.n_ff = cfg.n_expert, cfg.n_expert_used, n_ff_exp, n_ff
        m.kv_type, m.neox, m.norm_topk = _KV_TYPES[kv.type_k], int(cfg.rope_neox), int(cfg.norm_topk_prob)
        m.eps, m.scale, m.wscale = cfg.rms_eps, dec.scale if oai else D ** -0.5, cfg.expert_weights_scale
        if oai:                                         # softmax over the top k = the renormalised softmax
            m.norm_topk, m.alpha, m.limit = 1, cfg.swiglu_alpha, cfg.swiglu_limit
        m.out_norm = vec(dec.output_norm, H)
        m.embd, m.head = mat(dec.token_embd, H), mat(dec.output, H)
        self.layers = layers
        m.layers = layers
        self.scratch = torch.empty(lib.hm_decode_scratch(ctypes.byref(m)), dtype=torch.uint8)
        m.scratch = self.scratch.data_ptr()
        # prompts: the experts take the tile kernels from cpu.GEMM_MIN_T tokens, the dense products from
        # cpu.QMM_GEMM_MIN_T, where this CPU has tile products (for canonical types they compute the streaming
        # kernels' values: the int8 AMX tiles, or the streaming kernel itself)
        tiles = cpu.tile_mode() in ("amx", "avx512-bf16")
        m.moe_tile_t = cpu.GEMM_MIN_T if tiles else 0
        m.mm_tile_t = cpu.QMM_GEMM_MIN_T if tiles else 0
        self.prompt_scratch = None
        self.n_vocab = m.head.rows
        self.lib, self.mp = lib, ctypes.byref(m)
        self.times = (ctypes.c_double * 3)()
        self.rope = (-_ROPE_BLOCK - 1, None)      # (first position, (cos, sin)) of the cached block
        self.worked = False
        self._ptrs = weakref.WeakKeyDictionary()      # cache -> its per-layer K and V addresses (forward_batch)
        self._batch = None                            # decode_batch's records of the last batch's caches (_Batch)
        self._rope_tab = None                         # decode_batch: cos, sin [positions, D] from position 0
        self.batch_scratch = None                     # decode_batch's scratch (the prompt steps' is prompt_scratch)
        ek = [L for L in dec.layers if L.ffn_gate_inp is not None]
        # bytes of one routed expert per layer (0: no routed experts), for a batch's distinct experts
        self.layer_expert_bytes = [(L.ffn_gate_exps.nbytes + L.ffn_up_exps.nbytes + L.ffn_down_exps.nbytes)
                                   // L.ffn_gate_exps.shape[0] if L.ffn_gate_inp is not None else 0
                                   for L in dec.layers]
        # bytes the routed experts read a token: k experts of each MoE layer
        self.expert_bytes = sum(cfg.n_expert_used * (L.ffn_gate_exps.nbytes + L.ffn_up_exps.nbytes +
                                                     L.ffn_down_exps.nbytes) // L.ffn_gate_exps.shape[0] for L in ek)
        self.n_moe = len(ek)
        routed = sum(L.ffn_gate_exps.nbytes + L.ffn_up_exps.nbytes + L.ffn_down_exps.nbytes for L in ek)
        self.token_bytes = model.file.nbytes - routed + self.expert_bytes    # weights a token reads (about)
        # matrix-vector calls a token, counted as the eager path counts them: q/k/v (one), output, router,
        # the FFN's three, the head
        self.gemvs = sum(2 + (L.ffn_gate_inp is not None) +
                         3 * (L.ffn_gate_inp is None or getattr(L, "ffn_gate_shexp", None) is not None)
                         for L in dec.layers) + 1

    def _oai_layer(self, S, L, vec, slots: int, window: int):
        """gpt-oss's parts of layer L's struct S: its biases and sinks, its cache's ring and window."""
        cfg, H = self.cfg, self.cfg.n_embd
        nqkv = (cfg.n_head + 2 * cfg.n_head_kv) * cfg.head_dim
        qkv_b = torch.cat([b.dequant(torch.float32).reshape(-1) for b in (L.attn_q_b, L.attn_k_b, L.attn_v_b)])
        if qkv_b.numel() != nqkv:
            raise NotApplicable(f"layer {L.i}: q/k/v biases of {qkv_b.numel()} values, not {nqkv}")
        self.keep.append(qkv_b)
        S.qkv_b, S.o_b, S.sinks = qkv_b.data_ptr(), vec(L.attn_output_b, H), vec(L.attn_sinks, cfg.n_head)
        S.router_b = vec(L.ffn_gate_inp_b, cfg.n_expert)
        E, F = cfg.n_expert, L.ffn_gate_exps.shape[1]
        S.bg, S.bu, S.bd = (vec(b, n) for b, n in ((L.ffn_gate_exps_b, E * F), (L.ffn_up_exps_b, E * F),
                                                    (L.ffn_down_exps_b, E * H)))
        if window:                                      # a ring: position p in slot p % slots
            S.slots, S.window = slots, min(window, slots)

    def _threads(self) -> int:
        """-t, else every core, but one for a small model (SMALL_TOKEN_BYTES)."""
        if self.sched.n_threads:
            return self.sched.n_threads
        return 1 if self.token_bytes < SMALL_TOKEN_BYTES else torch.get_num_threads()

    def _check(self, w, cols):
        if w.device.kind != "cpu" or w.split:
            raise NotApplicable(f"{w.name} is on {w.device.name}")
        if int(w.qtype) not in cpu.KERNEL_TYPES:
            raise NotApplicable(f"{w.name}: no CPU kernel for {w.qtype.name}")
        if cols is not None and (w.shape[-1] != cols or cols % 32 or cols % block_size(w.qtype)
                                 or w.raw.dtype != torch.uint8 or not w.raw.is_contiguous()):
            raise NotApplicable(f"{w.name}: shape {tuple(w.shape)}, {cols} columns expected")

    def _cos_sin(self, pos: int):
        start, tabs = self.rope
        if not 0 <= pos - start < _ROPE_BLOCK:
            start = pos - pos % _ROPE_BLOCK
            cfg = self.cfg
            cos, sin = rope_tables(torch.arange(start, start + _ROPE_BLOCK), cfg.head_dim, cfg.rope_base,
                                   cfg.rope_neox, cfg.rope_yarn)
            tabs = (cos[:, 0].contiguous(), sin[:, 0].contiguous())
            self.rope = (start, tabs)
        return tabs[0][pos - start], tabs[1][pos - start]

    def _cos_sin_rows(self, pos: list[int]):
        """cos, sin [len(pos), D/2] of these positions: a gather from each block of the cached tables they lie in
        (one, mostly: a batch's decode tokens, a prompt chunk)."""
        blocks: dict[int, list[int]] = {}
        for i, p in enumerate(pos):
            blocks.setdefault(p // _ROPE_BLOCK, []).append(i)
        if not blocks:
            self._cos_sin(0)
            c, s = self.rope[1]
            return c[:0], s[:0]
        cos = sin = None
        for b, rows in blocks.items():
            self._cos_sin(b * _ROPE_BLOCK)
            start, (c, s) = self.rope
            idx = torch.tensor([pos[i] - start for i in rows])
            if len(blocks) == 1:
                return c[idx], s[idx]
            if cos is None:
                cos, sin = c.new_empty(len(pos), c.shape[1]), s.new_empty(len(pos), s.shape[1])
            rows = torch.tensor(rows)
            cos[rows], sin[rows] = c[idx], s[idx]
        return cos, sin

    def forward(self, tokens: torch.Tensor, pos0: int, all_logits: bool = True) -> torch.Tensor:
        """A prompt chunk: logits [T, n_vocab] (or [1, n_vocab], the last token's), the cache written at
        pos0..pos0 + T - 1."""
        T = int(tokens.shape[0])
        self.kv.check_fits(pos0, T)
        self.kv.check_rings(T)
        ids = tokens.to(torch.int64).contiguous()
        if T and not (0 <= int(ids.min()) and int(ids.max()) < self.m.embd.rows):
            raise ValueError(f"a token id is not in the vocabulary (0..{self.m.embd.rows - 1})")
        need = self.lib.hm_prompt_scratch(self.mp, T)
        if self.prompt_scratch is None or self.prompt_scratch.numel() < need:
            self.prompt_scratch = torch.empty(need, dtype=torch.uint8)
        cos, sin = self._cos_sin_rows(list(range(pos0, pos0 + T)))
        out = torch.empty(T if all_logits else 1, self.n_vocab, dtype=torch.float32)
        t = self.times
        self.m.nthreads = self._threads()
        rc = self.lib.hm_prompt_step(self.mp, ids.data_ptr(), T, pos0, cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                                     int(all_logits), self.prompt_scratch.data_ptr(), t)
        if rc:
            raise RuntimeError(f"the CPU prompt step failed: {_why(rc)}")
        self._account(T, self.expert_bytes)
        return out

    def accepts(self, kv) -> bool:
        """Whether a batch may hold this cache: on the CPU, of this step's cache type, no sliding-window ring."""
        return self._seq_ptrs(kv) is not None

    def _seq_ptrs(self, kv):
        """(keys, values): arrays of the cache's per-layer buffer addresses, made once per cache (its buffers are
        allocated once and never move); None for a cache the step can't take."""
        ptrs = self._ptrs.get(kv, self)
        if ptrs is self:
            n = self.cfg.n_layer
            ok = (kv.type_k == kv.type_v == self.kv.type_k and len(kv.k) == n and kv.windows == self.kv.windows
                  and all(s == (s0 if w else kv.n_ctx) for s, s0, w in zip(kv.slots, self.kv.slots, kv.windows))
                  and all(d.kind == "cpu" for d in kv.devs))
            ptrs = self._ptrs[kv] = ((c_vp * n)(*[t.data_ptr() for t in kv.k]),
                                     (c_vp * n)(*[t.data_ptr() for t in kv.v])) if ok else None
        return ptrs

    def forward_batch(self, items, all_logits: bool = False) -> tuple[torch.Tensor, list[int]]:
        """Several sequences in one pass (hm_batch_step): items [(tokens [T_i], pos0_i, kv_i)], each cache one
        accepts() takes. Returns (logits of every item's tokens, item after item, [sum T_i, n_vocab], or of each
        item's last token, [B, n_vocab]; per layer the number of distinct experts the batch routed to, 0 for
        layers without routed experts). Each item's logits are bit-identical to forward / step on its cache
        alone."""
        B = len(items)
        seqs = (_Seq * B)()
        pos = []
        for j, (tokens, pos0, kv) in enumerate(items):
            T = int(tokens.shape[0])
            kv.check_fits(pos0, T)
            kv.check_rings(T)
            kc, vc = self._seq_ptrs(kv)
            seqs[j].T, seqs[j].pos0, seqs[j].slots = T, pos0, kv.n_ctx
            seqs[j].kc, seqs[j].vc = ctypes.addressof(kc), ctypes.addressof(vc)
            pos.extend(range(pos0, pos0 + T))
        # ids out of the vocabulary: hm_batch_step refuses them
        ids = torch.cat([t for t, _, _ in items]).to(torch.int64).contiguous()
        n = int(ids.shape[0])
        cos, sin = self._cos_sin_rows(pos)
        need = self.lib.hm_batch_scratch(self.mp, n, B)
        if self.prompt_scratch is None or self.prompt_scratch.numel() < need:
            self.prompt_scratch = torch.empty(need, dtype=torch.uint8)
        out = torch.empty(n if all_logits else B, self.n_vocab, dtype=torch.float32)
        distinct = torch.zeros(self.cfg.n_layer, dtype=torch.int32)
        self.m.nthreads = self._threads()
        rc = self.lib.hm_batch_step(self.mp, ids.data_ptr(), seqs, B, cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                                    int(all_logits), self.prompt_scratch.data_ptr(), self.times, distinct.data_ptr())
        if rc:
            raise RuntimeError(f"the CPU batch step failed: {_why(rc)}")
        distinct = distinct.tolist()
        self._account(n, sum(d * b for d, b in zip(distinct, self.layer_expert_bytes)))
        return out, distinct

    def same_batch(self, kvs: list) -> bool:
        """Whether decode_batch's last batch had these caches, in this order (their records are kept)."""
        return self._batch is not None and self._batch.holds(kvs)

    def decode_batch(self, tokens: list[int], pos: list[int], kvs: list,
                     host_logits: bool = True) -> tuple[torch.Tensor, list[int], list[int]] | None:
        """One decode token for each of B sequences, ids, positions and caches as lists (each cache a distinct
        KVCache): their logits [B, n_vocab], per layer the distinct experts, as forward_batch gives them, and each
        row's argmax, by the same hm_batch_step (hm_decode_batch: the RoPE rows gathered, the logits' finiteness
        tested and their argmax taken in C). The
        sequences' records are made once for a batch of the same caches, so a step costs a few list copies of
        Python. None when a cache is one accepts() refuses (nothing ran). Raises IndexError for an id or position
        out of range (nothing written), NonFinite (a subclass of ValueError) when some logits are not finite (the
        caches written), RuntimeError for a kernel's failure. (host_logits: these logits are on the host anyway.)"""
        B = len(tokens)
        bt = self._batch
        if bt is None or not bt.holds(kvs):
            bt = self._batch = _Batch.of(self, kvs)
            if bt is None:
                return None
        bt.toks[:] = tokens
        bt.pos[:] = pos
        out = torch.empty(B, self.n_vocab, dtype=torch.float32)
        self.m.nthreads = self._threads()
        while True:
            tab = self._rope_tab
            rc = self.lib.hm_decode_batch(self.mp, bt.toks_p, bt.pos_p, bt.seqs_p, B, tab[0].data_ptr(),
                                          tab[1].data_ptr(), tab[0].shape[0], out.data_ptr(), bt.scratch_p,
                                          self.times, bt.distinct_p, bt.top_p) if tab is not None else -3
            if rc != -3:
                break
            self._grow_rope(max(pos))
        if rc < 0:
            if rc == -1:
                raise IndexError("a token id or position is out of range")
            raise RuntimeError(f"the CPU batch step failed: {_why(rc)}")
        distinct = list(bt.distinct)
        self._account(B, sum(d * b for d, b in zip(distinct, self.layer_expert_bytes)))
        if rc == 1:
            raise NonFinite(out, distinct)
        return out, distinct, bt.top[:B]

    def _grow_rope(self, max_pos: int):
        """decode_batch's RoPE tables, from position 0 past max_pos (in steps of _ROPE_BLOCK positions, doubling):
        the rows rope_tables gives each position, whatever range it is computed in."""
        have = 0 if self._rope_tab is None else self._rope_tab[0].shape[0]
        n = max(2 * have, -(-(max_pos + 1) // _ROPE_BLOCK) * _ROPE_BLOCK)
        cfg = self.cfg
        cos, sin = rope_tables(torch.arange(n), cfg.head_dim, cfg.rope_base, cfg.rope_neox, cfg.rope_yarn)
        self._rope_tab = (cos[:, 0].contiguous(), sin[:, 0].contiguous())

    def _account(self, n_tokens: int, expert_bytes: int):
        """The stats of one call: a forward of n_tokens, the expert bytes it read, the C timers' op seconds."""
        st, t = self.sched.stats, self.times
        st.forwards += 1
        st.tokens += n_tokens
        st.cpu_expert_bytes += expert_bytes
        st.cpu_expert_seconds += t[2]
        for i, (op, calls) in enumerate((("mul_mat", self.gemvs), ("attention", self.cfg.n_layer),
                                         ("moe_up_gate", self.n_moe))):
            if calls:
                rec = st.ops[(op, "CPU")]
                rec[0] += calls
                rec[1] += t[i] if st.profile else 0.0
            t[i] = 0.0

    def step(self, token: int, pos: int) -> torch.Tensor:
        """One decode step: the KV cache gets position pos; returns logits [1, n_vocab] float32."""
        self.kv.check_fits(pos, 1)
        if not 0 <= token < self.m.embd.rows:
            raise ValueError(f"token id {token} is not in the vocabulary (0..{self.m.embd.rows - 1})")
        cos, sin = self._cos_sin(pos)
        out = torch.empty(1, self.n_vocab, dtype=torch.float32)
        t = self.times
        self.m.nthreads = self._threads()     # bench -t changes it between runs
        rc = self.lib.hm_decode_step(self.mp, token, pos, cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t)
        if rc:
            raise RuntimeError(f"the CPU decode step failed: {_why(rc)}")
        self._account(1, self.expert_bytes)
        return out


class _Batch:
    """decode_batch's C records of one batch of caches, kept while the next steps have the same caches: the
    sequences' hm_seq records, the tokens, positions and distinct-experts arrays, the scratch; the caches
    themselves by weak reference (a cache that is freed and another made at its address is not taken for it)."""

    def __init__(self, step: CpuDecoder, kvs: list):
        B = len(kvs)
        self.refs = [weakref.ref(kv) for kv in kvs]
        self.seqs = (_Seq * B)()
        self.ptrs = []
        for j, kv in enumerate(kvs):
            kc, vc = step._seq_ptrs(kv)
            self.ptrs.append((kc, vc))
            self.seqs[j].T, self.seqs[j].slots = 1, kv.n_ctx
            self.seqs[j].kc, self.seqs[j].vc = ctypes.addressof(kc), ctypes.addressof(vc)
        self.toks, self.pos, self.top = (c_i64 * B)(), (c_i64 * B)(), (c_i64 * B)()
        self.distinct = (c_i32 * step.cfg.n_layer)()
        need = step.lib.hm_decode_batch_scratch(step.mp, B)
        if step.batch_scratch is None or step.batch_scratch.numel() < need:
            step.batch_scratch = torch.empty(need, dtype=torch.uint8)
        self.scratch = step.batch_scratch            # kept: a later, larger batch may replace step's
        self.toks_p, self.pos_p, self.seqs_p = (ctypes.addressof(self.toks), ctypes.addressof(self.pos),
                                                ctypes.addressof(self.seqs))
        self.distinct_p, self.scratch_p = ctypes.addressof(self.distinct), self.scratch.data_ptr()
        self.top_p = ctypes.addressof(self.top)

    @classmethod
    def of(cls, step: CpuDecoder, kvs: list):
        """The records of these caches, or None when accepts() refuses one."""
        if not all(step.accepts(kv) for kv in kvs):
            return None
        return cls(step, kvs)

    def holds(self, kvs: list) -> bool:
        """Whether these are this batch's caches, in this order (and all still alive)."""
        return len(kvs) == len(self.refs) and all(r() is kv for r, kv in zip(self.refs, kvs))


def _why(rc: int) -> str:
    return {-1: "a token, position or shape out of range",
            -2: "no memory for a kernel's workspace"}.get(rc, f"kernel error {rc}")
