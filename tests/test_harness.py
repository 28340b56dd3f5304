"""lm-evaluation-harness on zaya_jax (zaya_jax.harness): the model serves the harness's three request
types from a checkpoint or an HF export, scores do not depend on batching or padding, the CLI runs
local-JSONL tasks and the bundled demo set offline, mistakes are named before anything loads, and the
harness's own `hf` backend (PyTorch transformers) gives the same scores and generations."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("lm_eval")

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from tests.harness_fixtures import GEN, MC, ROLLING, write_model, write_tasks  # noqa: E402
from tests.train_helpers import RERUN_IF_OVERLOADED, REPO, Job, cli_env, run_train  # noqa: E402
from zaya_jax.data.chat_template import PLAIN, ChatTemplate, encode_prompt  # noqa: E402
from zaya_jax.data.tokenizer import Tokenizer  # noqa: E402
from zaya_jax.errors import EXIT_PREEMPTED, UserError  # noqa: E402
from zaya_jax.harness import model as harness_model  # noqa: E402
from zaya_jax.harness.model import ZayaHarnessLM  # noqa: E402
from zaya_jax.harness.tasks import task_manager, task_names  # noqa: E402

LOCAL_TASKS = ["local_mc", "local_gen", "local_rolling"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(checkpoint, HF export, --include_path of the local tasks)."""
    root = tmp_path_factory.mktemp("harness")
    checkpoint, hf = write_model(root)
    return checkpoint, hf, write_tasks(root / "tasks")


@pytest.fixture(scope="module")
def on_export(exported):
    return ZayaHarnessLM(hf=str(exported[1]), batch_size=4)


def run_tasks(model, include_path, tasks=LOCAL_TASKS, **options) -> dict:
    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=task_manager(str(include_path)),
                                   log_samples=True, bootstrap_iters=0, **options)


def scores(result: dict, task: str) -> list:
    """Every request's response of `task`, in document order ((loglikelihood, greedy), a float or a text)."""
    return [r[0] for sample in sorted(result["samples"][task], key=lambda s: s["doc_id"]) for r in sample["resps"]]


def harness(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zaya_jax.harness", *map(str, args)], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300)


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_scores_do_not_depend_on_the_batch_or_its_padding(on_export):
    pairs = [(d["question"], c) for d in MC for c in d["choices"]]
    together = on_export.loglikelihood(requests("loglikelihood", pairs))  # one batch, rows of several widths
    alone = [on_export.loglikelihood(requests("loglikelihood", [p]))[0] for p in pairs[:4]]
    assert [g for _, g in together[:4]] == [g for _, g in alone]
    np.testing.assert_allclose([s for s, _ in together[:4]], [s for s, _ in alone], atol=1e-5, rtol=0)
    assert on_export.devices == 8 and on_export.batch_size == 8  # data parallel over the 8 fake devices
    # an empty context is bos, the continuation as encoded alone
    empty, = on_export.loglikelihood(requests("loglikelihood", [("", "The quick")]))
    bos_first, = on_export.loglikelihood(requests("loglikelihood", [("<bos>", "The quick")]))
    assert empty[0] == pytest.approx(bos_first[0], abs=1e-5)


def test_checkpoint_and_its_export_score_alike(exported, on_export):
    from_checkpoint = ZayaHarnessLM(checkpoint=str(exported[0]), batch_size=4)
    pairs = [(d["question"], c) for d in MC[:2] for c in d["choices"]]
    for kind, args in (("loglikelihood", pairs), ("loglikelihood_rolling", [(r["text"],) for r in ROLLING])):
        a = from_checkpoint.loglikelihood(requests(kind, args)) if kind == "loglikelihood" else \
            from_checkpoint.loglikelihood_rolling(requests(kind, args))
        b = on_export.loglikelihood(requests(kind, args)) if kind == "loglikelihood" else \
            on_export.loglikelihood_rolling(requests(kind, args))
        np.testing.assert_allclose(np.ravel(a), np.ravel(b), atol=1e-5, rtol=0)
    gen = [(r["question"], {"until": ["\n"], "max_gen_toks": 6}) for r in GEN]
    assert from_checkpoint.generate_until(requests("generate_until", gen)) == \
        on_export.generate_until(requests("generate_until", gen))


def test_sampled_generation_follows_its_seed(on_export):
    prompt = [("The quick", {"until": ["\n"], "max_gen_toks": 6, "do_sample": True, "temperature": 1.5})]
    first = on_export.generate_until(requests("generate_until", prompt * 3))
    assert first == on_export.generate_until(requests("generate_until", prompt * 3))
    assert len(set(first)) > 1  # each row draws its own tokens
    with pytest.raises(UserError, match="repetition_penalty"):
        on_export.generate_until(requests("generate_until", [("x", {"max_gen_toks": 4, "repetition_penalty": 1.1})]))


def test_generation_in_slots_stops_at_the_stop_sequence_and_equals_static_batches(on_export, monkeypatch):
    import zaya_jax.engine.batch as engine_batch
    made, run_to_end = [], engine_batch.run_to_end

    def recording(engine, prompts, params, images=None):
        tokens, lengths = run_to_end(engine, prompts, params, images)
        made.append((tokens, lengths))
        return tokens, lengths
    monkeypatch.setattr(engine_batch, "run_to_end", recording)
    in_slots = {n: ZayaHarnessLM(model=on_export.model, tokenizer=on_export.tokenizer_path, slots=n) for n in (2, 3)}
    contexts = ["The quick", "Once upon a time there was", "a", "In the beginning the numbers were", "x y z", "It"]
    unstopped = on_export.generate_until(requests("generate_until", [(c, {"until": ["<never>"], "max_gen_toks": 10})
                                                                     for c in contexts]))
    text = "".join(unstopped).replace("\ufffd", "")  # not a byte sequence's unfinished character
    stop = max(set(text), key=text.count)  # the random model's commonest character: it ends some requests early
    greedy = requests("generate_until", [(c, {"until": [stop], "max_gen_toks": 10}) for c in contexts])
    static = on_export.generate_until(greedy)
    assert in_slots[3].generate_until(greedy) == static
    tokens, lengths = made[-1]
    eos = on_export.eot_token_id
    stopped = [n < 10 and tokens[i, n - 1] != eos for i, n in enumerate(lengths)]  # ended by `stop`, not eos
    assert any(stopped)
    sampled = requests("generate_until", [(c, {"until": ["\n"], "max_gen_toks": 6, "do_sample": True,
                                               "temperature": 1.5}) for c in contexts])
    drawn = in_slots[3].generate_until(sampled)
    assert drawn == in_slots[2].generate_until(sampled) and len(set(drawn)) > 1  # whatever runs beside
    with pytest.raises(UserError, match="slots=0: give a positive number of engine rows"):
        ZayaHarnessLM(model=on_export.model, tokenizer=on_export.tokenizer_path, slots=0)


def test_chat_prompts_are_the_ids_generate_chat_sends(exported):
    checkpoint, _, _ = exported
    lm = ZayaHarnessLM(checkpoint=str(checkpoint), chat_template=PLAIN, batch_size=1)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    text = lm.apply_chat_template(messages)
    assert text == "<bos>User: What is 2 + 3?\nAssistant: "
    cfg = lm.model.config
    tokenizer = Tokenizer(lm.tokenizer_path, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id)
    assert lm.tok_encode(text) == encode_prompt(ChatTemplate.load(PLAIN), tokenizer, messages).tolist()
    opened = lm.apply_chat_template([*messages, {"role": "assistant", "content": "5"}], add_generation_prompt=False)
    assert opened == "<bos>User: What is 2 + 3?\nAssistant: 5"  # the answer left open, no eos


def test_cli_runs_local_tasks_offline_and_writes_json(exported, tmp_path):
    checkpoint, _, tasks = exported
    done = harness("--checkpoint", checkpoint, "--tasks", "local_mc,local_gen", "--include_path", tasks,
                   "--limit", 3, "--output_path", tmp_path / "out", "--log_samples", "--bootstrap_iters", 0)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "local_mc" in done.stdout and "acc" in done.stdout
    # lm_eval's layout: OUT/<model path, sanitized>/results_<time>.json and samples_<task>_<time>.jsonl
    (model_dir,) = (tmp_path / "out").iterdir()
    assert model_dir.name == str(checkpoint).replace("/", "__")
    (results,) = model_dir.glob("results_*.json")
    out = json.loads(results.read_text())
    assert out["config"]["model"] == "ZayaHarnessLM" and out["config"]["model_args"] is None
    assert {"local_mc", "local_gen"} <= set(out["results"]) and "samples" not in out
    (samples,) = model_dir.glob("samples_local_mc_*.jsonl")
    assert len(samples.read_text().splitlines()) == 3 and len(list(model_dir.glob("samples_local_gen_*.jsonl"))) == 1


@pytest.mark.parametrize("args, named", [
    (("--checkpoint", "{ckpt}", "--tasks", "no_such_task"), "--tasks: unknown task no_such_task"),
    (("--checkpoint", "{ckpt}", "--hf", "{tmp}", "--tasks", "local_mc"), "give exactly one of --checkpoint"),
    (("--checkpoint", "{tmp}/nope", "--tasks", "local_mc"), "--checkpoint {tmp}/nope: no such directory"),
    (("--checkpoint", "{ckpt}", "--tasks", "hellaswag"), "--tasks hellaswag: a task's dataset is not available offline"),
])
def test_mistakes_are_named_before_anything_loads(exported, tmp_path, args, named, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "no_datasets"))  # hellaswag cached elsewhere stays unseen
    done = harness(*(a.format(ckpt=exported[0], tmp=tmp_path) for a in args))
    assert done.returncode == 2, done.stderr[-3000:]
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and named.format(tmp=tmp_path) in error[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_loglikelihood_is_the_float64_sum_of_the_models_logprobs_on_the_exact_continuation(on_export, monkeypatch):
    """Torch-free: a (context, continuation) request's log-likelihood sums exactly the continuation's
    tokens (against numpy float64 over the full sequence's log-softmax: dropping the last token
    moves it by a whole token's log-prob), and sums the model's own per-token log-probs in float64
    (against math.fsum of them: a float32 sum of the 120 terms is off by 6e-6, measured), for a
    1-token and a 120-token continuation."""
    lm = on_export
    per_token, scores_of = [], harness_model.continuation_scores  # the log-probs the model computed, per call

    def recorded(*args):
        out = scores_of(*args)
        per_token.append(np.asarray(out[0], np.float64))
        return out
    monkeypatch.setattr(harness_model, "continuation_scores", recorded)
    ids = list(np.random.default_rng(0).integers(3, lm.model.config.vocab_size, 127))
    hidden, _ = lm.replicated_model.hidden_states(jnp.asarray([ids[:-1]], jnp.int32))
    logp = np.asarray(jax.nn.log_softmax(lm.replicated_model.logits(hidden), axis=-1)[0], np.float64)
    for split in (126, 7):  # context ids[:split], continuation ids[split:]
        expected = math.fsum(logp[t - 1, ids[t]] for t in range(split, len(ids)))
        greedy = all(np.argmax(logp[t - 1]) == ids[t] for t in range(split, len(ids)))
        [(got, got_greedy)] = lm._loglikelihood_tokens([(None, ids[:split], ids[split:])])
        assert got == pytest.approx(expected, rel=1e-6), (split, got - expected)
        assert got_greedy == greedy
        assert abs(got - math.fsum(per_token[-1][0])) < 1e-9, (split, got - math.fsum(per_token[-1][0]))


def test_an_unknown_task_lists_the_bundled_and_included_tasks_first(exported):
    with pytest.raises(UserError) as raised:
        task_names(task_manager(str(exported[2])), "local_mc,no_such_task")
    message = str(raised.value)
    assert message.startswith("--tasks: unknown task no_such_task; the bundled and --include_path tasks are ")
    assert "local_gen, local_mc, local_rolling, zaya_demo, zaya_demo_cloze" in message
    assert "hellaswag" not in message and "`python -m lm_eval ls tasks`" in message


def test_demo_task_set_runs_on_the_demo_corpus(on_export, tmp_path):
    metadata = {"max_docs": 40, "cache_dir": str(tmp_path / "corpus"), "per_kind": 2}
    out = lm_eval.simple_evaluate(model=on_export, tasks=["zaya_demo"], task_manager=task_manager(metadata=metadata),
                                  limit=2, bootstrap_iters=0)
    results = out["results"]
    for task, metric in (("zaya_demo_heldout_prose", "bits_per_byte,none"), ("zaya_demo_heldout_code", "bits_per_byte,none"),
                         ("zaya_demo_heldout_math", "bits_per_byte,none"), ("zaya_demo_cloze", "acc,none"),
                         ("zaya_demo_questions", "exact_match,none"), ("zaya_demo_questions_mc", "acc,none")):
        assert np.isfinite(results[task][metric]), (task, results[task])
    assert 0 < results["zaya_demo_heldout_prose"]["bits_per_byte,none"] < 16


@pytest.mark.torch_reference
def test_the_harness_hf_backend_gives_the_same_scores_and_generations(exported, on_export):
    _, hf, tasks = exported
    ours = run_tasks(on_export, tasks)
    theirs = run_tasks("hf", tasks, model_args=f"pretrained={hf},dtype=float32", device="cpu", batch_size=4)
    assert theirs["config"]["model"] == "hf"
    for task in ("local_mc", "local_rolling"):
        a, b = scores(ours, task), scores(theirs, task)
        values = lambda xs: np.array([x[0] if isinstance(x, (list, tuple)) else x for x in xs])  # noqa: E731
        np.testing.assert_allclose(values(a), values(b), atol=1e-3, rtol=0)
        if task == "local_mc":
            assert [x[1] for x in a] == [x[1] for x in b]
    assert scores(ours, "local_gen") == scores(theirs, "local_gen")
    for task, metric in (("local_mc", "acc,none"), ("local_mc", "acc_norm,none"), ("local_gen", "exact_match,none")):
        assert ours["results"][task][metric] == theirs["results"][task][metric]


def training_config(directory, tokenizer) -> str:
    """configs/tiny.py (synthetic data) with the fixture's tokenizer as its data.tokenizer."""
    path = directory / "tiny_with_tokenizer.py"
    path.write_text(f"import ml_collections\nfrom zaya_jax.config_files import load_config_file\n\n"
                    f"def get_config():\n    config = load_config_file({os.path.join(REPO, 'configs', 'tiny.py')!r})\n"
                    f"    config.data = ml_collections.ConfigDict({{'tokenizer': {str(tokenizer)!r}}})\n"
                    f"    return config\n")
    return str(path)


def test_training_scores_the_tasks_at_its_checkpoints_and_resumes_after_a_stop(exported, tmp_path):
    checkpoint, _, tasks = exported
    config = training_config(tmp_path, checkpoint.parent / "tokenizer" / "tokenizer.json")
    workdir = tmp_path / "run"
    harness_flags = ("--config.train.steps=4", "--config.checkpoint.every_steps=2", "--config.eval.every_steps=0",
                     "--config.optimizer.warmup_steps=1", "--config.eval.harness_tasks=local_mc",
                     f"--config.eval.harness_include_path={tasks}", "--config.eval.harness_limit=3")
    stopped = run_train(workdir, *harness_flags, config=config, faults={"KILL_AT_STEP": 2, "KILL_SIGNAL": "SIGTERM"})
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-3000:]
    resumed = run_train(workdir, *harness_flags, config=config)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in lines if r["kind"] == "harness"]
    assert [r["step"] for r in records] == [2, 4]  # the stopped step's scores (once), then the resumed run's
    assert all(0 <= r["harness/local_mc/acc"] <= 1 and "harness/local_mc/acc_norm" in r for r in records)
    assert "harness/local_mc/acc=" in resumed.stderr + resumed.stdout
    events = b"".join(p.read_bytes() for p in (workdir / "tensorboard").iterdir())
    assert b"harness/local_mc/acc" in events


# Multi-process jobs share one xdist worker (--dist loadgroup), see tests/test_multihost.py.
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.flaky(**RERUN_IF_OVERLOADED)
def test_two_processes_score_the_tasks_as_the_offline_harness_scores_their_checkpoint(exported, tmp_path):
    checkpoint, _, tasks = exported
    config = training_config(tmp_path, checkpoint.parent / "tokenizer" / "tokenizer.json")
    flags = ("--config.train.steps=2", "--config.checkpoint.every_steps=2", "--config.eval.every_steps=0",
             "--config.optimizer.warmup_steps=1", "--config.eval.harness_tasks=local_mc,local_rolling",
             f"--config.eval.harness_include_path={tasks}", "--config.eval.harness_limit=3",
             "--config.monitor.tensorboard=False")
    workdir = tmp_path / "two"
    job = Job(workdir, *flags, devices_per_process=4, config=config)
    codes, _ = job.finish(timeout=300)
    assert codes == [0, 0], job.output(0)[-3000:] + job.output(1)[-3000:]
    assert "'global_devices': 8" in job.output(0)
    records = [r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "harness"]
    assert [r["step"] for r in records] == [2]
    # the reference: this process's harness on the checkpoint the job saved of the same step
    offline = run_tasks(ZayaHarnessLM(checkpoint=str(workdir), step=2, batch_size=4), tasks,
                        tasks=["local_mc", "local_rolling"], limit=3)["results"]
    assert records[0]["harness/local_mc/acc"] == offline["local_mc"]["acc,none"]
    assert records[0]["harness/local_rolling/word_perplexity"] == pytest.approx(
        offline["local_rolling"]["word_perplexity,none"], rel=1e-5)


def test_a_training_config_naming_an_unknown_task_stops_before_compiling(exported, tmp_path):
    checkpoint, _, tasks = exported
    config = training_config(tmp_path, checkpoint.parent / "tokenizer" / "tokenizer.json")
    done = run_train(tmp_path / "run", "--config.eval.harness_tasks=local_mcq",
                     f"--config.eval.harness_include_path={tasks}", config=config)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "eval.harness_tasks" in done.stderr and "unknown task local_mcq" in done.stderr
    assert "compiling" not in done.stderr + done.stdout
