"""The calibrated cost model (issue 30): the step kinds and uploads mirror the runtime's rules, each calibrated
cost enters its term, `calibrate` measures the costs and its fit reproduces what it timed, `plan --check` runs
bench's tests beside the prediction (synth:tiny, all on the CPU; no timing asserts), and the seeds' rigs answer
discussion 532."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import hybridmoe
from hybridmoe.commands import plan as plan_cmd
from hybridmoe.models.catalog import catalog_model
from hybridmoe.perf.costs import CPU_KEYS, Costs, floor_or_scale
from hybridmoe.perf.rigs import load_rig, read_rig, rig_names
from hybridmoe.placement.core import plan_placement
from hybridmoe.placement.planner import options_from_argv
from hybridmoe.placement.predict import predict

GiB = 1 << 30


def run_plan(argv, capsys):
    args = plan_cmd.setup_arg_parser().parse_args(argv)
    rc = plan_cmd.main(args)
    return rc, capsys.readouterr()


@pytest.fixture(scope="module")
def qwen30():
    return catalog_model("qwen3-30b-a3b:Q4_0:Q8_0")


def _plan(model, argv, rig="h200-rig"):
    cfg, tensors = model
    devices, rates = load_rig(rig)
    return plan_placement(tensors, cfg, options_from_argv(argv), devices), rates


# --- the runtime's rules, mirrored -----------------------------------------------------------------

@pytest.mark.parametrize("argv, decode, prompt", [
    (["-ngl", "99"], "graph", "graph"),                              # StaticDecoder, StaticPrefill
    (["-ngl", "99", "-ot", "exps=CPU"], "graph", "eager"),           # hand-offs in decode, uploads in prompts
    (["-ngl", "99", "--n-cpu-moe", "24"], "graph", "eager"),
    (["-ngl", "0"], "cpu", "eager"),                                  # CpuDecoder; a GPU may take a prompt's ops
    (["-ngl", "0", "--no-op-offload"], "cpu", "cpu"),                # CpuDecoder both ways
    (["-ngl", "30"], "eager", "eager"),                              # attention of 18 layers on the CPU
    (["-ngl", "99", "-ctk", "q8_0", "-ctv", "q8_0"], "eager", "eager"),
])
def test_step_kinds_as_the_runtime_builds_them(qwen30, argv, decode, prompt):
    p, rates = _plan(qwen30, argv)
    pred = predict(p, rates)
    assert (pred.decode_kind, pred.prompt_kind) == (decode, prompt)
    assert pred.tg == pytest.approx(pred.n_gen / sum(pred.tg_terms.values()))
    assert pred.pp == pytest.approx(pred.n_prompt / sum(pred.pp_terms.values()))
    assert predict(p, rates, graphs=False).decode_kind == "eager"     # --no-graphs: no static step at all


@pytest.mark.parametrize("argv, decode", [(["-ngl", "99"], "graph"), (["-ngl", "99", "-ot", "exps=CPU"], "graph"),
                                          (["-ngl", "0", "--no-op-offload"], "cpu"), (["-ngl", "10"], "eager")])
def test_gpt_oss_step_kinds(argv, decode):
    """gpt-oss: its decode step on one GPU (runtime/steps/gpu_decode_oai.py; prompts captured with every weight
    there, else eager) or all on the CPU (the C steps, prompts too); with host experts the polled hand-off (no sync
    a layer) and the decode share as the step counts it."""
    p, rates = _plan(catalog_model("gpt-oss-20b"), argv)
    pred = predict(p, rates)
    prompt = "cpu" if decode == "cpu" else "graph" if argv == ["-ngl", "99"] else "eager"
    assert (pred.decode_kind, pred.prompt_kind) == (decode, prompt)
    if "exps=CPU" in argv:
        assert rates.sync("CUDA0") > 0 and pred.share is not None and pred.share[1] == p.cfg.n_expert_used
        handoff = Costs(rates).gpu("CUDA0", "handoff_s")
        assert pred.tg_terms["hand-offs"] / pred.n_gen == pytest.approx(p.cfg.n_layer * handoff, rel=1e-6)


def test_check_names_a_subclassed_step_by_its_base(monkeypatch):
    """plan --check's "run" column: gpt-oss's captured decode step (a StaticDecoder subclass) is a graph step."""
    from hybridmoe.commands.plan_check import _step_kind
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    m = hybridmoe.load("synth:tiny-gpt-oss", ctx_size=64, n_gpu_layers=99)
    kv = m.new_cache(64)
    m.forward(torch.tensor([1, 2, 3]), 0, kv)
    m.forward(torch.tensor([4]), 3, kv)
    assert type(m.static_step("decode")).__name__ == "GptOssStaticDecoder" and _step_kind(m, "decode") == "graph"


def test_uploads_follow_the_scheduler(qwen30):
    """-ot exps=CPU at -ub 512: every layer's experts uploaded, each a layer ahead (so the whole tensor, 16.3 GB a
    ubatch); a last ubatch under 32 tokens never uploads (OFFLOAD_MIN_BATCH): the CPU computes its experts;
    --no-op-offload: never."""
    cfg, tensors = qwen30
    p, rates = _plan(qwen30, ["-ngl", "99", "-ot", "exps=CPU"])
    host = sum(t.nbytes for n, t in tensors.items() if "_exps." in n)
    pred = predict(p, rates, n_prompt=512)
    assert pred.uploaded_layers == list(range(cfg.n_layer)) and not pred.only_active
    assert pred.uploaded_bytes == pytest.approx(host)
    assert "CPU experts" not in pred.pp_terms and pred.pp_limit == "PCIe uploads"
    tail = predict(p, rates, n_prompt=520)                          # 512 + 8 tokens
    assert tail.uploaded_bytes == pytest.approx(host) and tail.pp_terms["CPU experts"] > 0
    off, _ = _plan(qwen30, ["-ngl", "99", "-ot", "exps=CPU", "--no-op-offload"])
    assert predict(off, rates, n_prompt=512).uploaded_bytes == 0


def _with_costs(rates, cpu=None, gpu=None):
    costs = {"cpu": dict(cpu or {})}
    if gpu:
        costs["CUDA0"] = dict(gpu)
    return dataclasses.replace(rates, costs=costs)


def test_each_calibrated_cost_enters_its_term(qwen30, monkeypatch):
    """Per layer, per hand-off, per call, per step and per ubatch: each cost times how often the step pays it."""
    monkeypatch.setenv("HYBRIDMOE_DECODE_SHARE", "0")
    cfg, _ = qwen30
    p, rates = _plan(qwen30, ["-ngl", "99", "--n-cpu-moe", "24"])
    base = predict(p, rates, n_prompt=1024, n_gen=64)
    gpu = dict(decode_layer_s=30e-6, decode_token_s=400e-6, handoff_s=50e-6, eager_prompt_layer_s=200e-6,
               eager_ubatch_s=2e-3, upload_layer_s=100e-6, upload_overlap=0.5, moe_flops=100e12)
    cal = predict(p, _with_costs(rates, dict(call_s=10e-6, stream_bw=70e9), gpu), n_prompt=1024, n_gen=64)
    n, L, ubatches = 64, cfg.n_layer, 2
    tg = cal.tg_terms
    assert tg["GPU layer floors"] == pytest.approx(n * (L - 24) * 30e-6)     # CPU-expert layers: in the hand-off
    assert tg["step overhead"] == pytest.approx(n * 400e-6)
    assert tg["hand-offs"] == pytest.approx(n * 24 * 50e-6)
    assert tg["CPU kernel calls"] == pytest.approx(n * 24 * 10e-6)
    assert tg["CPU experts"] == pytest.approx(base.tg_terms["CPU experts"] * rates.ram_read_bw / 70e9)
    pp = cal.pp_terms
    assert pp["layer floors (eager)"] == pytest.approx(ubatches * L * 200e-6)
    assert pp["ubatch overhead (eager)"] == pytest.approx(ubatches * 2e-3)
    assert pp["upload overhead"] == pytest.approx(ubatches * 24 * 100e-6)
    # each uploaded layer (a layer ahead): its upload less half of the smaller of the upload and the layer's
    # other work (its floors, attention, matrices and experts: alike in every layer, so 24/L of their terms)
    layer = [t for n, t in qwen30[1].items() if n.startswith("blk.0.") and "_exps." in n]
    u = sum(t.nbytes for t in layer) / rates.h2d("CUDA0")
    comp = 2.0 * sum(t.n_elements for t in layer) * cfg.n_expert_used / cfg.n_expert * 512 / 100e12
    rest = 24 / L * (pp["layer floors (eager)"] + pp["GPU attention"] + pp["GPU compute"]) + ubatches * 24 * comp
    assert rest < ubatches * 24 * u                   # the upload is the longer: what hides is the rest
    assert pp["PCIe uploads"] == pytest.approx(ubatches * 24 * u - 0.5 * rest)
    assert pp["GPU experts"] == pytest.approx(ubatches * L * comp)
    assert cal.tg < base.tg and cal.pp < base.pp and cal.calibrated and not base.calibrated


def test_ngl0_prompt_with_a_gpu_takes_the_offload_costs(qwen30):
    """-ngl 0 with a GPU runs prompts on the eager path (norms, RoPE and SDPA attention on the CPU, matrices and
    experts uploaded): its own calibrated floor and attention rate, not the C prompt step's; a calibration from
    before those were measured falls back to the C step's; --no-op-offload runs the C step."""
    cfg, _ = qwen30
    L = cfg.n_layer
    cpu = dict(prompt_layer_s=7e-3, prompt_ubatch_s=9e-3, attn_flops=0.4e12)
    gpu = dict(offload_prompt_layer_s=20e-3, offload_ubatch_s=5e-3, offload_attn_flops=2e12)
    attn = 4.0 * cfg.n_head * cfg.head_dim * 512 * 513 / 2                  # one layer, pp512 at depth 0
    p, rates = _plan(qwen30, ["-ngl", "0"])
    pp = predict(p, _with_costs(rates, cpu, gpu), n_prompt=512).pp_terms
    assert pp["CPU layer floors (offload)"] == pytest.approx(L * 20e-3)
    assert pp["CPU attention (eager)"] == pytest.approx(L * attn / 2e12)
    assert pp["ubatch overhead (offload)"] == pytest.approx(5e-3) and "CPU layer floors" not in pp
    old = predict(p, _with_costs(rates, cpu, {"eager_ubatch_s": 1e-3}), n_prompt=512).pp_terms
    assert old["CPU layer floors (offload)"] == pytest.approx(L * 7e-3)
    assert old["CPU attention (eager)"] == pytest.approx(L * attn / 0.4e12)
    off, _ = _plan(qwen30, ["-ngl", "0", "--no-op-offload"])
    c = predict(off, _with_costs(rates, cpu, gpu), n_prompt=512)
    assert c.prompt_kind == "cpu" and c.pp_terms["CPU layer floors"] == pytest.approx(L * 7e-3)
    part, _ = _plan(qwen30, ["-ngl", "30"])                               # 18 layers' attention in RAM
    pp = predict(part, _with_costs(rates, cpu, gpu), n_prompt=512).pp_terms
    assert pp["CPU layer floors (offload)"] == pytest.approx(18 * 20e-3) and "ubatch overhead (offload)" not in pp


def test_floor_or_scale():
    assert floor_or_scale(3.0, 2.0) == (1.0, 1.0)
    assert floor_or_scale(1.0, 2.0) == (0.0, 0.5)
    assert floor_or_scale(1.0, 0.0) == (1.0, 1.0)
    assert floor_or_scale(-1e-4, 2.0) == floor_or_scale(0.0, 2.0) == (0.0, 1.0)   # a noisy fit: the model stands


def test_costs_fall_back_to_the_roofline_and_share_by_gpu_name():
    _, rates = load_rig("h200-rig")
    c = Costs(rates)
    assert not c.calibrated and c.cpu("stream_bw") == rates.ram_read_bw and c.cpu("prompt_scale") == 1.0
    assert c.gpu("CUDA0", "moe_flops") == rates.flops("CUDA0") and c.gpu("CUDA0", "upload_overlap") == 1.0
    assert c.gpu("CUDA0", "handoff_s") == rates.sync("CUDA0")
    r2 = dataclasses.replace(rates, gpu_names={"CUDA0": "X", "CUDA1": "X"}, costs={"CUDA0": {"handoff_s": 1e-5}})
    assert Costs(r2).gpu("CUDA1", "handoff_s") == 1e-5                  # same GPU model: same costs


# --- calibrate and plan --check, for real on the CPU ------------------------------------------------

@pytest.mark.slow
def test_calibrate_costs_then_plan_check(tmp_path, monkeypatch, capsys):
    """`calibrate --quick` measures every CPU cost (positive, the rates beside them) and its fit reproduces the
    per-layer difference it timed between its two calibration models; then `plan --check` on synth:tiny all
    on the CPU prints the measured tests beside the prediction, as text and as JSON."""
    monkeypatch.setenv("HYBRIDMOE_CACHE", str(tmp_path))
    from hybridmoe.commands import calibrate as cal_cmd
    from hybridmoe.perf.calibrate import load_cached
    args = cal_cmd.setup_arg_parser(__import__("argparse").ArgumentParser()).parse_args(["--quick", "--json"])
    assert cal_cmd.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    cpu = doc["costs"]["cpu"]
    assert set(CPU_KEYS) <= set(cpu)
    assert cpu["call_s"] > 0 and cpu["stream_bw"] > 1e8 and cpu["prompt_scale"] > 0
    assert cpu["decode_layer_s"] + cpu["decode_token_s"] > 0 and cpu["prompt_layer_s"] + cpu["prompt_ubatch_s"] > 0
    rates = load_cached()
    assert rates is not None and rates.costs["cpu"] == cpu
    # the fit's algebra: the calibration models, predicted with the fitted costs, differ as measured
    from hybridmoe.devices import list_devices
    from hybridmoe.formats.gguf import open_gguf
    from hybridmoe.models.catalog import config_for_planning
    info = rates.costs["_calibration"]
    preds = []
    for path in info["models"]:
        f = open_gguf(path)
        cfg = config_for_planning(f.metadata, path, f.tensors)
        p = plan_placement(dict(f.tensors), cfg, options_from_argv(["-ngl", "0"]), list_devices())
        preds.append(predict(p, rates, n_gen=info["decode_steps"]))
    m1, m2 = info["measured"]["cpu_decode_s"]
    if cpu["decode_layer_s"] > 0:                       # not clamped: the slope is the measured one
        assert 1 / preds[1].tg - 1 / preds[0].tg == pytest.approx(m2 - m1, rel=1e-6)
    # plan --check: text, then JSON
    argv = ["-m", "synth:tiny", "-ngl", "0", "--check", "-p", "32", "-n", "4", "-r", "1"]
    rc, out = run_plan(argv, capsys)
    assert rc == 0
    lines = out.out.splitlines()
    assert lines[0].startswith("plan --check: -m synth:tiny -ngl 0")
    assert any(ln.startswith("| pp32 | cpu / cpu |") for ln in lines)
    assert any(ln.startswith("| tg4 | cpu / cpu |") for ln in lines)
    assert any("CPU layer floors" in ln for ln in lines)
    rc, out = run_plan(argv + ["--json"], capsys)
    doc = json.loads(out.out)
    assert doc["calibrated"] and [t["test"] for t in doc["tests"]] == ["pp32", "tg4"]
    # the expert kernel's streaming rate probed now (calibrate's sweep), beside the calibration's
    assert doc["stream_bw"]["calibrated"] == cpu["stream_bw"] and doc["stream_bw"]["now"] > 1e8
    for t in doc["tests"]:
        assert t["step"] == {"predicted": "cpu", "measured": "cpu"}
        assert t["predicted_ts"] > 0 and t["measured_ts"] > 0 and t["ratio"] == pytest.approx(
            t["measured_ts"] / t["predicted_ts"])
        assert t["terms"] and all(v >= 0 for v in t["terms"].values())
        assert sum(t["terms"].values()) == pytest.approx(t["predicted_s"])
    assert doc["tests"][0]["uploaded_bytes"] == {"predicted": 0.0, "measured": 0.0}
    assert doc["tests"][1]["decode_share"] == {"predicted": 0, "measured": 0}


def test_plan_check_refuses_what_it_cannot_measure(capsys, tmp_path, monkeypatch):
    from hybridmoe.errors import HybridMoeError
    monkeypatch.setenv("HYBRIDMOE_CACHE", str(tmp_path))
    with pytest.raises(HybridMoeError, match="drop --rig"):
        run_plan(["-m", "synth:tiny", "--rig", "h200-rig", "--check"], capsys)
    with pytest.raises(HybridMoeError, match="not a catalog entry"):
        run_plan(["-m", "catalog:qwen3-30b-a3b", "--check"], capsys)
    with pytest.raises(HybridMoeError, match="calibrate"):
        run_plan(["-m", "synth:tiny", "-ngl", "0", "--check"], capsys)
    with pytest.raises(HybridMoeError, match="without --suggest"):
        run_plan(["-m", "synth:tiny", "--suggest", "--check"], capsys)


# --- the seeds' rigs ----------------------------------------------------------------------------------

def test_seed_rigs_load():
    assert {"mtcl-4gpu", "desktop-24gb"} <= set(rig_names())
    for name in rig_names():
        rig = read_rig(name)
        assert rig.devices[0].name == "CPU" and rig.rates.ram_read_bw > 0 and rig.source
    mtcl = read_rig("mtcl-4gpu")
    names = [mtcl.rates.gpu_names[f"CUDA{i}"] for i in range(4)]
    assert names == ["NVIDIA GeForce RTX 5090", "NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090",
                     "NVIDIA GeForce RTX 5090"]                         # CUDA_VISIBLE_DEVICES=2,1,0,3
    assert round(mtcl.devices[0].total_bytes / GiB) == 358 and mtcl.rates.ram_read_bw == 307.2e9   # 8 x 48 GB, 8ch 4800
    desk = read_rig("desktop-24gb")
    assert len(desk.devices) == 2 and desk.devices[1].total_bytes == 24 * GiB
    assert desk.rates.ram_read_bw == 96e9


def test_plan_rig_answers_discussion_532(capsys):
    """DeepSeek-R1 with IQ4_KS_R4 experts on 2x RTX 5090 + 2x RTX 4090 and 384 GB DDR5: suggestions that fit,
    experts kept in RAM as whole layers, and a predicted speed limited by the CPU's experts."""
    rc, out = run_plan(["-m", "catalog:deepseek-r1:IQ4_KS_R4", "--rig", "mtcl-4gpu", "--suggest", "--top", "3",
                        "--json"], capsys)
    assert rc == 0
    doc = json.loads(out.out)
    sugs = doc["suggestions"]
    assert doc["rig"] == "mtcl-4gpu" and 1 <= len(sugs) <= 3
    for s in sugs:
        assert all(d["total"] <= d["free"] for d in s["devices"])
        assert s["predicted"]["tg_ts"] > 0 and s["predicted"]["pp_ts"] > 0
    first = sugs[0]["predicted"]
    assert first["tg_limit"] == "CPU experts" and first["n_prompt"] == 4096
    _, tensors = catalog_model("deepseek-r1:IQ4_KS_R4")
    exps = {n.split(".")[2]: t.qtype.name for n, t in tensors.items() if "_exps." in n}
    assert exps == {"ffn_gate_exps": "IQ4_KS_R4", "ffn_up_exps": "IQ4_KS_R4", "ffn_down_exps": "IQ5_KS_R4"}
    rc, out = run_plan(["-m", "catalog:deepseek-r1:IQ4_KS_R4", "--rig", "desktop-24gb", "--suggest", "--top", "1"],
                       capsys)
    assert rc == 0 and "#1 best TG" in out.out and "paged from disk" in out.out      # 340 GiB in 89 GiB of RAM


def test_rig_costs_enter_the_prediction(tmp_path, qwen30):
    """A rig file with the costs `calibrate --json` prints predicts with them; malformed costs are a clear error."""
    from hybridmoe.errors import HybridMoeError
    with open(read_rig("h200-rig").path, encoding="utf-8") as f:
        doc = json.load(f)
    doc["costs"] = {"cpu": {"call_s": 1e-5}, "CUDA0": {"handoff_s": 1e-4, "decode_layer_s": 5e-5}}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(doc))
    rig = read_rig(str(path))
    assert rig.rates.costs["CUDA0"]["handoff_s"] == 1e-4
    cfg, tensors = qwen30
    p = plan_placement(tensors, cfg, options_from_argv(["-ngl", "99", "-ot", "exps=CPU"]), rig.devices)
    pred = predict(p, rig.rates, n_gen=16)
    assert pred.calibrated and pred.tg_terms["hand-offs"] == pytest.approx(16 * cfg.n_layer * 1e-4)
    doc["costs"] = {"cpu": 3}
    path.write_text(json.dumps(doc))
    with pytest.raises(HybridMoeError, match="costs must map"):
        read_rig(str(path))


@pytest.mark.slow
def test_gpu_cost_fits_run_on_fake_gpus(monkeypatch):
    """The GPU half of the calibration on a fake GPU (CPU-backed: the placement logic and fits run, no GPU kernel,
    so the values mean nothing): every GPU cost is fitted, finite and non-negative, the overlap a share, and the
    upload fit runs where the rates say uploads pay."""
    import math

    from hybridmoe.commands.calibrate_costs import measure_costs
    from hybridmoe.perf.costs import GPU_KEYS
    from hybridmoe.perf.rates import Rates
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1")          # nothing is saved: the session's cache holds the models
    rates = Rates(ram_read_bw=20e9, cpu_bf16_flops=0.3e12, threads=2, h2d_bw={"CUDA0": 20e9},
                  gpu_bw={"CUDA0": 200e9}, gpu_bf16_flops={"CUDA0": 50e12}, sync_latency={"CUDA0": 2e-5},
                  gpu_names={"CUDA0": "fake"})
    costs = measure_costs(rates, quick=True, gpus=[0])
    g = costs["CUDA0"]
    assert set(g) == set(GPU_KEYS)
    assert all(math.isfinite(v) and v >= 0 for v in g.values()) and 0 <= g["upload_overlap"] <= 1
    assert g["moe_flops"] > 0 and g["attn_flops"] > 0 and g["eager_attn_flops"] > 0
    measured = costs["_calibration"]["measured"]
    assert {"cpu_decode_s", "CUDA0_decode_layer_s", "CUDA0_handoff_decode_s"} <= set(measured)


def test_calibration_fits_recover_known_costs(monkeypatch):
    """The fitting algebra alone: with the runtime's timings replaced by predict() under known costs (fake GPU,
    quick calibration models), measure_costs gives those costs back: per-layer and per-step floors, the MoE and
    attention rates (gpt-oss's captured steps' own too), the hand-off, the upload overlap. The offloaded path's floor is small beside its prefetched
    upload here, so part of the upload hides behind it: subtracting the model without the floor gives it back
    at 0.4x."""
    from hybridmoe.commands import calibrate_costs as cc
    from hybridmoe.perf.rates import Rates
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1")
    rates = Rates(ram_read_bw=20e9, cpu_bf16_flops=0.3e12, threads=2, h2d_bw={"CUDA0": 20e9},
                  gpu_bw={"CUDA0": 200e9}, gpu_bf16_flops={"CUDA0": 50e12}, sync_latency={"CUDA0": 2e-5},
                  gpu_names={"CUDA0": "fake"}, cpu_moe_flops={"32": 0.05e12, "512": 0.2e12})
    true = {"cpu": {"call_s": 9e-6, "stream_bw": 15e9, "decode_layer_s": 40e-6, "decode_token_s": 300e-6,
                    "prompt_layer_s": 2e-3, "prompt_scale": 1.0, "prompt_ubatch_s": 1e-3, "attn_flops": 0.1e12},
            "CUDA0": {"decode_layer_s": 50e-6, "decode_token_s": 400e-6, "eager_decode_layer_s": 300e-6,
                      "eager_token_s": 2e-3, "oai_decode_layer_s": 150e-6, "oai_decode_token_s": 900e-6,
                      "oai_prompt_layer_s": 90e-6, "oai_moe_flops": 3e12, "oai_prompt_ubatch_s": 1.5e-3,
                      "oai_attn_flops": 1.5e12, "oai_eager_prompt_layer_s": 800e-6, "oai_eager_ubatch_s": 4e-3,
                      "oai_eager_attn_flops": 0.8e12,
                      "handoff_s": 70e-6, "prompt_layer_s": 60e-6, "moe_flops": 5e12,
                      "prompt_ubatch_s": 1e-3, "attn_flops": 2e12, "eager_prompt_layer_s": 500e-6,
                      "eager_ubatch_s": 3e-3, "eager_attn_flops": 1e12, "upload_overlap": 0.6,
                      "upload_layer_s": 0.0, "offload_prompt_layer_s": 10e-6, "offload_ubatch_s": 2e-3,
                      "offload_attn_flops": 0.2e12, "pageable_h2d_bw": 9e9, "d2h_bw": 6e9}}
    truth = dataclasses.replace(rates, costs=true)

    def tg(model, n, reps):
        return 1 / predict(model.placement, truth, n_gen=n, graphs=model.runtime.graphs).tg

    def pp(model, T, reps, depth=0):
        return T / predict(model.placement, truth, n_prompt=T, ubatch=T, n_depth=depth,
                           graphs=model.runtime.graphs).pp
    monkeypatch.setattr(cc, "_time_tg", tg)
    monkeypatch.setattr(cc, "_time_pp", pp)
    monkeypatch.setattr(cc, "kernel_costs", lambda quick: {"call_s": 9e-6, "stream_bw": 15e9})
    monkeypatch.setattr(cc, "link_costs", lambda *a, **k: {"pageable_h2d_bw": 9e9, "d2h_bw": 6e9})
    monkeypatch.setattr(cc, "cpu_attention_flops", lambda *a, **k: 0.2e12)
    got = cc.measure_costs(rates, quick=True, gpus=[0])
    for dev in ("cpu", "CUDA0"):
        for k, v in true[dev].items():
            assert got[dev][k] == pytest.approx(v, rel=1e-6, abs=1e-12), (dev, k)


def test_a_noisy_depth_zero_ubatch_is_timed_again():
    """calibrate's prompt pairs (_Fitter.pp_pair): a ubatch at depth 0 that reads slower a layer than the same
    ubatch after cached tokens was hit by noise, and is timed again (at most twice); the faster of its timings is
    kept, in the fit and in what calibrate records."""
    from hybridmoe.commands.calibrate_costs import _Fitter

    class Scripted(_Fitter):
        def __init__(self, slopes):
            self.measured, self.slopes = {}, dict(slopes)

        def pp(self, label, T, depth=0):
            sm = self.slopes[depth].pop(0)
            self.measured[f"{label}_{T}_d{depth}"] = (sm, 2 * sm)
            return sm, 0.0, 0.0, 0.0

    f = Scripted({0: [5.0, 2.0], 2048: [3.0]})                  # noisy, then timed again: the second kept
    a, b = f.pp_pair("x", 512, 2048)
    assert (a[0], b[0]) == (2.0, 3.0) and f.measured["x_512_d0"] == (2.0, 4.0) and not f.slopes[0]
    f = Scripted({0: [5.0, 6.0, 4.0], 2048: [3.0]})             # twice at most, the fastest kept
    a, _ = f.pp_pair("x", 512, 2048)
    assert a[0] == 4.0 and f.measured["x_512_d0"] == (4.0, 8.0) and not f.slopes[0]
    f = Scripted({0: [1.0], 2048: [3.0]})                       # in order: timed once
    assert f.pp_pair("x", 512, 2048)[0][0] == 1.0


@pytest.mark.slow
def test_calibration_models_have_layers_of_the_48_layer_stack():
    """calibrate's models (quick shape, 3 layers): random weights per layer, residual branches scaled as in a
    48-layer stack (synth:qwen3-30b-a3b's 0.02 / 48), and a prompt's ubatch routed to nearly every expert in every
    layer. (Layers sharing one tensor per shape concentrated the routing with depth, so the prompt costs fitted
    on them were those of a few busy experts.)"""
    import torch

    import hybridmoe
    from hybridmoe.commands.calibrate_costs import CALIB_DEPTH, calibration_model
    from hybridmoe.formats.gguf import open_gguf
    from hybridmoe.quant.dequant import dequantize
    from hybridmoe.quant.types import row_bytes
    path = calibration_model(3, quick=True)
    f = open_gguf(path)

    def values(name):
        info = f.tensors[name]
        rows = f.raw(info).reshape(-1, row_bytes(info.qtype, info.shape[-1]))
        return dequantize(rows, info.qtype, info.shape[-1]).reshape(-1)
    for short in ("ffn_up_exps", "attn_q", "ffn_gate_inp"):
        a, b = values(f"blk.0.{short}.weight"), values(f"blk.2.{short}.weight")
        assert not torch.equal(a, b), short
    rms = lambda t: float(t.pow(2).mean().sqrt())                         # noqa: E731
    assert rms(values("blk.1.attn_output.weight")) == pytest.approx(0.02 / CALIB_DEPTH, rel=0.25)
    assert rms(values("blk.1.ffn_down_exps.weight")) == pytest.approx(0.02 / CALIB_DEPTH, rel=0.25)
    assert rms(values("blk.1.attn_q.weight")) == pytest.approx(0.02, rel=0.25)
    model = hybridmoe.load(path, ctx_size=256, n_gpu_layers=0, check_fit=False)
    cfg = model.cfg
    tokens = torch.randint(0, cfg.n_vocab, (128,), generator=torch.Generator().manual_seed(11))
    model.runtime.graphs = False
    model.drop_steps()
    model.sched.routing = {}
    model.forward(tokens, 0, model.new_cache(160), all_logits=False)
    assert sorted(model.sched.routing) == [0, 1, 2]
    for layer, ids in model.sched.routing.items():
        counts = torch.bincount(ids.flatten(), minlength=cfg.n_expert)
        assert int((counts > 0).sum()) == cfg.n_expert, layer                   # 128 x 4 picks of 16 experts
        assert float(counts.max()) < 3 * float(counts.float().mean()), layer     # no expert takes most tokens


def test_offload_copies_mirror_the_scheduler(monkeypatch):
    """The activations a layer with its attention in RAM copies to and from the GPU that takes its matrices and
    experts (-ngl 0 with a GPU): predict.offload_copies against the copies the scheduler makes (fake GPU, every
    host op offloaded by -op all,1; 3 layers), byte for byte; plus the residual's one move onto the GPU."""
    import torch

    import hybridmoe
    from hybridmoe.commands.calibrate_costs import calibration_model
    from hybridmoe.placement.predict import offload_copies
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1")
    m = hybridmoe.load(calibration_model(3, quick=True), ctx_size=128, n_gpu_layers=0, check_fit=False)
    m.set_policy("all,1")
    m.runtime.graphs = False
    m.drop_steps()
    cfg, T = m.cfg, 64
    m.sched.stats.reset()
    m.forward(torch.randint(0, cfg.n_vocab, (T,)), 0, m.new_cache(128), all_logits=False)
    copies = m.sched.stats.copies
    up = down = syncs = 0
    for il in range(cfg.n_layer):
        u, d, s = offload_copies(cfg, T, il > 0, True, True)
        up, down, syncs = up + u, down + d, syncs + s
    assert copies[("CPU", "CUDA0")][1] == up + 4 * T * cfg.n_embd          # + layer 0's residual to the GPU
    assert copies[("CUDA0", "CPU")][1] == down
    assert copies[("CUDA0", "CPU")][0] == syncs - cfg.n_layer               # (the choice is not a Stats copy)
    # the residual stays on the GPU from layer 0's first add; without offloaded matrices only the experts'
    # rows go up, and the attention's output joins the residual there
    u, d, s = offload_copies(cfg, T, True, False, True)
    assert (u, d, s) == (4 * T * (2 * cfg.n_embd + 2 * cfg.n_expert_used), 4 * T * 2 * cfg.n_embd, 3)
    assert offload_copies(cfg, T, False, False, False) == (0, 0, 0)


def test_ngl0_prompt_terms_add_the_copies_at_their_rates(qwen30):
    """-ngl 0 at pp512 with a GPU: per layer the activations' copies at the calibrated pageable rates plus a sync
    per copy down, the host matrices uploaded at the pageable rate, and the token path's two crossings (the
    residual onto the GPU at layer 0, back to the head in RAM) instead of two a layer."""
    cfg, _ = qwen30
    L, T, H = cfg.n_layer, 512, cfg.n_embd
    p, rates = _plan(qwen30, ["-ngl", "0"], rig="h100-vm")
    gpu = dict(rates.costs["CUDA0"], pageable_h2d_bw=20e9, d2h_bw=10e9)
    r = dataclasses.replace(rates, costs=dict(rates.costs, CUDA0=gpu))
    pred = predict(p, r, n_prompt=T, ubatch=T)
    from hybridmoe.placement.predict import offload_copies
    u0, d0, s0 = offload_copies(cfg, T, False, True, True)
    u1, d1, s1 = offload_copies(cfg, T, True, True, True)
    sync = rates.sync("CUDA0")
    want = (u0 + (L - 1) * u1) / 20e9 + (d0 + (L - 1) * d1) / 10e9 + (s0 + (L - 1) * s1) * sync
    assert pred.pp_terms["activation copies (offload)"] == pytest.approx(want)
    assert (u1, d1, s1) == (4 * T * (3 * H + 32 * 128 + 16), 4 * T * (2 * H + 32 * 128 + 2 * 4 * 128), 4)
    dense = sum(t.nbytes for n, t in p.tensors.items() if n.startswith("blk.") and "_exps." not in n
                and len(t.shape) > 1)
    exps = sum(t.nbytes for n, t in p.tensors.items() if "_exps." in n)
    assert pred.uploaded_bytes == pytest.approx(dense + exps)
    assert pred.pp_terms["crossings"] == pytest.approx(2 * (sync / 2 + 4 * T * H / rates.h2d("CUDA0")))
    part, _ = _plan(qwen30, ["-ngl", "30"], rig="h100-vm")               # the first 18 layers' attention in RAM
    cp = predict(part, r, n_prompt=T, ubatch=T).pp_terms["activation copies (offload)"]
    assert cp == pytest.approx((u0 + 17 * u1) / 20e9 + (d0 + 17 * d1) / 10e9 + (s0 + 17 * s1) * sync)
    old = predict(p, rates, n_prompt=T, ubatch=T)                          # a calibration without the rates
    assert old.pp_terms["activation copies (offload)"] == pytest.approx(
        (u0 + (L - 1) * u1 + d0 + (L - 1) * d1) / rates.h2d("CUDA0") + (s0 + (L - 1) * s1) * sync)


def test_a_moved_ram_rate_scales_the_ram_bound_terms(qwen30):
    """plan --check predicts with the RAM read rate it probes (Rates.with_ram_read): the CPU decode step's weights,
    experts and KV cache (streamed from RAM) take 1/f the time at f times the rate; its fixed costs, the GPU's
    rates and the calibration itself do not move."""
    p, rates = _plan(qwen30, ["-ngl", "0", "--no-op-offload"], rig="h100-vm")
    now = rates.with_ram_read(1.25 * rates.ram_read_bw)
    assert now.ram_read_bw == pytest.approx(1.25 * rates.ram_read_bw)
    assert now.costs["cpu"]["stream_bw"] == pytest.approx(1.25 * rates.costs["cpu"]["stream_bw"])
    assert now.costs["CUDA0"] == rates.costs["CUDA0"] and now.h2d_bw == rates.h2d_bw
    assert rates.costs["cpu"]["stream_bw"] == read_rig("h100-vm").rates.costs["cpu"]["stream_bw"]   # a copy
    a, b = predict(p, rates, n_gen=128).tg_terms, predict(p, now, n_gen=128).tg_terms
    assert a.keys() == b.keys() and {"CPU weights", "CPU experts", "KV cache"} <= set(a)
    for k in a:
        moved = k in ("CPU weights", "CPU experts", "KV cache")
        assert b[k] == pytest.approx(a[k] / 1.25 if moved else a[k]), k
    # the kernel's streaming rate probed too: the C kernel's terms take that rate, not the torch.sum probe's
    probed = rates.with_ram_read(1.25 * rates.ram_read_bw, 0.8 * rates.costs["cpu"]["stream_bw"])
    assert probed.ram_read_bw == pytest.approx(1.25 * rates.ram_read_bw)
    assert probed.costs["cpu"]["stream_bw"] == pytest.approx(0.8 * rates.costs["cpu"]["stream_bw"])
    c = predict(p, probed, n_gen=128).tg_terms
    for k in a:
        moved = k in ("CPU weights", "CPU experts", "KV cache")
        assert c[k] == pytest.approx(a[k] / 0.8 if moved else a[k]), k
    # the decode share's count: the runtime picks it on its cached calibration, whatever the RAM reads now
    hy, _ = _plan(qwen30, ["-ngl", "99", "-ot", "exps=CPU"], rig="h100-vm")
    assert predict(hy, now).share != predict(hy, rates).share                      # 2 of 8 against 3 of 8
    assert predict(hy, now, share_rates=rates).share == predict(hy, rates).share
