"""`generate`'s length-policy settings: names, validation, and the "auto" probe memory.

The policies themselves run inside the engine's step (`speculative.py`); their
per-step plan (the AdaFlash head rule, and the expected-commits-per-second
optimisation of "auto") is `verify_plan.py`; the statistics they report are
`decode_stats.py`.
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np

from adaflash_jax.decoding.verify_plan import StepCosts, length_rule

POLICIES = ("fixed", "head", "auto")


def resolve(policy: str | None, drafter, verify_len, rho: float, min_len: int, probe_every: int) -> str:
    """The validated policy name: default "auto" with a length head, else "fixed"."""
    if policy is None:
        policy = "auto" if drafter.has_length_head and verify_len is None else "fixed"
    if policy not in POLICIES:
        raise ValueError(f"unknown length_policy {policy!r}; choose one of {POLICIES}")
    if policy == "fixed":
        return policy
    if not drafter.has_length_head:
        raise ValueError(f"length_policy={policy!r} needs a drafter with a length head "
                         f"({drafter.name or 'this drafter'} has none); use 'fixed'")
    if verify_len is not None:
        raise ValueError(f"verify_len applies to length_policy='fixed' only (got {policy!r})")
    check_rule_settings(rho, min_len, drafter.block_size)
    if int(probe_every) < 1:
        raise ValueError(f"probe_every must be >= 1, got {probe_every}")
    return policy


def check_rule_settings(rho, min_len, block_size: int) -> None:
    """The AdaFlash rule's settings, checked here for every host-side caller (generate,
    `verify_lengths`, the serving runtime): ρ > 0 (NaN is not) and 1 <= min_len <= Bs."""
    if not rho > 0:
        raise ValueError(f"rho must be positive, got {rho}")
    if not 1 <= int(min_len) <= block_size:
        raise ValueError(f"min_len must lie in [1, block_size={block_size}], got {min_len}")


def verify_lengths(scores: jax.Array, block_size: int, *, rho: float = 1.3, min_len: int = 1) -> jax.Array:
    """Lv = clamp(round(ŝ · Bs · ρ), Lmin, Bs) per sequence (int32), for host-side settings."""
    check_rule_settings(rho, min_len, block_size)
    return length_rule(scores, block_size, rho, min_len)


def unit_costs(buckets):
    """Costs for the "head" policy, which never reads them (its lengths come from the rule);
    they only keep both adaptive policies on one compiled signature."""
    return StepCosts(jnp.asarray(buckets, jnp.float32), jnp.float32(0.0), jnp.float32(buckets[0]))


class ProbeMemory:
    """The "auto" policy's probe states, per length head (its weights object) and setting.

    A later call with the same head, batch, costs and probe_every starts where the last
    one ended. Entries hold their head weakly and leave when it is collected, so an object
    that happens to get a dead head's `id()` never inherits its state.
    """

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, dict]] = {}

    def _states(self, head, create: bool) -> dict | None:
        entry = self._entries.get(id(head))
        if entry is not None and entry[0]() is head:
            return entry[1]
        if not create:
            return None
        key = id(head)

        def forget(ref, entries=self._entries):
            if entries.get(key, (None,))[0] is ref:
                del entries[key]

        states: dict = {}
        self._entries[key] = (weakref.ref(head, forget), states)
        return states

    def get(self, head, setting):
        states = self._states(head, create=False)
        return None if states is None else states.get(setting)

    def put(self, head, setting, state) -> None:
        self._states(head, create=True)[setting] = state

    def __len__(self) -> int:
        return len(self._entries)


def probe_setting(block_size: int, batch: int, costs, probe_every: int) -> tuple:
    """What a probe state is valid for besides the head: block size, padded batch, costs."""
    values = tuple(float(x) for x in np.concatenate([np.ravel(np.asarray(c)) for c in costs]))
    return int(block_size), int(batch), values, int(probe_every)
