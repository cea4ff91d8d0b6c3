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


_STREAMS = """
import torch
from headrace.kernels.allreduce_norm import allreduce_add_rms_norm, allreduce_add_rms_norm_ref
from headrace.kernels.device import num_sms
world, dev = 2, torch.device("cuda")
programs = num_sms(dev) // world  # both ranks' programs resident at once on the one GPU
for dtype, rows, hidden in ((torch.bfloat16, 1, 4096), (torch.bfloat16, 300, 4096), (torch.float32, 37, 1000)):
    buffers = [torch.zeros(rows * hidden, dtype=dtype, device=dev) for _ in range(world)]
    pads = [torch.zeros(2 * programs * world, dtype=torch.int32, device=dev) for _ in range(world)]
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=dev)
    pad_ptrs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device=dev)
    gen = torch.Generator(dev).manual_seed(rows)
    parts = [torch.randn(rows, hidden, generator=gen, device=dev).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=gen, device=dev).to(dtype)
    weight = (torch.rand(hidden, generator=gen, device=dev) + 0.5).to(dtype)
    want_out, want_res = allreduce_add_rms_norm_ref(parts, residual.clone(), weight, 1e-6)
    streams = [torch.cuda.Stream() for _ in range(world)]
    for call in range(3):
        res = [residual.clone() for _ in range(world)]
        torch.cuda.synchronize()
        outs = []
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                outs.append(allreduce_add_rms_norm(parts[r], res[r], weight, 1e-6, buffer_ptrs, pad_ptrs, r,
                                                   world, programs)[0])
        torch.cuda.synchronize()
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # the norm's last-bit flips, as tests/test_layer_kernels.py
        for r in range(world):
            torch.testing.assert_close(outs[r], want_out, rtol=tol, atol=tol)
            assert torch.equal(res[r], want_res), (dtype, rows, call, r)  # the sum and add round exactly
        assert torch.equal(outs[0], outs[1])  # and every rank gets the same
    assert all(int(p.abs().sum()) == 0 for p in pads)
print("ok")
"""


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_fused_allreduce_add_rms_norm_on_a_gpu_with_two_ranks_as_two_streams():
    """Both ranks' kernels run at once on one GPU, each on its own stream, with their buffers and pads in
    that GPU's memory: the barrier's system-scope atomics and the sums on the device, against the reference
    (a separate process, so that a barrier that never opens fails the test instead of hanging it)."""
    proc = subprocess.run([sys.executable, "-c", _STREAMS], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
