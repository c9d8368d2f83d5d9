"""`-m builtin`: the small trained qwen3moe shipped inside the package (models/builtin.gguf).

It is trained by benchmarks/builtin/ (make_corpus.py here, train.py on a GPU machine; see the README there) on
permissively licensed documentation, so its text reads as English, unlike the random weights of `synth:*`.
When `-m` is not given, commands load it; a checkout without the file falls back to synth:tiny.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import HybridMoeError

NAME = "builtin"
BUILTIN_PATH = Path(__file__).resolve().parent / "builtin.gguf"
FALLBACK = "synth:tiny"


def builtin_path() -> str:
    """The packaged GGUF's path; a clear error when this installation has none."""
    if not BUILTIN_PATH.is_file():
        raise HybridMoeError(
            f"the built-in model is not in this installation ({BUILTIN_PATH} is missing): "
            "it is trained by benchmarks/builtin/run_gpu.sh and shipped as src/hybridmoe/models/builtin.gguf; "
            f"use -m {FALLBACK} (random weights) or -m FILE.gguf meanwhile")
    return str(BUILTIN_PATH)


def default_model() -> str:
    """What `-m` means when it is left out: the built-in model, or synth:tiny where it is absent."""
    return NAME if BUILTIN_PATH.is_file() else FALLBACK
