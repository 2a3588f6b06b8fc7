"""τ against training compute: held-out teacher-forced τ of one or more training runs.

Each run directory's `evals.jsonl` (written by `adaflash train`) holds, per evaluation,
the step, the run's training seconds so far (all resumes), the held-out teacher-forced
τ and the first-position accuracy. Prints one JSON object and draws the curves:

    python benchmarks/tau_curve.py runs/smollm2_135m [runs/other ...] --plot tau_vs_compute.png
        [--after CHILD=PARENT ...]

`--after CHILD=PARENT` (run names) draws a run that started from another's drafter
(`drafter.init_from`) after it: its clock starts where the parent's ended.
"""

from __future__ import annotations

import argparse
import json
import os

from adaflash_jax.eval.report import emit_json


def read_evals(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "evals.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"{path} does not exist: not a training run directory, or no evaluation yet")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    by_step = {r["step"]: r for r in rows}  # a resumed run re-evaluates nothing, but keep the last
    return [by_step[s] for s in sorted(by_step)]


def chain_clocks(curves: dict[str, list[dict]], pairs: list[str]) -> None:
    """Adds each row's `total_seconds`: its run's training seconds plus, for a run continuing
    another (CHILD=PARENT), the parent's total at its last evaluation."""
    parents = {}
    for pair in pairs:
        child, sep, parent = pair.partition("=")
        if not sep or child not in curves or parent not in curves:
            raise SystemExit(f"--after takes CHILD=PARENT, both among the runs {sorted(curves)}; got {pair!r}")
        parents[child] = parent

    def total(name, seen=()):
        if name in seen:
            raise SystemExit(f"--after pairs form a cycle through {name}")
        parent = parents.get(name)
        offset = total(parent, seen + (name,))[-1]["total_seconds"] if parent else 0.0
        for r in curves[name]:
            r["total_seconds"] = r["train_seconds"] + offset
        return curves[name]

    for name in curves:
        total(name)


def plot(curves: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tau, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in curves.items():
        minutes = [r["total_seconds"] / 60 for r in rows]
        ax_tau.plot(minutes, [r["tau_teacher_forced"] for r in rows], marker="o", label=name)
        ax_acc.plot(minutes, [r.get("accuracy_first", float("nan")) for r in rows], marker="o", label=name)
    ax_tau.set(xlabel="training minutes (2-core CPU)", ylabel="held-out teacher-forced τ",
               title="τ vs compute")
    ax_acc.set(xlabel="training minutes (2-core CPU)", ylabel="accuracy at the first drafted position",
               title="first-position accuracy")
    for ax in (ax_tau, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="training run directories (checkpoint.dir)")
    p.add_argument("--plot", default=None, help="draw the curves to this PNG")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--after", action="append", default=[], metavar="CHILD=PARENT",
                   help="CHILD continued PARENT's drafter: start its clock at PARENT's end")
    args = p.parse_args(argv)
    curves = {os.path.basename(os.path.normpath(r)): read_evals(r) for r in args.runs}
    chain_clocks(curves, args.after)
    if args.plot:
        plot(curves, args.plot)
    return emit_json({"runs": curves}, args.out)


if __name__ == "__main__":
    main()
