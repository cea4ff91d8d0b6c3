"""A tiny, deterministic byte-level BPE tokenizer for tests, trained offline on a built-in corpus.

Byte-level means every UTF-8 byte has its own base token, so any string encodes and decodes
losslessly (after NFC normalization), and characters outside the (small) learned vocabulary --
many CJK characters and most emoji -- split across several tokens. Streaming detokenization
tests rely on exactly that.

Why the Qwen2 pipeline (NFC, then the Qwen2 split regex, then ByteLevel without its own regex):
transformers 5's AutoTokenizer ignores tokenizer.json's normalizer and pre-tokenizer for
model_type "qwen2" and rebuilds them as Qwen2Tokenizer does. Training with that same pipeline
makes every loader (TokenizersBackend for llama/qwen3, Qwen2Tokenizer for qwen2) encode alike.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode
# Imported, not copied: it must stay what Qwen2Tokenizer uses (GPT-4-like; digits split singly).
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)  # ids 0..4, in this order

# ChatML: each message is `<|im_start|>role\ncontent<|im_end|>\n`; the generation prompt opens
# an assistant turn. No bos: the template writes only what it shows.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS: tuple[str, ...] = (
    # English prose
    "The river was low that autumn, and the rowers carried their boat down to the water "
    "before the sun had cleared the hills. Nobody spoke much; the coach checked the rigging, "
    "counted the oars twice, and wrote the times of the last three pieces on a small card.",
    "A good engine does one thing at a time and does it well. It reads the request, plans the "
    "batch, runs the model, and hands each token back as soon as it is ready. When memory runs "
    "short it waits, or it gives a block back, and then it tries again.",
    "She asked whether the answer would change if the question were longer. He said it might, "
    "but only a little, and that the first words of an answer matter more than the last ones.",
    "Hello, world! How are you today? I'm fine, thanks -- and you? Let's meet at 10:30 a.m. "
    "on Tuesday, the 3rd of March; bring the notes, the charts, and (if you can) the old map.",
    # code-ish text
    "def add(a: int, b: int) -> int:\n    return a + b\n\nprint(add(2, 3))  # prints 5\n",
    "for (int i = 0; i < n; ++i) {\n    sum += x[i] * w[i];\n}\nreturn sum / (float)n;\n",
    'import torch\nx = torch.zeros(4, 8, dtype=torch.float16)\nif x.shape[-1] != 8:\n    raise ValueError("bad shape")\n',
    '{"model": "tiny", "layers": 2, "hidden": 64, "tags": ["test", "demo"], "ok": true, "ratio": 0.75}',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name ASC LIMIT 10;",
    "git commit -m 'fix: off-by-one in block table' && git push origin main",
    # numbers
    "0 1 2 3 4 5 6 7 8 9 10 11 12 42 64 100 128 256 512 1000 1024 2048 4096 65536 1000000",
    "3.14159 2.71828 -0.5 1e-6 6.02e23 0x1F 0b1011 12,345.67 99% 1/3 2024-05-17 23:59:59",
    # Chinese
    "今天天气很好，我们去河边散步吧。河水很清，风也不大，远处有几条小船在慢慢地划。",
    "机器学习模型需要大量的数据和计算。推理引擎的任务是把模型的输出尽快地送回给用户。",
    "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。",
    "我们在测试中文的分词效果：一二三四五六七八九十，百千万亿。",
    # Japanese
    "今日はいい天気ですね。川のそばを散歩しましょう。ボートがゆっくり進んでいます。",
    "カタカナとひらがなと漢字がまざった文章を、トークナイザーはどう分けるでしょうか。",
    "東京から大阪まで新幹線で二時間半くらいかかります。駅弁を買うのを忘れないでください。",
    # Korean
    "안녕하세요! 오늘 날씨가 정말 좋네요. 강가에서 산책하고 싶어요.",
    "한국어 문장은 띄어쓰기가 있어서 단어를 나누기가 조금 더 쉽습니다.",
    # emoji, including skin-tone modifiers, ZWJ sequences, flags and keycaps
    "Great job 👍 👍🏽 👍🏿! 🎉🎉 Let's go 🚣‍♀️🚣 on the river 🌊 at dawn 🌅.",
    "Family: 👨‍👩‍👧 👨‍👩‍👧‍👦 👩‍❤️‍👨 — flags: 🇯🇵 🇺🇸 🇰🇷 🇨🇳 🇩🇪 🇫🇷 🏳️‍🌈 — keycaps: 1️⃣ 2️⃣ #️⃣",
    "Weather ☀️ 🌧️ ❄️ 🌈; food 🍣 🍜 🍕 🥟; faces 😀 😂 🥲 🤔 😴; hearts ❤️ 💙 💚.",
    # mixed
    "The word for river is 河 (hé) in Chinese, 川 (kawa) in Japanese and 강 (gang) in Korean 🌊.",
    "Tokens/s: 1234.5 ✅ | latency p99: 87 ms ⚠️ | 显存占用 12.3 GiB | メモリ 8 GB | 메모리 부족 ❌",
)


def _train(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # NFC only because Qwen2Tokenizer forces it (see the module docstring); it makes
    # decode(encode(s)) == s hold for NFC text only, which all our strings are.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte gets a base token, even ones the corpus never uses.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


# What fill_to adds: words (an ASCII word piece plus a learned letters-only piece, half of them led
# by the byte-level space marker, at most MAX_WORD_CHARS long) and, for CJK_SHARE of the new
# tokens, byte slices of CJK text that often start or end inside a character.
MAX_WORD_CHARS = 9
CJK_SHARE = 0.1


def _is_cjk(ch: str) -> bool:
    """CJK punctuation, kana, ideographs, Hangul, fullwidth forms: three UTF-8 bytes each."""
    return "\u3000" <= ch <= "\ud7af" or "\uff00" <= ch <= "\uffef"


def _fill(tok: Tokenizer, size: int) -> Tokenizer:
    """`tok` with deterministic synthetic merges appended until its vocabulary has `size` entries.

    Every new token is the merge of two tokens already there, so encoding stays lossless; the
    learned merges keep their ranks, and the new ones come after them.
    """
    data = json.loads(tok.to_str())
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]  # token -> id, [[left, right]]
    learned = sorted(t for t in vocab if re.fullmatch("Ġ?[A-Za-z]+", t))
    pools = {True: [t for t in learned if t[0] == "Ġ"], False: [t for t in learned if t[0] != "Ġ"]}
    suffixes = list(pools[False])
    byte_char = bytes_to_unicode()
    cjk_chars = sorted({ch for text in CORPUS for ch in text if _is_cjk(ch)})
    rng = random.Random(0)
    num_learned, num_cjk = len(vocab), 0

    def add(left: str, right: str) -> None:
        vocab[left + right] = len(vocab)
        merges.append([left, right])

    while len(vocab) < size:
        if num_cjk < CJK_SHARE * (len(vocab) - num_learned):
            chars = "".join(rng.choice(cjk_chars) for _ in range(rng.randint(1, 2)))
            encoded = "".join(byte_char[b] for b in chars.encode())
            piece = encoded[rng.randrange(3):len(encoded) - rng.randrange(3)]
            # Built one byte at a time, so each step merges two tokens that exist.
            for end in range(2, len(piece) + 1):
                if piece[:end] not in vocab and len(vocab) < size:
                    add(piece[:end - 1], piece[end - 1])
                    num_cjk += 1
        else:
            spaced = rng.random() < 0.5
            pool = pools[spaced]  # in the order added: the earlier, the shorter; favour those
            left, right = pool[int(len(pool) * rng.random() ** 3)], rng.choice(suffixes)
            if left + right not in vocab and len(left + right) <= MAX_WORD_CHARS:
                add(left, right)
                pools[spaced].append(left + right)
    return Tokenizer.from_str(json.dumps(data))


def build_tokenizer(out_dir: str | Path, vocab_size: int = 1000, fill_to: int | None = None) -> PreTrainedTokenizerFast:
    """Train the test tokenizer on `CORPUS`, save it to `out_dir` and return it.

    Deterministic: the same arguments write the same files every time. `vocab_size` is an
    upper bound (specials + 256 bytes + merges); the corpus may run out of merges first.
    `fill_to` then extends the trained vocabulary with synthetic merges to exactly that many
    entries, so that a model with a large vocabulary samples no id the tokenizer does not know:
    mostly ASCII words (half with a leading space) and some byte slices of CJK text, which
    split characters across tokens as real tokenizers do.
    Special tokens `<|bos|>`, `<|eos|>`, `<|pad|>`, `<|im_start|>`, `<|im_end|>` have ids 0..4.
    There is no post-processor: `encode` never adds bos/eos by itself, callers add them.
    There is no unk token (byte-level BPE needs none); tokenizer_config.json says so with
    `"unk_token": null`, else Qwen2Tokenizer would add an `<|endoftext|>` beyond the vocab.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    trained = _train(vocab_size)
    if fill_to is not None:
        if fill_to < trained.get_vocab_size():
            raise ValueError(f"fill_to ({fill_to}) is below the trained vocabulary ({trained.get_vocab_size()})")
        trained = _fill(trained, fill_to)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=trained,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=None,
        extra_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,  # keep decode lossless
        model_max_length=1 << 20,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer
