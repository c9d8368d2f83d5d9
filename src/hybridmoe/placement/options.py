"""Placement options with llama.cpp's names and flags, so users can paste their command lines."""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field, fields

from ..config import KV_TYPE_BYTES
from ..errors import PlacementError

SPLIT_MODES = ("layer", "none", "row")
# bytes per element of each KV cache type (q8_0: 34-byte blocks of 32)
ALL_LAYERS = 9999      # what `-ngl all` stores: every repeating layer plus the output layer

ALIASES = {
    "ngl": "n_gpu_layers", "gpu_layers": "n_gpu_layers", "ot": "override_tensor", "cmoe": "cpu_moe",
    "ncmoe": "n_cpu_moe", "ts": "tensor_split", "mg": "main_gpu", "sm": "split_mode", "nkvo": "no_kv_offload",
    "c": "ctx_size", "ctk": "cache_type_k", "ctv": "cache_type_v", "b": "batch_size", "ub": "ubatch_size",
    "fa": "flash_attn",
}


@dataclass
class PlacementOptions:
    n_gpu_layers: int = 0                  # -ngl: the last N repeating layers (and output when N > n_layer)
    override_tensor: list[str] = field(default_factory=list)   # -ot "REGEX=DEV[,REGEX=DEV...]", in order
    cpu_moe: bool = False                  # --cpu-moe: every layer's experts on the CPU
    n_cpu_moe: int = 0                     # --n-cpu-moe N: experts of blocks 0..N-1 on the CPU
    tensor_split: list[float] | None = None   # -ts: share of offloaded layers per GPU (default: by free memory)
    main_gpu: int = 0                      # -mg: the GPU used with -sm none
    split_mode: str = "layer"              # -sm: layer | none | row (row is treated as layer)
    no_kv_offload: bool = False            # -nkvo: KV cache in host memory
    ctx_size: int = 4096                   # -c (0: the model's training context)
    cache_type_k: str = "f16"              # -ctk
    cache_type_v: str = "f16"              # -ctv
    batch_size: int = 2048                 # -b
    ubatch_size: int = 512                 # -ub (clamped to -b, as llama.cpp does)
    flash_attn: bool = True                # -fa: off means attention scores are materialized (compute buffers)
    op_offload: bool = True                # --no-op-offload clears it: no staging buffers for uploaded experts

    def __post_init__(self):
        self.n_gpu_layers = _ngl(self.n_gpu_layers)
        if isinstance(self.override_tensor, str):
            self.override_tensor = [self.override_tensor]
        self.override_tensor = list(self.override_tensor or [])
        for ot in self.override_tensor:
            if not isinstance(ot, str):
                raise PlacementError(f"override_tensor items must be strings like 'exps=CPU', got {ot!r}")
        if isinstance(self.tensor_split, str):
            self.tensor_split = parse_tensor_split(self.tensor_split)
        if self.tensor_split is not None:
            self.tensor_split = [float(x) for x in self.tensor_split]
            if any(x < 0 for x in self.tensor_split):
                raise PlacementError(f"-ts {self.tensor_split}: proportions must not be negative")
        self.split_mode = str(self.split_mode).lower()
        if self.split_mode not in SPLIT_MODES:
            raise PlacementError(f"-sm {self.split_mode!r}: split mode must be one of {', '.join(SPLIT_MODES)}")
        for attr in ("cache_type_k", "cache_type_v"):
            v = str(getattr(self, attr)).lower()
            if v not in KV_TYPE_BYTES:
                flag = "-ctk" if attr == "cache_type_k" else "-ctv"
                raise PlacementError(f"{flag} {v}: KV cache type must be one of {', '.join(KV_TYPE_BYTES)}")
            setattr(self, attr, v)
        for attr, least in (("n_cpu_moe", 0), ("main_gpu", 0), ("ctx_size", 0), ("batch_size", 1),
                            ("ubatch_size", 1)):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise PlacementError(f"{attr} must be an integer >= {least}, got {v!r}")
        self.ubatch_size = min(self.ubatch_size, self.batch_size)
        self.flash_attn = _flash_attn(self.flash_attn)
        self.cpu_moe, self.no_kv_offload, self.op_offload = bool(self.cpu_moe), bool(self.no_kv_offload), \
            bool(self.op_offload)

    @classmethod
    def from_kwargs(cls, **kw) -> "PlacementOptions":
        """Options from llama.cpp's long names (n_gpu_layers=...) or short ones (ngl=..., ot=..., ts=...)."""
        known = {f.name for f in fields(cls)}
        out = {}
        for key, value in kw.items():
            k = key.lstrip("-").replace("-", "_")
            k = ALIASES.get(k, k)
            if k not in known:
                raise PlacementError(f"unknown placement option {key!r}; known: {', '.join(sorted(known))} "
                                     f"and the short names {', '.join(sorted(ALIASES))}")
            if k in out:
                raise PlacementError(f"placement option {k!r} is given twice (as {key!r} and another name)")
            out[k] = value
        return cls(**out)

    def replace(self, **kw) -> "PlacementOptions":
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["override_tensor"] = list(self.override_tensor)
        d.update(kw)
        return PlacementOptions(**d)


def _ngl(v) -> int:
    if isinstance(v, str):
        s = v.strip().lower()
        if s == "all":
            return ALL_LAYERS
        if not re.fullmatch(r"\d+", s):
            raise PlacementError(f"-ngl {v!r}: give a number of layers or 'all'")
        return int(s)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise PlacementError(f"-ngl {v!r}: give a number of layers >= 0 or 'all'")
    return v


def _ngl_arg(text: str) -> int:
    try:
        return _ngl(text)
    except PlacementError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _flash_attn(v) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("on", "1", "true", "auto", "yes"):
        return True
    if s in ("off", "0", "false", "no"):
        return False
    raise PlacementError(f"-fa {v!r}: use on, off or auto")


def parse_tensor_split(text: str) -> list[float]:
    """'3,1' or '3/1' (llama.cpp accepts both) -> [3.0, 1.0]."""
    parts = [p for p in re.split(r"[,/;]", text.strip()) if p.strip()]
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise PlacementError(f"-ts {text!r}: give proportions per GPU like 3,1 or 3/1") from None
    if not vals:
        raise PlacementError(f"-ts {text!r}: give proportions per GPU like 3,1 or 3/1")
    return vals


def add_placement_args(parser: argparse.ArgumentParser) -> None:
    """llama.cpp's placement flags, with its spellings."""
    g = parser.add_argument_group("placement (llama.cpp flags)")
    g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", type=_ngl_arg, default=0,
                   metavar="N", help="offload the last N repeating layers to the GPUs; N > layers also "
                   "offloads the output layer ('all' = everything)")
    g.add_argument("-ot", "--override-tensor", dest="override_tensor", action="append", default=[],
                   metavar="REGEX=DEV[,...]", help="put tensors whose name matches REGEX on DEV (CPU, CUDA0..); "
                   "repeatable; the first matching rule wins; beats -ngl")
    g.add_argument("-cmoe", "--cpu-moe", dest="cpu_moe", action="store_true",
                   help="keep all experts (ffn_*_exps) on the CPU")
    g.add_argument("-ncmoe", "--n-cpu-moe", dest="n_cpu_moe", type=int, default=0, metavar="N",
                   help="keep the experts of the first N layers on the CPU")
    g.add_argument("-ts", "--tensor-split", dest="tensor_split", type=str, default=None, metavar="SPLIT",
                   help="share of offloaded layers per GPU, e.g. 3,1 (default: by free memory)")
    g.add_argument("-mg", "--main-gpu", dest="main_gpu", type=int, default=0, metavar="I",
                   help="GPU used with --split-mode none")
    g.add_argument("-sm", "--split-mode", dest="split_mode", type=str.lower, choices=SPLIT_MODES, default="layer",
                   help="how to split layers over GPUs (row is treated as layer)")
    g.add_argument("-nkvo", "--no-kv-offload", dest="no_kv_offload", action="store_true",
                   help="keep the KV cache in host memory")
    g.add_argument("-c", "--ctx-size", dest="ctx_size", type=int, default=4096, metavar="N",
                   help="context size (0: the model's)")
    g.add_argument("-ctk", "--cache-type-k", dest="cache_type_k", type=str.lower, choices=list(KV_TYPE_BYTES),
                   default="f16", help="K cache type")
    g.add_argument("-ctv", "--cache-type-v", dest="cache_type_v", type=str.lower, choices=list(KV_TYPE_BYTES),
                   default="f16", help="V cache type")
    g.add_argument("-b", "--batch-size", dest="batch_size", type=int, default=2048, metavar="N",
                   help="logical batch size")
    g.add_argument("-ub", "--ubatch-size", dest="ubatch_size", type=int, default=512, metavar="N",
                   help="physical batch size (sizes the compute buffers)")
    g.add_argument("-fa", "--flash-attn", dest="flash_attn", nargs="?", const="on", default="auto",
                   choices=["on", "off", "auto", "1", "0"], help="flash attention (off sizes buffers for "
                   "materialized attention scores)")
    g.add_argument("--no-op-offload", dest="no_op_offload", action="store_true",
                   help="never run ops on host-resident weights on a GPU (no upload staging buffers)")
    add_compat_args(parser)


# Flags of llama.cpp / ik_llama.cpp command lines (the seeds' users paste whole lines) that change nothing
# here, with the reason printed once when one is given: "names" (a flag and its aliases, the first is the one
# named in the note) -> (takes a value, why).
COMPAT_FLAGS = {
    "--no-mmap": (0, "weights stay memory-mapped (read once, so mapping costs nothing extra); with a GPU, CPU "
                  "experts are copied into pinned RAM when they fit"),
    "--mlock": (0, "not implemented: pages of the mapping may be evicted under memory pressure"),
    "-rtr": (0, "the CPU kernels read GGUF blocks as they are, with no repacking"),
    "--run-time-repack": (0, "the CPU kernels read GGUF blocks as they are, with no repacking"),
    "-mla": (1, "DeepSeek attention always runs as MLA, with the compressed KV cache"),
    "-amb": (1, "attention runs without a separate attention buffer limit"),
    "--numa": (1, "threads are not pinned to NUMA nodes"),
    "-np": (1, "one sequence is generated (hybridmoe serve -np N serves N at once)"),
    "--parallel": (1, "one sequence is generated (hybridmoe serve -np N serves N at once)"),
    "-tb": (1, "prompt processing uses -t threads too"),
    "--threads-batch": (1, "prompt processing uses -t threads too"),
    "--jinja": (0, "chat templates always run (sandboxed jinja2)"),
}


def _compat_dest(names: str) -> str:
    return "compat_" + names.split()[-1].lstrip("-").replace("-", "_")


def add_compat_args(parser: argparse.ArgumentParser, table: dict = COMPAT_FLAGS) -> None:
    """The flags of `table` (names -> (takes a value, why)), accepted and noted, not acted on."""
    g = parser.add_argument_group("accepted for llama.cpp compatibility (no effect here)")
    for names, (nargs, why) in table.items():
        dest = _compat_dest(names)
        if nargs:
            g.add_argument(*names.split(), dest=dest, default=None, metavar="X", help=why)
        else:
            g.add_argument(*names.split(), dest=dest, action="store_true", help=why)


def compat_notes(args, table: dict = COMPAT_FLAGS, say: str = "is accepted for compatibility and has no effect"
                 ) -> list[str]:
    """One line per compatibility flag that was given: what it would do in llama.cpp and why not here."""
    out = []
    for names, (_, why) in table.items():
        v = getattr(args, _compat_dest(names), None)
        if v not in (None, False):
            out.append(f"note: {names.split()[0]} {say}: {why}")
    return out


def options_from_args(args: argparse.Namespace) -> PlacementOptions:
    """PlacementOptions from a namespace filled by add_placement_args."""
    for note in compat_notes(args):
        print(note, file=sys.stderr)
    return PlacementOptions(
        n_gpu_layers=args.n_gpu_layers, override_tensor=list(args.override_tensor or []), cpu_moe=args.cpu_moe,
        n_cpu_moe=args.n_cpu_moe, tensor_split=args.tensor_split, main_gpu=args.main_gpu,
        split_mode=args.split_mode, no_kv_offload=args.no_kv_offload, ctx_size=args.ctx_size,
        cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v, batch_size=args.batch_size,
        ubatch_size=args.ubatch_size, flash_attn=args.flash_attn,
        op_offload=not getattr(args, "no_op_offload", False))
