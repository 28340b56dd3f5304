"""One response's text as its tokens arrive: incremental detokenization with stop strings.

    text = ResponseText(tokenizer, stop_strings=["\\n\\n"], stop_ids={eos, end_of_turn})
    delta = text.add(token)     # the text that can be sent now ("" while it may still change)
    text.stopped                # a stop string appeared: the response ends before it
    rest = text.finish()        # what is left to send once the response has ended

Text is the decode of every token so far (bos, eos and pad skipped; a final stop id, which ends
the turn, is not text either), so a character split over several byte-level tokens is sent once
whole: a tail that decodes to U+FFFD is held back. With stop strings, the last
len(longest stop) - 1 characters are held back too, since they may begin a stop string; when one
appears, the text ends before it and nothing after it is ever sent (OpenAI's and vLLM's rule).

The engine's stop predicate (`stop_matched`, on the engine's thread) and `add` (on the server's
event loop) read the same decode: each response prefix is decoded once, by whichever comes
first (the last decode is kept, keyed by its token count; both see prefixes of one response).
"""

from __future__ import annotations

from typing import Collection, Sequence


class ResponseText:
    def __init__(self, tokenizer, stop_strings: Sequence[str] = (), stop_ids: Collection[int] = ()):
        self.tokenizer, self.stop_strings, self.stop_ids = tokenizer, list(stop_strings), set(stop_ids)
        self.tokens: list[int] = []
        self.sent = ""
        self.text = ""
        self.stopped = False
        self._hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self._decoded: tuple[int, str] = (0, "")  # (token count, its text): the last decode, either thread's

    def add(self, token: int) -> str:
        """Takes the next token -> the new text that can be sent now."""
        if self.stopped:
            return ""
        self.tokens.append(int(token))
        if int(token) in self.stop_ids:
            return ""
        self.text = self._decode(self.tokens)
        cut = self._first_stop()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._send(len(self.text))
        if self.text.endswith("\ufffd"):
            return ""
        return self._send(len(self.text) - self._hold)

    def finish(self) -> str:
        """The text still held back once no token will follow (an incomplete character at the very
        end as the tokenizer decodes it)."""
        return self._send(len(self.text))

    def stop_matched(self, tokens: list[int]) -> bool:
        """The engine's stop predicate: whether the response (its tokens so far) holds a stop string."""
        if not self.stop_strings or tokens[-1] in self.stop_ids:  # a final stop id ends it anyway and is no text
            return False
        text = self._decode(tokens)
        return any(s in text for s in self.stop_strings)

    def _decode(self, tokens: list[int]) -> str:
        """The text of a prefix of the response (no stop id in it: one only ever ends it)."""
        count, text = self._decoded  # one read: the other thread may replace it
        if count != len(tokens):
            text = self.tokenizer.decode(tokens)
            self._decoded = (len(tokens), text)
        return text

    def _first_stop(self) -> int | None:
        found = [i for i in (self.text.find(s) for s in self.stop_strings) if i >= 0]
        return min(found) if found else None

    def _send(self, upto: int) -> str:
        upto = max(upto, len(self.sent))
        delta, self.sent = self.text[len(self.sent):upto], self.text[:upto]
        return delta
