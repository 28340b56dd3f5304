"""The README's main command: a small ZAYA1 trained on the bundled demo corpus on a CPU.

  python -m zaya_jax.train --config configs/demo.py --workdir runs/demo

The corpus (Shakespeare, Python stdlib code, generated math; zaya_jax.data.demo_data_config) is
built offline on first use (~15 s). The model keeps ZAYA1's architecture (CCA, MLP router with
EDA, 8 experts + skip slot, residual scaling) at 4 layers of width 128; the curriculum keeps
the three phases of the demo data config (prose-heavy, then code/math-heavy at L=128 with
rope_theta 1e4, then mixed at L=256 with rope_theta 1e5), shortened so the whole run takes a
few minutes on 2 cores. Muon + AdamW as Zyphra trained ZAYA1. The layout is ZAYA1-8B's `native`
one (a skip-routed token outputs 0; one RMSNorm eps; residual stream in fp32), the one transformers'
ZayaForCausalLM implements, so `python -m zaya_jax.convert to_hf --checkpoint runs/demo --out DIR`
writes what transformers loads and computes the same logits. The balancing controller's rate
(1e-2) is the one measured to balance this model: it recovers the early collapse onto one expert
that top-1 routing shows at random init (router entropy 0 -> 0.98 within 150 steps).
"""

import ml_collections

from zaya_jax.config_files import model_section
from zaya_jax.data import demo_data_config
from zaya_jax.train.settings import checkpoint_section, eval_section

STEPS = (100, 100, 60)  # global batches per phase
BATCH = 8               # rows per global batch (the demo data config's 16, halved for speed)


def get_config():
    config = ml_collections.ConfigDict()
    config.model = model_section(
        vocab_size=4096, hidden_size=128, num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=32,
        num_experts=8, moe_intermediate_size=128, router_hidden_size=32,
        rope_theta=10_000.0, partial_rotary_factor=0.5, max_position_embeddings=1024,
        rms_norm_eps=1e-5, router_norm_eps=1e-5, layout="native", residual_in_fp32=True,
        dtype="float32", scan_layers=True, remat="none", moe_backend="auto",
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    config.kernels = ml_collections.ConfigDict(dict(attention="auto", moe_matmul="auto"))
    config.data = demo_data_config()
    for phase, steps in zip(config.data.phases, STEPS):
        phase.global_batch_size = BATCH
        phase.token_budget = steps * BATCH * phase.seq_len
    config.data.eval.max_batches = 2
    config.train = ml_collections.ConfigDict(dict(
        steps=sum(STEPS), seed=0, data="pipeline", microbatches=1, loss_chunk_size=128, log_every_steps=10,
        peak_flops_per_device=0.0, init_from_hf="", max_nonfinite_streak=3, max_rollbacks=3,
        init_from_checkpoint="", objective="lm",
    ))
    config.optimizer = ml_collections.ConfigDict(dict(
        name="muon", learning_rate=1e-2, adam_learning_rate=0.0, schedule="wsd", warmup_steps=20,
        decay_fraction=0.25, min_lr_ratio=0.05, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, decay_embedding=True,
        grad_clip_norm=1.0, muon_momentum=0.95, muon_ns_steps=5, muon_nesterov=True, muon_rms_scale=0.2,
        muon_distributed=False,
    ))
    config.balancing = ml_collections.ConfigDict(dict(enabled=True, rate=1e-2, b1=0.9, b2=0.999, include_skip=False))
    config.checkpoint = checkpoint_section(every_steps=100, max_to_keep=2, async_save=True)
    config.dpo = ml_collections.ConfigDict(dict(beta=0.1, label_smoothing=0.0, rpo_alpha=0.0))
    config.eval = eval_section(every_steps=100, max_batches=2)
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1, context=1,
                                                 shard_optimizer_over_data=False,
                                                 gradient_reduce_dtype="float32"))
    config.monitor = ml_collections.ConfigDict(dict(progress_bar=True, tensorboard=True, heatmap_every_steps=50,
                                                   profile_start_step=0, profile_steps=3))
    return config
