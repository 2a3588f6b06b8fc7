"""Laying a decode engine's slot state out on a mesh.

Slots are the serving batch: per-slot rows split over the "batch" rule's mesh
axes (data, fsdp), and the KV caches `[layers, slots, kv_heads, len, head_dim]`
also split their kv-head axis over "tensor" when the rules divide it, the same
axis that splits the attention weights, so attention reads only local heads.
Leaves shared by all slots (step counters, stop ids) are replicated.

`SlotLayout` is hashable, so jitted engine functions take it as a static
argument and pin every state they return to these shardings: a state keeps one
layout from step to step instead of whatever the compiler would pick per program.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from adaflash_jax.parallel.rules import DEFAULT_RULES, logical_to_spec

# Logical axes of a slot-major KV cache (`models.kv_cache.KVCache.k` / `.v`): stacked, and one
# layer's buffer of a per-layer cache.
CACHE_AXES = ("layers", "batch", "kv_heads", None, "head_dim")
LAYER_CACHE_AXES = CACHE_AXES[1:]


def batch_shards(mesh: Mesh | None) -> int:
    """The product of the mesh axes the "batch" rule names (the most the slots can split into)."""
    if mesh is None:
        return 1
    axes = DEFAULT_RULES["batch"]
    return math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)) if a in mesh.shape)


def leaf_spec(shape, slot_axis: int, mesh: Mesh) -> PartitionSpec:
    """The spec of one state leaf: slot_axis < 0 replicates; a rank-5 leaf with slots on axis 1
    is a stacked KV cache, a rank-4 leaf with slots on axis 0 one layer of a per-layer cache (no
    other state leaf has that shape); any other leaf splits only its slot axis."""
    if slot_axis < 0:
        return PartitionSpec()
    if len(shape) == 5 and slot_axis == 1:
        names = CACHE_AXES
    elif len(shape) == 4 and slot_axis == 0:
        names = LAYER_CACHE_AXES
    else:
        names = tuple("batch" if i == slot_axis else None for i in range(len(shape)))
    return logical_to_spec(names, shape, mesh, DEFAULT_RULES)


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Where a slot state lives: `mesh` (None: one device) and its slot shard count."""

    mesh: Mesh | None = None
    shards: int = 1

    def shardings(self, tree, slot_axes):
        """NamedShardings for `tree` (slot_axes: a matching tree of each leaf's slot axis)."""
        return jax.tree.map(lambda x, a: NamedSharding(self.mesh, leaf_spec(x.shape, a, self.mesh)),
                            tree, slot_axes)

    def constrain(self, tree, slot_axes):
        """`tree` pinned to this layout inside a jitted function (unchanged without a mesh)."""
        if self.mesh is None:
            return tree
        return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, s), tree,
                            self.shardings(tree, slot_axes))

    def place(self, tree, slot_axes):
        """Puts host or device arrays of `tree` on this layout (unchanged without a mesh)."""
        if self.mesh is None:
            return tree
        return jax.device_put(tree, self.shardings(tree, slot_axes))

    def replicated(self, x):
        """`x` copied to every device of the mesh (e.g. slot indices, stop ids)."""
        return x if self.mesh is None else jax.device_put(x, NamedSharding(self.mesh, PartitionSpec()))
