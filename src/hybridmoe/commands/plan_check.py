"""`hybridmoe plan --check`: run `bench`'s tests on the plan's placement here and print the prediction beside the
measurement, with every term of the prediction, so a miss says which term is off; also as JSON (--json).

The tests are llama-bench's pp{-p} (default 512) and tg{-n} (default 128), timed as `bench` times them (a warm-up,
then -r repetitions; t/s is the mean). Beside the times: which step the runtime built against the one predicted
(cpu / graph / eager), the host expert bytes uploaded per prompt, and the decode share's count.

A VM's RAM read rate moves between calls (83-112 GB/s on the lent H100 VM): the check probes it before and after
the tests, as calibrate measured it (torch.sum over a tensor, and the C expert kernel's streaming sweep, which do
not move together), and predicts with the faster of each (Rates.with_ram_read), printing them beside the
calibration's.
"""
from __future__ import annotations

import dataclasses
import json
import statistics

import torch

from ..errors import HybridMoeError

STEP_KINDS = {"StaticDecoder": "graph", "StaticPrefill": "graph", "CpuDecoder": "cpu"}


def _step_kind(model, which: str) -> str:
    """The kind of the step the runtime built (a subclass's, e.g. gpt-oss's decoder, as its base's)."""
    step = model.static_step(which)
    names = [c.__name__ for c in type(step).__mro__] if step is not None else []
    return next((STEP_KINDS[n] for n in names if n in STEP_KINDS), "eager")


def measure(model_path: str, opts, n_prompts: list[int], n_gen: int, reps: int) -> list[dict]:
    """bench's tests on this placement (pp of each n_prompts, then tg n_gen): [{"test", "n_prompt", "n_gen",
    "samples_ns", "uploaded_bytes", "step", "share"}]."""
    import hybridmoe

    from .bench import run_tests
    kw = dataclasses.asdict(opts)
    kw["ctx_size"] = max(kw.get("ctx_size") or 0, max(n_prompts) + n_gen + 1)
    model = hybridmoe.load(model_path, **kw)
    threads = torch.get_num_threads()
    config = {"b": opts.batch_size, "ub": opts.ubatch_size, "t": None, "op": None, "ooae": "auto", "fmoe": True}
    out = []
    try:
        for i, (n_p, n_g) in enumerate([(n, 0) for n in n_prompts] + ([(0, n_gen)] if n_gen else [])):
            (samples, up), = run_tests(model, [config], n_p, n_g, 0, reps, 1234 + i, threads, lambda: None, False)
            which = "prompt" if n_p else "decode"
            g, k = model.decode_share()
            out.append({"test": f"pp{n_p}" if n_p else f"tg{n_g}", "n_prompt": n_p, "n_gen": n_g,
                        "samples_ns": samples, "uploaded_bytes": up, "step": _step_kind(model, which),
                        "share": [g, k] if not n_p else None})
    finally:
        del model
        import gc
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def compare(preds: dict, runs: list[dict]) -> list[dict]:
    """One record per test: predicted and measured t/s and seconds, their ratio, the prediction's terms.
    preds: n_prompt -> the prediction for pp{n_prompt} (and, any of them, tg)."""
    rows = []
    for r in runs:
        pred = preds[r["n_prompt"]] if r["n_prompt"] else next(iter(preds.values()))
        n_tok = r["n_prompt"] + r["n_gen"]
        ts = [n_tok * 1e9 / s for s in r["samples_ns"]]
        meas = statistics.fmean(ts)
        is_pp = bool(r["n_prompt"])
        pts = pred.pp if is_pp else pred.tg
        terms = pred.pp_terms if is_pp else pred.tg_terms
        row = {"test": r["test"], "predicted_ts": pts, "measured_ts": meas,
               "stddev_ts": statistics.stdev(ts) if len(ts) > 1 else 0.0,
               "ratio": meas / pts if pts else 0.0, "predicted_s": n_tok / pts if pts else 0.0,
               "measured_s": n_tok / meas if meas else 0.0,
               "step": {"predicted": pred.prompt_kind if is_pp else pred.decode_kind, "measured": r["step"]},
               "terms": dict(sorted(terms.items(), key=lambda kv: -kv[1])),
               "bound_ts": (pred.pp_bound if is_pp else pred.tg_bound).ts}
        if is_pp:
            row["uploaded_bytes"] = {"predicted": pred.uploaded_bytes, "measured": r["uploaded_bytes"]}
        else:
            g = pred.share[0] if pred.share else 0
            row["decode_share"] = {"predicted": g, "measured": r["share"][0] if r["share"] else 0}
        rows.append(row)
    return rows


def format_check(rows: list[dict], flags: str, source: str) -> str:
    out = [f"plan --check: {flags}", f"rates: {source}", "",
           "| test | step (predicted / run) | predicted t/s | measured t/s | measured / predicted |",
           "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['test']} | {r['step']['predicted']} / {r['step']['measured']} | {r['predicted_ts']:.2f} | "
                   f"{r['measured_ts']:.2f} ± {r['stddev_ts']:.2f} | {r['ratio']:.2f} |")
    for r in rows:
        out += ["", f"{r['test']}: predicted {r['predicted_s'] * 1e3:.2f} ms, measured {r['measured_s'] * 1e3:.2f} ms "
                f"(roofline bound {r['bound_ts']:.2f} t/s)"]
        total = sum(r["terms"].values()) or 1.0
        for k, v in r["terms"].items():
            out.append(f"  {k:<34} {v * 1e3:10.3f} ms  {v / total:5.1%}")
        if "uploaded_bytes" in r:
            u = r["uploaded_bytes"]
            out.append(f"  uploaded to GPUs: predicted {u['predicted'] / 1e9:.2f} GB, measured {u['measured'] / 1e9:.2f} GB")
        if "decode_share" in r:
            d = r["decode_share"]
            out.append(f"  decode share (experts a CPU layer the GPU runs): predicted {d['predicted']}, "
                       f"runtime {d['measured']}")
    return "\n".join(out)


def opts_flags(o) -> str:
    """The placement's llama.cpp flags, for the report's heading."""
    out = [f"-ngl {o.n_gpu_layers}"]
    out += [f'-ot "{r}"' for r in o.override_tensor]
    if o.cpu_moe:
        out.append("--cpu-moe")
    if o.n_cpu_moe:
        out.append(f"--n-cpu-moe {o.n_cpu_moe}")
    if o.tensor_split:
        out.append("-ts " + "/".join(f"{x:g}" for x in o.tensor_split))
    if o.split_mode != "layer":
        out.append(f"-sm {o.split_mode}")
    if o.main_gpu:
        out.append(f"-mg {o.main_gpu}")
    if not o.op_offload:
        out.append("--no-op-offload")
    return " ".join(out + [f"-ub {o.ubatch_size}"])


def run_check(args, placement, rates, source: str, predict_fn) -> int:
    """plan --check: measure, compare, print (text or JSON). Exit status 0 (a miss is a result, not an error)."""
    if args.rig:
        raise HybridMoeError("--check measures this machine: drop --rig (a rig file describes another machine)")
    if args.model.startswith("catalog:"):
        raise HybridMoeError("--check runs the model: give a .gguf file, builtin or synth:PRESET, not a catalog entry")
    if rates is None:
        raise HybridMoeError("--check compares with this machine's calibration: run `hybridmoe calibrate` first")
    placement.check_fits()
    from ..perf.calibrate import ram_read_now
    from .calibrate_costs import stream_rate_now
    cached, calibrated_ram = rates, rates.ram_read_bw
    cpu = rates.costs.get("cpu", {})
    stream0 = cpu.get("stream_bw")

    def probe():
        return ram_read_now(), stream_rate_now(cpu.get("call_s", 0.0), rates.quick) if stream0 else None
    # probed before the tests and after them, the faster of each: the memory of a process that just ended (the
    # last placement's, its pinned arena) is still being handed back to the system at the first probe, which
    # then read the kernel at 66-72 GB/s where the tests ran at 84-94
    before = probe()
    runs = measure(args.model, placement.opts, args.n_prompts, args.n_gen, max(args.repetitions, 1))
    after = probe()
    stream = max(before[1], after[1]) if stream0 and before[1] and after[1] else None
    rates = rates.with_ram_read(max(before[0], after[0]), stream)
    source = (f"{source}; RAM read {rates.ram_read_bw / 1e9:.1f} GB/s now, {calibrated_ram / 1e9:.1f} GB/s at "
              f"calibration")
    if stream0:
        source += (f"; the expert kernel streams {rates.costs['cpu']['stream_bw'] / 1e9:.1f} GB/s now, "
                   f"{stream0 / 1e9:.1f} GB/s at calibration" + ("" if stream else " (scaled as the RAM read)"))
    # (the runtime picks its decode share's count on the cached rates: so does the prediction)
    preds = {n: predict_fn(placement, rates, n_prompt=n, n_gen=args.n_gen, share_rates=cached)
             for n in args.n_prompts}
    pred = preds[args.n_prompts[0]]
    rows = compare(preds, runs)
    flags = opts_flags(placement.opts)
    if args.json:
        print(json.dumps({"model": args.model, "flags": flags, "rates": source, "calibrated": pred.calibrated,
                          "ram_read_bw": {"calibrated": calibrated_ram, "now": rates.ram_read_bw},
                          "stream_bw": {"calibrated": stream0, "now": rates.costs.get("cpu", {}).get("stream_bw")},
                          "ubatch": pred.ubatch, "tests": rows}, indent=1))
    else:
        print(format_check(rows, f"-m {args.model} {flags}".strip(), source))
    return 0


def rank_agreement(predicted: list[float], measured: list[float], noise: list[float] | None = None) -> dict:
    """How well a predicted ranking (higher is better) matches the measured one: Spearman's rho over the ranks,
    and the pairs both order the same way. A pair whose measured values differ by less than their noise (the sum
    of their standard deviations), or that is predicted alike, is counted apart as a tie: nothing to check."""
    n = len(predicted)
    if n != len(measured) or (noise is not None and len(noise) != n):
        raise ValueError("predicted, measured and noise need one value per placement")
    noise = noise or [0.0] * n
    agree, differ, ties = [], [], []
    for i in range(n):
        for j in range(i + 1, n):
            if abs(measured[i] - measured[j]) <= noise[i] + noise[j] or predicted[i] == predicted[j]:
                ties.append((i, j))
            elif (predicted[i] - predicted[j]) * (measured[i] - measured[j]) > 0:
                agree.append((i, j))
            else:
                differ.append((i, j))

    def ranks(xs):
        order = sorted(range(n), key=lambda i: -xs[i])
        r = [0.0] * n
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r
    rho = None
    if n >= 2:
        rp, rm = ranks(predicted), ranks(measured)
        rho = 1 - 6 * sum((a - b) ** 2 for a, b in zip(rp, rm)) / (n * (n * n - 1))
    return {"spearman": rho, "agree": agree, "differ": differ, "ties": ties,
            "matches": not differ}
