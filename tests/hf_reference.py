"""The HF transformers ZAYA model as a test oracle: tiny configs, every parameter randomized.

torch and transformers are imported by the functions that use them, so that a module importing
this one still collects where they are not installed (Python 3.12, where the registry's torch is a
multi-GB CUDA build): its tests that call them carry the `torch_reference` mark (conftest.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from zaya_jax.checkpoints.hf_load import model_from_tensors

if TYPE_CHECKING:
    from transformers import ZayaForCausalLM
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

TINY_HF = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, num_experts=4, moe_intermediate_size=16, router_hidden_size=8, eos_token_id=1,
               rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": 10_000.0,
                                           "partial_rotary_factor": 0.5}})


def make_hf_model(seed: int = 0, **overrides) -> ZayaForCausalLM:
    """An fp32 HF model in eval mode whose every parameter and buffer is random.

    Scales keep the network well conditioned; balancing biases are large enough to change the
    routing; the skip slot's bias is kept at -1 (HF's from_pretrained resets it, zaya1-spec).
    """
    import torch
    from transformers import ZayaConfig, ZayaForCausalLM

    torch.manual_seed(seed)
    model = ZayaForCausalLM(ZayaConfig(**{**TINY_HF, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_scale", "layernorm.weight", "norm.weight")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("temp"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif ".mlp.gate." in name:  # routing varies per token; biases still matter
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("balancing_biases"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
                buf[-1] = -1.0
    return model


def hf_logits(model: ZayaForCausalLM, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()


def assert_lm_gradients_match(hf_model: ZayaForCausalLM, model, ids: np.ndarray) -> None:
    """The mean next-token cross-entropy of `ids` and its gradient for every parameter, written here in
    torch (autograd) and in jax: equal, tensor by tensor through the checkpoint names, and every one moved."""
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from zaya_jax.checkpoints.hf_load import _lookup
    from zaya_jax.checkpoints.hf_names import ENTRIES

    hf_model.zero_grad()
    logits = hf_model(torch.as_tensor(ids, dtype=torch.long)).logits
    torch_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                   torch.as_tensor(ids[:, 1:].reshape(-1), dtype=torch.long))
    torch_loss.backward()
    torch_grads = {n: p.grad.numpy().copy() for n, p in hf_model.named_parameters()}

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def jax_loss(params):
        logp = jax.nn.log_softmax(nnx.merge(graphdef, params, rest)(ids)[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(ids)[:, 1:, None], axis=-1))
    loss, grads = jax.jit(jax.value_and_grad(jax_loss))(params)
    assert abs(float(loss) - torch_loss.item()) < 1e-5
    pure, compared = nnx.to_pure_dict(grads), set()
    for entry in ENTRIES["native"](model.config):
        if entry.hf_name.endswith("balancing_biases"):
            continue  # a buffer: no gradient on either side
        ours = entry.to_hf(*(np.asarray(_lookup(pure, path)[index]) for path, index in entry.targets))
        theirs = torch_grads[entry.hf_name]
        scale = max(np.abs(theirs).max(), 1e-3)
        np.testing.assert_allclose(ours, theirs, atol=2e-5 * scale + 1e-7, rtol=1e-3, err_msg=entry.hf_name)
        compared.add(entry.hf_name)
    assert compared == set(torch_grads), sorted(set(torch_grads) ^ compared)
    moved = [n for n, g in torch_grads.items() if np.abs(g).max() > 0]
    assert len(moved) == len(torch_grads), "every parameter must receive a gradient"


def jax_from_hf(model: ZayaForCausalLM, **overrides):
    """Our ZayaLM with the HF model's in-memory weights (through the checkpoint name mapping)."""
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return model_from_tensors(model.config.to_dict(), set(state), state.__getitem__, "hf-in-memory", **overrides)


TINY_VISION = dict(depth=4, hidden_size=32, intermediate_size=40, num_heads=4, in_channels=3, patch_size=4,
                   temporal_patch_size=1, spatial_merge_size=2, window_size=16, out_hidden_size=24,
                   fullatt_block_indexes=[1, 3])  # windows of 2x2 merge blocks; blocks 1 and 3 full


def make_hf_vision_tower(seed: int = 1, **overrides) -> Qwen2_5_VisionTransformerPretrainedModel:
    """transformers 5.24's Qwen2.5-VL vision tower, fp32, eager attention, every parameter random
    (norm weights around 1, biases O(0.5), matrices at 1/sqrt(fan-in))."""
    import torch
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(seed)
    config = Qwen2_5_VLVisionConfig(**{**TINY_VISION, **overrides})
    config._attn_implementation = "eager"
    model = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.ndim == 1 else p[0].numel() ** -0.5))
    return model
