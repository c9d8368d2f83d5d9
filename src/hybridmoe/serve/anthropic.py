"""Anthropic's Messages API (POST /v1/messages) on the server's chat pipeline, as llama-server serves it for
agents written against Anthropic's API: the request becomes an OpenAI chat request (system, messages with
tool_use / tool_result blocks, tools, tool_choice, sampling), and the reply comes back as Anthropic's
content blocks (thinking, text, tool_use) or its stream of events."""
from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from .requests import ApiError, _bad, _show, _type_name

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


PATH = "/v1/messages"          # every answer under it, errors included, is in Anthropic's shape


def error_response(e: ApiError) -> JSONResponse:
    """An ApiError in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    message = e.message.encode("utf-8", "backslashreplace").decode("utf-8")
    headers = {"Connection": "close"} if e.status == 413 else None
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=e.status,
                        headers=headers)


def _text(content, where: str) -> str:
    """A string, or the text of text blocks (other blocks are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or an array of content blocks, got {_type_name(content)}", "messages",
                   "invalid_type")
    out = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else _type_name(b)
            raise _bad(f"{where}[{j}] is a {_show(kind)} block; this server takes text here", "messages")
        out.append(b["text"])
    return "".join(out)


def _messages(body: dict) -> list[dict]:
    """Anthropic's system and messages as OpenAI chat messages: tool_result blocks become tool messages
    (before the user's text, as they come first), tool_use blocks an assistant's tool_calls."""
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty array of {\"role\", \"content\"} objects", "messages")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where} must be an object with role \"user\" or \"assistant\"", "messages")
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content must be a string or an array of content blocks", "messages", "invalid_type")
        texts, calls = [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text":
                texts.append(_text([b], at))
            elif kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise _bad(f"{at}.tool_use_id must be a string", "messages")
                result = _text(b.get("content", ""), f"{at}.content")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": ("Error: " if b.get("is_error") else "") + result})
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise _bad(f"{at} needs a string id and name", "messages")
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue                              # earlier thoughts are not sent back to the model
            else:
                raise _bad(f"{at} is a {_show(kind)} block; this server takes text, tool_use and tool_result",
                           "messages")
        if texts or calls:                            # (a user turn of tool results only adds no message)
            msg = {"role": role, "content": "".join(texts) if texts else None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def to_openai(body) -> dict:
    """The OpenAI chat request for an Anthropic Messages request."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_type")
    out = {"messages": _messages(body), "stream": body.get("stream", False)}
    for a, o in (("max_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                 ("top_k", "top_k"), ("stop_sequences", "stop")):
        if body.get(a) is not None:
            out[o] = body[a]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be an array", "tools", "invalid_type")
        out["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
                raise _bad(f"tools[{i}] must be a custom tool {{\"name\", \"description\", \"input_schema\"}}; "
                           f"Anthropic's server tools are not supported", "tools")
            fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
            if t.get("description"):
                fn["description"] = t["description"]
            out["tools"].append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise _bad("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", "
                       "\"name\": ...}", "tool_choice")
        out["tool_choice"] = ({"type": "function", "function": {"name": choice.get("name")}} if kind == "tool"
                              else {"any": "required"}.get(kind, kind))
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        out["chat_template_kwargs"] = {"enable_thinking": False}
    out["cache_prompt"] = body.get("cache_prompt", True)     # llama-server's, as an extra field
    return out


def _stop_reason(info: dict) -> str:
    return {"length": "max_tokens", "tool_calls": "tool_use"}.get(
        info["finish_reason"], "stop_sequence" if info["stop_word"] else "end_turn")


def _usage(info: dict) -> dict:
    """Anthropic's usage counts each prompt token once: input_tokens are those that ran, cache_read_input_tokens
    those taken from the prompt cache (the two add up to the prompt)."""
    u, cached = info["usage"], info["timings"]["cache_n"]
    return {"input_tokens": u["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
            "output_tokens": u["completion_tokens"]}


def _tool_use(call: dict) -> dict:
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": args if isinstance(args, dict) else {"value": args}}


def message(rid: str, model: str, text: str, thoughts: str, info: dict) -> dict:
    """The reply as Anthropic's message object."""
    content = [{"type": "thinking", "thinking": thoughts, "signature": ""}] if thoughts else []
    if info["tool_calls"]:
        text = text.strip()
    if text:
        content.append({"type": "text", "text": text})
    content += [_tool_use(c) for c in info["tool_calls"]]
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": _stop_reason(info), "stop_sequence": info["stop_word"] or None, "usage": _usage(info)}


async def events(job, rid: str, model: str):
    """The reply as Anthropic's server-sent events: message_start, a content block per kind (thinking,
    text, each tool_use) with its deltas, message_delta (stop reason, usage), message_stop."""
    def event(kind: str, obj: dict) -> str:
        return f"event: {kind}\ndata: " + json.dumps({"type": kind, **obj}, ensure_ascii=False) + "\n\n"
    index, open_kind = -1, None

    def block(kind: str, start: dict):
        nonlocal index, open_kind
        out = [event("content_block_stop", {"index": index})] if open_kind else []
        index, open_kind = index + 1, kind
        return out + [event("content_block_start", {"index": index, "content_block": start})]
    try:
        pending = await job.queue.get()         # the prompt has run: how much of it came from the cache is known
        cached = job.timings.n_cached
        yield event("message_start", {"message": {
            "id": rid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": len(job.ids) - cached, "cache_read_input_tokens": cached,
                                             "output_tokens": 0}}})
        while True:
            item, pending = pending if pending is not None else await job.queue.get(), None
            if item[0] in ("text", "reasoning"):
                kind = "text" if item[0] == "text" else "thinking"
                if open_kind != kind:
                    for e in block(kind, {"type": "text", "text": ""} if kind == "text" else
                                   {"type": "thinking", "thinking": "", "signature": ""}):
                        yield e
                delta = {"type": "text_delta", "text": item[1]} if kind == "text" else \
                    {"type": "thinking_delta", "thinking": item[1]}
                yield event("content_block_delta", {"index": index, "delta": delta})
            elif item[0] == "end" and item[1]["finish_reason"] is not None:
                info = item[1]
                for call in info["tool_calls"]:
                    use = _tool_use(call)
                    for e in block("tool_use", dict(use, input={})):
                        yield e
                    yield event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(use["input"])}})
                if open_kind:
                    yield event("content_block_stop", {"index": index})
                yield event("message_delta", {"delta": {"stop_reason": _stop_reason(info),
                                                        "stop_sequence": info["stop_word"] or None},
                                              "usage": _usage(info)})
                yield event("message_stop", {})
                return
            elif item[0] in ("error", "end"):
                msg = item[1] if item[0] == "error" else "the generation was cancelled: the server is shutting down"
                yield event("error", {"error": {"type": "api_error", "message": msg}})
                return
    finally:
        job.cancel.set()
