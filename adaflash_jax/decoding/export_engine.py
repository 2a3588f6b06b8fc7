"""Exports the serving engine (`engine.init_state` / `insert` / `step` / `evict`, and the chunked
prefill's `prefill_chunk` and last-chunk insert) for the artifact.

The decode state is a tree of dataclasses; `jax.export` serializes only plain
array trees robustly across jax versions, so every exported engine function
takes and returns the state's flattened leaves (PRNG keys as their uint32
data). The manifest lists each leaf's name (its path in `DecodeState`, e.g.
"num_out", "tcache.k") and slot axis, so the runtime can read outputs and cut
live prefixes without the model code. The length policy's `PlanParams` are not
state leaves: `step` rebuilds them from rho / min_len inputs, since the
"head" policy's packed buckets are multiples of the slots stepped.

Shapes are symbolic in the slot count S, the rows inserted n, the prompt width
t and the slots evicted m. `step` is exported once, for S slots: the runtime
steps a live prefix of k slots by calling it on the first k rows of every leaf
inside one jitted function that donates the state, so XLA updates the full
buffers in place and copies only the k live rows (what `slot_engine` does in
process). Exporting one step per k would compile to the same program and
only multiply the artifact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decoding import engine as engine_lib
from adaflash_jax.decoding.engine_state import EngineConfig, EngineWeights, SlotParams
from adaflash_jax.decoding.length_policy import unit_costs
from adaflash_jax.decoding.packing import default_buckets
from adaflash_jax.decoding.verify_plan import PlanParams, ProbeState

# Inputs after the weight groups and the state leaves (the runtime builds them in this order).
INSERT_INPUTS = ("slots [n] int32", "tokens [n, t] int32", "lengths [n] int32", "max_new [n] int32",
                 "temperature [n] float32", "top_p [n] float32", "seed_key [n, K] uint32 (key data)",
                 "stream [n] int32", "verify_len [n] int32")
STEP_HEAD_INPUTS = ("rho [] float32", "min_len [] int32")
CHUNK_INPUTS = ("slots [n] int32", "tokens [n, t] int32", "lengths [n] int32", "starts [n] int32")


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


class EngineExporter:
    """Builds and exports the engine functions of one artifact.

    target / drafter: the models (drafter None: AR steps); policy: None, "fixed" or "head";
    weight_trees: (treedef, [ShapeDtypeStruct]) per weight group in `groups`; tree: the
    EngineConfig fields of tree verification ({}: chain).
    """

    def __init__(self, target, drafter, policy, *, cache_len: int, max_new_cap: int, num_eos: int,
                 groups: list[str], weight_trees: dict, tree: dict | None = None):
        self.target, self.drafter, self.policy, self.tree = target, drafter, policy, dict(tree or {})
        self.cache_len, self.max_new_cap, self.num_eos = cache_len, max_new_cap, num_eos
        self.groups, self.weight_trees = groups, weight_trees
        state = jax.eval_shape(lambda w: self._init(w, 2, jnp.zeros((num_eos,), jnp.int32)),
                               self._weight_specs())
        paths, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        self.keys = [_is_key(x) for _, x in paths]
        self.names = [jax.tree_util.keystr(p).lstrip(".").replace("'", "") for p, _ in paths]
        bigger = jax.eval_shape(lambda w: self._flat(self._init(w, 3, jnp.zeros((num_eos,), jnp.int32))),
                                self._weight_specs())
        smaller = jax.eval_shape(lambda w: self._flat(self._init(w, 2, jnp.zeros((num_eos,), jnp.int32))),
                                 self._weight_specs())
        self.slot_axes = []
        for a, b in zip(smaller, bigger):
            differ = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
            self.slot_axes.append(differ[0] if differ else -1)
        self.leaf_avals = smaller

    # ----- building blocks ------------------------------------------------------------
    def _weight_specs(self):
        return [self.weight_trees[g][1] for g in self.groups]

    def _weights(self, groups_leaves) -> EngineWeights:
        trees = {g: jax.tree_util.tree_unflatten(self.weight_trees[g][0], leaves)
                 for g, leaves in zip(self.groups, groups_leaves)}
        return EngineWeights(trees["target"], trees.get("drafter"), trees.get("head"))

    def _cfg(self, greedy: bool, slots) -> EngineConfig:
        engine = dict(target_def=self.target.graphdef, cache_len=self.cache_len, max_new_cap=self.max_new_cap,
                      greedy=greedy)
        if self.drafter is not None:
            engine.update(drafter_def=self.drafter.graphdef, block_size=self.drafter.block_size, **self.tree)
        if self.policy == "head":
            engine.update(length_head_def=self.drafter.head_graphdef, policy="head",
                          buckets=default_buckets(slots, self.drafter.block_size))
        return EngineConfig(**engine)

    def _plan(self, slots, rho, min_len) -> PlanParams | None:
        if self.policy != "head":
            return None
        buckets = default_buckets(slots, self.drafter.block_size)
        return PlanParams(rho, min_len, unit_costs(buckets), jnp.int32(1), ProbeState.fresh(1))

    def _init(self, weights, slots, eos_ids):
        plan = self._plan(slots, jnp.float32(1.0), jnp.int32(1))
        state = engine_lib.init_state(self._cfg(True, slots), self._weights(weights), slots, eos_ids, plan)
        return state.replace(plan=None)

    def _flat(self, state) -> list:
        return [jax.random.key_data(x) if _is_key(x) else x for x in jax.tree.leaves(state)]

    def _state(self, leaves):
        leaves = [jax.random.wrap_key_data(x) if k else x for x, k in zip(leaves, self.keys)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def _split(self, args):
        ng, ns = len(self.groups), len(self.keys)
        return list(args[:ng]), list(args[ng:ng + ns]), args[ng + ns:]

    # ----- the exported functions -------------------------------------------------------
    def init_fn(self, *args):
        weights, (slots, eos_ids) = list(args[:len(self.groups)]), args[len(self.groups):]
        return self._flat(self._init(weights, slots.shape[0], eos_ids))

    def insert_fn(self, *args, greedy: bool, chunked: bool = False):
        """`engine.insert`; chunked: a trailing starts [n] input, the prompts' last chunks after
        `prefill_chunk_fn` put their earlier tokens in the slots."""
        weights, leaves, rest = self._split(args)
        starts = rest[-1] if chunked else None
        slots, tokens, lengths, max_new, temperature, top_p, key_data, stream, verify_len = rest[:9]
        state = self._state(leaves)
        params = SlotParams(max_new, temperature, top_p, jax.random.wrap_key_data(key_data), stream, verify_len)
        cfg = self._cfg(greedy, state.num_slots)
        return self._flat(engine_lib.insert(cfg, self._weights(weights), state, slots, tokens, lengths, params,
                                            starts))

    def prefill_chunk_fn(self, *args, greedy: bool):
        """`engine.prefill_chunk`: a non-final chunk of prompts at positions starts + t."""
        weights, leaves, (slots, tokens, lengths, starts) = self._split(args)
        state = self._state(leaves)
        return self._flat(engine_lib.prefill_chunk(self._cfg(greedy, state.num_slots), self._weights(weights),
                                                   state, slots, tokens, lengths, starts))

    def step_fn(self, *args, greedy: bool):
        weights, leaves, rest = self._split(args)
        state = self._state(leaves)
        s = state.num_slots
        state = state.replace(plan=self._plan(s, *rest) if rest else None)
        out = engine_lib.step(self._cfg(greedy, s), self._weights(weights), state)
        return self._flat(out.replace(plan=None))

    def evict_fn(self, *args):
        leaves, (slots,) = args[:len(self.keys)], args[len(self.keys):]
        return self._flat(engine_lib.evict(self._state(list(leaves)), slots))

    # ----- export --------------------------------------------------------------------------
    def export(self, modes, platforms) -> dict:
        """{name: (Exported, manifest entry)} for every engine function of `modes`."""
        s, n, t, m = jax.export.symbolic_shape("S, n, t, m")
        spec = jax.ShapeDtypeStruct
        state = [spec(tuple(s if i == axis else d for i, d in enumerate(x.shape)), x.dtype)
                 for x, axis in zip(self.leaf_avals, self.slot_axes)]
        key_width = next(x.shape[-1] for x, k in zip(self.leaf_avals, self.keys) if k)
        weights = self._weight_specs()
        rows = lambda dtype: spec((n,), dtype)  # noqa: E731
        insert = [rows(jnp.int32), spec((n, t), jnp.int32), rows(jnp.int32), rows(jnp.int32),
                  rows(jnp.float32), rows(jnp.float32), spec((n, key_width), jnp.uint32), rows(jnp.int32),
                  rows(jnp.int32)]
        head = [spec((), jnp.float32), spec((), jnp.int32)] if self.policy == "head" else []
        jobs = [("engine_init", self.init_fn, [*weights, spec((s,), jnp.int32), spec((self.num_eos,), jnp.int32)],
                 self.groups, ["slots [S] int32 (only its length is read)", "eos_ids [E] int32"], None),
                ("engine_evict", self.evict_fn, [*state, spec((m,), jnp.int32)], [], ["slots [m] int32"], None)]
        for mode in modes:
            greedy = mode == "greedy"
            jobs += [(f"engine_insert_{mode}", lambda *a, g=greedy: self.insert_fn(*a, greedy=g),
                      [*weights, *state, *insert], self.groups, list(INSERT_INPUTS), greedy),
                     (f"engine_step_{mode}", lambda *a, g=greedy: self.step_fn(*a, greedy=g),
                      [*weights, *state, *head], self.groups, list(STEP_HEAD_INPUTS[:len(head)]), greedy),
                     (f"engine_prefill_chunk_{mode}", lambda *a, g=greedy: self.prefill_chunk_fn(*a, greedy=g),
                      [*weights, *state, *insert[:3], rows(jnp.int32)], self.groups, list(CHUNK_INPUTS), greedy),
                     (f"engine_insert_chunked_{mode}",
                      lambda *a, g=greedy: self.insert_fn(*a, greedy=g, chunked=True),
                      [*weights, *state, *insert, rows(jnp.int32)], self.groups,
                      [*INSERT_INPUTS, CHUNK_INPUTS[-1]], greedy)]
        out = {}
        for name, fn, args, groups, inputs, greedy in jobs:
            exported = jax.export.export(jax.jit(fn), platforms=platforms)(*args)
            out[name] = (exported, {"file": name + ".jaxexport", "loop": "engine", "greedy": greedy,
                                    "weight_groups": list(groups), "state": True, "inputs": inputs})
        return out

    def manifest(self) -> dict:
        """The state layout the runtime needs: leaf names, slot axes, dtypes, key leaves."""
        return {"leaves": [{"name": name, "slot_axis": axis, "dtype": str(x.dtype), "key": key}
                           for name, axis, x, key in zip(self.names, self.slot_axes, self.leaf_avals, self.keys)],
                "prng_impl": str(jax.random.key_impl(jax.random.key(0))),
                "step_inputs": list(STEP_HEAD_INPUTS) if self.policy == "head" else []}
