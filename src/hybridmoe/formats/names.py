"""Canonical GGUF tensor names: the layer a tensor belongs to, its kind, the expert and fused-pair patterns,
regexes over sets of layer numbers (for -ot rules), and byte sizes as printed in reports and errors."""
from __future__ import annotations

import re

EXPS_REGEX = r"\.ffn_(up|down|gate)_exps"     # llama.cpp's --cpu-moe / --n-cpu-moe pattern
FUSED_PAIRS = (("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "_exps"),
               ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "_shexp"),
               ("ffn_gate", "ffn_up", "ffn_down", r"\.weight"))
# the attention matrices that decide a layer's attention device
ATTN_MAIN = ("attn_k", "attn_kv_a_mqa", "attn_qkv", "attn_q", "attn_q_a", "attn_output")
GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
KINDS = ("embeddings", "attention", "norms", "router", "shared experts", "experts", "dense ffn", "other", "output")
_BLK = re.compile(r"^blk\.(\d+)\.")


def layer_of(name: str) -> int | None:
    m = _BLK.match(name)
    return int(m[1]) if m else None


def tensor_kind(name: str) -> str:
    """One of KINDS, from the canonical GGUF name."""
    if name.startswith("token_embd"):
        return "embeddings"
    if name.startswith("output"):
        return "output"
    if layer_of(name) is None:
        return "other"
    short = name.split(".")[2]
    if "_shexp" in short:
        return "shared experts"
    if short.endswith("_exps"):
        return "experts"
    if short.startswith("ffn_gate_inp") or short.startswith("exp_probs_b"):
        return "router"
    if short.endswith("norm"):
        return "norms"
    if short.startswith("attn_"):
        return "attention"
    if short.startswith("ffn_"):
        return "dense ffn"
    return "other"


def fmt_bytes(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    if n >= KiB:
        return f"{n / KiB:.1f} KiB"
    return f"{int(n)} B"


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _range_alternatives(a: int, b: int) -> list[str]:
    """Regex alternatives matching exactly the integers a..b (decimal, no leading zeros)."""
    out = []
    while a <= b:
        n_dig = len(str(a))
        top = min(b, 10 ** n_dig - 1)          # stay within numbers of a's digit count
        k = 0                                  # largest k: a is a multiple of 10^k and the block fits
        while k + 1 < n_dig and a % 10 ** (k + 1) == 0 and a + 10 ** (k + 1) - 1 <= top:
            k += 1
        step = 10 ** k
        d = (a // step) % 10
        m = min((top - a + 1) // step, 10 - d)  # blocks of 10^k sharing the higher digits
        prefix = str(a // (step * 10)) if n_dig - k - 1 > 0 else ""
        digit = str(d) if m == 1 else f"[{d}-{d + m - 1}]"
        out.append(prefix + digit + "[0-9]" * k)
        a += m * step
    return out


def layers_regex(layers) -> str:
    """A regex matching exactly the given layer numbers: [35] -> '35', [20..60] -> '(2[0-9]|[3-5][0-9]|60)'."""
    nums = sorted(set(int(x) for x in layers))
    if not nums:
        raise ValueError("layers_regex needs at least one layer")
    alts, start = [], nums[0]
    for prev, cur in zip(nums, nums[1:] + [None]):
        if cur is None or cur != prev + 1:
            alts += _range_alternatives(start, prev)
            start = cur
    if len(alts) == 1 and alts[0].isdigit():
        return alts[0]
    return "(" + "|".join(alts) + ")"


def layers_text(layers) -> str:
    """[0,1,2,5] -> '0-2,5'."""
    nums = sorted(set(layers))
    parts, start = [], nums[0]
    for prev, cur in zip(nums, nums[1:] + [None]):
        if cur is None or cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(parts)
