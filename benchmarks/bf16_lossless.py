"""How "lossless" speculative decoding is with a bfloat16 target: divergences and their margins.

In float32, greedy speculative output equals AR output token for token. In bfloat16 a
verify pass over 16 tokens does not round like 16 one-token AR steps, so where the
target's top two logits are nearly tied the argmax can flip and the outputs part ways
(both are then valid greedy decodes of the bf16 model, up to that near-tie). This script
decodes the fixed evaluation set greedily, AR and speculatively (fixed 16-token
verification), with the target in float32 and in bfloat16, counts the prompts whose
outputs differ, and for each divergence reports the AR run's top-1 minus top-2 logit
margin at the first differing position (scored by the same model, float32 logits).

    python benchmarks/bf16_lossless.py [--drafter NAME|DIR] [--prompts-per-domain 8]
        [--max-new-tokens 64] [--out FILE.json]
"""

from __future__ import annotations

import argparse

import numpy as np

import adaflash_jax as af
from adaflash_jax.eval.heldout import heldout_prompts
from adaflash_jax.eval.report import emit_json

MODEL = "smollm2-135m-instruct"


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(dtype: str, drafter_name: str, per_domain: int, max_new: int, batch: int) -> dict:
    target = af.load_target(MODEL, dtype=dtype)
    drafter = af.load_drafter(drafter_name, target=target)
    prompts = heldout_prompts(target, per_domain)
    rows, divergences = 0, []
    for domain, cases in prompts.items():
        ids = [c.ids for c in cases]
        for lo in range(0, len(ids), batch):
            chunk = ids[lo:lo + batch]
            ar = af.generate(target, chunk, max_new_tokens=max_new).token_ids
            spec = af.generate(target, chunk, max_new_tokens=max_new, drafter=drafter,
                               length_policy="fixed").token_ids
            for prompt, a, s in zip(chunk, ar, spec):
                rows += 1
                at = first_difference(a, s)
                if at is None:
                    continue
                logits = target.score([prompt + a[:at]])[0, -1]
                top2 = np.sort(logits)[-2:]
                divergences.append({"domain": domain, "position": at, "ar_margin": float(top2[1] - top2[0])})
    margins = [d["ar_margin"] for d in divergences]
    return {"prompts": rows, "differing_prompts": len(divergences),
            "differing_rate": len(divergences) / max(rows, 1),
            "max_margin_at_divergence": max(margins) if margins else None,
            "median_margin_at_divergence": float(np.median(margins)) if margins else None,
            "divergences": divergences}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="smollm2-135m-instruct-dflash")
    p.add_argument("--prompts-per-domain", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="prompts decoded together (AR and speculative alike)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    record = {"model": MODEL, "drafter": args.drafter, "max_new_tokens": args.max_new_tokens,
              "verify": "fixed, whole block", "batch": args.batch}
    for dtype in ("float32", "bfloat16"):
        record[dtype] = measure(dtype, args.drafter, args.prompts_per_domain, args.max_new_tokens, args.batch)
    return emit_json(record, args.out, indent=2)


if __name__ == "__main__":
    main()
