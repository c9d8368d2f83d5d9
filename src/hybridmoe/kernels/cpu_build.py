"""Building the CPU kernels: cpu_moe.c and its pieces cpu_*.h, compiled at first use as several translation units
in parallel (cpu_moe.c and cpu_units.h say which unit compiles what) and linked into one library in the cache
folder, named by a hash of every source byte, the compiler, its flags and the CPU's features (docs/cpu-kernels.md).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from .. import env
from ..errors import progress

SRC = Path(__file__).with_name("cpu_moe.c")
_INCLUDE = re.compile(rb'^#include "([^"/]+)".*$', re.MULTILINE)     # a piece beside cpu_moe.c
_UNITS = re.compile(rb"^#define HM_UNITS (\d+)", re.MULTILINE)        # cpu_units.h: how many units to compile
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")


def cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo), part of the cache key."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    return env.cache_dir() / "kernels"


def cflags() -> tuple:
    # extra flags (e.g. -DHM_PF_DIST=4096) for experiments; part of the cache key
    return _CFLAGS + tuple(env.get("HYBRIDMOE_KERNEL_CFLAGS").split())


def source(path: Path = SRC, _seen: tuple = ()) -> bytes:
    """cpu_moe.c with its pieces (`#include "cpu_*.h"`, files beside it) expanded in place, as the compiler gets
    it: the build hashes these bytes, so an edit to any piece rebuilds. #line markers keep the compiler's
    messages on the pieces' own names and lines."""
    if path.name in _seen:
        raise RuntimeError(f"{path.name} includes itself (through {' -> '.join(_seen)})")
    text = path.read_bytes()
    out, pos = [], 0
    for m in _INCLUDE.finditer(text):
        out += [text[pos:m.start()], b'#line 1 "%s"\n' % m.group(1),
                source(path.with_name(m.group(1).decode()), _seen + (path.name,)),
                b'#line %d "%s"' % (text.count(b"\n", 0, m.end()) + 2, path.name.encode())]
        pos = m.end()
    return b"".join(out + [text[pos:]])


def build(path: Path = SRC) -> Path:
    """The library of `path` (cpu_moe.c), built once per key (across processes) where it is not in the cache yet."""
    cc = os.environ.get("CC", "gcc")
    flags = cflags()
    src = source(path)
    key = hashlib.sha256(b"\0".join([src, cc.encode(), " ".join(flags).encode(),
                                     platform.machine().encode(), cpu_flags().encode()])).hexdigest()[:16]
    out = cache_dir() / f"cpu_moe-{key}.so"
    if out.exists():
        return out
    if shutil.which(cc) is None:
        raise RuntimeError(f"C compiler {cc!r} not found")
    out.parent.mkdir(parents=True, exist_ok=True)
    # one builder at a time per key across processes (a server's workers, test or benchmark processes started
    # together): the others wait for its file instead of each compiling the minutes-long build at once
    with open(out.with_suffix(".lock"), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return out
        _compile(cc, flags, src, out)
    return out


def _compile(cc: str, flags: tuple, src: bytes, out: Path) -> None:
    """src's units (cpu_moe.c: -DHM_UNIT=0 .. HM_UNITS - 1) compiled in parallel, linked into out."""
    n = int(_UNITS.search(src).group(1))
    for old in out.parent.glob(".build-*"):      # left by a builder that was killed (no finally ran): an hour on
        if time.time() - old.stat().st_mtime > 3600:
            shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    # gcc's own temporary files go there too, so nothing is left behind whatever happens
    genv = dict(os.environ, TMPDIR=str(tmp))
    try:
        csrc = tmp / "cpu_moe.c"      # the very bytes hashed above: a source edited meanwhile builds under its own key
        csrc.write_bytes(src)
        objs = [tmp / f"unit{i}.o" for i in range(n)]
        with progress("compiling the CPU kernels (once, cached)", n) as bar:   # a bar on a terminal only
            _run_units([([cc, *flags, "-c", f"-DHM_UNIT={i}", "-o", str(o), str(csrc)], o.with_suffix(".log"))
                        for i, o in enumerate(objs)], genv, bar)
        r = subprocess.run([cc, *flags, "-o", str(tmp / "cpu_moe.so"), *map(str, objs), "-lm"], env=genv,
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{cc} failed to link the units: {r.stderr.strip()[-2000:]}")
        os.replace(tmp / "cpu_moe.so", out)          # atomic: a reader never sees half a file
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_units(units: list, genv: dict, bar) -> None:
    """Runs the (compile command, log file) units, as many at once as this process may use cores. The first that
    fails stops the others (each is its own process group: the gcc driver, cc1 and as) and raises with its
    messages."""
    jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    waiting, running = list(enumerate(units)), {}
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                i, (cmd, log) = waiting.pop(0)
                with open(log, "wb") as f:        # a file: a pipe could fill up while nobody reads it
                    running[i] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f, env=genv,
                                                  start_new_session=True)
            done = [(i, p.returncode) for i, p in running.items() if p.poll() is not None]
            if not done:
                time.sleep(0.02)
            for i, rc in done:
                del running[i]
                bar.advance()
                if rc:
                    msg = units[i][1].read_text(errors="replace").strip()
                    raise RuntimeError(f"{units[i][0][0]} failed (unit {i} of {len(units)}): {msg[-2000:]}")
    finally:
        for p in running.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in running.values():
            p.wait()
