"""An in-process engine of S decode slots for the host scheduler (`serving.scheduler`).

It holds one `DecodeState` and calls `insert` / `step` / `evict` of
`decoding.engine`, jitted here. Three things make it fit a host loop on any hardware:

- **Live-prefix steps.** The scheduler fills the lowest free slots first, so
  every live slot sits below some k. `step(k)` runs the decode step on the
  first k slots only (k a power of two, one compiled program each) and writes
  them back in place. A step's cost on a CPU grows with the rows it computes,
  so one request in a 64-slot engine costs a 1-row step, not a 64-row one.
- **Bucketed inserts.** Prompts are right-padded to a power-of-two length
  (>= 16) and inserted in power-of-two groups, so prefill compiles a handful of
  shapes whatever arrives.
- **A mesh.** With a target loaded on a mesh (or `mesh=`), the slots split
  into g = data*fsdp shards and the KV caches' kv heads over "tensor"
  (`parallel.slot_sharding`); every jitted function returns its state pinned
  to that layout, so no step reshards it. Scheduler slot i is row
  (i % g) * (S/g) + i // g of the state: the first k slots are the first k/g
  rows of every shard, so a live prefix stays on its own devices and each
  shard computes an equal share. A sharded step is one SPMD program, so every
  shard steps the same number of rows: k rounds up to a multiple of g (a
  single request on data=2 costs a 2-row step). The extra rows are free
  slots, which a step leaves untouched.
- **Length policies.** "head" and "auto" (AdaFlash) pack verification into sizes
  that depend on the rows stepped, so a k-row step runs with the buckets and
  step costs of k rows (`serving.slot_policy`); the policy's per-slot state is
  cut with the prefix like every other per-slot row.
- **The adaptive decoder** (the default with a drafter): before each step the host
  reads the prefix's flags (`adaptive.programs.flags`) and runs the program they
  pick, a plain AR step (after a shadow probe, when one is due) or a drafted one
  with per-row budgets, each compiled
  on its own and donating the state, so a step that drafts nothing costs an AR step.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from adaflash_jax.decoding import engine
from adaflash_jax.decoding.adaptive import online_costs, programs
from adaflash_jax.decoding.batching import MIN_PROMPT_BUCKET, bucket, cache_length, slot_rows
from adaflash_jax.decoding.engine_state import DecodeState, EngineConfig, EngineWeights, SlotParams
from adaflash_jax.parallel.kernel_sharding import kernel_mesh
from adaflash_jax.parallel.rules import shard_state
from adaflash_jax.parallel.slot_sharding import SlotLayout, batch_shards
from adaflash_jax.serving.scheduler import SlotView
from adaflash_jax.serving.slot_policy import SlotPolicy

# DecodeState fields shared by all slots (never cut to a prefix); the KV caches keep slots on axis 1.
_SHARED_FIELDS = ("eos_ids", "plan", "steps", "drafted_steps")
_CACHE_FIELDS = ("tcache", "ctx")
_ONE_DEVICE = SlotLayout()


def _slot_axes(state: DecodeState):
    """A tree like `state` whose leaves give each leaf's slot axis (-1: shared by all slots)."""
    axes = {}
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        if field.name in _SHARED_FIELDS:
            axes[field.name] = jax.tree.map(lambda _: -1, value)
        elif field.name in _CACHE_FIELDS:
            axes[field.name] = None if value is None else value.slot_axes()
        else:  # per-slot rows; scalars inside (e.g. the policy's probe counters) are shared
            axes[field.name] = jax.tree.map(lambda x: 0 if jnp.ndim(x) else -1, value)
    return state.replace(**axes)


def physical_rows(num_slots: int, shards: int = 1) -> np.ndarray:
    """The state row of each scheduler slot: slot i -> (i % shards) * (S/shards) + i // shards."""
    i = np.arange(num_slots)
    return ((i % shards) * (num_slots // shards) + i // shards).astype(np.int32)


def _split(x: jax.Array, axis: int, shards: int) -> jax.Array:
    """[.., S, ..] -> [.., shards, S/shards, ..]: one entry of the new axis per slot shard."""
    return x.reshape(x.shape[:axis] + (shards, x.shape[axis] // shards) + x.shape[axis + 1:])


def take_prefix(state: DecodeState, k: int, shards: int = 1) -> DecodeState:
    """Scheduler slots [0, k) of `state` as a k-slot state: the first k/shards rows of each shard."""

    def take(x, axis):
        if axis < 0:
            return x
        part = jax.lax.slice_in_dim(_split(x, axis, shards), 0, k // shards, axis=axis + 1)
        return part.reshape(x.shape[:axis] + (k,) + x.shape[axis + 1:])

    return jax.tree.map(take, state, _slot_axes(state))


def put_prefix(state: DecodeState, prefix: DecodeState, shards: int = 1) -> DecodeState:
    """`state` with the rows `take_prefix` cut (and the shared counters) replaced by `prefix`'s."""

    def put(full, part, axis):
        if axis < 0:
            return part
        index = (slice(None),) * (axis + 1) + (slice(0, part.shape[axis] // shards),)
        return _split(full, axis, shards).at[index].set(_split(part, axis, shards)).reshape(full.shape)

    return jax.tree.map(put, state, prefix, _slot_axes(state))


def _pinned(layout: SlotLayout, state: DecodeState) -> DecodeState:
    return layout.constrain(state, _slot_axes(state))


def _step(cfg: EngineConfig, weights: EngineWeights, state: DecodeState, plan, kind):
    """engine.step (kind None) or the adaptive decoder's step `kind`, under `plan` (None: the
    state's own); the state keeps its plan. Also returns the seconds the plan predicts for
    a drafted adaptive step (0 otherwise)."""
    run_state = state if plan is None else state.replace(plan=plan)
    if kind is None:
        new, planned = engine.step(cfg, weights, run_state), jnp.float32(0.0)
    else:
        new, planned = programs.single_step(cfg, weights, run_state, kind)
    return new.replace(plan=state.plan), planned


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("layout", "kind"), donate_argnums=3)
def step_prefix(cfg: EngineConfig, k: int, weights: EngineWeights, state: DecodeState, plan=None,
                layout: SlotLayout = _ONE_DEVICE, kind: str | None = None):
    """One decode step of scheduler slots [0, k) (k a multiple of layout.shards); the other
    slots are left as they are. With a "head" / "auto" policy, cfg's buckets and `plan`'s
    costs are those of a k-row step (`SlotPolicy.for_rows`); kind: the adaptive decoder's
    step program (`adaptive.programs.single_step`), None for `engine.step`. Returns the
    state and the seconds `plan` predicts for a drafted adaptive step (0 otherwise)."""
    if k == state.num_slots:
        new, planned = _step(cfg, weights, state, plan, kind)
        return _pinned(layout, new), planned
    prefix = _pinned(layout, take_prefix(state, k, layout.shards))
    stepped, planned = _step(cfg, weights, prefix, plan, kind)
    return _pinned(layout, put_prefix(state, _pinned(layout, stepped), layout.shards)), planned


_NO_LIMIT = np.iinfo(np.int32).max


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames="layout")
def prefix_flags(cfg: EngineConfig, k: int, state: DecodeState, plan, layout: SlotLayout = _ONE_DEVICE):
    """The adaptive decoder's flags (`programs.flags`) of scheduler slots [0, k) under `plan`."""
    prefix = take_prefix(state, k, layout.shards).replace(plan=plan)
    return programs.flags(cfg, prefix, jnp.int32(_NO_LIMIT))


@functools.partial(jax.jit, static_argnums=(0, 2), static_argnames=("layout", "adaptive"))
def _init(cfg: EngineConfig, weights: EngineWeights, num_slots: int, eos_ids: jax.Array, plan,
          layout: SlotLayout, adaptive: bool = False) -> DecodeState:
    state = engine.init_state(cfg, weights, num_slots, eos_ids, plan)
    return _pinned(layout, programs.with_buffers(cfg, weights, state) if adaptive else state)


# insert and evict donate the state, as a step does: without it every call copies the whole
# state, KV caches included (≈ 190 ms at 32 slots of SmolLM2 on a CPU, once per finished request).
@functools.partial(jax.jit, static_argnums=0, static_argnames="layout", donate_argnums=2)
def _insert(cfg: EngineConfig, weights: EngineWeights, state: DecodeState, rows, tokens, lengths,
            params: SlotParams, starts, layout: SlotLayout) -> DecodeState:
    return _pinned(layout, engine.insert(cfg, weights, state, rows, tokens, lengths, params, starts))


@functools.partial(jax.jit, static_argnums=0, static_argnames="layout", donate_argnums=2)
def _prefill_chunk(cfg: EngineConfig, weights: EngineWeights, state: DecodeState, rows, tokens, lengths,
                   starts, layout: SlotLayout) -> DecodeState:
    return _pinned(layout, engine.prefill_chunk(cfg, weights, state, rows, tokens, lengths, starts))


@functools.partial(jax.jit, static_argnames="layout", donate_argnums=0)
def _evict(state: DecodeState, rows, layout: SlotLayout) -> DecodeState:
    return _pinned(layout, engine.evict(state, rows))


@jax.jit
def _read(num_out, done, out, nonfinite, rows, steps, drafted_steps):
    return num_out[rows], done[rows], out[rows], nonfinite[rows], steps, drafted_steps


class LocalEngine:
    """S slots of one engine configuration, with the models in this process.

    target / drafter: `af.load_target` / `af.load_drafter` results (drafter None: AR steps).
    greedy: the compiled acceptance rule for every slot (temperature 0), else each slot
    samples at its own temperature / top_p. verify_len: the DFlash-fixed verify length
    (default: the drafter's block). mesh: where the weights and slots live (default: the
    target's); num_slots must be a multiple of its data*fsdp size.
    verify: "adaptive", "chain" or "tree" as in `generate`; None: the adaptive decoder unless
    a chain or tree setting below implies the mode (`decoding.adaptive.mode`).
    length_policy (chain): "fixed", "head" or "auto" as in `generate` (default: "auto" when
    the drafter has a length head, else "fixed"), with its rho / min_len / probe_every;
    step_costs (adaptive, "auto"): StepCosts of a k-row step, as a callable k -> StepCosts
    or a mapping {k: StepCosts}; default: calibrated at batch k the first time k rows step.
    tree_budget: verify a best-first tree of N nodes per step, or "auto" (a budget per
    step by calibrated tree-step costs), instead of the drafted chain.
    """

    chunked_prefill = True  # `prefill_chunk` and `insert(..., starts)` (the scheduler asks)

    def __init__(self, target, drafter=None, *, num_slots: int, max_prompt_len: int, max_new_tokens: int,
                 greedy: bool = True, attn_impl: str = "xla", verify_len: int | None = None,
                 eos_ids=None, mesh=None, length_policy: str | None = None, rho: float = 1.3,
                 min_len: int = 1, probe_every: int = 8, step_costs=None,
                 tree_budget: int | str | None = None, verify: str | None = None):
        if num_slots < 1 or max_prompt_len < 1 or max_new_tokens < 1:
            raise ValueError(f"num_slots, max_prompt_len and max_new_tokens must be >= 1, got "
                             f"{num_slots}, {max_prompt_len}, {max_new_tokens}")
        block = drafter.block_size if drafter is not None else 0
        self.num_slots = int(num_slots)
        self.max_prompt_len = bucket(max_prompt_len, MIN_PROMPT_BUCKET)
        self.max_new_tokens = int(max_new_tokens)
        self.greedy = bool(greedy)
        self.mesh = target.mesh if mesh is None else mesh
        shards = batch_shards(self.mesh)
        if self.num_slots % shards:
            raise ValueError(f"num_slots {num_slots} must be a multiple of the mesh's data*fsdp size "
                             f"{shards}: the slots split evenly over it")
        self.layout = SlotLayout(self.mesh, shards) if self.mesh is not None else _ONE_DEVICE
        self._policy = SlotPolicy(length_policy, target, drafter, verify_len=verify_len, rho=rho,
                                  min_len=min_len, probe_every=probe_every, step_costs=step_costs,
                                  attn_impl=attn_impl, tree_budget=tree_budget, verify=verify,
                                  place=functools.partial(jax.tree.map, self.layout.replicated))
        self._rows = physical_rows(self.num_slots, shards)
        self.attn_impl = attn_impl
        cap = bucket(max_new_tokens, 16)
        headroom = self._policy.headroom
        cfg = dict(target_def=target.graphdef, cache_len=cache_length(self.max_prompt_len, cap, headroom),
                   max_new_cap=cap, greedy=self.greedy, attn_impl=attn_impl)
        self.weights = EngineWeights(self._placed(target.state))
        self.verify_len = 1
        if drafter is not None:
            drafter.cfg.check_target(target.cfg)
            self.verify_len = block if verify_len is None else int(verify_len)
            if not 1 <= self.verify_len <= block:
                raise ValueError(f"verify_len must lie in [1, {block}], got {verify_len}")
            cfg.update(drafter_def=drafter.graphdef, block_size=block,
                       **self._policy.engine_fields(self.num_slots, self.greedy))
            head = self._placed(drafter.head_state) if self._policy.uses_length_head else None
            self.weights = EngineWeights(self.weights.target, self._placed(drafter.state), head)
        self.cfg = EngineConfig(**cfg)
        limit = target.cfg.max_position_embeddings
        if self.cfg.cache_len > limit:
            raise ValueError(f"max_prompt_len {self.max_prompt_len} + max_new_tokens {cap} + {headroom} "
                             "(block or tree budget) "
                             f"exceed the target's {limit} positions")
        eos = target.eos_token_ids if eos_ids is None else tuple(eos_ids)
        eos = self.layout.replicated(jnp.asarray(eos, jnp.int32))
        self._stepped: set[tuple[int, str | None]] = set()  # (rows, kind) of the steps run so far
        self.state = _init(self.cfg, self.weights, self.num_slots, eos, self._policy.resting_plan(),
                           layout=self.layout, adaptive=self.verify == "adaptive")

    @property
    def length_policy(self) -> str | None:
        """The verify-length policy of speculative steps (None: AR steps)."""
        return self._policy.policy if self.cfg.speculative else None

    @property
    def verify(self) -> str | None:
        """"adaptive", "chain" or "tree" (None: AR steps)."""
        return self._policy.verify

    def _placed(self, state):
        """Model state on this engine's mesh by the logical-axis rules (a no-op where it already is)."""
        return state if self.mesh is None else shard_state(state, self.mesh)

    def step_rows(self, k: int) -> int:
        """Rows a step of live prefix k computes: k rounded up to a multiple of the slot shards."""
        g = self.layout.shards
        return min(self.num_slots, -(-int(k) // g) * g)

    def _batch(self, slots, prompts: list[list[int]], starts):
        """Device operands of an insert: rows, right-padded tokens (a power-of-two width), lengths
        and starts (None: whole prompts)."""
        tokens, lengths = slot_rows(prompts, self.max_prompt_len if starts is None else None)
        batch = (jnp.asarray(tokens), jnp.asarray(lengths))
        if starts is not None:
            batch += (jnp.asarray(np.asarray(starts, np.int32)),)
        batch = self.layout.place(batch, jax.tree.map(lambda _: 0, batch))
        rows = self.layout.replicated(jnp.asarray(self._rows[np.asarray(slots)], jnp.int32))
        return (rows,) + tuple(batch) + ((None,) if starts is None else ())

    def insert(self, slots, prompts: list[list[int]], params: SlotParams, starts=None) -> None:
        """Prefills `prompts` into `slots` (distinct; rows with params.max_new == 0 stay free).
        starts: per slot, the prompt tokens already there (`prefill_chunk`); `prompts` are then
        the last chunks."""
        rows, tokens, lengths, starts = self._batch(slots, prompts, starts)
        params = self.layout.place(params, jax.tree.map(lambda _: 0, params))
        with kernel_mesh(self.mesh, self.attn_impl):
            self.state = _insert(self.cfg, self.weights, self.state, rows, tokens, lengths, params, starts,
                                 layout=self.layout)

    def prefill_chunk(self, slots, chunks: list[list[int]], starts) -> None:
        """Chunked prefill: writes `chunks` (not the prompts' last) at positions starts[i] of
        `slots`; the slots decode nothing until `insert` with starts adds the last chunks."""
        args = self._batch(slots, chunks, starts)
        with kernel_mesh(self.mesh, self.attn_impl):
            self.state = _prefill_chunk(self.cfg, self.weights, self.state, *args, layout=self.layout)

    def step(self, k: int) -> None:
        """One decode step of slots [0, k) (k: a power of two <= num_slots; see `step_rows`).
        The adaptive decoder plans with its calibrated costs scaled by what its steps took
        (`online_costs`; costs the caller gave are used as they are)."""
        rows = self.step_rows(k)
        cfg, plan = self._policy.for_rows(self.cfg, rows, self.weights)
        kind, scales = None, None
        if self.verify == "adaptive":
            if self._policy.learns_costs:
                scales = online_costs.scales_for((cfg, rows), plan.costs)
                drafted_scale = scales.scales()[1]
                plan = plan._replace(costs=scales.apply(plan.costs))
            flags = prefix_flags(cfg, rows, self.state, plan, layout=self.layout)
            kind = programs.next_program(np.asarray(jax.device_get(flags)))
        began = time.perf_counter()
        with kernel_mesh(self.mesh, self.attn_impl):
            self.state, planned = step_prefix(cfg, rows, self.weights, self.state, plan, layout=self.layout,
                                              kind=kind)
        compiled_now = (rows, kind) not in self._stepped  # a first call's time is its compilation
        self._stepped.add((rows, kind))
        if scales is not None and not compiled_now:  # the step's own time (its results are read next anyway)
            planned = float(jax.device_get(planned))
            scales.observe(kind, time.perf_counter() - began, 1, planned / drafted_scale)

    def evict(self, slots) -> None:
        rows = self.layout.replicated(jnp.asarray(self._rows[np.asarray(slots)], jnp.int32))
        self.state = _evict(self.state, rows, layout=self.layout)

    def read(self, k: int) -> SlotView:
        rows = self.layout.replicated(jnp.asarray(self._rows[:k]))
        st = self.state
        num_out, done, out, failed, steps, drafted = jax.device_get(
            _read(st.num_out, st.done, st.out, st.nonfinite, rows, st.steps, st.drafted_steps))
        return SlotView(np.asarray(num_out), np.asarray(done), np.asarray(out),
                        float(drafted) / float(steps) if steps else 0.0, np.asarray(failed))
