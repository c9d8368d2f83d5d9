"""CI's share of benchmarks/fuzz_gguf.py (issue 26): 150 mutated synth files of every architecture, each through
`inspect`, the Python API and `run --chat` in a forked subprocess with a 10 s timeout. Every run must end in one
clear error line (under 300 printable characters) or in finite logits: no traceback, hang, crash or silent NaN.
The full run: python benchmarks/fuzz_gguf.py -n 10000."""
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fuzz_gguf  # noqa: E402


pytestmark = pytest.mark.slow


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the fuzzer forks")
def test_fuzz_subset_has_no_traceback_hang_crash_or_silent_nan():
    results = fuzz_gguf.fuzz(150, seed=26, jobs=2)
    outcomes = Counter(r[2] for r in results)
    bad = [r for r in results if r[2] not in ("clear", "ok")]
    examples = "\n".join(f"[{o}] {s} ({what}) {runner}: {detail.strip()[-400:]}"
                         for s, runner, o, detail, what, _ in bad[:10])
    assert not bad, f"{outcomes}\n{fuzz_gguf.table(results)}\n{examples}"
    assert len(results) == 150 * len(fuzz_gguf.RUNNERS)
    strategies = {r[0] for r in results}
    assert strategies == set(fuzz_gguf.STRATEGIES)                 # every strategy ran
    assert outcomes["clear"] > len(results) // 2                   # and most files were refused, each in one line
