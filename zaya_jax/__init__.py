"""zaya_jax: a JAX/Flax reimplementation of Zyphra's ZAYA1 and the system that trains it."""

from zaya_jax.config import ModelConfig


def load_hf(path, dtype="float32", **overrides):
    """Reads an HF ZAYA checkpoint directory into a ZayaLM (see zaya_jax.checkpoints.hf_load)."""
    from zaya_jax.checkpoints.hf_load import load_hf as _load_hf
    return _load_hf(path, dtype=dtype, **overrides)


def save_hf(model, path, **options):
    """Writes a ZayaLM as an HF `ZayaForCausalLM` directory (see zaya_jax.checkpoints.hf_save)."""
    from zaya_jax.checkpoints.hf_save import save_hf as _save_hf
    return _save_hf(model, path, **options)


def generate(model, prompt_ids, max_new_tokens, **options):
    """New token ids after each prompt, [B, max_new_tokens]: one static batch (zaya_jax.infer.generate),
    or with slots=N the serving engine's continuous batching (zaya_jax.engine.batch.generate)."""
    from zaya_jax.engine.batch import generate as _generate
    return _generate(model, prompt_ids, max_new_tokens, **options)


__all__ = ["ModelConfig", "generate", "load_hf", "save_hf"]
