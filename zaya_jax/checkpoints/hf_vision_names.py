"""Where every vision-tower parameter lives in an HF checkpoint: transformers'
`Qwen2_5_VisionTransformerPretrainedModel` names (`visual.*` in Qwen2.5-VL, `model.visual.*` in
ZAYA1-VL), under a prefix. Paths are relative to zaya_jax.model.vision.tower.VisionTower; the blocks are
stacked with a leading block axis, so a block's tensor fills index (i,)."""

from __future__ import annotations

from zaya_jax.checkpoints.hf_names import Entry, _Builder, _linear, _linear_in
from zaya_jax.model.vision.config import VisionConfig

_T = (lambda w: (w.T,), lambda x: x.T)


def vision_entries(cfg: VisionConfig, prefix: str) -> list[Entry]:
    d, n, h, i_size = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    wide, o = d * cfg.merge_unit, cfg.out_hidden_size
    b = _Builder()
    patch_shape = (d, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
    b.add(prefix + "patch_embed.proj.weight", patch_shape, ("patch_kernel",), (),
          (lambda w: (w.reshape(d, -1).T,), lambda x: x.T.reshape(patch_shape)))
    for i in range(cfg.depth):
        p, blk = f"{prefix}blocks.{i}.", ("blocks",)
        b.add(p + "norm1.weight", (d,), blk + ("norm1", "weight"), (i,))
        b.add(p + "norm2.weight", (d,), blk + ("norm2", "weight"), (i,))
        att = blk + ("attention",)
        b.add(p + "attn.qkv.weight", (3 * d, d), att + ("qkv_kernel",), (i,), _linear((3, n, h)))
        b.add(p + "attn.qkv.bias", (3 * d,), att + ("qkv_bias",), (i,),
              (lambda w: (w.reshape(3, n, h),), lambda x: x.reshape(-1)))
        b.add(p + "attn.proj.weight", (d, d), att + ("out_kernel",), (i,), _linear_in((n, h)))
        b.add(p + "attn.proj.bias", (d,), att + ("out_bias",), (i,))
        for name, shape in (("gate", (i_size, d)), ("up", (i_size, d)), ("down", (d, i_size))):
            b.add(p + f"mlp.{name}_proj.weight", shape, blk + ("mlp", name + "_kernel"), (i,), _T)
            b.add(p + f"mlp.{name}_proj.bias", shape[:1], blk + ("mlp", name + "_bias"), (i,))
    b.add(prefix + "merger.ln_q.weight", (d,), ("merger", "norm", "weight"))
    b.add(prefix + "merger.mlp.0.weight", (wide, wide), ("merger", "fc1_kernel"), (), _T)
    b.add(prefix + "merger.mlp.0.bias", (wide,), ("merger", "fc1_bias"))
    b.add(prefix + "merger.mlp.2.weight", (o, wide), ("merger", "fc2_kernel"), (), _T)
    b.add(prefix + "merger.mlp.2.bias", (o,), ("merger", "fc2_bias"))
    return b.entries
