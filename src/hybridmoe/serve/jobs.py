"""The server's generations: a `Job` is one request's generation, advanced step by step on the generation
thread (batching.Batcher: a slot's KV cache, a chunk of its prompt or one token a step, batched with the
other slots' sequences); it sends what it writes to the event loop, piece by piece ('text', 'reasoning',
'logprobs'), then ('end', info) or ('error', message[, status]). `StopMatcher` cuts the text at the
request's stop sequences.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import torch

from ..errors import NonFiniteError
from ..generate import Sampler, Timings
from ..text.replies import ReplySplitter, held_prefix
from .requests import GenParams

log = logging.getLogger(__name__)


class StopMatcher:
    """Cuts the text at the first stop sequence; holds back a tail that may be the start of one, so a
    stop sequence split over several tokens never reaches the client."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.word = ""              # the stop sequence that was hit

    def feed(self, text: str) -> tuple[str, bool]:
        """(text that is safe to send, whether a stop sequence was hit)."""
        if not self.stops:
            return text, False
        self.pending += text
        cut = -1
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            self.word = min((s for s in self.stops if self.pending.find(s) == cut), key=len)
            out, self.pending = self.pending[:cut], ""
            return out, True
        n = len(self.pending) - max(held_prefix(self.pending, s) for s in self.stops)
        out, self.pending = self.pending[:n], self.pending[n:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _joined(items: list) -> list:
    """Items with each run of consecutive 'text' (or 'reasoning') pieces joined into one: a whole answer's pieces,
    handed to the event loop as a few items instead of one a token."""
    out, run = [], []
    for it in items + [("", None)]:
        if run and it[0] != run[0][0]:
            out.append((run[0][0], "".join(x for _, x in run)) if len(run) > 1 else run[0])
            run = []
        if it[0] in ("text", "reasoning"):
            run.append(it)
        elif it[1] is not None:
            out.append(it)
    return out


class Job:
    """One generation. The batcher calls `begin` when the job gets a slot, then each step runs `next_tokens`
    at `pos` in the slot's cache and gives the last logits to `advance`, until it returns True; then `finish`
    (or `fail`). What it writes goes to `queue` on the event loop: ('text', str) ..., then ('end', info) or
    ('error', message, status). The same sampling, stop and reply-splitting steps as generate.generate_ids."""

    def __init__(self, loop, ids: list[int], max_tokens: int, params: GenParams):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.ids, self.max_tokens, self.params = ids, max_tokens, params
        self.id_slot = getattr(params, "id_slot", -1)     # the slot asked for (-1: any)
        self.slot = None                      # the batching.Slot it runs in, once admitted
        self.n_generated = 0
        self.tool_calls: list[dict] = []
        self.info: dict | None = None         # what the "end" item carries
        self.finish_reason: str | None = None
        self.cancelled = False
        self.done = threading.Event()
        self.timings = Timings()              # filled as it runs (n_cached once the prompt ran)
        self.t_start = time.perf_counter()
        self.in_prompt = True
        self.todo: list[int] = []             # tokens to run next: the rest of the prompt, or the last sampled one
        self.pos = 0                          # where they go in the cache
        self.outbox: list | None = None       # set by the batcher: (job, item) pairs it delivers after each step
        # a non-streamed answer is read whole: its pieces wait here for the end item, so that its request's task
        # is not woken every step (a Task and a timer on the event loop a token a request)
        self.held: list | None = None if params.stream else []

    def _emit(self, item):
        if self.held is not None:
            if item[0] in ("text", "reasoning", "logprobs"):
                self.held.append(item)
                return
            held, self.held = self.held, []
            for it in _joined(held):
                self._post(it)
        self._post(item)

    def _post(self, item):
        if self.outbox is not None:          # the batcher delivers a step's items together
            self.outbox.append((self, item))
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:                 # the event loop is gone (server shut down)
            self.cancel.set()

    @property
    def reserved(self) -> int:
        """Cache positions this generation may fill: its prompt and its reply's limit."""
        return len(self.ids) + self.max_tokens

    # ---------------------------------------------------------------- on the generation thread
    def begin(self, model, kv):
        """The job got a slot whose cache is `kv`: its sampler, and the prompt from the end of the prefix the
        cache already holds (llama-server's prompt cache)."""
        self.t_start = time.perf_counter()
        p, tok = self.params, model.tokenizer
        self.kv, self.eos = kv, tok.eos_ids
        settings = p.sampling
        if p.ignore_eos and self.eos:        # end-of-generation tokens can never be sampled
            settings = dataclasses.replace(settings, logit_bias={**settings.logit_bias,
                                                                 **{e: float("-inf") for e in self.eos}})
        self.sampler = Sampler(settings, p.constraint(tok))
        self.detok = tok.stream()
        self.stops = StopMatcher(p.stops)
        self.split = ReplySplitter(tools=bool(p.tools), reasoning=p.reasoning_format not in (None, "none"),
                                   think_opened=p.think_opened, harmony=p.harmony)
        self.finish_kind, self.hit, self.left = "length", False, self.max_tokens
        # a non-streamed reply with no stop strings, logprobs, reasoning or tools is read whole and its text passes
        # the stop matcher and the splitter as it comes: its tokens wait here and become text once, at the end
        self.deferred = [] if (self.held is not None and not self.stops.stops and p.logprobs is None
                               and self.split.first is None and self.split.calls is None) else None
        n_cached = kv.reusable_prefix(self.ids) if p.cache_prompt else 0
        self.sampler.start(self.ids)
        self.timings.n_cached, self.timings.n_prompt = n_cached, len(self.ids) - n_cached
        self.todo, self.pos = self.ids[n_cached:], n_cached

    def next_tokens(self, budget: int) -> list[int]:
        """What this step runs: a chunk of at most `budget` prompt tokens, or the token sampled last."""
        return self.todo[:budget] if self.in_prompt else self.todo

    def greedy_after(self, n_ran: int) -> bool:
        """Whether advance(n_ran, ...) samples, greedily from the logits as they are (Sampler.plain_greedy)."""
        return (not self.in_prompt or n_ran == len(self.todo)) and getattr(self.sampler, "plain_greedy", False)

    def advance(self, n_ran: int, logits, top: int | None = None) -> bool:
        """The step ran n_ran tokens of `next_tokens`; `logits` [n_vocab] are the last one's, or a callable that
        gives them (a row of the batch's logits, taken only where the sampling needs more than `top`: their argmax,
        if the batcher took it). Samples when the prompt is done; True when the generation is over."""
        self.pos += n_ran
        del self.todo[:n_ran]
        now = time.perf_counter()
        if self.in_prompt:
            if self.todo:
                return False
            self.in_prompt = False
            self.timings.t_prompt = now - self.t_start
            self.t_gen = now
        else:
            self.timings.n_eval += 1
            self.timings.t_eval = now - self.t_gen
        return self._sample(logits, top)

    def _sample(self, logits, top: int | None = None) -> bool:
        if self.cancel.is_set():
            return True
        if top is not None and self.sampler.takes(top):
            t = top
        else:
            logits = logits() if callable(logits) else logits
            t = self.sampler(logits) if top is None else self.sampler(logits, top)
        self.timings.n_generated += 1
        self.sampler.accept(t)
        if self.params.logprobs is not None:        # the model's own distribution, before sampling settings
            logits = logits() if callable(logits) else logits
            lp = torch.log_softmax(logits.float(), -1)
            n_top = self.params.logprobs
            top = torch.topk(lp, n_top) if n_top else None
            self._emit(("logprobs", (t, float(lp[t]), [(int(i), float(v)) for v, i in zip(*top)] if top else [])))
        self.left -= 1
        if t in self.eos and not self.params.ignore_eos:
            self.finish_kind = "stop"
            return True
        self.n_generated += 1
        if self.deferred is not None:
            self.deferred.append(t)
        else:
            text, self.hit = self.stops.feed(self.detok.add(t))
            self._send(text)
            if self.hit:
                self.finish_kind = "stop"
                return True
        if self.left <= 0 or self.pos >= self.kv.n_ctx:
            return True
        self.todo = [t]
        return False

    def _send(self, text):
        for part in self.split.feed(text):
            self._emit(part)

    def finish(self):
        """The generation is over (or cancelled, or never began): the held-back text, then the end item."""
        finish, stop_word = "length", ""
        cancelled = self.cancel.is_set()
        if hasattr(self, "sampler"):
            finish = self.finish_kind
            if self.deferred and not cancelled:
                add = self.detok.add
                self._send("".join([add(t) for t in self.deferred]))
                self.deferred = []
            if not self.hit and not cancelled:
                text, self.hit = self.stops.feed(self.detok.flush())
                if self.hit:
                    finish = "stop"
                else:
                    text += self.stops.flush()
                self._send(text)
            stop_word = self.stops.word
            if not cancelled:
                for part in self.split.finish():
                    self._emit(part)
                self.tool_calls = self.split.tool_calls
                if self.tool_calls:
                    finish = "tool_calls"
        self.cancelled = cancelled
        self.finish_reason = None if cancelled else finish
        timings = self.timings
        total_ms = (time.perf_counter() - self.t_start) * 1e3
        prompt_ms = timings.t_prompt * 1e3
        predicted_ms = max(total_ms - prompt_ms, 0.0) if self.n_generated else 0.0
        n_p, n_g = timings.n_prompt, self.n_generated
        self.info = {
            "finish_reason": self.finish_reason,
            "stop_word": stop_word,
            "tool_calls": self.tool_calls,
            "id_slot": self.slot.id if self.slot is not None else 0,
            "usage": {"prompt_tokens": len(self.ids), "completion_tokens": n_g,
                      "total_tokens": len(self.ids) + n_g},
            "timings": {
                "cache_n": timings.n_cached,
                "prompt_n": n_p, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / n_p if n_p else 0.0,
                "prompt_per_second": 1e3 * n_p / prompt_ms if prompt_ms > 0 else 0.0,
                "predicted_n": n_g, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / n_g if n_g else 0.0,
                "predicted_per_second": 1e3 * n_g / predicted_ms if predicted_ms > 0 else 0.0,
            },
        }
        self._emit(("end", self.info))

    def fail(self, exc: BaseException):
        """The model or the sampler failed for this generation: an error item for its one client."""
        if isinstance(exc, NonFiniteError):      # the model computed NaN/inf: this request fails, the server stays up
            self._emit(("error", str(exc), 422))
        else:                                    # a bug or a device failure
            log.error("generation failed", exc_info=exc)
            self._emit(("error", f"generation failed: {type(exc).__name__}: {exc}", 500))
