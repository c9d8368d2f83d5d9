"""Placements over several GPUs against all-CPU: logits, the placement's warnings, predicted vs measured speed.

    python3 benchmarks/multi_gpu.py -m synth:qwen3-30b-a3b --tokens 256 [--bench] -- "-ngl 99 -ts 1/1" "..."

For each placement (llama.cpp flags, as `hybridmoe run` takes them): the planner's warnings and prediction
(`plan --json`), then prompt logits (one --tokens prompt) and 16 greedy decode steps against the all-CPU run of
the same model (relative L2 and top-1 agreement), and with --bench `hybridmoe bench -p 512 -n 128 -r 3` in a
fresh process. One markdown table at the end. Needs the GPUs the flags name (issue 29).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shlex
import subprocess
import sys

import torch

import hybridmoe
from hybridmoe.placement.options import add_placement_args, options_from_args


def _options(flags: str) -> dict:
    p = argparse.ArgumentParser(add_help=False)
    add_placement_args(p)
    ns, rest = p.parse_known_args(shlex.split(flags))
    if rest:
        raise SystemExit(f"flags not understood: {rest}")
    return dataclasses.asdict(options_from_args(ns))


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _run(model: str, flags: str, ids: list[int], steps: int):
    opts = _options(flags)
    opts["ctx_size"] = len(ids) + steps + 8
    m = hybridmoe.load(model, **opts)
    kv = m.new_cache(len(ids) + steps + 8)
    p = m.forward(torch.tensor(ids), 0, kv).float().cpu()
    tok, dec = int(p[-1].argmax()), []
    for i in range(steps):
        out = m.forward(torch.tensor([tok]), len(ids) + i, kv).float().cpu()
        dec.append(out)
        tok = int(out[-1].argmax())
    devices = sorted({d.name for d in m.devices.values()})
    crossings = m.stats.crossings
    del m, kv
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return p, torch.cat(dec), devices, crossings


def _cli(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "hybridmoe.cli", *args], capture_output=True, text=True)
    if r.returncode:
        return "ERROR: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="synth:qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("placements", nargs="+")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (a.tokens,), generator=gen).tolist()
    # every run decodes its own greedy tokens: decode logits are compared up to and including the first step
    # whose top-1 token differs from all-CPU's (later steps have different inputs)
    ref_p, ref_d, _, _ = _run(a.model, "-ngl 0", ids, a.steps)
    rows = []
    for flags in a.placements:
        plan = _cli("plan", "-m", a.model, *shlex.split(flags), "--json")
        pred, warns = "", []
        if not plan.startswith("ERROR"):
            doc = json.loads(plan)
            warns = doc.get("warnings") or []
            pr = doc.get("predicted") or {}
            pred = f"tg {pr['tg_ts']:.1f}, pp{pr['n_prompt']} {pr['pp_ts']:.0f}" if pr else "(no rates)"
        try:
            p, d, devices, crossings = _run(a.model, flags, ids, a.steps)
        except Exception as e:                               # a placement that fails is a result, not a crash
            rows.append((flags, f"failed: {e}", "", "", pred, warns, ""))
            continue
        agree = int((d.argmax(-1) == ref_d.argmax(-1)).cumprod(0).sum())
        n = min(agree + 1, a.steps)
        row = (flags, ",".join(devices), f"{_rel_l2(p, ref_p):.2e} / top-1 {float((p.argmax(-1) == ref_p.argmax(-1)).float().mean()):.3f}",
               f"{_rel_l2(d[:n], ref_d[:n]):.2e} ({agree}/{a.steps} same tokens)", pred, warns, crossings)
        if a.bench:
            out = _cli("bench", "-m", a.model, *shlex.split(flags), "-p", "512", "-n", "128", "-r", "3")
            row = row + ("; ".join(l.strip() for l in out.splitlines() if "pp512" in l or "tg128" in l or "ERROR" in l),)
        rows.append(row)
        print(json.dumps({"flags": flags, "row": [str(x) for x in row]}), flush=True)
    print(f"\nmodel {a.model}, prompt {a.tokens} tokens, {a.steps} decode steps, against -ngl 0 (all-CPU)\n")
    print("| placement | devices | prompt logits rel. L2 | decode rel. L2 | predicted | crossings/run | warnings |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| `{r[0]}` | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[6]} | {'; '.join(w[:120] for w in r[5]) or '-'} |")
    for r in rows:
        if len(r) > 7:
            print(f"\n### bench {r[0]}\n{r[7]}")


if __name__ == "__main__":
    main()
