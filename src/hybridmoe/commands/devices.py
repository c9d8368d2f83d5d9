"""`hybridmoe devices`: the devices tensors can be placed on, as llama.cpp's --list-devices shows them."""
from __future__ import annotations

import argparse
import json

from ..devices import list_devices

MiB = 1 << 20


def setup_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="hybridmoe devices", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the devices as JSON")
    return parser


def main(args: argparse.Namespace) -> int:
    devices = list_devices()
    if args.json:
        print(json.dumps([{"name": d.name, "kind": d.kind, "index": d.index, "total_bytes": d.total_bytes,
                           "free_bytes": d.free_bytes, "fake": d.fake, "description": d.description}
                          for d in devices], indent=1))
        return 0
    print("Available devices:")
    for d in devices:
        print(f"  {d.name}: {d.description} ({d.total_bytes // MiB} MiB, {d.free_bytes // MiB} MiB free)")
    if not any(d.is_gpu for d in devices):
        print("no CUDA GPU is visible (set HYBRIDMOE_FAKE_GPUS=2x24GiB for a dry run with fake ones)")
    return 0
