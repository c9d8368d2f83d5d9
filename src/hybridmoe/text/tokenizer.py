"""Tokenizers for GGUF models, behaving like llama.cpp's, built on HF `tokenizers`.

Two vocab types are supported, named as in `tokenizer.ggml.model`:

* ``gpt2``  - byte-level BPE (Qwen, Llama 3, DeepSeek, gpt-oss, ...); the
  pre-tokenizer regex is picked by ``tokenizer.ggml.pre``.
* ``llama`` - SentencePiece BPE (Llama 2, Mixtral, ...): spaces become '▁', a
  '▁' is prepended, and characters missing from the vocab fall back to
  ``<0xNN>`` byte tokens. Merge priority comes from the token scores.

Decoding is done here from per-token bytes (not by `tokenizers`), so that
`decode` and the streaming detokenizer always give the same text.
"""

from __future__ import annotations

import bisect
import codecs
import numbers
import re

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers

from ..errors import HybridMoeError, ModelFileError, warn
from ..formats.validate import Meta

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_MODELS = ("gpt2", "llama")

# Pre-tokenizer regexes exactly as llama.cpp applies them (each one splits the
# pieces left by the previous one; unmatched text stays a piece of its own).
GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp spells "(?i:'s|...)" out case by case; same set of matches.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK3_RES = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_CASED = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O_RE = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CASED
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CASED
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class _Pre:
    def __init__(self, regexes, ignore_merges=False, add_bos=False):
        self.regexes = regexes
        self.ignore_merges = ignore_merges  # llama3: a whole word in the vocab wins
        self.add_bos = add_bos              # llama.cpp's default when the key is absent


PRE_TYPES: dict[str, _Pre] = {}


def _register(names, pre):
    for n in names:
        PRE_TYPES[n] = pre


_register(("default", "gpt-2", "phi-2", "olmo", "mpt", "jais", "exaone4", "gigachat",
           "mellum", "roberta-bpe"), _Pre((GPT2_RE,)))
_register(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
           "lfm2"), _Pre((LLAMA3_RE,), ignore_merges=True, add_bos=True))
_register(("dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), _Pre((LLAMA3_RE,)))
_register(("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2"), _Pre((QWEN2_RE,)))
_register(("deepseek-v3",), _Pre(DEEPSEEK3_RES))
_register(("gpt-4o", "llama4", "minimax-m2"), _Pre((GPT4O_RE,)))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE = _bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# ---------------------------------------------------------------- metadata checks
# Model files are untrusted: every field is checked and any problem becomes a
# one-line ModelFileError instead of a numpy/tokenizers traceback.

def _bad(path, problem, hint="the GGUF file's tokenizer metadata is malformed"):
    return ModelFileError(path, problem, hint)


def _str_list(md, key, path, required=True):
    """An array of strings, through formats.validate.Meta (typed, bounded)."""
    v = md.get(key)
    if v is None:
        if required:
            raise _bad(path, f"missing {key}")
        return None
    if isinstance(v, (list, tuple)) and not v:
        raise _bad(path, f"{key} is empty")
    return list(Meta(md, path).str_array(key))


def _num_array(md, key, path, n, kinds, what):
    """None, or an array of n numbers of those numpy kinds, finite, through formats.validate.Meta."""
    if md.get(key) is None:
        return None
    if not isinstance(md[key], np.ndarray):
        try:
            md = {key: np.asarray(md[key])}
        except Exception:  # noqa: BLE001 - anything numpy cannot read is "not an array of numbers"
            raise _bad(path, f"{key} must be an array of {n} {what} (one per token)") from None
    return Meta(md, path).num_array(key, n, kinds, f"{what} (one per token)")


def _opt_id(md, key, path, n):
    v = md.get(key)
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
        raise _bad(path, f"{key} must be an integer token id, got {type(v).__name__}")
    if not 0 <= int(v) < n:
        raise _bad(path, f"{key}={int(v)} is outside the vocabulary (0..{n - 1})")
    return int(v)


def _opt_bool(md, key, path, default):
    v = md.get(key)
    if v is None:
        return default
    if not isinstance(v, (bool, np.bool_)):
        raise _bad(path, f"{key} must be a boolean")
    return bool(v)


def _opt_str(md, key, path):
    v = md.get(key)
    if v is not None and not isinstance(v, str):
        raise _bad(path, f"{key} must be a string")
    return v


# ---------------------------------------------------------------- builders

def _build_gpt2(md, path, tokens, types, vocab):
    pre_name = _opt_str(md, "tokenizer.ggml.pre", path) or "default"
    pre = PRE_TYPES.get(pre_name)
    if pre is None:
        # llama.cpp also falls back (with a warning) rather than refusing the model.
        warn(f"{path}: unknown tokenizer.ggml.pre '{pre_name}', using the GPT-2 "
             f"pre-tokenizer; tokenization may differ from the original model")
        pre = PRE_TYPES["default"]
    missing = sum(c not in vocab for c in BYTE_TO_UNICODE.values())
    if missing:
        raise _bad(path, f"byte-level vocabulary lacks {missing} of the 256 byte tokens")
    merges = []
    for i, m in enumerate(_str_list(md, "tokenizer.ggml.merges", path)):
        sp = m.find(" ", 1)  # the left part may itself be a single ' '-like char
        if sp < 0:
            raise _bad(path, f"tokenizer.ggml.merges[{i}] is not of the form 'left right'")
        a, b = m[:sp], m[sp + 1:]
        # merges naming unknown tokens can never fire in llama.cpp; tokenizers refuses them
        if a in vocab and b in vocab and a + b in vocab:
            merges.append((a, b))
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok, pre.add_bos


def _spm_merges(tokens, types, scores, vocab, path="model"):
    """Merges ranked by the score of the merged piece: what SPM's bigram loop does.

    A token t splits into a + b only at lengths k where some token is k long and some is len(t) - k long,
    so a token is tried at no more split points than there are distinct token lengths below its own; the
    characters compared over the whole vocabulary are bounded by a multiple of its size (a vocabulary
    built to exceed that is refused), so this is linear in the vocabulary's bytes, never quadratic in one
    long token."""
    have = {len(t) for t in tokens}
    lengths = sorted(have)
    total = sum(len(t) for t in tokens)
    budget = 64 * total + (1 << 22)
    cands = []
    for i, t in enumerate(tokens):
        n = len(t)
        if types[i] not in (NORMAL, 0) or n < 2 or vocab.get(t) != i:
            continue
        below = bisect.bisect_left(lengths, n)
        if n <= 16 or below >= n - 1:
            splits = range(1, n)
        else:
            splits = [k for k in lengths[:below] if n - k in have]
        budget -= min(below, n) + len(splits) * n
        for k in splits:
            a = vocab.get(t[:k])
            if a is not None:
                b = vocab.get(t[k:])
                if b is not None:
                    cands.append((-float(scores[i]), i, k, tokens[a], tokens[b]))
        if budget < 0:
            raise _bad(path, "tokenizer.ggml.tokens: the vocabulary's merges take too long to build "
                       f"({len(tokens)} tokens of {total} characters)", "the file is corrupt or hostile")
    cands.sort()
    return [(a, b) for *_, a, b in cands]


def _build_spm(md, path, tokens, types, vocab):
    n = len(tokens)
    scores = _num_array(md, "tokenizer.ggml.scores", path, n, "fiu", "numbers")
    if scores is None:
        scores = np.zeros(n, np.float32)  # llama.cpp accepts a vocab without scores
    unk_id = _opt_id(md, "tokenizer.ggml.unknown_token_id", path, n)
    if unk_id is None and n > 0 and types[0] == UNKNOWN:
        unk_id = 0
    model = models.BPE(vocab=vocab, merges=_spm_merges(tokens, types, scores, vocab, path),
                       unk_token=tokens[unk_id] if unk_id is not None else None,
                       byte_fallback=True, fuse_unk=True)
    tok = tokenizers.Tokenizer(model)
    add_prefix = _opt_bool(md, "tokenizer.ggml.add_space_prefix", path, True)
    # Normalizers run on each piece between special tokens, so the '▁' prefix also
    # follows every special token, as in llama.cpp.
    norms = [normalizers.Prepend("▁")] if add_prefix else []
    tok.normalizer = normalizers.Sequence(norms + [normalizers.Replace(" ", "▁")])
    return tok, add_prefix


# ---------------------------------------------------------------- public API

# llama.cpp's fill-in-the-middle roles and the texts it recognizes them by when the file names no ids
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>", "<｜fim▁begin｜>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>", "<｜fim▁hole｜>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>", "<｜fim▁end｜>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>"),
    "sep": ("<|file_sep|>", "<file_sep>", "<|file_separator|>", "<FILE_SEP>"),
}


class Tokenizer:
    """Text <-> token ids for one model, from its GGUF tokenizer metadata."""

    def __init__(self, *, kind, tokens, types, hf, bos_id, eos_id, eot_id, eom_id,
                 add_bos, add_eos, strip_first_space, chat_template, fim=None):
        self.kind = kind
        self._tokens = tokens
        self._types = types
        self._hf = hf
        self._hf_literal = None  # copy that reads control tokens as plain text
        self._bos_id = bos_id
        self._eos_id = eos_id
        self._add_bos = add_bos and bos_id is not None
        self._add_eos = add_eos and eos_id is not None
        self._strip_first_space = strip_first_space
        self.chat_template = chat_template
        self._pieces: list[bytes | None] = [None] * len(tokens)
        eos = {i for i in (eos_id, eot_id, eom_id) if i is not None}
        control = {}
        for text in ("<|im_end|>", "<|endoftext|>", "<|return|>", "<|call|>", "<|end|>"):
            i = self._hf.token_to_id(text)
            if i is not None and i < len(types) and types[i] == CONTROL:
                control[text] = i
        eos |= {control[t] for t in ("<|im_end|>", "<|endoftext|>") if t in control}
        if "<|return|>" in control and "<|call|>" in control:
            # gpt-oss's harmony format (llama.cpp does the same): a reply ends at <|return|> or at a tool
            # <|call|>; <|end|> only closes one message (the thoughts) and the reply goes on after it
            eos |= {control["<|return|>"], control["<|call|>"]}
            eos.discard(control.get("<|end|>"))
        self._eos_ids = frozenset(eos)
        # fill-in-the-middle tokens (pre, suf, mid, rep, sep): the file's ids, else found by their text
        self.fim = dict(fim or {})
        for role, texts in FIM_TEXTS.items():
            for t in texts if role not in self.fim else ():
                i = self._hf.token_to_id(t)
                if i is not None and i < len(types) and types[i] in (CONTROL, USER_DEFINED):
                    self.fim[role] = i
                    break

    @classmethod
    def from_metadata(cls, md: dict, path: str = "model", n_vocab: int | None = None) -> "Tokenizer":
        """The tokenizer the metadata describes; `n_vocab` (the embedding's rows) is the vocabulary's
        length when given."""
        if not isinstance(md, dict):
            raise _bad(path, "tokenizer metadata is not a mapping")
        kind = md.get("tokenizer.ggml.model")
        if kind is None:
            raise _bad(path, "missing tokenizer.ggml.model",
                       "the file has no tokenizer; it cannot be used for text generation")
        if kind not in SUPPORTED_MODELS:
            raise ModelFileError(path, f"unsupported tokenizer type {kind!r}",
                                 f"supported: {', '.join(SUPPORTED_MODELS)}")
        tokens = _str_list(md, "tokenizer.ggml.tokens", path)
        n = len(tokens)
        if n == 0:
            raise _bad(path, "tokenizer.ggml.tokens is empty")
        if n_vocab is not None and n != n_vocab:
            raise _bad(path, f"metadata tokenizer.ggml.tokens: found {n} tokens, expected {n_vocab} (the rows of "
                       "token_embd.weight)")
        # llama.cpp renames empty tokens so they stay addressable but never match
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        ta = _num_array(md, "tokenizer.ggml.token_type", path, n, "iu", "integers")
        types = ta.astype(np.int64).tolist() if ta is not None else [NORMAL] * n
        vocab = {t: i for i, t in enumerate(tokens)}  # a repeated text maps to its last id
        try:
            if kind == "gpt2":
                hf, add_bos_default = _build_gpt2(md, path, tokens, types, vocab)
                strip_first_space = False
            else:
                hf, strip_first_space = _build_spm(md, path, tokens, types, vocab)
                add_bos_default = True
            # Control/user-defined tokens are matched in the raw text before the model
            # runs, so "<|im_start|>" is one id. Only control ones can be turned off.
            hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                   for i in range(n) if types[i] in (CONTROL, UNKNOWN)])
            hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                           for i in range(n) if types[i] == USER_DEFINED])
        except HybridMoeError:
            raise
        except Exception as e:  # tokenizers rejected what the file holds
            raise _bad(path, f"cannot build the {kind} tokenizer: "
                       + " ".join(str(e).split())) from e
        return cls(
            kind=kind, tokens=tokens, types=types, hf=hf,
            bos_id=_opt_id(md, "tokenizer.ggml.bos_token_id", path, n),
            eos_id=_opt_id(md, "tokenizer.ggml.eos_token_id", path, n),
            eot_id=_opt_id(md, "tokenizer.ggml.eot_token_id", path, n),
            eom_id=_opt_id(md, "tokenizer.ggml.eom_token_id", path, n),
            add_bos=_opt_bool(md, "tokenizer.ggml.add_bos_token", path, add_bos_default),
            add_eos=_opt_bool(md, "tokenizer.ggml.add_eos_token", path, False),
            strip_first_space=strip_first_space,
            chat_template=_opt_str(md, "tokenizer.chat_template", path),
            fim={role: i for role in FIM_TEXTS
                 if (i := _opt_id(md, f"tokenizer.ggml.fim_{role}_token_id", path, n)) is not None},
        )

    # -------------------------------------------------------------- properties
    @property
    def n_vocab(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every id that ends generation."""
        return self._eos_ids

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    def token_text(self, token_id: int) -> str:
        return self._tokens[token_id]

    def token_to_id(self, text: str) -> int | None:
        return self._hf.token_to_id(text)

    def is_control(self, token_id: int) -> bool:
        return self._types[token_id] in (CONTROL, UNKNOWN)

    # -------------------------------------------------------------- encode
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for `text`. `add_special` adds BOS (and EOS) where the model
        asks for them; `parse_special=False` reads control tokens as plain text."""
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, got {type(text).__name__}")
        hf = self._hf if parse_special else self._literal()
        ids = hf.encode(text, add_special_tokens=False).ids
        if add_special:
            # A chat template that already wrote BOS must not get a second one.
            if self._add_bos and not (ids and ids[0] == self._bos_id):
                ids.insert(0, self._bos_id)
            if self._add_eos:
                ids.append(self._eos_id)
        return ids

    def _literal(self):
        if self._hf_literal is None:
            t = tokenizers.Tokenizer.from_str(self._hf.to_str())
            t.encode_special_tokens = True
            self._hf_literal = t
        return self._hf_literal

    # -------------------------------------------------------------- decode
    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (control tokens: their text)."""
        p = self._pieces[token_id]
        if p is not None:
            return p
        text, ty = self._tokens[token_id], self._types[token_id]
        if ty == UNUSED:
            p = b""
        elif ty in (CONTROL, UNKNOWN, USER_DEFINED):
            p = text.encode()
        elif self.kind == "llama":
            m = _BYTE_TOKEN.fullmatch(text) if ty == BYTE else None
            p = bytes([int(m.group(1), 16)]) if m else text.replace("▁", " ").encode()
        else:
            out = bytearray()
            for ch in text:
                b = UNICODE_TO_BYTE.get(ch)
                if b is None:
                    out += ch.encode()  # not byte-level text; keep it as is
                else:
                    out.append(b)
            p = bytes(out)
        self._pieces[token_id] = p
        return p

    def decode(self, ids, skip_special: bool = False) -> str:
        """Text for `ids`; bytes that do not form valid UTF-8 become U+FFFD."""
        s = self.stream(skip_special)
        return "".join([s.add(i) for i in ids]) + s.flush()

    def stream(self, skip_special: bool = False) -> "StreamDetokenizer":
        return StreamDetokenizer(self, skip_special)

    # -------------------------------------------------------------- chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        from .chat import render_chat_template

        def text(i):
            return self._tokens[i] if i is not None else ""
        kwargs.setdefault("bos_token", text(self._bos_id))
        kwargs.setdefault("eos_token", text(self._eos_id))
        return render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt, **kwargs)


class StreamDetokenizer:
    """Turns ids into text one at a time; a character split over several tokens
    comes out once its last byte has arrived."""

    def __init__(self, tok: Tokenizer, skip_special: bool = False):
        self._tok = tok
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._strip = tok._strip_first_space  # SPM: drop the '▁' added at encode time

    def add(self, token_id) -> str:
        token_id = int(token_id)
        if not 0 <= token_id < self._tok.n_vocab:
            raise ValueError(f"token id {token_id} is outside the vocabulary "
                             f"(0..{self._tok.n_vocab - 1})")
        control = self._tok.is_control(token_id)
        if control and self._skip:
            return ""
        b = self._tok.piece_bytes(token_id)
        if self._strip and not control:
            self._strip = False
            if b[:1] == b" ":
                b = b[1:]
        return self._utf8.decode(b)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character comes out as U+FFFD)."""
        return self._utf8.decode(b"", final=True)
