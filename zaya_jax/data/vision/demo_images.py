"""Offline image+text examples for the vision-language demo: scikit-learn's handwritten digits
(`sklearn.datasets.load_digits`, 1,797 greyscale images of 8x8 pixels that ship with the package),
as TRL-format conversations: the image and "Which digit is this?", answered by the digit.

  digit_conversations("train" | "heldout")  -> [{"images": [uint8 [8, 8, 3]], "messages": [...]}]
The split is fixed (a seeded permutation: 1,438 training digits, 359 held out, HELDOUT_SHARE of
1,797 rounded), chance is 10%.

  digit_variant(conversations, variant)   variant one of VARIANTS:
the same conversations with each digit as a user might draw it elsewhere in the frame, at another
size or fainter (digit i is the i-th conversation; black comes in where the frame is left empty):
  "plain"                 as held out
  "shifted"               moved by one pixel towards NEIGHBOURS[i % 8] (the 8 neighbours in turn)
  "rescaled"              drawn at RESCALED_SIDES[i % 2] pixels a side (6 and 10: 0.75x and 1.25x;
                          bilinear) about the frame's centre, a larger one's border cut off
  "shifted_2px_diagonal"  moved by two pixels along each axis towards DIAGONALS[i % 4] (up-left,
                          up-right, down-left, down-right in turn)
  "rescaled_6px"          every digit drawn at 6x6 pixels (bilinear) in the middle of its 8x8 frame
  "contrast_60"           its contrast at CONTRAST_60 = 0.6 (augment.with_contrast: each pixel
                          m + 0.6 (pixel - m), m the digit's mean grey level rounded; then rounded)

  python -m zaya_jax.data.vision.demo_images --out digit.png [--index 0] [--variant shifted]
writes a held-out digit as a PNG (what `zaya_jax.generate --image` reads) and prints its label.
"""

from __future__ import annotations

import numpy as np

from absl import app, flags

from zaya_jax import cli
from zaya_jax.data.vision.augment import with_contrast
from zaya_jax.errors import UserError

QUESTION = "Which digit is this?"
HELDOUT_SHARE = 0.2
SPLIT_SEED = 0
SIDE = 8  # scikit-learn's digits are 8x8 pixels
VARIANTS = ("plain", "shifted", "rescaled", "shifted_2px_diagonal", "rescaled_6px", "contrast_60")
NEIGHBOURS = tuple((dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if dy or dx)
RESCALED_SIDES = (6, 10)
DIAGONALS = ((-1, -1), (-1, 1), (1, -1), (1, 1))
CONTRAST_60 = 0.6


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


def shifted(image: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """uint8 [h, w, 3] moved by (dy, dx) whole pixels, black where nothing moved in."""
    h, w = image.shape[:2]
    out = np.zeros_like(image)
    out[max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = image[max(-dy, 0):h - max(dy, 0),
                                                                      max(-dx, 0):w - max(dx, 0)]
    return out


def rescaled(image: np.ndarray, side: int) -> np.ndarray:
    """uint8 [SIDE, SIDE, 3] drawn at side x side pixels (bilinear) about the centre of its frame:
    padded with black when smaller, its border cut off when larger (even margins)."""
    from PIL import Image
    drawn = np.asarray(Image.fromarray(image).resize((side, side), Image.Resampling.BILINEAR))
    margin = abs(side - SIDE) // 2
    if side > SIDE:
        return np.ascontiguousarray(drawn[margin:margin + SIDE, margin:margin + SIDE])
    out = np.zeros_like(image)
    out[margin:margin + side, margin:margin + side] = drawn
    return out


def digit_variant(conversations: list[dict], variant: str) -> list[dict]:
    """The conversations with each digit drawn as `variant` says (VARIANTS; see the module docstring)."""
    if variant not in VARIANTS:
        raise UserError(f"unknown digit variant {variant!r} (known: {', '.join(VARIANTS)})")
    draw = {"plain": lambda image, i: image, "shifted": lambda image, i: shifted(image, *NEIGHBOURS[i % 8]),
            "rescaled": lambda image, i: rescaled(image, RESCALED_SIDES[i % 2]),
            "shifted_2px_diagonal": lambda image, i: shifted(image, *(2 * d for d in DIAGONALS[i % 4])),
            "rescaled_6px": lambda image, i: rescaled(image, 6),
            "contrast_60": lambda image, i: with_contrast(image, CONTRAST_60)}[variant]
    return [{**c, "images": [draw(image, i) for image in c["images"]]} for i, c in enumerate(conversations)]


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from PIL import Image
    heldout = digit_variant(digit_conversations("heldout"), flags.FLAGS.variant)
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
    flags.DEFINE_enum("variant", "plain", VARIANTS, "The digit as held out, moved, drawn at another size or at 60% contrast (the module's docstring).")
    cli.run(main)
