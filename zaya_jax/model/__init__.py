"""Pure model maths: norms, rope, CCA, router, MoE and its dispatch backends, the decoder (zaya.py)."""
