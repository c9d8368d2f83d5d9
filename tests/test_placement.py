"""Placement: llama.cpp's -ngl/-ts/-ot/--cpu-moe semantics on catalog models, the seeds' command lines,
memory totals, fit checks with verified suggestions, validation messages, the plan/inspect/devices commands."""
from __future__ import annotations

import argparse
import json
import re
import shlex

import numpy as np
import pytest

from hybridmoe.commands import devices as devices_cmd
from hybridmoe.commands import inspect as inspect_cmd
from hybridmoe.commands import plan as plan_cmd
from hybridmoe.devices import FAKE_ENV, get_device, list_devices, parse_fake_gpus
from hybridmoe.errors import HybridMoeError, PlacementError
from hybridmoe.formats.names import layers_regex
from hybridmoe.models.catalog import (
    PlanConfig,
    catalog_model,
    deepseek2_shapes,
    with_types,
)
from hybridmoe.models.tensors import tensor_shapes
from hybridmoe.placement.core import (
    KV_TYPE_BYTES,
    PlacementOptions,
    add_placement_args,
    options_from_args,
    plan_placement,
)
from hybridmoe.placement.report import format_plan, placement_to_json
from hybridmoe.quant.types import GGMLType

GiB = 1 << 30


@pytest.fixture(scope="module")
def qwen30():
    return catalog_model("qwen3-30b-a3b")


def fake(monkeypatch, spec):
    monkeypatch.setenv(FAKE_ENV, spec)
    return list_devices()


def parse(argv: str) -> PlacementOptions:
    p = argparse.ArgumentParser()
    add_placement_args(p)
    return options_from_args(p.parse_args(shlex.split(argv)))


def layer_devs(p, layer, shorts):
    return {s: p.device_of[f"blk.{layer}.{s}.weight"] for s in shorts}


def split_warnings(p):
    return [w for w in p.warnings if "TG gets slow" in w]


# --- devices -------------------------------------------------------------------------------------

def test_fake_gpu_specs(monkeypatch):
    assert parse_fake_gpus("2") == [24 * GiB] * 2
    assert parse_fake_gpus("2x24GiB") == [24 * GiB] * 2
    assert parse_fake_gpus("24GiB,8GiB") == [24 * GiB, 8 * GiB]
    assert parse_fake_gpus("1x512MiB,2x1G") == [512 << 20, GiB, GiB]
    for bad in ("two", "2xlots", "24 parsecs"):
        with pytest.raises(HybridMoeError, match=FAKE_ENV):
            parse_fake_gpus(bad)
    devs = fake(monkeypatch, "32GiB,24GiB")
    assert [d.name for d in devs] == ["CPU", "CUDA0", "CUDA1"]
    assert devs[0].kind == "cpu" and devs[0].total_bytes > 0 and 0 < devs[0].free_bytes <= devs[0].total_bytes
    assert [(d.kind, d.index, d.total_bytes, d.free_bytes, d.fake, d.torch_device.type) for d in devs[1:]] == \
        [("cuda", 0, 32 * GiB, 32 * GiB, True, "cpu"), ("cuda", 1, 24 * GiB, 24 * GiB, True, "cpu")]
    monkeypatch.delenv(FAKE_ENV)
    assert not any(d.fake for d in list_devices())      # fake GPUs exist only when the variable is set


def test_get_device_names(monkeypatch):
    devs = fake(monkeypatch, "2")
    assert get_device("cuda1", devs).name == "CUDA1"
    assert get_device("cpu", devs).name == "CPU"
    with pytest.raises(PlacementError, match=r"unknown device 'CUDA7': known devices are CPU, CUDA0, CUDA1$"):
        get_device("CUDA7", devs)
    with pytest.raises(PlacementError, match=r"known devices are CPU \(no CUDA GPU is visible.*HYBRIDMOE_FAKE_GPUS"):
        get_device("CUDA0", devs[:1])


def test_devices_command(monkeypatch, capsys):
    fake(monkeypatch, "24GiB,8GiB")
    assert devices_cmd.main(devices_cmd.setup_arg_parser().parse_args([])) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Available devices:" and out[1].startswith("  CPU: host memory (")
    assert re.fullmatch(r"  CUDA0: fake GPU.*\(24576 MiB, 24576 MiB free\)", out[2])
    assert re.fullmatch(r"  CUDA1: fake GPU.*\(8192 MiB, 8192 MiB free\)", out[3])
    devices_cmd.main(devices_cmd.setup_arg_parser().parse_args(["--json"]))
    js = json.loads(capsys.readouterr().out)
    assert [(d["name"], d["total_bytes"]) for d in js[1:]] == [("CUDA0", 24 * GiB), ("CUDA1", 8 * GiB)]


# --- catalog -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,params,n_tensors", [
    ("qwen3-30b-a3b", 30.53e9, 1 + 48 * 12 + 2),
    ("qwen3-235b-a22b", 235.09e9, 1 + 94 * 12 + 2),
    ("deepseek-r1", 671.03e9, 1 + 3 * 12 + 58 * 17 + 2),
    ("gpt-oss-20b", 20.91e9, 1 + 24 * 19 + 2),
    ("gpt-oss-120b", 116.83e9, 1 + 36 * 19 + 2),
])
def test_catalog_shapes_match_published_sizes(name, params, n_tensors):
    cfg, t = catalog_model(name)
    assert len(t) == n_tensors
    assert abs(sum(x.n_elements for x in t.values()) - params) < 0.01e9   # the models' published sizes
    for x in t.values():
        if x.qtype == GGMLType.F32:
            assert x.nbytes == 4 * x.n_elements
    assert t["blk.0.ffn_gate_inp.weight" if cfg.arch == "qwen3moe" else "blk.3.ffn_gate_inp.weight"].qtype == GGMLType.F32


@pytest.mark.parametrize("name,gb", [("gpt-oss-20b", 12.1), ("gpt-oss-120b", 63.4)])
def test_catalog_gpt_oss_like_ggml_orgs_files(name, gb):
    """Experts MXFP4, the rest Q8_0: the sizes of ggml-org's gpt-oss GGUFs (12.1 and 63.4 GB) within 2%."""
    cfg, t = catalog_model(name)
    assert cfg.arch == "gpt-oss" and cfg.is_swa_layer(0) and not cfg.is_swa_layer(1)
    assert {x.qtype for n, x in t.items() if "_exps.weight" in n} == {GGMLType.MXFP4}
    assert t["blk.0.attn_q.weight"].qtype == GGMLType.Q8_0 and t["blk.0.attn_sinks.weight"].qtype == GGMLType.F32
    assert abs(sum(x.nbytes for x in t.values()) / 1e9 - gb) < 0.02 * gb


def test_catalog_deepseek_names_and_types(dsr1):
    cfg, t = dsr1
    assert isinstance(cfg, PlanConfig) and cfg.arch == "deepseek2" and cfg.kv_lora_rank == 512
    assert t["blk.5.attn_q_b.weight"].shape == (128 * 192, 1536)
    assert t["blk.5.attn_kv_a_mqa.weight"].shape == (576, 7168)
    assert t["blk.5.attn_kv_b.weight"].shape == (128 * 256, 512)
    assert t["blk.5.attn_output.weight"].shape == (7168, 128 * 128)
    assert t["blk.5.ffn_up_exps.weight"].shape == (256, 2048, 7168)
    assert t["blk.5.ffn_down_shexp.weight"].shape == (7168, 2048)
    assert t["blk.5.exp_probs_b.bias"].shape == (256,)
    assert t["blk.2.ffn_up.weight"].shape == (18432, 7168) and "blk.2.ffn_up_exps.weight" not in t
    assert t["blk.5.ffn_up_exps.weight"].qtype == GGMLType.Q4_K
    assert t["blk.0.ffn_down.weight"].qtype == GGMLType.Q6_K          # llama.cpp's "more bits" layers
    assert t["blk.30.attn_kv_b.weight"].qtype == GGMLType.Q8_0
    r = with_types(t, expert="Q8_0")
    assert r["blk.5.ffn_up_exps.weight"].nbytes == 256 * 2048 * 7168 // 32 * 34
    assert r["blk.5.attn_q_b.weight"] is t["blk.5.attn_q_b.weight"]
    _, t2 = catalog_model("deepseek-r1:q3_k:q6_k")
    assert t2["blk.9.ffn_down_exps.weight"].qtype == GGMLType.Q3_K
    assert t2["blk.9.attn_output.weight"].qtype == GGMLType.Q6_K and t2["blk.9.ffn_gate_inp.weight"].qtype == GGMLType.F32
    with pytest.raises(HybridMoeError, match="no catalog model"):
        catalog_model("gpt-9")


def test_gpu_dense_matrices_count_their_dequantized_copy(monkeypatch, qwen30):
    """The runtime keeps a bf16 copy (F32: an F32 copy) of every dense matrix on a GPU; experts and
    token_embd have none. For Qwen3-30B-A3B all on one GPU that is ~2.4 GiB."""
    cfg, t = qwen30
    devs = fake(monkeypatch, "1")
    p = plan_placement(t, cfg, PlacementOptions(n_gpu_layers=99), devs)
    want = sum(i.n_elements * (4 if i.qtype == GGMLType.F32 else 2) for n, i in t.items()
               if len(i.shape) >= 2 and "_exps" not in n and n != "token_embd.weight")
    assert p.totals["CUDA0"].compute_parts["dense bf16 copies"] == want
    assert 2.2 * 2 ** 30 < want < 2.6 * 2 ** 30
    p_cpu = plan_placement(t, cfg, PlacementOptions(n_gpu_layers=0), devs)
    assert "dense bf16 copies" not in p_cpu.totals["CUDA0"].compute_parts


# --- -ngl / -ts / -sm ----------------------------------------------------------------------------

def test_ngl_offloads_last_layers_then_output(monkeypatch, qwen30):
    cfg, t = qwen30
    devs = fake(monkeypatch, "1")
    p = plan_placement(t, cfg, PlacementOptions(n_gpu_layers=10), devs)
    assert [p.layer_device[i] for i in range(48)] == ["CPU"] * 38 + ["CUDA0"] * 10
    assert p.device_of["blk.37.ffn_up_exps.weight"] == "CPU" and p.device_of["blk.38.attn_q.weight"] == "CUDA0"
    assert p.device_of["output.weight"] == "CPU" and p.device_of["token_embd.weight"] == "CPU"
    p48 = plan_placement(t, cfg, PlacementOptions(n_gpu_layers=48), devs)
    assert set(p48.layer_device) == {"CUDA0"} and p48.device_of["output.weight"] == "CPU"
    p49 = plan_placement(t, cfg, PlacementOptions(n_gpu_layers=49), devs)
    assert p49.device_of["output.weight"] == p49.device_of["output_norm.weight"] == "CUDA0"
    assert p49.device_of["token_embd.weight"] == "CPU"                   # llama.cpp keeps the input layer on CPU
    assert "-ngl 10: layer 37 is not offloaded" in p.explain("blk.37.attn_k.weight")
    pall = plan_placement(t, cfg, parse("-ngl all"), devs)
    assert pall.device_of == p49.device_of == plan_placement(t, cfg, PlacementOptions.from_kwargs(ngl="all"), devs).device_of
    p0 = plan_placement(t, cfg, PlacementOptions(), devs)
    assert set(p0.device_of.values()) == {"CPU"}


def test_split_by_free_memory_and_tensor_split(monkeypatch, qwen30):
    cfg, t = qwen30
    # 49 offloaded units (48 layers + output); split points 0.75/1.0: il/49 < 0.75 -> il <= 36 on CUDA0
    want = ["CUDA0"] * 37 + ["CUDA1"] * 11
    p = plan_placement(t, cfg, PlacementOptions(n_gpu_layers=999), fake(monkeypatch, "24GiB,8GiB"))
    assert p.layer_device == want and p.output_device == "CUDA1"
    devs = fake(monkeypatch, "2")
    for ts in ("3,1", "3/1"):
        p = plan_placement(t, cfg, parse(f"-ngl 999 -ts {ts}"), devs)
        assert p.layer_device == want
    p = plan_placement(t, cfg, parse("-ngl 999"), devs)                 # equal free memory: half each
    assert p.layer_device == ["CUDA0"] * 25 + ["CUDA1"] * 23            # il/49 < 0.5 -> il <= 24
    p = plan_placement(t, cfg, parse("-ngl 999 -sm none -mg 1 -ts 3,1"), devs)
    assert set(p.layer_device) == {"CUDA1"} and p.output_device == "CUDA1"
    p = plan_placement(t, cfg, parse("-ngl 999 -sm row"), devs)
    assert p.layer_device == ["CUDA0"] * 25 + ["CUDA1"] * 23
    assert any("-sm row is treated as -sm layer" in w for w in p.warnings)
    with pytest.raises(PlacementError, match=r"-mg 2: there are 2 GPUs \(CUDA0, CUDA1\)"):
        plan_placement(t, cfg, parse("-ngl 999 -mg 2"), devs)


# --- the seeds' command lines --------------------------------------------------------------------

ISSUE_521 = r'''-c 16384 -ngl 999 \
-ot "blk.(0|1|2|3|4|5|6|7).ffn.=CUDA0" \
-ot "blk.(8|9|10|11).ffn.=CUDA1" \
-ot "blk.(12|13|14|15).ffn.=CUDA2" \
-ot "blk.(16|17|18|19|20).ffn.=CUDA3" \
-ot "blk.(21|22|23).ffn.=CUDA4" \
-ot "blk.(24|25|26).ffn.=CUDA5" \
-ot "blk.(27|28|29|30|31|32|33|34).ffn.=CUDA6" \
-ot "blk.35.ffn_(norm|gate_inp|gate_shexp|down_shexp|up_shexp).weight=CUDA4" \
-ot "blk.35.ffn_gate_exps.weight=CUDA4" \
-ot "blk.36.ffn_(norm|gate_inp|gate_shexp|down_shexp|up_shexp).weight=CUDA5" \
-ot "blk.36.ffn_gate_exps.weight=CUDA5" \
-ot "ffn.*=CPU" \
-fa -mg 0 -ub 2048'''
RIG_521 = "32GiB,24GiB,24GiB,32GiB,24GiB,24GiB,48GiB"      # 5090, 4090, 4090, 5090, 3090, 3090, A6000
FFN = ("ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp",
       "ffn_up_shexp", "ffn_down_shexp")


def test_issue_521_seven_gpus(monkeypatch, dsr1):
    cfg, t = dsr1
    devs = fake(monkeypatch, RIG_521)
    p = plan_placement(t, cfg, parse(ISSUE_521.replace("\\\n", " ")), devs)
    ranges = {"CUDA0": range(0, 8), "CUDA1": range(8, 12), "CUDA2": range(12, 16), "CUDA3": range(16, 21),
              "CUDA4": range(21, 24), "CUDA5": range(24, 27), "CUDA6": range(27, 35), "CPU": range(37, 61)}
    for dev, layers in ranges.items():
        for il in layers:
            shorts = ("ffn_norm", "ffn_gate", "ffn_up", "ffn_down") if il < 3 else FFN
            assert set(layer_devs(p, il, shorts).values()) == {dev}, il
    for il, gpu in ((35, "CUDA4"), (36, "CUDA5")):
        d = layer_devs(p, il, FFN)
        assert d.pop("ffn_up_exps") == d.pop("ffn_down_exps") == "CPU"
        assert set(d.values()) == {gpu}, il                  # gate_exps, norm, router, shared experts
    # -ngl 999: everything the rules don't name is on a GPU, token_embd stays on the CPU
    for il in range(61):
        assert p.device_of[f"blk.{il}.attn_kv_b.weight"].startswith("CUDA")
        assert p.kv_device(il) == p.attn_device(il) == p.device_of[f"blk.{il}.attn_kv_a_mqa.weight"]
    assert p.device_of["blk.40.exp_probs_b.bias"] == p.layer_device[40] != "CPU"   # no "ffn" in its name
    assert p.device_of["output.weight"] == "CUDA6" and p.device_of["token_embd.weight"] == "CPU"
    assert "-ot #12 `ffn.*=CPU`" in p.explain("blk.35.ffn_up_exps.weight")
    assert "-ot #9" in p.explain("blk.35.ffn_gate_exps.weight")
    warns = split_warnings(p)
    assert len(warns) == 2
    assert warns[0].startswith("blk 35: ffn_gate_exps is on CUDA4 but ffn_up_exps is on CPU") and "5x" in warns[0]
    assert warns[1].startswith("blk 36: ffn_gate_exps is on CUDA5 but ffn_up_exps is on CPU")
    # the rules the warnings suggest, put first, remove the split
    fixes = [re.search(r'add -ot "([^"]+)"', w)[1] for w in warns]
    assert fixes == [r"blk\.35\.ffn_(gate|up)_exps=CPU", r"blk\.36\.ffn_(gate|up)_exps=CPU"]
    fixed = plan_placement(t, cfg, parse(" ".join(f'-ot "{f}"' for f in fixes) + " " + ISSUE_521.replace("\\\n", " ")),
                           devs)
    assert split_warnings(fixed) == []
    assert fixed.device_of["blk.35.ffn_gate_exps.weight"] == "CPU"


def test_issue_521_whole_layers_first_match_wins(monkeypatch, dsr1):
    # the issue's working line: "16..20" -> CUDA3 and "20..23" -> CUDA4 overlap on 20; the first rule wins
    cfg, t = dsr1
    line = ('-ngl 999 -ot "blk.(0|1|2|3|4|5|6|7).ffn.=CUDA0" -ot "blk.(8|9|10|11).ffn.=CUDA1" '
            '-ot "blk.(12|13|14|15).ffn.=CUDA2" -ot "blk.(16|17|18|19|20).ffn.=CUDA3"  '
            '-ot "blk.(20|21|22|23).ffn.=CUDA4" -ot "blk.(24|25|26).ffn.=CUDA5" '
            '-ot "blk.(27|28|29|30|31|32|33|34).ffn.=CUDA6" -ot "ffn.*=CPU" -fa -mg 0 -ub 2048')
    p = plan_placement(t, cfg, parse(line), fake(monkeypatch, RIG_521))
    assert set(layer_devs(p, 20, FFN).values()) == {"CUDA3"}
    assert set(layer_devs(p, 21, FFN).values()) == {"CUDA4"}
    assert set(layer_devs(p, 35, FFN).values()) == {"CPU"}
    assert split_warnings(p) == []


QWEN_532 = r'''--ctx-size 65536 -ctk q8_0 -ctv q8_0 -fa -b 4096 -ub 4096 --n-gpu-layers 100 \
  -ot "blk\.([0-9]|1[0-5])\.ffn=CUDA0" \
  -ot "blk\.(1[6-9]|2[0-7])\.ffn=CUDA1" \
  -ot "blk\.(2[8-9]|3[0-9])\.ffn=CUDA2" \
  -ot "blk\.(4[0-9]|5[0-5])\.ffn=CUDA3" \
  --override-tensor exps=CPU'''
RIG_532 = "32GiB,24GiB,24GiB,32GiB"     # CUDA_VISIBLE_DEVICES="2,1,0,3": 5090, 4090, 4090, 5090


def test_discussion_532_qwen3_235b(monkeypatch, qwen235):
    cfg, t = qwen235
    p = plan_placement(t, cfg, parse(QWEN_532.replace("\\\n", " ")), fake(monkeypatch, RIG_532))
    ffn = ("ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    for dev, layers in {"CUDA0": range(0, 16), "CUDA1": range(16, 28), "CUDA2": range(28, 40),
                        "CUDA3": range(40, 56)}.items():
        for il in layers:   # experts included: the ffn rule comes before exps=CPU
            assert set(layer_devs(p, il, ffn).values()) == {dev}, il
    # -ngl 100 > 94: layers and output split by free memory 32:24:24:32 over 95 units
    want = ["CUDA0"] * 28 + ["CUDA1"] * 20 + ["CUDA2"] * 20 + ["CUDA3"] * 26
    assert p.layer_device == want and p.output_device == "CUDA3"
    for il in range(56, 94):
        d = layer_devs(p, il, ffn)
        assert d["ffn_gate_exps"] == d["ffn_up_exps"] == d["ffn_down_exps"] == "CPU"
        assert d["ffn_norm"] == d["ffn_gate_inp"] == want[il]
    for il in range(94):
        assert p.kv_device(il) == want[il] == p.device_of[f"blk.{il}.attn_k.weight"]
    assert p.kv_bytes_layer[0] == 65536 * 4 * 128 * 2 * 34 // 32    # K and V in q8_0
    assert p.totals["CUDA1"].kv == 20 * p.kv_bytes_layer[0]
    assert split_warnings(p) == [] and not any("matches" in w for w in p.warnings)


DEEPSEEK_532 = r'''--ctx-size 40960 -ctk q8_0 -fa -b 4096 -ub 4096 -ngl 63 \
    -ot "blk\.[3-4]\.ffn_.*=CUDA0" \
    -ot "blk\.[5-6]\.ffn_.*=CUDA1" \
    -ot "blk\.[7-8]\.ffn_.*=CUDA2" \
    -ot "blk\.[9]\.ffn=CUDA3,blk\.1[0-1]\.ffn=CUDA3" \
    -ot exps=CPU'''


def test_discussion_532_deepseek(monkeypatch, dsr1):
    cfg, t = dsr1
    p = plan_placement(t, cfg, parse(DEEPSEEK_532.replace("\\\n", " ")), fake(monkeypatch, RIG_532))
    assert [r.device for r in p.rules] == ["CUDA0", "CUDA1", "CUDA2", "CUDA3", "CUDA3", "CPU"]   # comma list split
    for dev, layers in {"CUDA0": (3, 4), "CUDA1": (5, 6), "CUDA2": (7, 8), "CUDA3": (9, 10, 11)}.items():
        for il in layers:
            assert set(layer_devs(p, il, FFN).values()) == {dev}, il
    # 63 > 61 layers: all layers and output offloaded; split 32:24:24:32 over 62 units
    want = ["CUDA0"] * 18 + ["CUDA1"] * 13 + ["CUDA2"] * 14 + ["CUDA3"] * 16
    assert p.layer_device == want and p.output_device == "CUDA3"
    for il in range(12, 61):
        d = layer_devs(p, il, FFN)
        assert {d.pop(k) for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")} == {"CPU"}
        assert set(d.values()) == {want[il]}                  # shared experts, router, norm stay with the layer
    for il in range(3):
        assert set(layer_devs(p, il, ("ffn_gate", "ffn_up", "ffn_down")).values()) == {"CUDA0"}
    assert p.kv_bytes_layer[7] == 40960 * (512 + 64) * 34 // 32     # MLA: compressed KV + rope key, q8_0
    assert p.totals["CUDA2"].kv == 14 * p.kv_bytes_layer[7]


def test_pr_232_experts_on_cpu_rest_on_gpu(monkeypatch, dsr1):
    cfg, t = dsr1
    p = plan_placement(t, cfg, parse(r'-ngl 100 -ot "\.ffn_.*_exps\.=CPU"'), fake(monkeypatch, "2x80GiB"))
    for name, dev in p.device_of.items():
        if "_exps." in name:
            assert dev == "CPU", name
        elif name != "token_embd.weight":
            assert dev.startswith("CUDA"), name
    assert p.device_of["token_embd.weight"] == "CPU"
    assert p.totals["CPU"].weights == sum(x.nbytes for n, x in t.items() if "_exps." in n or n == "token_embd.weight")
    assert all(p.attn_device(i) != "CPU" for i in range(61))
    assert not split_warnings(p)


def test_cpu_moe_and_n_cpu_moe(monkeypatch, qwen30, dsr1):
    cfg, t = qwen30
    devs = fake(monkeypatch, "2")
    a = plan_placement(t, cfg, parse("-ngl 999 --cpu-moe"), devs)
    b = plan_placement(t, cfg, parse("-ngl 999 -ot exps=CPU"), devs)
    assert a.device_of == b.device_of
    assert "--cpu-moe" in a.explain("blk.3.ffn_down_exps.weight")
    p = plan_placement(t, cfg, parse("-ngl 999 --n-cpu-moe 24"), devs)
    for il in range(48):
        d = layer_devs(p, il, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp", "attn_q"))
        exps = {d.pop("ffn_gate_exps"), d.pop("ffn_up_exps"), d.pop("ffn_down_exps")}
        assert exps == ({"CPU"} if il < 24 else {p.layer_device[il]}), il
        assert set(d.values()) == {p.layer_device[il]} != {"CPU"}
    assert p.explain("blk.2.ffn_up_exps.weight").endswith(r"--n-cpu-moe 24 `blk\.2\.ffn_(up|down|gate)_exps=CPU`")
    # user -ot rules come first: experts 0-3 pinned to CUDA1 stay there
    q = plan_placement(t, cfg, parse(r'-ngl 999 -ncmoe 24 -ot "blk\.[0-3]\.ffn_.*_exps=CUDA1"'), devs)
    assert q.device_of["blk.3.ffn_up_exps.weight"] == "CUDA1" and q.device_of["blk.4.ffn_up_exps.weight"] == "CPU"
    cfg2, t2 = dsr1
    r = plan_placement(t2, cfg2, parse("-ngl 999 --n-cpu-moe 2"), devs)     # blocks 0-1 are dense
    assert any("--n-cpu-moe 2 changes nothing" in w for w in r.warnings)


# --- memory totals and fit checks ----------------------------------------------------------------

@pytest.mark.parametrize("line", ["-ngl 999 -ts 3,1", "-ngl 30 --n-cpu-moe 10 -nkvo", "-ngl 999 -ot exps=CPU -fa off",
                                  "-c 32768 -ctk q8_0 -ctv bf16 -ngl 999 -ub 1024 --no-op-offload"])
def test_totals_are_sums_of_records(monkeypatch, qwen30, line):
    cfg, t = qwen30
    p = plan_placement(t, cfg, parse(line), fake(monkeypatch, "24GiB,8GiB"))
    o = p.opts
    for d in p.devices:
        tot = p.totals[d.name]
        assert tot.weights == sum(t[n].nbytes for n, dev in p.device_of.items() if dev == d.name)
        assert tot.kv == sum(p.kv_bytes_layer[i] for i in range(48) if p.kv_device(i) == d.name)
        assert tot.total == tot.weights + tot.kv + tot.compute and tot.compute == sum(tot.compute_parts.values())
    assert sum(x.weights for x in p.totals.values()) == sum(x.nbytes for x in t.values())
    kv = (o.ctx_size * 4 * 128 * (KV_TYPE_BYTES[o.cache_type_k] + KV_TYPE_BYTES[o.cache_type_v]))
    assert p.kv_bytes_layer == [int(kv)] * 48
    if o.no_kv_offload:
        assert p.totals["CPU"].kv == 48 * int(kv)
    out = p.totals[p.device_of["output.weight"]].compute_parts
    assert out["logits"] == o.ubatch_size * 151936 * 4
    staged = [d for d in p.devices if "upload staging" in p.totals[d.name].compute_parts]
    assert bool(staged) == (o.op_offload and any(p.device_of[n] == "CPU" for n in t if "_exps." in n))


def test_out_of_memory_suggests_n_cpu_moe_that_fits(monkeypatch, qwen235):
    cfg, t = qwen235
    devs = fake(monkeypatch, "2x24GiB")
    opts = parse("-ngl 999 -c 8192")
    p = plan_placement(t, cfg, opts, devs)
    with pytest.raises(PlacementError) as e:
        p.check_fits()
    msg = str(e.value)
    m = re.fullmatch(r"(CUDA\d needs [\d.]+ GiB but has 24\.0 GiB free \([\d.]+ GiB over\)(, )?)+; "
                     r"try --n-cpu-moe (\d+)", msg)
    assert m, msg
    need = p.totals["CUDA0"].total / GiB
    assert f"CUDA0 needs {need:.1f} GiB but has 24.0 GiB free ({need - 24:.1f} GiB over)" in msg
    k = int(m[3])
    fixed = plan_placement(t, cfg, opts.replace(n_cpu_moe=k), devs)
    fixed.check_fits()                                        # the suggestion really fits
    assert all(fixed.totals[g].total <= 24 * GiB for g in ("CUDA0", "CUDA1"))
    assert not plan_placement(t, cfg, opts.replace(n_cpu_moe=k - 1), devs).fits   # and is the smallest


def test_out_of_memory_suggests_ngl_when_experts_already_on_cpu(monkeypatch, qwen235):
    cfg, t = qwen235
    devs = fake(monkeypatch, "2x2GiB")
    opts = parse("-ngl 999 --cpu-moe --no-op-offload")
    with pytest.raises(PlacementError, match=r"; try -ngl (\d+)$") as e:
        plan_placement(t, cfg, opts, devs).check_fits()
    g = int(re.search(r"-ngl (\d+)$", str(e.value))[1])
    assert 0 < g < 95
    assert plan_placement(t, cfg, opts.replace(n_gpu_layers=g), devs).fits
    assert not plan_placement(t, cfg, opts.replace(n_gpu_layers=g + 1), devs).fits


def test_out_of_memory_pinned_by_rules(monkeypatch, qwen30):
    cfg, t = qwen30
    devs = fake(monkeypatch, "1x4GiB")
    # experts of 0-9 pinned on CUDA0 (3.2 GiB): only the staging buffer for the others' uploads is too much
    opts = parse(r'-ot "blk\.[0-9]\.ffn_.*_exps=CUDA0"')
    with pytest.raises(PlacementError, match=r"0\.[0-9] GiB over\); try --no-op-offload"):
        plan_placement(t, cfg, opts, devs).check_fits()
    assert plan_placement(t, cfg, opts.replace(op_offload=False), devs).fits
    # experts of 0-14 pinned (4.8 GiB): nothing but moving them helps
    with pytest.raises(PlacementError, match=r"-ot rules pin [\d.]+ GiB on CUDA0; move some of those to CPU$"):
        plan_placement(t, cfg, parse(r'-ot "blk\.([0-9]|1[0-4])\.ffn_.*_exps=CUDA0"'), devs).check_fits()


# --- validation ----------------------------------------------------------------------------------

def test_rule_errors(monkeypatch, qwen30):
    cfg, t = qwen30
    devs = fake(monkeypatch, "2")
    with pytest.raises(PlacementError) as e:
        plan_placement(t, cfg, parse(r'-ot "blk\.(=CPU"'), devs)
    assert str(e.value) == r"regex `blk\.(` is invalid: missing ), unterminated subpattern at position 5"
    with pytest.raises(PlacementError, match=r"-ot `exps`: missing '='"):
        plan_placement(t, cfg, parse("-ot exps"), devs)
    with pytest.raises(PlacementError, match=r"unknown device 'CUDA2': known devices are CPU, CUDA0, CUDA1"):
        plan_placement(t, cfg, parse("-ot exps=CUDA2"), devs)
    p = plan_placement(t, cfg, parse(r"-ngl 999 -ot blk\.[0-9]{1,2}\.ffn_up_exps=cuda1"), devs)   # comma in {}
    assert len(p.rules) == 1 and p.rules[0].device == "CUDA1"
    assert p.device_of["blk.47.ffn_up_exps.weight"] == "CUDA1"


def test_rule_warnings(monkeypatch, qwen30):
    cfg, t = qwen30
    p = plan_placement(t, cfg, parse('-ngl 999 -ot "attn_qkv=CPU" -ot exps=CPU -ot "ffn_up_exps=CUDA1"'),
                       fake(monkeypatch, "2"))
    assert p.warnings[0].startswith("-ot #1 `attn_qkv=CPU` matches no tensor of this model (names look like blk.0.")
    assert p.warnings[1] == ("-ot #3 `ffn_up_exps=CUDA1` matches 48 tensors but earlier rules place all of them "
                             "(the first matching rule wins)")
    # a host-RAM warning depends on this machine's free memory at the moment; the rule warnings don't
    assert len([w for w in p.warnings if not w.startswith("CPU needs")]) == 2


def test_split_pair_warning_groups_layers(monkeypatch, qwen30):
    # kirnat's line (discussion 532): gate_exps of 0-19 on CPU, up/down everywhere on CPU: 20-47 split
    cfg, t = qwen30
    line = r'-ngl 49 -ot "blk\.[0-9]\.ffn_(gate)_exps.=CPU" -ot "blk\.1[0-9]\.ffn_(gate)_exps.=CPU" ' \
           r'-ot ".ffn_(up|down)_exps.=CPU"'
    devs = fake(monkeypatch, "1x80GiB")
    p = plan_placement(t, cfg, parse(line), devs)
    (w,) = split_warnings(p)
    assert w.startswith("blk 20-47: ffn_gate_exps is on CUDA0 but ffn_up_exps is on CPU")
    fix = re.search(r'add -ot "([^"]+)"', w)[1]
    assert fix == r"blk\.([2-3][0-9]|4[0-7])\.ffn_(gate|up)_exps=CPU"
    fixed = plan_placement(t, cfg, parse(f'-ot "{fix}" ' + line), devs)
    assert split_warnings(fixed) == []
    # dense pair (deepseek's first layers) split the same way
    cfg2, t2 = catalog_model("deepseek-r1")
    q = plan_placement(t2, cfg2, parse(r'-ngl 999 -ot "blk\.1\.ffn_up\.=CPU"'), devs)
    (w2,) = split_warnings(q)
    assert w2.startswith("blk 1: ffn_gate is on CUDA0 but ffn_up is on CPU") and r'blk\.1\.ffn_(gate|up)\.weight=CUDA0' in w2
    assert split_warnings(plan_placement(t2, cfg2, parse(r'-ngl 999 -ot "blk\.1\.ffn_(gate|up)\.weight=CUDA0" '
                                                         r'-ot "blk\.1\.ffn_up\.=CPU"'), devs)) == []


def test_layers_regex_is_exact():
    cases = [[35], [0, 1, 2], list(range(20, 61)), list(range(0, 94)), [7, 9, 10, 11, 99, 100, 101, 250],
             list(range(95, 131)), [0], [10, 20, 30]]
    for layers in cases:
        rx = re.compile(layers_regex(layers))
        assert [i for i in range(300) if rx.fullmatch(str(i))] == sorted(layers), layers
    assert layers_regex([35]) == "35"


def test_options_from_kwargs_and_flags():
    a = PlacementOptions.from_kwargs(ngl=99, ot="exps=CPU", ts="3,1", mg=1, nkvo=True, ctk="Q8_0", ctv="q8_0",
                                     c=8192, b=1024, ub=4096, ncmoe=3, sm="NONE")
    b = parse("-ngl 99 -ot exps=CPU -ts 3/1 -mg 1 -nkvo -ctk q8_0 -ctv q8_0 -c 8192 -b 1024 -ub 4096 -ncmoe 3 -sm none")
    assert a == b
    assert a.override_tensor == ["exps=CPU"] and a.tensor_split == [3.0, 1.0] and a.ubatch_size == 1024
    with pytest.raises(PlacementError, match="unknown placement option 'ngpu'"):
        PlacementOptions.from_kwargs(ngpu=3)
    with pytest.raises(PlacementError, match="-ctk q4_9: KV cache type must be one of f32, f16, bf16, q8_0"):
        PlacementOptions.from_kwargs(ctk="q4_9")
    with pytest.raises(PlacementError, match="given twice"):
        PlacementOptions.from_kwargs(ngl=3, n_gpu_layers=4)
    long = parse("--n-gpu-layers 7 --override-tensor a=CPU --override-tensor b=CPU --cpu-moe --tensor-split 1,2 "
                 "--main-gpu 0 --split-mode layer --no-kv-offload --ctx-size 100 --cache-type-k bf16 "
                 "--cache-type-v f32 --batch-size 64 --ubatch-size 32 --n-cpu-moe 2")
    assert (long.n_gpu_layers, long.override_tensor, long.cpu_moe, long.tensor_split, long.cache_type_v,
            long.ubatch_size, long.n_cpu_moe, long.no_kv_offload) == (7, ["a=CPU", "b=CPU"], True, [1.0, 2.0], "f32",
                                                                      32, 2, True)
    assert parse("--gpu-layers 5").n_gpu_layers == 5 and parse("-cmoe").cpu_moe


# --- report and commands -------------------------------------------------------------------------

def test_format_plan_collapses_layers(monkeypatch, qwen30):
    cfg, t = qwen30
    p = plan_placement(t, cfg, parse("-ngl 999 -ts 3,1 -ncmoe 10"), fake(monkeypatch, "2"))
    text = format_plan(p, cfg)
    rows = {tuple(re.split(r"\s{2,}", line.strip())[:3]) for line in text.splitlines()}
    assert ("experts", "blk 0-9", "CPU") in rows
    assert ("experts", "blk 10-36", "CUDA0") in rows and ("experts", "blk 37-47", "CUDA1") in rows
    assert ("attention", "blk 0-36", "CUDA0") in rows and ("embeddings", "-", "CPU") in rows
    assert ("output", "-", "CUDA1") in rows
    exp_row = next(line for line in text.splitlines() if line.startswith("experts") and "blk 0-9" in line)
    gib_cpu_exps = sum(t[f"blk.{i}.{s}.weight"].nbytes for i in range(10)
                       for s in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")) / GiB
    assert exp_row.split()[-2] == f"{gib_cpu_exps:.2f}" and exp_row.split()[-3] == "30"


def test_plan_command_json(monkeypatch, capsys):
    fake(monkeypatch, "2")
    parser = plan_cmd.setup_arg_parser()
    args = parser.parse_args(shlex.split(r'-m catalog:qwen3-30b-a3b -ngl 999 -ot "\.ffn_.*_exps\.=CPU" --json '
                                         "--explain blk.0.ffn_up_exps.weight"))
    assert plan_cmd.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    cfg, t = catalog_model("qwen3-30b-a3b")
    assert set(doc["tensors"]) == set(t) and doc["fits"] and doc["error"] is None
    assert {n for n, d in doc["tensors"].items() if d == "CPU"} == {n for n in t if "_exps." in n} | {"token_embd.weight"}
    for name, d in doc["devices"].items():
        assert d["weights"] == sum(t[n].nbytes for n, dev in doc["tensors"].items() if dev == name)
        assert d["total"] == d["weights"] + d["kv"] + d["compute"]
    assert [x["attn_device"] for x in doc["layers"]] == ["CUDA0"] * 25 + ["CUDA1"] * 23
    assert "\\.ffn_.*_exps\\.=CPU" in doc["explain"]["blk.0.ffn_up_exps.weight"]
    same = placement_to_json(plan_placement(t, cfg, options_from_args(args), list_devices()))
    assert same["tensors"] == doc["tensors"] and same["layers"] == doc["layers"]
    for name, d in same["devices"].items():      # host RAM available can move between the two calls
        skip = {"free", "over", "fits"} if name == "CPU" else set()
        assert {k: v for k, v in d.items() if k not in skip} == {k: v for k, v in doc["devices"][name].items()
                                                                 if k not in skip}
    # a placement that does not fit: exit status 1 and the reason in the JSON and in the text
    args = parser.parse_args(["-m", "catalog:qwen3-235b-a22b", "-ngl", "999", "--json"])
    assert plan_cmd.main(args) == 1
    doc = json.loads(capsys.readouterr().out)
    assert not doc["fits"] and "try --n-cpu-moe" in doc["error"] and doc["devices"]["CUDA0"]["over"] > 0
    assert plan_cmd.main(parser.parse_args(["-m", "catalog:qwen3-235b-a22b", "-ngl", "999"])) == 1
    out = capsys.readouterr().out
    assert "OVER by" in out and out.rstrip().splitlines()[-1].startswith("does not fit: CUDA0 needs")


def _write_gguf(path, arch, cfg, shapes, extra):
    import gguf
    w = gguf.GGUFWriter(str(path), arch=arch)
    for k, v in extra.items():
        (w.add_uint32 if isinstance(v, int) else w.add_float32)(f"{arch}.{k}", v)
    for name, shape in shapes:
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_plan_and_inspect_on_gguf_files(tmp_path, monkeypatch, capsys):
    from hybridmoe.config import ModelConfig
    fake(monkeypatch, "2")
    cfg = ModelConfig(arch="qwen3moe", n_layer=3, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_vocab=100,
                      n_ctx_train=256, rms_eps=1e-6, rope_base=1e6, n_expert=4, n_expert_used=2, n_ff_exp=32,
                      qk_norm=True)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "qwen3moe", cfg, tensor_shapes(cfg), {
        "block_count": 3, "embedding_length": 64, "attention.head_count": 4, "attention.head_count_kv": 2,
        "attention.key_length": 16, "vocab_size": 100, "context_length": 256, "expert_count": 4,
        "expert_used_count": 2, "expert_feed_forward_length": 32})
    args = plan_cmd.setup_arg_parser().parse_args(["-m", str(path), "-ngl", "2", "--n-cpu-moe", "2", "--json"])
    assert plan_cmd.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [x["layer_device"] for x in doc["layers"]] == ["CPU", "CUDA0", "CUDA1"]
    assert doc["tensors"]["blk.1.ffn_up_exps.weight"] == "CPU" and doc["tensors"]["blk.2.ffn_up_exps.weight"] == "CUDA1"
    assert doc["devices"]["CUDA0"]["kv"] == 4096 * 2 * 16 * 2 * 2
    # inspect: every matching tensor, per-layer sums, totals
    args = inspect_cmd.setup_arg_parser().parse_args(["-m", str(path), r"blk\.[12]\.ffn_(up|down)_exps"])
    assert inspect_cmd.main(args) == 0
    out = capsys.readouterr().out
    exp_bytes = 4 * 32 * 64 * 4
    assert re.search(r"blk\.1\.ffn_up_exps\.weight\s+4 x 32 x 64\s+F32\s+32\.0 KiB", out)
    assert re.search(r"^blk 2\s+2\s+64\.0 KiB\s+64\.0 KiB$", out, re.M)
    assert out.rstrip().endswith(f"total: 4 tensors, 128.0 KiB ({4 * exp_bytes} bytes)")
    args = inspect_cmd.setup_arg_parser().parse_args(["-m", str(path), "--json"])
    inspect_cmd.main(args)
    doc = json.loads(capsys.readouterr().out)
    assert doc["total_bytes"] == sum(x["nbytes"] for x in doc["tensors"]) == \
        sum(4 * int(np.prod(shape)) for _, shape in tensor_shapes(cfg))
    assert sum(x["bytes"] for x in doc["layers"]) == doc["total_bytes"]
    assert [x["layer"] for x in doc["layers"]] == [0, 1, 2, None]
    with pytest.raises(HybridMoeError, match=r"regex `blk\\.\(` is invalid"):
        inspect_cmd.main(inspect_cmd.setup_arg_parser().parse_args(["-m", str(path), r"blk\.("]))


def test_plan_deepseek2_gguf_uses_mla_kv(tmp_path, monkeypatch, capsys):
    fake(monkeypatch, "1")
    cfg = PlanConfig(arch="deepseek2", n_layer=3, n_embd=64, n_head=4, n_head_kv=4, head_dim=48, n_vocab=100,
                     n_ctx_train=512, rms_eps=1e-6, rope_base=1e4, n_ff=96, n_expert=4, n_expert_used=2,
                     n_ff_exp=32, kv_lora_rank=32, q_lora_rank=32, rope_dim=16, n_layer_dense_lead=1,
                     n_expert_shared=1, n_ff_shexp=32)
    path = tmp_path / "ds.gguf"
    _write_gguf(path, "deepseek2", cfg, deepseek2_shapes(cfg), {
        "block_count": 3, "embedding_length": 64, "attention.head_count": 4, "attention.head_count_kv": 4,
        "attention.key_length": 48, "vocab_size": 100, "context_length": 512, "expert_count": 4,
        "expert_used_count": 2, "expert_feed_forward_length": 32, "feed_forward_length": 96,
        "attention.kv_lora_rank": 32, "attention.q_lora_rank": 32, "rope.dimension_count": 16,
        "leading_dense_block_count": 1, "expert_shared_count": 1})
    got_cfg, tensors = plan_cmd.load_records(str(path))
    assert isinstance(got_cfg, PlanConfig) and got_cfg.kv_lora_rank == 32 and got_cfg.rope_dim == 16
    args = plan_cmd.setup_arg_parser().parse_args(["-m", str(path), "-ngl", "9", "-c", "1024", "--json"])
    assert plan_cmd.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [x["kv_bytes"] for x in doc["layers"]] == [1024 * (32 + 16) * 2] * 3
    assert doc["devices"]["CUDA0"]["kv"] == 3 * 1024 * 48 * 2


@pytest.mark.gpu
def test_real_gpus_listed_in_torch_order(monkeypatch):
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    monkeypatch.delenv(FAKE_ENV, raising=False)
    devs = list_devices()
    gpus = [d for d in devs if d.is_gpu]
    assert devs[0].name == "CPU" and len(gpus) == torch.cuda.device_count()
    for i, d in enumerate(gpus):
        props = torch.cuda.get_device_properties(i)
        assert (d.name, d.index, d.fake, d.torch_device) == (f"CUDA{i}", i, False, torch.device("cuda", i))
        assert d.total_bytes == props.total_memory and 0 < d.free_bytes <= d.total_bytes
        assert d.description == props.name


def test_seed_command_lines_paste_into_serve_and_run(capsys):
    """Discussion 532's whole llama-server lines (flags hybridmoe has no use for included) parse; the
    no-op flags are named on stderr."""
    import shlex

    from hybridmoe.cli import build_parser
    from hybridmoe.commands.common import runtime_kwargs
    qwen = r'''--model m.gguf --alias unsloth/Qwen3-235B --ctx-size 65536 -ctk q8_0 -ctv q8_0 -fa -b 4096 -ub 4096
        -fmoe --n-gpu-layers 100 -ot "blk\.([0-9]|1[0-5])\.ffn=CUDA0" --override-tensor exps=CPU --parallel 1
        --threads 56 --host 0.0.0.0 --port 10002'''
    deepseek = r'''--model m.gguf --ctx-size 40960 -ctk q8_0 -mla 3 -fa -b 4096 -ub 4096 -amb 512 -fmoe -ngl 63
        -ot "blk\.[3-4]\.ffn_.*=CUDA0" -ot exps=CPU --parallel 1 --threads 56 --no-mmap -rtr --numa distribute'''
    p = build_parser()
    a = p.parse_args(["serve", *shlex.split(qwen)])
    kw = runtime_kwargs(a)
    assert kw["n_gpu_layers"] == 100 and kw["override_tensor"][-1] == "exps=CPU" and kw["fused_moe"] is True
    assert kw["ctx_size"] == 65536 and kw["cache_type_k"] == "q8_0" and kw["threads"] == 56
    assert a.parallel == 1 and "--parallel is accepted" not in capsys.readouterr().err   # serve's slots (-np)
    b = p.parse_args(["run", *shlex.split(deepseek)])
    kw = runtime_kwargs(b)
    assert kw["n_gpu_layers"] == 63 and kw["ubatch_size"] == 4096
    err = capsys.readouterr().err
    for flag in ("-mla", "-amb", "--no-mmap", "-rtr", "--numa", "--parallel"):
        assert f"note: {flag} is accepted" in err



def test_experts_on_another_gpu_than_their_attention_are_warned(monkeypatch, dsr1):
    """The captured decode step runs a layer's experts on its attention's GPU or on the CPU; other layouts decode
    eagerly (3.8 t/s against 49.5 on two H100s), and plan says so, naming the layers and the way out."""
    cfg, t = dsr1
    devs = fake(monkeypatch, "200GiB,200GiB")
    eager = lambda p: [w for w in p.warnings if "runs eagerly" in w]              # noqa: E731
    p = plan_placement(t, cfg, parse(r'-ngl 999 -ts 1,1 -ot "blk\.(3|4)\.ffn_.*_exps=CUDA1" -ot exps=CPU'), devs)
    assert p.attn_device(3) == p.attn_device(4) == "CUDA0"
    assert eager(p) == [eager(p)[0]] and eager(p)[0].startswith("blk 3-4: experts on CUDA1, attention on CUDA0")
    assert eager(plan_placement(t, cfg, parse("-ngl 999 -ts 1,1 -ot exps=CPU"), devs)) == []
    assert eager(plan_placement(t, cfg, parse("-ngl 999 -ts 1,1"), devs)) == []
