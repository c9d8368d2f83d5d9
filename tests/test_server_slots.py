"""`serve -np N`: parallel slots and continuous batching, on a real socket with the real `openai` client and
synth:tiny on the CPU. Concurrent requests share batched steps and must give what they give one at a time
(the CPU kernels compute each row alike, whatever the batch and however a prompt is split); requests go to
the slot whose cache shares their prompt; slots are listed, saved, restored and erased one by one."""
from __future__ import annotations

import contextlib
import json
import random
import re
import threading
import time

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import hybridmoe
from hybridmoe.serve.app import create_app
from test_server import check_error, serving

N_CTX, NP, UB = 2048, 4, 16
STORIES = ["Tell me a story about a dragon.", "Name three rivers.", "What is the capital of France?",
           "Write a poem about the sea and the wind over it.", "Count from one to ten.", "Why is the sky blue?",
           "Describe a cat.", "List five colours, then five animals, then five cities of Europe."]


@pytest.fixture(scope="module")
def model():
    # -ub 16: prompts take several steps, so prompt chunks and decode tokens share steps. One thread: on a
    # loaded CI machine two OpenMP threads wait for each other at every barrier (10-100x slower steps).
    # --no-op-offload: on a machine with a GPU, -ngl 0 would leave prompt chunks to the eager path (their ops may
    # be offloaded), whose results depend on the chunking (bf16 prompt attention on AMX CPUs); the CPU batch
    # step computes every token alike, so batched and alone answers are equal on every machine
    threads = torch.get_num_threads()
    m = hybridmoe.load("synth:tiny", ctx_size=N_CTX, ubatch_size=UB, threads=1, op_offload=False)
    m.logits([1, 2])          # builds the CPU kernels (minutes on a fresh 2-core machine) before any client waits
    yield m
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def srv(model):
    yield from serving(create_app(model, alias="t", metrics=True, n_parallel=NP), model)


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def together(fns) -> list:
    """Run the callables on threads at once (released together by a barrier); their results in order (an
    exception is re-raised)."""
    out = [None] * len(fns)
    start = threading.Barrier(len(fns))

    def one(i):
        try:
            start.wait(60)
            out[i] = fns[i]()
        except BaseException as e:          # noqa: BLE001 - re-raised below
            out[i] = e
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


@contextlib.contextmanager
def slow_steps(srv, seconds=0.01):
    """Every step of the server's batcher takes at least `seconds` (synth:tiny's take ~0.1 ms): a generation
    then lasts long enough to look at."""
    b = srv.state.batcher
    forward = b._forward

    def slow(items):
        time.sleep(seconds)
        return forward(items)
    b._forward = slow
    try:
        yield
    finally:
        b._forward = forward


def greedy(client, text, n=24, temperature=0, **kw):
    r = client.chat.completions.create(model="t", messages=[{"role": "user", "content": text}], max_tokens=n,
                                       temperature=temperature, **kw)
    return r.choices[0].message.content


def test_concurrent_requests_are_batched_and_match_sequential(srv, client):
    """8 greedy chats and 4 seeded sampled ones, all at once on 4 slots, give the sequential texts; the steps
    held several sequences (and prompt chunks with decode tokens)."""
    b = srv.state.batcher
    seq = [greedy(client, s, extra_body={"cache_prompt": False}) for s in STORIES]
    sampled = [greedy(client, s, temperature=0.9, seed=7 + i, extra_body={"cache_prompt": False})
               for i, s in enumerate(STORIES[:4])]
    steps = []
    forward = b._forward

    def recording(items):
        steps.append([(j.in_prompt, len(t)) for j, t in items])
        return forward(items)
    b._forward = recording
    try:
        got = together([lambda s=s: greedy(client, s, extra_body={"cache_prompt": False}) for s in STORIES] +
                       [lambda i=i, s=s: greedy(client, s, temperature=0.9, seed=7 + i,
                                                extra_body={"cache_prompt": False}) for i, s in enumerate(STORIES[:4])])
    finally:
        b._forward = forward
    assert got[:8] == seq and got[8:] == sampled
    assert max(len(s) for s in steps) == NP                         # 4 slots: 4 sequences a step at most
    assert all(sum(n for _, n in s) <= UB for s in steps)           # the token budget of a step (-ub)
    assert any(any(p for p, _ in s) and not all(p for p, _ in s) for s in steps), "no prompt chunk shared a step"


def test_logprobs_penalties_and_grammar_per_sequence_in_a_batch(srv, client):
    """Each sequence of a batch keeps its own logprobs, penalties, logit bias and grammar: the same answers
    as one at a time."""
    kinds = [dict(logprobs=True, top_logprobs=3), dict(frequency_penalty=1.5, presence_penalty=0.5),
             dict(logit_bias={"5": -100, "7": 50}), dict(extra_body={"grammar": 'root ::= [a-z ]{4,20} "."'}),
             dict(extra_body={"repeat_penalty": 1.3, "repeat_last_n": 8})]

    def one(i):
        kw = dict(kinds[i % len(kinds)])
        kw["extra_body"] = {"cache_prompt": False, **kw.get("extra_body", {})}
        r = client.chat.completions.create(model="t", messages=[{"role": "user", "content": STORIES[i]}],
                                           max_tokens=16, temperature=0, **kw)
        lp = r.choices[0].logprobs
        return r.choices[0].message.content, lp.model_dump() if lp else None
    alone = [one(i) for i in range(8)]
    assert alone[0][1]["content"][0]["top_logprobs"] and re.fullmatch(r"[a-z ]{4,20}\.", alone[3][0])
    assert together([lambda i=i: one(i) for i in range(8)]) == alone


def test_a_long_prompt_is_spread_over_steps_while_others_decode(srv, client, http):
    """A 300-token prompt arriving while a stream generates runs in chunks of at most -ub tokens less the
    decode tokens, and the stream keeps getting a token every step meanwhile."""
    b = srv.state.batcher
    steps, forward = [], b._forward

    def recording(items):
        steps.append([(j.id_slot, j.in_prompt, len(t)) for j, t in items])
        return forward(items)
    long = [100 + i % 500 for i in range(300)]                     # token ids
    body = {"messages": [{"role": "user", "content": STORIES[0]}], "max_tokens": 400, "ignore_eos": True,
            "stream": True, "id_slot": 0, "cache_prompt": False}
    b._forward = recording
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c, c.stream("POST", "/v1/chat/completions",
                                                                        json=body) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            n0 = len(steps)
            out = http.post("/v1/completions", json={"prompt": long, "max_tokens": 2, "id_slot": 1,
                                                     "cache_prompt": False}).json()
            during = steps[n0:]
    finally:
        b._forward = forward
    assert out["usage"]["prompt_tokens"] == 300
    prompt_steps = [s for s in during if any(slot == 1 and p for slot, p, _ in s)]
    assert len(prompt_steps) >= out["usage"]["prompt_tokens"] // UB
    for s in prompt_steps:                # the stream's token, then at most UB - 1 prompt tokens
        assert (0, False, 1) in s and sum(n for _, _, n in s) <= UB


def test_slot_selection_by_prefix_then_least_recently_used(srv, http):
    """A prompt goes to the idle slot whose cache shares the longest prefix with it, if that prefix is more
    than --slot-prompt-similarity (0.5) of what the slot holds; else to the least recently used slot;
    id_slot picks one."""
    for i in range(NP):
        http.post(f"/slots/{i}?action=erase")
    preamble = "You are a helpful assistant who answers every question in one short sentence. " * 3

    def ask(prompt, **kw):
        r = http.post("/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0, **kw})
        assert r.status_code == 200, r.text
        return r.json()["id_slot"], r.json()["timings"]["cache_n"]
    first = [ask(STORIES[i])[0] for i in range(NP)]       # nothing shared: each to the least recently used
    assert sorted(first) == list(range(NP))
    slot, cached = ask(STORIES[2] + " And why?")
    assert slot == first[2] and cached > 5                # the slot holding its prefix; its cache reused
    slot, _ = ask("Something else entirely.")             # shares no more than BOS: the LRU slot
    assert slot == first[0]
    a = ask(preamble + "Question: " + STORIES[4])[0]       # to the LRU slot (first[1]), which it replaces
    assert a == first[1]
    # shares the preamble with slot a: more than half of what a holds, so it goes there
    assert ask(preamble + "Another question: " + STORIES[5])[0] == a
    assert ask(STORIES[3], id_slot=1)[0] == 1
    check_error(http.post("/completion", json={"prompt": "hi", "id_slot": NP}), 400, "'id_slot' is 4")
    check_error(http.post("/completion", json={"prompt": "hi", "id_slot": "0"}), 400, "'id_slot' must be an integer")


def test_slots_list_and_props(srv, http):
    slots = http.get("/slots").json()
    assert [s["id"] for s in slots] == list(range(NP)) and all(s["n_ctx"] == N_CTX // NP for s in slots)
    props = http.get("/props").json()
    assert props["total_slots"] == NP and props["default_generation_settings"]["n_ctx"] == N_CTX // NP
    body = {"prompt": "Once upon a time", "n_predict": 300, "ignore_eos": True, "stream": True, "id_slot": 2}
    with slow_steps(srv), httpx.Client(base_url=srv.url, timeout=60) as c, \
            c.stream("POST", "/completion", json=body) as r:
        lines = r.iter_lines()
        first = json.loads(next(x for x in lines if x.startswith("data: "))[6:])
        assert first["id_slot"] == 2
        busy = http.get("/slots").json()
        assert [s["is_processing"] for s in busy] == [i == 2 for i in range(NP)]
        assert busy[2]["n_prompt_tokens"] > 0 and busy[2]["id_task"] >= 0
    deadline = time.monotonic() + 20                     # the client left: its slot is freed
    while http.get("/slots").json()[2]["is_processing"]:
        assert time.monotonic() < deadline, "the slot stayed busy after its client left"
        time.sleep(0.05)
    check_error(http.post("/completion", json={"prompt": [5] * (N_CTX // NP + 10)}), 400,
                "per slot (-c 2048 / -np 4)")


def test_per_slot_save_restore_erase(srv, http, tmp_path, monkeypatch):
    """Slot 1's cache is saved, erased, and restored into slot 3: a continuation there reuses it and gives
    the text it gave in slot 1."""
    monkeypatch.setattr(srv.state, "slot_save_path", str(tmp_path))
    story = "Tell me a long story about a dragon who lives in a cave by the sea, and about its treasure."

    def ask(prompt, sid):
        r = http.post("/completion", json={"prompt": prompt, "n_predict": 6, "temperature": 0, "id_slot": sid})
        assert r.status_code == 200, r.text
        j = r.json()
        return j["content"], j["timings"]["cache_n"], j["id_slot"]
    ask(story, 1)
    saved = http.post("/slots/1?action=save", json={"filename": "one.slot"}).json()
    assert saved["id_slot"] == 1 and saved["n_saved"] > 20
    more = story + " Then one day"
    want = ask(more, 1)
    assert want[1] > 20
    erased = http.post("/slots/1?action=erase").json()
    assert erased["id_slot"] == 1 and erased["n_erased"] > want[1]
    assert ask(more, 1)[1] == 0                          # erased: nothing cached
    http.post("/slots/3?action=erase")
    restored = http.post("/slots/3?action=restore", json={"filename": "one.slot"}).json()
    assert restored["id_slot"] == 3 and restored["n_restored"] == saved["n_saved"]
    assert ask(more, 3) == (want[0], want[1], 3)
    check_error(http.post(f"/slots/{NP}?action=erase"), 400, f"this server has {NP}, 0..{NP - 1}")
    check_error(http.post("/slots/x?action=erase"), 400, "no slot 'x'")


def test_metrics_count_steps_and_batches(srv, client, http):
    def read():
        text = http.get("/metrics").text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+:\w+) (\S+)$", text, re.M)}
    before = read()
    together([lambda s=s: greedy(client, s, n=48) for s in STORIES[:NP]])    # long enough to overlap on a busy VM
    deadline = time.monotonic() + 10
    while read()["llamacpp:requests_total"] < before["llamacpp:requests_total"] + NP:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    after = read()
    steps = after["llamacpp:n_decode_total"] - before["llamacpp:n_decode_total"]
    predicted = after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"]
    assert 0 < steps < predicted                         # several sequences' tokens in one step
    assert after["llamacpp:n_busy_slots_per_decode"] > 1 - 1e-9 and after["hybridmoe:batch_sequences_per_decode"] >= 1
    assert after["llamacpp:requests_processing"] == 0 and after["llamacpp:requests_deferred"] == 0
    for name in ("hybridmoe:distinct_experts_per_decode", "hybridmoe:batch_tokens_per_decode",
                 "llamacpp:kv_cache_usage_ratio"):
        assert name in after


def test_kv_unified_shares_one_context(model):
    """--kv-unified: each slot may take the whole context, and requests whose prompt and reply limit would
    take the running ones over it wait."""
    app = create_app(model, alias="u", n_parallel=2, kv_unified=True)
    gen = serving(app, model)
    srv = next(gen)
    try:
        b = srv.state.batcher
        assert [s.n_ctx for s in b.slots] == [N_CTX, N_CTX]
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            long = [100 + i % 500 for i in range(N_CTX // 2 + 100)]   # more than half the context
            admitted = []
            admit = b._admit

            def recording():
                admit()
                admitted.append(len(b.order))
            b._admit = recording
            try:
                r = together([lambda: c.completions.create(model="u", prompt=long, max_tokens=50, temperature=0),
                              lambda: c.completions.create(model="u", prompt=long, max_tokens=50, temperature=0)])
            finally:
                b._admit = admit
            assert all(x.usage.prompt_tokens > N_CTX // 2 for x in r)
            assert max(admitted) == 1                     # the two never ran at once
            two = together([lambda: greedy(c, "hi", n=8), lambda: greedy(c, "ho", n=8)])
            assert all(two)
    finally:
        gen.close()


def test_cancelled_streams_free_their_slots(srv, http, client):
    """Clients that leave mid-stream free their slots at the next step; the server goes on serving."""
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    for _ in range(2):
        with slow_steps(srv), httpx.Client(base_url=srv.url, timeout=60) as c:
            streams = [c.stream("POST", "/v1/completions", json=body) for _ in range(NP)]
            lines = [s.__enter__().iter_lines() for s in streams]     # kept: a dropped iterator closes its stream
            for it in lines:
                next(it)
            assert all(s["is_processing"] for s in http.get("/slots").json())
            for s in streams:
                s.__exit__(None, None, None)
        deadline = time.monotonic() + 20
        while any(s["is_processing"] for s in http.get("/slots").json()):
            assert time.monotonic() < deadline, "slots stayed busy after their clients left"
            time.sleep(0.05)
    assert greedy(client, "Still there?", n=4)


def test_a_waiting_request_whose_client_left_is_dropped(srv, http):
    """With every slot busy a request waits (requests_deferred); when its client leaves it is dropped from
    the queue at the next step, not when a slot frees."""
    import socket

    def deferred():
        text = http.get("/metrics").text
        return float(re.search(r"^llamacpp:requests_deferred (\S+)$", text, re.M).group(1))
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with slow_steps(srv), httpx.Client(base_url=srv.url, timeout=60) as c:
        streams = [c.stream("POST", "/v1/completions", json=body) for _ in range(NP)]
        try:
            lines = [st.__enter__().iter_lines() for st in streams]   # kept: a dropped iterator closes its stream
            for it in lines:
                next(it)
            raw = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()
            host, port = srv.url[len("http://"):].rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
                deadline = time.monotonic() + 20
                while deferred() != 1:
                    assert time.monotonic() < deadline, "the request did not wait for a slot"
                    time.sleep(0.02)
            deadline = time.monotonic() + 20                # the client left; the slots are all still busy
            while deferred() != 0:
                assert time.monotonic() < deadline, "the request stayed queued after its client left"
                time.sleep(0.05)
            assert all(s["is_processing"] for s in http.get("/slots").json())
        finally:
            for st in streams:
                st.__exit__(None, None, None)


MIXED_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"], "additionalProperties": False}


def mixed_requests() -> list[dict]:
    """16 kinds of request: chat and completions, streamed or not, with a JSON schema or stop strings."""
    out = []
    for i in range(16):
        text = STORIES[i % len(STORIES)] + (" Answer in JSON." if i % 4 == 1 else "")
        req = {"kind": "chat" if i % 2 == 0 else "text", "stream": i % 3 == 0, "text": text, "max_tokens": 12 + i}
        if i % 4 == 1:
            req["schema"] = MIXED_SCHEMA
        if i % 4 == 2:
            req["stop"] = ["e", "\n"]
        out.append(req)
    return out


def run_mixed(c, req) -> str:
    kw = {"model": "t", "max_tokens": req["max_tokens"], "temperature": 0, "stream": req["stream"]}
    if "stop" in req:
        kw["stop"] = req["stop"]
    if "schema" in req:
        kw["extra_body"] = {"json_schema": req["schema"]} if req["kind"] == "text" else {}
        if req["kind"] == "chat":
            kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": req["schema"]}}
    if req["kind"] == "chat":
        r = c.chat.completions.create(messages=[{"role": "user", "content": req["text"]}], **kw)
        if req["stream"]:
            return "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices)
        return r.choices[0].message.content
    r = c.completions.create(prompt=req["text"], **kw)
    if req["stream"]:
        return "".join(ch.choices[0].text for ch in r if ch.choices)
    return r.choices[0].text


@pytest.mark.slow
def test_64_clients_mixed_requests(srv, client):
    """64 clients x 20 requests of 16 kinds (chat / completions, streamed or not, JSON schema, stop strings),
    greedy, with the prompt cache on: no failure, and every answer equals the one that kind gave alone."""
    reqs = mixed_requests()
    want = [run_mixed(client, r) for r in reqs]
    fails, wrong = [], []

    def one_client(k):
        rng = random.Random(k)
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
            for _ in range(20):
                i = rng.randrange(len(reqs))
                try:
                    got = run_mixed(c, reqs[i])
                except Exception as e:              # noqa: BLE001 - counted
                    fails.append(f"{type(e).__name__}: {e}")
                    continue
                if got != want[i]:
                    wrong.append((i, got, want[i]))
    together([lambda k=k: one_client(k) for k in range(64)])
    assert not fails, fails[:5]
    assert not wrong, wrong[:3]


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [dict(n_gpu_layers=99), dict(n_gpu_layers=99, override_tensor=["exps=CPU"])],
                         ids=["ngl99", "exps-cpu"])
def test_gpu_slots_answer_concurrent_requests(opts, capsys):
    """-np 4 on a real GPU: 8 concurrent greedy chats all answered, in batched steps; prints how many texts
    equal their sequential ones (a GPU batch rounds differently: docs/server.md)."""
    model = hybridmoe.load("synth:tiny-wide", ctx_size=N_CTX, **opts)
    app = create_app(model, alias="t", n_parallel=NP)
    assert app.state.hybridmoe.batcher.warm_slots() > 0          # serve's slot warm-up: steps and buckets built
    gen = serving(app, model)
    srv = next(gen)
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
            seq = [greedy(c, s, extra_body={"cache_prompt": False}) for s in STORIES]
            got = together([lambda s=s: greedy(c, s, extra_body={"cache_prompt": False}) for s in STORIES])
        b = srv.state.batcher
        assert all(got) and b.counts["batch_sequences"] > b.counts["decodes"]
        with capsys.disabled():
            print(f"\n{opts}: {sum(a == g for a, g in zip(seq, got))}/{len(seq)} concurrent texts equal the "
                  f"sequential ones; {b.counts['batch_sequences'] / b.counts['decodes']:.2f} sequences a step")
    finally:
        gen.close()


def test_warm_slots_leaves_them_empty_and_answers_alike(model):
    """serve's slot warm-up (Batcher.warm_slots): every slot's cache made and its decode step run, each batch size
    up to the slots' count run, the tokens forgotten; a prompt on a warmed slot gives what it gives on a fresh
    cache, bit for bit."""
    from hybridmoe.serve.batching import Batcher
    b = Batcher(model, 3, 3 * 256)
    calls = []
    orig = model.decode_batch
    model.decode_batch = lambda toks, *a, **k: calls.append(len(toks)) or orig(toks, *a, **k)
    try:
        assert b.warm_slots() > 0
    finally:
        del model.decode_batch
    assert calls == [2, 3] and all(s.kv is not None and not s.tokens for s in b.slots)
    ids = torch.tensor([5, 9, 13, 2])
    assert torch.equal(model.forward(ids, 0, b.slots[1].kv, all_logits=True),
                       model.forward(ids, 0, model.new_cache(256), all_logits=True))


def test_decode_batch_is_forward_batch_bit_for_bit(model):
    """Model.decode_batch (the server's decode steps: ids, positions and caches as lists, logits [B, n_vocab])
    gives forward_batch's logits bit for bit, step after step, and writes the caches alike; bad input is a
    clear error before any cache is touched."""
    from hybridmoe.errors import HybridMoeError
    g = torch.Generator().manual_seed(1)
    B = 5
    prompts = [torch.randint(0, model.cfg.n_vocab, (3 + 4 * j,), generator=g) for j in range(B)]
    runs = []
    for _ in range(2):
        kvs = [model.new_cache(256) for _ in range(B)]
        outs = model.forward_batch([(p, 0, kv) for p, kv in zip(prompts, kvs)])
        runs.append((kvs, [int(o[-1].argmax()) for o in outs], [len(p) for p in prompts]))
    (ka, ta, pa), (kb, tb, pb) = runs
    for _ in range(12):
        oa = model.forward_batch([(torch.tensor([t]), p, kv) for t, p, kv in zip(ta, pa, ka)])
        ob = model.decode_batch(tb, pb, kb)
        assert ob.shape == (B, model.cfg.n_vocab)
        assert all(torch.equal(a[-1], b) for a, b in zip(oa, ob))
        assert model.stats.last_batch["sequences"] == B
        ta, tb = [int(o[-1].argmax()) for o in oa], ob.argmax(-1).tolist()
        pa, pb = [p + 1 for p in pa], [p + 1 for p in pb]
    assert [kv.tokens for kv in ka] == [kv.tokens for kv in kb]
    for i in range(model.cfg.n_layer):
        assert all(torch.equal(a.k[i], b.k[i]) and torch.equal(a.v[i], b.v[i]) for a, b in zip(ka, kb))
    held = [list(kv.tokens) for kv in kb]
    for args, words in (((tb[:2] + [model.cfg.n_vocab], pb[:3], kb[:3]), "not in the vocabulary"),
                        ((tb[:2], pb[:2], [kb[0], kb[0]]), "its own KV cache"),
                        ((tb[:2], [pb[0], -1], kb[:2]), "negative"),
                        ((tb[:2], [pb[0], 256], kb[:2]), "context is full"),
                        ((tb[:2], pb[:1], kb[:2]), "as many")):
        with pytest.raises(HybridMoeError, match=words):
            model.decode_batch(*args)
    assert [list(kv.tokens) for kv in kb] == held


def test_decode_batch_same_caches_checked_in_c(model):
    """Steps on the same caches keep their C records and leave the id and position checks to the C step: a bad
    id or position there is the same clear error, nothing written; positions past the RoPE rows built so far
    (256, 512, 1024: the tables grow) give forward_batch's logits bit for bit; a step on a new cache at a freed
    one's address gets records of its own."""
    import gc

    from hybridmoe.errors import HybridMoeError
    g = torch.Generator().manual_seed(2)
    B, P = 3, 250
    prompts = [torch.randint(0, model.cfg.n_vocab, (P + j,), generator=g) for j in range(B)]
    ka, kb = ([model.new_cache(1100) for _ in range(B)] for _ in range(2))
    ta = [int(o[-1].argmax()) for o in model.forward_batch([(p, 0, kv) for p, kv in zip(prompts, ka)])]
    model.forward_batch([(p, 0, kv) for p, kv in zip(prompts, kb)])
    tb, pos = list(ta), [P + j for j in range(B)]
    for step in range(12):
        oa = model.forward_batch([(torch.tensor([t]), p, kv) for t, p, kv in zip(ta, pos, ka)])
        ob = model.decode_batch(tb, pos, kb)
        assert all(torch.equal(a[-1], b) for a, b in zip(oa, ob)), step
        ta, tb = [int(o[-1].argmax()) for o in oa], ob.argmax(-1).tolist()
        assert ta == tb
        pos = [p + 1 if step != 5 else p + 250 for p in pos]       # jump past 512 (gaps are allowed)
    assert [kv.tokens for kv in ka] == [kv.tokens for kv in kb]
    held = [list(kv.tokens) for kv in kb]
    k0 = [t.clone() for t in kb[0].k]
    for args, words in (((tb[:2] + [model.cfg.n_vocab], pos, kb), "not in the vocabulary"),
                        ((tb[:2] + [-1], pos, kb), "not in the vocabulary"),
                        ((tb, pos[:2] + [-1], kb), "negative"),
                        ((tb, pos[:2] + [1100], kb), "context is full")):
        assert model._batch.same_batch(kb)
        with pytest.raises(HybridMoeError, match=words):
            model.decode_batch(*args)
    assert [list(kv.tokens) for kv in kb] == held
    assert all(torch.equal(a, b) for a, b in zip(k0, kb[0].k))
    # a freed cache's records are not reused for a new cache, wherever it lies
    del kb[1]
    gc.collect()
    fresh = [model.new_cache(1100) for _ in range(2)]
    for kv in fresh:
        model.forward(prompts[1], 0, kv)
    kb.insert(1, fresh[0])
    p1 = [pos[0], P + 1, pos[2]]
    oa = model.forward_batch([(torch.tensor([t]), p, kv) for t, p, kv in zip(tb, p1, [ka[0], fresh[1], ka[2]])])
    ob = model.decode_batch(tb, p1, kb)
    assert all(torch.equal(a[-1], b) for a, b in zip(oa, ob))
