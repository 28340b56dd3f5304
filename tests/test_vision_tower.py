"""Proof against transformers 5.24: our vision tower equals `Qwen2_5_VisionTransformerPretrainedModel`
in its merged image tokens and in the gradient of every parameter, fp32, random weights.

Three images of two shapes in one batch (patch grids 6x8, 4x4 and 2x6; 4-pixel patches, windows of
2x2 merge blocks): windows that cut an image unevenly, a grid the windows divide exactly (where
transformers pads a whole empty window) and a one-window-high strip. Blocks 1 and 3 of 4 attend
over the whole image, blocks 0 and 2 within windows; the gradient is taken under a random cotangent.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.hf_reference import make_hf_vision_tower
from zaya_jax.checkpoints.hf_load import _lookup, vision_tower_from_tensors
from zaya_jax.checkpoints.hf_vision_names import vision_entries
from zaya_jax.model.vision.config import VisionConfig
from zaya_jax.model.vision.layout import patch_layout

pytestmark = pytest.mark.torch_reference

GRIDS = [(1, 6, 8), (1, 4, 4), (1, 2, 6)]


@pytest.fixture(scope="module")
def reference():
    """(HF tower with random weights, our config, patches [P, F], cotangent [P/4, O])."""
    model = make_hf_vision_tower()
    cfg = VisionConfig.from_hf(model.config.to_dict())
    rng = np.random.default_rng(2)
    patches = rng.normal(size=(sum(t * h * w for t, h, w in GRIDS), cfg.patch_dim)).astype(np.float32)
    cotangent = rng.normal(size=(patches.shape[0] // 4, cfg.out_hidden_size)).astype(np.float32)
    return model, cfg, patches, cotangent


def _hf_tokens_and_grads(model, patches, cotangent):
    import torch

    model.zero_grad()
    out = model(torch.as_tensor(patches), grid_thw=torch.as_tensor(GRIDS)).pooler_output
    (out * torch.as_tensor(cotangent)).sum().backward()
    return out.detach().numpy(), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def _ours(model, cfg):
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return vision_tower_from_tensors(cfg, state.__getitem__, "", "hf-in-memory")


def test_tokens_and_every_parameter_gradient_equal_transformers(reference):
    model, cfg, patches, cotangent = reference
    hf_tokens, hf_grads = _hf_tokens_and_grads(model, patches, cotangent)
    tower = _ours(model, cfg)
    layout = patch_layout(GRIDS, cfg)
    assert layout.tokens_per_image == (12, 4, 3)

    def loss(tower):
        return jnp.sum(tower.embed_images(patches, layout) * cotangent)

    tokens = tower.embed_images(patches, layout)
    np.testing.assert_allclose(np.asarray(tokens), hf_tokens, rtol=1e-4, atol=1e-4)
    grads = nnx.to_pure_dict(nnx.grad(loss)(tower))
    entries = vision_entries(cfg, "")
    assert {e.hf_name for e in entries} == set(hf_grads)
    for entry in entries:
        ours = entry.to_hf(*(np.asarray(_lookup(grads, path)[index]) for path, index in entry.targets))
        theirs = hf_grads[entry.hf_name]
        np.testing.assert_allclose(ours, theirs, rtol=2e-4, atol=2e-4 * np.abs(theirs).max(),
                                   err_msg=entry.hf_name)


def test_windows_act_and_padding_is_inert(reference):
    """The window blocks see only their window (treating them as full changes the tokens), and an
    example padded with group-0 patches gives its images' tokens unchanged, beside another example."""
    model, cfg, patches, _ = reference
    tower = _ours(model, cfg)
    layout = patch_layout(GRIDS, cfg)
    tokens = np.asarray(tower.embed_images(patches, layout))
    def batched(lay):
        return [jnp.asarray(a)[None] for a in (lay.positions, lay.image_segments, lay.window_segments)]
    pos, img, _ = batched(layout)
    all_full = np.asarray(tower(jnp.asarray(patches)[None], pos, img, img)[0])
    assert np.abs(all_full - tokens).max() > 1e-2

    first, second = patches[:48], patches[48:]                 # image 0 | images 1 and 2
    lay_a, lay_b = patch_layout(GRIDS[:1], cfg, pad_to=48), patch_layout(GRIDS[1:], cfg, pad_to=48)
    padded_b = np.concatenate([second, np.full((48 - len(second), cfg.patch_dim), 7.0, np.float32)])
    stacked = [jnp.concatenate(pair) for pair in zip(batched(lay_a), batched(lay_b))]
    both = np.asarray(tower(jnp.stack([first, padded_b]), *stacked))
    np.testing.assert_allclose(both[0], tokens[:12], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(both[1, :7], tokens[12:], rtol=1e-5, atol=1e-5)
