"""Bidirectional image attention beyond one attention block: the XLA attention cuts the queries into
blocks of 64 rows (attention_core.query_block_size), so an image whose tokens straddle a block edge
needs its early queries to read keys of the next block. On 140 positions, with one image across the
edge at 64 and another across the one at 128, the blocked attention, the VL model's loss and
gradients on a packed training row, its prefill and its greedy generation all equal the same
computed with dense attention written here from the spec (ZAYA1-VL: every pair of image positions of
one document sees each other both ways, in full and sliding layers; all else causal or windowed, and
documents apart)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.vision_fixtures import IDS, TEXT, VISION, random_vl_model
from zaya_jax.data.vision.processor import ImageProcessor
from zaya_jax.data.vision.prompts import expand_placeholders
from zaya_jax.infer.decode import prefill
from zaya_jax.model import kernels
from zaya_jax.model.attention_core import query_block_size, xla_attention
from zaya_jax.model.vision.layout import patch_layout
from zaya_jax.model.vision.vl import ImageBatch, place_image_tokens
from zaya_jax.engine import generate

PROCESSOR = ImageProcessor.for_tower(VISION, min_pixels=64, max_pixels=40 * 40)
SEQ, FIRST_DOC, NEW, WIDTH = 140, 100, 3, 144   # WIDTH: the reference forwards' padded length
IMAGE_SIZES = ((32, 40), (24, 24))               # 20 and 9 image tokens


def dense_attention(q, k, v, segment_ids, window=None, bidirectional=None):
    """q [B,S,N,H], k, v [B,S,K,H] -> [B,S,N,H]: softmax attention over a dense [S, S] mask: key t
    visible to query s when t <= s (and t > s - window), or when both are image positions; and
    always only within s's document."""
    s = q.shape[1]
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (k, v))
    logits = jnp.einsum("bqnh,bknh->bnqk", q.astype(jnp.float32), k,
                        precision=jax.lax.Precision.HIGHEST) * q.shape[-1] ** -0.5
    query, key = np.arange(s)[:, None], np.arange(s)[None, :]
    visible = jnp.asarray((key <= query) & ((key > query - window) if window else True))[None]
    if bidirectional is not None:
        visible = visible | (bidirectional[:, :, None] & bidirectional[:, None, :])
    if segment_ids is not None:
        visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :])
    weights = jax.nn.softmax(jnp.where(visible[:, None], logits, -jnp.inf), axis=-1)
    return jnp.einsum("bnqk,bknh->bqnh", weights, v, precision=jax.lax.Precision.HIGHEST).astype(q.dtype)


def image_positions() -> np.ndarray:
    """[SEQ] bool: 20 image positions across row 64 (52-71) and 9 across row 128 (124-132)."""
    mask = np.zeros(SEQ, bool)
    mask[52:72] = mask[124:133] = True
    return mask


def test_the_case_straddles_attention_blocks():
    block = query_block_size(SEQ)
    assert block == 64 and SEQ > 2 * block
    mask = image_positions()
    assert mask[block - 1] and mask[block] and mask[2 * block - 1] and mask[2 * block]


@pytest.mark.parametrize("window", [None, 16])
def test_blocked_attention_with_images_across_blocks_equals_dense(window):
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    q = jax.random.normal(keys[0], (2, SEQ, 4, 8))
    k, v = (jax.random.normal(key, (2, SEQ, 2, 8)) for key in keys[1:3])
    segments = jnp.asarray(np.stack([np.ones(SEQ, np.int32), np.repeat([1, 2], [FIRST_DOC, SEQ - FIRST_DOC])]))
    images = jnp.asarray(np.stack([image_positions()] * 2))
    cotangent = jax.random.normal(keys[3], q.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, segments, window, images) * cotangent)
    np.testing.assert_allclose(xla_attention(q, k, v, segments, window, images),
                               dense_attention(q, k, v, segments, window, images), atol=2e-5)
    ours = jax.grad(loss(xla_attention), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(ours, jax.grad(loss(dense_attention), argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(got, want, atol=5e-5)


@pytest.fixture(scope="module")
def case():
    """The model (a sliding layer of window 16 and a full one, every LoRA acting), a 140-token prompt
    whose two images straddle rows 64 and 128, and their pictures."""
    text = dataclasses.replace(TEXT, layer_types=("hybrid_sliding", "hybrid"), sliding_window=16)
    model = random_vl_model(text)
    rng = np.random.default_rng(5)
    pictures = [rng.integers(0, 256, (*size, 3), np.uint8) for size in IMAGE_SIZES]
    words = lambda n: rng.integers(3, IDS.image, n).tolist()  # noqa: E731
    short = [2, *words(50), IDS.image, *words(50), IDS.image, *words(6)]
    prompt = expand_placeholders(short, [PROCESSOR.grid(p) for p in pictures], IDS)
    assert len(prompt) == SEQ and np.array_equal(np.asarray(prompt) == IDS.image, image_positions())
    return model, pictures, prompt


def image_batch(model, pictures) -> ImageBatch:
    patches, grids = PROCESSOR.batch(pictures)
    return ImageBatch(*(jnp.asarray(a)[None] for a in (patches, *patch_layout(grids, model.vision.config)[:3])))


def with_dense_attention(fn):
    """`fn` traced with every attention of the model computed by dense_attention (a fresh jit)."""
    def run(*args):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernels, "xla_attention", dense_attention)
            return nnx.jit(lambda *a: fn(*a))(*args)
    return run


def training_loss(model, ids, images, segments, positions):
    """Mean next-token nll over a packed row of two documents (the last token of each unscored)."""
    hidden, _ = model.hidden_states(ids, images, segment_ids=segments, positions=positions)
    logp = jax.nn.log_softmax(model.text.logits(hidden)[:, :-1])
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    scored = segments[:, 1:] == segments[:, :-1]
    return jnp.sum(nll * scored) / jnp.sum(scored)


def test_training_on_a_row_longer_than_a_block_equals_dense_attention(case):
    """A packed row (documents of 100 and 40 tokens, positions restarting): the loss and the gradient of
    every parameter (text, LoRA and tower)."""
    model, pictures, prompt = case
    ids = jnp.asarray([prompt])
    segments = jnp.asarray([np.repeat([1, 2], [FIRST_DOC, SEQ - FIRST_DOC])])
    positions = jnp.asarray([np.concatenate([np.arange(FIRST_DOC), np.arange(SEQ - FIRST_DOC)])])

    def loss_and_grads(model, *row):
        return nnx.value_and_grad(training_loss)(model, *row)
    args = (model, ids, image_batch(model, pictures), segments, positions)
    loss, grads = nnx.jit(loss_and_grads)(*args)
    want_loss, want_grads = with_dense_attention(loss_and_grads)(*args)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def dense_forward_logits(model, sequence: list[int], pictures) -> np.ndarray:
    """The whole model's logits at the sequence's last token [V], dense attention, padded to WIDTH."""
    ids = np.zeros((1, WIDTH), np.int32)
    ids[0, :len(sequence)] = sequence
    logits = with_dense_attention(lambda m, i, b: m(i, b)[0])(model, jnp.asarray(ids), image_batch(model, pictures))
    return np.asarray(logits[len(sequence) - 1])


def test_prefill_and_generation_past_a_block_equal_dense_attention(case):
    model, pictures, prompt = case

    @nnx.jit
    def prefill_logits(model, ids, images):
        image_tokens = place_image_tokens(ids, model.vision(*images), IDS.image)
        return prefill(model.text, ids, jnp.asarray([SEQ]), WIDTH, image_tokens)[0][0]
    logits = prefill_logits(model, jnp.asarray([prompt]), image_batch(model, pictures))
    np.testing.assert_allclose(logits, dense_forward_logits(model, prompt, pictures), rtol=1e-5, atol=1e-5)
    new = generate(model, [prompt], NEW, images=[pictures], image_processor=PROCESSOR, stop_at_eos=False)
    sequence = list(prompt)
    for _ in range(NEW):
        sequence.append(int(dense_forward_logits(model, sequence, pictures).argmax()))
    assert new[0].tolist() == sequence[SEQ:]
