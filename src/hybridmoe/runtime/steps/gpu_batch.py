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
from the next batch on. More than 64 sequences run in chunks of 64.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from ...errors import warn_fallback
from ...kernels import gpu_batch_attention as ga
from .. import experts as X
from .base import NotApplicable
from .gpu_decode import capturing, gc_paused
from .gpu_prefill import StaticPrefill

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(n: int) -> int:
    """The smallest bucket holding n rows (n <= 64)."""
    return next(b for b in BUCKETS if b >= n)


class BatchDecode(StaticPrefill):
    single_tokens = True                 # Model runs batches with prompt chunks eagerly
    host_experts = True

    def __init__(self, model, kv):
        super().__init__(model, kv)
        if not ga.available():
            raise NotApplicable("triton is not installed")
        self.host = any(lay.get("host") for lay in self.layers)
        self._rows = 0                                   # the batch's real rows (the rest of the bucket is padding)
        self._open = None                                # while capturing: (graph, its capture context, pieces)
        kc = kv.k[0]
        if not ga.batch_caches_ok([kv.k[i] for i in range(len(kv.k))], [kv.v[i] for i in range(len(kv.v))]):
            raise NotApplicable("KV cache layers of different shapes or dtypes")
        self.shape, self.dtype, self.n_ctx = tuple(kc.shape), kc.dtype, kv.n_ctx
        # every cache is reached as anchor + offset: the graphs hold this tensor's address, not the caches'
        self.anchor = torch.empty(ga.ALIGN, dtype=kc.dtype, device=self.dev.torch_device)
        self._offsets = weakref.WeakKeyDictionary()     # KVCache -> [n_layer, 2] int64 offsets (k, v)
        self.buckets = {}                                # B -> its buffers (and graph, once captured)
        self.worked = False

    def accepts(self, kv) -> bool:
        """Whether kv can be one of this step's sequences: a plain cache on this GPU shaped as the first."""
        return (kv.n_ctx == self.n_ctx and all(d.name == self.dev.name for d in kv.devs)
                and all(kv.plain(i) and tuple(kv.k[i].shape) == self.shape and kv.k[i].dtype == self.dtype
                        and tuple(kv.v[i].shape) == self.shape for i in range(len(kv.k))))

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
        return buf

    # -- the prompt step's layer loop, with these hooks --------------------------------------------------------
    def _attention(self, i: int, lay: dict, qkv):
        cfg, buf = self.cfg, self._cur
        koff, voff = buf["offs"][i]
        q = ga.qk_rope_cache_batch(qkv, lay["q_norm"], lay["k_norm"], self.cos, self.sin, buf["pos"], self.anchor,
                                   koff, voff, self.shape, self.shape, cfg.n_head, cfg.rms_eps, cfg.rope_neox,
                                   q_dtype=self.dtype if self.cdt != torch.float32 else self.cdt)
        return ga.attention_batch(q, self.anchor, koff, voff, buf["pos"], self.shape, self.shape,
                                  cfg.head_dim ** -0.5, self.n_ctx, out_dtype=self.cdt, parts=buf["parts"])

    def _experts(self, h, ids, wts, exps):
        """The bucket's (token, slot) pairs pick the kernels (runtime/experts.gpu_moe_path): per-pair GEMVs, the
        grouped GEMVs or int8 tensor-core kernels (gpu_mmq) reading each active expert once per block of its
        pairs, or the prompt's grouped GEMMs.
        The GEMVs are called here, so fake GPUs run them too (in Triton's interpreter, as the tests do)."""
        g, u, d = exps
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
        B, L = self._rows, self.model.decoder.layers[i]
        s = self.sched
        y = s.moe(s.tag(h[:B], self.dev), ids[:B], wts[:B], L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps, layer=i)
        out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        out[:B].copy_(y)
        return out

    def _host_rows(self, i: int, buf):
        """Replaying: host-expert layer i over the rows in buf["pin_in"] (the real ones), into buf["pin_out"]."""
        B, H, k, L = self._rows, self.cfg.n_embd, self.cfg.n_expert_used, self.model.decoder.layers[i]
        rows, out = buf["pin_in"][:B], buf["pin_out"]
        y = self.sched.moe(rows[:, :H], rows[:, H + k:].long(), rows[:, H:H + k], L.ffn_gate_exps, L.ffn_up_exps,
                           L.ffn_down_exps, layer=i)
        out[:B].copy_(y)
        out[B:].zero_()

    def _split_capture(self, i: int, h, ids, wts):
        """Capturing, at host-expert layer i: the rows out to pinned memory end this graph; the next one begins
        with the host's result coming back, which the layers after i read."""
        graph, ctx, pieces, buf = self._open
        buf["pin_in"].copy_(torch.cat([h.float(), wts.float(), ids.float()], 1), non_blocking=True)
        ctx.close()
        pieces.append((graph, i))
        self._begin_capture(pieces, buf)
        dev_out = torch.empty(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        dev_out.copy_(buf["pin_out"], non_blocking=True)
        return dev_out

    def _begin_capture(self, pieces, buf):
        graph, ctx = torch.cuda.CUDAGraph(), contextlib.ExitStack()
        ctx.enter_context(capturing(graph, self.dev.torch_device, buf["side"], buf["pool"]))
        self._open = (graph, ctx, pieces, buf)

    # -- running -------------------------------------------------------------------------------------------------
    def forward_batch(self, items, all_logits: bool = False):
        """items [(tokens [1], pos_i, kv_i)] -> (logits [B, n_vocab] float32 on the CPU, {MoE layer: distinct
        experts the batch routed to})."""
        outs, distinct = [], {}
        for a in range(0, len(items), BUCKETS[-1]):
            out, d = self._run(items[a:a + BUCKETS[-1]])
            outs.append(out)
            for i, n in d.items():
                distinct[i] = max(distinct.get(i, 0), n)
        return torch.cat(outs), distinct

    def _run(self, items):
        B = self._rows = len(items)
        Bp = bucket(B)
        buf = self._cur = self._buffers(Bp)
        st, dev, td = self.sched.stats, self.dev, self.dev.torch_device
        emb = self.model.decoder.token_embd
        tokens = torch.cat([t for t, _, _ in items])
        x = emb.dequant(torch.float32, index=tokens.to(emb.raw.device)).to(td, non_blocking=True)
        pos = torch.full((Bp,), -1, dtype=torch.int64)
        pos[:B] = torch.tensor([int(p) for _, p, _ in items])
        offs = [self._offsets_of(kv) for _, _, kv in items]
        offs += offs[:1] * (Bp - B)                              # padded rows: position -1, nothing read or written
        buf["x"][:B].copy_(x)
        buf["x"][B:].zero_()
        buf["pos"].copy_(pos, non_blocking=True)
        buf["offs"].copy_(torch.stack(offs, -1), non_blocking=True)      # [n_layer, 2, Bp]
        st.forwards += 1
        st.tokens += B
        if emb.device.name != dev.name:
            st.copy(emb.device.name, dev.name, x.numel() * 4)
        sync = (lambda: torch.cuda.synchronize(td)) if self.capture and st.profile else None
        with st.op("batch graph" if buf["graph"] is not None else "batch step", dev, sync):
            if buf["graph"] is None:
                logits = self._forward(buf["x"], True)
                if self.capture:
                    self._capture_bucket(buf)
            else:
                self._replay(buf)
                logits = buf["logits"]
            out = logits[:B].to("cpu")
            ids = buf["ids"][:, :B].to("cpu")
        st.copy(dev.name, "CPU", out.numel() * 4)
        moe = [i for i, lay in enumerate(self.layers) if "exps" in lay]
        return out, {i: int(torch.unique(ids[i]).numel()) for i in moe}

    def _replay(self, buf):
        """The bucket's graphs in order, the host-expert layers' rows run on the host between them."""
        stream = torch.cuda.current_stream(self.dev.torch_device)
        for graph, host in buf["graph"]:
            graph.replay()
            if host is not None:
                stream.synchronize()                    # the rows are in pinned memory
                self._host_rows(host, buf)

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
