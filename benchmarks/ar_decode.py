"""AR decode throughput of SmolLM2-135M-Instruct against the memory-bandwidth bound.

A decode step at small batch reads every weight once, so its time cannot go
below weight_bytes / bandwidth. This script measures tokens/s and step time
per (dtype, batch), the machine's copy bandwidth in the same process, and the
ratio step_time / (weight_bytes / bandwidth): 1.0 means bandwidth-bound,
larger means time goes elsewhere (compute, overheads). Prints one JSON object
to stdout; progress goes to stderr.

    python benchmarks/ar_decode.py [--batches 1,8,32] [--dtypes float32,bfloat16]
        [--max-new-tokens 64] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import adaflash_jax as af
from adaflash_jax.eval.report import emit_json
from adaflash_jax.decoding.batching import bucket

MODEL = "smollm2-135m-instruct"
# Short user messages from different domains; batch b takes the first b (cycling).
PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "What is 17 multiplied by 23? Explain the steps.",
    "Describe a quiet forest at dawn in three sentences.",
    "Give three tips for writing clear emails.",
    "Explain what a hash table is to a beginner.",
    "Translate 'good morning, how are you?' into French.",
    "Summarise the water cycle in a few sentences.",
    "List four planets of the solar system and one fact about each.",
)
BANDWIDTH_BYTES = 256 * 2**20  # one 256 MiB float32 array
BANDWIDTH_RUNS = 5


def _csv(kind):
    def parse(text: str):
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if not values:
            raise argparse.ArgumentTypeError("needs at least one value")
        return values

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=_csv(int), default=[1, 8, 32], help="comma list (default 1,8,32)")
    p.add_argument("--dtypes", type=_csv(str), default=["float32", "bfloat16"],
                   help="comma list of float32/bfloat16 (default both)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per config; medians reported")
    p.add_argument("--out", help="also write the JSON to this file")
    args = p.parse_args(argv)
    if min(args.batches) < 1 or args.max_new_tokens < 2 or args.repeats < 1:
        p.error("batches must be >= 1, --max-new-tokens >= 2, --repeats >= 1")
    bad = [d for d in args.dtypes if d not in ("float32", "bfloat16")]
    if bad:
        p.error(f"unsupported dtypes {bad}")
    return args


def _best_seconds(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_bandwidth() -> dict:
    """Copy bandwidth, (read + write bytes) / s, best of a few runs, three ways.

    The jitted `x + 1` is run in place (donated input): with a fresh output
    buffer per call it mostly measures page-faulting new memory, reported apart.
    """
    n = BANDWIDTH_BYTES // 4
    add_one = jax.jit(lambda a: a + 1)
    x = jnp.zeros((n,), jnp.float32)
    jax.block_until_ready(add_one(x))
    fresh_s = _best_seconds(lambda: jax.block_until_ready(add_one(x)), BANDWIDTH_RUNS)
    add_one_in_place = jax.jit(lambda a: a + 1, donate_argnums=0)
    state = {"x": add_one_in_place(x)}
    jax.block_until_ready(state["x"])

    def in_place():
        state["x"] = jax.block_until_ready(add_one_in_place(state["x"]))

    jax_s = _best_seconds(in_place, BANDWIDTH_RUNS)
    src = np.ones((n,), np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    np_s = _best_seconds(lambda: np.copyto(dst, src), BANDWIDTH_RUNS)
    moved = 2 * BANDWIDTH_BYTES
    jax_bw, np_bw = moved / jax_s, moved / np_s
    del x, state, src, dst
    return {"array_bytes": BANDWIDTH_BYTES, "bytes_moved_per_run": moved, "runs": BANDWIDTH_RUNS,
            "jax_add_one_GBps": jax_bw / 1e9, "numpy_copy_GBps": np_bw / 1e9,
            "jax_add_one_fresh_output_GBps": moved / fresh_s / 1e9,
            "used_GBps": max(jax_bw, np_bw) / 1e9,
            "used": "jax_add_one" if jax_bw >= np_bw else "numpy_copy"}


def weight_bytes(target) -> int:
    """Bytes of every parameter array; the tied embedding/LM head is one array, so once."""
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(target.state)))


def warmup_tokens(max_new: int) -> int:
    """Fewest tokens that still select the same compiled loop as `max_new` (same bucket)."""
    cap = bucket(max_new, 16)
    return min(max_new, cap // 2 + 1) if cap > 16 else min(max_new, 2)


def bench_config(target, batch: int, max_new: int, repeats: int, bandwidth: float, bar) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    kw = dict(max_new_tokens=max_new, temperature=0.0)
    # Warm-up: compiles and runs the executable the timed runs use. The token budget
    # is a runtime argument within a compile bucket, so half the tokens suffice.
    warm = af.generate(target, prompts, **{**kw, "max_new_tokens": warmup_tokens(max_new)})
    bar.update()
    runs = []
    for _ in range(repeats):
        runs.append(af.generate(target, prompts, **kw).stats)
        bar.update()
    # Prefill + first token alone (max_new_tokens=1), to separate per-step decode time.
    # One run: compile is excluded from wall time, and at batch 32 a prefill takes ~10 s here.
    prefill = af.generate(target, prompts, max_new_tokens=1).stats["wall_time_s"]
    bar.update()
    step_s = statistics.median(s["wall_time_s"] / s["steps"] for s in runs)
    decode_step_s = statistics.median((s["wall_time_s"] - prefill) / max(s["steps"] - 1, 1)
                                      for s in runs)
    wbytes = weight_bytes(target)
    bound_s = wbytes / bandwidth
    return {
        "dtype": target.cfg.dtype, "batch": batch, "padded_batch": warm.stats["padded_batch"],
        "prompt_bucket": warm.stats["prompt_bucket"], "compile_time_s": warm.stats["compile_time_s"],
        "compile_time_in_timed_runs_s": sum(s["compile_time_s"] for s in runs),
        "steps": [s["steps"] for s in runs], "new_tokens": [s["new_tokens"] for s in runs],
        "tokens_per_s": statistics.median(s["tokens_per_s"] for s in runs),
        "tokens_per_s_runs": [s["tokens_per_s"] for s in runs],
        "wall_time_s": statistics.median(s["wall_time_s"] for s in runs),
        "step_time_s": step_s,
        "prefill_s": prefill,
        "decode_step_time_s": decode_step_s,
        "weight_bytes": wbytes,
        "weight_read_time_s": bound_s,
        "step_time_over_bandwidth_bound": step_s / bound_s,
        "decode_step_time_over_bandwidth_bound": decode_step_s / bound_s,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    bw = measure_bandwidth()
    results, num_params = [], None
    total = len(args.dtypes) * len(args.batches) * (args.repeats + 2)
    with tqdm(total=total, desc="ar_decode", file=sys.stderr) as bar:
        for dtype in args.dtypes:
            bar.set_postfix_str(f"loading {dtype}")
            target = af.load_target(MODEL, dtype=dtype)
            num_params = target.cfg.num_params()
            for batch in args.batches:
                bar.set_postfix_str(f"{dtype} batch {batch}")
                results.append(bench_config(target, batch, args.max_new_tokens, args.repeats,
                                            bw["used_GBps"] * 1e9, bar))
            del target
    record = {
        "benchmark": "ar_decode", "model": MODEL, "num_params": num_params,
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "greedy": True,
        "notes": ("tokens_per_s and step_time_s (= wall_time_s / steps) come from generate() stats: "
                  "compile excluded, prefill included. decode_step_time_s subtracts a measured "
                  "max_new_tokens=1 run (prefill + first token). Bound = weight_bytes / used_GBps."),
        "machine": {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
                    "cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "jax": jax.__version__, "python": platform.python_version()},
        "bandwidth": bw, "results": results,
        "total_time_s": time.perf_counter() - t_start,
    }
    return emit_json(record, args.out)


if __name__ == "__main__":
    main()
