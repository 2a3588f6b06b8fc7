"""Per-request slot settings (`SlotParams`), kept free of flax and the model code.

The host scheduler builds these for every engine, including the exported one,
which must run with jax alone; so the type lives here as a plain dataclass
pytree rather than beside the rest of the decode state (`engine_state`
re-exports it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_FIELDS = ("max_new", "temperature", "top_p", "seed_key", "stream", "verify_len")


@dataclasses.dataclass(frozen=True)
class SlotParams:
    """Per-request settings, one row per slot (or per inserted request)."""

    max_new: jax.Array  # int32: tokens the request may emit; 0 marks a free slot
    temperature: jax.Array  # float32 (> 0 when sampling; ignored by greedy engines)
    top_p: jax.Array  # float32 in (0, 1]
    seed_key: jax.Array  # PRNG key per row: the request's seed
    stream: jax.Array  # int32: which stream of that seed (generate: the prompt's index)
    verify_len: jax.Array  # int32: tokens verified per step under the "fixed" policy

    def replace(self, **changes) -> "SlotParams":
        return dataclasses.replace(self, **changes)

    @classmethod
    def build(cls, max_new, *, temperature, top_p, seeds, streams, verify_len) -> "SlotParams":
        """Rows from host values; every argument is a scalar or one value per row."""
        n = np.shape(max_new)[0]
        row = lambda x, dtype: jnp.asarray(np.broadcast_to(np.asarray(x, dtype), (n,)))  # noqa: E731
        unique, index = np.unique(np.broadcast_to(np.asarray(seeds, np.int64), (n,)), return_inverse=True)
        data = np.stack([np.asarray(jax.random.key_data(jax.random.key(int(s)))) for s in unique])
        keys = jax.random.wrap_key_data(jnp.asarray(data[index.reshape(-1)]))
        return cls(row(max_new, np.int32), row(temperature, np.float32), row(top_p, np.float32), keys,
                   row(streams, np.int32), row(verify_len, np.int32))


jax.tree_util.register_dataclass(SlotParams, data_fields=list(_FIELDS), meta_fields=[])
