"""`hybridmoe perplexity` (llama-perplexity): the arithmetic against hand-computed values, the base file,
KL divergence of a model against itself, a re-quantized copy and another placement, and the CLI."""
import math
import re

import pytest
import torch
from safetensors import safe_open

from hybridmoe.commands import perplexity as P
from hybridmoe.errors import HybridMoeError

TEXT = " ".join(f"The {w} of the {v} is a {u} thing, said the {w}." for w, v, u in
                zip(["cat", "dog", "bird", "fish", "tree", "stone"] * 40, ["house", "river", "hill", "sky"] * 60,
                    ["small", "large", "quiet", "bright", "old"] * 48))


def _cli(*argv):
    from hybridmoe.cli import main
    return main(list(argv))


# ------------------------------------------------------------------------------- arithmetic by hand

# two scored tokens over a vocabulary of 3. Row 0: uniform (p = 1/3), true token 0. Row 1: logits ln(1, 2, 1),
# p = (1/4, 1/2, 1/4), true token 1. PPL = exp((ln 3 + ln 2) / 2) = sqrt(6); the nlls' standard deviation
# (n - 1 in the denominator) over sqrt(2): (ln 3 - ln 2) / 2, times PPL.
LOGITS = torch.tensor([[0.0, 0.0, 0.0], [0.0, math.log(2), 0.0]], dtype=torch.float64)
TARGETS = torch.tensor([0, 1])


def test_perplexity_arithmetic_by_hand():
    nll = P.token_nll(LOGITS, TARGETS)
    assert torch.allclose(nll, torch.tensor([math.log(3), math.log(2)], dtype=torch.float64), atol=1e-12)
    s = P.PplStats()
    s.add(nll[:1])
    assert s.ppl == pytest.approx(3.0) and s.ppl_unc == 0.0              # one token: no spread yet
    s.add(nll[1:])
    assert s.ppl == pytest.approx(math.sqrt(6), rel=1e-12)
    assert s.ppl_unc == pytest.approx(math.sqrt(6) * (math.log(3) - math.log(2)) / 2, rel=1e-9)
    assert s.final_line() == f"Final estimate: PPL = {math.sqrt(6):.4f} +/- " \
                             f"{math.sqrt(6) * (math.log(3) - math.log(2)) / 2:.5f}"


def test_kl_divergence_arithmetic_by_hand():
    """Base = the two rows above; Q = the rows swapped. Row 0: KL(U || (1/4, 1/2, 1/4)) = ln(4/3) + ... by hand:
    sum 1/3 ln((1/3) / q) = (1/3)(ln(4/3) + ln(2/3) + ln(4/3)) = (1/3) ln(32/27). Row 1:
    KL((1/4, 1/2, 1/4) || U) = 2 (1/4) ln(3/4) + (1/2) ln(3/2) = (1/2) ln(9/8)."""
    base_lp = torch.log_softmax(LOGITS.double(), -1)
    q_logits = LOGITS.flip(0)
    want = [math.log(32 / 27) / 3, math.log(9 / 8) / 2]
    full = P.Reference(base_lp.gather(1, TARGETS[:, None])[:, 0].float(), base_lp.argmax(-1), base_lp,
                       torch.ones_like(base_lp, dtype=torch.bool))
    got = P.kl_divergence(full, torch.log_softmax(q_logits.double(), -1))
    assert got.tolist() == pytest.approx(want, rel=1e-12)
    # top-1 of 3: one token and a bucket for the other two. Row 0: top is token 0 (ties: the first),
    # p = (1/3, 2/3), q = (1/4, 3/4). Row 1: token 1, p = (1/2, 1/2), q = (1/3, 2/3).
    top1 = P.Reference(full.token_logprob, full.top_id, top_ids=base_lp.argmax(-1, keepdim=True),
                       top_logprob=base_lp.max(-1, keepdim=True).values)
    got = P.kl_divergence(top1, torch.log_softmax(q_logits.double(), -1))
    bucket = [1 / 3 * math.log(4 / 3) + 2 / 3 * math.log(8 / 9), 0.5 * math.log(1.5) + 0.5 * math.log(0.75)]
    assert got.tolist() == pytest.approx(bucket, rel=1e-12)
    assert all(b <= w + 1e-12 for b, w in zip(bucket, want))                    # coarse-graining: a lower bound
    # the statistics: PPL of both, the ratio, same top p (row 0: Q's top is token 1, the base's 0; row 1:
    # Q's top is token 0 (a tie), the base's 1: none the same), delta-p of the true tokens
    k = P.KldStats()
    k.add(q_logits, TARGETS, full)
    assert k.count == 2 and k.same_top == 0
    assert k.nll_base.ppl == pytest.approx(math.sqrt(6))
    assert k.nll.ppl == pytest.approx(math.exp((math.log(4) + math.log(3)) / 2))     # p(0)=1/4, p(1)=1/3
    assert k.log_ppl_ratio()[0] == pytest.approx((math.log(12) - math.log(6)) / 2)
    assert k.mean_kld()[0] == pytest.approx(sum(want) / 2)
    assert k.mean_kld()[1] == pytest.approx(abs(want[0] - want[1]) / 2)            # std error of 2 values
    assert k.p_diff_values == pytest.approx([1 / 4 - 1 / 3, 1 / 3 - 1 / 2])
    lines = "\n".join(k.summary())
    assert f"Mean    KLD: {sum(want) / 2:10.6f}" in lines and "Same top p:  0.000" in lines
    assert f"Maximum KLD: {max(want):10.6f}" in lines and f"Median  KLD: {sum(want) / 2:10.6f}" in lines


def test_percentiles_are_llama_cpps():
    v = [0.0, 1.0, 2.0, 3.0, 10.0]
    assert P.percentile(v, 0.5) == 2.0 and P.percentile(v, 0.9) == pytest.approx(3 + 0.6 * 7)
    assert P.percentile(v, 0) == 0.0 and P.percentile(v, 1) == 10.0
    assert P.median([1.0, 2.0, 3.0, 4.0]) == 2.5 and P.median(v) == 2.0


def test_compressed_rows_keep_log_probs_within_their_step():
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(4 * torch.randn(5, 3000, generator=g, dtype=torch.float64), -1)
    q, ls = P.compress_rows(lp)
    back, kept = P.expand_rows(q, ls)
    inside = lp >= (lp.max(-1, keepdim=True).values - P.WINDOW)
    assert torch.equal(kept, inside)
    assert float((back - lp)[kept].abs().max()) <= P.WINDOW / 65534 / 2 + 1e-6
    flat = torch.full((1, 7), -math.log(7), dtype=torch.float64)            # a flat row keeps every entry
    back, kept = P.expand_rows(*P.compress_rows(flat))
    assert kept.all() and torch.allclose(back, flat, atol=1e-6)


# ------------------------------------------------------------------------------- models


def _requantize(src: str, dst: str, qtype):
    from hybridmoe.models.convert import requantize
    return requantize(src, dst, qtype)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("ppl") / "t.txt"
    p.write_text(TEXT)
    return str(p)


def _final(out: str) -> tuple[float, float]:
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", out)
    return float(m[1]), float(m[2])


def _stat(out: str, name: str) -> float:
    return float(re.search(re.escape(name) + r"\s*:\s*(-?[\d.]+)", out)[1])


def test_cli_perplexity_and_kl_divergence(text_file, tmp_path, capsys, monkeypatch):
    """End to end on synth:tiny: the running PPL per chunk and the final estimate (equal to the model's own
    logits scored by hand); the base file; KLD of the model against itself (0, 100% same top), on another
    placement (fake GPUs: the same arithmetic) and of a Q4_0 copy (> 0)."""
    import hybridmoe
    base = str(tmp_path / "base.kld")
    assert _cli("perplexity", "-m", "synth:tiny", "-f", text_file, "-c", "64", "--chunks", "3",
                "--kl-divergence-base", base) == 0
    out, err = capsys.readouterr()
    assert "calculating perplexity over 3 chunks, n_ctx=64" in err
    assert re.match(r"\[1\][\d.]+,\[2\][\d.]+,\[3\][\d.]+,\n", out), out
    ppl, unc = _final(out)
    # the same number from the model's logits: each chunk from an empty context, BOS-less model (tiny adds
    # none), the second half scored
    m = hybridmoe.load("synth:tiny", ctx_size=64)
    ids = m.tokenizer.encode(TEXT, add_special=True, parse_special=False)
    nll = []
    for c in range(3):
        chunk = ids[c * 64:(c + 1) * 64]
        lp = torch.log_softmax(m.logits(chunk).double(), -1)
        nll += [-float(lp[i, chunk[i + 1]]) for i in range(32, 63)]
    assert ppl == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)
    assert 0 < unc < ppl
    with safe_open(base, "np") as f:                                       # any safetensors reader opens it
        assert f.metadata()["format"] == "hybridmoe-kld" and f.get_tensor("logprob_q").shape == (3, 31, 1024)
        assert f.get_tensor("tokens").tolist() == [ids[c * 64:(c + 1) * 64] for c in range(3)]

    assert _cli("perplexity", "-m", "synth:tiny", "--kl-divergence-base", base, "--kl-divergence") == 0
    out, err = capsys.readouterr()
    assert "chunk             PPL" in out and len(re.findall(r"^\s+\d ", out, re.M)) == 3
    assert _stat(out, "Mean PPL(Q)") == pytest.approx(ppl, rel=1e-5)
    assert _stat(out, "Mean PPL(base)") == pytest.approx(ppl, rel=1e-5)
    assert abs(_stat(out, "Mean    KLD")) < 1e-6 and abs(_stat(out, "Maximum KLD")) < 1e-6
    assert "Same top p: 100.000 ± 0.000 %" in out
    assert _stat(out, "Mean PPL(Q)/PPL(base)") == pytest.approx(1.0, abs=1e-5)

    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")                       # another placement
    assert _cli("perplexity", "-m", "synth:tiny", "--kl-divergence-base", base, "--kl-divergence",
                "-ngl", "99", "-ot", "exps=CPU", "-ub", "16") == 0
    out, _ = capsys.readouterr()
    assert abs(_stat(out, "Mean    KLD")) < 1e-5 and "Same top p: 100.000" in out
    monkeypatch.delenv("HYBRIDMOE_FAKE_GPUS")

    from hybridmoe.models.synth import ensure_synth
    from hybridmoe.quant.types import GGMLType
    q4 = _requantize(ensure_synth("tiny"), str(tmp_path / "q4.gguf"), GGMLType.Q4_0)
    assert _cli("perplexity", "-m", q4, "--kl-divergence-base", base, "--kl-divergence") == 0
    out, _ = capsys.readouterr()
    k = _stat(out, "Mean    KLD")
    assert k > 1e-4 and _stat(out, "Minimum KLD") >= 0 and _stat(out, "Maximum KLD") > k
    assert _stat(out, "Mean PPL(base)") == pytest.approx(ppl, rel=1e-5)
    assert _stat(out, "Mean PPL(Q)") != pytest.approx(ppl, rel=1e-6)
    assert 0 < _stat(out, "Same top p") < 100
    for name in ("99.0%   KLD", "95.0%   KLD", "90.0%   KLD", "Median  KLD", "RMS Δp"):
        assert name in out


def test_top_k_base_file_is_small_and_bounds_the_kld(text_file, tmp_path, capsys):
    from hybridmoe.models.synth import ensure_synth
    from hybridmoe.quant.types import GGMLType
    full, top = str(tmp_path / "full.kld"), str(tmp_path / "top.kld")
    common = ("-m", "synth:tiny", "-f", text_file, "-c", "64", "--chunks", "2")
    assert _cli("perplexity", *common, "--kl-divergence-base", full) == 0
    assert _cli("perplexity", *common, "--kl-divergence-base", top, "--kl-divergence-top", "32") == 0
    capsys.readouterr()
    import os
    assert os.path.getsize(top) < os.path.getsize(full) / 3
    q4 = _requantize(ensure_synth("tiny"), str(tmp_path / "q4.gguf"), GGMLType.Q4_0)
    res = {}
    for f in (full, top):
        assert _cli("perplexity", "-m", q4, "--kl-divergence-base", f, "--kl-divergence") == 0
        res[f] = capsys.readouterr().out
    assert 0 < _stat(res[top], "Mean    KLD") <= _stat(res[full], "Mean    KLD") * 1.001
    for name in ("Mean PPL(Q)", "Mean PPL(base)", "Same top p", "RMS Δp"):   # exact in both
        assert _stat(res[top], name) == pytest.approx(_stat(res[full], name), rel=1e-4)


def test_clear_errors(text_file, tmp_path, capsys, monkeypatch):
    short = tmp_path / "short.txt"
    short.write_text("only a few words here")
    cases = [
        (("-f", str(short), "-c", "64"), "tokenizes to only"),
        (("-c", "64"), "give the text to evaluate with -f FILE"),
        (("-f", str(tmp_path / "none.txt")), "cannot read"),
        (("--kl-divergence",), "give --kl-divergence-base FILE"),
        (("--kl-divergence-base", str(tmp_path / "none.kld"), "--kl-divergence"), "cannot read it"),
        (("--kl-divergence-base", text_file, "--kl-divergence"), "not a base file"),
        (("-f", text_file, "-c", "4"), "at least 8 tokens"),
        (("-f", text_file, "--chunks", "0"), "--chunks 0"),
    ]
    for extra, words in cases:
        with pytest.raises(HybridMoeError, match=re.escape(words)):
            P.main(_parse("-m", "synth:tiny", *extra))
    base = str(tmp_path / "b.kld")
    assert _cli("perplexity", "-m", "synth:tiny", "-f", text_file, "-c", "64", "--chunks", "2",
                "--kl-divergence-base", base) == 0
    with pytest.raises(HybridMoeError, match="holds chunks of 64 tokens"):
        P.main(_parse("-m", "synth:tiny", "--kl-divergence-base", base, "--kl-divergence", "-c", "128"))

    class OtherVocab(P.BaseFile):
        def __init__(self, path):
            super().__init__(path)
            self.n_vocab = 999
    monkeypatch.setattr(P, "BaseFile", OtherVocab)
    with pytest.raises(HybridMoeError, match="vocabulary of 999 tokens; this one has 1024"):
        P.main(_parse("-m", "synth:tiny", "--kl-divergence-base", base, "--kl-divergence"))
    monkeypatch.undo()
    capsys.readouterr()
    # more chunks than the text holds: a warning, then all of them
    assert _cli("perplexity", "-m", "synth:tiny", "-f", text_file, "-c", "512", "--chunks", "20") == 0
    out, err = capsys.readouterr()
    assert "holds only" in err and out.count("[") >= 2


def _parse(*argv):
    from hybridmoe.cli import build_parser
    return build_parser().parse_args(["perplexity", *argv])
