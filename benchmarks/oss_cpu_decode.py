"""gpt-oss all on the CPU: decode (or with -p N, prompts) through the C steps (hm_decode_step / hm_prompt_step with
gpt-oss's block) against the eager decoder, alternated, on a 4-layer slice of gpt-oss-20b's shape (MXFP4 experts, the rest Q8_0, vocabulary
32000; written once into the hybridmoe cache). The eager decoder is an earlier tree's (BASE: its src folder,
from before the C step took gpt-oss), on the same file. Prints bench's tg rows and the ratio of each round.

    python3 benchmarks/oss_cpu_decode.py --base .carry/base_src [--rounds 3] [-n 64 | -p 128] [-t THREADS]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from slices import slice_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-p", type=int, default=0, help="time a prompt of this many tokens instead of decode")
    ap.add_argument("-t", type=int, default=0)
    ap.add_argument("--base", required=True, help="the src folder of a tree whose gpt-oss decodes eagerly")
    a = ap.parse_args()
    from hybridmoe.env import cache_dir
    d = cache_dir() / "models"
    d.mkdir(parents=True, exist_ok=True)
    path = slice_model(str(d / "gpt-oss-20b-4l-mxfp4.gguf"), 32000, "gpt-oss-20b-4l", None, preset="gpt-oss-20b")
    base = [sys.executable, "-m", "hybridmoe.cli", "bench", "-m", path, "-ngl", "0", "-p", str(a.p), "-n", "0" if a.p else str(a.n),
            "-r", "3"] + (["-t", str(a.t)] if a.t else [])
    for r in range(a.rounds):
        rates = {}
        for label, src in (("C step", None), ("eager", os.path.abspath(a.base))):
            env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", "")) if src else None
            out = subprocess.run(base, capture_output=True, text=True, env=env).stdout
            row = [ln for ln in out.splitlines() if ln.startswith("| ") and ("pp" if a.p else "tg") in ln][-1]
            rates[label] = float(row.split("|")[-2].split("±")[0])
            print(f"round {r + 1}, {label}: {row}", flush=True)
        print(f"round {r + 1}: C step / eager {rates['C step'] / rates['eager']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
