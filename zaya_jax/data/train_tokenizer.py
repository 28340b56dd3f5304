"""CLI: train a small byte-level BPE tokenizer on a local corpus (for small experiments).

    python -m zaya_jax.data.train_tokenizer --input 'corpus/*.jsonl' --format jsonl \
        --vocab_size 4096 --output tokenizer.json

The result's first ids are <pad>=0, <eos>=1, <bos>=2 (the ZAYA1 config's special ids), so a
model config needs only its vocab_size changed to use it.
"""

from __future__ import annotations

import json

from absl import app, flags

from zaya_jax import cli
from zaya_jax.data import readers, tokenizer
from zaya_jax.errors import UserError


def define_flags() -> None:
    """The CLI's flags, defined only when this module runs as the CLI (zaya_jax.data.prepare's share names)."""
    flags.DEFINE_multi_string("input", None, "Glob pattern; repeatable.", required=True)
    flags.DEFINE_enum("format", None, list(readers.FORMATS), "Input format.", required=True)
    flags.DEFINE_string("text_field", "text", "jsonl key / parquet column.")
    flags.DEFINE_integer("vocab_size", 4096, "Vocabulary size.", lower_bound=260)
    flags.DEFINE_integer("min_frequency", 2, "Merges need at least this many occurrences.", lower_bound=1)
    flags.DEFINE_string("output", None, "tokenizer.json to write.", required=True)
    flags.DEFINE_bool("skip_bad", False, "Skip bad files/lines instead of failing.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    skipped: list[str] = []
    on_error = (lambda e: skipped.append(str(e))) if f.skip_bad else readers.raise_error

    def texts():
        for path in readers.expand_inputs(f.input):
            for doc in readers.read_documents(path, f.format, f.text_field, on_error):
                yield doc.text

    try:
        path = tokenizer.train_bpe(texts(), f.output, vocab_size=f.vocab_size, min_frequency=f.min_frequency,
                                   show_progress=True)
    except (FileNotFoundError, ValueError) as err:  # an InputError is a UserError already
        raise UserError(str(err)) from err
    print(json.dumps({"tokenizer": path, "sha256": tokenizer.file_sha256(path), "skipped": skipped}))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
