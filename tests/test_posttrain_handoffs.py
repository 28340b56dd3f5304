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
from zaya_jax.data.chat_template import encode_conversation, encode_prompt
from zaya_jax.data.tokenizer import Tokenizer
from zaya_jax.errors import UserError
from zaya_jax.infer.chat import chat_template_for
from zaya_jax.infer.loading import load_checkpoint
from zaya_jax.model.build import create_model
from zaya_jax.checkpoints.orbax_checkpoint import checkpoint_dir, load_checkpoint_model, read_config

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
    # what transformers' schema holds
    config.model.update(layout="native", router_norm_eps=config.model.rms_norm_eps, residual_in_fp32=True)
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


@pytest.mark.torch_reference
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


def test_init_from_hf_starts_the_run_from_those_weights(pipeline, tmp_path):
    """The state the Trainer starts with (step 0, before any step) holds the HF start's parameters and
    balancing biases exactly: a run that read the HF weights and then trained from a fresh random
    init (which the logs and the SFT run's success cannot tell apart) fails here."""
    import jax
    from zaya_jax.train.loop import Trainer
    from zaya_jax.checkpoints.model_parts import ModelParts

    config = load_config_file(pipeline["root"] / "posttrain.py")
    config.train.update(objective="sft", init_from_hf=str(pipeline["start_hf"]))
    trainer = Trainer(config, str(tmp_path / "run"))
    try:
        assert int(jax.device_get(trainer.state.step)) == 0
        state_params = jax.device_get(trainer.state.params)
        state_biases = np.asarray(jax.device_get(trainer.state.biases))
    finally:
        trainer.close()
    params, biases = ModelParts.arrays(zaya_jax.load_hf(pipeline["start_hf"]))
    expected = jax.tree_util.tree_leaves_with_path(jax.device_get(params))
    got = dict(jax.tree_util.tree_leaves_with_path(state_params))
    assert len(got) == len(expected) > 0
    for path, value in expected:
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(value), err_msg=jax.tree_util.keystr(path))
    np.testing.assert_array_equal(state_biases, np.asarray(biases))
    fresh = create_model(model_config(config), seed=config.train.seed)  # what a fresh init would hold instead
    fresh_params, _ = ModelParts.arrays(fresh)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(fresh_params), jax.tree.leaves(params)))


@pytest.mark.torch_reference
def test_export_carries_the_tokenizer_and_chat_template_transformers_encodes_with(pipeline):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(pipeline["dpo_hf"])
    ours = Tokenizer(pipeline["tokenizer"] / "tokenizer.json", bos_id=2, eos_id=1, pad_id=0)
    template = chat_template_for(hf=pipeline["tokenizer"])
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (2, 1, 0)
    text = "What is 12 plus 12? It is 24."
    assert hf.encode(text, add_special_tokens=False) == ours.encode_pieces([text])[0]
    # the ids training saw and `generate --chat` sends: bos first, though the template renders none
    prompt = [question(12)]
    assert hf.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"] == \
        encode_prompt(template, ours, prompt).tolist()
    conversation = [question(12), answer("It is 24.")]
    assert (hf.apply_chat_template(conversation)["input_ids"]
            == encode_conversation(template, ours, conversation)[0].tolist())
    # transformers' generate stops where `generate --chat` does: at <|im_end|>, which ends a turn before eos
    from transformers import GenerationConfig
    im_end = ours.encode("<|im_end|>")
    assert len(im_end) == 1
    assert GenerationConfig.from_pretrained(pipeline["dpo_hf"]).eos_token_id == sorted([1, *im_end])


def test_export_of_a_run_without_a_tokenizer_says_so(tmp_path):
    cfg = model_config(load_config_file(os.path.join(REPO, "configs", "tiny.py")))
    model = create_model(cfg.replace(layout="native", router_norm_eps=cfg.rms_norm_eps, residual_in_fp32=True), seed=0)
    zaya_jax.save_hf(model, tmp_path / "hf")
    assert cli("zaya_jax.convert", "to_orbax", "--hf", tmp_path / "hf", "--out", tmp_path / "orbax").returncode == 0
    done = cli("zaya_jax.convert", "to_hf", "--checkpoint", tmp_path / "orbax", "--out", tmp_path / "again")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "note: no tokenizer written" in done.stderr and "pass --tokenizer FILE" in done.stderr
    assert not (tmp_path / "again" / "tokenizer.json").exists()


def test_task_answering_renders_with_the_recorded_template(pipeline, tmp_path, monkeypatch):
    from zaya_jax.data.chat_template import PLAIN
    from zaya_jax.evaluation.answering import run_template
    from zaya_jax.evaluation.onpolicy_pairs import template_file
    assert run_template(str(pipeline["dpo"]), None).source == CHATML
    assert template_file(str(pipeline["dpo"]), None).path == str(pipeline["tokenizer"] / "tokenizer_config.json")
    assert run_template(str(pipeline["dpo"]), PLAIN).path == PLAIN  # --chat_template overrides
    moved = tmp_path / "tok"
    moved.mkdir()
    (moved / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML + " "}))
    record = read_config(checkpoint_dir(str(pipeline["dpo"]))).chat_template.to_dict()
    record["path"] = str(moved / "tokenizer_config.json")  # a run whose template file changed since
    from zaya_jax.data.chat_template import ChatTemplate
    monkeypatch.setattr("zaya_jax.evaluation.answering.checkpoint_chat_template", lambda _: ChatTemplate.from_record(record))
    with pytest.raises(UserError, match="is gone or changed since; pass --chat_template FILE"):
        template_file(str(pipeline["dpo"]), None)


def test_runs_record_the_chat_template_of_their_sources(pipeline):
    for run in ("sft", "dpo"):
        record = read_config(checkpoint_dir(str(pipeline[run]))).chat_template
        assert record.source == CHATML and record.sha256 == hashlib.sha256(CHATML.encode()).hexdigest()
        assert record.path == str(pipeline["tokenizer"] / "tokenizer_config.json")


@pytest.mark.torch_reference
def test_generate_chat_renders_with_the_recorded_template(pipeline):
    """The reply equals transformers' greedy generation from the export, on the prompt transformers
    renders from tokenizer_config.json's template."""
    import torch
    from transformers import ZayaForCausalLM
    from transformers.utils.chat_template_utils import render_jinja_template
    messages = [question(7)]
    (text,), _ = render_jinja_template(conversations=[messages], chat_template=CHATML, add_generation_prompt=True,
                                       bos_token="<bos>", eos_token="<eos>")
    hf_tokenizer = tokenizers.Tokenizer.from_file(str(pipeline["tokenizer"] / "tokenizer.json"))
    prompt = [2] + hf_tokenizer.encode(text, add_special_tokens=False).ids  # the model's bos first
    recorded = chat_template_for(checkpoint=str(pipeline["dpo"]))  # what --chat renders with
    tokenizer = Tokenizer(pipeline["tokenizer"] / "tokenizer.json", bos_id=2, eos_id=1, pad_id=0)
    assert encode_prompt(recorded, tokenizer, messages).tolist() == prompt
    hf = ZayaForCausalLM.from_pretrained(pipeline["dpo_hf"], torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.as_tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=1,
                          pad_token_id=0)[0, len(prompt):].tolist()
    expected = hf_tokenizer.decode(out[:out.index(1)] if 1 in out else out, skip_special_tokens=True)
    done = cli("zaya_jax.generate", "--checkpoint", pipeline["dpo"], "--chat", messages[0]["content"],
               "--max_new_tokens", 6)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == expected + "\n"


def test_chat_without_a_template_is_named(pipeline, tmp_path):
    from zaya_jax.data.chat_template import PLAIN
    from zaya_jax.checkpoints.orbax_checkpoint import config_json, save_model
    from zaya_jax.checkpoints.model_parts import ModelParts
    config = load_config_file(os.path.join(REPO, "configs", "tiny.py"))
    save_model(str(tmp_path / "lm"), *ModelParts.arrays(create_model(model_config(config), seed=0)),
               config_json(config))  # a run on text: no template recorded
    with pytest.raises(UserError, match=r"the run recorded no chat template .*; pass --chat_template FILE"):
        chat_template_for(checkpoint=str(tmp_path / "lm"))
    assert chat_template_for(checkpoint=str(tmp_path / "lm"), override=PLAIN).path == PLAIN
    done = cli("zaya_jax.generate", "--hf", pipeline["start_hf"], "--tokenizer",
               pipeline["tokenizer"] / "tokenizer.json", "--chat", "hi")
    assert done.returncode == 2 and done.stderr == (
        f"error: --hf {pipeline['start_hf']}: no tokenizer_config.json with a chat template in it; pass "
        "--chat_template FILE (a .jinja file or a tokenizer_config.json with a \"chat_template\")\n")


def test_no_template_is_recorded_when_sources_disagree_or_the_file_changed(tmp_path, caplog):
    from zaya_jax.data.chat_template import ChatTemplate
    from zaya_jax.data.sources import PreparedSource, chat_template_of
    files = {name: tmp_path / f"{name}.jinja" for name in ("a", "b")}
    for name, path in files.items():
        path.write_text(f"{{% for m in messages %}}{name}: {{{{ m['content'] }}}}\n{{% endfor %}}")
    infos = {name: {"path": str(path), "sha256": ChatTemplate.load(path).sha256} for name, path in files.items()}

    def sources(**templates):
        return {name: PreparedSource(name, "unused", {"chat_template": info}, None, None)
                for name, info in templates.items()}

    assert chat_template_of(sources(x=infos["a"], y=None)) == ChatTemplate.load(files["a"]).record()
    assert chat_template_of(sources(x=None)) is None
    assert chat_template_of(sources(x=infos["a"], y=infos["b"])) is None
    assert "data.sources.x and data.sources.y were prepared with different chat templates" in caplog.text
    recorded = ChatTemplate.load(files["a"]).record()  # what a manifest holds now: the text itself
    files["a"].write_text("{{ messages }}")
    assert chat_template_of(sources(x=infos["a"])) is None
    assert f"data.sources.x was prepared with the chat template {files['a']}, which has changed since" in caplog.text
    assert chat_template_of(sources(x=recorded)) == recorded  # its file changed: the recorded text is kept


def test_a_cached_source_whose_template_file_is_gone_records_the_bundled_template(tmp_path):
    """A demo corpus prepared from another checkout (its manifest, written before manifests held the
    text, names that checkout's plain.jinja, since deleted): the bundled template of that digest is
    recorded, so the run's chat endpoint and `generate --chat` still work (before: none was recorded)."""
    from zaya_jax.data.chat_template import PLAIN, ChatTemplate
    from zaya_jax.data.sources import PreparedSource, chat_template_of
    plain = ChatTemplate.load(PLAIN)
    gone = {"path": str(tmp_path / "deleted_checkout" / "plain.jinja"), "sha256": plain.sha256}
    assert chat_template_of({"chat": PreparedSource("chat", "unused", {"chat_template": gone}, None, None)}) == \
        plain.record()


def test_messages_files_are_read_or_named(tmp_path):
    from zaya_jax.infer.chat import read_messages
    conversation = [{"role": "system", "content": "Be brief."}, question(2), answer("It is 4."), question(3)]
    (tmp_path / "chat.json").write_text(json.dumps(conversation))
    assert read_messages(messages_file=str(tmp_path / "chat.json")) == conversation
    assert read_messages("hi") == [{"role": "user", "content": "hi"}]
    for content, message in (("{", "not valid JSON"), (json.dumps([{"role": "bot", "content": "x"}]),
                                                        r"messages\[0\]: role 'bot' is not one of")):
        (tmp_path / "bad.json").write_text(content)
        with pytest.raises(UserError, match=f"--messages {tmp_path / 'bad.json'}: .*{message}"):
            read_messages(messages_file=str(tmp_path / "bad.json"))
    with pytest.raises(UserError, match="cannot read it"):
        read_messages(messages_file=str(tmp_path / "missing.json"))


def test_train_steps_extends_a_curriculum_written_as_plain_dicts(tmp_path):
    """`--config.train.steps=N` past the curriculum (training a finished run on) with phases written
    as a tuple of dicts, as this test's config and most hand-written ones are."""
    from zaya_jax.train.data import training_data_config
    from zaya_jax.train.settings import settings_from_config
    config_file = tmp_path / "posttrain.py"
    config_file.write_text(CONFIG.format(tiny=os.path.join(REPO, "configs", "tiny.py"), chat="unused",
                                         tokenizer="unused"))
    config = load_config_file(config_file)
    assert isinstance(config.data.phases[0], dict)
    config.train.steps = 5  # the phase holds 2 batches of 8 x 64
    data = training_data_config(config, settings_from_config(config))
    assert data.phases[0]["token_budget"] == 5 * 8 * 64 and config.data.phases[0]["token_budget"] == 2 * 8 * 64
