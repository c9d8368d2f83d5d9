"""Model files are untrusted input (issue 26): each finding of the fuzzing that issue reports, as a test.

Files are synth presets re-encoded with benchmarks/fuzz_gguf.py's own GGUF codec, which writes whatever it
is told (wrong value types, duplicate names, overlapping offsets)."""
import math
import os
import struct
import sys
import time
from pathlib import Path

import pytest
import torch

import hybridmoe
from hybridmoe.config import ModelConfig
from hybridmoe.errors import MAX_MESSAGE, HybridMoeError, ModelFileError, NonFiniteError
from hybridmoe.formats.gguf import open_gguf
from hybridmoe.models.synth import ensure_synth

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from fuzz_gguf import Gguf  # noqa: E402


def _base(preset="tiny") -> Gguf:
    return Gguf(open(ensure_synth(preset), "rb").read())


def _write(g: Gguf, path) -> str:
    Path(path).write_bytes(g.encode())
    return str(path)


def _edit(tmp_path, preset="tiny", name="m.gguf", **kv) -> str:
    """The preset with metadata keys set: key=(value type id, value); None drops the key."""
    g = _base(preset)
    for key, v in kv.items():
        key = key.replace("__", ".")
        e = g.kv(key)
        if v is None:
            g.kvs.remove(e)
        elif e is None:
            g.kvs.append([key, *v])
        else:
            e[1], e[2] = v
    return _write(g, tmp_path / name)


def _one_line(e) -> str:
    msg = str(e.value if hasattr(e, "value") else e)
    assert "\n" not in msg and len(msg) <= MAX_MESSAGE and msg.isprintable(), msg
    return msg


def _fails(path, match, **options):
    with pytest.raises(ModelFileError, match=match) as e:
        hybridmoe.load(path, ctx_size=64, **options)
    return _one_line(e)


# ------------------------------------------------------------------------------ config: wrong types and values

@pytest.mark.parametrize("key,value,match", [
    ("tokenizer.ggml.tokens", (4, 7), "tokenizer.ggml.tokens"),                          # was TypeError
    ("qwen3moe.attention.key_length", (6, math.nan), "key_length: found nan"),          # was ValueError
    ("qwen3moe.block_count", (6, math.inf), "block_count: found inf"),                  # was OverflowError
    ("qwen3moe.attention.head_count", (7, False), "head_count: found False"),           # was ZeroDivisionError
    ("qwen3moe.attention.head_count", (4, 0), r"head_count: found 0 \(integer\), expected an integer in 1"),
    ("qwen3moe.block_count", (11, -3), "block_count: found -3"),                        # was IndexError in placement
    ("qwen3moe.block_count", (10, 10**9), "block_count: found 1000000000"),             # was a hang
    ("qwen3moe.block_count", (10, 2**63), "block_count"),
    ("qwen3moe.embedding_length", (10, 2**64 - 1), "embedding_length"),                 # was an overflow
    ("qwen3moe.expert_used_count", (11, -1), "expert_used_count: found -1"),            # was 'selected index k'
    ("qwen3moe.expert_used_count", (4, 9), r"expert_used_count: found 9.*expected an integer in 1\.\.8"),
    ("qwen3moe.attention.layer_norm_rms_epsilon", (6, math.nan), "layer_norm_rms_epsilon: found nan"),
    ("qwen3moe.rope.freq_base", (8, "fast"), "freq_base: found 'fast'"),
    ("qwen3moe.context_length", (9, (5, [])), "context_length: found"),
])
def test_wrong_metadata_is_one_clear_line(tmp_path, key, value, match):
    _fails(_edit(tmp_path, **{key.replace(".", "__"): value}), match)


def test_config_reads_through_typed_accessors():
    md = {"general.architecture": "qwen3", "qwen3.block_count": 2, "qwen3.embedding_length": 64,
          "qwen3.attention.head_count": 4, "qwen3.feed_forward_length": 128, "tokenizer.ggml.tokens": 12}
    with pytest.raises(ModelFileError, match="tokenizer.ggml.tokens: found 12 .integer., expected an array"):
        ModelConfig.from_metadata(md)
    md["tokenizer.ggml.tokens"] = ["a", "b"]
    assert ModelConfig.from_metadata(md).n_vocab == 2
    md["qwen3.attention.head_count_kv"] = 3
    with pytest.raises(ModelFileError, match="not a multiple of head_count_kv 3"):
        ModelConfig.from_metadata(md)


def test_yarn_beta_must_be_positive(tmp_path):
    # was a math domain error in runtime/ops.py's corr_dim
    p = _edit(tmp_path, "tiny-gpt-oss", **{"gpt-oss__rope__scaling__yarn_beta_fast": (6, -1.0)})
    _fails(p, r"yarn_beta_fast: found -1.0 \(float\), expected a finite number")


def test_rope_scaling_types(tmp_path):
    """The llama family's RoPE scaling types: linear read (the frequencies over the factor), one llama.cpp has and
    hybridmoe not refused in one line (it was ignored: every position rotated at the unscaled frequencies)."""
    p = _edit(tmp_path, name="lin.gguf", **{"qwen3moe__rope__scaling__type": (8, "linear"),
                                            "qwen3moe__rope__scaling__factor": (6, 4.0)})
    assert hybridmoe.load(p, ctx_size=64).cfg.rope_yarn == {"type": "linear", "factor": 4.0}
    p = _edit(tmp_path, name="long.gguf", **{"qwen3moe__rope__scaling__type": (8, "longrope")})
    _fails(p, "RoPE scaling 'longrope' is not supported for qwen3moe")


def test_leading_dense_block_count_empty_array_in_planning(tmp_path):
    # was a ValueError (max of an empty sequence) in models/catalog.py
    from hybridmoe.commands.plan import load_records
    p = _edit(tmp_path, "tiny-deepseek2", **{"deepseek2__leading_dense_block_count": (9, (5, []))})
    with pytest.raises(ModelFileError, match="leading_dense_block_count: found an empty array") as e:
        load_records(p)
    _one_line(e)


def test_alignment_of_the_wrong_type(tmp_path):
    # was an uncaught ValueError / TypeError in formats/gguf.py:_parse
    for i, v in enumerate([(6, math.nan), (6, math.inf), (9, (4, [32])), (4, 48), (4, 0), (8, "32")]):
        p = _edit(tmp_path, name=f"a{i}.gguf", **{"general__alignment": v})
        with pytest.raises(ModelFileError, match="general.alignment: found") as e:
            open_gguf(p)
        _one_line(e)


def test_duplicate_metadata_key(tmp_path):
    g = _base()
    g.kvs.append(list(g.kv("qwen3moe.block_count")))
    with pytest.raises(ModelFileError, match="metadata key 'qwen3moe.block_count' appears twice"):
        open_gguf(_write(g, tmp_path / "d.gguf"))


# ------------------------------------------------------------------------------ tensors against the metadata

def _tensor(g, name):
    return next(t for t in g.tensors if t[0] == name)


def test_missing_expert_tensor(tmp_path):
    g = _base()
    g.tensors.remove(_tensor(g, "blk.1.ffn_down_exps.weight"))             # was a KeyError in decoder.py
    _fails(_write(g, tmp_path / "m.gguf"), "tensor blk.1.ffn_down_exps.weight is missing for a qwen3moe model")


def test_extra_tensors_are_refused(tmp_path):
    for i, name in enumerate(["blk.0.ffn_gate_shexp.weight", "blk.7.attn_norm.weight", "junk"]):
        g = _base("tiny-dense")
        g.tensors.append([name, [64], 0, _tensor(g, "blk.0.attn_norm.weight")[3]])
        g.tensors[-1][3] = len(g.data)                                      # own bytes, after the rest
        g.data += b"\0" * 256
        _fails(_write(g, tmp_path / f"x{i}.gguf"), "is not part of a qwen3 model of 2 layers")
    g = _base("tiny-dense")                                                  # was an rms_norm shape error
    norm = _tensor(g, "blk.0.attn_q_norm.weight")
    norm[1] = [8]
    _fails(_write(g, tmp_path / "s.gguf"), r"blk.0.attn_q_norm.weight: found shape \[8\], expected \[16\]")


def test_expert_type_changed(tmp_path):
    g = _base()
    up = _tensor(g, "blk.0.ffn_up_exps.weight")
    up[2] = 8                                                                # Q4_0 -> Q8_0 (was 'bad shapes')
    p = _write(g, tmp_path / "t.gguf")
    with pytest.raises(ModelFileError) as e:
        hybridmoe.load(p, ctx_size=64)
    _one_line(e)


def test_vocab_shorter_than_the_embedding(tmp_path):
    # was an IndexError in weights.dequant
    g = _base()
    toks = g.kv("tokenizer.ggml.tokens")
    toks[2] = (8, toks[2][1][:1000])
    g.kv("tokenizer.ggml.token_type")[2] = (5, g.kv("tokenizer.ggml.token_type")[2][1][:1000])
    _fails(_write(g, tmp_path / "v.gguf"), "tokenizer.ggml.tokens: found 1000 tokens, expected 1024")


def test_duplicate_tensor_names_and_overlapping_data(tmp_path):
    g = _base()
    t = _tensor(g, "blk.0.attn_norm.weight")
    g.tensors.append(list(t))
    with pytest.raises(ModelFileError, match="tensor 'blk.0.attn_norm.weight' appears twice"):
        open_gguf(_write(g, tmp_path / "dup.gguf"))
    g = _base()
    _tensor(g, "blk.0.ffn_norm.weight")[3] = _tensor(g, "blk.0.attn_norm.weight")[3] + 32
    with pytest.raises(ModelFileError, match="overlap") as e:
        open_gguf(_write(g, tmp_path / "ovl.gguf"))
    _one_line(e)


def test_huge_names_are_truncated_and_escaped(tmp_path):
    g = _base()
    g.kvs.append(["k" * 4_000_000 + "\x1b[31m", 8, "v"])                     # a 4 MB key: fine, and unused
    g.tensors.append(["\x1b]0;x\x07" + "n" * 1_000_000, [32], 0, len(g.data)])
    g.data += b"\0" * 128
    with pytest.raises(ModelFileError, match="tensor name") as e:
        open_gguf(_write(g, tmp_path / "n.gguf"))
    msg = _one_line(e)
    assert "\x1b" not in msg and "1000006 characters" in msg


# ------------------------------------------------------------------------------ non-finite weights and logits

def _nan_in(g, name, at=0):
    t = _tensor(g, name)
    data = bytearray(g.data)
    if t[2] == 0:
        data[t[3] + 4 * at:t[3] + 4 * at + 4] = struct.pack("<f", math.nan)
    else:                                                                    # a Q4_0/Q8_0 block's f16 scale
        bb = {2: 18, 8: 34}[t[2]]
        data[t[3] + bb * at:t[3] + bb * at + 2] = b"\x00\x7e"
    g.data = bytes(data)


def test_nan_norm_weight_is_caught_at_load(tmp_path):
    g = _base()
    _nan_in(g, "blk.1.ffn_norm.weight", 5)                                  # was NaN logits without a word
    _fails(_write(g, tmp_path / "n.gguf"), r"tensor blk.1.ffn_norm.weight holds a non-finite value \(nan at element 5\)")


def test_nan_in_a_large_tensor_check_tensors_and_run_time(tmp_path):
    g = _base()
    _nan_in(g, "blk.1.attn_output.weight", 3)
    p = _write(g, tmp_path / "w.gguf")
    _fails(p, "tensor blk.1.attn_output.weight holds a non-finite value", check_tensors=True)
    m = hybridmoe.load(p, ctx_size=64)                                       # the cheap check reads no matrix
    with pytest.raises(NonFiniteError, match=r"non-finite values \(NaN or inf\) first in the output of layer 1 of 2"):
        m.logits([1, 2, 3])
    with pytest.raises(NonFiniteError):
        list(m.generate("Hello", 4, temperature=0))
    from hybridmoe.cli import main
    assert main(["run", "-m", p, "-n", "2", "--no-warmup", "-p", "hi", "--check-tensors"]) == 1


def test_nan_in_a_batched_decode_step_names_the_layer(tmp_path):
    """The CPU batch step's NaN logits (found in C by hm_decode_batch) are the same NonFiniteError as a single
    forward's; the caches keep no record of the step."""
    g = _base()
    _nan_in(g, "blk.1.attn_output.weight", 3)
    m = hybridmoe.load(_write(g, tmp_path / "w.gguf"), ctx_size=64, threads=1)
    kvs = [m.new_cache(64) for _ in range(2)]
    for _ in range(2):                        # the first builds the batch step (forward_batch), the second runs it
        with pytest.raises(NonFiniteError, match=r"first in the output of layer 1 of 2"):
            m.decode_batch([1, 2], [0, 0], kvs)
    assert m._batch and m._batch.same_batch(kvs)
    assert [kv.tokens for kv in kvs] == [[], []]


# ------------------------------------------------------------------------------ bounded work

def test_huge_spm_token_builds_in_linear_time():
    # a 10^6-character SentencePiece token took 171 s in tokenizer.py's merge building
    from hybridmoe.text.tokenizer import Tokenizer
    toks = ["<unk>", "<s>", "</s>", *[f"<0x{i:02X}>" for i in range(256)], *"abcd", "ab", "a" * 10**6, "a" * 1000]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(toks) - 259)
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": toks,
          "tokenizer.ggml.token_type": torch.tensor(types, dtype=torch.int32).numpy()}
    t0 = time.perf_counter()
    tok = Tokenizer.from_metadata(md)
    assert time.perf_counter() - t0 < 2.0
    assert tok.encode("ab aaaa", add_special=False)


def test_block_count_huge_does_not_hang(tmp_path):
    p = _edit(tmp_path, **{"qwen3moe__block_count": (4, 4000)})             # in range, but not in the file
    t0 = time.perf_counter()
    _fails(p, "block_count: found 4000, but the file has tensors of 2 layers")
    assert time.perf_counter() - t0 < 5


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_and_directory_are_refused(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelFileError, match="is a FIFO"):                  # blocked forever in os.open
        open_gguf(fifo)
    with pytest.raises(ModelFileError, match="is a directory"):
        open_gguf(tmp_path)
    first = tmp_path / "m-00001-of-00002.gguf"
    first.write_bytes(open(ensure_synth("tiny"), "rb").read())
    os.mkfifo(tmp_path / "m-00002-of-00002.gguf")
    with pytest.raises(ModelFileError, match="m-00002-of-00002.gguf: is a FIFO"):
        open_gguf(first)


def test_mmap_failure_is_a_clear_error(tmp_path, monkeypatch):
    import mmap as mmap_mod

    def refuse(*a, **k):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(mmap_mod, "mmap", refuse)
    with pytest.raises(ModelFileError, match="cannot map the .*Cannot allocate memory.*address space"):
        open_gguf(ensure_synth("tiny"))


# ------------------------------------------------------------------------------ split parts

def _split(tmp_path, how):
    import random

    from fuzz_gguf import make_split
    rng = random.Random(0)
    rng.randrange = lambda n: how                                           # make_split's choice of mistake
    g = _base()
    return make_split(rng, g, None, str(tmp_path), f"s{how}")[0]


@pytest.mark.parametrize("how,match", [
    (0, r"split.count: found 5, expected 2"), (1, r"split.no: found 0, expected 1"),
    (2, r"general.architecture: found 'llama', part 1 has 'qwen3moe'"),
    (3, r"general.alignment: found 64, part 1 has 32"), (5, r"the name says part 1 of 0"),
])
def test_split_parts_are_checked_against_part_one(tmp_path, how, match):
    with pytest.raises(ModelFileError, match=match) as e:
        open_gguf(_split(tmp_path, how))
    _one_line(e)


def test_split_part_with_a_retyped_tensor(tmp_path):
    p = _split(tmp_path, 4)
    with pytest.raises(ModelFileError) as e:
        hybridmoe.load(p, ctx_size=64)
    _one_line(e)


def test_good_split_still_loads(tmp_path):
    from hybridmoe.formats.gguf_write import write_split
    parts = write_split(ensure_synth("tiny"), 3, str(tmp_path / "ok"))
    m = hybridmoe.load(parts[0], ctx_size=64)
    assert torch.isfinite(m.logits([1, 2])).all()


# ------------------------------------------------------------------------------ chat templates within a budget

@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set x = range(100000)|list %}{% for i in x %}{% for j in x %}{% endfor %}{% endfor %}",
])
def test_template_time_budget(monkeypatch, template):
    from hybridmoe.text import chat
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.5)
    t0 = time.perf_counter()
    with pytest.raises(HybridMoeError, match="time budget"):
        chat.render_chat_template(template, [{"role": "user", "content": "hi"}])
    assert time.perf_counter() - t0 < 3
    assert chat.render_chat_template(None, [{"role": "user", "content": "hi"}]).endswith("assistant\n")


@pytest.mark.parametrize("template", [
    "{{ 'x'|center(10**10) }}", "{{ '%10000000000s'|format('x') }}", "{{ '{:10000000000}'.format('x') }}",
    "{{ '%*s' % (10**10, 'x') }}",
    "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ d('x' * 1000000, 40) }}",
    "{{ range(100000)|map('string')|map('center', 100000)|join }}",
    "{{ ('x' * 1000000)|replace('x', 'y' * 1000) }}",
    "{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}",
])
def test_template_memory_budget(template):
    from hybridmoe.text import chat
    t0 = time.perf_counter()
    with pytest.raises(HybridMoeError, match="chat template") as e:
        chat.render_chat_template(template, [{"role": "user", "content": "hi"}])
    assert time.perf_counter() - t0 < 3
    _one_line(e)


# ------------------------------------------------------------------------------ serve: the request fails, the server stays up

def test_server_answers_nan_logits_and_slow_templates_without_a_500(tmp_path, monkeypatch):
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from test_server import serving

    from hybridmoe.serve.app import create_app
    from hybridmoe.text import chat
    g = _base()
    _nan_in(g, "blk.0.attn_output.weight", 1)
    model = hybridmoe.load(_write(g, tmp_path / "nan.gguf"), ctx_size=256)
    with pytest.raises(NonFiniteError):
        model.logits([1, 2])                                              # (builds the kernels first)
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.5)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for srv in serving(create_app(model, alias="m"), model):
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 422, r.text
            assert "first in the output of layer 0" in r.json()["error"]["message"]
            model.tokenizer.chat_template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}" \
                                            "{% endfor %}"
            t0 = time.perf_counter()
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and "time budget" in r.json()["error"]["message"], r.text
            assert time.perf_counter() - t0 < 10
            assert c.get("/health").status_code == 200
