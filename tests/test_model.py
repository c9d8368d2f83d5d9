"""Our forward pass against transformers on tiny random models; KV-cached decode; split files; synth."""
import json
import math
import re
import subprocess
import sys

import pytest
import torch
from conftest import rel_l2
from hf_oracle import convert, hf_logits, load_dequantized_into_hf, make_hf_model

import hybridmoe
from hybridmoe.formats.gguf_write import write_split
from hybridmoe.generate import Timings, prefill
from hybridmoe.kernels import cpu
from hybridmoe.quant.types import GGMLType

IDS = [1, 17, 300, 42, 7, 7, 99, 511, 256, 3, 120, 64, 5, 480, 33, 2, 200, 201, 202, 10]


@pytest.fixture
def f32_attention(monkeypatch):
    """Prompt attention in float32 even where the CPU has AMX (where it runs in bf16 by default)."""
    import hybridmoe.models.decoder as dec
    monkeypatch.setattr(dec, "_CPU_ATTN_DTYPE", torch.float32)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    out = {}
    for kind in ("qwen3moe", "qwen3", "llama", "deepseek2", "deepseek2-yarn", "qwen3moe-yarn", "llama-linear"):
        d = tmp_path_factory.mktemp(f"hf-{kind}")
        out[kind] = (make_hf_model(kind, str(d)), str(d))
    return out


@pytest.mark.parametrize("kind", ["qwen3moe", "qwen3", "llama", "deepseek2", "deepseek2-yarn", "qwen3moe-yarn",
                                  "llama-linear"])
def test_f32_matches_transformers(hf_models, kind, tmp_path, f32_attention):
    model, d = hf_models[kind]
    path = convert(d, str(tmp_path / "m-f32.gguf"), GGMLType.F32)
    ours = hybridmoe.load(path, ctx_size=64).logits(IDS)
    ref = hf_logits(model, IDS)
    assert ours.shape == ref.shape
    assert rel_l2(ours, ref) <= 1e-3


@pytest.mark.parametrize("kind", ["qwen3moe-yarn", "llama-linear"])
def test_scaled_rope_decode_steps_match_transformers(hf_models, kind, tmp_path, f32_attention):
    """Qwen3 with YaRN (its long-context files) and llama with linear scaling: the decode steps (the C step all
    on the CPU, whose RoPE tables carry the scaled frequencies and YaRN's magnitude) after a cached prompt give
    transformers' logits."""
    model, d = hf_models[kind]
    path = convert(d, str(tmp_path / "m-f32.gguf"), GGMLType.F32)
    m = hybridmoe.load(path, ctx_size=64)
    if kind == "llama-linear":
        assert m.cfg.rope_yarn == {"type": "linear", "factor": 4.0}
    else:
        assert m.cfg.rope_yarn and m.cfg.rope_yarn["attn_factor"] == pytest.approx(0.1 * math.log(4.0) + 1)
    kv = m.new_cache(64)
    m.forward(torch.tensor(IDS[:5]), 0, kv)
    steps = torch.cat([m.forward(torch.tensor([t]), 5 + i, kv) for i, t in enumerate(IDS[5:])])
    assert rel_l2(steps, hf_logits(model, IDS)[5:]) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3moe-yarn", "llama-linear"])
def test_scaled_rope_on_a_real_gpu_matches_all_cpu(hf_models, kind, tmp_path):
    """Qwen3 with YaRN and llama with linear scaling all on a GPU: the captured prompt and decode steps (their
    RoPE tables from context_rope_tables with the scaling) give all-CPU's logits within bf16."""
    from conftest import top1_agreement
    _, d = hf_models[kind]
    path = convert(d, str(tmp_path / "m-q8.gguf"), GGMLType.Q8_0)
    outs = []
    for opts in (dict(), dict(n_gpu_layers=99)):
        m = hybridmoe.load(path, ctx_size=64, **opts)
        kv = m.new_cache(64)
        prompt = m.forward(torch.tensor(IDS[:8]), 0, kv, all_logits=True)
        outs.append(torch.cat([prompt, *(m.forward(torch.tensor([t]), 8 + i, kv) for i, t in enumerate(IDS[8:]))]))
    step = m._step_for("decode", kv)
    assert step is not None and step.worked
    assert rel_l2(outs[1], outs[0]) <= 1e-2 and top1_agreement(outs[1], outs[0]) >= 0.9


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_0])
def test_quantized_matches_transformers_on_dequantized_weights(hf_models, qtype, tmp_path):
    model, d = hf_models["qwen3moe"]
    path = convert(d, str(tmp_path / f"m-{qtype.name}.gguf"), qtype)
    ours = hybridmoe.load(path, ctx_size=64).logits(IDS)
    ref_model = load_dequantized_into_hf(make_hf_model("qwen3moe", str(tmp_path / "hf2")), path)
    ref = hf_logits(ref_model, IDS)
    # a type whose CPU activations take one int8 term (cpu.act_terms, as llama.cpp's q8_0; Q4_0 with
    # HYBRIDMOE_CPU_ACT_TERMS=1) sits at llama.cpp's distance from its dequantized weights, 6.8e-2 measured here;
    # two terms (Q4_0, Q8_0 by the rule) within 3e-2
    one = cpu.available() and cpu.int8_path(qtype) and cpu.act_terms(qtype) == 1
    assert rel_l2(ours, ref) <= (1.5e-1 if one else 3e-2)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= (0.9 if one else 0.95)


@pytest.mark.parametrize("preset", ["tiny", "tiny-deepseek2", "tiny-dense"])
def test_kv_cached_decode_equals_full_forward(preset):
    m = hybridmoe.load(f"synth:{preset}", ctx_size=64, ubatch_size=4)
    full = m.logits(IDS)
    kv = m.new_cache(64)
    m.forward(torch.tensor(IDS[:5]), 0, kv)
    steps = [m.forward(torch.tensor([t]), 5 + i, kv)[0] for i, t in enumerate(IDS[5:])]
    assert rel_l2(torch.stack(steps), full[5:]) <= 1e-5


def test_ubatch_size_does_not_change_logits():
    """Kernels are chosen by batch size (streaming int kernel for a few rows, bf16 GEMM for many, as
    llama.cpp switches too), so batches agree to bf16 precision, not bit for bit."""
    a = hybridmoe.load("synth:tiny", ctx_size=64, ubatch_size=512).logits(IDS)
    b = hybridmoe.load("synth:tiny", ctx_size=64, ubatch_size=3).logits(IDS)
    assert rel_l2(b, a) <= 1e-2
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95


def test_split_gguf_loads_like_whole(tmp_path):
    whole = hybridmoe.load("synth:tiny", ctx_size=64)
    parts = write_split(whole.path, 3, str(tmp_path / "tiny"))
    assert len(parts) == 3 and parts[0].endswith("-00001-of-00003.gguf")
    split = hybridmoe.load(parts[0], ctx_size=64)
    assert set(split.file.tensors) == set(whole.file.tensors)
    assert torch.equal(split.logits(IDS), whole.logits(IDS))


def test_generate_is_deterministic_with_seed():
    m = hybridmoe.load("synth:tiny", ctx_size=128)
    a = "".join(m.generate("Hello", max_tokens=12, seed=3))
    b = "".join(m.generate("Hello", max_tokens=12, seed=3, cache_prompt=False))   # from an empty cache too
    g = "".join(m.generate("Hello", max_tokens=12, temperature=0))
    assert a == b and len(a) > 0 and len(g) > 0


def test_generations_reuse_the_context_cache():
    """One generation after another runs on the model's one cache (its static steps keep their graphs), and a
    long earlier prompt left in it changes nothing; generations held open at once get caches of their own."""
    m = hybridmoe.load("synth:tiny", ctx_size=128)
    short = "".join(m.generate("Hello", max_tokens=8, temperature=0))
    kv = m._free_cache
    assert kv is not None
    "".join(m.generate("a much longer prompt, filling more of the cache than the short one " * 2, max_tokens=20,
                       temperature=0))
    assert m._free_cache is kv
    assert "".join(m.generate("Hello", max_tokens=8, temperature=0)) == short
    a, b = m.generate("Hello", max_tokens=8, temperature=0), m.generate("Hello", max_tokens=8, temperature=0)
    pieces = list(zip(a, b))                                  # interleaved, step by step
    assert "".join(p for p, _ in pieces) == "".join(q for _, q in pieces) == short


@pytest.mark.parametrize("preset", ["tiny", "tiny-deepseek2", "tiny-dense", "tiny-gpt-oss"])
def test_prompt_cache_runs_only_the_new_tokens(preset):
    """A prompt that shares a prefix with what the cache holds runs from where they part (llama-server's prompt
    cache); its logits are the full prompt's, to the precision batches of other sizes agree to."""
    m = hybridmoe.load(f"synth:{preset}", ctx_size=128)
    a, b = IDS + [9, 8], IDS[:12] + [400, 401, 402]
    kv = m.take_cache()
    prefill(m, kv, a)
    assert kv.tokens == a and kv.reusable_prefix(a) == len(a) - 1      # the last token always runs again
    n = kv.reusable_prefix(b)
    assert n == 12
    got = prefill(m, kv, b[n:], n)
    assert kv.tokens == b
    assert rel_l2(got, m.logits(b)[-1]) <= 1e-2
    m.return_cache(kv)                                                   # the model's cache again
    t = Timings()
    "".join(m.generate(b + [7, 7], 4, temperature=0, timings=t))
    assert t.n_cached == len(b) and t.n_prompt == 2


def test_prompt_cache_with_a_sliding_window_ring():
    """gpt-oss's sliding-window layers keep a ring of window - 1 + ubatch positions (8 - 1 + 8 here): a prefix is
    reused only while the keys the next tokens look back on are still in the ring."""
    m = hybridmoe.load("synth:tiny-gpt-oss", ctx_size=128, ubatch_size=8, batch_size=8)
    a = (IDS * 2)[:40]
    for keep, reused in [(38, 38), (25, 0)]:     # positions 18..24 were overwritten by 33..39
        b = a[:keep] + [500, 501, 502, 503, 504]
        kv = m.new_cache()
        prefill(m, kv, a)
        n = kv.reusable_prefix(b)
        assert n == reused
        got = prefill(m, kv, b[n:], n)
        assert rel_l2(got, m.logits(b)[-1]) <= 1e-5                     # gpt-oss runs eagerly in f32


def test_cache_forgets_what_a_failed_or_gapped_forward_touched(monkeypatch):
    m = hybridmoe.load("synth:tiny", ctx_size=64)
    kv = m.new_cache()
    prefill(m, kv, IDS)

    def fail(*a, **kw):
        raise RuntimeError("device lost")
    with monkeypatch.context() as mp:
        mp.setattr(m, "_forward", fail)
        with pytest.raises(RuntimeError):
            m.forward(torch.tensor([1, 2, 3]), 10, kv)
    assert kv.tokens == IDS[:10]
    m.forward(torch.tensor([4]), 30, kv)                                 # positions 10..29 unknown
    assert kv.tokens == [] and kv.reusable_prefix(IDS) == 0


def test_warmup_leaves_an_empty_cache_and_fresh_statistics():
    m = hybridmoe.load("synth:tiny", ctx_size=64)
    assert m.warmup() > 0
    assert m._free_cache is not None and m._free_cache.tokens == [] and m.stats.forwards == 0
    t = Timings()
    "".join(m.generate(IDS, 4, temperature=0, timings=t))
    assert (t.n_cached, t.n_prompt) == (0, len(IDS)) and m.stats.forwards == 4


@pytest.mark.slow
def test_run_conversation_mode_runs_only_each_turns_new_tokens():
    """`hybridmoe run -cnv` (llama-cli's conversation mode) on a real pipe: a turn per input line, the earlier
    turns from the cache; an empty line is skipped and /exit ends."""
    args = [sys.executable, "-m", "hybridmoe.cli", "run", "-m", "synth:tiny", "-cnv", "--temp", "0", "-n", "6",
            "-sys", "Be brief."]
    r = subprocess.run(args, input="Hello there\n\nTell me more\n/exit\nnot read\n", capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    turns = [(int(a), int(b)) for a, b in re.findall(r"\[prompt: (\d+) new tokens, (\d+) from the cache", r.stderr)]
    m = hybridmoe.load("synth:tiny")
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    ids = m.tokenizer.encode(m.tokenizer.apply_chat_template(first))
    assert len(turns) == 2 and turns[0] == (len(ids), 0)
    assert turns[1][1] >= len(ids) - 1 and turns[1][0] > 0
    t = Timings()
    assert r.stdout.startswith("".join(m.generate(ids, 6, temperature=0, timings=t)))
    replies = [int(n) for n in re.findall(r"reply: (\d+) tokens", r.stderr)]
    assert replies[0] == t.n_generated and 1 <= replies[1] <= 6


@pytest.mark.slow
def test_run_json_schema_and_grammar(tmp_path):
    """`hybridmoe run -j SCHEMA` / `--grammar GBNF` (llama-cli's): the random model writes what the schema or
    grammar accepts and ends; a schema or grammar it cannot use is a one-line error."""
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"enum": [1, 2]}, "b": {"type": "array", "items": {"type": "boolean"},
                                                          "maxItems": 3}}}
    base = [sys.executable, "-m", "hybridmoe.cli", "run", "-m", "synth:tiny", "--no-warmup", "-p", "JSON:", "-n", "300"]
    for extra in (["--temp", "0", "-j", json.dumps(schema)], ["--temp", "1", "-s", "3", "-j", json.dumps(schema)]):
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("JSON:\n")                   # the prompt, then the reply from the next line
        v = json.loads(r.stdout[len("JSON:\n"):])
        assert v["a"] in (1, 2) and len(v["b"]) <= 3 and all(isinstance(x, bool) for x in v["b"])
    r = subprocess.run(base + ["--temp", "0", "--grammar", 'root ::= "a" [b-d]{2,4} "!"'], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and re.fullmatch(r"JSON:\na[b-d]{2,4}!\n", r.stdout), r.stdout
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"type": "string", "not": {}}))
    for extra, words in ((["--json-schema-file", str(f)], "'not', which hybridmoe cannot enforce"),
                         (["-j", "{x"], "--json-schema is not JSON"),
                         (["--grammar", "root ::= x"], "--grammar: grammar line 1, column 10: rule 'x'"),
                         (["--grammar", "root ::= \"a\"", "-j", "{}"], "a grammar or a JSON schema, not both")):
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and words in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("ctk,ctv,tol", [("f32", "f32", 1e-3), ("bf16", "bf16", 5e-2), ("q8_0", "q8_0", 8e-2),
                                         ("q8_0", "f16", 8e-2)])
def test_kv_cache_types(ctk, ctv, tol, hf_models, tmp_path, f32_attention):
    """-ctk/-ctv: the cache's precision only; decode through each type stays near the f16 cache."""
    path = convert(hf_models["qwen3moe"][1], str(tmp_path / "m.gguf"), GGMLType.Q8_0)    # head size 32

    def run(**kw):
        m = hybridmoe.load(path, ctx_size=64, **kw)
        kv = m.new_cache(64)
        m.forward(torch.tensor(IDS[:8]), 0, kv)
        return torch.cat([m.forward(torch.tensor([t]), 8 + i, kv) for i, t in enumerate(IDS[8:])])
    ref = run()
    got = run(cache_type_k=ctk, cache_type_v=ctv)
    assert rel_l2(got, ref) <= tol
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_no_kv_offload_keeps_cache_on_cpu(monkeypatch):
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    a = hybridmoe.load("synth:tiny", ctx_size=64, n_gpu_layers=99)
    b = hybridmoe.load("synth:tiny", ctx_size=64, n_gpu_layers=99, no_kv_offload=True)
    assert {b.placement.kv_device(i) for i in range(b.cfg.n_layer)} == {"CPU"}
    assert rel_l2(b.logits(IDS), a.logits(IDS)) <= 1e-5


def test_q8_0_cache_needs_head_size_multiple_of_32():
    from hybridmoe.errors import HybridMoeError
    m = hybridmoe.load("synth:tiny", ctx_size=64, cache_type_k="q8_0")                   # head size 16
    with pytest.raises(HybridMoeError, match="multiple of 32.*use -ctk/-ctv f16"):
        m.logits(IDS)


def test_deepseek2_placements_match_all_cpu(hf_models, tmp_path, monkeypatch):
    """MLA, shared experts and grouped sigmoid routing under -ngl 99 -ot exps=CPU on a fake GPU."""
    path = convert(hf_models["deepseek2"][1], str(tmp_path / "ds.gguf"), GGMLType.F32)
    ref = hybridmoe.load(path, ctx_size=64).logits(IDS)
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    for opts in (dict(n_gpu_layers=99), dict(n_gpu_layers=99, override_tensor=["exps=CPU"])):
        m = hybridmoe.load(path, ctx_size=64, **opts)
        assert rel_l2(m.logits(IDS), ref) <= 1e-5
        kv = m.new_cache(64)
        full = m.logits(IDS)
        m.forward(torch.tensor(IDS[:6]), 0, kv)
        steps = torch.cat([m.forward(torch.tensor([t]), 6 + i, kv) for i, t in enumerate(IDS[6:])])
        assert rel_l2(steps, full[6:]) <= 1e-5


def test_mla_cache_is_compressed_and_takes_q8_0():
    """deepseek2 stores kv_lora_rank + rope_dim values per token and layer; -ctk q8_0 stays close."""
    m = hybridmoe.load("synth:tiny-deepseek2", ctx_size=64)
    cfg = m.cfg
    assert m.new_cache(64).nbytes() == cfg.n_layer * 64 * (cfg.kv_lora_rank + cfg.rope_dim) * 2
    ref = m.logits(IDS)
    q8 = hybridmoe.load("synth:tiny-deepseek2", ctx_size=64, cache_type_k="q8_0").logits(IDS)
    assert rel_l2(q8, ref) <= 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,P", [(1, 9), (3, 10), (20, 20), (200, 300), (256, 256)])
def test_cpu_attention_paths_match_float64(T, P, dtype, monkeypatch):
    """attend() on the CPU (a batched bmm for short chunks, fused SDPA for long ones and fresh prompts, in
    float32 or, as on CPUs with AMX, bf16) against causal GQA attention in float64, with cached positions
    before the chunk."""
    import hybridmoe.models.decoder as dec
    from hybridmoe.models.decoder import attend
    monkeypatch.setattr(dec, "_CPU_ATTN_DTYPE", dtype)
    g = torch.Generator().manual_seed(T + P)
    nh, nkv, D = 8, 2, 32
    q = torch.randn(T, nh, D, generator=g)
    keys, values = (torch.randn(nkv, P, D, generator=g).half() for _ in range(2))
    pos0 = P - T
    s = torch.einsum("thd,hpd->htp", q.double(), keys.double().repeat_interleave(nh // nkv, 0)) * D ** -0.5
    s = s.masked_fill(torch.arange(P)[None, None, :] > torch.arange(pos0, P)[None, :, None], float("-inf"))
    ref = torch.einsum("htp,hpd->thd", torch.softmax(s, -1), values.double().repeat_interleave(nh // nkv, 0))
    out = attend(q, keys, values, pos0)
    sdpa = T >= 192 or (T > 1 and P == T)
    assert rel_l2(out, ref.reshape(T, -1)) < (1e-2 if sdpa and dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("shape", [(1, 4099), (3, 2000), (1100, 1000)])    # a token's logits, a few, many
def test_all_finite(shape):
    """The logits' NaN / inf test: any one bad value anywhere is found; finite values whose sum overflows are not
    taken for one."""
    from hybridmoe.runtime.steps.base import all_finite
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    assert all_finite(x) and all_finite(x[:, ::3]) and all_finite(torch.full(shape, 3e38))   # a sum overflows
    for bad in (math.nan, math.inf, -math.inf):
        for at in ((0, 0), (shape[0] - 1, shape[1] - 1), (shape[0] // 2, 7)):
            y = x.clone()
            y[at] = bad
            assert not all_finite(y), (bad, at)
