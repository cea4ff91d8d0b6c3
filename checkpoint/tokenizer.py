"""A checkpoint's tokenizer without torch: prepared once with transformers, then loaded with `tokenizers` alone.

Frontend processes (API servers, the asyncio frontend) must not import torch, and `transformers`
imports torch whenever it is installed. So the engine core, which has torch anyway, calls
`prepare_tokenizer` once per checkpoint: it loads the tokenizer with `AutoTokenizer` and writes
the Rust backend transformers ended up with (after its per-class rebuilds) and the settings its
encode/decode/chat methods read. `Tokenizer.load` reads that back with `tokenizers` and `jinja2`
only, and answers those methods as transformers does.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import operator
import os
import shutil
import tempfile
from collections.abc import Mapping
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import tokenizers

from headrace.checkpoint import ConfigError

FORMAT_VERSION = 1
META_FILE = "headrace-tokenizer.json"  # written last: its presence marks a complete directory
KEY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
             "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
             "vocab.txt", "config.json", "generation_config.json")
# Methods of transformers' fast tokenizer that `Tokenizer` reproduces: a class overriding one is refused.
_REPRODUCED = ("encode", "_encode_plus", "decode", "_decode", "batch_decode", "clean_up_tokenization",
               "convert_ids_to_tokens", "convert_tokens_to_ids", "apply_chat_template", "get_chat_template")
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
_FORCE_BPE_CLEANUP = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _key(source: Path) -> str:
    # A .gguf's siblings count too: transformers reads e.g. a tokenizer.json next to it instead of the file's own.
    folder = source if source.is_dir() else source.parent
    names = [*KEY_FILES, *(p.relative_to(folder).as_posix() for p in folder.glob("additional_chat_templates/*"))]
    names += [] if source.is_dir() else [source.name]
    stats = sorted((n, (folder / n).stat()) for n in names if (folder / n).is_file())
    files = [(n, st.st_size, st.st_mtime_ns) for n, st in stats]
    blob = json.dumps([str(source), files, metadata.version("transformers"), FORMAT_VERSION])
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in source.name)[:48]
    return f"{stem}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"


def prepare_tokenizer(source: str | Path, cache_dir: Path) -> Path:
    """The prepared tokenizer directory for a local checkpoint directory or .gguf file: written under
    `cache_dir/tokenizers/` on the first call (importing transformers), only looked up after that."""
    source = Path(source).resolve()
    if not source.exists():
        raise ConfigError(f"cannot prepare a tokenizer from {source}: no such file or directory")
    target = Path(cache_dir) / "tokenizers" / _key(source)
    if (target / META_FILE).is_file():
        return target
    from transformers import AutoTokenizer, TokenizersBackend

    try:
        if source.is_dir():
            tok = AutoTokenizer.from_pretrained(str(source))
        else:
            tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except Exception as e:  # transformers raises many kinds here (OSError, ValueError, JSONDecodeError...)
        raise ConfigError(f"cannot load a tokenizer from {source}: {type(e).__name__}: {e}") from e
    kind = type(tok).__name__
    backend = getattr(tok, "backend_tokenizer", None)
    if not (getattr(tok, "is_fast", False) and isinstance(backend, tokenizers.Tokenizer)):
        raise ValueError(f"the tokenizer of {source} ({kind}) is not a fast (Rust-backed) one")
    if overrides := [m for m in _REPRODUCED if getattr(type(tok), m, None) is not getattr(TokenizersBackend, m)]:
        raise ValueError(f"the tokenizer of {source} ({kind}) overrides {', '.join(overrides)}: "
                         "headrace cannot reproduce it without transformers")
    names = list(tok.SPECIAL_TOKENS_ATTRIBUTES)  # bos_token, ..., plus model-specific ones
    meta = dict(
        format=FORMAT_VERSION, source=str(source), tokenizer_class=kind,
        transformers_version=metadata.version("transformers"),
        special_tokens_map=tok.special_tokens_map, special_token_names=names,
        special_token_ids={n: getattr(tok, f"{n}_id") for n in names if getattr(tok, n) is not None},
        extra_special_tokens=list(tok.extra_special_tokens), all_special_tokens=tok.all_special_tokens,
        all_special_ids=tok.all_special_ids, chat_template=tok.chat_template,
        clean_up_tokenization_spaces=bool(tok.clean_up_tokenization_spaces),
        # transformers before 5.17 cleans BPE text up too; later ones only when forced to
        clean_up_bpe=bool(getattr(tok, _FORCE_BPE_CLEANUP, True)),
        split_special_tokens=bool(tok.split_special_tokens), model_max_length=tok.model_max_length,
        add_bos_token=tok.add_bos_token, add_eos_token=tok.add_eos_token,  # for the record: the backend has them
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        backend.save(str(work / "tokenizer.json"))
        (work / META_FILE).write_text(json.dumps(meta, indent=1, ensure_ascii=False), encoding="utf-8")
        try:
            os.rename(work, target)  # atomic; fails if another process got there first, then theirs is kept
        except OSError:
            if not (target / META_FILE).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def read_prepared(path: str | Path) -> tuple[str, str]:
    """A prepared directory's two files as text: what a core hands its frontends (they may run elsewhere)."""
    path = Path(path)
    try:
        return (path / "tokenizer.json").read_text(encoding="utf-8"), (path / META_FILE).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path} is not a prepared tokenizer directory ({type(e).__name__}: {e})") from e


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer.load(path)


class Tokenizer:
    """transformers' fast tokenizer as headrace uses it (bos_token, eos_token_id... included), prepared."""

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """From a prepared directory."""
        return cls.from_prepared(*read_prepared(path), where=str(path))

    @classmethod
    def from_prepared(cls, tokenizer_json: str, meta_json: str, where: str = "the prepared tokenizer") -> Tokenizer:
        """From the text of a prepared directory's files (read_prepared)."""
        try:
            meta = json.loads(meta_json)
            backend = tokenizers.Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # bad JSON, a tokenizer.json this tokenizers cannot read
            raise ValueError(f"{where} is not a prepared tokenizer ({type(e).__name__}: {e})") from e
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"{where} was prepared in format {meta.get('format')}, not {FORMAT_VERSION}: "
                             "prepare it again")
        return cls(backend, meta)

    def __init__(self, backend: tokenizers.Tokenizer, meta: dict[str, Any]):
        self._tokenizer, self._meta = backend, meta
        backend.no_truncation()  # transformers' encode turns off what tokenizer.json may turn on
        backend.no_padding()
        backend.encode_special_tokens = meta["split_special_tokens"]
        self.name_or_path: str = meta["source"]
        self.chat_template: str | dict[str, str] | None = meta["chat_template"]
        self.clean_up_tokenization_spaces: bool = meta["clean_up_tokenization_spaces"]
        self.model_max_length: int = meta["model_max_length"]
        self.special_tokens_map: dict[str, str] = meta["special_tokens_map"]
        self.extra_special_tokens: list[str] = meta["extra_special_tokens"]
        self.all_special_tokens: list[str] = meta["all_special_tokens"]
        self.all_special_ids: list[int] = meta["all_special_ids"]
        self._cleanup_allowed = type(backend.model).__name__ != "BPE" or meta["clean_up_bpe"]

    def __getattr__(self, name: str) -> Any:
        meta = self.__dict__.get("_meta", {})
        base = name.removesuffix("_id")
        if base in meta.get("special_token_names", ()):
            return meta["special_token_ids"].get(base) if name != base else meta["special_tokens_map"].get(base)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:  # without the added tokens
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            found = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | None | list[str]:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(i) for i in map(int, ids) if i not in skip]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str | list[str]:
        """An int or a sequence of ints (numpy and torch too) gives a str; a sequence of sequences, a list of them."""
        token_ids = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids  # numpy, torch
        token_ids = [token_ids] if isinstance(token_ids, int) else token_ids
        token_ids = [t.tolist() if hasattr(t, "tolist") else t for t in token_ids]
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self.decode(ids, skip_special_tokens, clean_up_tokenization_spaces) for ids in token_ids]
        text = self._tokenizer.decode([operator.index(i) for i in token_ids], skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        if clean_up_tokenization_spaces and self._cleanup_allowed:  # transformers skips it for BPE models unless forced
            for old, new in _CLEANUP:
                text = text.replace(old, new)
        return text

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        if isinstance(sequences, int) or (hasattr(sequences, "ndim") and sequences.ndim == 0):
            raise TypeError(f"batch_decode takes a batch of sequences, not one id ({sequences!r}): use decode")
        if len(sequences) == 0:
            return []  # no sequences (decode([]) is one empty sequence)
        out = self.decode(sequences, skip_special_tokens, clean_up_tokenization_spaces)
        return [out] if isinstance(out, str) else out

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The given template, one of several named ones ("tool_use" with tools, else "default"), or the only one."""
        own = self.chat_template
        if isinstance(own, dict) and (chat_template in own or chat_template is None):
            name = chat_template or ("tool_use" if tools is not None and "tool_use" in own else "default")
            if name not in own:
                raise ValueError(f"this tokenizer has several chat templates and no default: pass one of {sorted(own)} "
                                 "(or a template) as chat_template")
            return own[name]
        if chat_template is None and own is None:
            raise ValueError(f"the tokenizer of {self.name_or_path} has no chat template and none was passed")
        return own if chat_template is None else chat_template

    def apply_chat_template(self, conversation: list, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, return_dict: bool = False, **kwargs: Any) -> Any:
        """Render a chat (or a list of chats, giving a list) as transformers does. The inputs are tidied as
        transformers 5.23 tidies them (None-valued keys dropped, a message's reasoning under each name
        templates read, values made plain data); earlier transformers render those differently or refuse
        them. With `tokenize` the text is encoded without special tokens and the ids are returned
        (transformers 5 returns a BatchEncoding by default), or with `return_dict` a plain dict of
        input_ids and attention_mask. Tools must be JSON schemas; sanitize_control_tokens, padding,
        truncation and tensors are not supported."""
        for name in ("sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
                     "return_assistant_tokens_mask", "tokenizer_kwargs"):
            if kwargs.pop(name, None):
                raise NotImplementedError(f"apply_chat_template({name}=...) needs transformers")
        template = self.get_chat_template(chat_template, tools)
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if isinstance(conversation[0], (list, tuple)):  # a batch
            out = [self.apply_chat_template(c, tools, documents, template, add_generation_prompt,
                                            continue_final_message, tokenize, **kwargs) for c in conversation]
            masks = [[1] * len(ids) for ids in out] if tokenize and return_dict else None
            return {"input_ids": out, "attention_mask": masks} if masks is not None else out
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        if any(not isinstance(t, dict) for t in tools or ()):
            raise ValueError("tools must be JSON schemas (dicts); headrace does not convert functions")
        if any(not isinstance(d, dict) for d in documents or ()):
            raise TypeError("documents must be a list of dicts with 'title' and 'text' keys")
        text = _render(template, conversation, _plain(tools), _plain(documents), add_generation_prompt,
                       continue_final_message, _plain({**self.special_tokens_map, **kwargs}))  # kwargs win
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids


def _render(template: str, chat: list, tools: Any, documents: Any, add_generation_prompt: bool,
            continue_final_message: bool | str, variables: dict) -> str:
    # Keys set to None (OpenAI's content=None, tool_calls=None) are dropped: templates handle missing keys better.
    chat = _plain([{k: v for k, v in m.items() if v is not None} for m in chat])
    for i, message in enumerate(chat):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        reasoning = next((message[f] for f in _REASONING_FIELDS if message.get(f) is not None), None)
        if reasoning is not None:  # templates read `reasoning_content` (gpt-oss ones `thinking`): fill both
            chat[i] = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    if continue_final_message:  # tag the end of the final message, render, cut the text at the tag
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        if not chat or (final := chat[-1].get(field)) is None:
            raise ValueError(f"continue_final_message is set but the final message has no {field!r} to continue")
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final] if field in _REASONING_FIELDS else [field]
        if not any(f in template for f in fields):
            raise ValueError(f"continue_final_message is set to {field!r} but the chat template does not use it")
        if isinstance(final, (list, tuple)):  # content blocks: continue the last text one
            block = next((b for b in reversed(final) if "text" in b), None)
            if block is None:
                raise ValueError("continue_final_message is set but the final message has no text to continue")
            final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    text = _compile(template).render(messages=chat, tools=tools, documents=documents,
                                     add_generation_prompt=add_generation_prompt, **variables)
    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ValueError("continue_final_message is set but the chat template dropped part of the final message")
        at = text.rindex(tag)  # the template may have trimmed the message: then trim what precedes the tag too
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text


def _plain(value: Any) -> Any:
    """What a template sees: plain JSON-like data only, anything else as an inert "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):
        if isinstance(value, kind):  # enums, numpy scalars...: back to the base type
            return getattr(kind, f"__{kind.__name__}__")(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value) if isinstance(value, tuple) else [_plain(v) for v in value]
    if any(c.__name__ == "generic" and c.__module__ == "numpy" for c in type(value).__mro__):  # numpy scalars
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=64)
def _compile(template: str):
    return _environment().from_string(template)


@functools.cache
def _environment():
    """A jinja2 sandbox set up as transformers sets up its own for chat templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):  # `{% generation %}...{% endgeneration %}` renders its body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def check(*names):  # no underscore names on a namespace: they lead to CPython internals
        if any(isinstance(n, str) and n.startswith("_") for n in names):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attributes {names}")

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            check(*dict(*args[1:], **kwargs))
            jinja2.utils.Namespace.__init__(*args, **kwargs)

        def __setitem__(self, name, value):
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    class Dict:  # `dict(...)` and `dict.fromkeys(...)`, without handing out the type itself
        __call__, fromkeys = staticmethod(dict), staticmethod(dict.fromkeys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # no HTML escaping
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=Dict(), namespace=Namespace)
    return env
