"""GGUF tokenizer metadata without downloads.

* `builtin_vocab_metadata(n_vocab)`: a small Qwen-like byte-level BPE, trained
  deterministically on the English text below, for synthetic test models.
* `hf_tokenizer_to_metadata(tok)`: a HF byte-level BPE tokenizer.json turned into
  the `tokenizer.ggml.*` keys that llama.cpp's converter writes.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Regex, decoders, pre_tokenizers, trainers

from ..errors import HybridMoeError, ModelFileError
from .chat import CHATML_TEMPLATE
from .tokenizer import (
    BYTE_TO_UNICODE,
    CONTROL,
    GPT2_RE,
    GPT4O_RE,
    LLAMA3_RE,
    NORMAL,
    QWEN2_RE,
    UNUSED,
    USER_DEFINED,
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MAX_BUILTIN_MERGES = 4000

# Original text written for this module: a mix of topics, dialogue, numbers,
# code and punctuation so the merges look like a real English vocabulary.
_CORPUS = """\
The morning train left the station at seven, carrying farmers, students and a few
tired engineers who had worked through the night. Outside the windows, the fields
were still grey with frost, and the river beside the tracks moved slowly under a
thin layer of mist. Nobody spoke much; most people read, slept, or watched the
light change over the hills.

"Do you think it will rain today?" asked the woman in the blue coat.
"Probably not," her friend answered. "The forecast said clear skies until Friday."
"That's what they said last week, and we were soaked by noon."
They both laughed, and the conversation drifted to other things: the price of
bread, a cousin's wedding, the new library that had opened on Market Street.

A computer program is a sequence of instructions that tells a machine what to do.
Good programs are written for people first and for computers second. Clear names,
small functions and honest comments make code easier to read, test and change.
When a test fails, the error message should explain what went wrong and how to
fix it, instead of printing a long trace that only the original author understands.

def average(values):
    if not values:
        raise ValueError("average() needs at least one value")
    return sum(values) / len(values)

for i in range(10):
    print(i, i * i, average([i, i + 1, i + 2]))

Water boils at 100 degrees Celsius at sea level, but at higher altitudes the
boiling point is lower because the air pressure is lower. On a mountain 3,000
metres high, water boils at roughly 90 degrees, which is why cooking pasta takes
longer there. Ice, on the other hand, melts at 0 degrees almost everywhere.

The history of writing began with simple marks on clay and bone. Over thousands of
years those marks became symbols for words, then for sounds, and finally for the
letters we use today. Printing made books cheaper; the telegraph made messages
faster; computers made it possible to store every book ever written in a space
smaller than a shoebox.

Recipe for a simple tomato soup: chop two onions and three cloves of garlic, fry
them gently in olive oil for ten minutes, add 800 grams of tomatoes, a litre of
stock, salt and pepper. Simmer for twenty-five minutes, blend until smooth, and
serve with fresh bread. It keeps well in the fridge for three or four days.

Questions people often ask:
1. How long does it take to learn a new language? It depends on the language,
   the learner, and how many hours a week they practise.
2. Why is the sky blue? Sunlight is scattered by the molecules in the air, and
   blue light is scattered more than red light.
3. What is the largest planet in our solar system? Jupiter, by a wide margin.

In 1969, two astronauts walked on the Moon while a third waited in orbit. The
journey took about three days each way. Millions of people watched the grainy
black-and-white pictures on television, and many of them remembered exactly where
they were on that July evening for the rest of their lives.

She opened the letter carefully, as if it might break. Inside was a single sheet of
paper, folded twice, with only three lines of handwriting: "I am sorry. I was
wrong. Please come home." She read it again, put it back in the envelope, and
looked out of the window for a long time before she reached for her coat.

Markets rise and fall for many reasons. Interest rates, harvests, elections,
storms and rumours all play a part. A careful investor spreads money across
different assets, keeps some savings in cash, and avoids decisions made in panic.
Nobody can predict next month's prices with certainty, whatever the newspapers say.

The cat sat on the warm windowsill and ignored everyone. When the dog came in,
wagging its tail and carrying a muddy ball, the cat simply closed its eyes. The
children thought this was very funny; their parents were more worried about the
mud on the carpet.

Email: support@example.com | Phone: +1 (555) 012-3456 | Hours: 09:00-17:30, Mon-Fri.
Total: $1,249.99 (including 20% tax). Order #A-7731 shipped on 2024-03-15.
Version 2.4.1 fixes three bugs, improves start-up time by 35%, and adds support for
larger files (up to 4 GB). See CHANGELOG.md for details.

Learning to play the piano takes patience. At first the hands refuse to move
independently, and even a simple melody sounds clumsy. After a few months of daily
practice, however, the fingers begin to remember the patterns, and the music starts
to flow. Teachers often say that fifteen minutes every day is better than two hours
once a week.

Forests cover about a third of the land on Earth. They store carbon, shelter animals
and plants, clean the air and hold soil in place during heavy rain. When a forest is
cut down, the ground dries out, rivers carry away the soil, and it can take a hundred
years or more for the trees to return.

{"name": "example", "count": 3, "tags": ["alpha", "beta", "gamma"], "active": true}
SELECT name, price FROM products WHERE price < 20 ORDER BY name;
git commit -m "Fix off-by-one error in the parser"

The old lighthouse keeper kept a diary for forty years. Each entry recorded the
weather, the ships that passed, and small events of island life: a broken window,
a visit from the doctor, the first swallows of spring. Read today, the diary is a
quiet history of a place that most people never saw.

Good morning! How are you today? I'm fine, thanks. Could you help me with something?
Of course. What do you need? I'm trying to understand how tokenizers work. They split
text into pieces called tokens; common words become single tokens, while rare words
are broken into smaller parts. That's why "unbelievably" might become "un", "believ"
and "ably", while "the" stays whole.

Mathematics is the language of patterns. The sum of the first n odd numbers is n
squared: 1 + 3 = 4, 1 + 3 + 5 = 9, 1 + 3 + 5 + 7 = 16. The area of a circle is pi
times the radius squared, and pi is approximately 3.14159. Prime numbers such as 2,
3, 5, 7, 11 and 13 can only be divided evenly by one and by themselves.
"""

# Generated sentences add word forms (stem + affix) and numbers. A fixed LCG
# instead of `random` keeps the text identical on every Python and machine.
_STEMS = """
act add agree allow answer appear arrive ask attack avoid bake balance bank bear beat
believe belong bend bind bite blend block boil book borrow bother bounce box brake
branch breathe brick bridge bring brush build burn buy calculate call camp care carry
catch cause change charge chase check cheer chew circle claim clean clear climb close
coach collect colour comb comfort command compare complain complete concern connect
consider contain control cook copy correct cough count cover crack crash crawl cross
crowd cry cure cycle damage dance dare deal decide deliver depend describe design
destroy develop direct discover divide doubt drag drain draw dream dress drink drive
drop dust earn educate employ empty encourage end enjoy enter equal escape examine
excite exist expand expect explain explode express extend face fail fasten fear feed
fill film finish fit fix flash float flood flow fold follow force form found frame
free frighten fry gather gaze glow govern grab grant greet grip groan grow guard guess
guide hammer hand handle hang happen harm hate heal heap heat help hook hope hover
hunt hurry identify ignore imagine improve include increase inform inject insist
instruct intend interest invent invite join joke judge jump keep kick kill kiss kneel
knit knock label land last laugh launch lead learn lend level lift light like limit
list listen live load lock look love manage mark marry match matter measure meet melt
mend mind miss mix move murmur nail name need nest note notice number obey object
observe obtain occur offer open order organise own pack paint park part pass paste
pause perform permit pick place plan plant play please plug point polish pour practise
praise pray present press pretend prevent print produce program promise protect
provide pull pump punch push question race rain raise reach read realise receive
record reduce reflect refuse regret reign reject relax release remain remember remind
remove repair repeat replace reply report request rescue rest return reward rhyme ring
risk roll rule run rush sail save scatter school score scratch scream search season
seat seem select sell send serve settle shape share shelter shift shine shock shop
shout show sign signal sing sink sleep slide slip smell smile smoke snow solve sort
sound spark speak spell spend spill spoil spray spread spring squeeze stamp stand
start stay steer step stir stop store strap stretch strike structure study succeed
suffer suggest supply support suppose surprise surround suspect swim switch talk taste
teach tear tempt test thank think thrill tickle tie time tip tire touch tour trace
trade train transport trap travel treat tremble trust try turn twist type understand
unite unlock use value vanish visit vote wait walk wander want warm warn wash waste
watch water wave wear weigh welcome whisper wish wonder work worry wrap write yawn
"""
_AFFIXES = ("", "s", "ed", "ing", "er", "ers", "able", "ment", "ly", "ful", "less", "ness",
            "ation", "ive")
_PREFIXES = ("", "", "", "un", "re", "pre", "over", "mis", "out", "dis")
_FRAMES = ("The {a} of the {b} was {c}.", "We {a} and {b} before the {c} began.",
           "Why did they {a} the {b}?", "{A} {b}, {c} and {d}.", "Nobody {a} {b} on {n} days.",
           "She said the {a} cost {n} dollars, not {m}.", "In {y}, {n} people {a} the {b}.",
           '"{A}!" he shouted, "the {b} is {c}!"')


def _generated(n_lines: int = 5000) -> list[str]:
    stems = _STEMS.split()
    state = 20240917

    def rnd(k):
        nonlocal state
        state = (state * 1103515245 + 12345) % 2**31
        return (state >> 8) % k

    def word():
        w = _PREFIXES[rnd(len(_PREFIXES))] + stems[rnd(len(stems))]
        return w + _AFFIXES[rnd(len(_AFFIXES))]

    lines = []
    for _ in range(n_lines):
        a = word()
        lines.append(_FRAMES[rnd(len(_FRAMES))].format(
            a=a, A=a.capitalize(), b=word(), c=word(), d=word(), n=rnd(1000), m=rnd(100000),
            y=1800 + rnd(225)))
    return lines


def _corpus() -> list[str]:
    return _CORPUS.split("\n\n") + _generated()


def _qwen2_pre_tokenizer():
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_RE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


@functools.lru_cache(maxsize=4)
def _trained_json(n_merges: int) -> str:
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = _qwen2_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + n_merges, min_frequency=2,
                                  show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok.to_str()


def builtin_tokenizer(n_vocab: int) -> tokenizers.Tokenizer:
    """The HF tokenizer behind `builtin_vocab_metadata(n_vocab)` (without padding)."""
    if n_vocab < 256 + len(SPECIAL_TOKENS):
        raise HybridMoeError(f"n_vocab={n_vocab} is too small for the built-in vocabulary "
                             f"(needs at least {256 + len(SPECIAL_TOKENS)})")
    n_merges = min(MAX_BUILTIN_MERGES, n_vocab - 256 - len(SPECIAL_TOKENS))
    return tokenizers.Tokenizer.from_str(_trained_json(n_merges))


def builtin_vocab_metadata(n_vocab: int) -> dict:
    """Qwen-like GGUF tokenizer metadata with exactly `n_vocab` tokens."""
    tok = builtin_tokenizer(n_vocab)
    return hf_tokenizer_to_metadata(
        tok, n_vocab=n_vocab, pre="qwen2", chat_template=CHATML_TEMPLATE,
        bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        add_bos_token=False)


# ---------------------------------------------------------------- HF conversion

def _pattern(pre_tok) -> str | None:
    if isinstance(pre_tok, dict):
        p = pre_tok.get("pattern")
        if isinstance(p, dict):
            return p.get("Regex") or p.get("String")
    return None


# HF files write "(?i:'s|...)"; llama.cpp (and tokenizer.py) spell it out by case.
_CONTRACTIONS_SPELLED = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"


def _detect_pre(pt, where) -> str:
    """llama.cpp's pre-tokenizer name for a tokenizer.json pre_tokenizer."""
    steps = pt.get("pretokenizers", [pt]) if isinstance(pt, dict) else []
    splits = [_pattern(s) for s in steps if s.get("type") == "Split"]
    byte_regex = any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps)
    if not splits and byte_regex:
        return "gpt-2"
    if len(splits) == 1 and splits[0]:
        forms = {splits[0], splits[0].replace("(?i:'s|'t|'re|'ve|'m|'ll|'d)",
                                              _CONTRACTIONS_SPELLED)}
        for name, regex in (("qwen2", QWEN2_RE), ("llama-bpe", LLAMA3_RE),
                            ("gpt-4o", GPT4O_RE), ("gpt-2", GPT2_RE)):
            if regex in forms:
                return name
    raise ModelFileError(where, "cannot tell which llama.cpp pre-tokenizer this tokenizer uses",
                         "pass pre=... (e.g. 'qwen2', 'llama-bpe', 'gpt-2')")


def _token_content(v):
    if isinstance(v, dict):  # tokenizer_config.json: {"content": "<s>", ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def _read_config(folder: Path) -> dict:
    cfg = {}
    f = folder / "tokenizer_config.json"
    if f.is_file():
        try:
            cfg = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelFileError(f, f"cannot read: {e}") from e
    jinja = folder / "chat_template.jinja"
    if jinja.is_file() and not cfg.get("chat_template"):
        cfg["chat_template"] = jinja.read_text(encoding="utf-8")
    ct = cfg.get("chat_template")
    if isinstance(ct, list):  # [{"name": "default", "template": ...}, ...]
        named = {d.get("name"): d.get("template") for d in ct if isinstance(d, dict)}
        cfg["chat_template"] = named.get("default")
    return cfg


def hf_tokenizer_to_metadata(tok, *, n_vocab: int | None = None, pre: str | None = None,
                             chat_template: str | None = None, bos_token=None,
                             eos_token=None, pad_token=None,
                             add_bos_token: bool | None = None) -> dict:
    """GGUF `tokenizer.ggml.*` metadata for a HF byte-level BPE tokenizer.

    `tok` is a `tokenizers.Tokenizer`, a tokenizer.json path, or a model folder
    (then tokenizer_config.json / chat_template.jinja beside it fill in the chat
    template, special tokens and add_bos_token unless given here). Special tokens
    may be given as text or id. `n_vocab` pads the list with unused `[PAD{i}]`
    tokens up to the model's embedding size.
    """
    cfg, where = {}, "tokenizer"
    if not isinstance(tok, tokenizers.Tokenizer):
        p = Path(tok)
        if p.is_dir():
            p = p / "tokenizer.json"
        where = str(p)
        try:
            tok = tokenizers.Tokenizer.from_file(str(p))
        except Exception as e:
            raise ModelFileError(p, f"cannot load tokenizer: {' '.join(str(e).split())}") from e
        cfg = _read_config(p.parent)
    try:
        return _convert(json.loads(tok.to_str()), tok, cfg, where, n_vocab, pre, chat_template,
                        bos_token, eos_token, pad_token, add_bos_token)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ModelFileError(where, f"unexpected tokenizer.json layout ({type(e).__name__}: "
                             f"{' '.join(str(e).split())})") from e


def _convert(spec, tok, cfg, where, n_vocab, pre, chat_template, bos_token, eos_token,
             pad_token, add_bos_token) -> dict:
    model = spec.get("model") or {}
    steps = spec.get("pre_tokenizer") or {}
    byte_level = "ByteLevel" in json.dumps([steps, spec.get("decoder")])
    if model.get("type") != "BPE" or not byte_level:
        raise ModelFileError(where, "only byte-level BPE tokenizers can be converted",
                             f"this one is {model.get('type')} without a ByteLevel step"
                             if not byte_level else f"model type is {model.get('type')}")
    pre = pre or _detect_pre(steps, where)

    id_to_text: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    types: dict[int, int] = {i: NORMAL for i in id_to_text}
    for a in spec.get("added_tokens") or []:
        id_to_text[a["id"]] = a["content"]
        types[a["id"]] = CONTROL if a.get("special") else USER_DEFINED
    size = max(id_to_text) + 1
    if n_vocab is not None:
        if n_vocab < size:
            raise ModelFileError(where, f"tokenizer has {size} tokens, more than n_vocab={n_vocab}")
        size = n_vocab
    tokens = [id_to_text.get(i, f"[PAD{i}]") for i in range(size)]
    token_type = np.array([types.get(i, UNUSED) for i in range(size)], dtype=np.int32)
    missing = [c for c in BYTE_TO_UNICODE.values() if c not in model["vocab"]]
    if missing:
        raise ModelFileError(where, f"vocabulary lacks {len(missing)} of the 256 byte tokens",
                             "not a byte-level BPE vocabulary")

    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]

    def token_id(v, key):
        v = _token_content(v) if not isinstance(v, int) else v
        if v is None:
            return None
        i = v if isinstance(v, int) else tok.token_to_id(v)
        if i is None or not 0 <= i < size:
            raise ModelFileError(where, f"{key} {v!r} is not in the vocabulary")
        return i

    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_type,
        "tokenizer.ggml.merges": merges,
    }
    for key, given, cfg_key in (("bos_token_id", bos_token, "bos_token"),
                                ("eos_token_id", eos_token, "eos_token"),
                                ("padding_token_id", pad_token, "pad_token")):
        i = token_id(given if given is not None else cfg.get(cfg_key), cfg_key)
        if i is not None:
            md[f"tokenizer.ggml.{key}"] = i
    if add_bos_token is None:
        add_bos_token = cfg.get("add_bos_token")
    if isinstance(add_bos_token, bool):
        md["tokenizer.ggml.add_bos_token"] = add_bos_token
    template = chat_template if chat_template is not None else cfg.get("chat_template")
    if isinstance(template, str) and template:
        md["tokenizer.chat_template"] = template
    return md
