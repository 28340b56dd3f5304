"""The harness model's weights and tokenizer, through the loaders generate and convert use.

  load_model(checkpoint, hf, step, dtype, quantize, mxfp4_block_axis)   zaya_jax.infer.loading, with a
                                                      dropless MoE
  load_tokenizer(checkpoint, hf, step, path, cfg)     the `tokenizers` file as the HF export holds it
"""

from __future__ import annotations

import os
import sys

from zaya_jax.checkpoints.carried_tokenizer import checkpoint_tokenizer
from zaya_jax.checkpoints.orbax_checkpoint import checkpoint_dir, read_config
from zaya_jax.convert.hf_tokenizer import with_bos_first
from zaya_jax.data.tokenizer import Tokenizer
from zaya_jax.errors import UserError
from zaya_jax.infer.loading import check_block_axis_source, load_checkpoint, load_hf


def check_source(checkpoint: str | None, hf: str | None, step: int | None) -> None:
    """Exactly one of checkpoint and hf, an existing directory; step only with checkpoint."""
    if (checkpoint is None) == (hf is None):
        raise UserError("give exactly one of --checkpoint WORKDIR and --hf DIR")
    if step is not None and checkpoint is None:
        raise UserError("--step goes with --checkpoint (an HF directory holds one model)")
    flag, path = ("--checkpoint", checkpoint) if checkpoint is not None else ("--hf", hf)
    if not os.path.isdir(path):
        raise UserError(f"{flag} {path}: no such directory; pass a training WORKDIR (--checkpoint) or an "
                        "HF export directory (--hf)")


def load_model(checkpoint: str | None, hf: str | None, step: int | None, dtype: str | None = None,
               quantize: str | None = None, mxfp4_block_axis: str | None = None):
    """-> ZayaLM. A `capacity` MoE backend (which drops tokens by batch composition, so padding would
    change scores) is replaced by `auto` (dropless). mxfp4_block_axis: with hf, as load_hf's."""
    check_source(checkpoint, hf, step)
    options = {"quantize": quantize}
    if dtype is not None:
        options["dtype"] = dtype
    if hf is not None:
        return load_hf(hf, mxfp4_block_axis=mxfp4_block_axis, **options)
    check_block_axis_source(mxfp4_block_axis, hf)
    config = read_config(checkpoint_dir(checkpoint), step)
    if "vision" in config:
        raise UserError(f"--checkpoint {checkpoint} holds a vision-language model; the harness scores text models "
                        f"(score a digits demo run with: python -m zaya_jax.evaluate_tasks --checkpoint {checkpoint})")
    if config.model.get("moe_backend") == "capacity":
        options["moe_backend"] = "auto"
    return load_checkpoint(checkpoint, step=step, **options)


def load_tokenizer(checkpoint: str | None, hf: str | None, step: int | None, path: str | None, cfg):
    """-> (a `tokenizers.Tokenizer` that puts bos first as `convert to_hf`'s export does, its file).

    path: a tokenizer.json (for a checkpoint: only the file it carries, carried_tokenizer), else
    the one the checkpoint carries (--checkpoint) or DIR/tokenizer.json (--hf)."""
    import tokenizers

    if checkpoint is not None:
        path, told = checkpoint_tokenizer(checkpoint, step, path)
        print(told, file=sys.stderr)
    elif path is None:
        path = os.path.join(hf, "tokenizer.json")
        if not os.path.isfile(path):
            raise UserError(f"--hf {hf} holds no tokenizer.json; pass --tokenizer FILE")
    tokenizer = Tokenizer(path, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id)
    if tokenizer.kind != "hf":
        raise UserError(f"tokenizer {path}: the harness needs an HF tokenizer.json (a SentencePiece model has no "
                        "tokenizer class of its own here); pass --tokenizer FILE.json")
    bos = tokenizer.id_to_token(cfg.bos_token_id)
    return tokenizers.Tokenizer.from_str(with_bos_first(path, bos, cfg.bos_token_id)), path
