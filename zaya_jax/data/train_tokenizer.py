"""CLI: train a small byte-level BPE tokenizer on a local corpus (for small experiments).

    python -m zaya_jax.data.train_tokenizer --input 'corpus/*.jsonl' --format jsonl \
        --vocab-size 4096 --output tokenizer.json

The result's first ids are <pad>=0, <eos>=1, <bos>=2 (the ZAYA1 config's special ids), so a
model config needs only its vocab_size changed to use it.
"""

from __future__ import annotations

import argparse
import json
import sys

from zaya_jax.data import readers, tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", action="append", required=True, help="glob pattern; repeatable")
    parser.add_argument("--format", choices=readers.FORMATS, required=True)
    parser.add_argument("--text-field", default="text", help="jsonl key / parquet column")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--output", required=True, help="tokenizer.json to write")
    parser.add_argument("--skip-bad", action="store_true", help="skip bad files/lines instead of failing")
    args = parser.parse_args(argv)

    skipped: list[str] = []
    on_error = (lambda e: skipped.append(str(e))) if args.skip_bad else readers.raise_error

    def texts():
        for path in readers.expand_inputs(args.input):
            for doc in readers.read_documents(path, args.format, args.text_field, on_error):
                yield doc.text

    try:
        path = tokenizer.train_bpe(texts(), args.output, vocab_size=args.vocab_size,
                                   min_frequency=args.min_frequency, show_progress=True)
    except (readers.InputError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"tokenizer": path, "sha256": tokenizer.file_sha256(path), "skipped": skipped}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
