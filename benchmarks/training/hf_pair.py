"""configs/bench_small.py, and HF transformers' ZayaForCausalLM and our ZayaLM with the same (HF
random-init) weights, for the benchmarks that compare the two on one CPU."""

from __future__ import annotations

import os

from typing import TYPE_CHECKING

import ml_collections

from benchmarks.common import REPO

from zaya_jax.config import ModelConfig
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.checkpoints.hf_config import hf_config_from_model
from zaya_jax.checkpoints.hf_load import model_from_tensors
from zaya_jax.model.zaya import ZayaLM

if TYPE_CHECKING:
    from transformers import ZayaForCausalLM


def bench_small(moe_backend: str = "auto") -> tuple[ml_collections.ConfigDict, ModelConfig]:
    """-> configs/bench_small.py and its ModelConfig with `moe_backend`."""
    config = load_config_file(os.path.join(REPO, "configs", "bench_small.py"))
    return config, model_config(config).replace(moe_backend=moe_backend)


def same_weights_pair(cfg: ModelConfig, torch_threads: int, seed: int = 0) -> tuple[ZayaForCausalLM, ZayaLM]:
    """-> (HF model in train mode, ours) built from one torch initialisation of `cfg` (native
    layout); ours keeps cfg's MoE backend. Imports torch and transformers here, so that bench_small
    works on a stack without them (Python 3.12's)."""
    import torch
    from transformers import ZayaConfig, ZayaForCausalLM

    torch.manual_seed(seed)
    torch.set_num_threads(torch_threads)
    hf = ZayaForCausalLM(ZayaConfig(**hf_config_from_model(cfg, "native"))).train()
    tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    return hf, model_from_tensors(hf.config.to_dict(), set(tensors), tensors.__getitem__, "bench",
                                  moe_backend=cfg.moe_backend)
