"""The adaptive decoder's compiled programs: pure functions of a `DecodeState` that donate it.

- `start`: fresh slots, every prompt prefilled (as `engine.decode_batch` begins);
- `ar_run`: a device loop of plain AR steps, until the policy wants to draft or probe, a
  row's feature ring is full, every row is done or the step limit is reached;
- `probe_run`: `catch_up`, a shadow probe (`shadow_probe`: the drafter's trees, scored
  later against the tokens the AR steps commit), then `ar_run`'s loop;
- `catch_up`: projects the ring's features into the drafter's context (a full ring
  with no drafting wanted);
- `spec_run`: `catch_up`, then a device loop of drafted steps with per-row budgets
  (`packed_step.adaptive_step`) while drafting pays, for at most SPEC_RUN_STEPS steps (so
  the host re-prices the steps with what the run took before it goes on).

Each returns the state, `flags` ([finished, wants_draft, ring_full, probe], int32), which the
host reads to pick the next program (`next_program`), and what it `spent` (steps run, and
the seconds the plan's costs predicted for its drafted steps), which the host compares with
its own timing (`online_costs`). The engine config is a tree config with policy "auto"
(`EngineConfig(verify="tree", policy="auto", buckets=auto budgets)`).

A host loop that steps one step at a time (the server's slot engine, which inserts and
evicts requests between steps) runs `single_step` with the kind `next_program` picks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.decoding import engine
from adaflash_jax.decoding.adaptive.allocation import draft_advantage, drafted_probe_gap, pays, probe_gap
from adaflash_jax.decoding.adaptive.packed_step import adaptive_step, engine_shapes, estimates_pay, makespan_rows
from adaflash_jax.decoding.adaptive.realized_gain import RealizedGain
from adaflash_jax.decoding.adaptive.shadow_probe import ShadowDraft, draft_shadow, score_shadow
from adaflash_jax.decoding.engine_state import DecodeState, EngineConfig, EngineWeights, commit
from adaflash_jax.decoding.sampling import sample_next, stream_keys
from adaflash_jax.models.drafter import append_context

RING = 32  # positions an AR run may decode before their features must go into the drafter's context
SPEC_RUN_STEPS = 16  # drafted steps a spec run takes at most before the host re-prices them
FINISHED, WANTS_DRAFT, RING_FULL, PROBE = range(4)


def models(cfg: EngineConfig, weights: EngineWeights):
    """The target and the drafter of the config's definitions and these weights."""
    return nnx.merge(cfg.target_def, weights.target), nnx.merge(cfg.drafter_def, weights.drafter)


def decision(cfg: EngineConfig, state: DecodeState) -> tuple[jax.Array, jax.Array]:
    """(wants_draft, probe), made before drafting: wants_draft when the rows' running
    estimates say drafting for some row beats plain AR steps by the margin
    (`allocation.pays`), or a drafted probe is due; else probe when a shadow probe is due
    and none is waiting to be scored.

    Which probe: inside the margin (the estimates put drafting at break-even or better) a
    drafted step (`allocation.drafted_probe_gap`), which loses little by the estimates,
    commits what it accepts and learns at once; below break-even a shadow probe
    (`allocation.probe_gap`), which costs the drafter's forward alone but learns only as the
    AR steps commit the tokens that score it. A decoder that knows nothing of its drafter
    yet (every live estimate 0: a fresh process) probes with a drafted step."""
    live, policy, costs = ~state.done, state.policy, state.plan.costs
    drafts, ratio, step_s = draft_advantage(policy.p_est, live, cfg.buckets, cfg.block_size, costs,
                                            engine_shapes(state.num_slots, cfg.buckets), makespan_rows(cfg, state))
    near = drafts & (ratio >= 1.0)
    drafted_due = near & (policy.since_draft >= drafted_probe_gap(ratio, step_s, costs, policy.probe_gap))
    shadow_due = (policy.since_draft >= probe_gap(costs, policy.probe_gap)) & ~jnp.any(policy.shadow.open)
    unknown = ~jnp.any(live & (policy.p_est > 0))
    wants = jnp.any(live) & (pays(drafts, ratio) | drafted_due | (shadow_due & unknown))
    return wants, jnp.any(live) & ~wants & ~near & shadow_due


def flags(cfg: EngineConfig, state: DecodeState, limit: jax.Array) -> jax.Array:
    """int32 [4]: finished (no live row, or the step limit), wants_draft, ring_full (some live
    row's drafter context lags its target cache by a whole ring), probe (`decision`)."""
    live = ~state.done
    lag = jnp.max(jnp.where(live, state.tcache.lengths - state.ctx.lengths, 0), initial=0)
    finished = ~jnp.any(live) | (state.steps >= limit)
    wants, probe = decision(cfg, state)
    return jnp.stack([finished, wants, lag >= state.pending.shape[1], probe]).astype(jnp.int32)


def next_program(flags) -> str:
    """The program the host runs next for these flags (host ints): "spec" when drafting
    pays, "probe" when a probe is due, "catch_up" when a row's ring is full, else "ar"."""
    if flags[WANTS_DRAFT]:
        return "spec"
    return "probe" if flags[PROBE] else "catch_up" if flags[RING_FULL] else "ar"


def with_buffers(cfg: EngineConfig, weights: EngineWeights, state: DecodeState) -> DecodeState:
    """`state` with an empty feature ring of RING positions per slot, no open shadow probe and
    fresh realized-gain sums."""
    target, drafter = models(cfg, weights)
    width = len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size  # the features' k·D
    shadow = ShadowDraft.empty(state.num_slots, max(cfg.buckets))
    return state.replace(pending=jnp.zeros((state.num_slots, RING, width), jnp.float32),
                         policy=state.policy.replace(shadow=shadow, gain=RealizedGain.fresh()))


def start(cfg: EngineConfig, weights: EngineWeights, tokens, lengths, params, eos_ids, plan, limit):
    """Row i of tokens [B, T] prefilled into slot i, with empty buffers (`with_buffers`); and its flags."""
    b = tokens.shape[0]
    state = engine.init_state(cfg, weights, b, eos_ids, plan)
    state = with_buffers(cfg, weights, engine.insert(cfg, weights, state, jnp.arange(b, dtype=jnp.int32), tokens,
                                                     lengths, params))
    return state, flags(cfg, state, limit)


def ar_feature_step(cfg: EngineConfig, target, drafter, state: DecodeState) -> DecodeState:
    """A plain AR step that also keeps each live row's target features at its position in
    the ring (the drafter's context is not touched: its length stays where it was), and
    scores the shadow probes its token completes (`shadow_probe.score_shadow`)."""
    p, live = state.params, ~state.done
    res = target(state.bonus[:, None], cache=state.tcache, feature_layers=drafter.cfg.target_layer_ids,
                 attn_impl=cfg.attn_impl)
    tok = sample_next(target.logits(res.hidden[:, 0]), stream_keys(p.seed_key, p.stream, state.num_out),
                      cfg.greedy, p.temperature[:, None], p.top_p[:, None])
    ring = state.pending.shape[1]
    rows = jnp.arange(state.num_slots)
    slot = jnp.where(live, state.tcache.lengths % ring, ring)  # finished rows write nothing
    pending = state.pending.at[rows, slot].set(res.features[:, 0].astype(jnp.float32), mode="drop")
    new = commit(state, tok[:, None], jnp.zeros_like(tok), res.cache, None, jnp.ones_like(tok), False)
    new = new.replace(ctx=state.ctx, pending=pending,
                      policy=state.policy.replace(since_draft=state.policy.since_draft + 1))
    return score_shadow(cfg, new, estimates_pay(cfg, new))


def catch_up(cfg: EngineConfig, drafter, state: DecodeState) -> DecodeState:
    """The drafter's context brought up to the target cache: the ring's features of positions
    ctx.lengths .. tcache.lengths - 1 projected and written (one ring-wide append; the
    entries past a row's lag are stale and are written past its length, never read)."""
    ring = state.pending.shape[1]
    positions = state.ctx.lengths[:, None] + jnp.arange(ring, dtype=jnp.int32)[None]
    rows = jnp.arange(state.num_slots)[:, None]
    ctx = append_context(drafter, state.ctx, state.pending[rows, positions % ring], positions)
    return state.replace(ctx=ctx.with_lengths(state.tcache.lengths))


def ar_loop(cfg: EngineConfig, target, drafter, state: DecodeState, limit):
    """AR steps until the run is finished or a flag asks for another program."""
    def keep_going(s):
        f = flags(cfg, s, limit)
        return (f[FINISHED] == 0) & (f[WANTS_DRAFT] == 0) & (f[RING_FULL] == 0) & (f[PROBE] == 0)

    return jax.lax.while_loop(keep_going, lambda s: ar_feature_step(cfg, target, drafter, s), state)


def ar_run(cfg: EngineConfig, weights: EngineWeights, state: DecodeState, limit):
    target, drafter = models(cfg, weights)
    first = state.steps
    state = ar_loop(cfg, target, drafter, state, limit)
    return state, flags(cfg, state, limit), spent(state.steps - first, 0.0)


def probe_run(cfg: EngineConfig, weights: EngineWeights, state: DecodeState, limit):
    target, drafter = models(cfg, weights)
    first = state.steps
    state = draft_shadow(cfg, target, drafter, catch_up(cfg, drafter, state))
    state = ar_loop(cfg, target, drafter, ar_feature_step(cfg, target, drafter, state), limit)
    return state, flags(cfg, state, limit), spent(state.steps - first, 0.0)


def catch_up_run(cfg: EngineConfig, weights: EngineWeights, state: DecodeState, limit):
    _, drafter = models(cfg, weights)
    state = catch_up(cfg, drafter, state)
    return state, flags(cfg, state, limit), spent(0, 0.0)


def spec_run(cfg: EngineConfig, weights: EngineWeights, state: DecodeState, limit):
    target, drafter = models(cfg, weights)
    state = catch_up(cfg, drafter, state)

    def keep_going(carry):
        f = flags(cfg, carry[0], limit)
        return (f[FINISHED] == 0) & (f[WANTS_DRAFT] == 1) & (carry[1] < SPEC_RUN_STEPS)

    def step(carry):
        s, steps, seconds = carry
        s, step_s = adaptive_step(cfg, target, drafter, s)
        return s, steps + 1, seconds + step_s

    state, steps, seconds = jax.lax.while_loop(keep_going, step, (state, jnp.int32(0), jnp.float32(0.0)))
    return state, flags(cfg, state, limit), spent(steps, seconds)


def spent(steps, seconds) -> jax.Array:
    """float32 [2]: the steps a program ran and the seconds its plan's costs predicted for them
    (drafted steps only; the host prices AR steps), for `online_costs`."""
    return jnp.stack([jnp.asarray(steps, jnp.float32), jnp.asarray(seconds, jnp.float32)])


def single_step(cfg: EngineConfig, weights: EngineWeights, state: DecodeState, kind: str):
    """One step of the program `kind` names (`next_program`): an AR step ("ar"), the ring
    projected into the drafter's context and then an AR step ("catch_up"), the same with a
    shadow probe drafted before the AR step ("probe"), or the ring projected and then a
    drafted step with per-row budgets ("spec"). Returns the state and the seconds the plan's
    costs predict for a drafted step (0 for the others)."""
    target, drafter = models(cfg, weights)
    if kind not in ("ar", "catch_up", "probe", "spec"):
        raise ValueError(f"unknown step kind {kind!r}")
    if kind != "ar":
        state = catch_up(cfg, drafter, state)
    if kind == "spec":
        return adaptive_step(cfg, target, drafter, state)
    if kind == "probe":
        state = draft_shadow(cfg, target, drafter, state)
    return ar_feature_step(cfg, target, drafter, state), jnp.float32(0.0)


start_jit = jax.jit(start, static_argnums=0)
flags_jit = jax.jit(flags, static_argnums=0)
ar_run_jit = jax.jit(ar_run, static_argnums=0, donate_argnums=2)
catch_up_jit = jax.jit(catch_up_run, static_argnums=0, donate_argnums=2)
probe_run_jit = jax.jit(probe_run, static_argnums=0, donate_argnums=2)
spec_run_jit = jax.jit(spec_run, static_argnums=0, donate_argnums=2)
