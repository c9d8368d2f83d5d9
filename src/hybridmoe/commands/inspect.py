"""`hybridmoe inspect -m MODEL [REGEX]`: tensors with shape, type and size, then sums per layer and kind.

The numbers to write -ot lines with: how big each layer's experts, attention and the rest are.
"""
from __future__ import annotations

import argparse
import json
import re

from ..errors import HybridMoeError
from ..formats.names import KINDS, fmt_bytes, layer_of, tensor_kind
from .plan import add_model_arg, load_records


def setup_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="hybridmoe inspect", description=__doc__)
    add_model_arg(parser)
    parser.add_argument("regex", nargs="?", default=None,
                        help="only tensors whose name matches (re.search, as -ot does)")
    parser.add_argument("--summary", action="store_true", help="only the sums, not every tensor")
    parser.add_argument("--json", action="store_true", help="print as JSON")
    return parser


def _table(headers, rows, right_from=1) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if i >= right_from else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def main(args: argparse.Namespace) -> int:
    cfg, tensors = load_records(args.model)
    if args.regex:
        try:
            rx = re.compile(args.regex)
        except re.error as e:
            raise HybridMoeError(f"regex `{args.regex}` is invalid: {e.msg} at position {e.pos}") from None
        tensors = {n: t for n, t in tensors.items() if rx.search(n)}
        if not tensors:
            raise HybridMoeError(f"regex `{args.regex}` matches no tensor of {args.model}")
    layers: dict[object, dict[str, int]] = {}      # layer (or "-") -> kind -> bytes
    counts: dict[object, int] = {}
    by_type: dict[str, list[int]] = {}
    for n, t in tensors.items():
        li = layer_of(n)
        key = "-" if li is None else li
        d = layers.setdefault(key, {})
        d[tensor_kind(n)] = d.get(tensor_kind(n), 0) + t.nbytes
        counts[key] = counts.get(key, 0) + 1
        bt = by_type.setdefault(t.qtype.name, [0, 0])
        bt[0] += 1
        bt[1] += t.nbytes
    total = sum(t.nbytes for t in tensors.values())
    kinds = [k for k in KINDS if any(k in d for d in layers.values())]
    order = sorted((k for k in layers if k != "-")) + (["-"] if "-" in layers else [])
    if args.json:
        print(json.dumps({
            "model": {"name": cfg.name, "arch": cfg.arch, "n_layer": cfg.n_layer},
            "tensors": [{"name": n, "shape": list(t.shape), "type": t.qtype.name, "nbytes": t.nbytes,
                         "layer": layer_of(n), "kind": tensor_kind(n)} for n, t in tensors.items()],
            "layers": [{"layer": None if k == "-" else k, "tensors": counts[k], "bytes": sum(layers[k].values()),
                        "by_kind": layers[k]} for k in order],
            "types": {q: {"tensors": c, "bytes": b} for q, (c, b) in by_type.items()},
            "total_bytes": total}, indent=1))
        return 0
    out = [f"model: {cfg.name or cfg.arch} ({cfg.arch}, {cfg.n_layer} layers); shapes in torch order (outermost first)"]
    if not args.summary:
        rows = [[n, " x ".join(map(str, t.shape)), t.qtype.name, fmt_bytes(t.nbytes)] for n, t in tensors.items()]
        out += [""] + _table(["tensor", "shape", "type", "bytes"], rows, right_from=3)
    rows = []
    for k in order:
        label = "non-layer" if k == "-" else f"blk {k}"
        rows.append([label, str(counts[k])] + [fmt_bytes(layers[k][kd]) if kd in layers[k] else "" for kd in kinds]
                    + [fmt_bytes(sum(layers[k].values()))])
    sums = {kd: sum(d.get(kd, 0) for d in layers.values()) for kd in kinds}
    rows.append(["total", str(len(tensors))] + [fmt_bytes(sums[kd]) for kd in kinds] + [fmt_bytes(total)])
    out += ["", "per layer:"] + _table(["layer", "tensors"] + kinds + ["total"], rows)
    out += ["", "by type: " + ", ".join(f"{q} {fmt_bytes(b)} ({c} tensors)" for q, (c, b) in
                                       sorted(by_type.items(), key=lambda x: -x[1][1]))]
    out.append(f"total: {len(tensors)} tensors, {fmt_bytes(total)} ({total} bytes)")
    print("\n".join(out))
    return 0
