"""A ZAYA1-shaped model small enough to train in seconds on a CPU (tests and examples).

Same architecture as zaya1_base (base layout); every dimension shrunk. The global batch (8)
divides by 8 so any mesh of up to 8 devices can run it.
"""

import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    config.model = ml_collections.ConfigDict(dict(
        vocab_size=512, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
        num_experts=4, moe_intermediate_size=64, router_hidden_size=16,
        rope_theta=10_000.0, partial_rotary_factor=0.5, max_position_embeddings=1024,
        rms_norm_eps=1e-5, router_norm_eps=1e-6, layout="base", residual_in_fp32=False,
        dtype="float32", scan_layers=True, remat="none", moe_backend="auto",
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    ))
    config.kernels = ml_collections.ConfigDict(dict(attention="auto", moe_matmul="auto"))
    config.train = ml_collections.ConfigDict(dict(seq_len=64, global_batch_size=8, seed=0))
    return config
