"""Tensor groups and the placement report: the table printed before anything is loaded, and its JSON."""
from __future__ import annotations

from ..formats.names import KINDS, fmt_bytes, gib, layer_of, tensor_kind
from .core import Placement


def _table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _short(name: str) -> str:
    parts = name.split(".")
    return parts[2] if layer_of(name) is not None else parts[0]


def group_rows(placement: "Placement") -> list[dict]:
    """Tensor groups: per kind, consecutive layers with the same devices collapsed into one range."""
    per: dict[tuple[str, int | None], dict[str, list[str]]] = {}
    for name, dev in placement.device_of.items():
        key = (tensor_kind(name), layer_of(name))
        per.setdefault(key, {}).setdefault(dev, []).append(name)
    order = {d.name: i for i, d in enumerate(placement.devices)}
    rows = []
    for kind in KINDS:
        keys = sorted((k for k in per if k[0] == kind), key=lambda k: -1 if k[1] is None else k[1])
        run = None
        for key in keys:
            by_dev = per[key]
            if len(by_dev) == 1:
                sig = ((next(iter(by_dev)), ()),)
            else:
                sig = tuple(sorted(((d, tuple(sorted(_short(n) for n in ns))) for d, ns in by_dev.items()),
                                   key=lambda x: order.get(x[0], 99)))
            names = [n for ns in by_dev.values() for n in ns]
            nbytes = sum(placement.tensors[n].nbytes for n in names)
            layer = key[1]
            if run and layer is not None and run["last"] is not None and layer == run["last"] + 1 and run["sig"] == sig:
                run["last"] = layer
                run["count"] += len(names)
                run["bytes"] += nbytes
                continue
            run = {"kind": kind, "first": layer, "last": layer, "sig": sig, "count": len(names), "bytes": nbytes}
            rows.append(run)
    for r in rows:
        if r["first"] is None:
            r["layers"] = "-"
        else:
            r["layers"] = f"blk {r['first']}" if r["first"] == r["last"] else f"blk {r['first']}-{r['last']}"
        sig = r["sig"]
        r["device"] = sig[0][0] if len(sig) == 1 else \
            " | ".join(f"{d}: {', '.join(ns)}" for d, ns in sig)
    return rows


def format_plan(placement: "Placement", cfg=None) -> str:
    """The placement as text: tensor groups with device and bytes, then memory per device, then warnings (all but
    the RAM shortfall, which `plan` gives as its verdict)."""
    cfg = cfg or placement.cfg
    o = placement.opts
    ctx = o.ctx_size or cfg.n_ctx_train
    name = getattr(cfg, "name", "") or cfg.arch
    out = [f"model: {name} ({cfg.arch}, {cfg.n_layer} layers, {len(placement.tensors)} tensors, "
           f"{fmt_bytes(sum(t.nbytes for t in placement.tensors.values()))})",
           f"options: -ngl {o.n_gpu_layers} -c {ctx} -ctk {o.cache_type_k} -ctv {o.cache_type_v} "
           f"-b {o.batch_size} -ub {o.ubatch_size} -sm {o.split_mode}"
           + (f" -ts {','.join(f'{x:g}' for x in o.tensor_split)}" if o.tensor_split else "")
           + (" -nkvo" if o.no_kv_offload else "") + ("" if o.flash_attn else " -fa off"), ""]
    rows = [[r["kind"], r["layers"], r["device"], str(r["count"]), fmt_bytes(r["bytes"])] for r in group_rows(placement)]
    out += _table(["group", "layers", "device", "tensors", "bytes"], rows, {3, 4})
    out.append("")
    drows = []
    for d in placement.devices:
        t = placement.totals[d.name]
        if d.is_gpu:
            status = f"OVER by {gib(t.over)}" if t.over > 0 else "fits"
        else:
            status = f"over available RAM by {gib(t.over)} (mmap pages from disk)" if t.over > 0 else "fits"
        drows.append([d.name + (" (fake)" if d.fake else ""), fmt_bytes(t.weights), fmt_bytes(t.kv),
                      fmt_bytes(t.compute), fmt_bytes(t.total), fmt_bytes(t.free), status])
    out += _table(["device", "weights", "KV cache", "compute", "total", "free", ""], drows, {1, 2, 3, 4, 5})
    if placement.rules:
        out += ["", "rules (first match wins):"]
        out += [f"  {r.source}: {r.pattern}={r.device}" for r in placement.rules]
    ram = placement.ram_shortfall()              # `plan` ends with it ("does not fit in RAM: ...")
    shown = [w for w in placement.warnings if w != ram]
    if shown:
        out += ["", "warnings:"] + [f"  - {w}" for w in shown]
    return "\n".join(out)


def placement_to_json(placement: "Placement") -> dict:
    """Everything the report shows, as plain data: tensor -> device map, per-layer devices, per-device totals."""
    o = placement.opts
    devices = {}
    for d in placement.devices:
        t = placement.totals[d.name]
        devices[d.name] = {"kind": d.kind, "fake": d.fake, "description": d.description,
                           "capacity": d.total_bytes, "free": t.free, "weights": t.weights, "kv": t.kv,
                           "compute": t.compute, "compute_parts": dict(t.compute_parts), "total": t.total,
                           "over": max(0, t.over), "fits": t.over <= 0}
    cfg = placement.cfg
    return {
        "model": {"name": getattr(cfg, "name", ""), "arch": cfg.arch, "n_layer": cfg.n_layer},
        "options": {k: getattr(o, k) for k in o.__dataclass_fields__},
        "tensors": dict(placement.device_of),
        "layers": [{"layer": i, "layer_device": placement.layer_device[i], "attn_device": placement.attn_device(i),
                    "kv_device": placement.kv_device(i), "kv_bytes": placement.kv_bytes_layer[i]}
                   for i in range(cfg.n_layer)],
        "output_device": placement.output_device,
        "devices": devices,
        "rules": [{"pattern": r.pattern, "device": r.device, "source": r.source} for r in placement.rules],
        "warnings": list(placement.warnings),
        "fits": not placement.over_budget(),
    }
