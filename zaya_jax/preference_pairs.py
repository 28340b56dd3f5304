"""On-policy DPO pairs: the model's own wrong answers to the training questions. Prints JSON.

  python -m zaya_jax.preference_pairs --checkpoint runs/demo_sft --output runs/demo_sft_pairs

The checkpoint's model (the SFT demo's) answers the TRAINING questions of
zaya_jax.data.instruction_tasks (`--per_kind` of each kind: those demo:chat trains on; never a
held-out one) by greedy generation, exactly as evaluate_tasks scores it. Each question it gets
wrong becomes a pair: chosen = the correct answer, rejected = the model's own completion (what
greedy decoding actually produces, so DPO pushes down the mistakes the model makes rather than
synthetic ones). A question it answers right gives a pair whose rejected answer is the task's
near miss (off by one or two) unless `--nonear_miss_for_correct`.

The pairs are written as TRL's conversational preference records to OUTPUT/pairs.jsonl and
prepared there as a preference dataset (`zaya_jax.data.prepare --kind preference`, with the
run's tokenizer and the chat template), in the order of the questions, so a data config's
`heldout_fraction` makes its trailing pairs a validation split of training questions. OUTPUT is
built beside itself and renamed into place (whole or absent); OUTPUT/pairs_made_from.json
records the checkpoint, its step and the counts.

The command holds its flags; the pairs are zaya_jax.evaluation.onpolicy_pairs'.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

from absl import app, flags

from zaya_jax import cli
from zaya_jax.data import demo_posttrain, instruction_tasks
from zaya_jax.errors import UserError
from zaya_jax.evaluation import answering
from zaya_jax.evaluation.answering import define_answering_flags, load_checkpoint
from zaya_jax.evaluation.onpolicy_pairs import onpolicy_records, template_file, write_pairs
from zaya_jax.evaluation.tasks import answer_tasks


def define_flags() -> None:
    """The CLI's flags, defined only when this module runs as the CLI."""
    define_answering_flags(per_kind=demo_posttrain.task_counts()[0],
                           per_kind_help="Training questions of each kind (default: all those demo:chat holds).",
                           batch_size=250)
    flags.adopt_module_key_flags(answering)  # --help lists them as this command's own
    flags.DEFINE_string("output", None, "Directory to create: pairs.jsonl and the prepared dataset.", required=True)
    flags.DEFINE_bool("near_miss_for_correct", True,
                      "Also a pair for each question answered right, rejected = its near miss.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if os.path.exists(f.output):
        raise UserError(f"--output {f.output} already exists; delete it or choose another directory")
    start = time.perf_counter()
    template = template_file(f.checkpoint, f.chat_template)
    model, step, tokenizer = load_checkpoint(f.checkpoint, f.step, f.tokenizer)
    tasks = instruction_tasks.tasks("train", f.per_kind, f.seed)
    completions = answer_tasks(model, tokenizer, template, tasks, f.max_new_tokens, f.batch_size)
    records = onpolicy_records(tasks, completions, f.near_miss_for_correct)
    if not records:
        raise UserError(f"--checkpoint {f.checkpoint}: no pairs from its answers to {len(tasks)} training questions "
                        "(every wrong answer was blank" + (", and --nonear_miss_for_correct); drop that flag"
                                                           if not f.near_miss_for_correct else "); train it further"))
    wrong = collections.Counter(t.kind for t, c in zip(tasks, completions) if not instruction_tasks.is_correct(t, c))
    made_from = {"checkpoint": os.path.abspath(f.checkpoint), "step": step, "questions": len(tasks),
                 "wrong_by_kind": {k: wrong[k] for k in instruction_tasks.KINDS},
                 "train_accuracy": round(1 - sum(wrong.values()) / len(tasks), 4),
                 "near_miss_for_correct": f.near_miss_for_correct, "pairs": len(records)}
    cfg = model.config
    write_pairs(f.output, records, tokenizer_path=tokenizer.path, template_path=template.path,
                ids=(cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id), made_from=made_from)
    print(f"[{len(tasks)} questions answered and {len(records)} pairs prepared in "
          f"{time.perf_counter() - start:.1f}s]", file=sys.stderr)
    print(json.dumps({"output": f.output, **made_from}, indent=2))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
