"""Acceptance of drafted blocks on the fixed evaluation set: per-domain τ and, for an
AdaFlash drafter, how well its length head predicts it.

The rows are the target's greedy responses to the fixed evaluation set
(`adaflash rollout <config> --eval-set`). A block is drafted at every `--stride`-th
response position of every row, as decoding would draft it there: the drafter sees
the target's features of everything before the anchor. Greedy verification of the
whole block would accept its leading drafts that equal the target's own next tokens,
so the accepted length a is exact, not an estimate. Reported per domain and overall:
teacher-forced τ = 1 + mean a over blocks (decoding's τ is lower: a decode step that
accepts much skips positions, so easy stretches get fewer steps). With a length head,
the head scores the same blocks (ŝ): the Pearson correlation of ŝ with a, the mean
score against the mean realized fraction (a + 1) / Bs, and a calibration table (mean
realized fraction per score bin). Prints one JSON object; `--plot FILE.png` draws the
calibration curve.

    python benchmarks/block_acceptance.py --drafter smollm2-135m-instruct-adaflash \
        --eval-rollouts runs/smollm2_135m_eval_rollouts [--stride 4] [--out FILE.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import adaflash_jax as af
from adaflash_jax.eval.report import emit_json
from adaflash_jax.models import draft_vocab
from adaflash_jax.models.length_head import accepted_counts, draft_confidence
from adaflash_jax.training.rollouts import rollout_arrays
from adaflash_jax.training.step import Batch, block_hidden, label_validity


def grid_anchors(prompt_lens: np.ndarray, seq_lens: np.ndarray, seq_len: int, stride: int):
    """Anchors [B, N] every `stride` positions from each row's first response token (an anchor
    is a known token, as the bonus token is in decoding: the first one is the token prefill
    picks) and their validity: an anchor needs at least one label after it."""
    n = (seq_len + stride - 1) // stride
    anchors = prompt_lens[:, None] + stride * np.arange(n)[None]
    valid = anchors < seq_lens[:, None] - 1
    return np.where(valid, anchors, 0).astype(np.int32), valid


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "head_def"))
def score_blocks(target_def, drafter_def, head_def, tstate, dstate, hstate, batch: Batch, anchors,
                 anchor_valid):
    """(head scores [B, N] (zeros without a head), accepted counts [B, N], the drafter's own
    expected accepted count Σ_k Π_{i≤k} p_i [B, N]) of the blocks at `anchors`."""
    target, drafter = nnx.merge(target_def, tstate), nnx.merge(drafter_def, dstate)
    hidden, labels, label_pos = block_hidden(target, drafter, batch, anchors)
    b, n, bs = labels.shape
    z = draft_vocab.logits(target, drafter, hidden).reshape(b * n, bs, -1)
    drafts = draft_vocab.to_target(drafter, jnp.argmax(z, axis=-1).astype(jnp.int32)).reshape(b, n, bs)
    valid = label_validity(label_pos, batch.seq_lens, anchor_valid)
    confidence = draft_confidence(z[:, 1:])  # [B*N, Bs-1]
    scores = jnp.zeros((b, n), jnp.float32)
    if head_def is not None:
        head = nnx.merge(head_def, hstate)
        head_input = confidence if head.uses_confidence else None
        scores = head(hidden.reshape(b * n, bs, -1), head_input).reshape(b, n)
    expected = jnp.sum(jnp.cumprod(confidence, axis=-1), axis=-1).reshape(b, n)
    return scores, accepted_counts(drafts, labels, valid), expected


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def measure(target, drafter, arrays: dict, *, stride: int, rows_per_call: int = 8) -> dict:
    """Per block: head score (0 without a head), accepted count and domain, over all rows."""
    head = drafter.length_head
    head_def, head_state = nnx.split(head) if head is not None else (None, None)
    tokens, plens, slens = arrays["tokens"], arrays["prompt_lens"], arrays["seq_lens"]
    seq_len = tokens.shape[1]
    scores, accepted, expected, domains = [], [], [], []
    for lo in range(0, len(tokens), rows_per_call):
        sl = slice(lo, lo + rows_per_call)
        rows = len(tokens[sl])
        pad = rows_per_call - rows  # one compiled shape: pad the last call with copies of row 0
        pick = np.concatenate([np.arange(lo, lo + rows), np.full(pad, lo, np.int64)])
        anchors, valid = grid_anchors(plens[pick], slens[pick], seq_len, stride)
        batch = Batch(jnp.asarray(tokens[pick]), jnp.asarray(plens[pick]), jnp.asarray(slens[pick]))
        s, a, e = jax.device_get(score_blocks(target.graphdef, drafter.graphdef, head_def, target.state,
                                              drafter.state, head_state, batch, jnp.asarray(anchors),
                                              jnp.asarray(valid)))
        keep = valid[:rows]
        scores.append(s[:rows][keep])
        accepted.append(a[:rows][keep])
        expected.append(e[:rows][keep])
        domains.append(np.repeat(arrays["domains"][sl], keep.sum(axis=1)))
    return {"scores": np.concatenate(scores), "accepted": np.concatenate(accepted),
            "expected": np.concatenate(expected), "domains": np.concatenate(domains)}


def summarize(blocks: dict, block_size: int, has_head: bool, bins: int = 10) -> dict:
    s, a, dom = blocks["scores"], blocks["accepted"].astype(np.float64), blocks["domains"]
    realized = np.minimum(a + 1, block_size) / block_size

    def stats(m):
        # confidence_pearson: the drafter's own estimate Σ_k Π_{i≤k} p_i against a, for reference
        row = {"blocks": int(m.sum()), "tau_teacher_forced": float(1.0 + np.mean(a[m])),
               "confidence_pearson": pearson(blocks["expected"][m], a[m])}
        if has_head:
            row.update(pearson=pearson(s[m], a[m]), mean_score=float(np.mean(s[m])),
                       mean_realized_fraction=float(np.mean(realized[m])))
        return row

    out = dict(stats(np.ones_like(a, bool)), domains={d: stats(dom == d) for d in sorted(set(dom.tolist()))})
    taus = [r["tau_teacher_forced"] for r in out["domains"].values()]
    out["tau_domain_mean"], out["tau_domain_cv"] = float(np.mean(taus)), float(np.std(taus) / np.mean(taus))
    if not has_head:
        return out
    edges = np.linspace(0.0, 1.0, bins + 1)
    idx = np.clip(np.digitize(s, edges) - 1, 0, bins - 1)
    out["calibration"] = [{"score_lo": float(edges[i]), "score_hi": float(edges[i + 1]),
                           "blocks": int((idx == i).sum()),
                           "mean_score": float(np.mean(s[idx == i])),
                           "mean_realized_fraction": float(np.mean(realized[idx == i]))}
                          for i in range(bins) if (idx == i).any()]
    return out


def plot(summary: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cal = summary["calibration"]
    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--", label="perfect calibration")
    ax.plot([c["mean_score"] for c in cal], [c["mean_realized_fraction"] for c in cal], marker="o",
            label=f"head (Pearson r = {summary['pearson']:.2f})")
    for c in cal:
        ax.annotate(str(c["blocks"]), (c["mean_score"], c["mean_realized_fraction"]), fontsize=7,
                    xytext=(3, -9), textcoords="offset points")
    ax.set_xlabel("length head score ŝ (binned)")
    ax.set_ylabel("realized fraction (a + 1) / Bs")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="target name or path")
    p.add_argument("--drafter", default="smollm2-135m-instruct-adaflash",
                   help="drafter name or path (with a length head: also the head's accuracy)")
    p.add_argument("--eval-rollouts", default="runs/smollm2_135m_eval_rollouts",
                   help="the target's responses to the fixed evaluation set (adaflash rollout --eval-set)")
    p.add_argument("--seq-len", type=int, default=384, help="rows are cut to this many tokens")
    p.add_argument("--stride", type=int, default=4, help="draft a block every N response positions")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--plot", help="draw the head's calibration curve to this PNG")
    args = p.parse_args(argv)
    if args.stride < 1:
        p.error(f"--stride must be >= 1, got {args.stride}")
    target = af.load_target(args.model)
    drafter = af.load_drafter(args.drafter, target=target)
    arrays = rollout_arrays(args.eval_rollouts, args.seq_len)
    summary = summarize(measure(target, drafter, arrays, stride=args.stride), drafter.block_size,
                        drafter.has_length_head)
    record = {"model": args.model, "drafter": args.drafter, "eval_rollouts": args.eval_rollouts,
              "rows": int(len(arrays["tokens"])), "stride": args.stride, "block_size": drafter.block_size,
              **summary}
    if args.plot and drafter.has_length_head:
        plot(summary, args.plot, f"{args.drafter}: head score vs realized acceptance")
    return emit_json(record, args.out)


if __name__ == "__main__":
    main()
