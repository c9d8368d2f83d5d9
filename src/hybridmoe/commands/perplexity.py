"""`hybridmoe perplexity`: llama-perplexity. Perplexity of a text in chunks, and the KL divergence of a model's
token distributions from a reference run's (`--kl-divergence-base` / `--kl-divergence`).

Chunks, as llama-perplexity evaluates them: the text is tokenized once (BOS where the model adds one), cut
into chunks of -c tokens, each chunk runs from an empty context with its first token replaced by BOS (when
the model adds BOS), and only the second half is scored: the logits at positions c/2 .. c-2 predict the
tokens at c/2+1 .. c-1 (c - 1 - c/2 tokens a chunk), so that every scored token has at least c/2 tokens of
context. PPL = exp(mean negative log-likelihood); its uncertainty is ppl x the standard error of that mean.

`--kl-divergence-base FILE` alone runs the perplexity and saves, per scored token, the reference
distribution; `--kl-divergence-base FILE --kl-divergence` runs the same tokens (read from FILE: -f and -c are
not needed) and compares. The file is safetensors (any safetensors reader opens it; metadata format
"hybridmoe-kld", version 1), written chunk by chunk:

  tokens          I32 [chunks, c]            the tokens each chunk ran (BOS substituted)
  token_logprob   F32 [chunks, s]            log p_base of each scored token's true next token (s = c - 1 - c/2)
  top_id          I32 [chunks, s]            the base's most likely token
  full vocabulary (default), llama.cpp's compression:
  logprob_q       U16 [chunks, s, n_vocab]   log p = lo + (q - 1) * scale for q >= 1; q = 0: more than 16
  logprob_lo_scale F32 [chunks, s, 2]        nats below the most likely token (left out of the KLD, as
                                             llama.cpp leaves out log p <= -16; the kept entries are
                                             renormalized); precision scale/2 <= 1.2e-4 nats
  --kl-divergence-top K (a bounded file: 8 K bytes a token instead of 2 n_vocab):
  top_ids         I32 [chunks, s, K]         the K most likely tokens, in order
  top_logprob     F32 [chunks, s, K]         their log p

With top K the KLD is that of the distributions coarse-grained to those K tokens and one bucket for all the
others (sum over the K of p log(p/q), plus p_rest log(p_rest/q_rest)): a lower bound of the full KLD, equal
to it where the K tokens hold all of p's mass. PPL(base), "same top p" and delta-p stay exact.

Statistics follow llama-perplexity's kl_divergence(): means with standard errors, ln(PPL(Q)/PPL(base))
with the covariance of the two, percentiles interpolated between sorted values. Departures: the summary is
printed for any number of tokens (llama.cpp prints none under 100, and no uncertainty under 11), and the
KLD percentiles list 95% and 90% (llama.cpp prints 99% twice).
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import HybridMoeError, warn
from .common import add_model_args, add_runtime_args, runtime_kwargs

DEFAULT_CTX = 512                    # llama-perplexity's -c
FORMAT, VERSION = "hybridmoe-kld", "1"
WINDOW = 16.0                        # nats below the top token kept in the full-vocabulary file (llama.cpp's)
ROWS = 64                            # rows scored at a time (bounds the float64 temporaries)


def setup_arg_parser(p):
    add_model_args(p)
    p.add_argument("-f", "--file", default=None, metavar="FILE",
                   help="the text to evaluate (not with --kl-divergence: the tokens come from the base file)")
    p.add_argument("--chunks", type=int, default=-1, metavar="N", help="evaluate at most N chunks (default: all)")
    p.add_argument("--kl-divergence-base", default=None, metavar="FILE",
                   help="alone: save the reference distributions of every scored token to FILE; with "
                        "--kl-divergence: the file to compare with")
    p.add_argument("--kl-divergence", action="store_true",
                   help="compare with --kl-divergence-base FILE: KLD, its percentiles, same top p, PPL ratio")
    p.add_argument("--kl-divergence-top", type=int, default=0, metavar="K",
                   help="save only each token's K most likely tokens (8 K bytes a token; default 0: the whole "
                        "vocabulary, 2 bytes a token and vocabulary entry, as llama.cpp); the KLD is then over "
                        "those K and one bucket for the rest (a lower bound)")
    add_runtime_args(p)
    p.set_defaults(ctx_size=None)    # -c: 512 as llama-perplexity, or the base file's with --kl-divergence
    for a in p._actions:
        if a.dest == "ctx_size":
            a.help = "tokens per chunk (default 512, as llama-perplexity; with --kl-divergence the base file's; " \
                     "0: the model's context)"


# -------------------------------------------------------------------------------- arithmetic


def _mean_unc(s: float, s2: float, n: int) -> tuple[float, float]:
    """Mean of n values from their sum and sum of squares, and its standard error."""
    if n < 1:
        return 0.0, 0.0
    m = s / n
    var = s2 / n - m * m
    return m, (math.sqrt(var / (n - 1)) if var > 0 and n > 1 else 0.0)


def _cov(s1: float, s2: float, s12: float, n: int) -> float:
    """Covariance of the means of two paired series (llama.cpp's covariance())."""
    if n < 2:
        return 0.0
    return (s12 / n - (s1 / n) * (s2 / n)) / (n - 1)


def percentile(sorted_values, fraction: float) -> float:
    """llama.cpp's: linear interpolation between sorted values at fraction x (n - 1)."""
    v = sorted_values
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    x = fraction * (len(v) - 1)
    i = int(x)
    x -= i
    return float((1 - x) * v[i] + x * v[min(i + 1, len(v) - 1)])


def median(sorted_values) -> float:
    v, n = sorted_values, len(sorted_values)
    return float(v[n // 2]) if n % 2 else float(0.5 * (v[n // 2] + v[n // 2 - 1]))


@dataclass
class PplStats:
    """Running sums of the negative log-likelihoods."""
    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0

    def add(self, nll: torch.Tensor):
        nll = nll.double()
        self.nll += float(nll.sum())
        self.nll2 += float((nll * nll).sum())
        self.count += nll.numel()

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count) if self.count else float("nan")

    @property
    def ppl_unc(self) -> float:
        """llama-perplexity's "+/-": ppl x the standard error of the mean nll."""
        return self.ppl * _mean_unc(self.nll, self.nll2, self.count)[1]

    def final_line(self) -> str:
        return f"Final estimate: PPL = {self.ppl:.4f} +/- {self.ppl_unc:.5f}"


def log_softmax64(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) of each row of logits [n, V] (float64)."""
    out = []
    for i in range(0, logits.shape[0], ROWS):
        lp = log_softmax64(logits[i:i + ROWS])
        out.append(-lp.gather(1, targets[i:i + ROWS, None].long())[:, 0])
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


@dataclass
class Reference:
    """The base distributions of n scored tokens: the true next token's log p, the top token, and either the
    whole vocabulary (logprob: float64 [n, V], with `kept` [n, V] the entries inside the 16-nat window) or
    the top K (top_ids [n, K], top_logprob [n, K])."""
    token_logprob: torch.Tensor
    top_id: torch.Tensor
    logprob: torch.Tensor | None = None
    kept: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprob: torch.Tensor | None = None

    def rows(self, i: int, j: int) -> "Reference":
        cut = lambda t: None if t is None else t[i:j]          # noqa: E731
        return Reference(*(cut(getattr(self, f)) for f in ("token_logprob", "top_id", "logprob", "kept",
                                                           "top_ids", "top_logprob")))


def kl_divergence(ref: Reference, logq: torch.Tensor) -> torch.Tensor:
    """KL(base || Q) per row, Q's log-probs logq [n, V] (float64)."""
    if ref.logprob is not None:
        # renormalized over the kept entries: a distribution again (the stored values lose up to 1.2e-4 nats
        # each), so that every row's KLD is >= 0 and a model against itself gives 0, not rounding noise
        lp = ref.logprob.double()
        lp = lp - torch.where(ref.kept, lp, torch.full((), -math.inf, dtype=lp.dtype)).logsumexp(-1, keepdim=True)
        terms = torch.where(ref.kept, lp.exp() * (lp - logq), torch.zeros((), dtype=torch.float64))
        return terms.sum(-1)
    lp = ref.top_logprob.double()
    lq = logq.gather(1, ref.top_ids.long())
    p, q = lp.exp(), lq.exp()
    kld = torch.where(p > 0, p * (lp - lq), torch.zeros((), dtype=torch.float64)).sum(-1)   # padding: p = 0
    p_rest = (1 - p.sum(-1)).clamp(min=0)
    q_rest = (1 - q.sum(-1)).clamp(min=1e-300)
    return kld + torch.where(p_rest > 0, p_rest * (p_rest.clamp(min=1e-300).log() - q_rest.log()),
                             torch.zeros((), dtype=torch.float64))


@dataclass
class KldStats:
    """llama-perplexity's kl_divergence_result: running sums over scored tokens, plus every token's KLD and
    delta-p (p(true token) under Q minus under the base) for the percentiles."""
    nll: PplStats = field(default_factory=PplStats)
    nll_base: PplStats = field(default_factory=PplStats)
    nll_nll_base: float = 0.0
    kld: float = 0.0
    kld2: float = 0.0
    p_diff: float = 0.0
    p_diff2: float = 0.0
    p_diff4: float = 0.0
    same_top: int = 0
    kld_values: list = field(default_factory=list)
    p_diff_values: list = field(default_factory=list)

    @property
    def count(self) -> int:
        return self.nll.count

    def add(self, logits: torch.Tensor, targets: torch.Tensor, ref: Reference):
        """Score rows of Q's logits [n, V] against the base's distributions of the same tokens."""
        for i in range(0, logits.shape[0], ROWS):
            r, lq = ref.rows(i, i + ROWS), log_softmax64(logits[i:i + ROWS])
            nll = -lq.gather(1, targets[i:i + ROWS, None].long())[:, 0]
            nll_b = -r.token_logprob.double()
            self.nll.add(nll)
            self.nll_base.add(nll_b)
            self.nll_nll_base += float((nll * nll_b).sum())
            k = kl_divergence(r, lq)
            self.kld += float(k.sum())
            self.kld2 += float((k * k).sum())
            dp = (-nll).exp() - (-nll_b).exp()
            self.p_diff += float(dp.sum())
            self.p_diff2 += float((dp * dp).sum())
            self.p_diff4 += float((dp ** 4).sum())
            self.same_top += int((lq.argmax(-1) == r.top_id.long()).sum())
            self.kld_values += k.tolist()
            self.p_diff_values += dp.tolist()

    # ---- the numbers llama-perplexity prints
    def log_ppl_ratio(self) -> tuple[float, float]:
        a = _mean_unc(self.nll.nll, self.nll.nll2, self.count)
        b = _mean_unc(self.nll_base.nll, self.nll_base.nll2, self.count)
        cov = _cov(self.nll.nll, self.nll_base.nll, self.nll_nll_base, self.count)
        return a[0] - b[0], math.sqrt(max(a[1] ** 2 + b[1] ** 2 - 2 * cov, 0.0))

    def mean_kld(self) -> tuple[float, float]:
        return _mean_unc(self.kld, self.kld2, self.count)

    def p_diff_rms(self) -> tuple[float, float]:
        mse, mse_unc = _mean_unc(self.p_diff2, self.p_diff4, self.count)
        rms = math.sqrt(mse)
        return rms, (0.5 / rms * mse_unc if rms > 0 else 0.0)

    def same_top_p(self) -> tuple[float, float]:
        n = self.count
        f = self.same_top / n if n else 0.0
        return f, (math.sqrt(f * (1 - f) / (n - 1)) if n > 1 else 0.0)

    def chunk_line(self, i: int) -> str:
        r, ru = self.log_ppl_ratio()
        k, ku = self.mean_kld()
        d, du = self.p_diff_rms()
        s, su = self.same_top_p()
        return (f"{i:4d}    {self.nll.ppl:9.4f} ± {self.nll.ppl_unc:9.4f}    {r:10.5f} ± {ru:10.5f}    "
                f"{k:10.5f} ± {ku:10.5f}    {100 * d:6.3f} ± {100 * du:6.3f} %    {100 * s:6.3f} ± {100 * su:6.3f} %")

    def summary(self) -> list[str]:
        n = self.count
        q, b = self.nll, self.nll_base
        lq, lb = _mean_unc(q.nll, q.nll2, n), _mean_unc(b.nll, b.nll2, n)
        cov = _cov(q.nll, b.nll, self.nll_nll_base, n)
        cor = cov / (lq[1] * lb[1]) if lq[1] > 0 and lb[1] > 0 else 0.0
        r, ru = self.log_ppl_ratio()
        ppl_cov = q.ppl * b.ppl * cov
        diff_unc = math.sqrt(max(q.ppl_unc ** 2 + b.ppl_unc ** 2 - 2 * ppl_cov, 0.0))
        kv, pv = sorted(self.kld_values), sorted(self.p_diff_values)
        k, ku = self.mean_kld()
        dm, dmu = _mean_unc(self.p_diff, self.p_diff2, n)
        rms, rmsu = self.p_diff_rms()
        s, su = self.same_top_p()
        out = ["====== Perplexity statistics ======",
               f"Mean PPL(Q)                   : {q.ppl:10.6f} ± {q.ppl_unc:10.6f}",
               f"Mean PPL(base)                : {b.ppl:10.6f} ± {b.ppl_unc:10.6f}",
               f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * cor:6.2f}%",
               f"Mean ln(PPL(Q)/PPL(base))     : {r:10.6f} ± {ru:10.6f}",
               f"Mean PPL(Q)/PPL(base)         : {math.exp(r):10.6f} ± {math.exp(r) * ru:10.6f}",
               f"Mean PPL(Q)-PPL(base)         : {q.ppl - b.ppl:10.6f} ± {diff_unc:10.6f}",
               "",
               "====== KL divergence statistics ======",
               f"Mean    KLD: {k:10.6f} ± {ku:10.6f}",
               f"Maximum KLD: {kv[-1]:10.6f}"]
        out += [f"{name:<8}KLD: {percentile(kv, f):10.6f}" for name, f in
                (("99.9%", .999), ("99.0%", .99), ("95.0%", .95), ("90.0%", .9))]
        out.append(f"Median  KLD: {median(kv):10.6f}")
        out += [f"{name:<8}KLD: {percentile(kv, f):10.6f}" for name, f in
                (("10.0%", .1), (" 5.0%", .05), (" 1.0%", .01), (" 0.1%", .001))]
        out += [f"Minimum KLD: {kv[0]:10.6f}", "",
                "====== Token probability statistics ======",
                f"Mean    Δp: {100 * dm:6.3f} ± {100 * dmu:5.3f} %",
                f"Maximum Δp: {100 * pv[-1]:6.3f}%"]
        for name, f in (("99.9%", .999), ("99.0%", .99), ("95.0%", .95), ("90.0%", .9), ("75.0%", .75)):
            out.append(f"{name:<8}Δp: {100 * percentile(pv, f):6.3f}%")
        out.append(f"Median  Δp: {100 * median(pv):6.3f}%")
        for name, f in (("25.0%", .25), ("10.0%", .1), (" 5.0%", .05), (" 1.0%", .01), (" 0.1%", .001)):
            out.append(f"{name:<8}Δp: {100 * percentile(pv, f):6.3f}%")
        out += [f"Minimum Δp: {100 * pv[0]:6.3f}%",
                f"RMS Δp    : {100 * rms:6.3f} ± {100 * rmsu:5.3f} %",
                f"Same top p: {100 * s:6.3f} ± {100 * su:5.3f} %"]
        return out


KLD_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
              "Δp RMS            Same top p")


# -------------------------------------------------------------------------------- the base file


def compress_rows(logprob: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """log-probs [n, V] -> (uint16 [n, V], float32 [n, 2] lo and scale): q = 1 + round((lp - lo) / scale)
    inside [lo, max], lo = max(min, max - 16); 0 below lo."""
    lp = logprob.double()
    hi = lp.max(-1, keepdim=True).values
    lo = torch.maximum(lp.min(-1, keepdim=True).values, hi - WINDOW)
    scale = (hi - lo) / 65534
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(lp >= lo, 1 + torch.round((lp - lo) / scale), torch.zeros((), dtype=torch.float64))
    return (q.clamp(0, 65535).to(torch.int32).numpy().astype(np.uint16),
            torch.cat([lo, scale], -1).float().numpy())


def expand_rows(q: np.ndarray, lo_scale: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """compress_rows' inverse: float64 log-probs [n, V] and the mask of entries inside the window."""
    qt = torch.from_numpy(q.astype(np.int32))
    ls = torch.from_numpy(np.asarray(lo_scale, dtype=np.float32)).double()
    return ls[:, :1] + (qt - 1).double() * ls[:, 1:], qt > 0


_DT = {"I32": (np.int32, 4), "F32": (np.float32, 4), "U16": (np.uint16, 2)}


class BaseWriter:
    """Writes the base file chunk by chunk (to FILE.part, renamed when every chunk is in)."""

    def __init__(self, path: str, n_chunk: int, n_ctx: int, n_vocab: int, top: int, meta: dict):
        self.path, self.n_chunk, self.top = path, n_chunk, top
        s = n_ctx - 1 - n_ctx // 2
        specs = [("tokens", "I32", [n_chunk, n_ctx]), ("token_logprob", "F32", [n_chunk, s]),
                 ("top_id", "I32", [n_chunk, s])]
        specs += ([("top_ids", "I32", [n_chunk, s, top]), ("top_logprob", "F32", [n_chunk, s, top])] if top else
                  [("logprob_lo_scale", "F32", [n_chunk, s, 2]), ("logprob_q", "U16", [n_chunk, s, n_vocab])])
        header, off, self.where = {}, 0, {}
        for name, dt, shape in specs:
            n = math.prod(shape) * _DT[dt][1]
            header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
            self.where[name] = (off, n // n_chunk)
            off += n
        header["__metadata__"] = {"format": FORMAT, "version": VERSION, "n_ctx": str(n_ctx),
                                  "n_vocab": str(n_vocab), "n_chunk": str(n_chunk), "top": str(top),
                                  **{k: str(v) for k, v in meta.items()}}
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        self.data0 = 8 + len(h)
        self.nbytes = self.data0 + off
        d = os.path.dirname(os.path.abspath(path))
        try:
            free = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize
        except OSError as e:
            raise HybridMoeError(f"--kl-divergence-base {path}: cannot write there: {e.strerror}") from None
        if self.nbytes > free:
            raise HybridMoeError(f"--kl-divergence-base {path}: the file needs {self.nbytes / 2**30:.2f} GiB and "
                                 f"{d} has {free / 2**30:.2f} GiB free; use fewer --chunks or --kl-divergence-top K")
        self.tmp = path + ".part"
        self.f = open(self.tmp, "wb")
        self.f.write(struct.pack("<Q", len(h)) + h)
        self.f.truncate(self.nbytes)

    def _put(self, name: str, i: int, arr: np.ndarray):
        off, per = self.where[name]
        b = np.ascontiguousarray(arr).tobytes()
        assert len(b) == per, (name, len(b), per)
        self.f.seek(self.data0 + off + i * per)
        self.f.write(b)

    def write_chunk(self, i: int, tokens: list[int], logits: torch.Tensor, targets: torch.Tensor):
        """Chunk i: its tokens and the base's distributions at its scored positions (logits [s, V])."""
        self._put("tokens", i, np.asarray(tokens, dtype=np.int32))
        tl, top1, qs, ls, tids, tlp = [], [], [], [], [], []
        for j in range(0, logits.shape[0], ROWS):
            lp = log_softmax64(logits[j:j + ROWS])
            tl.append(lp.gather(1, targets[j:j + ROWS, None].long())[:, 0])
            top1.append(lp.argmax(-1))
            if self.top:
                v, ix = lp.topk(min(self.top, lp.shape[-1]), dim=-1)
                if v.shape[-1] < self.top:                       # a vocabulary smaller than K: pad, p = 0
                    pad = self.top - v.shape[-1]
                    v = torch.cat([v, torch.full((v.shape[0], pad), -math.inf, dtype=v.dtype)], -1)
                    ix = torch.cat([ix, torch.zeros((ix.shape[0], pad), dtype=ix.dtype)], -1)
                tids.append(ix)
                tlp.append(v)
            else:
                q, l_s = compress_rows(lp)
                qs.append(q)
                ls.append(l_s)
        self._put("token_logprob", i, torch.cat(tl).float().numpy())
        self._put("top_id", i, torch.cat(top1).to(torch.int32).numpy())
        if self.top:
            self._put("top_ids", i, torch.cat(tids).to(torch.int32).numpy())
            self._put("top_logprob", i, torch.cat(tlp).float().numpy())
        else:
            self._put("logprob_lo_scale", i, np.concatenate(ls))
            self._put("logprob_q", i, np.concatenate(qs))

    def close(self):
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self):
        self.f.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


class BaseFile:
    """A base file, memory-mapped."""

    def __init__(self, path: str):
        bad = lambda why: HybridMoeError(f"--kl-divergence-base {path}: {why}")    # noqa: E731
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0] if size >= 8 else None
                if n is None or n > min(size - 8, 1 << 24):
                    raise bad("not a base file written by `hybridmoe perplexity --kl-divergence-base`")
                header = json.loads(f.read(n))
        except OSError as e:
            raise bad(f"cannot read it: {e.strerror} (write it first: a run with --kl-divergence-base FILE "
                      f"and without --kl-divergence)") from None
        except (ValueError, UnicodeDecodeError):
            raise bad("not a base file written by `hybridmoe perplexity --kl-divergence-base`") from None
        md = header.pop("__metadata__", {}) or {}
        if md.get("format") != FORMAT:
            raise bad("not a base file written by `hybridmoe perplexity --kl-divergence-base` "
                      "(llama.cpp's files are not read)")
        if md.get("version") != VERSION:
            raise bad(f"format version {md.get('version')}, this hybridmoe reads version {VERSION}")
        self.meta = md
        self.n_ctx, self.n_vocab = int(md["n_ctx"]), int(md["n_vocab"])
        self.n_chunk, self.top = int(md["n_chunk"]), int(md["top"])
        data0 = 8 + n
        self.arrays = {}
        for name, h in header.items():
            dt = _DT[h["dtype"]][0]
            b, e = h["data_offsets"]
            if data0 + e > size:
                raise bad(f"truncated ({size} bytes, the header describes {data0 + e})")
            self.arrays[name] = np.memmap(path, dtype=dt, mode="r", offset=data0 + b, shape=tuple(h["shape"]))

    def tokens(self, i: int) -> list[int]:
        return self.arrays["tokens"][i].tolist()

    def reference(self, i: int) -> Reference:
        a = self.arrays
        ref = Reference(torch.from_numpy(np.array(a["token_logprob"][i])),
                        torch.from_numpy(np.array(a["top_id"][i])))
        if self.top:
            ref.top_ids = torch.from_numpy(np.array(a["top_ids"][i]))
            ref.top_logprob = torch.from_numpy(np.array(a["top_logprob"][i]))
        else:
            ref.logprob, ref.kept = expand_rows(np.array(a["logprob_q"][i]), np.array(a["logprob_lo_scale"][i]))
        return ref


# -------------------------------------------------------------------------------- running


def chunk_scored_logits(model, kv, tokens: list[int], first: int, ubatch: int) -> torch.Tensor:
    """One chunk from an empty context; the logits [n - 1 - first, V] at positions first .. n - 2 (only
    batches that reach `first` compute logits for every token)."""
    n, outs = len(tokens), []
    for i in range(0, n, ubatch):
        ids = torch.tensor(tokens[i:i + ubatch], dtype=torch.long)
        if i + len(ids) <= first:
            model.forward(ids, i, kv, all_logits=False)
            continue
        out = model.forward(ids, i, kv, all_logits=True)
        lo, hi = max(first - i, 0), min(len(ids), n - 1 - i)
        if hi > lo:
            outs.append(out[lo:hi].float())
    return torch.cat(outs)


def _read_text(path: str | None) -> str:
    if not path:
        raise HybridMoeError("give the text to evaluate with -f FILE")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise HybridMoeError(f"cannot read {path}: {e.strerror}") from None
    if not text.strip():
        raise HybridMoeError(f"{path} is empty")
    return text


def main(args) -> int:
    import hybridmoe
    err = sys.stderr
    if args.kl_divergence_top < 0:
        raise HybridMoeError(f"--kl-divergence-top {args.kl_divergence_top}: give K >= 1, or 0 for the whole "
                             f"vocabulary")
    if args.chunks == 0 or args.chunks < -1:
        raise HybridMoeError(f"--chunks {args.chunks}: give N >= 1 (or -1: all)")
    base, text = None, None
    if args.kl_divergence:
        if not args.kl_divergence_base:
            raise HybridMoeError("--kl-divergence compares with a reference: give --kl-divergence-base FILE, "
                                 "written by a run with --kl-divergence-base FILE alone")
        base = BaseFile(args.kl_divergence_base)
        if args.ctx_size not in (None, base.n_ctx):
            raise HybridMoeError(f"-c {args.ctx_size}: {args.kl_divergence_base} holds chunks of {base.n_ctx} "
                                 f"tokens; leave -c out (or give -c {base.n_ctx})")
        if args.file:
            print(f"kl_divergence: the tokens come from {args.kl_divergence_base}; -f {args.file} is not read",
                  file=err)
        args.ctx_size = base.n_ctx
    else:
        text = _read_text(args.file)
        if args.ctx_size is None:
            args.ctx_size = DEFAULT_CTX
    if args.ctx_size < 0:
        raise HybridMoeError(f"-c {args.ctx_size}: give a context size (0: the model's)")
    model = hybridmoe.load(args.model, **runtime_kwargs(args))
    cfg, n_ctx = model.cfg, model.options.ctx_size
    print(f"loaded {cfg.name} ({cfg.arch}, {model.file.nbytes / 2**30:.2f} GiB) in {model.load_seconds:.2f} s",
          file=err)
    if n_ctx < 8:
        raise HybridMoeError(f"-c {n_ctx}: a chunk needs at least 8 tokens (half of them are scored)")
    if base is not None and base.n_vocab != cfg.n_vocab:
        raise HybridMoeError(f"{args.kl_divergence_base} was written by a model with a vocabulary of {base.n_vocab} "
                             f"tokens; this one has {cfg.n_vocab}: the KL divergence needs the same vocabulary")
    tok = model.tokenizer
    bos = tok.bos_id if tok.add_bos else None
    if base is None:
        print("perplexity: tokenizing the input ..", file=err)
        t0 = time.perf_counter()
        tokens = tok.encode(text, add_special=True, parse_special=False)
        print(f"perplexity: tokenization took {1e3 * (time.perf_counter() - t0):.3f} ms", file=err)
        if len(tokens) < 2 * n_ctx:
            raise HybridMoeError(f"{args.file} tokenizes to only {len(tokens)} tokens; perplexity with a context of "
                                 f"{n_ctx} needs at least {2 * n_ctx} (two chunks): use a longer text or a smaller -c")
        n_max = len(tokens) // n_ctx
    else:
        n_max = base.n_chunk
    n_chunk = n_max if args.chunks < 0 else min(args.chunks, n_max)
    if args.chunks > n_max:
        warn(f"--chunks {args.chunks}: {'the text' if base is None else args.kl_divergence_base} holds only "
             f"{n_max} chunks of {n_ctx} tokens; evaluating {n_max}")
    first = n_ctx // 2
    ubatch = max(1, min(model.options.ubatch_size, model.options.batch_size, n_ctx))
    what, tag = ("KL divergence", "kl_divergence") if base is not None else ("perplexity", "perplexity")
    print(f"{tag}: calculating {what} over {n_chunk} chunks, "
          f"n_ctx={n_ctx}, batch_size={min(model.options.batch_size, n_ctx)}, n_seq=1", file=err)
    writer = None
    if base is None and args.kl_divergence_base:
        writer = BaseWriter(args.kl_divergence_base, n_chunk, n_ctx, cfg.n_vocab, args.kl_divergence_top,
                            {"model": os.path.basename(model.path), "text": os.path.basename(args.file)})
        print(f"perplexity: saving the reference distributions to {args.kl_divergence_base} "
              f"({writer.nbytes / 2**20:.1f} MiB)", file=err)
    ppl, kld = PplStats(), KldStats()
    out = sys.stdout
    if base is not None:
        out.write("\n" + KLD_HEADER + "\n")
    kv = model.take_cache()
    try:
        for i in range(n_chunk):
            t0 = time.perf_counter()
            chunk = base.tokens(i) if base is not None else list(tokens[i * n_ctx:(i + 1) * n_ctx])
            if base is None and bos is not None:
                chunk[0] = bos                                   # every chunk starts as a text does
            if base is not None and max(chunk) >= cfg.n_vocab:
                raise HybridMoeError(f"{args.kl_divergence_base}: chunk {i + 1} holds token ids past the vocabulary")
            logits = chunk_scored_logits(model, kv, chunk, first, ubatch)
            targets = torch.tensor(chunk[first + 1:], dtype=torch.long)
            if base is not None:
                kld.add(logits, targets, base.reference(i))
            else:
                ppl.add(token_nll(logits, targets))
                if writer is not None:
                    writer.write_chunk(i, chunk, logits, targets)
            if i == 0:
                dt = time.perf_counter() - t0
                print(f"{tag}: {dt:.2f} seconds per pass - ETA {dt * n_chunk / 60:.2f} minutes", file=err)
            out.write(kld.chunk_line(i + 1) + "\n" if base is not None else f"[{i + 1}]{ppl.ppl:.4f},")
            out.flush()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        kv.tokens.clear()
        model.return_cache(kv)
    if writer is not None:
        writer.close()
    if base is None:
        out.write("\n" + ppl.final_line() + "\n")
    else:
        out.write("\n" + "\n".join(kld.summary()) + "\n")
    return 0
