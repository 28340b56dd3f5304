"""A checkpoint's model answering prompts greedily: the model, tokenizer and chat template a
command that answers with a training run's checkpoint uses (zaya_jax.evaluate_tasks,
zaya_jax.preference_pairs), its shared flags, and the batched completions (GRPO's rollouts use them too).

  model, step, tokenizer = load_checkpoint(run, None)
  template = run_template(run, None)
  texts = generate_completions(model, tokenizer, prompts, MAX_NEW_TOKENS, BATCH_SIZE, stop_ids)

Completions come from the static loop (zaya_jax.infer.static_loop.generate_static), each decoded up
to its first eos or stop id.
"""

from __future__ import annotations

import sys

import numpy as np
from absl import flags

from zaya_jax.checkpoints.carried_tokenizer import checkpoint_tokenizer
from zaya_jax.checkpoints.orbax_checkpoint import load_checkpoint_model
from zaya_jax.data import chat_template
from zaya_jax.data.tokenizer import Tokenizer
from zaya_jax.errors import UserError
from zaya_jax.infer.chat import checkpoint_chat_template
from zaya_jax.infer.static_loop import generate_static, stop_tokens
from zaya_jax.model.vision.vl import is_vision_language, text_model

MAX_NEW_TOKENS = 8
BATCH_SIZE = 100


def define_answering_flags(*, per_kind: int, per_kind_help: str, batch_size: int) -> None:
    """The flags of a command that answers generated tasks with a checkpoint's model (zaya_jax.evaluate_tasks and
    zaya_jax.preference_pairs), with their defaults of per_kind and batch_size."""
    flags.DEFINE_string("checkpoint", None, "Training run WORKDIR or its checkpoints/ directory.", required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest whole one).")
    flags.DEFINE_string("tokenizer", None, "tokenizer.json (default: the one the checkpoint carries; for a "
                                           "checkpoint that carries none, its run's data.tokenizer).")
    flags.DEFINE_string("chat_template", None,
                        "Chat template: a .jinja file or a tokenizer_config.json with chat_template (default: the "
                        "one the run recorded, else zaya_jax/data/chat_templates/plain.jinja).")
    flags.DEFINE_integer("per_kind", per_kind, per_kind_help, lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Task generation seed (the demo data's is 0).")
    flags.DEFINE_integer("max_new_tokens", MAX_NEW_TOKENS, "Token cap of a completion.", lower_bound=1)
    flags.DEFINE_integer("batch_size", batch_size, "Questions generated together.", lower_bound=1)


def load_checkpoint(checkpoint: str, step: int | None, tokenizer_path: str | None = None, *,
                    vision: bool = False):
    """(model, step, tokenizer) of a training run's checkpoint; the tokenizer is the one the step
    carries (the file its run was trained with; a `tokenizer_path` that is another file is refused).
    A vision-language run's ZayaVL only with `vision` (what this command scores on the digits); else
    refused naming that command."""
    model, step = load_checkpoint_model(checkpoint, step)
    if is_vision_language(model) and not vision:
        raise UserError(f"--checkpoint {checkpoint} holds a vision-language model: this command answers text "
                        f"questions with a text model (python -m zaya_jax.evaluate_tasks --checkpoint {checkpoint} "
                        "scores it on the held-out digits)")
    cfg = text_model(model).config
    path, told = checkpoint_tokenizer(checkpoint, step, tokenizer_path)
    print(told, file=sys.stderr)
    tokenizer = Tokenizer(path, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id)
    return model, step, tokenizer


def run_template(checkpoint: str, path: str | None) -> chat_template.ChatTemplate:
    """`path` (--chat_template), else the template the run recorded, else plain.jinja."""
    if path is not None:
        return chat_template.ChatTemplate.load(path)
    return checkpoint_chat_template(checkpoint) or chat_template.ChatTemplate.load(chat_template.PLAIN)


def generate_completions(model, tokenizer, prompts: list[np.ndarray], max_new_tokens: int,
                         batch_size: int, stop_ids: tuple[int, ...] = (), images: list | None = None,
                         image_processor=None) -> list[str]:
    """Greedy completions of `prompts` (int32 [n_i] each), decoded up to the first eos or stop id;
    for a ZayaVL, `images` holds each prompt's images (generate's images, resized
    and cut by `image_processor`).

    Batches are filled up to `batch_size` with the last prompt, so every batch of one prompt
    width reuses one compiled program."""
    stops = stop_tokens(text_model(model).config.eos_token_id, stop_ids)
    texts = []
    def filled(rows: list) -> list:  # a short last batch repeats its last row
        return rows + [rows[-1]] * (batch_size - len(rows))
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        extra = {}
        if images is not None:
            extra = dict(images=filled(images[start:start + batch_size]), image_processor=image_processor)
        new = generate_static(model, [list(p) for p in filled(batch)], max_new_tokens, stop_ids=stop_ids, **extra)
        for row in new[:len(batch)]:
            ids = row.tolist()
            end = next((i for i, token in enumerate(ids) if token in stops), len(ids))
            texts.append(tokenizer.decode(ids[:end]))
    return texts
