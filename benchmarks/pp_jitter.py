"""Run-to-run spread of a host-bound prefill: each forward's wall time, its host enqueue time, and the Python
garbage collections (by generation, with their duration) that ran during it. Usage (GPU machine):

    python3 benchmarks/pp_jitter.py [N_FORWARDS]      (-ngl 99, synth:qwen3-30b-a3b)
"""
import gc
import sys
import time

import torch

import hybridmoe

M = "synth:qwen3-30b-a3b"


def main(n: int):
    m = hybridmoe.load(M, n_gpu_layers=99, ctx_size=600)
    kv = m.new_cache(600)
    toks = torch.randint(0, 1000, (512,))
    events = []
    t_gc = {}

    def on_gc(phase, info):
        if phase == "start":
            t_gc["t"] = time.perf_counter()
        else:
            events.append((info["generation"], time.perf_counter() - t_gc["t"]))
    gc.callbacks.append(on_gc)
    print(f"gc thresholds {gc.get_threshold()}, tracked objects {len(gc.get_objects())}")
    for i in range(n):
        events.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.decoder.forward(toks, 0, kv, all_logits=False)                 # no copy to the host: enqueue only
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        gcs = ", ".join(f"gen{g} {d * 1e3:.1f} ms" for g, d in events) or "-"
        print(f"forward {i}: {(t2 - t0) * 1e3:.1f} ms ({512 / (t2 - t0):.0f} t/s), enqueue {(t1 - t0) * 1e3:.1f} ms, "
              f"gc: {gcs}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
