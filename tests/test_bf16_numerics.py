"""With model.dtype=bfloat16: the LM head multiplies bf16 operands into fp32, the router runs in fp32.

Read from the traced program (every dot_general's operand and result dtypes), and checked
against the fp32 model: the bf16 router picks the experts the fp32 router picks on the same input.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.model.build import create_model

CFG = model_config(load_config_file("configs/tiny.py"))


def dots(fn, *args, primitives=("dot_general",)) -> list[tuple[tuple[str, ...], str]]:
    """[(operand dtypes, result dtype)] of every dot_general (or other of `primitives`) in fn's
    jaxpr, sub-jaxprs included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in primitives:
                found.append((tuple(str(v.aval.dtype) for v in eqn.invars), str(eqn.outvars[0].aval.dtype)))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_lm_head_bf16_operands_fp32_accumulation():
    model = create_model(CFG.replace(dtype="bfloat16"))
    hidden = jnp.ones((2, 8, CFG.hidden_size), jnp.bfloat16)
    assert dots(model.logits, hidden) == [(("bfloat16", "bfloat16"), "float32")]
    fp32 = create_model(CFG)
    assert dots(fp32.logits, hidden.astype(jnp.float32)) == [(("float32", "float32"), "float32")]


def first_router(model):
    graphdef, state = nnx.split(model.layers)  # stacked layers: layer 0's slice
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state)).moe.router


def test_router_runs_in_fp32_and_chooses_as_the_fp32_model():
    router = first_router(create_model(CFG.replace(dtype="bfloat16")))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16, CFG.hidden_size)), jnp.bfloat16)
    prev = jnp.zeros((2, 16, CFG.router_hidden_size), jnp.float32)
    assert set(dots(router, x, prev)) == {(("float32", "float32"), "float32")}
    routing = router(x, prev)
    expected = first_router(create_model(CFG))(x.astype(jnp.float32), prev)  # same seed, fp32 throughout
    np.testing.assert_array_equal(routing.choice, expected.choice)
    assert routing.next_state.dtype == jnp.float32
