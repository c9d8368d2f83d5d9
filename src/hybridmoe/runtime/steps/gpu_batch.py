"""A batch of decode tokens, one per sequence, as one CUDA graph per batch-size bucket when every weight is on
one GPU (`-ngl 99`, experts included). With experts in host RAM (`-ngl 99 -ot exps=CPU`, `--n-cpu-moe N`) the
bucket's step is a chain of graphs, one per run of layers up to a host-expert layer's router: each ends by
copying the rows' [h | weights | ids] to pinned host memory; the host then runs the scheduler's expert op over the
batch's real rows (the CPU kernel reads every expert they route to once, B rows in one call), writes the rows
back to pinned memory, and the next graph starts by copying them in.

Each sequence has its own KV cache (a server slot's). The layer loop is the captured prompt step's
(gpu_prefill.StaticPrefill: fused norms, GEMMs over the batch's rows, router top-k, the MoE kernels reading each
expert the batch routes to once), with attention replaced by the batched decode kernels
(kernels/gpu_batch_attention.py): row b's query against its own cache up to its own position. Positions and the
caches' element offsets from a fixed anchor tensor live in device buffers, written before each replay, so a
graph captured for a bucket serves any sequences at any positions.

B sequences run in the smallest bucket (1, 2, 4, 8, 16, 32, 64) that holds them; the padded rows have position
-1: they write no cache and attend to nothing (their zero rows still go through the GEMMs and experts). A
bucket's first batch runs eagerly (it compiles the kernels); its graph is captured right after and replayed
from the next batch on. With every expert on the GPU a step's rows (prompt chunks' tokens next to the decode
tokens) also run in buckets of 128 and 256: sixteen slots' new prompts arriving together are one replay of the
prompt's grouped MoE GEMMs, not three of 64 rows each reading every expert. Host-expert layers take at most 64
rows a call (the C hand-off's buffers), so with experts in RAM more rows run in steps of 64.
"""
from __future__ import annotations

import contextlib
import math
import time
import weakref

import torch

from ... import env
from ...errors import warn_fallback
from ...kernels import gpu_batch_attention as ga
from ...kernels import gpu_decode as gd
from ...kernels import gpu_handoff as gh
from .. import experts as X
from .base import NonFinite, NotApplicable
from .gpu_decode import capturing, expert_shapes, gc_paused, handoff_failure, share_fraction, stage_buffers
from .gpu_prefill import StaticPrefill

BUCKETS = (1, 2, 4, 8, 16, 32, 64)              # decode batches (one token a sequence)
ROW_BUCKETS = BUCKETS + (128, 256)              # a step's rows with every expert on the GPU
ROW_PARTIALS_BYTES = 256 << 20                  # a row bucket's attention partials at most (256 rows: 16k context)


def bucket(n: int, buckets=BUCKETS) -> int:
    """The smallest of buckets holding n rows (n <= buckets[-1])."""
    return next(b for b in buckets if b >= n)


class BatchDecode(StaticPrefill):
    max_chunk = 64                       # longest prompt chunk taken as rows (Model runs longer ones apart)
    host_experts = True

    def __init__(self, model, kv):
        super().__init__(model, kv)
        if not ga.available():
            raise NotApplicable("triton is not installed")
        self.host = any(lay.get("host") for lay in self.layers)
        self._rows = 0                                   # the batch's real rows (the rest of the bucket is padding)
        self._open = None                                # while capturing: (graph, its capture context, pieces)
        self._last = None                                # decode_batch's last caches (weak references)
        self._ran_polled = False                         # the last batch ran the polled hand-off
        self._moe = [i for i, lay in enumerate(self.layers) if "exps" in lay]
        self._moe_idx = torch.tensor(self._moe, dtype=torch.long, device=self.dev.torch_device)
        kc = kv.k[0]
        # one dtype; each layer's keys and values of one shape (a sliding window's ring has fewer slots)
        if not all(ga.batch_caches_ok([kv.k[i]], [kv.v[i]]) and kv.k[i].dtype == kc.dtype for i in range(len(kv.k))):
            raise NotApplicable("KV cache layers of different dtypes, or keys and values of different shapes")
        self.shapes, self.dtype, self.n_ctx = [tuple(t.shape) for t in kv.k], kc.dtype, kv.n_ctx
        # a chunk's rows write their keys before any row attends: a sliding window's ring holds them beside the
        # window - 1 positions before them (KVCache.check_rings), so chunks as rows are at most that long
        self.max_chunk = min([self.max_chunk] + [n - w + 1 for w, n in zip(kv.windows, kv.slots) if w and n < kv.n_ctx])
        # the buckets forward_batch's rows run in: past 64 only with every expert here, and while a bucket's
        # attention partials (B x heads x splits of the context) stay within ROW_PARTIALS_BYTES
        n_split = ga.n_splits(self.n_ctx)[1]
        self.row_buckets = tuple(b for b in ROW_BUCKETS if b <= BUCKETS[-1] or (not self.host and ga.split_bytes(
            b, self.cfg.n_head, self.cfg.head_dim, n_split) <= ROW_PARTIALS_BYTES))
        # every cache is reached as anchor + offset: the graphs hold this tensor's address, not the caches'
        self.anchor = torch.empty(ga.ALIGN, dtype=kc.dtype, device=self.dev.torch_device)
        self._offsets = weakref.WeakKeyDictionary()     # KVCache -> [n_layer, 2] int64 offsets (k, v)
        self.buckets = {}                                # B -> its buffers (and graph, once captured)
        self.worked = False
        self.n = 0                                       # the polled hand-off's step number
        self.host_layers = [i for i, lay in enumerate(self.layers) if lay.get("host")]
        self._expert_bytes = {i: sum(w.raw[0].numel() for w in self.layers[i]["exps"]) for i in self.host_layers}
        # the polled hand-off (as the single-sequence step's): the graphs publish the rows and wait for the host's
        # with flags in pinned memory, the C kernel spins on them; --profile and HYBRIDMOE_HANDOFF=sync keep the
        # synchronous one (a stream sync and the scheduler's expert op a layer)
        self.polled = bool(self.host_layers) and self.capture and X.kernels() is not None and \
            not self.sched.stats.profile and env.get("HYBRIDMOE_HANDOFF") != "sync"
        # the decode share, for batches: while the CPU runs the others, the GPU reads this fraction of the distinct
        # experts a host-expert layer's rows route to over the bus and runs their pairs (_share_pairs; gpt-oss's with
        # their biases gathered beside them)
        self.share_frac = share_fraction(self.sched, self.dev, self.cfg.n_expert_used or 1,
                                         [self.layers[i]["exps"] for i in self.host_layers]) if self.polled else 0.0
        # gpt-oss's host-expert layers' biases, float32: in host memory for the C hand-off, on this GPU for the share
        L = self.model.decoder.layers
        self._host_b = {i: tuple(b.dequant(torch.float32).contiguous() for b in (
            L[i].ffn_gate_exps_b, L[i].ffn_up_exps_b, L[i].ffn_down_exps_b)) for i in self.host_layers} if self.oai \
            else {}
        self._share_b = {i: tuple(t.to(self.dev.torch_device) for t in bs) for i, bs in self._host_b.items()} \
            if self.share_frac else {}

    def accepts(self, kv) -> bool:
        """Whether kv can be one of this step's sequences: a plain cache on this GPU shaped as the first."""
        return (kv.n_ctx == self.n_ctx and all(d.name == self.dev.name for d in kv.devs)
                and all(kv.plain(i, ring=self.oai) and tuple(kv.k[i].shape) == shape and kv.k[i].dtype == self.dtype
                        and tuple(kv.v[i].shape) == shape for i, shape in enumerate(self.shapes)))

    def _offsets_of(self, kv) -> torch.Tensor:
        off = self._offsets.get(kv)
        if off is None:
            n = len(kv.k)
            off = torch.tensor(ga.cache_offsets(self.anchor, kv.k + kv.v), dtype=torch.int64).view(2, n).t()
            self._offsets[kv] = off = off.contiguous()
        return off

    def _buffers(self, B: int) -> dict:
        buf = self.buckets.get(B)
        if buf is None:
            td, cfg = self.dev.torch_device, self.cfg
            n_layer = len(self.layers)
            _, n_split = ga.n_splits(self.n_ctx)
            buf = self.buckets[B] = {
                "x": torch.zeros(B, cfg.n_embd, device=td),
                "pos": torch.full((B,), -1, dtype=torch.int64, device=td),
                "offs": torch.zeros(n_layer, 2, B, dtype=torch.int64, device=td),         # [layer, (k, v), row]
                "ids": torch.zeros(n_layer, B, cfg.n_expert_used or 1, dtype=torch.int64, device=td),
                "parts": ga.split_buffers(B, cfg.n_head, cfg.head_dim, n_split, td), "graph": None, "logits": None,
                "moe": None}
            if self.host and self.capture:               # the host-expert layers' rows out and back (one at a time)
                H, k = cfg.n_embd, cfg.n_expert_used
                buf["pin_in"] = torch.zeros(B, H + 2 * k, pin_memory=True)
                buf["pin_out"] = torch.zeros(B, H, pin_memory=True)
                if self.polled:
                    self._handoff_buffers(buf)
        return buf

    def _handoff_buffers(self, buf):
        """The polled hand-off's flags (a cache line each, a pair per host-expert layer) and C calls for a bucket;
        none (the synchronous hand-off) where the C kernel lacks a layer's types."""
        n, kern = len(self.host_layers), X.kernels()
        pin = lambda *shape: torch.zeros(*shape, dtype=torch.int32, pin_memory=True)  # noqa: E731
        ready, done = pin(n, 16), pin(n, 16)
        calls = {}
        for j, i in enumerate(self.host_layers):
            g, u, d = self.layers[i]["exps"]
            oai = (*self._host_b[i], self.cfg.swiglu_alpha, self.cfg.swiglu_limit) if self.oai else None
            try:
                calls[i] = (j, kern.handoff_rows_call(g.raw, u.raw, d.raw, g.qtype, d.qtype, buf["pin_in"],
                                                      buf["pin_out"], ready[j], done[j], self.sched.n_threads,
                                                      oai=oai))
            except ValueError:
                return
        buf["hk"] = {"ready": ready, "done": done, "err": pin(1), "calls": calls,
                     "step": torch.zeros(1, dtype=torch.int32, device=self.dev.torch_device)}
        if self.share_frac:
            self._share_buffers(buf)

    def _share_buffers(self, buf):
        """A bucket's decode share: room for the most experts the GPU may take in a layer (gmax) and a slot of
        zeros after them (the CPU's pairs run on it: zero scales, zero rows), per expert shape; the GPU's output
        rows, one a (token, slot) pair."""
        B, td = buf["x"].shape[0], self.dev.torch_device
        k, E, H = self.cfg.n_expert_used, self.cfg.n_expert, self.cfg.n_embd
        gmax = max(1, math.ceil(self.share_frac * min(B * k, E)))
        stage = stage_buffers([self.layers[i]["exps"] for i in self.host_layers], gmax + 1, td)
        buf["share"] = {"gmax": gmax, "stage": stage, "gout": torch.zeros(B * k, H, device=td),
                        "experts": torch.arange(E, dtype=torch.int32, device=td)}
        if self.oai:        # the staged experts' biases (the zero slot's stay zero: its pairs' rows come out zero)
            F = self.cfg.n_ff_exp
            buf["share"]["stage_b"] = tuple(torch.zeros(gmax + 1, n, device=td) for n in (F, F, H))

    def _share_pairs(self, ids, sh):
        """The decode share of a host-expert layer, on the GPU: of the distinct experts the real rows route to, the
        first G by id are the GPU's (G: share_frac of them, rounded, at most gmax). Returns (the ids for the CPU,
        the GPU's pairs elsewhere -1; the GPU's ids into its staged experts, the CPU's pairs the zero slot; the
        experts to stage [1, gmax], -1 for slots left unused)."""
        E, gmax = self.cfg.n_expert, sh["gmax"]
        idl = ids.long()
        real = (self._cur["pos"] >= 0)[:, None]
        present = torch.zeros(E + 1, dtype=torch.int64, device=ids.device)
        present.scatter_(0, torch.where(real, idl, E).reshape(-1), 1)
        present = present[:E]
        rank = present.cumsum(0) - 1
        g = torch.clamp(torch.floor(present.sum() * self.share_frac + 0.5), max=gmax)
        mine = (present > 0) & (rank < g)
        slot = torch.where(mine, rank, gmax)
        sel = torch.full((gmax + 1,), -1, dtype=torch.int32, device=ids.device)
        sel.scatter_(0, slot, sh["experts"])             # slot gmax: written by every other expert, never read
        pair = mine[idl] & real
        return torch.where(pair, -1, idl), torch.where(pair, slot[idl], gmax).to(torch.int32), sel[None, :gmax]

    def _gpu_share(self, i: int, h, wts, lids, sel, sh):
        """The GPU's pairs of host-expert layer i: their experts copied over the bus, run into sh["gout"]."""
        exps = self.layers[i]["exps"]
        g, u, d = exps
        stage = sh["stage"][expert_shapes(exps)]
        gd.stage_experts(sel, 0, [gd.stage_words(w.raw) for w in exps],
                         [gd.stage_words(w[:sh["gmax"]]) for w in stage])
        oai = None
        if self.oai:                                     # slots of unused experts (-1) get expert 0's: never read
            idx = sel[0].clamp(min=0).long()
            for src, dst in zip(self._share_b[i], sh["stage_b"]):
                torch.index_select(src, 0, idx, out=dst[:sh["gmax"]])
            oai = (*sh["stage_b"], self.cfg.swiglu_alpha, self.cfg.swiglu_limit)
        gd.moe(h, lids, wts, *stage, g.qtype, d.qtype, reduce=False, gate_split=g.split, down_split=d.split,
               out=sh["gout"], oai=oai)

    # -- the prompt step's layer loop, with these hooks --------------------------------------------------------
    def _attention(self, i: int, lay: dict, qkv):
        cfg, buf = self.cfg, self._cur
        koff, voff = buf["offs"][i]
        shape = self.shapes[i]
        q = ga.qk_rope_cache_batch(qkv, lay["q_norm"], lay["k_norm"], self.cos, self.sin, buf["pos"], self.anchor,
                                   koff, voff, shape, shape, cfg.n_head, cfg.rms_eps, cfg.rope_neox,
                                   q_dtype=self.dtype if self.cdt != torch.float32 else self.cdt)
        return ga.attention_batch(q, self.anchor, koff, voff, buf["pos"], shape, shape, self.scale, self.n_ctx,
                                  out_dtype=self.cdt, parts=buf["parts"], sinks=lay["sinks"], window=lay["window"])

    def _experts(self, h, ids, wts, exps, biases=None):
        """The bucket's (token, slot) pairs pick the kernels (runtime/experts.gpu_moe_path): per-pair GEMVs, the
        grouped GEMVs or int8 tensor-core kernels (gpu_mmq) reading each active expert once per block of its
        pairs, or the prompt's grouped GEMMs.
        The GEMVs are called here, so fake GPUs run them too (in Triton's interpreter, as the tests do)."""
        g, u, d = exps
        if biases is not None:                           # gpt-oss's: experts.moe_biased, by oai_moe_path
            self._cur["moe"] = X.oai_moe_path(ids.shape[0], ids.numel())
            return super()._experts(h, ids, wts, exps, biases)
        path = X.gpu_moe_path(ids.shape[0], ids.numel(), (g.qtype, u.qtype, d.qtype), g.split and d.split)
        mod = X.gpu_kernels(path)
        self._cur["moe"] = path                          # what ran, for benchmarks/batch_decode.py
        if path != "gemm" and not mod.supports(g.qtype, u.qtype, d.qtype):
            self._cur["moe"] = "runtime/experts.moe"
        elif path != "gemm":
            try:
                return mod.moe(h, ids, wts, g.raw, u.raw, d.raw, g.qtype, d.qtype, gate_split=g.split,
                               down_split=d.split)
            except Exception as e:                      # noqa: BLE001 - a kernel this GPU can't build
                mod.disable(g.qtype, d.qtype, e)
                self._cur["moe"] = "runtime/experts.moe"
        return super()._experts(h, ids, wts, exps)

    def _routed(self, i: int, ids):
        self._cur["ids"][i].copy_(ids)

    def _host_moe(self, i: int, h, ids, wts):
        """Host-expert layer i: the scheduler's expert op over the real rows (padding rows get zeros, no expert
        work): the CPU kernel reads each expert they route to once, or the batch's experts are uploaded and run
        here where the offload policy finds that pays for this many tokens; the rows back on this GPU. While a
        bucket is captured: the rows go to pinned memory, this graph ends and the next begins with the rows
        coming back (_replay runs the host part between them)."""
        if self._open is not None:
            return self._split_capture(i, h, ids, wts)
        s = self.sched
        y = self._host_op(i, s.tag(h[:self._rows], self.dev), ids[:self._rows], wts[:self._rows])
        out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        out[:self._rows].copy_(y)
        return out

    def _host_op(self, i: int, h, ids, wts):
        """The scheduler's expert op of host-expert layer i over rows h (gpt-oss's with its biases)."""
        L, s = self.model.decoder.layers[i], self.sched
        exps = (L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps)
        if self.oai:
            return s.moe_biased(h, ids, wts, exps, (L.ffn_gate_exps_b, L.ffn_up_exps_b, L.ffn_down_exps_b),
                                self.cfg.swiglu_alpha, self.cfg.swiglu_limit, layer=i)
        return s.moe(h, ids, wts, *exps, layer=i)

    def _host_rows(self, i: int, buf):
        """Replaying: host-expert layer i over the rows in buf["pin_in"] (the real ones), into buf["pin_out"]."""
        B, H, k = self._rows, self.cfg.n_embd, self.cfg.n_expert_used
        rows, out = buf["pin_in"][:B], buf["pin_out"]
        out[:B].copy_(self._host_op(i, rows[:, :H], rows[:, H + k:].long(), rows[:, H:H + k]))
        out[B:].zero_()

    def _split_capture(self, i: int, h, ids, wts):
        """Capturing, at host-expert layer i: the rows out to pinned memory end this graph; the next one begins
        with the host's result coming back, which the layers after i read."""
        graph, ctx, pieces, buf = self._open
        hk, sh = buf.get("hk"), buf.get("share")
        cpu_ids = ids
        if sh is not None:
            cpu_ids, lids, sel = self._share_pairs(ids, sh)
        buf["pin_in"].copy_(torch.cat([h.float(), wts.float(), cpu_ids.float()], 1), non_blocking=True)
        if hk is not None:                               # polled: the flag says the rows are there
            gh.publish(hk["ready"][hk["calls"][i][0]], hk["step"])
        if sh is not None:                               # the GPU's share while the CPU runs the rest
            self._gpu_share(i, h, wts, lids, sel, sh)
        ctx.close()
        pieces.append((graph, i))
        self._begin_capture(pieces, buf)
        if hk is not None:                               # the next graph waits for the host's rows
            gh.await_flag(hk["done"][hk["calls"][i][0]], hk["step"], hk["err"])
        dev_out = torch.empty(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        dev_out.copy_(buf["pin_out"], non_blocking=True)
        if sh is not None:
            dev_out += sh["gout"].view(h.shape[0], -1, h.shape[1]).sum(1)
        return dev_out

    def _begin_capture(self, pieces, buf):
        graph, ctx = torch.cuda.CUDAGraph(), contextlib.ExitStack()
        ctx.enter_context(capturing(graph, self.dev.torch_device, buf["side"], buf["pool"]))
        self._open = (graph, ctx, pieces, buf)

    # -- running -------------------------------------------------------------------------------------------------
    def forward_batch(self, items, all_logits: bool = False):
        """items [(tokens [T_i], pos_i, kv_i)], T_i <= max_chunk -> (logits [sum T_i or B, n_vocab] float32 on the
        CPU: each item's rows, or its last one, {MoE layer: the most distinct experts a step routed to}). Every token
        is a row at its own position: a decode token, or one of a prompt chunk's, whose rows write their keys before
        any row attends (qk_rope_cache_batch, then attention_batch), so a chunk's row sees the rows before it as a
        prompt's causal attention does. At most row_buckets[-1] rows a step; a chunk's rows stay in order over the
        steps."""
        for t, _, kv in items:                           # a prompt chunk's rows fit each sliding-window ring
            kv.check_rings(t.shape[0])
        rows = [(tok, int(p0) + t, kv, all_logits or t == len(ids) - 1)
                for ids, p0, kv in ((t.tolist(), p, kv) for t, p, kv in items) for t, tok in enumerate(ids)]
        outs, distinct = [], {}
        most = self.row_buckets[-1]
        for a in range(0, len(rows), most):
            group = rows[a:a + most]
            logits, n = self._run(torch.tensor([r[0] for r in group]), [r[1] for r in group], [r[2] for r in group])
            want = [j for j, r in enumerate(group) if r[3]]
            live = logits[:len(group)] if len(want) == len(group) else \
                logits.index_select(0, torch.tensor(want, device=logits.device))
            out, n = self._to_host(live, n)
            outs.append(out)
            n = n.tolist()
            self._account(n)
            for i, c in zip(self._moe, n):
                distinct[i] = max(distinct.get(i, 0), c)
        return torch.cat(outs), distinct

    def same_batch(self, kvs: list) -> bool:
        """Whether decode_batch's last batch had these caches, in this order (they were checked then)."""
        last = self._last
        return last is not None and len(last) == len(kvs) and all(r() is kv for r, kv in zip(last, kvs))

    def decode_batch(self, tokens: list[int], pos: list[int], kvs: list, host_logits: bool = True):
        """One decode token for each of B <= 64 sequences, as lists: (logits [B, n_vocab] on the CPU, per layer the
        distinct experts, each row's argmax), the argmax, the logits' finiteness and the expert counts taken on
        the GPU and sent back with the logits in one copy to pinned memory (host_logits=False: the logits stay on
        the GPU, a view of the bucket's buffer that the next step overwrites). None where a cache is one accepts()
        refuses, or B > 64 (nothing ran: forward_batch takes them). Raises IndexError for an id or position out
        of range (nothing ran), NonFinite when some logits are not finite (the caches written)."""
        launched = self.decode_launch(tokens, pos, kvs, host_logits)
        return None if launched is None else self.decode_finish(launched)

    def decode_launch(self, tokens: list[int], pos: list[int], kvs: list, host_logits: bool):
        """decode_batch's first half: the step queued on the GPU (with host experts, their rows run on the way) and
        its results' copies to pinned memory queued behind it; decode_finish(the returned state) waits for them.
        None and IndexError as decode_batch's."""
        B = len(tokens)
        if B > BUCKETS[-1]:
            return None
        if not self.same_batch(kvs):
            if not all(self.accepts(kv) for kv in kvs):
                return None
            self._last = [weakref.ref(kv) for kv in kvs]
        if min(tokens) < 0 or max(tokens) >= self.cfg.n_vocab or min(pos) < 0 or max(pos) >= self.n_ctx:
            raise IndexError("a token id or position is out of range")
        logits, n = self._run(torch.tensor(tokens), pos, kvs)
        live = logits[:B]
        tail = torch.cat([live.argmax(-1).to(n.dtype), torch.isfinite(live).all().to(n.dtype).view(1), n])
        out, tail = self._copy_out(live if host_logits else None, tail)
        return B, (live if out is None else out), tail

    def decode_finish(self, launched):
        """decode_batch's second half: waits for the step decode_launch queued; decode_batch's result."""
        B, out, tail = launched
        self._wait()
        top, finite, n = tail[:B].tolist(), bool(tail[B]), tail[B + 1:].tolist()
        self._account(n)
        distinct = [0] * len(self.layers)
        for i, c in zip(self._moe, n):
            distinct[i] = c
        if not finite:
            raise NonFinite(out, distinct)
        return out, distinct, top

    def _account(self, counts: list[int]):
        """The expert bytes the polled hand-off's C calls read and the decode share's GPU copied (the synchronous
        hand-off's expert op counts its own)."""
        if self._ran_polled:
            per, st = self._expert_bytes, self.sched.stats
            sh = self._cur.get("share")
            for i, c in zip(self._moe, counts):
                g = min(sh["gmax"], math.floor(c * self.share_frac + 0.5)) if sh is not None and i in per else 0
                st.cpu_expert_bytes += (c - g) * per.get(i, 0)
                st.gpu_share_bytes += g * per.get(i, 0)

    def _to_host(self, logits, small):
        """The logits [B, n_vocab] and a small int tensor to the CPU: copies into pinned memory, one wait."""
        out, tail = self._copy_out(logits, small)
        self._wait()
        return out, tail

    def _copy_out(self, logits, small):
        """The logits (None: none) and a small int tensor's copies to pinned memory, queued (_wait waits)."""
        if logits is not None:
            self.sched.stats.copy(self.dev.name, "CPU", logits.numel() * 4)
        if small.device.type != "cuda":                  # fake GPUs (tests): their tensors are in host memory
            return (logits.clone() if logits is not None else None), small.clone()
        out = None
        if logits is not None:
            out = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True)
            out.copy_(logits, non_blocking=True)
        tail = torch.empty(small.shape, dtype=small.dtype, pin_memory=True)
        tail.copy_(small, non_blocking=True)
        return out, tail

    def _wait(self):
        """Waits for the GPU's queued work; a polled hand-off whose GPU waited in vain for the host is an error."""
        if self.dev.torch_device.type == "cuda":
            torch.cuda.current_stream(self.dev.torch_device).synchronize()
        hk = self._cur.get("hk")
        if hk is not None and hk["err"][0]:
            hk["err"][0] = 0
            raise RuntimeError("the batched decode step's GPU waited in vain for the CPU experts' rows")

    def _run(self, tokens, pos: list[int], kvs: list):
        """The batch's step on the GPU (nothing waited for): (logits [Bp, n_vocab] on the GPU, the distinct experts
        each MoE layer routed the real rows to, int64 [n MoE layers] on the GPU)."""
        B = self._rows = len(kvs)
        Bp = bucket(B, self.row_buckets)
        buf = self._cur = self._buffers(Bp)
        st, dev, td = self.sched.stats, self.dev, self.dev.torch_device
        emb = self.model.decoder.token_embd
        x = emb.dequant(torch.float32, index=tokens.to(emb.raw.device)).to(td, non_blocking=True)
        pos_t = torch.full((Bp,), -1, dtype=torch.int64)
        pos_t[:B] = torch.tensor(pos)
        offs = [self._offsets_of(kv) for kv in kvs]
        offs += offs[:1] * (Bp - B)                              # padded rows: position -1, nothing read or written
        buf["x"][:B].copy_(x)
        buf["x"][B:].zero_()
        buf["pos"].copy_(pos_t, non_blocking=True)
        buf["offs"].copy_(torch.stack(offs, -1), non_blocking=True)      # [n_layer, 2, Bp]
        st.forwards += 1
        st.tokens += B
        if emb.device.name != dev.name:
            st.copy(emb.device.name, dev.name, x.numel() * 4)
        sync = (lambda: torch.cuda.synchronize(td)) if self.capture and st.profile else None
        self._ran_polled = buf["graph"] is not None and buf.get("hk") is not None
        with st.op("batch graph" if buf["graph"] is not None else "batch step", dev, sync):
            if buf["graph"] is None:
                logits = self._forward(buf["x"], True)
                if self.capture:
                    self._capture_bucket(buf)
            else:
                self._replay(buf)
                logits = buf["logits"]
        return logits, self._distinct(buf["ids"].index_select(0, self._moe_idx)[:, :B])

    def _distinct(self, ids):
        """ids [n MoE layers, B, k] -> the distinct experts of each layer, on the GPU."""
        if not self._moe:
            return torch.zeros(0, dtype=torch.int64, device=ids.device)
        hit = torch.zeros(ids.shape[0], self.cfg.n_expert, dtype=torch.int64, device=ids.device)
        return hit.scatter_(1, ids.reshape(ids.shape[0], -1), 1).sum(1)

    def _replay(self, buf):
        """The bucket's graphs in order, the host-expert layers' rows run on the host between them."""
        if buf.get("hk") is not None:
            return self._replay_polled(buf)
        stream = torch.cuda.current_stream(self.dev.torch_device)
        for graph, host in buf["graph"]:
            graph.replay()
            if host is not None:
                stream.synchronize()                    # the rows are in pinned memory
                self._host_rows(host, buf)

    def _replay_polled(self, buf):
        """The graphs with the polled hand-off: graph s + 1 is enqueued (its first kernel spins on the host's flag)
        before the C kernel takes graph s's rows (it spins on the GPU's flag), so no sync or Python sits between
        the two devices; both flags carry the step's number."""
        hk, pieces, B = buf["hk"], buf["graph"], self._rows
        self.n = n = self.n % (1 << 30) + 1
        hk["step"].fill_(n)
        pieces[0][0].replay()
        t0 = time.perf_counter()
        try:
            for s in range(len(pieces) - 1):
                pieces[s + 1][0].replay()
                i = pieces[s][1]
                rc = hk["calls"][i][1](n, B)
                if rc:
                    raise RuntimeError(handoff_failure(i, rc))
        except BaseException:
            hk["done"][:, 0].fill_(n)                   # let every waiting graph go on
            raise
        st = self.sched.stats
        m = len(pieces) - 1
        st.cpu_expert_seconds += time.perf_counter() - t0       # (the calls' waits for the GPU included)
        st.ops[("moe_up_gate", "CPU")][0] += m
        st.copy(self.dev.name, "CPU", buf["pin_in"][:B].numel() * 4, m)
        st.copy("CPU", self.dev.name, buf["pin_out"][:B].numel() * 4, m)

    def _capture_bucket(self, buf):
        """The bucket's step as graphs: [(graph, the host-expert layer that follows it, or None)]; one graph
        where every expert is on this GPU."""
        td = self.dev.torch_device
        buf["side"], buf["pool"] = torch.cuda.Stream(td), torch.cuda.graph_pool_handle()
        buf["side"].wait_stream(torch.cuda.current_stream(td))
        pieces = []
        try:
            with gc_paused():                            # one collection for all the pieces' captures
                self._begin_capture(pieces, buf)
                logits = self._forward(buf["x"], True)
                graph, ctx, _, _ = self._open
                ctx.close()
                pieces.append((graph, None))
        except RuntimeError as e:                                # a driver or op that can't be captured
            if self._open is not None:
                try:
                    self._open[1].close()                        # ends the broken capture
                except RuntimeError:
                    pass
            torch.cuda.synchronize(td)
            self.capture = False
            for b in self.buckets.values():
                b["graph"] = None
            warn_fallback("CUDA graph capture of the batched decode step", e, "batched decode without graphs")
            return
        finally:
            self._open = None
        torch.cuda.current_stream(td).wait_stream(buf["side"])
        buf["graph"], buf["logits"] = pieces, logits
