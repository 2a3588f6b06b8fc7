"""Rollout decoding throughput: static batches vs continuous batching, in one run.

Decodes the same training prompts twice with the target (greedy): in fixed
batches of B decoded to completion (each waits for its longest response), and
streamed through B engine slots by the host scheduler (a slot refills when its
response ends). Each method is compiled and warmed up on the same prompts
first; timed runs alternate methods; medians of the repeats. Prints one JSON
object; outputs are checked identical.

    python benchmarks/rollout_throughput.py --prompts 64 --batch 32 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import adaflash_jax as af
from adaflash_jax.data.prompts import DEFAULT_PROMPT_DIR
from adaflash_jax.eval.report import emit_json
from adaflash_jax.serving.scheduler import Request, Scheduler
from adaflash_jax.serving.slot_engine import LocalEngine
from adaflash_jax.training.rollout_job import encoded_train_prompts


def static_batches(target, prompts, batch: int, max_new: int) -> list[list[int]]:
    out = []
    for start in range(0, len(prompts), batch):
        out += af.generate(target, prompts[start:start + batch], max_new_tokens=max_new).token_ids
    return out


def continuous(target, prompts, batch: int, max_new: int) -> list[list[int]]:
    engine = LocalEngine(target, num_slots=batch, max_prompt_len=max(map(len, prompts)), max_new_tokens=max_new)
    return Scheduler({"greedy": engine}, max_queue=len(prompts)).run([Request(p, max_new) for p in prompts])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=64, help="training prompts decoded per run")
    ap.add_argument("--batch", type=int, default=32, help="static batch size = engine slots")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default=None, help="built-in prompt sets (default: the rollout job's)")
    args = ap.parse_args(argv)
    target = af.load_target(args.target)
    prompts, _ = encoded_train_prompts(target, args.data_dir or DEFAULT_PROMPT_DIR,
                                       per_domain=-(-args.prompts // 3))
    prompts = prompts[:args.prompts]
    methods = {"static": static_batches, "continuous": continuous}
    outputs = {name: fn(target, prompts, args.batch, args.max_new_tokens) for name, fn in methods.items()}
    if outputs["static"] != outputs["continuous"]:
        differ = sum(a != b for a, b in zip(outputs["static"], outputs["continuous"]))
        raise SystemExit(f"outputs differ on {differ} of {len(prompts)} prompts")
    tokens = sum(map(len, outputs["static"]))
    times = {name: [] for name in methods}
    for r in range(args.repeats):
        for name in (list(methods) if r % 2 == 0 else list(methods)[::-1]):
            t0 = time.perf_counter()
            methods[name](target, prompts, args.batch, args.max_new_tokens)
            times[name].append(time.perf_counter() - t0)
    result = {"target": args.target, "prompts": len(prompts), "batch": args.batch,
              "max_new_tokens": args.max_new_tokens, "tokens": tokens,
              "mean_response_tokens": tokens / len(prompts), "identical_outputs": True}
    for name, ts in times.items():
        result[f"{name}_tokens_per_s"] = tokens / statistics.median(ts)
        result[f"{name}_seconds"] = ts
    result["speedup"] = result["continuous_tokens_per_s"] / result["static_tokens_per_s"]
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
