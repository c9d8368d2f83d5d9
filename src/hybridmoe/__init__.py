"""hybridmoe: run big Mixture-of-Experts LLMs on machines whose GPUs can't hold them."""
import os as _os
import sys as _sys

__version__ = "0.1.0"

# OpenMP workers (torch's libgomp, which the C kernels share) wait for the next parallel region or barrier by
# spinning GOMP_SPINCOUNT times before they sleep: libgomp's default, 300000 (~3.5 ms on the dev VM), burns
# the time slices of a core another program wants, and on a 2-core VM with one core busy, CPU decode at the
# default thread count fell 5-20x and swung between runs (issue 25; benchmarks/contention.py). SPIN_COUNT
# (~0.1 ms) still covers the gaps inside a decode step on an idle machine (measured: no loss). libgomp reads it
# once, when torch loads it, so it is set here, unless torch is already loaded or the user set either variable.
SPIN_COUNT = "10000"
if "torch" not in _sys.modules and not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(_os.environ):
    _os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def load(path, **options):
    """Load a GGUF model (or `synth:PRESET`). Options: the CLI's long names with underscores."""
    from .model import load as _load
    return _load(path, **options)


__all__ = ["load", "__version__"]
