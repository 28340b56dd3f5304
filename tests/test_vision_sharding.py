"""ZAYA1-VL sharded == one device: the loss and every gradient (tower, text model, vision LoRA) on
an 8-device mesh that shards the tower's width over fsdp, its heads and MLP over tensor, and the
merged image experts over expert; and the tower's parameters are sharded there (not replicated)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.vision_fixtures import IDS, VISION, random_vl_model
from zaya_jax.data.vision.processor import image_span
from zaya_jax.model.vision.layout import patch_layout
from zaya_jax.model.vision.vl import ImageBatch
from zaya_jax.parallel.mesh import make_mesh
from zaya_jax.parallel.rules import batch_spec, state_shardings

B, S, GRID = 4, 16, (1, 4, 4)


def _inputs():
    rng = np.random.default_rng(0)
    span = image_span(GRID, *IDS)
    ids = np.stack([np.concatenate([rng.integers(3, 90, 2 + b), span, rng.integers(3, 90, S - 8 - b)])
                    for b in range(B)])
    layout = patch_layout([GRID], VISION)
    patches = rng.normal(size=(B, 16, VISION.patch_dim)).astype(np.float32)
    images = ImageBatch(patches, *(np.broadcast_to(a, (B, *a.shape)) for a in layout[:3]))
    return ids, images


def _loss(graphdef, rest):
    def loss(params, ids, images):
        logits = nnx.merge(graphdef, params, rest)(ids, images)[:, :-1]
        nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, ids[:, 1:, None], -1)[..., 0]
        return jnp.mean(nll)
    return loss


def test_sharded_vl_model_equals_one_device():
    model = random_vl_model()
    ids, images = _inputs()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    step = jax.jit(jax.value_and_grad(_loss(graphdef, rest)))
    ref_loss, ref_grads = step(params, ids, images)

    mesh = make_mesh({"fsdp": 2, "tensor": 2, "expert": 2})
    with jax.set_mesh(mesh):
        shardings = state_shardings(params, mesh)
        tower_qkv = shardings["vision"]["blocks"]["attention"]["qkv_kernel"].spec
        assert tower_qkv == P(None, "fsdp", None, "tensor", None), tower_qkv    # [layers, D, 3, N, H]
        sharded = jax.device_put(params, shardings)
        rest = jax.device_put(rest, state_shardings(rest, mesh))
        batch = batch_spec(mesh)[0]
        ids_s = jax.device_put(ids, NamedSharding(mesh, batch_spec(mesh)))
        images_s = ImageBatch(*(jax.device_put(a, NamedSharding(mesh, P(batch))) for a in images))
        loss, grads = jax.jit(jax.value_and_grad(_loss(graphdef, rest)))(sharded, ids_s, images_s)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5, rtol=1e-4, err_msg=str(path))
    lora_grad = np.asarray(ref_grads["text"]["layers"]["moe"]["vision_lora"]["down_b"][...])
    assert np.abs(lora_grad).max() > 1e-4  # the image experts ran
