"""CLI: generate text (or ids) from a ZAYA model, streaming tokens as the compiled loop makes them.

  python -m zaya_jax.generate --hf DIR --tokenizer tokenizer.json --prompt "Once upon a time" \\
      --max-new-tokens 64 [--temperature 0.8 --top-k 50 --top-p 0.95 --seed 0] [--quantize int8|int4]
  python -m zaya_jax.generate --hf DIR --prompt-ids 2,651,1234 --max-new-tokens 16   # prints ids
  python -m zaya_jax.generate --checkpoint DIR ...   # a trainer (Orbax) checkpoint

--hf reads an HF ZAYA checkpoint (zaya_jax.load_hf); --checkpoint the latest step of a training
run's Orbax checkpoint, its WORKDIR or checkpoint directory (zaya_jax.infer.load_checkpoint, through
zaya_jax.train.checkpoint; without that module it fails and says so), onto this process's first
device whatever mesh and device count the training run had. Timing goes to stderr, generated text or ids to stdout.

`zaya_jax.generate` is also the generate function (zaya_jax/__init__.py); importing this module
would shadow it with the module, so the module itself is made callable as that function.
"""

from __future__ import annotations

import argparse
import sys
import time
import types

import numpy as np

from zaya_jax.infer.generate import generate
from zaya_jax.infer.loading import load_checkpoint, load_hf
from zaya_jax.infer.quantize import MODES


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m zaya_jax.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", metavar="DIR", help="HF ZAYA checkpoint directory (config.json + safetensors)")
    source.add_argument("--checkpoint", metavar="DIR", help="training run WORKDIR or its checkpoint directory (Orbax)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs --tokenizer)")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 2,17,5")
    parser.add_argument("--tokenizer", metavar="PATH", help="HF tokenizer.json (the `tokenizers` library)")
    parser.add_argument("--no-bos", action="store_true",
                        help="do not prepend the model's bos id to an encoded --prompt that lacks it")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after the eos id")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="compute dtype (default: float32 for --hf, the saved config's for --checkpoint)")
    parser.add_argument("--quantize", choices=sorted(MODES), default=None, help="weight-only quantization")
    parser.add_argument("--group-size", type=int, default=64, help="quantization group along the input axis")
    args = parser.parse_args(argv)
    if args.prompt is not None and args.tokenizer is None:
        parser.error("--prompt needs --tokenizer (or pass --prompt-ids)")
    return args


def load_model(args: argparse.Namespace):
    options = dict(quantize=args.quantize, group_size=args.group_size)
    if args.dtype is not None:
        options["dtype"] = args.dtype
    if args.hf is not None:
        return load_hf(args.hf, **options)
    try:
        return load_checkpoint(args.checkpoint, **options)
    except ModuleNotFoundError as err:
        if "zaya_jax.train" not in str(err.name):
            raise
        raise SystemExit(f"--checkpoint: {err}") from err


class TextStream:
    """Prints each new token as it arrives: decoded text with a tokenizer, else ids."""

    def __init__(self, tokenizer, eos_id: int | None):
        self.tokenizer, self.eos_id = tokenizer, eos_id
        self.ids: list[int] = []
        self.printed = ""
        self.stopped = False

    def __call__(self, step, tokens) -> None:
        if self.stopped:
            return
        token = int(np.asarray(tokens)[0])
        self.ids.append(token)
        self.stopped = token == self.eos_id
        if self.tokenizer is None:
            sys.stdout.write(f"{token} ")
        else:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # hold back a partial UTF-8 character
                sys.stdout.write(text[len(self.printed):])
                self.printed = text
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tokenizer = None
    if args.tokenizer is not None:
        import tokenizers
        tokenizer = tokenizers.Tokenizer.from_file(args.tokenizer)
    start = time.perf_counter()
    model = load_model(args)
    cfg = model.config
    if args.prompt is not None:
        ids = tokenizer.encode(args.prompt).ids
        if not args.no_bos and ids[:1] != [cfg.bos_token_id]:
            ids = [cfg.bos_token_id] + ids
    else:
        ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    loaded = time.perf_counter()
    stream = TextStream(tokenizer, None if args.ignore_eos else cfg.eos_token_id)
    generate(model, [ids], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
             seed=args.seed, stop_at_eos=not args.ignore_eos, on_token=stream)
    sys.stdout.write("\n")
    done = time.perf_counter()
    print(f"[loaded in {loaded - start:.1f}s; {len(stream.ids)} tokens in {done - loaded:.1f}s "
          f"(including compilation)]", file=sys.stderr)


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
