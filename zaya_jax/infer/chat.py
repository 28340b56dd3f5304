"""Chat prompts for generation: the conversation to send and the chat template that renders it.

  chat_template_for(checkpoint=RUN)          the template the run recorded (ChatTemplate)
  chat_template_for(hf=DIR)                  DIR/tokenizer_config.json's chat_template
  chat_template_for(..., override=FILE)      FILE (a .jinja or a tokenizer_config.json) instead
  read_messages(text=None, messages_file=None)   one user turn, or a JSON list of {role, content}

A run trained on chat or preference sources keeps the template they were prepared with (its text)
in the config of every checkpoint (the top-level "chat_template", see checkpoints/orbax_checkpoint.py), so a
prompt is rendered as the training conversations were (chat_template.encode_prompt: bos, the
rendered messages, the generation prompt).
"""

from __future__ import annotations

import json
import os

from zaya_jax.checkpoints.orbax_checkpoint import checkpoint_dir, read_config
from zaya_jax.data.chat_template import ChatTemplate, check_messages
from zaya_jax.errors import UserError

FIX = "pass --chat_template FILE (a .jinja file or a tokenizer_config.json with a \"chat_template\")"


def checkpoint_chat_template(checkpoint: str) -> ChatTemplate | None:
    """The chat template a training run's checkpoint recorded, or None (a run on text or synthetic
    data, or one saved before runs recorded their template)."""
    record = read_config(checkpoint_dir(os.fspath(checkpoint))).get("chat_template")
    return None if record is None else ChatTemplate.from_record(record.to_dict())


def chat_template_for(*, checkpoint: str | None = None, hf: str | None = None,
                      override: str | None = None) -> ChatTemplate:
    """`override`, else the checkpoint's recorded template, else the HF directory's
    tokenizer_config.json; UserError naming the input and the fix when there is none."""
    if override is not None:
        return ChatTemplate.load(override)
    if checkpoint is not None:
        template = checkpoint_chat_template(checkpoint)
        if template is None:
            raise UserError(f"--checkpoint {checkpoint}: the run recorded no chat template (it was not trained on "
                            f"chat or preference data prepared with one); {FIX}")
        return template
    beside = os.path.join(os.fspath(hf), "tokenizer_config.json")
    if not os.path.isfile(beside):
        raise UserError(f"--hf {hf}: no tokenizer_config.json with a chat template in it; {FIX}")
    return ChatTemplate.load(beside)


def read_messages(text: str | None = None, messages_file: str | None = None) -> list[dict]:
    """`text` as one user message, or the JSON list of {role, content} messages in `messages_file`
    (system, user and earlier assistant turns; a content may be a list of text and image parts,
    which come back as one string with chat_template.IMAGE for each image: zaya_jax.data.vision.chat);
    UserError naming the file and the problem."""
    if text is not None:
        return [{"role": "user", "content": text}]
    try:
        with open(messages_file, encoding="utf-8") as f:
            messages = json.load(f)
    except OSError as e:
        raise UserError(f"--messages {messages_file}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--messages {messages_file}: not valid JSON ({e})") from None
    try:
        from zaya_jax.data.vision.chat import flatten_content
        messages = flatten_content(messages)[0] if isinstance(messages, list) else messages
        check_messages(messages, needs_assistant=False)
    except UserError as e:
        raise UserError(f"--messages {messages_file}: {e} (expected [{{\"role\": \"user\", \"content\": "
                        "\"...\"}, ...])") from None
    return messages
