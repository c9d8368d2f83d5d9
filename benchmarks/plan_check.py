"""The planner's predictions against `bench` on this machine (issues 30 and 29): `plan --check` for a table of
placements, and `plan --suggest`'s top three benched to see whether its ranking holds.

    python3 benchmarks/plan_check.py [SECTION ...] [--model synth:qwen3-30b-a3b] [-r 2] [--vram-gib 12[,24..]]
                                     [--objective tg[,pp,balanced]] [--top 3]

Sections (default: one, two where two GPUs are visible, suggest):
  one      issue 30's table: -ot exps=CPU, --n-cpu-moe 24, --n-cpu-moe 36, all on the GPU (-ngl 99), every weight
           in RAM (-ngl 0: with a GPU visible its prompts' matrices and experts are uploaded to it, op offload),
           and CPU only (-ngl 0 --no-op-offload: no GPU used, the C steps both ways, as on a machine without
           one); pp512, pp4096 (at -ub 512) and tg128 each
  two      issue 29's two-GPU placements: -ts 1/1 all on GPUs; -ts 1/1 --n-cpu-moe 24; -ot exps=CPU with the
           attention split (-ts 1/1); pp512 and tg128
  suggest  `plan --suggest --top 3` for a GPU of --vram-gib (the real GPU's free memory less --headroom, so the model
           does not fit), each suggestion benched (pp512, tg128); the predicted ranking against the measured one
           (Spearman's rho, pairs in the same order, pairs within the noise)
Each placement runs in its own process (`hybridmoe plan ... --check --json`), after `hybridmoe calibrate`.
Prints markdown tables: predicted vs measured t/s, their ratio, and the prediction's largest terms.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

ONE = [("-ngl 99 -ot exps=CPU", ["-ngl", "99", "-ot", "exps=CPU"]),
       ("-ngl 99 --n-cpu-moe 24", ["-ngl", "99", "--n-cpu-moe", "24"]),
       ("-ngl 99 --n-cpu-moe 36", ["-ngl", "99", "--n-cpu-moe", "36"]),
       ("-ngl 99", ["-ngl", "99"]),
       ("-ngl 0 (prompts offloaded to the GPU)", ["-ngl", "0"]),
       ("-ngl 0 --no-op-offload (CPU only)", ["-ngl", "0", "--no-op-offload"])]
TWO = [("-ts 1/1 (all on GPUs)", ["-ngl", "99", "-ts", "1/1"]),
       ("-ts 1/1 --n-cpu-moe 24", ["-ngl", "99", "-ts", "1/1", "--n-cpu-moe", "24"]),
       ("-ts 1/1 -ot exps=CPU (attention split)", ["-ngl", "99", "-ts", "1/1", "-ot", "exps=CPU"])]


def hm(argv: list[str], timeout: int) -> dict | None:
    cmd = [sys.executable, "-m", "hybridmoe.cli"] + argv
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"timed out ({timeout} s): {' '.join(argv)}", file=sys.stderr)
        return None
    if r.returncode != 0:
        print(f"failed ({r.returncode}): {' '.join(argv)}\n{r.stderr[-1500:]}", file=sys.stderr)
        return None
    return json.loads(r.stdout)


def top_terms(terms: dict, n: int = 3) -> str:
    total = sum(terms.values()) or 1.0
    return ", ".join(f"{k} {v / total:.0%}" for k, v in list(terms.items())[:n])


def check(model: str, argv: list[str], prompts: str, reps: int, timeout: int = 420) -> list[dict]:
    doc = hm(["plan", "-m", model] + argv + ["--check", "-p", prompts, "-n", "128", "-r", str(reps), "--json"],
             timeout)
    if not doc:
        return []
    for t in doc["tests"]:                      # the RAM rates the check probed, beside calibrate's
        t["ram_read_bw"], t["stream_bw"] = doc.get("ram_read_bw"), doc.get("stream_bw")
    return doc["tests"]


def table(rows: list[tuple[str, dict]]) -> list[str]:
    out = ["| placement | test | step (predicted / run) | predicted t/s | measured t/s | measured / predicted | "
           "uploaded GB or decode share (predicted / run) | RAM read GB/s (now / calibrated) | expert kernel stream GB/s "
           "(now / calibrated) | largest predicted terms |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for label, t in rows:
        u, g = t.get("uploaded_bytes"), t.get("decode_share")
        up = f"{u['predicted'] / 1e9:.2f} / {u['measured'] / 1e9:.2f} GB" if u else \
            f"share {g['predicted']} / {g['measured']}" if g else "-"
        ram = t.get("ram_read_bw")
        ram = f"{ram['now'] / 1e9:.1f} / {ram['calibrated'] / 1e9:.1f}" if ram else "-"
        sb = t.get("stream_bw") or {}
        sb = f"{sb['now'] / 1e9:.1f} / {sb['calibrated'] / 1e9:.1f}" if sb.get("now") and sb.get("calibrated") else "-"
        out.append(f"| `{label}` | {t['test']} | {t['step']['predicted']} / {t['step']['measured']} | "
                   f"{t['predicted_ts']:.2f} | {t['measured_ts']:.2f} ± {t['stddev_ts']:.2f} | "
                   f"{t['ratio']:.2f}{'' if 0.85 <= t['ratio'] <= 1.15 else ' (out)'} | {up} | {ram} | {sb} | "
                   f"{top_terms(t['terms'])} |")
    within = sum(1 for _, t in rows if 0.85 <= t["ratio"] <= 1.15)
    out.append(f"\n{within} of {len(rows)} within 0.85-1.15")
    return out


def section_rows(model: str, placements, prompts: str, reps: int) -> list[tuple[str, dict]]:
    rows = []
    for label, argv in placements:
        t0 = time.perf_counter()
        r = 1 if argv[:2] == ["-ngl", "0"] else reps           # the CPU's pp4096 takes seconds a repetition
        got = [(label, t) for t in check(model, argv, prompts, r)]
        rows += got
        print(f"done: {label} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        if got:                    # each placement's rows as they come: a run cut short keeps what it measured
            print("\n".join(table(got)[2:-1]), file=sys.stderr, flush=True)
    return rows


def section_suggest(model: str, reps: int, vram_gibs: list[float], objectives: list[str], top: int) -> None:
    """For each simulated GPU size and objective: `plan --suggest --top N` (pp512, tg128), each suggestion benched
    (pp512 and tg128, -r reps; a placement suggested twice is benched once), and the predicted ranking against the
    measured one: Spearman's rho and the pairs in the same order (pairs closer than their noise are ties)."""
    import torch

    from hybridmoe.commands.plan_check import rank_agreement
    if not torch.cuda.is_available():
        print("suggest: skipped, no GPU (it benches suggestions for a simulated smaller one)")
        return
    free, _ = torch.cuda.mem_get_info(0)
    measured: dict[str, dict] = {}
    for vram in vram_gibs:
        headroom = max(free / 2**30 - vram, 0.0)
        for objective in objectives:
            doc = hm(["plan", "-m", model, "--suggest", "--top", str(top), "--objective", objective, "-p", "512",
                      "-n", "128", "--headroom", f"{headroom:.2f}", "--json"], 300)
            if not doc:
                continue
            rows = []
            for s in doc["suggestions"]:
                if s["flags"] not in measured:
                    t0 = time.perf_counter()
                    measured[s["flags"]] = {t["test"]: t for t in check(model, s["argv"], "512", reps)}
                    print(f"done: {s['flags']} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
                tests = measured[s["flags"]]
                if "pp512" in tests and "tg128" in tests:
                    rows.append((s, tests["pp512"], tests["tg128"]))
            print(f"\n`plan --suggest --top {top} --objective {objective}` for a GPU of {vram:g} GiB "
                  f"(--headroom {headroom:.1f} on this one; pp512, tg128, -r {reps}):\n")
            print("| # | flags | predicted TG | measured TG | predicted PP | measured PP | note |")
            print("| ---: | --- | ---: | ---: | ---: | ---: | --- |")
            for i, (s, pp, tg) in enumerate(rows, 1):
                print(f"| {i} | `{s['flags']}` | {tg['predicted_ts']:.1f} | {tg['measured_ts']:.1f} ± "
                      f"{tg['stddev_ts']:.1f} | {pp['predicted_ts']:.0f} | {pp['measured_ts']:.0f} ± "
                      f"{pp['stddev_ts']:.0f} | {s['note']} |")
            if len(rows) < len(doc["suggestions"]):
                print(f"\n{len(doc['suggestions']) - len(rows)} suggestion(s) not measured (see stderr)")
            for name, k in (("TG", 2), ("PP", 1)):
                pred = [r[k]["predicted_ts"] for r in rows]
                meas = [r[k]["measured_ts"] for r in rows]
                agr = rank_agreement(pred, meas, [r[k]["stddev_ts"] for r in rows])
                order = lambda xs: [i + 1 for i in sorted(range(len(xs)), key=lambda i: -xs[i])]   # noqa: E731
                rho = "n/a" if agr["spearman"] is None else f"{agr['spearman']:.2f}"
                mark = " (the objective)" if name.lower() == objective else ""
                print(f"\n{name}{mark}: predicted order {order(pred)}, measured {order(meas)}; Spearman {rho}; "
                      f"pairs in the same order {len(agr['agree'])}, reversed {len(agr['differ'])}"
                      + (f" {[(i + 1, j + 1) for i, j in agr['differ']]}" if agr["differ"] else "")
                      + f", within noise {len(agr['ties'])}: {'AGREES' if agr['matches'] else 'DIFFERS'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sections", nargs="*", metavar="SECTION", help="one, two, suggest")
    ap.add_argument("--model", default="synth:qwen3-30b-a3b")
    ap.add_argument("-r", "--repetitions", type=int, default=2)
    ap.add_argument("--vram-gib", default="12", help="suggest: the GPU sizes --suggest plans for, GiB, comma list "
                    "(default 12)")
    ap.add_argument("--objective", default="tg", help="suggest: objectives to rank by, comma list of tg, pp, "
                    "balanced (default tg)")
    ap.add_argument("--top", type=int, default=3, help="suggest: suggestions benched per ranking (default 3)")
    ap.add_argument("--only", default="", help="rows of section one to run, by number from 1 (e.g. 1,2): a table "
                    "split over several calls")
    args = ap.parse_args()
    bad = [s for s in args.sections if s not in ("one", "two", "suggest")]
    if bad:
        ap.error(f"unknown section {bad[0]!r}: use one, two or suggest")
    import torch
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    sections = args.sections or (["one"] + (["two"] if n_gpu >= 2 else []) + (["suggest"] if n_gpu else []))
    cal = hm(["calibrate", "--cached", "--json"], 600)
    if cal:
        costs = cal.get("costs", {})
        print(f"calibration: {cal.get('host')} {cal.get('measured_at')}; costs: "
              f"{json.dumps({k: v for k, v in costs.items() if not k.startswith('_')})}")
        timed = costs.get("_calibration", {}).get("measured", {})       # the upload fit's timings, to check it
        print(f"calibration's timed runs (s per model): {json.dumps({k: v for k, v in timed.items() if 'upload' in k or 'offload' in k})}")
        checks = costs.get("_calibration", {}).get("checks", {})
        print(f"calibration's checks (s a layer, measured vs predicted, not fitted): {json.dumps(checks)}\n")
    rows = []
    for s in sections:
        if s == "one":
            extra = ["-sm", "none"] if n_gpu > 1 else []
            pick = [int(i) for i in args.only.split(",") if i.strip()] or range(1, len(ONE) + 1)
            rows += section_rows(args.model, [(ONE[i - 1][0], ONE[i - 1][1] + extra) for i in pick], "512,4096",
                                 args.repetitions)
        elif s == "two" and n_gpu < 2:
            print("two: skipped, fewer than two GPUs")
        elif s == "two":
            rows += section_rows(args.model, TWO, "512", args.repetitions)
    if rows:                                                   # one table for the placements
        print("\n".join(table(rows)), flush=True)
    if "suggest" in sections:
        section_suggest(args.model, args.repetitions, [float(v) for v in args.vram_gib.split(",")],
                        args.objective.split(","), args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
