"""Tokenizer loading and incremental detokenization that never splits a UTF-8 character."""

from __future__ import annotations

import os

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def load_tokenizer(folder: str) -> Tokenizer | None:
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        return None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the tokenizers library raises a bare Exception for any file it cannot parse
        raise ValueError(f"{path} is not a tokenizer file the tokenizers library can read: {exc}") from None


class Detokenizer:
    """Turns a growing list of token ids into text deltas.

    Byte-level tokens can end in the middle of a multi-byte character; such a tail
    decodes to U+FFFD and is held back until the following tokens complete it.
    Only a short window of recent ids is decoded each time, so cost stays flat.

    The window is the tokenizers library's own incremental decoder (`DecodeStream`: one call a token, against two
    decodes and two list slices from Python); the offsets are kept here too, for `flush` and for a decoder whose
    window no longer starts with the text already emitted, which DecodeStream refuses and the Python path handles.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context for tokenizers that merge across tokens
        self.read_offset = 0  # ids up to here have been emitted
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def push(self, token: int) -> str:
        self.ids.append(token)
        if self._stream is not None:
            try:
                delta = self._stream.step(self.tokenizer, token)
            except Exception:  # the window's text no longer starts with what was emitted: the Python path from here
                self._stream = None
            else:
                if delta is None:
                    return ""
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                return delta
        emitted = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if text.endswith("\ufffd") or len(text) <= len(emitted):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(emitted) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        emitted = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(emitted) :]


def text_while_running(params) -> bool:
    """Whether a request's text must grow with it inside the engine: its stop strings are searched in the text, or
    its constraint starts after some text. Otherwise the text may be made where it is read (the served front end
    streams it; offline generation decodes it once, at the end)."""
    return bool(params.stop or params.constraint_after)


def front_end_detokenizer(tokenizer: Tokenizer | None, params) -> Detokenizer | None:
    """The Detokenizer a served front end keeps for a request, making the text it streams from the ids; None where
    there is no tokenizer or the engine sends the text itself (`text_while_running`)."""
    if tokenizer is None or text_while_running(params):
        return None
    return Detokenizer(tokenizer, params.skip_special_tokens)


def whole_text(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool, stopped: bool) -> str:
    """The text a Detokenizer fed `ids` one by one would hold at the end, in one decode where that is the same: with
    its flush (a request that did not stop) it is the whole decode; a stopped request is not flushed, so an
    incomplete character it held back at the end is left out (only then is it replayed token by token)."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if not (stopped and text.endswith("\ufffd")):
        return text
    detok = Detokenizer(tokenizer, skip_special_tokens)
    return "".join(detok.push(token) for token in ids)
