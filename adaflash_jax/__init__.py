"""adaflash_jax: AdaFlash / DFlash speculative decoding in JAX.

Public API (stable): `load_target`, `generate`, `init_drafter`, `load_drafter`,
`save_drafter`, `draft_logits`, `load_exported`, and the `Target`, `Drafter`,
`GenerateResult` types.

Names resolve on first use, so `af.load_exported` (the exported decoder's runtime)
runs on jax and the artifact alone, without importing the model code.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Drafter": "adaflash_jax.drafter_api",
    "draft_logits": "adaflash_jax.drafter_api",
    "init_drafter": "adaflash_jax.drafter_api",
    "load_drafter": "adaflash_jax.drafter_api",
    "save_drafter": "adaflash_jax.drafter_api",
    "GenerateResult": "adaflash_jax.generation",
    "generate": "adaflash_jax.generation",
    "Target": "adaflash_jax.target_api",
    "load_target": "adaflash_jax.target_api",
    "random_target": "adaflash_jax.target_api",
    "load_exported": "adaflash_jax.serving.runtime",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'adaflash_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
