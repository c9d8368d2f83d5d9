"""Options shared by the commands that load a model (run, bench, sweep-bench, serve)."""
from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser, model_default: str | None = "synth:tiny"):
    p.add_argument("-m", "--model", default=model_default,
                   help="GGUF file (first part of a split model) or synth:PRESET (default: %(default)s)")


def add_runtime_args(p: argparse.ArgumentParser):
    from ..placement import add_placement_args
    add_placement_args(p)
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-op", "--offload-policy", default=None,
                   help="OP,0|1[,OP,0|1...]: force GPU offload of host-weight ops on (1) or off (0); OP is "
                        "mul_mat, mul_mat_id, moe_up_gate, all (or ik_llama.cpp's 26, 27, 29, -1)")
    p.add_argument("-ooae", "--offload-only-active-experts", default="auto", choices=["auto", "0", "1"],
                   help="when offloading, upload only the experts the router picked")
    p.add_argument("-fmoe", "--fused-moe", type=int, nargs="?", const=1, default=1, choices=[0, 1],
                   help="fused up/gate expert op (default 1; a bare -fmoe, as ik_llama.cpp takes it, means 1)")
    p.add_argument("--profile", action="store_true", help="print time per op and device, copies, uploads "
                   "(a captured decode or prompt step is timed as a whole; --no-graphs times every op)")
    p.add_argument("--no-graphs", action="store_true", help="run decode (and prompts with every weight on one GPU) eagerly, "
                   "without the static steps and CUDA graphs")


def add_warmup_arg(p: argparse.ArgumentParser):
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up run at load (a two-token prompt and one decode step, which compiles "
                        "kernels and captures graphs before the first prompt, as llama.cpp does)")


def warmup(model, args):
    if not args.no_warmup:
        import sys
        print(f"warmed up in {model.warmup():.2f} s (--no-warmup to skip)", file=sys.stderr)


def runtime_kwargs(args) -> dict:
    """The load() options these arguments stand for."""
    from ..placement import options_from_args
    import dataclasses
    kw = dataclasses.asdict(options_from_args(args))
    kw.update(threads=args.threads, offload_policy=args.offload_policy,
              offload_only_active_experts=args.offload_only_active_experts, fused_moe=bool(args.fused_moe),
              profile=args.profile, graphs=not args.no_graphs)
    return kw
