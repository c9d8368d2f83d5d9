"""Counters for --profile: op time per kind and device, copies, uploads, syncs, device crossings."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class Stats:
    def __init__(self, profile: bool = False):
        self.profile = profile
        self.reset()

    def reset(self):
        self.ops = defaultdict(lambda: [0, 0.0])          # (op kind, device) -> [calls, seconds]
        self.copies = defaultdict(lambda: [0, 0])         # (src, dst) -> [count, bytes]
        self.uploads = {"count": 0, "bytes": 0, "experts": 0}
        self.syncs = 0
        self.crossings = 0                                # device changes along the data flow
        self.forwards = 0
        self.tokens = 0
        self.cpu_expert_bytes = 0                         # weight bytes read by CPU expert kernels
        self.cpu_expert_seconds = 0.0
        self.gpu_share_bytes = 0                          # host expert bytes a GPU read over the bus (decode share)
        self.wall = [0.0, 0.0]                            # profiled forward seconds: [batches, single tokens]
        # the last Model.forward_batch: sequences, tokens, distinct_experts (mean over MoE layers of the experts
        # the batch routed to; None where the step that ran does not report its routing), distinct_per_layer
        self.last_batch = None

    @contextmanager
    def op(self, kind: str, device, sync=None):
        """Time an op when profiling (sync: a callable that waits for the device, so GPU time is real)."""
        if not self.profile:
            yield
            self.ops[(kind, device.name)][0] += 1
            return
        if sync:
            sync()
        t0 = time.perf_counter()
        yield
        if sync:
            sync()
            self.syncs += 1
        rec = self.ops[(kind, device.name)]
        rec[0] += 1
        rec[1] += time.perf_counter() - t0

    def copy(self, src: str, dst: str, nbytes: int, count: int = 1):
        rec = self.copies[(src, dst)]
        rec[0] += count
        rec[1] += nbytes * count
        self.crossings += count

    def upload(self, nbytes: int, experts: int):
        self.uploads["count"] += 1
        self.uploads["bytes"] += nbytes
        self.uploads["experts"] += experts

    def as_dict(self) -> dict:
        return {
            "ops": {f"{k}@{d}": {"calls": c, "seconds": s} for (k, d), (c, s) in sorted(self.ops.items())},
            "copies": {f"{s}->{d}": {"count": c, "bytes": b} for (s, d), (c, b) in sorted(self.copies.items())},
            "uploads": dict(self.uploads),
            "syncs": self.syncs,
            "crossings": self.crossings,
            "forwards": self.forwards,
            "tokens": self.tokens,
            "splits_per_forward": self.crossings / max(self.forwards, 1),
            "cpu_expert_bytes": self.cpu_expert_bytes,
            "cpu_expert_seconds": self.cpu_expert_seconds,
            "gpu_share_bytes": self.gpu_share_bytes,
        }

    def format(self, read_bw: float | None = None) -> str:
        lines = ["profile:", f"  {'op':<16} {'device':<7} {'calls':>8} {'time ms':>10}"]
        for (k, d), (c, s) in sorted(self.ops.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {k:<16} {d:<7} {c:>8} {s * 1e3:>10.2f}")
        for (s, d), (c, b) in sorted(self.copies.items()):
            lines.append(f"  copy {s}->{d}: {c} copies, {b / 1e6:.2f} MB")
        u = self.uploads
        lines.append(f"  uploads: {u['count']} copies, {u['bytes'] / 1e6:.2f} MB, {u['experts']} experts")
        lines.append(f"  syncs: {self.syncs}; device crossings per forward: {self.crossings / max(self.forwards, 1):.1f}")
        if self.profile and sum(self.wall) > 0:
            in_ops = sum(sec for _, sec in self.ops.values())
            other = max(sum(self.wall) - in_ops, 0.0)
            lines.append(f"  forward wall time {sum(self.wall) * 1e3:.1f} ms, in timed ops {in_ops * 1e3:.1f} ms; "
                         f"the rest (Python, small ops, copies) {other * 1e3:.1f} ms = "
                         f"{other / max(self.tokens, 1) * 1e3:.3f} ms per token")
        if self.cpu_expert_seconds > 0:
            bw = self.cpu_expert_bytes / self.cpu_expert_seconds
            msg = f"  CPU experts: {self.cpu_expert_bytes / 1e9:.2f} GB read at {bw / 1e9:.1f} GB/s"
            if read_bw:
                msg += f" = {bw / read_bw:.0%} of the measured read bandwidth ({read_bw / 1e9:.1f} GB/s)"
            lines.append(msg)
        return "\n".join(lines)
