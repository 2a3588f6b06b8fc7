"""Isolated timings of the pieces of one decode step (draft, verify, AR step).

The engine runs as one fused `while_loop`, so its phases cannot be timed from
the inside; these jitted stand-alone calls at the same shapes measure each
piece, and `split_time` apportions a measured run between drafting and
verifying. Medians of repeats, after a compile call.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.decoding.autoregressive import new_cache
from adaflash_jax.models import draft_vocab
from adaflash_jax.models.drafter import draft_block, new_context_cache


def timed_runs(fn, *args, repeats: int):
    """(output of one untimed call, seconds of each of `repeats` timed calls to fn(*args))."""
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return out, times


def median_time(fn, *args, repeats: int) -> float:
    return float(np.median(timed_runs(fn, *args, repeats=repeats)[1]))


@functools.partial(jax.jit, static_argnames=("target_def", "num_tokens", "layer_ids", "attn_impl"))
def _target_step(target_def, tstate, cache, tokens, *, num_tokens, layer_ids, attn_impl="xla"):
    target = nnx.merge(target_def, tstate)
    out = target(tokens[:, :num_tokens], cache=cache, feature_layers=layer_ids, attn_impl=attn_impl)
    return target.logits(out.hidden), out.features


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "attn_impl"))
def _draft_step(target_def, drafter_def, tstate, dstate, anchors, ctx, attn_impl="xla"):
    target = nnx.merge(target_def, tstate)
    drafter = nnx.merge(drafter_def, dstate)
    return draft_vocab.logits(target, drafter, draft_block(drafter, target.embed_tokens, anchors, ctx,
                                                          attn_impl=attn_impl)[:, 1:])


def measure_step_costs(target, drafter=None, *, batch: int, context: int = 128,
                       cache_len: int = 512, verify_tokens: int | None = None,
                       repeats: int = 5, attn_impl: str = "xla") -> dict:
    """Seconds per call: `ar_step` (1 token), `verify` (verify_tokens), `draft` (one block),
    each run with the kernels of `attn_impl` (the decode being profiled uses them)."""
    model = target.model
    cache = new_cache(model, batch, cache_len).with_lengths(jnp.full((batch,), context, jnp.int32))
    width = verify_tokens or (drafter.block_size if drafter is not None else 1)
    tokens = jnp.ones((batch, max(width, 1)), jnp.int32)
    layer_ids = tuple(drafter.cfg.target_layer_ids) if drafter is not None else ()
    costs = {"ar_step_s": median_time(functools.partial(
        _target_step, target.graphdef, num_tokens=1, layer_ids=(), attn_impl=attn_impl),
        target.state, cache, tokens, repeats=repeats)}
    if drafter is not None:
        costs["verify_s"] = median_time(functools.partial(
            _target_step, target.graphdef, num_tokens=width, layer_ids=layer_ids, attn_impl=attn_impl),
            target.state, cache, tokens, repeats=repeats)
        costs["draft_s"] = measure_draft(target, drafter, batch=batch, context=context,
                                         cache_len=cache_len, repeats=repeats, attn_impl=attn_impl)
    return costs


def measure_draft(target, drafter, *, batch: int, context: int, cache_len: int, repeats: int = 5,
                  attn_impl: str = "xla") -> float:
    """Seconds per drafter block (with LM head) at `batch`, `context` cached positions."""
    ctx = new_context_cache(drafter.module, batch, cache_len).with_lengths(
        jnp.full((batch,), context, jnp.int32))
    return median_time(functools.partial(_draft_step, target.graphdef, drafter.graphdef,
                                         attn_impl=attn_impl),
                        target.state, drafter.state, jnp.ones((batch,), jnp.int32), ctx,
                        repeats=repeats)


def split_time(wall_s: float, steps: int, costs: dict) -> dict:
    """Apportions a speculative run's wall time to draft / verify / engine overhead."""
    draft, verify = costs["draft_s"] * steps, costs["verify_s"] * steps
    return {"draft_time_s": draft, "verify_time_s": verify,
            "other_time_s": max(wall_s - draft - verify, 0.0),
            "overhead_vs_verify": (wall_s / steps - costs["verify_s"]) / costs["verify_s"]
            if steps else 0.0}
