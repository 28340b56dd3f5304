"""lm-evaluation-harness on zaya_jax (zaya_jax.harness): the model serves the harness's three request
types from a checkpoint or an HF export, scores do not depend on batching or padding, the CLI runs
local-JSONL tasks and the bundled demo set offline, mistakes are named before anything loads, and the
harness's own `hf` backend (PyTorch transformers) gives the same scores and generations."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval")

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from tests.harness_fixtures import MC, write_model, write_tasks  # noqa: E402
from tests.train_helpers import REPO, cli_env  # noqa: E402
from zaya_jax.data.chat_template import PLAIN, ChatTemplate, encode_prompt  # noqa: E402
from zaya_jax.data.tokenizer import Tokenizer  # noqa: E402
from zaya_jax.errors import UserError  # noqa: E402
from zaya_jax.harness.model import ZayaHarnessLM  # noqa: E402
from zaya_jax.harness.tasks import task_manager  # noqa: E402

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
    checkpoint, _, tasks = exported
    from_checkpoint = run_tasks(ZayaHarnessLM(checkpoint=str(checkpoint), batch_size=4), tasks)
    from_export = run_tasks(on_export, tasks)
    assert from_checkpoint["config"]["model"] == "ZayaHarnessLM"
    for task in LOCAL_TASKS:
        a, b = scores(from_checkpoint, task), scores(from_export, task)
        if task == "local_gen":
            assert a == b and all(isinstance(t, str) for t in a)
        else:
            flat = lambda xs: np.ravel([x[0] if isinstance(x, (list, tuple)) else x for x in xs])  # noqa: E731
            np.testing.assert_allclose(flat(a), flat(b), atol=1e-5, rtol=0)


def test_sampled_generation_follows_its_seed(on_export):
    prompt = [("The quick", {"until": ["\n"], "max_gen_toks": 6, "do_sample": True, "temperature": 1.5})]
    first = on_export.generate_until(requests("generate_until", prompt * 3))
    assert first == on_export.generate_until(requests("generate_until", prompt * 3))
    assert len(set(first)) > 1  # each row draws its own tokens
    with pytest.raises(UserError, match="repetition_penalty"):
        on_export.generate_until(requests("generate_until", [("x", {"max_gen_toks": 4, "repetition_penalty": 1.1})]))


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
                   "--limit", 3, "--output_path", tmp_path / "out.json", "--log_samples", "--bootstrap_iters", 0)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "local_mc" in done.stdout and "acc" in done.stdout
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["config"]["model"] == "ZayaHarnessLM" and out["config"]["model_args"] is None
    assert {"local_mc", "local_gen"} <= set(out["results"]) and len(out["samples"]["local_mc"]) == 3


@pytest.mark.parametrize("args, named", [
    (("--checkpoint", "{ckpt}", "--tasks", "no_such_task"), "--tasks: unknown task no_such_task"),
    (("--checkpoint", "{ckpt}", "--hf", "{tmp}", "--tasks", "local_mc"), "give exactly one of --checkpoint"),
    (("--checkpoint", "{tmp}/nope", "--tasks", "local_mc"), "--checkpoint {tmp}/nope: no such directory"),
])
def test_mistakes_are_named_before_anything_loads(exported, tmp_path, args, named):
    done = harness(*(a.format(ckpt=exported[0], tmp=tmp_path) for a in args))
    assert done.returncode == 2, done.stderr[-3000:]
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and named.format(tmp=tmp_path) in error[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr


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
