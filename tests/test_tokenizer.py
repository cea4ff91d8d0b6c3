"""headrace.checkpoint.tokenizer against transformers' AutoTokenizer loading the same source.

transformers is the reference: every check compares the prepared, torch-free `Tokenizer` with
`AutoTokenizer.from_pretrained` on the same checkpoint directory or GGUF file.
"""
from __future__ import annotations

import enum
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jinja2
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
import transformers
from packaging.version import Version
from transformers import AutoTokenizer

from headrace.checkpoint.smollm2 import FetchError, smollm2_gguf
from headrace.checkpoint.tokenizer import META_FILE, Tokenizer, load_tokenizer, prepare_tokenizer
from headrace.testing.checkpoint import make_checkpoint
from headrace.testing.tokenizer import CORPUS, build_tokenizer

# Uses raise_exception, tojson (with options, non-ASCII and HTML characters), loop controls,
# namespace, bos_token, a template kwarg (enable_thinking), tools, documents, reasoning and the
# `{% generation %}` tag.
TEMPLATE = """{{ bos_token }}
{%- if tools %}# Tools
{{ tools | tojson(indent=2, sort_keys=true) }}
{% endif %}
{%- for d in documents or [] %}[{{ loop.index }}: {{ d.title }}] {{ d.text }}
{% endfor %}
{%- set ns = namespace(turns=0) %}
{%- for m in messages %}
    {%- if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('Unknown role: ' + m.role) }}{% endif %}
    {%- if m.role == 'system' and not loop.first %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
<|im_start|>{{ m.role }}
    {%- if m.role == 'assistant' %}
{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}
{% generation %}{{ m.content if m.content is defined else '' }}{% endgeneration %}
    {%- else %}
{{ m.content | trim }}
    {%- endif %}
<|im_end|>
    {% if m.get('stop') %}{% break %}{% endif %}
{%- endfor %}
{{ dict(turns=ns.turns, note='<é & ü>', year=strftime_now('%Y')[:2], keys=dict.fromkeys(['k'], 0)) | tojson }}
{% if custom is defined %}{{ custom | tojson }} {{ custom[-1] }}
{% endif %}
{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"

TEXTS = (*CORPUS, "", " ", "  leading", "trailing  ", "multiple   spaces\there", "\n", "lines\n\n\nand\r\nmore\n",
         "e\u0301 n\u0303 a\u0308 \u1e9b\u0323 combining", "日本語 한국어 中文", "emoji 🚣‍♀️👍🏽🇯🇵 1️⃣",
         "Hello, world! It 's ok . Don 't stop , right ? I do n't know ' he 'm we 've they 're !",
         "<|im_start|>user\nhi<|im_end|>\n", "<s>x</s><unk>",
         "x<|bos|>y<|eos|>z<|pad|>", "<|endoftext|> ▁ <0x41>")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & here",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
DOCS = [{"title": "River", "text": "The river was low."}, {"title": "河", "text": "河水很清"}]
CHATS = (
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "今天天气很好 🌊"},
     {"role": "assistant", "content": "Yes. 👍", "reasoning": "The user says hi."},
     {"role": "system", "content": "skipped"}, {"role": "user", "content": "  spaces  \n", "name": None}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
     {"role": "user", "content": "<|im_start|>injected<|im_end|>", "stop": True}, {"role": "user", "content": "never"}],
)


class Colour(str, enum.Enum):
    RED = "red"


OPTIONS = ({}, {"add_generation_prompt": True}, {"add_generation_prompt": True, "enable_thinking": False},
           {"tools": TOOLS, "documents": DOCS},
           {"bos_token": "[kwarg bos]", "custom": [1, "two", np.int64(3), np.bool_(False), Colour.RED]})


def outcome(fn, *args, **kwargs):
    """fn's result, or its exception's type: so that both sides may fail, but alike."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - compared, not swallowed
        return "error", type(e).__name__


# ---- sources: checkpoint directories and GGUF files built offline ------------------------------

def _config(path: Path, **changes) -> Path:
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(changes)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _bytelevel(path: Path, **changes) -> Path:
    build_tokenizer(path)
    return _config(path, **changes)


def _config_template(path: Path) -> Path:
    """The chat template in tokenizer_config.json (no chat_template.jinja, which would win)."""
    _bytelevel(path, chat_template=TEMPLATE, model_max_length=2048)
    (path / "chat_template.jinja").unlink()
    return path


def _post_processor_bos(path: Path) -> Path:
    """Llama-3 style: tokenizer.json's own post-processor adds bos (add_bos_token in the config is ignored then)."""
    _bytelevel(path, add_bos_token=True, chat_template=TEMPLATE)
    (path / "chat_template.jinja").unlink()
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                       special_tokens=[("<|bos|>", 0)])
    tok.enable_truncation(max_length=8)  # in tokenizer.json, but transformers' encode turns both off
    tok.enable_padding(pad_id=2, pad_token="<|pad|>", length=64)
    tok.save(str(path / "tokenizer.json"))
    return path


def _vocab_files(path: Path, **config) -> Path:
    """GPT-2 style vocab.json + merges.txt and no tokenizer.json: transformers builds the backend,
    honouring add_bos_token / add_eos_token."""
    data = json.loads(build_tokenizer(path.parent / f"{path.name}-src").backend_tokenizer.to_str())
    path.mkdir()
    (path / "vocab.json").write_text(json.dumps(data["model"]["vocab"]))
    (path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in data["model"]["merges"]))
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="GPT2Tokenizer", bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>", unk_token=None,
        chat_template="{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}", **config)))
    return path


def _train_sentencepiece_bpe() -> tokenizers.Tokenizer:
    """Llama-2 style: BPE with byte fallback (<0x..> tokens) after a Metaspace pre-tokenizer."""
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  limit_alphabet=80, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    data = json.loads(tok.to_str())  # the byte tokens are vocabulary, not added tokens
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in byte_tokens]
    return tokenizers.Tokenizer.from_str(json.dumps(data))


def _sentencepiece(path: Path, **config) -> Path:
    path.mkdir()
    _train_sentencepiece_bpe().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="LlamaTokenizer", bos_token="<s>", eos_token="</s>", unk_token="<unk>", add_bos_token=True,
        legacy=False, clean_up_tokenization_spaces=True, model_max_length=4096, **config)))
    return path


def _wordlevel(path: Path) -> Path:
    """Whitespace-split words, no decoder (decode joins tokens with spaces): the clean-up applies."""
    path.mkdir()
    words = sorted({w.lower() for text in TEXTS for w in text.split()} | {"n't", "'s", "'m", "'ve", "'re", "'", "."})
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        clean_up_tokenization_spaces=True)))
    return path


def _qwen2_rebuilt(path: Path) -> Path:
    """tokenizer.json lowercases, but transformers rebuilds Qwen2's pipeline (NFC, its own split): it does not."""
    _bytelevel(path)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.normalizer = normalizers.Lowercase()
    tok.save(str(path / "tokenizer.json"))
    return path


def _named_templates(path: Path) -> Path:
    _bytelevel(path)  # chat_template.jinja becomes the "default" one
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "tool_use.jinja").write_text(TEMPLATE)
    (path / "additional_chat_templates" / "plain.jinja").write_text(PLAIN_TEMPLATE)
    return path


def _named_no_default(path: Path) -> Path:
    named = [{"name": "rich", "template": TEMPLATE}, {"name": "plain", "template": PLAIN_TEMPLATE}]
    _bytelevel(path, chat_template=named)
    (path / "chat_template.jinja").unlink()
    return path


def _write_gguf(path: Path, tokenizer: dict, **fields) -> Path:
    """A GGUF holding a tokenizer: `tokenizer` is a tokenizers JSON (vocab + merges); model "gpt2" or "llama"."""
    import gguf

    vocab, merges = tokenizer["model"]["vocab"], tokenizer["model"]["merges"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {t["content"] for t in tokenizer["added_tokens"]}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("context_length", 256), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("attention.head_count", 4), ("attention.head_count_kv", 2),
                       ("vocab_size", len(tokens))):
        w.add_key_value(f"llama.{key}", value, gguf.GGUFValueType.UINT32)
    w.add_tokenizer_model(fields.pop("model"))
    w.add_token_list(tokens)
    # 1 normal, 2 unknown, 3 control, 6 byte
    w.add_token_types([2 if t == "<unk>" else 3 if t in specials else 6 if t.startswith("<0x") else 1 for t in tokens])
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    for name, value in fields.items():
        getattr(w, f"add_{name}")(value)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_bytelevel(path: Path) -> Path:
    path.mkdir()  # alone: transformers would read a tokenizer.json next to it instead of the file
    data = json.loads(build_tokenizer(path.parent / f"{path.name}-src").backend_tokenizer.to_str())
    return _write_gguf(path / "tiny.gguf", data, model="gpt2", tokenizer_pre="qwen2", bos_token_id=0,
                       eos_token_id=1, pad_token_id=2, chat_template=TEMPLATE, add_eos_token=True)


def _gguf_sentencepiece(path: Path) -> Path:  # llama-type: transformers adds bos by default
    path.mkdir()
    return _write_gguf(path / "sp.gguf", json.loads(_train_sentencepiece_bpe().to_str()), model="llama",
                       bos_token_id=1, eos_token_id=2, unk_token_id=0)


BUILDERS = {
    "ckpt-llama": lambda p: make_checkpoint(p, "llama"),
    "ckpt-qwen2": lambda p: make_checkpoint(p, "qwen2"),
    "ckpt-qwen3": lambda p: make_checkpoint(p, "qwen3"),
    "config-template": _config_template,
    "post-processor-bos": _post_processor_bos,
    "vocab-files-bos": lambda p: _vocab_files(p, add_bos_token=True),
    "vocab-files-eos": lambda p: _vocab_files(p, add_eos_token=True),
    "sentencepiece": _sentencepiece,
    "sentencepiece-forced-cleanup": lambda p: _sentencepiece(
        p, clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True),
    "wordlevel-cleanup": _wordlevel,
    "qwen2-rebuilt": _qwen2_rebuilt,
    "split-special": lambda p: _bytelevel(p, split_special_tokens=True),
    "named-templates": _named_templates,
    "named-no-default": _named_no_default,
    "gguf-bytelevel": _gguf_bytelevel,
    "gguf-sentencepiece": _gguf_sentencepiece,
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """source(name) -> the checkpoint directory or .gguf file, built once per module."""
    base, built = tmp_path_factory.mktemp("sources"), {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = BUILDERS[name](base / name)
        return built[name]

    return get


def _hf(src: Path):
    if src.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    return AutoTokenizer.from_pretrained(str(src))


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


@pytest.fixture
def pair(source, cache):
    """pair(name) -> (our Tokenizer, transformers' tokenizer, the source)."""
    def get(name: str):
        src = source(name)
        return load_tokenizer(prepare_tokenizer(src, cache)), _hf(src), src

    return get


# ---- parity -------------------------------------------------------------------------------------

ATTRIBUTES = ("bos_token", "bos_token_id", "eos_token", "eos_token_id", "pad_token", "pad_token_id", "unk_token",
              "unk_token_id", "sep_token", "sep_token_id", "cls_token", "mask_token_id", "all_special_ids",
              "all_special_tokens", "special_tokens_map", "extra_special_tokens", "model_max_length",
              "clean_up_tokenization_spaces", "chat_template", "vocab_size")


def _id_sequences(hf, texts) -> list[list[int]]:
    """Encodings of `texts`, pieces of them cut inside multi-byte characters, and random ids, specials included."""
    rng = random.Random(0)
    encoded = [hf.encode(t) for t in texts]
    cut = [ids[i:j] for ids in encoded if len(ids) > 3 for i, j in ((1, None), (0, -1), (2, 5))]
    singles = [[i] for i in encoded[12][:40]]  # Chinese: most tokens are partial characters
    randoms = [[rng.randrange(len(hf)) for _ in range(rng.randint(1, 30))] for _ in range(30)]
    return [*encoded, *cut, *singles, *randoms, hf.all_special_ids, hf.all_special_ids[::-1] + [5, 6], []]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_encode_decode_and_attributes_match_transformers(pair, name):
    ours, hf, src = pair(name)
    texts = (*TEXTS, " ".join(hf.all_special_tokens) + " tail", "".join(hf.all_special_tokens))
    for text in texts:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), (text, add)
    sequences = _id_sequences(hf, texts)
    for ids in sequences:
        for skip in (False, True):
            for clean in (None, True, False):
                want = hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean)
                got = ours.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean)
                assert got == want, (ids, skip, clean)
    for skip in (False, True):
        want = hf.batch_decode(sequences, skip_special_tokens=skip)
        assert ours.batch_decode(sequences, skip_special_tokens=skip) == want
    numpy_ids = [np.array(sequences[0]), [np.int64(i) for i in sequences[0]], np.array([[3, 4], [5, 6]])]
    for weird in ([], [[]], [7], 7, (7, 8), *numpy_ids):
        assert ours.decode(weird) == hf.decode(weird)
        assert outcome(ours.batch_decode, weird) == outcome(hf.batch_decode, weird)
    assert outcome(ours.decode, [len(hf) + 10, 3]) == outcome(hf.decode, [len(hf) + 10, 3])

    for attribute in ATTRIBUTES:
        assert getattr(ours, attribute) == getattr(hf, attribute), attribute
    assert len(ours) == len(hf)
    assert ours.get_vocab() == hf.get_vocab()
    assert ours.name_or_path == str(src.resolve())
    everything = list(range(len(hf)))
    assert ours.convert_ids_to_tokens(everything) == hf.convert_ids_to_tokens(everything)
    want = hf.convert_ids_to_tokens(everything, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(everything, skip_special_tokens=True) == want
    assert ours.convert_ids_to_tokens(5) == hf.convert_ids_to_tokens(5)
    tokens = [*hf.convert_ids_to_tokens(everything[::7]), "<<not a token>>", *hf.all_special_tokens]
    assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert ours.convert_tokens_to_ids("<<not a token>>") == hf.convert_tokens_to_ids("<<not a token>>")


def _plain(value):
    """numpy scalars and str enums as the plain values they stand for."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value.item() if isinstance(value, np.generic) else value


def _tidied(chat, kwargs):
    """What headrace renders, as inputs any transformers 5 renders alike (transformers 5.23 tidies them
    so itself; earlier ones render None as "None" and refuse numpy values and enums): None-valued keys
    dropped, a `reasoning` or `thinking` field also given as the other and as `reasoning_content`,
    values plain."""
    def message(m):
        m = {k: v for k, v in m.items() if v is not None}
        r = next((m[f] for f in ("reasoning_content", "thinking", "reasoning") if f in m), None)
        return m if r is None else {"thinking": r, **m, "reasoning_content": r}

    chat = [message(m) for m in chat] if chat and isinstance(chat[0], dict) else [[message(m) for m in c] for c in chat]
    return chat, _plain(kwargs)


def _as_given(chat, kwargs):
    return chat, kwargs


def _chat_calls(tok, template: str | None, inputs=_as_given):
    """apply_chat_template over CHATS x OPTIONS, as strings and as ids, plus continue_final_message."""
    def call(chat, **kwargs):
        chat, kwargs = inputs(chat, kwargs)
        return outcome(tok.apply_chat_template, chat, **kwargs)

    results = []
    for chat in CHATS:
        for options in OPTIONS:
            kw = dict(options, chat_template=template)
            results.append(call(chat, tokenize=False, **kw))
            results.append(call(chat, tokenize=True, return_dict=False, **kw))
    finals = (("assistant", "The answer is"), ("assistant", "The answer is  "), ("assistant", "答案是🌊"),
              ("user", "Tell me  "))  # the user's, trimmed by the template: the cut must drop the spaces too
    for role, content in finals:
        chat = [{"role": "user", "content": "Go on"}, {"role": role, "content": content}]
        results.append(call(chat, continue_final_message=True, tokenize=False, chat_template=template))
    thinking = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "reasoning": "Let me think"}]
    results.append(call(thinking, continue_final_message="reasoning_content", tokenize=False, chat_template=template))
    results.append(call(list(CHATS[:2]), tokenize=False, chat_template=template))  # batched
    results.append(call(list(CHATS[:2]), return_dict=False, chat_template=template))
    return results


@pytest.mark.parametrize("name", ["ckpt-llama", "ckpt-qwen2", "ckpt-qwen3", "config-template", "post-processor-bos",
                                  "vocab-files-bos", "split-special", "named-templates", "gguf-bytelevel"])
def test_chat_template_matches_transformers(pair, name):
    ours, hf, _ = pair(name)
    templates = [None] + (sorted(hf.chat_template) if isinstance(hf.chat_template, dict) else [])
    for template in templates:
        want = _chat_calls(hf, template, _tidied)
        assert _chat_calls(ours, template) == want
        if Version(transformers.__version__) >= Version("5.23"):  # it tidies the inputs itself
            assert _chat_calls(hf, template) == want
        assert sum(kind == "ok" for kind, _ in want) >= 2 * 2 * len(OPTIONS)  # real renders, not only errors alike
    chat, _ = _tidied(CHATS[1], {})
    chats, _ = _tidied(list(CHATS[:2]), {})
    # transformers 5 returns a BatchEncoding by default; ours returns the ids unless asked for the dict.
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == hf.apply_chat_template(
        chat, add_generation_prompt=True)["input_ids"]
    assert ours.apply_chat_template(chat, return_dict=True) == dict(hf.apply_chat_template(chat))
    assert ours.apply_chat_template(chats, return_dict=True) == dict(hf.apply_chat_template(chats))


def test_template_features_render(pair):
    """The custom template really exercises what it claims to, in both."""
    ours, hf, _ = pair("config-template")
    text = ours.apply_chat_template(CHATS[1], tools=TOOLS, documents=DOCS, add_generation_prompt=True,
                                    enable_thinking=False, tokenize=False)
    assert text == hf.apply_chat_template(_tidied(CHATS[1], {})[0], tools=TOOLS, documents=DOCS,
                                          add_generation_prompt=True, enable_thinking=False, tokenize=False)
    assert text.startswith("<|bos|>") and '"get_weather"' in text and "[2: 河] 河水很清" in text
    assert "<think>The user says hi.</think>" in text and "skipped" not in text
    assert '"note": "<é & ü>"' in text and '"keys": {"k": 0}' in text
    assert text.endswith("<think>\n\n</think>\n\n")
    custom = ours.apply_chat_template(CHATS[0], tokenize=False, custom=OPTIONS[-1]["custom"])
    assert '[1, "two", 3, false, "red"] red' in custom
    cut = ours.apply_chat_template(CHATS[2], tokenize=False)
    assert "never" not in cut and cut == hf.apply_chat_template(_tidied(CHATS[2], {})[0], tokenize=False)


def test_named_templates(pair):
    ours, hf, _ = pair("named-templates")
    assert isinstance(hf.chat_template, dict) and ours.chat_template == hf.chat_template
    chat = CHATS[0]
    for kwargs in ({}, {"tools": TOOLS}, {"chat_template": "plain"}, {"chat_template": PLAIN_TEMPLATE + "!"}):
        want = hf.apply_chat_template(chat, tokenize=False, **kwargs)
        assert ours.apply_chat_template(chat, tokenize=False, **kwargs) == want
    assert ours.apply_chat_template(chat, tokenize=False, chat_template="plain") == "user: Hello there!\n"
    ours, hf, _ = pair("named-no-default")
    with pytest.raises(ValueError, match="no default"):
        ours.apply_chat_template(chat)
    with pytest.raises(ValueError):
        hf.apply_chat_template(chat)
    assert ours.apply_chat_template(chat, chat_template="rich", tokenize=False) == hf.apply_chat_template(
        chat, chat_template="rich", tokenize=False)


def _guards_namespaces(tok) -> bool:
    try:
        tok.apply_chat_template(CHATS[0], chat_template="{% set ns = namespace(_x=1) %}")
    except jinja2.exceptions.SecurityError:
        return True
    return False


def test_chat_errors_match_transformers(pair):
    ours, hf, _ = pair("config-template")
    assert _guards_namespaces(ours)  # as transformers 5.23 does; earlier ones do not
    for tok in (ours, hf) if _guards_namespaces(hf) else (ours,):
        for unsafe in ("{% set ns = namespace(_x=1) %}", "{% set ns = namespace() %}{% set ns.__x = 1 %}"):
            with pytest.raises(jinja2.exceptions.SecurityError):
                tok.apply_chat_template(CHATS[0], chat_template=unsafe)
    for tok in (ours, hf):
        with pytest.raises(jinja2.TemplateError, match="Unknown role: robot"):
            tok.apply_chat_template([{"role": "robot", "content": "beep"}])
        with pytest.raises(ValueError):
            tok.apply_chat_template([])
        with pytest.raises(ValueError):
            tok.apply_chat_template(CHATS[0], add_generation_prompt=True, continue_final_message=True)
        with pytest.raises(ValueError):  # the template drops the final message's name field
            tok.apply_chat_template(CHATS[0], continue_final_message="name", tokenize=False)
        with pytest.raises(TypeError):
            tok.apply_chat_template(CHATS[0], documents=["not a dict"])
    with pytest.raises(NotImplementedError, match="sanitize_control_tokens"):
        ours.apply_chat_template(CHATS[0], sanitize_control_tokens=True)
    ours, hf, _ = pair("sentencepiece")  # no chat template at all
    assert ours.chat_template is None is hf.chat_template
    for tok in (ours, hf):
        with pytest.raises(ValueError):
            tok.apply_chat_template(CHATS[0])
    assert ours.apply_chat_template(CHATS[0], chat_template=PLAIN_TEMPLATE) == hf.apply_chat_template(
        CHATS[0], chat_template=PLAIN_TEMPLATE, return_dict=False)


def test_prepared_backend_is_what_transformers_rebuilt(pair, source):
    """The raw tokenizer.json would encode differently: parity comes from serializing transformers' backend."""
    for name, text in (("qwen2-rebuilt", "Hello World"), ("split-special", "<|im_start|>hi"),
                       ("vocab-files-bos", "hi"), ("gguf-sentencepiece", "hi")):
        ours, hf, src = pair(name)
        assert ours.encode(text) == hf.encode(text)
        raw = src.parent / "tokenizer.json" if src.suffix == ".gguf" else src / "tokenizer.json"
        if raw.exists():
            assert tokenizers.Tokenizer.from_file(str(raw)).encode(text).ids != hf.encode(text), name
    ours, hf, _ = pair("vocab-files-eos")
    assert ours.encode("hi")[-1] == hf.eos_token_id
    ours, hf, _ = pair("wordlevel-cleanup")
    ids = hf.encode("The river , it 's ok . I do n't know")
    want = hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=True) == want == "the river, it's ok. i don't know"
    ours, hf, _ = pair("post-processor-bos")  # tokenizer.json truncates to 8 and pads to 64; transformers does not
    assert len(ours.encode(CORPUS[0])) == len(hf.encode(CORPUS[0])) > 8


def test_decode_stream_on_the_backend(pair):
    """Engine code steps tokenizers' DecodeStream on `_tokenizer`, as it did on transformers' fast tokenizers."""
    ours, hf, _ = pair("ckpt-qwen3")
    for text in TEXTS[12:26]:
        ids = hf.encode(text)
        stream = tokenizers.decoders.DecodeStream(skip_special_tokens=False)
        assert "".join(filter(None, (stream.step(ours._tokenizer, i) for i in ids))) == hf.decode(ids)
    batch = [hf.encode(t) for t in TEXTS[:5]]
    assert ours._tokenizer.decode_batch(batch) == hf.batch_decode(batch)


def test_smollm2_gguf(cache):
    """A real model's tokenizer, converted from its GGUF file."""
    try:
        path = smollm2_gguf()
    except FetchError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the real-weight tests: {e}")
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    ours, hf = load_tokenizer(prepare_tokenizer(path, cache)), _hf(path)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text)
        assert ours.decode(hf.encode(text)) == hf.decode(hf.encode(text))
    for chat in CHATS[:2]:
        assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == hf.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False)


# ---- the cache, processes, and no torch ---------------------------------------------------------

def _python(code: str, *args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(code: str, *args, cwd: Path) -> str:
    proc = _python(code, *args, cwd=cwd)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out


NO_TORCH = "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)"


def test_cache_hit_imports_no_transformers_and_changes_give_new_keys(source, tmp_path, cache):
    src = tmp_path / "ckpt"
    shutil.copytree(source("config-template"), src)
    first = prepare_tokenizer(src, cache)
    again = _run(f"""
        import sys
        from pathlib import Path
        import headrace.checkpoint.tokenizer as t
        {NO_TORCH}
        print(t.prepare_tokenizer(Path(sys.argv[1]), Path(sys.argv[2])))
        {NO_TORCH}
    """, src, cache, cwd=tmp_path)
    assert Path(again.strip()) == first
    assert prepare_tokenizer(str(src), cache) == first  # a str source, same key

    _config(src, model_max_length=1234)
    changed = prepare_tokenizer(src, cache)
    assert changed != first and changed.parent == first.parent
    assert load_tokenizer(changed).model_max_length == 1234 == _hf(src).model_max_length
    assert load_tokenizer(first).model_max_length == 2048  # the old one is left as it was
    (src / "config.json").write_text("{}")  # a new tokenizer-relevant file
    third = prepare_tokenizer(src, cache)
    assert third not in (first, changed)
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "plain.jinja").write_text(PLAIN_TEMPLATE)
    named = load_tokenizer(prepare_tokenizer(src, cache))
    assert named.name_or_path == str(src.resolve()) and named.chat_template == _hf(src).chat_template
    assert "plain" in named.chat_template and prepare_tokenizer(src, cache) not in (first, changed, third)
    assert sorted(p.name for p in first.iterdir()) == sorted(["tokenizer.json", META_FILE])


def test_gguf_key_counts_its_siblings(source, tmp_path, cache):
    """transformers reads a tokenizer.json next to a .gguf instead of the file's own tokenizer."""
    gguf_file = tmp_path / "model.gguf"
    shutil.copy(source("gguf-bytelevel"), gguf_file)
    alone = load_tokenizer(prepare_tokenizer(gguf_file, cache))
    assert alone.chat_template == _hf(gguf_file).chat_template == TEMPLATE
    shutil.copy(source("ckpt-llama") / "tokenizer.json", tmp_path / "tokenizer.json")
    beside = load_tokenizer(prepare_tokenizer(gguf_file, cache))
    assert beside.name_or_path == alone.name_or_path and beside.chat_template is _hf(gguf_file).chat_template is None
    (tmp_path / "tokenizer.json").unlink()
    shutil.copy(source("gguf-sentencepiece"), gguf_file)  # another tokenizer in the same file name
    other = load_tokenizer(prepare_tokenizer(gguf_file, cache))
    assert other.encode("hi") == _hf(gguf_file).encode("hi") != alone.encode("hi")


def test_concurrent_prepares_both_succeed(source, tmp_path, cache):
    """Two processes prepare the same source at once (a barrier lines them up after importing transformers)."""
    src = source("ckpt-qwen2")
    code = """
        import sys, time
        from pathlib import Path
        from transformers import AutoTokenizer, TokenizersBackend  # the slow part, before the barrier
        from headrace.checkpoint.tokenizer import prepare_tokenizer
        me, other = Path(sys.argv[3]), Path(sys.argv[4])
        me.touch()
        while not other.exists():
            time.sleep(0.005)
        print(prepare_tokenizer(Path(sys.argv[1]), Path(sys.argv[2])))
    """
    a, b = tmp_path / "a", tmp_path / "b"
    procs = [_python(code, src, cache, a, b, cwd=tmp_path), _python(code, src, cache, b, a, cwd=tmp_path)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    paths = {Path(out.strip()) for out, _ in outs}
    assert len(paths) == 1
    (path,) = paths
    assert [p.name for p in (cache / "tokenizers").iterdir()] == [path.name]  # no temporary directory left over
    hf = _hf(src)
    assert load_tokenizer(path).encode(CORPUS[12]) == hf.encode(CORPUS[12])


def test_fresh_interpreter_uses_no_torch(pair, source, tmp_path, cache):
    _, hf, src = pair("config-template")
    out = _run(f"""
        import json, sys
        from tokenizers.decoders import DecodeStream
        from headrace.checkpoint.tokenizer import prepare_tokenizer, Tokenizer
        tok = Tokenizer.load(prepare_tokenizer(sys.argv[1], sys.argv[2]))
        chat = [{{"role": "user", "content": "今天 🌊"}}]
        ids = tok.encode(sys.argv[3])
        stream = DecodeStream(skip_special_tokens=False)
        print(json.dumps(dict(ids=ids, text=tok.decode(ids),
                              batch=tok.batch_decode([ids, ids[:3]], skip_special_tokens=True),
                              chat=tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                              chat_ids=tok.apply_chat_template(chat, enable_thinking=False, add_generation_prompt=True),
                              streamed="".join(filter(None, (stream.step(tok._tokenizer, i) for i in ids))))))
        {NO_TORCH}
    """, src, cache, CORPUS[21], cwd=tmp_path)
    got = json.loads(out)
    chat = [{"role": "user", "content": "今天 🌊"}]
    ids = hf.encode(CORPUS[21])
    assert got == dict(ids=ids, text=hf.decode(ids), batch=hf.batch_decode([ids, ids[:3]], skip_special_tokens=True),
                       chat=hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                       chat_ids=hf.apply_chat_template(chat, enable_thinking=False, add_generation_prompt=True,
                                                       return_dict=False),
                       streamed=hf.decode(ids))


# ---- errors -------------------------------------------------------------------------------------

def test_sources_without_a_usable_tokenizer_are_refused(tmp_path, cache):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"cannot load a tokenizer from .*empty"):
        prepare_tokenizer(tmp_path / "empty", cache)
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot load a tokenizer from .*corrupt"):
        prepare_tokenizer(tmp_path / "corrupt", cache)
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "tokenizer_config.json").write_text('{"tokenizer_class": "ByT5Tokenizer"}')
    with pytest.raises(ValueError, match=r"slow \(ByT5Tokenizer\) is not a fast"):
        prepare_tokenizer(tmp_path / "slow", cache)
    with pytest.raises(ValueError, match="no such file"):
        prepare_tokenizer(tmp_path / "missing", cache)
    assert not (cache / "tokenizers").exists() or not any((cache / "tokenizers").iterdir())


def test_loading_a_directory_that_is_not_prepared(source, tmp_path, cache):
    with pytest.raises(ValueError, match="not a prepared tokenizer"):
        Tokenizer.load(tmp_path)
    with pytest.raises(ValueError, match="not a prepared tokenizer"):
        load_tokenizer(source("ckpt-llama"))  # a checkpoint, not a prepared directory
    prepared = prepare_tokenizer(source("ckpt-llama"), cache)
    stale = tmp_path / "stale"
    shutil.copytree(prepared, stale)
    meta = json.loads((stale / META_FILE).read_text())
    (stale / META_FILE).write_text(json.dumps({**meta, "format": 0}))
    with pytest.raises(ValueError, match="prepare it again"):
        Tokenizer.load(stale)
