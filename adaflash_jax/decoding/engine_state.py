"""The serving engine's typed state: S decode slots, and the static configuration around them.

Everything a decode step reads or writes lives in one `DecodeState` of per-slot
arrays, so `insert`, `step` and `evict` (`engine.py`) are pure functions of it
and a host loop can refill slots between steps. A slot's randomness depends only
on its request's (seed key, stream) and the output position (`sampling.stream_keys`):
the slot it sits in and whatever shares the batch never change a seeded result.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from adaflash_jax.decoding.length_policy import POLICIES
from adaflash_jax.decoding.slot_params import SlotParams  # noqa: F401 (re-exported)
from adaflash_jax.decoding.tree_build import check_tree_settings
from adaflash_jax.decoding.verify_plan import PlanParams, ProbeState
from adaflash_jax.models.kv_cache import KVCache

OBJECTIVES = ("throughput", "makespan")  # what the adaptive decoder's budgets maximise


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine settings (hashable: one compiled program per config and slot count).

    block_size is the drafter's (0 without a drafter: plain AR steps). greedy picks the
    compiled acceptance rule for every slot; with greedy=False each slot samples at its own
    temperature and top_p. policy / buckets / length_head_def: the length policy ("fixed"
    verifies each slot's verify_len; "head" and "auto" need the AdaFlash length head and
    packed buckets). use_verify_head: sampled verification through the fused verify head
    (`decoding.verify_head`), not [.., V] log-probs. verify: "chain" verifies the drafted
    block; "tree" verifies a best-first draft tree of tree_budget nodes (`decoding.tree_step`),
    or with policy "auto" one of the node budgets in buckets per step (`decoding.tree_policy`).
    objective (the adaptive decoder, `decoding.adaptive.allocation`): what its per-step budgets
    maximise, "throughput" (committed tokens per second: a server, whose finished rows are
    refilled) or "makespan" (the progress of the rows with the most tokens left: a batch decoded
    to completion, which ends with its slowest row).
    coupled_sampling (tree, T > 0): the target's token at output position j is drawn with
    that position's own key, as an AR step would draw it, and the walk follows the child
    carrying it (`tree_accept.tree_coupled_accept`): a seeded request's tokens are then those
    of AR sampling, whatever was drafted or shared the batch.
    """

    target_def: Any
    cache_len: int
    max_new_cap: int
    greedy: bool
    attn_impl: str = "xla"
    drafter_def: Any = None
    block_size: int = 0
    length_head_def: Any = None
    policy: str = "fixed"
    buckets: tuple = ()
    sample_drafts: bool = False
    use_verify_head: bool = False
    verify: str = "chain"
    tree_budget: int = 0
    coupled_sampling: bool = False
    objective: str = "throughput"

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.objective!r}; choose one of {OBJECTIVES}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown length policy {self.policy!r}; choose one of {POLICIES}")
        if (self.drafter_def is None) != (self.block_size == 0):
            raise ValueError("a drafter needs its block_size (>= 2), and block_size needs a drafter")
        if self.drafter_def is not None and self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.policy != "fixed" and self.verify == "chain" and (self.length_head_def is None or not self.buckets):
            raise ValueError(f"length policy {self.policy!r} needs a length head and packed buckets")
        if self.use_verify_head and (self.greedy or self.sample_drafts):
            raise ValueError("use_verify_head verifies argmax drafts at temperature > 0 only")
        if self.max_new_cap < 1 or self.cache_len < 1:
            raise ValueError(f"max_new_cap and cache_len must be >= 1, got {self.max_new_cap}, "
                             f"{self.cache_len}")
        check_tree_settings(self)

    @property
    def speculative(self) -> bool:
        return self.drafter_def is not None

    @property
    def out_width(self) -> int:
        """Output buffer columns: a step may write a whole block past max_new (dropped later)."""
        return self.max_new_cap + self.block_size


@struct.dataclass
class EngineWeights:
    """The models' parameters (nnx.State trees); drafter / length_head are None when unused."""

    target: Any
    drafter: Any = None
    length_head: Any = None


@struct.dataclass
class PolicyState:
    """The "auto" length policy's running state. hits / trials / predicted: each slot's
    discounted acceptance feedback (`verify_plan.observe_acceptance`), for its request only."""

    p_est: jax.Array  # float32 [S]: per-token acceptance estimate of each slot (feedback-corrected)
    since_draft: jax.Array  # int32 []: steps since the last drafted step
    probe_gap: jax.Array  # int32 []: steps between forced probes
    hits: jax.Array  # float32 [S]: drafts accepted
    trials: jax.Array  # float32 [S]: drafts examined (accepted, plus the first rejected one)
    predicted: jax.Array  # float32 [S]: acceptances the head predicted for those trials
    p_carry: jax.Array  # float32 []: where a new request starts when no slot has feedback
    shadow: Any = None  # the adaptive decoder's open probes (`adaptive.shadow_probe.ShadowDraft`)
    gain: Any = None  # the adaptive decoder's realized/expected drafts (`adaptive.realized_gain`), kept
    # across requests

    def reset(self, slots: jax.Array) -> "PolicyState":
        """`slots` hold a new request (or none), with no feedback of its own. It starts from
        the mean estimate of the requests that have feedback (those leaving `slots` included),
        else from the last such mean: a serving engine keeps what it learned of its drafter
        across requests, as `generate` does across calls."""
        informed = self.trials > 0
        count = jnp.sum(informed)
        mean = jnp.sum(jnp.where(informed, self.p_est, 0.0)) / jnp.maximum(count, 1).astype(jnp.float32)
        p = jnp.where(count > 0, mean, self.p_carry)
        zero = jnp.zeros(jnp.shape(slots), jnp.float32)
        return self.replace(p_est=self.p_est.at[slots].set(p), hits=self.hits.at[slots].set(zero),
                            trials=self.trials.at[slots].set(zero),
                            predicted=self.predicted.at[slots].set(zero), p_carry=p,
                            shadow=None if self.shadow is None else self.shadow.close(slots))


@struct.dataclass
class DecodeState:
    """S decode slots. Free and finished slots have done = True and are skipped by `step`.

    tcache holds committed target K/V (lengths = committed tokens); ctx the drafter's
    context K/V of the same positions (None without a drafter); bonus the last committed
    token, not yet run through the target; out / num_out the tokens emitted so far.
    commits / verified record, per verify step of the slot's request, the tokens
    committed and verified; slot_steps counts those steps. pending (the adaptive decoder
    only, `decoding.adaptive`): a ring of the target features of positions decoded by plain
    AR steps, position p at p mod R, projected into ctx when the slot next drafts; there
    ctx.lengths may lag tcache.lengths by up to R. nonfinite: a slot whose target logits
    held a NaN or an infinity; its last output token is `sampling.NONFINITE_TOKEN` (-1)
    and it is done. Other slots are unaffected: every row is checked on its own.
    """

    tcache: KVCache
    ctx: KVCache | None
    bonus: jax.Array  # int32 [S]
    out: jax.Array  # int32 [S, out_width]
    num_out: jax.Array  # int32 [S]
    done: jax.Array  # bool [S]
    params: SlotParams
    eos_ids: jax.Array  # int32 [E]: stop tokens (may be empty)
    commits: jax.Array  # int32 [S, max_new_cap]
    verified: jax.Array  # int32 [S, max_new_cap]
    slot_steps: jax.Array  # int32 [S]
    steps: jax.Array  # int32 []: steps run
    drafted_steps: jax.Array  # int32 []: steps that ran the drafter
    plan: PlanParams | None = None  # the "head" / "auto" policy settings
    policy: PolicyState | None = None  # "auto" only
    pending: jax.Array | None = None  # float32 [S, R, kD]: target features not yet in ctx (adaptive)
    nonfinite: jax.Array | None = None  # bool [S]: the request's logits went NaN / inf (it is done)

    @property
    def num_slots(self) -> int:
        return self.bonus.shape[0]


class DecodeOutput(NamedTuple):
    """What a whole-batch decode returns (`engine.decode_batch`)."""

    tokens: jax.Array  # int32 [S, out_width]: emitted tokens, the first num_out of each row
    num_out: jax.Array  # int32 [S]
    steps: jax.Array  # int32 []: decode steps run
    commits: jax.Array  # int32 [S, max_new_cap]: tokens committed per verify step
    verified: jax.Array  # int32 [S, max_new_cap]: tokens verified per step
    drafted_steps: jax.Array  # int32 []: steps that drafted
    probe: ProbeState | None  # "auto": the policy state to start the next call from


def slot_rows(tree, slots: jax.Array, rows) -> Any:
    """`tree` with the entries at `slots` of every leaf's first axis replaced by `rows`."""
    return jax.tree.map(lambda a, b: a.at[slots].set(b), tree, rows)


def cache_rows(cache: KVCache, slots: jax.Array, rows: KVCache) -> KVCache:
    """A slot-major KV cache with the rows at `slots` replaced, lengths included."""
    return cache.put_rows(slots, rows).with_lengths(cache.lengths.at[slots].set(rows.lengths))


def is_stop(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
    """True where a token is one of the stop ids (eos_ids: int [E], may be empty)."""
    if eos_ids.shape[0] == 0:
        return jnp.zeros(tokens.shape, bool)
    return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def commit(state: DecodeState, emitted: jax.Array, accepted: jax.Array, tcache: KVCache,
           ctx: KVCache | None, verified: jax.Array, drafted) -> DecodeState:
    """Commits a step: each live slot keeps `accepted` + 1 of its `emitted` tokens [S, W],
    cut at its first stop token and at its max_new, and both caches roll back to the
    committed length. tcache / ctx hold the step's K/V writes (lengths not yet advanced);
    verified [S]: tokens the step verified per slot. A negative token (the target's choice
    where its logits were not finite) ends the slot like a stop token and sets `nonfinite`."""
    done, num_out, max_new = state.done, state.num_out, state.params.max_new
    rows = jnp.arange(state.num_slots, dtype=jnp.int32)
    idx = jnp.arange(emitted.shape[1])[None]
    negative = emitted < 0
    stops = (is_stop(emitted, state.eos_ids) | negative) & (idx <= accepted[:, None])
    n_emit = jnp.where(jnp.any(stops, axis=1), jnp.argmax(stops, axis=1) + 1, accepted + 1)
    n_emit = jnp.where(done, 0, jnp.minimum(n_emit, max_new - num_out))
    write = jnp.where(idx < n_emit[:, None], num_out[:, None] + idx, state.out.shape[1])
    new_len = state.tcache.lengths + n_emit
    last = jnp.take_along_axis(emitted, jnp.maximum(n_emit - 1, 0)[:, None], axis=1)[:, 0]
    num_out = num_out + n_emit
    record = jnp.where(done, state.commits.shape[1], state.slot_steps)  # finished slots record nothing
    nonfinite = state.nonfinite
    if nonfinite is not None:  # a negative token among those the slot keeps
        nonfinite = nonfinite | jnp.any(negative & (idx < n_emit[:, None]), axis=1)
    return state.replace(
        nonfinite=nonfinite,
        tcache=tcache.with_lengths(new_len), ctx=None if ctx is None else ctx.with_lengths(new_len),
        bonus=jnp.where(n_emit > 0, last, state.bonus),
        out=state.out.at[rows[:, None], write].set(emitted, mode="drop"), num_out=num_out,
        done=done | jnp.any(stops & (idx < n_emit[:, None]), axis=1) | (num_out >= max_new),
        commits=state.commits.at[rows, record].set(n_emit, mode="drop"),
        verified=state.verified.at[rows, record].set(verified, mode="drop"),
        slot_steps=state.slot_steps + (~done).astype(jnp.int32), steps=state.steps + 1,
        drafted_steps=state.drafted_steps + jnp.asarray(drafted, jnp.int32))
