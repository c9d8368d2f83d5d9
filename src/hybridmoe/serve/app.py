"""OpenAI-compatible HTTP server, like llama.cpp's `llama-server`.

`create_app(model)` returns a FastAPI app with

    GET  /health                 {"status": "ok"}
    GET  /v1/models              the one loaded model (id: --alias, else the file name)
    GET  /props                  context size, chat template, default sampling settings
    POST /v1/chat/completions    chat, through the model's chat template (stream or not)
    POST /v1/completions         raw text or token-id prompt (stream or not)

(/models, /chat/completions and /completions answer too, as in llama-server.)

The model is not thread-safe, so every generation runs on one generation thread (batching.py): `-np N`
slots, each with its own KV cache, whose sequences advance together, one batched step at a time; the event
loop only parses requests, tokenizes (a long prompt in a helper thread) and relays text, so it stays
responsive while generations run. A streaming client that goes away cancels its generation after the current token, and
so does a non-streaming one (polled every 0.25 s). Requests are untrusted: the body is capped
(8 MiB by default), every field is type-checked, the prompt must fit the context, max_tokens is capped to
what the context has left, and every bad request gets OpenAI's error shape
({"error": {"message", "type", "code", "param"}}) with a 4xx status, never a traceback.

Requests are parsed in requests.py, generations run as jobs.Job, and responses.py builds the answers and
their streams (anthropic.py: Anthropic's).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import random
import threading
import time
import weakref

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as StarletteRequest

from .. import __version__
from ..constrain.tokens import harmony_calls
from ..errors import HybridMoeError
from ..text.replies import THINK_OPEN, is_harmony, template_takes_tools
from . import anthropic as anthropic_api
from . import slots as server_slots
from .batching import Batcher
from .jobs import Job
from .metrics import prometheus
from .requests import (
    DEFAULT_SAMPLING,
    ApiError,
    GenParams,
    _bad,
    _opt_bool,
    _read_json,
    _template_kwargs,
    _type_name,
    _unsupported,
    bind_grammar,
    infill_tokens,
    parse_messages,
    parse_tools,
)
from .responses import ResponseWriter

log = logging.getLogger("hybridmoe.serve.app")

MAX_BODY_BYTES = 8 << 20
MAX_QUEUE = 64            # requests running or waiting for the model; more get 503
INLINE_CHARS = 2048       # prompts this short are tokenized on the event loop (app.encode)


def text_chars(messages: list[dict]) -> int | None:
    """The characters of the messages' text (parse_messages' form), or None where some content is not text."""
    n = 0
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            n += len(c)
        elif c is not None:
            return None
        if len(m) > 2:                             # tool calls, names, reasoning: let the helper thread render them
            return None
    return n


def check_in_vocab(ids, n_vocab: int, key: str):
    bad = [t for t in ids if not 0 <= t < n_vocab]
    if bad:
        raise _bad(f"'{key}' has token id {bad[0]}, outside the vocabulary (0..{n_vocab - 1})", key)


class _CatchAll:
    """ASGI middleware: an exception a route lets through, before its response started, becomes a 500 answer
    here, inside Starlette's outermost handler, which would also answer it but then re-raise, so that uvicorn
    drops the connection; here the client keeps it."""

    def __init__(self, app, answer):
        self.app, self.answer = app, answer

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            await self.answer(StarletteRequest(scope), exc)(scope, receive, send)


class ServerState(ResponseWriter):
    """The model, its slots and generation thread (batching.Batcher) and what the endpoints share."""

    def __init__(self, model, alias: str | None, api_key: str | list[str] | None, max_body_bytes: int, max_queue: int,
                 reasoning_format: str = "auto", metrics: bool = False, slot_save_path: str | None = None,
                 n_parallel: int = 1, kv_unified: bool = False, slot_similarity: float = 0.5):
        self.model = model
        self.metrics = metrics
        self.slot_save_path = slot_save_path
        self.n_predict = -1                        # serve -n: the reply's limit when a request sets none
        # llama-server's /metrics counters, summed over finished generations
        self.totals = dict(prompt_tokens=0, prompt_seconds=0.0, predicted_tokens=0, predicted_seconds=0.0,
                           requests=0)
        self.reasoning_format = reasoning_format
        self.name = alias or os.path.basename(model.path)
        self.api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])   # any one opens
        self.max_body_bytes = max_body_bytes
        self.max_queue = max_queue
        self.created = int(time.time())
        self._lock = threading.Lock()
        self.last_job: Job | None = None          # for tests and debugging
        self.jobs_started = 0
        self.batcher = Batcher(model, n_parallel, self.n_ctx, slot_similarity, kv_unified, on_finished=self._finished)

    @property
    def n_ctx(self) -> int:
        """The whole context (-c), which the slots share."""
        return self.model.options.ctx_size

    @property
    def n_ctx_slot(self) -> int:
        """One slot's context: -c / -np (all of it with --kv-unified)."""
        return self.batcher.n_ctx_slot

    def submit(self, job: Job):
        with self._lock:
            self.last_job = job
            self.jobs_started += 1
        self.batcher.submit(job)

    async def slot_task(self, sid: int, fn, *args):
        """fn(model, slot, *args) on the generation thread once slot `sid` is idle; its result."""
        return await asyncio.wrap_future(self.batcher.call(sid, fn, *args))

    def _finished(self, job: Job):
        if job.info is None:
            return
        t = job.info["timings"]
        with self._lock:
            add = dict(prompt_tokens=t["prompt_n"], prompt_seconds=t["prompt_ms"] / 1e3, requests=1,
                       predicted_tokens=t["predicted_n"], predicted_seconds=t["predicted_ms"] / 1e3)
            for k, v in add.items():
                self.totals[k] += v

    def prometheus(self) -> str:
        """llama-server's /metrics (its metric names, so its dashboards work), Prometheus text format."""
        b = self.batcher
        busy, waiting = b.busy()
        with self._lock:
            totals = dict(self.totals)
        kv_tokens = sum(len(s.tokens) for s in b.slots)
        kv_size = b.n_ctx if b.unified else sum(s.n_ctx for s in b.slots)
        return prometheus(totals, dict(b.counts), dict(b.last_batch), busy, waiting, kv_tokens, kv_size)

    def close(self):
        self.batcher.close()

    def check_auth(self, request: Request):
        if not self.api_keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":                 # Anthropic's clients send the key as x-api-key
            key = request.headers.get("x-api-key", "")
        if not any(hmac.compare_digest(key.strip().encode(), k.encode()) for k in self.api_keys):
            raise ApiError(401, "invalid or missing API key; send 'Authorization: Bearer KEY' (or 'x-api-key: "
                           "KEY')", "invalid_api_key", type_="authentication_error")

    def check_prompt(self, ids: list[int], params: GenParams, param: str) -> int:
        """The number of tokens this request may generate."""
        n, n_ctx = len(ids), self.n_ctx_slot
        if n == 0:
            raise _bad("the prompt is empty after tokenization; send a non-empty prompt", param)
        if n >= n_ctx:
            want = n + (params.max_tokens or 256)
            suggest = -(-want // 256) * 256
            train = self.model.cfg.n_ctx_train
            over = n - n_ctx + 1
            slots = len(self.batcher.slots)
            per = f" per slot (-c {self.n_ctx} / -np {slots})" if n_ctx != self.n_ctx else ""
            raise ApiError(400, f"the prompt has {n} tokens but the context size is {n_ctx}{per}: {over} "
                           f"token{'s' if over != 1 else ''} too many (at least one token must be left for the "
                           f"reply); shorten the prompt "
                           f"or restart the server with a larger context, e.g. -c {suggest * (self.n_ctx // n_ctx)} "
                           f"(the model was trained with {train})", "context_length_exceeded", param)
        left = n_ctx - n
        limit = params.max_tokens or (self.n_predict if self.n_predict > 0 else None)
        return min(limit, left) if limit else left

    async def respond(self, request: Request, kind: str, ids: list[int], params: GenParams):
        """kind: "chat" (OpenAI chat), "text" (OpenAI completions), "native" (llama-server's /completion,
        /infill) or "anthropic" (/v1/messages): the same generation, answered in that API's form."""
        max_tokens = self.check_prompt(ids, params, "messages" if kind == "chat" else "prompt")
        tok = self.model.tokenizer
        check_in_vocab(params.sampling.logit_bias, tok.n_vocab, "logit_bias")
        banned = {t for t, b in params.sampling.logit_bias.items() if b == float("-inf")}
        if len(banned | (set(tok.eos_ids) if params.ignore_eos else set())) >= tok.n_vocab:
            raise _bad(f"'logit_bias' bans every token of the vocabulary ({tok.n_vocab}"
                       f"{', with ignore_eos banning the end-of-generation tokens' if params.ignore_eos else ''}): "
                       f"nothing could be generated; leave at least one token allowed", "logit_bias")
        bind_grammar(params, self.model.tokenizer)
        if params.id_slot >= len(self.batcher.slots):
            raise _bad(f"'id_slot' is {params.id_slot}, but this server has {len(self.batcher.slots)} slot"
                       f"{'s' if len(self.batcher.slots) > 1 else ''} (0..{len(self.batcher.slots) - 1}; -1: any)",
                       "id_slot")
        busy, waiting = self.batcher.busy()
        if busy + waiting >= self.max_queue:
            raise ApiError(503, f"the server is busy: {busy + waiting} requests are running or waiting; "
                           f"retry later", "server_busy", type_="server_error")
        job = Job(asyncio.get_running_loop(), ids, max_tokens, params)
        self.submit(job)
        # (not uuid4: its os.urandom call hands the GIL over, which costs the event loop more under load)
        rid = {"chat": "chatcmpl-", "anthropic": "msg_"}.get(kind, "cmpl-") + f"{random.getrandbits(128):032x}"
        if params.stream:
            events = (self._sse_native(job) if kind == "native" else
                      anthropic_api.events(job, rid, self.name) if kind == "anthropic" else
                      self._sse(job, kind, rid, params))
            # the generator's `finally` cancels the job; this covers a response dropped before it started
            weakref.finalize(events, job.cancel.set)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._collect(request, job, kind, rid)


# ---------------------------------------------------------------------------- the app

def create_app(model, alias: str | None = None, *, api_key: str | list[str] | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, max_queue: int = MAX_QUEUE,
               reasoning_format: str = "auto", metrics: bool = False, slot_save_path: str | None = None,
               template_defaults: dict | None = None, n_parallel: int = 1, kv_unified: bool = False,
               slot_similarity: float = 0.5) -> FastAPI:
    """The FastAPI app serving `model` (a loaded hybridmoe.Model). metrics: serve GET /metrics. slot_save_path:
    the folder for POST /slots/ID?action=save|restore. template_defaults: chat template variables for every
    request (its own chat_template_kwargs win). n_parallel: slots (-np), each with -c / n_parallel of the
    context, or all of it with kv_unified; slot_similarity: llama-server's --slot-prompt-similarity."""
    if not model.options.ctx_size:
        # -c 0 means the training context; the decoder's caches read options.ctx_size directly
        model.options.ctx_size = model.cfg.n_ctx_train
    if n_parallel < 1 or (not kv_unified and model.options.ctx_size // n_parallel < 2):
        raise HybridMoeError(f"-np {n_parallel}: give from 1 to {model.options.ctx_size // 2} slots for -c "
                             f"{model.options.ctx_size} (each gets -c / -np tokens; --kv-unified: all of them)")
    if not 0 <= slot_similarity <= 1:
        raise HybridMoeError(f"--slot-prompt-similarity {slot_similarity}: give a number from 0 to 1 (0: off)")
    state = ServerState(model, alias, api_key, max_body_bytes, max_queue, reasoning_format, metrics, slot_save_path,
                        n_parallel, kv_unified, slot_similarity)
    tok = model.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state.close()

    app = FastAPI(title="hybridmoe", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hybridmoe = state

    def error_answer(request, e: ApiError):
        """e in OpenAI's error shape, or in Anthropic's for any path under /v1/messages."""
        path = request.scope.get("path", "")
        if path == anthropic_api.PATH or path.startswith(anthropic_api.PATH + "/"):
            return anthropic_api.error_response(e)
        return e.response()

    def internal(request, exc: Exception):
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_answer(request, ApiError(500, f"internal server error: {type(exc).__name__}", "internal_error",
                                              type_="server_error"))

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error_answer(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = f"no endpoint {request.method} {request.url.path}; endpoints: GET /health, GET /v1/models, " \
                  f"GET /props, POST /v1/chat/completions, POST /v1/completions, POST /completion, POST /infill, " \
                  f"POST /v1/messages, POST /tokenize, POST /detokenize, POST /apply-template, GET /metrics"
            e = ApiError(404, msg, "not_found", type_="not_found_error")
        elif exc.status_code == 405:
            e = ApiError(405, f"{request.method} is not allowed on {request.url.path}", "method_not_allowed")
        else:
            e = ApiError(exc.status_code, str(exc.detail), "http_error")
        out = error_answer(request, e)
        out.headers.update(exc.headers or {})              # 405's Allow
        return out

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(x) for x in first.get("loc", ()))
        return error_answer(request, _bad(f"{where}: {first.get('msg', 'invalid')}", where or None))

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        return internal(request, exc)

    app.add_middleware(_CatchAll, answer=internal)

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        return {"status": "ok"}

    def model_card() -> dict:
        m = model
        return {"id": state.name, "object": "model", "created": state.created, "owned_by": "hybridmoe",
                "meta": {"n_ctx": state.n_ctx, "n_ctx_train": m.cfg.n_ctx_train, "n_vocab": tok.n_vocab,
                         "n_embd": m.cfg.n_embd, "arch": m.cfg.arch, "size": m.file.nbytes}}

    @app.get("/v1/models")
    @app.get("/models")
    async def models(request: Request):
        state.check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str, request: Request):
        state.check_auth(request)
        if model_id != state.name:
            raise ApiError(404, f"model {model_id!r} is not served here; this server serves {state.name!r}",
                           "model_not_found", "model")
        return model_card()

    @app.get("/props")
    async def props(request: Request):
        state.check_auth(request)
        return {"model_alias": state.name, "model_path": model.path, "n_ctx": state.n_ctx,
                "total_slots": len(state.batcher.slots), "chat_template": tok.chat_template or "",
                "build_info": f"hybridmoe {__version__}",
                "default_generation_settings": {"n_ctx": state.n_ctx_slot, "params": dict(DEFAULT_SAMPLING)}}

    async def encode(fn, *args, chars: int | None = None):
        """fn(*args): tokenization (and a chat template's rendering) in a helper thread, so that a long prompt
        does not hold up the event loop; a short one (`chars` of text, at most INLINE_CHARS: well under a
        millisecond) runs here, saving the two thread hand-offs, which cost more than it does when many
        requests come at once."""
        try:
            if chars is not None and chars <= INLINE_CHARS:
                return fn(*args)
            return await asyncio.to_thread(fn, *args)
        except HybridMoeError as e:
            raise ApiError(400, str(e), "chat_template_error", "messages") from None

    def render_chat(messages, kwargs) -> tuple[list[int], bool]:
        """The prompt's tokens, and whether it ends inside a <think> block the template opened."""
        text = tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        return tok.encode(text), text.rstrip().endswith(THINK_OPEN)

    def token_ids(v, key: str) -> list[int]:
        if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            raise _bad(f"'{key}' must be an array of token ids, got {_type_name(v)}", key, "invalid_type")
        check_in_vocab(v, tok.n_vocab, key)
        return list(v)

    # llama-server's token endpoints (frontends count tokens with them)
    @app.get("/metrics")
    async def metrics_endpoint(request: Request):
        state.check_auth(request)
        if not state.metrics:
            raise ApiError(501, "this server does not serve metrics; restart it with --metrics", "not_supported",
                           type_="not_supported_error")
        return PlainTextResponse(state.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/slots")
    async def slots_state(request: Request):
        """llama-server's slot list: each slot's context, whether it is generating, what its cache holds."""
        state.check_auth(request)
        out = []
        for s in state.batcher.slots:
            job = s.job
            out.append({"id": s.id, "id_task": id(job) & 0x7FFFFFFF if job is not None else -1, "n_ctx": s.n_ctx,
                        "speculative": False, "is_processing": job is not None, "n_cached": len(s.tokens),
                        "n_prompt_tokens": len(job.ids) if job is not None else 0,
                        "n_decoded": job.n_generated if job is not None else 0})
        return out

    @app.post("/slots/{slot_id}")
    async def slots(request: Request, slot_id: str, action: str = ""):
        """llama-server's slot actions: save a slot's KV cache to a file, restore it, erase it (serve/slots.py);
        each waits until its slot is idle."""
        state.check_auth(request)
        n = len(state.batcher.slots)
        if not (slot_id.isascii() and slot_id.isdigit() and int(slot_id) < n):
            has = "one, 0" if n == 1 else f"{n}, 0..{n - 1}"
            raise _bad(f"no slot {slot_id!r}: this server has {has}", "id_slot")
        if action not in ("save", "restore", "erase"):
            raise _bad(f"'action' must be save, restore or erase, got {action!r}", "action")
        if action == "erase":
            return await state.slot_task(int(slot_id), lambda m, s: server_slots.erase(m, s))
        if state.slot_save_path is None:
            raise ApiError(501, "slots cannot be saved or restored: start the server with --slot-save-path DIR",
                           "not_supported", type_="not_supported_error")
        body = await _read_json(request, state.max_body_bytes)
        fn = server_slots.save if action == "save" else server_slots.restore
        folder = state.slot_save_path
        return await state.slot_task(int(slot_id), lambda m, s: fn(m, folder, body, s))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        state.check_auth(request)
        body = await _read_json(request, state.max_body_bytes)
        content = body.get("content")
        if not isinstance(content, str):
            raise _bad(f"'content' must be a string, got {_type_name(content)}", "content",
                       "missing_required_parameter" if content is None else "invalid_type")
        add_special, parse_special = _opt_bool(body, "add_special"), _opt_bool(body, "parse_special", True)
        ids = await asyncio.to_thread(tok.encode, content, add_special, parse_special)
        if not _opt_bool(body, "with_pieces"):
            return {"tokens": ids}
        pieces = []
        for t in ids:
            b = tok.piece_bytes(t)
            try:
                pieces.append({"id": t, "piece": b.decode("utf-8")})
            except UnicodeDecodeError:                # part of a character: its bytes, as llama-server does
                pieces.append({"id": t, "piece": list(b)})
        return {"tokens": pieces}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        state.check_auth(request)
        body = await _read_json(request, state.max_body_bytes)
        ids = token_ids(body.get("tokens", []), "tokens")
        return {"content": await asyncio.to_thread(tok.decode, ids)}

    defaults = dict(template_defaults or {})

    def template_kwargs(body, tools) -> dict:
        kwargs = {**defaults, **_template_kwargs(body)}
        if tools:
            why = template_takes_tools(tok.chat_template)
            if why:
                raise _unsupported(f"'tools': {why}", "tools")
            kwargs["tools"] = tools
        return kwargs

    @app.post("/apply-template")
    async def apply_template(request: Request):
        state.check_auth(request)
        body = await _read_json(request, state.max_body_bytes)
        messages = parse_messages(body.get("messages"))
        kwargs = template_kwargs(body, parse_tools(body))

        def render():
            return tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        return {"prompt": await encode(render)}

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        state.check_auth(request)
        return await chat(request, await _read_json(request, state.max_body_bytes), "chat")

    @app.post("/v1/messages")
    async def messages(request: Request):
        """Anthropic's Messages API, on the chat pipeline (serve/anthropic.py)."""
        try:
            state.check_auth(request)
            body = anthropic_api.to_openai(await _read_json(request, state.max_body_bytes))
            return await chat(request, body, "anthropic")
        except ApiError as e:
            return anthropic_api.error_response(e)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """Anthropic's token count of a Messages request: its prompt through the chat template, with its tools."""
        try:
            state.check_auth(request)
            body = anthropic_api.to_openai(await _read_json(request, state.max_body_bytes))
            params = GenParams(body, chat=True)
            ids, _ = await encode(render_chat, parse_messages(body.get("messages")),
                                  template_kwargs(body, params.tools))
            return {"input_tokens": len(ids)}
        except ApiError as e:
            return anthropic_api.error_response(e)

    async def chat(request: Request, body: dict, kind: str):
        """A chat request (OpenAI's form): through the chat template, then generated."""
        messages = parse_messages(body.get("messages"))
        params = GenParams(body, chat=True)
        kwargs = template_kwargs(body, params.tools)
        ids, params.think_opened = await encode(render_chat, messages, kwargs,
                                                chars=None if params.tools else text_chars(messages))
        params.reasoning_format = params.reasoning_format or state.reasoning_format
        params.harmony = is_harmony(tok.chat_template) and params.reasoning_format != "none"
        if params.forced and is_harmony(tok.chat_template):    # the call in gpt-oss's header form, then <|call|>
            call = tok.token_to_id("<|call|>")
            if call is None or call not in tok.eos_ids:
                raise _unsupported("'tool_choice' forces a call, but this harmony model's vocabulary has no "
                                   "<|call|> token to end it; send \"auto\"", "tool_choice")
            params.schema, params.harmony_calls = None, harmony_calls(params.tools, params.forced)
        return await state.respond(request, kind, ids, params)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        state.check_auth(request)
        body = await _read_json(request, state.max_body_bytes)
        params = GenParams(body, chat=False)
        return await state.respond(request, "text", await prompt_tokens(body), params)

    @app.post("/completion")
    async def completion(request: Request):
        """llama-server's own completion endpoint (its result and stream format, n_probs)."""
        state.check_auth(request)
        body = await _read_json(request, state.max_body_bytes)
        params = GenParams(body, chat=False, native=True)
        return await state.respond(request, "native", await prompt_tokens(body), params)

    @app.post("/infill")
    async def infill(request: Request):
        """llama-server's fill-in-the-middle for code models: input_prefix, input_suffix, input_extra."""
        state.check_auth(request)
        body = await _read_json(request, state.max_body_bytes)
        missing = [r for r in ("pre", "suf", "mid") if r not in tok.fim]
        if missing:
            raise ApiError(501, "this model has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, "
                           "<|fim_middle|> or the file's tokenizer.ggml.fim_*_token_id): /infill needs a code model "
                           "trained for it", "not_supported", type_="not_supported_error")
        params = GenParams(body, chat=False, native=True)
        ids = await encode(infill_tokens, body, tok, state.n_ctx_slot, params.max_tokens)
        return await state.respond(request, "native", ids, params)

    async def prompt_tokens(body) -> list[int]:
        """A completion request's prompt: a string or token ids (a batch of one of either)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                      # one prompt in a batch of one
        if prompt is None:
            raise _bad("'prompt' is required: a string or an array of token ids", "prompt",
                       "missing_required_parameter")
        if isinstance(prompt, str):
            ids = await encode(tok.encode, prompt, chars=len(prompt))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            ids = token_ids(prompt, "prompt")
        elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise _bad(f"'prompt' holds {len(prompt)} prompts; this server takes one prompt per request",
                       "prompt")
        else:
            raise _bad(f"'prompt' must be a string or a non-empty array of token ids, got {_type_name(prompt)}",
                       "prompt", "invalid_type")
        return ids

    return app
