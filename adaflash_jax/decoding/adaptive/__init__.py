"""The adaptive decoder: the default for every drafter (`generate(..., drafter=d)`, the
server's `LocalEngine` and `adaflash serve --drafter d`).

Every step, each live row verifies a budget of n nodes: n = 1 is a plain AR token, n >= 2 a
best-first tree of n nodes over the drafter's per-position distributions (`tree_build`).
The budgets are chosen jointly for the rows (`allocation`), for the most expected committed
tokens per second: the expected accepted length of a tree is the sum of its nodes' path
probabilities under the drafter (`tree_policy.expected_accepted`), corrected by each
request's realized acceptance and scaled by what drafting delivered against what it was
expected to on the steps the decoder drafted (`realized_gain`), under step costs calibrated
on the running hardware
(`costs`, cached per machine and model) and corrected by what the decoder's own programs
take (`online_costs`: the machine's speed, which moves both prices, and the drafted steps'
cost relative to AR steps, which decides between them).
Whether to run the drafter at all is decided before drafting, from the rows' running
acceptance estimates. When it does not pay, a shadow probe refreshes them (`shadow_probe`):
the drafter drafts every row's tree at an AR step, and the tokens the AR steps then commit
score it, with the feedback verifying it would have given, for the cost of the drafter's
forward. Probes come after as many AR steps as keep their cost to a small share of the time
(`allocation.probe_gap`), never later than a gap that doubles after each probe that shows
drafting does not pay, up to `verify_plan.MAX_PROBE_GAP` steps. (A decoder that knows
nothing of its drafter yet probes with a drafted step, whose feedback comes at once.)

What makes it never slower than plain decoding is how a step that does not draft runs
(`programs`): not as a tree of one node inside the speculative program, which pays the
drafter's context append and the cache writes at the block's width on every step, but in
a program of its own, a device loop of plain AR steps that keeps each position's target
features in a small ring (`DecodeState.pending`) and exits as soon as the policy wants to
draft. The speculative program first projects the ring into the drafter's context, then
loops tree steps until drafting stops paying (returning every `SPEC_RUN_STEPS` steps, so
the host re-prices them with what they took). The host (`runner`) picks the program from
flags the previous one returned; both donate the state, so no conditional sits around a
cache write and XLA never copies a cache. The server's engine, which admits and evicts
requests between steps, runs the same steps one at a time (`programs.single_step`).

At T > 0 the tree's walk draws the target's token at output position j with the key AR
sampling uses there (`tree_accept.tree_coupled_accept`), so a seeded request's tokens are
exactly those of AR sampling with that seed: independent of what was drafted, of the
budgets chosen, and of the other requests in the batch.
"""

from adaflash_jax.decoding.adaptive.runner import decode_adaptive  # noqa: F401
