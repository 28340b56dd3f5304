"""zaya_jax: a JAX/Flax reimplementation of Zyphra's ZAYA1 and the system that trains it.

Generation is `from zaya_jax.engine import generate` (`zaya_jax.generate` is the CLI module,
`python -m zaya_jax.generate`)."""

from zaya_jax.config import ModelConfig


def load_hf(path, dtype="float32", **overrides):
    """Reads an HF ZAYA checkpoint directory into a ZayaLM (see zaya_jax.checkpoints.hf_load)."""
    from zaya_jax.checkpoints.hf_load import load_hf as _load_hf
    return _load_hf(path, dtype=dtype, **overrides)


def save_hf(model, path, **options):
    """Writes a ZayaLM as an HF `ZayaForCausalLM` directory (see zaya_jax.checkpoints.hf_save)."""
    from zaya_jax.checkpoints.hf_save import save_hf as _save_hf
    return _save_hf(model, path, **options)


__all__ = ["ModelConfig", "load_hf", "save_hf"]
