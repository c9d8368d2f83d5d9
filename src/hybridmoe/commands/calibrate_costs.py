"""`hybridmoe calibrate`'s second half: the costs that are not bandwidth (perf/costs.py), measured here because
measuring them runs the runtime (perf/ never imports runtime/; the planner only reads the results).

1. Micro-benchmarks of the C expert kernel: its fixed cost per call (T=1 on weights that stay in cache) and the
   rate it streams a decode step's experts from RAM (T=1 over a pool of layers far larger than L3); per GPU, of
   the copies to and from pageable host memory, and of the CPU attention the eager offloaded path runs.
2. The runtime's own steps on two calibration models that differ only in their number of layers (2 and 8;
   --quick: 1 and 3, small shapes): the full models have Qwen3-30B-A3B's layer (hidden 2048, 32/4 heads of
   128, 128 experts of 768, 8 used; Q4_0 experts, Q8_0 the rest) and a small vocabulary. Per placement
   (`-ngl 0`; per GPU `-ngl 99` with and without graphs, and `-ngl 99 -ot exps=CPU`), a decode step and a
   prompt ubatch are timed on both (and, per GPU, `-ngl 0`'s prompt, which offloads to it); the difference per
   layer and the intercept, minus what placement/predict.py
   computes for the same placement from the rates alone, are the per-layer and per-step costs. So the
   calibration models are predicted exactly by construction, and other models through their bytes and FLOPs.
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time

import torch

from ..perf.costs import fit_line, floor_or_scale
from ..perf.roofline import touched_fraction
from ..runtime.experts import kernels

FULL = dict(arch="qwen3moe", n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_vocab=8192, n_ctx_train=8192,
            rms_eps=1e-6, rope_base=1e6, n_expert=128, n_expert_used=8, n_ff_exp=768)
QUICK = dict(arch="qwen3moe", n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_vocab=1024, n_ctx_train=4096,
             rms_eps=1e-6, rope_base=1e6, n_expert=16, n_expert_used=4, n_ff_exp=256)
CALIB_VERSION = 2
CALIB_DEPTH = 48        # the residual branches scaled as in synth:qwen3-30b-a3b's 48 layers (models/synth.py)


# ---------------------------------------------------------------------------------- the C kernel alone

def _median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_costs(quick: bool = False) -> dict[str, float]:
    """{"call_s", "stream_bw"} of the C expert kernel at T=1 (Q4_0), or {} without it."""
    k = kernels()
    if k is None:
        return {}
    from ..quant.ref import random_blocks
    from ..quant.types import GGMLType
    q = GGMLType.Q4_0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 256, generator=g)
    small = [random_blocks(q, (8, 64, 256), g), random_blocks(q, (8, 64, 256), g), random_blocks(q, (8, 256, 64), g)]
    ids = torch.tensor([[0, 1]], dtype=torch.int32)
    wts = torch.full((1, 2), 0.5)
    call = min(_median_time(lambda: k.moe_ffn(x, ids, wts, *small, q, q), 200) for _ in range(3))
    return {"call_s": call, "stream_bw": stream_rate_now(call, quick)}


def stream_rate_now(call_s: float, quick: bool = False) -> float | None:
    """The C expert kernel's streaming rate now (bytes/s), by calibrate's own sweep, or None without the kernel:
    plan --check predicts with it (a VM's RAM rate moves between calls, and a torch.sum probe's rate did not
    move with the kernel's: on the lent H100 VM 107.5 GB/s at one check against 85.2 at calibrate, while the
    kernel's experts decoded as at calibrate); calibrate measures `stream_bw` by it. quick: calibrate --quick's
    pool (3 layers); either at most a quarter of the memory available."""
    k = kernels()
    if k is None:
        return None
    from ..perf.calibrate import _host_ram
    _, avail = _host_ram()
    n = max(3, min(3 if quick else STREAM_LAYERS, avail // 4 // STREAM_LAYER_BYTES))
    return _stream_rate(k, call_s, n, 2 if quick else 9)


STREAM_LAYERS = 48                      # the streaming pool's layers (4 GB: a 300 MiB L3 holds under a tenth)
POOL_E, POOL_F, POOL_H, POOL_USED = 32, 768, 2048, 8     # a pool layer: 32 Qwen3-30B-A3B experts, 8 a call
STREAM_LAYER_BYTES = 3 * POOL_E * POOL_F * POOL_H * 18 // 32            # (Q4_0: 18 bytes a 32-block)


def _stream_rate(k, call: float, n_layers: int, reps: int) -> float:
    """Bytes/s the C kernel streams a decode step's experts at T=1: a pool of n_layers layers of 32 Qwen3-30B-A3B
    experts (Q4_0), 8 random experts of one layer a call, layer after layer as a decode step reads them, less
    the kernel's fixed cost per call; the faster of two medians of `reps` sweeps (a full pool's sweep reads 2 GB
    in ~25 ms on the H100 VM: one sweep alone is at the mercy of a moment's noise)."""
    from ..quant.ref import random_blocks
    from ..quant.types import GGMLType
    q = GGMLType.Q4_0
    g = torch.Generator().manual_seed(1)
    E, F, H, used = POOL_E, POOL_F, POOL_H, POOL_USED
    base = [random_blocks(q, (E, F, H), g), random_blocks(q, (E, F, H), g), random_blocks(q, (E, H, F), g)]
    pool = [[w.clone() for w in base] for _ in range(n_layers)]
    per_expert = sum(w[0].numel() for w in base)
    xs = torch.randn(1, H, generator=g)
    w8 = torch.full((1, used), 1.0 / used)
    picks = [torch.randperm(E, generator=g)[:used].to(torch.int32)[None] for _ in range(2 * n_layers)]

    def sweep():
        for i, ids_ in enumerate(picks):
            lay = pool[i % n_layers]
            k.moe_ffn(xs, ids_, w8, lay[0], lay[1], lay[2], q, q)
    secs = min(_median_time(sweep, reps) for _ in range(2))
    return used * per_expert * len(picks) / max(secs - len(picks) * call, 1e-9)


def link_costs(index: int | None, nbytes: int, sync_s: float, reps: int = 5) -> dict[str, float]:
    """{"pageable_h2d_bw", "d2h_bw"}: bytes/s of the copies the eager offloaded path makes, between CUDA GPU
    `index` and pageable host memory (activations, memory-mapped matrices), less the sync round trip `sync_s`
    that the model counts per copy down. index None (a fake GPU, host memory): a plain copy in RAM."""
    host = torch.ones(nbytes // 4)
    if index is None or not torch.cuda.is_available():
        up = down = _median_time(lambda: host.clone(), reps)
    else:
        dev = torch.device("cuda", index)
        gpu = torch.ones(nbytes // 4, device=dev)
        up = _median_time(lambda: (host.to(dev, non_blocking=True), torch.cuda.synchronize(dev)), reps)
        down = _median_time(lambda: gpu.to("cpu"), reps)
        del gpu
    return {"pageable_h2d_bw": nbytes / max(up, 1e-9), "d2h_bw": nbytes / max(down - sync_s, 0.5 * down, 1e-9)}


def cpu_attention_flops(cfg, T: int, depth: int, reps: int = 3) -> float:
    """FLOP/s of a prompt's attention on the CPU as the eager path runs it (models/decoder.attend: torch SDPA on
    the f16 cache), from one ubatch of T tokens after `depth` cached ones against one at depth 0, so that the
    per-call part stays in the layer's floor."""
    from ..models.decoder import attend
    g = torch.Generator().manual_seed(5)

    def secs(p0):
        q = torch.randn(T, cfg.n_head, cfg.head_dim, generator=g)
        kv = [torch.randn(cfg.n_head_kv, p0 + T, cfg.head_dim, generator=g).half() for _ in range(2)]
        return _median_time(lambda: attend(q, kv[0], kv[1], p0), reps)
    s0, sD = secs(0), secs(depth)
    extra = _attn_flops(cfg, T, depth) - _attn_flops(cfg, T, 0)
    if sD > s0:
        return extra / (sD - s0)
    return _attn_flops(cfg, T, depth) / max(sD, 1e-9)        # (noise: the rate of the deeper call)


# ---------------------------------------------------------------------------------- calibration models

def _oai_shape(quick: bool) -> dict:
    """gpt-oss's block for its own decode and prompt costs (its steps are not the fused layer's): tiny-gpt-oss's
    shape, or gpt-oss-20b's layer, all 32 experts (a prompt's ubatch then routes as many tokens to each as in
    gpt-oss-20b, which sets its MoE GEMMs' rate), with a small vocabulary."""
    from ..models.synth import PRESETS
    p = {k: v for k, v in PRESETS["tiny-gpt-oss" if quick else "gpt-oss-20b"].items()
         if k not in ("expert_type", "other_type", "n_layer")}
    return p if quick else {**p, "n_vocab": 8192}


def calibration_model(n_layer: int, quick: bool, arch: str = "qwen3moe") -> str:
    """Path of a calibration model (written once into $HYBRIDMOE_CACHE/models): random weights per layer, as
    models/synth.py writes them for a 48-layer stack (CALIB_DEPTH), so that a prompt's ubatch routes to as many
    experts in each layer as in synth:qwen3-30b-a3b (and, spread, in a trained model). Layers sharing one random
    tensor per shape drive every token's hidden state toward one direction (a 512-token ubatch reaches 121
    distinct experts a layer at 2 layers, 40 at 8), and prompt costs fitted on them are those of a few busy
    experts. arch "gpt-oss": _oai_shape's block, MXFP4 experts as gpt-oss ships them."""
    import tempfile

    from .. import env
    from ..config import ModelConfig
    from ..formats.gguf_write import write_gguf
    from ..models.synth import config_metadata, synth_tensors
    from ..quant.types import GGMLType
    from ..text.builtin_vocab import builtin_vocab_metadata
    oai = arch == "gpt-oss"
    shape = _oai_shape(quick) if oai else QUICK if quick else FULL
    d = env.cache_dir() / "models"
    d.mkdir(parents=True, exist_ok=True)
    kind = f"oss-e{shape['n_expert']}-" if oai else ""
    path = d / f"calibration-{kind}{'quick' if quick else 'full'}-{n_layer}-v{CALIB_VERSION}.gguf"
    if path.exists():
        return str(path)
    cfg = ModelConfig(**shape, n_layer=n_layer, qk_norm=not oai, rope_neox=True, name=f"calibration-{n_layer}")
    md = {"general.name": cfg.name, "general.type": "model", **config_metadata(cfg),
          **builtin_vocab_metadata(cfg.n_vocab)}
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".part")
    os.close(fd)
    try:
        write_gguf(tmp, cfg.arch, md, synth_tensors(cfg, GGMLType.MXFP4 if oai else GGMLType.Q4_0, GGMLType.Q8_0,
                                                      seed=1234, depth=CALIB_DEPTH))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(path)


# ---------------------------------------------------------------------------------- timing the runtime

def _time_tg(model, n: int, reps: int) -> float:
    """Seconds per decode step (n steps from position 0), median of reps after a warm-up."""
    from .bench import prepare_test
    once = prepare_test(model, 0, n, 0, 7)
    return _median_time(lambda: once(n), reps) / n


def _time_pp(model, T: int, reps: int, depth: int = 0) -> float:
    """Seconds of one ubatch of T tokens at position `depth` (the cache filled before, untimed)."""
    from .bench import prepare_test
    model.options.ubatch_size = T
    model.options.batch_size = max(model.options.batch_size, T)
    once = prepare_test(model, T, 0, depth, 11)
    once(0)                                     # a second untimed run: a full ubatch is captured at its second

    def run():
        # a model of one or two MoE layers would find them still in the two upload slots from the run before
        # and upload nothing; a model of many layers never does
        model.sched.forget_uploads()
        once(0)
    return _median_time(run, reps)


def _eager(model, on: bool):
    model.runtime.graphs = not on
    model.drop_steps()


def _with(rates, costs):
    return dataclasses.replace(rates, costs={k: dict(v) for k, v in costs.items()})


def _fit(measured: tuple[float, float], modelled: tuple[float, float], layers: tuple[int, int]):
    """(per-layer floor, per-step floor) from two models' measured and modelled seconds."""
    sm, im = fit_line(layers[0], measured[0], layers[1], measured[1])
    sr, ir = fit_line(layers[0], modelled[0], layers[1], modelled[1])
    return max(sm - sr, 0.0), max(im - ir, 0.0)


class _Run:
    """The calibration models loaded with one placement, and predict() on them."""

    def __init__(self, paths, layers, **placement):
        import hybridmoe
        self.layers = layers
        self.models = [hybridmoe.load(p, ctx_size=4096, check_fit=False, **placement) for p in paths]

    def close(self):
        self.models = []
        import gc
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def predict(self, rates, costs, **kw):
        from ..placement.predict import predict
        return [predict(m.placement, _with(rates, costs), graphs=m.runtime.graphs, **kw) for m in self.models]


def _gpu_models() -> list[int]:
    """One CUDA GPU of each model: GPUs of one model share their costs (perf.costs.Costs)."""
    out, seen = [], set()
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            name = torch.cuda.get_device_properties(i).name
            if name not in seen:
                seen.add(name)
                out.append(i)
    return out


def _attn_flops(cfg, T: int, depth: int) -> float:
    """Attention score FLOPs of one layer for a ubatch of T tokens after `depth` cached ones (as predict counts)."""
    return 4.0 * cfg.n_head * cfg.head_dim * (T * depth + T * (T + 1) / 2)


class _Fitter:
    """Times the runtime on the calibration models and fits costs against predict() on the same placement."""

    def __init__(self, run, rates, costs, reps, n_tg, measured):
        self.run, self.rates, self.costs, self.reps, self.n_tg, self.measured = run, rates, costs, reps, n_tg, measured
        self.layers = run.layers
        for m in run.models:
            # the scheduler decides its uploads on these rates, as it will once they are cached (else on the
            # cache's older rates, or none: ik_llama.cpp's rule), so that it runs what predict() models
            m.sched.rates = rates

    def tg(self, label: str) -> tuple[tuple, tuple]:
        """(measured, modelled) seconds per decode step of each model."""
        meas = self.measured[label] = tuple(_time_tg(m, self.n_tg, self.reps) for m in self.run.models)
        mod = tuple(1 / p.tg for p in self.run.predict(self.rates, self.costs, n_gen=self.n_tg))
        return meas, mod

    def pp(self, label: str, T: int, depth: int = 0) -> tuple[float, float, float, float]:
        """(measured per-layer, modelled per-layer, measured intercept, modelled intercept) seconds of a ubatch."""
        meas = self.measured[f"{label}_{T}_d{depth}"] = tuple(_time_pp(m, T, self.reps, depth)
                                                              for m in self.run.models)
        (l1, l2) = self.layers
        sm, im = fit_line(l1, meas[0], l2, meas[1])
        sr, ir = self.modelled(T, depth)
        return sm, sr, im, ir

    def pp_pair(self, label: str, T: int, depth: int) -> tuple[tuple, tuple]:
        """pp at depth 0 and at `depth`. A ubatch after `depth` cached tokens does the same work and attention over
        them too, so where depth 0 reads slower a layer, noise hit it (one calibration read an eager ubatch of the
        8-layer model at 51 ms, 10 on other VMs, and fitted every eager prompt 1.5x slow): it is timed again, at
        most twice, and the faster kept."""
        a, b = self.pp(label, T), self.pp(label, T, depth)
        key = f"{label}_{T}_d0"
        kept = self.measured[key]
        for _ in range(2):
            if a[0] <= b[0]:
                break
            again = self.pp(label, T)
            if again[0] < a[0]:
                a, kept = again, self.measured[key]
        self.measured[key] = kept
        return a, b

    def modelled(self, T: int, depth: int = 0) -> tuple[float, float]:
        """(per-layer, intercept) seconds of a T-token ubatch as predict() gives them on the costs so far."""
        mod = tuple(T / p.pp for p in self.run.predict(self.rates, self.costs, n_gen=self.n_tg, n_prompt=T,
                                                        ubatch=T, n_depth=depth))
        (l1, l2) = self.layers
        return fit_line(l1, mod[0], l2, mod[1])

    def solve_floor(self, dev: str, key: str, T: int, target: float) -> float:
        """costs[dev][key] (a per-layer floor) set so that the modelled per-layer seconds of a T-token ubatch are
        `target` (the measured ones). Not target less the model without it: a prefetched upload runs behind
        the layer's other work (predict), the floor included, so the modelled layer grows by less than the floor
        until the upload is hidden; the model's layer is non-decreasing in the floor, so it is bisected."""
        c = self.costs[dev]
        c[key] = 0.0
        if self.modelled(T)[0] >= target:
            return 0.0
        lo, hi = 0.0, target                             # the modelled layer is at least its floor
        for _ in range(40):
            c[key] = (lo + hi) / 2
            lo, hi = (c[key], hi) if self.modelled(T)[0] < target else (lo, c[key])
        c[key] = hi
        return hi


def _fit_graph_prompt(f, g: dict, dev: str, pre: str, T1: int, T2: int, D: int):
    """The captured prompt step's costs into g under the prefix pre ("", or "oai_" for gpt-oss's step), from a
    ubatch at two sizes and one at depth: a per-layer floor, the MoE kernels' and the attention's FLOP rates
    (three equations: residual = floor + expert FLOPs / moe_flops + attention FLOPs / attn_flops). The experts
    modelled at moe_flops = inf are their bytes, taken out again."""
    run, rates = f.run, f.rates
    for m in run.models:
        _eager(m, False)
    g.update({pre + "prompt_layer_s": 0.0, pre + "prompt_ubatch_s": 0.0, pre + "moe_flops": math.inf,
              pre + "attn_flops": math.inf})
    cfg = run.models[0].cfg
    exp_bytes = sum(t.nbytes for n, t in run.models[0].file.tensors.items()    # a layer's expert matrices
                    if n.startswith("blk.0.") and n.endswith("_exps.weight"))

    def residual(T, timed):
        sm, sr, im, ir = timed
        frac = touched_fraction(T, cfg.n_expert, cfg.n_expert_used)
        return sm - sr + exp_bytes * frac / rates.read_bw(dev), im - ir
    label = f"{dev}_{pre}prompt_s"
    at_0, at_d = f.pp_pair(label, T1, D)             # depth 0 timed again where it read slower than depth D
    (r1, c1), (r3, _) = residual(T1, at_0), residual(T1, at_d)
    r2, c2 = residual(T2, f.pp(label, T2))
    ef = [2.0 * 3 * cfg.n_ff_exp * cfg.n_embd * cfg.n_expert_used * T for T in (T1, T2)]   # expert FLOPs
    at = [_attn_flops(cfg, T1, 0), _attn_flops(cfg, T2, 0), _attn_flops(cfg, T1, D)]
    inv_a = (r3 - r1) / (at[2] - at[0])
    cap = 0.5 * r1 / at[0]                           # noise: at depth 0 attention is under half a layer
    inv_a = min(inv_a, cap) if inv_a > 0 and cap > 0 else 1 / rates.flops(dev)   # (no signal: the rate)
    inv_m = (r2 - r1 - (at[1] - at[0]) * inv_a) / (ef[1] - ef[0])
    if inv_m <= 0:
        inv_m = 1 / rates.flops(dev)
    g[pre + "attn_flops"], g[pre + "moe_flops"] = 1 / inv_a, 1 / inv_m
    g[pre + "prompt_layer_s"] = max(r1 - ef[0] * inv_m - at[0] * inv_a, 0.0)
    g[pre + "prompt_ubatch_s"] = max((c1 + c2) / 2, 0.0)


def _fit_eager_prompt(f, g: dict, dev: str, pre: str, T1: int, D: int):
    """The eager prompt path's costs (placements no captured step covers: uploads, hybrid layers) into g under
    the prefix pre: its per-layer floor and per-ubatch cost and its attention's rate, from a ubatch at depth 0
    and one at depth D."""
    for m in f.run.models:
        _eager(m, True)
    g.update({pre + "eager_prompt_layer_s": 0.0, pre + "eager_ubatch_s": 0.0, pre + "eager_attn_flops": math.inf})
    cfg = f.run.models[0].cfg
    (s0, r0, i0, j0), (sD, rD, _, _) = f.pp_pair(f"{dev}_{pre}eager_prompt_s", T1, D)
    extra = (sD - rD) - (s0 - r0)
    a0, aD = _attn_flops(cfg, T1, 0), _attn_flops(cfg, T1, D)
    rate = (aD - a0) / extra if extra > 0 else f.rates.flops(dev)
    g[pre + "eager_attn_flops"] = rate = max(rate, 2 * a0 / max(s0 - r0, 1e-9))
    g[pre + "eager_prompt_layer_s"] = max(s0 - r0 - a0 / rate, 0.0)
    g[pre + "eager_ubatch_s"] = max(i0 - j0, 0.0)


def measure_costs(rates, quick: bool = False, progress=None, gpus: list[int] | None = None) -> dict:
    """The costs dict (perf/costs.py) for this machine; `rates` are its calibrated rates. gpus: indices of the
    GPUs to measure (default: one of each CUDA model present; tests pass fake GPUs to run the fitting)."""
    say = progress or (lambda msg: None)
    reps = 1 if quick else 3
    n_tg = 8 if quick else 32
    T1, T2, D = (64, 256, 128) if quick else (512, 2048, 2048)
    layers = (1, 3) if quick else (2, 8)
    costs: dict = {"cpu": {}}
    measured: dict = {}                          # what was timed, seconds per model (kept for checking the fit)
    checks: dict = {}                            # [measured, predicted] seconds a layer of runs not fitted
    say("CPU expert kernel: call cost and streaming rate")
    costs["cpu"].update(kernel_costs(quick))
    say("calibration models")
    paths = [calibration_model(n, quick) for n in layers]

    say("all on the CPU (-ngl 0 --no-op-offload)")
    # (with a GPU, -ngl 0 would upload a prompt's host weights: the hybrid eager path, not the CPU's step)
    run = _Run(paths, layers, n_gpu_layers=0, op_offload=False)
    try:
        f = _Fitter(run, rates, costs, reps, n_tg, measured)
        cfg = run.models[0].cfg
        c = costs["cpu"]
        c.update(decode_layer_s=0.0, decode_token_s=0.0)
        c["decode_layer_s"], c["decode_token_s"] = _fit(*f.tg("cpu_decode_s"), layers)
        # a ubatch at depth 0 and one after D cached tokens: the per-layer floor (or a factor on the modelled
        # compute, where the step beats it) and the attention's rate, with attention left out of the model
        c.update(prompt_layer_s=0.0, prompt_scale=1.0, prompt_ubatch_s=0.0, attn_flops=math.inf)
        (s0, r0, i0, j0), (sD, rD, _, _) = f.pp_pair("cpu_prompt_s", T1, D)
        a0, aD = _attn_flops(cfg, T1, 0), _attn_flops(cfg, T1, D)
        extra = (sD - rD) - (s0 - r0)
        c["attn_flops"] = (aD - a0) / extra if extra > 0 else rates.cpu_bf16_flops
        if s0 > 0:                                  # noise: at depth 0 attention is under half a layer
            c["attn_flops"] = max(c["attn_flops"], 2 * a0 / s0)
        c["prompt_layer_s"], c["prompt_scale"] = floor_or_scale(s0 - a0 / c["attn_flops"], r0)
        c["prompt_ubatch_s"] = max(i0 - j0 * c["prompt_scale"], 0.0)
    finally:
        run.close()

    if gpus is None:
        gpus = _gpu_models()
    for i in gpus:
        dev = f"CUDA{i}"
        g = costs[dev] = {}
        cfg_shape = QUICK if quick else FULL
        # the copies to and from pageable host memory, at the size of a ubatch's rows (the offloaded path's)
        g.update(link_costs(i if torch.cuda.is_available() else None, 2 * T1 * cfg_shape["n_embd"] * 4,
                            rates.sync(dev)))
        say(f"{dev}: every weight on the GPU (-ngl 99)")
        run = _Run(paths, layers, n_gpu_layers=99, split_mode="none", main_gpu=i)
        try:
            f = _Fitter(run, rates, costs, reps, n_tg, measured)
            cfg = run.models[0].cfg
            for eager in (False, True):
                lk, tk = ("eager_decode_layer_s", "eager_token_s") if eager else ("decode_layer_s", "decode_token_s")
                g.update({lk: 0.0, tk: 0.0})
                for m in run.models:
                    _eager(m, eager)
                g[lk], g[tk] = _fit(*f.tg(f"{dev}_{lk}"), layers)
            _fit_graph_prompt(f, g, dev, "", T1, T2, D)
            _fit_eager_prompt(f, g, dev, "", T1, D)
        finally:
            run.close()

        say(f"{dev}: gpt-oss's captured decode and prompt steps (-ngl 99)")
        run = _Run([calibration_model(n, quick, "gpt-oss") for n in layers], layers, n_gpu_layers=99,
                   split_mode="none", main_gpu=i)
        try:
            f = _Fitter(run, rates, costs, reps, n_tg, measured)
            g.update(oai_decode_layer_s=0.0, oai_decode_token_s=0.0)
            g["oai_decode_layer_s"], g["oai_decode_token_s"] = _fit(*f.tg(f"{dev}_oai_decode_layer_s"), layers)
            _fit_graph_prompt(f, g, dev, "oai_", T1, T2, D)
            _fit_eager_prompt(f, g, dev, "oai_", T1, D)
        finally:
            run.close()

        say(f"{dev}: experts in RAM (-ngl 99 -ot exps=CPU)")
        run = _Run(paths, layers, n_gpu_layers=99, split_mode="none", main_gpu=i, override_tensor=["exps=CPU"])
        old = os.environ.get("HYBRIDMOE_DECODE_SHARE")
        os.environ["HYBRIDMOE_DECODE_SHARE"] = "0"          # the hand-off alone; the share is modelled apart
        try:
            f = _Fitter(run, rates, costs, reps, n_tg, measured)
            g["handoff_s"] = 0.0
            g["handoff_s"] = _fit(*f.tg(f"{dev}_handoff_decode_s"), layers)[0]
            # uploads, every expert a layer ahead (forced, so the measurement does not depend on the policy)
            for m in run.models:
                m.set_policy("moe_up_gate,1,mul_mat_id,1", False, True)
            g.update(upload_overlap=0.0, upload_layer_s=0.0)
            preds = run.predict(rates, costs, n_gen=n_tg, n_prompt=T1, ubatch=T1)
            if all(len(p.uploaded_layers) == n for p, n in zip(preds, layers)):
                sm, s0, _, _ = f.pp(f"{dev}_upload_prompt_s", T1)           # modelled: nothing hidden
                g["upload_overlap"] = 1.0
                hid = run.predict(rates, costs, n_prompt=T1, ubatch=T1)        # modelled: all of it hidden
                s1 = fit_line(layers[0], T1 / hid[0].pp, layers[1], T1 / hid[1].pp)[0]
                ov = (s0 - sm) / (s0 - s1) if s0 > s1 else 1.0
                g["upload_overlap"] = min(max(ov, 0.0), 1.0)
                g["upload_layer_s"] = max(sm - (s0 - g["upload_overlap"] * (s0 - s1)), 0.0)
            else:
                del g["upload_overlap"], g["upload_layer_s"]   # the rates say uploads never pay here
        finally:
            if old is None:
                del os.environ["HYBRIDMOE_DECODE_SHARE"]
            else:
                os.environ["HYBRIDMOE_DECODE_SHARE"] = old
            run.close()

        say(f"{dev}: every weight in RAM, prompts offloaded (-ngl 0)")
        # with a GPU, -ngl 0's prompts take the eager path (steps.build_step): per layer the norms, q/k norms,
        # RoPE, the cache write and attention (torch SDPA) on the CPU, the matrices and experts uploaded where
        # that pays, the activations copied both ways (predict.offload_copies). The attention's rate and the
        # copies' rates are timed on the ops themselves; the per-layer floor is what the two models' difference
        # leaves beyond all that, and the per-ubatch cost their intercept's. A ubatch after D cached tokens is
        # timed too, as a check of the attention's term (kept in _calibration, not fitted).
        run = _Run(paths, layers, n_gpu_layers=0, main_gpu=i)
        try:
            f = _Fitter(run, rates, costs, reps, n_tg, measured)
            cfg = run.models[0].cfg
            g.update(offload_prompt_layer_s=0.0, offload_ubatch_s=0.0,
                     offload_attn_flops=cpu_attention_flops(cfg, T1, D))
            (s0, _, i0, _), (sD, _, _, _) = f.pp_pair(f"{dev}_offload_prompt_s", T1, D)
            f.solve_floor(dev, "offload_prompt_layer_s", T1, s0)
            g["offload_ubatch_s"] = max(i0 - f.modelled(T1)[1], 0.0)
            checks[f"{dev}_offload_prompt_layer_s_d{D}"] = [sD, f.modelled(T1, D)[0]]
        finally:
            run.close()
    costs["_calibration"] = {"layers": list(layers), "ubatches": [T1, T2], "depth": D, "decode_steps": n_tg,
                             "quick": quick, "models": paths, "measured": {k: list(v) for k, v in measured.items()},
                             "checks": checks}
    return costs
