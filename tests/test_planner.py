"""Planner: suggestions for the seeds' rigs fit when re-planned from their own flags, keep fused pairs together,
fill bigger and faster GPUs first; the performance model's TG/PP against hand-computed bounds; rig files; the
`plan --suggest` / `plan --rig` command."""
from __future__ import annotations

import argparse
import json
import re
import shlex

import pytest

from hybridmoe.commands import plan as plan_cmd
from hybridmoe.errors import HybridMoeError, PlacementError
from hybridmoe.models.catalog import catalog_model
from hybridmoe.perf.calibrate import Rates, save_rates
from hybridmoe.perf.rigs import load_rig, read_rig, rig_names
from hybridmoe.placement.core import (
    PlacementOptions,
    add_placement_args,
    options_from_args,
    plan_placement,
)
from hybridmoe.placement.planner import OBJECTIVES, options_from_argv, predict, suggest

GiB = 1 << 30
EXPS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@pytest.fixture(scope="module")
def cases(dsr1, qwen235):
    """(model, rig, suggestions) for the seeds: issue 521's 7-GPU rig, discussion 532's 4-GPU rig."""
    out = {}
    for key, (cfg, tensors), rig in (("dsr1", dsr1, "panchovix-7gpu"), ("qwen235", qwen235, "mtcl-4gpu")):
        devices, rates = load_rig(rig)
        out[key] = (cfg, tensors, devices, rates, suggest(tensors, cfg, devices, rates, PlacementOptions()))
    return out


def replan(flags: str, tensors, cfg, devices):
    """Flags as a user pastes them: shell words -> the argparse flags every command uses -> placement."""
    p = argparse.ArgumentParser()
    add_placement_args(p)
    return plan_placement(tensors, cfg, options_from_args(p.parse_args(shlex.split(flags))), devices)


def expert_layers(placement, device):
    return sorted({int(n.split(".")[1]) for n, d in placement.device_of.items() if d == device and "_exps." in n})


# --- rigs ----------------------------------------------------------------------------------------

def test_shipped_rigs_load_as_the_rigs_devices():
    assert set(rig_names()) >= {"h200-rig", "panchovix-7gpu", "mtcl-4gpu"}
    devices, rates = load_rig("panchovix-7gpu")
    assert [d.name for d in devices] == ["CPU"] + [f"CUDA{i}" for i in range(7)]
    assert all(d.fake and "rig panchovix-7gpu" in d.description and d.torch_device.type == "meta" for d in devices)
    assert [round(d.total_bytes / GiB) for d in devices[1:]] == [32, 24, 24, 32, 24, 24, 48]
    assert devices[7].free_bytes == int(47.5 * GiB)                  # 48 GiB less the rig's 0.5 GiB reserve
    assert devices[0].total_bytes == 192 * GiB
    assert rates.host == "rig:panchovix-7gpu"
    assert rates.read_bw("CPU") == pytest.approx(57.6e9) and rates.read_bw("CUDA6") == pytest.approx(768e9)
    assert rates.flops("CUDA0") == pytest.approx(209.5e12) and rates.h2d("CUDA3") == pytest.approx(31.5e9)
    assert "spec" in read_rig("panchovix-7gpu").source and "measured" in read_rig("h200-rig").source
    _, h200 = load_rig("h200-rig")
    assert (h200.ram_read_bw, h200.h2d_bw["CUDA0"], h200.gpu_bw["CUDA0"]) == (95e9, 54e9, 4300e9)   # RIG.md
    mtcl, _ = load_rig("mtcl-4gpu")
    assert [read_rig("mtcl-4gpu").rates.gpu_names[d.name] for d in mtcl[1:]] == \
        ["NVIDIA GeForce RTX 5090", "NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 5090"]


def test_rig_files_and_errors(tmp_path):
    rig = {"name": "two", "cpu": {"ram_gib": 64, "ram_read_gbps": 50, "bf16_tflops": 1, "threads": 8},
           "gpus": [{"name": "A", "memory_gib": 16, "free_gib": 15, "hbm_gbps": 500, "bf16_tflops": 50,
                     "h2d_gbps": 25, "sync_latency_us": 10}]}
    path = tmp_path / "two.json"
    path.write_text(json.dumps(rig))
    devices, rates = load_rig(str(path))
    assert devices[1].total_bytes == 16 * GiB and devices[1].free_bytes == 15 * GiB
    assert rates.sync("CUDA0") == pytest.approx(10e-6) and rates.threads == 8
    assert rates.cpu_expert_flops(512) == pytest.approx(0.4e12)       # no expert rate: 40% of bf16
    for bad in ({"x": 1}, {"32": -1}, [1]):
        path.write_text(json.dumps({**rig, "cpu": {**rig["cpu"], "expert_kernel_tflops": bad}}))
        with pytest.raises(HybridMoeError, match="expert_kernel_tflops"):
            load_rig(str(path))
    _, h200 = load_rig("h200-rig")
    assert h200.cpu_expert_flops(1) == pytest.approx(0.5e12) and h200.cpu_expert_flops(4096) == pytest.approx(3e12)
    path.write_text(json.dumps(rig))
    with pytest.raises(HybridMoeError, match="panchovix-7gpu"):
        load_rig("no-such-rig")
    del rig["gpus"][0]["hbm_gbps"]
    path.write_text(json.dumps(rig))
    with pytest.raises(HybridMoeError, match=r"gpus\[0\]: missing 'hbm_gbps'"):
        load_rig(str(path))
    path.write_text("{")
    with pytest.raises(HybridMoeError, match="not valid JSON"):
        load_rig(str(path))


# --- suggestions -----------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["dsr1", "qwen235"])
def test_suggestions_fit_when_replanned_from_their_flags(cases, key):
    cfg, tensors, devices, rates, sugs = cases[key]
    assert len(sugs) >= 2
    assert len({s.flags for s in sugs}) == len(sugs)
    for s in sugs:
        p = replan(s.flags, tensors, cfg, devices)
        assert p.fits, (s.flags, p.over_budget())
        assert p.device_of == s.placement.device_of
        assert [m.total for m in s.memory] == [p.totals[d.name].total for d in devices]
        assert s.estimate == [p.totals[d.name].total for d in devices[1:]]     # the search counts as placement
        assert all(m.total <= m.free for m in s.memory[1:])
        assert s.flags.startswith("-ngl ") and " -ts " in s.flags
        ot = r'-ot "blk\\\.\(?[0-9\[\]|()-]+\)?\\\.ffn_\(up\|down\|gate\)_exps=CPU"'
        assert "--n-cpu-moe " in s.flags or re.search(ot, s.flags)


@pytest.mark.parametrize("key", ["dsr1", "qwen235"])
def test_top_flags_reproduce_the_same_device_map(cases, key):
    cfg, tensors, devices, rates, sugs = cases[key]
    top = sugs[0]
    o = options_from_argv(shlex.split(top.flags))
    assert o == top.options
    again = plan_placement(tensors, cfg, o, devices)
    assert again.device_of == top.placement.device_of
    # and the prediction from the re-planned flags is the same
    assert predict(again, rates).tg == pytest.approx(top.tg) and predict(again, rates).pp == pytest.approx(top.pp)


@pytest.mark.parametrize("key", ["dsr1", "qwen235"])
def test_gate_up_down_of_a_layer_never_split(cases, key):
    cfg, tensors, devices, rates, sugs = cases[key]
    for s in sugs:
        p = s.placement
        for il in range(cfg.n_layer):
            devs = {p.device_of[n] for n in (p.layer_tensor(il, x) for x in EXPS) if n is not None}
            assert len(devs) <= 1, (s.flags, il, devs)
        assert not [w for w in p.warnings if "TG gets slow" in w]


@pytest.mark.parametrize("key", ["dsr1", "qwen235"])
def test_bigger_gpus_hold_more_experts(cases, key):
    cfg, tensors, devices, rates, sugs = cases[key]
    top = sugs[0]
    gpus = sorted(devices[1:], key=lambda d: d.free_bytes)
    count = {d.name: len(top.gpu_expert_layers[d.name]) for d in gpus}
    for a in gpus:
        for b in gpus:
            if a.free_bytes > b.free_bytes:
                assert count[a.name] >= count[b.name], count
    by_name = {m.name: m.expert_bytes for m in top.memory}
    assert by_name[gpus[-1].name] > by_name[gpus[0].name]
    # the model does not fit: every GPU holds experts and the rest are in RAM
    assert all(count.values()) and top.cpu_expert_layers
    # experts the GPUs hold are whole layers next to their attention (and KV cache)
    for d in gpus:
        for il in top.gpu_expert_layers[d.name]:
            assert top.placement.attn_device(il) == d.name == top.placement.kv_device(il)


@pytest.mark.parametrize("key", ["dsr1", "qwen235"])
def test_beats_the_usual_n_cpu_moe_recipe(cases, key):
    """`-ngl 99 --n-cpu-moe N` with the smallest N that fits (what placement.py's fix suggests) splits layers by
    free memory, so most GPUs hold only the attention of host layers; the planner balances -ts instead."""
    cfg, tensors, devices, rates, sugs = cases[key]
    fix = plan_placement(tensors, cfg, PlacementOptions(n_gpu_layers=99), devices).suggest_fix()
    n = int(re.fullmatch(r"try --n-cpu-moe (\d+)", fix)[1])
    naive = plan_placement(tensors, cfg, PlacementOptions(n_gpu_layers=99, n_cpu_moe=n), devices)
    assert naive.fits
    on_gpu = sum(1 for n_, d in naive.device_of.items() if d != "CPU" and n_.endswith("ffn_up_exps.weight"))
    assert sum(len(v) for v in sugs[0].gpu_expert_layers.values()) > on_gpu
    assert sugs[0].tg > 1.2 * predict(naive, rates).tg


def test_fastest_gpu_first_when_there_is_room(tmp_path):
    cfg, tensors = catalog_model("qwen3-30b-a3b")               # 17.7 GiB: fits on either GPU alone
    rig = {"name": "slow-fast", "cpu": {"ram_gib": 64, "ram_read_gbps": 60, "bf16_tflops": 1},
           "gpus": [{"name": "slow", "memory_gib": 24, "hbm_gbps": 900, "bf16_tflops": 70, "h2d_gbps": 25},
                    {"name": "fast", "memory_gib": 24, "hbm_gbps": 1800, "bf16_tflops": 200, "h2d_gbps": 25}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rig))
    devices, rates = load_rig(str(path))
    top = suggest(tensors, cfg, devices, rates)[0]
    assert "-ts 0,49" in top.flags and "exps=CPU" not in top.flags and "--n-cpu-moe" not in top.flags
    assert set(top.placement.device_of[n] for n in tensors if n.startswith("blk.")) == {"CUDA1"}
    # the slow GPU would have given a slower prediction
    slow = plan_placement(tensors, cfg, options_from_argv(["-ngl", "99", "-ts", "49,0"]), devices)
    assert predict(slow, rates).tg < top.tg


def test_objectives_rank_differently(cases):
    cfg, tensors, devices, rates, sugs = cases["qwen235"]
    by_pp = suggest(tensors, cfg, devices, rates, PlacementOptions(), objective="pp")
    by_bal = suggest(tensors, cfg, devices, rates, PlacementOptions(), objective="balanced")
    assert sugs[0].label == "best TG" and by_pp[0].label == "best PP" and by_bal[0].label == "best balanced"
    same_ub = [s for s in sugs + by_pp + by_bal if s.options.ubatch_size == 512]
    assert sugs[0].tg >= max(s.tg for s in same_ub) * 0.998
    assert by_pp[0].pp >= max(s.pp for s in same_ub) * 0.998
    # a larger ubatch is offered for prompt speed, paid for with compute buffers (fewer expert layers on GPUs)
    best_pp = max(sugs, key=lambda s: s.pp)
    assert best_pp.options.ubatch_size > 512 and best_pp.pp > 1.5 * sugs[0].pp
    assert sum(len(v) for v in best_pp.gpu_expert_layers.values()) < \
        sum(len(v) for v in sugs[0].gpu_expert_layers.values())
    short = suggest(tensors, cfg, devices, rates, PlacementOptions(), count=1, n_prompt=512, n_gen=32)
    assert len(short) == 1 and (short[0].prediction.n_prompt, short[0].prediction.n_gen) == (512, 32)
    assert short[0].flags == sugs[0].flags
    with pytest.raises(PlacementError, match="objective"):
        suggest(tensors, cfg, devices, rates, objective="speed")
    assert OBJECTIVES == ("tg", "pp", "balanced")


def test_small_gpu_offloads_fewer_layers(dsr1):
    cfg, tensors = dsr1
    devices, rates = load_rig("mtcl-4gpu")
    devices = devices[:1] + [devices[2]]
    devices[1].free_bytes = 8 * GiB                               # all attention (~15 GiB) can't fit
    top = suggest(tensors, cfg, devices, rates)[0]
    ngl = int(top.flags.split()[1])
    assert 0 < ngl < cfg.n_layer and top.placement.fits
    assert replan(top.flags, tensors, cfg, devices).device_of == top.placement.device_of
    cpu_only = suggest(tensors, cfg, devices[:1], rates)
    assert cpu_only[0].flags.startswith("-ngl 0") and cpu_only[0].tg < top.tg


# --- the performance model ----------------------------------------------------------------------------

def _active_expert_bytes(tensors, cfg):
    return sum(t.nbytes for n, t in tensors.items() if "_exps." in n) * cfg.n_expert_used / cfg.n_expert


@pytest.mark.parametrize("key", ["dsr1", "qwen235"])
def test_all_experts_on_cpu_is_bound_by_ram_bandwidth(cases, key):
    """Uncalibrated (rig files without costs), the prediction is the runtime's steps at the rates alone: the
    active experts' bytes over RAM bandwidth, each GPU's non-expert bytes over its bandwidth, and the
    hand-offs (captured step) or crossings (eager step) between them."""
    cfg, tensors, devices, rates, _ = cases[key]
    p = plan_placement(tensors, cfg, options_from_argv(["-ngl", "99", "--cpu-moe"]), devices)
    pred = predict(p, rates)
    per_token = 1 / pred.tg
    assert per_token == pytest.approx(sum(pred.tg_terms.values()) / pred.n_gen, rel=1e-9)
    # by hand: the active experts' bytes over RAM bandwidth, plus each GPU's non-expert bytes over its bandwidth
    cpu_s = _active_expert_bytes(tensors, cfg) / rates.ram_read_bw
    gpu_s = sum(t.nbytes / rates.read_bw(p.device_of[n]) for n, t in tensors.items()
                if p.device_of[n] != "CPU" and len(t.shape) > 1)
    assert pred.tg_bound.terms["CPU read"] / pred.n_gen == pytest.approx(cpu_s, rel=0.10)
    assert pred.tg_terms["CPU experts"] / pred.n_gen == pytest.approx(cpu_s, rel=1e-6)
    assert pred.tg <= rates.ram_read_bw / _active_expert_bytes(tensors, cfg)
    assert pred.tg_bound.limit == "CPU read" and pred.tg_limit == "CPU experts"
    moe = [il for il in range(cfg.n_layer) if p.layer_tensor(il, "ffn_up_exps")]
    bounds = [(a, b) for a, b in zip(p.layer_device, p.layer_device[1:]) if a != b]
    hid = cfg.n_embd * 4

    def end(d):
        return rates.sync(d) / 2 + hid / rates.h2d(d)
    if pred.decode_kind == "graph":
        # qwen3moe: the captured step; each CPU-expert layer hands off (several GPUs: the synchronous hand-off,
        # the calibrated hand-off (uncalibrated: a sync round trip) plus a sync), GPU to GPU through the host
        assert key == "qwen235"
        assert pred.tg_terms["hand-offs"] / pred.n_gen == pytest.approx(
            sum(2 * rates.sync(p.attn_device(il)) for il in moe), rel=1e-6)
        assert pred.tg_terms["crossings"] / pred.n_gen == pytest.approx(sum(end(a) + end(b) for a, b in bounds),
                                                                        rel=1e-6)
        extra = pred.tg_terms["hand-offs"] + pred.tg_terms["crossings"] + pred.tg_terms.get("KV cache", 0)
        assert per_token == pytest.approx(cpu_s + gpu_s + extra / pred.n_gen, rel=0.05)
        return
    # deepseek2 (MLA): the eager step; each MoE layer goes GPU -> CPU -> GPU, the input comes from and the logits
    # go to the host, and layer boundaries between GPUs go through the host; each end of a copy pays half a sync
    # round trip and the hidden state (fp32) over its PCIe link
    assert pred.decode_kind == "eager" and key == "dsr1"
    assert pred.crossings == 2 * len(moe) + 2 + len(bounds)
    hand = sum(2 * end(p.layer_device[il]) for il in moe) + sum(end(a) + end(b) for a, b in bounds) \
        + end(p.layer_device[0]) + end(p.output_device)
    assert pred.tg_terms["crossings"] / pred.n_gen == pytest.approx(hand, rel=0.02)
    assert per_token == pytest.approx(cpu_s + gpu_s + pred.tg_terms["crossings"] / pred.n_gen, rel=0.05)


@pytest.mark.parametrize("key", ["dsr1", "qwen235"])
def test_tg_rises_as_expert_layers_move_to_gpus(cases, key):
    cfg, tensors, devices, rates, sugs = cases[key]
    ts = sugs[0].options.tensor_split
    prev_tg, prev_on_gpu = 0.0, -1
    for n_cpu in range(cfg.n_layer, -1, -1):                   # fewer layers' experts in RAM each step
        o = PlacementOptions(n_gpu_layers=99, tensor_split=ts, n_cpu_moe=n_cpu)
        p = plan_placement(tensors, cfg, o, devices)
        on_gpu = sum(1 for n, d in p.device_of.items() if d != "CPU" and n.endswith("ffn_up_exps.weight"))
        tg = predict(p, rates).tg
        if on_gpu > prev_on_gpu:
            assert tg > prev_tg, (n_cpu, on_gpu, tg, prev_tg)
        else:
            assert tg == pytest.approx(prev_tg)
        prev_tg, prev_on_gpu = tg, on_gpu
    assert prev_on_gpu == sum(1 for n in tensors if n.endswith("ffn_up_exps.weight"))


def test_pp_uploads_when_they_pay():
    """RIG.md: Qwen3-30B-A3B Q4_0/Q8_0 with experts in RAM on the H200 machine: 16.3 GB of experts per ubatch
    over 54 GB/s bound PP at about 1,700 t/s for -ub 512 and 13,600 t/s for -ub 4096."""
    cfg, tensors = catalog_model("qwen3-30b-a3b:Q4_0:Q8_0")
    devices, rates = load_rig("h200-rig")
    host = sum(t.nbytes for n, t in tensors.items() if "_exps." in n)
    for ub in (512, 4096):
        p = plan_placement(tensors, cfg, options_from_argv(["-ngl", "99", "-ot", "exps=CPU", "-ub", str(ub),
                                                             "-b", "4096"]), devices)
        pred = predict(p, rates)
        assert len(pred.uploaded_layers) == cfg.n_layer and pred.pp_bound.limit == "PCIe CUDA0"
        # a layer's upload, a layer ahead, hides its GPU compute; attention and the crossings come on top
        assert pred.pp == pytest.approx(ub * rates.h2d_bw["CUDA0"] / host, rel=0.10)
        assert pred.pp < ub * rates.h2d_bw["CUDA0"] / host and pred.pp_limit == "PCIe uploads"
        no_up = predict(plan_placement(tensors, cfg, p.opts.replace(op_offload=False), devices), rates)
        assert not no_up.uploaded_layers and no_up.pp < pred.pp and no_up.pp_bound.limit.startswith("CPU")
    # decode: about 1.02 GB of active experts per token over 95 GB/s, the GPU side and crossings small
    assert _active_expert_bytes(tensors, cfg) == pytest.approx(1.02e9, rel=0.02)
    assert pred.tg == pytest.approx(rates.ram_read_bw / _active_expert_bytes(tensors, cfg), rel=0.15)
    # on issue 521's rig the planner's upload decision per ubatch and link equals the hand calculation (the CPU
    # at its measured efficiency vs PCIe + GPU); at -ub 4096 it pays on a 5090 (gen5 x8) and the A6000 (gen4 x4)
    cfg, tensors = catalog_model("deepseek-r1")
    devices, rates = load_rig("panchovix-7gpu")
    layer = [t for n, t in tensors.items() if n.startswith("blk.30.") and "_exps." in n]
    nbytes, params = sum(t.nbytes for t in layer), sum(t.n_elements for t in layer)
    for ub, gpu, ts in ((512, "CUDA0", "62,0,0,0,0,0,0"), (512, "CUDA6", "0,0,0,0,0,0,62"),
                        (4096, "CUDA0", "62,0,0,0,0,0,0"), (4096, "CUDA6", "0,0,0,0,0,0,62")):
        from hybridmoe.perf.roofline import (
            CPU_GEMM_EFFICIENCY,
            CPU_STREAM_EFFICIENCY,
            touched_fraction,
        )
        cpu_s = max(2 * params * cfg.n_expert_used / cfg.n_expert * ub / (CPU_GEMM_EFFICIENCY * rates.cpu_bf16_flops),
                    nbytes * touched_fraction(ub, cfg.n_expert, cfg.n_expert_used)
                    / (CPU_STREAM_EFFICIENCY * rates.ram_read_bw))
        up_s = nbytes / rates.h2d(gpu) + 2 * params * cfg.n_expert_used / cfg.n_expert * ub / rates.flops(gpu)
        p = plan_placement(tensors, cfg, options_from_argv(["-ngl", "99", "-ts", ts, "-ot", "exps=CPU", "-ub",
                                                             str(ub), "-b", "4096"]), devices)
        pred = predict(p, rates)
        assert (30 in pred.uploaded_layers) == (up_s < cpu_s), (ub, gpu, up_s, cpu_s)
        assert up_s < cpu_s or ub == 512                  # at -ub 4096 the upload pays on every link here


def test_split_gate_up_costs_a_crossing(dsr1):
    """Issue 521: gate on the GPU, up/down in RAM. Here the split costs one more crossing per token (the gate
    output moves to down's device) and saves the gate's bytes from RAM."""
    cfg, tensors = dsr1
    devices, rates = load_rig("panchovix-7gpu")
    cpu = plan_placement(tensors, cfg, options_from_argv(["-ngl", "99", "-ts", "62,0,0,0,0,0,0", "-ot",
                                                          "exps=CPU"]), devices)
    split = plan_placement(tensors, cfg, options_from_argv(["-ngl", "99", "-ts", "62,0,0,0,0,0,0", "-ot",
                                                            r"blk\.35\.ffn_gate_exps=CUDA0", "-ot", "exps=CPU"]),
                           devices)
    a, b = predict(cpu, rates), predict(split, rates)
    assert b.crossings == a.crossings + 1
    one = rates.sync("CUDA0") / 2 + cfg.n_embd * 4 / rates.h2d("CUDA0")
    gate = tensors["blk.35.ffn_gate_exps.weight"].nbytes * cfg.n_expert_used / cfg.n_expert
    saved = gate / rates.ram_read_bw - gate / rates.read_bw("CUDA0")
    assert 1 / b.tg - 1 / a.tg == pytest.approx(one - saved, rel=0.01)


# --- the command ----------------------------------------------------------------------------------

def run_plan(argv, capsys):
    args = plan_cmd.setup_arg_parser().parse_args(argv)
    rc = plan_cmd.main(args)
    return rc, capsys.readouterr()


def test_plan_suggest_prints_runnable_flags(capsys):
    model = ["-m", "catalog:deepseek-r1", "--rig", "panchovix-7gpu"]
    rc, out = run_plan(model + ["--suggest"], capsys)
    assert rc == 0
    text = out.out
    assert "rig panchovix-7gpu" in text and "spec" in text
    heads = re.findall(r"^#\d+ (.+?): TG ([\d.]+) t/s, PP (\d+) t/s", text, re.M)
    flag_lines = [ln.strip() for ln in text.splitlines() if ln.startswith("  -ngl ")]
    assert heads and len(heads) == len(flag_lines)
    for (label, tg, pp), flags in zip(heads, flag_lines):
        rc2, out2 = run_plan(model + shlex.split(flags) + ["-p", "4096"], capsys)   # --suggest predicts pp4096
        assert rc2 == 0, out2.out[-400:]                      # fits
        m = re.search(r"^predicted \(roofline: no calibrated costs, rates from rig panchovix-7gpu\): TG ([\d.]+) t/s.*PP (\d+) t/s",
                      out2.out, re.M)
        assert m and (m[1], m[2]) == (tg, pp)
        for dev in ("CUDA0", "CUDA6"):
            assert re.search(rf"^{dev} \(fake\) .* fits$", out2.out, re.M)


def test_plan_suggest_json_and_notes(capsys):
    rc, out = run_plan(["-m", "catalog:qwen3-235b-a22b", "--rig", "mtcl-4gpu", "--suggest", "--objective", "pp",
                        "--json", "-ngl", "99", "--top", "2"], capsys)
    assert rc == 0 and "chooses -ngl itself" in out.err
    doc = json.loads(out.out)
    assert doc["rig"] == "mtcl-4gpu" and doc["objective"] == "pp" and len(doc["suggestions"]) == 2
    s = doc["suggestions"][0]
    assert s["label"] == "best PP" and s["argv"] == shlex.split(s["flags"])
    assert s["predicted"]["pp_ts"] > 0 and all(d["total"] <= d["free"] for d in s["devices"][1:])


def test_plan_predicted_line_needs_rates(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HYBRIDMOE_CACHE", str(tmp_path))
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "2x24GiB")
    argv = ["-m", "catalog:qwen3-30b-a3b", "-ngl", "99", "-ot", "exps=CPU"]
    rc, out = run_plan(argv, capsys)
    assert rc == 0 and "predicted" not in out.out                    # no calibration, no rig: as before
    with pytest.raises(HybridMoeError, match="calibrate"):
        run_plan(argv + ["--suggest"], capsys)
    import torch
    save_rates(Rates(ram_read_bw=50e9, cpu_bf16_flops=1e12, threads=torch.get_num_threads(), host="test"))
    rc, out = run_plan(argv, capsys)
    assert rc == 0 and "predicted (roofline: no calibrated costs, rates from this machine's calibration" in out.out
    rc, out = run_plan(argv + ["--json"], capsys)
    doc = json.loads(out.out)
    assert doc["predicted"]["tg_ts"] > 0 and doc["rig"] is None
    rc, out = run_plan(argv + ["--suggest"], capsys)          # fake GPUs with this machine's rates
    assert rc == 0 and "#1 best TG" in out.out


def test_decode_share_balances_the_cpu_and_the_bus():
    """How many of a layer's k CPU experts the GPU takes over the bus in a decode step: more on a faster link
    or slower RAM, none where the link is far slower, never all k; the H200 VM's rates give 2 of 8 for the
    Qwen3-30B-A3B expert (2 beat 3 and 0 there: docs/benchmarks.md, "2026-11-25 ...: the decode share")."""
    from hybridmoe.perf.roofline import decode_share
    e = 3 * 768 * 1152                                  # gate, up, down of one Q4_0 expert, H 2048, F 768

    def share(ram, h2d, k=8):
        return decode_share(k, e, Rates(ram_read_bw=ram * 1e9, cpu_bf16_flops=1e12, threads=16,
                                        h2d_bw={"CUDA0": h2d * 1e9}), "CUDA0")
    assert share(101.5, 55.3) == 2
    shares = [share(ram, 55.0) for ram in (200, 100, 60, 30)]
    assert shares == sorted(shares) and shares[0] < shares[-1] <= 7
    assert share(100, 1) == 0 and share(1, 1000) == 7 and share(100, 55, k=1) == 0
    assert decode_share(8, e, None, "CUDA0") == share(80, 40)          # uncalibrated: half the RAM's rate


def test_batch_share_fraction_balances_both_sides():
    """A batch's decode share: the fraction of a layer's distinct experts whose copy over the bus and run on the
    GPU take as long as the CPU's reading of the rest; larger on a faster link or slower RAM, below one half on
    the H100 VM's rates (its bus gives a batch's many copies less than its H2D rate)."""
    from hybridmoe.perf import roofline as R

    def rates(ram, h2d):
        return Rates(ram_read_bw=ram * 1e9, cpu_bf16_flops=1e12, threads=16, h2d_bw={"CUDA0": h2d * 1e9})
    f = R.batch_share_fraction(rates(100, 55), "CUDA0")
    assert 0.2 < f < 0.35
    cpu = (1 - f) / (R.SHARE_CPU_EFFICIENCY * 100e9)
    gpu = f * (1 / (R.SHARE_BATCH_BUS_EFFICIENCY * 55e9) + 1 / R.SHARE_GPU_KERNEL_BW)
    assert abs(cpu - gpu) < 1e-6 * cpu
    fs = [R.batch_share_fraction(rates(ram, 55), "CUDA0") for ram in (200, 100, 50)]
    assert fs == sorted(fs) and R.batch_share_fraction(rates(100, 5), "CUDA0") < 0.05
    assert R.batch_share_fraction(None, "CUDA0") == R.batch_share_fraction(rates(80, 40), "CUDA0")


def test_decode_share_gives_more_to_the_gpu_where_the_cpu_kernel_is_slow():
    """A type whose CPU kernel is bound by its decoding (its one-token rate under SHARE_COMPUTE_BOUND of the RAM's)
    leaves more of a layer's experts to the GPU, in one token's share and in a batch's; a memory-bound kernel's
    rate (Q4_0's) changes nothing."""
    from hybridmoe.perf import roofline as R
    r = Rates(ram_read_bw=100e9, cpu_bf16_flops=1e12, threads=16, h2d_bw={"CUDA0": 55e9})
    e = 3 * 768 * 2048 * 9 // 32                        # one IQ2_KT expert of the 30B shape
    base = R.decode_share(8, e, r, "CUDA0")
    assert R.decode_share(8, e, r, "CUDA0", kernel_bw=82e9) == base
    assert R.share_cpu_rate(100e9, 82e9) == R.share_cpu_rate(100e9) == R.SHARE_CPU_EFFICIENCY * 100e9
    slow = R.decode_share(8, e, r, "CUDA0", kernel_bw=27e9)
    assert base < slow <= 7 and R.share_cpu_rate(100e9, 27e9) < 0.35 * 100e9
    assert R.batch_share_fraction(r, "CUDA0", 27e9) > R.batch_share_fraction(r, "CUDA0", 82e9) + 0.2


def test_decode_share_override(monkeypatch):
    """HYBRIDMOE_DECODE_SHARE forces the count (never all k); anything but a count is a clear error."""
    from hybridmoe.runtime.steps.gpu_decode import forced_share
    monkeypatch.delenv("HYBRIDMOE_DECODE_SHARE", raising=False)
    assert forced_share(8) is None
    for value, want in (("0", 0), ("3", 3), (" 2 ", 2), ("99", 7)):
        monkeypatch.setenv("HYBRIDMOE_DECODE_SHARE", value)
        assert forced_share(8) == want
    for bad in ("two", "-1", "1.5"):
        monkeypatch.setenv("HYBRIDMOE_DECODE_SHARE", bad)
        with pytest.raises(HybridMoeError, match="HYBRIDMOE_DECODE_SHARE"):
            forced_share(8)


def test_prediction_adds_the_decode_share_where_it_runs(monkeypatch):
    """One GPU with the experts in pinned host memory: the predicted TG is the decode share's, the CPU-expert
    layers' active bytes leaving RAM by both paths (k - g by the CPU at its share of the RAM's rate, g over
    PCIe and the GPU's kernels), so by hand from the same rates. No share with --no-op-offload (no pinned
    arena), with every expert on the GPU, or where HYBRIDMOE_DECODE_SHARE=0."""
    from hybridmoe.perf.roofline import SHARE_BUS_EFFICIENCY, SHARE_CPU_EFFICIENCY, SHARE_GPU_KERNEL_BW, decode_share
    cfg, tensors = catalog_model("qwen3-30b-a3b")
    devices, rates = load_rig("h200-rig")
    p = plan_placement(tensors, cfg, options_from_argv(["-ngl", "99", "-ot", "exps=CPU"]), devices)
    pred = predict(p, rates)
    g, k = pred.share
    e = _active_expert_bytes(tensors, cfg) / cfg.n_expert_used / cfg.n_layer       # one expert of one layer
    assert g == decode_share(k, e, rates, "CUDA0") and 0 < g < k
    cpu = (k - g) * e / (SHARE_CPU_EFFICIENCY * rates.ram_read_bw)
    gpu = g * e / (SHARE_BUS_EFFICIENCY * rates.h2d("CUDA0")) + g * e / SHARE_GPU_KERNEL_BW
    assert pred.tg_terms["CPU experts"] / pred.n_gen == pytest.approx(cfg.n_layer * cpu, rel=1e-6)
    assert pred.tg_terms.get("decode share (GPU side longer)", 0) / pred.n_gen == pytest.approx(
        cfg.n_layer * max(gpu - cpu, 0), rel=1e-6, abs=1e-12)
    assert f"decode share: {g} of {k} experts over PCIe" in pred.line()
    monkeypatch.setenv("HYBRIDMOE_DECODE_SHARE", "0")
    no_share = predict(p, rates)
    monkeypatch.delenv("HYBRIDMOE_DECODE_SHARE")
    assert no_share.share is None and no_share.tg < pred.tg
    off = plan_placement(tensors, cfg, options_from_argv(["-ngl", "99", "-ot", "exps=CPU", "--no-op-offload"]), devices)
    assert predict(off, rates).share is None
    gpu_only = plan_placement(tensors, cfg, options_from_argv(["-ngl", "99"]), devices)
    assert predict(gpu_only, rates).share is None


def test_calibrated_costs_report_their_units():
    """calibrate's report: rates in G.../s (gpt-oss's own oai_* ones too), times in us, factors bare."""
    from hybridmoe.perf.costs import format_costs
    line = format_costs({"CUDA0": {"moe_flops": 5.4e14, "oai_moe_flops": 2.04e14, "pageable_h2d_bw": 8.5e9,
                                   "oai_prompt_layer_s": 9.05e-4, "upload_overlap": 0.14}})[0]
    assert "moe_flops 540000.0 GFLOP/s" in line and "oai_moe_flops 204000.0 GFLOP/s" in line
    assert "pageable_h2d_bw 8.5 GB/s" in line and "oai_prompt_layer_s 905.0 us" in line
    assert "upload_overlap 0.14" in line
