"""ZAYA1-8B in the HF transformers native layout (`ZayaForCausalLM`).

The skip slot outputs 0, the residual stream is kept in fp32, rope_theta 5e6, 131k context.

Every other section is zaya1_base.py's, loaded from it (the same curriculum and optimizer;
assumptions where Zyphra published nothing).
"""

import os

from zaya_jax.config_files import load_config_file, model_section


def get_config():
    config = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "zaya1_base.py"))
    config.model = model_section(
        vocab_size=262_272, hidden_size=2048, num_layers=40, num_q_heads=8, num_kv_heads=2, head_dim=128,
        num_experts=16, moe_intermediate_size=2048, router_hidden_size=256,
        rope_theta=5_000_000.0, partial_rotary_factor=0.5, max_position_embeddings=131_072,
        rms_norm_eps=1e-5, router_norm_eps=1e-5, layout="native", residual_in_fp32=True,
        dtype="bfloat16", scan_layers=True, remat="dots_no_batch_and_kernels", moe_backend="auto",
        pad_token_id=0, bos_token_id=2, eos_token_id=106,
    )
    return config
