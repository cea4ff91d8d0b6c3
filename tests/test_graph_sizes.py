"""The CUDA graphs' size tables (executor/cuda_graphs.py), which the GPU path pads steps and LM-head rows to."""
from __future__ import annotations

from headrace.executor.cuda_graphs import capture_sizes, logit_rows, mixed_token_counts


def test_logit_rows_pads_to_the_next_decode_size():
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert [logit_rows(sizes, n) for n in (1, 3, 8, 9, 17, 129, 256)] == [1, 4, 8, 16, 32, 144, 256]
    assert logit_rows(sizes, 300) == 300  # past the largest: as it is
    # every count from 1 to 256 lands on one of the 20 sizes
    assert {logit_rows(sizes, n) for n in range(1, 257)} == set(sizes) and len(sizes) == 20


def test_capture_sizes_end_at_max_num_seqs():
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(100)[-2:] == [96, 100]


def test_mixed_token_counts_grow_by_at_most_half():
    counts = mixed_token_counts(8192)
    assert counts[0] == 32 and counts[-1] == 8192
    assert all(b <= a * 3 // 2 and b % 16 == 0 for a, b in zip(counts, counts[1:]))
