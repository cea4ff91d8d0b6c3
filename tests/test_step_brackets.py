"""benchmarks_common.by_rows, which splits a benchmark run's steps by batch rows (throughput.py --by-rows)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from benchmarks_common import StepShape, by_rows  # noqa: E402


class Floor:
    """A floor of 1 ms a step plus 1 us a cached token, and 1 us a computed token as its FLOPs term."""

    def seconds(self, steps, kv_tokens, tokens, sampled_rows, pairs):
        return steps * 1e-3 + kv_tokens * 1e-6, tokens * 1e-6


def test_steps_fall_in_their_brackets_with_their_time_wait_and_floor():
    shapes = [StepShape(2, 600, 600, 1, 0),  # a prefill chunk beside a decode row: mixed
              StepShape(4, 4, 1000, 4, 0), StepShape(8, 8, 2000, 8, 0),  # decode, 1-8 rows
              StepShape(9, 9, 3000, 9, 0),  # 9-32
              StepShape(200, 200, 100_000, 200, 0)]  # 129+
    spans = [(0.005, 0.0), (0.002, 0.001), (0.003, 0.0), (0.004, 0.0005), (0.2, 0.0)]
    lines = by_rows(shapes, spans, Floor())
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert list(rows) == ["1-8", "9-32", "129+", "mixed"]  # brackets in order; none for 33-128
    steps, gpu, wait, floor, ratio = rows["1-8"]
    assert int(steps) == 2 and float(gpu) == pytest.approx(0.005) and float(wait) == pytest.approx(0.001)
    # floor: 2 steps' 1 ms, 3000 cached tokens' 3 ms, 12 computed tokens' 12 us
    assert float(floor) == pytest.approx(0.005012, abs=1e-3) and float(ratio) == pytest.approx(0.006 / 0.005012, abs=0.01)
    assert rows["mixed"][:3] == ["1", "0.005", "0.000"]
    assert float(rows["129+"][3]) == pytest.approx(0.001 + 0.1 + 0.0002, abs=1e-3)


def test_unmatched_steps_are_refused():
    with pytest.raises(ValueError, match="2 recorded steps but 1 timed"):
        by_rows([StepShape(1, 1, 1, 1, 0)] * 2, [(0.001, 0.0)], Floor())
