"""The one validation step between the GGUF reader and everything else.

Model files are untrusted input. gguf.py checks the file's structure (lengths, offsets, duplicate names,
overlapping data, split parts); this module checks what the structure holds, before any large allocation
or loop is sized by it:

* `Meta`: typed metadata accessors with allowed ranges (counts >= 1 with upper bounds, finite floats,
  booleans, arrays of the right element type and length), used by config.py, models/catalog.py and
  text/tokenizer.py;
* `check_tensors`: the tensors an architecture needs are present with the shapes the metadata implies,
  in types hybridmoe computes with, and nothing else (llama.cpp refuses extra tensors too);
* `check_finite`: tensors hold no NaN or inf (the small ones at every load, all of them with
  --check-tensors).

A failing file gets one ModelFileError line: the key or tensor, what was found, what was expected. All of it
is O(metadata + tensor count); only check_finite reads tensor data.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ..errors import ModelFileError, printable
from ..quant.types import GGMLType, interleave, row_bytes
from .names import layer_of

MISSING = object()

# Upper bounds of counts: far above any real model, low enough that nothing sized by them hangs or overflows
MAX_LAYERS = 1 << 12
MAX_EMBD = 1 << 17
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 13
MAX_FF = 1 << 20
MAX_EXPERTS = 1 << 14
MAX_VOCAB = 1 << 24
MAX_CTX = 1 << 26

FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
# tensors a file may hold that no architecture here uses
IGNORED_TENSORS = ("rope_freqs.weight",)


def key_text(key: str) -> str:
    """A metadata key or tensor name for a message: as it is when short and plain, else errors.printable."""
    if isinstance(key, str) and 0 < len(key) <= 80 and key.isprintable() and " " not in key:
        return key
    return printable(key)


def _type_name(v) -> str:
    if isinstance(v, np.ndarray):
        return f"array of {v.dtype.name}"
    if isinstance(v, list):
        return "array"
    if isinstance(v, (bool, np.bool_)):
        return "bool"
    if isinstance(v, numbers.Integral):
        return "integer"
    if isinstance(v, numbers.Real):
        return "float"
    return type(v).__name__


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


class Meta:
    """Typed, range-checked reads of GGUF metadata. Keys are read as `prefix + key` (the architecture's
    prefix, e.g. "qwen3moe."); a missing key without a default is an error."""

    def __init__(self, md: dict, path: str, prefix: str = ""):
        self.md, self.path, self.prefix = md, str(path), prefix

    def full(self, key: str) -> str:
        return self.prefix + key

    def has(self, key: str) -> bool:
        return self.full(key) in self.md

    def fail(self, key: str, problem: str, hint: str = "the file is corrupt or was written wrongly"):
        return ModelFileError(self.path, f"metadata {key_text(self.full(key))}: {problem}", hint)

    def _get(self, key: str, default):
        full = self.full(key)
        if full in self.md:
            return self.md[full], True
        if default is MISSING:
            raise ModelFileError(self.path, f"metadata key {key_text(full)} is missing",
                                 f"a {self.prefix.rstrip('.') or 'GGUF'} model file must have it")
        return default, False

    def _wrong(self, key, v, expected):
        return self.fail(key, f"found {printable(v)} ({_type_name(v)}), expected {expected}")

    def count(self, key: str, default=MISSING, lo: int = 1, hi: int = MAX_FF, per_layer: bool = False) -> int:
        """An integer in lo..hi. per_layer: a non-empty array of such integers is accepted too (some
        architectures give one value per layer); its largest item is returned."""
        v, found = self._get(key, default)
        if not found:
            return v
        if per_layer and isinstance(v, np.ndarray) and v.dtype.kind in "iu" and v.ndim == 1:
            if v.size == 0:
                raise self.fail(key, "found an empty array", f"expected an integer in {lo}..{hi} or one per layer")
            bad = (v < lo) | (v > hi)
            if bad.any():
                raise self._wrong(key, v[bad][0], f"integers in {lo}..{hi}")
            return int(v.max())
        if not _is_int(v) or not lo <= v <= hi:
            raise self._wrong(key, v, f"an integer in {lo}..{hi}")
        return int(v)

    def real(self, key: str, default=MISSING, lo: float = -math.inf, hi: float = math.inf,
             lo_open: bool = False) -> float:
        """A finite number in lo..hi (lo excluded with lo_open)."""
        v, found = self._get(key, default)
        if not found:
            return v
        ok = isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))
        f = float(v) if ok else math.nan
        if not ok or not math.isfinite(f) or f < lo or f > hi or (lo_open and f == lo):
            lo_text = "-inf" if lo == -math.inf else f"{lo:g}"
            rng = f"{'>' if lo_open else '>='} {lo_text}" if hi == math.inf else \
                f"in {lo_text}..{hi:g}{' (excluding ' + lo_text + ')' if lo_open else ''}"
            raise self._wrong(key, v, f"a finite number {rng}")
        return f

    def flag(self, key: str, default=MISSING) -> bool:
        v, found = self._get(key, default)
        if not found:
            return v
        if isinstance(v, (bool, np.bool_)) or (_is_int(v) and v in (0, 1)):
            return bool(v)
        raise self._wrong(key, v, "a boolean")

    def text(self, key: str, default=MISSING, limit: int = 1 << 20) -> str:
        v, found = self._get(key, default)
        if not found:
            return v
        if not isinstance(v, str) or len(v) > limit:
            raise self._wrong(key, v, f"a string of at most {limit} characters")
        return v

    def str_array(self, key: str, default=MISSING, n: int | None = None, max_items: int = MAX_VOCAB) -> list[str]:
        v, found = self._get(key, default)
        if not found:
            return v
        if isinstance(v, np.ndarray) or not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise self._wrong(key, v, "an array of strings")
        if n is not None and len(v) != n:
            raise self.fail(key, f"has {len(v)} items, expected {n}")
        if not 1 <= len(v) <= max_items:
            raise self.fail(key, f"has {len(v)} items, expected 1..{max_items}")
        return v

    def num_array(self, key: str, n: int, kinds: str = "iuf", what: str = "numbers", default=MISSING,
                  finite: bool = True) -> np.ndarray:
        """An array of n numbers whose numpy kind is in `kinds` (i, u: integers, f: floats), finite."""
        v, found = self._get(key, default)
        if not found:
            return v
        if not isinstance(v, np.ndarray) or v.ndim != 1 or v.dtype.kind not in kinds:
            raise self._wrong(key, v, f"an array of {n} {what}")
        if v.shape[0] != n:
            raise self.fail(key, f"has {v.shape[0]} items, expected {n} (one per token)")
        if finite and v.dtype.kind == "f" and not np.isfinite(v).all():
            i = int(np.flatnonzero(~np.isfinite(v))[0])
            raise self.fail(key, f"item {i} is {v[i]}, expected finite {what}")
        return v


def architecture(md: dict, path: str, supported: tuple[str, ...] | None = None) -> str:
    """general.architecture: a short printable string (one of `supported` when given)."""
    arch = md.get("general.architecture")
    if arch is None:
        raise ModelFileError(path, "metadata key general.architecture is missing", "the file is not a model")
    if not isinstance(arch, str) or not arch or len(arch) > 64 or not arch.isprintable():
        raise ModelFileError(path, f"metadata general.architecture: found {printable(arch)} ({_type_name(arch)})",
                             "expected a short architecture name")
    if supported is not None and arch not in supported:
        raise ModelFileError(path, f"architecture {printable(arch)} is not supported",
                             f"supported: {', '.join(supported)}")
    return arch


def model_name(md: dict, default: str) -> str:
    """general.name for display: printable and at most 80 characters, else `default`."""
    name = md.get("general.name")
    if not isinstance(name, str) or not name.strip():
        return default
    name = "".join(c if c.isprintable() else " " for c in name).strip()
    return name if len(name) <= 80 else name[:79] + "\u2026"


def check_config(cfg, path: str) -> None:
    """Cross-key rules of a ModelConfig (each key's own range was checked when it was read)."""
    def bad(problem, hint="the file is corrupt or was written wrongly"):
        return ModelFileError(path, problem, hint)
    a = cfg.arch
    if cfg.n_head % cfg.n_head_kv:
        raise bad(f"metadata {a}.attention.head_count {cfg.n_head} is not a multiple of head_count_kv {cfg.n_head_kv}")
    if cfg.n_expert or cfg.n_expert_used:
        if not 1 <= cfg.n_expert_used <= cfg.n_expert:
            raise bad(f"metadata {a}.expert_used_count: found {cfg.n_expert_used}, expected 1..{a}.expert_count "
                      f"({cfg.n_expert})")
        if cfg.n_ff_exp < 1:
            raise bad(f"metadata {a}.expert_feed_forward_length is missing or 0", "a MoE model needs its expert width")
    if cfg.n_expert_groups > 1:
        if cfg.n_expert % cfg.n_expert_groups or cfg.n_expert // cfg.n_expert_groups < 2:
            raise bad(f"metadata {a}.expert_group_count: found {cfg.n_expert_groups}, expected a divisor of "
                      f"expert_count ({cfg.n_expert}) leaving at least 2 experts a group")
        if cfg.n_group_used > cfg.n_expert_groups:
            raise bad(f"metadata {a}.expert_group_used_count: found {cfg.n_group_used}, expected 1..{cfg.n_expert_groups}")
        if cfg.n_expert_used > cfg.n_group_used * (cfg.n_expert // cfg.n_expert_groups):
            raise bad(f"metadata {a}.expert_used_count: found {cfg.n_expert_used}, more than the "
                      f"{cfg.n_group_used} used groups of {cfg.n_expert // cfg.n_expert_groups} experts hold")
    if cfg.n_layer_dense_lead > cfg.n_layer:
        raise bad(f"metadata {a}.leading_dense_block_count: found {cfg.n_layer_dense_lead}, expected 0..{cfg.n_layer}")
    if cfg.kv_lora_rank:
        if not 2 <= cfg.rope_dim <= cfg.head_dim or cfg.rope_dim % 2:
            raise bad(f"metadata {a}.rope.dimension_count: found {cfg.rope_dim}, expected an even number in "
                      f"2..key_length ({cfg.head_dim})")
    elif cfg.head_dim % 2:
        raise bad(f"metadata {a}.attention.key_length: found {cfg.head_dim}, expected an even number (RoPE pairs)")
    if cfg.rope_yarn and cfg.rope_yarn.get("type") != "linear" and cfg.rope_base <= 1:   # YaRN's ramp takes log(base)
        raise bad(f"metadata {a}.rope.freq_base: found {cfg.rope_base:g}, expected > 1 with YaRN")


def check_layer_count(tensors: dict, n_layer: int, block_count_key: str, path: str) -> None:
    """Before a list sized by block_count is built: the file has tensors of that many layers."""
    top = -1
    for name in tensors:
        li = layer_of(name)
        if li is not None and li > top:
            top = li
    if n_layer > top + 1:
        raise ModelFileError(path, f"metadata {block_count_key}: found {n_layer}, but the file has tensors of "
                             f"{top + 1} layers", "the file is corrupt or incomplete")


def check_tensors(tensors: dict, expected: list[tuple[str, tuple[int, ...]]], arch: str, n_layer: int,
                  path: str, supported=None) -> None:
    """The file's tensors are exactly `expected` (output.weight optional: tied to token_embd), with those
    shapes, in types hybridmoe computes with (`supported`); norms, biases and sinks in a float type; an
    expert layer's gate and up in one type. One ModelFileError for the first problem."""
    want = dict(expected)
    for name, shape in expected:
        info = tensors.get(name)
        if info is None:
            if name == "output.weight":
                continue
            raise ModelFileError(path, f"tensor {name} is missing for a {arch} model of {n_layer} layers",
                                 "the file is incomplete or its metadata is wrong")
        if tuple(info.shape) != tuple(shape):
            raise ModelFileError(path, f"tensor {name}: found shape {list(info.shape)}, expected {list(shape)} "
                                 "from the metadata", "the file is corrupt or its metadata is wrong")
        qt = info.qtype
        if supported is not None and qt not in supported and not (
                qt == GGMLType.MXFP4 and arch == "gpt-oss" and name.endswith("_exps.weight")):
            raise ModelFileError(path, f"tensor {name}: found type {qt.name}, which hybridmoe cannot compute with "
                                 "yet", "convert the model to another type")
        if (len(shape) == 1 or name.endswith(".bias")) and qt not in FLOAT_TYPES:
            raise ModelFileError(path, f"tensor {name}: found type {qt.name}, expected F32, F16 or BF16",
                                 "norms, biases and sinks are never quantized")
        rows = math.prod(shape[:-1])
        if rows % interleave(qt):
            raise ModelFileError(path, f"tensor {name}: {rows} rows of {qt.name}, expected a multiple of "
                                 f"{interleave(qt)}", "the file is corrupt")
        if info.nbytes != rows * row_bytes(qt, shape[-1]):
            raise ModelFileError(path, f"tensor {name}: {info.nbytes} bytes, expected "
                                 f"{rows * row_bytes(qt, shape[-1])}", "the file is corrupt")
        if name.endswith("ffn_up_exps.weight"):
            gate = tensors.get(name.replace("ffn_up_exps", "ffn_gate_exps"))
            if gate is not None and gate.qtype != qt:
                raise ModelFileError(path, f"tensor {name}: found type {qt.name}, expected {gate.qtype.name} as its "
                                     "ffn_gate_exps", "hybridmoe runs an expert's gate and up in one kernel")
    for name in tensors:
        if name not in want and name not in IGNORED_TENSORS:
            raise ModelFileError(path, f"tensor {key_text(name)} is not part of a {arch} model of {n_layer} layers",
                                 "unexpected tensor: the file is corrupt or its metadata is wrong")


CHEAP_CHECK_BYTES = 256 << 10      # larger routers are left to the run-time check of the logits


def is_small(name: str, shape, nbytes: int = 0) -> bool:
    """The tensors every load checks for NaN/inf: 1-D ones (norms, sinks), biases and routers, each of at most
    CHEAP_CHECK_BYTES. Larger routers (Qwen3-30B-A3B's: 1 MiB a layer) are not read at load: their pages
    are not resident yet, and reading them would cost more than the 2% of load time this check may take; a NaN
    there makes the logits non-finite, which Model.forward reports with the layer."""
    return (len(shape) == 1 or name.endswith(".bias") or ".ffn_gate_inp." in name) and nbytes <= CHEAP_CHECK_BYTES


def first_nonfinite(raw, qtype, shape, chunk_bytes: int = 1 << 24) -> tuple[int, float] | None:
    """(flat index, value) of the first NaN or inf of a tensor given as its GGUF bytes (uint8, flat), or
    None. Quantized tensors are dequantized a chunk of rows at a time, so memory stays bounded."""
    import torch
    qtype = GGMLType(qtype)
    n_cols = shape[-1]
    rb = row_bytes(qtype, n_cols)
    rows = math.prod(shape[:-1])
    step = max(interleave(qtype), chunk_bytes // max(rb, 1) // interleave(qtype) * interleave(qtype))
    for r0 in range(0, rows, step):
        part = raw[r0 * rb:min(rows, r0 + step) * rb]
        if qtype in FLOAT_TYPES:
            x = part.view({GGMLType.F32: torch.float32, GGMLType.F16: torch.float16,
                           GGMLType.BF16: torch.bfloat16}[qtype])
        else:
            from ..quant.dequant import dequantize
            x = dequantize(part.view(-1, rb), qtype, n_cols).reshape(-1)
        ok = torch.isfinite(x)
        if not bool(ok.all()):
            i = int((~ok).nonzero()[0, 0])
            return r0 * n_cols + i, float(x[i])
    return None


def check_finite(model, names, path: str, hint: str) -> None:
    """Tensors `names` of a GGUFModel hold no NaN or inf; else a ModelFileError naming the first."""
    for name in names:
        info = model.tensors[name]
        bad = first_nonfinite(model.raw(info), info.qtype, info.shape)
        if bad is not None:
            i, v = bad
            raise ModelFileError(path, f"tensor {key_text(name)} holds a non-finite value ({v} at element {i})",
                                 hint)
