"""`hybridmoe serve`: the OpenAI-compatible server, run by uvicorn on a real socket and driven by the real
`openai` client (and raw httpx for the bad requests). synth:tiny has random weights, so the text is gibberish,
but it is deterministic: every check compares against `model.generate` or against another request. Those
exact comparisons run without the prompt cache (`cache_prompt: false`): as llama-server documents, a prompt's
tokens run alone (after a cached prefix) round differently from the same tokens in a batch; the prompt cache
has tests of its own."""
from __future__ import annotations

import asyncio
import functools
import json
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

import hybridmoe
from hybridmoe.serve.app import create_app
from hybridmoe.serve.jobs import StopMatcher

N_CTX = 2048
ALIAS = "tiny-test"
USER = "Tell me a story about a dragon."


class Running:
    def __init__(self, url, app, model, server, thread):
        self.url, self.app, self.model, self.server, self.thread = url, app, model, server, thread

    @property
    def state(self):
        return self.app.state.hybridmoe


def listening_socket() -> socket.socket:
    # proto IPPROTO_TCP: asyncio turns Nagle off (TCP_NODELAY) only on such sockets, as `serve` makes them; with
    # proto 0 every answer waited ~40 ms for the client's delayed ACK
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


@pytest.fixture(scope="module")
def srv():
    model = hybridmoe.load("synth:tiny", ctx_size=N_CTX)
    yield from serving(create_app(model, alias=ALIAS, metrics=True), model)


def serving(app, model):
    """Run `app` with uvicorn on a real socket until the generator is closed."""
    sock = listening_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive(), "the server thread died during startup"
            assert time.monotonic() < deadline, "the server did not start within 20 s"
            time.sleep(0.02)
        host, port = sock.getsockname()
        yield Running(f"http://{host}:{port}", app, model, server, thread)
    finally:
        server.should_exit = True
        thread.join(15)
        if thread.is_alive():
            server.force_exit = True
            thread.join(5)
        sock.close()
    assert not thread.is_alive(), "the server did not shut down"


@pytest.fixture(scope="module")
def ref():
    """A second copy of the model, for model.generate() outside the server."""
    return hybridmoe.load("synth:tiny", ctx_size=N_CTX)


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def chat_ids(model, messages) -> list[int]:
    tok = model.tokenizer
    return tok.encode(tok.apply_chat_template(messages))


NO_CACHE = {"cache_prompt": False}


def chat(client, content=USER, cache_prompt=False, **kw):
    kw["extra_body"] = {"cache_prompt": cache_prompt, **kw.get("extra_body", {})}
    return client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": content}], **kw)


def stream_pieces(client, content=USER, **kw) -> tuple[list[str], list]:
    chunks = list(chat(client, content, stream=True, **kw))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    return pieces, chunks


# ---------------------------------------------------------------------------------------------- basics

def test_health_models_props(srv, client, http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [ALIAS]
    assert models.data[0].model_extra["meta"]["n_ctx"] == N_CTX
    assert client.models.retrieve(ALIAS).id == ALIAS
    props = http.get("/props").json()
    assert props["n_ctx"] == N_CTX and props["total_slots"] == 1


def test_chat_greedy_equals_model_generate(client, ref):
    r = chat(client, temperature=0, max_tokens=24)
    want = "".join(ref.generate(USER, 24, temperature=0, chat=True, cache_prompt=False))
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.object == "chat.completion" and r.model == ALIAS and r.id.startswith("chatcmpl-")
    n_prompt = len(chat_ids(ref, [{"role": "user", "content": USER}]))
    u = r.usage
    assert u.prompt_tokens == n_prompt and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 1 <= u.completion_tokens <= 24
    assert r.choices[0].finish_reason == ("length" if u.completion_tokens == 24 else "stop")
    t = r.model_extra["timings"]
    assert t["prompt_n"] == n_prompt and t["predicted_n"] == u.completion_tokens
    assert t["prompt_ms"] > 0 and t["predicted_ms"] >= 0 and t["predicted_per_second"] >= 0


def test_chat_stream_equals_non_stream(client):
    full = chat(client, temperature=0, max_tokens=24)
    pieces, chunks = stream_pieces(client, temperature=0, max_tokens=24, stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(pieces) > 1                                   # really streamed, piece by piece
    assert "".join(pieces) == full.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == full.choices[0].finish_reason
    assert finish[0].model_extra["timings"]["predicted_n"] == full.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_sse_wire_format(http):
    body = {"messages": [{"role": "user", "content": USER}], "max_tokens": 4, "stream": True, "seed": 3,
            "cache_prompt": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ")
        json.loads(e[len("data: "):])


def test_seed_determinism_and_sampling_equals_model_generate(client, ref):
    a = chat(client, temperature=1.0, seed=7, max_tokens=24).choices[0].message.content
    b = chat(client, temperature=1.0, seed=7, max_tokens=24).choices[0].message.content
    c = chat(client, temperature=1.0, seed=8, max_tokens=24).choices[0].message.content
    assert a == b
    assert a != c
    assert a == "".join(ref.generate(USER, 24, temperature=1.0, seed=7, chat=True, cache_prompt=False))
    s, _ = stream_pieces(client, temperature=1.0, seed=7, max_tokens=24)
    assert "".join(s) == a


def test_text_parts_and_developer_role_read_as_plain_messages(client):
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    a, b = (client.chat.completions.create(model=ALIAS, messages=m, temperature=0, max_tokens=12, extra_body=NO_CACHE)
            for m in (plain, parts))
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_completions(client, ref):
    prompt = "Once upon a time"
    r = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=16, temperature=0, extra_body=NO_CACHE)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == "".join(ref.generate(prompt, 16, temperature=0, cache_prompt=False))
    assert r.usage.prompt_tokens == len(ref.tokenizer.encode(prompt))
    ids = client.completions.create(model=ALIAS, prompt=ref.tokenizer.encode(prompt), max_tokens=16, temperature=0,
                                    extra_body=NO_CACHE)
    assert ids.choices[0].text == r.choices[0].text
    chunks = list(client.completions.create(model=ALIAS, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                            extra_body=NO_CACHE))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_native_completion(http, ref):
    """llama-server's own POST /completion: its result object, its stream ({"content", "stop": false}
    events, then the result with "stop": true, no [DONE]), stop_type / stopping_word and n_probs."""
    prompt = "Once upon a time"
    body = {"prompt": prompt, "n_predict": 16, "temperature": 0, "cache_prompt": False}
    want = "".join(ref.generate(prompt, 16, temperature=0, cache_prompt=False))
    r = http.post("/completion", json=body).json()
    assert r["content"] == want and r["stop"] is True and r["stop_type"] == "limit" and r["stopping_word"] == ""
    assert r["tokens_predicted"] == 16 and r["tokens_evaluated"] == len(ref.tokenizer.encode(prompt))
    assert r["timings"]["predicted_n"] == 16 and r["generation_settings"]["n_predict"] == 16
    assert r["prompt"] == prompt and r["has_new_line"] == ("\n" in want) and "completion_probabilities" not in r
    with http.stream("POST", "/completion", json={**body, "stream": True}) as s:
        events = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == want
    assert events[-1]["stop"] and events[-1]["tokens_predicted"] == 16 and not any(e["stop"] for e in events[:-1])
    word = want[4:7]
    r = http.post("/completion", json={**body, "stop": [word, "\u0000never"]}).json()
    assert (r["stop_type"], r["stopping_word"], r["content"]) == ("word", word, want[:want.index(word)])
    r = http.post("/completion", json={**body, "n_predict": 3, "n_probs": 2}).json()
    probs = r["completion_probabilities"]
    assert len(probs) == 3 and all(len(p["top_logprobs"]) == 2 and p["logprob"] <= 0 for p in probs)
    assert "".join(p["token"] for p in probs) == r["content"] and probs[0]["id"] == ref.tokenizer.encode(
        want, add_special=False)[0]
    r = http.post("/completion", json={"prompt": "Shape:", "json_schema": SHAPE, "temperature": 0, "n_predict": 300,
                                       "cache_prompt": False}).json()
    assert r["stop_type"] == "eos"
    check_shape(r["content"])


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_prompt_cache_reuses_the_shared_prefix(srv, client, ref):
    """A conversation's next turn runs only the tokens after what the previous request left in the cache;
    the counts say so (llama-server's `cache_n` and `prompt_n`)."""
    first = [{"role": "user", "content": "Name three rivers."}]
    r1 = client.chat.completions.create(model=ALIAS, messages=first, temperature=0, max_tokens=12)
    ids1 = chat_ids(ref, first)
    held = list(srv.state.batcher.slots[0].tokens)               # what the server's cache holds now
    assert held[:len(ids1)] == ids1 and len(held) == len(ids1) + r1.usage.completion_tokens - 1
    turn = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": "And three mountains?"}]
    ids2 = chat_ids(ref, turn)
    r2 = client.chat.completions.create(model=ALIAS, messages=turn, temperature=0, max_tokens=12)
    t = r2.model_extra["timings"]
    assert t["cache_n"] == common_prefix(held, ids2) >= len(ids1) - 1
    assert t["prompt_n"] == len(ids2) - t["cache_n"] and r2.usage.prompt_tokens == len(ids2)
    # the same request again: only the last prompt token runs (its logits are needed)
    again = client.chat.completions.create(model=ALIAS, messages=turn, temperature=0, max_tokens=12)
    t = again.model_extra["timings"]
    assert (t["cache_n"], t["prompt_n"]) == (len(ids2) - 1, 1)
    # off: the whole prompt runs, and the text is model.generate's from an empty cache
    off = client.chat.completions.create(model=ALIAS, messages=turn, temperature=0, max_tokens=12,
                                         extra_body=NO_CACHE)
    t = off.model_extra["timings"]
    assert (t["cache_n"], t["prompt_n"]) == (0, len(ids2))
    assert off.choices[0].message.content == "".join(ref.generate(ids2, 12, temperature=0, cache_prompt=False))


def test_token_endpoints(http, ref):
    """llama-server's /tokenize, /detokenize and /apply-template, which frontends use to count tokens."""
    tok, text = ref.tokenizer, "Hello there, dragon! ünïcödé"
    r = http.post("/tokenize", json={"content": text})
    assert r.status_code == 200 and r.json() == {"tokens": tok.encode(text, add_special=False)}
    assert http.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"] == tok.encode(text)
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tok.encode(text, add_special=False)
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw.decode() == text
    ids = tok.encode(text, add_special=False)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
    assert http.post("/detokenize", json={}).json() == {"content": ""}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": USER}]
    r = http.post("/apply-template", json={"messages": msgs})
    assert r.status_code == 200 and r.json() == {"prompt": tok.apply_chat_template(msgs)}


def test_logprobs(client, ref):
    """The model's log-probabilities of each generated token and its top alternatives (before the sampling
    settings), as OpenAI returns them; the same in a stream; the legacy form on completions."""
    r = chat(client, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    lps = r.choices[0].logprobs.content
    assert len(lps) == r.usage.completion_tokens
    for e in lps:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert [a.logprob for a in e.top_logprobs] == sorted((a.logprob for a in e.top_logprobs), reverse=True)
        assert e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob   # greedy
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    assert "".join(bytes(b for e in lps for b in e.bytes).decode(errors="replace")) == r.choices[0].message.content
    ids = chat_ids(ref, [{"role": "user", "content": USER}])
    want = torch.log_softmax(ref.logits(ids)[-1], -1)                  # the first token, from a fresh batch
    assert abs(lps[0].logprob - float(want.max())) < 0.05
    streamed = [e for c in chat(client, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in lps]
    c = client.completions.create(model=ALIAS, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2,
                                  extra_body=NO_CACHE)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    joined = "".join(lp.tokens)                   # a token that ends inside a character shows as U+FFFD
    assert (joined == c.choices[0].text or "\ufffd" in joined) and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert chat(client, max_tokens=2).choices[0].logprobs is None


def test_logit_bias_and_penalties(client, ref):
    """OpenAI's logit_bias and llama.cpp's penalties: a +100 bias makes greedy decoding pick that token every
    time; llama-server's [id, false] form bans one; a frequency penalty ends a run of repeats (the exact
    arithmetic: test_sampler_penalties_as_llama_cpp)."""
    tok = ref.tokenizer
    x = tok.encode("x", add_special=False)[0]
    r = chat(client, temperature=0, max_tokens=6, logit_bias={str(x): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == "x" * 6
    free = chat(client, temperature=0, max_tokens=12, extra_body={"ignore_eos": True}, logprobs=True)
    first = free.choices[0].logprobs.content[0]
    first_id = tok.encode(first.token, add_special=False)
    banned = chat(client, temperature=0, max_tokens=1, extra_body={"ignore_eos": True,
                                                                   "logit_bias": [[first_id[0], False]]})
    assert banned.choices[0].message.content != first.token
    # a penalty of 2 per repeat against a bias of 5: x can win a few times, never six times running
    pen = chat(client, temperature=0, max_tokens=6, logit_bias={str(x): 5}, frequency_penalty=2.0,
               extra_body={"ignore_eos": True, "repeat_last_n": 6}, logprobs=True)
    assert pen.usage.completion_tokens == 6 and pen.choices[0].message.content.count("x") < 6


def test_sampler_penalties_as_llama_cpp():
    from hybridmoe.generate import Sampler, SamplerSettings
    logits = torch.tensor([2.0, -1.0, 1.0, 0.5])
    s = Sampler(SamplerSettings(temperature=0, repeat_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5,
                                repeat_last_n=3, logit_bias={3: 10.0}))
    s.start([9, 0, 1, 0])                                         # the last 3: 0, 1, 0
    got = s.adjust(logits)
    assert torch.allclose(got, torch.tensor([2.0 / 2 - 2 * 0.5 - 0.25, -1.0 * 2 - 0.5 - 0.25, 1.0, 10.5]))
    s.accept(2)                                                   # window now 1, 0, 2
    assert float(s.adjust(logits)[2]) == 1.0 / 2 - 0.5 - 0.25
    assert s(logits) == 3


@pytest.mark.parametrize("n", [7, 1000, 151936, 151937 + 63])
def test_host_top_k_and_argmax_as_torch(n):
    """generate.top_k / argmax (numpy, a blocks' maxima prefilter for long vectors) against torch.topk / argmax:
    the same values, the same indices where the values are distinct; ties (first index of the largest, tied
    values in index order), banned (-inf) logits, vocabularies not a multiple of the block, k past the
    prefilter's reach."""
    from hybridmoe.generate import argmax, top_k
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 3
    for k in (1, 40, 200, n):
        v, i = top_k(x, k)
        tv, ti = torch.topk(x, min(k, n))
        assert torch.equal(v, tv) and torch.equal(x[i], v) and i.unique().numel() == i.numel(), k
        assert torch.equal(i, ti) or v.unique().numel() < v.numel(), k          # ties: torch's order is open
    assert argmax(x) == int(torch.argmax(x))
    y = x.clone()
    y[n // 3] = y[n // 2] = y[n - 1] = float(x.max()) + 1              # a three-way tie at the top
    y[: n // 4] = float("-inf")
    v, i = top_k(y, 5)
    assert i[:3].tolist() == sorted({n // 3, n // 2, n - 1}) and torch.equal(v, torch.topk(y, 5).values)
    assert argmax(y) == n // 3 == int(torch.argmax(y))
    z = torch.full((n,), float("-inf"))
    z[[0, n - 1]] = torch.tensor([1.0, 2.0])
    assert top_k(z, 2)[1].tolist() == ([n - 1, 0] if n > 1 else [0]) and argmax(z) == n - 1


def test_sampler_takes_the_top_k_before_the_temperature():
    """Sampling with top-k scales only the k candidates: the same draws as scaling every logit first (the old
    order), and a temperature small enough to overflow still falls back to greedy."""
    from hybridmoe.generate import Sampler, SamplerSettings
    g = torch.Generator().manual_seed(1)
    x = torch.randn(151936, generator=g) * 4
    for top_k, top_p, min_p in ((40, 0.95, 0.05), (5, 1.0, 0.0), (1000, 0.5, 0.0)):
        st = SamplerSettings(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p, seed=3)
        a, b = Sampler(st), torch.Generator().manual_seed(3)
        for _ in range(20):
            v, idx = torch.topk(x / 0.8, top_k)                           # the chain with every logit scaled
            p = torch.softmax(v, -1)
            keep = torch.ones_like(p, dtype=torch.bool)
            if 0 < top_p < 1:
                keep &= (torch.cumsum(p, -1) - p) < top_p
            if min_p > 0:
                keep &= p >= min_p * p[0]
            keep[0] = True
            p = torch.where(keep, p, torch.zeros_like(p))
            assert a(x) == int(idx[int(torch.multinomial(p / p.sum(), 1, generator=b))])
    assert Sampler(SamplerSettings(temperature=1e-39, seed=1))(x) == int(torch.argmax(x))


def test_max_tokens_gives_length_and_counts(client, http):
    r = chat(client, max_tokens=7, seed=1, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7 and r.model_extra["timings"]["predicted_n"] == 7
    r = chat(client, max_completion_tokens=5, seed=1, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    # max_tokens beyond the context is capped to what the context has left
    ids = [5] * (N_CTX - 10)
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 100000, "ignore_eos": True})
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["choices"][0]["finish_reason"] == "length"
    assert j["usage"] == {"prompt_tokens": N_CTX - 10, "completion_tokens": 10, "total_tokens": N_CTX}


# ---------------------------------------------------------------------------------------------- tools

# ---------------------------------------------------------------------- structured output (response_format)

SHAPE = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "n"],
         "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]},
                        "n": {"type": "integer", "minimum": 0, "maximum": 9}}}


def check_shape(text: str):
    v = json.loads(text)
    assert set(v) == {"ok", "color", "n"} and isinstance(v["ok"], bool) and v["color"] in ("red", "green")
    assert isinstance(v["n"], int) and 0 <= v["n"] <= 9


def test_response_format_json_schema(client):
    """The random model would write gibberish; under OpenAI's json_schema it writes an object the schema
    accepts, ended by the model's end-of-generation token, greedy, sampled and streamed alike, and through
    llama-server's `json_schema` on completions."""
    rf = {"type": "json_schema", "json_schema": {"name": "shape", "schema": SHAPE, "strict": True}}
    r = chat(client, response_format=rf, temperature=0, max_tokens=300)
    assert r.choices[0].finish_reason == "stop"
    check_shape(r.choices[0].message.content)
    pieces, _ = stream_pieces(client, response_format=rf, temperature=0, max_tokens=300)
    assert "".join(pieces) == r.choices[0].message.content
    for seed in (1, 2):
        r = chat(client, response_format=rf, temperature=1.0, seed=seed, max_tokens=300)
        assert r.choices[0].finish_reason == "stop"
        check_shape(r.choices[0].message.content)
    c = client.completions.create(model=ALIAS, prompt="Shape:", max_tokens=300, temperature=0,
                                  extra_body={"json_schema": SHAPE, "cache_prompt": False})
    assert c.choices[0].finish_reason == "stop"
    check_shape(c.choices[0].text)


def test_grammar(client, http):
    """llama-server's `grammar` (GBNF): the reply is text the grammar accepts, ended by the model's
    end-of-generation token; on chat (extra body) and /completion."""
    g = 'root ::= ("yes" | "no") ", because " [a-z ]{3,15} "."'
    r = chat(client, temperature=0, max_tokens=100, extra_body={"grammar": g})
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"(yes|no), because [a-z ]{3,15}\.", r.choices[0].message.content)
    r = http.post("/completion", json={"prompt": "Answer:", "grammar": g, "temperature": 1.0, "seed": 3,
                                       "n_predict": 100}).json()
    assert r["stop_type"] == "eos" and re.fullmatch(r"(yes|no), because [a-z ]{3,15}\.", r["content"])


def test_response_format_json_object(client):
    from hybridmoe.constrain.json_machine import JsonMachine
    r = chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=40)
    text = r.choices[0].message.content
    m = JsonMachine({"type": "object"})
    assert text.lstrip().startswith("{") and m.feed(text.encode())      # cut by max_tokens, but on track
    assert (r.choices[0].finish_reason == "stop") == m.can_end()


# ---------------------------------------------------------------------- Anthropic's Messages API (/v1/messages)

@pytest.fixture(scope="module")
def claude(srv):
    anthropic = pytest.importorskip("anthropic")
    with anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60) as c:
        yield c


GREEDY_A = {"extra_body": {"cache_prompt": False, "temperature": 0}}      # (this SDK has no temperature argument)


def test_messages_api_text(claude, client):
    """The same conversation through /v1/messages and /v1/chat/completions gives the same greedy text;
    streamed, the text deltas add up to it; stop sequences and max_tokens give Anthropic's stop reasons."""
    msgs = [{"role": "user", "content": USER}]
    r = claude.messages.create(model=ALIAS, max_tokens=12, system="Be brief.", messages=msgs, **GREEDY_A)
    want = client.chat.completions.create(model=ALIAS, max_tokens=12, temperature=0, extra_body=NO_CACHE,
                                          messages=[{"role": "system", "content": "Be brief."}, *msgs])
    want = want.choices[0].message.content
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    with claude.messages.stream(model=ALIAS, max_tokens=12, system="Be brief.", messages=msgs, **GREEDY_A) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == want and final.content[0].text == want and final.stop_reason == "max_tokens"
    word = want[3:6]
    r = claude.messages.create(model=ALIAS, max_tokens=12, system="Be brief.", messages=msgs, stop_sequences=[word],
                               **GREEDY_A)
    assert (r.stop_reason, r.stop_sequence, r.content[0].text) == ("stop_sequence", word, want[:want.index(word)])


def test_messages_api_tools(srv, claude, hermes):
    """tools / tool_choice {"type": "tool"} give a tool_use block (input the schema accepts) with stop_reason
    tool_use, streamed too; a tool_use / tool_result round trip renders as the OpenAI form does."""
    tool = {"name": "get_weather", "description": "The weather in a city",
            "input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                             "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10}}}}
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = claude.messages.create(model=ALIAS, max_tokens=200, messages=msgs, tools=[tool],
                               tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY_A)
    use = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(use) == 1 and use[0].name == "get_weather"
    assert set(use[0].input) == {"city"} and 1 <= len(use[0].input["city"]) <= 10
    with claude.messages.stream(model=ALIAS, max_tokens=200, messages=msgs, tools=[tool],
                                tool_choice={"type": "any"}, **GREEDY_A) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content][-1] == "tool_use"
    assert final.content[-1].input == use[0].input            # greedy: the same call
    turn = [*msgs, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                      "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]}]
    r = claude.messages.create(model=ALIAS, max_tokens=4, messages=turn, tools=[tool], **GREEDY_A)
    same = [*msgs, {"role": "assistant", "content": None, "tool_calls": [{"id": "toolu_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"}]
    tok = srv.model.tokenizer                                 # with the Hermes template
    tools = [{"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                               "parameters": tool["input_schema"]}}]
    assert r.usage.input_tokens == len(tok.encode(tok.apply_chat_template(same, tools=tools)))


def test_messages_count_tokens(claude):
    msgs = [{"role": "user", "content": USER}]
    n = claude.messages.count_tokens(model=ALIAS, system="Be brief.", messages=msgs).input_tokens
    r = claude.messages.create(model=ALIAS, max_tokens=1, system="Be brief.", messages=msgs, **GREEDY_A)
    assert n == r.usage.input_tokens > 0


def test_messages_api_thinking(claude, monkeypatch):
    """Thoughts come back as a thinking block before the text, streamed as thinking deltas."""
    script_reply(monkeypatch, "<think>Let me see.</think>The answer.")
    r = claude.messages.create(model=ALIAS, max_tokens=50, messages=[{"role": "user", "content": "Q?"}])
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content] == \
        [("thinking", "Let me see."), ("text", "The answer.")]
    with claude.messages.stream(model=ALIAS, max_tokens=50, messages=[{"role": "user", "content": "Q?"}]) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in kinds and "text_delta" in kinds and final.content[0].thinking == "Let me see."


def test_messages_api_errors(srv, claude):
    anthropic = pytest.importorskip("anthropic")
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for body, words in (({"max_tokens": 5, "messages": []}, "'messages' must be a non-empty array"),
                            ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
                             "'image' block"),
                            ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]},
                             "'max_tokens' must be at least 1"),
                            ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "web_search_20250305",
                                                                                       "name": "w"}]}, "server tools"),
                            ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "maybe"}},
                             "'tool_choice' must be")):
            r = c.post("/v1/messages", json=body)
            j = r.json()
            assert r.status_code == 400 and j["type"] == "error" and j["error"]["type"] == "invalid_request_error"
            assert words in j["error"]["message"], j
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=ALIAS, max_tokens=5, messages=[{"role": "system", "content": "x"}])


# A Hermes / Qwen-style template with tools (synth:tiny's own ChatML template has none)
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a function with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.' }}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tc in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' }}"
    "{%- if tc.function.arguments is string %}{{- tc.function.arguments }}{%- else %}"
    "{{- tc.function.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def hermes(srv, monkeypatch):
    monkeypatch.setattr(srv.model.tokenizer, "chat_template", HERMES_TEMPLATE)


def script_reply(monkeypatch, text):
    """The model writes `text` (its tokens, through the real detokenizer and the server's pipeline): a model
    with random weights never writes a tool call of its own."""
    from hybridmoe.serve.jobs import Job
    begin = Job.begin

    class Scripted:                           # the text's tokens, then an end-of-generation token
        def __init__(self, tok):
            self.ids = iter([*tok.encode(text, add_special=False), min(tok.eos_ids)])

        def __call__(self, logits):
            return next(self.ids)

        def accept(self, token):
            pass

    def scripted_begin(job, model, kv):
        begin(job, model, kv)
        job.sampler = Scripted(model.tokenizer)
    monkeypatch.setattr(Job, "begin", scripted_begin)


def test_tool_call_splitter_holds_back_from_the_first_tag():
    from hybridmoe.text.replies import ToolCallSplitter, parse_tool_calls
    sp = ToolCallSplitter()
    sent = [sp.feed(p) for p in ["Hi <to", "ol_c", 'all>{"name": "f", "argu', 'ments": {"a": 1}}</tool_call>', " bye"]]
    assert sent == ["Hi ", "", "", "", ""]
    text, calls = sp.finish()
    assert text == "bye" and [c["function"] for c in calls] == [{"name": "f", "arguments": '{"a": 1}'}]
    two = parse_tool_calls('<tool_call>{"name": "a", "arguments": "{}"}</tool_call>\n<tool_call>{"name": "b"}')
    assert [c["function"] for c in two[1]] == [{"name": "a", "arguments": "{}"}, {"name": "b", "arguments": "{}"}]
    assert parse_tool_calls("<tool_call>{not json</tool_call>") is None
    sp = ToolCallSplitter()
    assert sp.feed("a <tool_c") == "a " and sp.finish() == ("<tool_c", [])    # a prefix that never completes


def test_tools_are_rendered_and_a_real_generation_runs(client, http, ref, hermes):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = http.post("/apply-template", json={"messages": msgs, "tools": [WEATHER]}).json()["prompt"]
    assert json.dumps(WEATHER, ensure_ascii=False) in prompt
    r = client.chat.completions.create(model=ALIAS, messages=msgs, tools=[WEATHER], temperature=0, max_tokens=8)
    assert r.usage.prompt_tokens == len(ref.tokenizer.encode(prompt))
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
    none = http.post("/apply-template", json={"messages": msgs, "tools": [WEATHER], "tool_choice": "none"}).json()
    assert "<tools>" not in none["prompt"]


def test_tool_choice_forces_a_call(client, hermes):
    """tool_choice "required" or a named function: the random model's reply is constrained to one
    <tool_call> block whose arguments the function's parameters accept; it comes back as tool_calls."""
    check_forced_calls(client, seed=4)


CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                      "additionalProperties": False}}}
BOOK = {"type": "function", "function": {"name": "book", "parameters": {     # Pydantic's style: $defs and $ref
    "type": "object", "additionalProperties": False, "required": ["when"],
    "properties": {"when": {"$ref": "#/$defs/Day"}}, "$defs": {"Day": {"type": "string", "format": "date"}}}}}


def check_forced_calls(client, seed):
    """tool_choice "required" (greedy and sampled) and a named function: one call, arguments in schema."""
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    for choice, names, kw in (("required", {"get_weather", "now"}, {"temperature": 0}),
                              ("required", {"get_weather", "now"}, {"temperature": 1.0, "seed": seed}),
                              ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"},
                               {"temperature": 0})):
        r = client.chat.completions.create(model=ALIAS, messages=msgs, tools=[CITY, NOW], tool_choice=choice,
                                           max_tokens=200, extra_body={"cache_prompt": False}, **kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        fn = c.message.tool_calls[0].function
        args = json.loads(fn.arguments)
        assert fn.name in names
        assert args == {} if fn.name == "now" else (set(args) == {"city"} and 1 <= len(args["city"]) <= 12)
    r = client.chat.completions.create(model=ALIAS, messages=msgs, tools=[CITY, BOOK], temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "book"}},
                                       max_tokens=200, extra_body={"cache_prompt": False})
    args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", args["when"]), args


def test_tool_calls_come_back_as_openai_tool_calls(client, http, hermes, monkeypatch):
    script_reply(monkeypatch, "Let me look." + CALL)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=ALIAS, messages=msgs, tools=[WEATHER])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me look."
    (tc,) = c.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_") and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris"}
    chunks = list(client.chat.completions.create(model=ALIAS, messages=msgs, tools=[WEATHER], stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me look."
    calls = [t for d in deltas for t in (d.tool_calls or [])]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        ["tool_calls"]
    # the next turn sends the call and its result back; the template renders both
    turn = msgs + [c.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": tc.id, "content": '{"sky": "clear"}'}]
    prompt = http.post("/apply-template", json={"messages": turn, "tools": [WEATHER]}).json()["prompt"]
    assert '"arguments": {"city": "Paris"}}' in prompt and "<tool_response>\n{\"sky\": \"clear\"}" in prompt


def test_a_tool_call_that_does_not_parse_stays_text(client, hermes, monkeypatch):
    text = "Hmm <tool_call>{not json</tool_call> ok"
    script_reply(monkeypatch, text)
    r = client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "x"}], tools=[WEATHER])
    assert r.choices[0].message.content == text and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason != "tool_calls"


def test_reasoning_splitter():
    from hybridmoe.text.replies import ReasoningSplitter

    def run(pieces, opened=False):
        sp = ReasoningSplitter(opened)
        out = [x for p in pieces for x in sp.feed(p)] + sp.finish()
        return tuple("".join(t for k, t in out if k == kind) for kind in ("reasoning", "text"))
    assert run(["<thi", "nk>\nI should", " greet.\n</th", "ink>\n\nHel", "lo!"]) == ("I should greet.\n", "Hello!")
    assert run(["Hello <think> x"]) == ("", "Hello <think> x")                 # not at the start: text
    assert run(["I think.\n</think>\n\nDone"], opened=True) == ("I think.\n", "Done")
    assert run(["  <think>never closed"]) == ("never closed", "")
    assert run(["<", "b>hi"]) == ("", "<b>hi")


def test_thoughts_come_back_as_reasoning_content(client, monkeypatch):
    script_reply(monkeypatch, "<think>\nThe user greets me.\n</think>\n\nHello!")
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=ALIAS, messages=msgs)
    m = r.choices[0].message
    assert m.content == "Hello!" and m.model_extra["reasoning_content"] == "The user greets me.\n"
    deltas = [c.choices[0].delta for c in client.chat.completions.create(model=ALIAS, messages=msgs, stream=True)
              if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Hello!"
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "The user greets me.\n"
    r = client.chat.completions.create(model=ALIAS, messages=msgs, extra_body={"reasoning_format": "none"})
    assert r.choices[0].message.content == "<think>\nThe user greets me.\n</think>\n\nHello!"
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


def test_thoughts_then_a_tool_call(client, hermes, monkeypatch):
    script_reply(monkeypatch, "<think>Paris: call it.</think>\n" + CALL)
    r = client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Paris?"}], tools=[WEATHER])
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content is None
    assert m.model_extra["reasoning_content"] == "Paris: call it." and m.tool_calls[0].function.name == "get_weather"


def test_a_template_that_opens_the_thought(srv, client, monkeypatch):
    """DeepSeek-R1's and others' templates end the prompt with <think>: the reply starts inside it."""
    from hybridmoe.text.chat import CHATML_TEMPLATE
    monkeypatch.setattr(srv.model.tokenizer, "chat_template", CHATML_TEMPLATE.replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"))
    script_reply(monkeypatch, "A plan.</think>The answer.")
    m = client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "?"}]).choices[0].message
    assert m.content == "The answer." and m.model_extra["reasoning_content"] == "A plan."


HARMONY_TEMPLATE = (   # gpt-oss's layout, cut down
    "{%- if tools %}<|start|>developer<|message|># Tools\\n{{ tools | tojson }}<|end|>{%- endif %}"
    "{%- for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m.content }}<|end|>{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")
THOUGHT = "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"


@pytest.fixture(scope="module")
def harmony_srv(tmp_path_factory):
    """synth:tiny's weights with a harmony vocabulary (gpt-oss's control tokens) and HARMONY_TEMPLATE, written
    as a GGUF file and served."""
    from hybridmoe.formats.gguf_write import write_gguf
    from hybridmoe.text.builtin_vocab import builtin_tokenizer, hf_tokenizer_to_metadata
    src = hybridmoe.load("synth:tiny").file
    specials = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
    hf = builtin_tokenizer(len(src.metadata["tokenizer.ggml.tokens"]) - len(specials))
    hf.add_special_tokens(specials)
    md = {k: v for k, v in src.metadata.items() if not k.startswith("tokenizer.")}
    md.update(hf_tokenizer_to_metadata(hf, pre="qwen2", eos_token="<|return|>", add_bos_token=False))
    md["tokenizer.chat_template"] = HARMONY_TEMPLATE
    path = str(tmp_path_factory.mktemp("harmony") / "tiny-harmony.gguf")
    write_gguf(path, md["general.architecture"], md,
               [(n, i.shape, i.qtype, lambda i=i: src.raw(i).clone()) for n, i in src.tensors.items()])
    model = hybridmoe.load(path, ctx_size=512)
    yield from serving(create_app(model), model)


def test_harmony_forced_tool_call(harmony_srv):
    """tool_choice on a gpt-oss (harmony) vocabulary: the reply is constrained to a commentary message to
    functions.NAME with JSON arguments, spelled with the real control tokens and ended by <|call|>."""
    tok = harmony_srv.model.tokenizer
    assert tok.is_control(tok.token_to_id("<|channel|>")) and tok.token_to_id("<|call|>") in tok.eos_ids
    with openai.OpenAI(base_url=harmony_srv.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        check_forced_calls(c, seed=2)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_harmony_splitter(step):
    from hybridmoe.text.replies import HarmonySplitter

    def run(text, tools=True):
        sp = HarmonySplitter(tools)
        out = [x for i in range(0, len(text), step) for x in sp.feed(text[i:i + step])] + sp.finish()
        return (*("".join(t for k, t in out if k == kind) for kind in ("reasoning", "text")),
                [c["function"] for c in sp.calls])
    assert run(THOUGHT + "<|channel|>final<|message|>Sunny.") == ("The user wants the weather.", "Sunny.", [])
    call = THOUGHT + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
    assert run(call) == ("The user wants the weather.", "", [{"name": "get_weather", "arguments": '{"city":"Paris"}'}])
    assert run(call, tools=False)[1] == '{"city":"Paris"}'                    # no tools asked: text
    assert run("plain <|end|> text") == ("", "plain <|end|> text", [])         # not harmony: all text


def test_harmony_replies(srv, client, monkeypatch):
    """gpt-oss: the analysis channel is reasoning_content, final is content, commentary to functions.NAME a call."""
    monkeypatch.setattr(srv.model.tokenizer, "chat_template", HARMONY_TEMPLATE)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    script_reply(monkeypatch, THOUGHT + "<|channel|>final<|message|>Sunny.")
    m = client.chat.completions.create(model=ALIAS, messages=msgs).choices[0].message
    assert m.content == "Sunny." and m.model_extra["reasoning_content"] == "The user wants the weather."
    deltas = [c.choices[0].delta for c in client.chat.completions.create(model=ALIAS, messages=msgs, stream=True)
              if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Sunny."
    raw = client.chat.completions.create(model=ALIAS, messages=msgs, extra_body={"reasoning_format": "none"})
    assert raw.choices[0].message.content == THOUGHT + "<|channel|>final<|message|>Sunny."
    script_reply(monkeypatch, THOUGHT + '<|channel|>commentary to=functions.get_weather <|constrain|>json'
                              '<|message|>{"city": "Paris"}')
    r = client.chat.completions.create(model=ALIAS, messages=msgs, tools=[WEATHER])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris"}


# ---------------------------------------------------------------------------------------------- stop

def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["</end>", "STOP"])
    out = []
    for piece in ["Hello </", "en", "d> world"]:
        text, hit = m.feed(piece)
        out.append(text)
        if hit:
            break
    assert out == ["Hello ", "", ""] and hit
    m = StopMatcher(["abc"])
    assert m.feed("xxab") == ("xx", False)
    assert m.feed("d") == ("abd", False)
    assert m.feed("a") == ("", False) and m.flush() == "a"
    m = StopMatcher(["world", "lo w"])                         # the earliest match wins
    assert m.feed("hello world") == ("hel", True)


def test_stop_sequences_split_across_tokens(client):
    kw = dict(temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
    pieces, _ = stream_pieces(client, **kw)
    text = "".join(pieces)
    # a stop sequence made of the end of one token's text and the start of the next one's
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    want = text[:text.find(stop)]
    r = chat(client, stop=stop, **kw)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    s, chunks = stream_pieces(client, stop=[stop], **kw)
    assert "".join(s) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    # a list: the earliest stop wins; a stop that never occurs changes nothing
    early = pieces[1][:2]
    r = chat(client, stop=[stop, early], **kw)
    assert r.choices[0].message.content == text[:min(text.find(early), text.find(stop))]
    r = chat(client, stop=["\x00never\x00"], **kw)
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == "length"
    # completions too
    c = client.completions.create(model=ALIAS, prompt="Once upon a time", temperature=0, max_tokens=30,
                                  extra_body={"ignore_eos": True, **NO_CACHE})
    full = c.choices[0].text
    stop = full[10:14]
    c = client.completions.create(model=ALIAS, prompt="Once upon a time", temperature=0, max_tokens=30,
                                  stop=stop, extra_body={"ignore_eos": True, **NO_CACHE})
    assert c.choices[0].text == full[:full.find(stop)] and c.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------------------------- concurrency

def test_concurrent_requests_run_one_at_a_time_and_match_serial(srv, client, monkeypatch):
    seeds = [11, 12, 13]
    serial = [chat(client, seed=s, max_tokens=16).choices[0].message.content for s in seeds]
    out = [None] * len(seeds)
    inside, most, lock, forward = [0], [0], threading.Lock(), srv.model.forward

    def counting_forward(*a, **kw):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.002)                            # widen the window an overlap would show in
            return forward(*a, **kw)
        finally:
            with lock:
                inside[0] -= 1
    monkeypatch.setattr(srv.model, "forward", counting_forward)

    def one(i):
        out[i] = chat(client, seed=seeds[i], max_tokens=16).choices[0].message.content

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(seeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == serial
    assert most[0] == 1, "two generations ran on the model at once"


def test_non_streaming_disconnect_cancels(srv):
    body = json.dumps({"messages": [{"role": "user", "content": USER}], "max_tokens": N_CTX - 100,
                       "ignore_eos": True}).encode()
    before = srv.state.jobs_started
    host, port = srv.url[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 20
        while srv.state.jobs_started == before or srv.state.last_job.n_generated == 0:
            assert time.monotonic() < deadline, "the generation did not start"
            time.sleep(0.01)
        job = srv.state.last_job
    # the client hung up while the generation ran
    assert job.done.wait(20), "the generation did not stop after the client went away"
    assert job.cancelled and job.finish_reason is None
    assert 0 < job.n_generated < N_CTX - 100


def test_stream_disconnect_stops_generation_and_loop_stays_responsive(srv, http, client):
    n = N_CTX - 100
    body = {"messages": [{"role": "user", "content": USER}], "max_tokens": n, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(8)]                # role chunk, then a few text chunks
        assert all(not x or x.startswith("data: ") for x in got)
        job = srv.state.last_job
        t0 = time.monotonic()
        assert http.get("/health").json() == {"status": "ok"}   # answered while the model is busy
        assert time.monotonic() - t0 < 5
        assert not job.done.is_set(), "the generation ended before the test could look"
    # leaving the block closed the connection mid-stream
    assert job.done.wait(20), "the generation did not stop after the client went away"
    assert job.cancelled and job.finish_reason is None
    assert 0 < job.n_generated < n
    assert chat(client, max_tokens=3, seed=1).usage.completion_tokens >= 1   # still serving


def test_generation_failure_is_a_500_not_a_hang(srv, client, monkeypatch):
    def boom(*a, **kw):
        raise RuntimeError("boom")
    monkeypatch.setattr(srv.model, "forward", boom)
    with pytest.raises(openai.InternalServerError) as e:
        chat(client, max_tokens=3)
    assert "generation failed: RuntimeError: boom" in str(e.value)
    with pytest.raises(openai.APIError, match="boom"):
        list(chat(client, max_tokens=3, stream=True))
    monkeypatch.undo()
    assert chat(client, max_tokens=3, seed=1).usage.completion_tokens >= 1


# ---------------------------------------------------------------------------------------------- bad requests

MSG = [{"role": "user", "content": "hi"}]
BAD = [
    # (endpoint, body (dict, or raw bytes), status, words the message must contain)
    ("chat", b'{"messages": [', 400, "not valid JSON"),
    ("chat", b"", 400, "empty"),
    ("chat", b"[1, 2]", 400, "JSON object"),
    ("chat", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "NaN"),
    ("chat", {}, 400, "'messages' is required"),
    ("chat", {"messages": "hi"}, 400, "'messages' must be an array"),
    ("chat", {"messages": []}, 400, "'messages' is empty"),
    ("chat", {"messages": ["hi"]}, 400, "messages[0] must be an object"),
    ("chat", {"messages": [{"content": "hi"}]}, 400, "messages[0].role is missing"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "'wizard' is not a known role"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content must be a string"),
    ("chat", {"messages": [{"role": "user"}]}, 400, "messages[0].content is missing"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "text parts only"),
    ("chat", {"messages": [{"role": "tool", "content": "42"}]}, 400, "chat template"),
    ("chat", {"messages": MSG, "temperature": "hot"}, 400, "'temperature' must be a number"),
    ("chat", {"messages": MSG, "temperature": -1}, 400, "'temperature' must be at least 0"),
    ("chat", {"messages": MSG, "top_p": 2}, 400, "'top_p' must be at most 1"),
    ("chat", {"messages": MSG, "max_tokens": 0}, 400, "'max_tokens' must be at least 1"),
    ("chat", {"messages": MSG, "max_tokens": -5}, 400, "'max_tokens' must be at least 1"),
    ("chat", {"messages": MSG, "max_completion_tokens": 1.5}, 400, "'max_completion_tokens' must be an integer"),
    ("chat", {"messages": MSG, "max_tokens": True}, 400, "'max_tokens' must be an integer"),
    ("chat", {"messages": MSG, "n": 2}, 400, "'n' is 2"),
    ("chat", {"messages": MSG, "stop": 5}, 400, "'stop' must be a string or an array"),
    ("chat", {"messages": MSG, "seed": "x"}, 400, "'seed' must be an integer"),
    ("chat", {"messages": MSG, "stream": "yes"}, 400, "'stream' must be a boolean"),
    ("chat", {"messages": MSG, "cache_prompt": 1}, 400, "'cache_prompt' must be a boolean"),
    ("chat", {"messages": MSG, "frequency_penalty": 2.5}, 400, "'frequency_penalty' must be at most 2"),
    ("chat", {"messages": MSG, "repeat_penalty": 0}, 400, "'repeat_penalty' must be above 0"),
    ("chat", {"messages": MSG, "logit_bias": {"x": 1}}, 400, "'logit_bias' has 'x', which is not a token id"),
    ("chat", {"messages": MSG, "logit_bias": {"5": 101}}, 400, "must be a number from -100 to 100"),
    ("chat", {"messages": MSG, "logit_bias": {"99999": 1}}, 400, "token id 99999, outside the vocabulary"),
    ("chat", {"messages": MSG, "logit_bias": [[5]]}, 400, "takes [token id, bias] pairs"),
    ("chat", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "'top_logprobs' must be at most 20"),
    ("chat", {"messages": MSG, "top_logprobs": 2}, 400, "'top_logprobs' needs 'logprobs': true"),
    ("chat", {"messages": MSG, "logprobs": 1}, 400, "'logprobs' must be a boolean"),
    ("text", {"prompt": "hi", "logprobs": 6}, 400, "'logprobs' must be at most 5"),
    ("chat", {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "chat template does not render tools"),
    ("chat", {"messages": MSG, "tools": {"type": "function"}}, 400, "'tools' must be an array"),
    ("chat", {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0] must be"),
    ("chat", {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "maybe"},
     400, "'tool_choice' must be"),
    ("chat", {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "'g', which is not one of"),
    ("chat", {"messages": MSG, "tool_choice": "required"}, 400, "the request has no tools"),
    ("chat", {"messages": MSG, "tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "not": {}}}}]}, 400, "forces a call, but the parameters of 'f'"),
    ("chat", {"messages": MSG, "functions": [{"name": "f"}]}, 400, "'functions' (OpenAI's old form)"),
    ("chat", {"messages": MSG, "reasoning_format": "raw"}, 400, "'reasoning_format' must be"),
    ("chat", {"messages": MSG, "response_format": {"type": "xml"}}, 400, "'response_format' must be"),
    ("chat", {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": "x"}}, 400,
     "'response_format.json_schema' must be an object"),
    ("chat", {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "not": {}}}}}, 400, "uses 'not', which hybridmoe cannot"),
    ("chat", {"messages": MSG, "response_format": {"type": "json_object"}, "json_schema": {}}, 400,
     "not both"),
    ("text", {"prompt": "hi", "json_schema": {"anyOf": [{"type": "object"}, {"not": {}}]}}, 400,
     "schema.anyOf[1] uses 'not'"),
    ("text", {"prompt": "hi", "grammar": "root ::= foo"}, 400, "'grammar': grammar line 1, column 10: rule 'foo'"),
    ("text", {"prompt": "hi", "grammar": "root ::= \"a\"", "json_schema": {}}, 400, "not both"),
    ("native", {"prompt": "hi", "grammar": 5}, 400, "'grammar' must be GBNF text"),
    ("native", {"prompt": "hi", "grammar": "root ::= <not a token>"}, 400,
     "'grammar': token reference <not a token>: not one token"),
    ("chat", {"messages": MSG, "grammar": "root ::= <[99999]>"}, 400, "the vocabulary has 1024 tokens"),
    ("native", {"prompt": "hi", "json_schema": functools.reduce(lambda d, _: {"items": d}, range(100), True)}, 400,
     "nested more than 64 levels"),
    ("native", {"prompt": "hi", "n_probs": 21}, 400, "'n_probs' must be at most 20"),
    ("native", {}, 400, "'prompt' is required"),
    ("text", {}, 400, "'prompt' is required"),
    ("text", {"prompt": 5}, 400, "'prompt' must be a string"),
    ("text", {"prompt": [1, 99999]}, 400, "token id 99999, outside the vocabulary"),
    ("text", {"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("text", {"prompt": ""}, 400, "the prompt is empty"),
    ("text", {"prompt": "hi", "max_tokens": 0}, 400, "'max_tokens' must be at least 1"),
    ("text", {"prompt": "hi", "echo": True}, 400, "'echo' is not supported"),
    ("tokenize", {}, 400, "'content' must be a string"),
    ("tokenize", {"content": "hi", "with_pieces": 1}, 400, "'with_pieces' must be a boolean"),
    ("detokenize", {"tokens": [1, 99999]}, 400, "token id 99999, outside the vocabulary"),
    ("detokenize", {"tokens": "hi"}, 400, "'tokens' must be an array of token ids"),
    ("apply-template", {"messages": []}, 400, "'messages' is empty"),
]
PATHS = {"chat": "/v1/chat/completions", "text": "/v1/completions", "native": "/completion", "tokenize": "/tokenize",
         "detokenize": "/detokenize", "apply-template": "/apply-template"}


def check_error(r, status, words):
    assert r.status_code == status, r.text
    assert "Traceback" not in r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    assert words in err["message"], err["message"]
    return err


@pytest.mark.parametrize("kind,body,status,words", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests(http, kind, body, status, words):
    path = PATHS[kind]
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    err = check_error(r, status, words)
    assert err["type"] == "invalid_request_error"


def test_prompt_longer_than_context(http, ref):
    content = "dragon " * 3000
    n = len(chat_ids(ref, [{"role": "user", "content": content}]))
    assert n > N_CTX
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    err = check_error(r, 400, f"the prompt has {n} tokens but the context size is {N_CTX}")
    assert f"{n - N_CTX + 1} tokens too many" in err["message"] and "-c " in err["message"]
    assert err["code"] == "context_length_exceeded"
    r = http.post("/v1/completions", json={"prompt": [5] * N_CTX, "stream": True})
    check_error(r, 400, "1 token too many")


def raw_request(srv, head: bytes) -> tuple[int, dict]:
    host, port = srv.url[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_body_too_large(srv):
    # refused from the header alone, before any of the body is read (so nothing is sent but the header here)
    status, j = raw_request(srv, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n" % (9 << 20))
    assert status == 413 and "this server accepts at most 8388608 bytes" in j["error"]["message"]


def test_body_too_large_without_content_length(ref):
    """A chunked body is counted as it arrives (in-process ASGI here, with a small limit)."""
    app = create_app(ref, max_body_bytes=1000)

    async def go():
        async def body():
            for _ in range(4):
                yield b" " * 400
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            big = await c.post("/v1/completions", content=body())
            ok = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            return big, ok
    big, ok = asyncio.run(go())
    assert "content-length" not in big.request.headers
    check_error(big, 413, "over 1000 bytes")
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
    app.state.hybridmoe.close()


def test_metrics(srv, http):
    """--metrics: llama-server's Prometheus counters, summed over finished generations."""
    def read():
        text = http.get("/metrics").text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^llamacpp:(\w+) (\S+)$", text, re.M)}
    before = read()
    r = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0,
                                           "cache_prompt": False}).json()
    deadline = time.monotonic() + 10                   # the counters move when the worker thread is done
    while read()["requests_total"] == before["requests_total"] and time.monotonic() < deadline:
        time.sleep(0.02)
    after = read()
    assert after["requests_total"] == before["requests_total"] + 1
    assert after["tokens_predicted_total"] - before["tokens_predicted_total"] == r["usage"]["completion_tokens"]
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == r["timings"]["prompt_n"]
    # the cache holds the prompt and the reply but its last token (sampled, never run)
    assert after["kv_cache_tokens"] == r["usage"]["total_tokens"] - 1 and 0 < after["kv_cache_usage_ratio"] < 1
    assert after["prompt_seconds_total"] > before["prompt_seconds_total"] and after["requests_processing"] == 0
    text = http.get("/metrics").text
    assert "# TYPE llamacpp:prompt_tokens_total counter" in text and text.endswith("\n")


FIM_IDS = {"pre": 1016, "suf": 1017, "mid": 1018, "sep": 1019, "rep": 1020}


@pytest.fixture(scope="module")
def fim_srv():
    """synth:tiny with fill-in-the-middle ids in its tokenizer metadata (as a code model's GGUF has them)."""
    from hybridmoe.text.tokenizer import Tokenizer
    model = hybridmoe.load("synth:tiny", ctx_size=256)
    md = dict(model.file.metadata, **{f"tokenizer.ggml.fim_{r}_token_id": i for r, i in FIM_IDS.items()})
    model.tokenizer = Tokenizer.from_metadata(md, "fim.gguf")
    yield from serving(create_app(model), model)


def test_infill(srv, http, fim_srv, ref):
    """llama-server's /infill: [rep] repo [sep] file text ... [sep] "filename" [pre] prefix [suf] suffix [mid]
    prompt; greedy output as model.generate gives for those ids; a model without FIM tokens gets a 501."""
    tok = fim_srv.model.tokenizer

    def enc(s):
        return tok.encode(s, add_special=False, parse_special=False)
    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n", "prompt": "ret",
            "input_extra": [{"filename": "util.py", "text": "X = 1"}], "n_predict": 8, "temperature": 0,
            "cache_prompt": False}
    want_ids = ([1020, *enc("myproject\n"), 1019, *enc("util.py"), *enc("\n"), *enc("X = 1"), 1019,
                 *enc("filename\n"), 1016, *enc(body["input_prefix"]), 1017, *enc(body["input_suffix"]), 1018,
                 *enc("ret")])
    with httpx.Client(base_url=fim_srv.url, timeout=60) as c:
        r = c.post("/infill", json=body).json()
        assert r["tokens_evaluated"] == len(want_ids) and r["stop"] is True
        assert r["content"] == "".join(fim_srv.model.generate(want_ids, 8, temperature=0, cache_prompt=False))
        long = c.post("/infill", json={**body, "input_prefix": "word " * 400, "input_suffix": "x " * 400,
                                       "input_extra": [], "prompt": ""}).json()
        assert long["tokens_evaluated"] <= 256 - 8                  # cut to leave room for the reply
        check_error(c.post("/infill", json={**body, "input_extra": [{"name": "a"}]}), 400, "'input_extra' must be")
    check_error(http.post("/infill", json=body), 501, "no fill-in-the-middle tokens")


def test_slots_save_restore_erase(srv, http, tmp_path, monkeypatch):
    """llama-server's slot persistence: the cache after one conversation is saved, another conversation
    replaces it, restore puts it back, and the conversation goes on exactly as if nothing had come between
    (same text, same tokens taken from the cache); erase empties it; bad names, missing and foreign files
    are refused."""
    monkeypatch.setattr(srv.state, "slot_save_path", str(tmp_path))

    def ask(msgs):
        r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0})
        return r.json()["choices"][0]["message"]["content"], r.json()["timings"]["cache_n"]
    a = [{"role": "user", "content": USER + " It lives in a cave by the sea."}]
    first, _ = ask(a)
    saved = http.post("/slots/0?action=save", json={"filename": "story.slot"}).json()
    assert saved["n_saved"] > 20 and (tmp_path / "story.slot").stat().st_size == saved["n_written"]
    a2 = [*a, {"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    want, cached = ask(a2)
    assert cached > 20
    ask([{"role": "user", "content": "Something else entirely: list three fruits."}])
    restored = http.post("/slots/0?action=restore", json={"filename": "story.slot"}).json()
    assert restored["n_restored"] == saved["n_saved"]
    assert ask(a2) == (want, cached)
    erased = http.post("/slots/0?action=erase").json()
    assert erased["n_erased"] > 0 and ask(a2)[1] == 0
    (tmp_path / "junk.slot").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + b"x" * 64)
    for url, body, status, words in (
            ("/slots/0?action=restore", {"filename": "nope.slot"}, 404, "no saved slot 'nope.slot'"),
            ("/slots/0?action=restore", {"filename": "../story.slot"}, 400, "plain file name"),
            ("/slots/0?action=restore", {"filename": "junk.slot"}, 400, "junk.slot"),
            ("/slots/0?action=dance", {}, 400, "'action' must be save, restore or erase"),
            ("/slots/1?action=save", {"filename": "x"}, 400, "this server has one, 0")):
        check_error(http.post(url, json=body), status, words)
    monkeypatch.setattr(srv.state, "slot_save_path", None)
    check_error(http.post("/slots/0?action=save", json={"filename": "x"}), 501, "--slot-save-path")


def test_saved_slots_belong_to_their_model_and_layout(tmp_path):
    """A slot saved with one context size or model is refused by another (before anything is copied)."""
    from hybridmoe.serve import slots as server_slots
    from hybridmoe.serve.requests import ApiError
    a, b = hybridmoe.load("synth:tiny", ctx_size=256), hybridmoe.load("synth:tiny", ctx_size=512)
    "".join(a.generate("Once upon a time", 4, temperature=0))
    server_slots.save(a, str(tmp_path), {"filename": "a.slot"})
    with pytest.raises(ApiError, match="another cache layout"):
        server_slots.restore(b, str(tmp_path), {"filename": "a.slot"})
    with pytest.raises(ApiError, match="another model"):
        server_slots.restore(hybridmoe.load("synth:tiny-gpt-oss", ctx_size=256), str(tmp_path), {"filename": "a.slot"})
    with pytest.raises(ApiError, match="the cache is empty"):
        server_slots.save(b, str(tmp_path), {"filename": "b.slot"})
    assert server_slots.restore(a, str(tmp_path), {"filename": "a.slot"})["n_restored"] > 0


def test_saved_slot_with_sliding_window_rings(tmp_path):
    """gpt-oss's sliding-window layers keep rings: their whole ring is saved, and a restored cache goes on
    as the original did."""
    from hybridmoe.generate import Timings
    from hybridmoe.serve import slots as server_slots
    m = hybridmoe.load("synth:tiny-gpt-oss", ctx_size=1024, ubatch_size=32)
    assert m.new_cache().slots[0] < 1024                 # layer 0 keeps a ring (window 8: 39 slots)
    tok = m.tokenizer
    first = tok.encode("Once upon a time there was a dragon who lived in a cave by the sea. " * 3)
    "".join(m.generate(first, 6, temperature=0))
    server_slots.save(m, str(tmp_path), {"filename": "g.slot"})
    more = first + tok.encode(" Then one day", add_special=False)
    t1, t2 = Timings(), Timings()
    want = "".join(m.generate(more, 6, temperature=0, timings=t1))
    "".join(m.generate(tok.encode("Something else entirely."), 6, temperature=0))
    server_slots.restore(m, str(tmp_path), {"filename": "g.slot"})
    assert "".join(m.generate(more, 6, temperature=0, timings=t2)) == want and t2.n_cached == t1.n_cached > 0


@pytest.mark.slow
def test_random_requests_get_answers_not_crashes(srv, http, tmp_path, monkeypatch):
    """Random bodies, well-formed or not, to the generating endpoints: a 200 or a 4xx (or /infill's 501 on
    a model without FIM tokens) with a JSON error, never a 500."""
    import random

    from conftest import random_json
    monkeypatch.setattr(srv.state, "slot_save_path", str(tmp_path))
    rng = random.Random(7)
    blocks = [{"type": "text", "text": "hi"}, {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
              {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}, {"type": "image"}, "str", 5,
              {"type": "tool_result", "tool_use_id": 5}]
    special = {
        "messages": lambda: [{"role": rng.choice(["user", "assistant", "system", None, 5]),
                              "content": rng.choice(["hello", [rng.choice(blocks)], None, 5])}
                             for _ in range(rng.randrange(4))],
        "tools": lambda: [{"name": "f", "input_schema": random_json(rng)},
                          {"type": "function", "function": {"name": "f", "parameters": random_json(rng)}}],
        "tool_choice": lambda: rng.choice([{"type": "any"}, {"type": "tool", "name": "f"}, "required", "x",
                                           {"type": "function", "function": {"name": "f"}}]),
        "grammar": lambda: rng.choice(['root ::= "a"', "root ::= x", "", "root ::= [a-z]{1,3}"]),
        "filename": lambda: rng.choice(["a.slot", "../x", "", "b.slot", 5]),
        "response_format": lambda: rng.choice([{"type": "json_object"}, {"type": "json_schema", "json_schema": {
            "schema": random_json(rng)}}, "x"])}
    keys = {"/v1/messages": ["messages", "system", "tools", "tool_choice", "stop_sequences", "stream", "thinking"],
            "/completion": ["prompt", "n_probs", "grammar", "json_schema", "stream", "stop"],
            "/infill": ["input_prefix", "input_suffix", "input_extra", "prompt"],
            "/v1/chat/completions": ["messages", "response_format", "tools", "tool_choice", "grammar", "stream"],
            "/slots/0?action=save": ["filename"], "/slots/0?action=restore": ["filename"]}
    for _ in range(150):
        path = rng.choice(list(keys))
        body = {"max_tokens": 2, "n_predict": 2}
        for k in rng.sample(keys[path], rng.randrange(len(keys[path]) + 1)):
            body[k] = special[k]() if k in special and rng.random() < 0.7 else \
                rng.choice([random_json(rng), None, 1, "x", True, [], {}])
        r = http.post(path, json=body)
        assert r.status_code in (200, 400, 404, 413, 501), (path, body, r.text[:300])
        if r.status_code != 200:
            assert "Traceback" not in r.text and "error" in r.json(), (path, body, r.text[:300])


def test_template_flags(tmp_path):
    """serve's --chat-template(-file), --chat-template-kwargs and --reasoning-budget (common.template_setup):
    the template is replaced (and checked at start), the variables reach every request, a request's own
    chat_template_kwargs win; bad values are one-line errors."""
    import argparse

    from hybridmoe.commands.common import add_template_args, template_setup
    from hybridmoe.errors import HybridMoeError
    p = argparse.ArgumentParser()
    add_template_args(p)
    model = hybridmoe.load("synth:tiny", ctx_size=256)
    f = tmp_path / "t.jinja"
    f.write_text("{% if enable_thinking is defined and not enable_thinking %}[no think]{% endif %}"
                 "{% if reasoning_effort is defined %}[{{ reasoning_effort }}]{% endif %}{{ messages[-1].content }}")
    kwargs = template_setup(model, p.parse_args(["--chat-template-file", str(f), "--reasoning-budget", "0",
                                                 "--chat-template-kwargs", '{"reasoning_effort": "high"}']))
    assert kwargs == {"reasoning_effort": "high", "enable_thinking": False}
    gen = serving(create_app(model, template_defaults=kwargs), model)
    running = next(gen)
    try:
        with httpx.Client(base_url=running.url, timeout=30) as c:
            msgs = [{"role": "user", "content": "hi"}]
            assert c.post("/apply-template", json={"messages": msgs}).json()["prompt"] == "[no think][high]hi"
            mine = {"messages": msgs, "chat_template_kwargs": {"reasoning_effort": "low", "enable_thinking": True}}
            assert c.post("/apply-template", json=mine).json()["prompt"] == "[low]hi"
    finally:
        gen.close()
    assert template_setup(model, p.parse_args(["--chat-template", "chatml"])) == {}
    assert model.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]).startswith("<|im_start|>user")
    for argv, words in ((["--chat-template", "{% if %}"], "syntax error"),
                        (["--chat-template-kwargs", "{x"], "--chat-template-kwargs is not JSON"),
                        (["--chat-template-kwargs", '{"messages": 1}'], "not messages or add_generation_prompt"),
                        (["--reasoning-budget", "100"], "only -1 (no limit) and 0"),
                        (["--chat-template-file", str(tmp_path / "nope")], "cannot read")):
        with pytest.raises(HybridMoeError, match=re.escape(words)):
            template_setup(model, p.parse_args(argv))


def test_not_found_and_wrong_method(http):
    check_error(http.get("/v1/nothing"), 404, "no endpoint GET /v1/nothing")
    check_error(http.get("/v1/models/other-model"), 404, "'other-model' is not served here")
    check_error(http.get("/v1/chat/completions"), 405, "GET is not allowed")


# ---------------------------------------------------------------------------------------------- the command

SERVE = """import argparse, sys
from hybridmoe.commands import serve
from hybridmoe.errors import HybridMoeError
p = argparse.ArgumentParser()
serve.setup_arg_parser(p)
try:
    sys.exit(serve.main(p.parse_args(sys.argv[1:])))
except HybridMoeError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
"""


def serve_argv(*args) -> list[str]:
    from hybridmoe.cli import COMMANDS
    if "serve" in COMMANDS:
        return [sys.executable, "-m", "hybridmoe.cli", "serve", *args]
    return [sys.executable, "-c", SERVE, *args]


@pytest.mark.slow
def test_serve_command(srv, tmp_path):
    used_port = srv.url.rsplit(":", 1)[1]
    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\nsecond-key\n\n")
    r = subprocess.run(serve_argv("-m", "synth:tiny", "--port", used_port), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "cannot listen on 127.0.0.1:" + used_port in r.stderr, r.stderr

    p = subprocess.Popen(serve_argv("-m", "synth:tiny", "--port", "0", "-c", "128", "--alias", "cli-tiny",
                                    "--api-key", "sekret", "--api-key-file", str(keys), "-n", "3",
                                    "--log-level", "warning"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = [None]
        reader = threading.Thread(target=lambda: line.__setitem__(0, p.stdout.readline()), daemon=True)
        reader.start()
        reader.join(240)                 # a cache without the C kernels builds them first (1-2 minutes on 2 cores)
        assert line[0], f"serve printed no URL; stderr: {p.stderr.read() if p.poll() is not None else ''}"
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line[0])
        assert m, line[0]
        url = m.group(1)
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/health").json() == {"status": "ok"}          # /health needs no key
            check_error(c.get("/v1/models"), 401, "API key")
            r = c.get("/v1/models", headers={"Authorization": "Bearer sekret"})
            assert r.json()["data"][0]["id"] == "cli-tiny" and r.json()["data"][0]["meta"]["n_ctx"] == 128
            check_error(c.get("/metrics", headers={"Authorization": "Bearer sekret"}), 501, "--metrics")
            second = {"Authorization": "Bearer second-key"}                   # from --api-key-file
            assert c.get("/slots", headers=second).json() == [{"id": 0, "id_task": -1, "n_ctx": 128,
                                                                "speculative": False, "is_processing": False,
                                                                "n_cached": 0, "n_prompt_tokens": 0, "n_decoded": 0}]
            r = c.post("/v1/completions", headers=second, json={"prompt": "hi", "temperature": 0})   # -n 3
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
            r = c.post("/v1/messages", headers={"x-api-key": "sekret"},      # Anthropic's clients' header
                       json={"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["usage"]["output_tokens"] >= 1
            r = c.post("/v1/messages", headers={"x-api-key": "wrong"}, json={"max_tokens": 2, "messages": []})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        with openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0, timeout=30) as oc:
            assert oc.completions.create(model="cli-tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    finally:
        p.send_signal(2)                                                # Ctrl-C: graceful shutdown
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    assert p.returncode == 0, p.stderr.read()
