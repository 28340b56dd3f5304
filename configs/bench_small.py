"""The throughput benchmark shape: vocab 4096, hidden 512, 4 blocks (CCA + MoE), 8 query and
2 KV heads of head_dim 32, 16 experts of intermediate size 512, router width 64, sequence 256,
batch 8. Compared against HF transformers on the same CPU (benchmarks/). Trains on synthetic
tokens with AdamW (what the HF comparison runs: torch.optim.AdamW), so
`python -m zaya_jax.train --config configs/bench_small.py --workdir DIR` shows throughput alone.
Layers run unrolled (scan_layers=False): with 4 layers that is ~12% faster on CPU than lax.scan,
whose per-layer slicing of the stacked weights and stacking of their gradients costs more."""

import ml_collections

from zaya_jax.config_files import model_section
from zaya_jax.train.settings import checkpoint_section, eval_section


def get_config():
    config = ml_collections.ConfigDict()
    config.model = model_section(
        vocab_size=4096, hidden_size=512, num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=32,
        num_experts=16, moe_intermediate_size=512, router_hidden_size=64,
        rope_theta=10_000.0, partial_rotary_factor=0.5, max_position_embeddings=4096,
        rms_norm_eps=1e-5, router_norm_eps=1e-5, layout="native", residual_in_fp32=True,
        dtype="float32", scan_layers=False, remat="none", moe_backend="auto",
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    config.kernels = ml_collections.ConfigDict(dict(attention="auto", moe_matmul="auto"))
    config.train = ml_collections.ConfigDict(dict(seq_len=256, global_batch_size=8, seed=0))
    config.train.update(dict(
        steps=50, data="synthetic", microbatches=1, loss_chunk_size=256, log_every_steps=5,
        peak_flops_per_device=0.0, init_from_hf="", max_nonfinite_streak=3, max_rollbacks=3,
        init_from_checkpoint="", objective="lm",
    ))
    config.optimizer = ml_collections.ConfigDict(dict(
        name="adamw", learning_rate=1e-3, adam_learning_rate=0.0, schedule="cosine", warmup_steps=5,
        decay_fraction=0.2, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, decay_embedding=True,
        grad_clip_norm=1.0, muon_momentum=0.95, muon_ns_steps=5, muon_nesterov=True, muon_rms_scale=0.2,
        muon_distributed=False,
    ))
    config.balancing = ml_collections.ConfigDict(dict(enabled=True, rate=1e-3, b1=0.9, b2=0.999, include_skip=False))
    config.checkpoint = checkpoint_section(every_steps=0, max_to_keep=1, async_save=True)
    config.dpo = ml_collections.ConfigDict(dict(beta=0.1, label_smoothing=0.0, rpo_alpha=0.0))
    config.eval = eval_section(every_steps=0, max_batches=0)
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1, context=1,
                                                 shard_optimizer_over_data=False,
                                                 gradient_reduce_dtype="float32", platform="any"))
    config.monitor = ml_collections.ConfigDict(dict(progress_bar=True, tensorboard=True, heatmap_every_steps=0,
                                                   profile_start_step=0, profile_steps=3))
    return config
