"""The built-in model's training code (benchmarks/builtin/moe.py) computes what hybridmoe computes from the GGUF it
exports, and `-m builtin` finds the packaged file or says clearly that it is missing."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "builtin"))

import moe


def _tiny(seed=0, **kw):
    c = moe.MoEConfig(**{**dict(n_vocab=320, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16, n_expert=4,
                               n_expert_used=2, n_ff_exp=32, n_ctx=64), **kw})
    torch.manual_seed(seed)
    m = moe.TinyQwen3Moe(c)
    with torch.no_grad():                                       # away from the init's ones, so norms count
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.mul_(4.0)                                    # sharper routing and attention than 0.02 gives
    return m.eval()


@pytest.fixture(scope="module")
def tok_json(tmp_path_factory):
    from hybridmoe.text.builtin_vocab import builtin_tokenizer
    p = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    builtin_tokenizer(320).save(str(p))
    return str(p)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("n_head_kv", [2, 4])
def test_exported_f32_logits_match_torch(tmp_path, tok_json, n_head_kv, monkeypatch):
    """Same arithmetic: float32 everywhere (KV cache, CPU attention), the logits agree to float32 rounding
    (3e-7 measured); with hybridmoe's defaults (f16 KV cache, bf16 attention on AMX CPUs) within 1e-2."""
    import hybridmoe
    from hybridmoe.models import decoder
    m = _tiny(n_head_kv=n_head_kv)
    path = str(tmp_path / "tiny.gguf")
    moe.export_gguf(m, tok_json, path, qtype="F32")
    ids = torch.randint(0, m.c.n_vocab, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(ids[None])[0]
    got = hybridmoe.load(path).logits(ids.tolist())
    assert got.shape == ref.shape
    assert _rel(got, ref) < 1e-2, _rel(got, ref)
    monkeypatch.setattr(decoder, "_CPU_ATTN_DTYPE", torch.float32)
    exact = hybridmoe.load(path, cache_type_k="f32", cache_type_v="f32").logits(ids.tolist())
    assert _rel(exact, ref) < 1e-5, _rel(exact, ref)
    assert torch.equal(exact.argmax(-1), ref.argmax(-1))


def test_exported_q8_0_is_close_and_tied(tmp_path, tok_json):
    import hybridmoe
    from hybridmoe.formats.gguf import GGUFModel
    m = _tiny(seed=3)
    path = str(tmp_path / "tiny-q8.gguf")
    moe.export_gguf(m, tok_json, path, qtype="Q8_0")
    g = GGUFModel(path)
    assert "output.weight" not in g.tensors                        # tied to token_embd
    assert g.tensors["blk.0.ffn_down_exps.weight"].qtype.name == "Q8_0"
    assert g.tensors["blk.0.ffn_gate_inp.weight"].qtype.name == "F32"
    md = g.metadata
    assert md["qwen3moe.expert_count"] == 4 and md["qwen3moe.expert_used_count"] == 2
    assert "<|im_start|>" in md["tokenizer.chat_template"]
    ids = list(range(5, 37))
    with torch.no_grad():
        ref = m(torch.tensor([ids]))[0]
    got = hybridmoe.load(path).logits(ids)
    assert _rel(got, ref) < 0.1


def test_tokenizer_round_trip_through_gguf(tmp_path, tok_json):
    """The GGUF's tokenizer encodes text as the tokenizer.json it came from (what the corpus was encoded with)."""
    import tokenizers

    import hybridmoe
    m = _tiny()
    path = str(tmp_path / "tiny.gguf")
    moe.export_gguf(m, tok_json, path, qtype="F32")
    hf = tokenizers.Tokenizer.from_file(tok_json)
    text = "The quick brown fox's 3 jumps, over  the lazy dog.\n\n<|im_start|>user\nhi<|im_end|>"
    tok = hybridmoe.load(path).tokenizer
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids


def test_builtin_missing_is_a_clear_error(monkeypatch, tmp_path):
    from hybridmoe.errors import HybridMoeError
    from hybridmoe.model import resolve_model_path
    from hybridmoe.models import builtin
    monkeypatch.setattr(builtin, "BUILTIN_PATH", tmp_path / "absent.gguf")
    with pytest.raises(HybridMoeError, match="built-in model"):
        resolve_model_path("builtin")
    assert builtin.default_model() == "synth:tiny"


def test_builtin_present_is_the_default(monkeypatch, tmp_path, tok_json):
    from hybridmoe.model import resolve_model_path
    from hybridmoe.models import builtin
    f = tmp_path / "builtin.gguf"
    moe.export_gguf(_tiny(), tok_json, str(f), qtype="F32")
    monkeypatch.setattr(builtin, "BUILTIN_PATH", f)
    assert resolve_model_path("builtin") == str(f)
    assert builtin.default_model() == "builtin"
