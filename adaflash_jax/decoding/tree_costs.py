"""Calibrating the "auto" tree budget's step costs on the running hardware.

A tree step of budget N (draft, tree build, tree forward, acceptance, compaction,
commit) is timed as one call of the engine's own fixed-budget step at the
engine's padded batch, half-full caches and the call's acceptance rule (greedy
or sampled: sampling scores every node over the vocabulary), so drafting is
folded into each budget's time (`StepCosts.draft_s` = 0) and budget 1 is the AR
step. Rows are cached as the chain policy's are (`calibration.cached_row`).
"""

from __future__ import annotations

import json

import jax.numpy as jnp

from adaflash_jax.decoding import engine
from adaflash_jax.decoding.calibration import cached_row, device_key
from adaflash_jax.decoding.engine_state import EngineConfig, EngineWeights
from adaflash_jax.decoding.step_costs import median_time
from adaflash_jax.decoding.verify_plan import StepCosts


def _key(target, drafter, batch: int, cache_len: int, budgets, greedy: bool, attn_impl: str) -> str:
    return json.dumps(["tree-v2", *device_key(), attn_impl, target.name, target.cfg.dtype, target.layer_layout,
                       drafter.cfg.num_layers, drafter.cfg.hidden_size, drafter.block_size, batch,
                       cache_len, list(budgets), bool(greedy)])


def calibrate_tree(target, drafter, *, batch: int, cache_len: int, budgets: tuple[int, ...],
                   greedy: bool = True, context: int | None = None, repeats: int = 3,
                   use_cache: bool = True, attn_impl: str = "xla") -> StepCosts:
    """Measured StepCosts for the tree policy: verify_s[k] = seconds of one step of budgets[k]."""
    key = _key(target, drafter, batch, cache_len, budgets, greedy, attn_impl)
    row = cached_row(key, lambda: measure_tree(target, drafter, batch=batch, cache_len=cache_len,
                                               budgets=budgets, greedy=greedy, context=context,
                                               repeats=repeats, attn_impl=attn_impl), use_cache)
    return StepCosts(jnp.asarray(row["step_s"], jnp.float32), jnp.float32(0.0), jnp.float32(row["step_s"][0]))


def measure_tree(target, drafter, *, batch: int, cache_len: int, budgets: tuple[int, ...], greedy: bool = True,
                 context: int | None = None, repeats: int = 3, attn_impl: str = "xla") -> dict:
    """{"step_s": [seconds per step of each budget]} with every slot live at `context` tokens."""
    context = context if context is not None else cache_len // 2
    weights = EngineWeights(target.state, drafter.state)
    times = []
    for n in budgets:
        cfg = EngineConfig(target_def=target.graphdef, cache_len=cache_len, max_new_cap=16, greedy=greedy,
                           attn_impl=attn_impl, drafter_def=drafter.graphdef, block_size=drafter.block_size,
                           verify="tree", tree_budget=n)
        state = engine.init_state_jit(cfg, weights, batch, jnp.zeros((0,), jnp.int32))
        live = jnp.full((batch,), context, jnp.int32)
        state = state.replace(tcache=state.tcache.with_lengths(live), ctx=state.ctx.with_lengths(live),
                              done=jnp.zeros((batch,), bool),
                              params=state.params.replace(max_new=jnp.full((batch,), 1 << 20, jnp.int32)))
        times.append(median_time(lambda s, cfg=cfg: engine.step_jit(cfg, weights, s).num_out, state,
                                 repeats=repeats))
    return {"step_s": times}
