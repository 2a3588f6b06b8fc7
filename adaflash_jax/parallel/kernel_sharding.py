"""Running Pallas kernels on a sharded batch: one kernel call per device shard.

XLA cannot partition a Pallas kernel (a custom call) by itself: under a mesh it
would gather the operands and run the whole batch on every device. When a
mesh is set (`jax.set_mesh`, as the trainer does for `attn_impl="pallas"`),
`per_shard` wraps the kernel in `jax.shard_map`: the batch dimension splits
over the mesh's data-parallel axes ("data", "fsdp") and the head dimension
over "tensor" where the head counts allow, so each device runs the kernel on
its own rows and heads. Attention is independent across rows and across kv
head groups, so nothing needs to be communicated.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Sequence

import jax
from jax.sharding import PartitionSpec

BATCH_AXES = ("data", "fsdp")
HEAD_AXIS = "tensor"


def current_mesh():
    """The mesh set with `jax.set_mesh` (abstract inside jit), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty or math.prod(mesh.axis_sizes) == 1 else mesh


def _axes_dividing(mesh, axes: Sequence[str], size: int) -> tuple[str, ...]:
    """The longest prefix of `axes` (present in the mesh) whose product divides `size`."""
    chosen: list[str] = []
    for axis in axes:
        if axis not in mesh.axis_names or mesh.shape[axis] == 1:
            continue
        if size % (math.prod(mesh.shape[a] for a in chosen) * mesh.shape[axis]) == 0:
            chosen.append(axis)
    return tuple(chosen)


def per_shard(kernel: Callable, arrays: Sequence[jax.Array], head_dims: Sequence[int | None],
              out_head_dim: int | None = 1) -> jax.Array:
    """kernel(*arrays), run per device shard under the current mesh (plain call without one).

    Every array has the batch at dim 0; head_dims[i] names array i's head dim (None: no
    heads, e.g. lengths or anchors). Heads split over "tensor" only when every head count
    divides by it (so GQA groups stay whole on one device); the output's head dim is
    `out_head_dim`.
    """
    mesh = current_mesh()
    if mesh is None:
        return kernel(*arrays)
    batch = _axes_dividing(mesh, BATCH_AXES, arrays[0].shape[0])
    head_sizes = [a.shape[d] for a, d in zip(arrays, head_dims) if d is not None]
    heads = (HEAD_AXIS if HEAD_AXIS in mesh.axis_names and mesh.shape[HEAD_AXIS] > 1
             and all(h % mesh.shape[HEAD_AXIS] == 0 for h in head_sizes) else None)
    if not batch and heads is None:
        return kernel(*arrays)
    batch_spec = batch if len(batch) > 1 else (batch[0] if batch else None)

    def spec(ndim: int, head_dim: int | None) -> PartitionSpec:
        parts = [batch_spec] + [None] * (ndim - 1)
        if head_dim is not None:
            parts[head_dim] = heads
        return PartitionSpec(*parts)

    in_specs = tuple(spec(a.ndim, d) for a, d in zip(arrays, head_dims))
    out_ndim = arrays[0].ndim
    return jax.shard_map(lambda *xs: kernel(*xs), mesh=mesh, in_specs=in_specs,
                         out_specs=spec(out_ndim, out_head_dim), check_vma=False)(*arrays)


def kernel_mesh(mesh, attn_impl: str):
    """Context for tracing a step: sets `mesh` (so `per_shard` splits the kernels over it) when
    the step runs Pallas kernels on more than one device; otherwise changes nothing."""
    from pallas_kernels.common import choose_kernel

    if mesh is None or mesh.size == 1 or not choose_kernel(attn_impl).use_pallas:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)
