"""ZAYA1-base as Zyphra released it (original layout; zaya1-spec sections 0 and 3).

80 alternating sub-layers = 40 decoder layers of (CCA, MoE); the skip slot passes p * x;
residual stream in the compute dtype (residual_in_fp32=False); rope_theta 1e6 and a 32k
context, as in the released checkpoint after the long-context mid-train.

Training (zaya1-spec section 4): the three-phase curriculum of zaya_jax.data.zaya1_base_data_config
(8T + 4T tokens at 4k with rope_theta 1e4, then a 32k mid-train at 1e6; point data.sources at
your prepared directories), Muon with AdamW RMS-matching for matrices and AdamW for the rest,
data parallelism with the optimizer state sharded over data x context (Zyphra's distributed optimizer)
and distributed Muon (each matrix orthogonalised on one rank of that group).
Zyphra's learning rate, schedule, warmup, clipping and controller settings are not public: the
values below are assumptions.

Mesh: data=-1, context=2 (context pairs are neighbouring GPUs of a node), one mesh for all three
phases, the mesh `python -m zaya_jax.planner --search --devices 1024` picks for this config on MI300X
and on H200 with the XLA attention path that kernels.attention=auto runs on GPU: on 1,024 GPUs
data=512 splits every phase's batch (4096, 4096 and the 32k phase's 512), which data=1024 cannot,
and the planner predicts 0.404 s per 4k step against 0.476 s for data=512,tensor=2
(launch/README.md, docs/parallel.md). The Pallas flash kernel (kernels.attention=pallas) runs
context > 1 too. The config declares mesh.platform=gpu: on
a jax without a GPU plugin the trainer stops and names the install.
"""

import ml_collections

from zaya_jax.config_files import model_section
from zaya_jax.data import parse_phases, zaya1_base_data_config
from zaya_jax.train.settings import checkpoint_section, eval_section


def get_config():
    config = ml_collections.ConfigDict()
    config.model = model_section(
        vocab_size=262_272, hidden_size=2048, num_layers=40, num_q_heads=8, num_kv_heads=2, head_dim=128,
        num_experts=16, moe_intermediate_size=2048, router_hidden_size=256,
        rope_theta=1_000_000.0, partial_rotary_factor=0.5, max_position_embeddings=32_768,
        rms_norm_eps=1e-5, router_norm_eps=1e-6, layout="base", residual_in_fp32=False,
        dtype="bfloat16", scan_layers=True, remat="dots_no_batch_and_kernels", moe_backend="auto",
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    config.kernels = ml_collections.ConfigDict(dict(attention="auto", moe_matmul="auto"))
    config.train = ml_collections.ConfigDict(dict(seq_len=4096, global_batch_size=4096, seed=0))
    config.data = zaya1_base_data_config()
    config.train.update(dict(
        steps=sum(p.num_batches for p in parse_phases(config.data)), data="pipeline", microbatches=1,
        loss_chunk_size=512, log_every_steps=10, peak_flops_per_device=0.0, init_from_hf="",
        max_nonfinite_streak=3, max_rollbacks=3, init_from_checkpoint="", objective="lm",
    ))
    config.optimizer = ml_collections.ConfigDict(dict(
        name="muon", learning_rate=3e-4, adam_learning_rate=0.0, schedule="wsd", warmup_steps=2000,
        decay_fraction=0.1, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, decay_embedding=True,
        grad_clip_norm=1.0, muon_momentum=0.95, muon_ns_steps=5, muon_nesterov=True, muon_rms_scale=0.2,
        muon_distributed=True,
    ))
    config.balancing = ml_collections.ConfigDict(dict(enabled=True, rate=1e-3, b1=0.9, b2=0.999, include_skip=False))
    config.checkpoint = checkpoint_section(every_steps=1000, max_to_keep=3, async_save=True)
    config.dpo = ml_collections.ConfigDict(dict(beta=0.1, label_smoothing=0.0, rpo_alpha=0.0))
    config.eval = eval_section(every_steps=5000, max_batches=0)
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1, context=2,
                                                 shard_optimizer_over_data=True,
                                                 gradient_reduce_dtype="float32", platform="gpu"))
    config.monitor = ml_collections.ConfigDict(dict(progress_bar=True, tensorboard=True, heatmap_every_steps=1000,
                                                   profile_start_step=0, profile_steps=3))
    return config
