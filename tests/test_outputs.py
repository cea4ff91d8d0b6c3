"""Logprobs, the lazy view of packed logprob rows, against dicts built from the same arrays by hand."""
from __future__ import annotations

import numpy as np
import pytest

from headrace.core.outputs import Logprob, Logprobs
from headrace.core.protocol import pack_floats, pack_ids


def reference(ids: np.ndarray, values: np.ndarray, ranks: np.ndarray, ranked: bool, text, num_empty: int) -> list:
    rows = [None] * num_empty
    for row_ids, row_values, rank in zip(ids.tolist(), values.astype(np.float32).tolist(), ranks.tolist()):
        entry = {t: Logprob(v, r if ranked else None, text[t])
                 for r, (t, v) in enumerate(zip(row_ids[1:], row_values[1:]), 1)}
        scored = row_ids[0]
        if scored in entry:  # the scored token among the top: one entry, with the scored token's rank
            entry[scored] = Logprob(entry[scored].logprob, rank, text[scored])
        else:
            entry[scored] = Logprob(row_values[0], rank, text[scored])
        rows.append(entry)
    return rows


@pytest.mark.parametrize("ranked", [True, False])
@pytest.mark.parametrize("num_empty", [0, 1])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_logprobs_read_like_the_dicts_of_their_rows(ranked, num_empty, k):
    rng = np.random.default_rng(k * 10 + num_empty)
    num, text = 5, [f"<{i}>" for i in range(50)]
    ids = np.stack([rng.choice(50, size=k, replace=False) for _ in range(num)]).astype(np.int32)
    ids[1, 0] = ids[1, -1]  # a scored token that is also in its row's top
    values = -rng.random((num, k)).astype(np.float32)
    ranks = rng.integers(1, 40, num).astype(np.int32)
    lp = Logprobs(pack_ids(ids.ravel()), pack_floats(values.ravel()), pack_ids(ranks), ranked, text, num_empty)
    ref = reference(ids, values, ranks, ranked, text, num_empty)
    assert len(lp) == num + num_empty
    assert list(lp) == ref and lp == ref
    assert [lp[i] for i in range(len(lp))] == ref and lp[-1] == ref[-1] and lp[1:3] == ref[1:3]
    with pytest.raises(IndexError):
        lp[len(lp)]
    assert lp[len(lp) - 1] is lp[-1]  # a row is built once
