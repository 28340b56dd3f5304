"""The throughput benchmark shape: vocab 4096, hidden 512, 4 blocks (CCA + MoE), 8 query and
2 KV heads of head_dim 32, 16 experts of intermediate size 512, router width 64, sequence 256,
batch 8. Compared against HF transformers on the same CPU (benchmarks/)."""

import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    config.model = ml_collections.ConfigDict(dict(
        vocab_size=4096, hidden_size=512, num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=32,
        num_experts=16, moe_intermediate_size=512, router_hidden_size=64,
        rope_theta=10_000.0, partial_rotary_factor=0.5, max_position_embeddings=4096,
        rms_norm_eps=1e-5, router_norm_eps=1e-5, layout="native", residual_in_fp32=True,
        dtype="float32", scan_layers=True, remat="none", moe_backend="auto",
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    ))
    config.kernels = ml_collections.ConfigDict(dict(attention="auto", moe_matmul="auto"))
    config.train = ml_collections.ConfigDict(dict(seq_len=256, global_batch_size=8, seed=0))
    return config
