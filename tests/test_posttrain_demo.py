"""The post-training demo: its prepared sources hold the generated tasks as the template encodes
them, and pretrain -> SFT -> DPO -> accuracy runs end to end through the CLIs (shrunk)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.run_all import json_output
from tests.fake_devices import xla_flags
from tests.train_helpers import REPO
from zaya_jax.data import chat_template, demo_posttrain, instruction_tasks
from zaya_jax.data.sources import heldout_count, open_sources, tokenizer_path
from zaya_jax.data.tokenizer import Tokenizer
from zaya_jax.evaluation.onpolicy_pairs import onpolicy_records, write_pairs

DEMO = {"cache_dir": "", "max_docs": 40, "vocab_size": 4096, "seed": 0}
TINY_MODEL = ["--config.model.hidden_size=32", "--config.model.num_layers=1", "--config.model.num_q_heads=4",
              "--config.model.num_kv_heads=2", "--config.model.head_dim=8", "--config.model.num_experts=2",
              "--config.model.moe_intermediate_size=32", "--config.model.router_hidden_size=8"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A small demo corpus (40 documents per source) and the post-training sources built on it."""
    root = tmp_path_factory.mktemp("demo_cache")
    demo_posttrain.build_posttrain_sources(root, max_docs=DEMO["max_docs"], progress=False)
    return root


def _data_config(source, cache):
    config = demo_posttrain.data_config(source, steps=2)
    config.demo.update(**{**DEMO, "cache_dir": str(cache)})
    return config


def test_the_heldout_fraction_takes_exactly_the_heldout_tasks():
    for max_docs in (0, 40):
        train, heldout = demo_posttrain.task_counts(max_docs)
        total = len(instruction_tasks.KINDS) * (train + heldout)
        assert heldout_count(total, demo_posttrain.HELDOUT_FRACTION) == len(instruction_tasks.KINDS) * heldout
    assert demo_posttrain.task_counts() == (1900, 100)


def test_chat_source_holds_the_tasks_and_its_heldout_part_is_the_heldout_questions(cache):
    config = _data_config("chat", cache)
    source = open_sources(config)["chat"]
    train_per_kind, heldout_per_kind = demo_posttrain.task_counts(DEMO["max_docs"])
    assert source.kind == "chat" and len(source.heldout) == 5 * heldout_per_kind == 5
    assert len(source.train) == 5 * train_per_kind
    tok = Tokenizer(tokenizer_path(config), bos_id=2, eos_id=1, pad_id=0)
    template = chat_template.ChatTemplate.load(chat_template.PLAIN)
    heldout = instruction_tasks.tasks("heldout", heldout_per_kind)
    train = instruction_tasks.tasks("train", train_per_kind)
    for split, tasks in ((source.heldout, heldout), (source.train, train)):
        for i in range(len(split)):
            ids, mask = split[i]
            task = tasks[i]
            prompt = chat_template.encode_prompt(template, tok, task.prompt_messages())
            # generation sees exactly the tokens training put before the answer
            np.testing.assert_array_equal(ids[:len(prompt)], prompt)
            assert not mask[:len(prompt)].any() and mask[len(prompt):].all()
            assert ids[-1] == tok.eos_id and tok.decode(ids[len(prompt):]) == task.answer
            assert task.question in tok.decode(prompt)


def test_preference_source_pairs_the_answer_with_its_near_miss(cache):
    config = _data_config("preference", cache)
    source = open_sources(config)["preference"]
    assert source.kind == "preference" and len(source.heldout) == 5
    tok = Tokenizer(tokenizer_path(config), bos_id=2, eos_id=1, pad_id=0)
    for i, task in enumerate(instruction_tasks.tasks("heldout", demo_posttrain.task_counts(DEMO["max_docs"])[1])):
        ids, part = source.heldout[i]
        prompt, chosen, rejected = (ids[part == p] for p in (0, 1, 2))
        assert task.question in tok.decode(prompt)
        assert (tok.decode(chosen), tok.decode(rejected)) == (task.answer, task.wrong)
        assert chosen[-1] == rejected[-1] == tok.eos_id


def test_the_corpus_cache_entry_is_unchanged_and_the_posttrain_one_beside_it(cache):
    names = sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))
    assert names[0] == "v1-py3.11-docs40-vocab4096-seed0".replace("3.11", "%d.%d" % sys.version_info[:2])
    assert names[1].startswith(names[0] + "-posttrain-v") and len(names) == 2


def test_onpolicy_pairs_reject_the_models_own_wrong_answers():
    tasks = instruction_tasks.tasks("train", 1)  # add, max, index, variable, length
    completions = [tasks[0].answer + ".", "1000", "", tasks[3].answer, " 77 \n"]
    only_wrong = onpolicy_records(tasks, completions, near_miss_for_correct=False)
    assert [(r["prompt"][0]["content"], r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in only_wrong] == [
        (tasks[1].question, tasks[1].answer, "1000"), (tasks[4].question, tasks[4].answer, "77")]
    assert tasks[4].answer != "77"
    topped_up = onpolicy_records(tasks, completions, near_miss_for_correct=True)
    assert [r["rejected"][0]["content"] for r in topped_up] == [tasks[0].wrong, "1000", tasks[3].wrong, "77"]
    assert all(r["chosen"][0]["content"] != r["rejected"][0]["content"] for r in topped_up)


def _run(args, cwd):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": REPO, "XLA_FLAGS": xla_flags(1, cheap_compile=False)})


def test_missing_start_checkpoint_names_the_command_that_makes_it(tmp_path):
    done = _run(["zaya_jax.train", "--config", os.path.join(REPO, "configs", "demo_dpo.py"),
                 "--workdir", str(tmp_path / "dpo")], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: train.init_from_checkpoint: no checkpoint at runs/demo_sft; train it first: "
        "python -m zaya_jax.train --config configs/demo_sft.py --workdir runs/demo_sft")


def test_missing_preference_pairs_name_the_command_that_makes_them(tmp_path):
    """demo_dpo's pairs are made by zaya_jax.preference_pairs from the SFT run, not by data.prepare."""
    done = _run(["zaya_jax.train", "--config", os.path.join(REPO, "configs", "demo_dpo.py"),
                 "--workdir", str(tmp_path / "dpo"), "--config.train.init_from_checkpoint="], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: data.sources.preference: data directory 'runs/demo_sft_pairs' does not exist; make it first: "
        "python -m zaya_jax.preference_pairs --checkpoint runs/demo_sft --output runs/demo_sft_pairs")


def _check_pairs_cli_and_write_pairs(tmp_path, pairs, cache):
    """The pairs CLI on the 2-step SFT model, whose answers are all blank (its turn is only newlines),
    so it makes no pair and says so; then `pairs` written by its library half from given answers."""
    done = _run(["zaya_jax.preference_pairs", "--checkpoint", str(tmp_path / "demo_sft"), "--output", str(pairs),
                 "--per_kind", "4", "--max_new_tokens", "3"], tmp_path)
    assert done.returncode == 2 and not pairs.exists(), done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].endswith(
        "no pairs from its answers to 20 training questions (every wrong answer was blank); train it further")
    tasks = instruction_tasks.tasks("train", 4)
    completions = [t.answer if i % 3 else "1000" for i, t in enumerate(tasks)]  # a third wrong
    records = onpolicy_records(tasks, completions, near_miss_for_correct=True)
    tok_path = tokenizer_path(_data_config("chat", cache))
    manifest = write_pairs(str(pairs), records, tokenizer_path=tok_path, template_path=chat_template.PLAIN,
                           ids=(2, 1, 0), made_from={"pairs": len(records)})
    assert manifest["num_pairs"] == len(tasks) == 20 and not os.path.exists(f"{pairs}.tmp")
    config = _data_config("preference", cache)
    config.sources.preference = str(pairs)
    prepared = open_sources(config)
    tok = Tokenizer(tok_path, bos_id=2, eos_id=1, pad_id=0)
    split = prepared["preference"]
    for i, task in enumerate(tasks[:len(split.train)]):
        ids, part = split.train[i]
        assert tok.decode(ids[part == 1]) == task.answer
        assert tok.decode(ids[part == 2]) == ("1000" if i % 3 == 0 else task.wrong)
    again = _run(["zaya_jax.preference_pairs", "--checkpoint", str(tmp_path / "demo_sft"), "--output", str(pairs)],
                 tmp_path)  # pairs are never overwritten
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1] == (
        f"error: --output {pairs} already exists; delete it or choose another directory")


def test_pretrain_sft_dpo_and_accuracy_end_to_end(cache, tmp_path):
    """The README's commands, every model shrunk and every stage 2 steps long."""
    common = [*TINY_MODEL, f"--config.data.demo.cache_dir={cache}", f"--config.data.demo.max_docs={DEMO['max_docs']}",
              "--config.train.steps=2", "--config.optimizer.warmup_steps=1", "--config.monitor.progress_bar=False",
              "--config.monitor.tensorboard=False"]
    # 2 pretraining steps stay in the first phase (RoPE base 1e4): the later stages start there too
    later = ["--config.data.phases[0].rope_theta=10000.0",
             "--config.eval.every_steps=2", "--config.eval.max_batches=1"]
    pairs = tmp_path / "demo_sft_pairs"
    stages = [("demo.py", "demo", None, []), ("demo_sft.py", "demo_sft", "demo", later),
              ("demo_dpo.py", "demo_dpo", "demo_sft", [*later, f"--config.data.sources.preference={pairs}"])]
    for config, workdir, previous, extra in stages:
        if config == "demo_dpo.py":
            _check_pairs_cli_and_write_pairs(tmp_path, pairs, cache)
        start = [f"--config.train.init_from_checkpoint={tmp_path / previous}"] if previous else []
        done = _run(["zaya_jax.train", "--config", os.path.join(REPO, "configs", config), "--workdir",
                     str(tmp_path / workdir), *common, *extra, *start], tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        if previous:
            assert f"weights of checkpoint 2 in {tmp_path / previous}/checkpoints" in done.stdout
    evals = [json.loads(line) for line in open(tmp_path / "demo_dpo" / "metrics.jsonl") if '"eval"' in line]
    assert {"eval/preference/reward_accuracy", "eval/preference/reward_margin"} <= set(evals[-1])
    sft_evals = [json.loads(line) for line in open(tmp_path / "demo_sft" / "metrics.jsonl") if '"eval"' in line]
    assert "eval/chat/loss" in sft_evals[-1]

    done = _run(["zaya_jax.evaluate_tasks", "--checkpoint", str(tmp_path / "demo_dpo"), "--per_kind", "2",
                 "--max_new_tokens", "3"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json_output(done.stdout)
    assert result["step"] == 2 and result["questions"] == 10
    assert sorted(result["accuracy_by_kind"]) == sorted(instruction_tasks.KINDS)
    assert all(len(examples) == 2 for examples in result["examples"].values())
    assert 0 <= result["accuracy"] <= 1
