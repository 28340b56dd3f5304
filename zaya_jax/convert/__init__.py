"""The conversions between HF safetensors directories and training checkpoints: `python -m zaya_jax.convert`
(conversions.py); the formats themselves are zaya_jax.checkpoints (hf_load, hf_save, orbax_checkpoint)."""
