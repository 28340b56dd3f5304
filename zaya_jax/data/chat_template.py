"""Chat templates (Jinja, as HF tokenizers ship them): conversations -> token ids and a loss mask.

    template = ChatTemplate.load("zaya_jax/data/chat_templates/plain.jinja")   # or a tokenizer_config.json
    template.render(messages, add_generation_prompt=True)        # str, as HF's apply_chat_template
    ids, mask = encode_conversation(template, tokenizer, messages)   # int32 [n], uint8 [n]
    prompt = encode_prompt(template, tokenizer, messages[:1])        # what generation feeds the model

Rendering follows transformers' `apply_chat_template`: a sandboxed Jinja environment with
trim_blocks and lstrip_blocks, the variables `messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, and `raise_exception`, `tojson`, `strftime_now`, `namespace`, loop controls.

Supervised (assistant) text: the output of `{% generation %}...{% endgeneration %}` blocks where
the template has them (HF's tags for `return_assistant_tokens_mask`); otherwise, for assistant
message i, the text that `render(messages[:i+1])` adds after `render(messages[:i],
add_generation_prompt=True)`. A template whose renders of a conversation's beginnings are not
prefixes of its whole render cannot mark assistant text that way and is refused by name.

Special tokens: `bos_token` / `eos_token` render as private sentinel characters that become the
model's bos / eos ids, whatever the tokenizer file calls them. The text is tokenized span by span
(prompt spans and assistant spans separately), so the prompt's ids in a training conversation
equal `encode_prompt`'s for the same first turns. Every sequence starts with one bos.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import re
from collections.abc import Sequence

import numpy as np

from zaya_jax.errors import UserError

ROLES = ("system", "user", "assistant")
# Unicode noncharacters, reserved for a program's internal use: never in real text.
# IMAGE stands for an image in a message's text (zaya_jax.data.vision.chat puts it there).
BOS, EOS, OPEN, CLOSE, IMAGE = "\ufdd0", "\ufdd1", "\ufdd2", "\ufdd3", "\ufdd4"
_SENTINELS = BOS + EOS + OPEN + CLOSE
_SPECIAL_SPLIT = re.compile(f"([{BOS}{EOS}{IMAGE}])")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
BUNDLED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")
PLAIN = os.path.join(BUNDLED, "plain.jinja")

Messages = Sequence[dict]


class ConversationError(UserError, ValueError):
    """A conversation the template cannot turn into training data (bad messages, or the template
    raised on it); prepare names the file and line it came from."""


class TemplateError(UserError):
    """A chat template file that cannot be used (missing key, syntax, not prefix-consistent)."""


def _generation_extension():
    """The `{% generation %}...{% endgeneration %}` tag: wraps the block's output in OPEN/CLOSE."""
    import jinja2  # pylint: disable=g-import-not-at-top
    from jinja2 import ext, nodes  # pylint: disable=g-import-not-at-top

    class GenerationTag(ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark", []), [], [], body).set_lineno(lineno)

        @staticmethod
        def _mark(caller: jinja2.runtime.Macro) -> str:
            return OPEN + caller() + CLOSE

    return GenerationTag


@functools.lru_cache(maxsize=8)
def _compile(source: str, path: str):
    import jinja2  # pylint: disable=g-import-not-at-top
    from jinja2 import ext, sandbox  # pylint: disable=g-import-not-at-top

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_generation_extension(), ext.loopcontrols])
    def tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
        # as transformers: plain JSON (Jinja's own filter escapes HTML characters)
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"{path}:{e.lineno}: chat template syntax error: {e.message}") from None


def _token_string(value, default: str) -> str:
    """A tokenizer_config.json special token: a string or {"content": string}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else default


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template. `bos_token` / `eos_token` are what `render` writes for them."""

    source: str
    path: str
    bos_token: str = "<bos>"
    eos_token: str = "<eos>"

    @classmethod
    def load(cls, path: str | os.PathLike) -> ChatTemplate:
        """A `.jinja` file, or a HF `tokenizer_config.json` with a `chat_template` string."""
        path = os.path.abspath(os.fspath(path))
        if not os.path.isfile(path):
            raise TemplateError(f"chat template {path!r} does not exist")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if not path.endswith(".json"):
            template = cls(text, path)
        else:
            try:
                config = json.loads(text)
            except json.JSONDecodeError as e:
                raise TemplateError(f"{path}: not valid JSON ({e})") from None
            source = config.get("chat_template") if isinstance(config, dict) else None
            if isinstance(source, (list, dict)):
                names = [t.get("name") for t in source] if isinstance(source, list) else list(source)
                raise TemplateError(f"{path} holds several named chat templates ({names}); save the one to use "
                                    "as a .jinja file and pass it with --chat_template")
            if not isinstance(source, str):
                raise TemplateError(f"{path} has no \"chat_template\" string; pass a .jinja file with --chat_template")
            template = cls(source, path, _token_string(config.get("bos_token"), cls.bos_token),
                           _token_string(config.get("eos_token"), cls.eos_token))
        _compile(template.source, path)  # a syntax error is named now
        return template

    def record(self) -> dict:
        """What a checkpoint keeps of the template its run was trained with (JSON): the text itself,
        so that generation renders prompts as training did even once the file is gone."""
        return {"path": self.path, "sha256": self.sha256, "source": self.source, "bos_token": self.bos_token,
                "eos_token": self.eos_token}

    @classmethod
    def from_record(cls, record: dict) -> ChatTemplate:
        """The template of `record()` (compiled now: a damaged record is named)."""
        template = cls(record["source"], record["path"], record.get("bos_token", cls.bos_token),
                       record.get("eos_token", cls.eos_token))
        _compile(template.source, template.path)
        return template

    @property
    def sha256(self) -> str:
        """Of the template text (what a manifest records)."""
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()

    @property
    def has_generation_tags(self) -> bool:
        return bool(_GENERATION_TAG.search(self.source))

    def transformers_source(self) -> str:
        """The template as transformers' `apply_chat_template` should run it to give this template's
        ids: with `{{ bos_token }}` first when the template does not render bos itself (every
        sequence here starts with one bos; transformers adds none to a chat)."""
        try:
            first_turn = self._render_marked([{"role": "user", "content": "x"}], add_generation_prompt=True)
        except ConversationError:  # a template that refuses a lone user turn: kept as it is
            return self.source
        return self.source if first_turn.startswith(BOS) else "{{ bos_token }}" + self.source

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> str:
        """The conversation as text, as `apply_chat_template(..., tokenize=False)` renders it."""
        marked = self._render_marked(messages, add_generation_prompt)
        return marked.translate({ord(OPEN): None, ord(CLOSE): None, ord(BOS): self.bos_token,
                                 ord(EOS): self.eos_token})

    def _render_marked(self, messages: Messages, add_generation_prompt: bool) -> str:
        """Rendered with sentinels for bos/eos and OPEN/CLOSE around generation blocks."""
        import jinja2  # pylint: disable=g-import-not-at-top
        for i, message in enumerate(messages):
            if isinstance(message, dict) and any(c in _SENTINELS for c in str(message.get("content", ""))):
                raise ConversationError(f"message {i} holds a reserved character (U+FDD0..U+FDD3)")
        try:
            return _compile(self.source, self.path).render(
                messages=[{k: v for k, v in m.items() if v is not None} for m in messages],  # None: absent, as HF
                add_generation_prompt=add_generation_prompt,
                bos_token=BOS, eos_token=EOS)
        except jinja2.TemplateError as e:
            raise ConversationError(f"chat template {os.path.basename(self.path)} refused the conversation: "
                                    f"{e.message or type(e).__name__}") from None

    def spans(self, messages: Messages, add_generation_prompt: bool = False) -> list[tuple[str, bool]]:
        """The rendered text (sentinels for bos/eos) as consecutive (text, is_assistant) spans."""
        if self.has_generation_tags:
            return self._tagged_spans(self._render_marked(messages, add_generation_prompt))
        return self._prefix_spans(messages, add_generation_prompt)

    def _tagged_spans(self, marked: str) -> list[tuple[str, bool]]:
        spans, inside = [], False
        for piece in re.split(f"([{OPEN}{CLOSE}])", marked):
            if piece in (OPEN, CLOSE):
                if (piece == OPEN) == inside:
                    raise TemplateError(f"{self.path}: nested {{% generation %}} blocks are not supported")
                inside = piece == OPEN
            elif piece:
                spans.append((piece, inside))
        return spans

    def _prefix_spans(self, messages: Messages, add_generation_prompt: bool) -> list[tuple[str, bool]]:
        full = self._render_marked(messages, add_generation_prompt)
        spans, done = [], 0
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            start = self._render_marked(messages[:i], True)
            whole = self._render_marked(messages[:i + 1], False)
            if not (full.startswith(whole) and whole.startswith(start) and len(start) >= done):
                raise TemplateError(
                    f"{self.path}: the chat template is not prefix-consistent (rendering the first {i + 1} "
                    "messages is not a prefix of the whole conversation), so its assistant text cannot be found; "
                    "mark it with {% generation %}...{% endgeneration %} tags")
            spans += [(full[done:len(start)], False), (full[len(start):len(whole)], True)]
            done = len(whole)
        spans.append((full[done:], False))
        return [(text, supervised) for text, supervised in spans if text]


END_OF_TURN_PROBE = "zaya end of turn probe"


def end_of_turn_ids(template: ChatTemplate, tokenizer) -> list[int]:
    """The ids that end an assistant turn in `template`: the first token of the text it writes
    after an assistant message's content when that token is eos or a special token of
    `tokenizer` that is not whitespace (ChatML's <|im_end|>), else none (a turn that ends in plain text, a newline say,
    has no stop token but eos, and so has a template whose assistant text cannot be found: one
    without generation tags that is not prefix-consistent). Generation stops at them as at eos."""
    conversation = [{"role": "user", "content": "x"}, {"role": "assistant", "content": END_OF_TURN_PROBE}]
    try:
        assistant = "".join(text for text, supervised in template.spans(conversation) if supervised)
    except TemplateError:
        return []
    after = assistant.partition(END_OF_TURN_PROBE)[2]
    first = next((piece for piece in _SPECIAL_SPLIT.split(after) if piece.strip()), None)
    if first is None or first == BOS:
        return []
    if first == EOS:
        return [tokenizer.eos_id]
    ids = tokenizer.encode_pieces([END_OF_TURN_PROBE, first])[1]  # as it continues the content
    return ids[:1] if ids and tokenizer.is_special(ids[0]) and tokenizer.id_to_token(ids[0]).strip() else []


def tokenize_spans(tokenizer, spans: Sequence[tuple[str, bool]], image_id: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Spans (sentinels for bos/eos, and IMAGE for an image) -> (ids int32 [n], mask uint8 [n]),
    one bos first; each IMAGE becomes one `image_id`.

    Each span's text between sentinels is tokenized on its own (`Tokenizer.encode_pieces`)."""
    pieces = [(piece, supervised) for text, supervised in spans for piece in _SPECIAL_SPLIT.split(text) if piece]
    if image_id is None and any(piece == IMAGE for piece, _ in pieces):
        raise ConversationError("the conversation holds an image, which a text model's data cannot")
    texts = [piece for piece, _ in pieces if piece not in (BOS, EOS, IMAGE)]
    encoded = iter(tokenizer.encode_pieces(texts))
    ids, mask = [], []
    for piece, supervised in pieces:
        piece_ids = {BOS: [tokenizer.bos_id], EOS: [tokenizer.eos_id], IMAGE: [image_id]}.get(piece) or next(encoded)
        ids += piece_ids
        mask += [int(supervised)] * len(piece_ids)
    if not ids or ids[0] != tokenizer.bos_id:
        ids, mask = [tokenizer.bos_id, *ids], [0, *mask]
    return np.asarray(ids, np.int32), np.asarray(mask, np.uint8)


def check_messages(messages, *, name: str = "messages", needs_assistant: bool = True) -> None:
    """Raises ConversationError naming the first problem: not a list of {role, content} dicts,
    an unknown role, a non-string or empty assistant content, no assistant turn (if needed)."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError(f"{name} must be a non-empty list of {{role, content}} messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ConversationError(f"{name}[{i}] is not a {{role, content}} message")
        if message["role"] not in ROLES:
            raise ConversationError(f"{name}[{i}]: role {message['role']!r} is not one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise ConversationError(f"{name}[{i}]: content is a {type(message['content']).__name__}, not a string")
        if message["role"] == "assistant" and not message["content"].strip():
            raise ConversationError(f"{name}[{i}]: empty assistant content")
    if needs_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ConversationError(f"{name} has no assistant turn (nothing to train on)")


def encode_conversation(template: ChatTemplate, tokenizer, messages: Messages, image_id: int | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """A training conversation: (ids int32 [n], mask uint8 [n]); mask 1 on assistant tokens; each
    IMAGE in a message's text one `image_id` (zaya_jax.data.vision.chat)."""
    check_messages(messages)
    ids, mask = tokenize_spans(tokenizer, template.spans(messages), image_id)
    if not mask.any():
        raise ConversationError(f"chat template {os.path.basename(template.path)} marked no assistant text "
                                "in this conversation")
    return ids, mask


def encode_prompt(template: ChatTemplate, tokenizer, messages: Messages, image_id: int | None = None) -> np.ndarray:
    """What generation feeds the model: bos + the rendered messages + the generation prompt, int32 [n]
    (each IMAGE in a message's text one `image_id`)."""
    check_messages(messages, needs_assistant=False)
    return tokenize_spans(tokenizer, template.spans(messages, add_generation_prompt=True), image_id)[0]


def encode_preference(template: ChatTemplate | None, tokenizer, prompt, chosen, rejected
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A preference pair -> (prompt_ids, chosen_ids, rejected_ids), int32.

    Standard (strings): prompt = bos + its ids, each completion = its ids + eos.
    Conversational (lists of messages): prompt = `encode_prompt(prompt)`, each completion = the ids
    of the rendered prompt + completion messages after the prompt's ids (template needed).
    """
    values = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    if all(isinstance(v, str) for v in values.values()):
        for name in ("chosen", "rejected"):
            if not values[name].strip():
                raise ConversationError(f"empty {name}")
        prompt_piece, chosen_piece, rejected_piece = tokenizer.encode_pieces([prompt, chosen, rejected])
        return (np.asarray([tokenizer.bos_id, *prompt_piece], np.int32),
                np.asarray([*chosen_piece, tokenizer.eos_id], np.int32),
                np.asarray([*rejected_piece, tokenizer.eos_id], np.int32))
    if not all(isinstance(v, list) for v in values.values()):
        kinds = ", ".join(f"{k} is a {type(v).__name__}" for k, v in values.items())
        raise ConversationError(f"prompt, chosen and rejected must all be strings or all lists of messages ({kinds})")
    if template is None:
        raise ConversationError("a conversational preference record needs a chat template (--chat_template)")
    check_messages(prompt, name="prompt", needs_assistant=False)
    prompt_ids = encode_prompt(template, tokenizer, prompt)
    completions = []
    for name in ("chosen", "rejected"):
        check_messages(values[name], name=name)
        ids, _ = tokenize_spans(tokenizer, template.spans(prompt + values[name]))
        if not np.array_equal(ids[:len(prompt_ids)], prompt_ids) or len(ids) == len(prompt_ids):
            raise TemplateError(f"{template.path}: prompt + {name} does not render as the prompt with its generation "
                                "prompt followed by the completion; use a template whose generation prompt "
                                "begins the assistant turn")
        completions.append(ids[len(prompt_ids):])
    return prompt_ids, completions[0], completions[1]


def bundled_template(sha256: str) -> ChatTemplate | None:
    """The template shipped in zaya_jax/data/chat_templates/ whose text has digest `sha256`, or None."""
    for name in sorted(os.listdir(BUNDLED)):
        template = ChatTemplate.load(os.path.join(BUNDLED, name))
        if template.sha256 == sha256:
            return template
    return None
