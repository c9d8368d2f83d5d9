"""The server's answers: OpenAI's chat and completions bodies, llama-server's /completion result, and
their server-sent event streams, built from what a jobs.Job sends (Anthropic's: anthropic.py).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from .. import __version__
from . import anthropic as anthropic_api
from .jobs import Job
from .requests import ApiError, GenParams

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


def _sse_data(obj) -> str:
    """One server-sent event of OpenAI's and llama-server's streams."""
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class ResponseWriter:
    """Mixin of app.ServerState: its responses to one request's job, in the form of the request's API. Uses
    the state's `name` (the served model's id) and `model` (its tokenizer)."""

    def _base(self, kind: str, rid: str, stream: bool) -> dict:
        obj = {"chat": ("chat.completion.chunk" if stream else "chat.completion"),
               "text": "text_completion"}[kind]
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.name,
                "system_fingerprint": f"hybridmoe-{__version__}"}

    def _token(self, t: int) -> tuple[str, list[int]]:
        b = self.model.tokenizer.piece_bytes(t)
        return b.decode("utf-8", errors="replace"), list(b)

    def _logprobs(self, kind: str, entries: list) -> dict:
        """OpenAI's logprobs object for (token, logprob, [(alternative, logprob)]) entries: chat's, or the
        completions' legacy one."""
        if kind in ("chat", "native"):
            def one(t, lp):
                s, b = self._token(t)
                return {"id": t, "token": s, "logprob": lp, "bytes": b} if kind == "native" else \
                    {"token": s, "logprob": lp, "bytes": b}
            out = [dict(one(t, lp), top_logprobs=[one(a, alp) for a, alp in top]) for t, lp, top in entries]
            return out if kind == "native" else {"content": out}
        tokens = [self._token(t)[0] for t, _, _ in entries]
        offsets = [0, *itertools.accumulate(len(s) for s in tokens)][:len(tokens)]   # within the completion
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{self._token(a)[0]: alp for a, alp in top} for _, _, top in entries],
                "text_offset": offsets}

    async def _gather(self, request: Request, job: Job) -> tuple[str, str, list, dict]:
        """A whole generation: (text, thoughts, logprobs entries, end info); ApiError if it did not end."""
        parts, thoughts, logprobs = [], [], []
        get = asyncio.ensure_future(job.queue.get())
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            while True:
                done, _ = await asyncio.wait({get}, timeout=DISCONNECT_POLL_S)
                if time.monotonic() >= next_check:      # also while text keeps coming
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        job.cancel.set()             # nobody will read the answer
                        raise ApiError(499, "client disconnected", "client_disconnected")
                if not done:
                    continue
                item = get.result()
                while item[0] in ("text", "reasoning", "logprobs"):
                    {"text": parts, "reasoning": thoughts, "logprobs": logprobs}[item[0]].append(item[1])
                    if job.queue.empty():
                        break
                    item = job.queue.get_nowait()        # what came meanwhile, without a wait each
                if item[0] in ("text", "reasoning", "logprobs"):
                    get = asyncio.ensure_future(job.queue.get())
                    continue
                if item[0] == "error":               # a third item: the status (422: the model computed NaN/inf)
                    raise ApiError(item[2] if len(item) > 2 else 500, item[1], "generation_failed",
                                   type_="server_error")
                info = item[1]
                if info["finish_reason"] is None:
                    raise ApiError(503, "the generation was cancelled: the server is shutting down", "cancelled",
                                   type_="server_error")
                return "".join(parts), "".join(thoughts), logprobs, info
        finally:
            get.cancel()
            job.cancel.set()                 # no-op once the job has ended

    async def _collect(self, request: Request, job: Job, kind: str, rid: str):
        text, thoughts, logprobs, info = await self._gather(request, job)
        if kind == "anthropic":
            return JSONResponse(anthropic_api.message(rid, self.name, text, thoughts, info))
        if kind == "native":
            return JSONResponse(self._native(job, text, info, logprobs))
        out = self._base(kind, rid, False)
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            if thoughts:
                choice["message"]["reasoning_content"] = thoughts
            if info["tool_calls"]:
                choice["message"].update(content=text.strip() or None, tool_calls=info["tool_calls"])
        else:
            choice = {"index": 0, "text": text}
        choice.update(finish_reason=info["finish_reason"],
                      logprobs=self._logprobs(kind, logprobs) if job.params.logprobs is not None else None)
        out.update(choices=[choice], usage=info["usage"], timings=info["timings"])
        return JSONResponse(out)

    def _native(self, job: Job, text: str, info: dict, logprobs: list) -> dict:
        """llama-server's /completion result (the last event of its stream, with the content streamed)."""
        p, u = job.params, info["usage"]
        s = p.sampling
        out = {"index": 0, "content": text, "id_slot": info.get("id_slot", 0), "stop": True, "model": self.name,
               "tokens_predicted": u["completion_tokens"], "tokens_evaluated": u["prompt_tokens"],
               "generation_settings": {
                   "n_predict": p.max_tokens or -1, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                   "min_p": s.min_p, "seed": s.seed, "repeat_penalty": s.repeat_penalty,
                   "repeat_last_n": s.repeat_last_n, "presence_penalty": s.presence_penalty,
                   "frequency_penalty": s.frequency_penalty, "stop": p.stops, "ignore_eos": p.ignore_eos,
                   "stream": p.stream, "n_probs": p.logprobs or 0, "cache_prompt": p.cache_prompt},
               "prompt": self.model.tokenizer.decode(job.ids), "has_new_line": "\n" in text, "truncated": False,
               "stop_type": "limit" if info["finish_reason"] == "length" else "word" if info["stop_word"] else "eos",
               "stopping_word": info["stop_word"], "tokens_cached": u["total_tokens"], "timings": info["timings"]}
        if p.logprobs:
            out["completion_probabilities"] = self._logprobs("native", logprobs)
        return out

    async def _sse_native(self, job: Job):
        """llama-server's /completion stream: {"content": piece, "stop": false} events, then the result with
        "stop": true (and no [DONE])."""
        try:
            while True:
                item = await job.queue.get()
                if item[0] in ("text", "logprobs"):
                    e = {"index": 0, "content": item[1] if item[0] == "text" else "",
                         "id_slot": job.slot.id if job.slot is not None else 0, "stop": False}
                    if item[0] == "logprobs":
                        e["completion_probabilities"] = self._logprobs("native", [item[1]])
                    yield _sse_data(e)
                elif item[0] == "end" and item[1]["finish_reason"] is not None:
                    yield _sse_data(self._native(job, "", item[1], []))
                    return
                elif item[0] != "reasoning":
                    msg = item[1] if item[0] == "error" else "the generation was cancelled: the server is shutting down"
                    yield _sse_data({"error": {"message": msg, "type": "server_error", "code": "generation_failed"
                                           if item[0] == "error" else "cancelled", "param": None}})
                    return
        finally:
            job.cancel.set()

    async def _sse(self, job: Job, kind: str, rid: str, params: GenParams):
        def chunk(delta_or_text, finish=None) -> dict:
            c = self._base(kind, rid, True)
            if kind == "chat":
                choice = {"index": 0, "delta": delta_or_text}
            else:
                choice = {"index": 0, "text": delta_or_text}
            choice.update(finish_reason=finish, logprobs=None)
            c["choices"] = [choice]
            return c

        try:
            if kind == "chat":
                yield _sse_data(chunk({"role": "assistant", "content": ""}))
            while True:
                item = await job.queue.get()
                if item[0] == "text":
                    yield _sse_data(chunk({"content": item[1]} if kind == "chat" else item[1]))
                elif item[0] == "reasoning":
                    yield _sse_data(chunk({"reasoning_content": item[1]}))
                elif item[0] == "logprobs":
                    c = chunk({} if kind == "chat" else "")
                    c["choices"][0]["logprobs"] = self._logprobs(kind, [item[1]])
                    yield _sse_data(c)
                elif item[0] == "error":
                    yield _sse_data({"error": {"message": item[1], "type": "server_error",
                                           "code": "generation_failed", "param": None}})
                    return
                else:
                    info = item[1]
                    if info["finish_reason"] is None:
                        yield _sse_data({"error": {"message": "the generation was cancelled: the server is shutting "
                                               "down", "type": "server_error", "code": "cancelled", "param": None}})
                        return
                    if info["tool_calls"]:
                        yield _sse_data(chunk({"tool_calls": [dict(index=i, **c)
                                                          for i, c in enumerate(info["tool_calls"])]}))
                    last = chunk({} if kind == "chat" else "", info["finish_reason"])
                    last["timings"] = info["timings"]
                    yield _sse_data(last)
                    if params.include_usage:
                        u = self._base(kind, rid, True)
                        u.update(choices=[], usage=info["usage"])
                        yield _sse_data(u)
                    yield "data: [DONE]\n\n"
                    return
        finally:
            job.cancel.set()                 # client gone (or stream over): stop generating
