"""The bundled demo task set (YAMLs here; their data built by demo_data.py) and the TaskManager that
knows it beside the harness's own tasks and a user's --include_path.

  zaya_demo                 the group of all of them
  zaya_demo_heldout         perplexity (loglikelihood_rolling) of the demo corpus's held-out documents,
                            per source: zaya_demo_heldout_prose / _code / _math
  zaya_demo_cloze           multiple choice: a held-out document's next line among lines of others
  zaya_demo_questions       the post-training demo's held-out questions, answered by generation
                            (exact match, instruction_tasks.is_correct)
  zaya_demo_questions_mc    the same questions, the right answer against the demo's wrong one
"""

from __future__ import annotations

import os

TASKS_DIR = os.path.dirname(os.path.abspath(__file__))


def task_manager(include_path: str | None = None, metadata: dict | None = None):
    """An lm_eval TaskManager that also knows TASKS_DIR and `include_path`; `metadata` reaches every
    task (the demo set reads cache_dir, max_docs, per_kind)."""
    from lm_eval.tasks import TaskManager
    paths = [TASKS_DIR] + ([include_path] if include_path else [])
    return TaskManager(include_path=paths, metadata=metadata)
