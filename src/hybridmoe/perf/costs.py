"""The calibrated costs that are not bandwidth: what the runtime spends per layer, per call, per step and per
ubatch beyond moving bytes and doing FLOPs at the calibrated rates. Plain data, no torch.

`hybridmoe calibrate` measures them (commands/calibrate_costs.py: micro-benchmarks of the CPU expert kernel, and
the runtime's own steps on two small calibration models of 2 and 6 layers, whose difference gives per-layer
costs and whose intercept gives per-step costs) and stores them in `Rates.costs`:

    {"cpu":   {key: value, ...},          the CPU side (the expert kernel, the all-CPU steps)
     "CUDA0": {key: value, ...}, ...}     per calibrated GPU

Keys (seconds unless named otherwise):

  cpu  call_s             the C expert kernel's fixed cost per call (T=1, weights in cache)
       stream_bw          bytes/s the C expert kernel streams at T=1 from RAM (weights far larger than L3)
       decode_layer_s     the all-CPU decode step (hm_decode_step), per layer beyond streaming its bytes
       decode_token_s     the same, per token (embedding, head beyond its bytes, Python, sampling)
       prompt_layer_s     the all-CPU prompt step (hm_prompt_step), per layer and ubatch beyond its FLOPs
       prompt_scale       factor on that step's FLOP time where it ran faster than the calibrated rates
       prompt_ubatch_s    per ubatch
       attn_flops         FLOP/s of its attention over cached keys (fitted from a ubatch at depth 0 and deeper)
  GPU  decode_layer_s     a layer of the captured decode step (graph replay), beyond its bytes at gpu_bw
       decode_token_s     per decode step: the graph launches, Python, the head beyond its bytes
       eager_decode_layer_s, eager_token_s      the same for the eager decoder (placements no graph covers)
       oai_decode_layer_s, oai_decode_token_s   the same for gpt-oss's captured decode step (its own block, not the
                          fused layer; uncalibrated: decode_layer_s, decode_token_s)
       oai_prompt_layer_s, oai_moe_flops, oai_prompt_ubatch_s, oai_attn_flops, oai_eager_prompt_layer_s,
       oai_eager_ubatch_s, oai_eager_attn_flops   the same as below for gpt-oss's prompt steps (captured and
                          eager) and MXFP4 experts (uncalibrated: the keys without oai_)
       handoff_s          one CPU-expert layer in the captured step beyond its bytes, the kernel's call_s and
                          its streaming time: the GPU segment it ends (graph replay) and the hand-off (GPU ->
                          CPU kernel -> GPU); such a layer pays this instead of decode_layer_s
       prompt_layer_s     a layer of the captured prompt step, beyond its FLOPs
       moe_flops          FLOP/s the GPU's grouped MoE kernels reach on a prompt (fitted at two ubatch sizes)
       prompt_ubatch_s    per captured ubatch
       attn_flops         FLOP/s of the captured step's attention (fitted as the CPU's)
       eager_attn_flops   FLOP/s of the eager path's attention
       eager_prompt_layer_s, eager_ubatch_s     a layer / a ubatch of the eager prompt path (Python, launches)
       upload_overlap     share (0..1) of the smaller of a layer's upload and the layer's other work (floors,
                          attention, matrices, experts) hidden by the other when uploads run a layer ahead
                          (prefetch), as measured
       upload_layer_s     per uploaded layer beyond that (the router's sync, slot waits)
       offload_prompt_layer_s, offload_ubatch_s    a layer whose attention is in RAM (-ngl 0, or a layer -ngl
                          leaves on the CPU) on the eager prompt path with op offload to this GPU: norms, q/k
                          norms, RoPE and the cache write on the CPU, Python and launches; per layer beyond its
                          modelled work (CPU attention, matrices and experts uploaded, the activations' copies
                          at the two rates below), and per ubatch (uncalibrated: the CPU step's costs)
       offload_attn_flops FLOP/s of that path's CPU attention (torch SDPA, not the C step's), timed on the op
       pageable_h2d_bw    bytes/s of a copy to this GPU from pageable host memory (a fresh activation, a
                          memory-mapped matrix: only experts are pinned), timed on the copy
       d2h_bw             bytes/s of a copy from this GPU into pageable host memory (it waits for the queue)

Uncalibrated (a rig file without "costs", or no `calibrate` here), every floor is 0, every factor 1, the
overlap full and the streaming rate the RAM's read rate: the model degrades to the roofline.
"""
from __future__ import annotations

CPU_KEYS = ("call_s", "stream_bw", "decode_layer_s", "decode_token_s", "prompt_layer_s", "prompt_scale",
            "prompt_ubatch_s", "attn_flops")
GPU_KEYS = ("decode_layer_s", "decode_token_s", "eager_decode_layer_s", "eager_token_s", "oai_decode_layer_s",
            "oai_decode_token_s", "oai_prompt_layer_s", "oai_moe_flops", "oai_prompt_ubatch_s", "oai_attn_flops",
            "oai_eager_prompt_layer_s", "oai_eager_ubatch_s", "oai_eager_attn_flops", "handoff_s",
            "prompt_layer_s", "moe_flops", "prompt_ubatch_s", "attn_flops", "eager_prompt_layer_s", "eager_ubatch_s",
            "eager_attn_flops", "upload_overlap", "upload_layer_s", "offload_prompt_layer_s", "offload_ubatch_s",
            "offload_attn_flops", "pageable_h2d_bw", "d2h_bw")
RATE_KEYS = ("stream_bw", "moe_flops", "attn_flops", "eager_attn_flops", "offload_attn_flops", "pageable_h2d_bw",
             "d2h_bw")   # bytes/s or FLOP/s; others: s or factors


class Costs:
    """Lookups on `rates.costs` with the uncalibrated defaults. A GPU without its own entry takes the entry of a
    calibrated GPU of the same name, else none (defaults)."""

    def __init__(self, rates):
        self.rates = rates
        self.d = dict(getattr(rates, "costs", None) or {})

    @property
    def calibrated(self) -> bool:
        return bool(self.d)

    def cpu(self, key: str) -> float:
        v = self.d.get("cpu", {}).get(key)
        if v is not None:
            return float(v)
        if key == "stream_bw":
            return self.rates.ram_read_bw
        if key == "attn_flops":
            return self.rates.cpu_bf16_flops
        return 1.0 if key == "prompt_scale" else 0.0

    def _gpu_entry(self, dev: str) -> dict:
        if dev in self.d:
            return self.d[dev]
        names = getattr(self.rates, "gpu_names", {})
        for other, entry in self.d.items():
            if other != "cpu" and names.get(other) and names.get(other) == names.get(dev):
                return entry
        return {}

    def gpu(self, dev: str, key: str) -> float:
        v = self._gpu_entry(dev).get(key)
        if v is not None:
            return float(v)
        if key.startswith("oai_"):                 # calibrated before these were: the fused layer's
            return self.gpu(dev, key[4:])
        if key.startswith("offload_"):             # calibrated before these were: the CPU step's costs
            return self.cpu({"offload_prompt_layer_s": "prompt_layer_s", "offload_ubatch_s": "prompt_ubatch_s",
                             "offload_attn_flops": "attn_flops"}[key])
        if key in ("moe_flops", "attn_flops", "eager_attn_flops"):
            return self.rates.flops(dev)
        if key in ("pageable_h2d_bw", "d2h_bw"):
            return self.rates.h2d(dev)
        if key == "handoff_s":
            return self.rates.sync(dev)
        return 1.0 if key == "upload_overlap" else 0.0


def fit_line(x1: float, y1: float, x2: float, y2: float) -> tuple[float, float]:
    """(slope, intercept) through two points (layer counts -> seconds)."""
    slope = (y2 - y1) / (x2 - x1)
    return slope, y1 - slope * x1


def floor_or_scale(measured: float, modelled: float) -> tuple[float, float]:
    """(floor, scale) with measured = floor + scale * modelled: the floor where the runtime is slower than the
    modelled work (scale 1), the factor where it is faster (floor 0). A measured time that is not positive (a
    fit over noisy timings) resolves nothing: the modelled work stands (0, 1)."""
    if measured <= 0:
        return 0.0, 1.0
    if modelled <= 0:
        return max(measured, 0.0), 1.0
    if measured >= modelled:
        return measured - modelled, 1.0
    return 0.0, measured / modelled


def format_costs(costs: dict) -> list[str]:
    """Lines for `calibrate`'s report."""
    out = []
    for dev, entry in costs.items():
        if dev.startswith("_"):
            continue
        parts = []
        for k, v in entry.items():
            if k.removeprefix("oai_") in RATE_KEYS:                        # gpt-oss's own rates (oai_*) too
                parts.append(f"{k} {v / 1e9:.1f} G" + ("B/s" if k.endswith("_bw") else "FLOP/s"))
            elif k.endswith("_s"):
                parts.append(f"{k} {v * 1e6:.1f} us")
            else:
                parts.append(f"{k} {v:.2f}")
        out.append(f"  {dev:<5} costs: " + ", ".join(parts))
    return out
