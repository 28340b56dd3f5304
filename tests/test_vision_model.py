"""Proof for ZAYA1-VL's whole model: logits and every parameter's gradient, fp32, random weights,
against a PyTorch reference assembled from transformers 5.24's released parts, as transformers'
main-branch `Zaya1VLForConditionalGeneration` computes (models/zaya1_vl/modeling_zaya1_vl.py):

* the vision tower: `Qwen2_5_VisionTransformerPretrainedModel` (itself proven in test_vision_tower);
* placement: `inputs_embeds.masked_scatter(image positions, image tokens)` over the batch in order;
* the text model: `ZayaForCausalLM` on those embeddings, with
  - the vision LoRA written here from the reference: forward hooks add `(x A^T B^T) * image_mask` to
    q_proj, k_proj, v_proj_current, v_proj_delayed (whose shifted output carries it one token on)
    and o_proj, and the experts run `gate_up + (x A^T B^T) * m`, `down + (h A^T B^T) * m`;
  - the mask: each layer's causal (or sliding) mask with every image-image pair unmasked.
Two examples (one image; two images of other shapes), layers sliding, full, sliding (window 4, so the
window cuts through an image), and every LoRA matrix random, B included. The reference with the LoRA
removed, or with causal image attention, differs from it (so both are exercised); the logits of
text-only inputs are exactly the text model's.
"""

import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.hf_reference import TINY_HF, jax_from_hf, make_hf_model, make_hf_vision_tower
from zaya_jax.checkpoints.hf_load import _lookup
from zaya_jax.checkpoints.hf_vl import vl_entries, vl_model_from_tensors
from zaya_jax.model.vision.layout import patch_layout
from zaya_jax.model.vision.vl import ImageBatch

pytestmark = pytest.mark.torch_reference

TEXT = dict(TINY_HF, num_hidden_layers=3, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
            sliding_window=4, experts_implementation="eager",
            rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
                             "hybrid_sliding": {"rope_type": "default", "rope_theta": 500.0,
                                                "partial_rotary_factor": 0.5}})
IMAGE, START, END = 90, 91, 92
R_ATTN, R_MLP = 2, 3
GRIDS = [[(1, 6, 8)], [(1, 4, 4), (1, 2, 6)]]   # example 0: 12 image tokens; example 1: 4 + 3
SEQ = 26


def _ids(rng) -> np.ndarray:
    rows = []
    for grids in GRIDS:
        row = [2, *rng.integers(3, 90, 2)]
        for t, h, w in grids:
            row += [START] + [IMAGE] * (t * h * w // 4) + [END] + list(rng.integers(3, 90, 2))
        rows.append(row + list(rng.integers(3, 90, SEQ - len(row))))
    return np.asarray(rows)


def _lora_tensors(cfg, gen) -> dict:
    """transformers' zaya1_vl LoRA tensors (names and shapes as its modules create them), random."""
    import torch

    d, n, k, h, e, i = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                        cfg.num_experts, cfg.moe_intermediate_size)
    shapes = {}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.language_model.layers.{layer}."
        for name, out in (("q", n * h), ("k", k * h), ("v_current", k * h // 2), ("v_delayed", k * h // 2)):
            shapes[f"{p}self_attn.qkv_proj.{name}_lora_a.weight"] = (R_ATTN, d)
            shapes[f"{p}self_attn.qkv_proj.{name}_lora_b.weight"] = (out, R_ATTN)
        shapes[f"{p}self_attn.o_lora_a.weight"] = (R_ATTN, n * h)
        shapes[f"{p}self_attn.o_lora_b.weight"] = (d, R_ATTN)
        shapes[f"{p}mlp.experts.lora_gate_up_proj_a"] = (e, R_MLP, d)
        shapes[f"{p}mlp.experts.lora_gate_up_proj_b"] = (e, 2 * i, R_MLP)
        shapes[f"{p}mlp.experts.lora_down_proj_a"] = (e, R_MLP, i)
        shapes[f"{p}mlp.experts.lora_down_proj_b"] = (e, d, R_MLP)
    return {name: (0.4 * torch.randn(shape, generator=gen)).requires_grad_() for name, shape in shapes.items()}


def _vl_name(text_name: str) -> str:
    """A ZayaForCausalLM tensor's name inside a zaya1_vl checkpoint (the reference's module names)."""
    name = text_name.replace("model.", "model.language_model.", 1)
    return name.replace("language_model.norm.", "language_model.final_norm.").replace(
        "router_mlp.norm.", "router_mlp.rmsnorm_eda.")


@pytest.fixture(scope="module")
def case():
    import torch

    text = make_hf_model(seed=3, **TEXT)
    text.config._attn_implementation = "eager"
    vision = make_hf_vision_tower(out_hidden_size=TINY_HF["hidden_size"])
    lora = _lora_tensors(text.config, torch.Generator().manual_seed(5))
    rng = np.random.default_rng(4)
    ids = _ids(rng)
    grids = [g for example in GRIDS for g in example]
    patches = rng.normal(size=(sum(t * h * w for t, h, w in grids), vision.config.in_channels * 16)).astype(np.float32)
    cotangent = rng.normal(size=(*ids.shape, TINY_HF["vocab_size"])).astype(np.float32)
    return text, vision, lora, ids, grids, patches, cotangent


def _experts_with_lora(layer: int, lora: dict, image_mask):
    """ZayaExperts.forward plus the reference's expert LoRA at image positions (top-1 routing)."""
    import torch

    p = f"model.language_model.layers.{layer}.mlp.experts.lora_"
    a, b, a2, b2 = (lora[p + n] for n in ("gate_up_proj_a", "gate_up_proj_b", "down_proj_a", "down_proj_b"))

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        flat = image_mask.reshape(-1, 1).to(hidden.dtype)
        for e in range(self.num_experts):
            rows = (top_k_index[:, 0] == e).nonzero()[:, 0]
            x, m = hidden[rows], flat[rows]
            gate, up = (x @ self.gate_up_proj[e].T + (x @ a[e].T @ b[e].T) * m).chunk(2, dim=-1)
            h = self.act_fn(gate) * up
            y = h @ self.down_proj[e].T + (h @ a2[e].T @ b2[e].T) * m
            out.index_add_(0, rows, y * top_k_weights[rows, 0, None])
        return out
    return forward


def _reference_logits(text, vision, lora, ids, grids, patches, *, with_lora=True, bidirectional=True):
    import torch

    ids_t = torch.as_tensor(ids)
    tokens = vision(torch.as_tensor(patches), grid_thw=torch.as_tensor(grids)).pooler_output
    image = ids_t == IMAGE
    embeds = text.model.embed_tokens(ids_t)
    embeds = embeds.masked_scatter(image[..., None].expand_as(embeds), tokens)
    s = ids.shape[1]
    q, kk = torch.arange(s)[:, None], torch.arange(s)[None, :]
    both = image[:, None, :, None] & image[:, None, None, :] if bidirectional else torch.zeros(1, 1, s, s, dtype=bool)
    window = text.config.sliding_window
    masks = {kind: torch.where((visible[None, None] | both), 0.0, torch.finfo(torch.float32).min)
             for kind, visible in (("hybrid", kk <= q), ("hybrid_sliding", (kk <= q) & (kk > q - window)))}
    masks["conv"] = None
    handles, m = [], image[..., None].float()
    for i, layer in enumerate(text.model.layers if with_lora else []):
        proj, p = layer.self_attn.qkv_proj, f"model.language_model.layers.{i}.self_attn."
        pairs = [(proj.q_proj, "qkv_proj.q"), (proj.k_proj, "qkv_proj.k"), (proj.v_proj_current, "qkv_proj.v_current"),
                 (proj.v_proj_delayed, "qkv_proj.v_delayed"), (layer.self_attn.o_proj, "o")]
        for module, name in pairs:
            a, b = lora[f"{p}{name}_lora_a.weight"], lora[f"{p}{name}_lora_b.weight"]

            def hook(module, inputs, out, a=a, b=b):
                x = inputs[0]
                return out if x.shape[1] != s else out + (x @ a.T @ b.T) * m  # not the zero start state
            handles.append(module.register_forward_hook(hook))
        layer.mlp.experts.forward = types.MethodType(_experts_with_lora(i, lora, image), layer.mlp.experts)
    try:
        return text(inputs_embeds=embeds, attention_mask=masks).logits
    finally:
        for h in handles:
            h.remove()
        for layer in text.model.layers:
            layer.mlp.experts.__dict__.pop("forward", None)


def _ours(text, vision, lora):
    state = {_vl_name(k): v.detach().numpy() for k, v in text.state_dict().items() if k != "lm_head.weight"}
    state |= {"model.visual." + k: v.detach().numpy() for k, v in vision.state_dict().items()}
    state |= {k: v.detach().numpy() for k, v in lora.items()}
    hf = {"model_type": "zaya1_vl", "image_token_id": IMAGE, "vision_start_token_id": START,
          "vision_end_token_id": END, "vision_config": vision.config.to_dict(),
          "text_config": {**text.config.to_dict(), "model_type": "zaya1_vl_text", "vision_lora": True,
                          "vision_lora_rank_attn": R_ATTN, "vision_lora_rank_mlp": R_MLP}}
    return vl_model_from_tensors(hf, set(state), state.__getitem__, "hf-in-memory", moe_backend="dense")


def _image_batch(model, grids_per_example, patches) -> ImageBatch:
    cfg, pad, rows, start = model.vision.config, 48, [], 0
    for grids in grids_per_example:
        n = sum(t * h * w for t, h, w in grids)
        lay = patch_layout(grids, cfg, pad_to=pad)
        rows.append((np.pad(patches[start:start + n], ((0, pad - n), (0, 0))), *lay[:3]))
        start += n
    return ImageBatch(*(jnp.asarray(np.stack(parts)) for parts in zip(*rows)))


def test_logits_and_every_gradient_equal_the_reference(case):
    text, vision, lora, ids, grids, patches, cotangent = case
    ref = _reference_logits(text, vision, lora, ids, grids, patches)
    model = _ours(text, vision, lora)
    images = _image_batch(model, GRIDS, patches)

    @nnx.jit
    def logits_and_grads(model):
        def loss(model):
            logits = model(jnp.asarray(ids), images)
            return jnp.sum(logits * cotangent), logits
        return nnx.grad(loss, has_aux=True)(model)

    grads, logits = logits_and_grads(model)
    np.testing.assert_allclose(np.asarray(logits), ref.detach().numpy(), rtol=1e-4, atol=1e-4)

    for variant in (dict(with_lora=False), dict(bidirectional=False)):  # both features change the logits
        other = _reference_logits(text, vision, lora, ids, grids, patches, **variant).detach().numpy()
        assert np.abs(other - ref.detach().numpy()).max() > 1e-2, variant

    import torch
    params = dict(text.named_parameters()) | {"model.visual." + k: v for k, v in vision.named_parameters()}
    for p in params.values():
        p.grad = None
    for t in lora.values():
        t.grad = None
    (ref * torch.as_tensor(cotangent)).sum().backward()
    theirs = {_vl_name(k) if not k.startswith("model.visual.") else k: v.grad.numpy()
              for k, v in params.items()} | {k: v.grad.numpy() for k, v in lora.items()}

    grads = nnx.to_pure_dict(grads)
    entries = vl_entries(model.text.config, model.vision.config)
    checked = 0
    for entry in entries:
        if entry.hf_name not in theirs:  # balancing biases: buffers, no gradient
            continue
        ours = entry.to_hf(*(np.asarray(_lookup(grads, path)[index]) for path, index in entry.targets))
        ref_grad = theirs[entry.hf_name]
        np.testing.assert_allclose(ours, ref_grad, rtol=5e-4, atol=5e-4 * max(np.abs(ref_grad).max(), 1e-6),
                                   err_msg=entry.hf_name)
        checked += 1
    assert checked == len(theirs)  # every parameter (the tied head's gradient is the embedding's)


def test_text_only_inputs_give_exactly_the_text_model(case):
    text, vision, lora, ids, *_ = case
    model = _ours(text, vision, lora)
    plain = jax_from_hf(text, moe_backend="dense")
    text_ids = jnp.asarray(np.where(ids >= 90, 5, ids))
    np.testing.assert_array_equal(np.asarray(model(text_ids)), np.asarray(plain(text_ids)))


def test_export_reads_back_with_the_reference_names_and_a_bad_write_leaves_nothing(case, tmp_path, monkeypatch):
    from zaya_jax.checkpoints import hf_vl
    from zaya_jax.checkpoints.safetensors_io import TensorReader

    text, vision, lora, ids, grids, patches, _ = case
    model = _ours(text, vision, lora)
    lines = []
    out = hf_vl.save_vl_hf(model, tmp_path / "vl", report=lines.append)
    expected = {_vl_name(k) for k in text.state_dict() if k != "lm_head.weight"}
    expected |= {"model.visual." + k for k in vision.state_dict()} | set(lora)
    assert TensorReader(out).names() == expected and "probe batch with an image" in lines[0]
    images = _image_batch(model, GRIDS, patches)
    again = hf_vl.load_vl_hf(out, moe_backend="dense")
    ids = jnp.asarray(ids)
    np.testing.assert_array_equal(np.asarray(again(ids, images)), np.asarray(model(ids, images)))

    honest = hf_vl.vl_tensors

    def corrupted(model):  # one LoRA matrix written wrong: only an image probe can see it
        for name, tensor in honest(model):
            yield name, tensor * 1.5 if "q_lora_b" in name else tensor
    monkeypatch.setattr(hf_vl, "vl_tensors", corrupted)
    with pytest.raises(hf_vl.ExportMismatch, match="nothing was written"):
        hf_vl.save_vl_hf(model, tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["vl"]
