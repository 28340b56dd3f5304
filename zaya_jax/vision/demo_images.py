"""Offline image+text examples for the vision-language demo: scikit-learn's handwritten digits
(`sklearn.datasets.load_digits`, 1,797 greyscale images of 8x8 pixels that ship with the package),
as TRL-format conversations: the image and "Which digit is this?", answered by the digit.

  digit_conversations("train" | "heldout")  -> [{"images": [uint8 [8, 8, 3]], "messages": [...]}]
The split is fixed (a seeded permutation; held-out: HELDOUT_SHARE of it), chance is 10%.

  python -m zaya_jax.vision.demo_images --out digit.png [--index 0]
writes a held-out digit as a PNG (what `zaya_jax.generate --image` reads) and prints its label.
"""

from __future__ import annotations

import numpy as np

from absl import app, flags

from zaya_jax import cli
from zaya_jax.errors import UserError

QUESTION = "Which digit is this?"
HELDOUT_SHARE = 0.2
SPLIT_SEED = 0


def digit_conversations(split: str) -> list[dict]:
    """The train or held-out digits as conversations (images uint8 RGB [8, 8, 3], 0 = black)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise UserError("the digits demo reads scikit-learn's bundled digits: pip install -e '.[eval]'") from err
    digits = load_digits()
    order = np.random.default_rng(SPLIT_SEED).permutation(len(digits.target))
    cut = int(round(len(order) * (1 - HELDOUT_SHARE)))
    chosen = order[:cut] if split == "train" else order[cut:]
    pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)
    return [{"images": [np.repeat(pixels[i][..., None], 3, axis=2)],
             "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                          {"role": "assistant", "content": [{"type": "text", "text": str(digits.target[i])}]}]}
            for i in chosen]


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from PIL import Image
    heldout = digit_conversations("heldout")
    index = flags.FLAGS.index
    if not 0 <= index < len(heldout):
        raise UserError(f"--index {index}: the held-out digits are 0..{len(heldout) - 1}")
    try:
        Image.fromarray(heldout[index]["images"][0]).save(flags.FLAGS.out)
    except (OSError, ValueError) as err:
        raise UserError(f"--out {flags.FLAGS.out}: cannot write it as an image ({err})") from err
    print(heldout[index]["messages"][1]["content"][0]["text"])


if __name__ == "__main__":
    flags.DEFINE_string("out", None, "PNG file to write.", required=True)
    flags.DEFINE_integer("index", 0, "Which held-out digit.")
    cli.run(main)
