"""ZAYA1-base as Zyphra released it (original layout; zaya1-spec sections 0 and 3).

80 alternating sub-layers = 40 decoder layers of (CCA, MoE); the skip slot passes p * x;
residual stream in the compute dtype (residual_in_fp32=False); rope_theta 1e6 and a 32k
context, as in the released checkpoint after the long-context mid-train.
"""

import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    config.model = ml_collections.ConfigDict(dict(
        vocab_size=262_272, hidden_size=2048, num_layers=40, num_q_heads=8, num_kv_heads=2, head_dim=128,
        num_experts=16, moe_intermediate_size=2048, router_hidden_size=256,
        rope_theta=1_000_000.0, partial_rotary_factor=0.5, max_position_embeddings=32_768,
        rms_norm_eps=1e-5, router_norm_eps=1e-6, layout="base", residual_in_fp32=False,
        dtype="bfloat16", scan_layers=True, remat="dots_no_batch", moe_backend="auto",
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    ))
    config.kernels = ml_collections.ConfigDict(dict(attention="auto", moe_matmul="auto"))
    config.train = ml_collections.ConfigDict(dict(seq_len=4096, global_batch_size=4096, seed=0))
    return config
