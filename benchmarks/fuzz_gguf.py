"""Fuzz the GGUF reader and everything behind it with mutated copies of the synthetic models.

Every architecture's tiny synth preset (qwen3moe, qwen3, deepseek2, gpt-oss) is mutated by one strategy
(truncations, bit flips, length fields, metadata of the wrong type or value, missing / duplicated / extra
tensors, tensor types and shapes changed, NaN weights, tokenizer and chat-template changes, split parts,
special files) and each file goes through `hybridmoe inspect`, the Python API (hybridmoe.load + logits) and
`hybridmoe run --chat`, each in a forked subprocess with a 10 s timeout. Outcomes:

  clear   one error line under 300 printable characters      ok      no error (finite logits)
  bad-msg an error of several lines, over 300 characters or unprintable
  trace   a Python traceback          hang   past the timeout          crash  killed by a signal
  nan     the API returned non-finite logits without a word

    python benchmarks/fuzz_gguf.py -n 10000 [-j 2] [--seed 1] [--keep DIR]

prints the strategy x outcome table (counts of runs: files x 3 runners) and the first examples of every
outcome that is not clear or ok. tests/test_fuzz_gguf.py runs a fast subset in CI.
"""
from __future__ import annotations

import argparse
import io
import math
import os
import random
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict

PRESETS = ("tiny", "tiny-dense", "tiny-deepseek2", "tiny-gpt-oss")
RUNNERS = ("inspect", "api", "run")
OUTCOMES = ("clear", "ok", "bad-msg", "trace", "hang", "crash", "nan")
TIMEOUT_S = 10.0
MAX_ERROR = 300

# ----------------------------------------------------------------------------------------------- GGUF codec
# An independent reader/writer (not hybridmoe's), so that files can be written wrong on purpose.
_SC = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class Gguf:
    """version, kvs [[key, vtype, value]] (arrays: value = (etype, [items])), tensors [[name, dims, type,
    offset]], data (the data section), align (for the padding). n_kv / n_tensors: header overrides."""

    def __init__(self, raw: bytes):
        self.pos, self.raw = 0, raw
        assert self._take(4) == b"GGUF"
        self.version = self._u32()
        n_t, n_kv = self._u64(), self._u64()
        self.kvs = []
        for _ in range(n_kv):
            key = self._str()
            vt = self._u32()
            self.kvs.append([key, vt, self._val(vt)])
        self.tensors = []
        for _ in range(n_t):
            name = self._str()
            nd = self._u32()
            dims = [self._u64() for _ in range(nd)]
            self.tensors.append([name, dims, self._u32(), self._u64()])
        self.align = self.get("general.alignment", 32)
        start = (self.pos + self.align - 1) // self.align * self.align
        self.data = raw[start:]
        self.n_kv = self.n_tensors = None
        del self.raw

    def _take(self, n):
        b = self.raw[self.pos:self.pos + n]
        self.pos += n
        return b

    def _u32(self):
        return struct.unpack("<I", self._take(4))[0]

    def _u64(self):
        return struct.unpack("<Q", self._take(8))[0]

    def _str(self):
        return self._take(self._u64()).decode("utf-8", "surrogateescape")

    def _val(self, vt):
        if vt in _SC:
            return struct.unpack(_SC[vt], self._take(struct.calcsize(_SC[vt])))[0]
        if vt == 8:
            return self._str()
        et, n = self._u32(), self._u64()
        return (et, [self._val(et) for _ in range(n)])

    def get(self, key, default=None):
        for k, _, v in self.kvs:
            if k == key:
                return v
        return default

    def kv(self, key):
        return next((e for e in self.kvs if e[0] == key), None)

    def copy(self) -> Gguf:
        g = object.__new__(Gguf)
        g.__dict__ = {k: v for k, v in self.__dict__.items()}
        g.kvs = [list(e) for e in self.kvs]
        g.tensors = [[n, list(d), t, o] for n, d, t, o in self.tensors]
        return g

    def encode(self, fields: list | None = None) -> bytes:
        """The file; `fields` collects (position, size) of every length and count field."""
        out = io.BytesIO()

        def mark(size):
            if fields is not None:
                fields.append((out.tell(), size))

        def s(x):
            b = x.encode("utf-8", "surrogateescape") if isinstance(x, str) else bytes(x)
            mark(8)
            out.write(struct.pack("<Q", len(b)) + b)

        def val(vt, v):
            if vt in _SC:
                out.write(struct.pack(_SC[vt], v))
            elif vt == 8:
                s(v)
            else:
                et, items = v
                out.write(struct.pack("<I", et))
                mark(8)
                out.write(struct.pack("<Q", len(items)))
                for it in items:
                    val(et, it)
        out.write(b"GGUF" + struct.pack("<I", self.version))
        mark(8)
        out.write(struct.pack("<Q", len(self.tensors) if self.n_tensors is None else self.n_tensors))
        mark(8)
        out.write(struct.pack("<Q", len(self.kvs) if self.n_kv is None else self.n_kv))
        for k, vt, v in self.kvs:
            s(k)
            out.write(struct.pack("<I", vt))
            val(vt, v)
        for name, dims, t, off in self.tensors:
            s(name)
            mark(4)
            out.write(struct.pack("<I", len(dims)))
            for d in dims:
                mark(8)
                out.write(struct.pack("<Q", d & (2**64 - 1)))
            out.write(struct.pack("<I", t))
            mark(8)
            out.write(struct.pack("<Q", off & (2**64 - 1)))
        a = self.align if isinstance(self.align, int) and 0 < self.align < 1 << 20 else 32
        out.write(b"\0" * (-out.tell() % a))
        return out.getvalue() + self.data


# ----------------------------------------------------------------------------------------------- mutations
NASTY_INTS = [0, 1, 2, 3, 7, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 10**9, 2**40, 2**62, 2**63 - 1, 2**63,
              2**64 - 1]
NASTY_VALUES = [(6, math.nan), (6, math.inf), (6, -math.inf), (12, math.nan), (12, 1e308), (6, 0.0), (6, -1.0),
                (11, -1), (11, -(2**63)), (5, 0), (4, 0), (10, 2**64 - 1), (10, 2**63), (11, 10**9), (4, 10**9),
                (7, True), (7, False), (8, ""), (8, "x" * 1000), (8, "\x00\x1b[31m\xff"), (9, (5, [])),
                (9, (5, [1, 2, 3])), (9, (6, [math.nan])), (9, (8, ["a", "b"])), (5, -1), (4, 1), (4, 2),
                (4, 3), (4, 64), (4, 1000), (6, 1e-30), (6, 3.0e38), (1, -128), (0, 255)]
F16_BAD = (b"\x00\x7e", b"\x00\x7c", b"\x00\xfc")        # NaN, +inf, -inf as f16


def _arch_keys(g: Gguf):
    return [e for e in g.kvs if not e[0].startswith(("tokenizer.", "general.name", "general.type"))]


def _type_size(t: int):                   # (block elements, block bytes) of the types mutations use
    return {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 8: (32, 34), 12: (256, 144), 14: (256, 210),
            13: (256, 176), 10: (256, 84), 6: (32, 22), 20: (32, 18), 39: (32, 17)}.get(t, (32, 18))


def m_truncate(rng, g, raw):
    cut = rng.choice([rng.randrange(0, min(len(raw), 4096)), rng.randrange(0, len(raw)), len(raw) - rng.randint(1, 64)])
    return raw[:max(cut, 0)], f"cut at {cut}"


def m_bitflip(rng, g, raw):
    b = bytearray(raw)
    hdr = len(raw) - len(g.data)
    n = rng.choice([1, 1, 2, 4, 8, 32])
    for _ in range(n):
        i = rng.randrange(hdr) if rng.random() < 0.8 else rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    return bytes(b), f"{n} bits"


def m_length(rng, g, raw):
    fields = []
    g.encode(fields)
    pos, size = rng.choice(fields)
    v = rng.choice(NASTY_INTS + [rng.randrange(0, 1 << 16)])
    old = int.from_bytes(raw[pos:pos + size], "little")
    v = rng.choice([v, old + 1, max(old - 1, 0), old * 2]) & ((1 << (8 * size)) - 1)
    return raw[:pos] + v.to_bytes(size, "little") + raw[pos + size:], f"field at {pos}: {old} -> {v}"


def m_meta_value(rng, g, raw):
    e = rng.choice(_arch_keys(g) + [g.kv("tokenizer.ggml.bos_token_id")] * 2)
    vt, v = rng.choice(NASTY_VALUES) if rng.random() < 0.7 else \
        (e[1] if e[1] in (0, 1, 2, 3, 4, 5, 10, 11) else 10, rng.choice(NASTY_INTS))
    if vt in (0, 1, 2, 3, 4, 5, 10, 11) and not isinstance(v, bool):
        lo, hi = {0: (0, 255), 1: (-128, 127), 2: (0, 65535), 3: (-32768, 32767), 4: (0, 2**32 - 1),
                  5: (-2**31, 2**31 - 1), 10: (0, 2**64 - 1), 11: (-2**63, 2**63 - 1)}[vt]
        v = min(max(v, lo), hi)
    e[1], e[2] = vt, v
    return None, f"{e[0]} = {vt}:{str(v)[:20]}"


def m_meta_missing(rng, g, raw):
    e = rng.choice(g.kvs)
    g.kvs.remove(e)
    return None, f"drop {e[0]}"


def m_meta_dup(rng, g, raw):
    e = rng.choice(g.kvs)
    g.kvs.insert(rng.randrange(len(g.kvs)), [e[0], *rng.choice([(e[1], e[2]), (4, 1)])])
    return None, f"dup {e[0]}"


def m_missing_tensor(rng, g, raw):
    t = rng.choice(g.tensors)
    g.tensors.remove(t)
    return None, f"drop {t[0]}"


def m_dup_tensor(rng, g, raw):
    t = rng.choice(g.tensors)
    other = rng.choice(g.tensors)
    g.tensors.insert(rng.randrange(len(g.tensors)), [t[0], list(t[1]), t[2], rng.choice([t[3], other[3]])])
    return None, f"dup {t[0]}"


def m_extra_tensor(rng, g, raw):
    n_layer = next((v for k, _, v in g.kvs if k.endswith(".block_count")), 2)
    src = rng.choice(g.tensors)
    name = rng.choice(["blk.0.attn_q_norm.weight", "blk.1.ffn_gate_shexp.weight", f"blk.{n_layer}.attn_norm.weight",
                       f"blk.{n_layer + 5}.ffn_up_exps.weight", "rope_freqs.weight", "output.weight", "junk",
                       "x" * 300, "blk.0.attn_k_norm.weight", "blk.1.exp_probs_b.bias", "\x1b]0;boom\x07"])
    g.tensors.append([name, list(src[1]), src[2], src[3] if rng.random() < 0.5 else 0])
    return None, f"add {name[:40]!r}"


def m_tensor_type(rng, g, raw):
    t = rng.choice(g.tensors)
    old = t[2]
    t[2] = rng.choice([0, 1, 30, 2, 8, 12, 14, 6, 39, 20, 10, 3, 4, 99, 2**31])
    n = t[1][0]
    if rng.random() < 0.5:                 # keep the row length legal for the new type
        blk = _type_size(t[2])[0]
        t[1][0] = max(blk, n // blk * blk)
    return None, f"{t[0]} type {old} -> {t[2]}"


def m_tensor_shape(rng, g, raw):
    t = rng.choice(g.tensors)
    old = list(t[1])
    how = rng.randrange(6)
    if how == 0 and len(t[1]) > 1:
        t[1].reverse()
    elif how == 1:
        i = rng.randrange(len(t[1]))
        t[1][i] = rng.choice([1, 2, 32, t[1][i] * 2, max(t[1][i] // 2, 1), t[1][i] + 32])
    elif how == 2 and len(t[1]) > 1:
        t[1].pop()
    elif how == 3:
        t[1].append(rng.choice([1, 2]))
    elif how == 4:
        t[1] = [math.prod(t[1])]
    else:
        t[3] += rng.choice([32, -32, 64, 1 << 20])
    return None, f"{t[0]} {old} -> {t[1]} @{t[3]}"


def m_nan_weight(rng, g, raw):
    small = [t for t in g.tensors if t[2] in (0, 1, 30)]
    t = rng.choice(small if rng.random() < 0.5 else g.tensors)
    data = bytearray(g.data)
    blk, bb = _type_size(t[2])
    n_blocks = math.prod(t[1]) // blk
    i = rng.randrange(max(n_blocks, 1))
    if t[2] == 0:
        data[t[3] + 4 * i:t[3] + 4 * i + 4] = struct.pack("<f", rng.choice([math.nan, math.inf, -math.inf]))
    else:                                   # f16 / bf16 element, or the f16 scale at the start of a block
        at = t[3] + (2 * i if t[2] in (1, 30) else bb * i)
        data[at:at + 2] = rng.choice(F16_BAD) if t[2] != 30 else b"\xc0\x7f"
    g.data = bytes(data)
    return None, f"NaN in {t[0]} block {i}"


def m_tokenizer(rng, g, raw):
    toks = g.kv("tokenizer.ggml.tokens")
    how = rng.randrange(8)
    if how == 0:
        toks[1], toks[2] = 5, 7
    elif how == 1:
        toks[2] = (8, toks[2][1][:rng.choice([0, 1, 100, len(toks[2][1]) - 1])])
    elif how == 2:
        toks[2] = (8, toks[2][1] + ["extra"])
    elif how in (3, 4):                     # SentencePiece with one huge token (the old quadratic merge build)
        g.kv("tokenizer.ggml.model")[2] = "llama"
        items = list(toks[2][1])
        items[rng.randrange(len(items))] = "a" * rng.choice([10**4, 10**5, 10**6])
        toks[2] = (8, items)
        g.kvs.append(["tokenizer.ggml.scores", 9, (6, [rng.choice([0.0, math.nan]) for _ in items])])
    elif how == 5:
        g.kv("tokenizer.ggml.token_type")[2] = (6, [math.nan] * 3)
    elif how == 6:
        g.kv("tokenizer.ggml.merges")[2] = (8, ["nospace", "", "a b c"] * 10)
    else:
        g.kv("tokenizer.ggml.model")[2] = rng.choice(["bert", "", "llama"])
    return None, f"tokenizer {how}"


TEMPLATES = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'x'|center(10**10) }}", "{{ '%10000000000s'|format('x') }}",
    "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ raise_exception('x' * 100000) }}", "{{ messages[0].content.__class__ }}", "{% for %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ (messages * 100000)|length }}",
]


def m_template(rng, g, raw):
    g.kv("tokenizer.chat_template")[2] = t = rng.choice(TEMPLATES)
    return None, f"template {t[:30]!r}"


STRATEGIES = {"truncate": m_truncate, "bitflip": m_bitflip, "length": m_length, "meta-value": m_meta_value,
              "meta-missing": m_meta_missing, "meta-dup": m_meta_dup, "tensor-missing": m_missing_tensor,
              "tensor-dup": m_dup_tensor, "tensor-extra": m_extra_tensor, "tensor-type": m_tensor_type,
              "tensor-shape": m_tensor_shape, "nan-weight": m_nan_weight, "tokenizer": m_tokenizer,
              "template": m_template, "split": None, "special": None}


def make_split(rng, g: Gguf, raw, d, stem) -> tuple[str, str]:
    """Two parts of a split model, part 2 wrong in one way (or the name's count)."""
    half = len(g.tensors) // 2
    p1, p2 = g.copy(), g.copy()
    end = p1.tensors[half][3]
    p1.tensors, p1.data = p1.tensors[:half], p1.data[:end]
    p2.tensors = [[n, dims, t, o - end] for n, dims, t, o in p2.tensors[half:]]
    p2.data = p2.data[end:]
    p2.kvs = [["general.architecture", 8, g.get("general.architecture")]]
    for p, no in ((p1, 0), (p2, 1)):
        p.kvs += [["split.no", 2, no], ["split.count", 2, 2], ["split.tensors.count", 5, len(g.tensors)]]
    how = rng.randrange(6)
    count = 2
    if how == 0:
        p2.kv("split.count")[2] = 5
    elif how == 1:
        p2.kv("split.no")[2] = 0
    elif how == 2:
        p2.kv("general.architecture")[2] = "llama"
    elif how == 3:
        p2.kvs.append(["general.alignment", 4, 64])
        p2.align = 64
    elif how == 4:
        p2.tensors[0][2] = 8 if p2.tensors[0][2] != 8 else 2
    else:
        count = 0
    base = os.path.join(d, f"{stem}")
    paths = [f"{base}-{i:05d}-of-{count:05d}.gguf" for i in (1, 2)]
    for p, path in zip((p1, p2), paths):
        with open(path, "wb") as f:
            f.write(p.encode())
    return paths[0], f"split {how}"


def make_case(i: int, seed: int, base: dict, d: str, strategies: list[str]) -> tuple[str, str, str]:
    """(strategy, path, what) of file i."""
    rng = random.Random(seed * 1_000_003 + i)
    strategy = strategies[i % len(strategies)]
    preset = PRESETS[(i // len(strategies)) % len(PRESETS)]
    g0, raw0 = base[preset]
    stem = f"f{i:05d}-{preset}"
    path = os.path.join(d, stem + ".gguf")
    if strategy == "special":
        kind = rng.randrange(2)
        if kind == 0:
            os.mkfifo(path)
        else:
            os.mkdir(path)
        return strategy, path, ("fifo", "directory")[kind]
    g = g0.copy()
    if strategy == "split":
        path, what = make_split(rng, g, raw0, d, stem)
        return strategy, path, what
    data, what = STRATEGIES[strategy](rng, g, raw0)
    with open(path, "wb") as f:
        f.write(data if data is not None else g.encode())
    return strategy, path, what


# ----------------------------------------------------------------------------------------------- runners
def _child(runner: str, path: str, w) -> None:
    """In the forked child: run one runner on one file, write 'OUTCOME\\tdetail' to w."""
    import torch
    torch.set_num_threads(1)
    err = io.StringIO()
    sys.stderr = err
    sys.stdout = io.StringIO()
    outcome, detail = "ok", ""
    try:
        if runner == "api":
            import hybridmoe
            from hybridmoe.errors import HybridMoeError
            try:
                m = hybridmoe.load(path, ctx_size=64, check_fit=False)
                ids = m.tokenizer.encode("Hello world")[:8] or [0]
                logits = m.logits(ids)
                outcome = "ok" if bool(torch.isfinite(logits).all()) else "nan"
            except HybridMoeError as e:
                outcome, detail = _judge(str(e))
        else:
            from hybridmoe.cli import main
            argv = ["inspect", "-m", path, "--summary"] if runner == "inspect" else \
                ["run", "-m", path, "-n", "3", "--temp", "0", "-c", "64", "--no-warmup", "--chat", "-p", "hi"]
            rc = main(argv)
            lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
            if rc == 0:
                outcome = "ok"
            elif "Traceback" in err.getvalue():
                outcome, detail = "trace", err.getvalue()[-600:]
            elif lines and lines[-1].startswith("error: "):
                errs = [ln for ln in lines if ln.startswith("error: ")]
                outcome, detail = _judge(lines[-1][7:]) if len(errs) == 1 else ("bad-msg", "\n".join(errs)[:600])
            else:
                outcome, detail = "bad-msg", "\n".join(lines)[-600:]
    except BaseException:                   # noqa: BLE001 - what escapes is the finding
        outcome, detail = "trace", traceback.format_exc()[-1500:]
    w.write(f"{outcome}\t{detail}".encode("utf-8", "replace"))


def _judge(msg: str) -> tuple[str, str]:
    if len(msg) + 7 >= MAX_ERROR or "\n" in msg or not msg.isprintable():
        return "bad-msg", repr(msg[:600])
    return "clear", msg


def run_one(runner: str, path: str, timeout: float = TIMEOUT_S):
    """Fork a child for one runner on one file; returns (pid, read fd, deadline)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            with os.fdopen(w, "wb") as wf:
                _child(runner, path, wf)
        except BaseException:               # noqa: BLE001
            code = 3
        os._exit(code)
    os.close(w)
    os.set_blocking(r, False)
    return pid, r, time.monotonic() + timeout


def run_all(cases, jobs: int, timeout: float = TIMEOUT_S, progress=None):
    """cases: [(strategy, path, what)] -> [(strategy, runner, outcome, detail, what, path)]."""
    todo = [(c, runner) for c in cases for runner in RUNNERS]
    running, results, bufs = {}, [], {}
    while todo or running:
        while todo and len(running) < jobs:
            c, runner = todo.pop(0)
            pid, fd, deadline = run_one(runner, c[1], timeout)
            running[pid] = (c, runner, fd, deadline)
            bufs[pid] = b""
        time.sleep(0.005)
        for pid, (c, runner, fd, deadline) in list(running.items()):
            try:
                while chunk := os.read(fd, 65536):
                    bufs[pid] += chunk
            except BlockingIOError:
                pass
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == 0 and time.monotonic() < deadline:
                continue
            if done == 0:                    # past its time: a hang
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                outcome, detail = "hang", f"over {timeout:g} s"
            elif os.WIFSIGNALED(status):
                outcome, detail = "crash", f"signal {os.WTERMSIG(status)}"
            else:
                try:
                    while chunk := os.read(fd, 65536):
                        bufs[pid] += chunk
                except BlockingIOError:
                    pass
                text = bufs[pid].decode("utf-8", "replace")
                outcome, _, detail = text.partition("\t")
                if outcome not in OUTCOMES:
                    outcome, detail = "crash", f"exit status {os.WEXITSTATUS(status)}, no report"
            os.close(fd)
            del running[pid], bufs[pid]
            results.append((c[0], runner, outcome, detail, c[2], c[1]))
            if progress:
                progress(len(results), len(results) + len(todo) + len(running))
    return results


def table(results) -> str:
    by = defaultdict(Counter)
    for strategy, runner, outcome, *_ in results:
        by[strategy][outcome] += 1
    rows = [["strategy", *OUTCOMES, "runs"]]
    for s in [s for s in STRATEGIES if s in by]:
        rows.append([s, *(str(by[s][o]) for o in OUTCOMES), str(sum(by[s].values()))])
    tot = Counter(o for _, _, o, *_ in results)
    rows.append(["total", *(str(tot[o]) for o in OUTCOMES), str(len(results))])
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) + " |"
             for r in rows]
    lines.insert(1, "|" + "|".join("-" * (x + 2) for x in w) + "|")
    return "\n".join(lines)


def base_files() -> dict:
    from hybridmoe.models.synth import ensure_synth
    out = {}
    for p in PRESETS:
        with open(ensure_synth(p), "rb") as f:
            raw = f.read()
        g = Gguf(raw)
        assert g.encode() == raw, f"the fuzzer's codec does not round-trip {p}"
        out[p] = (g, raw)
    return out


def warm_kernels():
    """Build the C kernels once, before any fork (a child must not build them concurrently), and import
    every module a child needs (importing torch's lazily loaded parts takes seconds a child must not spend).
    Nothing computes here: a forked child must find no OpenMP thread pool started."""
    import hybridmoe.model
    import hybridmoe.text.chat
    import hybridmoe.text.tokenizer  # noqa: F401 - imported before the forks
    from hybridmoe.cli import build_parser
    build_parser()                               # imports every command's module
    from hybridmoe.kernels import cpu
    cpu._load()                                  # the built library, loaded (not run)


def fuzz(n: int, seed: int = 1, jobs: int = 2, keep: str | None = None, strategies=None, progress=None):
    """Make and run n files; returns the results (see run_all)."""
    strategies = list(strategies or STRATEGIES)
    base = base_files()
    warm_kernels()
    d = keep or tempfile.mkdtemp(prefix="fuzz_gguf_")
    os.makedirs(d, exist_ok=True)
    results = []
    batch = 200
    for b0 in range(0, n, batch):                # files are written a batch at a time and removed after it
        cases = [make_case(i, seed, base, d, strategies) for i in range(b0, min(n, b0 + batch))]
        results += run_all(cases, jobs, progress=progress)
        if keep is None:
            for name in os.listdir(d):
                p = os.path.join(d, name)
                os.rmdir(p) if os.path.isdir(p) else os.unlink(p)
    if keep is None:
        os.rmdir(d)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=300, help="files to make (default 300)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", metavar="DIR", help="write the files here and keep them")
    ap.add_argument("--strategy", action="append", choices=list(STRATEGIES), help="only these (repeatable)")
    ap.add_argument("--examples", type=int, default=3, help="examples printed per finding kind and strategy")
    args = ap.parse_args(argv)
    t0 = time.time()

    def progress(done, total):
        if done % 100 == 0:
            print(f"  {done} runs, {time.time() - t0:.0f} s", file=sys.stderr)
    results = fuzz(args.n, args.seed, args.jobs, args.keep, args.strategy, progress)
    print(f"{args.n} files x {len(RUNNERS)} runners ({', '.join(RUNNERS)}), seed {args.seed}, "
          f"{time.time() - t0:.0f} s\n")
    print(table(results))
    shown = Counter()
    for strategy, runner, outcome, detail, what, path in results:
        if outcome not in ("clear", "ok") and shown[(outcome, strategy)] < args.examples:
            shown[(outcome, strategy)] += 1
            print(f"\n[{outcome}] {strategy} ({what}) {runner} {os.path.basename(path)}:\n  {detail.strip()[-800:]}")
    bad = sum(1 for r in results if r[2] not in ("clear", "ok"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
