"""Data: tokenizers, corpus preparation, the Grain curriculum pipeline and the demo corpus.

    from zaya_jax.data import build_pipeline, demo_data_config
    pipeline = build_pipeline(demo_data_config(), process_index=0, process_count=1, seed=0)
    batch = next(pipeline)          # inputs/targets/segment_ids/positions/loss_mask [B, L]
    pipeline.phase.seq_len, pipeline.phase.rope_theta

Names are imported lazily so the CLIs (prepare, train_tokenizer) start without Grain.
"""

import importlib

_EXPORTS = {
    "build_pipeline": "pipeline", "DataPipeline": "pipeline",
    "build_eval_batches": "evaluation",
    "PhaseInfo": "curriculum", "parse_phases": "curriculum",
    "demo_data_config": "curriculum", "zaya1_base_data_config": "curriculum",
    "Tokenizer": "tokenizer", "train_bpe": "tokenizer",
    "prepare_dataset": "prepare",
    "build_demo_corpus": "demo_corpus",
    "tokenizer_path": "sources",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
