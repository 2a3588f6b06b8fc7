"""A slot engine's verify-length policy, set up per live-prefix size.

"head" and "auto" (AdaFlash) verify through the packed layout, whose sizes
(`default_buckets(k, block)`) are multiples of the k rows a step computes, and
"auto" weighs those sizes by step costs measured at batch k. So each prefix size
the scheduler steps has its own static buckets (one EngineConfig, one compiled
program) and its own PlanParams. Both are built the first time that size is
stepped and kept: a scheduler steps only power-of-two prefixes, log2(S) + 1 sizes.

The engine's resting state carries the settings every size shares (rho, min_len,
probe_every, the start estimate) and no costs; each step brings its size's costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from adaflash_jax.decoding import length_policy as policies
from adaflash_jax.decoding.calibration import calibrate
from adaflash_jax.decoding.engine_state import EngineConfig
from adaflash_jax.decoding.packing import default_buckets
from adaflash_jax.decoding.verify_plan import PlanParams, ProbeState, StepCosts

# Step costs by rows stepped: k -> StepCosts, or {k: StepCosts}; None: calibrated at batch k.
CostSource = Callable[[int], StepCosts] | Mapping[int, StepCosts] | None


class SlotPolicy:
    """The length policy of one slot engine ("fixed" for AR and DFlash engines).

    length_policy: None picks "auto" when the drafter has a length head (and no verify_len
    is given), else "fixed", as `generate` does. rho / min_len: the AdaFlash rule's scale
    and floor; probe_every: "auto"'s forced-probe interval. step_costs ("auto"): see
    CostSource; "head" never reads costs and gets unit ones. place: puts a plan where
    the engine's state lives (its mesh).
    """

    def __init__(self, length_policy, target, drafter, *, verify_len=None, rho: float = 1.3, min_len: int = 1,
                 probe_every: int = 8, step_costs: CostSource = None, attn_impl: str = "xla",
                 place: Callable = lambda x: x):
        if drafter is None:
            if length_policy not in (None, "fixed"):
                raise ValueError(f"length_policy={length_policy!r} needs a drafter with a length head")
            self.policy = "fixed"
        else:
            self.policy = policies.resolve(length_policy, drafter, verify_len, rho, min_len, probe_every)
        self._target, self._drafter = target, drafter
        self._rho, self._min_len, self._probe_every = float(rho), int(min_len), int(probe_every)
        self._step_costs, self._attn_impl, self._place = step_costs, attn_impl, place
        self._by_rows: dict[int, tuple[EngineConfig, PlanParams]] = {}

    @property
    def adaptive(self) -> bool:
        """Whether verify lengths come from the length head (packed, per-prefix settings)."""
        return self.policy != "fixed"

    def engine_fields(self, num_slots: int) -> dict:
        """The EngineConfig fields of this policy, for a step of all num_slots slots."""
        if not self.adaptive:
            return {}
        return dict(policy=self.policy, buckets=default_buckets(num_slots, self._drafter.block_size),
                    length_head_def=self._drafter.head_graphdef)

    def resting_plan(self) -> PlanParams | None:
        """The plan the engine's state keeps between steps: every setting but the costs."""
        return self._plan(None) if self.adaptive else None

    def for_rows(self, cfg: EngineConfig, k: int) -> tuple[EngineConfig, PlanParams | None]:
        """(config, plan) of a k-row step of the engine configured by `cfg` (always the same)."""
        if not self.adaptive:
            return cfg, None
        if k not in self._by_rows:
            buckets = default_buckets(k, cfg.block_size)
            plan = self._plan(self._costs(k, buckets, cfg.cache_len))
            self._by_rows[k] = (dataclasses.replace(cfg, buckets=buckets), plan)
        return self._by_rows[k]

    def _plan(self, costs: StepCosts | None) -> PlanParams:
        plan = PlanParams(jnp.float32(self._rho), jnp.int32(self._min_len), costs,
                          jnp.int32(self._probe_every), ProbeState.fresh(self._probe_every))
        return self._place(jax.tree.map(jnp.asarray, plan))

    def _costs(self, k: int, buckets: tuple[int, ...], cache_len: int) -> StepCosts:
        source = self._step_costs
        if self.policy == "head":
            costs = policies.unit_costs(buckets)
        elif source is None:
            costs = calibrate(self._target, self._drafter, batch=k, cache_len=cache_len, buckets=buckets,
                              attn_impl=self._attn_impl)
        else:
            costs = source[k] if isinstance(source, Mapping) else source(k)
        costs = StepCosts(*(jnp.asarray(c, jnp.float32) for c in costs))
        if np.shape(costs.verify_s) != (len(buckets),) or np.shape(costs.draft_s) or np.shape(costs.ar_s):
            raise ValueError(f"step costs of a {k}-row step need one verify_s per packed size {buckets} and "
                             f"scalar draft_s / ar_s, got shapes {[np.shape(c) for c in costs]}")
        return costs
