"""hybridmoe: run big Mixture-of-Experts LLMs on machines whose GPUs can't hold them."""
import os as _os
import sys as _sys

__version__ = "0.1.0"

# OpenMP workers (torch's libgomp, which the C kernels share) wait for the next parallel region or barrier by
# spinning GOMP_SPINCOUNT times before they sleep. On a machine of few cores, libgomp's default, 300000 (~3.5 ms
# on the dev VM), burns the time slices of a core another program wants: on a 2-core VM with one core busy, CPU
# decode at the default thread count fell 5-20x and swung between runs (issue 25; benchmarks/contention.py), and
# SPIN_COUNT (~0.1 ms) still covers the gaps inside a decode step there. On many cores the sleeping workers'
# wake-ups cost more than the spinning: on a 32-core VM with two H100s, 10000 made decode 2-10x slower (-ts 1/1
# all on the GPUs 113 vs 256 t/s, with experts on the CPU 5.3 vs 54 t/s; docs/benchmarks.md), so libgomp's
# default stays there. libgomp reads it once, when torch loads it, so it is set here, unless torch is already
# loaded or the user set either variable.
SPIN_COUNT = "10000"
SHORT_SPIN_MAX_CPUS = 4


def _usable_cpus() -> int:
    try:
        return len(_os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return _os.cpu_count() or 1


def short_spin(n_cpus: int) -> bool:
    """Whether OpenMP workers should spin briefly (SPIN_COUNT) on a machine of n_cpus usable CPUs."""
    return n_cpus <= SHORT_SPIN_MAX_CPUS


if "torch" not in _sys.modules and not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(_os.environ) \
        and short_spin(_usable_cpus()):
    _os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT

def load(path, **options):
    """Load a GGUF model (or `synth:PRESET`). Options: the CLI's long names with underscores."""
    from .model import load as _load
    return _load(path, **options)


__all__ = ["load", "__version__"]
