"""The fused all-reduce + residual add + RMSNorm kernel under the Triton
interpreter: one process per rank, their buffers and signal pads in files
every rank maps (as GPUs map their peers' memory), against the torch
reference, bit for bit, twice in a row (the pads must come back zeroed)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "allreduce_rank.py")


@pytest.mark.parametrize("world,rows,hidden,dtype,programs", [
    (2, 1, 64, "bfloat16", 4),  # one row, one program (a decode step of one request)
    (2, 7, 100, "bfloat16", 3),  # rows shared out over programs, hidden not a power of two
    (2, 9, 64, "float32", 2),
    (4, 5, 32, "bfloat16", 5),  # four ranks
])
def test_fused_allreduce_add_rms_norm_matches_the_reference(tmp_path, world, rows, hidden, dtype, programs):
    itemsize = 4 if dtype == "float32" else 2
    for r in range(world):
        (tmp_path / f"buffer{r}").write_bytes(bytes(rows * hidden * itemsize))
        (tmp_path / f"pad{r}").write_bytes(bytes(4 * 2 * programs * world))
    args = [str(world), str(rows), str(hidden), dtype, str(programs), str(tmp_path)]
    procs = [subprocess.Popen([sys.executable, RANK, str(r), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0] * world, outs
    for r in range(world):  # every flag back to zero
        assert not any((tmp_path / f"pad{r}").read_bytes())
