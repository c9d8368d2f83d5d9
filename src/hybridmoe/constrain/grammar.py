"""GBNF grammars (llama.cpp's `grammar`, `--grammar`, `--grammar-file`) as a constraint on the reply.

    root   ::= answer "\\n"
    answer ::= "yes" | "no" | [0-9]+ ("." [0-9]{1,2})?

A grammar is rules of alternatives of sequences: "literals" (escapes \\n \\r \\t \\\\ \\" \\xHH \\uHHHH
\\UHHHHHHHH), [character classes] and [^negated ones], `.` (any character), rule names, ( groups ), and the
repetitions * + ? {m} {m,} {m,n}; `#` starts a comment; a rule's alternatives stay on its line unless inside
parentheses. `root` is where the reply starts. Tokens, as llama.cpp has them: `<[id]>` is the token of that id
and `<think>` the single token whose text that is (special tokens included), each matching one whole token;
`!<[id]>` and `!<think>` match any one token but that one. They are resolved against a vocabulary
(`Grammar.bind`, GrammarMachine(grammar, tokenizer)) and matched by `feed_token`.

`GrammarMachine` matches UTF-8 bytes with the same interface as constrain.JsonMachine (feed, accepts,
can_end, clone), so TokenConstraint and the sampler use either: its state is the set of parse stacks that
are still alive (each a tuple of positions in the rules, top last), immutable, so a copy is free. A
character is checked against each stack's top; rule references expand when they come to the top. Left
recursion, rules that are used but not defined, and bad syntax are refused with the line and column.
"""
from __future__ import annotations

MAX_RULES = 4096          # rules after expanding repetitions
MAX_STACKS = 2048         # live parse stacks (an ambiguous grammar beyond this is refused there)
MAX_STACK_DEPTH = 256
MAX_REPEAT = 1024         # the largest m or n of {m,n}
ANY = ((0, 0x10FFFF),)


class GrammarError(ValueError):
    """A grammar that does not parse, or that this module cannot run."""


class _Parser:
    """Text -> rules: list of alternatives, each a list of elements ("c", ranges, negated) or ("r", rule)."""

    def __init__(self, text: str):
        self.s, self.i = text, 0
        self.names: dict[str, int] = {}
        self.rules: list[list[list[tuple]] | None] = []
        self.used: dict[str, int] = {}              # name -> position of a use (for the error)

    def error(self, msg: str, at: int | None = None):
        at = self.i if at is None else at
        line = self.s.count("\n", 0, at) + 1
        col = at - (self.s.rfind("\n", 0, at) + 1) + 1
        raise GrammarError(f"grammar line {line}, column {col}: {msg}")

    def rule_id(self, name: str) -> int:
        if name not in self.names:
            self.names[name] = len(self.rules)
            self.rules.append(None)
        return self.names[name]

    def new_rule(self, alts) -> int:
        if len(self.rules) >= MAX_RULES:
            self.error(f"more than {MAX_RULES} rules once repetitions are expanded")
        self.rules.append(alts)
        return len(self.rules) - 1

    def space(self, newlines: bool):
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c == "#":
                while self.i < len(s) and s[self.i] != "\n":
                    self.i += 1
            elif c in " \t\r" or (newlines and c == "\n"):
                self.i += 1
            else:
                break

    def name(self) -> str:
        j = self.i
        while self.i < len(self.s) and (self.s[self.i].isalnum() or self.s[self.i] in "-_"):
            self.i += 1
        if j == self.i:
            self.error("expected a rule name")
        return self.s[j:self.i]

    def parse(self):
        self.space(True)
        while self.i < len(self.s):
            at = self.i
            name = self.name()
            self.space(False)
            if not self.s.startswith("::=", self.i):
                self.error("expected '::=' after the rule name")
            self.i += 3
            self.space(True)
            rid = self.rule_id(name)
            if self.rules[rid] is not None:
                self.error(f"rule {name!r} is defined twice", at)
            self.rules[rid] = self.alternatives(nested=False)
            if self.i < len(self.s) and self.s[self.i] != "\n":
                self.error("expected the end of the rule (a newline)")
            self.space(True)
        for name, at in self.used.items():
            if self.rules[self.names[name]] is None:
                self.error(f"rule {name!r} is used but not defined", at)
        if "root" not in self.names:
            raise GrammarError("the grammar has no 'root' rule (where the reply starts)")
        return self.rules, self.names["root"]

    def alternatives(self, nested: bool):
        alts = [self.sequence(nested)]
        while self.i < len(self.s) and self.s[self.i] == "|":
            self.i += 1
            self.space(True)
            alts.append(self.sequence(nested))
        return alts

    def sequence(self, nested: bool) -> list[tuple]:
        seq: list[tuple] = []
        while self.i < len(self.s):
            c = self.s[self.i]
            start = self.i
            if c == '"':
                self.i += 1
                items = []
                while True:
                    if self.i >= len(self.s) or self.s[self.i] == "\n":
                        self.error("unterminated string", start)
                    if self.s[self.i] == '"':
                        self.i += 1
                        break
                    cp = self.char()
                    items.append(("c", ((cp, cp),), False))
                if not items:                               # "" matches the empty string
                    self.space(nested)
                    continue
                last = len(seq)
                seq += items
            elif c == "[":
                self.i += 1
                neg = self.i < len(self.s) and self.s[self.i] == "^"
                self.i += neg
                ranges = []
                while True:
                    if self.i >= len(self.s) or self.s[self.i] == "\n":
                        self.error("unterminated character class", start)
                    if self.s[self.i] == "]" and (ranges or neg):
                        self.i += 1
                        break
                    lo = self.char()
                    hi = lo
                    if self.s.startswith("-", self.i) and not self.s.startswith("-]", self.i):
                        self.i += 1
                        hi = self.char()
                        if hi < lo:
                            self.error("a character range goes backwards", start)
                    ranges.append((lo, hi))
                last = len(seq)
                seq.append(("c", tuple(ranges), neg))
            elif c == ".":
                self.i += 1
                last = len(seq)
                seq.append(("c", ANY, False))
            elif c == "(":
                self.i += 1
                self.space(True)
                alts = self.alternatives(nested=True)
                if self.i >= len(self.s) or self.s[self.i] != ")":
                    self.error("expected ')'", start)
                self.i += 1
                last = len(seq)
                seq.append(("r", self.new_rule(alts)))
            elif c == "<" or (c == "!" and self.s.startswith("<", self.i + 1)):
                neg = c == "!"
                self.i += neg
                j = self.s.find(">", self.i)
                if j < 0 or "\n" in self.s[self.i:j]:
                    self.error("unterminated token reference <...>", start)
                body = self.s[self.i + 1:j]
                self.i = j + 1
                if body.startswith("[") and body.endswith("]"):
                    if not body[1:-1].isdigit():
                        self.error(f"bad token id <{body}>: write <[123]>", start)
                    key = int(body[1:-1])
                elif body:
                    key = f"<{body}>"                       # a token by its text, brackets included
                else:
                    self.error("empty token reference <>", start)
                last = len(seq)
                seq.append(("t", key, neg))
            elif c.isalnum() or c in "-_":
                name = self.name()
                self.used.setdefault(name, start)
                last = len(seq)
                seq.append(("r", self.rule_id(name)))
            elif c in "*+?{":
                if not seq:
                    self.error(f"{c!r} repeats nothing")
                seq[last:] = self.repeat(seq[last:])
                last = len(seq) - 1
            else:
                break
            self.space(nested)
        return seq

    def repeat(self, item: list[tuple]) -> list[tuple]:
        """The elements for `item` (the last primary) under the repetition operator at self.i."""
        c = self.s[self.i]
        self.i += 1
        if c == "{":
            j = self.s.find("}", self.i)
            if j < 0:
                self.error("unterminated {m,n}")
            body = self.s[self.i:j].replace(" ", "")
            self.i = j + 1
            lo_s, comma, hi_s = body.partition(",")
            try:
                lo = int(lo_s)
                hi = lo if not comma else (int(hi_s) if hi_s else None)
            except ValueError:
                self.error(f"bad repetition {{{body}}}")
            if lo < 0 or (hi is not None and hi < lo) or max(lo, hi or 0) > MAX_REPEAT:
                self.error(f"bad repetition {{{body}}} (0 <= m <= n <= {MAX_REPEAT})")
        else:
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        one = item if len(item) == 1 else [("r", self.new_rule([item]))]
        out = one * lo
        if hi is None:                                      # R ::= item R | ""
            rid = self.new_rule(None)
            self.rules[rid] = [one + [("r", rid)], []]
            return out + [("r", rid)]
        tail: list[tuple] = []                              # (item (item (...)?)?)? for hi - lo optionals
        for _ in range(hi - lo):
            tail = [("r", self.new_rule([one + tail, []]))]
        return out + tail

    def char(self) -> int:
        s = self.s
        if self.i >= len(s) or s[self.i] == "\n":
            self.error("unexpected end of line")
        c = s[self.i]
        if c != "\\":
            self.i += 1
            return ord(c)
        esc = s[self.i + 1:self.i + 2]
        simple = {"n": 10, "r": 13, "t": 9, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45, "^": 94, "/": 47}
        if esc in simple:
            self.i += 2
            return simple[esc]
        width = {"x": 2, "u": 4, "U": 8}.get(esc)
        digits = s[self.i + 2:self.i + 2 + (width or 0)]
        if width is None or len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
            self.error(f"bad escape \\{esc}")
        cp = int(digits, 16)
        if cp > 0x10FFFF:
            self.error(f"\\{esc}{digits} is beyond Unicode")
        self.i += 2 + width
        return cp


def _check_left_recursion(rules, root: int):
    """Refuse a rule that can reach itself before any character (it would expand forever)."""
    nullable = [False] * len(rules)
    changed = True
    while changed:
        changed = False
        for r, alts in enumerate(rules):
            if not nullable[r] and any(all(e[0] == "r" and nullable[e[1]] for e in alt) for alt in alts):
                nullable[r] = changed = True
    first = [set() for _ in rules]                       # rules reachable at the left edge
    for r, alts in enumerate(rules):
        for alt in alts:
            for e in alt:
                if e[0] != "r":
                    break
                first[r].add(e[1])
                if not nullable[e[1]]:
                    break
    for r in range(len(rules)):
        seen, todo = set(), list(first[r])
        while todo:
            q = todo.pop()
            if q == r:
                raise GrammarError("the grammar is left-recursive (a rule can reach itself before any character); "
                                   "rewrite it with repetition")
            if q not in seen:
                seen.add(q)
                todo += first[q]


def _matches(elem, cp: int) -> bool:
    kind, ranges, neg = elem
    return kind == "c" and any(lo <= cp <= hi for lo, hi in ranges) != neg


def _may_match(elem, lo: int, hi: int) -> bool:
    """Can the element match some code point in [lo, hi] (a UTF-8 character still arriving)?"""
    kind, ranges, neg = elem
    if kind != "c":
        return False
    if neg:
        return not any(a <= lo and hi <= b for a, b in ranges)
    return any(a <= hi and lo <= b for a, b in ranges)


class Grammar:
    """A parsed GBNF grammar."""

    def __init__(self, text: str):
        if not isinstance(text, str) or not text.strip():
            raise GrammarError("the grammar is empty")
        self.rules, self.root = _Parser(text).parse()
        _check_left_recursion(self.rules, self.root)
        self._expanded: dict[tuple, frozenset] = {}
        self.token_refs = {e[1] for alts in self.rules for alt in alts for e in alt if e[0] == "t"}

    def bind(self, tokenizer) -> "Grammar":
        """This grammar with its token references resolved to ids of `tokenizer`'s vocabulary (itself where it
        has none). A text must be one token (a special token's, or one the text encodes to whole); an id
        must be in the vocabulary; otherwise GrammarError."""
        for key in self.token_refs:
            if isinstance(key, int) and key >= tokenizer.n_vocab:
                raise GrammarError(f"token reference <[{key}]>: the vocabulary has {tokenizer.n_vocab} tokens")
        if all(isinstance(key, int) for key in self.token_refs):      # ids only (or bound already): as it is
            return self
        ids = {}
        for key in self.token_refs:
            if isinstance(key, int):
                ids[key] = key
                continue
            t = tokenizer.token_to_id(key)
            if t is None:
                enc = tokenizer.encode(key, add_special=False, parse_special=True)
                t = enc[0] if len(enc) == 1 else None
            if t is None:
                raise GrammarError(f"token reference {key}: not one token of this model's vocabulary; "
                                   f"give its id as <[id]> or spell it as a \"string\"")
            ids[key] = t
        g = object.__new__(Grammar)
        g.root, g._expanded, g.token_refs = self.root, {}, set(ids.values())
        g.rules = [[[("t", ids[e[1]], e[2]) if e[0] == "t" else e for e in alt] for alt in alts] for alts in self.rules]
        return g

    def expand(self, stack: tuple) -> frozenset:
        """The stacks `stack` becomes once rule references and finished alternatives at its top are resolved:
        each has a character element on top, or is empty (the reply may end)."""
        hit = self._expanded.get(stack)
        if hit is not None:
            return hit
        out: set = set()
        todo = [stack]
        while todo:
            st = todo.pop()
            if len(st) > MAX_STACK_DEPTH:
                continue
            if not st:
                out.add(st)
                continue
            r, a, i = st[-1]
            alt = self.rules[r][a]
            if i == len(alt):                                # this alternative is done: back to its parent
                rest = st[:-1]
                if rest:
                    pr, pa, pi = rest[-1]
                    rest = rest[:-1] + ((pr, pa, pi + 1),)
                todo.append(rest)
            elif alt[i][0] in ("c", "t"):                     # a character or a token: a terminal
                out.add(st)
            else:
                q = alt[i][1]
                todo += [st + ((q, b, 0),) for b in range(len(self.rules[q]))]
        res = frozenset(out)
        if len(self._expanded) < 100_000:
            self._expanded[stack] = res
        return res

    def start(self) -> frozenset:
        out = set()
        for b in range(len(self.rules[self.root])):
            out |= self.expand(((self.root, b, 0),))
        return frozenset(out)

    def step(self, stacks: frozenset, cp: int) -> frozenset:
        out: set = set()
        for st in stacks:
            if not st:
                continue
            r, a, i = st[-1]
            if _matches(self.rules[r][a][i], cp):
                out |= self.expand(st[:-1] + ((r, a, i + 1),))
                if len(out) > MAX_STACKS:
                    return frozenset()
        return frozenset(out)

    def may_continue(self, stacks: frozenset, lo: int, hi: int) -> bool:
        return any(st and _may_match(self.rules[st[-1][0]][st[-1][1]][st[-1][2]], lo, hi) for st in stacks)

    def _top(self, st: tuple) -> tuple:
        r, a, i = st[-1]
        return self.rules[r][a][i]

    def step_token(self, stacks: frozenset, t: int) -> frozenset:
        """The stacks after token t where a token reference is on top (bound: ids)."""
        out: set = set()
        for st in stacks:
            if st:
                kind, key, neg = self._top(st)
                if kind == "t" and (key == t) != neg:
                    r, a, i = st[-1]
                    out |= self.expand(st[:-1] + ((r, a, i + 1),))
        return frozenset(out)

    def token_tops(self, stacks: frozenset) -> tuple[set, bool]:
        """(ids that token references on top take, whether a negated one, which takes almost any, is there)."""
        ids, negated = set(), False
        for st in stacks:
            if st:
                kind, key, neg = self._top(st)
                if kind == "t":
                    negated |= neg
                    if not neg:
                        ids.add(key)
        return ids, negated


class GrammarMachine:
    """A Grammar's matcher over UTF-8 bytes, with constrain.JsonMachine's interface."""

    def __init__(self, grammar: Grammar | str, tokenizer=None):
        """tokenizer: resolve the grammar's token references against its vocabulary (Grammar.bind)."""
        self.g = grammar if isinstance(grammar, Grammar) else Grammar(grammar)
        if tokenizer is not None:
            self.g = self.g.bind(tokenizer)
        texts = sorted(k for k in self.g.token_refs if isinstance(k, str))
        if texts:
            raise GrammarError(f"token reference {texts[0]} needs the model's vocabulary to resolve it")
        self.stacks, self.pending = self.g.start(), b""

    def clone(self) -> "GrammarMachine":
        m = object.__new__(GrammarMachine)
        m.g, m.stacks, m.pending = self.g, self.stacks, self.pending
        return m

    def feed(self, data: bytes) -> bool:
        for b in data:
            if not self.pending and b < 0x80:
                self.stacks = self.g.step(self.stacks, b)
            else:
                if (not self.pending and not 0xC2 <= b <= 0xF4) or (self.pending and not 0x80 <= b < 0xC0):
                    return False
                self.pending += bytes((b,))
                need = 2 if self.pending[0] < 0xE0 else 3 if self.pending[0] < 0xF0 else 4
                if len(self.pending) == need:
                    try:
                        cp = ord(self.pending.decode("utf-8"))
                    except UnicodeDecodeError:
                        return False
                    self.pending = b""
                    self.stacks = self.g.step(self.stacks, cp)
                else:                                       # the code points the bytes so far can still become
                    cp = self.pending[0] & (0x1F, 0x0F, 0x07)[need - 2]
                    for c in self.pending[1:]:
                        cp = cp << 6 | (c & 0x3F)
                    shift = 6 * (need - len(self.pending))     # (the shortest form: no overlong encodings)
                    lo = max(cp << shift, (0x80, 0x800, 0x10000)[need - 2])
                    hi = min((cp + 1 << shift) - 1, 0x10FFFF)
                    if lo > hi or not self.g.may_continue(self.stacks, lo, hi):
                        return False
                    continue
            if not self.stacks:
                return False
        return True

    def accepts(self, data: bytes) -> bool:
        return self.clone().feed(data)

    def feed_token(self, t: int, piece: bytes, chars: bool = True) -> bool:
        """Token t, whose text is `piece`: taken whole by a token reference on top of a stack, or (chars) as
        its bytes by the characters on top of the others. Mid-character (a UTF-8 sequence still arriving),
        only characters go on; where both ways live but the bytes end mid-character, the characters' way
        is kept (a state is one or the other)."""
        by_token = self.g.step_token(self.stacks, t) if self.g.token_refs and not self.pending else frozenset()
        by_chars = self.clone()
        if not (chars and piece and by_chars.feed(piece)):
            by_chars.stacks, by_chars.pending = frozenset(), b""
        if by_chars.pending:
            self.stacks, self.pending = by_chars.stacks, by_chars.pending
        else:
            self.stacks, self.pending = by_chars.stacks | by_token, b""
        return bool(self.stacks)

    def accepts_token(self, t: int, piece: bytes, chars: bool = True) -> bool:
        return self.clone().feed_token(t, piece, chars)

    def token_tops(self) -> tuple[set, bool]:
        return self.g.token_tops(self.stacks) if self.g.token_refs and not self.pending else (set(), False)

    def can_end(self) -> bool:
        return not self.pending and () in self.stacks

    def in_header(self) -> bool:
        return False
