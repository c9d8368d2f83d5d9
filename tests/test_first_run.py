"""A newcomer's first commands (issue 28, part 4): `python -m hybridmoe`, the warm-up said before its pause,
the generated text apart from the echoed prompt, progress bars only on a terminal."""
import io
import subprocess
import sys

import hybridmoe
from hybridmoe import errors
from hybridmoe.cli import main as cli


def test_python_dash_m_runs_a_command():
    r = subprocess.run([sys.executable, "-m", "hybridmoe", "perplexity", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--kl-divergence-base" in r.stdout, r.stderr


def test_warmup_is_announced_before_it_runs(capsys, monkeypatch):
    seen = {}
    from hybridmoe.model import Model
    real = Model.warmup

    def spy(self, *a, **k):
        seen["before"] = capsys.readouterr().err                # what the user saw when the pause began
        return real(self, *a, **k)
    monkeypatch.setattr(Model, "warmup", spy)
    assert cli(["run", "-m", "synth:tiny", "-p", "Hello", "-n", "2", "--temp", "0"]) == 0
    assert "warming up" in seen["before"] and "--no-warmup" in seen["before"]
    assert "warmed up in" not in seen["before"] and "warmed up in" in capsys.readouterr().err


def test_generated_text_starts_on_the_line_after_the_prompt(capsys):
    assert cli(["run", "-m", "synth:tiny", "--no-warmup", "-p", "Hello there", "-n", "6", "--temp", "0"]) == 0
    out = capsys.readouterr().out
    m = hybridmoe.load("synth:tiny")
    reply = "".join(m.generate("Hello there", 6, temperature=0))
    assert out == "Hello there\n" + reply + "\n"                 # piped: no colour codes
    assert cli(["run", "-m", "synth:tiny", "--no-warmup", "-p", "Hello there", "-n", "6", "--temp", "0",
                "--no-display-prompt"]) == 0
    assert capsys.readouterr().out == reply + "\n"
    assert cli(["run", "-m", "synth:tiny", "--no-warmup", "-p", "Two lines\n", "-n", "6", "--temp", "0"]) == 0
    assert capsys.readouterr().out.startswith("Two lines\n" + "".join(m.generate("Two lines\n", 6, temperature=0)))


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bars_only_on_a_terminal(monkeypatch, capsys):
    with errors.progress("work", 10) as bar:                    # captured stderr is no terminal: nothing
        bar.advance(10)
    assert capsys.readouterr().err == ""
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    with errors.progress("outer work", 4) as bar:
        with errors.progress("inner work", 4) as inner:         # one bar at a time: the inner one hides
            inner.advance(4)
        bar.describe("step 2")
        bar.advance(4)
    shown = tty.getvalue()
    assert "outer work" in shown and "inner work" not in shown
    with errors.progress("hidden", 4, enabled=False) as bar:
        bar.advance(4)
    assert "hidden" not in tty.getvalue()
