"""What a chat reply holds besides its answer, split off as llama-server does: thoughts (`<think>` blocks,
`ReasoningSplitter`), tool calls in the Hermes / Qwen format (the chat template lists the tools, the model
answers with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, `ToolCallSplitter`), and
gpt-oss's harmony channels, which carry both (`HarmonySplitter`); `ReplySplitter` puts them together for a
request. The server returns them as OpenAI's `reasoning_content` and `tool_calls`.

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


def is_harmony(template: str | None) -> bool:
    """gpt-oss's chat template: replies come in harmony's channels."""
    return bool(template) and "<|channel|>" in template


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (and must wait for more text)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


def template_takes_tools(template: str | None) -> str | None:
    """None when this chat template renders tools and asks for a format parsed here; else why not."""
    if not template or "tools" not in template:
        return "this model's chat template does not render tools"
    if OPEN not in template and not is_harmony(template):
        return (f"this model's chat template asks for a tool-call format other than {OPEN}...{CLOSE} "
                f"(Hermes / Qwen) or gpt-oss's harmony channels, the ones hybridmoe parses")
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
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": obj["name"], "arguments": args}})
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
        n = len(self.pending) - held_prefix(self.pending, OPEN)
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
            n = len(self.pending) - held_prefix(self.pending, THINK_CLOSE)
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


class HarmonySplitter:
    """gpt-oss's harmony replies: messages `<|channel|>CH[ to=functions.NAME][ <|constrain|>json]<|message|>BODY`
    closed by `<|end|>` (the next starts with `<|start|>assistant`), the last one by the end of generation
    (`<|return|>`, or `<|call|>` after a tool call). The analysis channel is reasoning, final (and commentary
    addressed to nobody) is content, commentary to `functions.NAME` is a tool call when tools were given. A
    reply that does not start as a harmony message is all content."""

    _CLOSE = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")

    def __init__(self, tools: bool):
        self.tools = tools
        self.state = "first"             # first: the reply's first characters; header; body; plain
        self.header = self.pending = ""
        self.kind = "text"               # where the current body goes: "reasoning", "text" or "call"
        self.call = None                 # [name, arguments] of the call being read
        self.calls: list[dict] = []

    def _open(self):
        ch = re.search(r"<\|channel\|>\s*(\w+)", self.header)
        to = re.search(r"\bto=([^\s<]+)", self.header)
        channel = ch.group(1) if ch else "final"
        if self.tools and to and to.group(1).startswith("functions."):
            self.kind, self.call = "call", [to.group(1)[len("functions."):], ""]
        else:
            self.kind = "reasoning" if channel == "analysis" else "text"
        self.header, self.state = "", "body"

    def _close(self):
        if self.call is not None:
            self.calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                               "function": {"name": self.call[0], "arguments": self.call[1].strip()}})
            self.call = None
        self.state = "header"

    def _emit(self, out, piece):
        if not piece:
            return
        if self.kind == "call":
            self.call[1] += piece
        else:
            out.append((self.kind, piece))

    def feed(self, text: str) -> list[tuple[str, str]]:
        out = []
        self.pending += text
        while self.pending:
            if self.state == "first":
                if any(t.startswith(self.pending) for t in ("<|channel|>", "<|start|>", " to=")):
                    return out                                   # too short to tell yet
                harmony = self.pending.startswith(("<|channel|>", "<|start|>", " to="))
                self.state = "header" if harmony else "plain"
            elif self.state == "plain":
                out.append(("text", self.pending))
                self.pending = ""
            elif self.state == "header":
                self.header += self.pending
                i = self.header.find("<|message|>")
                if i < 0:
                    self.pending = ""
                    return out
                self.header, self.pending = self.header[:i], self.header[i + len("<|message|>"):]
                self._open()
            else:                                                # body
                hits = [(i, t) for t in self._CLOSE if (i := self.pending.find(t)) >= 0]
                if hits:
                    i, tag = min(hits)
                    self._emit(out, self.pending[:i])
                    self.pending = self.pending[i + (0 if tag == "<|start|>" else len(tag)):]
                    self._close()
                    continue
                keep = max(held_prefix(self.pending, t) for t in self._CLOSE)
                self._emit(out, self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return out
        return out

    def finish(self) -> list[tuple[str, str]]:
        out = []
        if self.state in ("first", "plain"):
            held, self.pending = self.pending, ""
            return [("text", held)] if held else []
        if self.state == "body":
            self._emit(out, self.pending)
            self.pending = ""
            self._close()
        elif self.header.strip() or self.pending:                 # a header with no message: keep its text
            out.append(("text", self.header + self.pending))
            self.header = self.pending = ""
        return out


class ReplySplitter:
    """A chat reply's text as it streams, split into ("text" | "reasoning", piece) parts to send now and, at the
    end, tool calls: gpt-oss's harmony channels, or <think> blocks (`reasoning`) and <tool_call> blocks
    (`tools`) in the text after them."""

    def __init__(self, *, tools: bool, reasoning: bool, think_opened: bool, harmony: bool):
        self.harmony = HarmonySplitter(tools) if harmony else None
        self.calls = ToolCallSplitter() if tools and not harmony else None
        self.first = self.harmony or (ReasoningSplitter(think_opened) if reasoning else None)
        self.tool_calls: list[dict] = []

    def _route(self, parts) -> list[tuple[str, str]]:
        out = []
        for kind, piece in parts:
            if kind == "text" and self.calls:
                piece = self.calls.feed(piece)
            if piece:
                out.append((kind, piece))
        return out

    def feed(self, text: str) -> list[tuple[str, str]]:
        return self._route(self.first.feed(text) if self.first else [("text", text)])

    def finish(self) -> list[tuple[str, str]]:
        """The parts still held; sets tool_calls."""
        out = self._route(self.first.finish()) if self.first else []
        if self.calls:
            text, self.tool_calls = self.calls.finish()
            if text:
                out.append(("text", text))
        elif self.harmony:
            self.tool_calls = self.harmony.calls
        return out
