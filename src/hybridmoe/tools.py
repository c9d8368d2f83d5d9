"""Tool calls in the Hermes / Qwen format: the chat template lists the tools, the model answers with
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, which the server returns as OpenAI
`tool_calls` (llama-server does the same for these models).

`ToolCallSplitter` sits after the stop-sequence matcher: text before the first `<tool_call>` streams as it
comes; from there on it is held back and parsed when the generation ends. A block that is not valid JSON with
a string `name` makes the whole held text plain content again, so nothing the model wrote is lost.
"""
from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)


def template_takes_tools(template: str | None) -> str | None:
    """None when this chat template renders tools and asks for the format parsed here; else why not."""
    if not template or "tools" not in template:
        return "this model's chat template does not render tools"
    if OPEN not in template:
        return (f"this model's chat template asks for a tool-call format other than {OPEN}...{CLOSE} "
                f"(the Hermes / Qwen format, the one hybridmoe parses)")
    return None


def parse_tool_calls(text: str) -> tuple[str, list[dict]] | None:
    """(the text outside the blocks, OpenAI tool_calls) of `text`, which starts at a `<tool_call>`; None when
    a block is not a call (then all of `text` is content)."""
    calls, rest, end = [], [], 0
    for m in _BLOCK.finditer(text):
        rest.append(text[end:m.start()])
        end = m.end()
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
    rest.append(text[end:])
    return ("".join(rest).strip(), calls) if calls else None


class ToolCallSplitter:
    def __init__(self):
        self.held = None          # the text from the first <tool_call> on, once it has come
        self.pending = ""         # a tail that may be the start of <tool_call>

    def feed(self, text: str) -> str:
        """The part of `text` that is safe to send now."""
        if self.held is not None:
            self.held += text
            return ""
        self.pending += text
        i = self.pending.find(OPEN)
        if i >= 0:
            out, self.held, self.pending = self.pending[:i], self.pending[i:], ""
            return out
        keep = next((k for k in range(min(len(OPEN) - 1, len(self.pending)), 0, -1)
                     if self.pending.endswith(OPEN[:k])), 0)
        n = len(self.pending) - keep
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(text still to send, the tool calls) at the end of the generation."""
        if self.held is None:
            out, self.pending = self.pending, ""
            return out, []
        held, self.held = self.held, None
        parsed = parse_tool_calls(held)
        if parsed is None:
            return held, []
        return parsed


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


class ReasoningSplitter:
    """llama-server's reasoning format "deepseek": a reply that starts with `<think>` (or whose prompt opened
    one) has its thoughts split off as `reasoning_content`; what follows `</think>` is the content. The
    whitespace right after either tag is dropped."""

    def __init__(self, opened: bool):
        self.state = "inside" if opened else "start"
        self.pending = ""
        self.strip = opened

    def feed(self, text: str) -> list[tuple[str, str]]:
        """("reasoning" | "text", piece) pairs that are safe to send now."""
        out = []
        self.pending += text
        while self.pending:
            if self.state == "start":                    # before anything but whitespace
                s = self.pending.lstrip()
                if THINK_OPEN.startswith(s):              # maybe the tag, not complete yet
                    return out
                if s.startswith(THINK_OPEN):
                    self.pending, self.state, self.strip = s[len(THINK_OPEN):], "inside", True
                else:
                    self.state = "after"
                continue
            if self.strip:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    return out
                self.strip = False
            if self.state == "after":
                out.append(("text", self.pending))
                self.pending = ""
                return out
            i = self.pending.find(THINK_CLOSE)
            if i >= 0:
                if i:
                    out.append(("reasoning", self.pending[:i]))
                self.pending, self.state, self.strip = self.pending[i + len(THINK_CLOSE):], "after", True
                continue
            n = len(self.pending) - _held_prefix(self.pending, THINK_CLOSE)
            if n:
                out.append(("reasoning", self.pending[:n]))
            self.pending = self.pending[n:]
            return out
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is still held at the end (an unfinished thought stays reasoning)."""
        held, self.pending = self.pending, ""
        if not held or (self.strip and not held.strip()):
            return []
        return [("reasoning" if self.state == "inside" else "text", held)]
