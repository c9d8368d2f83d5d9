"""`plan --suggest` ranks distinct placements: on the H100 VM's calibration (rig h100-vm) with a 12 GiB GPU, the
issue-30 case that once gave a single suggestion, the top N fit when re-planned from their flags, are ranked by
the objective, are each at least the gap apart, and a longer list starts with the shorter one; the candidates span
--n-cpu-moe N, every expert in RAM, partial -ngl, -ngl 0, ubatch sizes and op offload (the decode share)."""
from __future__ import annotations

import json
import re
import shlex

import pytest

from hybridmoe.commands import plan as plan_cmd
from hybridmoe.commands.plan_check import rank_agreement
from hybridmoe.errors import HybridMoeError, PlacementError
from hybridmoe.models.catalog import catalog_model
from hybridmoe.perf.rigs import load_rig, read_rig
from hybridmoe.placement import planner
from hybridmoe.placement.core import PlacementOptions, plan_placement
from hybridmoe.placement.planner import MIN_GAP, options_from_argv, predict, suggest

GiB = 1 << 30
MODEL = "qwen3-30b-a3b:Q4_0:Q8_0"             # synth:qwen3-30b-a3b's shape and types, without the file
HEADROOM = int(66.7 * GiB)                    # leaves 12 GiB of the rig's 78.7 free, as plan_check.py simulates
OPTS = PlacementOptions(ctx_size=4096)


@pytest.fixture(scope="module")
def vm():
    cfg, tensors = catalog_model(MODEL)
    devices, rates = load_rig("h100-vm")
    return cfg, tensors, devices, rates


@pytest.fixture(scope="module")
def cands(vm):
    cfg, tensors, devices, rates = vm
    s = planner._Search(tensors, cfg, OPTS.replace(split_mode="layer"), devices, rates)
    s.n_prompt = 512
    return planner._candidates(s, OPTS, HEADROOM)


def _suggest(vm, **kw):
    cfg, tensors, devices, rates = vm
    kw = {"n_prompt": 512, "headroom": HEADROOM, **kw}
    return suggest(tensors, cfg, devices, rates, OPTS, **kw)


def test_h100_vm_rig_is_its_calibration():
    rig = read_rig("h100-vm")
    assert "measured" in rig.source and rig.rates.costs["CUDA0"]["eager_prompt_layer_s"] > 0
    assert rig.devices[1].free_bytes == int(78.7 * GiB) and rig.rates.gpu_names["CUDA0"].startswith("NVIDIA H100")


@pytest.mark.parametrize("objective", ["tg", "pp", "balanced"])
def test_top_three_fit_are_ranked_and_apart(vm, objective):
    cfg, tensors, devices, rates = vm
    sugs = _suggest(vm, objective=objective)
    assert len(sugs) == 3 and len({s.flags for s in sugs}) == 3
    score = {"tg": lambda s: s.tg, "pp": lambda s: s.pp,
             "balanced": lambda s: 1 / s.prediction.request_seconds(4096, 512)}[objective]
    for a, b in zip(sugs, sugs[1:]):
        assert score(b) <= score(a) * (1 - MIN_GAP) + 1e-9          # ranked, and at least the gap apart
    for s in sugs:                                                  # the flags a user pastes give the same plan
        p = plan_placement(tensors, cfg, options_from_argv(shlex.split(s.flags)), devices)
        assert p.device_of == s.placement.device_of
        assert p.totals["CUDA0"].total <= devices[1].free_bytes - HEADROOM
        again = predict(p, rates, 512, 128)
        assert (again.tg, again.pp) == pytest.approx((s.tg, s.pp))
    assert sugs[0].label == f"best {planner._name(objective)}" and not sugs[0].note and all(s.note for s in sugs[1:])


def test_first_is_the_best_candidate_and_the_list_is_stable(vm, cands):
    sugs = _suggest(vm)
    assert sugs[0].tg >= max(c.tg for c in cands) * 0.998
    five = _suggest(vm, count=5)             # a longer list starts with the shorter one (and the same again)
    assert len(five) == 5 and [s.flags for s in five[:3]] == [s.flags for s in sugs]
    # without a gap the three best candidates come back, near-copies included (one more layer in RAM each)
    # without a gap, the best three candidates that are not predicted alike in TG and PP (-ub 1024 adds nothing
    # to pp512): one more layer's experts in RAM each
    close = _suggest(vm, min_gap=0)
    n = [int(re.search(r"--n-cpu-moe (\d+)", s.flags)[1]) for s in close]
    assert n == [n[0], n[0] + 1, n[0] + 2] and all("-ub 512" in s.flags for s in close)
    assert close[0].flags == sugs[0].flags and close[1].tg > sugs[1].tg
    with pytest.raises(PlacementError, match="at least one"):
        _suggest(vm, count=0)
    with pytest.raises(PlacementError, match="share"):
        _suggest(vm, min_gap=1.5)


def test_candidates_span_the_real_choices(vm, cands):
    cfg = vm[0]
    flags = [c.argv for c in cands]
    n_cpu = {int(a[a.index("--n-cpu-moe") + 1]) for a in flags if a[:2] == ["-ngl", "99"] and "--n-cpu-moe" in a}
    assert len(n_cpu) >= 10 and cfg.n_layer in n_cpu                # several N, and every expert in RAM
    ngl = {int(a[1]) for a in flags}
    assert 0 in ngl and any(0 < x < cfg.n_layer for x in ngl)       # -ngl 0 and partial -ngl
    assert {c.options.ubatch_size for c in cands} == {512, 1024, 2048, 4096}
    assert {c.options.op_offload for c in cands} == {True, False}
    for c in cands:
        assert c.placement.fits and c.placement.totals["CUDA0"].total <= vm[2][1].free_bytes - HEADROOM
    # the decode share runs only with op offload (pinned host experts): the best TG keeps it, and the same
    # expert layers without it decode slower
    best = max(cands, key=lambda c: c.tg)
    assert best.options.op_offload and best.prediction.share and best.prediction.share[0] > 0
    off = [c for c in cands if not c.options.op_offload and c.options.n_cpu_moe == best.options.n_cpu_moe]
    assert off and all(c.prediction.share is None and c.tg < best.tg for c in off)


def test_small_gpu_gave_one_suggestion_before(vm):
    """The old search listed only trade-offs better than every one shown in TG or PP; on one GPU the fullest
    layout beat them all, so --suggest gave one line: now the next placements by the objective follow."""
    sugs = _suggest(vm, count=3)
    on_gpu = [len(s.gpu_expert_layers["CUDA0"]) for s in sugs]
    assert on_gpu == sorted(on_gpu, reverse=True) and on_gpu[0] > on_gpu[-1]


def _run(argv, capsys):
    args = plan_cmd.setup_arg_parser().parse_args(argv)
    rc = plan_cmd.main(args)
    return rc, capsys.readouterr()


def test_plan_suggest_top_and_gap_flags(capsys):
    base = ["-m", f"catalog:{MODEL}", "--rig", "h100-vm", "--suggest", "-c", "4096", "-p", "512",
            "--headroom", "66.7"]
    rc, out = _run(base + ["--json", "--top", "4", "--min-gap", "10"], capsys)
    doc = json.loads(out.out)
    tg = [s["predicted"]["tg_ts"] for s in doc["suggestions"]]
    assert rc == 0 and len(tg) == 4 and all(b <= 0.9 * a + 1e-9 for a, b in zip(tg, tg[1:]))
    rc, out = _run(base, capsys)
    assert rc == 0 and len(re.findall(r"^#\d ", out.out, re.M)) == 3
    with pytest.raises(HybridMoeError, match="--min-gap 100"):
        _run(base + ["--min-gap", "100"], capsys)
    with pytest.raises(SystemExit):
        _run(base + ["--top", "0"], capsys)
    assert "expected a whole number" in capsys.readouterr().err


# --- plan_check.py's ranking comparison -----------------------------------------------------------------

def test_rank_agreement():
    same = rank_agreement([3.0, 2.0, 1.0], [30.0, 20.0, 10.0])
    assert same["spearman"] == 1.0 and same["matches"] and len(same["agree"]) == 3
    rev = rank_agreement([3.0, 2.0, 1.0], [10.0, 20.0, 30.0])
    assert rev["spearman"] == -1.0 and not rev["matches"] and len(rev["differ"]) == 3
    one = rank_agreement([3.0, 2.0, 1.0], [30.0, 10.0, 20.0])
    assert one["spearman"] == pytest.approx(0.5) and one["differ"] == [(1, 2)]
    # measured 20 +- 3 against 18 +- 1: closer than their noise, a tie the benchmark cannot order
    tie = rank_agreement([3.0, 2.0, 1.0], [30.0, 18.0, 20.0], [1.0, 1.0, 3.0])
    assert tie["ties"] == [(1, 2)] and tie["matches"]
    with pytest.raises(ValueError):
        rank_agreement([1.0], [1.0, 2.0])
    flat = rank_agreement([2.0, 2.0], [20.0, 10.0])                # predicted alike: no order to check
    assert flat["ties"] == [(0, 1)] and flat["matches"]
