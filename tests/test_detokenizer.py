"""Frontend text: the incremental detokenizer and per-request output processing.

The reference is always transformers' `tokenizer.decode` of all ids with the same options: the
deltas a stream emits (plus flush) must concatenate to exactly that, and no delta may show a
half-decoded character (U+FFFD) unless the token ids themselves are invalid UTF-8.
"""
from __future__ import annotations

import copy
import random
import time

import numpy as np
import pytest
from transformers import AutoTokenizer

from headrace.checkpoint.tokenizer import load_tokenizer, prepare_tokenizer
from headrace.core.protocol import EngineCoreOutput, pack_floats, pack_ids
from headrace.frontend.detokenizer import IncrementalDetokenizer
from headrace.frontend.output_processor import RequestState, TokenText
from headrace.sampling_params import RequestOutputKind, SamplingParams
from headrace.testing import CORPUS, build_tokenizer

SPECIAL_IDS = (0, 1, 2, 3, 4)  # <|bos|> <|eos|> <|pad|> <|im_start|> <|im_end|>
FFFD = "\ufffd"

# Beyond the corpus: rare CJK (some outside the BMP), Japanese, Korean, emoji with skin tones,
# ZWJ families, flags (regional indicators and tag sequences), keycaps, mixed with ASCII,
# whitespace and newlines. Most of these characters are not in the learned vocabulary, so
# their UTF-8 bytes split across several byte-level tokens.
EXTRA = (
    "龘龘 鬱 𠀋𠀌 — rare CJK, two of them outside the BMP",
    "日本語のテキスト：ひらがな、カタカナ、漢字。\n  次の行です",
    "한글 테스트입니다.\t탭과  두 칸 공백\n끝",
    "skin tones 👋🏻👋🏼👋🏽👋🏾👋🏿 and people 🧑🏾‍🚀 👩🏻‍💻",
    "families 👨‍👨‍👧‍👦 👩‍👩‍👦 ZWJ 🏳️‍⚧️ 🐻‍❄️",
    "flags 🇧🇷🇮🇳🇿🇦 🏴󠁧󠁢󠁳󠁣󠁴󠁿 keycaps *️⃣ 0️⃣ 9️⃣ 🔟",
    "\n\n  mixed: abc 河 def 🌊\r\n\tend 😀\n",
    "😀",
    "🇯🇵",
    "a👍🏽b河c강d",
    "   leading and trailing spaces   ",
)
TEXTS = CORPUS + EXTRA


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("detok_tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def hf(tokenizer_dir):
    """transformers' tokenizer: the reference every decode is checked against."""
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session", params=["headrace", "transformers"])
def tok(request, hf, tokenizer_dir, tmp_path_factory):
    """What the detokenizer runs on: headrace's torch-free tokenizer (the
    frontends') prepared from the same files, or transformers' own."""
    if request.param == "transformers":
        return hf
    return load_tokenizer(prepare_tokenizer(tokenizer_dir, tmp_path_factory.mktemp("prepared")))


def _chunks(n: int, rng: random.Random | None, max_chunk: int = 5) -> list[int]:
    """Chunk sizes summing to n: all 1 without rng, else seeded random sizes 1..max_chunk."""
    if rng is None:
        return [1] * n
    sizes = []
    while n > 0:
        sizes.append(min(n, rng.randint(1, max_chunk)))
        n -= sizes[-1]
    return sizes


def _with_specials(tok, text: str, rng: random.Random) -> list[int]:
    """text cut at random character positions, each piece encoded, special tokens between them."""
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 4))) if len(text) > 1 else []
    ids = [rng.choice(SPECIAL_IDS)]
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        ids += tok.encode(text[a:b])
        ids.append(rng.choice(SPECIAL_IDS))
    return ids


def _stream(tok, ids, sizes, **opts) -> tuple[list[str], str, IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, **opts)
    deltas, pos = [], 0
    for n in sizes:
        deltas.append(d.add(ids[pos : pos + n]))
        pos += n
    assert pos == len(ids)
    return deltas, d.flush(), d


def _token_byte_ends(tok, ids) -> set[int]:
    """Byte offsets where tokens end (byte-level BPE: one token char = one UTF-8 byte)."""
    ends, n = set(), 0
    for t in tok.convert_ids_to_tokens(ids):
        n += len(t)
        ends.add(n)
    return ends


# ---------------------------------------------------------------- IncrementalDetokenizer


def test_extra_texts_really_split_characters(tok, hf):
    """Guard for the streaming tests: many tokens hold only part of a character."""
    partial = [i for s in TEXTS for i in tok.encode(s) if FFFD in hf.decode([i])]
    assert len(partial) > 100
    for s in EXTRA:
        assert any(FFFD in hf.decode([i]) for i in tok.encode(s)) or s.isascii(), s


@pytest.mark.parametrize("mode", ["one_token", "random_chunks"])
@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_decode(tok, mode, skip, hf):
    """Every text, one token at a time or in random chunks: no U+FFFD in any delta, and the
    deltas plus flush() concatenate to decode(ids); the same with special tokens in between."""
    rng = random.Random(1234)
    for text in TEXTS:
        for ids in (tok.encode(text), _with_specials(tok, text, rng)):
            sizes = _chunks(len(ids), rng if mode == "random_chunks" else None)
            deltas, tail, d = _stream(tok, ids, sizes, skip_special_tokens=skip)
            ref = hf.decode(ids, skip_special_tokens=skip)
            assert FFFD not in ref
            assert not any(FFFD in x for x in deltas + [tail]), (text, deltas)
            assert "".join(deltas) + tail == ref == d.text
            assert d.token_ids == ids
            # valid text: flush has nothing left once the last character completed
            assert tail == ""


def test_a_tokenizer_with_clean_up_decodes_through_the_tokenizer(tok):
    """The Rust decode stream is only for tokenizers without the clean-up
    pass; one with it goes through tokenizer.decode, and the stream still
    adds up to that."""
    assert IncrementalDetokenizer(tok)._stream is not None
    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    text = "a , b . c ! don ' t"
    ids = cleaning.encode(text)
    deltas, tail, d = _stream(cleaning, ids, _chunks(len(ids), None))
    assert d._stream is None
    assert "".join(deltas) + tail == cleaning.decode(ids)


class _CountingStream:
    """Wraps a DecodeStream: counts step() calls, and raises at call number fail_at."""

    def __init__(self, stream, fail_at: int | None = None) -> None:
        self.stream, self.fail_at, self.calls = stream, fail_at, 0

    def step(self, backend, token_id):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("decoder rewrote earlier text")
        return self.stream.step(backend, token_id)


def test_one_decode_call_per_token(tok, hf):
    """A fast tokenizer decodes each token with one call into its backend's
    decode stream, and no other decode until flush()."""
    for text in TEXTS:
        ids = tok.encode(text)
        d = IncrementalDetokenizer(tok)
        counter = d._stream = _CountingStream(d._stream)
        d._decode = None  # any window decode would fail
        deltas = [d.add(ids[i : i + n]) for i, n in zip(range(0, len(ids), 3), [3] * len(ids))]
        assert counter.calls == len(ids)
        del d._decode
        assert "".join(deltas) + d.flush() == hf.decode(ids)


def test_a_failing_decode_stream_falls_back_to_windows(tok, hf):
    """A decode stream that raises part way (a decoder that rewrites earlier
    text) hands over to window decoding: nothing emitted is lost or repeated."""
    for text in TEXTS:
        ids = tok.encode(text)
        for fail_at in {1, len(ids) // 2 + 1, len(ids)}:
            d = IncrementalDetokenizer(tok)
            d._stream = _CountingStream(d._stream, fail_at)
            deltas = [d.add([t]) for t in ids]
            assert d._stream is None
            assert "".join(deltas) + d.flush() == hf.decode(ids), (text, fail_at)
            assert FFFD not in "".join(deltas)


def test_skipped_specials_inside_a_character(tok, hf):
    """Skipped special tokens between the byte tokens of one character: the character still
    comes out whole, once."""
    rng = random.Random(7)
    for text in TEXTS:
        ids = tok.encode(text)
        for _ in range(3):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(SPECIAL_IDS))
        deltas, tail, _ = _stream(tok, ids, _chunks(len(ids), rng, 3), skip_special_tokens=True)
        assert not any(FFFD in x for x in deltas + [tail])
        assert "".join(deltas) + tail == hf.decode(ids, skip_special_tokens=True) == text


def _byte_tokens(tok, char: str, num_bytes: int) -> list[int]:
    ids = tok.encode(char)
    assert len(ids) == num_bytes and all(tok.decode([i]) == FFFD for i in ids), (char, ids)
    return ids


@pytest.mark.parametrize("skip", [True, False])
def test_invalid_utf8_at_end(tok, skip, hf):
    """Ids ending in an incomplete character: nothing of it is emitted until flush(), which
    then yields what decode yields (with U+FFFD), so the concatenation still equals decode."""
    clef = _byte_tokens(tok, "𝄞", 4)  # U+1D11E, 4 bytes, 4 byte tokens
    dragon = _byte_tokens(tok, "龘", 3)  # 3 bytes, 3 byte tokens
    cases = [
        ([], clef[:1]),
        ([], clef[:3]),
        ([], dragon[:2]),
        (tok.encode("The river "), clef[:1]),
        (tok.encode("河水很清") + [3], dragon[:1]),
        (tok.encode("flag 🇯🇵 then"), clef[:2]),
    ]
    for valid, partial in cases:
        ids = valid + partial
        for sizes in ([1] * len(ids), [len(valid)] * bool(valid) + [len(partial)]):
            d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            deltas, pos = [], 0
            for n in sizes:
                deltas.append(d.add(ids[pos : pos + n]))
                pos += n
                if pos > len(valid):
                    assert deltas[-1] == "" or FFFD not in deltas[-1]
            emitted = "".join(deltas)
            assert FFFD not in emitted
            assert emitted == hf.decode(valid, skip_special_tokens=skip)
            tail = d.flush()
            ref = hf.decode(ids, skip_special_tokens=skip)
            assert FFFD in ref and FFFD in tail
            assert emitted + tail == ref == d.text
            assert d.flush() == ""  # a second flush adds nothing


def test_invalid_utf8_in_the_middle(tok, hf):
    """A lone lead byte followed by more text is genuinely invalid: the deltas show U+FFFD
    exactly where decode does, and still concatenate to decode."""
    lead = _byte_tokens(tok, "𝄞", 4)[0]
    ids = tok.encode("ab") + [lead] + tok.encode(" cd 河 👍🏽")
    for sizes in ([1] * len(ids), [2, 3, len(ids) - 5]):
        deltas, tail, _ = _stream(tok, ids, sizes)
        ref = hf.decode(ids)
        assert ref.count(FFFD) == 1
        assert "".join(deltas) + tail == ref


def test_literal_replacement_character(tok, hf):
    """A real U+FFFD in the text (bytes EF BF BD) is held until it cannot be a partial
    character any more, and the text still equals decode."""
    ids = tok.encode("a\ufffdb \ufffd")
    deltas, tail, _ = _stream(tok, ids, [1] * len(ids))
    assert "".join(deltas) + tail == hf.decode(ids) == "a\ufffdb \ufffd"


# ---------------------------------------------------------------- RequestState


def _state(tok, **params) -> RequestState:
    return RequestState("req-0", "a prompt", [5, 6, 7], SamplingParams(**params), tok, TokenText(tok, len(tok)),
                        time.time())


def _core_output(ids, finish=None, stop_reason=None, **kw) -> EngineCoreOutput:
    return EngineCoreOutput(request_id="req-0", new_token_ids=pack_ids(ids), finish_reason=finish,
                            stop_reason=stop_reason, **kw)


def _take(state, out):
    state.process(out)
    return state.output()


def _feed(state, ids, sizes, finish="length", stop_reason=None) -> list:
    """process() each chunk, the last with the core's finish, and take an output after each
    (a consumer that keeps up). Returns those outputs (None where there was nothing new)."""
    outs, pos = [], 0
    for k, n in enumerate(sizes):
        last = k == len(sizes) - 1
        outs.append(_take(state, _core_output(ids[pos : pos + n], finish if last else None,
                                               stop_reason if last else None)))
        pos += n
    assert pos == len(ids)
    return outs


KIND_TEXTS = [CORPUS[0], CORPUS[12], CORPUS[22], CORPUS[25], EXTRA[4], EXTRA[6]]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds(tok, kind, skip, hf):
    rng = random.Random(99)
    for text in KIND_TEXTS:
        ids = _with_specials(tok, text, rng)
        final = hf.decode(ids, skip_special_tokens=skip)
        state = _state(tok, output_kind=kind, skip_special_tokens=skip)
        outs = _feed(state, ids, _chunks(len(ids), rng, 4))
        assert state.finished and state.finish_reason == "length" and not state.stopped_by_string
        assert state.final_text() == final
        got = [o for o in outs if o is not None]
        assert got[-1] is outs[-1] and got[-1].finished
        assert not any(o.finished for o in got[:-1])
        for o in got:
            assert o.request_id == "req-0" and o.prompt == "a prompt" and o.prompt_token_ids == [5, 6, 7]
            assert len(o.outputs) == 1 and o.outputs[0].logprobs is None and o.outputs[0].cumulative_logprob is None
        comps = [o.outputs[0] for o in got]
        assert comps[-1].finish_reason == "length" and comps[-1].stop_reason is None
        assert all(c.finish_reason is None for c in comps[:-1])
        if kind == RequestOutputKind.DELTA:
            assert not any(FFFD in c.text for c in comps)
            assert "".join(c.text for c in comps) == final
            assert [t for c in comps for t in c.token_ids] == ids
        elif kind == RequestOutputKind.CUMULATIVE:
            assert len(got) == len(outs)  # one per core output
            for a, b in zip(comps, comps[1:]):
                assert b.text.startswith(a.text)
                assert b.token_ids[: len(a.token_ids)] == a.token_ids
            assert comps[-1].text == final and comps[-1].token_ids == ids
        else:
            assert outs[:-1] == [None] * (len(outs) - 1)
            assert len(comps) == 1 and comps[0].text == final and comps[0].token_ids == ids
        assert _take(state, _core_output(tok.encode(" more"), "length")) is None  # finished: ignored


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_finish_flushes_an_incomplete_character(tok, kind, hf):
    """The core finishing on a token that leaves a character incomplete: the last output holds
    the rest of decode (with U+FFFD); nothing of it was shown before."""
    valid = tok.encode("Weather 河 ok ")
    ids = valid + _byte_tokens(tok, "𝄞", 4)[:2]
    state = _state(tok, output_kind=kind)
    outs = _feed(state, ids, [1] * len(ids))
    got = [o.outputs[0] for o in outs if o is not None]
    assert not any(FFFD in c.text for c in got[:-1])
    full = "".join(c.text for c in got) if kind == RequestOutputKind.DELTA else got[-1].text
    assert full == hf.decode(ids) == state.final_text() and full.endswith(FFFD)


def _stop_case(tok, text: str, stop: str, cjk: bool):
    """The ids of text, with checks that stop really occurs there and spans token boundaries
    (for cjk: one inside a multi-byte character)."""
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    i = text.index(stop)
    bs = len(text[:i].encode())
    be = bs + len(stop.encode())
    inner = {b for b in _token_byte_ends(tok, ids) if bs < b < be}
    assert inner, "the stop string must span a token boundary"
    assert bs not in _token_byte_ends(tok, ids) or be not in _token_byte_ends(tok, ids)
    if cjk:
        char_bounds = {len(text[:k].encode()) for k in range(len(text) + 1)}
        assert inner - char_bounds, "a token boundary must fall inside a character of the stop string"
        assert any(len(c.encode()) == 3 for c in stop)
    assert len(ids) - len(tok.encode(text[: i + len(stop)])) > 5  # tokens follow the match
    return ids, i


STOP_CASES = [
    (CORPUS[0], "iver was l", False),  # starts inside " river", ends inside " lo"
    (CORPUS[12], "边散步", True),  # 边 and 步 each split across two byte-level tokens
    (CORPUS[25], "显存", True),
]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", list(RequestOutputKind))
@pytest.mark.parametrize("text,stop,cjk", STOP_CASES)
def test_stop_string(tok, text, stop, cjk, kind, include):
    ids, i = _stop_case(tok, text, stop, cjk)
    expected = text[: i + len(stop)] if include else text[:i]
    for seed in (None, 0, 1, 2):
        rng = None if seed is None else random.Random(seed)
        state = _state(tok, output_kind=kind, stop=[stop], include_stop_str_in_output=include)
        outs = _feed(state, ids, _chunks(len(ids), rng, 4))
        done = [k for k, o in enumerate(outs) if o is not None and o.finished]
        assert len(done) == 1, "exactly one finished output"
        end = done[0]
        assert end < len(outs) - 1, "the frontend ends it before the core does"
        assert outs[end + 1 :] == [None] * (len(outs) - end - 1), "later core outputs are ignored"
        assert state.stopped_by_string and state.finished
        assert state.finish_reason == "stop" and state.stop_reason == stop
        assert state.final_text() == expected
        last = outs[end].outputs[0]
        assert last.finish_reason == "stop" and last.stop_reason == stop
        got = [o.outputs[0] for o in outs[: end + 1] if o is not None]
        if kind == RequestOutputKind.DELTA:
            assert "".join(c.text for c in got) == expected
            if not include:
                assert not any(stop in c.text for c in got)
        elif kind == RequestOutputKind.CUMULATIVE:
            for c in got:  # never anything at or after the match (beyond it, when included)
                assert expected.startswith(c.text)
            for a, b in zip(got, got[1:]):
                assert b.text.startswith(a.text)
            assert last.text == expected
        else:
            assert len(got) == 1 and last.text == expected
        if include:
            assert state.final_text().endswith(stop)
        assert _take(state, _core_output(tok.encode(" tail"), "length")) is None
        assert state.finish_reason == "stop" and state.final_text() == expected


@pytest.mark.parametrize("stops,winner", [
    (["the water", "iver was l", "never there"], "iver was l"),
    (["autumn", "that autumn"], "that autumn"),  # same end, earlier start wins
    (["the water", "The river"], "The river"),
    (["oars", "coach", "hills"], "hills"),
])
@pytest.mark.parametrize("mode", ["one_token", "random_chunks", "one_output"])
def test_several_stop_strings_earliest_wins(tok, stops, winner, mode):
    text = CORPUS[0]
    ids = tok.encode(text)
    if mode == "one_output":  # everything at once, the core not finished yet
        sizes = [len(ids) - 1, 1]
    else:
        sizes = _chunks(len(ids), random.Random(5) if mode == "random_chunks" else None)
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        state = _state(tok, output_kind=kind, stop=stops)
        outs = _feed(state, ids, sizes)
        assert state.stop_reason == winner and state.finish_reason == "stop" and state.stopped_by_string
        expected = text[: text.index(winner)]
        assert state.final_text() == expected
        got = [o.outputs[0] for o in outs if o is not None]
        texts = "".join(c.text for c in got) if kind == RequestOutputKind.DELTA else got[-1].text
        assert texts == expected and got[-1].stop_reason == winner


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_unmatched_stop_strings_leave_text_complete(tok, kind):
    """Stop strings that never occur (one a long partial match) hold text back only until the
    core finishes; then the whole text comes out, with the core's finish reason."""
    rng = random.Random(3)
    for text, stops in ((CORPUS[0], ["river was high", "zzz"]), (CORPUS[12], ["河水很浑", "河边走"])):
        assert not any(s in text for s in stops)
        ids = tok.encode(text)
        for finish, stop_reason, extra in (("length", None, []), ("stop", 1, [1])):
            state = _state(tok, output_kind=kind, stop=stops)
            all_ids = ids + extra
            outs = _feed(state, all_ids, _chunks(len(all_ids), rng, 4), finish, stop_reason)
            got = [o.outputs[0] for o in outs if o is not None]
            full = "".join(c.text for c in got) if kind == RequestOutputKind.DELTA else got[-1].text
            assert full == text == state.final_text()
            assert outs[-1].finished and got[-1].finish_reason == finish and got[-1].stop_reason == stop_reason
            assert not state.stopped_by_string


def test_stop_string_completed_by_the_final_core_output(tok):
    """A match completed by the output that also finishes the request: reported as the stop
    string, but the core already ended it, so no abort is needed."""
    text = CORPUS[0]
    assert text.endswith("small card.")
    ids = tok.encode(text)
    state = _state(tok, output_kind=RequestOutputKind.DELTA, stop=["card."])
    outs = _feed(state, ids, [1] * len(ids))
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    assert outs[-1].outputs[0].stop_reason == "card."
    assert not state.stopped_by_string
    assert "".join(o.outputs[0].text for o in outs if o is not None) == text[: -len("card.")]


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_logprobs(tok, kind, hf):
    ids = tok.encode("Hello 河 👍🏽 world")
    rng = np.random.default_rng(0)
    rows = []  # per position: (sampled, sampled_lp, rank, top ids, top lps)
    for k, sampled in enumerate(ids):
        others = [int(t) for t in rng.choice(np.setdiff1d(np.arange(5, 1000), [sampled]), 3, replace=False)]
        top_lps = sorted(rng.uniform(-3.0, -0.01, 2).tolist(), reverse=True)
        if k % 3 == 0:  # the sampled token is the most likely
            top, rank, lp = [sampled, others[0]], 1, top_lps[0]
        elif k % 3 == 1:  # second most likely
            top, rank, lp = [others[0], sampled], 2, top_lps[1]
        else:  # outside the top-2
            top, rank, lp = others[:2], 5 + k, top_lps[1] - 1.25
        rows.append((sampled, lp, rank, top, top_lps))

    state = _state(tok, output_kind=kind, logprobs=2)
    outs, pos = [], 0
    sizes = [1, 2, 3] + [1] * len(ids)
    for n in sizes:
        part = rows[pos : pos + n]
        if not part:
            break
        pos += len(part)
        outs.append(_take(state, _core_output(
            [r[0] for r in part],
            "length" if pos == len(ids) else None,
            logprob_token_ids=pack_ids([[r[0], *r[3]] for r in part]),
            logprobs=pack_floats([[r[1], *r[4]] for r in part]),
            sampled_ranks=pack_ids([r[2] for r in part]),
            sampled_logprobs=pack_floats([r[1] for r in part]),
        )))
    assert pos == len(ids)
    got = [o.outputs[0] for o in outs if o is not None]
    if kind == RequestOutputKind.DELTA:
        per_pos = [d for c in got for d in c.logprobs]
        for c in got:
            assert len(c.logprobs) == len(c.token_ids)
    else:
        per_pos = got[-1].logprobs
    assert per_pos == state.logprobs and len(per_pos) == len(ids)

    f32 = lambda x: float(np.float32(x))  # noqa: E731  values travel as float32
    for entry, (sampled, lp, rank, top, top_lps) in zip(per_pos, rows):
        assert set(entry) == {sampled, *top}
        for r, (t, v) in enumerate(zip(top, top_lps), 1):
            assert entry[t].rank == r and entry[t].logprob == f32(v)
        assert entry[sampled].rank == rank and entry[sampled].logprob == f32(lp)
        for t, v in entry.items():
            assert v.decoded_token == hf.decode([t])
    assert any(FFFD in per_pos[k][ids[k]].decoded_token for k in range(len(ids)))  # byte tokens too
    expected = sum(f32(r[1]) for r in rows)
    assert got[-1].cumulative_logprob == pytest.approx(expected, abs=1e-9)
    assert state.cumulative_logprob == pytest.approx(expected, abs=1e-9)
    full = "".join(c.text for c in got) if kind == RequestOutputKind.DELTA else got[-1].text
    assert full == hf.decode(ids)


def test_token_text_table(tok, hf):
    """The logprobs' decoded_token table: each id's text alone, as decode([id])
    gives it, also for ids the model has beyond the tokenizer."""
    table = TokenText(tok, len(tok) + 7).of
    assert len(table) == len(tok) + 7
    assert all(table[i] == hf.decode([i]) for i in range(len(tok) + 7))


def _lp_output(ids, finish=None):
    """A core output for ids with logprobs=1: the sampled token (rank 1) and the next id."""
    return _core_output(ids, finish, logprob_token_ids=pack_ids([[t, (t + 1) % 1000] for t in ids]),
                        logprobs=pack_floats([[-0.5, -1.5] for _ in ids]), sampled_ranks=pack_ids([1] * len(ids)),
                        sampled_logprobs=pack_floats([-0.5] * len(ids)))


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_outputs_merge_when_the_consumer_lags(tok, kind):
    """Several core outputs arrive before the consumer asks: it gets one output
    with everything since its last (DELTA), or the latest state (CUMULATIVE)."""
    ids = tok.encode(CORPUS[12] + " " + EXTRA[3])
    state = _state(tok, output_kind=kind, logprobs=1)
    first = _take(state, _lp_output(ids[:5]))
    for i in range(5, len(ids), 2):
        state.process(_lp_output(ids[i : i + 2], "length" if i + 2 >= len(ids) else None))
    last = state.output()
    assert state.output() is None  # nothing new since
    assert last.finished and last.outputs[0].finish_reason == "length"
    c = last.outputs[0]
    if kind == RequestOutputKind.FINAL_ONLY:
        assert first is None
    if kind == RequestOutputKind.DELTA:
        assert first.outputs[0].token_ids + c.token_ids == ids
        assert first.outputs[0].text + c.text == tok.decode(ids)
        assert len(c.logprobs) == len(ids) - 5
    else:
        assert c.token_ids == ids and c.text == tok.decode(ids) and len(c.logprobs) == len(ids)
    assert all(set(e) == {t, (t + 1) % 1000} and e[t].rank == 1 for e, t in zip(c.logprobs, ids[-len(c.logprobs):]))
    assert c.cumulative_logprob == pytest.approx(-0.5 * len(ids))
    assert list(c.logprobs) == c.logprobs[:] and c.logprobs == list(c.logprobs)
