"""CPU tests of the benchmarks listed in benchmarks/README.md: each one's --help, and the
helpers whose numbers docs/performance.md reports."""
import math
import os
import runpy
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ab_ws import load_revision  # noqa: E402
from bench_kernel import SERIES, SHAPES, _numbers, epilogue_gbps, shape_of, write_csv  # noqa: E402
from bench_step import device_gaps  # noqa: E402
from sweep_ws import ratio_floor, ratio_series  # noqa: E402

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


BENCHMARKS = ["ab_ws", "bench_dp", "bench_embedding", "bench_hf", "bench_hf_checkpoint",
              "bench_kernel", "bench_overlap", "bench_sft", "bench_step", "bench_tp",
              "closeness_sweep", "convergence", "graphed_small", "power_probe", "stress_kernel",
              "sweep_kernel", "sweep_ws", "tp_headroom"]


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_parses_its_flags_without_a_gpu(name, monkeypatch, capsys):
    """Every benchmark of benchmarks/README.md imports and prints its --help on the CPU."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(path), run_name="__main__")
    assert done.value.code == 0
    assert f"usage: {name}.py" in capsys.readouterr().out


def event(name, start, end, device=CUDA, annotation=False):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                           device_type=device, is_user_annotation=annotation)


def test_device_gaps_splits_launch_gaps_from_host_waits():
    """Two steps of a device timeline (microseconds): overlapping kernels merge, a gap is
    charged to the operations around it, host events and user annotations are ignored, and a
    gap over 0.5 ms counts as waiting for the host. Expected values worked out by hand."""
    events = [
        event("a", 0, 100), event("b", 103, 200), event("c", 150, 250),  # c overlaps b
        event("a", 251, 300),
        event("host op", 300, 2000, device=CPU), event("range", 0, 5000, annotation=True),
        event("b", 1300, 1400),  # 1000 us after the last: the host's wait
        event("a", 1402, 1500), event("b", 1510, 1600),
    ]
    got = device_gaps(events, steps=2)
    assert got["short_n"] == pytest.approx(4 / 2)  # 3 (a->b), 1 (c->a), 2 (b->a), 10 (a->b)
    assert got["short_ms"] == pytest.approx((3 + 1 + 2 + 10) / 1e3 / 2)
    assert got["long_ms"] == pytest.approx(1000 / 1e3 / 2)
    pairs = {(a, b): (n, ms) for a, b, n, ms in got["pairs"]}
    assert pairs == {("a", "b"): (1.0, pytest.approx(13 / 1e3 / 2)),
                     ("c", "a"): (0.5, pytest.approx(1 / 1e3 / 2)),
                     ("b", "a"): (0.5, pytest.approx(2 / 1e3 / 2))}
    assert [p[:2] for p in got["pairs"]][0] == ["a", "b"]  # largest first


def test_device_gaps_of_no_device_work():
    assert device_gaps([event("host", 0, 10, device=CPU)], steps=1) == dict(
        short_ms=0.0, short_n=0.0, long_ms=0.0, pairs=[])


def test_epilogue_rate_is_nan_where_the_difference_is_no_device_time():
    """bench_kernel's epilogue rate: bytes over (kernel - token loop); NaN when that share is
    not positive or would beat the copy ceiling of the run (the 201326 TB/s it printed for
    proj at 512 tokens, where do_bench timed the host's launches). Values worked by hand."""
    assert epilogue_gbps(12e9, 5.0, 1.0, 4.25) == pytest.approx(3000.0)  # 12 GB in 4 ms
    assert math.isnan(epilogue_gbps(12e9, 1.0, 1.0, 4.25))  # no time left for the epilogue
    assert math.isnan(epilogue_gbps(12e9, 1.0, 2.0, 4.25))
    assert math.isnan(epilogue_gbps(12e9, 3.0, 1.0, 4.25))  # 6 TB/s, over the ceiling


def test_sweep_ratio_series_per_token_count_format_and_variant():
    """sweep_ws.py's plot data from two CSVs (bf16 and int8 moments; csv.DictReader gives
    strings): per token count the shapes in first-seen order and one series per variant and
    format, time / unfused; a shape a series lacks is NaN there; --variants filters, and the
    unfused column is the baseline, never a series. Values worked by hand."""
    rows = [dict(shape="qkv", T="2048", states="bf16", unfused_ms="0.4", triton_ms="0.5",
                 ws_ms="0.2"),
            dict(shape="fc1", T="2048", states="bf16", unfused_ms="2.0", triton_ms="3.0",
                 ws_ms="1.0"),
            dict(shape="qkv", T="4096", states="bf16", unfused_ms="1.0", triton_ms="0.9",
                 ws_ms="0.8"),
            dict(shape="fc1", T="2048", states="int8", unfused_ms="2.0", triton_ms="2.5",
                 split_ms="1.5")]
    data = ratio_series(rows)
    assert sorted(data) == [2048, 4096]
    shapes, series = data[2048]
    assert shapes == ["qkv", "fc1"]
    assert sorted(series) == ["split, int8 moments", "triton, bf16 moments",
                              "triton, int8 moments", "ws, bf16 moments"]
    assert series["ws, bf16 moments"] == pytest.approx([0.5, 0.5])
    assert series["triton, bf16 moments"] == pytest.approx([1.25, 1.5])
    assert math.isnan(series["split, int8 moments"][0])  # no int8 row for qkv
    assert series["split, int8 moments"][1] == pytest.approx(0.75)
    assert data[4096][1]["ws, bf16 moments"] == pytest.approx([0.8])
    only = ratio_series(rows, ["ws"])
    assert list(only[2048][1]) == ["ws, bf16 moments"] and list(only[4096][1]) == [
        "ws, bf16 moments"]


def test_sweep_plot_floor_shows_the_lowest_bar():
    """sweep_ws.py's panels start at 0.6 unless a ratio lies under it: then at the next step
    of 0.05 under the lowest ratio less 0.05 (NaN, a shape a series lacks, is skipped)."""
    def data(*ys):
        return {2048: (["qkv", "fc1"], {"a, bf16 moments": list(ys)})}
    assert ratio_floor(data(0.8, float("nan"))) == 0.6
    assert ratio_floor(data(0.9, 0.66)) == 0.6
    assert ratio_floor(data(0.562, 0.9)) == pytest.approx(0.5)
    assert ratio_floor(data(0.55, 0.9)) == pytest.approx(0.5)
    assert ratio_floor(data(0.31, 0.9)) == pytest.approx(0.25)
    assert ratio_floor({}) == 0.6


def test_bench_kernel_plots_the_series_a_csv_has_as_numbers():
    """bench_kernel.py's plot draws each SERIES column that the CSV rows give as numbers: a
    CSV without default-route columns (absent), a run without Hopper has NaN in the WS
    kernel's, an empty cell is no number; one number among NaNs is enough (the column is
    measured)."""
    old = [{"ratio_bf16": "0.9", "ratio_int8": "1.1", "ratio_ws": "nan"}]
    new = [{"ratio_bf16": "0.9", "ratio_route_bf16": "0.85", "ratio_route_int8": ""},
           {"ratio_bf16": "0.8", "ratio_route_bf16": "nan", "ratio_route_int8": ""}]
    assert [c for c, _ in SERIES if _numbers(old, c)] == ["ratio_bf16", "ratio_int8"]
    assert [c for c, _ in SERIES if _numbers(new, c)] == ["ratio_bf16", "ratio_route_bf16"]
    assert {c for c, _ in SERIES} >= {"ratio_route_bf16", "ratio_route_int8"}


def test_write_csv_replaces_whole_files_only(tmp_path, capsys):
    """write_csv writes through a file beside the CSV and renames it over: the file holds
    every row written, and a write that fails part way (a row with a column the first row
    lacks) leaves the previous complete file and no partial file; quiet says nothing."""
    import csv
    path = tmp_path / "cells.csv"
    rows = [dict(shape="qkv", T=2048, ms=0.25), dict(shape="fc1", T=4096, ms=1.5)]
    write_csv(str(path), rows)
    assert capsys.readouterr().out == f"wrote {path}\n"
    before = path.read_text()
    assert [r["shape"] for r in csv.DictReader(path.open())] == ["qkv", "fc1"]
    with pytest.raises(ValueError):
        write_csv(str(path), rows + [dict(shape="proj", T=512, ms=0.1, extra=1)], quiet=True)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cells.csv"]
    write_csv(str(path), rows[:1], quiet=True)
    assert capsys.readouterr().out == ""
    assert [r["shape"] for r in csv.DictReader(path.open())] == ["qkv"]


def test_shape_of_takes_names_and_n_by_k_and_refuses_the_rest():
    assert shape_of("fc1") == SHAPES["fc1"] == (28672, 4096)
    assert shape_of("8192x4096") == (8192, 4096)
    for bad in ("fc3", "8192x", "0x4096", "8192x4096x2", "-1x8"):
        with pytest.raises(SystemExit, match="neither one of"):
            shape_of(bad)


def test_ab_ws_loads_fused_ws_at_a_revision_as_a_module_of_its_own():
    """The A side of benchmarks/ab_ws.py: fused_ws.py as committed at HEAD, not the tree's
    module object (the A/B compares two files)."""
    from forge_engine.kernels import fused_ws
    base = load_revision("HEAD")
    assert base is not fused_ws and base.__name__ == "fused_ws_base"
    assert callable(base.fused_wgrad_update_ws) and base.SPLIT_LARGE["EPI_GLOBAL"] is True
    with pytest.raises(SystemExit, match="neither a file nor a revision"):
        load_revision("no-such-revision-0123")


def test_ab_ws_loads_a_file_as_version_a(tmp_path):
    """--base FILE: a copy of fused_ws.py (a variant; a GPU checkout without git history) is
    loaded as its own module, its text as written."""
    from forge_engine.kernels import fused_ws
    src = Path(fused_ws.__file__).read_text()
    variant = tmp_path / "fws_variant.py"
    variant.write_text(src.replace("SPLIT_LARGE = dict(EPI_GLOBAL=True",
                                   "SPLIT_LARGE = dict(MARKER=1, EPI_GLOBAL=True"))
    base = load_revision(str(variant))
    assert base is not fused_ws and base.SPLIT_LARGE["MARKER"] == 1
    assert "MARKER" not in fused_ws.SPLIT_LARGE


def test_ab_ws_csv_from_reads_back_what_it_printed(tmp_path, monkeypatch):
    """ab_ws.py --csv-from: cell lines as main() prints them (cell_line), with fresh random
    rounds and an NxK shape, mixed with other lines, come back as rows whose version times are
    the medians of the rounds (exactly: the rounds are printed in full), under --names; the
    CSV it writes draws through sweep_ws.py's ratio_series."""
    import csv
    import random
    import statistics

    import ab_ws
    rng = random.Random()
    cells = []
    for fmt, T, shape in [("bf16", 512, "qkv"), ("int8", 2048, "1000x336"), ("bf16", 4096, "head")]:
        # three rounds: their median is not their mean
        times = {v: [rng.uniform(0.05, 9.0) for _ in range(3)] for v in ("A", "B")}
        cells.append((fmt, T, shape, rng.uniform(0.1, 10.0), times,
                      rng.choice(["equal", "DIFFERENT"])))
    log = tmp_path / "ab.txt"
    log.write_text("card: NVIDIA H200 | torch 2.11 | A = x, B = the tree | SPLIT_LARGE\n"
                   + "".join(ab_ws.cell_line(*c) + "\n" for c in cells) + "=== end\n")
    out = tmp_path / "ab.csv"
    monkeypatch.setattr(sys, "argv", ["ab_ws.py", "--csv-from", str(log), "--names",
                                      "before,fixed", "--out", str(out)])
    ab_ws.main()
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(cells)
    for r, (fmt, T, shape, unfused, times, bitwise) in zip(rows, cells):
        assert (r["states"], int(r["T"]), r["shape"], r["bitwise"]) == (fmt, T, shape, bitwise)
        assert (int(r["N"]), int(r["K"])) == shape_of(shape)
        assert float(r["unfused_ms"]) == pytest.approx(unfused, abs=5e-5)  # printed to 4 places
        assert float(r["before_ms"]) == statistics.median(times["A"])
        assert float(r["fixed_ms"]) == statistics.median(times["B"])
    series = ratio_series(rows, ["fixed"])
    assert series[512][1]["fixed, bf16 moments"] == [float(rows[0]["fixed_ms"])
                                                     / float(rows[0]["unfused_ms"])]


@pytest.mark.parametrize("argv,message", [
    (["--csv-from", "LOG"], "--csv-from needs --out CSV"),
    (["--names", "a,a", "--csv-from", "LOG", "--out", "x.csv"], "two different names"),
    (["--names", "a", "--csv-from", "LOG", "--out", "x.csv"], "two different names"),
    (["--names", "a b,c", "--csv-from", "LOG", "--out", "x.csv"], "two different names"),
    (["--csv-from", "EMPTY", "--out", "x.csv"], "no cell line of ab_ws.py in it"),
    ([], "--base REV (or FILE) is needed"),
])
def test_ab_ws_refuses_bad_flags_in_one_line(tmp_path, monkeypatch, argv, message):
    """ab_ws.py's flag errors: one line, before any GPU check or file is written."""
    import ab_ws
    (tmp_path / "EMPTY").write_text("card: NVIDIA H200\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ab_ws.py", *argv])
    with pytest.raises(SystemExit, match=re.escape(message)):
        ab_ws.main()
    assert not (tmp_path / "x.csv").exists()


def test_power_probe_names_the_clock_event_reasons_it_reports():
    """power_probe.py's reasons column: NVML's clock event bits that slow a busy GPU, by name
    (docs/performance.md reads 'sw-power-cap' off it); other bits, such
    as idle (0x1), are not reasons a busy kernel runs slower."""
    from power_probe import reasons_text
    assert reasons_text(0) == "none" and reasons_text(0x1) == "none"
    assert reasons_text(0x4) == "sw-power-cap"
    assert reasons_text(0x4 | 0x8 | 0x40) == "sw-power-cap+hw-slowdown+hw-thermal"


def test_power_probe_refuses_bad_arguments_before_it_needs_a_gpu(monkeypatch, tmp_path):
    """A misspelt shape or a missing --ws-file is one line before NVML or the GPU is asked."""
    import power_probe
    for argv, match in ((["--shapes", "fc9"], "neither one of"),
                        (["--ws-file", str(tmp_path / "none.py")], "no such file"),
                        (["--seconds", "1"], "leaves no samples")):
        monkeypatch.setattr(sys, "argv", ["power_probe.py", *argv])
        with pytest.raises(SystemExit, match=match):
            power_probe.main()


def test_power_probe_energies_keep_each_cell_to_one_run(tmp_path):
    """--plot-from's cells: energy = ms x W / 1000 per workload, the 0.85x budget at the fused
    kernel's power, and a cell a later CSV also holds replaced whole (never one card's GEMM
    beside another card's fused kernel). Values worked out by hand."""
    from bench_kernel import rows_from
    from power_probe import energies
    head = "shape,T,N,K,workload,ms,clock_mhz,power_w,reasons,samples\n"
    first = tmp_path / "a.csv"
    first.write_text(head + "fc1,2048,1,1,gemm,0.5,1500,600,none,9\n"
                     "fc1,2048,1,1,unfused,1.0,1700,650,none,9\n"
                     "fc1,2048,1,1,fused-bf16,0.8,1400,700,none,9\n"
                     "fc1,2048,1,1,fused-int8,0.9,1400,700,none,9\n"
                     "fc2,2048,1,1,gemm,0.25,1500,600,none,9\n")
    second = tmp_path / "b.csv"
    second.write_text(head + "fc1,2048,1,1,gemm,0.4,1500,500,none,9\n"
                      "fc1,2048,1,1,unfused,2.0,1700,650,none,9\n"
                      "fc1,2048,1,1,fused-bf16,1.0,1400,600,none,9\n")
    cells = energies(rows_from("x.png", f"{first},{second}"))
    fc1 = cells[(2048, "fc1")]
    assert fc1["gemm"] == pytest.approx(0.2) and fc1["fused-bf16"] == pytest.approx(0.6)
    assert "fused-int8" not in fc1  # the first card's row went with its cell
    assert fc1["budget-0.85"] == pytest.approx(0.85 * 2.0 * 600 / 1000)
    assert cells[(2048, "fc2")]["gemm"] == pytest.approx(0.15)
    with pytest.raises(SystemExit, match="needs --plot"):
        rows_from(None, str(first))


def test_power_probe_reads_instantaneous_power_and_falls_back_to_the_average():
    """power_w: NVML's instantaneous field (id 186, mW) where the driver answers it; the
    averaged nvmlDeviceGetPowerUsage where the field fails or the binding raises."""
    from power_probe import POWER_INSTANT, instant_power_w, power_w

    class NVMLError(Exception):
        pass

    def fake(ret=0, raises=False):
        def fields(handle, ids):
            assert ids == [POWER_INSTANT]
            if raises:
                raise NVMLError("not supported")
            return [SimpleNamespace(nvmlReturn=ret, value=SimpleNamespace(uiVal=612_500))]
        return SimpleNamespace(NVMLError=NVMLError, nvmlDeviceGetFieldValues=fields,
                               nvmlDeviceGetPowerUsage=lambda handle: 498_000)
    assert power_w(fake(), None) == 612.5
    assert instant_power_w(fake(ret=3), None) is None and power_w(fake(ret=3), None) == 498.0
    assert power_w(fake(raises=True), None) == 498.0


def test_convergence_names_interleave_repeats_and_pool_by_mode(tmp_path):
    """convergence.py: --repeat interleaves the modes (a budget that stops early leaves them
    about equal), a name twice is refused, and --merge pools the finished runs of several
    files by mode, the older files' "fp32-master (a)" names included. The summary's numbers
    worked out by hand: finals 3.0, 3.2 (mean 3.1, sd 0.1414) against 2.9, 3.1, 3.0 (mean
    3.0, sd 0.1): difference 0.1, standard error sqrt(0.02 / 2 + 0.01 / 3) = 0.11547."""
    import json

    from convergence import merge, mode_of, run_names, summary, summary_lines
    assert run_names(["a", "b"], 2) == ["a", "b", "a#2", "b#2"]
    with pytest.raises(SystemExit, match="twice"):
        run_names(["fp32-master", "fp32-master#2"], 2)
    assert mode_of("fp32-master (a)") == "fp32-master" and mode_of("forge-int8#12") == "forge-int8"
    assert mode_of("forge-bf16@ws0#3") == "forge-bf16@ws0"  # a variant: a mode of its own

    def rec(final):
        return {"rc": 0 if final is not None else 1, "final": final}
    first, second = tmp_path / "c1.json", tmp_path / "c2.json"
    first.write_text(json.dumps({"runs": {"fp32-master (a)": rec(2.9), "forge-bf16": rec(3.0),
                                          "fp32-master (b)": rec(3.1)}}))
    second.write_text(json.dumps({"runs": {"fp32-master": rec(3.0), "forge-bf16#2": rec(3.2),
                                           "forge-bf16#3": rec(None)}}))
    runs = merge([str(first), str(second)])
    assert sorted(runs) == ["c1/forge-bf16", "c1/fp32-master (a)", "c1/fp32-master (b)",
                            "c2/forge-bf16#2", "c2/forge-bf16#3", "c2/fp32-master"]
    s = summary(runs)
    assert s["fp32-master"]["n"] == 3 and s["forge-bf16"]["n"] == 2  # the failed run left out
    assert s["fp32-master"]["sd"] == pytest.approx(0.1)
    assert s["forge-bf16"]["minus_ref"] == pytest.approx(0.1)
    assert s["forge-bf16"]["ref"] == "fp32-master"
    assert s["forge-bf16"]["se"] == pytest.approx(math.sqrt(0.02 / 2 + 0.01 / 3))
    assert s["fp32-master"]["median"] == pytest.approx(3.0)
    other = summary(runs, "forge-bf16")  # --ref: the differences against another mode
    assert other["fp32-master"]["minus_ref"] == pytest.approx(-0.1)
    assert other["fp32-master"]["ref"] == "forge-bf16" and "ref" not in other["forge-bf16"]
    assert summary_lines(summary(runs, "bf16-mastr"), "bf16-mastr")[0] == \
        "note: no finished run of bf16-mastr (--ref): no differences below"
    second.write_text(json.dumps({"runs": {"forge-bf16@ws0": rec(3.4)}}))
    assert summary(merge([str(first), str(second)]))["forge-bf16@ws0"]["n"] == 1
    s = summary(merge([str(first), str(second)], untag=True))  # a route variant pooled
    assert s["forge-bf16"]["n"] == 2 and s["forge-bf16"]["median"] == pytest.approx(3.2)


def test_convergence_refuses_bad_arguments_before_it_prepares_data(monkeypatch, tmp_path):
    import convergence
    assert convergence.parse_variants(["ws0:FORGE_WS=0", "ws0:X={\"A\": 1}", "b:Y="]) == {
        "ws0": {"FORGE_WS": "0", "X": '{"A": 1}'}, "b": {"Y": ""}}
    for argv, match in ((["--modes", "fp32,forge-bf16"], "unknown mode"),
                        (["--per-gpu", "0"], "--per-gpu must be at least 1"),
                        (["--repeat", "2", "--modes", "forge-bf16,forge-bf16"], "twice"),
                        (["--modes", "forge-bf16@ws0"], "no --variant TAG:KEY=VALUE for it"),
                        (["--modes", "forge-bf16@ws0", "--variant", "ws0=FORGE_WS=0"],
                         "--variant takes TAG:KEY=VALUE")):
        monkeypatch.setattr(sys, "argv", ["convergence.py", "--out", str(tmp_path / "x.json"),
                                          *argv])
        monkeypatch.setattr(convergence.subprocess, "run", lambda *a, **k: pytest.fail("ran"))
        with pytest.raises(SystemExit, match=match):
            convergence.main()


def test_convergence_budget_stops_runs_and_keeps_their_losses(monkeypatch, tmp_path):
    """--budget-s is also a deadline: a run still going then is stopped with the losses it
    logged kept (no final), a run not started is listed as skipped; Ctrl-C does the same and
    exits with a message. pretrain.py is replaced by a process that logs one line and waits."""
    import json

    import convergence
    fake = ("import time; print(' iteration       10/     300 | lm loss: 5.250000E+00 |', "
            "flush=True); time.sleep(60)")

    real = subprocess.Popen  # (convergence.subprocess is this module: patched below)

    def popen(cmd, **kw):
        assert cmd[1] == "pretrain.py"
        return real([sys.executable, "-c", fake], stdout=kw["stdout"], stderr=kw["stderr"])
    monkeypatch.setattr(convergence.subprocess, "run", lambda *a, **k: None)  # data: none
    monkeypatch.setattr(convergence.subprocess, "Popen", popen)
    out = tmp_path / "c.json"
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--out", str(out), "--modes",
                                      "fp32-master", "--repeat", "2", "--budget-s", "3"])
    t = time.monotonic()
    convergence.main()
    assert time.monotonic() - t < 30  # not the fake's 60 s
    res = json.loads(out.read_text())
    run = res["runs"]["fp32-master"]
    assert run["losses"] == [[10, 5.25]] and run["final"] is None
    assert run["cut_off"] == "stopped at --budget-s 3" and res["skipped"] == ["fp32-master#2"]

    pauses, real_sleep = [], time.sleep  # (convergence.time is this module too)

    def sleep(seconds):  # the loop's second pause is a Ctrl-C (Popen.wait sleeps too)
        pauses.append(seconds)
        if len(pauses) == 2:
            raise KeyboardInterrupt
        real_sleep(min(seconds, 0.01))
    monkeypatch.setattr(convergence.time, "sleep", sleep)
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--out", str(out), "--modes",
                                      "forge-bf16"])
    with pytest.raises(SystemExit, match="interrupted: the finished runs"):
        convergence.main()
    run = json.loads(out.read_text())["runs"]["forge-bf16"]
    assert run["cut_off"] == "stopped by an interrupt" and run["final"] is None


def test_written_and_sumsq_close_shared_by_ab_ws_and_stress_kernel():
    """bench_kernel.written: W, then each present state's data and (int8) scale, in slot order;
    sumsq_close: two orders of an fp32 sum of `tiles` (64 x 128) positive terms may differ by
    at most 2 (tiles - 1) 2^-24 relative to first order (130 x 200: 3 x 2 = 6 tiles, 10 x 2^-24),
    which fresh random terms summed in shuffled orders never exceed; NaN is never close."""
    import stress_kernel  # noqa: F401  (imports the shared helpers, no GPU needed)
    from bench_kernel import sumsq_close, written

    from forge_engine.kernels import StateTensor
    w = torch.randn(130, 200)
    m = StateTensor.from_fp32(torch.randn(130, 200), "int8", False)
    v = StateTensor.from_fp32(torch.rand(130, 200), "bf16", True)
    got = written(w, [m, None, v])
    assert len(got) == 4 and got[0] is w and got[1] is m.data and got[2] is m.scale
    assert got[3] is v.data
    assert sumsq_close(1.0 + 9.999 * 2.0 ** -24, 1.0, 130, 200)
    assert not sumsq_close(1.0 + 10.001 * 2.0 ** -24, 1.0, 130, 200)
    assert not sumsq_close(1.0 + 2.0 ** -30, 1.0, 64, 128)  # one tile: one order, exact
    assert sumsq_close(0.0, 0.0, 0, 128)  # no tile: nothing summed, equal values close
    seed = int(torch.randint(0, 2**31, ()))
    gen = torch.Generator().manual_seed(seed)
    widest = 0.0
    for _ in range(2000):  # the terms of 6 tiles, spread over decades, in two random orders
        terms = torch.exp(torch.randn(6, generator=gen, dtype=torch.float64) * 3).float()
        sums = []
        for order in (torch.randperm(6, generator=gen), torch.randperm(6, generator=gen)):
            acc = torch.zeros((), dtype=torch.float32)
            for t in terms[order]:
                acc = acc + t  # fp32 rounding after every add, as each atomic add does
            sums.append(acc.item())
        assert sumsq_close(sums[0], sums[1], 130, 200), (seed, terms, sums)
        widest = max(widest, abs(sums[0] - sums[1]) / sums[1])
    assert widest > 0  # reordering did change some sums: the check above was not vacuous
    assert not sumsq_close(float("nan"), 1.0, 130, 200)


def test_stress_hammer_counts_finite_wrong_and_skipped_tiles(monkeypatch, capsys):
    """stress_kernel.hammer on the CPU (the Triton kernel, interpreted; a shape that is not a
    multiple of the tiles): of four launches compared on the device with the first result, a
    finite wrong weight is counted as 'differ', a skipped tile with a NaN sumsq as
    'non-finite', and describe_bad says which (a tile holding the input W unchanged)."""
    import stress_kernel
    from bench_kernel import moments, problem

    torch.manual_seed(7)
    T, N, K = 96, 130, 200
    x, dy, w, m0, v0, spec, hp_list = problem(T, N, K, torch.device("cpu"))
    hp = torch.tensor(hp_list)
    st = moments(m0, v0, "bf16")
    cfg = stress_kernel.route_config("triton")
    ref_w, ref_st, ref_s = w.clone(), stress_kernel.clone_states(st), torch.zeros(1)
    stress_kernel.fused_wgrad_update(x, dy, ref_w, ref_st, spec, hp, ref_s, 1, True, config=cfg)
    assert not torch.equal(ref_w, w)  # the update moved W
    real, calls = stress_kernel.fused_wgrad_update, []

    def faulty(x, dy, ww, states, spec, hp, s, seed, stochastic, config=None):
        real(x, dy, ww, states, spec, hp, s, seed, stochastic, config=config)
        calls.append(1)
        if len(calls) == 2:  # a finite wrong element
            ww[3, 150] = ww[3, 150] * 2 + 1
        if len(calls) == 4:  # a tile skipped as non-finite: W there as it was read
            ww[128:130, 128:200] = w[128:130, 128:200]
            s.fill_(float("nan"))
    monkeypatch.setattr(stress_kernel, "fused_wgrad_update", faulty)
    cell = dict(name="cell", x=x, dy=dy, w=w, st=st, spec=spec, hp=hp, config=cfg,
                ref=stress_kernel.written(ref_w, ref_st), ref_s=ref_s,
                tol=2 * 2 * 2.0 ** -24 * abs(ref_s.item()))
    failures = stress_kernel.hammer([cell], seconds=1e-9, poison=False, gemm=False,
                                    check_every=4)
    assert len(calls) == 4 and cell["launches"] == 4
    assert (cell["differ"], cell["nonfinite"], cell["sumsq_off"], failures) == (1, 1, 0, 2)
    assert "1 elements differ in 1 tile(s) of 128x128, 0 of them the input W unchanged, " \
           "0 non-finite values" in cell["notes"][0]
    assert "sumsq nan" in cell["notes"][1]
    assert "1 tile(s) of 128x128, 1 of them the input W unchanged" in cell["notes"][1]


def test_convergence_median_difference_bootstrap():
    """convergence.median_diff_ci: constant samples give their difference exactly; fresh
    normal samples 0.5 apart (sd 0.1, 40 each: the median difference's standard error is
    about 0.03) give an interval around 0.5 that excludes 0; one run far out (a late exit from
    the plateau) moves the interval by little, where it moves the mean by 2.4; the same data
    give the same interval. summary() reports it beside the mean's difference."""
    import random

    import convergence
    assert convergence.median_diff_ci([2.0] * 5, [1.0] * 7) == (1.0, 1.0)
    rng = random.Random()  # fresh draws each run
    b = [rng.gauss(3.0, 0.1) for _ in range(40)]
    a = [rng.gauss(3.5, 0.1) for _ in range(40)]
    lo, hi = convergence.median_diff_ci(a, b)
    assert 0.3 < lo < hi < 0.7
    assert convergence.median_diff_ci(a, b) == (lo, hi)
    lo2, hi2 = convergence.median_diff_ci(a + [100.0], b)
    assert abs(lo2 - lo) < 0.1 and abs(hi2 - hi) < 0.1
    runs = {f"fp32-master#{i}": dict(final=x) for i, x in enumerate(b, 1)}
    runs.update({f"forge-bf16#{i}": dict(final=x) for i, x in enumerate(a, 1)})
    row = convergence.summary(runs)["forge-bf16"]
    assert row["median_ci95"] == (lo, hi)
    assert row["median_minus_ref"] == pytest.approx(
        sorted(a)[19] / 2 + sorted(a)[20] / 2 - sorted(b)[19] / 2 - sorted(b)[20] / 2)
    line = convergence.summary_lines({"forge-bf16": row})[-1]
    assert f"95% {lo:+.4f} to {hi:+.4f} (bootstrap)" in line


@pytest.mark.parametrize("argv,message", [
    (["--poison"], "--poison and --gemm go with --hammer"),
    (["--hammer", "5", "--routes", "large,norm"], "--hammer takes update routes, not norm"),
    (["--hammer", "5", "--check-every", "0"], "--check-every >= 1"),
    (["--routes", "large,split"], "unknown route(s) ['split']"),
])
def test_stress_kernel_refuses_bad_flags_before_any_work(monkeypatch, argv, message):
    """stress_kernel.py's flag errors: one line, before it asks for a GPU (these run on the
    CPU, where the next check would be 'needs a GPU')."""
    import stress_kernel
    monkeypatch.setattr(sys, "argv", ["stress_kernel.py", *argv])
    with pytest.raises(SystemExit, match=re.escape(message)):
        stress_kernel.main()


def test_convergence_losses_at_takes_medians_of_finished_runs(tmp_path, monkeypatch, capsys):
    """--merge --at: per mode, the median logged loss at the named iterations over the
    finished runs that kept their curves (a stopped run and a run without curves left out;
    an iteration no run logged: none), in the printout and the JSON; --at alone is refused."""
    import json

    import convergence

    def rec(final, losses):
        return {"rc": 0 if final is not None else 1, "final": final, "losses": losses}
    src = tmp_path / "c.json"
    src.write_text(json.dumps({"runs": {
        "fp32-master": rec(3.0, [[10, 5.0], [20, 4.0]]),
        "fp32-master#2": rec(3.1, [[10, 5.2], [20, 4.4]]),
        "fp32-master#3": rec(3.2, [[10, 5.4], [20, 4.1]]),
        "fp32-master#4": rec(None, [[10, 9.0]]),
        "forge-bf16": rec(2.9, [])}}))
    got = convergence.losses_at(convergence.merge([str(src)]), [10, 20, 30])
    assert got["fp32-master"] == {10: (5.2, 3), 20: (4.1, 3), 30: (None, 0)}
    assert got["forge-bf16"] == {10: (None, 0), 20: (None, 0), 30: (None, 0)}
    out = tmp_path / "pooled.json"
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--merge", str(src), "--at", "10,20",
                                      "--out", str(out)])
    convergence.main()
    assert "fp32-master median logged loss at 10: 5.2000 (n 3), at 20: 4.1000 (n 3)" in \
        capsys.readouterr().out
    assert json.loads(out.read_text())["losses_at"]["fp32-master"]["20"] == [4.1, 3]
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--at", "10"])
    with pytest.raises(SystemExit, match="--at goes with --merge"):
        convergence.main()
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--merge", str(src), "--at", "1x"])
    with pytest.raises(SystemExit, match="--at takes comma-separated iterations"):
        convergence.main()


def test_bench_hf_smoke_on_the_cpu(tmp_path, monkeypatch, capsys):
    """bench_hf.py --device cpu: transformers' tiny Llama in the plain loop with torch's AdamW
    and with FORGE, one timed step each; the same first loss (same weights, same tokens) and
    the ratios against torch in the table; --host: the hooked step's linear backward nodes,
    one per linear (the tiny preset has 7 per layer and the head); --profile: each phase's
    functions under cProfile."""
    import bench_hf
    monkeypatch.setenv("FORGE_BACKEND", "torch")
    out = tmp_path / "hf.json"
    assert bench_hf.main(["--device", "cpu", "--warmup", "2", "--steps", "1", "--host",
                          "--profile", "400", "--timeline", "--modes", "torch-fused,forge-bf16",
                          "--unsynced", "2", "--out", str(out)]) == 0
    import json
    res = json.loads(out.read_text())["results"]
    assert [r["status"] for r in res.values()] == ["ok", "ok"]
    assert res["forge-bf16"]["losses"][0] == res["torch-fused"]["losses"][0]
    # --unsynced 2: two more steps (their losses kept) timed together, in their own table
    for r in res.values():
        assert len(r["losses"]) == 2 + 1 + 2
        assert len(r["unsynced_round_ms"]) == 1 and r["unsynced_ms"] > 0
    # FORGE's linears: torch's dX node, the update in a hook on it (linear._hooked_linear)
    linears = res["forge-bf16"]["host"]["nodes"]["MmBackward0"]
    assert linears["count"] == res["torch-fused"]["host"]["nodes"]["MmBackward0"]["count"]
    assert linears["count"] == 7 * 2 + 1 and linears["median_us"] > 0
    # FORGE's hook on each of them, and the update's launch within it for each but the head
    # (tied to the embedding: stashed, and updated at step())
    nodes = res["forge-bf16"]["host"]["nodes"]
    assert nodes["FORGE hook"]["count"] == 15 and nodes["FORGE launch"]["count"] == 14
    # each hook runs inside its node: paired times, so the medians are ordered too
    assert 0 < nodes["FORGE hook"]["median_us"] <= linears["median_us"]
    assert nodes["FORGE launch"]["median_us"] > 0
    assert "FORGE hook" not in res["torch-fused"]["host"]["nodes"]
    # --profile: each phase's functions by own time, each phase in its own profile: FORGE's
    # Slot.backward_update in the backward, once a step for each of the 15 linears (the
    # tied head's stashes its segment); its _hooked_linear in the forward, once a step for
    # each of the 15 linears (the head among them), and neither in another phase; its step()
    # once a step, in the step's profile alone
    def calls(mode, phase, prefix):
        return [r["calls"] for r in res[mode][f"{phase}_profile"]
                if r["function"].startswith(prefix)]
    assert calls("forge-bf16", "backward", "backward_update (slots.py") == [15]
    assert calls("forge-bf16", "forward", "_hooked_linear (linear.py") == [15]
    assert calls("forge-bf16", "step", "step (base.py") == [1]
    for phase, others in (("backward", ("forward", "step")), ("forward", ("backward", "step"))):
        name = "backward_update (slots.py" if phase == "backward" else "_hooked_linear ("
        assert all(calls("forge-bf16", o, name) == [] for o in others)
    assert calls("forge-bf16", "forward", "step (base.py") == []
    for phase in bench_hf.PHASES:
        rows = res["torch-fused"][f"{phase}_profile"]
        assert rows and rows == sorted(rows, key=lambda r: -r["own_us"])
        assert not any(r["function"].startswith(("backward_update (slots.py",
                                                  "_hooked_linear (linear.py")) for r in rows)
    host = res["forge-bf16"]["host"]
    assert host["backward_ms"] > 0 and host["step_ms"] > 0 and host["forward_ms"] > 0
    # --timeline: each phase's host range inside the step's span; no device on the CPU
    for mode in ("torch-fused", "forge-bf16"):
        t = res[mode]["timeline"]
        assert all(t[p]["host_ms"] > 0 and t[p]["busy_ms"] is None and t[p]["idle_ms"] is None
                   for p in bench_hf.PHASES)
        # (in every step each phase lies within the step, so their medians are ordered too)
        assert all(t[p]["host_ms"] <= t["span_ms"] for p in bench_hf.PHASES)
        assert t["kernels"] == {p: [] for p in bench_hf.PHASES}
    printed = capsys.readouterr().out
    assert "| forge-bf16 | ok |" in printed and "MmBackward0 x15" in printed
    ratio = res["forge-bf16"]["unsynced_ms"] / res["torch-fused"]["unsynced_ms"]
    assert f"| forge-bf16 | {res['forge-bf16']['unsynced_ms']:.1f} | {ratio:.3f} | " in printed
    assert "| forge-bf16 | " + f"{res['forge-bf16']['timeline']['span_ms']:.1f} |" in printed
    # each row's ratios are against torch run the same way
    assert [bench_hf.baseline(m) for m in ("forge-int8", "forge-bf16-graph",
                                           "forge-int8-compile", "torch-fused-compile",
                                           "forge-int8-compile-graph")] == \
        ["torch-fused", "torch-fused-graph", "torch-fused-compile", "torch-fused-compile",
         "torch-fused-compile-graph"]
    assert all(bench_hf.baseline(m) in bench_hf.MODES for m in bench_hf.MODES)


def test_bench_hf_gpt2_fuses_its_conv1d_weights(tmp_path, monkeypatch, capsys):
    """bench_hf.py --model gpt2-xl (on the CPU: gpt2-tiny): transformers' GPT-2, whose linears
    are Conv1D modules, trains in the plain loop with FORGE fusing every weight matrix, from
    the same first loss as torch; an unknown model or a sequence past GPT-2's 1024 positions
    is one line before any work."""
    import json
    import bench_hf
    monkeypatch.setenv("FORGE_BACKEND", "torch")
    out = tmp_path / "hf.json"
    assert bench_hf.main(["--device", "cpu", "--model", "gpt2-xl", "--warmup", "2", "--steps",
                          "1", "--modes", "torch-fused,forge-bf16", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert [r["status"] for r in res.values()] == ["ok", "ok"]
    summary = res["forge-bf16"]["summary"]
    assert summary.startswith("FORGE: fused 10 of 10 weight matrices")
    assert summary.endswith("standard path: none")
    assert res["forge-bf16"]["losses"][0] == res["torch-fused"]["losses"][0]
    assert "gpt2-tiny b1 x 32" in capsys.readouterr().out
    for argv, said in ((["--model", "gpt3"], "--model 'gpt3': not a preset"),
                       (["--model", "gpt2", "--seq", "2048"], "GPT-2 has 1024 positions")):
        assert bench_hf.main(argv + ["--device", "cpu"]) == 2
        assert said in capsys.readouterr().err


def test_bench_hf_clip_modes_run_trainers_step(tmp_path, monkeypatch):
    """bench_hf.py's *-clip modes: clip_grad_norm_(model.parameters(), 1.0) before step(), as
    transformers.Trainer does by default. FORGE's updates="auto" moves the updates into
    step() (the plain mode keeps them in backward), and its norm before clipping is torch's:
    the same weights and tokens in the first step, where torch's norm is of bf16 gradients
    (each element within 2**-8 of the exact one, so the norm too) and FORGE's of its
    exactly summed segments."""
    import bench_hf
    monkeypatch.setenv("FORGE_BACKEND", "torch")
    out = tmp_path / "hf.json"
    assert bench_hf.main(["--device", "cpu", "--warmup", "2", "--steps", "2", "--modes",
                          "torch-fused-clip,forge-bf16-clip,forge-bf16", "--out",
                          str(out)]) == 0
    import json
    res = json.loads(out.read_text())["results"]
    assert [r["status"] for r in res.values()] == ["ok"] * 3
    assert res["forge-bf16-clip"]["updates"] == "step"
    assert res["forge-bf16"]["updates"] == "backward" and "grad_norms" not in res["forge-bf16"]
    torch_norms, forge_norms = (res[m]["grad_norms"] for m in ("torch-fused-clip",
                                                               "forge-bf16-clip"))
    assert len(torch_norms) == len(forge_norms) == 2 + 2
    assert torch_norms[0] > 1  # the clipping scales this step's update
    assert forge_norms[0] == pytest.approx(torch_norms[0], rel=2 ** -7)
    assert bench_hf.baseline("forge-int8-clip") == "torch-fused-clip"


def test_bench_hf_trainer_modes_run_trainers_own_loop(tmp_path, monkeypatch):
    """bench_hf.py's *-trainer modes: transformers.Trainer trains on the token stream of the
    other modes. Its first step is the *-clip modes' step (same weights, tokens, clipping and
    rate), so the first two losses are theirs bit for bit; from the second step on its linear
    schedule lowers the rate, so the third differs. FORGE updates in step() there too, and
    each timed step is one interval between step ends."""
    import bench_hf
    monkeypatch.setenv("FORGE_BACKEND", "torch")
    out = tmp_path / "hf.json"
    modes = ["torch-fused-clip", "forge-bf16-clip", "torch-fused-trainer", "forge-bf16-trainer"]
    assert bench_hf.main(["--device", "cpu", "--warmup", "2", "--steps", "2", "--modes",
                          ",".join(modes), "--out", str(out)]) == 0
    import json
    res = json.loads(out.read_text())["results"]
    assert [res[m]["status"] for m in modes] == ["ok"] * 4
    for who in ("torch-fused", "forge-bf16"):
        clip, trainer = res[f"{who}-clip"], res[f"{who}-trainer"]
        assert len(trainer["losses"]) == 4 and len(trainer["step_ms"]) == 2
        assert trainer["losses"][:2] == clip["losses"][:2]
        assert trainer["losses"][2] != clip["losses"][2]
    assert res["forge-bf16-trainer"]["updates"] == "step"
    assert bench_hf.baseline("forge-int8-trainer") == "torch-fused-trainer"


@pytest.mark.parametrize("args, message", [
    (["--modes", "torch-fused,sgd"], "unknown modes ['sgd']"),
    (["--warmup", "1"], "--warmup must be >= 2"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--unsynced", "-1"], "--unsynced must be >= 0")])
def test_bench_hf_refuses_bad_arguments_in_one_line(args, message, tmp_path, capsys):
    """bench_hf.py: a bad argument gets one line and status 2 before any model is built."""
    import bench_hf
    assert bench_hf.main(["--device", "cpu", "--out", str(tmp_path / "x.json"), *args]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [err.strip()] and message in err
    assert not (tmp_path / "x.json").exists()


def test_bench_hf_timeline_union_of_device_intervals():
    """bench_hf._covered: the device's busy time in a window is the union of its intervals
    clipped to the window, overlaps counted once, against a brute-force count over a grid."""
    import random
    import bench_hf
    rng = random.Random()
    for _ in range(200):
        iv = sorted((s, s + rng.randint(0, 30)) for s in (rng.randint(0, 200) for _ in range(8)))
        lo, hi = sorted(rng.sample(range(0, 240), 2))
        brute = sum(any(s <= t < e for s, e in iv) for t in range(lo, hi))
        assert bench_hf._covered(iv, lo, hi) == brute


def test_bench_hf_timeline_counts_kernels_not_annotations():
    """A record_function range on the main thread (the forward's, the optimizer's step) has a
    span on the device too, from its first kernel to its last; it is no device work."""
    import bench_hf

    class Typed:  # a kineto event that names its activity (torch 2.13)
        def __init__(self, activity):
            self.activity_type = lambda: activity

    class Flagged:  # one that only flags a range (torch 2.11's)
        def __init__(self, annotation):
            self.is_user_annotation = lambda: annotation

    assert [bench_hf.device_work(Typed(a)) for a in ("kernel", "gpu_memcpy", "gpu_memset",
                                                     "gpu_user_annotation")] == [True] * 3 + [False]
    assert [bench_hf.device_work(Flagged(a)) for a in (False, True)] == [True, False]


def test_bench_hf_compiled_modes_run_every_layer_compiled(tmp_path, monkeypatch):
    """bench_hf.py's *-compile modes: each decoder layer compiled (its autograd graph holds
    one compiled region a layer, checked in the run), FORGE's first loss torch's."""
    import bench_hf
    monkeypatch.setenv("FORGE_BACKEND", "torch")
    out = tmp_path / "hf.json"
    assert bench_hf.main(["--device", "cpu", "--warmup", "2", "--steps", "1", "--modes",
                          "torch-fused-compile,forge-bf16-compile", "--out", str(out)]) == 0
    import json
    res = json.loads(out.read_text())["results"]
    assert [(r["status"], r["compiled_layers"]) for r in res.values()] == [("ok", 2)] * 2
    assert res["forge-bf16-compile"]["losses"][0] == \
        pytest.approx(res["torch-fused-compile"]["losses"][0], rel=1e-5)


def test_bench_host_smoke_on_the_cpu(tmp_path, monkeypatch, capsys):
    """bench_host.py --device cpu: one linear per shape of the tiny preset's block, torch and
    FORGE in both formats, a host time for each in the JSON and the table, and FORGE's hook
    and launch timed within the node; with --blocks, the same in one backward of a block."""
    import bench_host
    monkeypatch.setenv("FORGE_BACKEND", "torch")
    out = tmp_path / "host.json"
    assert bench_host.main(["--device", "cpu", "--blocks", "1", "--out", str(out)]) == 0
    import json
    full = json.loads(out.read_text())
    res = full["results"]
    assert list(res) == ["q", "k/v", "o", "gate/up", "down"]
    assert res["gate/up"]["shape"] == [176, 64] and res["down"]["shape"] == [64, 176]
    assert all(0 < r[m]["node_us"] <= r[m]["call_us"] for r in res.values()
               for m in bench_host.MODES)
    # FORGE's hook runs inside the node, and the update's launch inside the hook
    assert all(0 < r[m]["launch_us"] <= r[m]["hook_us"] <= r[m]["node_us"]
               for r in res.values() for m in ("forge-bf16", "forge-int8"))
    # --blocks: one backward of a block's seven linears, each node timed, and in FORGE's
    # nodes its hook and launch
    step = full["step"]
    assert list(step) == list(bench_host.MODES)
    assert all(r["linears"] == 7 and 0 < r["node_us"] <= r["call_ms"] * 1e3
               for r in step.values())
    assert all(0 < step[m]["launch_us"] <= step[m]["hook_us"] <= step[m]["node_us"]
               for m in ("forge-bf16", "forge-int8"))
    printed = capsys.readouterr().out
    assert "| down 64x176 |" in printed and "| forge-int8 |" in printed


def test_bench_hf_checkpoint_smoke_on_the_cpu(tmp_path):
    """bench_hf_checkpoint.py --tiny: writes the directory, runs pretrain.py --hf-checkpoint
    with and without FORGE, and parses both logs into the CSV."""
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "benchmarks/bench_hf_checkpoint.py", "--tiny",
                        "--iters", "4", "--log-interval", "2", "--workdir", str(tmp_path / "w"),
                        "--out", str(tmp_path / "o")], cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = (tmp_path / "o" / "hf_checkpoint.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[1].split(",")[4] == "forge" and \
        rows[2].split(",")[4] == "no-forge"


def test_closeness_sweep_reports_its_cases_and_restores_what_it_patched(capsys, monkeypatch):
    """Two seeds of a test loop and of a defect: one line each, the defect needing more than
    tests/closeness.py's K; the tests' assert_fp32_close, os.urandom, torch's generator and the
    environment are as before."""
    import closeness
    import closeness_sweep
    import test_drop_in
    monkeypatch.setenv("FORGE_BACKEND", "triton")
    urandom, rng = os.urandom, torch.random.get_rng_state()
    assert closeness_sweep.main(["--seeds", "0:2", "clip", "defect:beta1 0.89"]) == 0
    assert os.environ["FORGE_BACKEND"] == "triton"
    assert torch.equal(torch.random.get_rng_state(), rng)
    out = capsys.readouterr().out
    assert "clip: seeds 0..1 (2 runs" in out
    smallest = re.search(r"defect:beta1 0\.89: .*smallest both ([0-9.]+)", out)
    assert float(smallest.group(1)) > closeness.K
    assert test_drop_in.assert_fp32_close is closeness.assert_fp32_close
    assert os.urandom is urandom


def test_bench_hf_triton_modes_switch_the_routing_for_their_run(monkeypatch):
    """bench_hf's forge-*-triton modes: FORGE_WS_SPLIT=0 while the mode runs (the routing
    fused_update reads), the environment's own value after it, set or unset."""
    import bench_hf
    from forge_engine.kernels import fused_update as fu
    for name in ("_WS_FLAG", "_WS_SPLIT", "_WS_LARGE"):  # (restored after the test, failed too)
        monkeypatch.setattr(fu, name, getattr(fu, name))
    assert bench_hf.MODES["forge-int8-triton"]["switches"] == {"ws_split": "0"}
    assert bench_hf.baseline("forge-bf16-triton") == "torch-fused"
    for before in (None, "1"):
        if before is None:
            monkeypatch.delenv("FORGE_WS_SPLIT", raising=False)
        else:
            monkeypatch.setenv("FORGE_WS_SPLIT", before)
        fu.read_routing()
        outside = fu._WS_SPLIT
        with bench_hf.switched(bench_hf.MODES["forge-bf16-triton"]["switches"]):
            assert fu._WS_SPLIT == "0" and os.environ["FORGE_WS_SPLIT"] == "0"
        assert os.environ.get("FORGE_WS_SPLIT") == before and fu._WS_SPLIT == outside
    assert outside == "1"
