"""AR vs speculative decoding of SmolLM2-135M-Instruct on the same prompts, same run.

For each batch size: tokens/s of both modes (medians of repeats, compile
excluded), the speedup, τ (mean tokens committed per verify step), whether
outputs are identical, and the split of a speculative run's time between
drafting, verifying and the rest of the engine (from isolated timings of the
draft and verify calls at the same shapes). With a randomly initialised
drafter τ ≈ 1 and this measures pure overhead; with a trained one, the speedup.
Prints one JSON object to stdout; progress goes to stderr.

    python benchmarks/speculative.py [--drafter PATH|NAME] [--batches 1,8,32]
        [--max-new-tokens 48] [--repeats 3] [--block-size 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys

import jax
from tqdm import tqdm

import adaflash_jax as af
from adaflash_jax.eval.report import emit_json
from adaflash_jax.decoding.step_costs import measure_step_costs, split_time

sys.path.insert(0, __import__("os").path.dirname(__file__))
from ar_decode import MODEL, PROMPTS, _csv  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default=None,
                   help="drafter dir or built-in name (default: a random-init 2-layer drafter)")
    p.add_argument("--batches", type=_csv(int), default=[1, 8, 32])
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p.parse_args(argv)


def _median_run(target, prompts, repeats, **kwargs):
    runs = [af.generate(target, prompts, **kwargs) for _ in range(repeats + 1)][1:]
    med = statistics.median(r.stats["tokens_per_s"] for r in runs)
    return runs[0], med, statistics.median(r.stats["wall_time_s"] for r in runs)


def main(argv=None) -> dict:
    args = parse_args(argv)
    target = af.load_target(MODEL, dtype=args.dtype)
    if args.drafter:
        drafter = af.load_drafter(args.drafter, target=target)
    else:
        drafter = af.init_drafter(target, num_layers=2, block_size=args.block_size, seed=0)
    record = {"model": MODEL, "drafter": drafter.name, "dtype": args.dtype,
              "block_size": args.block_size, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "jax": jax.__version__, "backend": jax.default_backend(),
              "machine": platform.processor() or platform.machine(), "results": []}
    for batch in tqdm(args.batches, desc="batches", file=sys.stderr):
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        common = dict(max_new_tokens=args.max_new_tokens)
        ar, ar_tps, _ = _median_run(target, prompts, args.repeats, **common)
        sp, sp_tps, sp_wall = _median_run(target, prompts, args.repeats, drafter=drafter,
                                          block_size=args.block_size, **common)
        steps = sp.stats["verify_steps"]
        costs = measure_step_costs(target, drafter.with_block_size(args.block_size),
                                   batch=sp.stats["padded_batch"], context=sp.stats["prompt_bucket"])
        record["results"].append({
            "batch": batch, "ar_tokens_per_s": ar_tps, "spec_tokens_per_s": sp_tps,
            "speedup": sp_tps / ar_tps, "mean_tau": sp.stats["mean_tau"], "verify_steps": steps,
            "identical_outputs": ar.token_ids == sp.token_ids,
            "step_costs_s": costs, "verify_over_ar_step": costs["verify_s"] / costs["ar_step_s"],
            "time_split": split_time(sp_wall, steps, costs)})
    emit_json(record, args.out, indent=2)
    return record


if __name__ == "__main__":
    main()
