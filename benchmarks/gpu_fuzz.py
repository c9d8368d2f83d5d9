"""Randomized differential test of GPU placements (issue 25, point 1).

Each seed makes a random small qwen3moe (hidden 64-1024, 1-4 layers, 2-64 experts, top-k 1-8, expert widths
32-1024, head dims 64/128, GQA ratios, weight types from Q4_0 Q8_0 Q4_K Q5_K Q6_K F16 BF16 F32 and the
reference-only IQ4_XS Q3_K IQ4_KS IQ2_KT, mixed per tensor group), written once as a GGUF, and a prompt of
1-600 tokens plus 40 teacher-forced decode tokens. A case is one random placement of that model (-ngl,
-ot rules, --n-cpu-moe, -op, -ooae, -ub, -ctk/-ctv, -nkvo, --no-op-offload, HYBRIDMOE_DECODE_SHARE,
graphs on/off, the prompt split at a random point): the prompt runs in ubatches on one cache, then 40
single-token steps, and the logits are compared with the oracle on rel. L2 (all rows, and the worst row)
and top-1 agreement (a near-tie within 0.05 std counts as agreement, as tests/conftest.py does).

The oracle is a plain float32 qwen3moe forward written here (~40 lines of torch), independent of
hybridmoe's kernels, scheduler and cache: every weight dequantized once by the reference dequantizers
(quant/dequant.py, the oracle of every fast path), the prompt and the decode tokens in one causal pass.
It agrees with `hybridmoe.load(path)` under HYBRIDMOE_CPU_KERNELS=torch with an f32 KV cache to ~2e-7;
tests/test_gpu_fuzz.py checks that on fake GPUs, up to the KV cache's rounding.

Every seed runs in its own process (its cases in sequence, as a server would load models one after the
other), so a CUDA fault, a crash or a hang ends only that process: the parent records the case as a fault
with its seed and the exact repro command, and goes on with the seed's remaining cases in a new process.
--workers processes run at once (default: half the cores, at most 8 a GPU), the CPU threads split between
them; each sees the GPUs (--gpus, default all visible) through CUDA_VISIBLE_DEVICES, its first one taken
round-robin over them, so single-GPU cases spread over every card. With two GPUs or more, a seed sees one
GPU or all of them (by the seed, as --fake draws one fake GPU or two), so -ts and CUDA1 placements are drawn
and run on real cards too.

    python benchmarks/gpu_fuzz.py [--cases 300] [--seed S] [--time-limit 480] [--workers W] [--gpus 0,1] [--json OUT]
    python benchmarks/gpu_fuzz.py --one SEED [--case K | --from K --to K]   # a seed's cases, in this process
    python benchmarks/gpu_fuzz.py --fake --cases 20                         # fake GPUs (CPU-backed), here

On the GPU machine (one call of at most ~9 minutes; the full log and the records come back under $OUT):

    source benchmarks/device_setup.sh; set +e
    timeout 580 python3 benchmarks/gpu_fuzz.py --json $OUT/gpu_fuzz.json > $OUT/gpu_fuzz.log 2>&1
    sed -n '/## gpu_fuzz summary/,$p' $OUT/gpu_fuzz.log

The summary ends with markdown tables (worst errors per weight type and per placement kind) for
docs/benchmarks.md. Exit status: 0 when no case faulted or left its tolerance.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from fuzz_cases import (MARK, N_DECODE, SRC, TOL, build_model, case_label, draw_case, draw_model, judge,
                        model_label, model_types, oracle_logits, rel_l2, tolerance, top1, worst_row)


# ------------------------------------------------------------------------------------------- a worker

class _Collect:
    """Warnings the hybridmoe logger gives during a case."""
    def __init__(self):
        import logging
        self.lines: list[str] = []
        outer = self

        class H(logging.Handler):
            def emit(self, record):
                outer.lines.append(record.getMessage())
        self.handler = H(level=logging.WARNING)
        logging.getLogger("hybridmoe").addHandler(self.handler)


def _step_note(m, which: str, warnings: list[str]) -> tuple[str, str]:
    """(the static step that ran this cache's prompts / decode steps, or "eager"; why eager)."""
    held = m._steps.get(which)
    if held is None:
        return "eager", "graphs off" if not m.runtime.graphs else "not used"
    kv, step = held
    if step is not None:
        return type(step).__name__, ""
    if any(f"static {which} step" in w for w in warnings):
        return "eager", "fallback: failed at its first use"
    from hybridmoe.runtime.steps import NotApplicable
    try:                                               # it raised NotApplicable when built: ask again for why
        if which == "prompt":
            from hybridmoe.runtime.steps.gpu_prefill import StaticPrefill as Step
        elif all(d.kind == "cpu" for d in kv.devs):
            from hybridmoe.runtime.steps.cpu_decode import CpuDecoder as Step
        else:
            from hybridmoe.runtime.steps.gpu_decode import StaticDecoder as Step
        Step(m, kv)
        return "eager", "?"
    except NotApplicable as e:
        return "eager", str(e)[:120]
    except Exception as e:                             # noqa: BLE001 - informational only
        return "eager", f"{type(e).__name__}: {e}"[:120]


def _paths(m, warnings: list[str]) -> dict:
    """What ran: the static steps built for the cache (or eager, and why), the decode share, uploads."""
    out = {}
    for which in ("decode", "prompt"):
        out[which + "_step"], out[which + "_why"] = _step_note(m, which, warnings)
    try:
        out["share"] = m.decode_share()[0]
    except Exception:                                  # noqa: BLE001 - informational only
        out["share"] = None
    st = m.stats
    out["uploaded_mb"] = round(st.uploads.get("bytes", 0) / 2**20, 2) if isinstance(st.uploads, dict) else None
    out["crossings"] = getattr(st, "crossings", None)
    return out


def run_case(path: str, spec: dict, case: dict, threads: int | None, warnings: list[str]):
    """The case's placement: maybe a warm-up or another request first (case['pre']), then on a new cache the
    prompt in ubatches (split at case['split'] first) and N_DECODE single-token steps. Returns (prompt logits,
    decode logits, what ran)."""
    import gc

    import torch

    import hybridmoe
    if case["share"] is None:
        os.environ.pop("HYBRIDMOE_DECODE_SHARE", None)
    else:
        os.environ["HYBRIDMOE_DECODE_SHARE"] = case["share"]
    ids, P = spec["ids"], spec["n_prompt"]
    o = dict(case["opts"])
    m = hybridmoe.load(path, threads=threads, graphs=case["graphs"], **o)
    try:
        if case.get("pre") == "warmup":
            m.warmup()
        elif case.get("pre"):
            m.logits(ids[:case["pre"]])
        kv = m.new_cache(o["ctx_size"])
        ub = m.options.ubatch_size
        bounds = [0] + ([case["split"]] if case["split"] else [])
        while bounds[-1] < P:
            bounds.append(min(P, bounds[-1] + ub))
        outs = [m.forward(torch.tensor(ids[a:b]), a, kv) for a, b in itertools.pairwise(bounds)]
        dec = [m.forward(torch.tensor([ids[P + j]]), P + j, kv) for j in range(N_DECODE)]
        m.sync()
        info = _paths(m, warnings)
        return torch.cat(outs).float(), torch.cat(dec).float(), info
    finally:
        del m
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


_EMIT_LOCK = threading.Lock()


def _emit(events: bool, ev: dict):
    if events:
        with _EMIT_LOCK:
            sys.stdout.write(MARK + json.dumps(ev) + "\n")
            sys.stdout.flush()


def _heartbeat(period: float = 2.0):
    """Every `period` s, where the main thread is (its innermost frames): a hang's record says where it hung, and
    the parent does not count Triton's compiling (a fresh machine's first cases) as hanging."""
    import traceback
    main = threading.main_thread().ident

    def run():
        while True:
            time.sleep(period)
            f = sys._current_frames().get(main)
            if f is None:
                return
            st = traceback.extract_stack(f)
            compiling = any(f"triton{os.sep}compiler" in x.filename or f"triton{os.sep}backends" in x.filename
                            for x in st)
            where = " < ".join(f"{os.path.basename(x.filename)}:{x.lineno} {x.name}" for x in reversed(st[-4:]))
            _emit(True, {"ev": "beat", "compiling": compiling, "where": where})
    threading.Thread(target=run, daemon=True).start()


def repro_command(seed: int, first: int | None, last: int | None, a, cuda: str | None = None) -> str:
    """The command that runs this process's cases again, up to and including the one that failed (on the GPUs
    it saw, `cuda`, where the parent chose them)."""
    cmd = (f"CUDA_VISIBLE_DEVICES={cuda} " if cuda is not None else "") + f"python benchmarks/gpu_fuzz.py --one {seed}"
    if first:
        cmd += f" --from {first}"
    if last is not None:
        cmd += f" --to {last}"
    return cmd + "".join(f" --{n.replace('_', '-')}" for n in ("fake", "quick", "inject_error") if getattr(a, n)) \
        + (f" --inject-fault {a.inject_fault}" if a.inject_fault else "")


def worker(a) -> int:
    """--one SEED: build (or reuse) the seed's model and oracle, run cases [from, to) in this process. With
    --events, one JSON line per event on stdout for the parent."""
    if a.fake and not os.environ.get("HYBRIDMOE_FAKE_GPUS"):     # one fake GPU or two, by the seed
        os.environ["HYBRIDMOE_FAKE_GPUS"] = random.Random(f"gpus-{a.one}").choice(("4GiB", "2x4GiB"))
    threads = a.threads
    if threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    from hybridmoe.devices import list_devices
    if threads:
        torch.set_num_threads(threads)
    spec = draw_model(a.one, a.quick)
    first = a.case if a.case is not None else a.first
    last = a.case + 1 if a.case is not None else min(a.to if a.to is not None else spec["n_cases"], spec["n_cases"])
    wd = a.workdir
    if not wd:
        import atexit
        wd = tempfile.mkdtemp(prefix=f"fuzz-{a.one}-")
        atexit.register(shutil.rmtree, wd, True)
    os.makedirs(wd, exist_ok=True)
    path, opath = os.path.join(wd, "model.gguf"), os.path.join(wd, "oracle.pt")
    say = (lambda *x: None) if a.events else (lambda *x: print(*x, flush=True))
    t0 = time.perf_counter()
    if not os.path.exists(path):
        build_model(spec, path + ".part")
        os.replace(path + ".part", path)
    t_build = time.perf_counter() - t0
    if os.path.exists(opath):
        ref = torch.load(opath)
    else:
        ref = oracle_logits(path, spec["ids"])
        torch.save(ref, opath + ".part")
        os.replace(opath + ".part", opath)
    t_oracle = time.perf_counter() - t0 - t_build
    n_gpus = sum(d.kind == "cuda" for d in list_devices())
    cases = [draw_case(a.one, k, spec, n_gpus) for k in range(spec["n_cases"])]
    _emit(a.events, {"ev": "plan", "seed": a.one, "model": model_label(spec), "types": model_types(spec),
                         "n_cases": spec["n_cases"], "n_gpus": n_gpus, "build_s": round(t_build, 2),
                         "oracle_s": round(t_oracle, 2)})
    say(f"seed {a.one}: {model_label(spec)}; {n_gpus} GPU(s); built in {t_build:.1f} s, oracle {t_oracle:.1f} s")
    if not n_gpus:
        say("warning: no GPU is visible: every case runs on the CPU (use --fake to test with fake GPUs)")
    P = spec["n_prompt"]
    rp, rd = ref[:P], ref[P:]
    col = _Collect()
    if a.events:
        _heartbeat()
    failed = 0
    for k in range(first, last):
        case = cases[k]
        if a.deadline and time.time() > a.deadline:
            _emit(a.events, {"ev": "stop", "case": k})
            break
        _emit(a.events, {"ev": "start", "case": k})
        say(f"case {a.one}:{k} {case_label(case)}")
        rec = {"seed": a.one, "case": k, "kind": case["kind"], "label": case_label(case), "model": model_label(spec),
                   "types": model_types(spec), "expert_type": spec["expert_type"], "other_type": spec["other_type"],
                   "n_prompt": P, "opts": case["opts"], "share_env": case["share"], "graphs": case["graphs"],
                   "split": case["split"], "pre": case["pre"], "n_gpus": n_gpus,
                   "repro": repro_command(a.one, first, k + 1, a, os.environ.get("CUDA_VISIBLE_DEVICES")
                                          if a.events and not a.fake else None)}
        del col.lines[:]
        t1 = time.perf_counter()
        if a.inject_fault and k == 1:                   # the parent's fault handling, tested
            if a.inject_fault == "hang":
                time.sleep(1e6)
            os.kill(os.getpid(), signal.SIGSEGV)
        try:
            cp, cd, info = run_case(path, spec, case, threads, col.lines)
        except Exception as e:                          # noqa: BLE001 - a case's error is its result
            import traceback
            rec.update(status="error", error=f"{type(e).__name__}: {e}"[:2000],
                       traceback=traceback.format_exc()[-4000:], seconds=round(time.perf_counter() - t1, 2),
                       warnings=list(col.lines))
            _emit(a.events, dict(ev="result", **rec))
            say(f"  ERROR {rec['error']}\n{rec['traceback']}")
            return 3                                    # the CUDA context may be gone: the parent goes on afresh
        if a.inject_error and k == 0:
            cd[0, 0] += 1e3                             # one logit: must be reported out of tolerance
        rec.update(info)
        rec["prompt"] = {"rel": rel_l2(cp, rp), "row": worst_row(cp, rp), "top1": top1(cp, rp),
                             "finite": bool(torch.isfinite(cp).all())}
        rec["decode"] = {"rel": rel_l2(cd, rd), "row": worst_row(cd, rd), "top1": top1(cd, rd),
                             "finite": bool(torch.isfinite(cd).all())}
        tol = tolerance(spec, case)
        bad = judge(rec, tol)
        rec.update(status="out-of-tolerance" if bad else "ok", problems=bad, tol=tol,
                   seconds=round(time.perf_counter() - t1, 2), warnings=list(col.lines))
        failed += bool(bad)
        _emit(a.events, dict(ev="result", **rec))
        say(f"  {rec['status']}: prompt rel {rec['prompt']['rel']:.2e} row {rec['prompt']['row']:.2e} top-1 "
            f"{rec['prompt']['top1']:.3f}; decode rel {rec['decode']['rel']:.2e} row {rec['decode']['row']:.2e} "
            f"top-1 {rec['decode']['top1']:.3f}; {info['prompt_step']}/{info['decode_step']} share {info['share']}"
            f"; {rec['seconds']:.1f} s" + "".join(f"\n  ! {b}" for b in bad)
            + "".join(f"\n  warning: {w}" for w in col.lines))
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------- the parent

def gpu_list(a) -> list[str]:
    """The GPUs the workers use: --gpus (a count or a comma list of ids), else CUDA_VISIBLE_DEVICES, else every
    GPU nvidia-smi lists; none with --fake. (The parent stays free of torch and CUDA.)"""
    if a.fake:
        return []
    if a.gpus:
        return [str(i) for i in range(int(a.gpus))] if a.gpus.isdigit() else [g for g in a.gpus.split(",") if g]
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if seen is not None:
        return [g for g in seen.split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def gpus_for(seed: int, slot: int, gpus: list[str]) -> str | None:
    """CUDA_VISIBLE_DEVICES of a worker process: its first GPU round-robin by `slot`; one GPU or all of them
    by the seed (the same count whenever the seed's cases run again, so they draw the same placements)."""
    if not gpus:
        return None
    n = len(gpus) if len(gpus) > 1 and random.Random(f"gpus-{seed}").random() < 0.5 else 1
    return ",".join(gpus[(slot + j) % len(gpus)] for j in range(n))


class Proc:
    """One worker process: a seed's cases [first, last)."""
    def __init__(self, seed, first, last, a, q, deadline, threads, wd, cuda=None):
        self.seed, self.first, self.last, self.cuda = seed, first, last, cuda
        self.cur, self.since, self.planned, self.where = None, time.time(), False, ""
        os.makedirs(wd, exist_ok=True)
        self.errfile = open(os.path.join(wd, f"stderr-{first}.txt"), "w+")  # noqa: SIM115 - the process's life
        cmd = [sys.executable, "-u", os.path.abspath(__file__), "--one", str(seed), "--from", str(first),
               "--to", str(last), "--events", "--deadline", f"{deadline:.0f}", "--workdir", wd]
        if threads:
            cmd += ["--threads", str(threads)]
        cmd += (["--fake"] if a.fake else []) + (["--quick"] if a.quick else []) + \
            (["--inject-error"] if a.inject_error else []) + \
            (["--inject-fault", a.inject_fault] if a.inject_fault else [])
        env = child_env()
        if cuda is not None:
            env["CUDA_VISIBLE_DEVICES"] = cuda
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.errfile, text=True, env=env,
                                  start_new_session=True)
        self.eof = threading.Event()

        def read():
            for line in self.p.stdout:
                if line.startswith(MARK):
                    try:
                        q.put((self, json.loads(line[len(MARK):])))
                    except ValueError:
                        pass
            self.eof.set()
        threading.Thread(target=read, daemon=True).start()

    def kill(self):
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.p.wait()
        self.eof.wait(5)

    def stderr_tail(self, n=3000) -> str:
        self.errfile.flush()
        try:
            with open(self.errfile.name) as fh:
                return fh.read()[-n:]
        except OSError:
            return ""


def child_env() -> dict:
    """This process's environment with this checkout's hybridmoe first on the path, for the processes it starts."""
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))


def parent(a) -> int:
    t_start = time.time()
    base = a.seed if a.seed is not None else int(time.time()) % 1_000_000
    deadline = t_start + a.time_limit
    hard = deadline + a.grace
    gpus = gpu_list(a)
    cores = os.cpu_count() or 2
    # a case is mostly Python launching small kernels, one core a process: half the cores run workers (the
    # 16-core H100 machine: 8, each a case ~4 s plus ~7 s a process to start, build and run its oracle)
    workers = a.workers or (1 if a.fake else max(1, min(cores // 2, 8 * max(1, len(gpus)))))
    # torch's threads and the C kernels' OpenMP threads both spin between regions: oversubscribed cores collapse
    # (issue 25's thread collapse; 25x slower cases on a loaded 2-core machine), so half the cores at most
    threads = a.threads or (1 if a.fake else max(1, cores // (2 * workers)))
    print(f"gpu_fuzz: seed {base}, {a.cases} cases, {workers} worker(s) x {threads} threads, time limit "
          f"{a.time_limit:.0f} s{' (fake GPUs)' if a.fake else ''}"
          f"{', GPUs ' + ','.join(gpus) if gpus else ''}", flush=True)
    if not a.fake:
        # the CPU kernels' build (about a minute) once here, before the workers start: each would otherwise wait
        # for it inside its first case and pass for a hang
        t0 = time.time()
        r = subprocess.run([sys.executable, "-c", "from hybridmoe.kernels import cpu; assert cpu._load()"],
                           env=child_env())
        print(f"CPU kernels built in {time.time() - t0:.0f} s{'' if r.returncode == 0 else ' (failed)'}", flush=True)
    root = tempfile.mkdtemp(prefix="gpu-fuzz-")
    q: queue.Queue = queue.Queue()
    records: list[dict] = []
    n_gpus: dict[int, int] = {}
    todo: list[tuple[int, int, int]] = []              # (seed, first, last) to (re)start after a fault
    active: list[Proc] = []
    assigned, next_seed, started = 0, base, 0

    def fault(pr: Proc, status: str, why: str):
        k = pr.cur
        spec = draw_model(pr.seed, a.quick)
        rec = {"seed": pr.seed, "case": k, "kind": "(model build)", "status": status, "error": why,
               "stderr": pr.stderr_tail(), "where": pr.where, "types": model_types(spec), "model": model_label(spec),
               "expert_type": spec["expert_type"], "other_type": spec["other_type"], "n_prompt": spec["n_prompt"],
               "repro": repro_command(pr.seed, pr.first, k + 1 if k is not None else None, a, pr.cuda)}
        if k is not None:
            c = draw_case(pr.seed, k, spec, n_gpus.get(pr.seed, 1))
            rec.update(kind=c["kind"], label=case_label(c), opts=c["opts"], graphs=c["graphs"])
        records.append(rec)
        tail = rec["stderr"].strip().splitlines()[-1:] or [""]
        print(f"  FAULT {pr.seed}:{k} {status}: {why} {tail[0][:300]}\n    repro: {rec['repro']}", flush=True)
        if k is not None and k + 1 < pr.last:
            todo.append((pr.seed, k + 1, pr.last))

    def on_event(pr: Proc, ev: dict):
        if ev["ev"] == "beat":                          # only progress while Triton compiles
            pr.where = ev["where"]
            if ev["compiling"]:
                pr.since = time.time()
            return
        pr.since = time.time()
        if ev["ev"] == "plan":
            n_gpus[pr.seed] = ev["n_gpus"]
            pr.planned = True
            if pr.first == 0:
                print(f"seed {pr.seed}: {ev['model']} (build {ev['build_s']} s, oracle {ev['oracle_s']} s)", flush=True)
        elif ev["ev"] == "start":
            pr.cur = ev["case"]
        elif ev["ev"] == "result":
            ev.pop("ev")
            records.append(ev)
            pr.cur = None
            mark = {"ok": "ok ", "out-of-tolerance": "TOL", "error": "ERR"}[ev["status"]]
            extra = "; ".join(ev.get("problems") or []) or ev.get("error", "")
            nums = (f"prompt {ev['prompt']['rel']:.2e} decode {ev['decode']['rel']:.2e} top-1 "
                    f"{min(ev['prompt']['top1'], ev['decode']['top1']):.3f} " if "prompt" in ev else "")
            print(f"  {mark} {ev['seed']}:{ev['case']} {ev['label']}: {nums}({ev['seconds']} s)"
                  f"{' ' + extra if extra else ''}", flush=True)
            if ev["status"] == "error" and ev["case"] + 1 < pr.last:
                todo.append((pr.seed, ev["case"] + 1, pr.last))
        elif ev["ev"] == "stop":
            pr.cur = None

    def _loop():
        nonlocal assigned, next_seed, started
        while True:
            now = time.time()
            while len(active) < workers and now < deadline and (todo or assigned < a.cases):
                if todo:
                    seed, first, last = todo.pop(0)
                else:
                    spec = draw_model(next_seed, a.quick)
                    n = min(spec["n_cases"], a.cases - assigned)
                    seed, first, last = next_seed, 0, n
                    assigned += n
                    next_seed += 1
                active.append(Proc(seed, first, last, a, q, deadline, threads, os.path.join(root, str(seed)),
                                   gpus_for(seed, started, gpus)))
                started += 1
            if not active:
                break
            ended = [pr for pr in active if pr.p.poll() is not None and pr.eof.is_set()]
            try:                                            # every event so far (the ended ones' are all queued)
                on_event(*q.get(timeout=0.5))
                while True:
                    on_event(*q.get_nowait())
            except queue.Empty:
                pass
            now = time.time()
            for pr in active[:]:
                if pr in ended:
                    active.remove(pr)
                    if pr.cur is not None:                  # it died inside a case
                        rc = pr.p.returncode
                        fault(pr, "crash", f"exit {'signal ' + str(-rc) if rc < 0 else rc} inside the case")
                    elif not pr.planned:
                        fault(pr, "crash", f"exit {pr.p.returncode} before its first case (model build or oracle)")
                elif now > hard or now - pr.since > (a.case_timeout if pr.cur is not None else a.startup_timeout):
                    pr.kill()
                    while True:                             # its last events
                        try:
                            ev_pr, ev = q.get_nowait()
                        except queue.Empty:
                            break
                        on_event(ev_pr, ev)
                    active.remove(pr)
                    if now > hard:
                        if pr.cur is not None:
                            print(f"  cut {pr.seed}:{pr.cur} at the time limit", flush=True)
                            records.append({"seed": pr.seed, "case": pr.cur, "status": "unfinished",
                                                "repro": repro_command(pr.seed, pr.first, pr.cur + 1, a, pr.cuda)})
                    else:
                        fault(pr, "hang", f"no progress for {now - pr.since:.0f} s, in {pr.where or '?'}")
    try:
        _loop()
    finally:                                           # an interrupted run leaves no worker behind
        for pr in active:
            if pr.p.poll() is None:
                pr.kill()
    wall = time.time() - t_start
    shutil.rmtree(root, ignore_errors=True)            # the models (a repro builds its seed's again)
    text = summary(records, base, wall, a, f"{workers} workers x {threads} threads"
                   + (f", GPUs {','.join(gpus)}" if gpus else ""))
    print(text, flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"seed": base, "wall_s": wall, "fake": a.fake, "records": records}, fh, indent=1)
    return 1 if any(r["status"] not in ("ok", "unfinished") for r in records) else 0


def summary(records: list[dict], base: int, wall: float, a, how: str = "") -> str:
    done = [r for r in records if r["status"] in ("ok", "out-of-tolerance")]
    faults = [r for r in records if r["status"] in ("crash", "hang", "error")]
    tol = [r for r in records if r["status"] == "out-of-tolerance"]
    seeds = sorted({r["seed"] for r in records})
    head = (f"seed {base} ({len(seeds)} models, seeds {seeds[0] if seeds else '-'}..{seeds[-1] if seeds else '-'}), "
            f"{len(done) + len(faults)} cases in {wall:.0f} s{' on fake GPUs' if a.fake else ''}"
            f"{' (' + how + ')' if how else ''}: "
            f"{len(faults)} faults, {len(tol)} out of tolerance, "
            f"{sum(r['status'] == 'unfinished' for r in records)} cut at the time limit")
    L = ["", "## gpu_fuzz summary", "", head, ""]
    if faults:
        L.append("faults:")
        for r in faults:
            L.append(f"- {r['seed']}:{r['case']} {r['status']} ({r.get('label', r.get('kind'))}; {r.get('model')}): "
                     f"{(r.get('error') or '').splitlines()[0] if r.get('error') else ''}")
            L.append(f"  repro: `{r['repro']}`")
        L.append("")
    if tol:
        L.append("out of tolerance:")
        for r in tol:
            L.append(f"- {r['seed']}:{r['case']} ({r['label']}; {r['model']}): {'; '.join(r['problems'])}")
            L.append(f"  repro: `{r['repro']}`")
        L.append("")
    warns: dict[str, int] = {}
    for r in records:
        for w in r.get("warnings") or []:
            if "no fast kernel yet" not in w:
                warns[w[:200]] = warns.get(w[:200], 0) + 1
    why: dict[str, int] = {}
    for r in done:
        for w in ("prompt", "decode"):
            if r.get(w + "_step") == "eager" and r.get(w + "_why") not in (None, "", "not used"):
                why[f"{w}: {r[w + '_why']}"] = why.get(f"{w}: {r[w + '_why']}", 0) + 1
    if why:
        L.append("eager paths (why a case's cache had no static step):")
        L += [f"- {n}x {w}" for w, n in sorted(why.items(), key=lambda x: -x[1])[:15]]
        L.append("")
    if warns:
        L.append("warnings (other than reference-only types):")
        L += [f"- {n}x {w}" for w, n in sorted(warns.items(), key=lambda x: -x[1])[:15]]
        L.append("")

    def table(title, key):
        groups: dict[str, list] = {}
        for r in done:
            for g in key(r):
                groups.setdefault(g, []).append(r)
        cols = "cases | faults | prompt rel L2 (worst) | decode rel L2 (worst) | worst row | top-1 (worst)"
        out = [f"| {title} | {cols} |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for g in sorted(set(groups) | {x for r in faults for x in key(r)}):
            rs = groups.get(g, [])
            nf = sum(g in key(r) for r in faults)
            if rs:
                out.append(f"| {g} | {len(rs)} | {nf} | {max(r['prompt']['rel'] for r in rs):.2e} | "
                           f"{max(r['decode']['rel'] for r in rs):.2e} | "
                           f"{max(max(r['prompt']['row'], r['decode']['row']) for r in rs):.2e} | "
                           f"{min(min(r['prompt']['top1'], r['decode']['top1']) for r in rs):.3f} |")
            else:
                out.append(f"| {g} | 0 | {nf} | - | - | - | - |")
        return out
    L += table("expert type", lambda r: [r.get("expert_type") or "?"]) + [""]
    L += table("other type", lambda r: [r.get("other_type") or "?"]) + [""]
    L += table("placement", lambda r: [r.get("kind") or "?"]) + [""]

    def cache(r):
        o = r.get("opts") or {}
        return [f"cache {o.get('cache_type_k', 'f16')}/{o.get('cache_type_v', 'f16')}",
                f"{r.get('n_gpus', '?')} GPU(s) seen",
                "graphs" if r.get("graphs", True) else "no graphs",
                f"decode step {r.get('decode_step', '?')}", f"prompt step {r.get('prompt_step', '?')}"]
    L += table("option / path", cache) + [""]
    return "\n".join(L)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=300, help="cases (placements) to run in all (default 300)")
    p.add_argument("--seed", type=int, default=None, help="first model seed (default: from the clock)")
    p.add_argument("--time-limit", type=float, default=480.0, help="start no case after this many seconds (480: "
                   "with the grace, the cut cases and the summary, one 600 s call)")
    p.add_argument("--grace", type=float, default=20.0, help="seconds past the time limit before running cases "
                   "are cut (20)")
    p.add_argument("--workers", type=int, default=None, help="processes at a time (default: half the cores, at most "
                   "8 a GPU; 1 with --fake)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per worker (default cores / 2 / workers; "
                   "1 with --fake)")
    p.add_argument("--gpus", default=None, help="GPUs for the workers: a count or ids (0,1); default "
                   "CUDA_VISIBLE_DEVICES or every GPU nvidia-smi lists")
    p.add_argument("--case-timeout", type=float, default=120.0, help="a case running longer is a hang (120 s)")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="imports + model build + oracle (180 s)")
    p.add_argument("--fake", action="store_true", help="fake GPUs (CPU-backed): HYBRIDMOE_FAKE_GPUS, else one or two "
                   "of 4 GiB by the seed")
    p.add_argument("--quick", action="store_true", help="small models and prompts (tests)")
    p.add_argument("--json", metavar="OUT", help="write the per-case records here")
    p.add_argument("--inject-error", action="store_true", help="perturb one decode logit of each seed's case 0 "
                   "(checks that the check can fail)")
    p.add_argument("--inject-fault", choices=("crash", "hang"), help="each seed's case 1 crashes (SIGSEGV) or "
                   "hangs (checks that faults are caught)")
    p.add_argument("--one", type=int, metavar="SEED", help="run this seed's cases in this process (repro)")
    p.add_argument("--case", type=int, default=None, help="with --one: only this case")
    p.add_argument("--from", dest="first", type=int, default=0, help="with --one: first case (0)")
    p.add_argument("--to", type=int, default=None, help="with --one: end case, exclusive (default: all)")
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--events", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one is not None:
        if SRC not in sys.path:
            sys.path.insert(0, SRC)
        return worker(a)
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
