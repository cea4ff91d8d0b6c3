"""Incremental detokenization: text deltas that never split a character."""
from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Each token decodes only a short window: the tokens since the last
    emitted boundary (prefix) and those plus the new ones. A window whose
    text ends in U+FFFD holds a character whose bytes are still arriving
    (a CJK character or emoji split across byte-level tokens), so nothing
    is emitted until it completes. flush() ends the stream with the rest of
    the full decode, so the deltas concatenate to exactly
    tokenizer.decode(all ids) with the same options.

    A fast tokenizer without a clean-up pass runs that window in its Rust
    backend (tokenizers' DecodeStream): one call per token. Other
    tokenizers go through tokenizer.decode, once per token while a
    character is incomplete and twice when text is emitted.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text is emitted
        self._prefix_text = ""  # decode(token_ids[_prefix:_read])
        backend = getattr(tokenizer, "_tokenizer", None)
        clean_up = getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._stream = self._backend = None
        if DecodeStream is not None and backend is not None and hasattr(backend, "decode") and not clean_up:
            self._backend = backend
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def _decode(self, ids) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip)
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids) -> str:
        """Take new token ids; returns the text they complete (possibly "")."""
        before, start = len(self.text), len(self.token_ids)
        self.token_ids.extend(token_ids)
        if self._stream is not None:
            try:
                self._add_streamed(start)
            except Exception:  # a decoder that rewrites earlier text: decode windows from here on
                self._stream = None
                self._prefix, self._prefix_text = self._read, ""
                self._add_window()
        else:
            self._add_window()
        return self.text[before:]

    def _add_streamed(self, start: int) -> None:
        step, backend, ids = self._stream.step, self._backend, self.token_ids
        for i in range(start, len(ids)):
            piece = step(backend, ids[i])
            if piece:
                self.text += piece
                self._prefix = self._read = i + 1

    def _add_window(self) -> None:
        window_text = self._decode(self.token_ids[self._prefix :])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith("\ufffd"):
            return
        self.text += window_text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix : self._read])

    def flush(self) -> str:
        """End the stream: emit what the full decode has beyond the deltas so far
        (a character left incomplete decodes as U+FFFD)."""
        full = self._decode(self.token_ids)
        if full.startswith(self.text):
            delta = full[len(self.text) :]
        else:  # a decoder that rewrites earlier text: keep what was sent, append the window's rest
            window = self._decode(self.token_ids[self._prefix :])
            delta = window[len(self._prefix_text) :]
        self._stream = None  # the stream is over; a later add() decodes windows
        self._prefix = self._read = len(self.token_ids)
        self._prefix_text = ""
        self.text += delta
        return delta
