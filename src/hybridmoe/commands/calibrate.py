"""`hybridmoe calibrate`: measure this machine's rates (RAM read bandwidth, CPU bf16 matmul, per GPU: PCIe
upload, device copy, bf16 matmul, sync latency) and the costs that are not bandwidth (the CPU expert kernel's
call cost and streaming rate; per layer, hand-off, step and ubatch costs of the runtime's steps, measured on two
small calibration models: calibrate_costs.py), and cache them for the roofline and the planner."""
from __future__ import annotations

import json
import sys


def setup_arg_parser(p):
    p.add_argument("--quick", action="store_true", help="smaller buffers, models and fewer repetitions (less exact)")
    p.add_argument("--cached", action="store_true", help="print the cached rates; measure only if there are none")
    p.add_argument("--no-costs", action="store_true",
                   help="measure the rates only, not the runtime's costs (keeps the costs cached before)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads to measure with (default: all)")
    p.add_argument("--json", action="store_true", help="print the rates as JSON")
    return p


def main(args) -> int:
    import torch

    from ..errors import progress
    from ..perf.calibrate import cache_path, calibrate, load_or_calibrate, save_rates
    from .calibrate_costs import measure_costs
    old = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.cached:
            rates = load_or_calibrate(quick=args.quick)
        else:
            rates = calibrate(quick=args.quick, save=args.no_costs)
            if not args.no_costs:
                with progress("calibrating costs", 1) as bar:
                    rates.costs = measure_costs(rates, quick=args.quick, progress=bar.describe)
                save_rates(rates)
    finally:
        torch.set_num_threads(old)
    if args.json:
        print(json.dumps(rates.to_dict(), indent=1))
    else:
        print(rates.format())
        print(f"cached in {cache_path()}", file=sys.stderr)
    return 0
