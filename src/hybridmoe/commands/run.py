"""`hybridmoe run`: generate text from a prompt and print llama.cpp-style timings."""
from __future__ import annotations

import sys

from .common import add_model_args, add_runtime_args, runtime_kwargs


def setup_arg_parser(p):
    add_model_args(p)
    p.add_argument("-p", "--prompt", default="Once upon a time", help="prompt text")
    p.add_argument("-f", "--file", help="read the prompt from this file")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate")
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed (-1: random)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_runtime_args(p)


def main(args) -> int:
    import hybridmoe
    from ..errors import HybridMoeError
    from ..generate import Timings
    prompt = args.prompt
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                prompt = f.read()
        except OSError as e:
            raise HybridMoeError(f"cannot read prompt file {args.file}: {e.strerror}") from None
    model = hybridmoe.load(args.model, **runtime_kwargs(args))
    print(f"loaded {model.cfg.name} ({model.cfg.arch}, {model.file.nbytes / 2**30:.2f} GiB) "
          f"in {model.load_seconds:.2f} s", file=sys.stderr)
    timings = Timings()
    if not args.chat:
        sys.stdout.write(prompt)
    for piece in model.generate(prompt, args.n_predict, args.temp, args.seed, args.top_k, args.top_p, args.min_p,
                                chat=args.chat, timings=timings):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(timings.format(), file=sys.stderr)
    if args.profile:
        from ..runtime.calibrate import load_cached
        rates = load_cached(args.threads)
        print(model.stats.format(rates.ram_read_bw if rates else None), file=sys.stderr)
        if rates is None:
            print("  (run `hybridmoe calibrate` once to compare the CPU experts with this machine's read bandwidth)",
                  file=sys.stderr)
    return 0
