"""What the Pallas kernel tests share: fast CPU compiles of interpret-mode kernels, and export for accelerators.

Imported as a top-level module (pytest puts this folder on sys.path).
"""

import jax

from pallas_kernels.common import TRITON_CALL, TRITON_EXPORT_CHECKS

ON_CPU = jax.default_backend() == "cpu"
# Interpret-mode kernels compile to big CPU programs (large while loops); XLA's CPU optimisations
# add only compile time at the tests' tiny shapes and change nothing the kernels compute.
FAST_COMPILE = ({"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                 "xla_cpu_use_fusion_emitters": False} if ON_CPU else {})
EXPORT_PLATFORMS = {"tpu": "tpu", "gpu": "cuda"}  # kernel variant -> jax.export platform
CUSTOM_CALLS = {"tpu": "tpu_custom_call", "gpu": TRITON_CALL}  # what each variant lowers to


def fast_jit(fn):
    """jax.jit with FAST_COMPILE."""
    return jax.jit(fn, compiler_options=FAST_COMPILE)


def compiled(fn, *args):
    """fn compiled once, with FAST_COMPILE, for the shapes and dtypes of args."""
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)


def run_compiled(fn, *args):
    return compiled(fn, *args)(*args)


def export_for(fn, variant: str, *args) -> jax.export.Exported:
    """fn lowered from this host for the variant's accelerator (Triton's export check disabled)."""
    return jax.export.export(jax.jit(fn), platforms=(EXPORT_PLATFORMS[variant],),
                             disabled_checks=TRITON_EXPORT_CHECKS)(*args)
