"""What drafting delivered against what its trees promised: one factor on the budgets.

A drafted step gives each row the budget its tree's expected accepted drafts pay for (the
drafter's own path probabilities, corrected per request by the levels it examined,
`verify_plan.feedback_shift`). Those expectations came out too high on the steps the
policy drafted: at concurrency 1 on the fixed evaluation set the drafted steps committed
0.91-0.93 of the tokens (bonus included) their allocation expected greedy and 0.60-0.80
at T = 0.7, whose drafted steps then ran at 0.6-0.8 of an AR step's rate while their
allocation promised 1.0-1.2. Two things bias them, and the per-request correction sees
neither: a step is drafted because its estimate is high, so its errors are not centred
(the selection); and every request starts with no feedback of its own, at the drafter's
raw calibration, which at T > 0 is overconfident for as long as a short request lasts.

So the decoder keeps one more pair of running sums over its drafted steps: the accepted
drafts (`realized`) and the accepted drafts the allocation expected for the budgets it
gave (`promised`, before this correction), both discounted by DECAY per drafted step. Their
ratio, with PRIOR_TOKENS of agreement (factor 1) as the prior, multiplies the tree's
expectations when the budgets are chosen (`packed_step.adaptive_step`). It does not touch
the rows' running estimates, which decide whether to draft at all (`allocation.pays` says
why). Unlike the per-request counts it is not reset when a slot takes a new request;
`generate` carries it from call to call per drafter and sampling mode (`carried`, `keep`),
the server's engine in its state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from adaflash_jax.decoding.length_policy import ProbeMemory

PRIOR_TOKENS = 8.0  # promised drafts of agreement the factor starts from
DECAY = 0.97  # per drafted step: the sums remember about the last 30 drafted steps
FACTOR_RANGE = (0.25, 1.5)  # never switches drafting off for good, never more than half again


@struct.dataclass
class RealizedGain:
    """Discounted sums over drafted steps of accepted drafts and of those expected."""

    realized: jax.Array  # float32 []
    promised: jax.Array  # float32 []

    @classmethod
    def fresh(cls) -> "RealizedGain":
        return cls(jnp.float32(0.0), jnp.float32(0.0))

    def factor(self) -> jax.Array:
        """float32 []: realized over promised, pulled towards 1 by PRIOR_TOKENS."""
        ratio = (self.realized + PRIOR_TOKENS) / (self.promised + PRIOR_TOKENS)
        return jnp.clip(ratio, *FACTOR_RANGE).astype(jnp.float32)

    def observe(self, accepted: jax.Array, expected: jax.Array, drafted: jax.Array) -> "RealizedGain":
        """After a drafted step: accepted [S] drafts against expected [S] (uncorrected), summed
        over the rows in `drafted` [S] (live rows given a budget of 2 or more)."""
        got = jnp.sum(jnp.where(drafted, accepted.astype(jnp.float32), 0.0))
        want = jnp.sum(jnp.where(drafted, expected, 0.0))
        return RealizedGain(DECAY * self.realized + got, DECAY * self.promised + want)


def gain_of(policy) -> jax.Array | float:
    """The factor in force for a policy state, or 1 for an engine that keeps none."""
    return 1.0 if policy.gain is None else policy.gain.factor()


_CARRIED = ProbeMemory()


def carried(drafter_state, greedy: bool) -> RealizedGain:
    """The sums the last `generate` call with this drafter (its weights object) and sampling
    mode ended with, or fresh ones."""
    kept = _CARRIED.get(drafter_state, bool(greedy))
    return RealizedGain.fresh() if kept is None else RealizedGain(*(jnp.float32(x) for x in kept))


def keep(drafter_state, greedy: bool, gain: RealizedGain) -> None:
    """Remembers a call's final sums for the next call (host floats: no device buffer is held)."""
    _CARRIED.put(drafter_state, bool(greedy), tuple(float(np.asarray(x)) for x in (gain.realized, gain.promised)))
