"""AR vs speculative decoding on held-out prompts, per domain, on the same prompts in one run.

Prompts come from the built-in prompt sets' EVAL splits (code, math, prose —
never used for training) and HumanEval (eval-only). Each prompt is decoded
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
# HumanEval prompts carry a whole function signature + docstring: allow them more room.
MAX_PROMPT_TOKENS = {"code": 128, "math": 128, "prose": 128, "humaneval": 320}


class HeldoutPrompt(NamedTuple):
    text: str  # the user message
    ids: list[int]  # with the chat template applied


def heldout_prompts(target, per_domain: int, *, domains=EVAL_DOMAINS, data_dir: str | None = None,
                    offset: int = 0) -> dict[str, list[HeldoutPrompt]]:
    """{domain: prompts}: eval-split prompts in their stored order, skipping long ones."""
    from adaflash_jax.data.prompts import DEFAULT_PROMPT_DIR, build_prompt_datasets, load_prompts

    if per_domain < 1:
        raise ValueError(f"per_domain must be >= 1, got {per_domain}")
    data_dir = data_dir or DEFAULT_PROMPT_DIR
    build_prompt_datasets(data_dir, tuple(domains))
    out = {}
    for domain in domains:
        source = load_prompts(domain, "eval", data_dir=data_dir)
        picked = []
        for i in range(offset, len(source)):
            text = source[i]["prompt"].decode("utf-8")
            ids = encode_prompts(target, [text])[0]
            if len(ids) <= MAX_PROMPT_TOKENS.get(domain, 128):
                picked.append(HeldoutPrompt(text, ids))
            if len(picked) == per_domain:
                break
        if not picked:
            raise ValueError(f"no {domain} eval prompt fits in {MAX_PROMPT_TOKENS.get(domain, 128)} tokens")
        out[domain] = picked
    return out


def _timed(target, prompt, repeats: int, **kwargs):
    """(result, median wall seconds) of `repeats` runs after a warm-up run, or of one run
    when repeats=0 (generate compiles ahead of time, so compile is never in the timing)."""
    runs = [generate(target, [prompt], **kwargs) for _ in range(repeats + 1)]
    return runs[1] if repeats else runs[0], statistics.median(
        r.stats["wall_time_s"] for r in (runs[1:] or runs))


def compare_on_domains(target, drafter, prompts: dict[str, list[HeldoutPrompt]], *,
                       max_new_tokens: int = 64, repeats: int = 1, verify_len=None,
                       progress: bool = True, keep_outputs: bool = False) -> dict[str, dict]:
    """Per domain: AR and speculative tokens/s, speedup, τ, identical (see the module doc).

    drafter=None measures AR only (the speculative fields are absent).
    """
    results = {}
    bar = tqdm(total=sum(len(v) for v in prompts.values()), desc="held-out prompts", unit="prompt",
               disable=not progress)
    for domain, cases in prompts.items():
        ar_s = sp_s = 0.0
        tokens, taus, steps, same, outputs = 0, [], 0, True, []
        for case in cases:
            prompt = case.ids
            ar, ar_wall = _timed(target, prompt, repeats, max_new_tokens=max_new_tokens)
            ar_s, tokens = ar_s + ar_wall, tokens + ar.stats["new_tokens"]
            sp = None
            if drafter is not None:
                sp, sp_wall = _timed(target, prompt, repeats, max_new_tokens=max_new_tokens,
                                     drafter=drafter, verify_len=verify_len)
                sp_s += sp_wall
                taus += [c for row in sp.stats["acceptance_lengths"] for c in row]
                steps += sp.stats["verify_steps"]
                same &= ar.token_ids == sp.token_ids
            if keep_outputs:
                outputs.append({"prompt": case, "ar": ar, "spec": sp})
            bar.update(1)
        row = {"prompts": len(cases), "new_tokens": tokens, "ar_tokens_per_s": tokens / ar_s}
        if drafter is not None:
            row.update(spec_tokens_per_s=tokens / sp_s, speedup=ar_s / sp_s,
                       mean_tau=float(np.mean(taus)) if taus else 0.0, verify_steps=steps,
                       spec_s_per_step=sp_s / max(steps, 1), identical=bool(same))
        if keep_outputs:
            row["outputs"] = outputs
        results[domain] = row
    bar.close()
    return results


def summarize(results: dict[str, dict]) -> dict:
    """Totals over domains: throughput, and with a drafter τ (mean of domain τ), its
    spread (std/mean across domains), the overall speedup and identity."""
    tokens = sum(r["new_tokens"] for r in results.values())
    ar_s = sum(r["new_tokens"] / r["ar_tokens_per_s"] for r in results.values())
    out = {"prompts": sum(r["prompts"] for r in results.values()), "new_tokens": tokens,
           "ar_tokens_per_s": tokens / ar_s}
    if all("mean_tau" in r for r in results.values()):
        taus = [r["mean_tau"] for r in results.values()]
        sp_s = sum(r["new_tokens"] / r["spec_tokens_per_s"] for r in results.values())
        out.update(mean_tau=float(np.mean(taus)), tau_std_over_mean=float(np.std(taus) / np.mean(taus)),
                   spec_tokens_per_s=tokens / sp_s, speedup=ar_s / sp_s,
                   identical=all(r["identical"] for r in results.values()))
    return out
