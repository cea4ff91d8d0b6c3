"""Beam search on the device: choosing each group's next beams inside the
step, and applying the choice (forking) before the group's next step.

A group's plan lives on the device, keyed by its home slot (beam 0's):
select_beams() writes it from the step's logits, fork_beams() applies it at the start
of the group's next step, so no host round trip sits between two steps of
a group. The host gets the same K candidates the plan was made from and
follows the beams a step behind (core/beam.py).
"""
from __future__ import annotations

import numpy as np
import torch

from headrace.executor.input_batch import InputBatch
from headrace.executor.sampler import pack_logprobs
from headrace.executor.staged import StagedTensor, upload
from headrace.executor.states import RequestStates
from headrace.kernels import dispatch
from headrace.sampling_params import MAX_BEST_OF
from headrace.step import BeamFork, BeamSelect, NewRequestData


class BeamState:
    """Per-slot beam values on the device."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.score = StagedTensor((num_slots,), torch.float32, device)  # slot -> its beam's cumulative score
        self.temperature = StagedTensor((num_slots,), torch.float32, device)  # slot -> beam_search_temperature
        # home slot -> new beam j -> (its parent beam, its token, its score), written by _select()
        self.plan_parent = torch.zeros(num_slots, MAX_BEST_OF, dtype=torch.int64, device=device)
        self.plan_token = torch.zeros(num_slots, MAX_BEST_OF, dtype=torch.int64, device=device)
        self.plan_score = torch.zeros(num_slots, MAX_BEST_OF, dtype=torch.float32, device=device)

    def add(self, slot: int, new: NewRequestData) -> None:
        self.score.stage(slot, new.beam_score)
        self.temperature.stage(slot, new.sampling_params.beam_search_temperature)

    def apply_staged(self) -> None:
        self.score.apply()
        self.temperature.apply()


def select_beams(logits: torch.Tensor, batch: InputBatch, states: RequestStates, beam: BeamState,
                 selects: list[BeamSelect]) -> tuple:
    """_select() for one step's groups, with their temperatures, min_tokens
    bans and, for groups that ask, each candidate's logprobs (as the sampler
    packs them, from the logits the scores came from). Returns the tensors
    to copy to the host: scores, parents, tokens, and the logprobs' ints and
    floats (None when no group asks)."""
    row_of = {rid: r for r, rid in enumerate(batch.req_ids)}
    slot_of = states.req_to_slot
    st = states.sampling
    temps = beam.temperature.np[batch.idx_mapping_np]
    scale = upload(np.where(temps > 0, temps, 1.0).astype(np.float32), logits.device) if (temps > 0).any() else None
    homes = np.array([slot_of[s.home] for s in selects], dtype=np.int64)
    mask = None
    if (st.min_tokens.np[homes] > 0).any():
        ban_rows, ban_ids = [], []
        i = 0
        for s in selects:
            for rid in s.beam_ids:
                slot = slot_of[rid]
                if st.min_tokens.np[slot] > states.num_tokens[slot] - st.num_prompt.np[slot]:
                    ban_rows.extend([i] * len(s.stop_ids))
                    ban_ids.extend(s.stop_ids)
                i += 1
        if ban_rows:
            mask = (np.array(ban_rows, dtype=np.int64), np.array(ban_ids, dtype=np.int64))
    scores, parents, tokens, cell_rows = _select(logits, row_of, slot_of, selects, homes, beam, scale, mask)
    if not (st.num_logprobs.np[homes] >= 0).any():
        return scores, parents, tokens, None, None
    # Logprobs of every candidate: its parent's row of the logits, its token sampled.
    k_max = scores.shape[1]
    cand_rows = cell_rows.gather(1, parents).view(-1)
    raw = logits[cand_rows]
    final = raw if scale is None else raw / scale[cand_rows][:, None]
    slots = np.repeat(homes, k_max)
    ints, floats = pack_logprobs(raw, final, tokens.view(-1), slots, upload(slots, logits.device), st)
    return scores, parents, tokens, ints, floats


def _select(logits: torch.Tensor, row_of: dict[str, int], slot_of: dict[str, int], selects: list[BeamSelect],
            homes: np.ndarray, beam: BeamState, scale: torch.Tensor | None,
            mask: tuple[np.ndarray, np.ndarray] | None):
    """Each group's K best continuations by cumulative score, best first,
    and its plan: the first W of them that do not end a beam.

    logits [num_rows, vocab] float32; homes [G]: each group's home slot;
    scale [num_rows] divides the beam rows' logits (beam_search_temperature)
    or is None; mask: (beam row, token) pairs banned (min_tokens). Returns
    the candidates (score, parent beam, token) as [G, Kmax] tensors and
    [G, Wmax], each group's beams' batch rows.
    """
    dev = logits.device
    G = len(selects)
    k_max = max(s.num_candidates for s in selects)
    w_max = max(s.width for s in selects)
    s_max = max(1, max(len(s.stop_ids) for s in selects))
    rows = [row_of[r] for s in selects for r in s.beam_ids]
    cells = [g * w_max + b for g, s in enumerate(selects) for b in range(len(s.beam_ids))]
    slots = [slot_of[r] for s in selects for r in s.beam_ids]
    stops = np.full((G, s_max), -1, dtype=np.int64)
    for g, s in enumerate(selects):
        stops[g, : len(s.stop_ids)] = s.stop_ids
    meta = np.array([*rows, *cells, *slots, *homes, *(s.num_candidates for s in selects)], dtype=np.int64)
    meta = upload(np.concatenate([meta, stops.reshape(-1)]), dev)
    R = len(rows)
    rows_t, cells_t, slots_t = meta[:R], meta[R : 2 * R], meta[2 * R : 3 * R]
    homes_t, k_t = meta[3 * R : 3 * R + G], meta[3 * R + G : 3 * R + 2 * G]
    stops_t = meta[3 * R + 2 * G :].view(G, s_max)

    every_row = rows == list(range(logits.shape[0]))  # a batch of beams alone: no gather
    x = logits if every_row else logits[rows_t]  # [R, vocab]
    if scale is not None:
        x = x / scale[rows_t][:, None]
    elif every_row and mask is not None:
        x = x.clone()  # the logits stay unmasked for the logprobs
    lse = torch.logsumexp(x, dim=-1)  # scores are log_softmax values, not renormalized after masking
    if mask is not None:
        x[upload(mask[0], dev), upload(mask[1], dev)] = float("-inf")
    vals, toks = x.topk(min(k_max, x.shape[1]), dim=-1)  # [R, k]
    k_row = vals.shape[1]
    cand = vals - lse[:, None] + beam.score.gpu[slots_t][:, None]
    grid = torch.full((G * w_max, k_row), float("-inf"), device=dev)
    grid[cells_t] = cand
    tgrid = torch.zeros((G * w_max, k_row), dtype=torch.int64, device=dev)
    tgrid[cells_t] = toks
    scores, idx = grid.view(G, -1).topk(k_max, dim=-1)  # [G, Kmax], best first
    parents = idx // k_row
    tokens = tgrid.view(G, -1).gather(1, idx)
    ends = (tokens[:, :, None] == stops_t[:, None, :]).any(-1)
    rank = torch.arange(k_max, device=dev)[None, :]
    usable = ~ends & (rank < k_t[:, None])
    order = torch.where(usable, rank, rank + k_max).argsort(dim=-1)[:, :w_max]  # the first W that go on
    beam.plan_parent[homes_t, :w_max] = parents.gather(1, order)
    beam.plan_token[homes_t, :w_max] = tokens.gather(1, order)
    beam.plan_score[homes_t, :w_max] = scores.gather(1, order)
    cell_rows = torch.zeros(G * w_max, dtype=torch.int64, device=dev)
    cell_rows[cells_t] = rows_t
    return scores, parents, tokens, cell_rows.view(G, w_max)


def fork_beams(forks: list[BeamFork], slot_of: dict[str, int], beam: BeamState, token_ids: torch.Tensor,
         block_table: torch.Tensor, kv: torch.Tensor, block_size: int) -> None:
    """Apply the groups' plans: beam j of a group takes, from its parent,
    the first L tokens and the block table's full blocks of them, a copy of
    the parent's partial block (if L is not a block boundary), then its
    selected token at position L and its score. Every read happens before
    any write, so a beam that is both a parent and a child is safe.

    token_ids [slots, max_model_len], block_table [slots, max_blocks],
    kv [layers, 2, blocks, block_size, heads, head_dim].
    """
    dev = token_ids.device
    for f in forks:
        if f.plan is not None:  # the host's plan (stop strings) replaces the device's
            home, width = slot_of[f.home], len(f.plan)
            parents, tokens, scores = zip(*f.plan)
            beam.plan_parent[home, :width] = upload(np.array(parents, dtype=np.int64), dev)
            beam.plan_token[home, :width] = upload(np.array(tokens, dtype=np.int64), dev)
            beam.plan_score[home, :width] = upload(np.array(scores, dtype=np.float32), dev)
    dst, homes, js, lens, bases = [], [], [], [], []  # per beam: its slot, its group's home slot and first beam
    starts = []  # group -> its first beam
    for f in forks:
        group_slots = [slot_of[r] for r in f.beam_ids]
        base = len(dst)
        starts.append(base)
        dst.extend(group_slots)
        homes.extend([group_slots[0]] * len(group_slots))
        js.extend(range(len(group_slots)))
        lens.extend([f.num_tokens] * len(group_slots))
        bases.extend([base] * len(group_slots))
    F = len(dst)
    starts.append(F)
    meta = upload(np.array([*dst, *homes, *js, *lens, *bases, *starts], dtype=np.int64), dev)
    dst_t, homes_t, js_t, lens_t, bases_t = (meta[i * F : (i + 1) * F] for i in range(5))
    starts_t = meta[5 * F :]
    src_t = dst_t[bases_t + beam.plan_parent[homes_t, js_t]]

    l_max = max(lens)
    cols = torch.arange(l_max, device=dev)[None, :]
    moved = token_ids[src_t, :l_max]
    token_ids[dst_t, :l_max] = torch.where(cols < lens_t[:, None], moved, token_ids[dst_t, :l_max])
    token_ids[dst_t, lens_t] = beam.plan_token[homes_t, js_t].to(token_ids.dtype)
    beam.score.gpu[dst_t] = beam.plan_score[homes_t, js_t]

    full_t = lens_t // block_size
    c_max = max(lens) // block_size
    if c_max:
        cols = torch.arange(c_max, device=dev)[None, :]
        moved = block_table[src_t, :c_max]
        block_table[dst_t, :c_max] = torch.where(cols < full_t[:, None], moved, block_table[dst_t, :c_max])
    if any(n % block_size for n in lens):  # partial blocks: each child copies its parent's (a beam that
        # continues itself keeps its own)
        num = torch.where(src_t != dst_t, lens_t % block_size, 0)
        dispatch.copy_partial_blocks(kv, block_table[src_t, full_t].long(), block_table[dst_t, full_t].long(), num,
                                     starts_t, max(len(f.beam_ids) for f in forks))
