"""A request's sampling and stopping settings, checked on the host before anything runs."""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from zaya_jax.infer.sampling import Sampler


class SamplingParams(NamedTuple):
    """max_tokens: new tokens at most. temperature 0 is greedy; top_k (None: off) and top_p (None:
    off) as zaya_jax.infer.sampling. seed: the request's random stream (token i draws with
    fold_in(key(seed), i), whatever else is in the batch). stop_ids: ids that end the response
    (kept in it) besides eos (unless ignore_eos). stop: a host predicate over the tokens so far
    (stop strings); True ends the response. logprobs: report each token's log-probability;
    top_logprobs: and that many best tokens with theirs."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    stop_ids: Sequence[int] = ()
    ignore_eos: bool = False
    stop: Callable[[list[int]], bool] | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def validate(self, vocab_size: int, max_top_logprobs: int) -> "SamplingParams":
        """-> self; ValueError naming the first bad field."""
        Sampler(self.temperature, self.top_k, self.top_p).validate(vocab_size)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= max_top_logprobs:
            raise ValueError(f"top_logprobs must be an integer in [0, {max_top_logprobs}] (the engine's "
                             f"max_top_logprobs), got {self.top_logprobs!r}")
        if any(not 0 <= int(i) < vocab_size for i in self.stop_ids):
            raise ValueError(f"stop_ids {list(self.stop_ids)} hold ids outside the vocabulary [0, {vocab_size})")
        return self
