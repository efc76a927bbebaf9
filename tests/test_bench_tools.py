"""Helpers of the benchmarks whose numbers docs/benchmarks.md reports."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_step import device_gaps  # noqa: E402

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


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
