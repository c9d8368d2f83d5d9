"""The token-level constraint that drives sampling: a JsonMachine (or a grammar.GrammarMachine) over a
tokenizer's vocabulary, optionally after a trigger (the end of a thinking block, gpt-oss's final channel);
and the schemas / headers of tool calls that such a constraint enforces.
"""
from __future__ import annotations

import re
import weakref

import torch

from ..text.replies import THINK_CLOSE
from .json_machine import JsonMachine
from .json_schema import BY_NAME, ORDERED


def harmony_calls(tools: list[dict], names: list[str]) -> dict[bytes, object]:
    """gpt-oss's tool call headers for `names` (each followed by that function's arguments, then <|call|>)."""
    return {f"<|channel|>commentary to=functions.{t['function']['name']} <|constrain|>json<|message|>".encode():
            t["function"].get("parameters") or {"type": "object"} for t in tools if t["function"]["name"] in names}


def tool_call_schema(tools: list[dict], names: list[str]) -> dict:
    """The schema of one Hermes / Qwen tool call, {"name": ..., "arguments": ...}, to one of `names` (the
    request's tools: OpenAI's {"type": "function", "function": {"name": ..., "parameters": ...}})."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
              for t in tools if t["function"]["name"] in names}
    return {"type": "object", ORDERED: True, "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"enum": list(params)}, "arguments": {"type": "object"}}, BY_NAME: params}


_FIRST_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()      # tokenizer -> first bytes
THINK_END = re.compile(re.escape(THINK_CLOSE.encode()))
HARMONY_FINAL = re.compile(rb"<\|channel\|>final[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>")


class TokenConstraint:
    """A JsonMachine over a tokenizer's vocabulary (generate.Sampler asks `allows` and calls `accept`).

    trigger: a bytes regex after whose first match the constraint starts (THINK_END when the prompt opened
    a thinking block, HARMONY_FINAL for gpt-oss's final channel); until then every token is allowed."""

    def __init__(self, machine: JsonMachine, tokenizer, eog_ids, trigger: re.Pattern | None = None, ends=None):
        """ends: the end-of-generation tokens that may end this reply (default: all of eog_ids)."""
        self.m, self.tok, self.eog = machine, tokenizer, frozenset(eog_ids)
        self.ends = self.eog if ends is None else frozenset(ends)
        self.trigger, self.active, self.before = trigger, trigger is None, b""
        self._piece = tokenizer.piece_bytes                 # (the tokenizer caches them)

    def _first_bytes(self) -> torch.Tensor:
        """Each token's first byte (256: none), for best()'s prefilter; computed once per tokenizer."""
        first = _FIRST_BYTES.get(self.tok)
        if first is None:
            first = _FIRST_BYTES[self.tok] = torch.tensor(
                [p[0] if (p := self._piece(t)) else 256 for t in range(self.tok.n_vocab)], dtype=torch.long)
        return first

    def best(self, logits: torch.Tensor) -> int:
        """The most likely token allowed (when the sampled candidates all failed): only tokens whose first
        byte the machine takes are checked, in the order of their logits; an end-of-generation token when
        the machine allows none (then the reply ends, as it must)."""
        if not self.active:
            return int(torch.argmax(logits))
        ok = torch.zeros(257, dtype=torch.bool)
        ok[[b for b in range(256) if self.m.accepts(bytes((b,)))]] = True
        cand = ok[self._first_bytes()]
        ids, negated = self.m.token_tops()
        if negated:                                  # a grammar's !<token>: almost any token
            cand[:] = True
        cand[[t for t in ids if t < cand.numel()]] = True  # a grammar's <token>: that one, whatever its text
        cand &= logits > float("-inf")
        eog = [t for t in self.ends if t < logits.numel()]
        if eog and self.m.can_end():
            cand[eog] = True
        ids = cand.nonzero().flatten()
        for t in ids[torch.argsort(logits[ids].float(), descending=True)].tolist():
            if self.allows(t):
                return t
        return min(self.ends or self.eog) if self.eog else int(torch.argmax(logits))

    def allows(self, t: int) -> bool:
        if not self.active:
            return True
        if t in self.eog:
            return t in self.ends and self.m.can_end()
        chars = not self.tok.is_control(t) or self.m.in_header()      # control tokens spell headers only,
        return self.m.accepts_token(t, self._piece(t), chars)          # or what a grammar names by token

    def accept(self, t: int):
        if self.active:
            if t not in self.eog:
                self.m.feed_token(t, self._piece(t), not self.tok.is_control(t) or self.m.in_header())
            return
        self.before += self._piece(t)
        hit = self.trigger.search(self.before)
        if hit:
            self.active = True
            self.m.feed(self.before[hit.end():])
        else:
            self.before = self.before[-256:]
