"""A slot engine's verify-length policy, set up per live-prefix size.

"head" and "auto" (AdaFlash) verify through the packed layout, whose sizes
(`default_buckets(k, block)`) are multiples of the k rows a step computes, and
"auto" weighs those sizes by step costs measured at batch k. So each prefix size
the scheduler steps has its own static buckets (one EngineConfig, one compiled
program) and its own PlanParams. Both are built the first time that size is
stepped and kept: a scheduler steps only power-of-two prefixes, log2(S) + 1 sizes.

The engine's resting state carries the settings every size shares (rho, min_len,
probe_every, the start estimate) and no costs; each step brings its size's costs.

Tree verification (`tree_budget`) is one more policy: a fixed node budget needs no
plan, and "auto" picks a budget per step from `tree_policy.auto_budgets` (the same
for every prefix size) by tree-step costs measured at batch k (`calibrate_tree`).

The adaptive decoder (`decoding.adaptive`, verify "adaptive") is the default with a
drafter and no mode settings, as in `generate`: per-row budgets from 1 (a plain AR
token) to the largest auto budget, under costs of its own packed shapes measured at
batch k (`calibrate_adaptive`); the engine runs its AR and drafted steps as separate
programs (`adaptive.programs.single_step`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from adaflash_jax.decoding import length_policy as policies
from adaflash_jax.decoding.adaptive.costs import calibrate_adaptive
from adaflash_jax.decoding.adaptive.mode import verify_mode
from adaflash_jax.decoding.adaptive.packed_step import engine_shapes
from adaflash_jax.decoding.calibration import calibrate
from adaflash_jax.decoding.engine_state import EngineConfig, EngineWeights
from adaflash_jax.decoding.packing import default_buckets
from adaflash_jax.decoding.tree_costs import calibrate_tree
from adaflash_jax.decoding.tree_policy import tree_budgets
from adaflash_jax.decoding.verify_plan import PlanParams, ProbeState, StepCosts

# Step costs by rows stepped: k -> StepCosts, or {k: StepCosts}; None: calibrated at batch k.
CostSource = Callable[[int], StepCosts] | Mapping[int, StepCosts] | None


class SlotPolicy:
    """The verification of one slot engine: `verify` "adaptive" (the default with a drafter),
    "chain" or "tree", or None for AR engines; and its length policy ("fixed" for AR and DFlash).

    verify: as `generate`'s (None: implied by the other settings, `adaptive.mode`).
    length_policy (chain): None picks "auto" when the drafter has a length head (and no verify_len
    is given), else "fixed", as `generate` does. rho / min_len: the AdaFlash rule's scale
    and floor; probe_every: "auto"'s forced-probe interval. step_costs ("auto"): see
    CostSource; "head" never reads costs and gets unit ones. place: puts a plan where
    the engine's state lives (its mesh). tree_budget: verify a best-first tree of this
    many nodes per step, or "auto" (a budget per step; step_costs then give one verify_s
    per budget of `tree_budgets`); None verifies the drafted chain.
    """

    def __init__(self, length_policy, target, drafter, *, verify_len=None, rho: float = 1.3, min_len: int = 1,
                 probe_every: int = 8, step_costs: CostSource = None, attn_impl: str = "xla",
                 place: Callable = lambda x: x, tree_budget: int | str | None = None, verify: str | None = None):
        self.verify = None
        if drafter is None:
            if verify is not None:
                raise ValueError(f"verify={verify!r} needs a drafter")
        else:
            self.verify = verify_mode(verify, tree_budget=tree_budget, length_policy=length_policy,
                                      verify_len=verify_len)
        if verify == "chain" and tree_budget is not None:
            raise ValueError("verify='chain' verifies the drafted block; tree_budget applies to verify='tree'")
        if self.verify == "adaptive":
            tree_budget = "auto"
        elif self.verify == "tree" and tree_budget is None:
            tree_budget = drafter.block_size
        self.tree_budgets = _tree_budgets(tree_budget, drafter, length_policy, verify_len)
        if drafter is None:
            if length_policy not in (None, "fixed"):
                raise ValueError(f"length_policy={length_policy!r} needs a drafter with a length head")
            self.policy = "fixed"
        elif self.tree_budgets:
            self.policy = "auto" if len(self.tree_budgets) > 1 else "fixed"
        else:
            self.policy = policies.resolve(length_policy, drafter, verify_len, rho, min_len, probe_every)
        self._target, self._drafter = target, drafter
        self._rho, self._min_len, self._probe_every = float(rho), int(min_len), int(probe_every)
        self._step_costs, self._attn_impl, self._place = step_costs, attn_impl, place
        self._by_rows: dict[int, tuple[EngineConfig, PlanParams]] = {}

    @property
    def learns_costs(self) -> bool:
        """The costs are calibrated here (no step_costs given), so the engine corrects them by
        its steps' timings (`adaptive.online_costs`)."""
        return self._step_costs is None

    @property
    def adaptive(self) -> bool:
        """Whether each step decides its verify length or tree budget (a plan per prefix size)."""
        return self.policy != "fixed"

    @property
    def uses_length_head(self) -> bool:
        """Whether the steps read the AdaFlash length head (adaptive chain verification)."""
        return self.adaptive and not self.tree_budgets

    @property
    def headroom(self) -> int:
        """Cache slots a step may write past a slot's committed length: none for plain AR steps
        and for the adaptive decoder, which writes committed tokens only (its verification
        reads the caches and attends to the nodes' own K/V; a write past the end is dropped)."""
        if self._drafter is None or self.verify == "adaptive":
            return 0
        return max((self._drafter.block_size, *self.tree_budgets))

    def engine_fields(self, num_slots: int, greedy: bool = True) -> dict:
        """The EngineConfig fields of this policy, for a step of all num_slots slots."""
        if self.tree_budgets:
            tree = dict(verify="tree", tree_budget=max(self.tree_budgets),
                        coupled_sampling=self.verify == "adaptive" and not greedy)
            return tree if not self.adaptive else dict(tree, policy="auto", buckets=self.tree_budgets)
        if not self.adaptive:
            return {}
        return dict(policy=self.policy, buckets=default_buckets(num_slots, self._drafter.block_size),
                    length_head_def=self._drafter.head_graphdef)

    def resting_plan(self) -> PlanParams | None:
        """The plan the engine's state keeps between steps: every setting but the costs."""
        return self._plan(None) if self.adaptive else None

    def for_rows(self, cfg: EngineConfig, k: int, weights: EngineWeights) -> tuple[EngineConfig, PlanParams | None]:
        """(config, plan) of a k-row step of the engine configured by `cfg` (always the same)
        whose models hold `weights` (what a calibration runs)."""
        if not self.adaptive:
            return cfg, None
        if k not in self._by_rows:
            buckets = self.tree_budgets or default_buckets(k, cfg.block_size)
            plan = self._plan(self._costs(k, buckets, cfg, weights))
            self._by_rows[k] = (dataclasses.replace(cfg, buckets=buckets), plan)
        return self._by_rows[k]

    def _plan(self, costs: StepCosts | None) -> PlanParams:
        plan = PlanParams(jnp.float32(self._rho), jnp.int32(self._min_len), costs,
                          jnp.int32(self._probe_every), ProbeState.fresh(self._probe_every))
        return self._place(jax.tree.map(jnp.asarray, plan))

    def _costs(self, k: int, buckets: tuple[int, ...], cfg: EngineConfig, weights: EngineWeights) -> StepCosts:
        source = self._step_costs
        sizes = engine_shapes(k, buckets) if self.verify == "adaptive" else buckets
        if self.policy == "head":
            costs = policies.unit_costs(buckets)
        elif source is None and self.verify == "adaptive":
            costs = calibrate_adaptive(cfg, weights, self._target.name, batch=k)
        elif source is None and self.tree_budgets:
            costs = calibrate_tree(self._target, self._drafter, batch=k, cache_len=cfg.cache_len, budgets=buckets,
                                   greedy=cfg.greedy, attn_impl=self._attn_impl)
        elif source is None:
            costs = calibrate(self._target, self._drafter, batch=k, cache_len=cfg.cache_len, buckets=buckets,
                              attn_impl=self._attn_impl)
        else:
            costs = source[k] if isinstance(source, Mapping) else source(k)
        costs = StepCosts(*(jnp.asarray(c, jnp.float32) for c in costs))
        if np.shape(costs.verify_s) != (len(sizes),) or np.shape(costs.draft_s) or np.shape(costs.ar_s):
            raise ValueError(f"step costs of a {k}-row step need one verify_s per size {sizes} and "
                             f"scalar draft_s / ar_s, got shapes {[np.shape(c) for c in costs]}")
        return costs


def _tree_budgets(tree_budget, drafter, length_policy, verify_len) -> tuple[int, ...]:
    """() for chain verification, (N,) for a fixed tree, the "auto" budgets otherwise."""
    if tree_budget is None:
        return ()
    if drafter is None:
        raise ValueError("tree_budget needs a drafter: the tree is built from its distributions")
    if length_policy not in (None, "fixed") or verify_len is not None:
        raise ValueError("a tree is sized by tree_budget; length_policy / verify_len apply to chain verification")
    return tree_budgets(tree_budget, drafter.block_size)
