"""Issue 25's CUDA fault: a tiny Qwen3-MoE (vocab 512, hidden 256, 3 layers, 4 heads / 2 KV heads of 64, 16
experts of 128, top-4, every matrix Q4_0, router F32) with -ngl 99 -ot exps=CPU -op all,1: a 300-token logits()
call, then a new cache, a 24-token prompt and single-token decode steps. Prints the outcome of each placement.

    python benchmarks/fault_repro.py [OUT_DIR]"""
import dataclasses
import sys

import torch

import hybridmoe
from hybridmoe.formats.gguf_write import write_gguf
from hybridmoe.models.synth import config_metadata, preset_config, synth_tensors
from hybridmoe.quant.types import GGMLType
from hybridmoe.text.builtin_vocab import builtin_vocab_metadata

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
cfg, _, _ = preset_config("tiny")
cfg = dataclasses.replace(cfg, n_vocab=512, n_embd=256, n_layer=3, n_head=4, n_head_kv=2, head_dim=64,
                          n_expert=16, n_expert_used=4, n_ff_exp=128, name="fault-repro")
path = f"{out}/fault-repro.gguf"
md = {"general.name": cfg.name, "general.type": "model", **config_metadata(cfg), **builtin_vocab_metadata(512)}
write_gguf(path, cfg.arch, md, synth_tensors(cfg, GGMLType.Q4_0, GGMLType.Q4_0, seed=7))
g = torch.Generator().manual_seed(0)
ids = torch.randint(1, 512, (300,), generator=g).tolist()
for opts in (dict(n_gpu_layers=99, override_tensor=["exps=CPU"], offload_policy="all,1"),
             dict(n_gpu_layers=99, override_tensor=["exps=CPU"]),
             dict(n_gpu_layers=99, override_tensor=["exps=CPU"], offload_policy="all,1",
                  offload_only_active_experts="1")):
    print(opts, flush=True)
    m = hybridmoe.load(path, ctx_size=512, **opts)
    ref = hybridmoe.load(path, ctx_size=512)
    print("  loaded", flush=True)
    a = m.logits(ids)
    b = ref.logits(ids)
    torch.cuda.synchronize()
    print("  300-token logits done", flush=True)
    kv = m.new_cache(64)
    m.forward(torch.tensor(ids[:24]), 0, kv)
    torch.cuda.synchronize()
    print("  24-token prompt done", flush=True)
    for i in range(40):
        m.forward(torch.tensor([ids[24 + i]]), 24 + i, kv)
        torch.cuda.synchronize()
    print("  40 decode steps done", flush=True)
    print(opts, "ok; 300-token rel L2 vs CPU", float((a - b).norm() / b.norm()), flush=True)
