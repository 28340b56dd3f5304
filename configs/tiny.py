"""A ZAYA1-shaped model small enough to train in seconds on a CPU (tests and examples).

Same architecture as zaya1_base (base layout); every dimension shrunk. The global batch (8)
divides by 8 so any mesh of up to 8 devices can run it. Trains on synthetic packed documents
(zaya_jax.train.data), so `python -m zaya_jax.train --config configs/tiny.py --workdir DIR` needs
no preparation.
"""

import ml_collections

from zaya_jax.config_files import model_section
from zaya_jax.train.settings import checkpoint_section, eval_section


def get_config():
    config = ml_collections.ConfigDict()
    config.model = model_section(
        vocab_size=512, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
        num_experts=4, moe_intermediate_size=64, router_hidden_size=16,
        rope_theta=10_000.0, partial_rotary_factor=0.5, max_position_embeddings=1024,
        rms_norm_eps=1e-5, router_norm_eps=1e-6, layout="base", residual_in_fp32=False,
        dtype="float32", scan_layers=True, remat="none", moe_backend="auto",
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    config.kernels = ml_collections.ConfigDict(dict(attention="auto", moe_matmul="auto"))
    config.train = ml_collections.ConfigDict(dict(
        seq_len=64, global_batch_size=8, seed=0,
        steps=200, data="synthetic", microbatches=1, loss_chunk_size=32, log_every_steps=10,
        peak_flops_per_device=0.0, init_from_hf="", max_nonfinite_streak=3, max_rollbacks=3,
        init_from_checkpoint="", objective="lm",
    ))
    config.optimizer = ml_collections.ConfigDict(dict(
        name="muon", learning_rate=3e-3, adam_learning_rate=0.0, schedule="cosine", warmup_steps=10,
        decay_fraction=0.2, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, decay_embedding=True,
        grad_clip_norm=1.0, muon_momentum=0.95, muon_ns_steps=5, muon_nesterov=True, muon_rms_scale=0.2,
        muon_distributed=False,
    ))
    config.balancing = ml_collections.ConfigDict(dict(enabled=True, rate=1e-4, b1=0.9, b2=0.999, include_skip=False))
    config.checkpoint = checkpoint_section(every_steps=100, max_to_keep=3, async_save=True)
    config.dpo = ml_collections.ConfigDict(dict(beta=0.1, label_smoothing=0.0, rpo_alpha=0.0))
    config.eval = eval_section(every_steps=100, max_batches=2)
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1, context=1,
                                                 shard_optimizer_over_data=False,
                                                 gradient_reduce_dtype="float32", platform="any"))
    config.monitor = ml_collections.ConfigDict(dict(progress_bar=True, tensorboard=True, heatmap_every_steps=50,
                                                   profile_start_step=0, profile_steps=3))
    return config
