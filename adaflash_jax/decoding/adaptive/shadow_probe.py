"""Shadow probes: the drafter's tree drafted at a plain AR step and scored later against the
tokens the target commits after it, instead of verifying it.

While drafting does not pay, probes keep the rows' acceptance estimates current. A probe
that verifies its tree is a drafted step: at concurrency 32 on the fixed evaluation set it
took 1.6-1.8 AR steps and committed little more than one, and its cost is what kept the
default below plain decoding under load. But the adaptive decoder's target tokens never
depend on what was drafted (greedy: the argmax; T > 0: the draws of AR sampling with the
request's keys, `tree_accept.tree_coupled_accept`), so the path a verification would
accept is the path of the tree that the next committed tokens spell out, whichever steps
commit them. A shadow probe therefore drafts every live row's tree (the drafter's forward
after the feature ring's catch-up), keeps it, and goes on with AR steps; each row's tree is
scored as soon as its outcome is known: at the committed token no child of its path
carries (or at the tree's depth), with the feedback a verified probe gives
(`tree_policy.level_feedback`). Its cost is the drafter's forward alone. The decoder uses
them below break-even (`programs.decision`); inside the drafting margin a drafted probe
loses little and commits what it accepts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from adaflash_jax.decoding import tree_policy, verify_plan
from adaflash_jax.decoding.engine_state import DecodeState
from adaflash_jax.decoding.tree_accept import tree_greedy_accept
from adaflash_jax.decoding.tree_build import DraftTree
from adaflash_jax.decoding.tree_step import draft_tree, folded_feedback, tree_depth


@struct.dataclass
class ShadowDraft:
    """Each slot's last probe tree, while it waits for the tokens that score it."""

    tree: DraftTree  # [S, N]: the tree drafted at the probe (its root the bonus token then)
    base: jax.Array  # int32 [S]: the slot's output count at the probe
    open: jax.Array  # bool [S]: drafted and not yet scored

    @classmethod
    def empty(cls, num_slots: int, num_nodes: int) -> "ShadowDraft":
        zeros = jnp.zeros((num_slots, num_nodes), jnp.int32)
        tree = DraftTree(zeros, zeros - 1, zeros, jnp.zeros((num_slots, num_nodes), jnp.float32),
                         jnp.zeros((num_slots, num_nodes), bool))
        return cls(tree, jnp.zeros((num_slots,), jnp.int32), jnp.zeros((num_slots,), bool))

    def close(self, slots: jax.Array) -> "ShadowDraft":
        """`slots` hold a new request (or none): their trees were drafted for another."""
        return self.replace(open=self.open.at[slots].set(False))


def draft_shadow(cfg, target, drafter, state: DecodeState) -> DecodeState:
    """Every live row's best-first tree of max(cfg.buckets) nodes kept as an open probe (the
    drafter's context must be caught up to the target cache); the probe counts as a draft for
    the probe schedule."""
    tree = draft_tree(cfg, target, drafter, state, max(cfg.buckets))
    shadow = ShadowDraft(tree, state.num_out, ~state.done)
    return state.replace(policy=state.policy.replace(shadow=shadow, since_draft=jnp.zeros_like(
        state.policy.since_draft)))


def shadow_outcome(cfg, state: DecodeState):
    """(ready, seen, accepted, examined, predicted) [S] of each slot's open probe against its
    committed tokens: ready, its outcome is known (the walk stopped at a committed token no
    child carries, or the slot has committed as many tokens as the tree is deep) or the slot
    is done; seen, its outcome was observed (a row that finished inside the tree's depth with
    every committed token matched never showed where the walk would stop)."""
    shadow = state.policy.shadow
    tree, depth = shadow.tree, tree_depth(cfg.block_size, shadow.tree.num_nodes)
    have = state.num_out - shadow.base  # tokens committed since the probe
    # the target's token after a node of depth d is output base + d, once it is committed
    known = tree.depths < have[:, None]
    index = jnp.clip(shadow.base[:, None] + tree.depths, 0, state.out.shape[1] - 1)
    best = jnp.where(known, jnp.take_along_axis(state.out, index, axis=1), -1)
    path, accepted, _ = tree_greedy_accept(tree, best, depth)
    examined, predicted = tree_policy.level_feedback(tree, path, accepted)
    known_outcome = (have >= depth) | (accepted < have)
    ready = shadow.open & (known_outcome | state.done)
    seen = ready & known_outcome & (examined > 0)
    return ready, seen, accepted, examined, predicted


def score_shadow(cfg, state: DecodeState, pays) -> DecodeState:
    """`state` with the probes that can be scored folded into their rows' feedback and closed
    (pays: the new estimates [S] -> whether drafting pays); once the last open one is scored
    the probe schedule moves on as after a drafted probe (`verify_plan.next_probe_gap`)."""
    plan = state.plan
    ready, seen, accepted, examined, predicted = shadow_outcome(cfg, state)
    policy = folded_feedback(state.policy, plan, accepted, examined, predicted, seen)
    still_open = policy.shadow.open & ~ready
    finished = jnp.any(ready) & ~jnp.any(still_open)
    gap = verify_plan.next_probe_gap(finished, pays(policy.p_est), policy.probe_gap, plan.probe_every)
    return state.replace(policy=policy.replace(probe_gap=gap, shadow=policy.shadow.replace(open=still_open)))
