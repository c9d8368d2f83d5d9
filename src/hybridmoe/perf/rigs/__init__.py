"""Rig files: the devices and rates of a machine you don't have, for `hybridmoe plan --rig`.

A rig is JSON (see the files beside this module):
    {"name": ..., "description": ..., "source": "measured | spec-sheet values ...", "gpu_reserve_gib": 0.5,
     "cpu": {"name", "threads", "ram_gib", "ram_read_gbps", "bf16_tflops", ["ram_free_gib"]},
     "gpus": [{"name", "memory_gib", "hbm_gbps", "bf16_tflops", "h2d_gbps", ["sync_latency_us", "free_gib",
               "pcie"]}, ...], ["costs": {"cpu": {...}, "CUDA0": {...}}]}
Bandwidths are decimal GB/s, sizes binary GiB. A GPU's free memory is `free_gib`, else memory_gib minus the
rig's gpu_reserve_gib (CUDA context). The devices are marked fake (nothing can be loaded on them: their torch
device is `meta`) and described as the rig's; the rates are a perf.rates.Rates whose host is `rig:NAME`.
`costs` (optional) are measured costs that are not bandwidth (perf/costs.py), as `hybridmoe calibrate --json`
prints them; without them the planner predicts the runtime's steps at the rates alone.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from ...devices import Device
from ...errors import HybridMoeError
from ..rates import Rates

GiB = 1 << 30
_CPU_KEYS = ("ram_gib", "ram_read_gbps", "bf16_tflops")
_GPU_KEYS = ("memory_gib", "hbm_gbps", "bf16_tflops", "h2d_gbps")


@dataclass
class Rig:
    name: str
    description: str
    source: str
    devices: list[Device]
    rates: Rates
    notes: list[str] = field(default_factory=list)
    path: str = ""

    def summary(self) -> str:
        """Two or more lines: what the rig is, where its numbers come from, one line per device."""
        r = self.rates
        cpu = self.devices[0]
        out = [f"rig {self.name}: {self.description}", f"  numbers: {self.source}",
               f"  CPU    {cpu.description.split(': ', 1)[-1]}: {cpu.total_bytes / GiB:.0f} GiB RAM, "
               f"read {r.ram_read_bw / 1e9:.1f} GB/s, bf16 {r.cpu_bf16_flops / 1e12:.2f} TFLOP/s, {r.threads} threads"]
        for d in self.devices[1:]:
            out.append(f"  {d.name:<6} {r.gpu_names.get(d.name, '?')}: {d.total_bytes / GiB:.0f} GiB "
                       f"({d.free_bytes / GiB:.1f} free), {r.gpu_bw[d.name] / 1e9:.0f} GB/s, "
                       f"bf16 {r.gpu_bf16_flops[d.name] / 1e12:.0f} TFLOP/s, H2D {r.h2d_bw[d.name] / 1e9:.1f} GB/s")
        return "\n".join(out)


def rig_names() -> list[str]:
    """The rigs shipped with hybridmoe (package data)."""
    return sorted(p.name[:-5] for p in resources.files(__package__).iterdir() if p.name.endswith(".json"))


def _num(d: dict, key: str, where: str, minimum: float = 0.0, default=None) -> float:
    v = d.get(key, default)
    if v is None:
        raise HybridMoeError(f"{where}: missing {key!r}")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= minimum:
        raise HybridMoeError(f"{where}: {key} must be a number >= {minimum:g}, got {v!r}")
    return float(v)


def _read_text(path_or_name: str) -> tuple[str, str]:
    p = Path(path_or_name)
    if p.suffix == ".json" or p.exists():
        if not p.is_file():
            raise HybridMoeError(f"rig file {path_or_name} does not exist; shipped rigs: {', '.join(rig_names())}")
        return p.read_text(encoding="utf-8"), str(p)
    name = path_or_name[:-5] if path_or_name.endswith(".json") else path_or_name
    if name not in rig_names():
        raise HybridMoeError(f"no rig {path_or_name!r}: give a .json file or one of {', '.join(rig_names())}")
    res = resources.files(__package__) / f"{name}.json"
    return res.read_text(encoding="utf-8"), str(res)


def read_rig(path_or_name: str) -> Rig:
    """A rig from a JSON file path or the name of a shipped rig (see rig_names())."""
    text, where = _read_text(path_or_name)
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise HybridMoeError(f"rig {where} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cpu"), dict) or not isinstance(doc.get("gpus"), list):
        raise HybridMoeError(f"rig {where}: expected an object with 'cpu' (an object) and 'gpus' (a list)")
    name = str(doc.get("name") or Path(where).stem)
    cpu = doc["cpu"]
    for k in _CPU_KEYS:
        _num(cpu, k, f"rig {name} cpu", 1e-9)
    ram = int(_num(cpu, "ram_gib", f"rig {name} cpu") * GiB)
    ram_free = int(_num(cpu, "ram_free_gib", f"rig {name} cpu", 0, cpu["ram_gib"]) * GiB)
    reserve = _num(doc, "gpu_reserve_gib", f"rig {name}", 0, 0)
    threads = int(_num(cpu, "threads", f"rig {name} cpu", 1, 1))
    devices = [Device("CPU", "cpu", 0, ram, min(ram_free, ram), torch.device("meta"), True,
                      f"rig {name}: {cpu.get('name', 'CPU')}")]
    # optional: the CPU expert kernel's measured rate by batch size ({"32": TFLOP/s, "512": TFLOP/s}, what
    # `hybridmoe calibrate` prints); without it the offload model assumes 40% of the bf16 matmul rate
    moe = cpu.get("expert_kernel_tflops", {})
    if not isinstance(moe, dict) or any(not str(t).isdigit() for t in moe):
        raise HybridMoeError(f"rig {name} cpu: expert_kernel_tflops must map token counts to TFLOP/s, "
                             f'e.g. {{"32": 0.5, "512": 3.0}}')
    moe_flops = {str(t): _num(moe, t, f"rig {name} cpu expert_kernel_tflops", 1e-9) * 1e12 for t in moe}
    rates = Rates(ram_read_bw=cpu["ram_read_gbps"] * 1e9, cpu_bf16_flops=cpu["bf16_tflops"] * 1e12,
                  threads=threads, host=f"rig:{name}", measured_at=str(doc.get("source", "")),
                  cpu_moe_flops=moe_flops)
    for i, g in enumerate(doc["gpus"]):
        where_g = f"rig {name} gpus[{i}]"
        if not isinstance(g, dict):
            raise HybridMoeError(f"{where_g}: expected an object")
        for k in _GPU_KEYS:
            _num(g, k, where_g, 1e-9)
        dev = f"CUDA{i}"
        total = int(g["memory_gib"] * GiB)
        free = int(_num(g, "free_gib", where_g, 0, g["memory_gib"] - reserve) * GiB)
        if free <= 0 or free > total:
            raise HybridMoeError(f"{where_g}: free memory {free / GiB:.2f} GiB is not within (0, memory_gib]")
        gname = str(g.get("name", "GPU"))
        devices.append(Device(dev, "cuda", i, total, free, torch.device("meta"), True,
                              f"rig {name}: {gname}" + (f", PCIe {g['pcie']}" if g.get("pcie") else "")))
        rates.gpu_names[dev] = gname
        rates.gpu_bw[dev] = g["hbm_gbps"] * 1e9
        rates.gpu_bf16_flops[dev] = g["bf16_tflops"] * 1e12
        rates.h2d_bw[dev] = g["h2d_gbps"] * 1e9
        rates.sync_latency[dev] = _num(g, "sync_latency_us", where_g, 0, 0) * 1e-6
    costs = doc.get("costs", {})                 # optional: measured costs, as `hybridmoe calibrate --json` prints
    if not isinstance(costs, dict) or not all(isinstance(v, dict) for v in costs.values()):
        raise HybridMoeError(f"rig {name}: costs must map \"cpu\" / \"CUDA0\".. to objects of numbers "
                             "(as `hybridmoe calibrate --json` prints them)")
    rates.costs = {k: dict(v) for k, v in costs.items()}
    notes = [str(n) for n in doc.get("notes", [])] if isinstance(doc.get("notes", []), list) else []
    return Rig(name, str(doc.get("description", "")), str(doc.get("source", "unstated")), devices, rates, notes,
               where)


def load_rig(path_or_name: str) -> tuple[list[Device], Rates]:
    """(devices, rates) of a rig: CPU first, then CUDA0.. in the rig's order, all marked as the rig's."""
    rig = read_rig(path_or_name)
    return rig.devices, rig.rates
