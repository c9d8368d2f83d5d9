"""Prefill in ubatches, then one token per step; sampling; llama.cpp-style timings."""
from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

TOPK_BLOCK = 64          # top_k's group of logits: one maximum a group prefilters the candidates


def _host_vector(t: torch.Tensor) -> bool:
    """A 1-D float32 CPU tensor: what numpy reads in place for argmax and top_k."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 1


def argmax(logits: torch.Tensor) -> int:
    """The index of the largest of 1-D logits (the first, where several tie, as torch.argmax). A CPU float32
    vector is read by numpy: torch's CPU argmax of a 152k vocabulary took ~290 us a token, numpy's ~11 (dev VM),
    where a GPU decodes a token in 3-5 ms."""
    if _host_vector(logits):
        return int(np.argmax(logits.numpy()))
    return int(torch.argmax(logits))


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest of 1-D logits, largest first, as torch.topk (on the CPU tied values in
    index order, where torch leaves their order open). A long CPU float32 vector is prefiltered: the k largest
    of its groups' maxima are k of its values, so its k-th largest value is at least the k-th largest group
    maximum, and only the values from there up are sorted (~65 us for a 152k vocabulary against torch.topk's
    ~490, dev VM)."""
    n = logits.numel()
    k = min(k, n)
    if not _host_vector(logits):
        return torch.topk(logits, k)
    a = logits.numpy()
    if n >= 4 * TOPK_BLOCK * k:
        # groups of TOPK_BLOCK values a stride of m / TOPK_BLOCK apart (a column each of the [TOPK_BLOCK, m /
        # TOPK_BLOCK] view: numpy's max over its rows runs along memory), and the tail
        m = n - n % TOPK_BLOCK
        maxima = a[:m].reshape(TOPK_BLOCK, -1).max(0)
        if m < n:
            maxima = np.append(maxima, a[m:].max())
        c = np.partition(maxima, maxima.size - k)[maxima.size - k]
        cand = np.flatnonzero(a >= c)
    else:
        cand = np.arange(n)
    idx = cand[np.argsort(-a[cand], kind="stable")[:k]]
    return torch.from_numpy(a[idx]), torch.from_numpy(idx.astype(np.int64))


@dataclass
class SamplerSettings:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1
    # llama.cpp's penalties over the last repeat_last_n tokens (prompt and reply; -1: all, 0: none)
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    logit_bias: dict = field(default_factory=dict)      # token id -> added to its logit (-inf: never)


class Sampler:
    """Penalties, bias, temperature, top-k, top-p and min-p, as llama.cpp's chain. `constraint` (a
    constrain.TokenConstraint): a drawn token it refuses is dropped and the draw repeated among the rest;
    when it refuses them all, the most likely token of the whole vocabulary it allows is taken."""

    def __init__(self, s: SamplerSettings, constraint=None):
        self.s = s
        self.constraint = constraint
        self.gen = torch.Generator()
        self.gen.manual_seed(s.seed if s.seed >= 0 else int(time.time_ns() % (2**31)))
        self.penalize = s.repeat_last_n != 0 and (s.repeat_penalty != 1 or s.presence_penalty or s.frequency_penalty)
        self.recent = collections.deque(maxlen=None if s.repeat_last_n < 0 else s.repeat_last_n)
        self.bias = (torch.tensor(list(s.logit_bias), dtype=torch.long),
                     torch.tensor(list(s.logit_bias.values()), dtype=torch.float32)) if s.logit_bias else None
        # a bias that only bans tokens (ignore_eos bans the end-of-generation ones): greedy takes the argmax of
        # the logits as they are when it is not banned (then it is the argmax of the biased ones too)
        self.banned = {int(t) for t in s.logit_bias} if s.logit_bias and all(
            b == float("-inf") for b in s.logit_bias.values()) else None
        # greedy on the logits as they come (no penalties; a bias, if any, only bans tokens): the token is their
        # argmax unless that is banned or the constraint refuses it
        self.plain_greedy = s.temperature <= 0 and not self.penalize and (self.bias is None or self.banned is not None)

    def start(self, prompt_ids):
        """The context so far (the penalties look back into the prompt, as llama.cpp's)."""
        if self.penalize:
            self.recent.extend(prompt_ids[-self.recent.maxlen:] if self.recent.maxlen else prompt_ids)

    def accept(self, token: int):
        if self.penalize:
            self.recent.append(token)
        if self.constraint is not None:
            self.constraint.accept(token)

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after the repeat / presence / frequency penalties and the logit bias."""
        s = self.s
        if not (self.penalize and self.recent) and self.bias is None:
            return logits
        logits = logits.float().clone()
        if self.penalize and self.recent:
            ids, counts = torch.unique(torch.tensor(list(self.recent), dtype=torch.long), return_counts=True)
            v = logits[ids]
            v = torch.where(v > 0, v / s.repeat_penalty, v * s.repeat_penalty)
            logits[ids] = v - counts * s.frequency_penalty - s.presence_penalty
        if self.bias is not None:
            logits[self.bias[0]] += self.bias[1]
        return logits

    def takes(self, top: int) -> bool:
        """Whether `top`, the logits' argmax, is the token __call__ would return (plain greedy, and it is allowed):
        then the logits need not be read."""
        c = self.constraint
        return self.plain_greedy and (self.banned is None or top not in self.banned) and (c is None or c.allows(top))

    def __call__(self, logits: torch.Tensor, top: int | None = None) -> int:
        """logits [n_vocab] float32 -> token id (greedy at temperature <= 0, as llama.cpp). `top`: their argmax,
        where the caller has it (a batch's rows take theirs in one op)."""
        s = self.s
        c = self.constraint
        if self.plain_greedy:
            tok = argmax(logits) if top is None else top
            if (self.banned is None or tok not in self.banned) and (c is None or c.allows(tok)):
                return tok
        logits = self.adjust(logits).float()
        # the candidates before the temperature: dividing by T > 0 keeps the logits' order, so only the top k
        # are scaled (their first, the scaled maximum, is the overflow test)
        if s.temperature > 0:
            v, idx = top_k(logits, s.top_k) if s.top_k > 0 else torch.sort(logits, descending=True)
            v = v / s.temperature
        # greedy at 0, and at a temperature so small that the logits overflow (its limit)
        if s.temperature <= 0 or not math.isfinite(float(v[0])):
            tok = argmax(logits)
            return tok if c is None or c.allows(tok) else c.best(logits)
        p = torch.softmax(v, -1)
        keep = torch.ones_like(p, dtype=torch.bool)
        if 0 < s.top_p < 1:
            keep &= (torch.cumsum(p, -1) - p) < s.top_p
        if s.min_p > 0:
            keep &= p >= s.min_p * p[0]
        keep[0] = True              # the most likely stays, as llama.cpp's min_keep (top_p 5e-324 is 0 in float32)
        p = torch.where(keep, p, torch.zeros_like(p))
        while True:
            j = int(torch.multinomial(p / p.sum(), 1, generator=self.gen))
            if c is None or c.allows(int(idx[j])):
                return int(idx[j])
            p[j] = 0
            if not p.sum() > 0:
                return c.best(logits)


@dataclass
class Timings:
    n_prompt: int = 0            # prompt tokens run (not those taken from the cache)
    n_cached: int = 0            # prompt tokens whose keys and values the cache already held
    t_prompt: float = 0.0
    n_eval: int = 0              # decode steps run (llama.cpp's "eval" count: the last token sampled is not run)
    t_eval: float = 0.0
    n_generated: int = 0         # tokens sampled and yielded
    extra: dict = field(default_factory=dict)

    def format(self) -> str:
        def line(label, ms, n):
            per = ms / n if n else 0.0
            tps = 1e3 * n / ms if ms > 0 else 0.0
            return f"{label} = {ms:10.2f} ms / {n:5d} tokens ({per:8.2f} ms per token, {tps:8.2f} tokens per second)"
        return "\n".join([line("prompt eval time", self.t_prompt * 1e3, self.n_prompt),
                          line("       eval time", self.t_eval * 1e3, self.n_eval)])


def prefill(model, kv, tokens: list[int], pos0: int = 0) -> torch.Tensor:
    """Run the prompt in ubatches; returns the last position's logits [n_vocab]."""
    ub = model.options.ubatch_size
    logits = None
    for i in range(0, len(tokens), ub):
        chunk = torch.tensor(tokens[i:i + ub], dtype=torch.long)
        logits = model.forward(chunk, pos0 + i, kv, all_logits=False)
    return logits[-1]


def generate_ids(model, prompt_ids: list[int], n_predict: int, sampler: Sampler, timings: Timings,
                 stop_ids=frozenset(), cache_prompt: bool = True, on_logits=None):
    """Yield generated token ids; fills `timings` as llama.cpp counts them. With `cache_prompt` the prompt
    runs from the end of the longest prefix it shares with what the model's cache holds (the previous
    generation's prompt and output), as llama-server's prompt cache does. `on_logits(logits, token)` sees the
    logits each yielded token was sampled from."""
    kv = model.take_cache()
    try:
        t0 = time.perf_counter()
        n_cached = kv.reusable_prefix(prompt_ids) if cache_prompt else 0
        sampler.start(prompt_ids)
        logits = prefill(model, kv, prompt_ids[n_cached:], n_cached)
        model.sync()
        timings.t_prompt = time.perf_counter() - t0
        timings.n_prompt = len(prompt_ids) - n_cached
        timings.n_cached = n_cached
        pos = len(prompt_ids)
        t0 = time.perf_counter()
        for i in range(n_predict):
            tok = sampler(logits)
            if tok in stop_ids:
                break
            timings.n_generated += 1
            sampler.accept(tok)
            if on_logits is not None:
                on_logits(logits, tok)
            yield tok
            if i == n_predict - 1 or pos >= kv.n_ctx:
                break
            logits = model.forward(torch.tensor([tok]), pos, kv, all_logits=False)[-1]
            pos += 1
            timings.n_eval += 1
            timings.t_eval = time.perf_counter() - t0
    finally:
        model.return_cache(kv)
