"""GRPO's sampling (zaya_jax.train.grpo_rollout): G completions per prompt drawn by the serving
engine, laid out as train rows. The layout is checked by hand on a small case; on a model, each
row's teacher-forced logits equal those of its prompt and completion alone (left padding,
positions and segments give it the context generation gave it) and pick each greedy token at its
target column, and greedy rows are the static generator's (zaya_jax.infer.static_loop). Sampled rows:
each is what the static generator samples for that prompt alone with the row's documented seed
(SeedSequence([seed, row])), whatever the slot count (fewer slots than rows: rows wait and take the
slots others leave), a group's samples differ, and the same seed gives the same rollout (what an
exact resume replays). The engine is built once and given new weights in place: it then samples
what a fresh engine on those weights samples, and nothing compiles again."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.model_fixtures import random_tiny_model, tiny_model
from tests.test_engine_serving import compilations
from zaya_jax.infer.static_loop import generate_static
from zaya_jax.train.grpo_rollout import completion_rows, rollout_engine, row_seed, sample_groups

PROMPTS, G, T, STOP = [[2, 17, 5, 33], [2, 9], [2, 40, 41]], 4, 6, 5  # 12 rows; STOP ends some completions early


def test_rows_hold_each_prompt_right_aligned_then_its_completion():
    rows = completion_rows([[5, 6, 7], [8]], np.asarray([[9, 1, 0], [10, 11, 12]], np.int32),
                           np.asarray([2, 3], np.int32), width=3, pad_id=0)
    np.testing.assert_array_equal(rows["inputs"], [[5, 6, 7, 9, 1], [0, 0, 8, 10, 11]])
    np.testing.assert_array_equal(rows["targets"], [[6, 7, 9, 1, 0], [0, 8, 10, 11, 12]])
    np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])
    np.testing.assert_array_equal(rows["loss_mask"], [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])


def test_greedy_rows_reproduce_the_generation():
    model = tiny_model()
    prompts = PROMPTS[:2]
    greedy = sample_groups(rollout_engine(model, 4, 4, 5), prompts, 2, 5, temperature=0.0)
    assert greedy.prompt_width == 4 and greedy.completions.shape == (4, 5)
    want = generate_static(model, prompts, 5)
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


@pytest.fixture(scope="module")
def sampled():
    """(the model, the rollout of PROMPTS x G at temperature 1, seed 7, on 3 slots for 12 rows)."""
    model = random_tiny_model()
    return model, sample_groups(rollout_engine(model, 3, 4, T), PROMPTS, G, T, seed=7, stop_ids=(STOP,))


def test_each_sampled_row_is_its_prompt_sampled_alone_with_the_rows_seed(sampled):
    model, rollout = sampled
    rows = [p for p in PROMPTS for _ in range(G)]
    alone = np.concatenate([generate_static(model, [p], T, temperature=1.0, seed=row_seed(7, i), stop_ids=(STOP,))
                            for i, p in enumerate(rows)])
    np.testing.assert_array_equal(rollout.completions, alone)
    stops = {STOP, model.config.eos_token_id}
    ends = [next((t + 1 for t, token in enumerate(row) if token in stops), T) for row in alone.tolist()]
    np.testing.assert_array_equal(rollout.lengths, ends)
    assert min(ends) < T and max(ends) == T       # rows stopped early and left their slots to waiting ones
    assert len({tuple(c) for c in rollout.completions[:G].tolist()}) > 1     # a group's completions differ
    assert [row_seed(7, i) for i in range(len(rows))] == [int(np.random.SeedSequence([7, i]).generate_state(1)[0])
                                                          for i in range(len(rows))]  # row 0 alone hides SeedSequence(7 + i)


def test_the_same_seed_gives_the_same_rollout_on_any_slot_count(sampled):
    model, rollout = sampled
    again = sample_groups(rollout_engine(model, 12, 4, T), PROMPTS, G, T, seed=7, stop_ids=(STOP,))
    np.testing.assert_array_equal(again.completions, rollout.completions)
    for key in rollout.rows:
        np.testing.assert_array_equal(again.rows[key], rollout.rows[key])


def test_new_weights_in_place_sample_as_a_fresh_engine_without_compiling(sampled):
    first, rollout = sampled
    engine = rollout_engine(first, 3, 4, T)
    np.testing.assert_array_equal(sample_groups(engine, PROMPTS, G, T, seed=7, stop_ids=(STOP,)).completions,
                                  rollout.completions)
    second = random_tiny_model(seed=1)
    fresh = sample_groups(rollout_engine(second, 3, 4, T), PROMPTS, G, T, seed=7, stop_ids=(STOP,))
    assert (fresh.completions != rollout.completions).any()
    with compilations() as compiled:
        engine.set_weights(second)
        swapped = sample_groups(engine, PROMPTS, G, T, seed=7, stop_ids=(STOP,))
        engine.set_weights(first)
        back = sample_groups(engine, PROMPTS, G, T, seed=7, stop_ids=(STOP,))
    assert compiled == []
    np.testing.assert_array_equal(swapped.completions, fresh.completions)
    np.testing.assert_array_equal(back.completions, rollout.completions)
    with pytest.raises(ValueError, match="set_weights needs a model of the engine's architecture"):
        engine.set_weights(random_tiny_model(num_layers=1))
