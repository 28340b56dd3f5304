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

    def add(self, token: int) -> str:
        """Takes the next token -> the new text that can be sent now."""
        if self.stopped:
            return ""
        self.tokens.append(int(token))
        if int(token) in self.stop_ids:
            return ""
        self.text = self.tokenizer.decode(self.tokens)
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
        if not self.stop_strings:
            return False
        text = self.tokenizer.decode([t for t in tokens if t not in self.stop_ids])
        return any(s in text for s in self.stop_strings)

    def _first_stop(self) -> int | None:
        found = [i for i in (self.text.find(s) for s in self.stop_strings) if i >= 0]
        return min(found) if found else None

    def _send(self, upto: int) -> str:
        upto = max(upto, len(self.sent))
        delta, self.sent = self.text[len(self.sent):upto], self.text[:upto]
        return delta
