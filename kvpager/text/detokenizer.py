"""Streaming text out of token ids: the incremental detokenizer and the stop-string checker. Torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Tokens of the prompt kept in the first decode window, so the first output token is decoded in
# context (SentencePiece strips a leading space at the start of a decode).
INITIAL_WINDOW = 5


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer (kvpager.text.tokenizer.Tokenizer satisfies it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one token at a time into new text, never emitting a half-decoded UTF-8 character.

    Prefix/read offsets (as in vLLM/TGI): `ids[prefix_offset:read_offset]` is a window already
    emitted; each step decodes the window plus the unread tokens and emits what the longer decode
    adds. Decoding a short window keeps each step O(window) and reproduces the context-dependent
    spacing of SentencePiece and byte-level decoders.
    NOTE: when the decode ends in U+FFFD the last character is incomplete (byte-level BPE spreads a
    CJK character or an emoji over several tokens): nothing is emitted and the offsets stay until
    it completes.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - INITIAL_WINDOW, 0)
        self.output_text = ""

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ("" while a character is pending)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.token_ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """Text still held back at the end of the request (an incomplete character decodes as U+FFFD)."""
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        delta = self._decode(self.prefix_offset, len(self.token_ids))[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.output_text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self._skip_special_tokens)


class StopChecker:
    """Finds stop strings in streamed text, even when one is split across tokens.

    `feed(delta)` returns `(text_to_emit, stopped, matched_stop_string)`. Text that could be the
    start of a stop string is held back until the next deltas decide it. On a match, the stop string
    and everything after it are cut (the stop string is kept when `include_in_output`).
    NOTE: the held-back text is always the longest suffix of the seen text that is a proper prefix
    of some stop string, so a match can never start inside text already emitted.
    """

    def __init__(self, stop: Sequence[str], include_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self._stop = list(stop)
        self._include = include_in_output
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool, str | None]:
        """Take new text; return the text safe to emit, whether to stop, and the stop string matched."""
        if self.stopped:
            return "", True, self.matched
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            index, stop = match
            self._held, self.stopped, self.matched = "", True, stop
            return text[: index + (len(stop) if self._include else 0)], True, stop
        keep = self._pending_prefix_length(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False, None

    def flush(self) -> str:
        """The held-back text, when the request ends for another reason (length, EOS, abort)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """The stop string that completes first in `text` (at equal ends, the longer one).

        Choosing by end position makes the result independent of how the text was split into deltas.
        """
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = text.find(stop)
            if index < 0:
                continue
            if best is None or (index + len(stop), index) < (best[0] + len(best[1]), best[0]):
                best = (index, stop)
        return best

    def _pending_prefix_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
