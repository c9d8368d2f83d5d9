"""`hybridmoe SUBCOMMAND ...`: one dispatcher; each command module has setup_arg_parser() and main()."""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import HybridMoeError

COMMANDS = {
    "run": ("hybridmoe.commands.run", "generate text (llama-cli)"),
    "synth": ("hybridmoe.models.synth", "write a synthetic model with random weights"),
    "convert": ("hybridmoe.models.convert", "convert a HF safetensors model to GGUF"),
    "plan": ("hybridmoe.commands.plan", "show where each tensor goes, before loading"),
    "inspect": ("hybridmoe.commands.inspect", "list tensors with shape, type and size"),
    "devices": ("hybridmoe.commands.devices", "list devices (llama.cpp --list-devices)"),
    "calibrate": ("hybridmoe.commands.calibrate", "measure this machine's bandwidths and rates (cached)"),
    "serve": ("hybridmoe.commands.serve", "OpenAI-compatible HTTP server (llama-server)"),
    "bench": ("hybridmoe.commands.bench", "llama-bench"),
    "sweep-bench": ("hybridmoe.commands.sweep_bench", "llama-sweep-bench"),
    "perplexity": ("hybridmoe.commands.perplexity", "perplexity and KL divergence of a text (llama-perplexity)"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridmoe", description="Run MoE LLMs on a CPU and GPUs that can't hold them.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (mod, help_) in COMMANDS.items():
        module = importlib.import_module(mod)
        sp = sub.add_parser(name, help=help_, description=help_)
        module.setup_arg_parser(sp)
        sp.set_defaults(_module=module)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    try:
        return args._module.main(args) or 0
    except HybridMoeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
