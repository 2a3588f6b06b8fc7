"""Step costs of the adaptive decoder, calibrated on the running hardware.

Two kinds of step are timed with the programs' own step functions, at the engine's slot
count, every slot live at half the cache: the AR program's step (`StepCosts.ar_s`) and a
drafted step in each packed shape of `packed_step.engine_shapes` (`verify_s[j]`: drafting,
tree build, packed verify, acceptance and commit; `draft_s` = 0). All shapes go through
one compiled step whose shape is an argument, so calibration compiles two programs. Rows
are cached per device, attention implementation, target, drafter shape, slot count, cache
length and acceptance rule (`calibration.cached_row`: memory and
`~/.cache/adaflash_jax/step_costs.json`), so a process pays for it once per setting and
later processes not at all.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.decoding import engine
from adaflash_jax.decoding.adaptive import programs
from adaflash_jax.decoding.adaptive.packed_step import draft_and_expect, engine_shapes, verify_and_commit
from adaflash_jax.decoding.calibration import cached_row, device_key
from adaflash_jax.decoding.engine_state import EngineConfig, EngineWeights
from adaflash_jax.decoding.step_costs import median_time
from adaflash_jax.decoding.verify_plan import PlanParams, ProbeState, StepCosts


def calibrate_adaptive(cfg: EngineConfig, weights: EngineWeights, target_name: str, *, batch: int,
                       repeats: int = 3, use_cache: bool = True) -> StepCosts:
    """Measured StepCosts for the adaptive decoder's engine config at `batch` slots."""
    drafter = nnx.merge(cfg.drafter_def, weights.drafter)
    tcfg = nnx.merge(cfg.target_def, weights.target).cfg
    key = json.dumps(["adaptive-v1", *device_key(), cfg.attn_impl, target_name, tcfg.dtype, drafter.cfg.num_layers,
                      drafter.cfg.hidden_size, cfg.block_size, batch, cfg.cache_len, list(cfg.buckets),
                      bool(cfg.greedy)])
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


@functools.partial(jax.jit, static_argnums=0)
def _drafted_step(cfg, weights, state, counts, shape):
    target, drafter = programs.models(cfg, weights)
    tree, mask, _ = draft_and_expect(cfg, target, drafter, state)
    return verify_and_commit(cfg, target, drafter, state, tree, mask, counts, shape).num_out


@functools.partial(jax.jit, static_argnums=0)
def _ar_step(cfg, weights, state):
    target, drafter = programs.models(cfg, weights)
    return programs.ar_feature_step(cfg, target, drafter, state).num_out


def measure(cfg: EngineConfig, weights: EngineWeights, batch: int, repeats: int = 3) -> dict:
    """{"ar_s": seconds per AR-program step, "shape_s": [seconds per drafted step, per shape]}."""
    plan = PlanParams(jnp.float32(1.3), jnp.int32(1),
                      StepCosts(jnp.ones((len(engine_shapes(batch, cfg.buckets)),), jnp.float32), jnp.float32(0.0),
                                jnp.float32(1.0)), jnp.int32(8), ProbeState.fresh(8))
    state = engine.init_state(cfg, weights, batch, jnp.zeros((0,), jnp.int32), plan)
    target, drafter = programs.models(cfg, weights)
    live = jnp.full((batch,), cfg.cache_len // 2, jnp.int32)
    width = len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size
    state = state.replace(tcache=state.tcache.with_lengths(live), ctx=state.ctx.with_lengths(live),
                          done=jnp.zeros((batch,), bool), pending=jnp.zeros((batch, programs.RING, width), jnp.float32),
                          params=state.params.replace(max_new=jnp.full((batch,), 1 << 20, jnp.int32)))
    shape_s = [median_time(lambda s, j=j, c=fill_counts(batch, *shape): _drafted_step(cfg, weights, s, c, j),
                           state, repeats=repeats)
               for j, shape in enumerate(engine_shapes(batch, cfg.buckets))]
    return {"ar_s": median_time(lambda s: _ar_step(cfg, weights, s), state, repeats=repeats), "shape_s": shape_s}
