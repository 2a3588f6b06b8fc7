"""Token ids to the text a client sees: incremental decoding and stop strings.

A request's text is always the decode of all its tokens so far (decoding token by
token would split multi-byte characters and drop the spaces some tokenizers attach
to the next token), and a delta is what that text added. Two things are held back
until the next tokens decide them: a trailing replacement character (an incomplete
UTF-8 sequence) and a tail that could be the start of a stop string. When a stop
string appears, the text ends just before it, as OpenAI clients expect: the stop
string itself is never sent.
"""

from __future__ import annotations


class TextAssembler:
    """Accumulates one request's tokens and yields its text deltas (no tokenizer: always "")."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text already handed out
        self.stopped = False  # a stop string was found: nothing more comes

    def _text(self) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def push(self, new_tokens: list[int]) -> str:
        """Adds tokens; returns the text now safe to send (may be "")."""
        if self.stopped:
            return ""
        self.tokens += new_tokens
        text = self._text()
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            return self._advance(text[:cut])
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        return self._advance(text[:end - self._held_tail(text[:end])])

    def finish(self) -> str:
        """The rest of the text once the request ended (held-back text included)."""
        if self.stopped:
            return ""
        return self._advance(self._text())

    def _advance(self, text: str) -> str:
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta

    def _first_stop(self, text: str) -> int | None:
        """Where the earliest stop string starts in the unsent-adjacent text, if any appears."""
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, self.sent - longest + 1)
        found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held_tail(self, text: str) -> int:
        """Characters at the end of `text` that could begin a stop string (kept until decided)."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text) - self.sent), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        return held
