"""The server's failures of issue 27 (point 5), each on a real socket: invalid text (lone UTF-16 surrogates),
degenerate sampling (a vanishing temperature, a logit_bias that bans everything), slot files whose bytes were
changed, clients that send half a request or never read, the connection cap, Anthropic's error shape and usage,
impossible JSON schemas. None may answer 500, and a refused request leaves its connection usable."""
from __future__ import annotations

import fcntl
import json
import re
import socket
import struct
import termios
import threading
import time

import pytest
import torch

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

import hybridmoe
from hybridmoe.serve import transport
from hybridmoe.serve.app import MAX_BODY_BYTES, create_app

N_CTX = 512
MSG = [{"role": "user", "content": "Tell me a story."}]


# ---------------------------------------------------------------------------------------------- helpers

def serve(app, sndbuf: int | None = None, **kw):
    """Run `app` with uvicorn on a loopback socket, through transport.config (kw: its options), until the
    generator is closed; yields the URL. sndbuf: the send buffer of every connection (Linux gives accepted
    sockets the listener's; a fixed size also stops the kernel from growing it to megabytes)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    server = uvicorn.Server(transport.config(app, log_level="error", timeout_graceful_shutdown=2, **kw))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        yield "http://%s:%d" % sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(10)
        if thread.is_alive():
            server.force_exit = True
            thread.join(5)
        sock.close()


class RawConn:
    """One kept-alive HTTP/1.1 connection on a raw socket: what a client sends, byte for byte, and the
    answers as they come (Content-Length or chunked bodies)."""

    def __init__(self, url: str, timeout: float = 60, rcvbuf: int | None = None):
        """rcvbuf: a small receive buffer (set before connecting, so the TCP window it gives holds)."""
        host, port = url[len("http://"):].rsplit(":", 1)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect((host, int(port)))
        self.buf = b""

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, data: bytes):
        self.sock.sendall(data)

    def request(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None):
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        head = [f"{method} {path} HTTP/1.1", "Host: test"]
        for k, v in (headers or {}).items():
            head.append(f"{k}: {v}")
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        self.send(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
        return self.response()

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def _until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            if not self._fill():
                raise ConnectionError("the server closed the connection")
        out, _, self.buf = self.buf.partition(sep)
        return out

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise ConnectionError("the server closed the connection mid-body")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self) -> tuple[int, dict, bytes]:
        """(status, headers (lower-case names), body) of the next answer."""
        lines = self._until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if "content-length" in headers:
            body = self._take(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                n = int(self._until(b"\r\n").split(b";")[0], 16)
                body += self._take(n)
                self._take(2)
                if n == 0:
                    break
        else:
            while self._fill():
                pass
            body, self.buf = self.buf, b""
        return status, headers, body

    def closed_within(self, seconds: float) -> bool:
        """Whether the server closes this connection (EOF or reset) within `seconds`."""
        self.sock.settimeout(seconds)
        try:
            while self.sock.recv(65536):
                pass
            return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False


def error_of(status: int, body: bytes, anthropic: bool = False) -> dict:
    """The error object of a JSON error answer (OpenAI's shape, or Anthropic's)."""
    assert status != 500 and b"Traceback" not in body, body[:300]
    j = json.loads(body)
    if anthropic:
        assert j["type"] == "error" and set(j["error"]) == {"type", "message"}, j
        return j["error"]
    assert set(j["error"]) >= {"message", "type", "code"}, j
    return j["error"]


@pytest.fixture(scope="module")
def model():
    model = hybridmoe.load("synth:tiny", ctx_size=N_CTX)
    "".join(model.generate("Hi", 2, temperature=0))       # builds the CPU kernels before any request waits on them
    return model


@pytest.fixture(scope="module")
def app(model):
    app = create_app(model, alias="t", metrics=True)
    yield app
    app.state.hybridmoe.close()


@pytest.fixture(scope="module")
def url(app):
    yield from serve(app)


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=60) as c:
        yield c


# ---------------------------------------------------------------------------------------------- invalid text

SURR = "a\ud800b"
SCHEMA_ENUM = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [SURR, "ok"]}}}
SURROGATE_CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURR}], "max_tokens": 2}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": SURR}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": MSG, "stop": ["x", SURR]}, "stop[1]"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": SCHEMA_ENUM},
     "response_format.json_schema.schema.enum[0]"),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {SURR: 1}}, "a key of chat_template_kwargs"),
    ("/v1/completions", {"prompt": SURR, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "json_schema": {"const": SURR}}, "json_schema.const"),
    ("/completion", {"prompt": [SURR], "n_predict": 2}, "prompt[0]"),
    ("/completion", {"prompt": "hi", "grammar": f'root ::= "{SURR}"'}, "grammar"),
    ("/infill", {"input_prefix": SURR, "input_suffix": "x"}, "input_prefix"),
    ("/tokenize", {"content": SURR}, "content"),
    ("/detokenize", {"tokens": [1], "x": SURR}, "x"),
    ("/apply-template", {"messages": [{"role": "system", "content": SURR}]}, "messages[0].content"),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": SURR}]}, "messages[0].content"),
    ("/v1/messages", {"max_tokens": 2, "system": SURR, "messages": MSG}, "system"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [{"type": "text", "text": SURR}]}]},
     "messages[0].content[0].text"),
]


def test_lone_surrogates_are_refused_and_the_connection_stays(url):
    """A lone UTF-16 surrogate (JSON's "\\ud800" escape, or its raw UTF-8 bytes) in any text of any endpoint
    is a 400 that names where it is, on a connection that then answers the next request."""
    with RawConn(url) as c:
        for path, body, where in SURROGATE_CASES:
            status, _, raw = c.request("POST", path, json.dumps(body).encode())     # ensure_ascii: "\ud800"
            assert b"\\ud800" in json.dumps(body).encode()
            err = error_of(status, raw, anthropic=path.startswith("/v1/messages"))
            assert status == 400 and f"{where} holds a lone UTF-16 surrogate" in err["message"], (path, err)
            status, _, raw = c.request("POST", "/tokenize", {"content": "still here"})
            assert status == 200 and json.loads(raw)["tokens"], raw
        # the same character as raw bytes (CESU-style UTF-8, which Python's JSON reader lets through)
        status, _, raw = c.request("POST", "/tokenize", b'{"content": "a\xed\xa0\x80b"}')
        assert status == 400 and "content holds a lone UTF-16 surrogate" in error_of(status, raw)["message"]
        # ... or in a UTF-16 body (which Python's JSON reader also takes; found by the fuzzer)
        utf16 = '{"content": "a\udfffb"}'.encode("utf-16", "surrogatepass")
        status, _, raw = c.request("POST", "/tokenize", utf16)
        assert status == 400 and "content holds a lone UTF-16 surrogate" in error_of(status, raw)["message"]
        # a surrogate pair is one character, and fine
        status, _, raw = c.request("POST", "/tokenize", b'{"content": "\\ud83d\\ude00", "with_pieces": true}')
        assert status == 200, raw
        status, _, raw = c.request("POST", "/apply-template", b'{"messages": [{"role": "user", "content": '
                                                              b'"\\ud83d\\ude00"}]}')
        assert status == 200 and "\U0001F600" in json.loads(raw)["prompt"]


def test_an_internal_error_is_a_500_in_the_api_shape_and_keeps_the_connection(url, model, monkeypatch):
    """A bug (here: the tokenizer raising) is a one-line 500 in the API's shape, never a traceback, and the
    connection goes on (Starlette's outermost handler would re-raise, and uvicorn drop it)."""
    def boom(*a, **kw):
        raise RuntimeError("boom")
    monkeypatch.setattr(model.tokenizer, "apply_chat_template", boom)
    with RawConn(url) as c:
        status, _, raw = c.request("POST", "/apply-template", {"messages": MSG})
        assert status == 500 and json.loads(raw)["error"]["message"] == "internal server error: RuntimeError"
        status, _, raw = c.request("POST", "/v1/messages/count_tokens", {"messages": MSG})
        j = json.loads(raw)
        assert status == 500 and j == {"type": "error", "error": {"type": "api_error",
                                                                   "message": "internal server error: RuntimeError"}}
        monkeypatch.undo()
        status, _, raw = c.request("POST", "/apply-template", {"messages": MSG})
        assert status == 200 and json.loads(raw)["prompt"]


# ---------------------------------------------------------------------------------------------- sampling

def test_a_vanishing_temperature_is_greedy(http):
    """Temperatures so small that the logits overflow (1e-39 and below, down to the smallest double) give the
    greedy reply, not a 500."""
    def reply(t):
        r = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 6, "temperature": t,
                                                    "cache_prompt": False, "seed": 3})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    greedy = reply(0)
    for t in (1e-39, 1e-45, 5e-324, 1e-300):
        assert reply(t) == greedy, t


def test_sampler_at_a_vanishing_temperature_or_top_p():
    from hybridmoe.generate import Sampler, SamplerSettings
    logits = torch.randn(1000) * 30
    for t in (1e-39, 1e-45, 5e-324):
        for top_k in (0, 40):
            s = Sampler(SamplerSettings(temperature=t, top_k=top_k, top_p=1.0, min_p=0.0, seed=1))
            assert s(logits) == int(logits.argmax())
    banned = logits.clone()
    banned[logits.argmax()] = float("-inf")
    s = Sampler(SamplerSettings(temperature=1e-39, seed=1))
    assert s(banned) == int(banned.argmax())
    # (found by the fuzzer) a top_p that is 0 in float32 keeps the most likely token, as llama.cpp's min_keep
    for top_p in (5e-324, 1e-46):
        s = Sampler(SamplerSettings(temperature=2.0, top_p=top_p, seed=1))
        assert s(logits) == int(logits.argmax())


def test_greedy_sampler_given_the_argmax_takes_what_it_would_alone():
    """Sampler(logits, top): the batcher hands greedy samplers their row's argmax (one op for the batch); the
    token is the one the sampler picks from the logits alone, also when the argmax is banned (logit_bias false,
    ignore_eos) or the constraint refuses it, and a sampler with penalties or a bias that is not a ban ignores it."""
    from hybridmoe.generate import Sampler, SamplerSettings
    logits = torch.randn(1000) * 5
    top = int(logits.argmax())
    second = int(logits.topk(2).indices[1])

    class Refuses:                                   # a constraint that refuses the argmax
        def allows(self, t):
            return t != top

        def best(self, lg):
            lg = lg.clone()
            lg[top] = float("-inf")
            return int(lg.argmax())
    cases = [(SamplerSettings(temperature=0), None, top),
             (SamplerSettings(temperature=0, logit_bias={top: float("-inf")}), None, second),
             (SamplerSettings(temperature=0, logit_bias={5: float("-inf")}), None, top),
             (SamplerSettings(temperature=0), Refuses(), second),
             (SamplerSettings(temperature=0, logit_bias={second: 100.0}), None, second),
             (SamplerSettings(temperature=0, repeat_penalty=100.0), None, second)]
    for settings, constraint, want in cases:
        s = Sampler(settings, constraint)
        if settings.repeat_penalty != 1:
            s.start([top])
        assert s(logits) == want and s(logits, top) == want, settings
        assert s.plain_greedy == (settings.repeat_penalty == 1 and
                                  all(b == float("-inf") for b in settings.logit_bias.values()))


def test_logit_bias_that_bans_everything_is_refused(http, model):
    """A logit_bias that bans every token (llama-server's false) is a 400 at any temperature (also when
    ignore_eos bans the end-of-generation tokens it left); at temperature 0 a banned token is never
    emitted."""
    n = model.tokenizer.n_vocab
    everything = [[i, False] for i in range(n)]
    for t in (0, 0.8, 1e-39):
        r = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, "temperature": t,
                                                    "logit_bias": everything})
        assert r.status_code == 400 and "bans every token" in r.json()["error"]["message"], r.text
    eos = set(model.tokenizer.eos_ids)
    but_eos = [[i, False] for i in range(n) if i not in eos]
    r = http.post("/completion", json={"prompt": "hi", "n_predict": 2, "logit_bias": but_eos, "ignore_eos": True})
    assert r.status_code == 400 and "ignore_eos" in r.json()["error"]["message"], r.text
    r = http.post("/completion", json={"prompt": "hi", "n_predict": 2, "logit_bias": but_eos})
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 0 and r.json()["stop_type"] == "eos"
    # only a few tokens left: greedy (and sampling) keeps to them
    allowed = {100, 200, 300, 400}
    few = [[i, False] for i in range(n) if i not in allowed]
    for t in (0, 0.8, 1e-39):
        r = http.post("/completion", json={"prompt": "Once upon a time", "n_predict": 8, "temperature": t,
                                           "logit_bias": few, "ignore_eos": True, "n_probs": 1, "cache_prompt": False})
        assert r.status_code == 200, r.text
        ids = [p["id"] for p in r.json()["completion_probabilities"]]
        assert len(ids) == 8 and set(ids) <= allowed, (t, ids)


# ---------------------------------------------------------------------------------------------- slot files

def test_slot_files_are_checksummed(url, http, app, tmp_path, monkeypatch):
    """A slot file whose KV bytes were changed (header intact) is refused (400) and the cache keeps what it
    held; so is one whose keys are NaN (with a checksum that matches them), and one from before checksums."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hybridmoe.serve import slots as server_slots
    monkeypatch.setattr(app.state.hybridmoe, "slot_save_path", str(tmp_path))

    def ask(text):
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                    "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["timings"]["cache_n"]
    story = "Tell me a story about a dragon who lives in a cave by the sea."
    ask(story)
    assert http.post("/slots/0?action=save", json={"filename": "good.slot"}).status_code == 200
    data = (tmp_path / "good.slot").read_bytes()
    flipped = bytearray(data)
    flipped[-3] ^= 0x40                                  # a byte of the last tensor; the header is untouched
    (tmp_path / "flipped.slot").write_bytes(bytes(flipped))
    with safe_open(str(tmp_path / "good.slot"), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["k.0"][0, 1, :4] = float("nan")
    sums = json.loads(meta["sha256"])
    sums["k.0"] = server_slots._digest(tensors["k.0"])
    save_file(tensors, str(tmp_path / "nan.slot"), metadata={**meta, "sha256": json.dumps(sums)})
    save_file(tensors, str(tmp_path / "old.slot"), metadata={**meta, "format": "hybridmoe-kv-1"})

    other = "Something else entirely: list three fruits."
    ask(other)
    want = ask(other)                                     # the cache holds this conversation: its prompt is cached
    assert want[1] > 10
    for name, words in (("flipped.slot", "do not match their checksum"), ("nan.slot", "NaN or infinite"),
                        ("old.slot", "older hybridmoe")):
        r = http.post("/slots/0?action=restore", json={"filename": name})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert ask(other) == want                         # the cache was not touched
    r = http.post("/slots/0?action=restore", json={"filename": "good.slot"})
    assert r.status_code == 200 and ask(story)[1] > 10


# ---------------------------------------------------------------------------------------------- connections

@pytest.fixture(scope="module")
def short(model):
    """A server with a 1 s read/write timeout and at most 4 connections."""
    app = create_app(model, alias="t")
    yield from serve(app, timeout=1.0, max_connections=4, sndbuf=16384)
    app.state.hybridmoe.close()


@pytest.fixture(scope="module")
def short_keep_alive(model):
    """The same with a keep-alive (0.2 s) that ends before the timeout: a connection whose answer is still being
    written is closing when the timeout comes."""
    app = create_app(model, alias="t")
    yield from serve(app, timeout=1.0, max_connections=4, sndbuf=16384, keep_alive=0.2)
    app.state.hybridmoe.close()


def test_half_requests_are_cut_off_after_the_timeout(short):
    """--timeout: a connection that sends nothing, half a request head, or a head and half its body, is closed
    after the timeout (1 s here); one that keeps to the protocol is served."""
    halves = [b"", b"POST /tokenize HTTP/1.1\r\nHost: t\r\n",
              b"POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n"
              b'{"content": "h']
    t0 = time.monotonic()
    conns = [RawConn(short, timeout=10) for _ in halves]
    try:
        for c, data in zip(conns, halves):
            if data:
                c.send(data)
        for c in conns:
            assert c.closed_within(6), "a half request was not cut off"
        assert time.monotonic() - t0 < 6
    finally:
        for c in conns:
            c.close()
    with RawConn(short) as c:                            # a slow but whole request is served
        c.send(b"POST /tokenize HTTP/1.1\r\nHost: t\r\n")
        time.sleep(0.5)
        c.send(b"Content-Type: application/json\r\nContent-Length: 17\r\n\r\n")
        time.sleep(0.5)
        c.send(b'{"content": "hi"}')
        status, _, raw = c.response()
        assert status == 200 and json.loads(raw)["tokens"]


@pytest.mark.parametrize("server", ["short", "short_keep_alive"])
def test_a_client_that_stops_reading_is_cut_off(server, model, request):
    """The write side of --timeout: an answer to a client that no longer reads is aborted once the server has
    waited that long to write: the client finds the connection cut before its end. The client stops reading once
    the answer has begun (before, a server slow to start answering met a client already reading again), and the
    answer (~10 MB) is larger than the kernel's socket buffers can take in (Linux's tcp_wmem allows up to 4 MB).
    The whole answer is handed to the transport at once, so the response is complete (for uvicorn) while most of
    it waits to be written, and the keep-alive timer starts: on `short_keep_alive` it closes the connection
    first (close() waits to flush), and the timeout must still cut it (on `short` the two race)."""
    short = request.getfixturevalue(server)
    tok = model.tokenizer
    text = {i: tok.decode([i]) for i in range(model.cfg.n_vocab)}
    long = max((i for i, t in text.items() if not t.startswith("<")), key=lambda i: len(text[i].encode()))
    body = json.dumps({"tokens": [long] * (10_000_000 // len(text[long].encode()) + 1)}).encode()
    assert len(body) < MAX_BODY_BYTES, "the request would be refused as too large"
    c = RawConn(short, timeout=30, rcvbuf=4096)
    c.send(b"POST /detokenize HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
           % len(body) + body)
    try:
        got, cut = c.sock.recv(4096), False              # the answer has started (the server may take a while)
        time.sleep(5)                                    # the server fills the socket, then waits > 1 s
        head, _, rest = got.partition(b"\r\n\r\n")
        n = int(re.search(rb"content-length: (\d+)", head).group(1))
        queued = struct.unpack("i", fcntl.ioctl(c.sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        if len(rest) + queued >= n:                      # this kernel took the whole answer in for the client
            pytest.skip(f"the client's socket took in all {n} bytes: the server never had to wait on it")
        c.sock.settimeout(5)
        try:
            while chunk := c.sock.recv(65536):
                got += chunk
            cut = True                                   # closed
        except ConnectionResetError:
            cut = True                                   # aborted
        except socket.timeout:
            pass                                         # still open: it was never cut off
        head, _, rest = got.partition(b"\r\n\r\n")
        n = int(re.search(rb"content-length: (\d+)", head).group(1)) if head else None
        assert cut and n and len(rest) < n, (cut, n, len(rest))
    finally:
        c.close()
    with RawConn(short) as c:
        assert c.request("GET", "/health")[0] == 200


def test_connections_over_the_cap_get_a_503(short):
    """--max-connections: connections over the cap get a 503 (JSON, Connection: close) to their request;
    once others close, new ones are served."""
    idle = [RawConn(short) for _ in range(4)]
    try:
        time.sleep(0.1)
        with RawConn(short) as c:
            status, headers, raw = c.request("GET", "/health")
            assert status == 503 and headers["connection"] == "close"
            assert "--max-connections" in error_of(status, raw)["message"]
        with RawConn(short) as c:
            status, _, raw = c.request("POST", "/v1/messages", {"messages": MSG})
            assert status == 503 and error_of(status, raw, anthropic=True)["type"] == "overloaded_error"
    finally:
        for c in idle:
            c.close()
    time.sleep(0.2)
    with RawConn(short) as c:
        assert c.request("GET", "/health")[0] == 200


def test_malformed_http_is_a_json_400(url):
    for junk in (b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n",
                 b"POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Length: x\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nHost: t\r\nX: " + b"a" * (1 << 20) + b"\r\n\r\n"):
        with RawConn(url) as c:
            c.send(junk)
            status, _, raw = c.response()
            assert status == 400 and "invalid HTTP request" in error_of(status, raw)["message"], (junk[:40], raw)


# ---------------------------------------------------------------------------------------------- Anthropic

def test_every_messages_answer_is_in_anthropics_shape(url):
    with RawConn(url) as c:
        for method, path, body, status in (("GET", "/v1/messages", None, 405), ("PUT", "/v1/messages", {}, 405),
                                           ("POST", "/v1/messages/nope", {}, 404),
                                           ("GET", "/v1/messages/count_tokens", None, 405),
                                           ("POST", "/v1/messages", b"{not json", 400),
                                           ("POST", "/v1/messages", {"messages": MSG, "max_tokens": "x"}, 400)):
            got, headers, raw = c.request(method, path, body)
            err = error_of(got, raw, anthropic=True)
            assert got == status, (path, raw)
            assert err["type"] == {405: "invalid_request_error", 404: "not_found_error",
                                   400: "invalid_request_error"}[status]
            if status == 405:
                assert "POST" in headers["allow"]
        c.send(b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (9 << 20))
        got, headers, raw = c.response()                  # refused from the head: the body is never read
        assert got == 413 and error_of(got, raw, anthropic=True)["type"] == "request_too_large"


def test_anthropic_usage_counts_each_prompt_token_once(url):
    """input_tokens are the prompt tokens that ran, cache_read_input_tokens those from the prompt cache: they
    add up to the prompt (count_tokens), streamed (message_start, message_delta) or not."""
    anthropic = pytest.importorskip("anthropic")
    msgs = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]
    with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60) as claude:
        n = claude.messages.count_tokens(model="t", messages=msgs).input_tokens
        first = claude.messages.create(model="t", max_tokens=3, messages=msgs)
        again = claude.messages.create(model="t", max_tokens=3, messages=msgs)
        u = again.usage
        assert u.cache_read_input_tokens > 0 and u.input_tokens >= 1
        assert u.input_tokens + u.cache_read_input_tokens == n == first.usage.input_tokens + \
            (first.usage.cache_read_input_tokens or 0)
        with claude.messages.stream(model="t", max_tokens=3, messages=msgs) as stream:
            start = [e for e in stream if e.type == "message_start"]
            final = stream.get_final_message()
    s = start[0].message.usage
    assert s.input_tokens + s.cache_read_input_tokens == n and s.cache_read_input_tokens > 0
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (s.input_tokens,
                                                                              s.cache_read_input_tokens)


# ---------------------------------------------------------------------------------------------- schemas

IMPOSSIBLE = [
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 is more than maxLength 2"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "leave no integer"),
    ({"type": "number", "minimum": 5, "maximum": 1}, "leave no number"),
    ({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1}, "leave no number"),
    ({"type": "number", "minimum": 1, "exclusiveMaximum": 1}, "leave no number"),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "leave no integer"),
    ({"type": "integer", "minimum": 1.2, "maximum": 1.8}, "leave no integer"),
    ({"type": "number", "minimum": 1e60}, "without an exponent in at most 40 characters"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems 3 is more than"),
    ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}, "minItems 2 is more than"),
    ({"type": "string", "enum": [1, 2]}, "nothing can match"),
    ({"type": "string", "enum": ["a", 2]}, "the enum value 2 is an integer, not string"),
    ({"type": "integer", "const": "x"}, "the const value \"x\" is a string, not integer"),
    ({"enum": ["a", "b"], "const": "c"}, "not one of its 'enum'"),
    ({"type": "string", "maxLength": 2, "enum": ["abc"]}, "length outside minLength..maxLength"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"], "additionalProperties": False},
     "requires properties it does not allow"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "which its schema forbids"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 3, "maximum": 2}}},
     "schema.properties.a: the bounds"),
    ({"allOf": [{"type": "number", "minimum": 5}, {"maximum": 1}]}, "leave no number"),
]


@pytest.mark.parametrize("schema,words", IMPOSSIBLE, ids=[w[:30] for _, w in IMPOSSIBLE])
def test_impossible_schemas_are_refused(http, schema, words):
    r = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    r = http.post("/completion", json={"prompt": "hi", "n_predict": 4, "json_schema": schema})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_possible_schemas_near_the_edge_are_kept(http):
    for schema in ({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 2},
                   {"type": "integer", "minimum": 2, "maximum": 2}, {"type": "string", "minLength": 2, "maxLength": 2},
                   {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-30},
                   {"type": ["string", "null"], "enum": ["a", None]}, {"type": "integer", "const": 3.0},
                   {"type": "array", "minItems": 1, "maxItems": 1}):
        r = http.post("/completion", json={"prompt": "hi", "n_predict": 2, "json_schema": schema})
        assert r.status_code == 200, (schema, r.text)


def test_a_forced_tool_with_an_impossible_schema_is_refused(url, model, monkeypatch):
    from test_server import HERMES_TEMPLATE
    monkeypatch.setattr(model.tokenizer, "chat_template", HERMES_TEMPLATE)
    tool = {"name": "f", "input_schema": {"type": "object", "required": ["n"],
                                          "properties": {"n": {"type": "integer", "minimum": 9, "maximum": 1}}}}
    with RawConn(url) as c:
        status, _, raw = c.request("POST", "/v1/messages", {"max_tokens": 4, "messages": MSG, "tools": [tool],
                                                            "tool_choice": {"type": "any"}})
        assert status == 400 and "leave no integer" in error_of(status, raw, anthropic=True)["message"]


# ---------------------------------------------------------------------------------------------- fuzzer findings

def test_what_the_fuzzer_found(url):
    """tests/test_server_fuzz.py found these 500s: a logit_bias id of 1e400 (int(inf) overflows), a
    repeat_last_n too large for a deque, and a top_p that is 0 in float32 (nothing left to sample)."""
    with RawConn(url) as c:
        for body, status, words in (
                (b'{"prompt": "hi", "logit_bias": [[1e400, 1]], "n_predict": 1}', 400, "which is not a token id"),
                (b'{"prompt": "hi", "logit_bias": {"' + b"9" * 5000 + b'": 1}, "n_predict": 1}', 400,
                 "which is not a token id"),
                (b'{"prompt": "hi", "repeat_last_n": 1000000000000000000000000000000, "n_predict": 1}', 400,
                 "'repeat_last_n' must be at most"),
                (b'{"prompt": "hi", "top_p": 5e-324, "temperature": 2, "n_predict": 2}', 200, None)):
            got, _, raw = c.request("POST", "/completion", body)
            assert got == status, raw
            if words:
                assert words in error_of(got, raw)["message"]


def test_big_enums_cost_little_per_token():
    """(found by fuzzing schemas with longer replies) a request's enum of 50,000 values, or one value of 100,000
    items, held the generation thread for seconds a token (every value scanned for every byte tried; every
    value written out again each time a token might start it): now the texts are written once per schema and
    searched by bisection. Before, each loop below took tens of seconds."""
    from hybridmoe.constrain.json_machine import JsonMachine
    many = JsonMachine({"enum": [f"value-{i:05d}" for i in range(50000)]})
    t0 = time.perf_counter()
    for i in range(2000):
        c = many.clone()
        assert c.feed(b'"value-%05d' % (i * 7)) and not c.can_end() and c.feed(b'"') and c.can_end()
        assert not many.clone().feed(b'"valuf')
    assert time.perf_counter() - t0 < 5
    big = JsonMachine({"enum": [list(range(100000)), "x"]})
    t0 = time.perf_counter()
    for _ in range(500):
        assert big.clone().feed(b"[0, 1") and big.clone().feed(b'"x"')
    assert time.perf_counter() - t0 < 5
