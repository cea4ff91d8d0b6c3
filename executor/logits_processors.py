"""Custom logits processors: registered at engine construction, run on the core.

A processor is a class, instantiated once per engine as cls(vocab_size,
device), that follows the batch's slots:
- add_request(slot, params, prompt_token_ids) when a request takes a slot
  (params.extra_args carries the request's own arguments);
- remove_request(slot) when it leaves;
- record(slot, token) for each token sampled (optional);
- apply(logits, batch) every step, changing in place the rows
  ([num_rows, vocab] float32, before temperature) of the requests it
  follows; batch.slots maps rows to slots and batch.num_output_tokens
  gives each row's generated count.
A spawned core gets processors as "module:Class" strings, imported there,
so nothing is pickled between processes.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from headrace.checkpoint import ConfigError
from headrace.config import EngineArgs
from headrace.sampling_params import SamplingParams


class LogitsProcessor:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    def add_request(self, slot: int, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        pass

    def remove_request(self, slot: int) -> None:
        pass

    def record(self, slot: int, token: int) -> None:
        """A token was sampled for the request in slot (after apply)."""

    def apply(self, logits: torch.Tensor, batch) -> None:
        raise NotImplementedError


def per_request(arg_name: str, fn: Callable) -> type[LogitsProcessor]:
    """Adapt a stateless per-request function into a processor class.

    For each request whose extra_args holds arg_name, every step calls
    fn(arg, output_token_ids, logits_row) -> logits_row (a new or the same
    [vocab] tensor); other requests are untouched.
    """

    class PerRequest(LogitsProcessor):
        def __init__(self, vocab_size: int, device: torch.device) -> None:
            super().__init__(vocab_size, device)
            self.args: dict[int, object] = {}  # slot -> the request's argument
            self.outputs: dict[int, list[int]] = {}  # slot -> generated tokens so far

        def add_request(self, slot, params, prompt_token_ids) -> None:
            extra = params.extra_args or {}
            if arg_name in extra:
                self.args[slot] = extra[arg_name]
                self.outputs[slot] = []

        def remove_request(self, slot) -> None:
            self.args.pop(slot, None)
            self.outputs.pop(slot, None)

        def record(self, slot: int, token: int) -> None:
            if slot in self.outputs:
                self.outputs[slot].append(token)

        def apply(self, logits, batch) -> None:
            for row, slot in enumerate(batch.slots.tolist()):
                if slot in self.args:
                    logits[row] = fn(self.args[slot], list(self.outputs[slot]), logits[row])

    PerRequest.__name__ = PerRequest.__qualname__ = f"PerRequest[{arg_name}]"
    return PerRequest


def load_logits_processors(args: EngineArgs) -> list[type[LogitsProcessor]]:
    classes = []
    for spec in args.logits_processors:
        cls = _import(spec) if isinstance(spec, str) else spec
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ConfigError(f"logits_processors entry {spec!r} is not a LogitsProcessor subclass")
        classes.append(cls)
    return classes


def _import(spec: str):
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"logits_processors entry {spec!r} must look like 'package.module:ClassName'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import logits processor {spec!r}: {e}") from None
