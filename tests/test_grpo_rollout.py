"""GRPO's sampling (zaya_jax.train.grpo_rollout): G completions per prompt from zaya_jax's generation,
laid out as train rows. The layout is checked by hand on a small case; on a model, each row's
teacher-forced logits equal those of its prompt and completion alone (left padding, positions and
segments give it the context generation gave it) and pick each greedy token at its target column,
a group's samples differ
at temperature 1, and the same seed gives the same rollout (what an exact resume replays)."""

import jax.numpy as jnp
import numpy as np

from tests.model_fixtures import tiny_model
from zaya_jax.infer.generate import generate
from zaya_jax.train.grpo_rollout import completion_rows, sample_groups


def test_rows_hold_each_prompt_right_aligned_then_its_completion():
    rows = completion_rows([[5, 6, 7], [8]], np.asarray([[9, 1, 0], [10, 11, 12]], np.int32),
                           np.asarray([2, 3], np.int32), width=3, pad_id=0)
    np.testing.assert_array_equal(rows["inputs"], [[5, 6, 7, 9, 1], [0, 0, 8, 10, 11]])
    np.testing.assert_array_equal(rows["targets"], [[6, 7, 9, 1, 0], [0, 8, 10, 11, 12]])
    np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])
    np.testing.assert_array_equal(rows["loss_mask"], [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])


def test_greedy_rows_reproduce_the_generation_and_samples_differ():
    model = tiny_model()
    prompts = [[2, 17, 5, 33], [2, 9]]
    greedy = sample_groups(model, prompts, 2, 5, temperature=0.0)
    assert greedy.prompt_width == 4 and greedy.completions.shape == (4, 5)
    want = generate(model, prompts, 5)
    np.testing.assert_array_equal(greedy.completions, np.repeat(want, 2, axis=0))
    rows = greedy.rows
    logits = np.asarray(model(jnp.asarray(rows["inputs"]), segment_ids=jnp.asarray(rows["segment_ids"]),
                              positions=jnp.asarray(rows["positions"])))
    for i, length in enumerate(greedy.lengths):
        prompt = prompts[i // 2]
        alone = np.asarray(model(jnp.asarray([prompt + greedy.completions[i, :length - 1].tolist()])))[0]
        start = 4 - len(prompt)                                    # the row's logits equal the sequence's alone
        np.testing.assert_allclose(logits[i, start:3 + length], alone, rtol=1e-5, atol=1e-5)
        columns = np.arange(3, 3 + length)
        np.testing.assert_array_equal(logits[i, columns].argmax(-1), greedy.completions[i, :length])
        np.testing.assert_array_equal(rows["targets"][i, columns], greedy.completions[i, :length])
        assert rows["loss_mask"][i].sum() == length
    sampled = sample_groups(model, prompts, 4, 5, temperature=1.0, seed=3)
    assert len({tuple(c) for c in sampled.completions[:4].tolist()}) > 1     # a group's completions differ
    again = sample_groups(model, prompts, 4, 5, temperature=1.0, seed=3)
    np.testing.assert_array_equal(again.completions, sampled.completions)
    for key in sampled.rows:
        np.testing.assert_array_equal(again.rows[key], sampled.rows[key])
