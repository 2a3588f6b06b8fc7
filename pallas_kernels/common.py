"""What every kernel shares: the `impl=` vocabulary and the choice of kernel variant.

Each kernel file has a TPU (Mosaic) variant, a GPU variant and a plain-jnp
`*_reference`. `impl` says which the caller wants:

- "xla": the reference (what XLA compiles; the default on CPU).
- "pallas": the Pallas kernel for the current backend; on a host without an
  accelerator it runs the TPU variant in interpret mode (slow, exact, for tests).
- "auto": Pallas on TPU/GPU, the reference elsewhere.

`variant=` ("tpu" | "gpu") pins the kernel variant, e.g. to lower the TPU kernel
with `jax.export(..., platforms=("tpu",))` from a CPU host. The GPU variants are
Pallas Triton kernels, whose custom call has no serialization stability
guarantee: exporting them needs `TRITON_EXPORT_CHECKS` as `disabled_checks`.
"""

from __future__ import annotations

import dataclasses

import jax

IMPLS = ("xla", "pallas", "auto")
VARIANTS = ("tpu", "gpu")
TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call target of Pallas Triton kernels
TRITON_EXPORT_CHECKS = (jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL),)


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The resolved choice: `variant` is None for the XLA reference."""

    variant: str | None
    interpret: bool = False

    @property
    def use_pallas(self) -> bool:
        return self.variant is not None


def unknown_variant(variant) -> ValueError:
    """The error for a variant name that is neither "tpu" nor "gpu" (raise it)."""
    return ValueError(f"unknown kernel variant {variant!r}; choose 'tpu' or 'gpu'")


def current_platform() -> str:
    """'tpu', 'gpu' or 'cpu' for the default backend."""
    platform = jax.default_backend()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def choose_kernel(impl: str, variant: str | None = None, interpret: bool | None = None) -> KernelChoice:
    """Resolves `impl` (and an optional pinned `variant`/`interpret`) into a KernelChoice."""
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel impl {impl!r}; choose one of {IMPLS}")
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"unknown kernel variant {variant!r}; choose one of {VARIANTS}")
    platform = current_platform()
    on_accelerator = platform in VARIANTS
    if impl == "xla" or (impl == "auto" and not on_accelerator and variant is None):
        return KernelChoice(None)
    chosen = variant or (platform if on_accelerator else "tpu")
    if interpret is None:
        interpret = chosen != platform
    return KernelChoice(chosen, interpret)
