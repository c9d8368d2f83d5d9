"""What the precise CPU prompt path costs: pp (llama-bench's prompt test) with HYBRIDMOE_CPU_PROMPT=exact
against =bf16, interleaved on one loaded model (issue 25, point 2).

The switch is the C kernels' global setting (kernels/cpu.py, set_exact), so both modes run in one process on
the same weights and cache, rep after rep (exact, bf16, bf16, exact, ...), and drift of a shared machine falls
on both alike. Each repetition is timed as `hybridmoe bench` times it (commands/bench.py, prepare_test: a
fresh prompt at depth 0, after one untimed warm-up per mode). Besides wall-clock t/s the table gives t/s per
CPU-second of this process (a fairer figure where other programs take cores away).

    python benchmarks/prompt_cost.py -m synth:tiny-wide -p 512 -r 6                  # all on the CPU
    python benchmarks/prompt_cost.py -m synth:qwen3-30b-a3b -ngl 0 -nopo -p 512 -r 2   # the same, GPU machine
    python benchmarks/prompt_cost.py -m synth:qwen3-30b-a3b -ngl 99 -ot exps=CPU -p 512 -r 2

All on the CPU, prompts run the C prompt step (CpuDecoder.forward, hm_prompt_step), where the switch acts; on a
machine with a GPU only with --no-op-offload (-nopo), since otherwise a large batch's host weights may run on
the GPU (llama.cpp's op offload) and prompts take the eager decoder. With a GPU holding the attention (-ngl 99
-ot exps=CPU) prompts run the eager decoder too, and a ubatch of 512 uploads the CPU experts and multiplies
them on the GPU (scheduler.wants_offload), so the switch should make no difference there; the run says which
prompt step ran and how many bytes each repetition uploaded.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="synth:tiny-wide")
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-r", "--repetitions", type=int, default=5, help="timed runs per mode (default 5)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    p.add_argument("-ot", "--override-tensor", action="append", default=[])
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("-nopo", "--no-op-offload", action="store_true", help="never upload host weights for an op")
    a = p.parse_args(argv)

    import torch

    import hybridmoe
    from hybridmoe.commands.bench import prepare_test, timed
    from hybridmoe.kernels import cpu
    if not cpu.available():
        print("prompt_cost: the C kernels are unavailable: nothing to compare", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    m = hybridmoe.load(a.model, n_gpu_layers=a.n_gpu_layers, override_tensor=a.override_tensor or None,
                       ctx_size=a.n_prompt + 8, ubatch_size=a.ubatch_size, batch_size=max(2048, a.ubatch_size),
                       threads=a.threads, op_offload=not a.no_op_offload)
    threads = a.threads or torch.get_num_threads()
    print(f"{a.model}: loaded in {time.perf_counter() - t0:.1f} s; -ngl {a.n_gpu_layers} "
          f"{' '.join('-ot ' + o for o in a.override_tensor)}{' -nopo' if a.no_op_offload else ''} -t {threads} pp{a.n_prompt}, {a.repetitions} reps "
          f"a mode, CPU {cpu.simd()} / tiles {cpu.tile_mode()}", flush=True)
    once = prepare_test(m, a.n_prompt, 0, 0, seed=1)
    modes = {"exact": True, "bf16": False}
    wall: dict[str, list[float]] = {k: [] for k in modes}
    per_cpu: dict[str, list[float]] = {k: [] for k in modes}
    up: dict[str, int] = {k: 0 for k in modes}
    for name, on in modes.items():                      # warm-up per mode (compiles, Triton, first touches)
        cpu.set_exact(on)
        once(0)
    for r in range(a.repetitions):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for name in order:
            cpu.set_exact(modes[name])
            c0 = time.process_time()
            ns, nbytes = timed(m, once, 0)
            cs = time.process_time() - c0
            wall[name].append(a.n_prompt / (ns / 1e9))
            per_cpu[name].append(a.n_prompt / max(cs, 1e-9))
            up[name] += nbytes
            print(f"  rep {r} {name:5s}: {wall[name][-1]:9.1f} t/s, {per_cpu[name][-1]:8.1f} t/s per CPU-second",
                  flush=True)
    cpu.set_exact(True)
    step = m._steps.get("prompt", (None, None))[1]
    print(f"\nprompt step: {type(step).__name__ if step is not None else 'eager decoder'}; uploaded per rep: "
          + ", ".join(f"{k} {up[k] / a.repetitions / 2**20:.2f} MiB" for k in modes))
    print("\n| mode | pp t/s (median) | best | t/s per CPU-second (median) | exact / bf16 (median) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    med = {k: statistics.median(v) for k, v in wall.items()}
    for k in modes:
        print(f"| {k} | {med[k]:.1f} | {max(wall[k]):.1f} | {statistics.median(per_cpu[k]):.1f} | "
              f"{med['exact'] / med[k]:.2f} |")
    pairs = [e / b for e, b in zip(wall["exact"], wall["bf16"])]
    print(f"\nexact / bf16 per rep pair: {', '.join(f'{x:.2f}' for x in pairs)} (median {statistics.median(pairs):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
