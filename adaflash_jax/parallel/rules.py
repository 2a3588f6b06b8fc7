"""Logical axis names -> mesh axes, and placing module state on a mesh.

Parameters name their axes (`logical_axes` metadata, e.g. `("embed", "mlp")`);
this one table says which mesh axis shards each name. A dimension that the
mesh axis does not divide is replicated instead of failing, so the same rules
serve models whose head counts do not match the mesh (e.g. SmolLM2's 9 heads).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# logical name -> mesh axis (or tuple of axes); names absent here are replicated.
DEFAULT_RULES: Mapping[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "layers": None,
    "head_dim": None,
    "norm": None,
}


def _axis_size(mesh: Mesh, axis) -> int:
    axes = axis if isinstance(axis, tuple) else (axis,)
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping = DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec for one array; replicates dims the mesh axis would not divide."""
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match array rank {len(shape)}")
    used: set[str] = set()
    spec = []
    for name, dim in zip(names, shape):
        axis = rules.get(name) if name is not None else None
        if axis is not None:
            axes = axis if isinstance(axis, tuple) else (axis,)
            axes = tuple(a for a in axes if a in mesh.shape and a not in used)
            axis = axes if len(axes) > 1 else (axes[0] if axes else None)
        if axis is not None and dim % _axis_size(mesh, axis) == 0:
            used.update(axis if isinstance(axis, tuple) else (axis,))
            spec.append(axis)
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Mapping = DEFAULT_RULES):
    """NamedShardings for every variable of an nnx state (same tree structure)."""

    def one(var):
        names = var.get_metadata().get("logical_axes") or (None,) * var[...].ndim
        return NamedSharding(mesh, logical_to_spec(names, var[...].shape, mesh, rules))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_state(state: nnx.State, mesh: Mesh, rules: Mapping = DEFAULT_RULES) -> nnx.State:
    """Places every variable of `state` on `mesh` according to `rules`."""
    shardings = state_shardings(state, mesh, rules)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return jax.tree.map(lambda var, sh: var.replace(jax.device_put(var[...], sh)),
                        state, shardings, is_leaf=is_var)


def batch_sharding(mesh: Mesh, ndim: int, batch: int, rules: Mapping = DEFAULT_RULES) -> NamedSharding:
    """Sharding for an activation/input whose leading dim is the batch."""
    spec = logical_to_spec(("batch",) + (None,) * (ndim - 1), (batch,) + (1,) * (ndim - 1), mesh, rules)
    return NamedSharding(mesh, spec)
