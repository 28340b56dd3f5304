"""Training-image augmentation (zaya_jax.data.vision.augment, train.augment_*): each image a training lane
draws is moved, resized and its contrast changed as drawn from the seed of that draw; the rows keep
their tokens, masks and packing; held-out rows keep the stored images; the demo has it on. And the
held-out variants it is measured on (demo_images.digit_variant): each digit moved by one or two
pixels, drawn smaller or larger about the frame's centre, or at 60% contrast, each against images
computed here by hand; and the demo's augmentation ranges cover those variants."""

import numpy as np

from tests.test_vision_training import _digit_documents, _vl_config
from tests.vision_fixtures import VISION
from zaya_jax.config_files import load_config_file
from zaya_jax.data import packing
from zaya_jax.data.lanes import LaneStream
from zaya_jax.data.records import ImageChatDocument
from zaya_jax.data.vision.augment import ImageAugment
from zaya_jax.data.vision.image_rows import ImageChatRows
from zaya_jax.train.data import eval_batches, image_rows, open_training_data
from zaya_jax.train.settings import settings_from_config

AUGMENT = dict(augment_shift=0.15, augment_scale=0.25, augment_contrast=0.3)
SEQ = 64


def reference(image: np.ndarray, dy: float, dx: float, factor: float, contrast: float) -> np.ndarray:
    """The spec in numpy: output pixel centre p reads the input at c + (p - c - shift) / factor (c the
    frame's centre), bilinear between pixel centres; then contrast about the mean grey level.
    -> float [h, w, 3] before rounding, and [h, w] bool: where every pixel read lies inside the image."""
    h, w = image.shape[:2]
    ys, xs = np.mgrid[0:h, 0:w] + 0.5
    sy, sx = (ys - h / 2 - dy) / factor + h / 2 - 0.5, (xs - w / 2 - dx) / factor + w / 2 - 0.5
    y0, x0 = np.floor(sy).astype(int), np.floor(sx).astype(int)
    inside = (y0 >= 0) & (x0 >= 0) & (y0 + 1 < h) & (x0 + 1 < w)
    fy, fx = (sy - y0)[..., None], (sx - x0)[..., None]
    at = lambda y, x: image[np.clip(y, 0, h - 1), np.clip(x, 0, w - 1)].astype(np.float64)  # noqa: E731
    moved = ((1 - fy) * ((1 - fx) * at(y0, x0) + fx * at(y0, x0 + 1))
             + fy * ((1 - fx) * at(y0 + 1, x0) + fx * at(y0 + 1, x0 + 1)))
    return moved, inside


def test_an_image_is_moved_resized_and_its_contrast_changed_as_drawn():
    """Against the spec in numpy, for the draws the module documents (numpy's Generator of the seed:
    the shift along y and x, the scale factor, the contrast factor), on a 16x16 digit."""
    image = _digit_documents(1)[0][2][0]
    augment = ImageAugment(**{k.removeprefix("augment_"): v for k, v in AUGMENT.items()})
    doc = ImageChatDocument(np.zeros((2, 4), np.int32), (image,))
    for seed in range(4):
        rng = np.random.default_rng(seed)
        dy, dx = rng.uniform(-0.15, 0.15, 2) * 16
        factor, contrast = rng.uniform(0.75, 1.25), rng.uniform(0.7, 1.3)
        got = augment.document(doc, seed).images[0].astype(np.float64)
        moved, inside = reference(image, dy, dx, factor, contrast)
        geometry = ImageAugment(shift=0.15, scale=0.25).document(doc, seed).images[0]  # same draws, contrast 1
        assert inside.sum() > 100 and np.abs(geometry[inside] - moved[inside]).max() <= 1  # rounding
        mean = (geometry.astype(np.float64) @ [0.299, 0.587, 0.114]).mean()
        want = np.clip(mean + contrast * (geometry - mean), 0, 255)
        assert np.abs(got - want).max() <= 1
        assert not np.array_equal(got, image)


def _pipeline(config, **augment):
    """(the first 3 training batches, the held-out batches) of the config with train.augment_* set."""
    config.train.update(augment)
    settings = settings_from_config(config)
    data = open_training_data(config, settings)
    try:
        batches = [next(data) for _ in range(3)]
    finally:
        data.close()
    return batches, eval_batches(config, settings)


def test_training_rows_are_augmented_deterministically_and_heldout_rows_are_not(tmp_path):
    config = _vl_config(tmp_path, "unused")
    plain, plain_heldout = _pipeline(config)
    augmented, heldout = _pipeline(config, **AUGMENT)
    again, _ = _pipeline(config, **AUGMENT)
    for got, want, same in zip(augmented, plain, again, strict=True):
        for key in packing.ROW_KEYS + ("patch_positions", "image_segments", "window_segments"):
            np.testing.assert_array_equal(got[key], want[key])                       # labels and packing kept
        has_images = want["image_segments"].max(axis=1) > 0
        changed = np.abs(got["patches"] - want["patches"]).max(axis=(1, 2)) > 0.1
        assert has_images.all() and changed.all()                                    # every row's images moved
        for key in got:
            np.testing.assert_array_equal(got[key], same[key])                       # the same seed, the same rows
    for got, want in zip(heldout["digits"], plain_heldout["digits"], strict=True):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def _documents(n: int) -> list[ImageChatDocument]:
    return [ImageChatDocument(np.stack([ids, mask]), tuple(images)) for ids, mask, images in _digit_documents(n)]


def _draws(stream: LaneStream, count: int) -> list[ImageChatDocument]:
    return [stream.next_chunk() for _ in range(count)]


def test_each_draw_is_augmented_by_its_seed_whatever_lane_draws_it():
    """A document's augmented image depends on the seed, the epoch and the document only: one lane
    drawing a whole epoch and two lanes splitting it give each document the same image; the next epoch
    gives it another; its tokens are the stored ones."""
    documents = _documents(6)
    rows = ImageChatRows(VISION, 48, ImageAugment(shift=0.15, scale=0.25, contrast=0.3))
    key = lambda doc: doc.tokens.tobytes()  # noqa: E731  (each digit's tokens hold its own answer)
    stored = {key(d): d for d in documents}
    assert len(stored) == len(documents)
    one_lane = _draws(LaneStream([documents], [1.0], [11], 0, 1, SEQ, rows), 12)
    two_lanes = [d for lane in (0, 1) for d in _draws(LaneStream([documents], [1.0], [11], lane, 2, SEQ, rows), 3)]
    first_epoch = {key(d): d.images[0] for d in one_lane[:6]}
    assert len(first_epoch) == len(stored)
    for doc in two_lanes:
        np.testing.assert_array_equal(doc.images[0], first_epoch[key(doc)])
    for doc in one_lane[6:]:
        assert not np.array_equal(doc.images[0], first_epoch[key(doc)])             # anew each epoch
    for doc in one_lane:
        np.testing.assert_array_equal(doc.tokens, stored[key(doc)].tokens)
        assert not np.array_equal(doc.images[0], stored[key(doc)].images[0])


def test_the_vl_demo_trains_with_augmentation_that_covers_the_heldout_variants():
    """Its ranges reach past what the held-out variants draw: a move of 2 of 8 pixels (shifted_2px_diagonal),
    a digit at 6 of 8 pixels (rescaled_6px) or 10 of 8 (rescaled), contrast 0.6 (contrast_60)."""
    settings = settings_from_config(load_config_file("configs/demo_vl.py"))
    augment = image_rows(settings).augment
    assert augment.shift > 2 / 8 and 1 - augment.scale < 6 / 8 and 1 + augment.scale > 10 / 8
    assert 1 - augment.contrast < 0.6


def test_the_heldout_variants_move_each_digit_one_pixel_or_draw_it_at_another_size():
    from zaya_jax.data.vision.demo_images import digit_conversations, digit_variant
    heldout = digit_conversations("heldout")[:9]
    moved = digit_variant(heldout, "shifted")
    directions = [(-1, -1), (-1, 0), (-1, 1), (0, -1), (0, 1), (1, -1), (1, 0), (1, 1), (-1, -1)]  # digit i: i % 8
    for c, m, (dy, dx) in zip(heldout, moved, directions, strict=True):
        padded = np.pad(c["images"][0], ((1, 1), (1, 1), (0, 0)))                  # black comes in
        np.testing.assert_array_equal(m["images"][0], padded[1 - dy:9 - dy, 1 - dx:9 - dx])
        assert m["messages"] == c["messages"]
    white = np.full((8, 8, 3), 255, np.uint8)
    square = np.zeros((8, 8, 3), np.uint8)
    square[2:6, 2:6] = 255                                                           # 4x4, centred
    small, large = (c["images"][0] for c in digit_variant([{**heldout[0], "images": [white]},
                                                           {**heldout[1], "images": [square]}], "rescaled"))
    want = np.zeros_like(white)
    want[1:7, 1:7] = 255
    np.testing.assert_array_equal(small, want)                                       # 0.75x: 6x6 in the middle
    assert (large[2:6, 2:6] == 255).all() and large[0, 0].max() == 0
    assert large[1, 3].min() > 0 and large[6, 3].min() > 0                           # 1.25x: 5x5, past the 4x4


def _variant_images(variant: str, images: list[np.ndarray]) -> list[np.ndarray]:
    from zaya_jax.data.vision.demo_images import digit_conversations, digit_variant
    heldout = digit_conversations("heldout")[:len(images)]
    drawn = digit_variant([{**c, "images": [image]} for c, image in zip(heldout, images)], variant)
    assert [c["messages"] for c in drawn] == [c["messages"] for c in heldout]
    return [c["images"][0] for c in drawn]


def _dots(*points: tuple[int, int, int]) -> np.ndarray:
    """An 8x8 grey image, black but for the given (y, x, level) pixels."""
    image = np.zeros((8, 8, 3), np.uint8)
    for y, x, level in points:
        image[y, x] = level
    return image


def test_the_2px_diagonal_variant_moves_each_digit_two_pixels_along_each_axis_the_four_diagonals_in_turn():
    image = _dots((3, 4, 255), (0, 0, 90), (7, 7, 40))  # (0, 0) and (7, 7) leave the frame on some diagonals
    moved = _variant_images("shifted_2px_diagonal", [image] * 5)
    want = [_dots((1, 2, 255), (5, 5, 40)),              # up-left: (0, 0) leaves
            _dots((1, 6, 255)),                          # up-right: both corners leave
            _dots((5, 2, 255)),                          # down-left
            _dots((5, 6, 255), (2, 2, 90)),              # down-right: (7, 7) leaves
            _dots((1, 2, 255), (5, 5, 40))]              # digit 4: up-left again
    for got, expected in zip(moved, want, strict=True):
        np.testing.assert_array_equal(got, expected)


def _pil_bilinear_weights(size_in: int, size_out: int) -> np.ndarray:
    """[size_out, size_in]: Pillow's BILINEAR resize along one axis from its definition (a triangle filter
    widened by the scale when shrinking, centred on each output pixel's centre, weights normalised)."""
    scale = size_in / size_out
    support = max(scale, 1.0)
    centres = (np.arange(size_out) + 0.5) * scale
    weights = np.clip(1 - np.abs(np.arange(size_in) + 0.5 - centres[:, None]) / support, 0, None)
    return weights / weights.sum(1, keepdims=True)


def test_the_6px_variant_draws_every_digit_at_6x6_in_the_middle_of_its_frame():
    white = np.full((8, 8, 3), 255, np.uint8)
    ramp = np.repeat(np.repeat((np.arange(8) * 30)[None, :, None], 8, 0), 3, 2).astype(np.uint8)  # columns 0..210
    got = _variant_images("rescaled_6px", [white, ramp, white])
    want_white = np.zeros_like(white)
    want_white[1:7, 1:7] = 255
    np.testing.assert_array_equal(got[0], want_white)
    np.testing.assert_array_equal(got[2], want_white)                                # every digit, not every other
    columns = _pil_bilinear_weights(8, 6) @ (np.arange(8) * 30.0)                   # 8 -> 6 across; rows all alike
    # by hand, column 0: centre 2/3 of an input pixel, filter half-width 4/3: pixels 0 and 1 weigh 0.875 and
    # 0.375 -> 0.7 and 0.3 -> 9; column 1: centre 2, pixels 1 and 2 alike -> 45; column 2: centre 10/3,
    # pixels 2, 3, 4 weigh 0.375, 0.875, 0.125 -> (60 * 0.375 + 90 * 0.875 + 120 * 0.125) / 1.375 = 84.55
    assert np.abs(columns - [9, 45, 84.5455, 125.4545, 165, 201]).max() < 1e-3
    want_ramp = np.zeros((8, 8), np.float64)
    want_ramp[1:7, 1:7] = columns
    assert np.abs(got[1][..., 0] - want_ramp).max() <= 1 and (got[1][0] == 0).all() and (got[1][:, 7] == 0).all()


def test_the_contrast_variant_sets_each_digit_at_60_percent_contrast_about_its_mean_grey():
    image = _dots((2, 2, 255), (2, 3, 255), (3, 2, 255), (5, 5, 100))
    # by hand: mean grey (3 * 255 + 100) / 64 = 13.52 -> 14; black 14 - 0.6 * 14 = 5.6 -> 6;
    # 255 -> 14 + 0.6 * 241 = 158.6 -> 159; 100 -> 14 + 0.6 * 86 = 65.6 -> 66
    want = np.full((8, 8, 3), 6, np.uint8)
    want[2, 2] = want[2, 3] = want[3, 2] = 159
    want[5, 5] = 66
    for got in _variant_images("contrast_60", [image, image]):
        np.testing.assert_array_equal(got, want)
