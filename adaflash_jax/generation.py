"""`generate`: the one user-facing decode call (text or token-id prompts).

It validates inputs, applies the chat template to text prompts, pads the
batch to bucket shapes, runs the engine (`decoding.engine.decode_batch`: every
prompt inserted into its own slot, then decode steps until all are done), and trims the outputs to
exactly what each sequence emitted (up to and including its stop token).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from adaflash_jax.decoding import engine
from adaflash_jax.decoding.adaptive import decode_adaptive
from adaflash_jax.decoding.adaptive.costs import calibrate_adaptive
from adaflash_jax.decoding.adaptive.mode import verify_mode
from adaflash_jax.decoding.adaptive.packed_step import engine_shapes
from adaflash_jax.decoding.compile_cache import compiled
from adaflash_jax.decoding.decode_stats import acceptance_stats, verify_stats
from adaflash_jax.decoding.engine_state import EngineConfig, EngineWeights, SlotParams
from adaflash_jax.decoding.batching import bucket, cache_length, encode_chat_prompts, pad_batch, trim_outputs
from adaflash_jax.decoding import length_policy as policies
from adaflash_jax.decoding.packing import default_buckets
from adaflash_jax.decoding.sampling import SamplingParams
from adaflash_jax.decoding.tree_build import MAX_TREE_BUDGET
from adaflash_jax.decoding.tree_costs import calibrate_tree
from adaflash_jax.decoding.tree_policy import auto_budgets
from adaflash_jax.decoding.verify_plan import PlanParams, ProbeState
from adaflash_jax.decoding.calibration import calibrate
from adaflash_jax.errors import InputError, as_input_error
from adaflash_jax.decoding.step_costs import measure_step_costs, split_time
from adaflash_jax.target_api import Target
from pallas_kernels.common import choose_kernel


class NonFiniteLogitsError(RuntimeError):
    """The target's logits went NaN / infinite while decoding some prompts (a broken checkpoint
    or an overflow). prompts: their indices in the call; the other prompts decoded normally."""

    def __init__(self, prompts: list[int], positions: list[int]):
        self.prompts = prompts
        where = ", ".join(f"prompt {i} (at output token {j})" for i, j in zip(prompts, positions))
        super().__init__(f"the target's logits became non-finite (NaN or infinity) while decoding {where}; "
                         "check the checkpoint's weights and the compute dtype")


def _check_finite(token_ids: list[list[int]]) -> None:
    """Raises NonFiniteLogitsError naming every prompt whose output holds the engine's
    non-finite marker (a negative token, always its last)."""
    bad = [i for i, ids in enumerate(token_ids) if ids and ids[-1] < 0]
    if bad:
        raise NonFiniteLogitsError(bad, [len(token_ids[i]) - 1 for i in bad])


@dataclasses.dataclass
class GenerateResult:
    token_ids: list[list[int]]  # new tokens only, stop token included
    texts: list[str] | None
    stats: dict[str, Any]


def encode_prompts(target: Target, prompts) -> list[list[int]]:
    """Validated token-id prompts: text gets the checkpoint's chat template; ids pass through."""
    with as_input_error():  # the checks live in decoding.batching
        return encode_chat_prompts(prompts, target.tokenizer, target.cfg.vocab_size)


def generate(target: Target, prompts: Sequence, *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             stop_token_ids: Sequence[int] | None = None, attn_impl: str = "xla",
             drafter=None, block_size: int | None = None, verify_len=None,
             length_policy: str | None = None, rho: float = 1.3, min_len: int = 1,
             probe_every: int = 8, step_costs=None,
             sample_drafts: bool = False, verify_head: bool | None = None,
             profile: bool = False, fused_head: bool | None = None, verify: str | None = None,
             tree_budget: int | str | None = None) -> GenerateResult:
    """Decodes `prompts` with the target: autoregressively, or speculatively with `drafter=`.

    prompts: list[str] (chat template applied) or list[list[int]] (raw ids, used as-is).
    With a drafter and no mode settings the adaptive decoder runs (`decoding.adaptive`): per
    step, plain AR steps or a best-first tree of 2..2·Bs nodes, whichever the drafter's
    own probabilities, each request's realized acceptance and step costs calibrated on this
    hardware (or `step_costs`: ar_s, and one verify_s per packed shape of
    `decoding.adaptive.engine_shapes`) say commits more tokens per second;
    its AR steps cost what plain decoding's do. verify="adaptive" asks for it by name. The
    fixed modes below stay available: any chain setting (length_policy, verify_len,
    sample_drafts, verify_head) or verify="chain" picks chain verification, a tree_budget
    or verify="tree" tree verification.
    Speculative options: block_size (default: the drafter's; smaller blocks draft
    fewer tokens), verify_len (int or one int per prompt, 1..block_size: how many
    block tokens the target verifies; default the whole block), sample_drafts
    (draw drafts from the drafter's distribution instead of argmax when T > 0),
    profile (also time draft and verify calls in isolation and split the wall time).
    verify_head (T > 0): verify through the fused vocabulary-tiled verify head with
    counter-based sampling (the same tokens from the Pallas kernel and its XLA reference, no
    [.., V] log-probs); default: on when attn_impl runs Pallas, top_p = 1 and drafts are
    argmax. fused_head: its former name, deprecated.
    length_policy: "fixed" (verify `verify_len` tokens, DFlash), "head" (the AdaFlash rule
    clamp(round(ŝ·Bs·rho), min_len, Bs) per row and step), or "auto" (per step, the lengths
    that maximise expected committed tokens per second under step costs calibrated on this
    hardware, or `step_costs`; it skips drafting when plain AR steps are faster, probing
    again after `probe_every` steps, the gap doubling while drafting keeps losing; its
    acceptance estimate and probe schedule carry over to the next call with the same
    drafter and batch, which changes speed, never output). Default: "auto" when the drafter
    has a length head, else "fixed". "head" and "auto" verify through the packed layout
    (cost ∝ tokens verified).
    verify: "adaptive", "chain" (the drafted block, as above) or "tree": each step verifies a best-first
    tree of `tree_budget` nodes (root included; default the block size) built from the
    drafter's distributions at every block offset, and follows the longest path the target
    accepts (greedy: its argmax; T > 0: lossless recursive rejection over siblings); the length
    policy, verify_len, sample_drafts and verify_head do not apply. tree_budget=1 is AR.
    tree_budget="auto" picks the budget per step (1, 2, 4, .. up to twice the block size; 1 is
    an AR step without drafting) with the most expected committed tokens per second: expected
    acceptance from the tree's own path probabilities, corrected by each request's realized
    acceptance, step costs calibrated on this hardware or `step_costs` (one verify_s per budget,
    `tree_policy`); it carries its acceptance estimate over calls as "auto" does.
    Output is the target's own: token-identical to AR at T = 0, same distribution above.
    """
    verify_head = _renamed_keyword(fused_head, verify_head)
    check_numbers(max_new_tokens=max_new_tokens, seed=seed, min_len=min_len, probe_every=probe_every,
                  temperature=temperature, top_p=top_p, rho=rho)
    params = _validated(SamplingParams, temperature, top_p)
    if int(max_new_tokens) < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = encode_prompts(target, prompts)
    max_new_cap = bucket(max_new_tokens, 16)
    spec, budget, tree_auto, adaptive = None, 0, (), False
    if drafter is not None:
        spec = _speculative_setup(target, drafter, block_size, verify_len, len(ids))
        verify = _verify_mode(verify, tree_budget=tree_budget, length_policy=length_policy,
                              verify_len=verify_len, sample_drafts=sample_drafts, verify_head=verify_head)
        adaptive = verify == "adaptive"
        budget, tree_auto = _tree_budget("tree" if adaptive else verify, "auto" if adaptive else tree_budget,
                                         spec[0].block_size, length_policy=length_policy, verify_len=verify_len,
                                         sample_drafts=sample_drafts, verify_head=verify_head)
        policy = "fixed" if budget else _validated(policies.resolve, length_policy, spec[0], verify_len, rho,
                                                   min_len, probe_every)
    elif (block_size is not None or verify_len is not None or length_policy is not None
          or verify_head is not None or verify is not None or tree_budget is not None):
        raise InputError("block_size / verify_len / length_policy / verify_head / verify / tree_budget "
                         "need a drafter")
    headroom = max(spec[0].block_size, budget) if spec else 0  # a tree writes `budget` slots per step
    batch = _validated(pad_batch, ids, max_prompt_len=target.cfg.max_position_embeddings - max_new_tokens - headroom)
    # The adaptive decoder writes committed tokens only (its verification reads the caches and
    # attends to the nodes' own K/V; a path's write past the end is dropped), so its cache is
    # AR's: every step, drafted or not, attends over no more slots than an AR step does.
    cache_len = cache_length(batch.prompt_len, max_new_cap, 0 if adaptive else headroom)
    eos = tuple(stop_token_ids) if stop_token_ids is not None else target.eos_token_ids
    n = batch.num_prompts
    vlen = np.ones((batch.batch,), np.int32)
    cfg = dict(target_def=target.graphdef, cache_len=cache_len, max_new_cap=max_new_cap,
               greedy=params.greedy, attn_impl=attn_impl)
    weights, plan = EngineWeights(target.state), None
    if spec is not None:
        spec_drafter = spec[0]
        vlen[:n] = spec[1]
        cfg.update(drafter_def=spec_drafter.graphdef, block_size=spec_drafter.block_size,
                   sample_drafts=bool(sample_drafts),
                   use_verify_head=bool(not budget and _use_verify_head(verify_head, params, attn_impl,
                                                                         sample_drafts)))
        if budget:
            cfg.update(verify="tree", tree_budget=budget, coupled_sampling=adaptive and not params.greedy)
        if tree_auto:
            if step_costs is not None:
                costs = step_costs
            elif adaptive:
                costs = calibrate_adaptive(EngineConfig(**cfg, policy="auto", buckets=tree_auto),
                                           EngineWeights(target.state, spec_drafter.state), target.name,
                                           batch=batch.batch)
            else:
                costs = calibrate_tree(target, spec_drafter, batch=batch.batch, cache_len=cache_len,
                                       budgets=tree_auto, greedy=params.greedy, attn_impl=attn_impl)
            _check_costs(costs, engine_shapes(batch.batch, tree_auto) if adaptive else tree_auto, verify)
            probe_owner = spec_drafter.state
            probe_setting = (verify,) + policies.probe_setting(spec_drafter.block_size, batch.batch, costs,
                                                               probe_every)
            start = PROBES.get(probe_owner, probe_setting) or ProbeState.fresh(probe_every)
            plan = PlanParams(jnp.float32(rho), jnp.int32(min_len), costs, jnp.int32(probe_every), start)
            cfg.update(policy="auto", buckets=tree_auto)
        weights = EngineWeights(target.state, spec_drafter.state)
        if policy != "fixed":
            buckets = default_buckets(batch.batch, spec_drafter.block_size)
            costs = step_costs if step_costs is not None else (calibrate(
                target, spec_drafter, batch=batch.batch, cache_len=cache_len, buckets=buckets,
                attn_impl=attn_impl)
                if policy == "auto" else policies.unit_costs(buckets))
            probe_owner = spec_drafter.head_state
            probe_setting = policies.probe_setting(spec_drafter.block_size, batch.batch, costs, probe_every)
            start = PROBES.get(probe_owner, probe_setting) or ProbeState.fresh(probe_every)
            plan = PlanParams(jnp.float32(rho), jnp.int32(min_len), costs, jnp.int32(probe_every), start)
            weights = EngineWeights(target.state, spec_drafter.state, spec_drafter.head_state)
            cfg.update(policy=policy, buckets=buckets, length_head_def=spec_drafter.head_graphdef)
    # Prompt i is stream i of the call's seed, so a prompt's samples never depend on its row.
    slot_params = SlotParams.build(np.where(batch.active, int(max_new_tokens), 0),
                                   temperature=max(temperature, 1e-6), top_p=top_p, seeds=seed,
                                   streams=np.arange(batch.batch), verify_len=vlen)
    slot_params = jax.tree.map(target.place_batch, slot_params)
    args = (weights, target.place_batch(batch.tokens), target.place_batch(batch.lengths), slot_params,
            jnp.asarray(eos, jnp.int32), plan)
    adaptive_stats = {}
    if spec is not None and adaptive:
        # the batch is decoded to completion: its budgets serve the rows that finish last
        outputs, adaptive_stats = decode_adaptive(EngineConfig(**cfg, objective="makespan"), *args,
                                                  learn_costs=step_costs is None)
        compile_s, wall = adaptive_stats.pop("compile_time_s"), adaptive_stats.pop("wall_time_s")
    else:
        exe, compile_s = compiled(engine.decode_batch, (EngineConfig(**cfg),), args, {})
        t0 = time.perf_counter()
        outputs = jax.block_until_ready(exe(*args))
        wall = time.perf_counter() - t0
    out, num_out = np.asarray(outputs.tokens), np.asarray(outputs.num_out)
    steps = int(outputs.steps) + (0 if spec else 1)  # AR counts the prefill as its first step
    token_ids = trim_outputs(out, num_out, n)
    _check_finite(token_ids)
    total = sum(len(t) for t in token_ids)
    texts = ([target.tokenizer.decode(t, skip_special_tokens=True) for t in token_ids]
             if target.tokenizer is not None else None)
    stats = {"mode": "speculative" if spec else "autoregressive", "steps": steps,
             "wall_time_s": wall, "compile_time_s": compile_s, "new_tokens": total,
             "tokens_per_s": total / wall if wall > 0 else float("inf"),
             "batch": batch.num_prompts, "padded_batch": batch.batch,
             "prompt_bucket": batch.prompt_len}
    if spec:
        if policy == "auto" or tree_auto:
            PROBES.put(probe_owner, probe_setting, outputs.probe)
        commits = np.asarray(outputs.commits)[:n]
        stats.update(acceptance_stats(commits, steps))
        stats.update(verify_stats(np.asarray(outputs.verified)[:n], commits, int(outputs.drafted_steps), steps))
        stats["block_size"] = spec[0].block_size
        stats["length_policy"] = "auto" if tree_auto else policy
        stats["verify"] = verify
        stats.update(adaptive_stats)
        if budget:
            stats["tree_budget"] = "auto" if tree_auto else budget
        if tree_auto:
            stats["tree_budgets"] = list(tree_auto)
        if policy == "fixed" and not budget:
            stats["verify_len"] = [int(v) for v in spec[1]]
        if profile:
            costs = measure_step_costs(target, spec[0], batch=batch.batch, context=batch.prompt_len,
                                       cache_len=cache_len, attn_impl=attn_impl)
            stats.update(costs)
            stats.update(split_time(wall, steps, costs))
    return GenerateResult(token_ids, texts, stats)


# "auto" policy state per length head and setting: a later call starts from the acceptance
# estimate and probe schedule the previous call ended with (see length_policy.ProbeMemory).
PROBES = policies.ProbeMemory()


def _renamed_keyword(fused_head, verify_head):
    """`fused_head=` is `verify_head=`'s former name: still accepted, with a warning."""
    if fused_head is None:
        return verify_head
    if verify_head is not None:
        raise InputError("pass verify_head= only; fused_head= is its deprecated former name")
    warnings.warn("generate(fused_head=) is deprecated; use verify_head=", DeprecationWarning, stacklevel=3)
    return fused_head


def _use_verify_head(requested, params: SamplingParams, attn_impl: str, sample_drafts: bool) -> bool:
    """Whether sampled verification runs through the fused verify head (`decoding/verify_head.py`)."""
    if params.greedy:
        return False  # greedy verification already uses the fused argmax under Pallas
    if requested is None:
        return choose_kernel(attn_impl).use_pallas and params.top_p >= 1.0 and not sample_drafts
    if requested and params.top_p < 1.0:
        raise InputError("verify_head=True samples from the full distribution; it needs top_p=1")
    if requested and sample_drafts:
        raise InputError("verify_head=True verifies argmax drafts; it cannot be combined with sample_drafts")
    return bool(requested)


def _check_costs(costs, sizes, verify: str) -> None:
    """step_costs must hold one verify_s per packed shape (adaptive) or per budget (tree)."""
    if np.shape(costs.verify_s) != (len(sizes),):
        what = (f"one verify_s per packed shape {sizes} (decoding.adaptive.engine_shapes)" if verify == "adaptive"
                else f"one verify_s per budget {sizes}")
        raise InputError(f"step_costs for verify={verify!r} need {what}")


def _verify_mode(verify, *, tree_budget, **chain_settings) -> str:
    """The verification mode (`decoding.adaptive.mode.verify_mode`), a bad one an InputError."""
    with as_input_error():
        return verify_mode(verify, tree_budget=tree_budget, **chain_settings)


def _tree_budget(verify, tree_budget, block_size: int, *, length_policy, verify_len, sample_drafts,
                 verify_head) -> tuple[int, tuple[int, ...]]:
    """Validated tree settings -> (node budget, or the largest "auto" may pick; 0: chain
    verification; the budgets "auto" chooses from, () for a fixed budget)."""
    if verify not in ("chain", "tree"):
        raise InputError(f"verify must be 'chain' or 'tree', got {verify!r}")
    if verify == "chain":
        if tree_budget is not None:
            raise InputError("tree_budget applies to verify='tree' only")
        return 0, ()
    auto = tree_budget == "auto"
    budget = block_size if tree_budget is None else max(auto_budgets(block_size)) if auto else tree_budget
    check_numbers(tree_budget=budget)
    if not 1 <= int(budget) <= MAX_TREE_BUDGET:
        raise InputError(f"tree_budget must lie in [1, {MAX_TREE_BUDGET}], got {tree_budget}")
    if length_policy not in (None, "fixed") or verify_len is not None:
        raise InputError("verify='tree' sizes verification by tree_budget; length_policy and verify_len "
                         "apply to chain verification only")
    if sample_drafts or verify_head:
        raise InputError("verify='tree' verifies a best-first tree of the drafter's distributions; "
                         "sample_drafts and verify_head apply to chain verification only")
    return int(budget), auto_budgets(block_size) if auto else ()


def _speculative_setup(target, drafter, block_size, verify_len, num_prompts):
    """Validates speculative options -> (drafter at the chosen block size, verify lens)."""
    _validated(drafter.cfg.check_target, target.cfg)
    if block_size is not None:
        if int(block_size) < 2:
            raise InputError(f"block_size must be >= 2, got {block_size}")
        if int(block_size) > drafter.block_size:
            raise InputError(f"block_size {block_size} exceeds the drafter's trained block size "
                             f"{drafter.block_size}")
        drafter = drafter.with_block_size(int(block_size))
    bs = drafter.block_size
    if verify_len is not None and np.ndim(verify_len) and np.shape(verify_len) != (num_prompts,):
        raise InputError(f"verify_len must be an int or a list of one int per prompt "
                         f"({num_prompts} prompts), got shape {np.shape(verify_len)}")
    lengths = np.full((num_prompts,), bs, np.int32) if verify_len is None else np.broadcast_to(
        np.asarray(verify_len, np.int32), (num_prompts,)).copy()
    if lengths.min() < 1 or lengths.max() > bs:
        raise InputError(f"verify_len must lie in [1, block_size={bs}], got {sorted(set(lengths.tolist()))}")
    return drafter, lengths


def _validated(check, *args, **kwargs):
    """`check(*args, **kwargs)` for validators in decoding/, their ValueError as InputError."""
    with as_input_error():
        return check(*args, **kwargs)


def check_numbers(**values) -> None:
    """Every value is a finite real number (NaN and inf pass comparisons such as `rho <= 0`,
    so they are refused here); integer arguments (all but temperature, top_p, rho) are whole."""
    for name, value in values.items():
        if value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise InputError(f"{name} must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise InputError(f"{name} must be finite, got {value}")
        if name not in ("temperature", "top_p", "rho") and number != int(number):
            raise InputError(f"{name} must be a whole number, got {value}")
