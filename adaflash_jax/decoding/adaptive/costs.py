"""Step costs of the adaptive decoder, calibrated on the running hardware.

Two kinds of step are timed with the programs' own step functions, at the engine's slot
count, every slot live at half the cache: the AR program's step (`StepCosts.ar_s`) and a
drafted step in each packed shape of `packed_step.engine_shapes` (`verify_s[j]`: drafting,
tree build, packed verify, acceptance and commit; `draft_s` = 0). All shapes go through
one compiled step whose shape is an argument, so calibration compiles two programs. They
are timed in interleaved rounds and the medians made `monotone` (a drafted step never
cheaper than an AR step or a shape it contains): noise that made a 10-token drafted step
look cheaper than an AR step had the decoder draft every step at batch 8 and lose. Rows
are cached per device, attention implementation, target, drafter shape, slot count, cache
length and acceptance rule (`calibration.cached_row`: memory and
`~/.cache/adaflash_jax/step_costs.json`), so a process pays for it once per setting and
later processes not at all.
"""

from __future__ import annotations

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.decoding import engine
from adaflash_jax.decoding.adaptive import programs
from adaflash_jax.decoding.adaptive.packed_step import draft_and_expect, engine_shapes, verify_and_commit
from adaflash_jax.decoding.calibration import cached_row, device_key
from adaflash_jax.decoding.engine_state import DecodeState, EngineConfig, EngineWeights
from adaflash_jax.decoding.verify_plan import PlanParams, ProbeState, StepCosts


def calibrate_adaptive(cfg: EngineConfig, weights: EngineWeights, target_name: str, *, batch: int,
                       repeats: int = 5, use_cache: bool = True) -> StepCosts:
    """Measured StepCosts for the adaptive decoder's engine config at `batch` slots."""
    drafter = nnx.merge(cfg.drafter_def, weights.drafter)
    target = nnx.merge(cfg.target_def, weights.target)
    tcfg, layout = target.cfg, "per_layer" if target.layers.per_layer else "stacked"
    key = json.dumps(["adaptive-v5", *device_key(), cfg.attn_impl, target_name, tcfg.dtype, layout,
                      drafter.cfg.num_layers, drafter.cfg.hidden_size, cfg.block_size, batch, cfg.cache_len,
                      list(cfg.buckets), bool(cfg.greedy)])
    row = cached_row(key, lambda: measure(cfg, weights, batch, repeats), use_cache)
    return StepCosts(jnp.asarray(row["shape_s"], jnp.float32), jnp.float32(0.0), jnp.float32(row["ar_s"]))


def fill_counts(num_slots: int, tokens: int, width: int) -> np.ndarray:
    """Nodes per row that fill a shape: one each, the rest up to `width` from row 0 on."""
    counts = np.ones((num_slots,), np.int32)
    extra = tokens - num_slots
    for i in range(num_slots):
        add = min(width - 1, extra)
        counts[i] += add
        extra -= add
    return counts


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _drafted_step(cfg, weights, state, counts, shape):
    target, drafter = programs.models(cfg, weights)
    tree, mask, _ = draft_and_expect(cfg, target, drafter, state)
    return verify_and_commit(cfg, target, drafter, state, tree, mask, counts, shape)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _ar_step(cfg, weights, state):
    target, drafter = programs.models(cfg, weights)
    return programs.ar_feature_step(cfg, target, drafter, state)


@functools.partial(jax.jit, donate_argnums=0)
def _rewind(state, live):
    """Every slot back at `live` tokens with nothing emitted, in place."""
    zeros = jnp.zeros_like(state.num_out)
    return state.replace(tcache=state.tcache.with_lengths(live), ctx=state.ctx.with_lengths(live),
                         done=jnp.zeros_like(state.done), num_out=zeros, slot_steps=zeros)


def _timed_call(step, state, live) -> tuple[float, DecodeState]:
    """(seconds of `step(state)`, the state rewound): the whole state is the output, donated
    and updated in place as in the decode loop (an output of a few counters would let XLA
    drop the model from the program)."""
    t0 = time.perf_counter()
    state = jax.block_until_ready(step(state))
    return time.perf_counter() - t0, _rewind(state, live)


def monotone(ar_s: float, shapes, shape_s) -> list[float]:
    """Measured costs made consistent with the work each step does: a drafted step does all
    an AR step does and more, and a shape verifying no more tokens at no more width than
    another does no more work. Each cost is raised to the largest cost of AR and of every
    shape it contains, so timing noise never makes drafting look cheaper than it is."""
    out = []
    for tokens, width in shapes:
        inside = [c for (t, w), c in zip(shapes, shape_s) if t <= tokens and w <= width]
        out.append(float(max([ar_s, *inside])))
    return out


def timing_state(cfg: EngineConfig, weights: EngineWeights, batch: int) -> DecodeState:
    """`batch` live slots at half the cache, with their own buffers (init_state may share some)."""
    plan = PlanParams(jnp.float32(1.3), jnp.int32(1),
                      StepCosts(jnp.ones((len(engine_shapes(batch, cfg.buckets)),), jnp.float32), jnp.float32(0.0),
                                jnp.float32(1.0)), jnp.int32(8), ProbeState.fresh(8))
    state = programs.with_buffers(cfg, weights, engine.init_state(cfg, weights, batch, jnp.zeros((0,), jnp.int32),
                                                                  plan))
    state = state.replace(params=state.params.replace(max_new=jnp.full((batch,), 1 << 20, jnp.int32)))
    return _rewind(jax.tree.map(jnp.copy, state), _live(cfg, batch))


def _live(cfg: EngineConfig, batch: int) -> jax.Array:
    return jnp.full((batch,), cfg.cache_len // 2, jnp.int32)


def measure(cfg: EngineConfig, weights: EngineWeights, batch: int, repeats: int = 5) -> dict:
    """{"ar_s": seconds per AR-program step, "shape_s": [seconds per drafted step, per shape]}:
    medians over `repeats` rounds, each round timing the AR step and every shape once (so a
    drift in machine speed touches all alike), after one untimed round; then `monotone`."""
    state, live = timing_state(cfg, weights, batch), _live(cfg, batch)
    shapes = engine_shapes(batch, cfg.buckets)
    steps = [lambda s: _ar_step(cfg, weights, s)]
    steps += [lambda s, j=j, c=fill_counts(batch, *shape): _drafted_step(cfg, weights, s, c, j)
              for j, shape in enumerate(shapes)]
    times = [[] for _ in steps]
    for r in range(repeats + 1):
        for k, step in enumerate(steps):
            seconds, state = _timed_call(step, state, live)
            if r:
                times[k].append(seconds)
    ar_s, *shape_s = (float(np.median(t)) for t in times)
    return {"ar_s": ar_s, "shape_s": monotone(ar_s, shapes, shape_s)}
