"""Request parsing and validation for the OpenAI-compatible server: untrusted JSON in, typed values out.

Every bad field becomes an `ApiError` carrying OpenAI's error shape and a 4xx status.
"""
from __future__ import annotations

import json
import math
import re

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from ..constrain.grammar import Grammar, GrammarError, GrammarMachine
from ..constrain.json_machine import JsonMachine
from ..constrain.json_schema import SchemaError, check_schema
from ..constrain.tokens import (
    HARMONY_FINAL,
    THINK_END,
    TokenConstraint,
    tool_call_schema,
)
from ..generate import SamplerSettings
from ..text.replies import CLOSE, OPEN

_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_STOPS = 16            # stop sequences per request
MAX_STOP_CHARS = 512      # characters per stop sequence
CHAT_ROLES = ("system", "user", "assistant", "tool")   # "developer" (OpenAI's newer name) reads as "system"
# llama-server's defaults, which are also `hybridmoe run`'s
DEFAULT_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


class ApiError(Exception):
    """A request the server refuses; becomes {"error": {...}} with `status`."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_

    def response(self) -> JSONResponse:
        headers = {"Connection": "close"} if self.status == 413 else None
        return _error_response(self.status, self.message, self.code, self.param, self.type, headers)


def _error_response(status, message, code, param=None, type_="invalid_request_error", headers=None):
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")     # never fails to encode
    return JSONResponse({"error": {"message": message, "type": type_, "code": code, "param": param}},
                        status_code=status, headers=headers)


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


# ---------------------------------------------------------------------------- request parsing

def _type_name(v) -> str:
    if v is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(v), type(v).__name__)


def _show(v, limit: int = 60) -> str:
    """repr(v), cut to `limit` characters: error messages quote what a request sent, not megabytes of it."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _reject_constant(name):
    raise ValueError(f"{name} is not allowed in JSON")


async def _read_json(request: Request, limit: int) -> dict:
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise _bad(f"Content-Length {_show(cl)} is not a number", code="invalid_request") from None
        if n > limit:
            raise ApiError(413, f"request body is {n} bytes; this server accepts at most {limit} bytes",
                           "request_too_large")
    buf = bytearray()
    try:
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise ApiError(413, f"request body is over {limit} bytes; this server accepts at most {limit} "
                               f"bytes", "request_too_large")
    except ClientDisconnect:
        raise _bad("the client disconnected while sending the request body", code="client_disconnected") from None
    if not buf.strip():
        raise _bad("request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(bytes(buf), parse_constant=_reject_constant)
    except RecursionError:
        raise _bad("request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except ValueError as e:          # JSONDecodeError, UnicodeDecodeError, huge integers, NaN
        raise _bad(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad(f"request body must be a JSON object, got {_type_name(body)}", code="invalid_json")
    # JSON's \\u escapes can spell them, and so can raw bytes (json.loads decodes UTF-8, -16 and -32 bodies with
    # "surrogatepass"); a UTF-8 body with neither a \\u nor an 0xED byte holds none
    maybe = b"\\u" in buf or b"\xed" in buf or json.detect_encoding(bytes(buf[:4])) != "utf-8"
    where = _lone_surrogate(body) if maybe else None
    if where is not None:
        raise _bad(f"{where} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair); text must "
                   f"be valid Unicode", None if where.startswith("a key") else where.split("[", 1)[0].split(".", 1)[0],
                   "invalid_text")
    return body


def _lone_surrogate(body) -> str | None:
    """Where a string (or an object key) of a parsed body holds a lone UTF-16 surrogate, which no text
    encoding can carry (the tokenizer, the template and our answers would fail on it), as a path like
    messages[0].content; None if nowhere. Iterative: bodies may nest as deep as the JSON parser allows."""
    def bad(v):
        return isinstance(v, str) and not v.isascii() and _SURROGATE.search(v) is not None
    todo = [(body, "")]
    while todo:
        v, where = todo.pop()
        if isinstance(v, dict):
            for k, x in v.items():
                at = f"{where}.{k[:40]}" if where else k[:40]
                if bad(k):
                    return f"a key of {where or 'the request body'}"
                if bad(x):
                    return at
                if isinstance(x, (dict, list)):
                    todo.append((x, at))
        else:
            for i, x in enumerate(v):
                if bad(x):
                    return f"{where}[{i}]"
                if isinstance(x, (dict, list)):
                    todo.append((x, f"{where}[{i}]"))
    return None


def _opt_bool(body, key, default=False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be a boolean, got {_type_name(v)}", key, "invalid_type")
    return v


def _opt_int(body, key, default=None, lo=None, hi=None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"'{key}' must be an integer, got {_type_name(v)}", key, "invalid_type")
    if lo is not None and v < lo:
        raise _bad(f"'{key}' must be at least {lo}, got {v}", key)
    if hi is not None and v > hi:
        raise _bad(f"'{key}' must be at most {hi}, got {v}", key)
    return v


def _opt_num(body, key, default=None, lo=None, hi=None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(f"'{key}' must be a number, got {_type_name(v)}", key, "invalid_type")
    v = float(v)
    if not math.isfinite(v):
        raise _bad(f"'{key}' must be a finite number", key)
    if lo is not None and v < lo:
        raise _bad(f"'{key}' must be at least {lo}, got {v:g}", key)
    if hi is not None and v > hi:
        raise _bad(f"'{key}' must be at most {hi}, got {v:g}", key)
    return v


def _unsupported(message: str, param: str) -> ApiError:
    return ApiError(400, message, "unsupported_parameter", param)


def _parse_stop(v) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad(f"'stop' must be a string or an array of strings, got {_type_name(v)}", "stop", "invalid_type")
    if len(v) > MAX_STOPS:
        raise _bad(f"'stop' has {len(v)} sequences; at most {MAX_STOPS} are accepted", "stop")
    for s in v:
        if len(s) > MAX_STOP_CHARS:
            raise _bad(f"a stop sequence has {len(s)} characters; at most {MAX_STOP_CHARS} are accepted", "stop")
    return [s for s in v if s]


class GenParams:
    """What a request asks of one generation (common to chat and completions)."""

    def __init__(self, body: dict, chat: bool, native: bool = False):
        """native: llama-server's own /completion (n_probs instead of OpenAI's logprobs)."""
        self.stream = _opt_bool(body, "stream")
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise _bad(f"'stream_options' must be an object, got {_type_name(so)}", "stream_options", "invalid_type")
        self.include_usage = _opt_bool(so or {}, "include_usage")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad(f"'model' must be a string, got {_type_name(model)}", "model", "invalid_type")
        n = _opt_int(body, "n", 1)
        if n != 1:
            raise _bad(f"'n' is {n}, but this server returns one choice per request; send n=1 or leave it out",
                       "n")
        # max_completion_tokens (newer OpenAI), max_tokens, n_predict (llama-server; -1 = no limit)
        self.max_tokens = None
        for key in ("max_completion_tokens", "max_tokens", "n_predict"):
            if body.get(key) is None:
                continue
            v = _opt_int(body, key)
            if key == "n_predict" and v == -1:
                break
            if v <= 0:
                raise _bad(f"'{key}' must be at least 1, got {v}", key)
            self.max_tokens = v
            break
        temperature = _opt_num(body, "temperature", DEFAULT_SAMPLING["temperature"], lo=0)
        top_p = _opt_num(body, "top_p", DEFAULT_SAMPLING["top_p"], lo=0, hi=1)
        top_k = _opt_int(body, "top_k", DEFAULT_SAMPLING["top_k"], lo=0)
        min_p = _opt_num(body, "min_p", DEFAULT_SAMPLING["min_p"], lo=0, hi=1)
        seed = _opt_int(body, "seed", -1, lo=-(2**63), hi=2**63 - 1)
        self.sampling = SamplerSettings(
            temperature, top_k, top_p, min_p, seed,
            repeat_penalty=_opt_num(body, "repeat_penalty", 1.0, lo=0),
            presence_penalty=_opt_num(body, "presence_penalty", 0.0, lo=-2, hi=2),
            frequency_penalty=_opt_num(body, "frequency_penalty", 0.0, lo=-2, hi=2),
            repeat_last_n=_opt_int(body, "repeat_last_n", 64, lo=-1, hi=2**31 - 1),
            logit_bias=_parse_logit_bias(body.get("logit_bias")))
        if self.sampling.repeat_penalty == 0:
            raise _bad("'repeat_penalty' must be above 0 (1 is off)", "repeat_penalty")
        self.stops = _parse_stop(body.get("stop"))
        self.ignore_eos = _opt_bool(body, "ignore_eos")
        # llama-server's prompt cache: start after the prefix shared with the previous generation
        self.cache_prompt = _opt_bool(body, "cache_prompt", True)
        # llama-server's id_slot: the slot to run in (-1: the one whose cache shares most of the prompt, else the
        # least recently used); checked against the server's slots by the app
        self.id_slot = _opt_int(body, "id_slot", -1, lo=-1, hi=2**31 - 1)
        # what we cannot do is refused, not silently ignored
        # llama-server's reasoning formats: "deepseek" (= "auto") splits <think>...</think> off as
        # reasoning_content; "none" leaves it in the content. None: the server's --reasoning-format.
        self.reasoning_format = body.get("reasoning_format")
        if self.reasoning_format not in (None, "auto", "deepseek", "none"):
            raise _bad(f"'reasoning_format' must be \"auto\", \"deepseek\" or \"none\", got "
                       f"{_show(self.reasoning_format)}", "reasoning_format")
        self.think_opened = False       # the prompt ends inside a <think> block (set by the chat endpoint)
        self.harmony = False            # the reply is in gpt-oss's harmony format (set by the chat endpoint)
        # logprobs: None, or how many alternatives each generated token lists (chat: logprobs + top_logprobs
        # 0-20; completions: logprobs 0-5, OpenAI's legacy form)
        self.logprobs, self.tools = None, None
        self.schema = parse_response_format(body)     # the reply must be JSON this schema accepts (None: free)
        self.grammar = parse_grammar(body, self.schema)  # ... or text this GBNF grammar accepts
        self.wrap = (b"", b"")                        # ... between these two texts
        self.forced = None                            # the functions tool_choice forces a call to
        self.harmony_calls = None                     # ... in gpt-oss's form: header -> arguments' schema
        if chat:
            if _opt_bool(body, "logprobs"):
                self.logprobs = _opt_int(body, "top_logprobs", 0, lo=0, hi=20)
            elif body.get("top_logprobs") is not None:
                raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            self.tools = parse_tools(body)
            self.forced = forced_tools(body, self.tools)
            if self.forced:                     # the reply is one call: constrained like a response format
                if self.schema is not None or self.grammar is not None:
                    raise _bad("a JSON 'response_format' or a 'grammar' and a 'tool_choice' that forces a call "
                               "cannot both hold", "tool_choice")
                self.schema, self.wrap = tool_call_schema(self.tools, self.forced), (OPEN.encode(), CLOSE.encode())
                try:
                    check_schema(self.schema)
                except SchemaError as e:
                    raise _bad(f"'tool_choice' forces a call, but {e}", "tools") from None
            if body.get("functions"):
                raise _unsupported("'functions' (OpenAI's old form) is not supported by this server; send 'tools'",
                                   "functions")
        elif native:
            n_probs = _opt_int(body, "n_probs", 0, lo=0, hi=20)
            self.logprobs = n_probs or None
        else:
            if body.get("logprobs") is not None:
                self.logprobs = _opt_int(body, "logprobs", lo=0, hi=5)
            if _opt_bool(body, "echo"):
                raise _unsupported("'echo' is not supported by this server", "echo")
            if body.get("suffix"):
                raise _unsupported("'suffix' (insertion) is not supported by this server", "suffix")
            if _opt_int(body, "best_of", 1) != 1:
                raise _unsupported("'best_of' must be 1 on this server", "best_of")


    def constraint(self, tok):
        """What the reply must keep to, as a constrain.TokenConstraint over `tok`'s vocabulary, or None: a JSON
        schema or a grammar (from the first token, or once the thoughts the prompt opened, or gpt-oss's final
        channel, begin), or a forced gpt-oss tool call, which <|call|> ends."""
        if self.harmony_calls:
            return TokenConstraint(JsonMachine.choice(self.harmony_calls), tok, tok.eos_ids,
                                   ends={tok.token_to_id("<|call|>")})
        if self.schema is None and self.grammar is None:
            return None
        machine = JsonMachine(self.schema, *self.wrap) if self.schema is not None else GrammarMachine(self.grammar, tok)
        trigger = THINK_END if self.think_opened else HARMONY_FINAL if self.harmony else None
        return TokenConstraint(machine, tok, tok.eos_ids, trigger)


def _parse_logit_bias(v) -> dict:
    """OpenAI's {"token id": bias} (bias -100..100), or llama-server's [[id, bias | false], ...] (false: never)."""
    if v is None:
        return {}
    pairs = v.items() if isinstance(v, dict) else v if isinstance(v, list) else None
    if pairs is None:
        raise _bad(f"'logit_bias' must be an object of token id -> bias, got {_type_name(v)}", "logit_bias",
                   "invalid_type")
    out = {}
    for p in pairs:
        if not (isinstance(p, (tuple, list)) and len(p) == 2):
            raise _bad("'logit_bias' as an array takes [token id, bias] pairs", "logit_bias")
        k, b = p
        try:
            tid = int(k) if not isinstance(k, (bool, float)) else None
        except (TypeError, ValueError, OverflowError):      # not a number, or more digits than int() reads
            tid = None
        if tid is None:
            raise _bad(f"'logit_bias' has {_show(k)}, which is not a token id", "logit_bias")
        if b is False:
            out[tid] = float("-inf")
        elif isinstance(b, (int, float)) and not isinstance(b, bool) and -100 <= b <= 100:
            out[tid] = float(b)
        else:
            raise _bad(f"'logit_bias' for token {tid} must be a number from -100 to 100, got {_show(b)}", "logit_bias")
    return out


def infill_tokens(body: dict, tok, n_ctx: int, max_tokens: int | None) -> list[int]:
    """llama-server's /infill prompt: the extra files (a repository name and [file separator, name, text]
    each, when the model has those tokens), then prefix, suffix and middle in llama.cpp's PSM order:
    [pre] input_prefix [suf] input_suffix [mid] prompt. Too long for the context (less room for the reply):
    the suffix keeps its start (at most a quarter), the prefix its end, the extra files their end."""
    def text(key):
        v = body.get(key, "")
        if not isinstance(v, str):
            raise _bad(f"'{key}' must be a string, got {_type_name(v)}", key, "invalid_type")
        return v
    extra = body.get("input_extra", [])
    if not isinstance(extra, list) or not all(isinstance(c, dict) and isinstance(c.get("text"), str)
                                              and isinstance(c.get("filename", ""), str) for c in extra):
        raise _bad("'input_extra' must be an array of {\"filename\": str, \"text\": str}", "input_extra",
                   "invalid_type")
    fim = tok.fim

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special=False, parse_special=False) if s else []
    ext = [fim["rep"], *enc("myproject\n")] if extra and "rep" in fim else []
    for c in extra:
        head = [fim["sep"], *enc(c.get("filename") or "tmp")] + enc("\n") if "sep" in fim else []
        ext += head + enc(c["text"] + ("" if "sep" in fim else "\n\n"))
    if extra and "sep" in fim:
        ext += [fim["sep"], *enc("filename\n")]
    pre, suf, mid = enc(text("input_prefix")), enc(text("input_suffix")), enc(text("prompt"))
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    room = n_ctx - min(max_tokens or 256, n_ctx // 4) - 3 - len(mid) - len(bos)
    if room < 0:
        raise _bad(f"'prompt' has {len(mid)} tokens, too many for the context of {n_ctx}", "prompt")
    n_suf = min(len(suf), room // 4)
    n_pre = min(len(pre), room - n_suf)
    n_ext = min(len(ext), room - n_suf - n_pre)
    return (bos + ext[len(ext) - n_ext:] + [fim["pre"]] + pre[len(pre) - n_pre:] + [fim["suf"]] + suf[:n_suf]
            + [fim["mid"]] + mid)


def bind_grammar(params: "GenParams", tok):
    """Resolve the request's grammar's token references (<[id]>, <think>) in `tok`'s vocabulary: a 400 where
    one is not a token of it."""
    if params.grammar is not None:
        try:
            params.grammar = params.grammar.bind(tok)
        except GrammarError as e:
            raise _bad(f"'grammar': {e}", "grammar") from None


def parse_grammar(body, schema):
    """llama-server's `grammar` (GBNF text), parsed; None when absent."""
    text = body.get("grammar")
    if text is None or text == "":
        return None
    if not isinstance(text, str):
        raise _bad(f"'grammar' must be GBNF text (a string), got {_type_name(text)}", "grammar", "invalid_type")
    if schema is not None:
        raise _bad("send a 'grammar' or a JSON schema ('json_schema', 'response_format'), not both", "grammar")
    try:
        return Grammar(text)
    except GrammarError as e:
        raise _bad(f"'grammar': {e}", "grammar") from None


def parse_response_format(body):
    """The JSON schema the reply must follow, or None: OpenAI's `response_format` ({"type": "json_object"}
    or {"type": "json_schema", "json_schema": {"name": ..., "schema": ...}}; llama-server's
    {"type": "json_object", "schema": ...} too), or llama-server's top-level `json_schema`."""
    rf, schema = body.get("response_format"), None
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if not isinstance(rf, dict) or kind not in (None, "text", "json_object", "json_schema"):
            raise _bad("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": ...}}",
                       "response_format")
        if kind == "json_object":
            schema = rf.get("schema", {"type": "object"})
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise _bad("'response_format.json_schema' must be an object: {\"name\": ..., \"schema\": ...}",
                           "response_format", "invalid_type")
            schema = js.get("schema", rf.get("schema", {"type": "object"}))
    if body.get("json_schema") is not None:
        if schema is not None:
            raise _bad("send 'json_schema' or a JSON 'response_format', not both", "json_schema")
        schema = body["json_schema"]
    if schema is not None:
        try:
            check_schema(schema)
        except SchemaError as e:
            raise _bad(f"the response format's schema: {e}", "response_format") from None
    return schema


def parse_tools(body) -> list[dict] | None:
    """The request's function tools, or None (none given, or tool_choice "none")."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad(f"'tools' must be an array, got {_type_name(tools)}", "tools", "invalid_type")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                       f"\"parameters\": ...}}}}", "tools", "invalid_type")
    if body.get("tool_choice") == "none":
        return None
    _opt_bool(body, "parallel_tool_calls", True)
    return tools or None


def forced_tools(body, tools) -> list[str] | None:
    """The functions `tool_choice` makes the reply call ("required": one of the tools; a named function), or
    None ("auto", "none" or absent: the model decides)."""
    choice = body.get("tool_choice")
    if choice in (None, "auto", "none"):
        return None
    names = [t["function"]["name"] for t in tools or []]
    if choice == "required":
        if not names:
            raise _bad("'tool_choice' is \"required\" but the request has no tools", "tool_choice")
        return names
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                   "\"function\": {\"name\": ...}}", "tool_choice")
    if fn["name"] not in names:
        raise _bad(f"'tool_choice' names {_show(fn['name'])}, which is not one of the request's tools", "tool_choice")
    return [fn["name"]]


def _parse_content(content, where: str):
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise _bad(f"{where}.content[{j}] must be an object, got {_type_name(part)}", where, "invalid_type")
            kind = part.get("type")
            if kind != "text":
                raise _bad(f"{where}.content[{j}] has type {_show(kind)}; this server takes text parts only",
                           where, "unsupported_content")
            if not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{j}].text must be a string, got {_type_name(part.get('text'))}",
                           where, "invalid_type")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"{where}.content must be a string or an array of text parts, got {_type_name(content)}",
               where, "invalid_type")


def parse_messages(v) -> list[dict]:
    if v is None:
        raise _bad("'messages' is required: an array of {\"role\", \"content\"} objects", "messages",
                   "missing_required_parameter")
    if not isinstance(v, list):
        raise _bad(f"'messages' must be an array, got {_type_name(v)}", "messages", "invalid_type")
    if not v:
        raise _bad("'messages' is empty; send at least one message", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object, got {_type_name(m)}", "messages", "invalid_type")
        role = m.get("role")
        if role is None:
            raise _bad(f"{where}.role is missing", "messages", "missing_required_parameter")
        if not isinstance(role, str):
            raise _bad(f"{where}.role must be a string, got {_type_name(role)}", "messages", "invalid_type")
        if role == "developer":
            role = "system"
        if role not in CHAT_ROLES:
            raise _bad(f"{where}.role {_show(role)} is not a known role; use one of {', '.join(CHAT_ROLES)} "
                       f"(or developer)", "messages")
        msg = {"role": role}
        tool_calls = m.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant" or not isinstance(tool_calls, list):
                raise _bad(f"{where}.tool_calls must be an array on an assistant message", "messages",
                           "invalid_type")
            msg["tool_calls"] = tool_calls
        content = m.get("content")
        if content is None:
            if role != "assistant" or tool_calls is None:
                raise _bad(f"{where}.content is missing", "messages", "missing_required_parameter")
            msg["content"] = None
        else:
            msg["content"] = _parse_content(content, where)
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise _bad(f"{where}.{key} must be a string, got {_type_name(m[key])}", "messages",
                               "invalid_type")
                msg[key] = m[key]
        out.append(msg)
    return out


def _template_kwargs(body) -> dict:
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise _bad(f"'chat_template_kwargs' must be an object, got {_type_name(kw)}", "chat_template_kwargs",
                   "invalid_type")
    for key in ("messages", "add_generation_prompt"):
        if key in kw:
            raise _bad(f"'chat_template_kwargs' may not set {_show(key)}", "chat_template_kwargs")
    return dict(kw)
