"""A trained drafter on held-out prompts: τ per domain, AR vs speculative tokens/s, engine overhead.

Held-out prompts of each domain (the code / math / prose EVAL splits, never
trained on, and HumanEval) are decoded one at a time (batch 1), AR and
speculatively ("spec": the fixed-length chain; with `--tree` also a tree of as
many nodes and the auto tree budget), in the same run; throughput is tokens over summed wall time
(medians of `--repeats` after a compile run). The engine overhead is the time
per speculative step minus the target's verify forward alone (an isolated,
jitted call at the same shapes), as a fraction of the latter. Prints one JSON
object; `--plot FILE.png` also draws τ and speedup per domain.

    python benchmarks/drafter_eval.py [--drafter smollm2-135m-instruct-dflash]
        [--prompts-per-domain 8] [--max-new-tokens 96] [--repeats 1] [--verify-len 16]
        [--tree] [--out FILE.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import platform

import jax
import numpy as np

import adaflash_jax as af
from adaflash_jax.eval.report import emit_json
from adaflash_jax.eval.heldout import compare_on_domains, heldout_prompts, summarize
from adaflash_jax.decoding.step_costs import measure_step_costs

MODEL = "smollm2-135m-instruct"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="smollm2-135m-instruct-dflash", help="drafter dir or built-in name")
    p.add_argument("--prompts-per-domain", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per prompt after a compile run")
    p.add_argument("--verify-len", type=int, default=None, help="tokens verified per step (default: block)")
    p.add_argument("--tree", action="store_true",
                   help="also decode with a best-first tree of --verify-len nodes (tree16 at block 16) and "
                        "with the auto tree budget, at batch 1 on the same prompts")
    p.add_argument("--data-dir", default=None, help="prompt sets (default: ~/.cache/adaflash_jax/prompts)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--plot", default=None, help="draw τ and speedup per domain to this PNG")
    return p.parse_args(argv)


def engine_overhead(target, drafter, results: dict, context: int, verify_len: int) -> dict:
    """(spec seconds per step − verify forward) / verify forward, from isolated timings."""
    costs = measure_step_costs(target, drafter, batch=1, context=context, cache_len=context + 256,
                               verify_tokens=verify_len)
    steps = sum(r["methods"]["spec"]["verify_steps"] for r in results.values())
    spec_s = sum(r["new_tokens"] / r["methods"]["spec"]["tokens_per_s"] for r in results.values())
    per_step = spec_s / steps
    return {"step_costs_s": costs, "spec_s_per_step": per_step,
            "verify_over_ar_step": costs["verify_s"] / costs["ar_step_s"],
            "draft_over_verify": costs["draft_s"] / costs["verify_s"],
            "overhead_vs_verify": (per_step - costs["verify_s"]) / costs["verify_s"],
            "overhead_beyond_draft_and_verify": (per_step - costs["verify_s"] - costs["draft_s"])
            / costs["verify_s"]}


def plot(results: dict, path: str, title: str) -> None:
    """τ and speedup per domain, one bar per method (chain; with --tree also the trees)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(results)
    methods = list(results[domains[0]]["methods"])
    width = 0.8 / len(methods)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, name in enumerate(methods):
        xs = np.arange(len(domains)) + (i - (len(methods) - 1) / 2) * width
        label = "chain" if name == "spec" else name
        for ax, key in zip(axes, ("mean_tau", "speedup")):
            ax.bar(xs, [results[d]["methods"][name][key] for d in domains], width, label=label)
    axes[0].set_ylabel("τ (tokens per verify step)")
    axes[1].axhline(1.0, color="gray", lw=1, ls="--")
    axes[1].set_ylabel("speculative / AR tokens/s")
    for ax in axes:
        ax.set_xticks(np.arange(len(domains)), domains, rotation=20)
    if len(methods) > 1:
        axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    args = parse_args(argv)
    target = af.load_target(MODEL)
    drafter = af.load_drafter(args.drafter, target=target)
    prompts = heldout_prompts(target, args.prompts_per_domain, data_dir=args.data_dir)
    methods = {"spec": dict(drafter=drafter, length_policy="fixed", verify_len=args.verify_len)}
    if args.tree:
        nodes = args.verify_len or drafter.block_size
        methods[f"tree{nodes}"] = dict(drafter=drafter, verify="tree", tree_budget=nodes)
        methods["tree_auto"] = dict(drafter=drafter, verify="tree", tree_budget="auto")
    results = compare_on_domains(target, methods, prompts, max_new_tokens=args.max_new_tokens,
                                 repeats=args.repeats)
    context = int(np.median([len(p.ids) for ps in prompts.values() for p in ps])) + args.max_new_tokens // 2
    record = {"model": MODEL, "drafter": drafter.name, "batch": 1, "block_size": drafter.block_size,
              "verify_len": args.verify_len or drafter.block_size, "max_new_tokens": args.max_new_tokens,
              "prompts_per_domain": args.prompts_per_domain, "repeats": args.repeats,
              "jax": jax.__version__, "backend": jax.default_backend(),
              "machine": platform.processor() or platform.machine(),
              "domains": results, "summary": summarize(results),
              "engine": engine_overhead(target, drafter, results, context,
                                        args.verify_len or drafter.block_size)}
    emit_json(record, args.out, indent=2)
    if args.plot:
        plot(results, args.plot, f"{drafter.name} on held-out prompts (batch 1, "
             f"verify {record['verify_len']})")
    return record


if __name__ == "__main__":
    main()
