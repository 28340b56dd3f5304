"""The tokenizer files of an HF export, so that `transformers.AutoTokenizer.from_pretrained(DIR)`
encodes as the run did:

  tokenizer.json          the run's HF `tokenizers` file, with a post-processor that puts bos first
                          when it adds none itself: every training sequence starts with bos, and
                          zaya_jax's generate prepends it, so transformers' usual `tok(text)` then
                          `generate` feeds the ids training saw (`add_special_tokens=False`, which
                          `apply_chat_template` uses, leaves it out)
  tokenizer_config.json   PreTrainedTokenizerFast; bos / eos / pad are the tokens of the model
                          config's ids; `chat_template`: the template the run recorded (a chat or
                          preference run), with `{{ bos_token }}` first when it renders no bos
                          itself, so that `apply_chat_template` gives the ids training and
                          `generate --chat` use (ChatTemplate.transformers_source)
  generation_config.json  when the template ends a turn with a special token other than eos
                          (ChatML's <|im_end|>, chat_template.end_of_turn_ids): eos_token_id lists
                          both, so transformers' `generate` stops where `generate --chat` does

A SentencePiece `.model` has no tokenizer class that does not depend on the model family, so it is
not written (`convert to_hf` says so).
"""

from __future__ import annotations

import json

from zaya_jax.config import ModelConfig
from zaya_jax.data.chat_template import ChatTemplate, end_of_turn_ids
from zaya_jax.data.tokenizer import Tokenizer


def with_bos_first(path: str, bos: str, bos_id: int) -> str:
    """The tokenizer.json at `path`, its post-processor followed by one that prepends `bos` (kept as it is
    when it already puts `bos_id` first)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors
    hf = HFTokenizer.from_file(path)
    if hf.encode("a").ids[:1] == [bos_id]:
        return hf.to_str()
    first = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)])
    hf.post_processor = first if hf.post_processor is None else processors.Sequence([hf.post_processor, first])
    return hf.to_str()


def tokenizer_files(tokenizer: Tokenizer, cfg: ModelConfig, template: ChatTemplate | None) -> dict[str, str]:
    """{file name: text} for an HF export directory; `tokenizer` must be an HF `tokenizers` file."""
    if tokenizer.kind != "hf":
        raise ValueError(f"{tokenizer.path}: only HF tokenizer.json files are exported")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "bos_token": tokenizer.id_to_token(cfg.bos_token_id),
              "eos_token": tokenizer.id_to_token(cfg.eos_token_id),
              "pad_token": tokenizer.id_to_token(cfg.pad_token_id)}
    files = {"tokenizer.json": with_bos_first(tokenizer.path, config["bos_token"], cfg.bos_token_id)}
    if template is not None:
        config["chat_template"] = template.transformers_source()
        stops = sorted({cfg.eos_token_id, *end_of_turn_ids(template, tokenizer)})
        if len(stops) > 1:
            files["generation_config.json"] = json.dumps({
                "bos_token_id": cfg.bos_token_id, "eos_token_id": stops, "pad_token_id": cfg.pad_token_id}, indent=2)
    files["tokenizer_config.json"] = json.dumps(config, indent=2, ensure_ascii=False)
    return files
