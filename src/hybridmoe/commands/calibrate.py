"""`hybridmoe calibrate`: measure this machine's rates (RAM read bandwidth, CPU bf16 matmul, per GPU: PCIe
upload, device copy, bf16 matmul, sync latency) and cache them for the roofline and the planner."""
from __future__ import annotations

import json
import sys


def setup_arg_parser(p):
    p.add_argument("--quick", action="store_true", help="smaller buffers and fewer repetitions (less exact)")
    p.add_argument("--cached", action="store_true", help="print the cached rates; measure only if there are none")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads to measure with (default: all)")
    p.add_argument("--json", action="store_true", help="print the rates as JSON")
    return p


def main(args) -> int:
    import torch

    from ..perf.calibrate import cache_path, calibrate, load_or_calibrate
    old = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        rates = load_or_calibrate(quick=args.quick) if args.cached else calibrate(quick=args.quick)
    finally:
        torch.set_num_threads(old)
    if args.json:
        print(json.dumps(rates.to_dict(), indent=1))
    else:
        print(rates.format())
        print(f"cached in {cache_path()}", file=sys.stderr)
    return 0
