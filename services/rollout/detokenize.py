"""Incremental detokenization with stop strings, for engines that do not detokenize themselves (hf)."""

from __future__ import annotations

from typing import Any


class IncrementalText:
    """Turns a growing list of token ids into text deltas.

    A delta never ends inside a multi-byte character (those bytes wait for the next token), and
    text that could still become a stop string is held back until it cannot.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()):
        self._tok = tokenizer
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] decode to text already accounted for
        self._read = 0
        self._text = ""  # all text decoded so far
        self._sent = 0  # chars of _text already returned
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text that can be released now ('' if none, or once stopped)."""
        if self.stopped_by is not None:
            return ""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        for s in self._stop:
            at = self._text.find(s, max(0, self._sent - len(s)))
            if at >= 0:
                self.stopped_by = s
                self._text = self._text[:at]
                return self.flush()
        release = max(self._sent, len(self._text) - self._hold)
        out, self._sent = self._text[self._sent:release], release
        return out

    def flush(self) -> str:
        """Everything not yet returned (at the end of a completion)."""
        out, self._sent = self._text[self._sent:], len(self._text)
        return out
