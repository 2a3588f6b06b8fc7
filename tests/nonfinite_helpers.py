"""What the tests of the non-finite guard share: targets whose logits go non-finite on chosen
tokens, and fixed step costs for the adaptive decoder."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from adaflash_jax.decoding.adaptive.packed_step import engine_shapes
from adaflash_jax.decoding.tree_policy import auto_budgets
from adaflash_jax.decoding.verify_plan import StepCosts
from spec_helpers import BLOCK


def poisoned(target, *tokens: int):
    """`target` with a NaN embedding row for each of `tokens`: a position holding one has a NaN
    residual stream, and so has every later position that attends to it."""
    state = jax.tree.map(lambda x: x, target.state)
    name = target.name
    for token in tokens:
        state["embed"][...] = state["embed"][...].at[token].set(jnp.nan)
        name += f"-nan{token}"
    return dataclasses.replace(target, state=state, name=name)


def fixed_costs(ar_s: float):
    """k -> StepCosts of a k-row adaptive step: every drafted shape 1 s, an AR step ar_s. Given
    costs are used as they are, so the decoder's choices do not depend on timings."""
    def of_rows(k: int) -> StepCosts:
        shapes = engine_shapes(k, auto_budgets(BLOCK))
        return StepCosts(jnp.ones((len(shapes),), jnp.float32), jnp.float32(0.0), jnp.float32(ar_s))
    return of_rows
