"""A small ZAYA1-VL (text model, tower and every vision LoRA adapter acting) shared by the vision tests
that need no torch."""

import numpy as np
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.vision.config import VisionConfig
from zaya_jax.model.vision.vl import ImageTokenIds, ZayaVL

TEXT = ModelConfig(vocab_size=96, hidden_size=32, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8,
                   num_experts=4, moe_intermediate_size=16, router_hidden_size=8, layout="native",
                   residual_in_fp32=True, moe_backend="dense", capacity_factor=8.0,
                   vision_lora_rank_attn=2, vision_lora_rank_mlp=2)
VISION = VisionConfig(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4, window_size=16,
                      fullatt_block_indexes=(1,), out_hidden_size=32)
IDS = ImageTokenIds(90, 91, 92)


def random_vl_model(text: ModelConfig = TEXT, vision: VisionConfig = VISION) -> ZayaVL:
    """A ZayaVL with random weights and random LoRA B matrices (zero at init), so every adapter acts."""
    model = ZayaVL(text, vision, IDS, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    pure = nnx.to_pure_dict(state)
    rng = np.random.default_rng(1)

    def lora(tree):
        return {k: lora(v) if isinstance(v, dict) else 0.3 * rng.normal(size=v.shape).astype(np.float32)
                for k, v in tree.items()}
    for block in (pure["text"]["layers"]["attention"], pure["text"]["layers"]["moe"]):
        block["vision_lora"] = lora(block["vision_lora"])
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return model
