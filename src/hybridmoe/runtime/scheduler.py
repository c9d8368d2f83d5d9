"""Where each op runs: with its weights, or on a GPU after uploading host weights when that pays.

Activations carry their logical device as a tag (`hm_dev`), so fake GPUs (CPU-backed, for tests) count
crossings exactly like real ones. Every crossing, upload and sync is recorded in `Stats`.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import HybridMoeError
from ..perf.roofline import OFFLOAD_MIN_BATCH
from ..quant.types import interleave
from . import experts as X
from .ops import rms_norm
from .stats import Stats
from .upload import Uploader
from .weights import QTensor

OP_KINDS = ("mul_mat", "mul_mat_id", "moe_up_gate")
EMBED_ON_GPU_MIN = 16      # tokens from which a host table's rows for a GPU are dequantized there (embed)
OP_ALIASES = {"26": "mul_mat", "27": "mul_mat_id", "29": "moe_up_gate", "-1": "all", "all": "all",
              **{k: k for k in OP_KINDS}}


def parse_offload_policy(spec: str | None) -> dict[str, bool | None]:
    """`-op a,b[,a,b...]`: a is an op name or ik_llama.cpp's ggml op number (26, 27, 29, -1 = all); b is 0/1.

    Ops not named stay None, meaning `auto`.
    """
    policy: dict[str, bool | None] = {k: None for k in OP_KINDS}
    if not spec or spec == "auto":
        return policy
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) % 2:
        raise HybridMoeError(f"-op {spec!r}: expected pairs OP,0|1 (e.g. -op mul_mat_id,0 or -op 27,0,29,1)")
    for op, flag in zip(parts[::2], parts[1::2]):
        kind = OP_ALIASES.get(op.lower())
        if kind is None:
            raise HybridMoeError(f"-op: unknown op {op!r}; use one of {', '.join(OP_KINDS)}, all, "
                                 "or ik_llama.cpp's numbers 26, 27, 29, -1")
        if flag not in ("0", "1"):
            raise HybridMoeError(f"-op: {op},{flag}: the second number must be 0 or 1")
        for k in (OP_KINDS if kind == "all" else (kind,)):
            policy[k] = flag == "1"
    return policy


class Scheduler:
    def __init__(self, devices: dict, cpu, main_gpu=None, offload_policy: str | None = None,
                 only_active: str | bool = "auto", fused_moe: bool = True, n_threads: int | None = None,
                 profile: bool = False, rates=None):
        self.devices = devices
        self.cpu = cpu
        self.main_gpu = main_gpu                  # Device or None
        self.policy = parse_offload_policy(offload_policy)
        self.only_active = only_active
        self.fused_moe = fused_moe
        self.n_threads = n_threads
        self.stats = Stats(profile)
        self.rates = rates                        # calibrated rates (perf/calibrate.py) or None
        self._small = {}                          # (tensor name, device) -> dequantized small tensor
        self._uploaders = {}                      # GPU name -> Uploader
        self._recent = {}                         # (id(src), device) -> (src, copy): the last few copies
        self.expert_layers = {}
        self.routing = None                       # layer -> ids [T, k] of this forward, where a caller asks for them

    # -- devices -------------------------------------------------------------------------------------
    def dev_of(self, t: torch.Tensor):
        d = getattr(t, "hm_dev", None)
        if d is not None:
            return d
        if t.device.type == "cpu":
            return self.cpu
        for dev in self.devices.values():
            if not dev.fake and dev.torch_device == t.device:
                return dev
        raise HybridMoeError(f"tensor on unknown device {t.device}")

    @staticmethod
    def tag(t: torch.Tensor, dev) -> torch.Tensor:
        t.hm_dev = dev
        return t

    def move(self, t: torch.Tensor, dev) -> torch.Tensor:
        src = self.dev_of(t)
        if src.name == dev.name:
            return self.tag(t, dev)
        key = (id(t), dev.name)
        hit = self._recent.get(key)
        if hit is not None and hit[0] is t:
            return hit[1]                          # already copied there (the residual and its norm's input)
        self.stats.copy(src.name, dev.name, t.numel() * t.element_size())
        if t.device != dev.torch_device:
            t2 = t.to(dev.torch_device, non_blocking=dev.kind == "cuda")
        else:
            t2 = t.clone()                         # fake GPU: a real copy, as a device crossing would be
        self._recent[key] = (t, self.tag(t2, dev))
        while len(self._recent) > 4:
            self._recent.pop(next(iter(self._recent)))
        return t2

    def _sync(self, dev):
        if dev.kind == "cuda" and not dev.fake:
            return lambda: torch.cuda.synchronize(dev.torch_device)
        return None

    def small(self, w: QTensor, dev) -> torch.Tensor:
        """Norm weights and the like, dequantized once per device."""
        key = (w.name, dev.name)
        t = self._small.get(key)
        if t is None:
            t = self._small[key] = w.dequant(torch.float32).to(dev.torch_device)
        return t

    # -- ops -----------------------------------------------------------------------------------------
    def embed(self, w: QTensor, tokens: torch.Tensor, to=None) -> torch.Tensor:
        """Token embeddings [T, H] float32, on `to` (the first layer's device) where given. A prompt's rows for a
        GPU from a host table go in their file bytes, gathered on one thread, and are dequantized there: on the
        CPU they took a few multi-threaded torch ops while the GPU waited (~4 ms for 512 rows of gpt-oss's
        table, 15-37 ms when the OpenMP workers were slow to come)."""
        self.stats.forwards += 1
        self.stats.tokens += tokens.shape[0]
        if to is not None and to.kind == "cuda" and w.device.kind == "cpu" and tokens.shape[0] >= EMBED_ON_GPU_MIN \
                and tokens.device.type == "cpu" and not w.split and interleave(w.qtype) == 1 and w.raw.dim() == 2:
            ids = tokens.numpy()
            if 0 <= ids.min() and ids.max() < w.raw.shape[0]:
                rows = self.move(self.tag(torch.from_numpy(np.take(w.raw.numpy(), ids, axis=0)), w.device), to)
                with self.stats.op("get_rows", to):
                    x = QTensor(w.name, rows, w.qtype, (rows.shape[0], w.shape[-1]), to).dequant(torch.float32) \
                        .contiguous()
                return self.tag(x, to)
        with self.stats.op("get_rows", w.device):
            rows = w.dequant(torch.float32, index=tokens.to(w.raw.device))
        rows = self.tag(rows, w.device)
        return rows if to is None else self.move(rows, to)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Residual add: on a GPU when either side is on one (the next layer's attention is there too, as
        ggml's scheduler pulls weightless ops to GPU backends), else where the newer result is."""
        xd, yd = self.dev_of(x), self.dev_of(y)
        dev = xd if (yd.kind == "cpu" and xd.kind == "cuda") else yd
        return self.tag(self.move(x, dev) + self.move(y, dev), dev)

    def norm(self, x: torch.Tensor, w: QTensor, eps: float) -> torch.Tensor:
        """RMSNorm runs with its weight (as ggml assigns an op to its weight's backend)."""
        dev = w.device
        return self.tag(rms_norm(self.move(x, dev), self.small(w, dev), eps), dev)

    def _offload_target(self, x_dev):
        if x_dev.kind == "cuda":
            return x_dev
        return self.main_gpu

    def wants_offload(self, kind: str, w_dev, n_tokens: int, n_expert: int = 1, n_used: int = 1,
                      nbytes: int = 0, n_params: int | None = None, n_active: int | None = None,
                      prefetched: bool = False) -> bool:
        """Run a host-weight op on a GPU? Forced by -op, else the calibrated cost model, else ik's rule."""
        if w_dev.kind != "cpu" or self.main_gpu is None:
            return False
        forced = self.policy.get(kind)
        if forced is False:
            return False
        if n_tokens < OFFLOAD_MIN_BATCH:
            # as in llama.cpp and ik_llama.cpp, an op needs a batch: token generation never uploads. The
            # cost model alone sent -ngl 0's decode matmuls to the GPU once CPU streaming was estimated
            # below PCIe (0.5 x a 79 GB/s probe): 1.4 GB of pageable uploads a token, 3.7 t/s
            return False
        if forced is True:
            return True
        if self.rates is not None:
            return self.rates.offload_pays(kind, n_tokens, nbytes, n_expert, n_used, n_params=n_params,
                                           n_active=n_active, prefetched=prefetched)
        return n_tokens >= 32 * n_expert // max(n_used, 1)

    def linear(self, x: torch.Tensor, w: QTensor, bias: QTensor | None = None, f32: bool = True) -> torch.Tensor:
        """x @ W^T (+ bias, added where the matmul ran: ggml's add follows its input there). f32=False: a
        GPU's bf16 result is not cast to float32 (its consumer reads bf16)."""
        x_dev = self.dev_of(x)
        T = x.numel() // x.shape[-1]
        run = w.device
        if self.wants_offload("mul_mat", w.device, T, nbytes=w.nbytes, n_params=math.prod(w.shape)):
            run = self._offload_target(x_dev)
        x = self.move(x, run)
        with self.stats.op("mul_mat", run, self._sync(run)):
            if run.name != w.device.name:
                raw = self.upload(w.raw, run)
                y = X.linear_raw(x, raw, w, run, self.n_threads)
            else:
                y = X.linear_raw(x, w.raw, w, run, self.n_threads, f32=f32)
            if bias is not None:
                y = y + self.small(bias, run)
        return self.tag(y, run)

    def upload(self, raw: torch.Tensor, dev) -> torch.Tensor:
        """A dense weight to `dev` for one op (mul_mat offload)."""
        self.stats.upload(raw.numel(), 0)
        if raw.device == dev.torch_device:
            return raw.clone()                     # fake GPU: copy anyway, so the arithmetic is the same path
        return raw.to(dev.torch_device, non_blocking=True)

    def dense_ffn(self, x, gate: QTensor, up: QTensor, down: QTensor) -> torch.Tensor:
        g = self.linear(x, gate)
        u = self.linear(x, up)
        u = self.move(u, self.dev_of(g))
        h = self.tag(F.silu(g) * u, self.dev_of(g))
        return self.linear(h, down)

    def begin_forward(self, n_tokens: int):
        """Start uploading the first MoE layer's host experts now if this batch will offload them, so the
        copy overlaps the first attention block."""
        if not self.expert_layers or self.main_gpu is None or self.only_active is True:
            return
        first = min(self.expert_layers)
        ws = self.expert_layers[first]
        E, k = ws[0].shape[0], self.n_expert_used
        nbytes, n_params = sum(w.nbytes for w in ws), 3 * math.prod(ws[0].shape)
        dev = ws[0].device
        if all(w.device.kind == "cpu" for w in ws) \
                and self.wants_offload("moe_up_gate", dev, n_tokens, E, k, nbytes, n_params) \
                and self.wants_offload("mul_mat_id", dev, n_tokens, E, k, nbytes, n_params):
            self.uploader(self.main_gpu).prefetch_all(first, ws)

    def set_expert_layers(self, layers: dict, n_expert_used: int = 1):
        """layer -> (gate, up, down) QTensors, so uploads can run one layer ahead."""
        self.expert_layers = layers
        self.n_expert_used = n_expert_used

    def forget_uploads(self):
        """Drop the experts the upload slots hold: the next batch uploads them again (a policy change; timings
        that must not find a small model's layers still on the GPU from the run before)."""
        for u in self._uploaders.values():
            u.forget()

    def uploader(self, dev) -> Uploader:
        u = self._uploaders.get(dev.name)
        if u is None:
            u = self._uploaders[dev.name] = Uploader(dev, self.stats)
        return u

    def _route_to(self, x, ids, wts, dev):
        """Hidden state and the router's choice to `dev` in one copy (one crossing, one sync)."""
        ids, wts = ids.to(x.device), wts.to(x.device)      # the router may have run elsewhere (offloaded)
        if self.dev_of(x).name == dev.name:
            return x, ids, wts
        k = ids.shape[1]
        packed = self.tag(torch.cat((x.float(), wts.float(), ids.float()), dim=1), self.dev_of(x))
        packed = self.move(packed, dev)
        H = x.shape[1]
        x = self.tag(packed[:, :H], dev)
        return x, packed[:, H + k:].long(), packed[:, H:H + k]

    def moe(self, x, ids, wts, gate: QTensor, up: QTensor, down: QTensor, layer: int) -> torch.Tensor:
        """Routed experts. ids/wts [T, k]. Returns [T, H] on the device the experts ran on."""
        if self.routing is not None:
            self.routing[layer] = ids
        if not (self.fused_moe and gate.device.name == up.device.name == down.device.name):
            return self._moe_unfused(x, ids, wts, gate, up, down)
        dev = gate.device
        run, counts = self._moe_target(x, ids, (gate, up, down), layer)
        if run.name != dev.name:
            return self._moe_uploaded(x, ids, wts, (gate, up, down), run, layer, counts, lambda x, ids, wts, bufs, _:
                                      X.moe(x, ids, wts, *bufs, gate, up, down, self.n_threads))
        x, ids, wts = self._route_to(x, ids, wts, dev)
        with self.stats.op("moe_up_gate", dev, self._sync(dev)):
            y = X.moe(x, ids, wts, gate.raw, up.raw, down.raw, gate, up, down, self.n_threads, self.stats)
        return self.tag(y, dev)

    def _moe_target(self, x, ids, ws: tuple, layer: int, only_active: bool = True):
        """(the device a layer's experts run on, the batch's expert counts where they were taken): where they
        live, or the offload GPU when this batch pays for their upload. With the policy on auto, host experts
        decide on the batch's routing: the experts it touches (the one sync an upload needs anyway; priced as
        the upload's bytes only where only the active experts may go) and whether the layer's upload is
        already under way."""
        gate = ws[0]
        T, E, k, dev = x.shape[0], gate.shape[0], ids.shape[1], gate.device
        nbytes = sum(w.nbytes for w in ws)
        n_params = 3 * math.prod(gate.shape)
        counts, n_active, prefetched = None, None, False
        if dev.kind == "cpu" and self.main_gpu is not None and self.rates is not None and T >= OFFLOAD_MIN_BATCH and \
                self.policy["moe_up_gate"] is None and self.policy["mul_mat_id"] is None:
            counts = torch.bincount(ids.flatten(), minlength=E).cpu()
            n_active = int(torch.count_nonzero(counts)) if only_active else None
            prefetched = self.uploader(self._offload_target(self.dev_of(x))).has_all(layer)
        if self.wants_offload("moe_up_gate", dev, T, E, k, nbytes, n_params, n_active, prefetched) and \
                self.wants_offload("mul_mat_id", dev, T, E, k, nbytes, n_params, n_active, prefetched):
            return self._offload_target(self.dev_of(x)), counts
        return dev, counts

    def _use_only_active(self, n_active: int, E: int) -> bool:
        if self.only_active == "auto":
            # only-active uploads can't run a layer ahead (they wait for the router), so they pay only
            # when they save much of the bytes
            return n_active <= E // 2
        return bool(self.only_active)

    def _moe_uploaded(self, x, ids, wts, ws: tuple, run, layer: int, counts, compute, only_active: bool = True):
        """Upload host experts (all, or only those the router picked where only_active allows it) and compute on
        GPU `run`: compute(x, ids, wts, uploaded (gate, up, down), active), active the experts the uploaded
        tensors hold in order (ids renumbered into them), or None for all of them."""
        E = ws[0].shape[0]
        x, ids, wts = self._route_to(x, ids, wts, run)
        up_ = self.uploader(run)
        if counts is None:
            counts = torch.bincount(ids.flatten(), minlength=E).cpu()
        active = torch.nonzero(counts).flatten().tolist()
        few = only_active and self._use_only_active(len(active), E)
        if few and not up_.has_all(layer):
            bufs = up_.get_active(layer, ws, active)
            remap = torch.full((E,), -1, dtype=torch.long)
            remap[active] = torch.arange(len(active))
            ids = remap.to(ids.device)[ids]
        else:
            bufs, active = up_.get_all(layer, ws), None
        nxt = self.expert_layers.get(layer + 1)
        if not few and nxt is not None and all(w.device.kind == "cpu" for w in nxt):
            # this batch's routing is spread: expect the next layer's too, and upload it all a layer
            # ahead; when it is concentrated, the next layer waits for its router and sends only its experts
            up_.prefetch_all(layer + 1, nxt)
        with self.stats.op("moe_up_gate", run, self._sync(run)):
            y = compute(x, ids, wts, bufs, active)
        up_.release(bufs)
        return self.tag(y, run)

    def _moe_unfused(self, x, ids, wts, gate, up, down):
        """Gate, up and down not on one device (or -fmoe 0): each matmul runs with its weights, and the
        SiLU product runs where down lives, so a split pair costs one extra crossing (the half that is
        away from down sends its [T, k, F] result there)."""
        outs = {}
        for name, w in (("gate", gate), ("up", up)):
            xd = self.move(x, w.device)
            with self.stats.op("mul_mat_id", w.device, self._sync(w.device)):
                outs[name] = self.tag(X.expert_matmul(xd, ids.to(w.device.torch_device), w, self.n_threads),
                                      w.device)                       # [T, k, F]
        dd = down.device
        g, u = self.move(outs["gate"], dd), self.move(outs["up"], dd)
        h = self.tag(F.silu(g) * u, dd)
        with self.stats.op("mul_mat_id", dd, self._sync(dd)):
            y = X.expert_matmul(h, ids.to(dd.torch_device), down, self.n_threads)   # [T, k, H]
            y = (y * wts.to(y.device)[..., None]).sum(1)
        return self.tag(y, dd)

    def moe_biased(self, x, ids, wts, ws: tuple, bs: tuple, alpha: float, limit: float, layer: int) -> torch.Tensor:
        """gpt-oss's routed experts: biased gate/up/down and the clamped SwiGLU ("swiglu_oai"), where the
        experts live or on the offload GPU when a batch pays for the upload (moe's decision, and whole layers
        uploaded a layer ahead; not only the active experts, whose biases would need the same renumbering),
        computed by experts.moe_biased. Gate, up and down on different devices: each matmul with its weights."""
        gate, up, down = ws
        if self.routing is not None:
            self.routing[layer] = ids
        if not (self.fused_moe and gate.device.name == up.device.name == down.device.name):
            return self._moe_biased_unfused(x, ids, wts, ws, bs, alpha, limit)
        dev = gate.device
        run, counts = self._moe_target(x, ids, ws, layer, only_active=False)

        def compute(x, ids, wts, raws, _):
            biases = [self.small(b, run) for b in bs]
            return X.moe_biased(x, ids, wts, raws, ws, biases, alpha, limit,
                                stats=self.stats if run.kind == "cpu" else None, n_threads=self.n_threads)
        if run.name != dev.name:
            return self._moe_uploaded(x, ids, wts, ws, run, layer, counts, compute, only_active=False)
        x, ids, wts = self._route_to(x, ids, wts, dev)
        with self.stats.op("moe_up_gate", dev, self._sync(dev)):
            y = compute(x, ids, wts, (gate.raw, up.raw, down.raw), None)
        return self.tag(y, dev)

    def _moe_biased_unfused(self, x, ids, wts, ws, bs, alpha, limit):
        """As _moe_unfused: gate and up run with their weights, the activation and down where down lives."""
        outs = []
        for w, b in zip(ws[:2], bs[:2]):
            xd = self.move(x, w.device)
            with self.stats.op("mul_mat_id", w.device, self._sync(w.device)):
                y = X.expert_matmul_dequant(xd, ids.to(w.device.torch_device), w)                # [T, k, F]
                y = y + self.small(b, w.device)[ids.to(w.device.torch_device)]
            outs.append(self.tag(y, w.device))
        dd = ws[2].device
        g, u = self.move(outs[0], dd), self.move(outs[1], dd)
        h = self.tag(X.swiglu_oai(g, u, alpha, limit), dd)
        ids_d = ids.to(dd.torch_device)
        with self.stats.op("mul_mat_id", dd, self._sync(dd)):
            y = X.expert_matmul_dequant(h, ids_d, ws[2]) + self.small(bs[2], dd)[ids_d]       # [T, k, H]
            y = (y * wts.to(y.device)[..., None]).sum(1)
        return self.tag(y, dd)
