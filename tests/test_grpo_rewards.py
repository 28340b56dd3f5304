"""GRPO's rewards (zaya_jax.train.grpo_rewards): the built-in exact-answer and format rewards on
the demo's questions, their weighted combination, and a user's reward that raises, returns the
wrong count or a non-number, each named in one error."""

import numpy as np
import pytest

from zaya_jax.data import instruction_tasks
from zaya_jax.train.grpo_rewards import RewardError, answer_format, combine_rewards, exact_answer


def test_builtin_rewards_score_the_demo_questions():
    task = instruction_tasks.tasks("heldout", per_kind=1)[0]
    completions = [task.answer, f" {task.answer}.\n", f"{task.answer} because", task.wrong, "", f"{task.answer}\nmore"]
    prompts = [task.prompt_messages()] * len(completions)
    answers = [task.answer] * len(completions)
    assert exact_answer(prompts, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert answer_format(prompts, completions, answer=answers) == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    messages = [[{"role": "assistant", "content": c}] for c in completions]  # TRL's shape for chat prompts
    assert exact_answer(prompts, messages, answer=answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert answer_format(prompts, messages, answer=answers) == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    total, each = combine_rewards([exact_answer, answer_format], [1.0, 0.5], prompts, completions,
                                  {"answer": answers})
    np.testing.assert_array_equal(total, [1.5, 1.0, 0.0, 0.5, 0.0, 1.0])
    assert each.shape == (2, 6)


def test_a_bad_reward_function_is_named():
    def wrong_count(prompts, completions, **columns):
        return [1.0]

    def raises(prompts, completions, **columns):
        raise KeyError("solution")

    def not_a_number(prompts, completions, **columns):
        return [float("nan")] * len(completions)
    for fn, message in ((wrong_count, "wrong_count returned 1 values for 2 completions"),
                        (raises, "raises raised KeyError: 'solution'"),
                        (not_a_number, "not_a_number returned nan: each value must be a finite number")):
        with pytest.raises(RewardError, match=message):
            combine_rewards([exact_answer, fn], None, ["p", "q"], ["1", "2"], {"answer": ["1", "3"]})
    with pytest.raises(RewardError, match="1 reward weights for 2 reward functions"):
        combine_rewards([exact_answer, answer_format], [1.0], ["p"], ["1"], {"answer": ["1"]})
