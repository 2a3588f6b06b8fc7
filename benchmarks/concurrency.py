"""AR vs DFlash (fixed-16) vs AdaFlash throughput as concurrency grows, on the fixed evaluation set.

At each concurrency c the same c prompts of the fixed evaluation set
(`eval.heldout.heldout_prompts`: code, math, prose and HumanEval, interleaved so
every batch mixes the domains, cycled past its 32 prompts per domain) are
decoded in one batch by every method, in the same run:

- `ar`: autoregressive;
- `dflash_offline`: the offline drafter, every step verifying the whole block;
- `dflash_opd`: the OPD drafter, the same fixed-length verification;
- `adaflash`: the OPD drafter with its length head and the "auto" policy (per
  step lengths from measured step costs, packed verification, AR steps when
  drafting does not pay).

No method is favoured: every one gets the same `--warmup` untimed calls first
(compilation happens ahead of time anyway; a warm-up also lets "auto" calibrate
and carry its state over, as it would in a serving process, and gives the others
the same warm caches), then `--repeats` timed calls each (default 3), with the
order of methods rotated every repeat (repeat r starts at method r mod m), so
drift in machine speed spreads over all methods. The reported wall time is the
median of the timed calls.

For each: tokens/s, τ, τ per domain, mean verify length, verified tokens per
committed token, and whether the output equals AR. Prints one JSON object;
`--plot FILE.png` draws tokens/s and speedup over AR against concurrency.

    python benchmarks/concurrency.py [--concurrency 1,8,32,64] [--max-new-tokens 64]
        [--offline smollm2-135m-instruct-dflash] [--opd smollm2-135m-instruct-adaflash]
        [--warmup 1] [--repeats 3] [--out FILE.json] [--plot FILE.png]
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
EVAL_SET_PER_DOMAIN = 32  # prompts per domain in the fixed evaluation set


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated batch sizes")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--offline", default="smollm2-135m-instruct-dflash", help="offline DFlash drafter")
    p.add_argument("--opd", default="smollm2-135m-instruct-adaflash", help="OPD drafter with length head")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per method and point, the same for all")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per method and point (median)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (ar is always run: the reference)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--plot", default=None, help="draw throughput against concurrency to this PNG")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    return args


def mixed_prompts(target, count: int) -> tuple[list[list[int]], list[str]]:
    """`count` prompts of the fixed evaluation set, domains interleaved round-robin, each domain's
    prompts cycled when `count` needs more than it holds (ids, domain labels)."""
    per_domain = min(-(-count // len(EVAL_DOMAINS)), EVAL_SET_PER_DOMAIN)
    by_domain = heldout_prompts(target, per_domain)
    ids, labels = [], []
    for k in range(-(-count // len(EVAL_DOMAINS))):
        for domain in EVAL_DOMAINS:
            cases = by_domain[domain]
            ids.append(cases[k % len(cases)].ids)
            labels.append(domain)
    return ids[:count], labels[:count]


def schedule(names, warmup: int, repeats: int) -> list[tuple[str, bool]]:
    """(method, timed) calls of one point: every method's warm-up calls first, then `repeats`
    rounds of one timed call per method, the order rotated by one method per round."""
    names = list(names)
    calls = [(n, False) for _ in range(warmup) for n in names]
    for r in range(repeats):
        k = r % len(names)
        calls += [(n, True) for n in names[k:] + names[:k]]
    return calls


def measure_point(methods: dict[str, dict], prompts, labels, *, warmup: int, repeats: int,
                  max_new_tokens: int, generate=af.generate) -> dict[str, dict]:
    """Rows {method: stats} of one concurrency point (see the module doc); `generate` is the
    decoding call (`af.generate(prompts, max_new_tokens=..., **kwargs)` semantics)."""
    walls: dict[str, list[float]] = {n: [] for n in methods}
    last, compile_s = {}, {}
    for name, timed in schedule(methods, warmup, repeats):
        res = generate(prompts, max_new_tokens=max_new_tokens, **methods[name])
        compile_s.setdefault(name, res.stats.get("compile_time_s", 0.0))  # the first call compiles
        if timed:
            walls[name].append(res.stats["wall_time_s"])
            last[name] = res
    rows, ar_ids = {}, last["ar"].token_ids if "ar" in last else None
    for name, res in last.items():
        wall = statistics.median(walls[name])
        row = {"tokens_per_s": res.stats["new_tokens"] / wall, "wall_s": wall, "wall_s_runs": walls[name],
               "new_tokens": res.stats["new_tokens"], "compile_s": compile_s[name],
               "identical_to_ar": res.token_ids == ar_ids}
        if "acceptance_lengths" in res.stats:
            row.update(_spec_stats(res.stats, labels))
        rows[name] = row
    for row in rows.values():
        if "ar" in rows:
            row["speedup_vs_ar"] = row["tokens_per_s"] / rows["ar"]["tokens_per_s"]
        if "dflash_opd" in rows:
            row["speedup_vs_dflash_fixed"] = row["tokens_per_s"] / rows["dflash_opd"]["tokens_per_s"]
    return rows


def _spec_stats(st: dict, labels) -> dict:
    per_domain = {}
    for domain in EVAL_DOMAINS:
        commits = [c for lens, lab in zip(st["acceptance_lengths"], labels) if lab == domain for c in lens]
        if commits:
            per_domain[domain] = float(np.mean(commits))
    return dict(mean_tau=st["mean_tau"], tau_per_domain=per_domain, verify_steps=st["verify_steps"],
                mean_verify_len=st["mean_verify_len"], verified_per_committed=st["verified_per_committed"],
                drafted_step_fraction=st["drafted_step_fraction"])


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
    prompts, labels = mixed_prompts(target, max(levels))
    chosen = {"ar", *args.methods.split(",")}
    if chosen - set(METHODS):
        raise SystemExit(f"--methods: unknown {sorted(chosen - set(METHODS))}; choose from {METHODS}")
    methods = {"ar": {}, "dflash_offline": dict(drafter=offline, length_policy="fixed"),
               "dflash_opd": dict(drafter=opd, length_policy="fixed"),
               "adaflash": dict(drafter=opd, length_policy="auto")}
    methods = {name: kw for name, kw in methods.items() if name in chosen}
    results = {}
    for c in tqdm(levels, desc="concurrency"):
        results[str(c)] = measure_point(methods, prompts[:c], labels[:c], warmup=args.warmup,
                                        repeats=args.repeats, max_new_tokens=args.max_new_tokens,
                                        generate=lambda p, **kw: af.generate(target, p, **kw))
    record = {"model": MODEL, "offline_drafter": offline.name, "opd_drafter": opd.name,
              "max_new_tokens": args.max_new_tokens, "warmup": args.warmup, "repeats": args.repeats,
              "method_order": "rotated per repeat", "concurrency": levels,
              "jax": jax.__version__, "backend": jax.default_backend(),
              "machine": platform.processor() or platform.machine(), "results": results}
    emit_json(record, args.out, indent=2)
    if args.plot:
        plot(record, args.plot)
    return record


if __name__ == "__main__":
    main()
