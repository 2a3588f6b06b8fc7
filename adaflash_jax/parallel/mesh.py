"""Device meshes with the project's three axes: data, fsdp, tensor."""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "fsdp", "tensor")


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axes.

    Auto (not Explicit) axis types: with Explicit axes, embedding gathers and
    row-parallel matmuls need manual out-shardings everywhere; Auto lets the
    compiler propagate shardings from the parameters and inputs.
    """
    devices = list(devices if devices is not None else jax.devices())
    need = data * fsdp * tensor
    if min(data, fsdp, tensor) < 1:
        raise ValueError(f"mesh sizes must be >= 1, got data={data} fsdp={fsdp} tensor={tensor}")
    if need != len(devices):
        raise ValueError(f"mesh data*fsdp*tensor = {need} but {len(devices)} devices are available; "
                         "set the sizes so their product equals the device count")
    return jax.make_mesh((data, fsdp, tensor), MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices)
