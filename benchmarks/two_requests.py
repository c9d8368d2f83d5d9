"""Three generations in one process, as a server runs them: prompt and decode speed of each, so the cost of
the first request (compiling, capturing graphs) shows against the next ones.
Usage: python3 benchmarks/two_requests.py [PLACEMENT ...], a placement as llama.cpp flags in one string."""
import shlex
import sys
import time

import hybridmoe
from hybridmoe.generate import Timings

M = "synth:qwen3-30b-a3b"
PROMPT = "word " * 1200
for spec in sys.argv[1:] or ["-ngl 99"]:
    a = shlex.split(spec)
    opts = {"n_gpu_layers": int(a[a.index("-ngl") + 1])}
    if "-ot" in a:
        opts["override_tensor"] = [a[a.index("-ot") + 1]]
    m = hybridmoe.load(M, **opts)
    for r in range(3):
        t = Timings()
        t0 = time.perf_counter()
        # cache_prompt=False: every request runs its whole prompt
        "".join(m.generate(PROMPT, max_tokens=32, temperature=0, timings=t, cache_prompt=False))
        print(f"{spec}: request {r + 1}: {time.perf_counter() - t0:.2f} s, prompt {t.n_prompt} tokens at "
              f"{t.n_prompt / t.t_prompt:.0f} t/s, decode {t.n_eval / max(t.t_eval, 1e-9):.1f} t/s", flush=True)
    del m
