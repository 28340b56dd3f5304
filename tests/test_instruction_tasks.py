"""The post-training demo's generated instruction tasks: answers checked by running the question,
disjoint splits, and the answer extractor of the accuracy command."""

import contextlib
import io
import re

import pytest

from zaya_jax.data import instruction_tasks
from zaya_jax.evaluation.tasks import score


def _run_question(task):
    """What the question asks, computed by Python itself: the sum, or the printed line of the code."""
    if task.kind == "add":
        return str(eval(re.fullmatch(r"What is (\d+ \+ \d+)\?", task.question)[1]))  # noqa: S307
    code = re.fullmatch(r"What does `(.+)` print\?", task.question)[1]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})  # noqa: S102
    return out.getvalue().strip()


@pytest.mark.parametrize("split", instruction_tasks.SPLITS)
def test_answers_are_what_python_computes_and_wrong_answers_are_near_misses(split):
    tasks = instruction_tasks.tasks(split, 100)
    assert [t.kind for t in tasks[:5]] == list(instruction_tasks.KINDS)
    for task in tasks:
        assert task.answer == _run_question(task), task
        assert task.wrong != task.answer and re.fullmatch(r"\d+", task.wrong), task
        assert abs(int(task.wrong) - int(task.answer)) <= 2, task  # a near miss
        assert len(task.answer) <= 2


def test_splits_are_disjoint_deterministic_and_heldout_distinct():
    train = instruction_tasks.tasks("train", 1000)
    heldout = instruction_tasks.tasks("heldout", 100)
    assert not {t.question for t in train} & {t.question for t in heldout}
    assert len({t.question for t in heldout}) == len(heldout) == 500
    assert all(instruction_tasks.is_heldout(t.question) for t in heldout)
    assert instruction_tasks.tasks("heldout", 100) == heldout
    assert instruction_tasks.tasks("heldout", 100, seed=1) != heldout
    assert instruction_tasks.tasks("train", 10) == train[:50]  # a longer list extends a shorter one
    # the held-out bucket is about 1 in HELDOUT_BUCKETS of all questions drawn
    drawn = [instruction_tasks.draw("max", i) for i in range(2000)]
    assert 0.07 < sum(instruction_tasks.is_heldout(t.question) for t in drawn) / len(drawn) < 0.13


def test_a_split_that_runs_out_of_questions_says_so():
    with pytest.raises(ValueError, match="add: only .* heldout questions"):
        instruction_tasks.kind_tasks("add", "heldout", 200)  # 31 * 31 sums, about a tenth held out


def test_records_hold_question_answer_and_wrong_answer():
    task = instruction_tasks.Task("add", "What is 2 + 3?", "5", "6")
    assert task.chat_record() == {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                                               {"role": "assistant", "content": "5"}]}
    assert task.preference_record() == {"prompt": [{"role": "user", "content": "What is 2 + 3?"}],
                                        "chosen": [{"role": "assistant", "content": "5"}],
                                        "rejected": [{"role": "assistant", "content": "6"}]}


@pytest.mark.parametrize("completion, correct", [
    (" 42", True), ("42", True), ("42.", True), (" 42 \nUser: What is 1 + 1?", True), ("\n42", True),
    ("420", False), ("4 2", False), (" 41", False), ("", False), ("The answer is 42", False), ("42, 43", False),
])
def test_exact_match_on_handwritten_completions(completion, correct):
    task = instruction_tasks.Task("add", "What is 20 + 22?", "42", "43")
    assert instruction_tasks.is_correct(task, completion) is correct


def test_score_counts_per_kind():
    tasks = [instruction_tasks.Task("add", "q1", "1", "2"), instruction_tasks.Task("add", "q2", "3", "4"),
             instruction_tasks.Task("max", "q3", "5", "6")]
    result = score(tasks, [" 1", " 4", "5\n"])
    assert result["accuracy"] == round(2 / 3, 4) and result["questions"] == 3 and result["correct"] == "101"
    assert result["accuracy_by_kind"] == {"add": 0.5, "max": 1.0}
    assert [e["correct"] for e in result["examples"]["add"]] == [True, False]
