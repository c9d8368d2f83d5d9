"""`hybridmoe bench`: llama-bench. Tests pp<N>, tg<N>, pp<N>+tg<M> (optionally at depth d) over the cross
product of every option's values; each distinct placement is loaded once.

Every numeric option takes a comma list (`-ub 128,512 -ngl 0,99 -t 8,16`); `-ts` alternatives are
comma-separated with '/' inside (`-ts 3/1,1/1`) and `-ot`/`-op` alternatives are separated by ';' (one
`-ot` alternative may hold several comma-separated rules, as in llama-server; an empty alternative means
no override). Repeated `-ot` flags vary independently (cross product) and each combination's rules apply in
flag order. Defaults follow llama-bench (-p 512, -n 128, -r 5, -ngl 99 where a GPU is visible), with -fa 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from ..errors import HybridMoeError
from ..placement.options import add_compat_args, compat_notes
from .sweep_bench import memory_report, progress_bar, random_tokens

# -------------------------------------------------------------------------------- options


def _int(s: str) -> int:
    if not s.strip().isdigit():
        raise ValueError(s)
    return int(s)


def _pos(s: str) -> int:
    if _int(s) < 1:
        raise ValueError(s)
    return int(s)


def _bool(s: str) -> bool:
    v = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}.get(s.lower())
    if v is None:
        raise ValueError(s)
    return v


def _ngl(s: str) -> int:
    from ..placement.options import ALL_LAYERS
    return ALL_LAYERS if s.lower() == "all" else _int(s)


def _ts(s: str):
    vals = tuple(float(x) for x in s.split("/")) if s.strip() else ()
    return vals if any(vals) else None


def _choice(*names):
    def parse(s: str):
        if s.lower() not in names:
            raise ValueError(s)
        return s.lower()
    return parse


@dataclass(frozen=True)
class Opt:
    dest: str
    flags: str           # space-separated
    header: str          # markdown column (llama-bench's name)
    field: str           # the result record's key
    width: int           # llama-bench's markdown width; negative: left-aligned
    default: object
    parse: object        # one item -> value
    kind: str            # P: placement (a reload) | R: runtime (changed on the loaded model)
    sep: str = ","


# llama-bench flags that change nothing here: accepted (pasted command lines keep working), with a note
BENCH_COMPAT = {
    "-mmp --mmap": (1, "weights are memory-mapped either way; with a GPU, CPU experts are copied into pinned RAM "
                       "when they fit"),
    "--prio": (1, "threads run at the normal priority"),
    "--poll": (1, "the CPU kernels' threads always spin while waiting"),
    "-C --cpu-mask": (1, "threads are not pinned to CPUs"),
    "--cpu-strict": (1, "threads are not pinned to CPUs"),
}
KV_TYPES = ("f32", "f16", "bf16", "q8_0")
OPTS = tuple(Opt(*row) for row in (
    ("b", "-b --batch-size", "n_batch", "n_batch", 7, 2048, _pos, "R"),
    ("ub", "-ub --ubatch-size", "n_ubatch", "n_ubatch", 8, 512, _pos, "R"),
    ("ctk", "-ctk --cache-type-k", "type_k", "type_k", 6, "f16", _choice(*KV_TYPES), "P"),
    ("ctv", "-ctv --cache-type-v", "type_v", "type_v", 6, "f16", _choice(*KV_TYPES), "P"),
    ("t", "-t --threads", "threads", "n_threads", 7, None, _pos, "R"),
    ("ngl", "-ngl --n-gpu-layers", "ngl", "n_gpu_layers", 3, 99, _ngl, "P"),
    ("ncmoe", "-ncmoe --n-cpu-moe", "n_cpu_moe", "n_cpu_moe", 10, 0, _int, "P"),
    ("cmoe", "-cmoe --cpu-moe", "cmoe", "cpu_moe", 4, False, _bool, "P"),
    ("sm", "-sm --split-mode", "sm", "split_mode", 6, "layer", _choice("layer", "none", "row"), "P"),
    ("mg", "-mg --main-gpu", "main_gpu", "main_gpu", 10, 0, _int, "P"),
    ("nkvo", "-nkvo --no-kv-offload", "nkvo", "no_kv_offload", 10, False, _bool, "P"),
    ("fa", "-fa --flash-attn", "fa", "flash_attn", 2, True, _bool, "P"),
    ("ts", "-ts --tensor-split", "ts", "tensor_split", -10, None, _ts, "P"),
    ("ot", "-ot --override-tensor", "ot", "tensor_buft_overrides", -10, (), str, "P", ";"),
    ("nopo", "-nopo --no-op-offload", "nopo", "no_op_offload", 4, False, _bool, "P"),
    ("op", "-op --offload-policy", "op", "offload_policy", -10, None, lambda s: s.strip() or None, "R", ";"),
    ("ooae", "-ooae --offload-only-active-experts", "ooae", "offload_only_active_experts", 4, "auto",
     lambda s: "auto" if s == "auto" else _bool(s), "R"),
    ("fmoe", "-fmoe --fused-moe", "fmoe", "fused_moe", 4, True, _bool, "R"),
))


def setup_arg_parser(p):
    p.add_argument("-m", "--model", action="append", default=None,
                   help="GGUF file, builtin or synth:PRESET; repeatable (default: builtin, or synth:tiny where "
                        "the package has no built-in model)")
    p.add_argument("-p", "--n-prompt", action="append", default=None, metavar="N[,N..]", help="default 512")
    p.add_argument("-n", "--n-gen", action="append", default=None, metavar="N[,N..]", help="default 128")
    p.add_argument("-pg", action="append", default=[], metavar="PP,TG", help="a pp+tg test; repeatable")
    p.add_argument("-d", "--n-depth", action="append", default=None, metavar="N[,N..]",
                   help="tokens already in the KV cache (filled first, not timed); default 0")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="timed runs per test (default 5)")
    p.add_argument("-o", "--output", choices=["md", "json", "jsonl", "csv", "sql"], default="md")
    p.add_argument("-oe", "--output-err", choices=["md", "json", "jsonl", "csv", "sql", "none"], default="none",
                   help="also print the results to stderr in this format")
    p.add_argument("--delay", type=float, default=0.0, metavar="S", help="seconds to wait before each test")
    add_compat_args(p, BENCH_COMPAT)
    p.add_argument("--roofline", action="store_true",
                   help="add each test's roofline bound from calibrated rates and the share reached")
    p.add_argument("--interleave", action="store_true",
                   help="alternate the repetitions of options that need no reload (-op, -ooae, -fmoe, -t, -b, -ub) "
                        "on one loaded model, so drift over the run (warm-up, the VM) does not favour the first")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show progress on stderr (default: when stderr is a terminal)")
    from .common import add_check_tensors_arg
    add_check_tensors_arg(p)
    g = p.add_argument_group("parameters: comma lists (-ot, -op: ';' lists); every combination is run")
    for o in OPTS:
        g.add_argument(*o.flags.split(), dest=f"opt_{o.dest}", action="append", default=None, metavar="V",
                       help=f"default {_cell(o.default) if o.default not in (None, ()) else 'none'}"
                       + (" (99 with a GPU, else 0)" if o.dest == "ngl" else ""))


def _values(o: Opt, given: list[str] | None) -> list:
    if not given:
        return [o.default]
    if o.dest == "ot":
        # each flag varies independently; a combination is the tuple of its non-empty rules
        per_flag = [[a.strip() for a in g.split(";")] for g in given]
        return [tuple(r for r in combo if r) for combo in itertools.product(*per_flag)]
    out = []
    for g in given:
        for item in g.split(o.sep):
            item = item.strip()
            try:
                out.append(o.parse(item))
            except (ValueError, TypeError):
                raise HybridMoeError(f"{o.flags.split()[0]} {g!r}: {item!r} is not a valid value") from None
    return out


def _ints(given, default) -> list[int]:
    if not given:
        return list(default)
    try:
        return [_int(x.strip()) for g in given for x in g.split(",") if x.strip()]
    except ValueError:
        raise HybridMoeError(f"expected comma-separated numbers, got {given}") from None


def parameter_sets(args) -> tuple[list[dict], dict[str, list]]:
    """Every combination of the options' values (in option order), and the values of each option."""
    values = {o.dest: _values(o, getattr(args, f"opt_{o.dest}", None)) for o in OPTS}
    if not getattr(args, "opt_ngl", None):
        from ..devices import list_devices
        values["ngl"] = [99 if any(d.is_gpu for d in list_devices()) else 0]   # llama-bench's 99 needs a GPU
    sets = [dict(zip(values, combo)) for combo in itertools.product(*values.values())]
    return sets, values


def list_tests(args) -> list[tuple[int, int]]:
    """(n_prompt, n_gen) of each test, in llama-bench's order: pp tests, tg tests, pp+tg tests."""
    tests = [(p, 0) for p in _ints(args.n_prompt, [512]) if p > 0]
    tests += [(0, n) for n in _ints(args.n_gen, [128]) if n > 0]
    for pg in args.pg:
        parts = [x for x in pg.split(",") if x.strip()]
        if len(parts) != 2 or not all(x.strip().isdigit() for x in parts):
            raise HybridMoeError(f"-pg {pg!r}: give PP,TG like -pg 512,128")
        tests.append((int(parts[0]), int(parts[1])))
    if not tests:
        raise HybridMoeError("no tests: give -p, -n or -pg with a value above 0")
    return tests


def placement_key(p: dict) -> tuple:
    return tuple(p[o.dest] for o in OPTS if o.kind == "P")


def load_kwargs(group: list[dict], ctx: int) -> dict:
    p = group[0]
    return dict(n_gpu_layers=p["ngl"], override_tensor=list(p["ot"]), cpu_moe=p["cmoe"], n_cpu_moe=p["ncmoe"],
                tensor_split=list(p["ts"]) if p["ts"] else None, main_gpu=p["mg"], split_mode=p["sm"],
                no_kv_offload=p["nkvo"], ctx_size=ctx, cache_type_k=p["ctk"], cache_type_v=p["ctv"],
                batch_size=max(q["b"] for q in group), ubatch_size=max(min(q["ub"], q["b"]) for q in group),
                flash_attn=p["fa"], op_offload=not p["nopo"], threads=p["t"])


def apply_runtime(model, p: dict, default_threads: int) -> int:
    """Batch sizes, threads and the scheduler's policies on a loaded model (no reload). Returns the thread
    count in use."""
    model.options.batch_size = p["b"]
    model.options.ubatch_size = min(p["ub"], p["b"])
    threads = p["t"] or default_threads
    torch.set_num_threads(threads)
    model.runtime.threads = p["t"]
    model.sched.n_threads = p["t"]
    model.set_policy(p["op"], p["ooae"], p["fmoe"])
    return threads


# -------------------------------------------------------------------------------- running


def prepare_test(model, n_prompt: int, n_gen: int, n_depth: int, seed: int):
    """A function once(n_steps) that runs the test's prompt (at depth n_depth, filled here, not timed) and
    n_steps decode steps, as llama-bench times them."""
    from ..generate import prefill
    kv = model.new_cache(max(n_depth + n_prompt + n_gen, 1))
    gen = torch.Generator().manual_seed(seed)
    vocab = model.cfg.n_vocab
    if n_depth:
        prefill(model, kv, random_tokens(gen, vocab, n_depth), 0)
    prompt = random_tokens(gen, vocab, n_prompt)
    steps = [torch.tensor([t]) for t in random_tokens(gen, vocab, n_gen)]

    def once(n_steps: int):
        if prompt:
            prefill(model, kv, prompt, n_depth)
        pos = n_depth + n_prompt
        for i in range(n_steps):
            model.forward(steps[i], pos + i, kv, all_logits=False)
        model.sync()
    return once


def timed(model, once, n_gen: int) -> tuple[int, int]:
    """(nanoseconds, bytes uploaded) of one repetition."""
    up0 = model.stats.uploads["bytes"]
    t0 = time.perf_counter_ns()
    once(n_gen)
    return time.perf_counter_ns() - t0, model.stats.uploads["bytes"] - up0


def reads_host_ram(model) -> bool:
    """Does a decode step read a share (1% or more) of its weight bytes from host RAM? (The token embedding's
    row alone does not count.)"""
    from ..perf.roofline import model_work
    per_dev = model_work(model.file.tensors, model.placement.device_of, model.cfg).decode_bytes
    return per_dev.get("CPU", 0.0) >= 0.01 * sum(per_dev.values())


def run_tests(model, configs: list[dict], n_prompt: int, n_gen: int, n_depth: int, reps: int, seed: int,
              default_threads: int, tick, interleave: bool) -> list[tuple[list[int], float]]:
    """Per config (runtime options on this loaded model): nanoseconds of each timed repetition (after an
    untimed warm-up) and the bytes uploaded per repetition. Interleaved: rep 1 of every config, then rep 2..."""
    once = prepare_test(model, n_prompt, n_gen, n_depth, seed)
    samples = [[] for _ in configs]
    uploaded = [0] * len(configs)
    order = [(r, c) for r in range(reps) for c in range(len(configs))] if interleave else \
        [(r, c) for c in range(len(configs)) for r in range(reps)]
    for r, c in order:
        apply_runtime(model, configs[c], default_threads)
        if not samples[c]:
            once(min(n_gen, 2))                                           # warm-up
            tick()
        ns, up = timed(model, once, n_gen)
        samples[c].append(ns)
        uploaded[c] += up
        tick()
    return [(smp, up / reps) for smp, up in zip(samples, uploaded)]


def name_of_test(n_prompt: int, n_gen: int, n_depth: int) -> str:
    name = f"pp{n_prompt}" if not n_gen else f"tg{n_gen}" if not n_prompt else f"pp{n_prompt}+tg{n_gen}"
    return name + (f" @ d{n_depth}" if n_depth else "")


def result_record(model, info: dict, p: dict, threads: int, n_prompt, n_gen, n_depth, samples, uploaded,
                  bound) -> dict:
    desc = model_description(model)
    ts = [(n_prompt + n_gen) * 1e9 / s for s in samples]
    sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0    # noqa: E731
    r = dict(info)
    r.update(
        backends=desc["backend"], model_filename=model.path, model_type=desc["type"], model_size=desc["size"],
        model_n_params=desc["params"], n_batch=p["b"], n_ubatch=model.options.ubatch_size, n_threads=threads,
        cpu_mask="0x0", cpu_strict=False, poll=50, type_k=p["ctk"], type_v=p["ctv"], n_gpu_layers=p["ngl"],
        n_cpu_moe=p["ncmoe"], split_mode=p["sm"], main_gpu=p["mg"], no_kv_offload=p["nkvo"], flash_attn=p["fa"],
        tensor_split="/".join(f"{x:.2f}" for x in p["ts"]) if p["ts"] else "0.00",
        tensor_buft_overrides=",".join(p["ot"]) if p["ot"] else "none", use_mmap=True, embeddings=False,
        n_prompt=n_prompt, n_gen=n_gen, n_depth=n_depth,
        test_time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        avg_ns=int(statistics.fmean(samples)), stddev_ns=int(sd(samples)),
        avg_ts=statistics.fmean(ts), stddev_ts=sd(ts), samples_ns=samples, samples_ts=ts,
        test=name_of_test(n_prompt, n_gen, n_depth), cpu_moe=p["cmoe"], no_op_offload=p["nopo"],
        offload_policy=p["op"] or "auto", offload_only_active_experts=p["ooae"], fused_moe=p["fmoe"],
        uploaded_bytes=int(uploaded))
    if bound is not None:
        r.update(roofline_ts=bound.ts, roofline_frac=r["avg_ts"] / bound.ts if math.isfinite(bound.ts) else 0.0,
                 roofline_limit=bound.limit, roofline_detail=bound.detail())
    return r


def main(args) -> int:
    import gc

    import hybridmoe

    from ..perf.calibrate import load_or_calibrate, ram_read_now
    from ..perf.roofline import model_bound
    from .common import freeze_heap
    for note in compat_notes(args, BENCH_COMPAT, say="changes nothing here"):
        print(note, file=sys.stderr)
    if args.delay < 0:
        raise HybridMoeError(f"--delay {args.delay}: give a number of seconds, 0 or more")
    if not args.model:
        from ..models.builtin import default_model
        models = [default_model()]
    else:
        models = args.model
    tests = list_tests(args)
    depths = _ints(args.n_depth, [0])
    sets, values = parameter_sets(args)
    reps = max(args.repetitions, 1)
    ctx = max(d + p + n for d in depths for p, n in tests)
    groups: dict[tuple, list[dict]] = {}
    for p in sets:
        groups.setdefault(placement_key(p), []).append(p)
    default_threads = torch.get_num_threads()
    info = system_info()
    results: list[dict] = []
    rates_by_threads: dict = {}
    total = len(models) * len(sets) * len(depths) * len(tests) * (reps + 1)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    try:
        with progress_bar(show, total, "bench") as bar:
            for path in models:
                for group in groups.values():
                    bar.describe(f"loading {path}")
                    model = hybridmoe.load(path, **load_kwargs(group, ctx), check_tensors=args.check_tensors)
                    freeze_heap()                       # no collector pass walks the model mid-run
                    # llama-bench's order: config by config (or, --interleave, all of them per test)
                    batches = [group] if args.interleave else [[p] for p in group]
                    # --roofline with weights in host RAM: the RAM's read bandwidth is measured again around
                    # each test (the VMs' bandwidth drifts by a third within minutes), not taken from the cache
                    probe = args.roofline and reads_host_ram(model)
                    for configs in batches:
                        runs = []
                        for d in depths:
                            for i, (n_p, n_g) in enumerate(tests):
                                threads = apply_runtime(model, configs[0], default_threads)
                                bar.describe(f"{name_of_test(n_p, n_g, d)} (ub {model.options.ubatch_size}, "
                                             f"{threads} threads)")
                                time.sleep(args.delay)
                                ram0 = ram_read_now() if probe else 0.0
                                shared0 = model.stats.gpu_share_bytes
                                got = run_tests(model, configs, n_p, n_g, d, reps, 1234 + i, default_threads,
                                                bar.advance, args.interleave)
                                ram = (ram0 + ram_read_now()) / 2 if probe else 0.0
                                shared = model.stats.gpu_share_bytes > shared0
                                runs += [(c, d, n_p, n_g, smp, up, ram, shared) for c, (smp, up) in enumerate(got)]
                        for c, d, n_p, n_g, samples, up, ram, shared in sorted(runs, key=lambda r: r[0]):
                            p = configs[c]
                            threads = apply_runtime(model, p, default_threads)
                            rates = None
                            if args.roofline:
                                if threads not in rates_by_threads:
                                    rates_by_threads[threads] = load_or_calibrate(threads=threads, isolated=True)
                                rates = rates_by_threads[threads]
                                if ram:
                                    rates = dataclasses.replace(rates, ram_read_bw=ram)
                            bound = model_bound(model, rates, n_p, n_g, d, up) if rates else None
                            results.append(result_record(model, info, p, threads, n_p, n_g, d, samples, up, bound))
                            if rates:
                                results[-1].update(roofline_ram_read=rates.ram_read_bw, roofline_ram_probed=bool(ram))
                            if rates and shared and not n_p:
                                # the decode share read host experts over the bus as well: the bound with
                                # both paths out of RAM flat out (the column above is RAM's alone)
                                gpu = model.sched.main_gpu.name
                                both = model_bound(model, dataclasses.replace(
                                    rates, ram_read_bw=rates.ram_read_bw + rates.h2d(gpu)), n_p, n_g, d, up)
                                results[-1].update(roofline_bus_ts=both.ts,
                                                   roofline_bus_frac=results[-1]["avg_ts"] / both.ts)
                    gc.unfreeze()                       # so the model can be freed
                    del model
                    gc.collect()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(default_threads)
        if results:
            print_results(results, args.output, values, OPTS, roofline=args.roofline)
            if args.output_err != "none":
                print_results(results, args.output_err, values, OPTS, roofline=args.roofline, file=sys.stderr)
        memory_report()
    return 0


# -------------------------------------------------------------------------------- reporting

JSON_FIELDS = ("build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename", "model_type",
               "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "cpu_mask", "cpu_strict", "poll",
               "type_k", "type_v", "n_gpu_layers", "n_cpu_moe", "split_mode", "main_gpu", "no_kv_offload",
               "flash_attn", "tensor_split", "tensor_buft_overrides", "use_mmap", "embeddings", "n_prompt", "n_gen",
               "n_depth", "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts")
EXTRA_FIELDS = ("test", "cpu_moe", "no_op_offload", "offload_policy", "offload_only_active_experts", "fused_moe",
                "uploaded_bytes")                    # bytes uploaded to GPUs per repetition
ROOFLINE_FIELDS = ("roofline_ts", "roofline_frac", "roofline_limit", "roofline_detail", "roofline_ram_read",
                   "roofline_ram_probed", "roofline_bus_ts", "roofline_bus_frac")


def _build() -> tuple[str, int]:
    import subprocess
    from pathlib import Path
    here = str(Path(__file__).resolve().parent)
    try:
        c = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        n = subprocess.run(["git", "-C", here, "rev-list", "--count", "HEAD"], capture_output=True, text=True, timeout=5)
        if c.returncode == 0 and n.returncode == 0:
            return c.stdout.strip(), int(n.stdout.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    from .. import __version__
    return f"v{__version__}", 0


def system_info() -> dict:
    from ..devices import list_devices
    from ..perf.calibrate import cpu_name
    commit, number = _build()
    gpus = ", ".join(d.description for d in list_devices() if d.is_gpu)
    return dict(build_commit=commit, build_number=number, cpu_info=cpu_name(), gpu_info=gpus)


def _size_class(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{int(n // div)}{unit}"
    return str(int(n))


def model_description(model) -> dict:
    """llama-bench's model columns: type ('qwen3moe 30B.A3B Q4_0'), size (bytes), params, backend."""
    from ..perf.roofline import main_qtype, param_counts
    cfg, tensors = model.cfg, model.file.tensors
    total, active = param_counts(tensors, cfg)
    cls = _size_class(total) + (f".A{_size_class(active)}" if cfg.is_moe else "")
    # the input embedding is a row lookup that stays on the CPU, as in llama.cpp; it does not make a backend
    skip = "token_embd.weight" if "output.weight" in tensors else None
    devs = {d for n, d in model.placement.device_of.items() if n != skip}
    gpu, cpu = any(d != "CPU" for d in devs), "CPU" in devs
    backend = "CUDA+CPU" if gpu and cpu else "CUDA" if gpu else "CPU"
    return dict(type=f"{cfg.arch} {cls} {main_qtype(tensors)}", size=model.file.nbytes, params=total,
                backend=backend)


def _ordered(r: dict) -> dict:
    keys = JSON_FIELDS + ("samples_ns", "samples_ts") + EXTRA_FIELDS + tuple(k for k in ROOFLINE_FIELDS if k in r)
    return {k: r[k] for k in keys}


def _cell(v) -> str:
    return str(int(v)) if isinstance(v, bool) else str(v)


def _md_size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _md_params(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"


def markdown(results: list[dict], values: dict, opts=OPTS, roofline: bool = False) -> str:
    """llama-bench's table: model, size, params, backend, ngl, each option not at its default, test, t/s."""
    cols = [("model", -30, lambda r: r["model_type"]), ("size", 10, lambda r: _md_size(r["model_size"])),
            ("params", 10, lambda r: _md_params(r["model_n_params"])), ("backend", -10, lambda r: r["backends"]),
            ("ngl", 3, lambda r: _cell(r["n_gpu_layers"]))]
    for o in opts:
        if o.dest != "ngl" and (len(values[o.dest]) > 1 or values[o.dest] != [o.default]):
            cols.append((o.header, o.width, lambda r, f=o.field: _cell(r[f])))
    cols += [("test", 15, lambda r: r["test"]), ("t/s", 20, lambda r: f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}")]
    if roofline:
        cols.append(("roofline", 16, lambda r: f"{r['roofline_ts']:.2f} ({r['roofline_frac']:.0%})"))
        if any(r.get("roofline_ram_probed") for r in results):
            cols.append(("RAM GB/s", 8, lambda r: f"{r['roofline_ram_read'] / 1e9:.1f}"))
        if any("roofline_bus_ts" in r for r in results):              # the decode share ran
            cols.append(("RAM+bus roofline", 16, lambda r: f"{r['roofline_bus_ts']:.2f} ({r['roofline_bus_frac']:.0%})"
                         if "roofline_bus_ts" in r else ""))
    rows = [[fn(r) for _, _, fn in cols] for r in results]
    widths = []
    for j, (name, w, _) in enumerate(cols):
        n = max([abs(w), len(name)] + [len(row[j]) for row in rows])
        widths.append(n if w > 0 else -n)

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if w > 0 else c.ljust(-w) for c, w in zip(cells, widths)) + " |"
    out = [line([c[0] for c in cols]),
           "| " + " | ".join("-" * (abs(w) - 1) + (":" if w > 0 else "-") for w in widths) + " |"]
    out += [line(row) for row in rows]
    r0 = results[0]
    out += ["", f"build: {r0['build_commit']} ({r0['build_number']})"]
    return "\n".join(out)


def print_results(results: list[dict], fmt: str, values: dict, opts=OPTS, roofline: bool = False, file=None):
    file = file or sys.stdout
    fields = JSON_FIELDS + EXTRA_FIELDS + (ROOFLINE_FIELDS if roofline else ())
    if fmt == "md":
        print(markdown(results, values, opts, roofline), file=file)
    elif fmt == "json":
        print(json.dumps([_ordered(r) for r in results], indent=2), file=file)
    elif fmt == "jsonl":
        for r in results:
            print(json.dumps(_ordered(r)), file=file)
    elif fmt == "sql":
        print(sql(results, fields), file=file)
    else:
        import csv
        w = csv.writer(file, quoting=csv.QUOTE_ALL, lineterminator="\n")
        w.writerow(fields)
        for r in results:
            w.writerow([_cell(r.get(f, "")) for f in fields])
    file.flush()


def sql(results: list[dict], fields) -> str:
    """llama-bench's -o sql: a CREATE TABLE test for the fields and one INSERT a result (sqlite3's dialect)."""
    def kind(v):
        return "INTEGER" if isinstance(v, (bool, int)) else "REAL" if isinstance(v, float) else "TEXT"

    def lit(v):
        if v is None:
            return "NULL"
        if isinstance(v, (bool, int, float)):
            return str(int(v)) if isinstance(v, bool) else repr(v) if math.isfinite(v) else "NULL"
        return "'" + _cell(v).replace("'", "''") + "'"
    def first(f):                                  # a field some rows lack (roofline_bus_*): its first value
        return next((r[f] for r in results if r.get(f) is not None), None)
    out = ["CREATE TABLE IF NOT EXISTS test (", ",\n".join(f"  {f} {kind(first(f))}" for f in fields), ");", ""]
    for r in results:
        out.append(f"INSERT INTO test ({', '.join(fields)}) VALUES ({', '.join(lit(r.get(f)) for f in fields)});")
    return "\n".join(out)
