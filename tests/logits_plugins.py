"""Logits processors the tests register with engines (importable as tests.logits_plugins)."""
from __future__ import annotations

from headrace.executor.logits_processors import LogitsProcessor, per_request


class ForceEveryK(LogitsProcessor):
    """For requests with extra_args {"force_every": k, "force_token": t}: every
    k-th generated token is t. Other requests are untouched."""

    def __init__(self, vocab_size, device) -> None:
        super().__init__(vocab_size, device)
        self.rules: dict[int, tuple[int, int]] = {}  # slot -> (k, token)

    def add_request(self, slot, params, prompt_token_ids) -> None:
        extra = params.extra_args or {}
        if "force_every" in extra:
            self.rules[slot] = (int(extra["force_every"]), int(extra["force_token"]))

    def remove_request(self, slot) -> None:
        self.rules.pop(slot, None)

    def apply(self, logits, batch) -> None:
        for row, slot in enumerate(batch.slots.tolist()):
            rule = self.rules.get(slot)
            if rule and (batch.num_output_tokens[row] + 1) % rule[0] == 0:
                logits[row] = float("-inf")
                logits[row, rule[1]] = 0.0


def _ban_last(arg, output_ids, row):
    """A stateless per-request rule: never repeat the previous token."""
    if output_ids:
        row = row.clone()
        row[output_ids[-1]] = float("-inf")
    return row


NoRepeat = per_request("no_repeat", _ban_last)
