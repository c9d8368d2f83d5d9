"""The static steps (see base.py): build_step picks the one for a model and cache."""
from __future__ import annotations

from .base import DecodeStep, NonFinite, NotApplicable, PromptStep, all_finite


def build_step(model, kv, which: str) -> DecodeStep | PromptStep | None:
    """The static "decode" or "prompt" step for this model and cache, or None where none applies. With the cache
    and every weight on the CPU, one kind of step serves both (cpu_decode.CpuDecoder: hm_decode_step and
    hm_prompt_step), so that prompts and decode steps compute every token alike; for prompts only where no GPU
    may take their ops: as in llama.cpp, `-ngl 0` with a GPU uploads a large batch's host weights to it (op
    offload, the scheduler's decision per op), which the C step would skip."""
    steps = []
    if all(d.kind == "cpu" for d in kv.devs) and (which != "prompt" or not may_offload(model)):
        from .cpu_decode import CpuDecoder
        steps.append(CpuDecoder)
    if which == "prompt":
        from .gpu_prefill import StaticPrefill
        steps.append(StaticPrefill)
    elif not steps and model.cfg.arch == "gpt-oss":
        from .gpu_decode_oai import GptOssStaticDecoder
        steps.append(GptOssStaticDecoder)
    elif not steps:
        from .gpu_decode import StaticDecoder
        steps.append(StaticDecoder)
    for Step in steps:
        try:
            return Step(model, kv)
        except NotApplicable:
            pass
    return None


def may_offload(model) -> bool:
    """Whether the scheduler may run a host weight's op on a GPU (a GPU is present and -op / --no-op-offload
    leave some op to it)."""
    sched = model.sched
    return sched.main_gpu is not None and any(v is not False for v in sched.policy.values())
