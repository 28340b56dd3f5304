"""zaya_jax.engine.generate(..., slots=N): the prompts through the serving engine's continuous batching
(zaya_jax.engine.batch). Against the static loop (zaya_jax.infer.static_loop's compiled loop, another
code path): five ragged prompts on two slots, some stopping early on a stop id, give the static
loop's greedy tokens, and the engine's steps are what ran them. A sampled row is what the static
loop samples for that prompt alone with the row's seed."""

import numpy as np
import pytest

from tests.model_fixtures import tiny_model
from zaya_jax.engine import generate
from zaya_jax.engine.engine import Engine

PROMPTS = [[2, 17, 5, 33], [2, 9], [2, 40, 41], [7], [3, 4, 5, 6, 8, 10]]
NEW, STOPS = 6, (9, 41)  # the tiny model repeats a prompt's last token: rows 1 and 2 stop at once


def test_slots_give_the_static_loops_greedy_tokens_through_the_engine(monkeypatch):
    model = tiny_model()
    steps = []
    original = Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: steps.append(1) or original(self))
    engine_tokens = generate(model, PROMPTS, NEW, stop_ids=STOPS, slots=2)
    static = generate(model, PROMPTS, NEW, stop_ids=STOPS)
    np.testing.assert_array_equal(engine_tokens, static)
    pad = model.config.pad_token_id
    assert any(row[-1] == pad for row in static) and any(row[-1] != pad for row in static)  # rows end apart
    assert steps  # the engine ran them (the static loop steps no engine)


def test_a_sampled_row_is_its_prompt_sampled_alone_with_the_rows_seed():
    model = tiny_model()
    sampled = generate(model, PROMPTS[:3], NEW, temperature=1.0, seed=7, slots=2)
    for i, prompt in enumerate(PROMPTS[:3]):
        # the documented seed of row i, written out (rows 1 and 2: SeedSequence(7 + i) differs there)
        seed = int(np.random.SeedSequence([7, i]).generate_state(1)[0])
        alone = generate(model, [prompt], NEW, temperature=1.0, seed=seed)
        np.testing.assert_array_equal(sampled[i], alone[0], err_msg=f"row {i}")


@pytest.mark.parametrize("kwargs, message", [
    (dict(slots=0), "slots must be a positive integer"),
    (dict(slots=2, on_token=lambda step, tokens: None), "on_token streams the static loop's columns"),
])
def test_bad_slot_arguments_fail_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(tiny_model(), PROMPTS, NEW, **kwargs)
