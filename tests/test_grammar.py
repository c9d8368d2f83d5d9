"""GBNF grammars (grammar.py): parsing, matching against hand cases and Python's re, errors, and sampling
under a grammar with synth:tiny's real vocabulary."""
from __future__ import annotations

import random
import re

import pytest
import torch
from conftest import byte_verdict

import hybridmoe
from hybridmoe.constrain.grammar import Grammar, GrammarError, GrammarMachine
from hybridmoe.constrain.tokens import TokenConstraint
from hybridmoe.generate import Sampler, SamplerSettings


def verdict(grammar, text: str | bytes) -> str:
    return byte_verdict(GrammarMachine(grammar), text)


ANSWER = 'root ::= answer "\\n"\nanswer ::= "yes" | "no" | [0-9]+ ("." [0-9]{1,2})?  # a comment\n'
LIST = 'root ::= item+\nitem ::= "- " [^\\n]+ "\\n"\n'
ARITH = '''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= [0-9]+ | "(" expr ")"
'''
MISC = r'''root ::= "<" word ">" ws tail?
word ::= [a-zA-Z_] [a-zA-Z0-9_]{0,3}
ws   ::= [ \t]*
tail ::= ( "\x41" | "\u00e9t\u00E9" | . "!" )
'''


@pytest.mark.parametrize("grammar, text, want", [
    (ANSWER, "yes\n", "ok"), (ANSWER, "no", "prefix"), (ANSWER, "12.5\n", "ok"), (ANSWER, "12.\n", "refused"),
    (ANSWER, "12.555\n", "refused"), (ANSWER, "maybe", "refused"), (ANSWER, "007\n", "ok"),
    (LIST, "- a\n- héllo wörld\n", "ok"), (LIST, "- \n", "refused"), (LIST, "", "prefix"), (LIST, "x", "refused"),
    (ARITH, "1+(2-3)", "ok"), (ARITH, "1+", "prefix"), (ARITH, "(1", "prefix"), (ARITH, "1)", "refused"),
    (ARITH, "((((1))))-2", "ok"),
    (MISC, "<ab_1> \tA", "ok"), (MISC, "<ab_1>", "ok"), (MISC, "<abcde>", "refused"), (MISC, "<1", "refused"),
    (MISC, "<a>été", "ok"), (MISC, "<a>é!", "ok"), (MISC, "<a>😀!", "ok"), (MISC, "<a>😀", "prefix"),
    (MISC, b"<a>\xe0\x80", "refused"),                                  # not UTF-8 (overlong)
    ('root ::= [^"\\\\]* "\\""', 'abc"', "ok"), ('root ::= [^"\\\\]* "\\""', 'a\\', "refused"),
    ('root ::= "a"{2} "b"{0,2} "c"{1,}', "aabbcc", "ok"), ('root ::= "a"{2} "b"{0,2} "c"{1,}', "aabbbc", "refused"),
    ('root ::= ("ab")*', "abab", "ok"), ('root ::= ("ab")*', "aba", "prefix"), ('root ::= ("ab")*', "", "ok"),
    ('root ::= "x" (\n  "y" |\n  "z"\n)', "xz", "ok"),                 # alternatives over lines in a group
])
def test_matching(grammar, text, want):
    assert verdict(grammar, text) == want


def test_agrees_with_python_re():
    """Grammars that are also regular expressions: complete exactly when re.fullmatch says so, for random
    texts over their alphabet (every prefix of a match is a prefix)."""
    pairs = [('root ::= [a-c]+ ("-" [0-9]{1,3})?', r"[a-c]+(-[0-9]{1,3})?"),
             ('root ::= ("ab" | "a" "c"*)* "."', r"(ab|ac*)*\."),
             ('root ::= [^x]? "x" [xy]{2,3}', r"[^x]?x[xy]{2,3}")]
    rng = random.Random(0)
    for g, rx in pairs:
        grammar = Grammar(g)
        for _ in range(400):
            text = "".join(rng.choice("abcxy.-0129") for _ in range(rng.randrange(8)))
            assert (verdict(grammar, text) == "ok") == bool(re.fullmatch(rx, text)), (g, text)


@pytest.mark.parametrize("text, msg", [
    ('root ::= root "a" | "b"', "left-recursive"),
    ('root ::= foo', "line 1, column 10: rule 'foo' is used but not defined"),
    ('root = "a"', "expected '::='"),
    ('root ::= "a', "unterminated string"),
    ('x ::= "a"', "no 'root' rule"),
    ('root ::= [b-a]', "goes backwards"),
    ('root ::= "a"{3,1}', "bad repetition"),
    ('root ::= "a"\nroot ::= "b"', "line 2, column 1: rule 'root' is defined twice"),
    ('root ::= * "a"', "repeats nothing"),
    ('root ::= "\\q"', "bad escape"),
    ('root ::= "a" @', "expected the end of the rule"),
    ("   ", "empty"),
])
def test_errors(text, msg):
    with pytest.raises(GrammarError, match=re.escape(msg)):
        Grammar(text)


def _random_grammar(rng: random.Random) -> str:
    def item(d):
        if rng.random() < 0.02:                           # now and then something broken
            return rng.choice(["[", '"', "(", "::=", "{", "a{9,1}", "[b-a]", "\\q"])
        c = rng.choice(['"ab"', '"a"', "[a-c]", "[^x]", ".", "x", "y", '""', '"\\n"', "[é-ê]"]
                       + ([f"({seq(d + 1)} | {seq(d + 1)})"] if d < 3 else []))
        return c + rng.choice(["", "", "*", "+", "?", "{2}", "{0,3}", "{1,}"])

    def seq(d=0):
        return " ".join(item(d) for _ in range(rng.randrange(1, 4)))
    return f'root ::= {seq()}\nx ::= {seq()} | "q"\ny ::= "z" {seq()}?\n'


def test_any_grammar_runs_or_is_refused_cleanly():
    """Random grammars, well-formed or not: GrammarError or a machine that takes random bytes without raising."""
    rng = random.Random(0)
    parsed = 0
    for _ in range(600):
        try:
            g = Grammar(_random_grammar(rng))
        except GrammarError:
            continue
        parsed += 1
        m = GrammarMachine(g)
        for _ in range(rng.randrange(1, 25)):
            b = bytes([rng.choice(b"abcxyzq\n\xc3\xa9\xaa")])
            if m.accepts(b):
                m.feed(b)
        m.can_end()
    assert parsed > 100


@pytest.fixture(scope="module")
def tok():
    return hybridmoe.load("synth:tiny").tokenizer


def sampled(tok, grammar, temperature, seed, gen, n=300) -> list[int]:
    """The tokens a sampler draws under the grammar from random logits, until end-of-generation (or n)."""
    s = Sampler(SamplerSettings(temperature=temperature, seed=seed),
                TokenConstraint(GrammarMachine(grammar, tok), tok, tok.eos_ids))
    ids = []
    for _ in range(n):
        t = s(torch.randn(tok.n_vocab, generator=gen) * 3)
        if t in tok.eos_ids:
            break
        s.accept(t)
        ids.append(t)
    return ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampling_under_a_grammar(tok, temperature):
    """Random logits over the real vocabulary: the reply ends with an end-of-generation token and the
    grammar accepts it."""
    g = Grammar('root ::= ("yes" | "no") ", because " [a-z ]{3,20} "." ("\\n" item){0,2}\nitem ::= "- " [0-9]+')
    gen = torch.Generator().manual_seed(3)
    for seed in range(3):
        text = tok.decode(sampled(tok, g, temperature, seed, gen))
        assert re.fullmatch(r"(yes|no), because [a-z ]{3,20}\.(\n- [0-9]+){0,2}", text), text


@pytest.mark.parametrize("text, msg", [
    ("root ::= <[12x]>", "bad token id <[12x]>"), ("root ::= <think", "unterminated token reference"),
    ("root ::= <>", "empty token reference"), ("root ::= !", "expected"),
])
def test_token_reference_errors(text, msg):
    with pytest.raises(GrammarError, match=re.escape(msg)):
        Grammar(text)


def test_token_references(tok):
    """llama.cpp's <[id]>, <text> and their negations: each takes one whole token, resolved in the vocabulary
    (ids, special tokens by text); a control token passes only where a grammar names it; an id outside the
    vocabulary or a text that is not one token is refused when bound."""
    start = tok.token_to_id("<|im_start|>")
    g = Grammar('root ::= <|im_start|> "a" !<[3]> ("b" | <[%d]>)' % start)
    assert g.bind(tok).token_refs == {start, 3}
    m = GrammarMachine(g, tok)
    assert m.feed_token(start, tok.piece_bytes(start), chars=False) and m.token_tops() == (set(), False)
    assert m.feed_token(tok.encode("a", add_special=False)[0], b"a")
    assert m.token_tops() == (set(), True)                           # any token but 3 comes next
    assert not m.accepts_token(3, tok.piece_bytes(3)) and m.accepts_token(5, tok.piece_bytes(5))
    assert m.feed_token(start, b"", chars=False)                       # a control token: also "any but 3"
    assert m.token_tops() == ({start}, False)
    assert m.accepts_token(start, b"", chars=False) and m.accepts(b"b") and not m.accepts(b"c")
    assert GrammarMachine('root ::= <[0]> | "!"', tok).feed_token(0, tok.piece_bytes(0))     # both ways: "!"
    for bad, msg in (("root ::= <[5000]>", "the vocabulary has 1024 tokens"),
                     ("root ::= <two words>", "not one token")):
        with pytest.raises(GrammarError, match=msg):
            Grammar(bad).bind(tok)
    assert Grammar('root ::= "x"').bind(tok).token_refs == set()
    with pytest.raises(GrammarError, match="needs the model's vocabulary"):
        GrammarMachine("root ::= !<think>")                          # unresolved, it would take any token


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampling_a_control_token_a_grammar_names(tok, temperature):
    """The constraint takes a control token where the grammar names it (its text is never spelled), then
    text, with random logits over the real vocabulary."""
    start = tok.token_to_id("<|im_start|>")
    g = Grammar('root ::= <|im_start|> [a-z]{2,8} "." !<|im_start|>')
    gen = torch.Generator().manual_seed(5)
    for seed in range(3):
        ids = sampled(tok, g, temperature, seed, gen, n=40)
        assert ids[0] == start and start not in ids[1:] and len(ids) >= 4, ids
        assert re.fullmatch(r"[a-z]{2,8}\.", tok.decode(ids[1:-1])), tok.decode(ids)
