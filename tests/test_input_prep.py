"""The input-preparation kernel against its torch reference, and the
reference against a plain loop over rows and tokens."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from headrace.kernels.input_prep import (  # noqa: E402
    advance_slots, advance_slots_ref, prepare_inputs, prepare_inputs_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def slot_state(seed: int, num_slots: int, max_len: int, block_size: int):
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max_len // block_size)
    token_ids = torch.randint(0, 50_000, (num_slots, max_len), generator=g, dtype=torch.int32)
    block_table = torch.randint(0, 10_000, (num_slots, max_blocks), generator=g, dtype=torch.int32)
    return g, token_ids, block_table


def make_batch(g, num_slots: int, max_len: int, num_reqs: int):
    """Rows on distinct slots: each has some computed tokens and computes 1
    (decode), a few, or more than the kernel's 128-token block."""
    slots = torch.randperm(num_slots, generator=g)[:num_reqs]
    kind = torch.rand(num_reqs, generator=g)
    counts = torch.where(kind < 0.5, 1, torch.randint(1, 40, (num_reqs,), generator=g))
    counts = torch.where(kind > 0.85, torch.randint(129, 260, (num_reqs,), generator=g), counts)
    computed = torch.stack([torch.randint(0, max_len - int(c) + 1, (1,), generator=g)[0] for c in counts])
    num_computed = torch.zeros(num_slots, dtype=torch.int32)
    num_computed[slots] = computed.int()
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = counts.cumsum(0)
    return slots.long(), qsl, int(qsl[-1]), num_computed


def loop_reference(idx_mapping, qsl, num_computed, token_ids, block_table, block_size):
    ids, pos, slot_map = [], [], []
    for r, slot in enumerate(idx_mapping.tolist()):
        for i in range(int(qsl[r + 1] - qsl[r])):
            p = int(num_computed[slot]) + i
            pos.append(p)
            ids.append(int(token_ids[slot, p]))
            slot_map.append(int(block_table[slot, p // block_size]) * block_size + p % block_size)
    return ids, pos, slot_map, block_table[idx_mapping].tolist()


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_reqs", [1, 5, 33])
def test_prepare_inputs_matches_reference(block_size, num_reqs):
    num_slots, max_len = 40, 300
    g, token_ids, block_table = slot_state(block_size * 100 + num_reqs, num_slots, max_len, block_size)
    idx_mapping, qsl, num_tokens, num_computed = make_batch(g, num_slots, max_len, num_reqs)
    want = prepare_inputs_ref(idx_mapping, qsl, num_tokens, num_computed, token_ids, block_table, block_size)
    assert [t.tolist() for t in want] == list(loop_reference(idx_mapping, qsl, num_computed, token_ids,
                                                             block_table, block_size))
    args = [t.to(DEVICE) for t in (idx_mapping, qsl)] + [num_tokens] + \
        [t.to(DEVICE) for t in (num_computed, token_ids, block_table)] + [block_size]
    got = prepare_inputs(*args)
    for w, o in zip(want, got, strict=True):
        assert o.dtype == w.dtype and o.shape == w.shape
        assert torch.equal(o.cpu(), w)


@pytest.mark.parametrize("kernel", [prepare_inputs, prepare_inputs_ref])
def test_prepare_inputs_into_buffers(kernel):
    """With out, the kernel (and the reference) write the batch into the leading rows of larger buffers,
    return those rows, and leave the rest alone (what the CUDA graphs' input buffers rely on)."""
    num_slots, max_len, block_size = 40, 300, 16
    g, token_ids, block_table = slot_state(7, num_slots, max_len, block_size)
    idx_mapping, qsl, num_tokens, num_computed = make_batch(g, num_slots, max_len, 5)
    want = prepare_inputs_ref(idx_mapping, qsl, num_tokens, num_computed, token_ids, block_table, block_size)
    rows, tokens = 9, num_tokens + 20
    out = (torch.full((tokens,), -7, dtype=torch.int64), torch.full((tokens,), -7, dtype=torch.int64),
           torch.full((tokens,), -7, dtype=torch.int64),
           torch.full((rows, block_table.shape[1]), -7, dtype=torch.int32))
    out = tuple(o.to(DEVICE) for o in out)
    args = [t.to(DEVICE) for t in (idx_mapping, qsl)] + [num_tokens] + \
        [t.to(DEVICE) for t in (num_computed, token_ids, block_table)] + [block_size]
    got = kernel(*args, out)
    for w, o, buf in zip(want, got, out, strict=True):
        assert o.data_ptr() == buf.data_ptr() and o.shape == w.shape
        assert torch.equal(o.cpu(), w)
        assert (buf[w.shape[0]:] == -7).all()
    short = (out[0][: num_tokens - 1], out[1], out[2], out[3])  # one token short: refused, nothing written
    with pytest.raises(ValueError, match="out buffers"):
        kernel(*args, short)
    with pytest.raises(ValueError, match="out buffers"):
        kernel(*args, out[:3] + (out[3][:4],))  # a row short


def test_step_inputs_in_buffers_match_new_tensors():
    """executor.input_batch.prepare_inputs with InputBuffers gives the batch it gives without them, as views
    of the buffers, with the rows past the batch packed as the CUDA graphs' padding wants them: query starts
    at the token count, one key a row, last in decode attention's order."""
    from headrace.executor.input_batch import InputBuffers
    from headrace.executor.input_batch import prepare_inputs as prepare_step
    from headrace.executor.sampling_state import SamplingState
    from headrace.executor.states import RequestStates
    from headrace.sampling_params import SamplingParams
    from headrace.step import NewRequestData

    cpu = torch.device("cpu")
    S, block_size = 6, 4
    states = RequestStates(S, 64, 16, cpu, SamplingState(S, 300, [1], False, cpu))
    for i, (prompt, computed) in enumerate([(9, 0), (5, 4), (12, 11)]):
        states.add(NewRequestData(f"r{i}", list(range(2, 2 + prompt)), prompt, list(range(3 * i, 3 * i + 4)),
                                  computed, SamplingParams(), i))
    states.apply_staged()
    scheduled = {"r0": 9, "r1": 1, "r2": 1}
    plain = prepare_step(states, scheduled, block_size, cpu)
    bufs = InputBuffers(S, 32, 16, cpu)
    batch = prepare_step(states, scheduled, block_size, cpu, bufs)
    for name in ("idx_mapping", "sample_rows", "input_ids", "positions", "logits_indices", "sample_positions"):
        assert torch.equal(getattr(batch, name), getattr(plain, name)), name
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(batch.attn, name), getattr(plain.attn, name)), name
    assert batch.input_ids.data_ptr() == bufs.input_ids.data_ptr()
    assert batch.attn.seq_lens.data_ptr() == bufs.seq_lens.data_ptr()
    assert bufs.query_start_loc[4:].tolist() == [11] * (S - 3) and bufs.seq_lens[3:].tolist() == [1] * (S - 3)
    # decode attention takes the rows longest first (seq_lens 9, 5, 12); the padding rows after, as they are
    assert plain.attn.decode_order.tolist() == batch.attn.decode_order.tolist() == [2, 0, 1]
    assert bufs.decode_order.tolist() == [2, 0, 1, 3, 4, 5] and bufs.decode_order.dtype == torch.int32
    assert plain.sample_rows.tolist() == [0, 1, 2]
    assert plain.logits_indices.tolist() == [8, 9, 10] and plain.sample_positions.tolist() == [9, 5, 12]
    for t in (plain.idx_mapping, plain.sample_rows, plain.logits_indices, plain.sample_positions):
        assert t.dtype == torch.int64
    assert plain.attn.query_start_loc.dtype == plain.attn.seq_lens.dtype == torch.int32
    small = InputBuffers(S, 8, 16, cpu)  # fewer tokens than the step's 11: new tensors
    batch = prepare_step(states, scheduled, block_size, cpu, small)
    assert batch.input_ids.data_ptr() != small.input_ids.data_ptr()
    assert torch.equal(batch.input_ids, plain.input_ids) and torch.equal(batch.attn.seq_lens, plain.attn.seq_lens)


def _check_advance(fn, g, idx_mapping, seq_lens, sample_rows, moved, num_rows=None):
    """fn on random slot state against a loop: rows `moved` set their slot's computed count, and
    sample_rows[:len(sample_rows)] (each a moved row) write their sampled token at seq_lens."""
    num_slots, width = 12, 40
    sampled = torch.randint(0, 50_000, (len(idx_mapping),), generator=g)
    num_computed = torch.randint(0, 9, (num_slots,), generator=g, dtype=torch.int32)
    token_ids = torch.randint(0, 50_000, (num_slots, width), generator=g, dtype=torch.int32)
    want_computed, want_ids = num_computed.clone(), token_ids.clone()
    for r in range(moved):
        want_computed[idx_mapping[r]] = seq_lens[r]
    for r in sample_rows[:moved if num_rows is not None else len(sample_rows)].tolist():
        want_ids[idx_mapping[r], seq_lens[r]] = int(sampled[r])
    got_computed, got_ids = num_computed.to(DEVICE), token_ids.to(DEVICE)
    args = (idx_mapping, seq_lens, sample_rows, sampled)
    extra = {} if num_rows is None else dict(num_rows=torch.tensor(num_rows, dtype=torch.int32).to(DEVICE))
    fn(*(t.to(DEVICE) for t in args), got_computed, got_ids, **extra)
    assert torch.equal(got_computed.cpu(), want_computed) and torch.equal(got_ids.cpu(), want_ids)


@pytest.mark.parametrize("fn", [advance_slots, advance_slots_ref])
@pytest.mark.parametrize("num_samples", [0, 2, 5])
def test_advance_slots(fn, num_samples):
    """Each row's slot gets its computed count; each sampling row's token lands at its slot's seq_lens,
    checked against a loop; slots outside the batch are untouched."""
    g = torch.Generator().manual_seed(num_samples)
    n = 5
    idx_mapping = torch.randperm(12, generator=g)[:n]
    seq_lens = torch.randint(1, 40, (n,), generator=g, dtype=torch.int32)
    sample_rows = torch.randperm(n, generator=g)[:num_samples].sort().values
    _check_advance(fn, g, idx_mapping, seq_lens, sample_rows, n)


@pytest.mark.parametrize("fn", [advance_slots, advance_slots_ref])
def test_advance_slots_padded_rows_count_on_device(fn):
    """With num_rows (a CUDA graph's padded batch), only the rows before it move, each writing its token;
    the padding rows, whose slot reads 0 as the step's upload leaves them, touch nothing."""
    n, size = 3, 8
    idx_mapping = torch.zeros(size, dtype=torch.int64)
    idx_mapping[:n] = torch.tensor([5, 9, 2])
    seq_lens = torch.ones(size, dtype=torch.int32)
    seq_lens[:n] = torch.tensor([7, 30, 12], dtype=torch.int32)
    sample_rows = torch.zeros(size, dtype=torch.int64)
    sample_rows[:n] = torch.arange(n)
    _check_advance(fn, torch.Generator().manual_seed(3), idx_mapping, seq_lens, sample_rows, n, num_rows=n)
