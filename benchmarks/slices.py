"""Small slices of the Qwen3-30B-A3B shape for CPU benchmarks that compare against llama.cpp on the same file
(contention.py, vs_llamacpp_cpu.py): written once, and the weight bytes a decode token reads from them."""
from __future__ import annotations

import dataclasses
import os
import sys


def slice_model(path: str, n_vocab: int, name: str, expert_type: str | None = None, n_layer: int = 4,
                preset: str = "qwen3-30b-a3b") -> str:
    """An n_layer-layer model of a synth preset's shape (Qwen3-30B-A3B's by default) with an n_vocab-token
    vocabulary at `path` (written once): experts of `expert_type` (the preset's by default), the rest as the
    preset."""
    if os.path.exists(path):
        return path
    from hybridmoe.formats.gguf_write import write_gguf
    from hybridmoe.models.synth import config_metadata, preset_config, synth_tensors
    from hybridmoe.quant.types import GGMLType
    from hybridmoe.text.builtin_vocab import builtin_vocab_metadata
    cfg, et, ot = preset_config(preset)
    cfg = dataclasses.replace(cfg, n_layer=n_layer, n_vocab=n_vocab, name=name)
    md = {"general.name": cfg.name, "general.type": "model", **config_metadata(cfg),
          **builtin_vocab_metadata(cfg.n_vocab)}
    tmp = path + ".part"
    print(f"writing {path} (once) ...", file=sys.stderr, flush=True)
    write_gguf(tmp, cfg.arch, md, synth_tensors(cfg, GGMLType[expert_type] if expert_type else et, ot, seed=1234))
    os.replace(tmp, path)
    return path


def qwen3_slice(expert_type: str = "Q4_0") -> str:
    """The 4-layer Qwen3-30B-A3B slice of the CPU comparisons (vocabulary 32000, experts `expert_type`, the rest
    Q8_0), in the hybridmoe cache, written once."""
    from hybridmoe.env import cache_dir
    d = cache_dir() / "models"
    d.mkdir(parents=True, exist_ok=True)
    name = f"qwen3-30b-a3b-4l-{expert_type.lower()}"
    return slice_model(str(d / f"{name}.gguf"), 32000, name, expert_type)


def bytes_per_token(path: str) -> int:
    """Weight bytes a decode step reads: every non-expert matrix, k/E of each expert tensor, one embedding row."""
    from hybridmoe.formats.gguf import open_gguf
    f = open_gguf(path)
    arch = f.metadata["general.architecture"]
    E, k = int(f.metadata.get(f"{arch}.expert_count", 0)), int(f.metadata.get(f"{arch}.expert_used_count", 0))
    total = 0
    for name, t in f.tensors.items():
        if name == "token_embd.weight":
            total += t.nbytes // t.shape[0]
        elif "_exps" in name and E:
            total += t.nbytes * k // E
        else:
            total += t.nbytes
    return total
