"""What a decode step that does not draft costs, against a plain AR step, at batch 1 and 32.

Drafting is forced off (step costs under which no tree pays, and no probe due), so
every step of the speculative engines is a step without a draft. Three engines decode
the same prompts of the fixed evaluation set, greedy, no stop tokens:

- `ar`: the AR engine (`engine.decode_batch` without a drafter);
- `adaptive`: the adaptive decoder's AR program (`decoding.adaptive`), its feature ring
  and the catch-up every `programs.RING` steps included;
- `tree_auto`: the "auto" tree budget inside one program, where such a step is a tree
  of one node (the design the adaptive decoder replaces).

A step's cost is the marginal one, (wall(n_long) - wall(n_short)) / (n_long - n_short)
with the same compiled program, so prefill and call overhead cancel; calls are
interleaved and each wall is the median of `--repeats`. Prints one JSON object.

    python benchmarks/no_draft_overhead.py [--batches 1,32] [--repeats 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import adaflash_jax as af
from adaflash_jax.decoding import engine
from adaflash_jax.decoding.adaptive import decode_adaptive
from adaflash_jax.decoding.adaptive.packed_step import engine_shapes
from adaflash_jax.decoding.batching import cache_length, pad_batch
from adaflash_jax.decoding.engine_state import EngineConfig, EngineWeights, SlotParams
from adaflash_jax.decoding.tree_policy import auto_budgets
from adaflash_jax.decoding.verify_plan import PlanParams, ProbeState, StepCosts
from adaflash_jax.eval.heldout import EVAL_DOMAINS, heldout_prompts
from adaflash_jax.eval.report import emit_json

MODEL = "smollm2-135m-instruct"
SHORT, LONG = 16, 80  # decode steps of the two timed lengths


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--drafter", default="smollm2-135m-instruct-dflash")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per engine and length (median)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def never_drafts(shapes: int, first_drafts: bool) -> PlanParams:
    """A plan under which no drafted step pays (each costs 1000 AR steps) and no probe is ever
    due; `shapes` costs, the first an AR step's unless `first_drafts` (the adaptive decoder's
    shapes all draft; the tree engine's budget 1 does not)."""
    verify = jnp.asarray([1.0 if not first_drafts else 1e3] + [1e3] * (shapes - 1), jnp.float32)
    start = ProbeState(jnp.float32(0.0), jnp.int32(0), jnp.int32(1 << 30))
    return PlanParams(jnp.float32(1.3), jnp.int32(1), StepCosts(verify, jnp.float32(0.0), jnp.float32(1.0)),
                      jnp.int32(1 << 30), start)


def batch_of(target, size: int):
    """`size` prompts of the fixed evaluation set (8 per domain, interleaved, cycled), padded."""
    cases = heldout_prompts(target, 8)
    prompts = [cases[d][k].ids for k in range(8) for d in EVAL_DOMAINS]
    return pad_batch([prompts[i % len(prompts)] for i in range(size)], max_prompt_len=512)


def engines(target, drafter, batch):
    """{name: run(n) -> seconds of prefill + n decode steps of every row}."""
    budgets = auto_budgets(drafter.block_size)
    cache_len = cache_length(batch.prompt_len, LONG, max(budgets))
    base = dict(target_def=target.graphdef, cache_len=cache_len, max_new_cap=LONG, greedy=True)
    tree = EngineConfig(**base, drafter_def=drafter.graphdef, block_size=drafter.block_size, verify="tree",
                        tree_budget=max(budgets), policy="auto", buckets=budgets)
    ar_cfg = EngineConfig(**base)
    w_ar, w_spec = EngineWeights(target.state), EngineWeights(target.state, drafter.state)
    tokens, lengths = jnp.asarray(batch.tokens), jnp.asarray(batch.lengths)
    eos = jnp.zeros((0,), jnp.int32)
    plan = never_drafts(len(budgets), first_drafts=False)
    adaptive_plan = never_drafts(len(engine_shapes(batch.batch, budgets)), first_drafts=True)

    def params(n):
        return SlotParams.build(np.full((batch.batch,), n), temperature=1e-6, top_p=1.0, seeds=0,
                                streams=np.arange(batch.batch), verify_len=np.ones((batch.batch,), np.int32))

    def whole(cfg, weights, p):
        def run(n):
            t0 = time.perf_counter()
            jax.block_until_ready(engine.decode_batch(cfg, weights, tokens, lengths, params(n), eos, p))
            return time.perf_counter() - t0
        return run

    def adaptive(n):
        out, stats = decode_adaptive(tree, w_spec, tokens, lengths, params(n), eos, adaptive_plan)
        assert int(out.drafted_steps) == 0, "drafting was meant to be off"
        return stats["wall_time_s"]

    return {"ar": whole(ar_cfg, w_ar, None), "adaptive": adaptive, "tree_auto": whole(tree, w_spec, plan)}


def measure(runs: dict, repeats: int) -> dict:
    for run in runs.values():  # compile and warm every program at both lengths
        run(SHORT), run(LONG)
    walls = {(name, n): [] for name in runs for n in (SHORT, LONG)}
    for r in range(repeats):
        names = list(runs)
        for name in names[r % len(names):] + names[:r % len(names)]:
            for n in (SHORT, LONG):
                walls[name, n].append(runs[name](n))
    rows = {}
    for name in runs:
        short, long = (statistics.median(walls[name, n]) for n in (SHORT, LONG))
        rows[name] = {"step_ms": 1e3 * (long - short) / (LONG - SHORT), "wall_s_short": short, "wall_s_long": long}
    for row in rows.values():
        row["vs_ar_step"] = row["step_ms"] / rows["ar"]["step_ms"]
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    target = af.load_target(MODEL)
    drafter = af.load_drafter(args.drafter, target=target)
    results = {}
    for b in [int(x) for x in args.batches.split(",")]:
        results[str(b)] = measure(engines(target, drafter, batch_of(target, b)), args.repeats)
    record = {"model": MODEL, "drafter": drafter.name, "steps": [SHORT, LONG], "repeats": args.repeats,
              "jax": jax.__version__, "backend": jax.default_backend(),
              "machine": platform.processor() or platform.machine(), "results": results}
    emit_json(record, args.out, indent=2)
    return record


if __name__ == "__main__":
    main()
