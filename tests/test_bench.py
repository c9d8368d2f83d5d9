"""bench (llama-bench), sweep-bench (ik_llama.cpp's llama-sweep-bench), calibration and the roofline.

Everything runs on synth:tiny with a few tokens; no timing thresholds (CI is 2 shared cores)."""
from __future__ import annotations

import csv
import io
import itertools
import json
import math
import re

import pytest
import torch

import hybridmoe
from hybridmoe.cli import main as cli
from hybridmoe.commands.bench import JSON_FIELDS, ROOFLINE_FIELDS
from hybridmoe.formats.gguf import tensor_info_from_shape
from hybridmoe.models.synth import preset_config
from hybridmoe.models.tensors import default_qtype, tensor_shapes
from hybridmoe.perf import calibrate as cal
from hybridmoe.perf.roofline import (
    Work,
    kv_bytes_per_position,
    main_qtype,
    model_work,
    param_counts,
    pp_bound,
    tg_bound,
    upload_targets,
)

TS_RE = re.compile(r"^\d+\.\d\d ± \d+\.\d\d$")


def bench(capsys, *argv) -> tuple[int, str, str]:
    rc = cli(["bench", "-m", "synth:tiny", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def bench_json(capsys, *argv) -> list[dict]:
    rc, out, err = bench(capsys, "-o", "json", *argv)
    assert rc == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def quick_rates():
    """A quick calibration in this run's cache folder (conftest points HYBRIDMOE_CACHE at a temp dir)."""
    return cal.calibrate(quick=True)


# ------------------------------------------------------------------------------------------ bench

def test_json_has_llama_bench_fields_and_every_test(capsys):
    recs = bench_json(capsys, "-p", "16", "-n", "3", "-pg", "8,2", "-d", "0,8", "-r", "2", "-ub", "8", "-ngl", "0")
    got = [(r["n_prompt"], r["n_gen"], r["n_depth"], r["test"]) for r in recs]
    assert got == [(16, 0, 0, "pp16"), (0, 3, 0, "tg3"), (8, 2, 0, "pp8+tg2"),
                   (16, 0, 8, "pp16 @ d8"), (0, 3, 8, "tg3 @ d8"), (8, 2, 8, "pp8+tg2 @ d8")]
    for r in recs:
        assert list(r)[:len(JSON_FIELDS)] == list(JSON_FIELDS)
        assert len(r["samples_ns"]) == len(r["samples_ts"]) == 2
        n_tok = r["n_prompt"] + r["n_gen"]
        for ns, ts in zip(r["samples_ns"], r["samples_ts"]):
            assert ns > 0 and ts == pytest.approx(n_tok * 1e9 / ns)
        assert r["avg_ts"] == pytest.approx(sum(r["samples_ts"]) / 2)
        assert r["avg_ns"] == int(sum(r["samples_ns"]) / 2)
        assert r["n_ubatch"] == 8 and r["backends"] == "CPU" and r["n_gpu_layers"] == 0
        assert r["model_type"].startswith("qwen3moe ") and r["model_type"].endswith(" Q8_0")
        assert r["model_filename"].endswith(".gguf") and r["model_size"] > 0


def test_model_columns_from_tensor_records():
    m = hybridmoe.load("synth:tiny")
    total, active = param_counts(m.file.tensors, m.cfg)
    assert total == sum(t.n_elements for t in m.file.tensors.values())
    exps = sum(t.n_elements for n, t in m.file.tensors.items() if "_exps." in n)
    assert active == total - exps + exps * m.cfg.n_expert_used // m.cfg.n_expert
    by = {}
    for t in m.file.tensors.values():
        if len(t.shape) >= 2:
            by[t.qtype.name] = by.get(t.qtype.name, 0) + t.nbytes
    assert main_qtype(m.file.tensors) == max(by, key=by.get)


def test_comma_lists_make_the_cross_product_and_load_each_placement_once(capsys, monkeypatch):
    loads = []
    real = hybridmoe.load
    monkeypatch.setattr(hybridmoe, "load", lambda path, **kw: loads.append(kw) or real(path, **kw))
    rc, out, err = bench(capsys, "-o", "jsonl", "-p", "8", "-n", "0", "-r", "1", "-ub", "4,8", "-t", "1,2",
                         "-ncmoe", "0,1")
    assert rc == 0, err
    recs = [json.loads(line) for line in out.splitlines()]
    combos = [(r["n_ubatch"], r["n_threads"], r["n_cpu_moe"]) for r in recs]
    assert sorted(combos) == sorted(itertools.product((4, 8), (1, 2), (0, 1)))
    assert len(loads) == 2 and sorted(kw["n_cpu_moe"] for kw in loads) == [0, 1]   # ub and -t reuse a model


def test_override_alternatives_with_semicolons(capsys, monkeypatch):
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1")
    alts = r"exps=CPU;;blk\.0\.ffn_(up|gate)_exps=CPU,blk\.1\.ffn_(up|gate)_exps=CPU"
    recs = bench_json(capsys, "-p", "8", "-n", "0", "-r", "1", "-ngl", "99", "-ot", alts)
    got = {r["tensor_buft_overrides"]: r["backends"] for r in recs}
    assert got == {"exps=CPU": "CUDA+CPU", "none": "CUDA",
                   r"blk\.0\.ffn_(up|gate)_exps=CPU,blk\.1\.ffn_(up|gate)_exps=CPU": "CUDA+CPU"}
    assert {r["n_gpu_layers"] for r in recs} == {99}


def test_csv_output(capsys):
    rc, out, err = bench(capsys, "-o", "csv", "-p", "8", "-n", "2", "-r", "1", "-fa", "0,1")
    assert rc == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert set(JSON_FIELDS) <= set(rows[0])
    assert [(r["n_prompt"], r["n_gen"], r["flash_attn"]) for r in rows] == \
        [("8", "0", "0"), ("0", "2", "0"), ("8", "0", "1"), ("0", "2", "1")]
    assert all(float(r["avg_ts"]) > 0 for r in rows)


def test_markdown_table_columns(capsys):
    rc, out, err = bench(capsys, "-p", "8", "-n", "2", "-d", "0,4", "-r", "2", "-ub", "4,8", "-ot", "exps=CPU;")
    assert rc == 0, err
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    assert cells[0] == ["model", "size", "params", "backend", "ngl", "n_ubatch", "ot", "test", "t/s"]
    assert all(set(c) <= {"-", ":"} for c in cells[1])
    assert cells[1][1].endswith(":") and cells[1][0].endswith("-")       # numbers right, model left-aligned
    body = cells[2:]
    assert len(body) == 2 * 2 * 2 * 2
    assert {r[7] for r in body} == {"pp8", "tg2", "pp8 @ d4", "tg2 @ d4"}
    assert {(r[5], r[6]) for r in body} == {("4", "exps=CPU"), ("8", "exps=CPU"), ("4", "none"), ("8", "none")}
    assert all(TS_RE.match(r[8]) and r[1].endswith(" MiB") and r[2].endswith(" M") for r in body)
    assert len({len(ln) for ln in lines}) == 1                               # aligned columns
    assert re.search(r"^build: \S+ \(\d+\)$", out, re.M)
    assert "peak RSS" in err


def test_sql_output_and_llama_bench_flags(capsys):
    """-o sql loads into sqlite3 as llama-bench's does; -oe also prints to stderr; llama-bench's flags that
    change nothing here (-mmp, --prio, --poll, -C, --cpu-strict) are taken with a note; --delay waits."""
    import sqlite3
    rc, out, err = bench(capsys, "-o", "sql", "-oe", "jsonl", "-p", "8", "-n", "2", "-r", "2", "-ngl", "0", "-mmp", "0",
                         "--prio", "2", "-C", "0x3", "--delay", "0.01")
    assert rc == 0, err
    db = sqlite3.connect(":memory:")
    db.executescript(out)
    rows = db.execute("SELECT test, n_prompt, n_gen, avg_ts, use_mmap FROM test").fetchall()
    errs = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert [(t, p, n) for t, p, n, *_ in rows] == [("pp8", 8, 0), ("tg2", 0, 2)]
    assert [r[3] for r in rows] == pytest.approx([e["avg_ts"] for e in errs]) and rows[0][4] == 1
    assert "note: -mmp changes nothing here" in err and "note: --prio" in err and "note: -C" in err
    rc, out, err = bench(capsys, "--delay", "-1")
    assert rc == 1 and "--delay -1" in err


def test_progress_goes_to_stderr_only(capsys):
    recs = bench_json(capsys, "-p", "8", "-n", "2", "-r", "1", "--progress")
    assert len(recs) == 2


def test_bad_values_are_reported(capsys):
    rc, out, err = bench(capsys, "-ub", "8,x")
    assert rc == 1 and "-ub" in err and "'x'" in err
    rc, out, err = bench(capsys, "-pg", "512")
    assert rc == 1 and "-pg" in err


# ------------------------------------------------------------------------------------------ roofline

@pytest.fixture
def small_probe(monkeypatch):
    """bench --roofline measures the RAM again around each test with weights in host RAM; here on 64 MiB
    (the real probe reads up to 4 GiB, seconds a test on the CI machine)."""
    monkeypatch.setattr(cal, "ram_read_now", lambda reps=3: cal.measure_ram_read_bw(64 << 20, 1))


def test_roofline_fields(capsys, quick_rates, monkeypatch, small_probe):
    recs = bench_json(capsys, "-p", "16", "-n", "2", "-pg", "8,2", "-r", "1", "-ngl", "0", "--roofline")
    bus = {"roofline_bus_ts", "roofline_bus_frac"}      # only where the GPU's decode share ran
    for r in recs:
        assert set(ROOFLINE_FIELDS) - bus <= set(r) and not bus & set(r)
        assert math.isfinite(r["roofline_ts"]) and r["roofline_ts"] > 0 and r["roofline_frac"] > 0
        assert r["roofline_frac"] == pytest.approx(r["avg_ts"] / r["roofline_ts"])
        assert r["roofline_limit"].startswith("CPU ")
    # a (fake) GPU with the experts on the CPU: from ubatch 128 (32 x 8 experts / 2 used) the scheduler uploads
    # them, so the bound moves the experts' work off the CPU
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1")
    recs = bench_json(capsys, "-p", "128", "-n", "0", "-r", "1", "-ub", "64,128", "-ngl", "99", "-ot", "exps=CPU",
                      "--roofline")
    detail = {r["n_ubatch"]: r["roofline_detail"] for r in recs}
    uploaded = {r["n_ubatch"]: r["uploaded_bytes"] for r in recs}
    assert "CPU" in detail[64] and "CPU" not in detail[128] and "CUDA0" in detail[128]
    assert uploaded[64] == 0 and uploaded[128] >= 0     # 2 layers fit the uploader's 2 slots: reused, not resent
    rc, out, err = bench(capsys, "-p", "8", "-n", "0", "-r", "1", "-ngl", "0", "--roofline")
    assert rc == 0, err
    head = [c.strip() for c in out.splitlines()[0].strip("|").split("|")]
    assert head[-2:] == ["roofline", "RAM GB/s"]
    assert re.search(r"\d+\.\d\d \(\d+%\) \| +\d+\.\d \|$", out.splitlines()[2])


def test_roofline_reads_the_ram_around_each_test(capsys, quick_rates, monkeypatch):
    """The RAM limit of a placement with host weights is the read bandwidth measured just before and after
    the test (their mean), not the cached calibration's; a placement with none keeps the cache's."""
    def probes(*values):
        it = iter(values)
        monkeypatch.setattr(cal, "ram_read_now", lambda reps=3: next(it))
    probes(10e9, 30e9, 40e9, 40e9)
    slow, fast = bench_json(capsys, "-p", "0", "-n", "2", "-r", "1", "-ngl", "0", "-fa", "0,1", "--roofline")
    assert slow["roofline_ram_read"] == 20e9 and fast["roofline_ram_read"] == 40e9
    assert slow["roofline_ram_probed"] and fast["roofline_ram_probed"]
    assert fast["roofline_ts"] == pytest.approx(2 * slow["roofline_ts"], rel=1e-6)   # decode: bytes / bandwidth
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1")
    probes()                                            # no probe may run
    rec, = bench_json(capsys, "-p", "0", "-n", "2", "-r", "1", "-ngl", "99", "--roofline")
    assert not rec["roofline_ram_probed"] and rec["roofline_ram_read"] == quick_rates.ram_read_bw


def _qwen30_records():
    cfg, et, ot = preset_config("qwen3-30b-a3b")
    tensors = {n: tensor_info_from_shape(n, s, default_qtype(n, s, et, ot)) for n, s in tensor_shapes(cfg)}
    return cfg, tensors


def _rig_rates():
    # the GPU machine's rates as docs RIG.md lists them
    return cal.Rates(ram_read_bw=95e9, cpu_bf16_flops=4.4e12, threads=16, h2d_bw={"CUDA0": 54e9},
                     gpu_bw={"CUDA0": 4.3e12}, gpu_bf16_flops={"CUDA0": 790e12}, sync_latency={"CUDA0": 2e-5})


def test_roofline_decode_bytes_match_the_hand_count():
    cfg, tensors = _qwen30_records()
    dev = {n: "CPU" if "_exps." in n or n == "token_embd.weight" else "CUDA0" for n in tensors}
    w = model_work(tensors, dev, cfg)
    active_experts = 48 * 8 * 3 * 768 * 2048 * 18 / 32          # Q4_0: 18 bytes per 32 weights
    row = 2048 * 34 / 32                                          # one Q8_0 row of token_embd
    assert w.decode_bytes["CPU"] == pytest.approx(active_experts + row)
    gpu_mats = sum(t.nbytes for n, t in tensors.items() if dev[n] == "CUDA0" and len(t.shape) >= 2)
    assert w.decode_bytes["CUDA0"] == pytest.approx(gpu_mats)
    rates = _rig_rates()
    b = tg_bound(w, cfg, ["CUDA0"] * cfg.n_layer, rates, n_gen=1, n_depth=0, kv_bytes_pos=0.0)
    assert b.seconds == pytest.approx(active_experts / 95e9 + row / 95e9 + gpu_mats / 4.3e12)
    assert b.limit == "CPU read" and 85 < b.ts < 95                 # RIG.md: "about 93 tokens/s"
    # KV reads grow the bound's time linearly with depth
    kvb = kv_bytes_per_position(cfg)
    deep = tg_bound(w, cfg, ["CUDA0"] * cfg.n_layer, rates, n_gen=1, n_depth=4095, kv_bytes_pos=kvb)
    assert deep.seconds - b.seconds == pytest.approx(cfg.n_layer * kvb * 4096 / 4.3e12)


def test_roofline_prompt_with_uploaded_experts_is_pcie_bound():
    cfg, tensors = _qwen30_records()
    dev = {n: "CPU" if "_exps." in n or n == "token_embd.weight" else "CUDA0" for n in tensors}
    targets = upload_targets(tensors, dev, lambda layer: "CUDA0", "CUDA0")
    assert set(targets) == {n for n in tensors if "_exps." in n} and set(targets.values()) == {"CUDA0"}
    w = model_work(tensors, dev, cfg, targets)
    experts = sum(t.nbytes for n, t in tensors.items() if "_exps." in n)
    assert w.pcie_bytes == {"CUDA0": experts} and "CPU" not in w.expert_bytes
    b = pp_bound(w, cfg, ["CUDA0"] * cfg.n_layer, _rig_rates(), n_prompt=1024, ubatch=512)
    assert b.limit == "PCIe CUDA0" and b.seconds == pytest.approx(2 * experts / 54e9)
    assert 1500 < b.ts < 1900                                       # RIG.md: "about 1,700 t/s for ubatch 512"
    # uploading only the routed experts (-ooae) moves fewer bytes: the PCIe term shrinks with them
    half = pp_bound(w, cfg, ["CUDA0"] * cfg.n_layer, _rig_rates(), n_prompt=1024, ubatch=512, pcie_scale=0.5)
    assert half.seconds == pytest.approx(experts / 54e9)
    # without a GPU, prompt processing is bound by CPU matmul FLOPs (2 x active params x tokens)
    cpu = {n: "CPU" for n in tensors}
    w2 = model_work(tensors, cpu, cfg)
    b2 = pp_bound(w2, cfg, ["CPU"] * cfg.n_layer, _rig_rates(), n_prompt=512, ubatch=512)
    _, active = param_counts(tensors, cfg)
    embd = tensors["token_embd.weight"].n_elements
    assert b2.limit == "CPU bf16"
    assert b2.seconds >= 2 * (active - embd) * 512 / 4.4e12


def test_roofline_pieces_are_additive():
    cfg, _ = _qwen30_records()
    w = Work(decode_bytes={"CPU": 1e9, "CUDA0": 1e9})
    b = tg_bound(w, cfg, ["CPU"] * cfg.n_layer, _rig_rates(), n_gen=10, kv_bytes_pos=0.0)
    assert b.seconds == pytest.approx(10 * (1e9 / 95e9 + 1e9 / 4.3e12))
    assert sum(b.terms.values()) == pytest.approx(b.seconds)


def test_interleaved_policies_share_one_load(capsys, monkeypatch):
    """-op alternatives run on one loaded model (no reload), alternating their repetitions with
    --interleave; each record keeps its own policy's uploads."""
    monkeypatch.setenv("HYBRIDMOE_FAKE_GPUS", "1x1GiB")
    loads = []
    real_load = hybridmoe.load
    monkeypatch.setattr(hybridmoe, "load", lambda *a, **kw: loads.append(kw) or real_load(*a, **kw))
    rc = cli(["bench", "-m", "synth:tiny", "-ngl", "99", "-ot", "exps=CPU", "-p", "64", "-n", "0", "-ub", "64",
              "-r", "2", "-op", "all,0;all,1", "--interleave", "-o", "json", "-t", "1"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(loads) == 1
    assert [r["offload_policy"] for r in out] == ["all,0", "all,1"]
    assert out[0]["uploaded_bytes"] == 0 and out[1]["uploaded_bytes"] > 0
    assert all(len(r["samples_ns"]) == 2 for r in out)


def test_offload_cost_follows_the_batch_routing():
    """auto's inputs: the experts a batch touches set the CPU's bytes and, when few, the only-active upload;
    a prefetched layer costs no upload; the CPU expert rate is the calibrated one when present."""
    from hybridmoe.perf.roofline import offload_times
    r = _rig_rates()
    nbytes, E, k, T = 340e6, 128, 8, 64
    n_params = 3 * 128 * 768 * 2048
    cpu_all, gpu_all = offload_times(r, "CUDA0", T, nbytes, E, k, n_params, n_active=128)
    cpu_few, gpu_few = offload_times(r, "CUDA0", T, nbytes, E, k, n_params, n_active=16)
    assert cpu_few < cpu_all and gpu_few < gpu_all
    assert gpu_all == pytest.approx(nbytes / 54e9 + 2 * n_params * k / E * T / 790e12 + 2e-5)
    assert gpu_few == pytest.approx(nbytes / 8 / 54e9 + 2 * n_params * k / E * T / 790e12 + 2e-5)
    _, gpu_pre = offload_times(r, "CUDA0", T, nbytes, E, k, n_params, n_active=128, prefetched=True)
    assert gpu_pre == pytest.approx(2 * n_params * k / E * T / 790e12 + 2e-5)
    slow = cal.Rates(**{**r.to_dict(), "cpu_moe_flops": {"32": 1e11, "512": 1e11}})
    assert offload_times(slow, "CUDA0", T, nbytes, E, k, n_params)[0] == \
        pytest.approx(2 * n_params * k / E * T / 1e11)


def test_token_generation_never_uploads_host_weights():
    """Below a 32-token batch no op uploads host weights, whatever the cost model says: on a VM whose
    probe read 79 GB/s it priced CPU streaming (at half of that) under PCIe, and -ngl 0 decode uploaded
    1.4 GB a token. From 32 tokens the model decides (and -op forces)."""
    from hybridmoe.devices import Device
    from hybridmoe.perf.roofline import offload_times
    from hybridmoe.runtime.scheduler import Scheduler
    slow_ram = cal.Rates(**{**_rig_rates().to_dict(), "ram_read_bw": 79e9})
    head = 151936 * 2048 * 34 // 32                              # the Q8_0 output head's bytes
    cpu_s, gpu_s = offload_times(slow_ram, "CUDA0", 1, head, n_params=151936 * 2048)
    assert gpu_s < cpu_s                                         # the model alone would upload at T=1
    cpu = Device("CPU", "cpu", 0, 1 << 36, 1 << 36, torch.device("cpu"))
    gpu = Device("CUDA0", "cuda", 0, 1 << 36, 1 << 36, torch.device("cpu"), fake=True)
    for policy in (None, "all,1"):
        sched = Scheduler({"CPU": cpu, "CUDA0": gpu}, cpu, gpu, offload_policy=policy, rates=slow_ram)
        assert not sched.wants_offload("mul_mat", cpu, 1, nbytes=head, n_params=151936 * 2048)
        assert not sched.wants_offload("mul_mat", cpu, 31, nbytes=head, n_params=151936 * 2048)
        assert sched.wants_offload("mul_mat", cpu, 512, nbytes=head, n_params=151936 * 2048)


# ------------------------------------------------------------------------------------------ calibration

def test_quick_calibration_is_positive_and_cached(quick_rates, monkeypatch):
    r = quick_rates
    for v in (r.ram_read_bw, r.cpu_bf16_flops):
        assert math.isfinite(v) and v > 0
    for d in (r.h2d_bw, r.gpu_bw, r.gpu_bf16_flops, r.sync_latency):
        assert all(math.isfinite(v) and v > 0 for v in d.values())
    assert set(r.cpu_moe_flops) == {"32", "512"} and all(v > 0 for v in r.cpu_moe_flops.values())
    assert r.quick and r.threads >= 1 and cal.cache_path().exists()
    assert cal.load_cached(r.threads) == r
    assert cal.load_cached(r.threads + 1000) is None                # other thread counts are measured anew
    monkeypatch.setattr(cal, "calibrate", lambda **kw: pytest.fail("should have used the cache"))
    assert cal.load_or_calibrate(threads=r.threads) == r
    # a fake GPU has no measured link: it gets the CPU's rates
    assert r.read_bw("CUDA7") == r.ram_read_bw and r.flops("CUDA7") == r.cpu_bf16_flops


def test_calibrate_command_prints_rates(capsys, quick_rates):
    import argparse

    from hybridmoe.commands import calibrate as cmd
    p = argparse.ArgumentParser()
    cmd.setup_arg_parser(p)
    assert cmd.main(p.parse_args(["--cached", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ram_read_bw"] == quick_rates.ram_read_bw


# ------------------------------------------------------------------------------------------ sweep-bench

def test_sweep_bench_markdown(capsys):
    rc = cli(["sweep-bench", "-m", "synth:tiny", "-c", "64", "-ub", "16", "-n", "4", "-t", "1"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.splitlines()
    assert "main: n_kv_max = 64, n_batch = 2048, n_ubatch = 16, flash_attn = 1, n_gpu_layers = 0, " \
           "n_threads = 1, n_threads_batch = 1" in lines
    i = lines.index("|    PP |     TG |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |")
    assert lines[i + 1] == "|-------|--------|--------|----------|----------|----------|----------|"
    rows = lines[i + 2:]
    # llama-sweep-bench's widths (%6d, %8.3f, %8.2f); a rate past 99999.99 t/s (synth:tiny on a quiet core) widens
    # its column, as printf does
    row_re = re.compile(r"^\|(.{6}) \| (.{6}) \| (.{6}) \| ([^|]{8,}) \| ([^|]{8,}) \| ([^|]{8,}) \| ([^|]{8,}) \|$")
    parsed = [row_re.match(r) for r in rows]
    assert all(parsed) and len(rows) == 4
    assert [int(m[3]) for m in parsed] == [0, 16, 32, 48]
    assert all(int(m[1]) == 16 and int(m[2]) == 4 and re.fullmatch(r" *\d+\.\d{3}", m[4]) for m in parsed)


def test_sweep_bench_jsonl(capsys):
    rc = cli(["sweep-bench", "-m", "synth:tiny", "-c", "40", "-ub", "8", "--output-format", "jsonl"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    recs = [json.loads(line) for line in out.splitlines()]
    keys = ["n_kv_max", "n_batch", "n_ubatch", "flash_attn", "n_gpu_layers", "n_threads", "n_threads_batch",
            "pp", "tg", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg"]
    assert all(list(r) == keys for r in recs)
    assert [r["n_kv"] for r in recs] == [0, 8, 16, 24, 32]
    for r in recs:
        assert r["pp"] == 8 and r["tg"] == 2 and r["n_kv_max"] == 40          # TG defaults to ubatch / 4
        assert r["speed_pp"] == pytest.approx(r["pp"] / r["t_pp"])
        assert r["speed_tg"] == pytest.approx(r["tg"] / r["t_tg"])
