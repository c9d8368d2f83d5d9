"""Robustness found on a first run (issue 25, point 4): each case says one actionable line."""
import subprocess
import sys

import pytest
import torch

from hybridmoe.cli import main as cli
from hybridmoe.commands import plan as plan_cmd


def _plan(argv, capsys):
    rc = plan_cmd.main(plan_cmd.setup_arg_parser().parse_args(argv))
    return rc, capsys.readouterr().out


def test_plan_says_the_cpu_side_does_not_fit_in_ram(monkeypatch, capsys):
    monkeypatch.delenv("HYBRIDMOE_FAKE_GPUS", raising=False)
    if torch.cuda.is_available():
        pytest.skip("the advice differs with a GPU")
    rc, out = _plan(["-m", "catalog:deepseek-r1"], capsys)         # 383 GiB: over any RAM this runs on
    last = out.rstrip().splitlines()[-1]
    assert rc == 0                                                 # it still runs (mmap pages from disk)
    assert last.startswith("does not fit in RAM: CPU needs 383.8 GiB but ") and " GiB over)" in last
    assert "smaller quant" in last and "fits:" not in out
    assert out.count("does not fit in RAM") == 1                   # the verdict, not a warning besides it
    # with GPUs, the advice is to put more on them
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "80GiB")
    rc, out = _plan(["-m", "catalog:deepseek-r1", "-ngl", "99", "-ot", "exps=CPU"], capsys)
    last = out.rstrip().splitlines()[-1]
    assert rc == 0 and last.startswith("does not fit in RAM: ") and "--n-cpu-moe" in last and "GPUs" in last
    rc, doc = _plan(["-m", "catalog:deepseek-r1", "--json"], capsys)
    assert '"ram_error": "CPU needs 383.8 GiB' in doc
    # a model that fits says so, and says where
    monkeypatch.delenv("HYBRIDMOE_FAKE_GPUS")
    rc, out = _plan(["-m", "synth:tiny"], capsys)
    assert rc == 0 and out.rstrip().splitlines()[-1] == "fits: weights, KV cache and compute buffers fit in RAM"


def _warnings(err: str, text: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("warning:") and text in ln]


def test_context_beyond_training_warns_once(capsys):
    assert cli(["run", "-m", "synth:tiny", "--no-warmup", "-c", "8192", "-p", "Hi", "-n", "1", "--temp", "0"]) == 0
    (w,) = _warnings(capsys.readouterr().err, "trained on")
    assert w.startswith("warning: -c 8192 is larger than the context the model was trained on (4096 tokens)")
    assert "use -c 4096 or less" in w
    for ctx in ("4096", "0"):                                     # at or within it (0: the model's own): nothing
        assert cli(["run", "-m", "synth:tiny", "--no-warmup", "-c", ctx, "-p", "Hi", "-n", "1", "--temp", "0"]) == 0
        assert not _warnings(capsys.readouterr().err, "trained on")


def test_gpu_layers_without_a_gpu_warn(monkeypatch, capsys):
    monkeypatch.delenv("HYBRIDMOE_FAKE_GPUS", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert cli(["run", "-m", "synth:tiny", "--no-warmup", "-ngl", "99", "-p", "Hi", "-n", "1", "--temp", "0"]) == 0
    (w,) = _warnings(capsys.readouterr().err, "-ngl")
    assert w.startswith("warning: -ngl 99: no GPU is visible") and "every layer runs on the CPU" in w
    assert cli(["run", "-m", "synth:tiny", "--no-warmup", "-p", "Hi", "-n", "1", "--temp", "0"]) == 0
    assert not _warnings(capsys.readouterr().err, "-ngl")          # no -ngl: nothing to say


def test_prompt_longer_than_the_context_errs_on_its_own_line(tmp_path):
    """stdout and stderr on one terminal (here one pipe): the error never continues the echoed prompt."""
    prompt = " ".join(["word"] * 25)
    r = subprocess.run([sys.executable, "-m", "hybridmoe", "run", "-m", "synth:tiny", "--no-warmup", "-c", "8",
                        "-p", prompt, "-n", "4"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert prompt in lines                                          # the prompt, on its own line
    (err,) = [ln for ln in lines if "error:" in ln]
    assert err.startswith("error: the prompt has ") and "context is 8" in err and "-c" in err


def test_an_error_mid_reply_starts_a_new_line(monkeypatch, capsys):
    from hybridmoe.errors import NonFiniteError
    from hybridmoe.model import Model

    def broken(self, *a, **k):
        yield "half a rep"
        raise NonFiniteError("the model computed NaN")
    monkeypatch.setattr(Model, "generate", broken)
    assert cli(["run", "-m", "synth:tiny", "--no-warmup", "-p", "Hi", "-n", "4"]) == 1
    got = capsys.readouterr()
    assert got.out == "Hi\nhalf a rep\n" and got.err.rstrip().endswith("error: the model computed NaN")


def test_openmp_workers_spin_briefly_unless_the_user_chose():
    """Thread collapse: on a machine of few cores libgomp's workers spin 10000 times (not 300000) before they
    sleep, set before torch loads libgomp, unless the user chose a wait policy or torch was loaded first (too late
    then); on many cores libgomp's default stays (wake-ups cost more there)."""
    import hybridmoe
    assert hybridmoe.short_spin(2) and hybridmoe.short_spin(4)
    assert not hybridmoe.short_spin(16) and not hybridmoe.short_spin(32)
    if not hybridmoe.short_spin(hybridmoe._usable_cpus()):
        pytest.skip("a machine of many cores: the short spin is not set here")

    def spin(code, **env):
        e = {k: v for k, v in __import__("os").environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
        r = subprocess.run([sys.executable, "-c", "import os\n" + code + "\nprint(os.environ.get('GOMP_SPINCOUNT'), "
                            "os.environ.get('OMP_WAIT_POLICY'))"], env=dict(e, **env), capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.split()
    assert spin("import hybridmoe.cli, torch") == [hybridmoe.SPIN_COUNT, "None"]
    assert spin("import hybridmoe", GOMP_SPINCOUNT="300000") == ["300000", "None"]
    assert spin("import hybridmoe", OMP_WAIT_POLICY="active") == ["None", "active"]
    assert spin("import torch, hybridmoe") == ["None", "None"]
