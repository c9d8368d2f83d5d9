"""`hybridmoe plan -m MODEL [llama.cpp placement flags] [--json]`: where each tensor goes, before loading anything."""
from __future__ import annotations

import argparse
import json

from ..config import ModelConfig
from ..errors import HybridMoeError
from ..formats.gguf import TensorInfo, open_gguf
from ..models.catalog import catalog_model, catalog_names, config_for_planning
from ..placement import add_placement_args, format_plan, options_from_args, placement_to_json, plan_placement

CATALOG_PREFIX = "catalog:"


def load_records(spec: str) -> tuple[ModelConfig, dict[str, TensorInfo]]:
    """Config and tensor records of a .gguf path (first part of a split model) or `catalog:NAME[:TYPES]`."""
    if spec.startswith(CATALOG_PREFIX):
        return catalog_model(spec[len(CATALOG_PREFIX):])
    if spec.startswith("synth:"):
        from ..model import resolve_model_path
        spec = resolve_model_path(spec)
    model = open_gguf(spec)
    return config_for_planning(model.metadata, spec, model.tensors), dict(model.tensors)


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", required=True, metavar="MODEL",
                        help="a .gguf file (first part of a split model), synth:PRESET, or catalog:NAME[:EXPERT_TYPE[:OTHER_TYPE]] "
                        f"with NAME one of {', '.join(catalog_names())}")


def setup_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="hybridmoe plan", description=__doc__)
    add_model_arg(parser)
    add_placement_args(parser)
    parser.add_argument("--json", action="store_true", help="print the placement as JSON")
    parser.add_argument("--explain", action="append", default=[], metavar="NAME",
                        help="say which rule placed this tensor (repeatable)")
    return parser


def main(args: argparse.Namespace) -> int:
    """Print the plan; exit status 1 when some GPU is over its free memory (the last line says what to try)."""
    cfg, tensors = load_records(args.model)
    placement = plan_placement(tensors, cfg, options_from_args(args))
    problem = None
    try:
        placement.check_fits()
    except HybridMoeError as e:
        problem = str(e)
    if args.json:
        doc = placement_to_json(placement)
        doc["error"] = problem
        doc["explain"] = {n: placement.explain(n) for n in args.explain}
        print(json.dumps(doc, indent=1))
    else:
        print(format_plan(placement, cfg))
        for name in args.explain:
            print(placement.explain(name))
        print(f"\ndoes not fit: {problem}" if problem else "\nfits: every GPU has room for its weights, KV cache "
              "and compute buffers")
    return 1 if problem else 0
