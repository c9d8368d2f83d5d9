"""The static steps (see base.py): build_step picks the one for a model and cache."""
from __future__ import annotations

from .base import DecodeStep, NotApplicable, PromptStep


def build_step(model, kv, which: str) -> DecodeStep | PromptStep | None:
    """The static "decode" or "prompt" step for this model and cache, or None where none applies."""
    if which == "prompt":
        from .gpu_prefill import StaticPrefill as Step
    elif all(d.kind == "cpu" for d in kv.devs):
        from .cpu_decode import CpuDecoder as Step
    else:
        from .gpu_decode import StaticDecoder as Step
    try:
        return Step(model, kv)
    except NotApplicable:
        return None
