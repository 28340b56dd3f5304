"""The bundled demo task set (YAMLs here; their data built by demo_data.py) and the TaskManager that
knows it beside the harness's own tasks and a user's --include_path.

  zaya_demo                 the group of all of them
  zaya_demo_heldout         perplexity (loglikelihood_rolling) of the demo corpus's held-out documents,
                            per source: zaya_demo_heldout_prose / _code / _math
  zaya_demo_cloze           multiple choice: a held-out document's next line among lines of others
  zaya_demo_questions       the post-training demo's held-out questions, answered by generation
                            (exact match, instruction_tasks.is_correct)
  zaya_demo_questions_mc    the same questions, the right answer against the demo's wrong one

task_manager(include_path, metadata), task_names(manager, "a,b") (unknown names refused by name) and
parse_metadata(json_text) serve the CLI and the trainer's hook alike.
"""

from __future__ import annotations

import json
import os

from zaya_jax.errors import UserError

TASKS_DIR = os.path.dirname(os.path.abspath(__file__))


def task_manager(include_path: str | None = None, metadata: dict | None = None):
    """An lm_eval TaskManager that also knows TASKS_DIR and `include_path`; `metadata` reaches every
    task (the demo set reads cache_dir, max_docs, per_kind)."""
    from lm_eval.tasks import TaskManager
    paths = [TASKS_DIR] + ([include_path] if include_path else [])
    return TaskManager(include_path=paths, metadata=metadata)


def task_names(manager, requested: str) -> list[str]:
    """--tasks as a list; UserError naming the unknown ones and where names come from."""
    names = [n.strip() for n in requested.split(",") if n.strip()]
    unknown = [n for n in names if not manager.match_tasks([n]) and not os.path.isfile(n)]
    if unknown:
        local = local_task_names(manager)
        raise UserError(f"--tasks: unknown task {', '.join(unknown)}; the bundled and --include_path tasks are "
                        f"{', '.join(local)}; lm-eval's own are listed by `python -m lm_eval ls tasks`, and "
                        "--include_path DIR adds a directory of task YAMLs")
    return names


def local_task_names(manager) -> list[str]:
    """The names of the tasks and groups from TASKS_DIR and the manager's other include paths (not
    lm-eval's own ~14,700), sorted."""
    roots = tuple(os.path.abspath(p) + os.sep for p in manager.include_path)
    return sorted(name for name, entry in manager.task_index.items()
                  if entry.yaml_path and os.path.abspath(str(entry.yaml_path)).startswith(roots))


def parse_metadata(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        metadata = json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"--metadata {text!r}: not JSON ({err.msg}); e.g. --metadata '{{\"max_docs\": 40}}'") from None
    if not isinstance(metadata, dict):
        raise UserError(f"--metadata {text!r}: must be a JSON object")
    return metadata
