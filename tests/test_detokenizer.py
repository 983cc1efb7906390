"""Incremental detokenization: the deltas put together are the whole decode, for byte-level tokens that split
characters and for a Metaspace tokenizer whose decode drops the space of a window's first word; and the text an
offline request gets in one decode at its end is the one the deltas would have made."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models

from moeplex.models.make_model import EOS, byte_level_tokenizer
from moeplex.tokenizer import Detokenizer, whole_text

BYTES = byte_level_tokenizer()
WORDS = ["\u2581the", "\u2581cat", "\u2581sat", "s", "\u2581on", "\u2581\u00e9t\u00e9", "\u2581\u4e16\u754c", "!"]


def metaspace_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="!"))
    tokenizer.decoder = decoders.Metaspace()
    return tokenizer


def pushed(tokenizer: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    detok = Detokenizer(tokenizer)
    deltas = [detok.push(token) for token in ids]
    return deltas, "".join(deltas) + detok.flush()


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.text(min_size=0, max_size=80))
def test_byte_level_deltas_make_the_text_and_never_end_inside_a_character(text):
    ids = BYTES.encode(text).ids
    deltas, whole = pushed(BYTES, ids)
    assert whole == BYTES.decode(ids) == text
    assert not any(delta.endswith("\ufffd") for delta in deltas)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, len(WORDS) - 1), min_size=1, max_size=3 * 16 + 5))
def test_metaspace_words_keep_their_spaces_across_windows(ids):
    tokenizer = metaspace_tokenizer()
    deltas, whole = pushed(tokenizer, ids)
    assert whole == tokenizer.decode(ids)
    assert "".join(deltas) == whole  # nothing held back: every word is whole


def test_special_tokens_are_skipped_and_a_split_character_waits_for_its_last_byte():
    eos = BYTES.token_to_id(EOS)
    ids = BYTES.encode("a\u20ac").ids  # the euro sign is three bytes
    deltas, whole = pushed(BYTES, [ids[0], eos, *ids[1:]])
    assert deltas == ["a", "", "", "", "\u20ac"]
    assert whole == "a\u20ac"


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from([*range(0, 256, 7), 0xC3, 0xE2, 0x82, 0xAC, 0x80, 0xF0, 0x9F]), min_size=1, max_size=24),
       st.booleans(), st.booleans())
def test_the_text_decoded_at_the_end_is_the_streamed_text(ids, stopped, skip_special):
    """Byte tokens that often leave a character incomplete, or invalid, at the end; a stopped request's last token is
    the eos. Streamed: the deltas of every token, flushed unless the request stopped (what Engine._retire does)."""
    if stopped:
        ids = [*ids, BYTES.token_to_id(EOS)]
    detok = Detokenizer(BYTES, skip_special)
    streamed = "".join(detok.push(token) for token in ids) + ("" if stopped else detok.flush())
    assert whole_text(BYTES, ids, skip_special, stopped) == streamed


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, len(WORDS) - 1), min_size=1, max_size=40), st.booleans())
def test_the_text_decoded_at_the_end_keeps_metaspace_spaces(ids, stopped):
    tokenizer = metaspace_tokenizer()
    detok = Detokenizer(tokenizer)
    streamed = "".join(detok.push(token) for token in ids) + ("" if stopped else detok.flush())
    assert whole_text(tokenizer, ids, True, stopped) == streamed


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from([*range(0, 256, 5), 0xC3, 0xE2, 0x82, 0xAC, 0x80, 0xF0, 0x9F]), min_size=1, max_size=30),
       st.integers(0, 30), st.booleans())
def test_the_librarys_stream_and_the_python_path_agree_and_hand_over_midway(ids, switch_at, metaspace):
    """The tokenizers library's DecodeStream makes the deltas; where it refuses a window, the Python path goes on
    from the same offsets. Both paths give the same deltas, and so does a hand-over at any token."""
    tokenizer = metaspace_tokenizer() if metaspace else BYTES
    if metaspace:
        ids = [i % len(WORDS) for i in ids]
    streamed, python, handed = Detokenizer(tokenizer), Detokenizer(tokenizer), Detokenizer(tokenizer)
    python._stream = None
    deltas = {"stream": [], "python": [], "handed": []}
    for at, token in enumerate(ids):
        if at == switch_at:
            handed._stream = None
        for name, detok in (("stream", streamed), ("python", python), ("handed", handed)):
            deltas[name].append(detok.push(token))
    assert deltas["stream"] == deltas["python"] == deltas["handed"]
    assert streamed.flush() == python.flush() == handed.flush()


def test_a_window_the_library_refuses_goes_on_in_python():
    class Refusing:
        def step(self, tokenizer, token):
            raise Exception("Invalid prefix encountered")  # what DecodeStream raises where the window was rewritten

    ids = BYTES.encode("ab\u20acc").ids
    detok = Detokenizer(BYTES)
    first = detok.push(ids[0])
    detok._stream = Refusing()
    assert first + "".join(detok.push(token) for token in ids[1:]) == "ab\u20acc"
    assert detok._stream is None
