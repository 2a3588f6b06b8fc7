"""`BlockSizes`: the tiles the block-attention kernels share, inference and training.

Its own module, so the training kernels' layout imports it without importing
`block_attention` (and nothing imports back).
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.common import unknown_variant
from pallas_kernels.tiling import check_positive_ints, is_triton_tile


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the block-attention kernels.

    block_q / block_kv: query rows / context keys per tile of the forward pass
    (the inference kernel and the training forward). block_q_bwd /
    block_kv_bwd: the same for the training backward kernels (None: the forward
    values). In training a query tile holds whole blocks: its row count is
    rounded down to a multiple of the block size (at least one block).
    num_warps / num_stages: Triton launch parameters (GPU variant only;
    num_warps None: 4 for head dims <= 64, else 8).
    """

    block_q: int = 128
    block_kv: int = 512
    block_q_bwd: int | None = None
    block_kv_bwd: int | None = None
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        check_positive_ints(self, ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd", "num_warps", "num_stages"),
                            optional=("block_q_bwd", "block_kv_bwd", "num_warps"))

    @classmethod
    def for_variant(cls, variant: str) -> BlockSizes:
        """The default tiles of a kernel variant ("tpu" or "gpu")."""
        if variant == "tpu":
            return cls(block_q=128, block_kv=512, block_q_bwd=128, block_kv_bwd=256)
        if variant == "gpu":
            return cls(block_q=64, block_kv=64, block_q_bwd=32, block_kv_bwd=32, num_stages=2)
        raise unknown_variant(variant)

    @property
    def q_bwd(self) -> int:
        return self.block_q if self.block_q_bwd is None else self.block_q_bwd

    @property
    def kv_bwd(self) -> int:
        return self.block_kv if self.block_kv_bwd is None else self.block_kv_bwd

    def warps(self, head_dim: int) -> int:
        return self.num_warps if self.num_warps is not None else (4 if head_dim <= 64 else 8)

    def check(self, variant: str) -> BlockSizes:
        """Validates the tiles for `variant`; returns self."""
        tiles = {"block_q": self.block_q, "block_kv": self.block_kv,
                 "block_q_bwd": self.q_bwd, "block_kv_bwd": self.kv_bwd}
        for name, value in tiles.items():
            if variant == "tpu" and value % 8:
                raise ValueError(f"TPU tiles must be multiples of 8 (sublanes): BlockSizes.{name}={value}")
            if variant == "gpu" and not is_triton_tile(value):
                raise ValueError(
                    f"GPU (Triton) tiles must be powers of two >= 16: BlockSizes.{name}={value}")
        return self


def resolve_block_sizes(block_sizes: BlockSizes | None, variant: str) -> BlockSizes:
    if block_sizes is None:
        return BlockSizes.for_variant(variant)
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}")
    return block_sizes.check(variant)
