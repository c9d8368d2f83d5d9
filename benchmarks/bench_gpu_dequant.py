"""GPU dequantization of the types in users' files (issue 24 point 2), two tables:

1. `dequant`: kernels/gpu_dequant.py's one-pass kernel on one layer's experts of the Qwen3-30B-A3B shape
   ([128, 768, 2048], the ffn_up_exps a prompt uploads), per type: milliseconds, GB/s of file bytes read, G
   weights/s (bf16 written) and both as a share of Q4_0's; plus the reference dequantizer (quant/dequant.py,
   several torch passes), which these types used before they had a kernel.
2. `pp`: pp512 of `-ngl 99 -ot exps=CPU` on a slice of each synthetic mix (synth:qwen3-30b-a3b and its
   -iq4_ks, -q3_k_mix, -iq2_kt, -iq4_xs mixes, --layers of the 48 layers, full vocabulary), through
   `hybridmoe bench -o json`: t/s, GB uploaded per pass, and the upload rate reached (uploaded bytes x
   t/s / 512) next to the Q4_0 row's. With experts in RAM a prompt is bound by the upload, so the bar is
   "per uploaded byte within 85% of Q4_0" (the rate ratio >= 0.85).

    python benchmarks/bench_gpu_dequant.py [dequant] [pp] [--layers 12] [--reps 20] [--json OUT]
        [--bench-args "-op all,1"] [--keep DIR]

Needs a CUDA GPU (and triton). The slices are written to a temporary folder (--keep DIR: there, reused) and
deleted after each row; --layers 12 takes ~4.5 GB of disk per mix and a minute or two to write.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ4_K", "IQ5_K", "IQ4_KS", "IQ5_KS",
         "IQ2_KT", "IQ3_KT", "IQ4_KT", "IQ2_K", "IQ3_XXS")
PRESETS = ("qwen3-30b-a3b", "qwen3-30b-a3b-iq4_ks", "qwen3-30b-a3b-q3_k_mix", "qwen3-30b-a3b-iq2_kt",
           "qwen3-30b-a3b-iq4_xs")
E, F, H = 128, 768, 2048


def _time_ms(fn, reps: int) -> float:
    import torch
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def dequant_table(reps: int) -> list[dict]:
    import torch

    from hybridmoe.kernels.gpu_dequant import dequantize_bf16, has_kernel
    from hybridmoe.quant.dequant import dequantize
    from hybridmoe.quant.random_blocks import random_tensor
    from hybridmoe.quant.types import GGMLType
    rows = []
    for name in TYPES:
        t = GGMLType[name]
        raw = random_tensor(t, (E, F, H), torch.Generator().manual_seed(1)).cuda()
        ms = _time_ms(lambda raw=raw, t=t: dequantize_bf16(raw, t, H), reps)
        ref_ms = _time_ms(lambda raw=raw, t=t: dequantize(raw, t, H, dtype=torch.bfloat16), max(3, reps // 5))
        n = E * F * H
        rows.append(dict(type=name, kernel=has_kernel(t), bits=8 * raw.numel() / n, mib=raw.numel() / 2**20,
                         ms=ms, gbs=raw.numel() / ms / 1e6, gws=n / ms / 1e6, ref_ms=ref_ms))
        raw = None
        torch.cuda.empty_cache()
    q4 = next(r for r in rows if r["type"] == "Q4_0")
    for r in rows:
        r["gbs_vs_q4_0"], r["gws_vs_q4_0"] = r["gbs"] / q4["gbs"], r["gws"] / q4["gws"]
    print(f"\none layer's ffn_up_exps [{E}, {F}, {H}] -> bf16 on {torch.cuda.get_device_name()}, median of {reps}\n")
    print("| type | kernel | bits/w | MiB | ms | GB/s read | vs Q4_0 | G weights/s | vs Q4_0 | reference ms | speedup |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['type']} | {'yes' if r['kernel'] else 'no'} | {r['bits']:.3f} | {r['mib']:.1f} | {r['ms']:.3f} | "
              f"{r['gbs']:.0f} | {r['gbs_vs_q4_0']:.2f} | {r['gws']:.0f} | {r['gws_vs_q4_0']:.2f} | "
              f"{r['ref_ms']:.2f} | {r['ref_ms'] / r['ms']:.1f}x |")
    return rows


def write_slice(preset: str, layers: int, path: str) -> None:
    from hybridmoe.formats.gguf_write import write_gguf
    from hybridmoe.models.synth import (
        config_metadata,
        preset_config,
        preset_mix,
        synth_tensors,
    )
    from hybridmoe.text.builtin_vocab import builtin_vocab_metadata
    cfg, et, ot = preset_config(preset)
    cfg = dataclasses.replace(cfg, n_layer=layers, name=f"{cfg.name}-{layers}l")
    md = {"general.name": cfg.name, "general.type": "model", **config_metadata(cfg),
          **builtin_vocab_metadata(cfg.n_vocab)}
    write_gguf(path, cfg.arch, md, synth_tensors(cfg, et, ot, seed=1234, mix=preset_mix(preset)))


def pp_table(layers: int, bench_args: str, keep: str | None) -> list[dict]:
    rows = []
    folder = keep or tempfile.mkdtemp(prefix="hm-dequant-")
    for preset in PRESETS:
        path = os.path.join(folder, f"{preset}-{layers}l.gguf")
        if not os.path.exists(path):
            print(f"writing {path}", file=sys.stderr, flush=True)
            write_slice(preset, layers, path + ".part")
            os.replace(path + ".part", path)
        cmd = [sys.executable, "-m", "hybridmoe.cli", "bench", "-m", path, "-ngl", "99", "-ot", "exps=CPU",
               "-p", "512", "-n", "0", "-r", "3", "-o", "json", *shlex.split(bench_args)]
        print("$", " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if not keep:
            os.unlink(path)
        if res.returncode:
            print(res.stderr[-2000:], file=sys.stderr)
            rows.append(dict(preset=preset, error=res.stderr.strip().splitlines()[-1:]))
            continue
        r = json.loads(res.stdout)[0]
        up = r["uploaded_bytes"]
        rows.append(dict(preset=preset, ts=r["avg_ts"], sd=r["stddev_ts"], uploaded=up,
                         rate=up * r["avg_ts"] / 512 / 1e9))
    base = next((r for r in rows if r["preset"] == PRESETS[0] and "ts" in r), None)
    print(f"\n`-ngl 99 -ot exps=CPU {bench_args}` pp512, {layers} of 48 layers\n")
    print("| model | pp512 t/s | GB uploaded a pass | upload GB/s reached | per uploaded byte vs Q4_0 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "ts" not in r:
            print(f"| synth:{r['preset']} | failed: {r['error']} | | | |")
            continue
        rel = f"{r['rate'] / base['rate']:.2f}" if base and base["rate"] else "-"
        print(f"| synth:{r['preset']} | {r['ts']:.2f} ± {r['sd']:.2f} | {r['uploaded'] / 1e9:.2f} | "
              f"{r['rate']:.1f} | {rel} |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="*", help="dequant and/or pp (default: both)")
    ap.add_argument("--layers", type=int, default=12, help="layers of each synthetic slice (default 12 of 48)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bench-args", default="", help="more `hybridmoe bench` options, e.g. \"-op all,1\"")
    ap.add_argument("--keep", help="write the slices here and keep them")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    what = a.what or ["dequant", "pp"]
    if set(what) - {"dequant", "pp"}:
        ap.error(f"unknown table(s) {sorted(set(what) - {'dequant', 'pp'})}: dequant, pp")
    out = {}
    if "dequant" in what:
        out["dequant"] = dequant_table(a.reps)
    if "pp" in what:
        out["pp"] = pp_table(a.layers, a.bench_args, a.keep)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
