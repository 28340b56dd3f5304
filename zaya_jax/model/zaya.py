"""The whole ZAYA1 forward pass.

Conventions: B batch, S seq, D hidden, V vocab, L decoder layers, E experts (+1 skip slot),
R router width. One decoder layer = CCA attention then MoE (ZAYA1-base: 40 layers = the 80
alternating sub-layers of Zyphra's code).

  stream = (embed[ids] + b_in) * s_in                      [B,S,D]  (fp32 if residual_in_fp32)
  router_state = 0                                         [B,S,R]
  for each layer (stacked parameters and layer types, run with lax.scan):
      a = CCA(RMSNorm(stream));        stream = ResScale_attn(a, stream)
                                       (full or sliding-window attention; zaya_jax.model.layer_types)
      m, router_state = MoE(RMSNorm(stream), router_state);  stream = ResScale_moe(m, stream)
  logits = RMSNorm(stream) @ embed^T                       [B,S,V]  fp32, tied, no soft-cap
                                     (bf16 operands, fp32 accumulation when dtype is bf16)
The router runs in fp32 and its state is carried in fp32 (zaya_jax.model.router).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.flash_attention import RESIDUAL_NAMES as FLASH_RESIDUAL_NAMES
from zaya_jax.config import ModelConfig
from zaya_jax.model.cca import CCA, QKV, CCACarry, continues_previous_token
from zaya_jax.model.kernels import attention_fn, moe_dispatch_fn
from zaya_jax.model.layer_types import LayerKinds, layer_flags, layer_kinds
from zaya_jax.model.moe import Gathered, MoE, MoEStats
from zaya_jax.model.moe_dispatch import EXPERT_OUTPUT_NAMES
from zaya_jax.model.norms import ResidualScaling, RMSNorm
from zaya_jax.model.params import constant, param
from zaya_jax.parallel.activations import constrain_tokens

# dots_no_batch_and_kernels: dots_no_batch, plus the outputs of the kernels it would recompute
# (the expert matmuls, the flash attention forward's output and logsumexp), as MaxText saves its
# MLP matmul outputs; the XLA attention path's probabilities stay recomputed.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_no_batch_and_kernels": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*EXPERT_OUTPUT_NAMES, *FLASH_RESIDUAL_NAMES)),
}


def tied_logits(hidden: jax.Array, embed: jax.Array, *, dtype: str) -> jax.Array:
    """hidden [..., D] final-normed, embed [V, D] -> logits [..., V] float32.

    Operands in the compute dtype, accumulated in fp32: at V = 262k this is the largest
    matmul of the model, and bf16 runs it at the bf16 rate (8x MI300X's fp32 rate)."""
    dt = jnp.dtype(dtype)
    return jnp.einsum("...d,vd->...v", hidden.astype(dt), embed.astype(dt), preferred_element_type=jnp.float32)


class LayerContext(NamedTuple):
    """What a layer needs besides its parameters and the carried streams (cos, sin and attention
    are that layer's type's: LayerKinds.for_layer)."""
    cos: jax.Array                  # [B,S,R_rot]
    sin: jax.Array                  # [B,S,R_rot]
    segment_ids: jax.Array | None   # [B,S]
    token_mask: jax.Array           # [B,S] bool, False on padding
    attention: Callable             # attention(q, k, v, segment_ids)
    dispatch: Callable
    dtype: jnp.dtype
    stream_dtype: jnp.dtype
    image_mask: jax.Array | None = None  # [B,S] bool: ZAYA1-VL's image positions (vision LoRA), or None


class RowGroup(NamedTuple):
    """One group of rows a layer step runs: its own CCA and attention (B rows, S tokens each)."""
    stream: jax.Array                # [B,S,D] residual stream entering the layer
    cos: jax.Array                   # [B,S,R_rot]
    sin: jax.Array                   # [B,S,R_rot]
    continues: jax.Array             # [B,S] bool: token t-1 feeds token t's convolutions and value shift
    attend: Callable                 # attend(q, k, v, cache) -> (o [B,S,N,H], cache)
    prev: CCACarry | None = None     # carry of the token before stream[:, 0] (None: each row starts there)


class StepOut(NamedTuple):
    streams: list[jax.Array]         # each group's [B,S,D] leaving the layer
    router_state: jax.Array          # [rows, tokens/rows, R] of the joined tokens
    cache: object                    # the last attend's cache
    qkv: list[QKV]                   # each group's q, k, v and per-token CCA carry
    stats: MoEStats


def join_groups(parts: list[jax.Array], rows: int) -> jax.Array:
    """Groups' [B_g,S_g,...] arrays as one [rows, sum B_g S_g / rows, ...] of their tokens in order
    (one group: as it is). rows: the batch axes' product on the current mesh (the MoE's shard_map
    splits dim 0 over them; each B_g is a multiple of it), 1 without one."""
    if len(parts) == 1:
        return parts[0]
    return jnp.concatenate([x.reshape(-1, *x.shape[2:]) for x in parts]).reshape(rows, -1, *parts[0].shape[2:])


def split_groups(joined: jax.Array, like: list[jax.Array]) -> list[jax.Array]:
    """join_groups' inverse: [rows, T/rows, ...] -> each group's [B_g,S_g,...] (`like`'s leading two)."""
    if len(like) == 1:
        return [joined]
    flat, out, at = joined.reshape(-1, *joined.shape[2:]), [], 0
    for x in like:
        b, c = x.shape[:2]
        out.append(flat[at:at + b * c].reshape(b, c, *joined.shape[2:]))
        at += b * c
    return out


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps, "embed")
        self.attention = CCA(cfg, rngs=rngs)
        self.attention_residual = ResidualScaling(d)
        self.post_attention_norm = RMSNorm(d, cfg.rms_norm_eps, "embed")
        self.moe = MoE(cfg, rngs=rngs)
        self.moe_residual = ResidualScaling(d)

    def __call__(self, stream: jax.Array, router_state: jax.Array, ctx: LayerContext
                 ) -> tuple[jax.Array, jax.Array, MoEStats]:
        """The training forward: `step` over one group of the whole batch, no cache."""
        b, s, _ = stream.shape
        continues = continues_previous_token(ctx.segment_ids if self.attention.isolate_documents else None, b, s)
        attend = lambda q, k, v, cache: (ctx.attention(q, k, v, ctx.segment_ids), cache)  # noqa: E731
        out = self.step([RowGroup(stream, ctx.cos, ctx.sin, continues, attend)], router_state, None,
                        token_mask=ctx.token_mask, dispatch=ctx.dispatch, dtype=ctx.dtype,
                        stream_dtype=ctx.stream_dtype, image_mask=ctx.image_mask)
        return out.streams[0], out.router_state, out.stats

    def step(self, groups: Sequence[RowGroup], router_state: jax.Array, cache, *, token_mask: jax.Array,
             dispatch: Callable | Gathered, dtype, stream_dtype, rows: int = 1, skip_masked: bool = False,
             image_mask: jax.Array | None = None) -> StepOut:
        """The one decoder-layer step that training, prefill and extension all run.

        Each group: RMSNorm, CCA's q/k/v from `prev`, attend (which reads and writes `cache`, threaded
        through the groups in order), output projection, residual, RMSNorm; then one MoE over every
        group's tokens joined (join_groups over `rows`) and each group's residual. router_state,
        token_mask: [rows, tokens/rows, ...] of the joined tokens; dispatch, skip_masked: MoE.__call__'s;
        image_mask: [B,S] (one group only) where the vision LoRA acts, or None."""
        if image_mask is not None and len(groups) != 1:
            raise ValueError("image_mask needs a single row group")
        streams, normed, qkvs = [], [], []
        for group in groups:
            with jax.named_scope("attention"):  # op-name scopes: profiles sum time per block
                qkv = self.attention.qkv(self.input_norm(group.stream, dtype), group.cos, group.sin,
                                         group.continues, group.prev, image_mask)
                o, cache = group.attend(qkv.q, qkv.k, qkv.v, cache)
                stream = self.attention_residual(self.attention.output(o, image_mask), group.stream, stream_dtype)
            streams.append(stream)
            qkvs.append(qkv)
            with jax.named_scope("moe"):
                normed.append(self.post_attention_norm(stream, dtype))
        with jax.named_scope("moe"):
            m, router_state, stats = self.moe(join_groups(normed, rows), router_state, token_mask, dispatch,
                                              image_mask, skip_masked=skip_masked)
            streams = [self.moe_residual(part, stream, stream_dtype)
                       for part, stream in zip(split_groups(m, streams), streams)]
        return StepOut(streams, router_state, cache, qkvs, stats)


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """[B,S] segment ids -> [B,S] positions restarting at 0 at every document start."""
    seq = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(seq), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


class ZayaLM(nnx.Module):
    """ZAYA1 causal LM. `model(input_ids)` -> logits [B,S,V]; `forward_with_stats` adds router stats."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        v, d = cfg.vocab_size, cfg.hidden_size
        embed_init = lambda k, s, dt: jax.random.normal(k, s, dt).at[cfg.pad_token_id].set(0) * cfg.init_std  # noqa
        self.embed = param(embed_init, rngs.params(), (v, d), ("vocab", "embed"))
        self.input_scale = constant(1.0, (d,), ("embed",))
        self.input_bias = constant(0.0, (d,), ("embed",))

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(layer_rngs):
            return DecoderLayer(cfg, rngs=layer_rngs)

        self.layers = make_layers(rngs.split(cfg.num_layers))
        self.final_norm = RMSNorm(d, cfg.rms_norm_eps, "embed")

    def __call__(self, input_ids: jax.Array, *, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        """input_ids: [B,S] int -> logits [B,S,V] float32."""
        return self.forward_with_stats(input_ids, segment_ids=segment_ids, positions=positions)[0]

    def forward_with_stats(self, input_ids, *, segment_ids=None, positions=None) -> tuple[jax.Array, MoEStats]:
        """-> logits [B,S,V] float32 and per-layer router stats (each field with a leading [L] axis)."""
        hidden, stats = self.hidden_states(input_ids, segment_ids=segment_ids, positions=positions)
        return self.logits(hidden), stats

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [..., D] final-normed -> [..., V] float32 (tied embedding, `tied_logits`)."""
        return tied_logits(hidden, self.embed[...], dtype=self.config.dtype)

    def hidden_states(self, input_ids, *, segment_ids=None, positions=None, rope_theta=None,
                      image_tokens: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, MoEStats]:
        """input_ids: [B,S] -> final-normed hidden [B,S,D] (compute dtype) and router stats.

        segment_ids: [B,S] packed document ids (0 = padding) or None; positions default to
        0..S-1, or restart per document when segment_ids are given. rope_theta overrides the
        config's full-layer base (curriculum phases change it; sliding layers keep theirs).
        image_tokens: ZAYA1-VL's (image_mask [B,S] bool, features [B,S,D]): the embedding at each
        image position is replaced by its feature (zaya_jax.model.vision.vl places them), those
        positions see each other both ways and the vision LoRA acts there.
        """
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        stream_dtype = jnp.float32 if cfg.residual_in_fp32 else dtype
        b, s = input_ids.shape
        if positions is None:
            positions = (positions_from_segments(segment_ids) if segment_ids is not None
                         else jnp.broadcast_to(jnp.arange(s), (b, s)))
        image_mask = None if image_tokens is None else image_tokens[0]
        kinds = layer_kinds(cfg, positions, attention_fn(cfg, bidirectional=image_mask), rope_theta)
        token_mask = segment_ids > 0 if segment_ids is not None else jnp.ones((b, s), bool)
        ctx = LayerContext(*kinds.full_rope, segment_ids, token_mask, kinds.attention, moe_dispatch_fn(cfg),
                           dtype, stream_dtype, image_mask)

        emb = jnp.take(self.embed[...], input_ids, axis=0)
        # torch.nn.Embedding(padding_idx=pad) as in Zyphra's and HF's code: looking up the pad
        # token sends no gradient to its row (the tied LM head still does)
        is_pad = (input_ids == cfg.pad_token_id)[..., None].astype(emb.dtype)
        emb = emb - is_pad * (emb - jax.lax.stop_gradient(emb))
        if image_tokens is not None:
            emb = jnp.where(image_mask[..., None], image_tokens[1].astype(emb.dtype), emb)
        stream = constrain_tokens(((emb + self.input_bias[...]) * self.input_scale[...]).astype(stream_dtype))
        router_state = jnp.zeros((b, s, cfg.router_hidden_size), jnp.float32)
        stream, stats = self._run_layers(stream, router_state, ctx, kinds)
        return self.final_norm(stream, dtype), stats

    def _run_layers(self, stream, router_state, ctx: LayerContext, kinds: LayerKinds
                    ) -> tuple[jax.Array, MoEStats]:
        cfg = self.config
        graphdef, layer_states = nnx.split(self.layers)

        def body(carry, xs):
            layer_state, sliding = xs
            layer = nnx.merge(graphdef, layer_state)
            cos, sin, attention = kinds.for_layer(sliding)
            stream, router_state, stats = layer(*carry, ctx._replace(cos=cos, sin=sin, attention=attention))
            return (constrain_tokens(stream), constrain_tokens(router_state)), stats

        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[cfg.remat])
        carry, xs = (stream, router_state), (layer_states, layer_flags(cfg))
        if cfg.scan_layers:
            (stream, _), stats = jax.lax.scan(body, carry, xs)
            return stream, stats
        # unstack (not x[i]): its gradient is one concatenate, not L zero-padded stacks summed
        leaves, treedef = jax.tree.flatten(xs)
        per_leaf = [jnp.unstack(leaf) for leaf in leaves]
        per_layer = []
        for i in range(cfg.num_layers):
            carry, layer_stats = body(carry, jax.tree.unflatten(treedef, [parts[i] for parts in per_leaf]))
            per_layer.append(layer_stats)
        return carry[0], jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
