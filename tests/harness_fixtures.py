"""A tiny trained-tokenizer ZAYA model for the lm-evaluation-harness tests: a model-only checkpoint
whose config names its tokenizer (as a training run's does), its `convert to_hf` export, and task
YAMLs over local JSONL files (a multiple-choice, a generation and a rolling-perplexity task)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from zaya_jax.config import ModelConfig

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3, "To be or not to be, that is the question.",
         "2 + 3 = 5, 7 - 4 = 3, 6 + 1 = 7"] * 20
# native layout (what transformers implements), weights large enough that greedy choices are clear-cut
TINY_LM = ModelConfig(vocab_size=320, hidden_size=32, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8,
                      num_experts=4, moe_intermediate_size=16, router_hidden_size=8, rope_theta=10_000.0,
                      max_position_embeddings=128, rms_norm_eps=1e-5, router_norm_eps=1e-5, layout="native",
                      residual_in_fp32=True, init_std=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1)
MC = [{"question": "The quick brown", "choices": [" fox", " dog", " question"], "answer": 0},
      {"question": "To be or not", "choices": [" to be", " the fox", " 5"], "answer": 0},
      {"question": "2 + 3 =", "choices": [" 5", " 3", " lazy dog jumps"], "answer": 0},
      {"question": "that is the", "choices": [" question", " quick", " 7 - 4"], "answer": 0},
      {"question": "over the lazy", "choices": [" dog", " fox."], "answer": 0}]
GEN = [{"question": "The quick", "answer": "brown fox"}, {"question": "2 + 3", "answer": "= 5"},
       {"question": "To be or not to be, that", "answer": "is the question"}, {"question": "7", "answer": "- 4"}]
ROLLING = [{"text": "The quick brown fox jumps over the lazy dog. To be or not to be."},
           {"text": "2 + 3 = 5 " * 40}]  # longer than the 128-token window: several rolling windows


def task_yaml(name: str, data: Path, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}metadata:\n  version: 1.0\n")


TASK_BODIES = {
    "local_mc": (MC, 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
                     "doc_to_target: answer\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
    "local_gen": (GEN, 'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
                       'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 6\n  do_sample: false\n'
                       "metric_list:\n  - metric: exact_match\n"),
    "local_rolling": (ROLLING, 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                               "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"),
}


def write_tasks(directory: Path) -> Path:
    """The local tasks' JSONL files and YAMLs in `directory` (an --include_path)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, (rows, body) in TASK_BODIES.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (directory / f"{name}.yaml").write_text(task_yaml(name, data, body))
    return directory


def write_model(root: Path) -> tuple[Path, Path]:
    """-> (a model-only checkpoint whose config names its tokenizer, its HF export)."""
    from zaya_jax.convert.conversions import to_hf
    from zaya_jax.data.tokenizer import train_bpe
    from zaya_jax.model.build import create_model
    from zaya_jax.checkpoints.orbax_checkpoint import save_model
    from zaya_jax.checkpoints.model_parts import ModelParts
    tokenizer = train_bpe(TEXTS, root / "tokenizer" / "tokenizer.json", vocab_size=300)
    params, biases = ModelParts.arrays(create_model(TINY_LM, seed=0))
    save_model(str(root / "ckpt"), params, biases, {"model": dataclasses.asdict(TINY_LM), "data": {"tokenizer": tokenizer}})
    to_hf(str(root / "ckpt"), str(root / "hf"))
    return root / "ckpt", root / "hf"
