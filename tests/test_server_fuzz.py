"""Hostile-input fuzzing of every endpoint of the server, on a real loopback socket: random and malformed JSON
bodies, fields of the wrong type, huge and tiny numbers, deep nesting, bad headers and paths, Unicode edge
cases. A fixed seed and a fixed number of requests (~20-30 s on 2 cores). Every answer must be a 2xx or a 4xx
(501 where a feature is off), never a 500; every error must have a JSON body in the API's shape (Anthropic's
under /v1/messages); streams must not end in an error event; and a connection must stay usable after any
answer that does not say `Connection: close`."""
from __future__ import annotations

import json
import random
import threading
import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.slow

import hybridmoe
from hybridmoe.serve.app import create_app

from test_server import FIM_IDS, HERMES_TEMPLATE
from test_server_failures import RawConn, serve

SEED = 27
N_REQUESTS = 6000
N_CONCURRENT = 150     # requests per client of the concurrent run (8 clients)
N_CTX = 160
KEY = "k"
ALLOWED = {200, 400, 401, 404, 405, 413, 501}


@pytest.fixture(scope="module")
def fuzz_url(tmp_path_factory):
    """synth:tiny with FIM tokens (so /infill runs), a Hermes template (so tools render and tool_choice
    forces calls), an API key, --metrics, --slot-save-path and -n 4."""
    from hybridmoe.text.tokenizer import Tokenizer
    model = hybridmoe.load("synth:tiny", ctx_size=N_CTX)
    "".join(model.generate("Hi", 2, temperature=0))       # builds the CPU kernels before any request waits on them
    md = dict(model.file.metadata, **{f"tokenizer.ggml.fim_{r}_token_id": i for r, i in FIM_IDS.items()})
    model.tokenizer = Tokenizer.from_metadata(md, "fim.gguf")
    model.tokenizer.chat_template = HERMES_TEMPLATE
    app = create_app(model, alias="fuzz", api_key=KEY, metrics=True,
                     slot_save_path=str(tmp_path_factory.mktemp("slots")))
    state = app.state.hybridmoe
    state.n_predict = 4
    check_prompt = state.check_prompt           # the requests are checked as ever; a reply is cut at 6 tokens (a
    state.check_prompt = lambda *a: min(check_prompt(*a), 6)   # fuzzer that fills the context learns nothing)
    yield from serve(app)
    app.state.hybridmoe.close()


# ---------------------------------------------------------------------------------------------- values

UNICODE = ["", "x", "\x00", "\ufeff", "\u202e evil", "e\u0301", "\uffff", "\U0010ffff", "\U0001F600", "<|im_start|>",
           "<|im_end|>", "<tool_call>", "</think>", "\r\n\t", "{{ 7 * 7 }}", "{% for x in y %}", "\\", '"', "%s%n",
           "a\ud800b", "\udfff", "\u0085\u2028\u2029", "日本語", "\x7f\x80", " " * 300, "Ω" * 100]
RAW_NUMBERS = ["1e400", "-1e400", "1" + "0" * 5000, "1" + "0" * 300, "-0", "1E+2", "0." + "0" * 400 + "1",
               "NaN", "Infinity", "-Infinity", "123456789012345678901234567890"]
NUMBERS = [0, 1, -1, 2, 0.5, -0.5, 1e308, -1e308, 10 ** 30, -(10 ** 30), 2 ** 63, 2 ** 63 - 1, -(2 ** 63) - 1,
           2 ** 64, 5e-324, -0.0, 1e-39, 0.999999, 100, 101, -100, -101, 20, 21, N_CTX, N_CTX * 10]


class Fuzz:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.raw: list[str] = []          # raw JSON texts for numbers json.dumps cannot write

    # ------------------------------------------------------------------------------------- primitives
    def pick(self, seq):
        return seq[self.rng.randrange(len(seq))]

    def raw_number(self):
        self.raw.append(self.pick(RAW_NUMBERS))
        return f"__RAW{len(self.raw) - 1}__"

    def text(self):
        r = self.rng.random()
        if r < 0.6:
            return self.pick(UNICODE)
        if r < 0.8:
            return "".join(self.pick(UNICODE) for _ in range(self.rng.randrange(1, 5)))
        if r < 0.9:
            return self.pick(["Once upon a time", "def f(x):", "Hi!", "JSON please"])
        return "a" * self.rng.choice([1000, 20000])

    def deep(self):
        """Arrays or objects nested 20 to 5000 deep (as raw JSON text: json.dumps itself stops at ~1000)."""
        n = self.rng.choice([20, 64, 65, 200, 900, 990, 5000])
        opens = "".join(self.pick(["[", '{"a": ']) for _ in range(n))
        closes = "".join("]" if o == "[" else "}" for o in reversed(opens.replace('{"a": ', "{")))
        self.raw.append(opens + self.pick(["1", '"x"', "null", "{}", "[]"]) + closes)
        return f"__RAW{len(self.raw) - 1}__"

    def junk(self, depth=0):
        """A value of any type, hostile or not."""
        r = self.rng.random()
        if r < 0.25:
            return self.pick([None, True, False, [], {}, [None], {"a": 1}, "", [1, 2, 3]])
        if r < 0.5:
            return self.pick(NUMBERS) if self.rng.random() < 0.8 else self.raw_number()
        if r < 0.7:
            return self.text()
        if r < 0.75 and depth == 0:
            return self.deep()
        if r < 0.8:
            return list(range(self.rng.choice([100, 100000])))
        if depth < 3:
            if self.rng.random() < 0.5:
                return [self.junk(depth + 1) for _ in range(self.rng.randrange(4))]
            return {self.pick(["a", "type", "text", "role", "content", "", "\U0001F600"]): self.junk(depth + 1)
                    for _ in range(self.rng.randrange(4))}
        return 0

    # ------------------------------------------------------------------------------------- schemas, grammars
    def schema(self, depth=0):
        rng = self.rng
        if depth > 3 or rng.random() < 0.15:
            return self.pick([True, False, {}, {"type": "string"}, {"type": "integer"}, 1, "x", None])
        kind = self.pick(["object", "array", "string", "number", "integer", "boolean", "null", None, ["string", "null"],
                          "nope", 5])
        s = {} if kind is None else {"type": kind}
        if kind == "object" or rng.random() < 0.2:
            props = {self.pick(["a", "b", "name", "x y", "é", ""]): self.schema(depth + 1)
                     for _ in range(rng.randrange(3))}
            s["properties"] = props
            if rng.random() < 0.6:
                s["required"] = rng.sample(list(props) + ["zz"], rng.randrange(len(props) + 2))
            if rng.random() < 0.5:
                s["additionalProperties"] = self.pick([False, True, {"type": "integer"}])
        if kind == "array" or rng.random() < 0.1:
            s["items"] = self.schema(depth + 1)
            if rng.random() < 0.3:
                s["prefixItems"] = [self.schema(depth + 1) for _ in range(rng.randrange(3))]
        for k in ("minItems", "maxItems", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
                  "exclusiveMaximum"):
            if rng.random() < 0.12:
                s[k] = self.pick([0, 1, 2, 5, -1, 1.5, 1e300, -1e300, 10 ** 40, "3", None]) \
                    if rng.random() < 0.9 else self.raw_number()
        if rng.random() < 0.15:
            s["enum"] = [self.junk(2) for _ in range(rng.randrange(3))]
        if rng.random() < 0.08:
            s["const"] = self.junk(2) if rng.random() < 0.8 else self.deep()
        if rng.random() < 0.12:
            s["pattern"] = self.pick(["^a+$", "[", "(a|b)*c", "\\d{3}", "(?<=x)y", "^(a+)+$", "\\p{L}+", ""])
        if rng.random() < 0.08:
            s["format"] = self.pick(["date", "time", "date-time", "uuid", "email"])
        if rng.random() < 0.1:
            s[self.pick(["anyOf", "oneOf", "allOf"])] = [self.schema(depth + 1) for _ in range(rng.randrange(3))]
        if rng.random() < 0.06:
            s["$defs"] = {"a": self.schema(depth + 1)}
            s["$ref"] = self.pick(["#/$defs/a", "#", "#/nope", "http://x", 5])
        if rng.random() < 0.05:
            s[self.pick(["not", "if", "uniqueItems", "multipleOf", "x-custom"])] = self.junk(2)
        return s

    def grammar(self):
        return self.pick(['root ::= "a"', "root ::= [a-z]{1,3}", 'root ::= "x" root | "y"', "root ::= root",
                          "root ::= x", "", "root ::= <[5]>", "root ::= <think>", "root ::= !<[9999999]>",
                          'root ::= ("a" | "b")* "."', "root ::= [^\\x00]{0,4}", "root ::= " + "(" * 300,
                          "root ::= \"\\ud800\"", "root ::= " + " | ".join(f'"{i}"' for i in range(200)),
                          "root ::= [a-" , "x ::= \"a\""])

    # ------------------------------------------------------------------------------------- request parts
    def message(self):
        rng = self.rng
        role = self.pick(["user", "user", "assistant", "system", "developer", "tool", "wizard", None, 5])
        m = {"role": role}
        r = rng.random()
        if r < 0.5:
            m["content"] = self.text()
        elif r < 0.7:
            m["content"] = [self.pick([{"type": "text", "text": self.text()}, {"type": "image_url", "image_url": {}},
                                       {"type": "text"}, "x", {"type": "text", "text": 5}])
                            for _ in range(rng.randrange(3))]
        elif r < 0.8:
            m["content"] = None
        else:
            m["content"] = self.junk()
        if rng.random() < 0.15:
            m["tool_calls"] = self.pick([[{"id": "c1", "type": "function", "function": {
                "name": "f", "arguments": self.pick(['{"a": 1}', "not json", {"a": 1}, None])}}], "x", [5], []])
        if rng.random() < 0.1:
            m[self.pick(["name", "tool_call_id"])] = self.pick(["n", 5, None, self.text()])
        return m

    def messages(self):
        r = self.rng.random()
        if r < 0.7:
            return [self.message() if self.rng.random() < 0.4 else {"role": "user", "content": self.text()}
                    for _ in range(self.rng.randrange(1, 4))]
        return self.junk()

    def tools(self):
        return [{"type": self.pick(["function", "function", "x"]),
                 "function": self.pick([{"name": self.pick(["f", "get_weather", "", 5]), "parameters": self.schema()},
                                        {"name": "f"}, "x", None])} for _ in range(self.rng.randrange(1, 3))]

    def anthropic_messages(self):
        blocks = [lambda: {"type": "text", "text": self.text()},
                  lambda: {"type": "tool_use", "id": "t1", "name": "f", "input": self.junk(2)},
                  lambda: {"type": "tool_result", "tool_use_id": self.pick(["t1", 5]), "content": self.pick(
                      [self.text(), [{"type": "text", "text": "ok"}], 5]), "is_error": self.pick([True, False, "x"])},
                  lambda: {"type": "thinking", "thinking": "hm"}, lambda: {"type": "image", "source": {}},
                  lambda: self.junk(2)]
        out = []
        for _ in range(self.rng.randrange(1, 4)):
            role = self.pick(["user", "user", "assistant", "system", None])
            content = self.text() if self.rng.random() < 0.5 else [self.pick(blocks)() for _ in range(
                self.rng.randrange(1, 3))]
            out.append({"role": role, "content": content})
        return out if self.rng.random() < 0.85 else self.junk()

    def logit_bias(self):
        r = self.rng.random()
        if r < 0.4:
            return {self.pick(["1", "5", "-1", "99999", "x", "1e3", " 7 ", "1_0", "9" * 5000, "\U0001F600"]):
                    self.pick([1, -100, 100, 101, -1e308, 0.5, False, True, None, "x"]) for _ in range(3)}
        if r < 0.7:
            return [self.pick([[1, 2], [1, False], [1.0, 2], [True, 1], [1], [1, 2, 3], "x", [10 ** 30, 1],
                               [self.raw_number(), 1], [2, self.raw_number()]]) for _ in range(3)]
        return self.junk()

    FIELDS = {
        "common": {
            "max_tokens": None, "max_completion_tokens": None, "n_predict": None, "temperature": None,
            "top_p": None, "top_k": None, "min_p": None, "seed": None, "stop": "stop", "stream": None,
            "stream_options": "stream_options", "n": None, "logit_bias": "logit_bias", "presence_penalty": None,
            "frequency_penalty": None, "repeat_penalty": None, "repeat_last_n": None, "ignore_eos": None,
            "cache_prompt": None, "json_schema": "schema", "response_format": "response_format",
            "grammar": "grammar", "reasoning_format": None, "model": None, "logprobs": None,
            "top_logprobs": None, "n_probs": None, "echo": None, "suffix": None, "best_of": None, "zzz": None},
        "/v1/chat/completions": {"messages": "messages", "tools": "tools", "tool_choice": "tool_choice",
                                 "parallel_tool_calls": None, "chat_template_kwargs": "kwargs", "functions": None},
        "/v1/completions": {"prompt": "prompt"},
        "/completion": {"prompt": "prompt"},
        "/infill": {"input_prefix": "text", "input_suffix": "text", "input_extra": "extra", "prompt": "text"},
        "/v1/messages": {"messages": "anthropic_messages", "system": "system", "tools": "anthropic_tools",
                         "tool_choice": "anthropic_choice", "stop_sequences": "stop", "thinking": "thinking",
                         "max_tokens": None, "temperature": None, "top_p": None, "top_k": None, "stream": None,
                         "metadata": None, "cache_prompt": None},
        "/tokenize": {"content": "text", "add_special": None, "parse_special": None, "with_pieces": None},
        "/detokenize": {"tokens": "ids"},
        "/apply-template": {"messages": "messages", "tools": "tools", "chat_template_kwargs": "kwargs",
                            "tool_choice": "tool_choice"},
        "/slots/0": {"filename": "filename"},
    }

    PLAIN = {   # well-formed values of the scalar fields, some at their edges
        "max_tokens": [1, 2, 3], "max_completion_tokens": [1, 2], "n_predict": [-1, 1, 3], "n": [1],
        "temperature": [0, 0.5, 1.0, 2.0, 1e-39, 5e-324, 100.0], "top_p": [0, 0.01, 0.5, 1, 5e-324],
        "top_k": [0, 1, 5, 10 ** 9],
        "min_p": [0, 0.5, 1], "seed": [0, 1, -1, 2 ** 63 - 1, -(2 ** 63)], "stream": [True, False],
        "presence_penalty": [-2, 0, 2], "frequency_penalty": [-2, 0.5, 2], "repeat_penalty": [0.01, 1, 1.5, 100],
        "repeat_last_n": [-1, 0, 1, 64, 2 ** 31 - 1], "ignore_eos": [True, False], "cache_prompt": [True, False],
        "reasoning_format": ["auto", "deepseek", "none"], "logprobs": [True, False, 0, 5],
        "top_logprobs": [0, 5, 20], "n_probs": [0, 1, 20], "model": ["fuzz", "gpt-4o"], "with_pieces": [True],
        "add_special": [True, False], "parse_special": [True, False], "parallel_tool_calls": [True, False],
        "best_of": [1], "echo": [False]}

    def field_value(self, kind, key=None, plain=False):
        """A value for a field: of its own kind (often well-formed) or anything; `plain`: well-formed only
        (as far as the generators go)."""
        if kind is None and plain and key in self.PLAIN:
            return self.pick(self.PLAIN[key])
        if kind is None or (not plain and self.rng.random() < 0.35):
            return self.junk()
        rng = self.rng
        return {
            "stop": lambda: self.pick([self.text(), [self.text() for _ in range(rng.randrange(4))],
                                       ["s"] * 17, ["x" * 513]]),
            "stream_options": lambda: self.pick([{"include_usage": True}, {"include_usage": "x"}, "x"]),
            "logit_bias": self.logit_bias,
            "schema": self.schema,
            "response_format": lambda: self.pick([{"type": "json_object"}, {"type": "text"}, {"type": "xml"},
                                                  {"type": "json_schema", "json_schema": {"name": "x",
                                                                                          "schema": self.schema()}},
                                                  {"type": "json_schema", "json_schema": "x"},
                                                  {"type": "json_object", "schema": self.schema()}]),
            "grammar": self.grammar,
            "messages": self.messages,
            "tools": self.tools,
            "tool_choice": lambda: self.pick(["auto", "none", "required", "x", {"type": "function", "function": {
                "name": self.pick(["f", "g", 5])}}, {"type": "function"}, 5]),
            "kwargs": lambda: self.pick([{"enable_thinking": False}, {"messages": 1}, {"x": self.deep()},
                                         {"tools": self.junk()}, "x"]),
            "prompt": lambda: self.pick([self.text(), [self.text()], [1, 2, 3], [-1], [10 ** 30], [[1, 2]],
                                         ["a", "b"], [], [True], list(range(N_CTX + 5)), [1.5]]),
            "text": self.text,
            "extra": lambda: self.pick([[{"filename": "a.py", "text": self.text()}], [{"text": 5}], ["x"], "x",
                                        [{"filename": 5, "text": "t"}]]),
            "anthropic_messages": self.anthropic_messages,
            "system": lambda: self.pick([self.text(), [{"type": "text", "text": self.text()}], [{"type": "image"}],
                                         5]),
            "anthropic_tools": lambda: [self.pick([{"name": "f", "input_schema": self.schema()},
                                                   {"name": "f", "type": "web_search_20250305"}, {"x": 1}, "x"])],
            "anthropic_choice": lambda: self.pick([{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "f"},
                                                   {"type": "tool", "name": 5}, {"type": "none"}, {"type": "x"}, "x"]),
            "thinking": lambda: self.pick([{"type": "disabled"}, {"type": "enabled", "budget_tokens": 10}, "x"]),
            "ids": lambda: self.pick([[1, 2, 3], [-1], [10 ** 30], ["x"], [1.0], list(range(1000)), [True], "x"]),
            "filename": lambda: self.pick(["a.slot", "b.slot", "../x", "", ".hidden", "a/b", "x" * 300, 5, None,
                                           "\U0001F600.slot", "con", "a..b"]),
        }[kind]()

    BASE = {
        "/v1/chat/completions": lambda: {"messages": [{"role": "user", "content": "Hi"}]},
        "/v1/completions": lambda: {"prompt": "Once upon a time"},
        "/completion": lambda: {"prompt": "Once upon a time"},
        "/infill": lambda: {"input_prefix": "def f(", "input_suffix": "):\n    pass"},
        "/v1/messages": lambda: {"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]},
        "/v1/messages/count_tokens": lambda: {"messages": [{"role": "user", "content": "Hi"}]},
        "/tokenize": lambda: {"content": "Hello world"},
        "/detokenize": lambda: {"tokens": [1, 2, 3]},
        "/apply-template": lambda: {"messages": [{"role": "user", "content": "Hi"}]},
        "/slots/0": lambda: {"filename": "a.slot"},
    }
    GENERATING = {"/v1/chat/completions", "/v1/completions", "/completion", "/infill", "/v1/messages"}
    LIMITS = ("max_tokens", "max_completion_tokens", "n_predict")

    def body(self, path: str) -> dict:
        body = self.BASE[path]()
        fields = dict(self.FIELDS.get("/v1/messages" if path.startswith("/v1/messages") else path, {}))
        if path in self.GENERATING and path != "/v1/messages":
            fields.update(self.FIELDS["common"])
        mutated = set()
        plain = self.rng.random() < 0.4           # well-formed fields only: the requests that get furthest
        for _ in range(self.rng.randrange(1, 5 if plain else 4)):
            if not fields:
                break
            key = self.pick(sorted(fields))
            body[key] = self.field_value(fields[key], key, plain)
            mutated.add(key)
        if path in self.GENERATING and not mutated & set(self.LIMITS):
            body["max_tokens" if path != "/completion" else "n_predict"] = self.rng.randrange(1, 4)
        return body

    def encode(self, body) -> bytes:
        text = json.dumps(body, ensure_ascii=self.rng.random() < 0.5)
        for i, raw in enumerate(self.raw):
            text = text.replace(f'"__RAW{i}__"', raw)
        self.raw.clear()
        return text.encode("utf-8", "surrogatepass")

    def raw_body(self, path: str) -> bytes:
        """A body that is not a good JSON object."""
        good = self.encode(self.body(path))
        return self.pick([
            b"", b"   ", b"null", b"[]", b'"x"', b"1", b"{", b"{}}", b'{"a": 1,}', b"{'a': 1}", good[:len(good) // 2],
            good + b"garbage", b"\xef\xbb\xbf" + good,
            good.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass"),
            b'{"a": NaN}', b'{"a": 1e400}', b'{"a": "\\ud800"}', b'{"a": "\xff\xfe"}', b'{"a": "\xc0\xaf"}',
            b'{"messages": 1, "messages": 2}', b"[" * 100000 + b"]" * 100000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
            bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(1, 200))), b"\x00" * 10,
            b'{"prompt": "' + b"a" * 100 + b'\x00"}'])


# ---------------------------------------------------------------------------------------------- the run

def check_answer(method: str, path: str, status: int, headers: dict, body: bytes, what: str, allowed=ALLOWED):
    assert status in allowed, f"{what}: {status} {body[:400]!r}"
    assert b"Traceback" not in body, what
    bare = path.split("?", 1)[0]
    anthropic = bare == "/v1/messages" or bare.startswith("/v1/messages/")
    if status >= 400:
        assert headers.get("content-type", "").startswith("application/json"), f"{what}: {headers}"
        j = json.loads(body)
        if anthropic and not j.get("error", {}).get("message", "").startswith("invalid HTTP request"):
            assert j.get("type") == "error" and set(j["error"]) == {"type", "message"}, f"{what}: {j}"
        else:
            assert set(j.get("error", {})) >= {"message", "type", "code"}, f"{what}: {j}"
        assert j["error"]["message"], what
        return
    ctype = headers.get("content-type", "")
    if ctype.startswith("application/json"):
        json.loads(body)
    elif ctype.startswith("text/event-stream"):
        assert b"event: error" not in body, f"{what}: {body[-400:]!r}"
        for line in body.split(b"\n"):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event or anthropic, f"{what}: {event}"


PATHS = ["/v1/chat/completions"] * 5 + ["/v1/completions"] * 2 + ["/completion"] * 3 + ["/infill"] * 2 + \
    ["/v1/messages"] * 4 + ["/v1/messages/count_tokens"] * 2 + ["/tokenize"] * 2 + \
    ["/detokenize", "/apply-template"] * 2 + ["/slots/0"] * 2 + ["GET"] * 3
GETS = ["/health", "/v1/health", "/v1/models", "/models", "/v1/models/fuzz", "/v1/models/%ED%A0%80",
        "/v1/models/a%00b", "/v1/models/" + "x" * 3000, "/props", "/slots", "/metrics", "/v1/nothing", "/%",
        "/v1/chat/completions", "/v1/messages", "/v1/messages/x", "/slots/0?action=erase", "/tokenize?x=%ZZ&y",
        "//v1//models", "/v1/models/..%2F..%2Fetc"]


def next_request(fz: Fuzz) -> tuple[str, str, bytes | None, dict, bool]:
    """(method, path, body, headers, fresh): one hostile request; fresh: send it on a connection of its own
    (its Content-Length leaves junk behind it)."""
    rng = fz.rng
    mode = rng.random()
    headers = {"Authorization": f"Bearer {KEY}"}
    path = fz.pick(PATHS)
    fresh = False
    if path == "GET":
        method, path, data = fz.pick(["GET", "GET", "POST", "DELETE", "PUT", "OPTIONS", "HEAD"]), fz.pick(GETS), None
        if method == "HEAD":
            method = "GET"                                  # (a HEAD answer has no body to check)
        if method != "GET":
            data = b"{}"
    else:
        method = "POST"
        if path == "/slots/0":
            path += "?action=" + fz.pick(["save", "restore", "erase", "dance", "", "save&action=x"])
        data = fz.raw_body(path.split("?")[0]) if mode < 0.15 else fz.encode(fz.body(path.split("?")[0]))
    if 0.15 <= mode < 0.27:                                 # hostile headers
        kind = rng.randrange(8)
        if kind == 0:
            headers = {"Authorization": fz.pick(["Bearer wrong", "Basic k", "Bearer", "", "Bearer k k",
                                                 "Bearer \xe9\xff"])}
        elif kind == 1:
            headers = {"x-api-key": fz.pick([KEY, "wrong", "\xe9"])}
        elif kind == 2:
            headers["Content-Type"] = fz.pick(["text/plain", "application/x-www-form-urlencoded",
                                               "multipart/form-data; boundary=x", "application/json; charset=latin-1"])
        elif kind == 3:
            headers["X-Long"] = "v" * 8000
        elif kind == 4:
            headers.update({f"X-H{j}": "v" for j in range(100)})
        elif kind == 5:
            headers["Accept-Encoding"] = "gzip, br, \xe9"
        elif kind == 6 and data is not None:                # fewer bytes than the body: the rest is junk
            fresh = True
            headers["Content-Length"] = str(rng.randrange(len(data) + 1))
        elif kind == 7 and data is not None:                # chunked, no Content-Length
            headers["Transfer-Encoding"] = "chunked"
    return method, path, data, headers, fresh


def describe(i, method, path, data, headers) -> str:
    shown = data if data is None or len(data) < 600 else data[:200] + b"...(%d bytes)..." % len(data) + data[-300:]
    return f"request {i}: {method} {path} {headers} {shown!r}"


def still_serving(url: str):
    """The server answers a plain chat request, and nothing is left running."""
    with RawConn(url) as c:
        status, _, body = send(c, "POST", "/v1/chat/completions",
                               json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode(),
                               {"Authorization": f"Bearer {KEY}"})
        assert status == 200 and json.loads(body)["choices"][0]["message"]["role"] == "assistant"
        for _ in range(100):
            status, _, body = send(c, "GET", "/slots", None, {"Authorization": f"Bearer {KEY}"})
            if not json.loads(body)[0]["is_processing"]:
                break
            time.sleep(0.1)
        assert not json.loads(body)[0]["is_processing"], "a generation was left running"


def test_fuzz_every_endpoint(fuzz_url):
    """N_REQUESTS hostile requests, one after another on a kept-alive connection."""
    fz = Fuzz(SEED)
    conn = RawConn(fuzz_url)
    counts: dict[int, int] = {}
    t0 = time.monotonic()
    try:
        for i in range(N_REQUESTS):
            method, path, data, headers, fresh = next_request(fz)
            what = describe(i, method, path, data, headers)
            c = RawConn(fuzz_url) if fresh else conn
            try:
                status, rh, body = send(c, method, path, data, headers)
            except (ConnectionError, OSError) as e:
                raise AssertionError(f"{what}: no answer ({e})") from None
            finally:
                if fresh:
                    c.close()
            check_answer(method, path, status, rh, body, what)
            counts[status] = counts.get(status, 0) + 1
            if not fresh and rh.get("connection", "").lower() == "close":
                conn.close()
                conn = RawConn(fuzz_url)
    finally:
        conn.close()
    still_serving(fuzz_url)
    print(f"fuzz: {N_REQUESTS} requests in {time.monotonic() - t0:.1f} s, answers {dict(sorted(counts.items()))}")
    assert counts.get(200, 0) > N_REQUESTS // 10 and counts.get(400, 0) > N_REQUESTS // 4


def test_fuzz_concurrently_with_clients_that_leave(fuzz_url):
    """8 clients at once, each sending hostile requests; a tenth of them leave right after sending (before any
    answer) or half-way through reading one. The others' answers keep the rules; nothing is left running."""
    errors: list[str] = []
    counts: dict[int, int] = {}

    def client(k: int):
        fz = Fuzz(SEED * 100 + k)
        conn = RawConn(fuzz_url)
        try:
            for i in range(N_CONCURRENT):
                method, path, data, headers, fresh = next_request(fz)
                what = describe(f"{k}.{i}", method, path, data, headers)
                leave = fz.rng.random()
                try:
                    if leave < 0.1:                         # gone before the answer, or in the middle of it
                        with RawConn(fuzz_url) as c:
                            if leave < 0.05:
                                c.send(build(method, path, data, headers))
                            else:
                                c.send(build(method, path, data, headers))
                                c.sock.recv(fz.rng.randrange(1, 200))
                        continue
                    c = RawConn(fuzz_url) if fresh else conn
                    try:
                        status, rh, body = send(c, method, path, data, headers)
                    finally:
                        if fresh:
                            c.close()
                    check_answer(method, path, status, rh, body, what, ALLOWED | {503})     # (the queue is full)
                    counts[status] = counts.get(status, 0) + 1
                    if not fresh and rh.get("connection", "").lower() == "close":
                        conn.close()
                        conn = RawConn(fuzz_url)
                except (AssertionError, ConnectionError, OSError) as e:
                    errors.append(f"{what}: {type(e).__name__}: {e}"[:3000])
                    return
        finally:
            conn.close()
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a client got no answer"
    assert not errors, "\n".join(errors)
    still_serving(fuzz_url)
    print(f"fuzz, 8 clients: {8 * N_CONCURRENT} requests in {time.monotonic() - t0:.1f} s, answers "
          f"{dict(sorted(counts.items()))}")


def send(c: RawConn, method: str, path: str, data: bytes | None, headers: dict):
    c.send(build(method, path, data, headers))
    return c.response()


def build(method: str, path: str, data: bytes | None, headers: dict) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: fuzz"]
    chunked = headers.get("Transfer-Encoding") == "chunked"
    if data is not None and "Content-Type" not in headers:
        head.append("Content-Type: application/json")
    if data is not None and "Content-Length" not in headers and not chunked:
        head.append(f"Content-Length: {len(data)}")
    head += [f"{k}: {v}" for k, v in headers.items()]
    payload = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
    if chunked:
        for j in range(0, len(data), 1000):
            part = data[j:j + 1000]
            payload += b"%x\r\n" % len(part) + part + b"\r\n"
        payload += b"0\r\n\r\n"
    elif data:
        payload += data
    return payload
