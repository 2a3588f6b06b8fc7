"""The host side of the adaptive decoder: compile its programs, then run whichever the
last one's flags ask for until every row is done (`programs`).

A program runs many steps on the device before it returns (a run of AR steps ends when
a probe is due or drafting pays, a run of tree steps when drafting stops paying), so the
host reads its flags per phase, not per step. It also times each run and corrects the
step costs the policy plans with by what the runs took (`online_costs`).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from adaflash_jax.decoding.adaptive import online_costs, programs, realized_gain
from adaflash_jax.decoding.compile_cache import compiled
from adaflash_jax.decoding.engine_state import DecodeOutput, DecodeState, EngineConfig, EngineWeights
from adaflash_jax.decoding.verify_plan import ProbeState

_LOOPS = {"ar": programs.ar_run_jit, "catch_up": programs.catch_up_jit, "probe": programs.probe_run_jit,
          "spec": programs.spec_run_jit}


def decode_adaptive(cfg: EngineConfig, weights: EngineWeights, tokens: jax.Array, lengths: jax.Array,
                    params, eos_ids: jax.Array, plan, learn_costs: bool = False) -> tuple[DecodeOutput, dict]:
    """Row i of tokens [B, T] in slot i, decoded to completion by the adaptive policy
    (cfg: a tree config with policy "auto"). learn_costs: the plan's costs are a calibration,
    to be corrected by the runs' timings (`online_costs`); given costs are used as they are.
    Returns the output (as `engine.decode_batch`)
    and {"compile_time_s", "wall_time_s" (prefill and decoding, compilation excluded),
    "program_runs": {"ar", "catch_up", "probe", "spec"}: device loops run, "ar_steps", and with
    learn_costs "cost_scales": the corrections of the AR and drafted step costs at the end, and
    "realized_gain": the factor on expected drafts at the end (`realized_gain`; with learn_costs it
    carries over to the next call with these drafter weights)}."""
    limit = jnp.int32(cfg.max_new_cap)
    args = (weights, tokens, lengths, params, eos_ids, plan, limit)
    start, compile_s = compiled(programs.start_jit, (cfg,), args, {})
    t0 = time.perf_counter()
    state, flags = start(*args)
    if learn_costs:  # go on from what drafting delivered in the last call
        gain = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding),
                            realized_gain.carried(weights.drafter, cfg.greedy), state.policy.gain)
        state = state.replace(policy=state.policy.replace(gain=gain))
    exes = {}
    for name, fn in _LOOPS.items():  # for the state's own shardings (a mesh shards the caches)
        exes[name], seconds = compiled(fn, (cfg,), (weights, state, limit), {})
        compile_s += seconds
        t0 += seconds  # compilation is never timed
    runs = dict.fromkeys(_LOOPS, 0)
    scales = online_costs.scales_for((cfg, state.num_slots), state.plan.costs) if learn_costs else None
    if scales is not None:
        decide, seconds = compiled(programs.flags_jit, (cfg,), (state, limit), {})
        compile_s, t0 = compile_s + seconds, t0 + seconds
    flags = np.asarray(flags)
    while not flags[programs.FINISHED]:
        if scales is not None:  # plan with the calibration scaled by what the runs took, and decide so
            state = state.replace(plan=state.plan._replace(costs=scales.apply(state.plan.costs)))
            drafted_scale = scales.scales()[1]
            flags = np.asarray(decide(state, limit))
        name = programs.next_program(flags)
        began = time.perf_counter()
        state, flags, spent = exes[name](weights, state, limit)
        flags = np.asarray(flags)
        if scales is not None:
            steps, predicted = np.asarray(spent).tolist()
            scales.observe(name, time.perf_counter() - began, steps, predicted / drafted_scale)
        runs[name] += 1
    out = _output(state, params)
    jax.block_until_ready(out)
    wall = time.perf_counter() - t0
    stats = {"compile_time_s": compile_s, "wall_time_s": wall, "program_runs": runs,
             "ar_steps": int(out.steps) - int(out.drafted_steps),
             "realized_gain": float(state.policy.gain.factor())}
    if learn_costs:
        realized_gain.keep(weights.drafter, cfg.greedy, state.policy.gain)
    if scales is not None:
        stats["cost_scales"] = dict(zip(("ar", "drafted"), scales.scales()))
    return out, stats


def _output(state: DecodeState, params) -> DecodeOutput:
    real = (params.max_new > 0).astype(jnp.float32)  # the next call starts from the real rows' mean
    p = jnp.sum(state.policy.p_est * real) / jnp.maximum(jnp.sum(real), 1.0)
    probe = ProbeState(p, state.policy.since_draft, state.policy.probe_gap)
    return DecodeOutput(state.out, state.num_out, state.steps, state.commits, state.verified,
                        state.drafted_steps, probe)
