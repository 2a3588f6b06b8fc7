"""Tile arithmetic and in-kernel matmuls that every Pallas kernel here needs.

TPU (Mosaic) blocks must tile (8, 128) sublanes x lanes (16 rows for 16-bit
dtypes); Triton's `dot` wants power-of-two tiles >= 16. The pickers below turn
a preferred tile into a legal one for each variant, and the checks give
`BlockSizes` classes one wording for bad values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

LANES = 128  # TPU lane width: per-row statistics are kept lane-replicated
DOT_NT = (((1,), (1,)), ((), ()))  # a @ b.T
DOT_NN = (((1,), (0,)), ((), ()))  # a @ b
DOT_TN = (((0,), (0,)), ((), ()))  # a.T @ b


# --------------------------------------------------------------------------- integers


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, x - 1).bit_length()


def is_int(x) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def is_triton_tile(x: int) -> bool:
    """Triton's `dot` takes power-of-two tiles of at least 16."""
    return x >= 16 and is_pow2(x)


def check_positive_ints(sizes, names, *, optional=()) -> None:
    """Raises ValueError unless each named field of `sizes` is a positive int (or None if optional)."""
    for name in names:
        value = getattr(sizes, name)
        if value is None and name in optional:
            continue
        if not is_int(value) or value < 1:
            allowed = "None or a positive int" if name in optional else "a positive int"
            raise ValueError(f"{type(sizes).__name__}.{name} must be {allowed}, got {value!r}")


# --------------------------------------------------------------------------- tiles and padding


def sublane_align(dtype) -> int:
    """Row alignment of a TPU tile of `dtype` (8 for 32-bit, 16 for 16-bit)."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def pick_tile(n: int, pref: int, variant: str, align: int) -> tuple[int, int]:
    """(tile, padded length) for an axis of length n tiled by at most `pref`.

    TPU: the whole axis when n <= pref (a block equal to the array dim is
    always legal), else the largest multiple of `align` in [pref/4, pref] that
    divides n (no padding copy), else `pref` rounded to `align` with n padded.
    GPU: powers of two >= 16 (Triton), the largest in [pref/4, pref] dividing
    n, else n padded.
    """
    if variant == "gpu":
        tile = min(pref, next_pow2(max(n, 16)))
        cands = [tile >> s for s in range(8) if (tile >> s) >= max(16, tile // 4)]
    else:
        if n <= pref:  # one tile spanning the whole axis is always a legal TPU block
            return n, n
        tile = max(align, pref - pref % align)
        cands = list(range(tile, max(align, tile // 4) - 1, -align))
    for cand in cands:
        if n % cand == 0:
            return cand, n
    return tile, round_up(n, tile)


def divisor_tile(n: int, pref: int, variant: str, itemsize: int) -> int:
    """The largest legal tile <= pref that divides n exactly; ValueError if there is none.

    For an axis that must not be padded (a KV cache: padding it copies it on
    every call). TPU: n itself when n <= pref, else a multiple of 128 lanes,
    failing that of the packed sublane tile, failing that of 8. GPU: a power
    of two >= 16.
    """
    if variant == "tpu":
        if n <= pref:
            return n  # one tile equal to the full axis is always a legal block
        for align in sorted({LANES, 8 * max(1, 4 // itemsize), 8}, reverse=True):
            for tile in range(pref - pref % align, 0, -align):
                if n % tile == 0:
                    return tile
        raise ValueError(f"the cache length axis S={n} has no divisor <= block_kv={pref} "
                         f"that is a multiple of 8; pad the cache to a multiple of 8 for the TPU kernel")
    tile = pref
    while tile >= 16:
        if n % tile == 0:
            return tile
        tile //= 2
    raise ValueError(f"the cache length axis S={n} has no power-of-two divisor >= 16 and <= "
                     f"block_kv={pref}; pad the cache to a multiple of 16 for the GPU kernel")


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pads one axis of x up to `size` (no copy when it already has that size)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


# --------------------------------------------------------------------------- in-kernel matmul


def dot(a, b, dims, precision=None):
    """lax.dot_general accumulating in float32 (dims: DOT_NT, DOT_NN or DOT_TN)."""
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
