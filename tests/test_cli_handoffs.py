"""After a curriculum: the checkpoint rebuilds the model of its last phase for generate, evaluate and
convert with no extra flags, and `--config.train.steps=N` alone trains the finished run on.

One run of the demo config (a 2-layer width-64 model, a 40-document demo corpus, each phase one or
two batches) through its three phases: the last trains at rope_theta 1e5, the config's model
section says 1e4.
"""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.train_helpers import REPO, cli_env, run_train, train_losses
from zaya_jax.checkpoints.orbax_checkpoint import checkpoint_dir, load_checkpoint_model, read_config
from zaya_jax.train.monitor import read_metrics

SMALL_DEMO = ("--config.model.hidden_size=64", "--config.model.num_layers=2", "--config.model.head_dim=16",
              "--config.model.moe_intermediate_size=64", "--config.model.router_hidden_size=16",
              "--config.model.num_experts=4", "--config.data.demo.max_docs=40", "--config.data.eval.max_batches=1",
              "--config.data.phases[0].token_budget=2048", "--config.data.phases[1].token_budget=1024",
              "--config.data.phases[2].token_budget=2048", "--config.train.steps=4", "--config.train.log_every_steps=1",
              "--config.optimizer.warmup_steps=1", "--config.checkpoint.every_steps=0", "--config.eval.every_steps=0",
              "--config.monitor.heatmap_every_steps=0")


def cli(module, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("curriculum")
    done = run_train(root / "run", *SMALL_DEMO, f"--config.data.demo.cache_dir={root / 'corpus'}",
                     config="configs/demo.py")
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "run", done.stdout + done.stderr


def test_every_phase_is_announced_and_the_run_ends_with_a_summary(demo_run):
    workdir, log = demo_run
    for number, name, theta in ((1, "prose_heavy", "10000"), (2, "code_math_heavy", "10000"),
                                (3, "long_mixed", "100000")):
        assert re.search(rf"phase {number}/3 '{name}' \(batch 8 x seq_len \d+, rope_theta {theta}\)", log), log
    assert "seq_len 256, rope_theta 100000); compiling the step for it" in log
    assert "seq_len 128, rope_theta 10000)\n" in log  # phase 2 reuses phase 1's compiled step
    assert f"finished at step 4, loss {read_metrics(str(workdir / 'metrics.jsonl'))[-1]['loss']:.4f}" in log
    for output in ("checkpoints", "metrics.jsonl", "tensorboard", "expert_load.png"):
        assert str(workdir / output) in log, output


def test_checkpoint_rebuilds_the_last_phase_model(demo_run):
    workdir, _ = demo_run
    config = read_config(checkpoint_dir(str(workdir)))
    assert config.data.phases[2]["rope_theta"] == 1e5 and config.data.phases[0]["rope_theta"] == 1e4
    assert config.model.rope_theta == 1e5  # the demo file says 1e4; the step was trained at 1e5
    model, step = load_checkpoint_model(str(workdir))
    assert step == 4 and model.config.rope_theta == 1e5 and model.config.layout == "native"


def test_generate_from_the_checkpoint_needs_no_tokenizer_flag(demo_run):
    workdir, _ = demo_run
    done = cli("zaya_jax.generate", "--checkpoint", workdir, "--prompt", "ROMEO:", "--max_new_tokens", 4,
               "--ignore_eos")
    assert done.returncode == 0, done.stderr[-3000:]
    carried = workdir / "checkpoints" / "4" / "tokenizer" / "tokenizer.json"
    assert f"[tokenizer: {carried}, carried by checkpoint 4 (sha256 " in done.stderr
    assert "the run's data.tokenizer 'demo:tokenizer')]" in done.stderr
    assert "4 tokens in" in done.stderr


@pytest.fixture(scope="module")
def demo_export(demo_run, tmp_path_factory):
    """`convert to_hf` of the demo run: (its directory, the command's stderr)."""
    workdir, _ = demo_run
    out = tmp_path_factory.mktemp("export") / "hf"
    exported = cli("zaya_jax.convert", "to_hf", "--checkpoint", workdir, "--out", out)
    assert exported.returncode == 0, exported.stderr[-3000:]
    return out, exported.stderr


def test_evaluate_and_convert_use_the_phase_rope_theta(demo_run, demo_export):
    workdir, _ = demo_run
    scored = cli("zaya_jax.evaluate", "--checkpoint", workdir)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert json.loads(scored.stdout)["rope_theta"] == 1e5
    hf_config = json.loads((demo_export[0] / "config.json").read_text())
    assert hf_config["rope_parameters"]["hybrid"]["rope_theta"] == 1e5
    # the export, scored with the config the run used (whose model section says 1e4), is the same model
    on_hf = cli("zaya_jax.evaluate", "--hf", demo_export[0], "--config", "configs/demo.py", *SMALL_DEMO,
                f"--config.data.demo.cache_dir={workdir.parent / 'corpus'}")
    assert on_hf.returncode == 0, on_hf.stderr[-3000:]
    assert json.loads(on_hf.stdout)["rope_theta"] == 1e5
    losses = [{source: r["loss"] for source, r in json.loads(done.stdout)["results"].items()} for done in (on_hf, scored)]
    # the same fp32 weights through the same program: equal to 1e-7 (measured: bit-identical), where the
    # wrong RoPE base (1e4) moves a loss by 2e-5 relative; a 1e-5 tolerance left that margin thin
    assert losses[0] == pytest.approx(losses[1], rel=1e-7) and len(losses[0]) == 3


def test_evaluate_scores_a_quantized_export(demo_run, demo_export, tmp_path):
    """`evaluate --hf` on the demo run's FP8 export: its weights dequantized onto the evaluation mesh (a
    traceback before: quantized leaves do not take the float weights' shardings). The losses are the
    float export's within FP8's error, and not equal to them (the FP8 weights were scored)."""
    workdir, _ = demo_run
    out = tmp_path / "fp8"
    exported = cli("zaya_jax.convert", "to_hf", "--checkpoint", workdir, "--out", out, "--quantize", "fp8",
                   "--fp8_block", "16")
    assert exported.returncode == 0, exported.stderr[-3000:]
    scores = []
    for directory in (out, demo_export[0]):
        done = cli("zaya_jax.evaluate", "--hf", directory, "--config", "configs/demo.py", *SMALL_DEMO,
                   f"--config.data.demo.cache_dir={workdir.parent / 'corpus'}")
        assert done.returncode == 0, done.stderr[-3000:]
        scores.append({source: r["loss"] for source, r in json.loads(done.stdout)["results"].items()})
    assert scores[0] == pytest.approx(scores[1], rel=2e-2) and scores[0] != scores[1]


def test_convert_says_what_its_read_back_check_found(demo_export):
    line = next(ln for ln in demo_export[1].splitlines() if ln.startswith("checked:"))
    found = re.fullmatch(r"checked: the native export read back gives every architecture field and the source's "
                         r"logits on a 2 x 24 probe batch \(max difference (\S+), logits up to (\S+), tolerance "
                         r"1e-05 of the scale\)", line)
    assert found and float(found[1]) <= 1e-5 * float(found[2]) and float(found[2]) > 0, line


def test_the_exported_tokenizer_puts_bos_first_as_training_did(demo_run, demo_export):
    import tokenizers
    workdir, _ = demo_run
    trained = tokenizers.Tokenizer.from_file(str(next((workdir.parent / "corpus").glob("*/tokenizer.json"))))
    exported = tokenizers.Tokenizer.from_file(str(demo_export[0] / "tokenizer.json"))
    bos = read_config(checkpoint_dir(str(workdir))).model.bos_token_id
    text = "ROMEO: hello"
    assert trained.encode(text).ids[:1] != [bos]  # the run's file adds nothing: the loader puts bos first
    assert exported.encode(text).ids == [bos] + trained.encode(text).ids
    assert exported.encode(text, add_special_tokens=False).ids == trained.encode(text).ids  # apply_chat_template's


def test_generate_reads_the_exports_tokenizer_and_a_given_step(demo_run, demo_export):
    workdir, _ = demo_run
    args = ("--prompt", "ROMEO:", "--max_new_tokens", 6, "--ignore_eos")
    on_hf = cli("zaya_jax.generate", "--hf", demo_export[0], *args)
    assert on_hf.returncode == 0, on_hf.stderr[-3000:]
    assert f"[tokenizer: {demo_export[0] / 'tokenizer.json'}]" in on_hf.stderr
    at_step = cli("zaya_jax.generate", "--checkpoint", workdir, "--step", 4, *args)
    assert at_step.returncode == 0, at_step.stderr[-3000:]
    assert on_hf.stdout == at_step.stdout  # one model, one prompt (bos first), greedy
    assert "6 tokens in" in on_hf.stderr and "6 tokens in" in at_step.stderr
    missing = cli("zaya_jax.generate", "--checkpoint", workdir, "--step", 3, *args)
    assert missing.returncode == 2 and "(step 3): step 3: no such step directory (saved steps: 4)" in missing.stderr
    step_dir = cli("zaya_jax.generate", "--checkpoint", workdir / "checkpoints" / "4", *args)
    assert step_dir.returncode == 2, step_dir.stderr[-2000:]
    assert f"(it is a step directory: give --checkpoint {workdir / 'checkpoints'} --step 4)" in step_dir.stderr
    workdir_as_hf = cli("zaya_jax.generate", "--hf", workdir, *args)
    assert workdir_as_hf.returncode == 2 and "Traceback" not in workdir_as_hf.stderr, workdir_as_hf.stderr[-2000:]
    assert f"is a zaya_jax run or checkpoint directory, not an HF export: give it as --checkpoint {workdir}" \
        in workdir_as_hf.stderr and "--tokenizer" not in workdir_as_hf.stderr


@pytest.mark.parametrize("args,message", [
    (("--prompt_ids", "2,99999"), "error: --prompt_ids: 99999 outside the model's vocabulary (ids 0..4095)"),
    (("--prompt_ids", "2,5", "--max_new_tokens", "5000"),
     "error: --max_new_tokens 5000: with the 2-token prompt that needs 5001 positions (the last new token is not "
     "fed back), past the model's max_position_embeddings 1024; ask for at most 1023"),
    (("--prompt_ids", ",".join(["5"] * 1030)),
     "error: the prompt is 1030 tokens, 6 too many: the model's max_position_embeddings 1024 leaves room for a "
     "prompt of at most 1024 and one new token; shorten it"),
])
def test_generate_names_a_prompt_the_model_cannot_take(demo_run, args, message):
    done = cli("zaya_jax.generate", "--checkpoint", demo_run[0], *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_train_steps_alone_extends_a_finished_run_in_its_last_phase(demo_run, tmp_path):
    """Also the bar of a resumed run: it starts at the restored step, and its rate counts this
    session's steps after the first (which compiles), so its ETA is the steps' own."""
    workdir, _ = demo_run
    shutil.copytree(workdir, tmp_path / "run")
    corpus = workdir.parent / "corpus"
    steps = [a for a in SMALL_DEMO if not a.startswith("--config.train.steps")]
    done = run_train(tmp_path / "run", *steps, "--config.train.steps=7", f"--config.data.demo.cache_dir={corpus}",
                     "--config.monitor.progress_bar=True", config="configs/demo.py")
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "start at step 4: restored checkpoint 4" in log and "data exhausted" not in log
    assert "train.steps=7 is 3 batches past the curriculum: its last phase 'long_mixed' continues" in log
    records = {r["step"]: r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl"))}
    assert sorted(train_losses(tmp_path / "run")) == [1, 2, 3, 4, 5, 6, 7]
    assert records[5]["phase"] == records[7]["phase"] == "long_mixed" and records[7]["rope_theta"] == 1e5
    assert not re.search(r"\b0/7 \[", log)  # never drawn at 0 before the restore
    # the bar as step 7's record drew it (the redraw at close also counts the final save)
    last, *_ = re.findall(r"7/7 \[[\d:]+<[^,\]]*, *([\d.]+)(step/s|s/step)", log)
    bar_seconds_per_step = float(last[0]) if last[1] == "s/step" else 1 / float(last[0])
    tokens = 8 * 256  # the long_mixed phase's batch x seq_len
    step_seconds = [tokens / records[s]["tokens_per_sec"] for s in (6, 7)]  # the compiled steps' own time
    compile_included = tokens / records[5]["tokens_per_sec"]  # step 5's window holds the compile
    assert compile_included > 3 * max(step_seconds)  # (what the bar would show otherwise)
    assert bar_seconds_per_step < 3 * max(step_seconds), (last, step_seconds)


# -- the tokenizer a checkpoint carries ---------------------------------------------------------------

PROBE_TEXT = "ROMEO: def parse(x): return 17 + 25"


def corpus_tokenizer(workdir):
    """The file the run's data.tokenizer ('demo:tokenizer') names: its demo corpus's tokenizer.json."""
    return next((workdir.parent / "corpus").glob("*/tokenizer.json"))


@contextlib.contextmanager
def tokenizer_replaced(path, scratch):
    """`path` holds another tokenizer (a BPE of other text, the same special ids) inside the block, as
    the demo corpus's file does on another Python; its own bytes are put back after."""
    from zaya_jax.data.tokenizer import train_bpe
    original = path.read_bytes()
    other = train_bpe([f"{i} * {i} = {i * i}; ROMEO and JULIET {i}" for i in range(400)], scratch / "other.json",
                      vocab_size=400)
    try:
        shutil.copyfile(other, path)
        yield other
    finally:
        path.write_bytes(original)


def test_a_checkpoint_carries_its_tokenizer_inside_the_step(demo_run):
    from zaya_jax.data.tokenizer import file_sha256
    from zaya_jax.checkpoints import integrity
    workdir, _ = demo_run
    step_dir = workdir / "checkpoints" / "4"
    carried = step_dir / "tokenizer" / "tokenizer.json"
    assert carried.read_bytes() == corpus_tokenizer(workdir).read_bytes()
    manifest = integrity.read_manifest(str(step_dir))
    assert "tokenizer" in manifest["items"] and os.path.join("tokenizer", "tokenizer.json") in manifest["files"]
    record = read_config(checkpoint_dir(str(workdir))).tokenizer
    assert record.to_dict() == {"file": "tokenizer/tokenizer.json", "sha256": file_sha256(carried),
                                "source": str(corpus_tokenizer(workdir)), "setting": "demo:tokenizer"}


def test_every_reader_keeps_the_tokenizer_the_run_trained_with_when_its_file_changes(demo_run, demo_export,
                                                                                     tmp_path):
    """The file data.tokenizer names is replaced after training (as the demo corpus is another
    tokenizer on another Python): every reader of the checkpoint gives what it gave before, from the
    copy the checkpoint carries; one told to use the new file refuses it, naming both files."""
    from zaya_jax.convert.conversions import export_tokenizer
    from zaya_jax.data.tokenizer import file_sha256
    from zaya_jax.errors import UserError
    from zaya_jax.evaluation.answering import load_checkpoint
    from zaya_jax.harness.loading import load_tokenizer
    workdir, _ = demo_run
    carried = workdir / "checkpoints" / "4" / "tokenizer" / "tokenizer.json"
    model, _, before = load_checkpoint(str(workdir), None)
    cfg = model.config
    harness_before = load_tokenizer(str(workdir), None, None, None, cfg)[0].encode(PROBE_TEXT).ids
    generate = ("zaya_jax.generate", "--checkpoint", workdir, "--prompt", "ROMEO:", "--max_new_tokens", 6, "--ignore_eos")
    generated = cli(*generate)
    assert generated.returncode == 0, generated.stderr[-3000:]
    with tokenizer_replaced(corpus_tokenizer(workdir), tmp_path) as other:
        from zaya_jax.data.tokenizer import Tokenizer
        assert Tokenizer(other, bos_id=2, eos_id=1, pad_id=0).encode(PROBE_TEXT) != before.encode(PROBE_TEXT)
        _, _, after = load_checkpoint(str(workdir), None)  # evaluate_tasks and preference_pairs
        assert after.encode(PROBE_TEXT) == before.encode(PROBE_TEXT) and after.path == str(carried)
        assert load_tokenizer(str(workdir), None, None, None, cfg)[0].encode(PROBE_TEXT).ids == harness_before
        files, _ = export_tokenizer(str(workdir), None, cfg, None)  # convert to_hf
        assert json.loads(files["tokenizer.json"]) == json.loads((demo_export[0] / "tokenizer.json").read_text())
        again = cli(*generate)
        assert again.returncode == 0 and again.stdout == generated.stdout, again.stderr[-3000:]
        refusal = (f"--tokenizer {other} (sha256 {file_sha256(other)[:12]}) is not the tokenizer {workdir} was "
                   f"trained with: checkpoint 4 carries {carried} (sha256 {file_sha256(carried)[:12]}, copied from "
                   f"{corpus_tokenizer(workdir)}); drop --tokenizer to use it")
        for read in (lambda: load_checkpoint(str(workdir), None, str(other)),
                     lambda: load_tokenizer(str(workdir), None, None, str(other), cfg),
                     lambda: export_tokenizer(str(workdir), None, cfg, str(other))):
            with pytest.raises(UserError) as refused:
                read()
            assert str(refused.value) == refusal
        told = cli(*generate, "--tokenizer", other)
        assert told.returncode == 2 and told.stderr.strip() == f"error: {refusal}", told.stderr[-3000:]


def test_a_resume_or_a_run_started_from_the_checkpoint_refuses_another_tokenizer(demo_run, tmp_path):
    """In one `error:` line, before anything compiles: the file data.tokenizer names now, and the one
    the checkpoint carries, each with its sha256."""
    from zaya_jax.data.tokenizer import file_sha256
    workdir, _ = demo_run
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    source = corpus_tokenizer(workdir)
    settings = [f"--config.data.demo.cache_dir={workdir.parent / 'corpus'}",
                *(a for a in SMALL_DEMO if not a.startswith("--config.train.steps")), "--config.train.steps=5"]
    with tokenizer_replaced(source, tmp_path) as other:
        carried = copy / "checkpoints" / "4" / "tokenizer" / "tokenizer.json"
        both = (f"it carries {carried} (sha256 {file_sha256(carried)[:12]}, copied from {source}), but this run's "
                f"data.tokenizer 'demo:tokenizer' = {source} (sha256 {file_sha256(other)[:12]})")
        resumed = run_train(copy, *settings, config="configs/demo.py")
        assert resumed.returncode == 2, resumed.stderr[-3000:]
        assert resumed.stderr.strip() == (
            f"error: resuming {copy / 'checkpoints'} step 4: the checkpoint was trained with another tokenizer: "
            f"{both}; resume where data.tokenizer is the file that run was trained with (and data.sources were "
            "prepared with it), or train this config in a new --workdir")
        started = run_train(tmp_path / "next", *settings, f"--config.train.init_from_checkpoint={workdir}",
                            "--config.data.phases[0].rope_theta=100000.0", config="configs/demo.py")
        assert started.returncode == 2, started.stderr[-3000:]
        assert started.stderr.strip() == (
            f"error: train.init_from_checkpoint: {workdir / 'checkpoints'} step 4 was trained with another tokenizer: "
            f"{both.replace(str(copy), str(workdir))}; set --config.data.tokenizer to a copy of the carried file (and "
            "prepare data.sources with it), or start from a checkpoint trained with this run's tokenizer")
    assert sorted(train_losses(copy)) == [1, 2, 3, 4] and not (tmp_path / "next" / "checkpoints").exists()


def test_evaluate_refuses_held_out_data_prepared_with_another_tokenizer(demo_run, tmp_path):
    """A corpus of other documents has another tokenizer (as the demo corpus does on another Python):
    its held-out loss under this checkpoint would be noise."""
    from zaya_jax.data.tokenizer import file_sha256
    workdir, _ = demo_run
    carried = workdir / "checkpoints" / "4" / "tokenizer" / "tokenizer.json"
    done = cli("zaya_jax.evaluate", "--checkpoint", workdir, "--config", "configs/demo.py", *SMALL_DEMO,
               "--config.data.demo.max_docs=30", f"--config.data.demo.cache_dir={tmp_path / 'other'}")
    other = next((tmp_path / "other").glob("*/tokenizer.json"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: data.sources were prepared with the tokenizer {other} (sha256 {file_sha256(other)[:12]}), but "
        f"{workdir} was trained with another: checkpoint 4 carries {carried} (sha256 {file_sha256(carried)[:12]}, "
        f"copied from {corpus_tokenizer(workdir)}); evaluate it on sources prepared with that file "
        "(python -m zaya_jax.data.prepare --tokenizer FILE), given with --config")


def test_a_checkpoint_that_carries_no_tokenizer_resolves_its_setting_and_says_it_is_unverified(demo_run, tmp_path):
    """Checkpoints saved before checkpoints carried their tokenizer still load, as they did."""
    from zaya_jax.checkpoints.carried_tokenizer import UNVERIFIED, checkpoint_tokenizer
    from zaya_jax.checkpoints.orbax_checkpoint import save_model
    from zaya_jax.checkpoints.model_parts import ModelParts
    workdir, _ = demo_run
    model, _ = load_checkpoint_model(str(workdir))
    source = str(corpus_tokenizer(workdir))
    save_model(str(tmp_path / "old"), *ModelParts.arrays(model),
               {"model": read_config(checkpoint_dir(str(workdir))).model.to_dict(), "data": {"tokenizer": source}})
    assert checkpoint_tokenizer(tmp_path / "old") == (
        source, f"[tokenizer: {source}, the run's data.tokenizer {source!r}; checkpoint 0 {UNVERIFIED}]")


# -- a resume with another config -------------------------------------------------------------------

@pytest.mark.parametrize("config, written_by, this", [
    ("configs/demo_sft.py", "a train.objective='lm' run on text data (data.sources code, math, prose)",
     "a train.objective='sft' run on chat data (data.sources chat)"),
    ("configs/demo_grpo.py", "a train.objective='lm' run on text data (data.sources code, math, prose)",
     "a train.objective='grpo' run on the prompts demo:tasks (grpo.prompts)"),
])
def test_resuming_a_run_with_a_post_training_config_is_one_line(demo_run, tmp_path, config, written_by, this):
    """Resuming a finished pretraining run with a post-training config (the README's next command,
    with the wrong --workdir): one `error:` line naming the run that wrote it and the fix, before the
    data is opened or anything compiles; no log, tensorboard or thread is left (on Python 3.12
    tensorboardX's writer, once started, printed 18 lines at exit)."""
    workdir, _ = demo_run
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    before = sorted(copy.rglob("*"))
    done = run_train(copy, config=config)
    assert done.returncode == 2, done.stderr[-3000:]
    source = "runs/demo" if config.endswith("sft.py") else "runs/demo_sft"
    assert done.stderr.strip() == (
        f"error: resuming {copy / 'checkpoints'} step 4: its checkpoints were written by {written_by}, and this "
        f"config is {this}: resume it with the config it was trained with, or train this config in a new --workdir "
        f"(it starts from {source} through train.init_from_checkpoint)")
    assert sorted(copy.rglob("*")) == before and done.stdout == ""


def test_resuming_with_another_data_pipeline_is_one_line(demo_run, tmp_path):
    """The same objective and data kind, but a pipeline whose saved iterator state does not fit."""
    workdir, _ = demo_run
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    done = run_train(copy, *SMALL_DEMO, f"--config.data.demo.cache_dir={workdir.parent / 'corpus'}",
                     "--config.data.packing_bins=4", config="configs/demo.py")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip() == (
        f"error: resuming {copy / 'checkpoints'} step 4: its data iterator state was saved by a different pipeline "
        "(packing_bins 8 there, 4 here): resume it with the config it was trained with, or train this config in a "
        "new --workdir")
