"""kernels/cpu_build.py on a small source tree of the same shape as cpu_moe.c (units chosen by HM_UNIT, a piece
beside it), compiled by the real gcc: the units link into one library that exports only the entry points; a unit
that fails stops the others and leaves nothing behind; two processes building at once build once. CC is a shell
script in front of gcc where a test needs to see or slow down the compiles."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridmoe.kernels import cpu_build

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")

MAIN = """#ifndef HM_UNIT
#define HM_UNIT 0
#endif
#include "piece.h"
"""
PIECE = """#define HM_UNITS 3
__attribute__((visibility("hidden"))) int part(int i);
__attribute__((visibility("hidden"))) int twice(int i);
#if HM_UNIT == 0
int hm_sum(int n) { int s = 0; for (int i = 0; i < n; i++) s += twice(part(i)); return s; }
#elif HM_UNIT == 1
__attribute__((visibility("hidden"))) int part(int i) { return i + 1; }
#elif HM_UNIT == 2
__attribute__((visibility("hidden"))) int twice(int i) { return 2 * i; }
#endif
"""


def tree(d: Path, piece: str = PIECE) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "cpu_moe.c").write_text(MAIN)
    (d / "piece.h").write_text(piece)
    return d / "cpu_moe.c"


def wrapper(d: Path, body: str) -> str:
    """A CC that runs `body` (shell) and then gcc with the same arguments."""
    p = d / "cc.sh"
    p.write_text(f"#!/bin/sh\n{body}\nexec gcc \"$@\"\n")
    p.chmod(0o755)
    return str(p)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("HYBRIDMOE_KERNEL_CFLAGS", raising=False)
    return tmp_path / "cache" / "kernels"


def test_units_link_into_one_library(tmp_path, cache):
    """One library from the units, only hm_* exported; a build folder a killed builder left an hour ago goes."""
    stale, recent = cache / ".build-stale", cache / ".build-recent"
    for d in (stale, recent):
        d.mkdir(parents=True)
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    so = cpu_build.build(tree(tmp_path / "src"))
    assert not stale.exists() and recent.exists()
    recent.rmdir()
    assert so.parent == cache and sorted(p.suffix for p in cache.iterdir()) == [".lock", ".so"]
    lib = ctypes.CDLL(str(so))
    assert lib.hm_sum(4) == 2 * (1 + 2 + 3 + 4)
    with pytest.raises(AttributeError):        # the units' shared functions are hidden: only hm_* is exported
        lib.part
    assert cpu_build.build(tree(tmp_path / "src")) == so                       # found, not built again
    assert cpu_build.build(tree(tmp_path / "src2", PIECE.replace("i + 1", "i + 2"))) != so


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two units at once")
def test_failed_unit_stops_the_others(tmp_path, cache, monkeypatch):
    """Unit 1 fails while unit 0 is still running (its compiler has a child, as gcc has cc1): the error names unit 1
    and the piece's line, unit 0 and its child are stopped at once, and nothing is left in the cache folder."""
    pidfile = tmp_path / "child.pid"
    monkeypatch.setenv("CC", wrapper(tmp_path, f"""case "$*" in
  *-DHM_UNIT=0*) sleep 60 & echo $! > {pidfile}; wait; exit 1;;
  *-DHM_UNIT=1*) while [ ! -s {pidfile} ]; do sleep 0.05; done;;
esac"""))
    bad = PIECE.replace("#elif HM_UNIT == 2", "#error unit 1 does not compile\n#elif HM_UNIT == 2")
    line = bad.splitlines().index("#error unit 1 does not compile") + 1
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        cpu_build.build(tree(tmp_path / "src", bad))
    assert time.monotonic() - t0 < 30                  # did not wait for unit 0's minute
    msg = str(e.value)
    assert "(unit 1 of 3)" in msg and f"piece.h:{line}:" in msg and "unit 1 does not compile" in msg, msg
    child = int(pidfile.read_text())
    for _ in range(100):                               # SIGTERM reached it: gone (or a zombie awaiting its reaper)
        try:
            if Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"unit 0's child {child} still runs")
    assert [p.name for p in cache.iterdir()] == [p.name for p in cache.glob("*.lock")]


BUILD = "import sys, pathlib; from hybridmoe.kernels import cpu_build as b; print(b.build(pathlib.Path(sys.argv[1])))"


def test_two_processes_build_once(tmp_path, cache, monkeypatch):
    log = tmp_path / "cc.log"
    monkeypatch.setenv("CC", wrapper(tmp_path, f'echo "$*" >> {log}; sleep 1'))
    src = tree(tmp_path / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(src)], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and outs[0] == outs[1] and Path(outs[0]).exists()
    calls = log.read_text().splitlines()
    assert len(calls) == 4, calls                       # three units and the link, by one of the two
    assert sorted(c.split("-DHM_UNIT=")[1][0] for c in calls if "-DHM_UNIT=" in c) == ["0", "1", "2"]



STATE = ("g_simd", "g_xterms", "g_f16", "g_e8m0", "g_int8", "g_int8_default", "g_exact", "g_tile", "g_trace", "ws_ptr")


def test_the_kernel_library_has_its_state_once_and_exports_only_hm():
    """The real library: no piece of run-time state is two symbols (a unit with a copy of its own that it writes
    or takes the address of would not see the main unit's settings), and only the hm_* entry points are
    exported (what units share is hidden)."""
    from hybridmoe.kernels import cpu
    if not cpu.available():
        pytest.skip("no CPU kernel library")
    so = str(cpu_build.build())
    names = [ln.split()[-1] for ln in subprocess.run(["nm", so], capture_output=True, text=True,
                                                      check=True).stdout.splitlines()]
    counts = {s: names.count(s) for s in STATE}
    assert counts["g_simd"] == 1 and all(n <= 1 for n in counts.values()), counts
    exported = subprocess.run(["nm", "-D", "--defined-only", so], capture_output=True, text=True,
                              check=True).stdout.split()[2::3]
    assert exported and all(n.startswith("hm_") for n in exported), [n for n in exported if not n.startswith("hm_")]
