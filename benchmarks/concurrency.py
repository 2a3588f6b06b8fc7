"""AR vs DFlash (fixed-16) vs AdaFlash throughput as concurrency grows, on held-out prompts.

At each concurrency c the same c held-out prompts (code / math / prose eval
splits and HumanEval, interleaved, so every batch mixes the domains) are
decoded in one batch by every method, in the same run:

- `ar`: autoregressive;
- `dflash_offline`: the offline drafter, every step verifying the whole block;
- `dflash_opd`: the OPD drafter, the same fixed-length verification;
- `adaflash`: the OPD drafter with its length head and the "auto" policy (per
  step lengths from measured step costs, packed verification, AR steps when
  drafting does not pay).

Every call compiles ahead of time, so compile time is never in the timing; with
`--repeats 0` each method is timed once (runs here last minutes, so one run's
noise is small), else the median of `repeats` runs after the first. AdaFlash is
timed as a serving process that has decoded one batch before: an untimed
warm-up call first, so its step costs are calibrated and its acceptance
estimate and probe schedule carry over (as they would between requests).

For each: tokens/s, τ,
τ per domain, mean verify length, verified tokens per committed token, and
whether the output equals AR. Prints one JSON object; `--plot FILE.png` draws
tokens/s and speedup over AR against concurrency.

    python benchmarks/concurrency.py [--concurrency 1,8,32,64] [--max-new-tokens 64]
        [--offline smollm2-135m-instruct-dflash] [--opd smollm2-135m-instruct-adaflash]
        [--repeats 1] [--out FILE.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import platform
import statistics

import jax
import numpy as np
from tqdm import tqdm

import adaflash_jax as af
from adaflash_jax.eval.report import emit_json
from adaflash_jax.eval.heldout import EVAL_DOMAINS, heldout_prompts

MODEL = "smollm2-135m-instruct"
METHODS = ("ar", "dflash_offline", "dflash_opd", "adaflash")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated batch sizes")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--offline", default="smollm2-135m-instruct-dflash", help="offline DFlash drafter")
    p.add_argument("--opd", default="smollm2-135m-instruct-adaflash", help="OPD drafter with length head")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per method after a compile run")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (ar is always run: the reference)")
    p.add_argument("--data-dir", default=None, help="prompt sets (default: ~/.cache/adaflash_jax/prompts)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--plot", default=None, help="draw throughput against concurrency to this PNG")
    return p.parse_args(argv)


def mixed_prompts(target, count: int, data_dir=None) -> tuple[list[list[int]], list[str]]:
    """`count` held-out prompts, domains interleaved round-robin (ids, domain labels)."""
    per_domain = -(-count // len(EVAL_DOMAINS))
    by_domain = heldout_prompts(target, per_domain, data_dir=data_dir)
    ids, labels = [], []
    for k in range(per_domain):
        for domain in EVAL_DOMAINS:
            cases = by_domain[domain]
            ids.append(cases[k % len(cases)].ids)
            labels.append(domain)
    return ids[:count], labels[:count]


def run_method(target, prompts, labels, repeats: int, max_new_tokens: int, warmup: bool = False,
               **kwargs) -> tuple[dict, list]:
    runs = [af.generate(target, prompts, max_new_tokens=max_new_tokens, **kwargs)
            for _ in range(repeats + 1 + int(warmup))]
    compile_s = runs[0].stats["compile_time_s"]
    runs = runs[int(warmup):]
    res = runs[-1]
    wall = statistics.median(r.stats["wall_time_s"] for r in (runs[1:] or runs))
    row = {"tokens_per_s": res.stats["new_tokens"] / wall, "wall_s": wall,
           "new_tokens": res.stats["new_tokens"], "compile_s": compile_s}
    if "acceptance_lengths" in res.stats:
        st = res.stats
        per_domain = {}
        for domain in EVAL_DOMAINS:
            commits = [c for lens, lab in zip(st["acceptance_lengths"], labels) if lab == domain for c in lens]
            if commits:
                per_domain[domain] = float(np.mean(commits))
        row.update(mean_tau=st["mean_tau"], tau_per_domain=per_domain, verify_steps=st["verify_steps"],
                   mean_verify_len=st["mean_verify_len"], verified_per_committed=st["verified_per_committed"],
                   drafted_step_fraction=st["drafted_step_fraction"])
    return row, res.token_ids


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [int(c) for c in record["results"]]
    methods = list(next(iter(record["results"].values())))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for m in methods:
        tps = [record["results"][str(c)][m]["tokens_per_s"] for c in cs]
        ar = [record["results"][str(c)]["ar"]["tokens_per_s"] for c in cs]
        axes[0].plot(cs, tps, marker="o", label=m)
        axes[1].plot(cs, [t / a for t, a in zip(tps, ar)], marker="o", label=m)
    axes[0].set_ylabel("tokens/s")
    axes[1].set_ylabel("speedup over AR")
    axes[1].axhline(1.0, color="gray", lw=1, ls="--")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (batch)")
        ax.set_xticks(cs, [str(c) for c in cs])
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{record['model']}: AR vs DFlash vs AdaFlash ({record['backend']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if not levels or min(levels) < 1:
        raise SystemExit(f"--concurrency needs positive integers, got {args.concurrency!r}")
    target = af.load_target(MODEL)
    offline = af.load_drafter(args.offline, target=target)
    opd = af.load_drafter(args.opd, target=target)
    if not opd.has_length_head:
        raise SystemExit(f"{args.opd} has no length head; AdaFlash needs one")
    prompts, labels = mixed_prompts(target, max(levels), args.data_dir)
    chosen = {"ar", *args.methods.split(",")}
    if chosen - set(METHODS):
        raise SystemExit(f"--methods: unknown {sorted(chosen - set(METHODS))}; choose from {METHODS}")
    methods = {"ar": {}, "dflash_offline": dict(drafter=offline, length_policy="fixed"),
               "dflash_opd": dict(drafter=opd, length_policy="fixed"),
               "adaflash": dict(drafter=opd, length_policy="auto", warmup=True)}
    methods = {name: kw for name, kw in methods.items() if name in chosen}
    results = {}
    bar = tqdm(total=len(levels) * len(methods), desc="concurrency x method")
    for c in levels:
        rows, ar_ids = {}, None
        for name, kwargs in methods.items():
            row, ids = run_method(target, prompts[:c], labels[:c], args.repeats, args.max_new_tokens, **kwargs)
            ar_ids = ids if name == "ar" else ar_ids
            row["identical_to_ar"] = ids == ar_ids
            rows[name] = row
            bar.update(1)
        for name, row in rows.items():
            row["speedup_vs_ar"] = row["tokens_per_s"] / rows["ar"]["tokens_per_s"]
            if "dflash_opd" in rows:
                row["speedup_vs_dflash_fixed"] = row["tokens_per_s"] / rows["dflash_opd"]["tokens_per_s"]
        results[str(c)] = rows
    bar.close()
    record = {"model": MODEL, "offline_drafter": offline.name, "opd_drafter": opd.name,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "concurrency": levels,
              "jax": jax.__version__, "backend": jax.default_backend(),
              "machine": platform.processor() or platform.machine(), "results": results}
    emit_json(record, args.out, indent=2)
    if args.plot:
        plot(record, args.plot)
    return record


if __name__ == "__main__":
    main()
