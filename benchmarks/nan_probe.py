"""Where a GPU forward first computes a non-finite value: every function of the GPU kernel modules (and the
routed-experts entry) is wrapped to synchronize and check its tensor outputs, and the dequantized weights the
steps multiply by are checked as they are made; then prompts run through Model.forward, with and without the
static steps. For a NonFiniteError seen on a GPU and not in Triton's interpreter.

    python3 benchmarks/nan_probe.py -m synth:tiny -ngl 99 --ctx 64 --prompts 5,12,1
"""
from __future__ import annotations

import argparse
import functools
import sys
import types

import torch

from hybridmoe.commands.common import add_model_args, add_runtime_args, runtime_kwargs


def _tensors(v):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (tuple, list)):
        for x in v:
            yield from _tensors(x)


def wrap_module(mod, seen: list):
    for name in dir(mod):
        fn = getattr(mod, name)
        # the module's functions and those it re-exports from other kernel modules (gd.attention)
        # (plain functions only: a Triton kernel or helper stays as it is, kernels reference them)
        if name.startswith("_") or not isinstance(fn, types.FunctionType) \
                or not fn.__module__.startswith(("hybridmoe.kernels", "hybridmoe.runtime")):
            continue

        def checked(*a, _fn=fn, _name=f"{mod.__name__.split('.')[-1]}.{name}", **kw):
            args = list(a) + list(kw.values())
            out = _fn(*a, **kw)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return out
            for i, t in enumerate(_tensors(out)):
                if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
                    ins = [(tuple(x.shape), str(x.dtype), bool(torch.isfinite(x).all()) if x.is_floating_point()
                            else None) for x in _tensors(args)]
                    bad = (~torch.isfinite(t)).nonzero()[:4].tolist()
                    seen.append(f"{_name} output {i} {tuple(t.shape)} {t.dtype}: non-finite at {bad}; "
                                f"inputs (shape, dtype, finite) {ins}")
            return out
        setattr(mod, name, functools.wraps(fn)(checked))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, model_default="synth:tiny")
    add_runtime_args(ap)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--prompts", default="5,12,1")
    args = ap.parse_args()
    import hybridmoe
    from hybridmoe.kernels import gpu_attention, gpu_decode, gpu_moe
    from hybridmoe.runtime import weights
    from hybridmoe.runtime import experts
    seen: list[str] = []
    for mod in (gpu_decode, gpu_attention, gpu_moe, experts):
        wrap_module(mod, seen)
    orig_cached = weights.QTensor.cached

    def cached(self, *a, **kw):
        w = orig_cached(self, *a, **kw)
        if isinstance(w, torch.Tensor) and w.is_floating_point() and not bool(torch.isfinite(w).all()):
            seen.append(f"dequantized weight {getattr(self, 'name', '?')} {self.qtype.name} {tuple(w.shape)} "
                        f"-> {w.dtype}: non-finite")
        return w
    weights.QTensor.cached = cached
    ids = [(i * 37 + 11) % 1000 + 3 for i in range(64)]
    lens = [int(x) for x in args.prompts.split(",")]
    kw = runtime_kwargs(args)
    kw.pop("graphs", None)
    bad = 0
    for graphs in (True, False):
        m = hybridmoe.load(args.model, **{**kw, "ctx_size": args.ctx, "graphs": graphs})
        at = 0
        for n in lens:
            kv = m.new_cache(args.ctx)
            seen.clear()
            try:
                out = m.forward(torch.tensor(ids[at:at + n]), 0, kv)
                res = f"finite {bool(torch.isfinite(out).all())}"
            except Exception as e:                 # noqa: BLE001 - the probe reports every failure
                res = f"{type(e).__name__}: {str(e)[:160]}"
            at += n
            step = (m._steps.get("prompt" if n > 1 else "decode") or (None, None))[1]
            print(f"graphs={graphs} prompt {n}: {res}; step {type(step).__name__ if step else 'eager'}")
            for s in seen[:6]:
                print("   ", s)
            bad += bool(seen)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
