"""Incremental detokenization: text deltas that never split a character."""
from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Each step decodes only a short window: the tokens since the last
    emitted boundary (prefix) and those plus the new ones. A window whose
    text ends in U+FFFD holds a character whose bytes are still arriving
    (a CJK character or emoji split across byte-level tokens), so nothing
    is emitted until it completes. flush() ends the stream with the rest of
    the full decode, so the deltas concatenate to exactly
    tokenizer.decode(all ids) with the same options.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self._tok = tokenizer
        self._opts = dict(skip_special_tokens=skip_special_tokens,
                          spaces_between_special_tokens=spaces_between_special_tokens)
        # A fast tokenizer's decode is its Rust backend's, plus an optional
        # clean-up pass; without that pass, call the backend directly (a
        # third of the time: two decodes run per token and stream).
        backend = getattr(tokenizer, "_tokenizer", None)
        clean_up = getattr(tokenizer, "clean_up_tokenization_spaces", True)
        if backend is not None and hasattr(backend, "decode") and not clean_up:
            self._backend, self._skip = backend, skip_special_tokens
            self._decode = self._backend_decode
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text is emitted

    def _decode(self, ids) -> str:
        return self._tok.decode(ids, **self._opts)

    def _backend_decode(self, ids) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids) -> str:
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        window_text = self._decode(self.token_ids[self._prefix :])
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        delta = window_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        full = self._decode(self.token_ids)
        if full.startswith(self.text):
            delta = full[len(self.text) :]
        else:  # a decoder that rewrites earlier text: keep what was sent, append the window's rest
            delta = self._decode(self.token_ids[self._prefix :])[
                len(self._decode(self.token_ids[self._prefix : self._read])) :
            ]
        self._prefix = self._read = len(self.token_ids)
        self.text += delta
        return delta
