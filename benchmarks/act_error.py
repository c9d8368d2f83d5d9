"""Per weight type, the two errors that set how many int8 terms the CPU integer path's activations take
(docs/cpu-kernels.md, "Activation terms per weight type"), on one MoE expert layer's output:

- the weight error: the type's own quantization, float64 on the quantized weights against float64 on the f32
  weights they were quantized from (Gaussian, by the type's own quantizer: llama.cpp's ggml_quantize_chunk for
  mainline types, ik_llama.cpp's quantize_<type> for its own; a uniform importance matrix);
- the activation error: the C kernel at T=1 (each token alone, as decode runs) against float64 on the same
  quantized weights, with the activations in one int8 term and in two (cpu.set_act_terms forces the count).

The rule's margin is the weight error over the one-term activation error (errors add in quadrature: at 10x
the result's error grows by 0.5%). Activations x ~ N(0, 1), and again with outlier channels (8 of H at 10x, as
hidden states after RMSNorm have), which coarsen one-term blocks.

    PYTHONPATH=src python benchmarks/act_error.py --ggml /path/to/libggml-base.so [--ik /path/to/libikq.so]
        [--types Q4_0,Q2_K,IQ2_K] [--tokens 32]

libggml-base.so: any llama.cpp build; libikq.so: ik_llama.cpp's quantizers alone (benchmarks/ik_quant_shim.c
says how to build it).

A library missing or without a type's quantizer: that type's weight error is left blank.
"""
from __future__ import annotations

import argparse
import ctypes

import torch

from hybridmoe.kernels import cpu
from hybridmoe.quant.dequant import dequantize
from hybridmoe.quant.types import GGMLType, block_size, row_bytes, row_header_bytes, type_size

E, K_USED, H, F = 8, 4, 2048, 768
TYPES = ("Q8_0,Q6_K,Q5_K,Q4_K,Q4_0,IQ4_NL,IQ4_XS,IQ4_KS,IQ4_K,IQ5_K,Q3_K,IQ3_K,IQ3_S,IQ3_XXS,IQ3_KT,IQ4_KT,Q2_K,"
         "IQ2_K,IQ2_KS,IQ2_KL,IQ2_XS,IQ2_XXS,IQ2_KT,IQ1_M,IQ1_S")
MAINLINE = {"Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0", "IQ4_NL", "IQ4_XS", "Q3_K", "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_XS",
            "IQ2_XXS", "IQ1_M", "IQ1_S"}


class Quantizers:
    """f32 rows -> a type's blocks by the reference implementations' own quantizers, loaded with ctypes."""

    def __init__(self, ggml: str | None, ik: str | None):
        self.ggml = ctypes.CDLL(ggml) if ggml else None
        self.ik = ctypes.CDLL(ik) if ik else None
        if self.ik and hasattr(self.ik, "ikq_set_type"):       # a quantize-only build: its ggml type sizes
            for q in GGMLType:
                self.ik.ikq_set_type(int(q), ctypes.c_int64(block_size(q)), ctypes.c_int64(type_size(q)),
                                     ctypes.c_int64(row_header_bytes(q)))
        if self.ggml:
            self.ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
            self.ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                      ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    def fn(self, q: GGMLType):
        if q.name in MAINLINE and self.ggml:
            return lambda src, dst, n, k, im: self.ggml.ggml_quantize_chunk(int(q), src, dst, 0, n, k, im)
        f = getattr(self.ik, f"quantize_{q.name.lower()}", None) if self.ik and q.name not in MAINLINE else None
        if f is None:
            return None
        f.restype = ctypes.c_size_t
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                      ctypes.c_void_p]
        return lambda src, dst, n, k, im: f(src, dst, n, k, im, None)

    def __call__(self, w: torch.Tensor, q: GGMLType) -> torch.Tensor | None:
        """w f32 [..., n_cols] -> uint8 [..., row_bytes(q, n_cols)], or None without a quantizer for q."""
        fn = self.fn(q)
        if fn is None:
            return None
        k = w.shape[-1]
        src = w.reshape(-1, k).contiguous()
        dst = torch.zeros(src.shape[0], row_bytes(q, k), dtype=torch.uint8)
        im = torch.ones(k)
        n = fn(src.data_ptr(), dst.data_ptr(), src.shape[0], k, im.data_ptr())
        if n != dst.numel():
            raise RuntimeError(f"{q.name}: the quantizer wrote {n} bytes, expected {dst.numel()}")
        return dst.view(*w.shape[:-1], -1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def layer_f64(x, ids, wts, g, u, d) -> torch.Tensor:
    """The expert layer in float64 on float weights g, u [E, F, H], d [E, H, F]."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(K_USED):
            e = int(ids[t, j])
            xe = x[t].double()
            h = torch.nn.functional.silu(g[e].double() @ xe) * (u[e].double() @ xe)
            out[t] += float(wts[t, j]) * (d[e].double() @ h)
    return out


def kernel_t1(x, ids, wts, raw, q, terms: int) -> torch.Tensor:
    """The C kernel one token at a time with `terms` activation terms forced."""
    prev = cpu.set_act_terms(terms)
    try:
        return torch.cat([cpu.moe_ffn(x[t:t + 1], ids[t:t + 1], wts[t:t + 1], *raw, q, q, impl="kernel")
                          for t in range(x.shape[0])])
    finally:
        cpu.set_act_terms(prev)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--ggml", help="llama.cpp's libggml-base.so (mainline types' quantizers)")
    ap.add_argument("--ik", help="a library with ik_llama.cpp's quantize_<type> functions (its types): "
                                 "iqk_quantize.cpp and ggml-quants.c linked with benchmarks/ik_quant_shim.c")
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args(argv)
    if not cpu.available():
        ap.error("the C kernels did not build (see the warning above)")
    quant = Quantizers(a.ggml, a.ik)
    gen = torch.Generator().manual_seed(0)
    T = a.tokens
    x = torch.randn(T, H, generator=gen)
    xo = x.clone()
    xo[:, torch.randperm(H, generator=gen)[:8]] *= 10                         # outlier channels
    ids = torch.stack([torch.randperm(E, generator=gen)[:K_USED] for _ in range(T)]).to(torch.int32)
    wts = torch.softmax(torch.randn(T, K_USED, generator=gen), -1)
    wf = (torch.randn(E, F, H, generator=gen), torch.randn(E, F, H, generator=gen), torch.randn(E, H, F, generator=gen))
    ref_f = {n: layer_f64(v, ids, wts, *wf) for n, v in (("x", x), ("xo", xo))}
    print(f"kernel: {cpu.simd()}; layer: {E} experts of {H} x {F}, {K_USED} a token, {T} tokens one at a time")
    head = ["type", "bits/weight", "weight error", "1 term", "2 terms", "weight / 1 term",
            "1 term, outliers", "weight / 1 term, outliers"]
    rows = []
    for name in a.types.split(","):
        q = GGMLType[name.strip()]
        raw = [quant(w, q) for w in wf]
        if raw[0] is None:
            from hybridmoe.quant.random_blocks import random_blocks      # valid blocks: activation errors only
            raw = [random_blocks(q, w.shape[0] * w.shape[1], w.shape[2], gen).view(*w.shape[:2], -1) for w in wf]
            werr = None
        deq = [dequantize(r.reshape(-1, r.shape[-1]), q, w.shape[-1], torch.float64).view(w.shape)
               for r, w in zip(raw, wf)]
        cells = [q.name, f"{8 * row_bytes(q, 256) / 256:.3f}"]
        res = {}
        for n, v in (("x", x), ("xo", xo)):
            ref_q = layer_f64(v, ids, wts, *deq)
            werr = rel(ref_q, ref_f[n]) if quant.fn(q) else None
            res[n] = (werr, rel(kernel_t1(v, ids, wts, raw, q, 1), ref_q), rel(kernel_t1(v, ids, wts, raw, q, 2), ref_q))
        (w0, a1, a2), (w1, o1, _) = res["x"], res["xo"]
        fmt = lambda v: "" if v is None else f"{v:.2e}"                     # noqa: E731
        cells += [fmt(w0), fmt(a1), fmt(a2), "" if w0 is None else f"{w0 / a1:.0f}", fmt(o1),
                  "" if w1 is None else f"{w1 / o1:.0f}"]
        rows.append(cells)
        print("  " + " ".join(cells), flush=True)
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for c in rows:
        print("| " + " | ".join(c) + " |")


if __name__ == "__main__":
    main()
