"""What a user does after SFT and DPO, through the CLIs, on a tiny model: chat and preference JSONL
prepared with the chat template of a HF-style tokenizer_config.json -> SFT from HF weights
(train.init_from_hf) -> DPO from the SFT run (train.init_from_checkpoint) -> `convert to_hf` of the
DPO run, which transformers loads and which computes what `zaya_jax.infer.load_checkpoint` of the
run computes; `generate --chat` renders with the template the run recorded.

References: transformers' ZayaForCausalLM (the export), the HF weights the SFT run started from,
the template text as written to tokenizer_config.json.
"""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tokenizers

import zaya_jax
from tests.train_helpers import REPO, cli_env, run_train
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.infer.loading import load_checkpoint
from zaya_jax.model.build import create_model
from zaya_jax.train.checkpoint import checkpoint_dir, load_checkpoint_model, read_config

# ChatML-like, the model's turns inside generation tags, each ending with eos (the stop token).
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>{{ eos_token }}"
          "{% endgeneration %}\n{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CONFIG = """
import ml_collections
from zaya_jax.config_files import load_config_file

def get_config():
    config = load_config_file({tiny!r})
    config.model.update(layout="native", router_norm_eps=config.model.rms_norm_eps, residual_in_fp32=True)  # transformers' schema
    config.train.update(data="pipeline", steps=2, log_every_steps=1)
    config.optimizer.warmup_steps = 1
    config.checkpoint.every_steps = 0
    config.eval.every_steps = 0
    config.monitor.update(tensorboard=False, heatmap_every_steps=0)
    config.data = ml_collections.ConfigDict(dict(
        sources={{"train": {chat!r}}}, tokenizer={tokenizer!r}, pad_id=0, heldout_fraction=0.1, packing_bins=4,
        worker_count=0, worker_buffer_size=1, prefetch_buffer_size=2,
        phases=(dict(name="one", token_budget=2 * 8 * 64, seq_len=64, rope_theta=1e4, global_batch_size=8,
                     weights={{"train": 1.0}}),),
        eval=dict(seq_len=64, batch_size=8, max_batches=1)))
    return config
"""


def cli(module, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def question(i):
    return {"role": "user", "content": f"What is {i} plus {i}?"}


def answer(text):
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """{name: path} of the SFT run, the DPO run, its HF export, the HF start and the tokenizer dir."""
    root = tmp_path_factory.mktemp("posttrain")
    from zaya_jax.data import tokenizer
    corpus = [f"What is {i} plus {i}? It is {2 * i}. user assistant" for i in range(60)]
    path = tokenizer.train_bpe(corpus * 3, root / "tok" / "tokenizer.json", vocab_size=320)
    hf_tokenizer = tokenizers.Tokenizer.from_file(path)
    hf_tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    hf_tokenizer.save(path)
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "bos_token": "<bos>", "eos_token": "<eos>"}))
    with open(root / "chat.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [question(i), answer(f"It is {2 * i}.")]}) + "\n")
    with open(root / "pref.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": [question(i)], "chosen": [answer(f"It is {2 * i}.")],
                                "rejected": [answer(f"It is {2 * i + 1}.")]}) + "\n")
    for kind, source in (("chat", "chat.jsonl"), ("preference", "pref.jsonl")):  # the template beside the tokenizer
        done = cli("zaya_jax.data.prepare", "--kind", kind, "--input", root / source, "--format", "jsonl",
                   "--tokenizer", path, "--output", root / kind, "--quiet")
        assert done.returncode == 0, done.stderr[-3000:]
    config = root / "posttrain.py"
    config.write_text(CONFIG.format(tiny=os.path.join(REPO, "configs", "tiny.py"), chat=str(root / "chat"),
                                    tokenizer=path))
    start = create_model(model_config(load_config_file(config)), seed=3)
    zaya_jax.save_hf(start, root / "start_hf")

    sft = run_train(root / "sft", "--config.train.objective=sft", f"--config.train.init_from_hf={root / 'start_hf'}",
                    config=str(config))
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert f"start at step 0: HF weights {root / 'start_hf'}" in sft.stdout + sft.stderr
    dpo = run_train(root / "dpo", "--config.train.objective=dpo", f"--config.train.init_from_checkpoint={root / 'sft'}",
                    f"--config.data.sources.train={root / 'preference'}", config=str(config))
    assert dpo.returncode == 0, dpo.stderr[-3000:]
    assert "(train.init_from_checkpoint), a fresh optimizer" in dpo.stdout + dpo.stderr
    exported = cli("zaya_jax.convert", "to_hf", "--checkpoint", root / "dpo", "--out", root / "dpo_hf")
    assert exported.returncode == 0, exported.stderr[-3000:]
    return {"root": root, "sft": root / "sft", "dpo": root / "dpo", "dpo_hf": root / "dpo_hf",
            "start_hf": root / "start_hf", "tokenizer": root / "tok"}


def test_sft_then_dpo_then_export_loads_in_transformers(pipeline):
    import torch
    from transformers import ZayaForCausalLM
    ids = np.random.default_rng(0).integers(3, 322, (2, 24))
    dpo = load_checkpoint(pipeline["dpo"])
    hf = ZayaForCausalLM.from_pretrained(pipeline["dpo_hf"], torch_dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(dpo(ids)), expected, atol=2e-4, rtol=2e-4)
    # each stage trained: the DPO model is neither the SFT run's nor the HF start
    sft, _ = load_checkpoint_model(str(pipeline["sft"]))
    start = zaya_jax.load_hf(pipeline["start_hf"])
    for earlier in (sft, start):
        assert np.abs(np.asarray(earlier(ids)) - np.asarray(dpo(ids))).max() > 1e-4
