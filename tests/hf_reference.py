"""The HF transformers ZAYA model as a test oracle: tiny configs, every parameter randomized.

torch and transformers are imported by the functions that use them, so that a module importing
this one still collects where they are not installed (Python 3.12, where the registry's torch is a
multi-GB CUDA build): its tests that call them carry the `torch_reference` mark (conftest.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from zaya_jax.convert.hf_load import model_from_tensors

if TYPE_CHECKING:
    from transformers import ZayaForCausalLM

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


def jax_from_hf(model: ZayaForCausalLM, **overrides):
    """Our ZayaLM with the HF model's in-memory weights (through the checkpoint name mapping)."""
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return model_from_tensors(model.config.to_dict(), set(state), state.__getitem__, "hf-in-memory", **overrides)
