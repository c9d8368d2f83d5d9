"""Which placements the captured decode step (runtime/steps/gpu_decode.py) can run: one rule, asked by the step
and by the planner's warnings (placement/core.py), in a module without torch so that `plan` stays light.

The step runs each layer as two parts: the attention part (attn norm .. attention output) on its attention's
GPU, and the FFN part (ffn_norm, router, experts or dense FFN) on the device of the FFN's large weights. Small
tensors (norms, router, expert bias) are copied once to their part's GPU; a large one (an expert or dense FFN
matrix, shared experts) is never copied, so its part runs where it is or the step does not apply."""
from __future__ import annotations

EXPS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
DENSE = ("ffn_gate", "ffn_up", "ffn_down")
SHEXP = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


def _is_gpu(dev: str) -> bool:
    return dev != "CPU"


def ffn_part_device(dev_of: dict[str, str], attn: str) -> tuple[str | None, str]:
    """(device of a layer's FFN part, "") or (None, why the captured step cannot run it). dev_of: the device
    names ("CUDA1", "CPU") of the layer's FFN tensors by short name (EXPS or DENSE, SHEXP if any); attn: its
    attention's device. Experts in host RAM are the CPU hand-off: the FFN norm and router then run on the
    attention's GPU, the experts on the CPU ("CPU" is returned). Shared experts must sit with the FFN part: they
    run with the experts where those are on a GPU, with the router (the attention's GPU) where the experts are
    in RAM."""
    moe = EXPS[0] in dev_of
    big = EXPS if moe else DENSE
    where = {dev_of[n] for n in big if n in dev_of}
    if len(where) != 1:
        parts = ", ".join(f"{n.split('_')[1]} on {dev_of[n]}" for n in big if n in dev_of)
        what = "experts" if moe else "dense FFN"
        return None, f"{what} split across devices ({parts}); the step would copy a large matrix every token"
    dev = next(iter(where))
    if not _is_gpu(dev):
        if not moe:
            return None, "dense FFN in host RAM (the step hands only experts to the CPU)"
        dev = "CPU"
    home = attn if dev == "CPU" else dev
    sh = {dev_of[n] for n in SHEXP if n in dev_of}
    if sh and sh != {home}:
        return None, f"shared experts on {'/'.join(sorted(sh))}, the FFN's router on {home}"
    return dev, ""
