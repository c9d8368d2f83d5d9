"""`hybridmoe plan -m MODEL [llama.cpp placement flags] [--json]`: where each tensor goes, before loading anything.

`--suggest` searches placements instead (planner.py) and prints llama.cpp flags with predicted TG/PP;
`--rig NAME_OR_FILE` plans for a machine described by a rig file (rigs/) instead of this one. Without
--suggest, when rates are known (--rig, or this machine's cached `hybridmoe calibrate`), the plan gains a
predicted TG/PP line for the given flags.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..config import ModelConfig
from ..devices import list_devices
from ..errors import HybridMoeError
from ..formats.gguf import TensorInfo, open_gguf
from ..formats.names import fmt_bytes, gib, layers_text
from ..models.catalog import catalog_model, catalog_names, config_for_planning
from ..perf.rigs import read_rig, rig_names
from ..placement.core import add_placement_args, options_from_args, plan_placement
from ..placement.planner import MIN_GAP, OBJECTIVES, Suggestion, predict, suggest
from ..placement.report import format_plan, placement_to_json

CATALOG_PREFIX = "catalog:"


def load_records(spec: str) -> tuple[ModelConfig, dict[str, TensorInfo]]:
    """Config and tensor records of a .gguf path (first part of a split model) or `catalog:NAME[:TYPES]`."""
    if spec.startswith(CATALOG_PREFIX):
        return catalog_model(spec[len(CATALOG_PREFIX):])
    if spec.startswith("synth:") or spec == "builtin":
        from ..model import resolve_model_path
        spec = resolve_model_path(spec)
    model = open_gguf(spec)
    return config_for_planning(model.metadata, spec, model.tensors), dict(model.tensors)


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", required=True, metavar="MODEL",
                        help="a .gguf file (first part of a split model), builtin, synth:PRESET, or catalog:NAME[:EXPERT_TYPE[:OTHER_TYPE]] "
                        f"with NAME one of {', '.join(catalog_names())}")


def setup_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="hybridmoe plan", description=__doc__)
    add_model_arg(parser)
    add_placement_args(parser)
    parser.add_argument("--json", action="store_true", help="print the placement (or the suggestions) as JSON")
    parser.add_argument("--explain", action="append", default=[], metavar="NAME",
                        help="say which rule placed this tensor (repeatable)")
    g = parser.add_argument_group("planner")
    g.add_argument("--suggest", action="store_true",
                   help="search placements and print llama.cpp flags with predicted TG/PP and memory per device "
                   "(-c, -ub, -b, -ctk, -ctv, -fa, -nkvo, --no-op-offload are kept; -ngl/-ot/-ts/--n-cpu-moe "
                   "are chosen)")
    g.add_argument("--rig", metavar="NAME_OR_FILE",
                   help=f"plan for the machine a rig JSON file describes, or a shipped rig ({', '.join(rig_names())}), "
                   "instead of this one")
    g.add_argument("--objective", choices=OBJECTIVES, default="tg",
                   help="rank suggestions by decode speed (tg), prompt speed (pp) or the time of a 4096-token prompt "
                   "plus 512 generated tokens (balanced); default tg")
    g.add_argument("--top", type=_positive, default=3, metavar="N",
                   help="how many suggestions to print, best first by --objective (default 3)")
    g.add_argument("--min-gap", type=float, default=MIN_GAP * 100, metavar="PCT",
                   help="each suggestion is predicted at least PCT%% slower (by --objective) than every one above it "
                   f"(default {MIN_GAP * 100:g}): near-copies of one placement are left out")
    g.add_argument("--headroom", type=float, default=0.0, metavar="GIB",
                   help="GiB to keep free on every GPU beyond the estimate of compute buffers (default 0)")
    g.add_argument("-p", "--n-prompt", type=_positives, default=None, metavar="N[,N..]",
                   help="prompt tokens the PP prediction is for (pp N in ubatches of -ub; default 512, as bench; "
                   "--suggest: 4096, where larger ubatches can pay); --check runs each of a comma list")
    g.add_argument("-n", "--n-gen", type=_positive, default=128, metavar="N",
                   help="generated tokens the TG prediction is for (tg N at depth 0; default 128, as bench)")
    g.add_argument("--check", action="store_true",
                   help="run bench's pp/tg tests on this placement here and print predicted vs measured, with each "
                   "term of the prediction (needs `hybridmoe calibrate`)")
    g.add_argument("-r", "--repetitions", type=_positive, default=3, metavar="N",
                   help="--check: timed runs per test (default 3)")
    return parser


def _positives(s: str) -> list[int]:
    return [_positive(x) for x in s.split(",")]


def _positive(s: str) -> int:
    if not s.strip().isdigit() or int(s) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {s!r}")
    return int(s)


def _short_description(text: str) -> str:
    """'rig x: NVIDIA GeForce RTX 5090, PCIe gen5 x8' -> 'RTX 5090'."""
    text = text.split(": ", 1)[-1].split(", PCIe")[0].split(" (")[0]
    for prefix in ("NVIDIA GeForce ", "NVIDIA "):
        text = text.removeprefix(prefix)
    return text[:24]


def format_suggestions(sugs: list[Suggestion], objective: str) -> str:
    """The suggestions as text: flags, predictions, experts per device, memory per device."""
    if not sugs:
        return "no suggestion"
    first = sugs[0]
    cfg = first.placement.cfg
    total = sum(t.nbytes for t in first.placement.tensors.values())
    out = [f"model: {getattr(cfg, 'name', '') or cfg.arch} ({cfg.arch}, {cfg.n_layer} layers, {fmt_bytes(total)})",
           f"objective: {objective} (best first); predictions: the runtime's steps on the rates, "
           + ("with calibrated costs" if first.prediction.calibrated else "without calibrated costs (roofline)")
           + f" (tg{first.prediction.n_gen} at depth 0, pp{first.prediction.n_prompt}); memory as `hybridmoe plan` "
           "counts it"]
    for i, s in enumerate(sugs, 1):
        out += ["", f"#{i} {s.label}: TG {s.tg:.1f} t/s, PP {s.pp:.0f} t/s" + (f"   ({s.note})" if s.note else ""),
                f"  {s.flags}", f"  predicted: {s.prediction.line()}"]
        n_exp = sum(1 for il in range(cfg.n_layer) if s.placement.layer_tensor(il, "ffn_up_exps"))
        on_gpu = sum(len(v) for v in s.gpu_expert_layers.values())
        if n_exp:
            out.append(f"  expert layers on GPUs: {on_gpu} of {n_exp}" +
                       (f"; in RAM: blk {layers_text(s.cpu_expert_layers)}" if s.cpu_expert_layers else ""))
        rows = []
        for m in s.memory:
            if m.name == "CPU" or m.total:
                status = "OVER" if m.total > m.free else ""
                rows.append((m.name, _short_description(m.description), layers_text(m.expert_layers)
                             if m.expert_layers else "-", gib(m.expert_bytes), gib(m.weights), gib(m.kv),
                             gib(m.compute), gib(m.total), gib(m.free), status))
        head = ("device", "", "experts of blk", "experts", "weights", "KV", "compute", "total", "free", "")
        widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
        for r in [head] + rows:
            out.append("  " + "  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w)
                                        for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        for w in s.placement.warnings:
            out.append(f"  warning: {w}")
    return "\n".join(out)


def _machine(args):
    """(devices, rates, rig or None, where the rates come from)."""
    if args.rig:
        rig = read_rig(args.rig)
        return rig.devices, rig.rates, rig, f"rig {rig.name}"
    from ..perf.calibrate import cache_path, load_cached
    rates = load_cached()
    return list_devices(), rates, None, (f"this machine's calibration ({cache_path()}, {rates.measured_at})"
                                         if rates else "")


def _prediction_doc(pred, source: str) -> dict:
    return {"tg_ts": pred.tg, "pp_ts": pred.pp, "n_gen": pred.n_gen, "n_prompt": pred.n_prompt,
            "ubatch": pred.ubatch, "tg_limit": pred.tg_limit, "pp_limit": pred.pp_limit,
            "tg_terms_s": pred.tg_terms, "pp_terms_s": pred.pp_terms, "decode_step": pred.decode_kind,
            "prompt_step": pred.prompt_kind, "calibrated": pred.calibrated,
            "tg_bound_ts": pred.tg_bound.ts, "pp_bound_ts": pred.pp_bound.ts,
            "uploaded_layers": pred.uploaded_layers, "uploaded_bytes": pred.uploaded_bytes,
            "only_active": pred.only_active, "crossings_per_token": pred.crossings, "rates": source,
            "decode_share": list(pred.share) if pred.share else None}


def _ignored_flags(args) -> list[str]:
    out = []
    if args.n_gpu_layers:
        out.append("-ngl")
    if args.override_tensor:
        out.append("-ot")
    if args.cpu_moe:
        out.append("--cpu-moe")
    if args.n_cpu_moe:
        out.append("--n-cpu-moe")
    if args.tensor_split:
        out.append("-ts")
    return out


def _suggest(args, cfg, tensors, opts, devices, rates, rig, source) -> int:
    if rates is None:
        raise HybridMoeError("--suggest needs the machine's rates: run `hybridmoe calibrate` here, or plan for a "
                             f"rig with --rig NAME_OR_FILE (shipped: {', '.join(rig_names())})")
    ignored = _ignored_flags(args)
    if ignored:
        print(f"note: --suggest chooses {', '.join(ignored)} itself; the given values are ignored", file=sys.stderr)
    if args.headroom < 0:
        raise HybridMoeError(f"--headroom {args.headroom:g}: give GiB >= 0")
    if not 0 <= args.min_gap < 100:
        raise HybridMoeError(f"--min-gap {args.min_gap:g}: give a percentage from 0 to below 100")
    sugs = suggest(tensors, cfg, devices, rates, opts, objective=args.objective, count=args.top,
                   headroom=int(args.headroom * (1 << 30)), n_prompt=args.n_prompt, n_gen=args.n_gen,
                   min_gap=args.min_gap / 100)
    if args.json:
        print(json.dumps({"rig": rig.name if rig else None, "rates": source, "objective": args.objective,
                          "suggestions": [{"label": s.label, "note": s.note, "flags": s.flags, "argv": s.argv,
                                           "predicted": _prediction_doc(s.prediction, source),
                                           "devices": [{"name": m.name, "description": m.description,
                                                        "expert_layers": m.expert_layers,
                                                        "expert_bytes": m.expert_bytes, "weights": m.weights,
                                                        "kv": m.kv, "compute": m.compute, "total": m.total,
                                                        "free": m.free} for m in s.memory],
                                           "warnings": list(s.placement.warnings)} for s in sugs]}, indent=1))
        return 0
    if rig:
        print(rig.summary() + "\n")
    else:
        print(f"rates: {source}\n")
    print(format_suggestions(sugs, args.objective))
    return 0


def main(args: argparse.Namespace) -> int:
    """Print the plan; exit status 1 when some GPU is over its free memory (the last line says what to try). A CPU
    side over the available RAM ends with "does not fit in RAM" and what to do, but exits 0: mmap runs it, slowly."""
    cfg, tensors = load_records(args.model)
    opts = options_from_args(args)
    args.n_prompts = args.n_prompt or [4096 if args.suggest else 512]
    args.n_prompt = args.n_prompts[0]
    devices, rates, rig, source = _machine(args)
    if args.suggest:
        if args.check:
            raise HybridMoeError("--check measures one placement: give its flags without --suggest (see "
                                 "benchmarks/plan_check.sh for checking suggestions)")
        return _suggest(args, cfg, tensors, opts, devices, rates, rig, source)
    placement = plan_placement(tensors, cfg, opts, devices)
    if args.check:
        from .plan_check import run_check
        return run_check(args, placement, rates, source, predict)
    pred = predict(placement, rates, n_prompt=args.n_prompt, n_gen=args.n_gen) if rates is not None else None
    problem = None
    try:
        placement.check_fits()
    except HybridMoeError as e:
        problem = str(e)
    if args.json:
        doc = placement_to_json(placement)
        doc["error"] = problem
        doc["ram_error"] = placement.ram_shortfall()
        doc["explain"] = {n: placement.explain(n) for n in args.explain}
        doc["rig"] = rig.name if rig else None
        doc["predicted"] = _prediction_doc(pred, source) if pred else None
        print(json.dumps(doc, indent=1))
    else:
        if rig:
            print(rig.summary() + "\n")
        print(format_plan(placement, cfg))
        for name in args.explain:
            print(placement.explain(name))
        if pred:
            what = "calibrated costs" if pred.calibrated else "roofline: no calibrated costs"
            print(f"\npredicted ({what}, rates from {source}): {pred.line()}")
        ram = placement.ram_shortfall()
        if ram:                     # it still runs (mmap pages from disk): said, but exit status 0 for it alone
            print(f"\ndoes not fit in RAM: {ram}")
        if problem:                 # last: the line the exit status is about
            print(("" if ram else "\n") + f"does not fit: {problem}")
        if not problem and not ram:
            print("\nfits: " + ("every GPU has room for its weights, KV cache and compute buffers, and the CPU side "
                                 "fits in RAM" if placement.gpus else "weights, KV cache and compute buffers fit in RAM"))
    return 1 if problem else 0
