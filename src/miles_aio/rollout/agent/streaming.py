"""What of a reply still being generated can be shown to the agent: the content deltas of a streamed turn.

A streamed answer must add up to the non-streamed one: the agent appends the message it assembled from
the deltas to its history, and the session matches that history against the reply it stored. So a delta
is only ever text that the final content is sure to start with (`ContentStream`):

* the text is detokenized incrementally (a few tokens of context before each new piece, as vLLM and TGI
  do), so each chunk costs what its own tokens cost; a piece that ends inside a character (U+FFFD) waits
  for the next token;
* a suffix that could be the start of a stop string is held back (a matched stop is cut from the reply);
* the tool-call parser decides how much of the rest is surely content (`parsers.streamable_length`).

`finish(content)` gives the rest of the final content. If the text shown ever stops being a prefix of it
(a tokenizer whose incremental decoding differs from decoding the whole), nothing more is streamed and
`finish` reports the mismatch, so the server can log it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from miles_aio.rollout.agent.parsers import ToolCallParser, streamable_length

__all__ = ["ContentStream"]

_CONTEXT_TOKENS: Final = 5
"""Tokens decoded before each new piece, so that the piece decodes as it does inside the whole text."""


class ContentStream:
    """The content deltas of one streamed reply (see the module docstring)."""

    def __init__(
        self,
        *,
        decode: Callable[[list[int]], str],
        parser: ToolCallParser | None,
        stops: Sequence[str] = (),
    ) -> None:
        """`decode` detokenizes as the reply's text is detokenized (special tokens skipped); `parser` is the
        tool-call parser, None when tool calls are not parsed (all the text is content)."""
        self._decode = decode
        self._parser = parser
        self._stops = [s for s in stops if s]
        self._ids: list[int] = []
        self._prefix = 0
        """Start of the context tokens decoded before the next piece."""
        self._read = 0
        """Tokens whose text is in `text`."""
        self.text = ""
        """The reply's text so far."""
        self.sent = ""
        """What the deltas have shown."""
        self.diverged = False

    def push(self, ids: Sequence[int]) -> str:
        """Take the next tokens; return the content that can be shown now ("" if none)."""
        self._ids.extend(ids)
        if self.diverged:
            return ""
        context = self._decode(self._ids[self._prefix : self._read])
        whole = self._decode(self._ids[self._prefix :])
        if not whole.startswith(context):  # more tokens re-decode the context: the pieces are unreliable
            self.diverged = True
            return ""
        if len(whole) > len(context) and not whole.endswith("\ufffd"):
            self.text += whole[len(context) :]
            self._prefix = max(self._prefix, len(self._ids) - _CONTEXT_TOKENS)
            self._read = len(self._ids)
        n = len(self.text) - self._stop_holdback()
        if self._parser is not None:
            n = min(n, streamable_length(self._parser, self.text))
        if n <= len(self.sent):
            return ""
        shown = self.text[:n]
        if not shown.startswith(self.sent):
            self.diverged = True
            return ""
        delta, self.sent = shown[len(self.sent) :], shown
        return delta

    def _stop_holdback(self) -> int:
        """Length of the longest suffix of `text` that a stop string starts with."""
        text, best = self.text, 0
        for stop in self._stops:
            for k in range(min(len(stop), len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def finish(self, content: str | None) -> str | None:
        """The last delta: the rest of the final `content`; None if what was shown is not its start."""
        final = content or ""
        if not final.startswith(self.sent):
            self.diverged = True
            return None
        return final[len(self.sent) :]
