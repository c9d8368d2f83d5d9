"""Tokenizer, chat template and built-in vocab tests (CPU only, fast)."""

import heapq
import json
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import tokenizers
from tokenizers import Regex, pre_tokenizers

from hybridmoe.errors import HybridMoeError, ModelFileError
from hybridmoe.text import builtin_vocab as vocab_mod
from hybridmoe.text.builtin_vocab import (
    builtin_tokenizer,
    builtin_vocab_metadata,
    hf_tokenizer_to_metadata,
)
from hybridmoe.text.chat import CHATML_TEMPLATE, render_chat_template
from hybridmoe.text.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, Tokenizer

TRICKY = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nmore",
    "digits 1234567890 and 3.14159, 1,000,000",
    "I'm sure you've seen it; they'll say it's DON'T or WE'RE",
    "naïve café résumé — Ωmega ß ﬁ",
    "中文字符 日本語のテキスト 한국어",
    "emoji 🙂🚀👩‍👩‍👧 flags 🇫🇷",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|>",
    "def f(x):\n    return x ** 2  # square\n",
    '{"key": [1, 2, 3], "ok": true}',
    "a" * 300,
    "    \n\n  \t ",
    "mixed<|im_start|>inside words<|im_end|>end",
]


@pytest.fixture(scope="module")
def tok512():
    return Tokenizer.from_metadata(builtin_vocab_metadata(512), "tiny.gguf")


@pytest.fixture(scope="module")
def tok_big():
    return Tokenizer.from_metadata(builtin_vocab_metadata(151936), "big.gguf")


# ------------------------------------------------------------------ built-in vocab

@pytest.mark.parametrize("n_vocab", [512, 4096, 151936])
def test_builtin_vocab_exact_size_and_specials(n_vocab):
    md = builtin_vocab_metadata(n_vocab)
    tokens = md["tokenizer.ggml.tokens"]
    types = md["tokenizer.ggml.token_type"]
    assert len(tokens) == n_vocab and types.shape == (n_vocab,) and types.dtype == np.int32
    assert len(set(tokens)) == n_vocab
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "qwen2"
    assert md["tokenizer.ggml.add_bos_token"] is False
    assert md["tokenizer.chat_template"] == CHATML_TEMPLATE
    assert len(md["tokenizer.ggml.merges"]) == min(4000, n_vocab - 259)
    tok = Tokenizer.from_metadata(md)
    assert tok.n_vocab == n_vocab
    ids = {s: tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    for s, i in ids.items():
        assert types[i] == CONTROL
        assert tok.encode(s) == [i]
    assert md["tokenizer.ggml.eos_token_id"] == ids["<|im_end|>"]
    assert tok.eos_ids == {ids["<|im_end|>"], ids["<|endoftext|>"]}
    assert tok.encode("<|im_start|>user")[0] == ids["<|im_start|>"]
    assert tok.encode("hello", add_special=True) == tok.encode("hello", add_special=False)


def test_harmony_vocab_ends_at_return_and_call_not_end():
    """gpt-oss: <|end|> closes the thoughts' message and the reply goes on; <|return|> and <|call|> end it,
    whatever eot id the file names (llama.cpp's rule too)."""
    hf = builtin_tokenizer(512)
    hf.add_special_tokens(["<|return|>", "<|call|>", "<|end|>"])
    md = hf_tokenizer_to_metadata(hf, pre="qwen2", eos_token="<|return|>", add_bos_token=False)
    ids = {t: hf.token_to_id(t) for t in ("<|return|>", "<|call|>", "<|end|>")}
    md["tokenizer.ggml.eot_token_id"] = ids["<|end|>"]
    tok = Tokenizer.from_metadata(md, "harmony.gguf")
    assert {ids["<|return|>"], ids["<|call|>"]} <= tok.eos_ids and ids["<|end|>"] not in tok.eos_ids


def test_fill_in_the_middle_tokens():
    """FIM ids from the file's tokenizer.ggml.fim_*_token_id, else found by their text (Qwen-Coder's
    <|fim_prefix|>..., as llama.cpp does); none for a vocabulary without them."""
    hf = builtin_tokenizer(512)
    hf.add_special_tokens(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>", "<|repo_name|>"])
    md = hf_tokenizer_to_metadata(hf, pre="qwen2", eos_token="<|endoftext|>", add_bos_token=False)
    ids = {r: hf.token_to_id(t) for r, t in (("pre", "<|fim_prefix|>"), ("suf", "<|fim_suffix|>"),
                                             ("mid", "<|fim_middle|>"), ("sep", "<|file_sep|>"),
                                             ("rep", "<|repo_name|>"))}
    assert Tokenizer.from_metadata(md).fim == ids
    md["tokenizer.ggml.fim_mid_token_id"] = 7
    assert Tokenizer.from_metadata(md).fim == dict(ids, mid=7)
    assert Tokenizer.from_metadata(builtin_vocab_metadata(512)).fim == {}


def test_builtin_vocab_fast_and_deterministic():
    vocab_mod._trained_json.cache_clear()
    t = time.perf_counter()
    md = builtin_vocab_metadata(151936)
    assert time.perf_counter() - t < 3.0
    digest = _digest(md)
    # Another process (different hash seeds, thread scheduling) must train the same vocab.
    code = ("import hashlib, json; from hybridmoe.text.builtin_vocab import builtin_vocab_metadata;"
            "md = builtin_vocab_metadata(151936);"
            "print(hashlib.sha256(json.dumps([md['tokenizer.ggml.tokens'],"
            "md['tokenizer.ggml.merges'], md['tokenizer.ggml.token_type'].tolist()])"
            ".encode()).hexdigest())")
    env = dict(os.environ, PYTHONHASHSEED="123", RAYON_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env)
    assert out.stdout.strip() == digest


def _digest(md):
    import hashlib
    return hashlib.sha256(json.dumps([md["tokenizer.ggml.tokens"], md["tokenizer.ggml.merges"],
                                      md["tokenizer.ggml.token_type"].tolist()]).encode()
                          ).hexdigest()


def test_builtin_vocab_too_small():
    with pytest.raises(HybridMoeError, match="too small"):
        builtin_vocab_metadata(200)


@pytest.mark.parametrize("which", ["tok512", "tok_big"])
def test_round_trip_tricky_text(which, request):
    tok = request.getfixturevalue(which)
    for s in TRICKY:
        ids = tok.encode(s)
        assert all(0 <= i < tok.n_vocab for i in ids)
        assert tok.decode(ids) == s


def test_bigger_vocab_compresses(tok512, tok_big):
    text = "The children thought this was very funny, and the teacher laughed too."
    assert len(tok_big.encode(text)) < len(tok512.encode(text)) < len(text.encode())


def test_parse_special_off_reads_control_tokens_as_text(tok_big):
    s = "<|im_start|>user"
    literal = tok_big.encode(s, parse_special=False)
    assert tok_big.token_to_id("<|im_start|>") not in literal
    assert tok_big.decode(literal) == s


# ------------------------------------------------------------------ vs transformers

LLAMA3_HF_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _variant(tok: tokenizers.Tokenizer, kind: str) -> tokenizers.Tokenizer:
    """The built-in vocab with another pre-tokenizer, written as HF models write it."""
    spec = json.loads(tok.to_str())
    if kind == "gpt-2":
        spec["pre_tokenizer"] = json.loads(pre_tokenizers.ByteLevel(
            add_prefix_space=False, use_regex=True).__getstate__())
    elif kind == "llama-bpe":
        spec["pre_tokenizer"] = json.loads(pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_HF_RE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]).__getstate__())
        spec["model"]["ignore_merges"] = True
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


@pytest.mark.parametrize("pre", ["qwen2", "gpt-2", "llama-bpe"])
def test_matches_transformers_fast_tokenizer(pre):
    from transformers import PreTrainedTokenizerFast

    hf_tok = _variant(builtin_tokenizer(151936), pre)
    md = hf_tokenizer_to_metadata(hf_tok, n_vocab=151936, add_bos_token=False)
    assert md["tokenizer.ggml.pre"] == pre  # detected from the tokenizer.json regex
    ours = Tokenizer.from_metadata(md)
    ref = PreTrainedTokenizerFast(tokenizer_object=hf_tok)
    extra = ["x" * 50 + " 12345678901234", "AaBbCc'S'T'RE'VE", "\u3000ideographic space",
             " " * 7 + "x", "\n\n\nx\n", "emoji👍🏽!"]
    for s in TRICKY + extra:
        want = ref.encode(s, add_special_tokens=False)
        assert ours.encode(s) == want, s
        assert ours.decode(want) == ref.decode(want)


def test_hf_conversion_from_folder(tmp_path):
    hf_tok = builtin_tokenizer(1000)
    hf_tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"},
        "bos_token": None, "add_bos_token": False, "chat_template": "{{ messages[0].content }}"}))
    md = hf_tokenizer_to_metadata(tmp_path)
    tok = Tokenizer.from_metadata(md)
    assert tok.n_vocab == hf_tok.get_vocab_size()
    assert md["tokenizer.ggml.eos_token_id"] == hf_tok.token_to_id("<|im_end|>")
    assert md["tokenizer.ggml.padding_token_id"] == hf_tok.token_to_id("<|endoftext|>")
    assert "tokenizer.ggml.bos_token_id" not in md
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


# ------------------------------------------------------------------ SPM ("llama")

def _spm_vocab(seed=0):
    """A small sentencepiece-style vocab: <unk>, <s>, </s>, 256 byte tokens, pieces."""
    pieces = ["▁", *"abdehilnorstw", "é", "▁h", "he", "▁he", "ll", "llo", "▁hello", "▁w",
              "or", "▁wor", "ld", "▁world", "in", "ing", "th", "▁th", "▁the", "er", "▁t",
              "▁a", "an", "▁an", "▁and", "nd", "es", "▁s", "st", "▁st", "sta", "ta", "at",
              "ion", "io", "on", "ti", "tion", "▁▁", "▁▁▁▁", "ré", "▁ré"]
    rng = random.Random(seed)
    scores = rng.sample(range(-5000, 0), len(pieces))  # distinct, like real SPM vocabs
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    all_scores = [0.0] * 259 + [float(s) for s in scores]
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.scores": np.array(all_scores, dtype=np.float32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    return md


def _spm_reference(md, text):
    """llama.cpp's SPM loop written out: merge the best-scoring adjacent pair
    (leftmost on ties) until none is in the vocab; leftovers become <0xNN>."""
    tokens = md["tokenizer.ggml.tokens"]
    ids = {t: i for i, t in enumerate(tokens)}
    scores = md["tokenizer.ggml.scores"]
    if not text:
        return []
    text = ("▁" + text).replace(" ", "▁")
    sym = [[c, i - 1, i + 1] for i, c in enumerate(text)]
    sym[-1][2] = -1
    heap = []

    def try_add(left, right):
        if left == -1 or right == -1:
            return
        t = sym[left][0] + sym[right][0]
        if t in ids:
            heapq.heappush(heap, (-float(scores[ids[t]]), left, right, len(t)))

    for i in range(1, len(sym)):
        try_add(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        L, R = sym[left], sym[right]
        if not L[0] or not R[0] or len(L[0]) + len(R[0]) != size:
            continue
        L[0] += R[0]
        R[0] = ""
        L[2] = R[2]
        if R[2] >= 0:
            sym[R[2]][1] = left
        try_add(L[1], left)
        try_add(left, L[2])
    out, i = [], 0
    while i != -1:
        t = sym[i][0]
        if t in ids:
            out.append(ids[t])
        else:
            out.extend(ids[f"<0x{b:02X}>"] for b in t.encode())
        i = sym[i][2]
    return out


def test_spm_matches_reference_algorithm():
    md = _spm_vocab()
    tok = Tokenizer.from_metadata(md, "spm.gguf")
    rng = random.Random(1)
    alphabet = "helowrdtinsaé  世🙂x"
    cases = ["hello world", "the station and the rest", "héllo wörld", " two  spaces",
             "restation", "ré ré"]
    cases += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
              for _ in range(400)]
    for s in cases:
        assert tok.encode(s, add_special=False) == _spm_reference(md, s), s
        assert tok.encode(s) == [1] + _spm_reference(md, s)


def test_spm_round_trip_and_bytes():
    tok = Tokenizer.from_metadata(_spm_vocab(), "spm.gguf")
    assert tok.bos_id == 1 and tok.eos_ids == {2}
    ids = tok.encode("hello world")
    texts = [tok.token_text(i) for i in ids]
    assert texts == ["<s>", "▁hello", "▁world"]
    ids = tok.encode("世", add_special=False)
    assert [tok.token_text(i) for i in ids] == ["▁", "<0xE4>", "<0xB8>", "<0x96>"]
    for s in ["hello world", " leading space", "trailing  ", "世界 🙂 héllo\nnew line", ""]:
        assert tok.decode(tok.encode(s, add_special=False)) == s
        assert tok.decode(tok.encode(s), skip_special=True) == s
    assert tok.decode(tok.encode("hi")) == "<s>hi"


def test_spm_stream_byte_fallback():
    tok = Tokenizer.from_metadata(_spm_vocab(), "spm.gguf")
    text = "hé 世界🙂 ok"
    ids = tok.encode(text)
    s = tok.stream(skip_special=True)
    parts = [s.add(i) for i in ids] + [s.flush()]
    assert "".join(parts) == text
    assert "\ufffd" not in "".join(parts)


# ------------------------------------------------------------------ streaming

def test_stream_holds_back_partial_utf8(tok512):
    text = "é世🙂👩‍👩‍👧 naïve"
    ids = tok512.encode(text)
    s = tok512.stream()
    parts = [s.add(i) for i in ids]
    parts.append(s.flush())
    assert "".join(parts) == tok512.decode(ids) == text
    assert all("\ufffd" not in p for p in parts)
    assert len(ids) > len(text)  # chars really were split across tokens
    s = tok512.stream()
    first = tok512.encode("🙂")
    assert [s.add(i) for i in first] == ["", "", "", "🙂"]


def test_stream_matches_decode_on_broken_bytes(tok512):
    ids = tok512.encode("🙂")
    for cut in ([ids[0]], ids[:2] + ids[:1], ids[1:], ids[:3] + tok512.encode("x")):
        s = tok512.stream()
        assert "".join(s.add(i) for i in cut) + s.flush() == tok512.decode(cut)
    assert tok512.decode(ids[:1]) == "\ufffd"


def test_skip_special_and_bad_ids(tok_big):
    ids = tok_big.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok_big.decode(ids, skip_special=True) == "user\nhi"
    with pytest.raises(ValueError):
        tok_big.decode([tok_big.n_vocab])


# ------------------------------------------------------------------ chat templates

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
]


def test_chatml_renders_exactly(tok_big):
    want = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\nHi!<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n"
            "<|im_start|>user\n2+2?<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert tok_big.apply_chat_template(CONV) == want
    assert tok_big.apply_chat_template(CONV, add_generation_prompt=False) == \
        want[:-len("<|im_start|>assistant\n")]
    assert render_chat_template(None, CONV) == want  # fallback for models without one
    ids = tok_big.encode(want)
    assert ids.count(tok_big.token_to_id("<|im_start|>")) == 5
    assert tok_big.decode(ids) == want


def test_chatml_rejects_unknown_role():
    with pytest.raises(HybridMoeError, match="unsupported role: tool"):
        render_chat_template(CHATML_TEMPLATE, [{"role": "tool", "content": "x"}])


def test_hf_helpers_and_whitespace_control():
    tmpl = ("{% for m in messages %}\n"
            "    {{ m.role }}:{{ m.content | tojson }}\n"
            "{% endfor %}\n"
            "{% generation %}{{ bos_token }}{% endgeneration %}"
            "{{ strftime_now('%Y')|length }}"
            "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}")
    out = render_chat_template(tmpl, [{"role": "user", "content": "é <b>&\"'"}],
                               bos_token="<s>")
    assert out == "    user:\"é <b>&\\\"'\"\n<s>401"


@pytest.mark.parametrize("tmpl, match", [
    ("{{ ''.__class__.__mro__ }}", "sandbox"),
    ("{{ messages.__class__.__base__.__subclasses__() }}", "sandbox"),
    ("{{ cycler.__init__.__globals__ }}", "sandbox"),
    ("{{ messages.append(1) }}", "sandbox"),
    ("{{ 'x' * 10**10 }}", "sandbox"),
    ("{{ 7 ** 1000000 }}", "sandbox"),
    ("{% for x in messages %}", "syntax error"),
    ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
    ("{{ 'a' + 1 }}", "TypeError"),
])
def test_template_errors_are_one_line(tmpl, match):
    with pytest.raises(HybridMoeError, match=match) as ei:
        render_chat_template(tmpl, CONV)
    assert "\n" not in str(ei.value)


# ------------------------------------------------------------------ untrusted metadata

def _broken(mutate):
    md = dict(builtin_vocab_metadata(512))
    mutate(md)
    return md


@pytest.mark.parametrize("mutate, match", [
    (lambda md: md.pop("tokenizer.ggml.model"), "missing tokenizer.ggml.model"),
    (lambda md: md.update({"tokenizer.ggml.model": "bert"}), "supported: gpt2, llama"),
    (lambda md: md.pop("tokenizer.ggml.tokens"), "missing tokenizer.ggml.tokens"),
    (lambda md: md.update({"tokenizer.ggml.tokens": "abc"}), "array of strings"),
    (lambda md: md.update({"tokenizer.ggml.tokens": [1, 2, 3]}), "array of strings"),
    (lambda md: md.update({"tokenizer.ggml.tokens": []}), "empty"),
    (lambda md: md.update({"tokenizer.ggml.token_type": np.zeros(3, np.int32)}), "one per token"),
    (lambda md: md.update({"tokenizer.ggml.token_type": np.zeros(512, np.float32)}),
     "one per token"),
    (lambda md: md.pop("tokenizer.ggml.merges"), "missing tokenizer.ggml.merges"),
    (lambda md: md.update({"tokenizer.ggml.merges": ["nospace"]}), "merges\\[0\\]"),
    (lambda md: md.update({"tokenizer.ggml.eos_token_id": 10**6}), "outside the vocabulary"),
    (lambda md: md.update({"tokenizer.ggml.bos_token_id": "1"}), "integer token id"),
    (lambda md: md.update({"tokenizer.ggml.add_bos_token": "yes"}), "boolean"),
    (lambda md: md.update({"tokenizer.chat_template": 5}), "must be a string"),
    (lambda md: md.update({"tokenizer.ggml.tokens": ["a"] * 512}), "256 byte tokens"),
])
def test_malformed_metadata(mutate, match):
    with pytest.raises(ModelFileError, match=match) as ei:
        Tokenizer.from_metadata(_broken(mutate), "bad.gguf")
    assert str(ei.value).startswith("bad.gguf: ") and "\n" not in str(ei.value)


def test_malformed_spm_scores():
    md = _spm_vocab()
    md["tokenizer.ggml.scores"] = np.zeros(5, np.float32)
    with pytest.raises(ModelFileError, match="tokenizer.ggml.scores"):
        Tokenizer.from_metadata(md, "spm.gguf")


def test_unknown_pre_warns_and_falls_back(capsys):
    md = _broken(lambda md: md.update({"tokenizer.ggml.pre": "no-such-pre"}))
    tok = Tokenizer.from_metadata(md)
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "no-such-pre" in err
    assert tok.decode(tok.encode("still works")) == "still works"


# A template in the style of recent Qwen ones (written for this test) that uses
# namespace(), reverse slicing, string methods, tojson and extra kwargs.
QWEN_STYLE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == 'user' and not message.content.startswith('<tool_response>') %}
        {%- set ns.last_query = index %}{% break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- if loop.index0 > ns.last_query %}{{- ' [after last query]' }}{%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False},
                                    {"tools": [{"name": "get_weather", "about": "météo <x>"}]}])
def test_renders_like_transformers(kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    conv = CONV + [{"role": "assistant", "content": "<think>hmm</think>\n\n4"},
                   {"role": "user", "content": "Thanks ✓"}]
    ours = render_chat_template(QWEN_STYLE, conv, add_generation_prompt=True, **kwargs)
    tools = kwargs.pop("tools", None)
    ref = render_jinja_template([conv], tools=tools, chat_template=QWEN_STYLE,
                                add_generation_prompt=True, **kwargs)
    ref = ref[0] if isinstance(ref, tuple) else ref
    ref = ref[0] if isinstance(ref, list) else ref
    assert ours == ref
    assert "<|im_start|>assistant\n4<|im_end|>" in ours
