"""llama.cpp's error and hybridmoe's on the same long prompts, against transformers in float32 (issue 25, point 3).

The model is tests/test_prompt_precision.py's: a tiny random Qwen3-MoE in transformers (vocabulary 512, hidden
256, 2 layers, 4 heads / 2 KV heads of 64, 8 experts of 256 with top-2, seed 0, norms perturbed), converted to
a GGUF of each type; the reference is transformers in float32 on the GGUF's weights dequantized by the gguf
package (tests/hf_oracle.py). The same token ids (the test's) go through llama.cpp (llama-cpp-python's bindings
over a libllama built from source, every position's logits, one call a prompt) and through hybridmoe all on the
CPU (Model.logits), each with an f32 and an f16 KV cache. Per prompt: whole-matrix relative L2, the per-row
median and 99th percentile, and top-1 agreement.

    LLAMA_CPP_LIB_PATH=/path/to/libllama-dir PYTHONPATH=src:/path/to/llama-cpp-python \\
        python benchmarks/llamacpp_precision.py [--types F32,Q8_0] [--lengths 300,1000] [-t 2]

Without the bindings it prints hybridmoe's rows only. A one-time reference outside CI (docs/cpu-kernels.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))          # hf_oracle: the transformers oracle


def metrics(ours, ref) -> dict:
    import torch
    ours, ref = ours.double(), ref.double()
    err = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
    med, p99 = torch.quantile(err, torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
    return {"whole": float((ours - ref).norm() / ref.norm()), "median": med, "p99": p99,
            "top1": float((ours.argmax(-1) == ref.argmax(-1)).double().mean())}


def llamacpp_logits(path: str, ids: list[int], cache: str, threads: int):
    """Every position's logits of one prompt by llama.cpp (n_batch = n_ubatch = 512, as its defaults)."""
    import llama_cpp
    import numpy as np
    import torch
    kv_type = {"f32": 0, "f16": 1}[cache]                # GGML_TYPE_F32, GGML_TYPE_F16
    llm = llama_cpp.Llama(path, n_ctx=1024, n_batch=512, n_ubatch=512, logits_all=True, n_threads=threads,
                          n_threads_batch=threads, type_k=kv_type, type_v=kv_type, verbose=False)
    llm.eval(ids)
    out = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    llm.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default="F32", help="GGUF types (default F32)")
    p.add_argument("--lengths", default="300,1000")
    p.add_argument("--caches", default="f32,f16")
    p.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 2)
    a = p.parse_args(argv)
    import torch
    import transformers as tf
    from hf_oracle import hf_logits, load_dequantized_into_hf

    import hybridmoe
    from hybridmoe.models.convert import convert_hf
    from hybridmoe.quant.types import GGMLType
    try:
        import llama_cpp  # noqa: F401
        have_lcpp = True
    except ImportError as e:
        print(f"llama.cpp bindings not importable ({e}): hybridmoe only", file=sys.stderr)
        have_lcpp = False
    torch.set_num_threads(a.threads)
    lengths = [int(x) for x in a.lengths.split(",")]
    ids = torch.randint(0, 512, (max(lengths),), generator=torch.Generator().manual_seed(1)).tolist()
    work = tempfile.mkdtemp(prefix="lcpp-precision-")
    from hf_oracle import make_long_prompt_moe
    d = make_long_prompt_moe(os.path.join(work, "hf"))
    print(f"model: tests/test_prompt_precision.py's Qwen3-MoE; {a.threads} threads; hybridmoe {hybridmoe.__file__}")
    print("\n| type | KV cache | tokens | engine | whole rel L2 | per-row median | per-row 99th | top-1 |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for tname in a.types.split(","):
        q = GGMLType[tname]
        path = os.path.join(work, f"m-{tname}.gguf")
        convert_hf(d, path, expert_type=q, other_type=q)
        ref_model = load_dequantized_into_hf(tf.Qwen3MoeForCausalLM.from_pretrained(d), path)
        refs = {n: hf_logits(ref_model, ids[:n]) for n in lengths}
        for cache in a.caches.split(","):
            m = hybridmoe.load(path, ctx_size=1024, cache_type_k=cache, cache_type_v=cache, n_gpu_layers=0,
                               threads=a.threads)
            for n in lengths:
                rows = [("hybridmoe", m.logits(ids[:n]))]
                if have_lcpp:
                    t0 = time.perf_counter()
                    rows.append(("llama.cpp", llamacpp_logits(path, ids[:n], cache, a.threads)))
                    print(f"  (llama.cpp {n} tokens: {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
                for engine, got in rows:
                    r = metrics(got, refs[n])
                    print(f"| {tname} | {cache} | {n} | {engine} | {r['whole']:.2e} | {r['median']:.2e} | "
                          f"{r['p99']:.2e} | {r['top1']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
