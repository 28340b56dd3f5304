"""CLI: lm-evaluation-harness tasks scored by a zaya_jax model, offline.

  python -m zaya_jax.harness --checkpoint runs/demo --tasks zaya_demo [--step N]
  python -m zaya_jax.harness --hf DIR --tasks my_task --include_path DIR_OF_YAMLS --limit 50 \\
      --output_path results/ [--num_fewshot 5 --batch_size 16 --log_samples --apply_chat_template]

--tasks: comma-separated task or group names (the harness's own, the bundled zaya_demo set of
zaya_jax/harness/tasks/, or those of --include_path). The model is ZayaHarnessLM (model.py).
Nothing is downloaded: HF_DATASETS_OFFLINE / HF_HUB_OFFLINE are set, so a task reads local files
(`dataset_path: json` with `data_files`) or builds its data (`custom_dataset`, as the demo set does).
The results table goes to stdout; --output_path gets the JSON in lm_eval's own layout
(`save_as_lm_eval`: DIR/<model>/results_<time>.json, with --log_samples a samples_<task>_<time>.jsonl
per task beside it). Task names and the model source are checked before anything
loads or compiles.
"""

from __future__ import annotations

import os

for _name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")  # before datasets / huggingface_hub read them

import sys  # noqa: E402

from absl import app, flags  # noqa: E402

from zaya_jax import cli  # noqa: E402
from zaya_jax.checkpoints.hf_quantized import BLOCK_AXES, BLOCK_AXIS_HELP  # noqa: E402

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Training run WORKDIR, its checkpoints/ directory, or a "
                                                      "`convert to_orbax` output.")
_STEP = flags.DEFINE_integer("step", None, "With --checkpoint: the step (default: the newest whole one).", lower_bound=0)
_HF = flags.DEFINE_string("hf", None, "HF ZAYA export directory (config.json, safetensors, tokenizer.json).")
_TASKS = flags.DEFINE_string("tasks", None, "Comma-separated task or group names.")
_INCLUDE_PATH = flags.DEFINE_string("include_path", None, "A directory of extra task YAMLs.")
_LIMIT = flags.DEFINE_float("limit", None, "Documents per task (below 1: a fraction of them).")
_NUM_FEWSHOT = flags.DEFINE_integer("num_fewshot", None, "Few-shot examples per prompt.", lower_bound=0)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Rows scored together (rounded up to the device count).",
                                   lower_bound=1)
_SLOTS = flags.DEFINE_integer("slots", None, "generate_until through the serving engine's N rows, each request "
                               "ending at eos or its first stop sequence and its row taking the next (default: "
                               "static batches of --batch_size, every row decoding until the batch's last stops).",
                               lower_bound=1)
_OUTPUT_PATH = flags.DEFINE_string("output_path", None, "Write the results (and samples) here, in lm_eval's layout.")
_LOG_SAMPLES = flags.DEFINE_bool("log_samples", False, "Keep every sample's requests and responses in the JSON.")
_CHAT = flags.DEFINE_bool("apply_chat_template", False, "Render prompts with the chat template.")
_MULTITURN = flags.DEFINE_bool("fewshot_as_multiturn", False, "With --apply_chat_template: few-shot examples "
                                                              "as conversation turns.")
_SYSTEM = flags.DEFINE_string("system_instruction", None, "A system message for every prompt.")
_GEN_KWARGS = flags.DEFINE_string("gen_kwargs", None, "Generation overrides, e.g. do_sample=True,temperature=0.7.")
_METADATA = flags.DEFINE_string("metadata", None, "JSON passed to the tasks (the demo set: "
                                                  "{\"cache_dir\": ..., \"max_docs\": ...}).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the harness's sampling of documents and of generation.")
_BOOTSTRAP = flags.DEFINE_integer("bootstrap_iters", 100000, "Bootstrap iterations for standard errors "
                                                             "(0: none).", lower_bound=0)
_MAX_LENGTH = flags.DEFINE_integer("max_length", None, "Context window (default: max_position_embeddings).",
                                   lower_bound=2)
_MAX_GEN = flags.DEFINE_integer("max_gen_toks", 256, "Default cap of generated tokens.", lower_bound=1)
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer.json (default: the one the checkpoint carries, or "
                                                    "DIR/tokenizer.json).")
_CHAT_TEMPLATE = flags.DEFINE_string("chat_template", None, "A .jinja or tokenizer_config.json (default: the "
                                                            "run's recorded template or DIR's).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Compute dtype (default: the model's).")
_MXFP4_BLOCK_AXIS = flags.DEFINE_enum("mxfp4_block_axis", None, list(BLOCK_AXES), BLOCK_AXIS_HELP)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not _TASKS.value:
        raise app.UsageError("--tasks is required, e.g. --tasks zaya_demo")
    from zaya_jax.errors import UserError
    try:
        import lm_eval
    except ModuleNotFoundError as err:
        if err.name != "lm_eval":
            raise
        raise UserError("python -m zaya_jax.harness needs lm-evaluation-harness, which this install lacks: "
                        'pip install -e ".[eval]"') from err
    from zaya_jax.harness.loading import check_source
    check_source(_CHECKPOINT.value, _HF.value, _STEP.value)
    if _INCLUDE_PATH.value and not os.path.isdir(_INCLUDE_PATH.value):
        raise UserError(f"--include_path {_INCLUDE_PATH.value}: no such directory of task YAMLs")
    from zaya_jax.harness.tasks import parse_metadata, task_manager, task_names
    manager = task_manager(_INCLUDE_PATH.value, parse_metadata(_METADATA.value))
    tasks = task_names(manager, _TASKS.value)
    try:
        manager.load(tasks)  # builds every task's data now: a missing dataset ends here, before the model loads
    except ConnectionError as err:
        raise UserError(f"--tasks {_TASKS.value}: a task's dataset is not available offline ({err}); nothing is "
                        "downloaded here: give the task local data with a task YAML (dataset_path: json, "
                        "dataset_kwargs.data_files) in an --include_path directory (docs/evaluation.md)") from err

    from lm_eval.utils import make_table

    from zaya_jax.harness.model import ZayaHarnessLM
    lm = ZayaHarnessLM(checkpoint=_CHECKPOINT.value, hf=_HF.value, step=_STEP.value, tokenizer=_TOKENIZER.value,
                       chat_template=_CHAT_TEMPLATE.value, batch_size=_BATCH_SIZE.value, max_length=_MAX_LENGTH.value,
                       max_gen_toks=_MAX_GEN.value, seed=_SEED.value, dtype=_DTYPE.value, slots=_SLOTS.value,
                       mxfp4_block_axis=_MXFP4_BLOCK_AXIS.value)
    tracker = None
    if _OUTPUT_PATH.value:
        from lm_eval.loggers import EvaluationTracker
        tracker = EvaluationTracker(output_path=_OUTPUT_PATH.value)
    results = lm_eval.simple_evaluate(
        model=lm, evaluation_tracker=tracker, tasks=tasks, task_manager=manager, limit=_LIMIT.value, num_fewshot=_NUM_FEWSHOT.value,
        log_samples=_LOG_SAMPLES.value, apply_chat_template=_CHAT.value, fewshot_as_multiturn=_MULTITURN.value,
        system_instruction=_SYSTEM.value, gen_kwargs=_GEN_KWARGS.value, bootstrap_iters=_BOOTSTRAP.value,
        random_seed=_SEED.value, numpy_random_seed=_SEED.value, fewshot_random_seed=_SEED.value)
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if tracker is not None:
        save_as_lm_eval(tracker, results, _CHECKPOINT.value or _HF.value)


def save_as_lm_eval(tracker, results: dict, source: str) -> None:
    """lm_eval's own layout (its EvaluationTracker, as `lm_eval --output_path` writes): DIR/<model>/
    results_<time>.json, or PATH_<time>.json for a PATH ending in .json, and with --log_samples one
    samples_<task>_<time>.jsonl per task beside it; <model> is the checkpoint or HF path, sanitized
    as lm_eval does a `pretrained=` path."""
    from lm_eval.utils import sanitize_model_name

    names = tracker.general_config_tracker
    names.model_name, names.model_name_sanitized = source, sanitize_model_name(str(source))
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in results["configs"] if samples else ():
        tracker.save_results_samples(task_name=task, samples=samples[task])
    print(f"wrote the results under {tracker.output_path} (lm_eval's layout)", file=sys.stderr)

if __name__ == "__main__":
    cli.run(main)
