"""Counter-based randomness of the fused verification head: 32-bit integer hashing, no PRNG state.

The kernels (both variants, in-kernel) and the plain-jnp reference draw the
same numbers for the same (seed, counter, vocab id), so a kernel's samples can
be checked exactly against the reference's. Each position gets a key from
(seed, counter); each vocab id (or the acceptance lane) a lane hash; the
uniform for (position, lane) is the mix of the two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ACCEPT_LANE = -1  # hash lane of the acceptance uniform; vocab lanes are 0 .. V-1


def _i32(c: int) -> np.int32:
    """A 32-bit constant as a (wrapped) signed int32."""
    return np.int32(c - (1 << 32) if c >= (1 << 31) else c)


_MUL1 = _i32(0x85EBCA6B)
_MUL2 = _i32(0xC2B2AE35)
_GOLDEN = _i32(0x9E3779B9)
_SEED_SALT = _i32(0x68E31DA4)


def _srl(x, bits: int):
    return lax.shift_right_logical(x, np.int32(bits))


def _mix32(x):
    """A bijective avalanche mix of int32 (the MurmurHash3 finaliser); multiplies wrap."""
    x = x ^ _srl(x, 16)
    x = x * _MUL1
    x = x ^ _srl(x, 13)
    x = x * _MUL2
    return x ^ _srl(x, 16)


def seed_mix(seed) -> jax.Array:
    """The seed's half of a position key (elementwise). Since keys are
    `_mix32(seed_mix(seed) ^ counter)`, counters XOR-ed with `seed_mix(s) ^ seed_mix(0)`
    under seed 0 give exactly seed s's keys: that is how callers give rows their own seeds."""
    return _mix32(jnp.asarray(seed, jnp.int32) ^ _SEED_SALT)


def position_keys(seed, counters) -> jax.Array:
    """int32 key per position from a scalar seed and int counters: distinct counters give
    distinct keys for one seed (both steps are bijections)."""
    return _mix32(seed_mix(seed) ^ jnp.asarray(counters, jnp.int32))


def lane_hash(lanes):
    """The per-lane half of the hash: computed once per vocab tile, mixed with each position's key."""
    return _mix32(lanes * _GOLDEN)


def hash_bits(keys, lane_mix):
    """32 random bits for (position key, lane); keys and lane_mix (a `lane_hash`) broadcast."""
    return _mix32(keys ^ lane_mix)


def uniform_from_bits(bits):
    """The top 23 bits as a float32 uniform in (0, 1): cell centres, exact in float32, so the
    extremes are 2**-24 and 1 - 2**-24 and the Gumbel transform stays finite (24 bits would
    round the top cell to 1.0, whose Gumbel is +inf)."""
    return (_srl(bits, 9).astype(jnp.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)


def gumbel_from_bits(bits):
    """Gumbel(0, 1) noise -log(-log u): finite, since u stays inside (0, 1)."""
    return -jnp.log(-jnp.log(uniform_from_bits(bits)))


def acceptance_uniforms(keys) -> jax.Array:
    """float32 uniforms in (0, 1) for the accept/reject draw at each position (lane -1)."""
    keys = jnp.asarray(keys, jnp.int32)
    return uniform_from_bits(hash_bits(keys, lane_hash(jnp.full((), ACCEPT_LANE, jnp.int32))))


def gumbel_noise(keys, num_lanes: int) -> jax.Array:
    """float32 [..., num_lanes]: the Gumbel noise the sampler adds at vocab ids 0 .. num_lanes-1."""
    keys = jnp.asarray(keys, jnp.int32)
    lanes = jnp.arange(num_lanes, dtype=jnp.int32)
    return gumbel_from_bits(hash_bits(keys[..., None], lane_hash(lanes)))
