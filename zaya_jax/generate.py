"""CLI: generate text (or ids) from a ZAYA model, streaming tokens as the compiled loop makes them.

  python -m zaya_jax.generate --checkpoint runs/demo --prompt "ROMEO:" --max_new_tokens 64
  python -m zaya_jax.generate --hf DIR --prompt "Once upon a time" \\
      --max_new_tokens 64 [--temperature 0.8 --top_k 50 --top_p 0.95 --seed 0] [--quantize int8|int4]
  python -m zaya_jax.generate --hf DIR --prompt_ids 2,651,1234 --max_new_tokens 16   # prints ids
  python -m zaya_jax.generate --checkpoint runs/sft --chat "What is 2+3?"    # prints the assistant's reply
  python -m zaya_jax.generate --checkpoint runs/sft --messages chat.json [--chat_template FILE]
  python -m zaya_jax.generate --hf VL_DIR --image cat.png --prompt "What is this?"   # a zaya1_vl model

(Every flag may also be spelled with dashes: --max-new-tokens, --prompt-ids.)
--checkpoint reads a training run (its WORKDIR or checkpoints/ directory, or a `convert to_orbax`
output; default: the latest step) onto this process's first device, whatever mesh wrote it, as
the model it was at that step (the saved config's layout and the RoPE base of its curriculum
phase); --prompt then uses the tokenizer the checkpoint carries (a copy of the file its run was
trained with: zaya_jax.checkpoints.carried_tokenizer); a --tokenizer that is another file is refused.
--step N reads that step instead of the latest. --hf reads an HF ZAYA checkpoint
(zaya_jax.load_hf); --prompt then uses DIR/tokenizer.json (what `convert to_hf` writes) unless
--tokenizer is given. Timing goes to stderr, generated text or ids to stdout. Prompt ids outside
the vocabulary, or a prompt plus --max_new_tokens past the model's max_position_embeddings, are
refused (one `error:` line naming the limit) before anything compiles.
--chat (one user turn) or --messages (a JSON list of {role, content}) renders the conversation with
the chat template and its generation prompt (zaya_jax.infer.chat): --chat_template, else the one a
run trained on chat or preference data recorded, else (--hf) DIR/tokenizer_config.json's; the
reply stops at eos or at the template's end-of-turn token (ChatML's <|im_end|>:
chat_template.end_of_turn_ids).
--image PATH (repeatable) needs a vision-language model: --hf DIR of a zaya1_vl checkpoint
(zaya_jax.checkpoints.hf_vl), or --checkpoint of a vision-language run (configs/demo_vl.py): with
--prompt each image's span (vision_start, its placeholders, vision_end) goes after bos, before the
text, in the order given; with --chat, at the start of the user's message; --messages holds them
as {"type": "image"} content parts (TRL's format) and --prompt_ids as one image_token_id each,
expanded to its placeholders as transformers' processor does. The images are resized and cut by
Qwen2-VL's processor (zaya_jax.data.vision.processor): within the run's vision.min_pixels and
max_pixels for a checkpoint (those its images were prepared with), as DIR/preprocessor_config.json
says for --hf. Each image gets one stderr line (its size -> the resized size, its patch grid, its
image tokens); a side below patch_size x merge_size pixels is refused, naming the file, and so is
--image for a text model, both before the tokenizer, the chat template or the weights are read. A
vision-language model given no --image says so in one line.

The tokens come from the library's generate (zaya_jax.engine.generate; its static loop, which
streams them).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from absl import app, flags

from zaya_jax import cli
from zaya_jax.data.vision.processor import ImageProcessor, read_image
from zaya_jax.data.vision.prompts import expand_placeholders
from zaya_jax.errors import UserError
from zaya_jax.data.chat_template import IMAGE
from zaya_jax.infer.chat import chat_template_for, read_messages
from zaya_jax.engine import generate
from zaya_jax.infer.static_loop import new_token_room, stop_tokens
from zaya_jax.infer import loading
from zaya_jax.infer.loading import tokenizer_for
from zaya_jax.checkpoints.hf_quantized import BLOCK_AXES, BLOCK_AXIS_HELP
from zaya_jax.checkpoints.quantize import MODES
from zaya_jax.model.vision.vl import ZayaVL, is_vision_language, text_model

_HF = flags.DEFINE_string("hf", None, "HF ZAYA checkpoint directory (config.json + safetensors).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Training run WORKDIR, its checkpoints/ directory, or a "
                                                      "`convert to_orbax` output (Orbax).")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text (tokenized with --tokenizer or the checkpoint's).")
_PROMPT_IDS = flags.DEFINE_string("prompt_ids", None, "Comma-separated prompt token ids, e.g. 2,17,5.")
_CHAT = flags.DEFINE_string("chat", None, "A user message, rendered with the chat template; prints the reply.")
_MESSAGES = flags.DEFINE_string("messages", None, "A JSON file: a list of {role, content} messages (system, user, "
                                                  "assistant), rendered with the chat template.")
_CHAT_TEMPLATE = flags.DEFINE_string("chat_template", None, "Chat template for --chat / --messages: a .jinja file "
                                                            "or a tokenizer_config.json (default: the run's).")
_STEP = flags.DEFINE_integer("step", None, "With --checkpoint: the step to read (default: the newest whole one).",
                             lower_bound=0)
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer.json (default for --checkpoint: the copy it carries "
                                                    "of the one its run was trained with; for --hf: "
                                                    "DIR/tokenizer.json).")
_NO_BOS = flags.DEFINE_bool("no_bos", False, "Do not prepend the model's bos id to an encoded --prompt.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.", lower_bound=0.0)
_TOP_K = flags.DEFINE_integer("top_k", None, "Sample among the k most likely tokens.", lower_bound=1)
_TOP_P = flags.DEFINE_float("top_p", None, "Nucleus sampling mass.", lower_bound=0.0, upper_bound=1.0)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", False,
                                 "Keep generating after eos (and, with --chat, the end-of-turn token).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                           "Compute dtype (default: float32 for --hf, the saved config's for --checkpoint).")
_QUANTIZE = flags.DEFINE_enum("quantize", None, sorted(MODES), "Weight-only quantization.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 64, "Quantization group along the input axis.", lower_bound=1)
_MXFP4_BLOCK_AXIS = flags.DEFINE_enum("mxfp4_block_axis", None, list(BLOCK_AXES), BLOCK_AXIS_HELP)
_IMAGE = flags.DEFINE_multi_string("image", [], "An image file for a vision-language model (a zaya1_vl --hf "
                                                "directory or a vision-language run's --checkpoint); repeat for several.")


def check_flags() -> None:
    if (_HF.value is None) == (_CHECKPOINT.value is None):
        raise app.UsageError("give exactly one of --checkpoint and --hf")
    if _STEP.value is not None and _CHECKPOINT.value is None:
        raise app.UsageError("--step goes with --checkpoint (an HF directory holds one model)")
    if sum(f.value is not None for f in (_PROMPT, _PROMPT_IDS, _CHAT, _MESSAGES)) != 1:
        raise app.UsageError("give exactly one of --prompt, --prompt_ids, --chat and --messages")


def load_model():
    """The model the flags name (zaya_jax.infer.loading.load_model)."""
    options = dict(quantize=_QUANTIZE.value, group_size=_GROUP_SIZE.value, mxfp4_block_axis=_MXFP4_BLOCK_AXIS.value)
    if _DTYPE.value is not None:
        options["dtype"] = _DTYPE.value
    return loading.load_model(checkpoint=_CHECKPOINT.value, hf=_HF.value, step=_STEP.value, **options)


def model_image_processor() -> ImageProcessor | None:
    """The image processor of the model the flags name (zaya_jax.infer.loading.model_image_processor)."""
    return loading.model_image_processor(checkpoint=_CHECKPOINT.value, hf=_HF.value, step=_STEP.value)


def checked_images() -> tuple[list, ImageProcessor | None]:
    """(--image files read, the model's image processor), each file said in one stderr line (what the
    processor does to it); --image for a text model, an unreadable file or one below the processor's
    minimum is refused naming the file. Reads the model's config only, not its weights."""
    if not _IMAGE.value:
        return [], None
    processor = model_image_processor()
    if processor is None:
        source = f"--hf {_HF.value}" if _HF.value is not None else f"--checkpoint {_CHECKPOINT.value}"
        raise UserError(f"--image: {source} holds a text model; images need a vision-language run's checkpoint "
                        "(configs/demo_vl.py) or --hf DIR of a zaya1_vl model")
    images = []
    for path in _IMAGE.value:
        try:
            image = read_image(path)
            print(f"[image {path}: {processor.describe(image.height, image.width)}]", file=sys.stderr)
        except (ValueError, UserError) as err:
            raise UserError(f"--image {path}: {err}") from err
        images.append(image)
    return images, processor


def tokenizer_file() -> str:
    """The tokenizer the flags name (zaya_jax.infer.loading.tokenizer_for), said on stderr."""
    path, told = tokenizer_for(checkpoint=_CHECKPOINT.value, hf=_HF.value, step=_STEP.value, given=_TOKENIZER.value)
    if told:
        print(told, file=sys.stderr)
    return path


def load_tokenizer(path: str):
    import tokenizers
    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as err:  # tokenizers raises a bare Exception for a missing or malformed file
        raise UserError(f"--tokenizer {path}: cannot read it as a tokenizer.json ({err})") from err


def prompt_ids() -> list[int]:
    try:
        return [int(x) for x in _PROMPT_IDS.value.split(",") if x.strip()]
    except ValueError as err:
        raise UserError(f"--prompt_ids {_PROMPT_IDS.value!r}: not comma-separated integers") from err


def with_image_spans(ids: list[int], model: ZayaVL, images: list, processor: ImageProcessor) -> list[int]:
    """--prompt: each image's placeholder after bos; then every placeholder expanded to its image's span."""
    token_ids = model.ids
    if _PROMPT.value is not None:  # --chat, --messages and --prompt_ids hold their placeholders
        head = 1 if ids[:1] == [model.text.config.bos_token_id] else 0
        ids = ids[:head] + [token_ids.image] * len(images) + ids[head:]
    return expand_placeholders(ids, [processor.grid(image) for image in images], token_ids,
                               model.vision.config.spatial_merge_size)


def check_lengths(ids: list[int], cfg, image_id: int | None = None) -> None:
    """The prompt's ids lie in the vocabulary, and it fits with --max_new_tokens in max_position_embeddings
    (infer.static_loop.new_token_room, the server's rule) unless dynamic RoPE lifts that bound (a prompt
    too long for it names its images' share, when it has images: `image_id`'s)."""
    outside = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if outside:
        raise UserError(f"--prompt_ids: {', '.join(map(str, outside[:5]))} outside the model's vocabulary "
                        f"(ids 0..{cfg.vocab_size - 1})")
    if cfg.position_limit is None:  # dynamic RoPE: its base grows past max_position_embeddings
        return
    limit = cfg.max_position_embeddings
    room = new_token_room(len(ids), limit)
    if room < 1:
        placeholders = ids.count(image_id) if image_id is not None else 0
        fix = (f"{placeholders} of them are the --image files' placeholders: give smaller images (or fewer)"
               if placeholders else "shorten it")
        raise UserError(f"the prompt is {len(ids)} tokens, {1 - room} too many: the model's max_position_embeddings "
                        f"{limit} leaves room for a prompt of at most {limit} and one new token; {fix}")
    if _MAX_NEW.value > room:
        raise UserError(f"--max_new_tokens {_MAX_NEW.value}: with the {len(ids)}-token prompt that needs "
                        f"{len(ids) + _MAX_NEW.value - 1} positions (the last new token is not fed back), past the "
                        f"model's max_position_embeddings {limit}; ask for at most {room}")


class TextStream:
    """Prints each new token as it arrives: decoded text with a tokenizer, else ids."""

    def __init__(self, tokenizer, stop_ids: tuple[int, ...]):
        self.tokenizer, self.stop_ids = tokenizer, stop_ids
        self.ids: list[int] = []
        self.printed = ""
        self.stopped = False

    def __call__(self, step, tokens) -> None:
        if self.stopped:
            return
        token = int(np.asarray(tokens)[0])
        self.ids.append(token)
        self.stopped = token in self.stop_ids
        if self.tokenizer is None:
            sys.stdout.write(f"{token} ")
        else:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # hold back a partial UTF-8 character
                sys.stdout.write(text[len(self.printed):])
                self.printed = text
        sys.stdout.flush()


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    check_flags()
    images, processor = checked_images()   # before the tokenizer, the chat template and the weights
    chat = _CHAT.value is not None or _MESSAGES.value is not None
    path = tokenizer_file() if _PROMPT.value is not None or chat else None
    tokenizer = None if path is None else load_tokenizer(path)
    if chat:
        messages = read_messages(_CHAT.value, _MESSAGES.value)
        if _CHAT.value is not None and _IMAGE.value:
            messages[0]["content"] = IMAGE * len(_IMAGE.value) + messages[0]["content"]
        template = chat_template_for(checkpoint=_CHECKPOINT.value, hf=_HF.value, override=_CHAT_TEMPLATE.value)
    start = time.perf_counter()
    model = load_model()
    if is_vision_language(model) and not images:
        print("note: a vision-language model with no --image: it answers from the text alone (give --image FILE "
              "to show it one)", file=sys.stderr)
    cfg = text_model(model).config
    end_of_turn = []
    if chat:
        from zaya_jax.data.chat_template import encode_prompt, end_of_turn_ids
        from zaya_jax.data.tokenizer import Tokenizer
        chat_tokenizer = Tokenizer(path, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id)
        ids = encode_prompt(template, chat_tokenizer, messages,
                            model.ids.image if is_vision_language(model) else None).tolist()
        end_of_turn = end_of_turn_ids(template, chat_tokenizer)
    elif _PROMPT.value is not None:
        ids = ([] if _NO_BOS.value else [cfg.bos_token_id]) + tokenizer.encode(_PROMPT.value,
                                                                               add_special_tokens=False).ids
    else:
        ids = prompt_ids()
    if images:
        ids = with_image_spans(ids, model, images, processor)
    check_lengths(ids, cfg, model.ids.image if images else None)
    loaded = time.perf_counter()
    stream = TextStream(tokenizer, stop_tokens(cfg.eos_token_id, end_of_turn, not _IGNORE_EOS.value))
    generate(model, [ids], _MAX_NEW.value, temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
             seed=_SEED.value, stop_at_eos=not _IGNORE_EOS.value, stop_ids=end_of_turn, on_token=stream,
             images=[images] if images else None, image_processor=processor)
    sys.stdout.write("\n")
    done = time.perf_counter()
    print(f"[loaded in {loaded - start:.1f}s; {len(stream.ids)} tokens in {done - loaded:.1f}s "
          f"(including compilation)]", file=sys.stderr)


if __name__ == "__main__":
    cli.run(main)
