"""The devices a model can be placed on: the CPU (host RAM) and CUDA GPUs, named as llama.cpp names them.

`HYBRIDMOE_FAKE_GPUS` makes CUDA0..N stand for the CPU with the memory sizes given, so placement,
scheduling and upload logic run in CI with no GPU:
    HYBRIDMOE_FAKE_GPUS=2            two fake GPUs of 24 GiB
    HYBRIDMOE_FAKE_GPUS=2x24GiB      the same
    HYBRIDMOE_FAKE_GPUS=24GiB,8GiB   two fake GPUs of different sizes (a bare number is GiB)
Fake GPUs replace any real ones and appear nowhere unless the variable is set.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from . import env
from .errors import HybridMoeError, PlacementError

FAKE_ENV = "HYBRIDMOE_FAKE_GPUS"
DEFAULT_FAKE_BYTES = 24 << 30
GiB = 1 << 30

_UNITS = {"": GiB, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20,
          "mb": 10**6, "g": GiB, "gib": GiB, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([a-z]*)\s*$", re.I)


@dataclass
class Device:
    name: str                  # "CPU", "CUDA0", ... (what `-ot ...=CUDA1` says)
    kind: str                  # "cpu" | "cuda"
    index: int                 # torch ordinal for CUDA (after CUDA_VISIBLE_DEVICES); 0 for the CPU
    total_bytes: int
    free_bytes: int
    torch_device: torch.device
    fake: bool = False
    description: str = ""

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"


def parse_size(text: str) -> int:
    """'24GiB' -> bytes. Binary units for K/M/G/T and KiB..TiB, decimal for KB..TB; a bare number is GiB."""
    m = _SIZE_RE.match(text)
    if not m or m[2].lower() not in _UNITS:
        raise HybridMoeError(f"size {text!r} is not understood (write e.g. 24GiB, 8G, 512MiB)")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def parse_fake_gpus(spec: str) -> list[int]:
    """The memory size of each fake GPU from a HYBRIDMOE_FAKE_GPUS value."""
    spec = spec.strip()
    bad = HybridMoeError(f"{FAKE_ENV}={spec!r} is not understood: use a count (2), COUNTxSIZE (2x24GiB) "
                         "or a list of sizes (24GiB,8GiB)")
    if not spec:
        return []
    if spec.isdigit():
        return [DEFAULT_FAKE_BYTES] * int(spec)
    sizes = []
    for item in spec.split(","):
        count, sep, size = item.strip().partition("x")
        try:
            if sep and count.strip().isdigit():
                sizes += [parse_size(size)] * int(count)
            else:
                sizes.append(parse_size(item))
        except HybridMoeError:
            raise bad from None
    if any(s <= 0 for s in sizes):
        raise bad
    return sizes


def _host_memory() -> tuple[int, int]:
    """(total, available) host RAM in bytes."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
        return info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))
    except (OSError, KeyError, ValueError, IndexError):
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES") if "SC_AVPHYS_PAGES" in os.sysconf_names else pages
        return pages * size, avail * size


def _cpu_device() -> Device:
    total, free = _host_memory()
    return Device("CPU", "cpu", 0, total, free, torch.device("cpu"), False, "host memory")


def _cuda_devices() -> list[Device]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        name = torch.cuda.get_device_properties(i).name
        out.append(Device(f"CUDA{i}", "cuda", i, int(total), int(free), torch.device("cuda", i), False, name))
    return out


def list_devices() -> list[Device]:
    """CPU first, then CUDA0.. in torch order (which follows CUDA_VISIBLE_DEVICES), or the fake GPUs."""
    devices = [_cpu_device()]
    spec = env.get(FAKE_ENV) or None
    if spec is not None and spec.strip() not in ("", "0"):
        for i, size in enumerate(parse_fake_gpus(spec)):
            devices.append(Device(f"CUDA{i}", "cuda", i, size, size, torch.device("cpu"), True,
                                  f"fake GPU backed by the CPU ({FAKE_ENV})"))
        return devices
    return devices + _cuda_devices()


def get_device(name: str, devices: list[Device] | None = None) -> Device:
    """The device called `name` ('CPU', 'cuda0', 'CUDA0': case does not matter, as in llama.cpp)."""
    if devices is None:
        devices = list_devices()
    want = name.strip().upper()
    for d in devices:
        if d.name.upper() == want:
            return d
    known = ", ".join(d.name for d in devices)
    hint = ""
    if not any(d.is_gpu for d in devices):
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = " (no CUDA GPU is visible" + (f" with CUDA_VISIBLE_DEVICES={cvd}" if cvd is not None else "") + \
               f"; for a dry run without GPUs set {FAKE_ENV}=2x24GiB)"
    raise PlacementError(f"unknown device {name!r}: known devices are {known}{hint}")
