"""AR vs speculative decoding on held-out prompts, per domain, on the same prompts in one run.

Prompts come from the fixed evaluation set shipped with the package
(`adaflash_jax.data.eval_set`: code, math, prose and HumanEval prompts frozen from
the built-in eval splits, the same on every machine and excluded from training by
hash; `benchmarks/freeze_eval_set.py` wrote it). Each prompt is decoded
alone (batch 1) autoregressively and speculatively; a domain's throughput is
its tokens over its summed wall time (compile excluded), τ is the mean number
of tokens committed per verify step, and `identical` says whether every
speculative output equals the AR one token for token.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from adaflash_jax.generation import encode_prompts, generate

EVAL_DOMAINS = ("code", "math", "prose", "humaneval")
# The token limits the fixed set was selected under (SmolLM2 chat template); HumanEval
# prompts carry a whole function signature + docstring, so they get more room.
MAX_PROMPT_TOKENS = {"code": 128, "math": 128, "prose": 128, "humaneval": 320}


class HeldoutPrompt(NamedTuple):
    text: str  # the user message
    ids: list[int]  # with the chat template applied


def heldout_prompts(target, per_domain: int, *, domains=EVAL_DOMAINS, data_dir: str | None = None,
                    offset: int = 0) -> dict[str, list[HeldoutPrompt]]:
    """{domain: prompts}: `per_domain` prompts of the fixed evaluation set from `offset` on,
    in stored order, encoded with the target's chat template.

    The set is the same for every target and machine, so results compare across them.
    `data_dir` is accepted for older callers and ignored: the set is a package asset.
    """
    from adaflash_jax.data.eval_set import load_eval_set

    del data_dir
    if per_domain < 1:
        raise ValueError(f"per_domain must be >= 1, got {per_domain}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    out = {}
    for domain, cases in load_eval_set(tuple(domains)).items():
        if offset + per_domain > len(cases):
            raise ValueError(f"the fixed evaluation set has {len(cases)} {domain} prompts; offset={offset} + "
                             f"per_domain={per_domain} asks for {offset + per_domain}")
        texts = [case.prompt for case in cases[offset:offset + per_domain]]
        out[domain] = [HeldoutPrompt(t, ids) for t, ids in zip(texts, encode_prompts(target, texts))]
    return out


def _timed(target, prompt, repeats: int, **kwargs):
    """(result, median wall seconds) of `repeats` runs after a warm-up run, or of one run
    when repeats=0 (generate compiles ahead of time, so compile is never in the timing)."""
    runs = [generate(target, [prompt], **kwargs) for _ in range(repeats + 1)]
    return runs[1] if repeats else runs[0], statistics.median(
        r.stats["wall_time_s"] for r in (runs[1:] or runs))


def compare_on_domains(target, methods: dict[str, dict], prompts: dict[str, list[HeldoutPrompt]], *,
                       max_new_tokens: int = 64, repeats: int = 1, progress: bool = True,
                       keep_outputs: bool = False) -> dict[str, dict]:
    """Per domain: AR tokens/s and, for each speculative method, its tokens/s, speedup, τ,
    mean verify length and whether its outputs equal AR's (see the module doc).

    methods: {name: `generate` keyword arguments (drafter=..., length_policy=...)}; {}
    measures AR only. A domain row holds `ar_tokens_per_s` and `methods[name]`.
    """
    results = {}
    bar = tqdm(total=sum(len(v) for v in prompts.values()), desc="held-out prompts", unit="prompt",
               disable=not progress)
    for domain, cases in prompts.items():
        ar_s, tokens, outputs = 0.0, 0, []
        acc = {name: {"seconds": 0.0, "commits": [], "steps": 0, "verified": 0, "same": True}
               for name in methods}
        for case in cases:
            ar, ar_wall = _timed(target, case.ids, repeats, max_new_tokens=max_new_tokens)
            ar_s, tokens = ar_s + ar_wall, tokens + ar.stats["new_tokens"]
            replies = {"ar": ar}
            for name, kwargs in methods.items():
                sp, sp_wall = _timed(target, case.ids, repeats, max_new_tokens=max_new_tokens, **kwargs)
                a = acc[name]
                a["seconds"] += sp_wall
                a["commits"] += [c for row in sp.stats["acceptance_lengths"] for c in row]
                a["steps"] += sp.stats["verify_steps"]
                a["verified"] += sp.stats["mean_verify_len"] * sp.stats["verify_steps"]
                a["same"] &= ar.token_ids == sp.token_ids
                replies[name] = sp
            if keep_outputs:
                outputs.append({"prompt": case, **replies})
            bar.update(1)
        row = {"prompts": len(cases), "new_tokens": tokens, "ar_tokens_per_s": tokens / ar_s,
               "methods": {name: {"tokens_per_s": tokens / a["seconds"], "speedup": ar_s / a["seconds"],
                                  "mean_tau": float(np.mean(a["commits"])) if a["commits"] else 0.0,
                                  "verify_steps": a["steps"], "s_per_step": a["seconds"] / max(a["steps"], 1),
                                  "mean_verify_len": a["verified"] / max(a["steps"], 1),
                                  "identical": bool(a["same"])}
                           for name, a in acc.items()}}
        if keep_outputs:
            row["outputs"] = outputs
        results[domain] = row
    bar.close()
    return results


def summarize(results: dict[str, dict]) -> dict:
    """Totals over domains: AR throughput and, per method, τ (mean of domain τ), its spread
    (std/mean across domains), throughput, speedup and identity."""
    tokens = sum(r["new_tokens"] for r in results.values())
    ar_s = sum(r["new_tokens"] / r["ar_tokens_per_s"] for r in results.values())
    out = {"prompts": sum(r["prompts"] for r in results.values()), "new_tokens": tokens,
           "ar_tokens_per_s": tokens / ar_s, "methods": {}}
    for name in next(iter(results.values()))["methods"]:
        rows = [r["methods"][name] for r in results.values()]
        taus = [m["mean_tau"] for m in rows]
        seconds = sum(r["new_tokens"] / r["methods"][name]["tokens_per_s"] for r in results.values())
        steps = sum(m["verify_steps"] for m in rows)
        out["methods"][name] = {
            "mean_tau": float(np.mean(taus)), "tau_std_over_mean": float(np.std(taus) / np.mean(taus)),
            "tokens_per_s": tokens / seconds, "speedup": ar_s / seconds, "verify_steps": steps,
            "mean_verify_len": sum(m["mean_verify_len"] * m["verify_steps"] for m in rows) / max(steps, 1),
            "identical": all(m["identical"] for m in rows)}
    return out
