"""The on-disk formats every layer above reads and writes: a run's Orbax checkpoints
(orbax_checkpoint: read, write and restore the model; integrity and sealing: the manifest committed
with each step; carried_tokenizer: the tokenizer file a step carries; model_parts: a model split into
the arrays a checkpoint holds) and HF safetensors directories (hf_load, hf_save, hf_vl and their
names, config, quantized tensors and the quantized weight types of quantize)."""
