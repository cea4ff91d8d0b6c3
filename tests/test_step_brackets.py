"""benchmarks_common.by_rows, which splits a benchmark run's steps by batch rows (throughput.py --by-rows), and
GcPauses, which times the garbage collector's pauses over a run."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from benchmarks_common import GcPauses, ScheduleRecorder, StepShape, by_rows  # noqa: E402


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


def test_schedule_recorder_keeps_each_step_and_the_totals():
    """Two steps through a stand-in executor: a prefill chunk of 4 tokens over 2 cached, then one decode
    token for each of two requests; the totals are the steps' sums, and detach restores execute."""
    from types import SimpleNamespace as NS

    def execute(sched):
        return "queued"

    core = NS(executor=NS(execute=execute))
    rec = ScheduleRecorder(core)
    a, b = NS(request_id="a", num_computed_tokens=6), NS(request_id="b", num_computed_tokens=3)
    assert core.executor.execute(NS(reqs=[a], num_scheduled_tokens={"a": 4}, total_num_scheduled_tokens=4,
                                    samples=[True])) == "queued"
    a.num_computed_tokens = 7
    core.executor.execute(NS(reqs=[a, b], num_scheduled_tokens={"a": 1, "b": 1}, total_num_scheduled_tokens=2,
                             samples=[True, True]))
    # a: 2 cached + 4 new (pairs 4 * 2 + 10); then a 6 + 1, b 2 + 1 (pairs 6 + 1 and 2 + 1)
    assert rec.per_step == [StepShape(1, 4, 6, 1, 18), StepShape(2, 2, 10, 2, 10)]
    assert (rec.steps, rec.tokens, rec.kv_tokens, rec.sampled_rows, rec.pairs) == (2, 6, 16, 3, 28)
    rec.detach()
    assert core.executor.execute is execute


def test_gc_pauses_counts_the_collections_made_while_attached():
    import gc

    with GcPauses() as pauses:
        gc.collect(0)
        gc.collect()
    gc.collect()  # detached: not counted
    gens = [gen for gen, _ in pauses.pauses]  # an automatic young collection may come first
    assert gens[-2:] == [0, 2] and gens.count(2) == 1
    assert all(seconds >= 0 for _, seconds in pauses.pauses)
    summary = pauses.summary()
    assert summary.startswith("host GC ") and f" in {len(gens)} collections, 1 full (longest " in summary
