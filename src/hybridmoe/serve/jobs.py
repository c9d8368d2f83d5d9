"""The server's generations: a `Job` runs one on the generation worker thread (app.ServerState owns that
thread and its queue, in arrival order) and sends what it writes to the event loop, piece by piece
('text', 'reasoning', 'logprobs'), then ('end', info) or ('error', message). `StopMatcher` cuts the text at
the request's stop sequences.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import torch

from ..errors import NonFiniteError
from ..generate import Sampler, Timings, generate_ids
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


class Job:
    """One generation. `run` executes on the worker thread and sends ('text', str), then
    ('end', info) or ('error', message), to `queue` on the event loop."""

    def __init__(self, loop, ids: list[int], max_tokens: int, params: GenParams):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.ids, self.max_tokens, self.params = ids, max_tokens, params
        self.n_generated = 0
        self.tool_calls: list[dict] = []
        self.info: dict | None = None         # what the "end" item carries
        self.finish_reason: str | None = None
        self.cancelled = False
        self.done = threading.Event()
        self.timings = Timings()              # filled as it runs (n_cached once the prompt ran)

    def _emit(self, item):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:                 # the event loop is gone (server shut down)
            self.cancel.set()

    def run(self, model):
        try:
            self._run(model)
        except NonFiniteError as e:              # the model computed NaN/inf: this request fails, the server stays up
            self._emit(("error", str(e), 422))
        except Exception as e:                   # a bug or a device failure, reported to the one client
            log.exception("generation failed")
            self._emit(("error", f"generation failed: {type(e).__name__}: {e}"))
        finally:
            self.done.set()

    def _run(self, model):
        t_start = time.perf_counter()
        timings = self.timings
        finish = "length"
        stop_word = ""
        p = self.params
        if not self.cancel.is_set():
            tok = model.tokenizer
            eos = tok.eos_ids
            settings = p.sampling
            if p.ignore_eos and eos:         # end-of-generation tokens can never be sampled
                settings = dataclasses.replace(settings, logit_bias={**settings.logit_bias,
                                                                     **{e: float("-inf") for e in eos}})
            sampler = Sampler(settings, p.constraint(tok))
            detok = tok.stream()
            stops = StopMatcher(p.stops)
            split = ReplySplitter(tools=bool(p.tools), reasoning=p.reasoning_format not in (None, "none"),
                                  think_opened=p.think_opened, harmony=p.harmony)

            def send(text):
                for part in split.feed(text):
                    self._emit(part)
            hit = False
            n_top = p.logprobs

            def on_logits(logits, token):             # the model's own distribution, before sampling settings
                lp = torch.log_softmax(logits.float(), -1)
                top = torch.topk(lp, n_top) if n_top else None
                self._emit(("logprobs", (token, float(lp[token]),
                                         [(int(i), float(v)) for v, i in zip(*top)] if top else [])))
            gen = generate_ids(model, self.ids, self.max_tokens, sampler, timings,
                               cache_prompt=p.cache_prompt,
                               on_logits=on_logits if n_top is not None else None)
            try:
                for t in gen:
                    if self.cancel.is_set():
                        break
                    if t in eos and not p.ignore_eos:
                        finish = "stop"
                        break
                    self.n_generated += 1
                    text, hit = stops.feed(detok.add(t))
                    send(text)
                    if hit:
                        finish = "stop"
                        break
            finally:
                gen.close()
            if not hit and not self.cancel.is_set():
                text, hit = stops.feed(detok.flush())
                if hit:
                    finish = "stop"
                else:
                    text += stops.flush()
                send(text)
            stop_word = stops.word
            if not self.cancel.is_set():
                for part in split.finish():
                    self._emit(part)
                self.tool_calls = split.tool_calls
                if self.tool_calls:
                    finish = "tool_calls"
        self.cancelled = self.cancel.is_set()
        self.finish_reason = None if self.cancelled else finish
        total_ms = (time.perf_counter() - t_start) * 1e3
        prompt_ms = timings.t_prompt * 1e3
        predicted_ms = max(total_ms - prompt_ms, 0.0) if self.n_generated else 0.0
        n_p, n_g = timings.n_prompt, self.n_generated
        self.info = {
            "finish_reason": self.finish_reason,
            "stop_word": stop_word,
            "tool_calls": self.tool_calls,
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
