"""Constrained decoding: replies that must be JSON, or JSON that a schema accepts (the server's
`response_format` and llama-server's `json_schema`), enforced token by token as the sampler picks them.

`JsonMachine` parses UTF-8 bytes incrementally with a stack of small frames whose state copies cheaply:
`feed(b)` says whether the bytes can continue the text so far toward a value the schema accepts, and
`can_end()` whether the text is such a value already. tokens.TokenConstraint puts it between the sampler and
the vocabulary: a token is allowed if a copy of the machine takes its bytes, an end-of-generation token only
once the value is complete. The sampler (generate.Sampler) samples as usual and redraws on a refused
token, so a model that keeps to the format pays one check a token, not a pass over the vocabulary.

The schemas it enforces, and the SchemaError for others: json_schema.py.
"""
from __future__ import annotations

import bisect
import json

from .json_schema import (
    BY_NAME,
    KIND_START,
    MAX_DEPTH,
    MAX_NUMBER,
    ORDERED,
    _patterns,
    _Schemas,
    check_schema,
)

WS = frozenset(b" \t\n\r")
MAX_INDENT = 20       # whitespace between tokens is llama.cpp's: one space, or a newline and at most 20 spaces or
                      # tabs (a model stuck on whitespace has to go on)
REGEX_TIMEOUT_S = 0.05  # one pattern check at most
DIGITS = frozenset(b"0123456789")
REFEED = 2            # a frame's step result: it ended without taking the byte, which goes to its parent


def _literals(values) -> tuple[bytes, ...]:
    """The texts a value of an enum / const may be written as: compact, and with json.dumps' spaces."""
    out = []
    for v in values:
        for sep in ((",", ":"), (", ", ": ")):
            out.append(json.dumps(v, ensure_ascii=False, separators=sep).encode())
    return tuple(dict.fromkeys(out))


# ----------------------------------------------------------------------------------------------- frames

def _ws(state: int, c: int) -> int:
    """Whitespace between tokens: the run's state after byte c (0: none yet, 1: one space, 2 + k: a newline
    and k spaces or tabs), or -1 if c may not go on the run."""
    if state == 0:
        return 1 if c == 0x20 else 2 if c == 0x0A else -1
    return state + 1 if state >= 2 and c in (0x20, 0x09) and state - 2 < MAX_INDENT else -1

# Each frame takes bytes through step(c, m) -> True (taken), False (refused) or REFEED; a frame that
# completes calls m.pop(value). Frame state is plain immutable values, so a shallow copy is a full copy.

class _Frame:
    __slots__ = ()

    def clone(self):
        c = object.__new__(type(self))
        for k in self.__slots__:
            setattr(c, k, getattr(self, k))
        return c

    def can_finish(self) -> bool:       # could end right here, with no more bytes (numbers, literals)
        return False

    def child_done(self, value, m):
        pass


class _Value(_Frame):
    """Any value of `schema`, after optional whitespace; becomes the frame of the kind its first byte opens.
    by_prefix: the schema is chosen by the header literal before the value (JsonMachine.choice)."""
    __slots__ = ("schema", "ws", "by_prefix")

    def __init__(self, schema, by_prefix=None):
        self.schema, self.ws, self.by_prefix = schema, 0, by_prefix

    def child_done(self, value, m):
        if self.by_prefix is not None:                   # the header chose the schema (its own document)
            self.schema = self.by_prefix[value]
            m.schemas = _Schemas(self.schema)

    def step(self, c, m):
        if c in WS:
            self.ws = _ws(self.ws, c)
            return self.ws >= 0
        f = m.open(self.schema, c)
        if f is None or (isinstance(f, _Container) and len(m.stack) > MAX_DEPTH + 1):    # root + levels + this
            return False
        m.stack[-1] = f
        return REFEED


class _Root(_Frame):
    """Under the value: after it, whitespace, the suffix (if any), whitespace."""
    __slots__ = ("done", "ws", "suffix", "got")

    def __init__(self, suffix=b""):
        self.done, self.ws, self.suffix, self.got = False, 0, suffix, 0

    def finished(self) -> bool:
        return self.done and self.got == len(self.suffix)

    def child_done(self, value, m):
        self.done = True

    def step(self, c, m):               # only reached after the value
        if self.got < len(self.suffix) and c == self.suffix[self.got]:
            self.got += 1
            self.ws = 0
            return True
        if c not in WS or 0 < self.got < len(self.suffix):
            return False
        self.ws = _ws(self.ws, c)
        return self.ws >= 0


class _Container(_Frame):
    """Objects and arrays (s: their schema, a dict): the opening bracket first, whitespace between tokens."""
    __slots__ = ()
    OPEN = 0

    def _lead(self, c):
        """True or False when c is the opening bracket or whitespace; None when it is a token of the body."""
        if self.state == 0:
            self.state = 1
            return c == self.OPEN
        if c in WS:
            self.ws = _ws(self.ws, c)
            return self.ws >= 0
        self.ws = 0
        return None


class _Object(_Container):
    # state 0: '{' next; 1: a key or '}'; 2: a key (after ','); 3: ':'; 4: ',' or '}' (after a value)
    __slots__ = ("s", "state", "seen", "key", "ws", "name")

    def __init__(self, s):
        self.s, self.state, self.seen, self.key, self.ws, self.name = s, 0, frozenset(), None, 0, None

    OPEN = 0x7B

    def _props(self):
        return self.s.get("properties", {})

    def _closed(self):
        return self.s.get("additionalProperties", True) is False

    def step(self, c, m):
        r = self._lead(c)
        if r is not None:
            return r
        if self.state in (1, 2) and c == 0x22:
            names = [k.encode() for k in self._props() if k.encode() not in self.seen]
            if self.s.get(ORDERED):
                names = names[:1]
            if self._closed() and not names:
                return False
            m.stack.append(_String(allowed=tuple(names) if self._closed() else None, exclude=self.seen, keep=True))
            return REFEED
        if self.state == 3:
            if c != 0x3A:
                return False
            self.state = 4
            vs = self._value_schema(self.key)
            if self.key == b"arguments" and BY_NAME in self.s:    # a function's parameters: their own document
                m.schemas = _Schemas(vs)                           # ($ref into their $defs)
            m.stack.append(_Value(vs))
            return True
        if c == 0x7D and self.state in (1, 4):
            if any(r.encode() not in self.seen for r in self.s.get("required", [])):
                return False
            m.pop(None)
            return True
        if c == 0x2C and self.state == 4:
            if self._closed() and all(k.encode() in self.seen for k in self._props()):
                return False
            self.state = 2
            return True
        return False

    def _value_schema(self, key: bytes):
        props = self._props()
        name = key.decode("utf-8", "surrogatepass")
        if name == "arguments" and BY_NAME in self.s and self.name is not None:
            return self.s[BY_NAME][json.loads(self.name)]
        if name in props:
            return props[name]
        return self.s.get("additionalProperties", True)

    def child_done(self, value, m):
        if self.state in (1, 2):        # the key
            self.key, self.seen, self.state = value, self.seen | {value}, 3
        elif self.key == b"name":       # its value's text (a literal of an enum)
            self.name = value


class _Array(_Container):
    # state 0: '[' next; 1: a value or ']'; 2: a value (after ','); 4: ',' or ']'
    __slots__ = ("s", "state", "n", "ws")

    def __init__(self, s):
        self.s, self.state, self.n, self.ws = s, 0, 0, 0

    OPEN = 0x5B

    def _get(self, k, default):
        return self.s.get(k, default)

    def _max(self):
        hi = self._get("maxItems", None)
        if self._get("items", True) is False:
            n = len(self._get("prefixItems", []))
            hi = n if hi is None else min(hi, n)
        return hi

    def step(self, c, m):
        r = self._lead(c)
        if r is not None:
            return r
        if self.state in (1, 4) and c == 0x5D:
            if self.n < self._get("minItems", 0):
                return False
            m.pop(None)
            return True
        if self.state == 4:
            if c != 0x2C or (self._max() is not None and self.n >= self._max()):
                return False
            self.state = 2
            return True
        if self._max() is not None and self.n >= self._max():
            return False
        prefix = self._get("prefixItems", [])
        item = prefix[self.n] if self.n < len(prefix) else self._get("items", True)
        self.n += 1
        self.state = 4
        m.stack.append(_Value(item))
        return REFEED


_UTF8_SECOND = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
_ESC = {ord('"'): b'"', ord("\\"): b"\\", ord("/"): b"/", ord("b"): b"\b", ord("f"): b"\f", ord("n"): b"\n",
        ord("r"): b"\r", ord("t"): b"\t"}
_HEX = frozenset(b"0123456789abcdefABCDEF")


class _String(_Frame):
    """A JSON string; its decoded bytes are kept when they must be one of `allowed` or none of `exclude`."""
    # state 0: '"' next; 1: content; 2: after '\'; 3: in \uXXXX
    __slots__ = ("allowed", "exclude", "lo", "hi", "pats", "state", "buf", "hexd", "n", "keep", "cont", "nxt")

    def __init__(self, allowed=None, exclude=frozenset(), lo=0, hi=None, keep=False, pats=()):
        self.allowed, self.exclude, self.lo, self.hi, self.pats = allowed, exclude, lo, hi, pats
        self.state, self.buf, self.hexd, self.n, self.cont, self.nxt = 0, b"", b"", 0, 0, (0x80, 0xBF)
        self.keep = keep or allowed is not None or bool(exclude) or bool(pats)

    def _matches(self, partial: bool, extra: bytes = b"") -> bool:
        """Does the text so far (and `extra`) match every pattern (partial: can it still, once more follows)?"""
        text = (self.buf + extra).decode("utf-8", "ignore")   # a character still arriving counts once complete
        try:                                           # untrusted patterns: a slow one refuses, never hangs
            return all(p.search(text, partial=partial, timeout=REGEX_TIMEOUT_S) is not None for p in self.pats)
        except TimeoutError:
            return False

    def _full(self) -> bool:            # maxLength reached: only the closing quote may come
        return self.hi is not None and self.n >= self.hi

    def _escape_fits(self) -> bool:
        """Can a backslash continue this string? When it must be one of a few values or match a pattern, only
        if some escaped character keeps it on track (no \\u there: its character comes too late to judge)."""
        k = len(self.buf)
        for b in _ESC.values():
            if self.allowed is not None and not any(a[k:k + 1] == b and a.startswith(self.buf) for a in self.allowed):
                continue
            if self.pats and not self._matches(partial=True, extra=b):
                continue
            return True
        return False

    def _add(self, b: bytes, chars: int) -> bool:
        self.n += chars
        if self.hi is not None and self.n > self.hi:
            return False
        if self.keep:
            self.buf += b
            if self.allowed is not None and not any(a.startswith(self.buf) for a in self.allowed):
                return False
            if self.pats and not self._matches(partial=True):
                return False
        return True

    def step(self, c, m):
        st = self.state
        if st == 0:
            self.state = 1
            return c == 0x22
        if st == 1:
            if self.cont:               # inside a UTF-8 sequence: continuation bytes only (valid UTF-8:
                lo, hi = self.nxt       # no overlong forms, surrogates or code points past U+10FFFF)
                self.cont, self.nxt = self.cont - 1, (0x80, 0xBF)
                return lo <= c <= hi and self._add(bytes((c,)), 0)
            if c == 0x22:
                if self.n < self.lo or (self.keep and (self.buf in self.exclude or
                                                       (self.allowed is not None and self.buf not in self.allowed)
                                                       or (self.pats and not self._matches(partial=False)))):
                    return False
                m.pop(self.buf)
                return True
            if c < 0x20 or self._full() or 0x80 <= c < 0xC2 or c > 0xF4:
                return False
            if c == 0x5C:
                self.state = 2
                return self._escape_fits()
            self.cont = 0 if c < 0x80 else 1 if c < 0xE0 else 2 if c < 0xF0 else 3
            self.nxt = _UTF8_SECOND.get(c, (0x80, 0xBF))
            return self._add(bytes((c,)), 1)
        if st == 2:
            if c == 0x75:               # not in a string that must be one of a few or match a pattern
                self.state, self.hexd = 3, b""
                return self.allowed is None and not self.pats
            self.state = 1
            if c not in _ESC:
                return False
            return self._add(_ESC[c], 1)
        if c not in _HEX:
            return False
        self.hexd += bytes((c,))
        if len(self.hexd) < 4:
            return True
        self.state = 1
        return self._add(chr(int(self.hexd, 16)).encode("utf-8", "surrogatepass"), 1)


# number DFA: state -> {byte class: next}; terminal states end a number
_NUM = {0: {"-": 1, "0": 2, "d": 3}, 1: {"0": 2, "d": 3}, 2: {".": 4, "e": 6}, 3: {"d": 3, "0": 3, ".": 4, "e": 6},
        4: {"d": 5, "0": 5}, 5: {"d": 5, "0": 5, "e": 6}, 6: {"-": 7, "+": 7, "d": 8, "0": 8}, 7: {"d": 8, "0": 8},
        8: {"d": 8, "0": 8}}
_NUM_END = frozenset({2, 3, 5, 8})


def _num_class(c: int) -> str:
    return ("0" if c == 0x30 else "d" if c in DIGITS else "-" if c == 0x2D else "+" if c == 0x2B
            else "." if c == 0x2E else "e" if c in (0x65, 0x45) else "")


class _Number(_Frame):
    """A JSON number (integer: no fraction or exponent). With bounds there is no exponent either, so the
    digits only move the value away from 0 and a number that has left the range is refused right there."""
    __slots__ = ("bounds", "integer", "state", "buf")

    def __init__(self, s, integer):
        s = s if isinstance(s, dict) else {}
        inf = float("inf")
        self.bounds = (s.get("minimum", -inf), s.get("exclusiveMinimum", -inf), s.get("maximum", inf),
                       s.get("exclusiveMaximum", inf))
        self.integer, self.state, self.buf = integer, 0, b""

    def can_finish(self):
        return self.state in _NUM_END and self._in_range(float(self.buf))

    def _in_range(self, v: float) -> bool:
        lo, lo_x, hi, hi_x = self.bounds
        return lo <= v <= hi and (lo_x == -float("inf") or v > lo_x) and (hi_x == float("inf") or v < hi_x)

    def _reachable(self, v: float) -> bool:
        lo, lo_x, hi, hi_x = self.bounds
        return not ((v > 0 and (v > hi or v >= hi_x)) or (v < 0 and (v < lo or v <= lo_x)))

    def step(self, c, m):
        cls = _num_class(c)
        nxt = _NUM[self.state].get(cls)
        bounded = self.bounds != (-float("inf"), -float("inf"), float("inf"), float("inf"))
        if (nxt is not None and len(self.buf) < MAX_NUMBER and not (cls == "." and self.integer)
                and not (cls == "e" and (self.integer or bounded))):
            buf = self.buf + bytes((c,))
            if nxt in (3, 5) and not self._reachable(float(buf)):
                return False
            self.state, self.buf = nxt, buf
            return True
        if self.can_finish():
            m.pop(self.buf)
            return REFEED
        return False


class _Union(_Frame):
    """A value of anyOf / oneOf alternatives that begin alike (two objects, say): each alternative runs in
    a machine of its own over the same bytes, those that refuse a byte drop out, and the value ends where
    the ones still alive end it."""
    __slots__ = ("subs",)

    def __init__(self, subs):
        self.subs = subs

    def can_finish(self):
        return any(sub.can_end() for sub in self.subs)

    def step(self, c, m):
        taken, ended = [], False
        for sub in self.subs:
            s2 = sub.clone()
            r = s2.feed1(c)
            if r == 1:
                taken.append(s2)
            ended |= r == 2
        if taken:
            self.subs = tuple(taken)
            if all(len(t.stack) == 1 for t in taken):    # the byte closed the value in all of them
                m.pop(None)
            return True
        if ended:                                        # the value ended before this byte
            m.pop(None)
            return REFEED
        return False


class _Literal(_Frame):
    """One of a few fixed texts (true, false, null, an enum's values; header: text before the value, which
    control tokens may spell). `options` is sorted, so the texts a prefix begins are found by bisection
    (an enum may have thousands)."""
    __slots__ = ("options", "buf", "header")

    def __init__(self, options, header=False):
        self.options, self.buf, self.header = options, b"", header

    def _has(self, text: bytes) -> bool:
        i = bisect.bisect_left(self.options, text)
        return i < len(self.options) and self.options[i] == text

    def can_finish(self):
        return self._has(self.buf)

    def step(self, c, m):
        nb, opts = self.buf + bytes((c,)), self.options
        i = bisect.bisect_left(opts, nb)                  # the first text that nb begins, if any
        if i < len(opts) and opts[i].startswith(nb):
            self.buf = nb
            if opts[i] == nb and not (i + 1 < len(opts) and opts[i + 1].startswith(nb)):
                m.pop(nb)                                 # complete, and no longer text goes on from it
            return True
        if self._has(self.buf):
            m.pop(self.buf)
            return REFEED
        return False


# ---------------------------------------------------------------------------------------------- machine

class JsonMachine:
    """Incremental check of UTF-8 bytes against a JSON schema (True: any JSON value)."""

    def __init__(self, schema=True, prefix: bytes = b"", suffix: bytes = b""):
        """prefix, suffix: fixed text before the value (nothing between) and after it (whitespace between)."""
        check_schema(schema)
        self.schemas = _Schemas(schema)
        self.stack: list[_Frame] = [_Root(suffix), _Value(schema)] + ([_Literal((prefix,))] if prefix else [])

    @classmethod
    def choice(cls, options: dict[bytes, object]) -> "JsonMachine":
        """One of several fixed headers, each followed by a value of its own schema (gpt-oss's tool calls:
        the header names the function, the arguments follow its parameters)."""
        for schema in options.values():
            check_schema(schema)
        m = object.__new__(cls)
        m.schemas = _Schemas({})
        m.stack = [_Root(), _Value(True, by_prefix=dict(options)), _Literal(tuple(sorted(options)), header=True)]
        return m

    def _sub(self, schema) -> "JsonMachine":
        """A machine for one value of `schema` in this document (an alternative of a _Union)."""
        m = object.__new__(JsonMachine)
        m.schemas, m.stack = self.schemas, [_Root(), _Value(schema)]
        return m

    def feed1(self, c: int) -> int:
        """One byte into a _Union's alternative: 1 taken, 0 refused, 2 its value had ended before c."""
        while True:
            if len(self.stack) == 1:
                return 2 if self.stack[0].done else 0
            r = self.stack[-1].step(c, self)
            if r != REFEED:
                return 1 if r else 0

    def in_header(self) -> bool:
        top = self.stack[-1]
        return isinstance(top, _Literal) and top.header

    def clone(self) -> "JsonMachine":
        m = object.__new__(JsonMachine)
        m.schemas, m.stack = self.schemas, [f.clone() for f in self.stack]
        return m

    def feed(self, data: bytes) -> bool:
        """Take `data`; False if it cannot continue the text toward an accepted value (the machine is then
        spent: check on a clone first)."""
        for c in data:
            while True:
                r = self.stack[-1].step(c, self)
                if r == REFEED:
                    continue
                if not r:
                    return False
                break
        return True

    def accepts(self, data: bytes) -> bool:
        """Can `data` (a token's bytes) continue the text? A string with a pattern may not be left inside a
        UTF-8 character: the pattern cannot judge it until it is complete, and might refuse every ending."""
        m = self.clone()
        if not m.feed(data):
            return False
        top = m.stack[-1]
        return not (isinstance(top, _String) and top.pats and top.cont)

    # TokenConstraint's token interface, as GrammarMachine has it (a schema never names a token): a token is
    # its bytes, and a control token outside a header (chars=False) is never accepted
    def accepts_token(self, t: int, piece: bytes, chars: bool = True) -> bool:
        return chars and bool(piece) and self.accepts(piece)

    def feed_token(self, t: int, piece: bytes, chars: bool = True) -> bool:
        return self.feed(piece)

    def token_tops(self) -> tuple[set, bool]:
        return set(), False

    def can_end(self) -> bool:
        """Is the text so far a complete value the schema accepts?"""
        m = self.clone()
        while len(m.stack) > 1:
            top = m.stack[-1]
            if not top.can_finish():
                return False
            m.pop(getattr(top, "buf", None))
        return m.stack[0].finished()

    def pop(self, value):
        self.stack.pop()
        self.stack[-1].child_done(value, self)

    def _literal_options(self, s: dict) -> dict[bytes, tuple[bytes, ...]]:
        """An enum's or const's texts by their first byte, written once per schema document (not each time a
        value may start: a big enum written for every token tried cost seconds a token)."""
        values = s["const"] if "const" in s else s["enum"]
        key = ("const" in s, id(values))
        hit = self.schemas.literals.get(key)
        if hit is None:
            by_first: dict[bytes, list] = {}
            for o in _literals([values] if "const" in s else values):
                by_first.setdefault(o[:1], []).append(o)
            hit = self.schemas.literals[key] = (values, {k: tuple(sorted(v)) for k, v in by_first.items()})
        return hit[1]                                   # (the values are kept, so their id stays theirs)

    def open(self, schema, c: int):
        """The frame for a value of `schema` that starts with byte c, or None."""
        s = self.schemas.resolve(schema)
        if s is False:
            return None
        if isinstance(s, dict) and ("const" in s or "enum" in s):
            opts = self._literal_options(s).get(bytes((c,)))
            return _Literal(opts) if opts else None
        if isinstance(s, dict) and ("anyOf" in s or "oneOf" in s):
            alts = [a for a in s.get("anyOf", s.get("oneOf"))
                    if any(c in KIND_START[k] for k in self.schemas.kinds(self.schemas.resolve(a)))]
            if len(alts) > 1:                            # alike from their first character: all at once
                return _Union(tuple(self._sub(a) for a in alts))
            return self.open(alts[0], c) if alts else None
        kinds = self.schemas.kinds(s)
        d = s if isinstance(s, dict) else {}
        if c == 0x7B and "object" in kinds:
            return _Object(d)
        if c == 0x5B and "array" in kinds:
            return _Array(d)
        if c == 0x22 and "string" in kinds:
            return _String(lo=d.get("minLength", 0), hi=d.get("maxLength"), pats=_patterns(d))
        if c in KIND_START["number"] and kinds & {"number", "integer"}:
            return _Number(d, integer="number" not in kinds)
        if c in b"tf" and "boolean" in kinds:
            return _Literal((b"false", b"true"))
        if c == 0x6E and "null" in kinds:
            return _Literal((b"null",))
        return None

