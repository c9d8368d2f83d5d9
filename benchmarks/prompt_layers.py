"""Does the captured prompt step's cost per layer grow with the number of layers? (issue 30: `-ngl 99` pp512 costs
0.42 ms a layer on calibrate's 2- and 8-layer models and 0.70 ms a layer on the 48-layer synth:qwen3-30b-a3b.)

Times one ubatch of the captured prompt step (StaticPrefill, every weight on one GPU; or, with -ngl 0, the eager
path that offloads a prompt's matrices and experts to the GPU while attention stays in RAM) as `calibrate` times it
(commands/calibrate_costs._time_pp: warm-up and capture first, median of -r) on models of Qwen3-30B-A3B's layer
(hidden 2048, 32/4 heads of 128, 128 experts of 768, 8 used; Q4_0 experts, Q8_0 the rest) with 2, 8, 16, 32, 48
layers, of two kinds:
  calib  calibrate's calibration models (calibrate_costs.calibration_model: synth's random weights per layer,
         residual branches at 0.02 / 48 as in the 48-layer model, vocabulary 8192)
  synth  synth:qwen3-30b-a3b's weights with n layers (models/synth.py: random per layer, residual branches at
         0.02 / n_layer above 8 layers, vocabulary 151936)
Per model it prints the ubatch's time, time / layers, the slope from the previous size (the cost of the added
layers alone), the routing of one eager forward of the same prompt (distinct experts a layer, the busiest
expert's tokens against the mean: the grouped MoE kernels' load), and what `plan` predicts with this machine's
cached calibration. A slope that grows with the count while the routing stays alike says the floor grows with
depth; a routing that concentrates says the weights, not the count, make the difference.

    python3 benchmarks/prompt_layers.py [--layers 2,8,16,32,48] [--kinds calib,synth] [-ub 512] [-r 5] [--keep]
    python3 benchmarks/prompt_layers.py --routing [--layers 2,8] [--kinds calib,synth]     # the CPU is enough
    python3 benchmarks/prompt_layers.py -ngl 0 --layers 2,8 --kinds calib     # -ngl 0: the offloaded eager path

GPU only, but --routing (each model's routing alone, every weight in RAM: no timing, no prediction). Models are written into $HYBRIDMOE_CACHE/models (calibrate's two and synth:qwen3-30b-a3b itself are
kept; the others are deleted after their timing unless --keep: 48 layers are 17 GB). Rows print as they come.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch  # noqa: E402


def synth_model(n_layer: int) -> str:
    """synth:qwen3-30b-a3b's tensors with n_layer layers, written once into the cache's models folder."""
    import dataclasses
    import tempfile

    from hybridmoe import env
    from hybridmoe.formats.gguf_write import write_gguf
    from hybridmoe.models.synth import SYNTH_VERSION, config_metadata, preset_config, synth_tensors
    from hybridmoe.text.builtin_vocab import builtin_vocab_metadata
    cfg, et, ot = preset_config("qwen3-30b-a3b")
    if n_layer == cfg.n_layer:                   # the preset itself (bench's and plan_check's synth model)
        from hybridmoe.models.synth import ensure_synth
        return ensure_synth("qwen3-30b-a3b")
    cfg = dataclasses.replace(cfg, n_layer=n_layer, name=f"synth-qwen3-30b-a3b-{n_layer}l")
    d = env.cache_dir() / "models"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"prompt-layers-synth-{n_layer}-v{SYNTH_VERSION}.gguf"
    if not path.exists():
        md = {"general.name": cfg.name, "general.type": "model", **config_metadata(cfg),
              **builtin_vocab_metadata(cfg.n_vocab)}
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".part")
        os.close(fd)
        try:
            write_gguf(tmp, cfg.arch, md, synth_tensors(cfg, et, ot, seed=1234))
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return str(path)


def routing(model, T: int, per_layer: bool = False) -> tuple:
    """(distinct experts a layer, busiest expert's tokens / the mean over the routed ones), mean over layers, of
    one eager forward of T random tokens (the captured step does not report its routing); per_layer: and the
    fewest distinct experts of any layer."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, model.cfg.n_vocab, (T,), generator=g)
    model.runtime.graphs = False
    model.drop_steps()
    kv = model.new_cache(T + 1)
    model.sched.routing = {}
    try:
        model.forward(tokens, 0, kv, all_logits=False)
        ids = dict(model.sched.routing)
    finally:
        model.sched.routing = None
        model.runtime.graphs = True
        model.drop_steps()
    distinct, skew = [], []
    for x in ids.values():
        counts = torch.bincount(x.flatten().cpu(), minlength=model.cfg.n_expert)
        busy = counts[counts > 0].float()
        distinct.append(busy.numel())
        skew.append(float(busy.max() / busy.mean()))
    n = max(len(distinct), 1)
    if per_layer:
        return sum(distinct) / n, sum(skew) / n, min(distinct, default=0)
    return sum(distinct) / n, sum(skew) / n


def routing_only(args) -> int:
    """Each model's routing of one -ub token ubatch, every weight in RAM: distinct experts per layer."""
    import hybridmoe
    from hybridmoe.commands.calibrate_costs import calibration_model
    T = args.ubatch
    print(f"routing of one {T}-token ubatch (random tokens), every weight in RAM\n")
    print("| kind | layers | distinct experts a layer (mean) | fewest in a layer | busiest / mean tokens |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for kind in args.kinds.split(","):
        for n in [int(x) for x in args.layers.split(",")]:
            path = calibration_model(n, quick=False) if kind == "calib" else synth_model(n)
            model = hybridmoe.load(path, ctx_size=T + 16, n_gpu_layers=0, check_fit=False)
            try:
                distinct, skew, fewest = routing(model, T, per_layer=True)
            finally:
                del model
            print(f"| {kind} | {n} | {distinct:.1f} | {fewest} | {skew:.2f} |", flush=True)
            if not args.keep and not (kind == "calib" and n in (2, 8)) and not (kind == "synth" and n == 48):
                os.unlink(path)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="2,8,16,32,48")
    ap.add_argument("--kinds", default="calib,synth", help="calib, synth or both")
    ap.add_argument("-ub", "--ubatch", type=int, default=512)
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="keep the models written here")
    ap.add_argument("--routing", action="store_true", help="the routing alone, all on the CPU (no GPU needed)")
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=99, help="the placement timed (default 99: the "
                    "captured prompt step; 0: every weight in RAM, the prompt's ops offloaded to the GPU)")
    args = ap.parse_args()
    if args.routing:
        return routing_only(args)
    if not torch.cuda.is_available():
        print("prompt_layers: needs a CUDA GPU (the captured prompt step)")
        return 0
    import hybridmoe
    from hybridmoe.commands.calibrate_costs import _time_pp, calibration_model
    from hybridmoe.perf.calibrate import load_cached
    from hybridmoe.placement.predict import predict
    rates = load_cached()
    layers = [int(x) for x in args.layers.split(",")]
    T = args.ubatch
    print(f"{torch.cuda.get_device_name(0)}; pp{T} as one ubatch at -ngl {args.n_gpu_layers}, median of "
          f"{args.repetitions}; predicted with {'the cached calibration' if rates else 'no calibration (none cached)'}")
    for kind in args.kinds.split(","):
        print(f"\n{kind}:\n")
        print("| layers | ms a ubatch | ms / layer | ms / added layer | predicted ms | distinct experts a layer "
              "| busiest / mean tokens | step | largest predicted terms, ms |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
        prev = None
        for n in layers:
            t0 = time.perf_counter()
            path = calibration_model(n, quick=False) if kind == "calib" else synth_model(n)
            written = time.perf_counter() - t0
            model = hybridmoe.load(path, ctx_size=4096, n_gpu_layers=args.n_gpu_layers, split_mode="none",
                                   check_fit=False)
            try:
                secs = _time_pp(model, T, args.repetitions)
                st = model.static_step("prompt")
                step = type(st).__name__ if st is not None else "eager"
                pr = predict(model.placement, rates, n_prompt=T, ubatch=T) if rates else None
                pred = T / pr.pp * 1e3 if pr else float("nan")
                terms = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(pr.pp_terms.items(), key=lambda kv: -kv[1])[:4]) \
                    if pr else "-"
                distinct, skew = routing(model, T)
            finally:
                del model
                import gc
                gc.collect()
                torch.cuda.empty_cache()
            slope = f"{(secs - prev[1]) / (n - prev[0]) * 1e3:.3f}" if prev else "-"
            print(f"| {n} | {secs * 1e3:.2f} | {secs / n * 1e3:.3f} | {slope} | {pred:.2f} | {distinct:.1f} | "
                  f"{skew:.2f} | {step} | {terms} |", flush=True)
            print(f"  ({kind} {n} layers: written or found in {written:.0f} s)", file=sys.stderr, flush=True)
            prev = (n, secs)
            if not args.keep and not (kind == "calib" and n in (2, 8)) and not (kind == "synth" and n == 48):
                os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
