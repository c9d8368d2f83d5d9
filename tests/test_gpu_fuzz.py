"""benchmarks/gpu_fuzz.py (issue 25's randomized differential test) on fake GPUs: the harness itself.

The kernels run as hybridmoe's float32 torch reference (HYBRIDMOE_CPU_KERNELS=torch, float32 attention), so
every case must agree with the benchmark's own oracle up to the KV cache's rounding: that checks the oracle.
An injected wrong logit must be reported out of tolerance, and an injected crash as a fault with its repro
command, the seed's remaining case running on in a fresh process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_fuzz.py"
RUNS = {"clean": ("--cases", "3"), "injected": ("--cases", "3", "--inject-error", "--inject-fault", "crash")}


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs at once (each starts worker processes; together they take the time of one)."""
    env = dict(os.environ, HYBRIDMOE_CPU_KERNELS="torch", HYBRIDMOE_CPU_ATTN="fp32")
    env.pop("HYBRIDMOE_FAKE_GPUS", None)
    procs = {}
    for name, args in RUNS.items():
        out = tmp_path_factory.mktemp(name) / "records.json"
        cmd = [sys.executable, str(FUZZ), "--fake", "--quick", "--seed", "1", "--time-limit", "100",
               "--json", str(out), *args]
        procs[name] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env),
                       out)
    done = {}
    for name, (p, out) in procs.items():
        text, _ = p.communicate(timeout=240)
        assert out.exists(), text
        done[name] = (p.returncode, text, json.loads(out.read_text())["records"])
    return done


def test_three_fake_cases_pass_and_agree_with_the_oracle(runs):
    rc, out, recs = runs["clean"]
    assert rc == 0, out
    assert "3 cases in" in out and "0 faults, 0 out of tolerance" in out
    assert [x["status"] for x in recs] == ["ok"] * 3
    # float32 torch kernels on fake GPUs vs the oracle: only the f16 / bf16 / q8_0 KV cache rounds
    assert max(max(x["prompt"]["rel"], x["decode"]["rel"]) for x in recs) < 2e-3
    assert min(min(x["prompt"]["top1"], x["decode"]["top1"]) for x in recs) == 1.0
    for table in ("| expert type |", "| other type |", "| placement |"):
        assert table in out


def test_injected_error_and_crash_are_reported(runs):
    rc, out, recs = runs["injected"]
    assert rc == 1, out
    assert "1 faults, 1 out of tolerance" in out
    by = {x["case"]: x for x in recs}
    assert by[0]["status"] == "out-of-tolerance"
    assert any(p.startswith("decode rel L2") for p in by[0]["problems"])
    assert by[1]["status"] == "crash" and "signal 11" in by[1]["error"]
    assert by[1]["repro"].startswith("python benchmarks/gpu_fuzz.py --one 1 ")
    assert by[1]["repro"] in out
    assert by[2]["status"] == "ok"                      # the seed's last case, in a new process


def test_workers_spread_over_the_gpus():
    """CUDA_VISIBLE_DEVICES of the worker processes: the first GPU round-robin over the slots; a seed sees one
    GPU or all of them, the same count on every restart (its cases draw placements by that count); --gpus
    takes a count or ids; --fake uses none."""
    sys.path.insert(0, str(FUZZ.parent))
    import gpu_fuzz as g
    gpus = ["0", "1"]
    seen = [g.gpus_for(seed, slot, gpus) for slot, seed in enumerate(range(40))]
    assert {s.split(",")[0] for s in seen[0::2]} == {"0"} and {s.split(",")[0] for s in seen[1::2]} == {"1"}
    counts = [len(s.split(",")) for s in seen]
    assert set(counts) == {1, 2}
    assert all(len(g.gpus_for(seed, 7, gpus).split(",")) == n for seed, n in zip(range(40), counts))
    assert g.gpus_for(3, 5, ["0"]) == "0" and g.gpus_for(3, 5, []) is None

    class A:
        fake, gpus = False, "2"
    assert g.gpu_list(A()) == ["0", "1"]
    A.gpus = "1,3"
    assert g.gpu_list(A()) == ["1", "3"]
    A.fake = True
    assert g.gpu_list(A()) == []
