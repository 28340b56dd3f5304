"""SwiGLU experts over expert-sorted rows, one window of rows at a time (the `tiles` backend).

Rows arrive sorted by expert: expert e owns rows [start_e, start_e + n_e). A loop over the
experts reads each expert's weights once; an inner loop walks that expert's run in windows of
W rows (the last one partial) and runs the expert's three matmuls on each:

    window j of expert e: rows [start_e + j W, start_e + (j+1) W), the first
                          min(W, n_e - j W) of them valid; y[valid rows] = SwiGLU_e(x[rows])

Work is sum_e ceil(n_e / W) windows (at most ceil(T / W) + E), with no copies of the weights
beyond one per expert. The inner trip count is data-dependent, which reverse-mode autodiff
cannot take, hence the custom VJP: its backward walks the same windows, sums each expert's
weight gradients over its windows in float32 (starting from the first window's, so no zero-filled
[E, ...] buffers; a scan over the experts stacks them) and writes the input gradient window by
window.
Forward saves the two pre-activations [T, I] (what autodiff of a dense SwiGLU would save).

Shapes: T rows, D hidden, I expert hidden, E experts, W window rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class ExpertRuns(NamedTuple):
    """Where each expert's rows are in the sorted buffer."""
    start: jax.Array  # [E] int32 first row
    size: jax.Array   # [E] int32 rows


def exclusive_cumsum(sizes: jax.Array) -> jax.Array:
    """[n] sizes of consecutive runs -> [n] their starts."""
    return jnp.cumsum(sizes) - sizes


def expert_runs(group_sizes: jax.Array) -> ExpertRuns:
    """group_sizes: [E] rows per expert, runs in expert order -> their starts and sizes."""
    sizes = group_sizes.astype(jnp.int32)
    return ExpertRuns(exclusive_cumsum(sizes), sizes)


def _window(buf: jax.Array, start: jax.Array, window: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(buf, start, window)


def _expert(w: jax.Array, e: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(w, e, keepdims=False)


def _put_valid(buf: jax.Array, rows: jax.Array, start: jax.Array, valid: jax.Array) -> jax.Array:
    """buf[start:start+W] = rows where the row is valid, unchanged elsewhere."""
    keep = (jnp.arange(rows.shape[0]) < valid)[:, None]
    return jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(keep, rows, _window(buf, start, rows.shape[0])),
                                               start, 0)


def _walk_run(runs: ExpertRuns, e: jax.Array, window: int, per_window, carry, first: int = 0):
    """carry = per_window(first row, valid rows, carry) over the windows of expert e's run,
    from window number `first` on."""
    start, size = runs.start[e], runs.size[e]
    return jax.lax.fori_loop(first, (size + window - 1) // window,
                             lambda j, c: per_window(start + j * window, jnp.minimum(window, size - j * window), c),
                             carry)


def _weights_of(e: jax.Array, *weights: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(_expert(w, e) for w in weights)


def _forward(x, gate, up, down, runs: ExpertRuns, window: int):
    """x: [T+W, D] sorted rows padded by W -> y [T+W, D] (0 outside runs), gate_pre, up_pre [T+W, I]."""
    t, d = x.shape
    i = gate.shape[-1]

    def per_window(weights, start, valid, carry):
        y, gate_pre, up_pre = carry
        g_w, u_w, d_w = weights
        xw = _window(x, start, window)
        g, u = xw @ g_w, xw @ u_w
        return (_put_valid(y, (jax.nn.silu(g) * u) @ d_w, start, valid),
                jax.lax.dynamic_update_slice_in_dim(gate_pre, g, start, 0),
                jax.lax.dynamic_update_slice_in_dim(up_pre, u, start, 0))

    def expert_body(e, carry):
        return _walk_run(runs, e, window, functools.partial(per_window, _weights_of(e, gate, up, down)), carry)

    init = (jnp.zeros((t, d), x.dtype), jnp.zeros((t, i), x.dtype), jnp.zeros((t, i), x.dtype))
    return jax.lax.fori_loop(0, gate.shape[0], expert_body, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def expert_windows(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, runs: ExpertRuns,
                   window: int) -> jax.Array:
    """x: [T+W, D] expert-sorted rows padded with W rows; gate, up: [E, D, I]; down: [E, I, D]
    -> [T+W, D]: SwiGLU of each row's expert on the rows of `runs`, 0 on the others."""
    return _forward(x, gate, up, down, runs, window)[0]


def _expert_windows_fwd(x, gate, up, down, runs, window):
    y, gate_pre, up_pre = _forward(x, gate, up, down, runs, window)
    return y, (x, gate, up, down, runs, gate_pre, up_pre)


def _expert_windows_bwd(window, residuals, dy):
    x, gate, up, down, runs, gate_pre, up_pre = residuals
    f32 = jnp.float32
    dot_t = lambda a, b: jnp.dot(a.T, b, preferred_element_type=f32)  # noqa: E731

    def window_grads(weights, start, valid):
        g_w, u_w, d_w = weights
        dyw = jnp.where((jnp.arange(window) < valid)[:, None], _window(dy, start, window), 0)
        xw, g, u = _window(x, start, window), _window(gate_pre, start, window), _window(up_pre, start, window)
        sig = jax.nn.sigmoid(g)
        silu = g * sig
        dh = dyw @ d_w.T
        dg = dh * u * (sig * (1 + g * (1 - sig)))
        du = dh * silu
        return dg @ g_w.T + du @ u_w.T, (dot_t(xw, dg), dot_t(xw, du), dot_t(silu * u, dyw))

    def per_window(weights, start, valid, carry):
        dx, sums = carry
        dxw, more = window_grads(weights, start, valid)
        return _put_valid(dx, dxw, start, valid), tuple(a + b for a, b in zip(sums, more))

    def expert_body(dx, e):
        weights = _weights_of(e, gate, up, down)
        # the first window (all rows masked when the run is empty) starts the weight-gradient sums
        start, valid = runs.start[e], jnp.minimum(window, runs.size[e])
        dxw, sums = window_grads(weights, start, valid)
        dx, sums = _walk_run(runs, e, window, functools.partial(per_window, weights),
                             (_put_valid(dx, dxw, start, valid), sums), first=1)
        return dx, tuple(acc.astype(w.dtype) for acc, w in zip(sums, (gate, up, down)))

    dx, (d_gate, d_up, d_down) = jax.lax.scan(expert_body, jnp.zeros_like(x), jnp.arange(gate.shape[0]))
    return dx, d_gate, d_up, d_down, None


expert_windows.defvjp(_expert_windows_fwd, _expert_windows_bwd)
