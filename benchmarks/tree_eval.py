"""Tree vs chain verification on the fixed evaluation set: τ, tokens/s, and losslessness.

Methods, all greedy and all decoding the same prompts in the same run:

- `ar`: autoregressive (the reference every output is compared with);
- `chain16`: the drafter's 16-token block verified as a chain (DFlash, fixed length);
- `tree16`: a 16-node best-first tree per step (with a block of 16 it starts from the
  chain, `tree_build`; `--budget 32` compares `tree32`, which also branches);
- `tree_auto`: the node budget chosen per step from calibrated step costs
  (`tree_policy`; budget 1 is an AR step).

Prompts: `--prompts-per-domain` of each domain of the fixed evaluation set
(`eval.heldout.heldout_prompts`: code, math, prose, HumanEval), interleaved;
at concurrency c one batch of c of them (cycled when c exceeds the pool). The
schedule is `benchmarks/concurrency.py`'s: the same `--warmup` untimed calls per
method, then `--repeats` timed calls with the method order rotated each repeat,
median wall times. τ (mean committed tokens per verify step) is reported per
point and per domain; the summary takes it from the point with the most
distinct prompts. Prints one JSON object; `--plot FILE.png` draws tokens/s.

    python benchmarks/tree_eval.py [--drafter smollm2-135m-instruct-dflash]
        [--prompts-per-domain 4] [--max-new-tokens 64] [--concurrency 1,32]
        [--warmup 1] [--repeats 1] [--out FILE.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import adaflash_jax as af  # noqa: E402
from adaflash_jax.eval.heldout import EVAL_DOMAINS, heldout_prompts  # noqa: E402
from adaflash_jax.eval.report import emit_json  # noqa: E402
from concurrency import measure_point  # noqa: E402

MODEL = "smollm2-135m-instruct"
METHODS = ("ar", "chain{n}", "tree{n}", "tree_auto")  # {n}: --budget


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="smollm2-135m-instruct-dflash", help="drafter dir or built-in name")
    p.add_argument("--prompts-per-domain", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--budget", type=int, default=16, help="nodes of the fixed tree and tokens of the chain")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per method and point, the same for all")
    p.add_argument("--repeats", type=int, default=1, help="timed calls per method and point (median)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--plot", default=None, help="draw tokens/s per method and concurrency to this PNG")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.prompts_per_domain < 1:
        p.error("--repeats and --prompts-per-domain must be >= 1, --warmup >= 0")
    return args


def prompt_pool(target, per_domain: int) -> tuple[list[list[int]], list[str]]:
    """(ids, domain labels): per_domain prompts of every domain, interleaved round-robin."""
    by_domain = heldout_prompts(target, per_domain)
    ids, labels = [], []
    for k in range(per_domain):
        for domain in EVAL_DOMAINS:
            ids.append(by_domain[domain][k].ids)
            labels.append(domain)
    return ids, labels


def cycled(items: list, count: int) -> list:
    return [items[i % len(items)] for i in range(count)]


def methods_for(drafter, budget: int) -> dict[str, dict]:
    """The compared methods as `generate` keyword sets: chain{n} verifies min(n, Bs) block
    tokens, tree{n} an n-node tree."""
    chain = min(budget, drafter.block_size)
    return {"ar": {},
            f"chain{chain}": dict(drafter=drafter, length_policy="fixed", verify_len=chain),
            f"tree{budget}": dict(drafter=drafter, verify="tree", tree_budget=budget),
            "tree_auto": dict(drafter=drafter, verify="tree", tree_budget="auto")}


def summarize(results: dict[str, dict], pool_size: int) -> dict:
    """τ of tree vs chain (from the point with the most distinct prompts), tokens/s and speedups
    per point, and whether every output equalled AR's."""
    points = sorted(results, key=int)
    tau_point = max(points, key=lambda c: (min(int(c), pool_size), -int(c)))
    rows = results[tau_point]
    out = {"tau_point": int(tau_point),
           "tau": {m: rows[m]["mean_tau"] for m in rows if "mean_tau" in rows[m]},
           "tau_per_domain": {m: rows[m]["tau_per_domain"] for m in rows if "tau_per_domain" in rows[m]},
           "tokens_per_s": {c: {m: r["tokens_per_s"] for m, r in results[c].items()} for c in points},
           "speedup_vs_ar": {c: {m: r["speedup_vs_ar"] for m, r in results[c].items()} for c in points},
           "all_identical_to_ar": all(r["identical_to_ar"] for c in points for r in results[c].values())}
    chain = [t for m, t in out["tau"].items() if m.startswith("chain")]
    tree = [t for m, t in out["tau"].items() if m.startswith("tree") and m != "tree_auto"]
    if chain and tree:
        out["tau_tree_over_chain"] = tree[0] / chain[0]
    return out


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(record["results"], key=int)
    methods = list(record["results"][points[0]])
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ax.bar([j + i * width for j in range(len(points))],
               [record["results"][c][m]["tokens_per_s"] for c in points], width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(points))], [f"concurrency {c}" for c in points])
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    ax.set_title(f"{record['model']}: tree vs chain verification ({record['backend']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None, *, target=None, drafter=None) -> dict:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if not levels or min(levels) < 1:
        raise SystemExit(f"--concurrency needs positive integers, got {args.concurrency!r}")
    target = target if target is not None else af.load_target(MODEL)
    drafter = drafter if drafter is not None else af.load_drafter(args.drafter, target=target)
    ids, labels = prompt_pool(target, args.prompts_per_domain)
    methods = methods_for(drafter, args.budget)
    results = {}
    for c in levels:
        results[str(c)] = measure_point(methods, cycled(ids, c), cycled(labels, c), warmup=args.warmup,
                                        repeats=args.repeats, max_new_tokens=args.max_new_tokens,
                                        generate=lambda p, **kw: af.generate(target, p, **kw))
    record = {"model": target.name or MODEL, "drafter": drafter.name, "block_size": drafter.block_size,
              "budget": args.budget, "prompts_per_domain": args.prompts_per_domain,
              "max_new_tokens": args.max_new_tokens, "warmup": args.warmup, "repeats": args.repeats,
              "concurrency": levels, "jax": jax.__version__, "backend": jax.default_backend(),
              "machine": platform.processor() or platform.machine(),
              "summary": summarize(results, len(ids)), "results": results}
    emit_json(record, args.out, indent=2)
    if args.plot:
        plot(record, args.plot)
    return record


if __name__ == "__main__":
    main()
