"""Types the fused verify head's entry points and kernels share: tiles, outputs, problem.

Their own module, so `fused_verify` and `_fused_verify_kernels` both import
them and neither imports the other back.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from pallas_kernels.common import unknown_variant
from pallas_kernels.tiling import check_positive_ints, is_triton_tile

WEIGHT_LAYOUTS = ("dv", "vd")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Kernel tiling.

    token_tile: positions per tile (TPU: a multiple of 8; GPU: a power of two >= 16).
    vocab_tile: vocab columns per tile (TPU: a multiple of 128; GPU: a power of two >= 16).
    vocab_splits: vocab ranges reduced in parallel and combined afterwards (>= 1).
    d_tile: GPU only, the contraction chunk of D (a power of two >= 16); TPU takes all of D.
    num_warps, num_stages: GPU (Triton) launch parameters; None = Triton's defaults.
    vmem_limit_bytes: TPU only; None = raised automatically when the tiles need it.
    Tiles larger than the problem are shrunk to fit, so the defaults suit any size.
    """

    token_tile: int
    vocab_tile: int
    vocab_splits: int = 1
    d_tile: int = 64
    num_warps: int | None = None
    num_stages: int | None = None
    vmem_limit_bytes: int | None = None

    def __post_init__(self):
        check_positive_ints(self, ("token_tile", "vocab_tile", "vocab_splits", "d_tile", "num_warps", "num_stages",
                                   "vmem_limit_bytes"), optional=("num_warps", "num_stages", "vmem_limit_bytes"))

    @classmethod
    def for_variant(cls, variant: str) -> BlockSizes:
        if variant == "tpu":
            return cls(token_tile=256, vocab_tile=512, vocab_splits=2)
        if variant == "gpu":
            return cls(token_tile=32, vocab_tile=128, vocab_splits=64, d_tile=64, num_warps=4, num_stages=2)
        raise unknown_variant(variant)

    def validate(self, variant: str) -> None:
        """Raises ValueError if these sizes cannot tile the given variant."""
        if variant == "tpu":
            if self.token_tile % 8:
                raise ValueError(f"TPU token_tile must be a multiple of 8, got {self.token_tile}")
            if self.vocab_tile % 128:
                raise ValueError(f"TPU vocab_tile must be a multiple of 128, got {self.vocab_tile}")
        elif variant == "gpu":
            for name in ("token_tile", "vocab_tile", "d_tile"):
                value = getattr(self, name)
                if not is_triton_tile(value):
                    raise ValueError(f"GPU {name} must be a power of two >= 16, got {value}")
        else:
            raise unknown_variant(variant)


class VerifyHeadOut(NamedTuple):
    """Per-position results, each shaped like hidden.shape[:-1] (pallas_kernels/README.md)."""

    argmax: jax.Array       # int32
    lse: jax.Array          # float32, logsumexp(logits / T) (T = 1 when greedy)
    draft_logit: jax.Array  # float32, (logits / T)[draft_ids]; -inf outside [0, V)
    sample: jax.Array       # int32, the argmax when greedy


@dataclasses.dataclass(frozen=True)
class Problem:
    """One call's static shape: leading positions, flat N, D, V, weight layout, sampling or not."""

    positions: tuple[int, ...]
    n: int
    d: int
    vocab: int
    layout: str
    sample: bool
