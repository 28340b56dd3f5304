"""GRPO's sampling: G completions of each prompt from the policy's current weights (zaya_jax's
generation: the compressed cache, batched, data-parallel over a mesh), laid out as the rows the
train step scores.

P prompts, G completions each (N = P * G rows, a prompt's completions consecutive), T = max_new_tokens,
Q = the longest prompt. Row i holds its prompt right-aligned at column Q, then its completion:

  inputs       [N, Q + T - 1]  pad..pad, prompt, completion[:-1]     (left padding: segment 0)
  targets      [N, Q + T - 1]  the next token of each input (the prompt's tail, then the completion)
  segment_ids  1 on the prompt and the completion (through its eos), 0 on padding
  positions    0 at the prompt's first token, counting on
  loss_mask    1 where the target is a completion token (through its eos), 0 after it
so the completion tokens' targets are columns [Q - 1, Q - 1 + T) of every row: sliced there,
the per-token log-probabilities are [N, T] as grpo_loss.GRPOLoss takes them (dr_grpo's T is the
completion budget). The eos (or a stop id) stays in the completion; later slots are padding.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import numpy as np

from zaya_jax.infer.generate import generate, stop_tokens, text_model


class Rollout(NamedTuple):
    rows: dict[str, np.ndarray]   # inputs, targets, segment_ids, positions (int32), loss_mask (float32) [N, Q+T-1]
    completions: np.ndarray       # int32 [N, T]: the sampled tokens, pad_token_id after a stop
    lengths: np.ndarray           # int32 [N]: each completion's tokens through its stop (T without one)
    prompt_width: int             # Q: completion token t of a row is its target at column Q - 1 + t


def sample_groups(model, prompts: Sequence[Sequence[int]], group_size: int, max_new_tokens: int, *,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                  stop_ids: Sequence[int] = (), mesh: jax.sharding.Mesh | None = None,
                  width: int | None = None) -> Rollout:
    """`group_size` completions of each prompt sampled from `model` (its weights now), as train rows;
    width: Q, the prompts' column (default the longest prompt; a fixed one keeps every batch's shape)."""
    if group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    cfg = text_model(model).config
    repeated = [list(p) for p in prompts for _ in range(group_size)]
    tokens = np.asarray(generate(model, repeated, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 seed=seed, stop_ids=stop_ids, mesh=mesh), np.int32)
    stops = set(stop_tokens(cfg.eos_token_id, stop_ids))
    lengths = np.asarray([next((t + 1 for t, token in enumerate(row) if token in stops), max_new_tokens)
                          for row in tokens.tolist()], np.int32)
    width = width or max(len(p) for p in repeated)
    return Rollout(completion_rows(repeated, tokens, lengths, width, cfg.pad_token_id), tokens, lengths, width)


def completion_rows(prompts: Sequence[Sequence[int]], completions: np.ndarray, lengths: np.ndarray, width: int,
                    pad_id: int) -> dict[str, np.ndarray]:
    """Each prompt (right-aligned at column `width`) and its completion's first `lengths[i]` tokens as
    one train row of width + T - 1 positions (the module's layout)."""
    n, t = completions.shape
    full = np.full((n, width + t), pad_id, np.int32)
    segment = np.zeros((n, width + t), np.int32)
    positions = np.zeros((n, width + t), np.int32)
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        start = width - len(prompt)
        real = len(prompt) + int(length)
        full[i, start:width] = prompt
        full[i, width:width + length] = completions[i, :length]
        segment[i, start:start + real] = 1
        positions[i, start:start + real] = np.arange(real)
    loss_mask = np.zeros((n, width + t - 1), np.float32)
    loss_mask[:, width - 1:] = np.arange(t)[None, :] < lengths[:, None]
    return {"inputs": full[:, :-1], "targets": full[:, 1:], "segment_ids": segment[:, :-1],
            "positions": positions[:, :-1], "loss_mask": loss_mask}
