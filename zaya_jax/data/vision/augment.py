"""Training-image augmentation of a vision-language run: random shift, scale and contrast, as a
vision pipeline draws them, deterministic per (seed, sample).

  ImageAugment(shift, scale, contrast).document(doc, seed) -> the ImageChatDocument with each image
    moved by up to `shift` of its side (each axis), resized about its centre by a factor in
    [1 - scale, 1 + scale] (bilinear; black where it leaves the frame) and its contrast set by a
    factor in [1 - contrast, 1 + contrast] about its mean grey level (torchvision's
    adjust_contrast), every draw uniform from numpy's Generator of `seed`
The images keep their size (the processor's, as stored), so a document's tokens, patches and
packing do not change; its ids and mask are returned as they are. The training lanes apply it to
each document they draw, with the seed of that draw (data/lanes.LaneStream: the run's seed, the
phase, the source, the epoch and the document), so an image is augmented anew each epoch and the
same way on every host and worker; held-out rows (lanes.SequentialStream) are never augmented.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from PIL import Image

from zaya_jax.data.records import ImageChatDocument

# the luminance weights of PIL's "L" conversion (ITU-R 601-2), which torchvision's contrast uses too
GREY = np.asarray([0.299, 0.587, 0.114], np.float32)
LIMITS = {"shift": 0.5, "scale": 1.0, "contrast": 1.0}  # each setting lies in [0, limit)


def with_contrast(image: np.ndarray, factor: float) -> np.ndarray:
    """[h, w, 3] (any dtype) -> uint8 [h, w, 3]: round(m + factor * (pixel - m)) clipped to [0, 255], m the
    image's mean grey level (GREY) rounded, as torchvision's adjust_contrast."""
    image = np.asarray(image, np.float32)
    mean = float(np.round((image @ GREY).mean()))
    return np.clip(np.round(mean + factor * (image - mean)), 0, 255).astype(np.uint8)


@dataclasses.dataclass(frozen=True)
class ImageAugment:
    shift: float = 0.0      # the largest move along each axis, a fraction of that side (LIMITS: below 0.5)
    scale: float = 0.0      # the largest relative change of size (below 1)
    contrast: float = 0.0   # the largest relative change of contrast (below 1)

    @property
    def active(self) -> bool:
        return bool(self.shift or self.scale or self.contrast)

    def image(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """uint8 [h, w, 3] -> uint8 [h, w, 3], one draw of each transform from `rng`."""
        h, w = image.shape[:2]
        dy, dx = rng.uniform(-self.shift, self.shift, 2) * (h, w)
        factor = rng.uniform(1 - self.scale, 1 + self.scale)
        contrast = rng.uniform(1 - self.contrast, 1 + self.contrast)
        # PIL's affine map takes each output point (x, y) to the input point it reads (pixel centres
        # at +0.5): the inverse of "scale by `factor` about the centre, then move by (dx, dy)".
        cx, cy = w / 2, h / 2
        inverse = (1 / factor, 0.0, cx - (cx + dx) / factor, 0.0, 1 / factor, cy - (cy + dy) / factor)
        moved = np.asarray(Image.fromarray(image).transform((w, h), Image.Transform.AFFINE, inverse,
                                                            resample=Image.Resampling.BILINEAR, fillcolor=(0, 0, 0)),
                           np.float32)
        return with_contrast(moved, contrast)

    def document(self, doc: ImageChatDocument, seed: int) -> ImageChatDocument:
        """`doc` with its images augmented by the draws of `seed` (unchanged when nothing is active)."""
        if not self.active:
            return doc
        rng = np.random.default_rng(seed)
        return doc._replace(images=tuple(self.image(image, rng) for image in doc.images))
