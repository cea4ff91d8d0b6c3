"""One rank of tests/test_allreduce_norm.py: maps every rank's buffer and signal
pad (files shared by the ranks' processes), runs the fused all-reduce + residual
add + RMSNorm under the Triton interpreter, and checks it against the torch
reference. Usage: python tests/allreduce_rank.py RANK WORLD ROWS HIDDEN DTYPE PROGRAMS DIR"""
from __future__ import annotations

import mmap
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from headrace.kernels.allreduce_norm import allreduce_add_rms_norm, allreduce_add_rms_norm_ref  # noqa: E402


def main() -> None:
    rank, world, rows, hidden = map(int, sys.argv[1:5])
    dtype, programs, directory = getattr(torch, sys.argv[5]), int(sys.argv[6]), sys.argv[7]
    maps = []
    for name in [f"buffer{r}" for r in range(world)] + [f"pad{r}" for r in range(world)]:
        with open(os.path.join(directory, name), "r+b") as f:
            maps.append(mmap.mmap(f.fileno(), 0))
    buffers = [torch.frombuffer(m, dtype=dtype) for m in maps[:world]]
    pads = [torch.frombuffer(m, dtype=torch.int32) for m in maps[world:]]
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    pad_ptrs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)  # the same inputs on every rank
    parts = [torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    want_out, want_res = allreduce_add_rms_norm_ref(parts, residual.clone(), weight, 1e-6)
    for call in range(2):  # a second call reuses the buffers and the pads the first left zeroed
        res = residual.clone()
        out, res = allreduce_add_rms_norm(parts[rank], res, weight, 1e-6, buffer_ptrs, pad_ptrs, rank, world,
                                          programs)
        # float32 keeps the sum of squares' order visible (the kernel sums in its
        # own order, as norm.py's does); bfloat16 rounds it away.
        close = torch.equal(out, want_out) if dtype != torch.float32 else \
            torch.allclose(out, want_out, rtol=1e-6, atol=1e-6)
        if not (close and torch.equal(res, want_res)):
            print(f"rank {rank} call {call}: max error {(out.float() - want_out.float()).abs().max().item()} "
                  f"(normalised), {(res.float() - want_res.float()).abs().max().item()} (residual)")
            raise SystemExit(1)
    del buffers, pads
    print("ok", flush=True)


if __name__ == "__main__":
    main()
