"""adaflash_jax: AdaFlash / DFlash speculative decoding in JAX.

Public API (stable): `load_target`, `generate`, `Target`, `GenerateResult`.
"""

from adaflash_jax.generation import GenerateResult, generate
from adaflash_jax.target_api import Target, load_target, random_target

__all__ = ["GenerateResult", "Target", "generate", "load_target", "random_target"]
