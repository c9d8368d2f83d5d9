"""`hybridmoe.load(path, **options)`: file -> config -> placement -> weights -> decoder, in that order."""
from __future__ import annotations

import dataclasses
import gc
import os
import time

import torch

from . import env
from .config import ModelConfig
from .devices import list_devices
from .errors import HybridMoeError, ModelFileError, NonFiniteError, one_line, warn
from .formats.gguf import open_gguf
from .generate import Sampler, SamplerSettings, Timings, generate_ids
from .models.registry import build_decoder
from .placement.core import PlacementOptions, plan_placement
from .quant.dequant import SUPPORTED
from .quant.types import GGMLType
from .runtime.kvcache import KVCache
from .runtime.scheduler import Scheduler
from .runtime.steps import NonFinite, all_finite, build_step
from .runtime.weights import load_weights


@dataclasses.dataclass
class RuntimeOptions:
    threads: int | None = None
    offload_policy: str | None = None         # -op
    offload_only_active_experts: str = "auto"  # -ooae: auto | 0 | 1
    fused_moe: bool = True                     # -fmoe
    profile: bool = False
    check_fit: bool = True
    graphs: bool = True                        # static decode step, GPU segments as CUDA graphs
    check_tensors: bool = False                # --check-tensors: scan every tensor for NaN/inf at load



RUNTIME_ALIASES = {"t": "threads", "op": "offload_policy", "ooae": "offload_only_active_experts",
                   "fmoe": "fused_moe", "n_threads": "threads"}


def resolve_model_path(path: str) -> str:
    """`builtin` is the trained model shipped in the package; `synth:PRESET` makes (or reuses) a synthetic model
    file; anything else is a path."""
    if path == "builtin":
        from .models.builtin import builtin_path
        return builtin_path()
    if path.startswith("synth:"):
        from .models.synth import ensure_synth
        return ensure_synth(path[len("synth:"):])
    return path


def split_options(options: dict) -> tuple[PlacementOptions, RuntimeOptions]:
    runtime_names = {f.name for f in dataclasses.fields(RuntimeOptions)}
    rt, pl = {}, {}
    for k, v in options.items():
        k2 = RUNTIME_ALIASES.get(k, k)
        (rt if k2 in runtime_names else pl)[k2] = v
    if "offload_only_active_experts" in rt:
        v = rt["offload_only_active_experts"]
        rt["offload_only_active_experts"] = v if v == "auto" else bool(int(v)) if isinstance(v, str) else bool(v)
    return PlacementOptions.from_kwargs(**pl), RuntimeOptions(**rt)


class Model:
    def __init__(self, path: str, options: PlacementOptions, runtime: RuntimeOptions):
        t0 = time.perf_counter()
        self.path = resolve_model_path(str(path))
        self.options, self.runtime = options, runtime
        self.file = open_gguf(self.path)
        self.cfg = self._validate(runtime.check_tensors)
        from .text.tokenizer import Tokenizer
        self.tokenizer = Tokenizer.from_metadata(self.file.metadata, self.path, n_vocab=self.cfg.n_vocab)
        if not options.ctx_size:                              # -c 0: the training context, as llama.cpp
            self.options = options = dataclasses.replace(options, ctx_size=self.cfg.n_ctx_train)
        if options.ctx_size > self.cfg.n_ctx_train:          # llama.cpp warns the same
            warn(f"-c {options.ctx_size} is larger than the context the model was trained on ({self.cfg.n_ctx_train} "
                 f"tokens): past that its output may degrade; use -c {self.cfg.n_ctx_train} or less (-c 0: the model's)")
        devs = list_devices()
        self.devices = {d.name: d for d in devs}
        self.placement = plan_placement(self.file.tensors, self.cfg, options, devs)
        self._warn_slow_types()
        for w in dict.fromkeys(self.placement.warnings):      # -ngl without a GPU, split pairs, RAM over, ...
            warn(w)
        if runtime.check_fit:
            self.placement.check_fits()
        self.weights = load_weights(self.file, self.placement, self.devices)
        gpus = [d for d in devs if d.kind == "cuda"]
        main = None
        if gpus:
            main = self.devices.get(f"CUDA{options.main_gpu}", gpus[0])
        if runtime.threads:
            torch.set_num_threads(runtime.threads)
        from .perf.calibrate import load_cached
        rates = load_cached(runtime.threads) if gpus and not gpus[0].fake else None
        self.sched = Scheduler(self.devices, self.devices["CPU"], main, n_threads=runtime.threads,
                               profile=runtime.profile, rates=rates)
        self.set_policy(runtime.offload_policy, runtime.offload_only_active_experts, runtime.fused_moe)
        self.decoder = build_decoder(self.cfg, self.weights, self.sched)
        self._steps = {}                                      # "decode" / "prompt" -> (cache, its static step)
        self._step_gen = {"decode": 0, "prompt": 0}           # bumped: every cache's step of that kind is stale
        self._batch = None                                    # forward_batch's CPU step (False: none applies)
        self._free_cache = None
        self.load_seconds = time.perf_counter() - t0

    def _validate(self, check_all: bool) -> ModelConfig:
        """formats/validate.py's checks, before anything is sized by the file: the metadata (config), the
        tensors it implies (names, shapes, types), and NaN/inf in the small tensors (norms, biases, routers;
        every tensor with --check-tensors)."""
        from .formats import validate
        from .models.tensors import tensor_shapes
        f, path = self.file, self.path
        arch = f.metadata.get("general.architecture")
        for info in f.tensors.values():
            if info.qtype == GGMLType.MXFP4 and arch == "gpt-oss" and info.name.endswith("_exps.weight"):
                continue                 # gpt-oss's own expert type: the C kernels and quant/ref.py read it
            if info.qtype not in SUPPORTED:
                names = [t.name for t in SUPPORTED]
                raise ModelFileError(path, f"tensor {validate.key_text(info.name)} has type {info.qtype.name}, which "
                                     "hybridmoe cannot compute with yet",
                                     f"supported: {', '.join(names[:6])} and {len(names) - 6} more")
        embd = f.tensors.get("token_embd.weight")
        if embd is None or len(embd.shape) != 2:
            raise ModelFileError(path, "tensor token_embd.weight is missing or not 2-D",
                                 "the file is not a complete model")
        cfg = ModelConfig.from_metadata(f.metadata, path, n_vocab=embd.shape[0])
        validate.check_layer_count(f.tensors, cfg.n_layer, f"{cfg.arch}.block_count", path)
        validate.check_tensors(f.tensors, tensor_shapes(cfg), cfg.arch, cfg.n_layer, path, SUPPORTED)
        if check_all:
            validate.check_finite(f, list(f.tensors), path, "--check-tensors: the file is corrupt")
        else:
            small = [n for n, t in f.tensors.items() if validate.is_small(n, t.shape, t.nbytes)]
            validate.check_finite(f, small, path, "the file is corrupt; --check-tensors scans every tensor")
        return cfg

    def set_policy(self, offload_policy: str | None = None, only_active="auto", fused_moe: bool = True):
        """-op / -ooae / -fmoe on the loaded model (bench switches them without a reload)."""
        from .runtime.scheduler import parse_offload_policy
        rt = self.runtime
        if hasattr(self, "_steps") and (rt.offload_policy, rt.offload_only_active_experts, rt.fused_moe) == \
                (offload_policy, only_active, fused_moe):
            return                               # unchanged (bench sets them before every repetition): the
                                                 # prompt step keeps its captured graphs, the slots their uploads
        rt.offload_policy, rt.offload_only_active_experts, rt.fused_moe = offload_policy, only_active, fused_moe
        # --no-op-offload (llama.cpp's flag): host weights are never uploaded, whatever -op says
        self.sched.policy = parse_offload_policy("all,0" if not self.options.op_offload else offload_policy)
        self.sched.only_active = only_active
        self.sched.fused_moe = fused_moe
        self.sched.forget_uploads()
        if hasattr(self, "_steps"):              # (set at load, after this first call)
            self.drop_steps("prompt")            # an all-CPU prompt step depends on whether ops may offload

    @property
    def stats(self):
        return self.sched.stats

    def new_cache(self, n_ctx: int | None = None) -> KVCache:
        cfg = self.cfg
        if any(d.kind == "cuda" for d in self.devices.values()):
            # a dropped cache and its static steps refer to each other (the steps' graphs read its tensors):
            # collect them before a new cache takes their memory
            gc.collect()
        devs = [self.devices[self.placement.kv_device(i)] for i in range(cfg.n_layer)]
        if cfg.kv_lora_rank:                  # MLA: one compressed row per token: latent + shared roped key
            return KVCache(cfg.n_layer, n_ctx or self.options.ctx_size, 1, cfg.kv_lora_rank + cfg.rope_dim, devs,
                           self.options.cache_type_k, self.options.cache_type_v, head_dim_v=0)
        return KVCache(cfg.n_layer, n_ctx or self.options.ctx_size, cfg.n_head_kv, cfg.head_dim, devs,
                       self.options.cache_type_k, self.options.cache_type_v,
                       windows=[cfg.window(i) for i in range(cfg.n_layer)],
                       ubatch=min(self.options.ubatch_size, self.options.batch_size))

    def take_cache(self) -> KVCache:
        """A cache of the context size for one generation: the model's own unless another generation holds
        it (then a new one). Reused from one request to the next, as llama.cpp allocates its context once,
        so the static decode and prompt steps keep their CUDA graphs (they are per cache). Nothing needs
        clearing: a forward reads only the positions this generation wrote."""
        kv, self._free_cache = self._free_cache, None
        return kv if kv is not None else self.new_cache()

    def return_cache(self, kv: KVCache):
        self._free_cache = kv

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, pos0: int, kv: KVCache, all_logits: bool = True) -> torch.Tensor:
        """Logits of `tokens` [T] at positions pos0.. given what `kv` holds before pos0 ([T or 1, n_vocab] on
        the CPU); writes their keys and values and records them in kv.tokens."""
        kv.begin_write(pos0, tokens.shape[0])
        out = self._forward(tokens, pos0, kv, all_logits)
        if not all_finite(out):                               # cheap; the diagnostic pass only when they are bad
            raise NonFiniteError(self._nonfinite_message(tokens, pos0, kv))
        kv.end_write(pos0, tokens.tolist())
        return out

    @torch.inference_mode()
    def forward_batch(self, items, all_logits: bool = False) -> list[torch.Tensor]:
        """Several sequences in one pass: items [(tokens [T_i] int64, pos0_i, kv_i)], each kv_i its own cache (a
        server slot's). Returns what forward(tokens_i, pos0_i, kv_i, all_logits) would for each item (float32 on
        the CPU), the projections and experts over all items' tokens together (each expert read once), attention
        per item on its cache; T_i may differ. All on the CPU each item's logits are bit-identical to forward's
        alone (hm_batch_step); elsewhere they differ as the kernels' batch sizes make them (docs/server.md). The
        caller bounds sum T_i (llama-server's -b / -ub). stats.last_batch: sequences, tokens, distinct experts."""
        if not items:
            return []
        lists = self._check_batch(items)
        for tokens, pos0, kv in items:
            kv.begin_write(pos0, int(tokens.shape[0]))
        t0 = time.perf_counter()
        out, routed = self._forward_batch(items, all_logits)          # [sum T_i or B, n_vocab]
        if self.runtime.profile:
            self.stats.wall[0] += time.perf_counter() - t0
        sizes = [int(t.shape[0]) for t, _, _ in items]
        outs = list(out.split(sizes if all_logits else 1))
        if not all_finite(out):
            j = next(j for j, o in enumerate(outs) if not all_finite(o))
            raise NonFiniteError(self._nonfinite_message(*items[j]))
        for (_, pos0, kv), ids in zip(items, lists):
            kv.end_write(pos0, ids)
        self.stats.last_batch = {"sequences": len(items), "tokens": sum(sizes),
                                 "distinct_experts": sum(routed.values()) / len(routed) if routed else None,
                                 "distinct_per_layer": routed}
        return outs

    @torch.inference_mode()
    def decode_batch(self, tokens: list[int], pos: list[int], kvs: list[KVCache], argmax: bool = False,
                     host_logits: bool = True):
        """forward_batch for one decode token a sequence, given as lists: token ids, their positions and the
        sequences' caches (each its own). Returns their logits [B, n_vocab] (row j: what forward(tokens[j], pos[j],
        kvs[j]) gives), with `argmax` (logits, each row's argmax as a list: the greedy tokens); a server's decode
        step, with little Python a sequence where the CPU batch step runs it: the caches' records are made (and
        the caches checked) when the batch's caches change, the ids and positions checked by the C step, and
        explained here when it refuses them. host_logits=False: the logits may stay on the GPU (the step's buffer,
        valid until the next step), for a caller that reads a few rows or none beside the argmax."""
        if not (len(tokens) == len(pos) == len(kvs)) or not tokens:
            raise HybridMoeError("decode_batch: give as many tokens, positions and caches, at least one")
        step = self._batch if len(tokens) > 1 else None
        fast = getattr(step, "decode_batch", None) if step else None
        if fast is not None and not step.same_batch(kvs):
            self._check_sequences("decode_batch", [[t] for t in tokens], pos, kvs)
        t0 = time.perf_counter()
        res = self._decode_call(lambda: fast(tokens, pos, kvs, host_logits), tokens, pos, kvs) \
            if fast is not None else None
        if res is None:
            self._check_sequences("decode_batch", [[t] for t in tokens], pos, kvs)
            out = torch.cat(self.forward_batch([(torch.tensor([t]), p, kv) for t, p, kv in zip(tokens, pos, kvs)]))
            return (out, out.argmax(-1).tolist()) if argmax else out
        out, top = self._decoded(res, tokens, pos, kvs, t0)
        return (out, top) if argmax else out

    @torch.inference_mode()
    def decode_batch_async(self, tokens: list[int], pos: list[int], kvs: list[KVCache]):
        """decode_batch(argmax=True, host_logits=False) in two halves: where queues_decode and the caches are the
        step's last batch's, the step is queued now and the returned function waits for it and returns what
        decode_batch would (the caches' records made then, no other step on them before). None elsewhere."""
        step = self._batch
        if len(tokens) < 2 or not self.queues_decode or not len(tokens) == len(pos) == len(kvs) or \
                not step.same_batch(kvs):
            return None
        t0 = time.perf_counter()
        launched = self._decode_call(lambda: step.decode_launch(tokens, pos, kvs, False), tokens, pos, kvs)

        @torch.inference_mode()
        def finish():
            return self._decoded(self._decode_call(lambda: step.decode_finish(launched), tokens, pos, kvs),
                                 tokens, pos, kvs, t0)
        return finish if launched is not None else None

    @property
    def queues_decode(self) -> bool:
        """Whether decode_batch_async may queue a step: the GPU batch step, built, without host experts (their rows
        would run in the queueing thread: nothing to overlap)."""
        return getattr(self._batch, "decode_launch", None) is not None and not self._batch.host

    def _decode_call(self, fn, tokens, pos, kvs):
        """fn() of a batch step's decode (None: it did not run), failures explained: an id or position out of range
        named, non-finite logits a NonFiniteError; the records of the step's positions dropped where it failed."""
        try:
            return fn()
        except IndexError:                              # nothing ran: say which id or position
            self._check_sequences("decode_batch", [[t] for t in tokens], pos, kvs)
            raise
        except Exception as e:                          # the caches hold this step's keys, but no record of them
            for p, kv in zip(pos, kvs):
                kv.begin_write(p, 1)
            if isinstance(e, NonFinite):
                j = next(j for j in range(len(tokens)) if not all_finite(e.out[j]))
                raise NonFiniteError(self._nonfinite_message(torch.tensor([tokens[j]]), pos[j], kvs[j])) from None
            raise

    def _decoded(self, res, tokens, pos, kvs, t0: float):
        """(logits, argmax) of a batch step's decode result, the caches' records and the batch's stats made."""
        if self.runtime.profile:
            self.stats.wall[0] += time.perf_counter() - t0
        out, distinct, top = res
        for t, p, kv in zip(tokens, pos, kvs):
            kv.wrote(p, t)
        routed = {i: distinct[i] for i in self._moe_layers()}
        self.stats.last_batch = {"sequences": len(tokens), "tokens": len(tokens),
                                 "distinct_experts": sum(routed.values()) / len(routed) if routed else None,
                                 "distinct_per_layer": routed}
        return out, top

    def _check_batch(self, items) -> list[list[int]]:
        """A clear error for a batch forward_batch can't run, before any cache is touched; each item's token ids
        (checked in Python: a decode step's few ids cost less so than as tensor ops)."""
        for j, item in enumerate(items):
            if not (isinstance(item, (tuple, list)) and len(item) == 3):
                raise HybridMoeError(f"forward_batch item {j}: expected (tokens, pos0, kv), got {type(item).__name__}")
            tokens = item[0]
            if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.shape[0] < 1 or \
                    tokens.is_floating_point():
                raise HybridMoeError(f"forward_batch item {j}: tokens must be a non-empty 1-D integer tensor")
        lists = [t.tolist() for t, _, _ in items]
        self._check_sequences("forward_batch", lists, [int(p) for _, p, _ in items], [kv for _, _, kv in items])
        return lists

    def _check_sequences(self, what: str, ids: list[list[int]], pos: list[int], kvs: list) -> None:
        """Sequence j's ids at pos[j].. in kvs[j]: each its own cache, a position >= 0 with room for the ids, ids in
        the vocabulary; else a clear error naming the sequence."""
        seen, n = set(), self.cfg.n_vocab
        for j, kv in enumerate(kvs):
            if not isinstance(kv, KVCache) or id(kv) in seen:
                raise HybridMoeError(f"{what} item {j}: each item needs its own KV cache (model.new_cache)")
            seen.add(id(kv))
            if pos[j] < 0:
                raise HybridMoeError(f"{what} item {j}: position {pos[j]} is negative")
            kv.check_fits(pos[j], len(ids[j]))
        for j, t in enumerate(ids):
            if min(t) < 0 or max(t) >= n:
                raise HybridMoeError(f"{what} item {j}: a token id is not in the vocabulary (0..{n - 1})")

    def _forward_batch(self, items, all_logits: bool):
        """(logits of the batch's rows on the CPU, item after item, {MoE layer: distinct experts the batch routed
        to}) by the CPU batch step where it applies, else the eager decoder over the whole batch (a single item:
        forward's own path)."""
        step = self._batch_step(items)
        parts = self._split_parts(items) if step is None else None
        if parts is not None:
            return self._forward_split(items, parts, all_logits)
        if step is not None:
            try:
                out, distinct = step.forward_batch(items, all_logits)
            except Exception as e:                      # noqa: BLE001 - first use only, then eager for good
                if step.worked:
                    raise
                from .errors import warn_fallback
                warn_fallback("the CPU batch step", e, "running batches with the eager path")
                self._batch = False
            else:
                step.worked = True
                return out, {i: distinct[i] for i in self._moe_layers()}
        self.sched.routing = {}
        try:
            if len(items) == 1:
                tokens, pos0, kv = items[0]
                out = self._forward(tokens, int(pos0), kv, all_logits)
            else:
                # a sliding-window ring holds one ubatch of new tokens: a longer chunk runs on its own, split
                alone = {j for j, (t, _, kv) in enumerate(items) if t.shape[0] > kv.ubatch and any(kv.windows)}
                rest = [it for j, it in enumerate(items) if j not in alone]
                out = self.decoder.forward_batch([(t, int(p), kv) for t, p, kv in rest], all_logits).to("cpu") \
                    if rest else None
                if alone:
                    rows = list(out.split([t.shape[0] if all_logits else 1 for t, _, _ in rest])) if rest else []
                    rows.reverse()
                    out = torch.cat([self._forward(t, int(p), kv, all_logits) if j in alone else rows.pop()
                                     for j, (t, p, kv) in enumerate(items)])
            routing = self.sched.routing
        finally:
            self.sched.routing = None
        if not routing and len(items) == 1 and items[0][0].shape[0] == 1:
            k = self.cfg.n_expert_used                  # a static decode step: one token routes to k experts
            return out, {i: k for i in self._moe_layers()}
        return out, {i: int(torch.unique(ids).numel()) for i, ids in routing.items()}

    def _split_parts(self, items) -> list[list[int]] | None:
        """Where a batch of decode tokens and prompt chunks runs as several (its items' indices, part after part),
        not as one eager pass (Python launching every op of every layer: ~10x a captured step with every weight
        on a GPU): with the GPU batch step, the items it takes as rows (chunks up to its max_chunk) in it and each
        longer chunk through its cache's prompt step (together in one eager pass where host experts may be
        uploaded for them: once for all); elsewhere the decode tokens through a batch step (or the static decode
        step, one alone) and the prompt chunks through the prompt path. None: one pass."""
        sizes = [int(t.shape[0]) for t, _, _ in items]
        if len(items) < 2 or not self.runtime.graphs:
            return None
        step = self._batch_for(items[0][2], max(sizes) == 1)
        rows = getattr(step, "max_chunk", 0)
        if rows:
            if not all(step.accepts(kv) for _, _, kv in items):
                return None
            small = [j for j, n in enumerate(sizes) if n <= rows]
            big = [j for j, n in enumerate(sizes) if n > rows]
            parts = ([small] if small else []) + ([big] if step.host else [[j] for j in big])
            return parts if len(parts) > 1 else None
        if min(sizes) > 1 or max(sizes) == 1:
            return None
        dec = [j for j, n in enumerate(sizes) if n == 1]
        chunks = [j for j, n in enumerate(sizes) if n > 1]
        if len(dec) == 1:                                  # (a placement without a static step: one eager pass)
            ok = self._step_for("decode", items[dec[0]][2]) is not None
        else:
            ok = self._batch_step([items[j] for j in dec]) is not None
        return [dec, chunks] if ok else None

    def _forward_split(self, items, parts: list[list[int]], all_logits: bool):
        """_forward_batch's result for a batch split by _split_parts: the rows item after item, each layer's
        distinct experts summed over the parts (what the step read)."""
        sizes = [int(t.shape[0]) for t, _, _ in items]
        rows, routed = [None] * len(items), {}
        for idx in parts:
            out, r = self._forward_batch([items[j] for j in idx], all_logits)
            for j, o in zip(idx, out.split([sizes[j] if all_logits else 1 for j in idx])):
                rows[j] = o
            for i, n in r.items():
                routed[i] = routed.get(i, 0) + n
        return torch.cat(rows), routed

    def _moe_layers(self) -> list[int]:
        if getattr(self, "_moe_ids", None) is None:
            self._moe_ids = [L.i for L in self.decoder.layers if L.ffn_gate_inp is not None]
        return self._moe_ids

    def _batch_step(self, items):
        """The batch step that runs these items (decode tokens, and chunks of up to the GPU step's max_chunk
        tokens), or None: one decode token alone takes the static decode step, and elsewhere batches with prompt
        chunks take the eager path where a GPU may take host weights' ops (op offload, as build_step decides for
        prompts)."""
        from .runtime.steps import may_offload
        sizes = [int(t.shape[0]) for t, _, _ in items]
        single = max(sizes) == 1
        step = self._batch_for(items[0][2], single)
        if step is None:
            return None
        rows = getattr(step, "max_chunk", 0)
        if rows:
            if max(sizes) > rows or (len(items) == 1 and single):
                return None
        elif not single and may_offload(self):
            return None
        return step if all(step.accepts(kv) for _, _, kv in items) else None

    def batch_rows(self, kv) -> tuple[int, tuple[int, ...]]:
        """(the longest prompt chunk the batched step takes as rows for caches like kv, the row counts its steps
        run in): the GPU batch step's max_chunk and row_buckets, the step built now if it was not; (0, ()) where
        prompt chunks do not run as its rows."""
        step = self._batch_for(kv, True)
        ok = step is not None and getattr(step, "max_chunk", 0) and step.accepts(kv)
        return (step.max_chunk, step.row_buckets) if ok else (0, ())

    def _batch_for(self, kv0, single: bool):
        """self._batch, built at first use for caches like kv0: the CPU batch step (runtime/steps/cpu_decode.py)
        when every weight and the cache are on the CPU and it covers the model (not built for a first batch with
        prompt chunks a GPU may take), the GPU one (runtime/steps/gpu_batch.py) when every weight but host experts
        and the cache are on one GPU; None where none applies."""
        if not self.runtime.graphs or self._batch is False:
            return None
        if self._batch is None:
            from .runtime.steps import may_offload
            from .runtime.steps.base import NotApplicable
            if all(d.kind == "cpu" for d in kv0.devs):
                if not single and may_offload(self):
                    return None
                from .runtime.steps.cpu_decode import CpuDecoder as Step
            else:
                from .runtime.steps.gpu_batch import BatchDecode as Step
            try:
                self._batch = Step(self, kv0)
            except NotApplicable:
                self._batch = False
                return None
        return self._batch

    def _nonfinite_message(self, tokens: torch.Tensor, pos0: int, kv: KVCache) -> str:
        """Why the logits were not finite: the first layer whose output is not, found by running the tokens
        (one ubatch of them) once more through the eager path with every layer's output checked."""
        cfg = self.cfg
        found = []

        def watch(i, x):
            if not found and not bool(torch.isfinite(x).all()):
                found.append(i)
                raise _Stop
        try:
            self.decoder.forward(tokens[:kv.ubatch], pos0, kv, all_logits=False, watch=watch)
        except _Stop:
            pass
        except Exception:                                   # noqa: BLE001 - the diagnosis is best effort
            pass
        if not found:
            where = "in the output layer (output_norm, output), every layer's output being finite"
        elif found[0] < 0:
            where = "in the token embeddings (token_embd.weight)"
        else:
            where = f"first in the output of layer {found[0]} of {cfg.n_layer} (blk.{found[0]}.*)"
        return one_line(f"{os.path.basename(self.path)}: the model computed non-finite values (NaN or inf) {where}; "
                        "generation stopped (corrupt or overflowing weights: --check-tensors scans them at load)")

    def _forward(self, tokens: torch.Tensor, pos0: int, kv: KVCache, all_logits: bool) -> torch.Tensor:
        T = tokens.shape[0]
        if T > kv.ubatch and any(kv.windows):          # a sliding-window ring holds one ubatch of new tokens
            outs = [self._forward(tokens[i:i + kv.ubatch], pos0 + i, kv, all_logits) for i in range(0, T, kv.ubatch)]
            return torch.cat(outs) if all_logits else outs[-1]
        t0 = time.perf_counter()
        out = None
        if T == 1:
            out = self._run_step("decode", kv, lambda step: step.step(int(tokens[0]), pos0))
        elif T > 1:
            out = self._run_step("prompt", kv, lambda step: step.forward(tokens, pos0, all_logits))
        if out is None:
            out = self.decoder.forward(tokens, pos0, kv, all_logits).to("cpu")
        if self.runtime.profile:
            self.stats.wall[T == 1] += time.perf_counter() - t0
        return out

    def _run_step(self, which: str, kv, run):
        """run(step) on this cache's static decode or prompt step; None where there is none, or where it failed
        at its first use (a warning, and the eager path for this cache from then on)."""
        step = self._step_for(which, kv)
        if step is None:
            return None
        try:
            out = run(step)
        except Exception as e:                          # noqa: BLE001 - first use only, then eager for good
            if step.worked:
                raise
            from .errors import warn_fallback
            warn_fallback(f"the static {which} step", e, "running it with the eager path")
            kv.static_steps[which] = (self._step_gen[which], None)
            self._steps[which] = (kv, None)
            return None
        step.worked = True
        return out

    def slow_tensors(self) -> dict[str, list[str]]:
        """Type name -> tensors of that type that no fast kernel reads yet where they live: they compute through
        the reference dequantizer (correct, slow). On a real GPU, the one-pass dequantizing kernels count; on the
        CPU, the C kernels (an _R4 / _R8 type's through its base type: repacked at load)."""
        from .kernels.cpu import kernel_type
        from .kernels.gpu_dequant import has_kernel
        out: dict[str, list[str]] = {}
        for info in self.file.tensors.values():
            if len(info.shape) < 2 or kernel_type(info.qtype) is not None:
                continue
            dev = self.devices.get(self.placement.device_of.get(info.name, "CPU"))
            if dev is not None and dev.kind == "cuda" and not dev.fake and has_kernel(info.qtype):
                continue
            out.setdefault(info.qtype.name, []).append(info.name)
        return out

    def _warn_slow_types(self) -> None:
        from .kernels.cpu import kernel_names
        from .kernels.gpu_dequant import kernel_types
        slow = self.slow_tensors()
        if slow:
            what = ", ".join(f"{len(v)} {t}" for t, v in sorted(slow.items()))
            cpu = kernel_names()
            gpu = ", ".join(t.name for t in kernel_types())
            warn(f"{what} tensors have no fast kernel yet: they run through the reference dequantizer (slow); "
                 f"the fast kernels read {cpu}" + (f" (on a GPU also {gpu})" if gpu else ""))

    def _step_for(self, which: str, kv):
        """The static "decode" or "prompt" step of this cache, built at its first use and kept with the cache
        (a server's slots each keep theirs: a request on another slot does not capture the graphs again), or
        None where the placement or architecture has none: the eager path runs then."""
        if not self.runtime.graphs:
            return None
        gen = self._step_gen[which]
        held = kv.static_steps.get(which)
        if held is None or held[0] != gen:
            held = kv.static_steps[which] = (gen, build_step(self, kv, which))
        self._steps[which] = (kv, held[1])
        return held[1]

    def drop_steps(self, which: str | None = None):
        """Forget the static steps ("decode", "prompt" or both) of every cache: built again at next use."""
        for w in ([which] if which else list(self._step_gen)):
            self._step_gen[w] += 1
            self._steps.pop(w, None)

    def static_step(self, which: str):
        """The static step used last for "decode" or "prompt" (None: none yet, or the eager path)."""
        return self._steps.get(which, (None, None))[1]

    def warmup(self, prompt_sizes: bool = False) -> float:
        """llama.cpp's warm-up: a two-token prompt and one decode step, so that the kernels (the C build, Triton's
        compiles) and the decode step's graphs are ready before the first real prompt and its timings; with
        prompt_sizes (a server's) also a prompt of each size whose GPU MoE kernels compile apart
        (experts.kernel_variants, up to -ub), so no request pays seconds of compiling. The cache is left empty and
        the statistics reset. Returns the seconds it took."""
        t0 = time.perf_counter()
        tok = self.tokenizer
        first = tok.bos_id if tok.bos_id is not None else 0
        kv = self.take_cache()
        try:
            self.forward(torch.tensor([first, first]), 0, kv, all_logits=False)
            self.forward(torch.tensor([first]), 2, kv, all_logits=False)
            for T in self._warmup_sizes(kv) if prompt_sizes else []:
                self.forward(torch.full((T,), first), 0, kv, all_logits=False)
            self.sync()
        finally:
            kv.tokens.clear()
            self.return_cache(kv)
        self.stats.reset()
        return time.perf_counter() - t0

    def _warmup_sizes(self, kv) -> list[int]:
        """Prompt sizes for warmup(prompt_sizes=True): one a GPU MoE kernel variant (none without a GPU, or
        without experts), each within a ubatch and the cache."""
        L = next((L for L in self.decoder.layers if L.ffn_gate_inp is not None), None)
        if L is None or not any(d.kind == "cuda" and not d.fake for d in kv.devs + [L.ffn_gate_exps.device]):
            return []
        from .runtime.experts import kernel_variants
        g, d = L.ffn_gate_exps, L.ffn_down_exps
        on_gpu = g.device.kind == "cuda"
        sizes = kernel_variants(min(kv.ubatch, kv.n_ctx), self.cfg.n_expert_used, self.cfg.n_expert,
                                  (g.qtype, L.ffn_up_exps.qtype, d.qtype), on_gpu and g.split and d.split)
        return [T for T in sizes if T > 2]

    def decode_share(self) -> tuple[int, int]:
        """(g, k): the decode step's GPU runs g of each CPU-expert layer's k experts itself, read over the bus
        (runtime/steps/gpu_decode.py); g = 0 where it does not (or no decode step was built yet)."""
        step = self.static_step("decode")
        hk = getattr(step, "hk", None)
        return (hk.share if hk is not None else 0), self.cfg.n_expert_used

    def sync(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    @torch.inference_mode()
    def logits(self, token_ids) -> torch.Tensor:
        """float32 logits [n_tokens, n_vocab] for every position, from an empty context."""
        ids = [int(t) for t in token_ids]
        kv = self.new_cache(max(len(ids), 1))
        ub = self.options.ubatch_size
        outs = [self.forward(torch.tensor(ids[i:i + ub], dtype=torch.long), i, kv) for i in range(0, len(ids), ub)]
        return torch.cat(outs).float()

    def generate(self, prompt: str | list[int], max_tokens: int = 128, temperature: float = 0.8, seed: int = -1,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, chat: bool = False,
                 timings: Timings | None = None, cache_prompt: bool = True, json_schema=None, grammar=None,
                 template_kwargs: dict | None = None, **penalties):
        """Yield text pieces as they are generated. With `cache_prompt`, a prompt that starts as the previous
        generation's prompt and output did runs only from where they part (the KV cache is kept). `json_schema`
        (a schema, or True for any JSON): the reply is JSON it accepts (constrain/; after the thoughts when
        the prompt opened a <think> block); `grammar` (GBNF text or a grammar.Grammar): text it accepts.
        `penalties`: SamplerSettings' repeat_penalty, presence_penalty, frequency_penalty, repeat_last_n,
        logit_bias. `template_kwargs`: chat template variables (with chat=True)."""
        from .constrain.grammar import GrammarMachine
        from .constrain.json_machine import JsonMachine
        from .constrain.tokens import THINK_END, TokenConstraint
        from .text.replies import THINK_OPEN
        tok = self.tokenizer
        text = None
        if isinstance(prompt, str):
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], **(template_kwargs or {})) \
                if chat else prompt
            ids = tok.encode(text)
        else:
            ids = list(prompt)
        if not ids:
            raise HybridMoeError("the prompt is empty after tokenization; give a non-empty prompt")
        if len(ids) >= self.options.ctx_size:
            raise HybridMoeError(f"the prompt has {len(ids)} tokens but the context is {self.options.ctx_size}; raise -c")
        if max_tokens < 0:                                    # llama.cpp's -n -1: until the end or a full context
            max_tokens = self.options.ctx_size - len(ids)
        constraint = None
        if json_schema is not None or grammar is not None:
            if text is None:
                text = tok.decode(ids)
            trigger = THINK_END if text.rstrip().endswith(THINK_OPEN) else None
            machine = JsonMachine(json_schema) if grammar is None else GrammarMachine(grammar, tok)
            constraint = TokenConstraint(machine, tok, tok.eos_ids, trigger)
        sampler = Sampler(SamplerSettings(temperature, top_k, top_p, min_p, seed, **penalties), constraint)
        timings = timings if timings is not None else Timings()
        stream = tok.stream()
        for t in generate_ids(self, ids, max_tokens, sampler, timings, stop_ids=tok.eos_ids,
                              cache_prompt=cache_prompt):
            piece = stream.add(t)
            if piece:
                yield piece
        tail = stream.flush()
        if tail:
            yield tail


class _Stop(Exception):
    """Ends the diagnostic pass at the first non-finite layer output."""


def load(path, **options) -> Model:
    """Load a model. Options are the CLI's long names with underscores (n_gpu_layers, override_tensor, ...)."""
    pl, rt = split_options(options)
    if env.get("HYBRIDMOE_PROFILE") == "1":
        rt.profile = True
    return Model(path, pl, rt)
