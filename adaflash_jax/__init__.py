"""adaflash_jax: AdaFlash / DFlash speculative decoding in JAX.

Public API (stable): `load_target`, `generate`, `init_drafter`, `load_drafter`,
`save_drafter`, `draft_logits`, and the `Target`, `Drafter`, `GenerateResult` types.
"""

from adaflash_jax.drafter_api import Drafter, draft_logits, init_drafter, load_drafter, save_drafter
from adaflash_jax.generation import GenerateResult, generate
from adaflash_jax.target_api import Target, load_target, random_target

__all__ = ["Drafter", "GenerateResult", "Target", "draft_logits", "generate", "init_drafter",
           "load_drafter", "load_target", "random_target", "save_drafter"]
