"""Packed verify buckets: the few static slot counts a packed verify step compiles for.

The layout itself (`PackedLayout`, `pack_layout`, `pack`, `unpack`) lives in
`models.packed_layout`, beside the packed forward that consumes it.
"""

from __future__ import annotations


def default_buckets(batch: int, block_size: int) -> tuple[int, ...]:
    """Packed sizes `batch · 2^k`, capped at (and always ending with) `batch · block_size`.

    Σ L_b runs from `batch` (every row verifies only its bonus, an AR step) to
    `batch · block_size`; geometric steps keep the padding waste under 2x with
    only log2(block_size) + 1 compiled shapes (5 for Bs = 16). Sizes stay
    multiples of the batch, so a batch aligned to the hardware's tiles keeps them
    aligned too.
    """
    if batch < 1 or block_size < 1:
        raise ValueError(f"batch and block_size must be positive; got {batch}, {block_size}")
    cap = batch * block_size
    sizes, n = [], batch
    while n < cap:
        sizes.append(n)
        n *= 2
    return tuple(sizes) + (cap,)
