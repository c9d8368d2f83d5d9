"""Per-tensor type mixes: the recipes of the quantized files users run, as ordered (regex, type) rules.

A mix is written the way ik_llama.cpp's `llama-quantize --custom-q` recipes are (and `-ot` rules are): the
first rule whose regex `re.search`es a tensor's canonical name gives its type. Norms, 1-D tensors, biases and
the router (ffn_gate_inp) stay F32 in every mix, as llama.cpp's quantize keeps them.

The mixes approximate published files; their rules are not copied from those files' tensor lists. The
DeepSeek-R1 mixes' sizes are checked against the published files' in tests/test_mixes.py; q3_k_xl follows the
issue's recipe (down Q4_K everywhere), 15.1 GB for Qwen3-30B-A3B, larger than unsloth's file (about 13.8 GB,
which keeps more of ffn_down in Q3_K):
- iq4_ks:    experts IQ4_KS, everything else Q8_0 (ubergarm's ik_llama.cpp Qwen3 recipes keep attention,
             token_embd and output in Q8_0, so the GPU side stays on fast kernels).
- iq4_xs:    experts IQ4_XS, everything else Q8_0 (the same split with mainline's 4.25-bit type).
- iq2_kt:    experts IQ2_KT (the trellis type), everything else Q8_0.
- q3_k_xl:   like unsloth's UD-Q3_K_XL: experts gate/up Q3_K, down Q4_K; layer 0's experts one step higher
             (Q4_K / Q5_K); attn_k / attn_v Q8_0, attn_q / attn_output Q6_K; token_embd Q4_K, output Q6_K.
- ud-q2_k_xl: like unsloth's DeepSeek-R1 UD-Q2_K_XL: experts gate/up Q2_K, down Q3_K, down Q4_K on the first
             three MoE layers (3-5); dense FFN and shared experts Q4_K (down Q6_K); attention Q4_K
             (attn_kv_b Q6_K); token_embd Q4_K, output Q6_K.
- iq4_ks_r4: like ubergarm's DeepSeek-R1-0528 IQ4_KS_R4: experts gate/up IQ4_KS_R4, down IQ5_KS_R4; the
             rest Q8_0.
"""
from __future__ import annotations

import re

from ..errors import HybridMoeError
from ..quant.types import GGMLType

T = GGMLType
_EXPS_GU = r"ffn_(gate|up)_exps\."
_EXPS_D = r"ffn_down_exps\."

MIXES: dict[str, tuple[tuple[str, GGMLType], ...]] = {
    "iq4_ks": ((r"_exps\.", T.IQ4_KS), (r".", T.Q8_0)),
    "iq4_xs": ((r"_exps\.", T.IQ4_XS), (r".", T.Q8_0)),
    "iq2_kt": ((r"_exps\.", T.IQ2_KT), (r".", T.Q8_0)),
    "q3_k_xl": (
        (r"^blk\.0\." + _EXPS_GU, T.Q4_K), (r"^blk\.0\." + _EXPS_D, T.Q5_K),
        (_EXPS_GU, T.Q3_K), (_EXPS_D, T.Q4_K),
        (r"attn_(k|v)\.", T.Q8_0), (r"attn_(q|output)\.", T.Q6_K),
        (r"^token_embd\.", T.Q4_K), (r"^output\.", T.Q6_K), (r".", T.Q8_0)),
    "ud-q2_k_xl": (
        (r"^blk\.[3-5]\." + _EXPS_D, T.Q4_K), (_EXPS_GU, T.Q2_K), (_EXPS_D, T.Q3_K),
        (r"ffn_down(_shexp)?\.", T.Q6_K), (r"ffn_(gate|up)(_shexp)?\.", T.Q4_K),
        (r"attn_kv_b\.", T.Q6_K), (r"attn_", T.Q4_K),
        (r"^token_embd\.", T.Q4_K), (r"^output\.", T.Q6_K), (r".", T.Q8_0)),
    "iq4_ks_r4": ((_EXPS_GU, T.IQ4_KS_R4), (_EXPS_D, T.IQ5_KS_R4), (r".", T.Q8_0)),
}
_COMPILED = {k: tuple((re.compile(rx), t) for rx, t in v) for k, v in MIXES.items()}


def mix_names() -> list[str]:
    return list(MIXES)


def find_mix(name: str) -> str | None:
    """The mix called `name` (any case; UD-Q2_K_XL and ud-q2_k_xl alike), or None."""
    key = str(name).strip().lower()
    return key if key in MIXES else None


def mix_type(mix: str, name: str, shape) -> GGMLType:
    """The type `mix` gives the tensor `name` of `shape`."""
    if len(shape) == 1 or ".ffn_gate_inp." in name or name.endswith(".bias"):
        return T.F32
    rules = _COMPILED.get(mix)
    if rules is None:
        raise HybridMoeError(f"unknown type mix {mix!r}; mixes: {', '.join(MIXES)}")
    for rx, t in rules:
        if rx.search(name):
            return t
    raise AssertionError(f"mix {mix} has no rule for {name}")       # every mix ends with a catch-all
