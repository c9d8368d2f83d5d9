"""The quality table (issue 28): perplexity and KL-divergence of the built-in model re-quantized to each type
hybridmoe can quantize, against its F16 weights, on the held-out text; all on the CPU (and on any placement
given after --). Prints a markdown table for docs/benchmarks.md.

    python benchmarks/builtin/quality.py F16_GGUF [--chunks 10] [-- PLACEMENT FLAGS]"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

from hybridmoe.models.convert import requantize
from hybridmoe.quant.types import GGMLType, bits_per_weight

HERE = os.path.dirname(os.path.abspath(__file__))
TYPES = ("F16", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0")


def perplexity(model, base, extra, args, first):
    cmd = [sys.executable, "-m", "hybridmoe", "perplexity", "-m", model, "-f", args.text, "-c", str(args.ctx),
           "--chunks", str(args.chunks), "--kl-divergence-base", base, *extra]
    if not first:
        cmd.append("--kl-divergence")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    ppl = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", out) or re.search(
        r"Mean PPL\(Q\)\s*:\s*([\d.]+)\s*±\s*([\d.]+)", out)
    kld = re.search(r"Mean\s+KLD:\s+([\d.]+) ±\s+([\d.]+)", out)
    top = re.search(r"Same top p:\s+([\d.]+) ±", out)
    return ppl.groups(), (kld.groups() if kld else ("0", "0")), (top.group(1) if top else "100")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("f16")
    p.add_argument("--text", default=os.path.join(HERE, "heldout.txt"))
    p.add_argument("--chunks", type=int, default=10)
    p.add_argument("-c", "--ctx", type=int, default=512)
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    tmp = tempfile.mkdtemp()
    base = os.path.join(tmp, "base.kld")
    print(f"placement: {' '.join(extra) or 'all on the CPU'}; {args.chunks} chunks of {args.ctx} tokens of "
          f"{os.path.basename(args.text)}\n")
    print("| type | bits/weight | PPL | KLD vs F16 | same top |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for i, t in enumerate(TYPES):
        model = args.f16 if t == "F16" else requantize(args.f16, os.path.join(tmp, f"{t}.gguf"), GGMLType[t])
        (ppl, ppl_e), (kld, kld_e), top = perplexity(model, base, extra, args, first=i == 0)
        print(f"| {t} | {bits_per_weight(GGMLType[t]):.2f} | {float(ppl):.3f} ± {float(ppl_e):.3f} | "
              f"{float(kld):.5f} ± {float(kld_e):.5f} | {float(top):.2f}% |", flush=True)


if __name__ == "__main__":
    main()
