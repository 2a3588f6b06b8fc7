"""Packed layout for variable-length verification: Σ L_b tokens in one flat buffer.

A verify step scores the first L_b tokens of each row's block (0 ≤ L_b ≤ Bs).
Packing those spans back to back into N static slots makes the target's
projections, MLP and LM head cost Σ L_b tokens instead of B × Bs; N is one of a
few bucket sizes so the number of compiled shapes stays small.

Slots past Σ L_b are padding: `valid` is False, the row is 0 and the offset is
`PAD_OFFSET`, so their position `cache.lengths[0] + PAD_OFFSET` lies past any
KV cache and their K/V writes are dropped instead of clobbering row 0.

It lives with the models because their packed forward consumes it; the
decoding engine builds it (`pack_layout`) and picks the bucket sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

PAD_OFFSET = 1 << 30  # far past any cache length, yet no int32 overflow once a length is added


@struct.dataclass
class PackedLayout:
    seq_ids: jax.Array  # int32 [N]: row of each slot (0 for padding)
    offsets: jax.Array  # int32 [N]: index in the row's verified span (PAD_OFFSET for padding)
    valid: jax.Array  # bool [N]: False for bucket padding
    row_start: jax.Array  # int32 [B]: slot of each row's first token
    lengths: jax.Array  # int32 [B]: tokens each row verifies
    block_size: int = struct.field(pytree_node=False)  # static bound on lengths (padded width)

    @property
    def num_slots(self) -> int:
        return self.seq_ids.shape[0]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def pack(self, values: jax.Array) -> jax.Array:
        """[B, Bs, ...] -> [N, ...]: each slot's (row, offset) entry; padding slots are zeros."""
        offsets = jnp.minimum(self.offsets, values.shape[1] - 1)
        out = values[self.seq_ids, offsets]
        mask = self.valid.reshape((-1,) + (1,) * (out.ndim - 1))
        return jnp.where(mask, out, jnp.zeros((), out.dtype))

    def unpack(self, values: jax.Array, block_size: int | None = None, fill=0) -> jax.Array:
        """[N, ...] -> [B, Bs, ...]; positions at or past a row's length hold `fill`.

        A gather (each output reads its slot), not a scatter: deterministic and
        cheap on accelerators. Bs defaults to the layout's block size.
        """
        bs = self.block_size if block_size is None else block_size
        t = jnp.arange(bs, dtype=jnp.int32)[None]
        slot = self.row_start[:, None] + t
        out = values[jnp.clip(slot, 0, values.shape[0] - 1)]
        keep = t < self.lengths[:, None]
        mask = keep.reshape(keep.shape + (1,) * (out.ndim - 2))
        return jnp.where(mask, out, jnp.asarray(fill, out.dtype))


def pack_layout(lengths: jax.Array, num_slots: int, block_size: int | None = None) -> PackedLayout:
    """Layout of rows packed in order, each contiguous, padding at the end.

    `block_size` bounds every length; it is the width the XLA attention unpacks
    to, so pass the verify block size (None falls back to `num_slots`, correct
    but B × N wide). Concrete lengths are checked here; traced ones cannot be.
    """
    block_size = num_slots if block_size is None else block_size
    if not isinstance(lengths, jax.core.Tracer):
        host = np.asarray(lengths)
        if host.ndim != 1 or host.size == 0:
            raise ValueError(f"lengths must be a non-empty 1-D array; got shape {host.shape}")
        if host.min() < 0 or host.max() > block_size:
            raise ValueError(f"lengths must lie in [0, {block_size}]; got {host.tolist()}")
        if host.sum() > num_slots:
            raise ValueError(f"num_slots={num_slots} cannot hold the {int(host.sum())} tokens "
                             f"of lengths {host.tolist()}")
    lengths = jnp.asarray(lengths, jnp.int32)
    ends = jnp.cumsum(lengths)
    row_start = ends - lengths
    slot = jnp.arange(num_slots, dtype=jnp.int32)
    # The row of each slot: how many rows end at or before it (skips empty rows). A count, not
    # a searchsorted, so it also traces with a symbolic batch (jax.export); N·B compares.
    row = jnp.sum(ends[None, :] <= slot[:, None], axis=1, dtype=jnp.int32)
    valid = slot < ends[-1]
    seq_ids = jnp.where(valid, row, 0)
    offsets = jnp.where(valid, slot - row_start[jnp.minimum(row, lengths.shape[0] - 1)], PAD_OFFSET)
    return PackedLayout(seq_ids=seq_ids, offsets=offsets, valid=valid, row_start=row_start,
                        lengths=lengths, block_size=block_size)


def pack(values: jax.Array, layout: PackedLayout) -> jax.Array:
    """[B, Bs, ...] -> [N, ...]; see `PackedLayout.pack`."""
    return layout.pack(values)


def unpack(values: jax.Array, layout: PackedLayout, block_size: int | None = None,
           fill=0) -> jax.Array:
    """[N, ...] -> [B, Bs, ...]; see `PackedLayout.unpack`."""
    return layout.unpack(values, block_size, fill)
