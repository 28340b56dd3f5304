"""GRPO's sampling: G completions of each prompt from the policy's current weights, drawn by the
serving engine (zaya_jax.engine: continuous batching over fixed decode slots), laid out as the
rows the train step scores.

P prompts, G completions each (N = P * G rows, a prompt's completions consecutive), T = max_new_tokens,
Q = the prompts' column (the longest prompt, or grpo.max_prompt_length). Row i holds its prompt
right-aligned at column Q, then its completion:

  inputs       [N, Q + T - 1]  pad..pad, prompt, completion[:-1]     (left padding: segment 0)
  targets      [N, Q + T - 1]  the next token of each input (the prompt's tail, then the completion)
  segment_ids  1 on the prompt and the completion (through its eos), 0 on padding
  positions    0 at the prompt's first token, counting on
  loss_mask    1 where the target is a completion token (through its eos), 0 after it
so the completion tokens' targets are columns [Q - 1, Q - 1 + T) of every row: sliced there,
the per-token log-probabilities are [N, T] as grpo_loss.GRPOLoss takes them (dr_grpo's T is the
completion budget). The eos (or a stop id) stays in the completion; later slots are padding.

The engine (`rollout_engine`): built once per run from the policy and given each generation's
weights in place (`Engine.set_weights`: same graph, same placement, so nothing recompiles);
`slots` decode rows (grpo.rollout_slots, default 64, at most a generation's rows: 64 sampled the
demo's 512 rows faster than 512 slots, benchmarks/serving/grpo_rollouts.py), each of Q + T - 1
positions; a prompt prefilled in one chunk of Q tokens; no prefix cache (a prompt's G copies are
admitted together, before any could reuse another's blocks), no top log-probs. With the
trainer's mesh its weights are placed by the trainer's rules and its slots split over `data`
(zaya_jax.engine.placement). Rows wait for a free slot and take the next one a finished row
leaves, so a generation's rows run in an order that depends on the slot count and on when the
others stop: what each row samples must not. Row i is submitted as its own request:
SamplingParams(max_tokens=T, temperature, top_k, top_p, stop_ids (eos is the engine's own stop),
seed = row_seed(seed, i) = SeedSequence([seed, i]).generate_state(1)[0]); the engine draws its
token t with fold_in(key(row seed), t), whatever else is in the batch. So a generation is a
function of the weights, the prompts and `seed` alone (what an exact resume and the one-device
reference rely on), the same on any mesh and with any number of slots. The engine's log-probs
are not used: old_logp is the train side's (grpo_batches), the function the loss differentiates.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import numpy as np

from zaya_jax.engine import Engine, SamplingParams
from zaya_jax.engine.batch import batch_engine, row_seed, run_to_end


class Rollout(NamedTuple):
    rows: dict[str, np.ndarray]   # inputs, targets, segment_ids, positions (int32), loss_mask (float32) [N, Q+T-1]
    completions: np.ndarray       # int32 [N, T]: the sampled tokens, pad_token_id after a stop
    lengths: np.ndarray           # int32 [N]: each completion's tokens through its stop (T without one)
    prompt_width: int             # Q: completion token t of a row is its target at column Q - 1 + t


def rollout_engine(model, slots: int, prompt_width: int, max_new_tokens: int,
                   mesh: jax.sharding.Mesh | None = None) -> Engine:
    """The engine sample_groups draws from: `slots` rows of prompt_width + max_new_tokens - 1
    positions, prompts prefilled in one chunk of prompt_width, `model`'s weights (Engine.set_weights
    changes them), on `mesh` (None: one device)."""
    return batch_engine(model, slots, prompt_width, max_new_tokens, mesh=mesh)


def sample_groups(engine: Engine, prompts: Sequence[Sequence[int]], group_size: int, max_new_tokens: int, *,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                  stop_ids: Sequence[int] = (), width: int | None = None) -> Rollout:
    """`group_size` completions of each prompt sampled by `engine` (its weights now; idle: it runs
    these rows alone, to the end), as train rows; width: Q, the prompts' column (default the longest
    prompt; a fixed one keeps every batch's shape). Each prompt and max_new_tokens must fit the
    engine's rows (ValueError from Engine.submit otherwise)."""
    if group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    repeated = [list(p) for p in prompts for _ in range(group_size)]
    params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             seed=row_seed(seed, i), stop_ids=tuple(stop_ids)) for i in range(len(repeated))]
    tokens, lengths = run_to_end(engine, repeated, params)
    width = width or max(len(p) for p in repeated)
    return Rollout(completion_rows(repeated, tokens, lengths, width, engine.config.pad_token_id), tokens, lengths,
                   width)


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
