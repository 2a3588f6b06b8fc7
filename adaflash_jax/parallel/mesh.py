"""Device meshes with the project's three axes: data, fsdp, tensor."""

from __future__ import annotations

import contextlib

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


def parse_mesh_spec(text: str) -> dict[str, int]:
    """'data=2,tensor=4' -> {"data": 2, "tensor": 4}; axes left out have size 1."""
    sizes: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in MESH_AXES or name in sizes:
            raise ValueError(f"bad mesh spec {text!r}: expected AXIS=SIZE items, each axis once, "
                             f"from {', '.join(MESH_AXES)} (e.g. data=2,tensor=4)")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"bad mesh spec {text!r}: {name} size {value.strip()!r} is not an integer") from None
    if not sizes:
        raise ValueError(f"bad mesh spec {text!r}: name at least one axis, e.g. tensor=8")
    return sizes


def mesh_from_spec(text: str, devices=None) -> Mesh:
    """The mesh a spec such as 'data=2,tensor=4' names, on the first data*fsdp*tensor devices."""
    sizes = parse_mesh_spec(text)
    devices = list(devices if devices is not None else jax.devices())
    need = sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("tensor", 1)
    if need > len(devices):
        raise ValueError(f"mesh {text!r} needs {need} devices but {len(devices)} are available")
    return make_mesh(devices=devices[:need], **sizes)


def host_staging(mesh: Mesh | None):
    """A context in which new arrays are built on the host CPU, when they are to be sharded onto
    `mesh` afterwards: a model too big for one accelerator (Qwen3-8B in bf16 on a 16 GiB chip)
    must never sit whole on the default device. Without a mesh (or a CPU backend) it does nothing."""
    if mesh is None:
        return contextlib.nullcontext()
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:
        return contextlib.nullcontext()
    return jax.default_device(cpu)
