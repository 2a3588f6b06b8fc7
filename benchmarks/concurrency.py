"""Every decoding mode's throughput as concurrency grows, on the fixed evaluation set.

At each concurrency c the same max(c, 4) prompts of the fixed evaluation set
(`eval.heldout.heldout_prompts`: code, math, prose and HumanEval, interleaved so
every batch mixes the domains, cycled past its 32 prompts per domain) are decoded
by every method, in the same run, at each temperature asked, in batches of c one
after another (so concurrency 1 is four requests in turn, one per domain, not one
prompt's luck):

- `ar`: autoregressive (the reference);
- `<drafter>/default`: `generate(..., drafter=d)` with no settings, the adaptive decoder
  (per-step tree budgets from 1 = plain AR up, zero-overhead AR steps);
- `<drafter>/chain16`: DFlash, every step verifying the whole 16-token block;
- `<drafter>/tree16`: a best-first tree of 16 nodes every step;
- `<drafter>/tree_auto`: the "auto" tree budget inside one program (AR steps as 1-node trees);
- `<drafter>/chain_auto`: the length head's "auto" chain policy (drafters with a head only),

for the DFlash drafter (`dflash`) and the AdaFlash drafter (`adaflash`).

No method is favoured: every one gets the same `--warmup` untimed calls first
(compilation happens ahead of time anyway; a warm-up also lets the adaptive policies
calibrate their step costs and carry their state over, as they would in a serving
process), then `--repeats` timed calls each (default 3), with the order of methods
rotated every repeat (repeat r starts at method r mod m), so drift in machine speed
spreads over all methods. The reported wall time is the median of the timed calls, and
the speedup over AR the ratio of the medians; `paired_speedup` is the median over rounds of
AR's wall over the method's in the same round (and `paired_speedup_range` its spread),
which a slow drift in machine speed moves less than it moves either median.

For each: tokens/s, speedup over AR, τ (per domain), mean verify length, verified
tokens per committed token, and whether the output equals AR (greedy: it must; T > 0:
the default's tokens are AR's samples of the same seed, the other modes only share
AR's distribution). The record also holds what a decode step that does not draft costs
against an AR step at `--no-draft-batches` (`no_draft_overhead.py`: the adaptive decoder's
AR program and the one-program "auto" tree budget against the AR engine, marginal step
times). Prints one JSON object; `--plot FILE.png` draws tokens/s and speedup over AR
against concurrency.

Every point's ratios come from the calls of one point, so a long matrix may be measured
in parts: with `--resume` and `--out FILE`, the record is written after each point, and a
later run with the same settings measures only the points FILE lacks (each point keeps
when it was measured).

    python benchmarks/concurrency.py [--concurrency 1,8,32,64] [--max-new-tokens 64]
        [--temperatures 0,0.7] [--methods ar,dflash/default,...] [--warmup 1] [--repeats 3]
        [--no-draft-batches 1,32] [--out FILE.json [--resume]] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import partial
from types import SimpleNamespace

import jax
import numpy as np
from tqdm import tqdm

import adaflash_jax as af
from adaflash_jax.atomic_io import atomic_write_json
from adaflash_jax.eval.report import emit_json
from adaflash_jax.eval.heldout import EVAL_DOMAINS, heldout_prompts

MODEL = "smollm2-135m-instruct"
MODES = {"default": {}, "chain16": dict(verify="chain", length_policy="fixed"),
         "tree16": dict(verify="tree", tree_budget=16), "tree_auto": dict(verify="tree", tree_budget="auto"),
         "chain_auto": dict(verify="chain", length_policy="auto")}
DRAFTERS = ("dflash", "adaflash")
METHODS = ("ar",) + tuple(f"{d}/{m}" for d in DRAFTERS for m in MODES if m != "chain_auto" or d == "adaflash")
EVAL_SET_PER_DOMAIN = 32  # prompts per domain in the fixed evaluation set


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated batch sizes")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dflash", default="smollm2-135m-instruct-dflash", help="the DFlash drafter")
    p.add_argument("--adaflash", default="smollm2-135m-instruct-adaflash",
                   help="the AdaFlash drafter (OPD, with a length head)")
    p.add_argument("--temperatures", default="0", help="comma-separated temperatures (default: 0, greedy)")
    p.add_argument("--prompt-set", choices=("eval", "unseen"), default="eval",
                   help="eval: the fixed evaluation set (default); unseen: the last training-split prompts of "
                        "the rollout job's order, which the shipped drafters never trained on (a check that a "
                        "result does not hold on the evaluation set only)")
    p.add_argument("--layer-layout", choices=("per_layer", "stacked"), default="stacked",
                   help="the target's layer layout (models.decoder_layers; default stacked)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per method and point, the same for all")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per method and point (median)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (ar is always run: the reference)")
    p.add_argument("--no-draft-batches", default="1,32",
                   help="batch sizes at which to time a step that does not draft against an AR step "
                        "(no_draft_overhead.py); empty: skip")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--resume", action="store_true",
                   help="keep the points --out already holds (same settings) and measure the others, "
                        "writing --out after each point")
    p.add_argument("--plot", default=None, help="draw throughput against concurrency to this PNG")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    if args.resume and not args.out:
        p.error("--resume needs --out (the record to resume)")
    return args


def resumed_record(path: str, settings: dict) -> dict:
    """The record at `path` to go on with: empty when there is none; its points when it was
    measured with `settings` (a partial record of an interrupted run included). A record of
    other settings is never overwritten: that is an error naming them."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    differ = sorted(k for k, v in settings.items() if record.get(k) != v)
    if differ:
        raise SystemExit(f"--resume: {path} was measured with other settings ({', '.join(differ)}); "
                         "choose another --out or the same settings")
    return record


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


UNSEEN_PER_DOMAIN = 2800  # the rollout job's size; the shipped drafters trained on its first 4736 prompts


def unseen_prompts(target, count: int) -> tuple[list[list[int]], list[str]]:
    """The last `count` prompts of the rollout job's interleaved training-split order (ids,
    domains): never in the fixed evaluation set, never trained on by the shipped drafters."""
    from adaflash_jax.data.prompts import DEFAULT_PROMPT_DIR
    from adaflash_jax.training.rollout_job import encoded_train_prompts

    ids, labels = encoded_train_prompts(target, DEFAULT_PROMPT_DIR, per_domain=UNSEEN_PER_DOMAIN)
    return ids[-count:], labels[-count:]


def schedule(names, warmup: int, repeats: int) -> list[tuple[str, bool]]:
    """(method, timed) calls of one point: every method's warm-up calls first, then `repeats`
    rounds of one timed call per method, the order rotated by one method per round."""
    names = list(names)
    calls = [(n, False) for _ in range(warmup) for n in names]
    for r in range(repeats):
        k = r % len(names)
        calls += [(n, True) for n in names[k:] + names[:k]]
    return calls


def decode_in_batches(generate, prompts, concurrency: int, **kwargs) -> SimpleNamespace:
    """`prompts` decoded in consecutive batches of `concurrency`, as one result: token_ids in
    order, walls, compile times, tokens and verify steps summed, τ over every step, the other
    means weighted by what they average over (row-steps, committed tokens, steps)."""
    parts = [generate(prompts[i:i + concurrency], **kwargs) for i in range(0, len(prompts), concurrency)]
    stats = [r.stats for r in parts]
    merged = {k: sum(st.get(k, 0.0) for st in stats) for k in ("wall_time_s", "compile_time_s", "new_tokens")}
    if all("acceptance_lengths" in st for st in stats):
        lengths = [row for st in stats for row in st["acceptance_lengths"]]
        flat = [c for row in lengths for c in row]
        row_steps = [sum(len(row) for row in st["acceptance_lengths"]) for st in stats]
        committed = [sum(map(sum, st["acceptance_lengths"])) for st in stats]
        steps = [st["verify_steps"] for st in stats]
        merged.update(acceptance_lengths=lengths, mean_tau=float(np.mean(flat)) if flat else 0.0,
                      verify_steps=sum(steps),
                      mean_verify_len=_weighted(stats, "mean_verify_len", row_steps),
                      verified_per_committed=_weighted(stats, "verified_per_committed", committed),
                      drafted_step_fraction=_weighted(stats, "drafted_step_fraction", steps))
    for key in ("cost_scales", "realized_gain"):  # the adaptive decoder's corrections after the last batch
        if key in stats[-1]:
            merged[key] = stats[-1][key]
    return SimpleNamespace(token_ids=[ids for r in parts for ids in r.token_ids], stats=merged)


def _weighted(stats, key: str, weights) -> float:
    return float(np.average([st[key] for st in stats], weights=weights)) if sum(weights) else 0.0


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
    for name, row in rows.items():
        if "ar" in rows:
            row["speedup_vs_ar"] = row["tokens_per_s"] / rows["ar"]["tokens_per_s"]
            paired = [ar / wall for ar, wall in zip(walls["ar"], walls[name])]  # round r's calls
            row["paired_speedup"] = statistics.median(paired)
            row["paired_speedup_range"] = [min(paired), max(paired)]
    return rows


def _point_key(concurrency: int, temperature: float) -> str:
    """Result keys: "32" for greedy (as before), "32@T0.7" above."""
    return str(concurrency) if temperature == 0 else f"{concurrency}@T{temperature:g}"


def _spec_stats(st: dict, labels) -> dict:
    per_domain = {}
    for domain in EVAL_DOMAINS:
        commits = [c for lens, lab in zip(st["acceptance_lengths"], labels) if lab == domain for c in lens]
        if commits:
            per_domain[domain] = float(np.mean(commits))
    return dict(mean_tau=st["mean_tau"], tau_per_domain=per_domain, verify_steps=st["verify_steps"],
                mean_verify_len=st["mean_verify_len"], verified_per_committed=st["verified_per_committed"],
                drafted_step_fraction=st["drafted_step_fraction"],
                **{k: st[k] for k in ("cost_scales", "realized_gain") if k in st})


def _checkpoint(record: dict, args) -> None:
    if args.resume:
        atomic_write_json(args.out, record, indent=2)


def no_draft_step(target, drafter, batch: int, repeats: int) -> dict:
    """`no_draft_overhead.py`'s rows at one batch size: {engine: {"step_ms", "vs_ar_step", ...}}
    for the AR engine, the adaptive decoder's AR program and the one-program "auto" tree budget."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import no_draft_overhead as nd
    finally:
        sys.path.pop(0)
    return nd.measure(nd.engines(target, drafter, nd.batch_of(target, batch)), max(repeats, 5))


def plot(record: dict, path: str) -> None:
    """Tokens/s and speedup over AR against concurrency, one row of panels per temperature
    (a point not yet measured is left out of its line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(next(iter(record["results"].values())))
    temps = [t for t in record.get("temperatures", [0.0])
             if any(_point_key(c, t) in record["results"] for c in record["concurrency"])]
    fig, axes = plt.subplots(len(temps), 2, figsize=(11, 3.6 * len(temps)), squeeze=False)
    for row, temp in zip(axes, temps):
        cs = [c for c in record["concurrency"] if _point_key(c, temp) in record["results"]]
        points = [record["results"][_point_key(c, temp)] for c in cs]
        for m in methods:
            tps = [pt[m]["tokens_per_s"] for pt in points]
            style = "-" if m == "ar" or m.endswith("/default") else "--"
            row[0].plot(cs, tps, style, marker="o", label=m)
            row[1].plot(cs, [pt[m]["paired_speedup"] for pt in points], style, marker="o", label=m)
        row[0].set_ylabel(f"tokens/s (T={temp:g})")
        row[1].set_ylabel(f"paired speedup over AR (T={temp:g})")
        row[1].axhline(1.0, color="gray", lw=1, ls=":")
        for ax in row:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency (batch)")
            ax.set_xticks(cs, [str(c) for c in cs])
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{record['model']}: decoding modes against AR ({record['backend']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if not levels or min(levels) < 1:
        raise SystemExit(f"--concurrency needs positive integers, got {args.concurrency!r}")
    target = af.load_target(MODEL, layer_layout=args.layer_layout)
    drafters = {"dflash": af.load_drafter(args.dflash, target=target),
                "adaflash": af.load_drafter(args.adaflash, target=target)}
    pick = mixed_prompts if args.prompt_set == "eval" else unseen_prompts
    prompts, labels = pick(target, max(max(levels), len(EVAL_DOMAINS)))
    chosen = ["ar"] + [m for m in args.methods.split(",") if m != "ar"]
    if set(chosen) - set(METHODS):
        raise SystemExit(f"--methods: unknown {sorted(set(chosen) - set(METHODS))}; choose from {METHODS}")
    methods = {name: ({} if name == "ar" else dict(drafter=drafters[name.split("/")[0]],
                                                    **MODES[name.split("/")[1]])) for name in chosen}
    temperatures = [float(t) for t in args.temperatures.split(",")]
    settings = {"model": MODEL, "layer_layout": args.layer_layout,
                "drafters": {k: d.name for k, d in drafters.items()}, "prompt_set": args.prompt_set,
                "max_new_tokens": args.max_new_tokens, "warmup": args.warmup, "repeats": args.repeats,
                "methods": chosen}
    earlier = resumed_record(args.out, settings) if args.resume else {}
    record = {**settings, "requests_per_point": "max(concurrency, 4), in batches of concurrency",
              "method_order": "rotated per repeat",
              "concurrency": sorted(set(levels) | set(earlier.get("concurrency", []))),
              "temperatures": sorted(set(temperatures) | set(earlier.get("temperatures", []))),
              "jax": jax.__version__, "backend": jax.default_backend(),
              "machine": platform.processor() or platform.machine(),
              "results": dict(earlier.get("results", {})), "measured_at": dict(earlier.get("measured_at", {})),
              "no_draft_step": dict(earlier.get("no_draft_step", {}))}
    for temp in temperatures:
        for c in tqdm(levels, desc=f"concurrency (T={temp:g})"):
            if _point_key(c, temp) in record["results"]:
                continue
            point = {n: dict(kw, temperature=temp, seed=0) for n, kw in methods.items()}
            n = max(c, len(EVAL_DOMAINS))
            row = measure_point(
                point, prompts[:n], labels[:n], warmup=args.warmup, repeats=args.repeats,
                max_new_tokens=args.max_new_tokens,
                generate=lambda p, c=c, **kw: decode_in_batches(partial(af.generate, target), p, c, **kw))
            record["results"][_point_key(c, temp)] = row
            record["measured_at"][_point_key(c, temp)] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            _checkpoint(record, args)
    for b in [int(x) for x in args.no_draft_batches.split(",") if x.strip()]:
        if str(b) not in record["no_draft_step"]:
            record["no_draft_step"][str(b)] = no_draft_step(target, drafters["dflash"], b, args.repeats)
            _checkpoint(record, args)
    emit_json(record, args.out, indent=2)
    if args.plot:
        plot(record, args.plot)
    return record


if __name__ == "__main__":
    main()
