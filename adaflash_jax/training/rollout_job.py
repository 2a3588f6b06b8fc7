"""The rollout job: built-in training prompts -> the target's responses on disk.

Prompts are drawn from each trainable domain's TRAIN split (never an eval
split, never HumanEval, never a prompt of the fixed evaluation set, which may
come from another machine's train split), interleaved round-robin in a seeded
order, so any prefix of the job — the shards finished so far — is balanced
across domains. The OPD rollout rounds draw their prompts here too.
`adaflash rollout` is the command-line face of `run_rollout_job`.
"""

from __future__ import annotations

import numpy as np

from adaflash_jax.data.records import TRAINABLE_DOMAINS


def interleaved_prompts(data_dir: str, domains, per_domain: int, seed: int, encode=None,
                        max_prompt_tokens: int | None = None,
                        exclude: frozenset[str] | None = None) -> tuple[list, list[str]]:
    """(prompts, domains): `per_domain` seeded picks of each domain's train split, round-robin.

    Prompts of the fixed evaluation set are skipped (`exclude`: sha256 hex digests to
    skip instead; default `eval_prompt_hashes()`). With `encode` (text -> token ids) the
    prompts come back encoded, and those longer than `max_prompt_tokens` are skipped
    (long prompts would pad a whole batch).
    """
    from adaflash_jax.data.eval_set import eval_prompt_hashes, is_eval_prompt
    from adaflash_jax.data.prompts import build_prompt_datasets, is_eval_only, load_prompts

    bad = [d for d in domains if d not in TRAINABLE_DOMAINS or is_eval_only(d)]
    if bad:
        raise ValueError(f"rollouts use trainable domains only {TRAINABLE_DOMAINS}; got {bad}")
    if per_domain < 1:
        raise ValueError(f"per_domain must be >= 1, got {per_domain}")
    exclude = eval_prompt_hashes() if exclude is None else frozenset(exclude)
    build_prompt_datasets(data_dir, tuple(domains))
    picked = {}
    for i, domain in enumerate(domains):
        source = load_prompts(domain, "train", data_dir=data_dir)
        picked[domain], held_out = [], 0
        for j in np.random.default_rng([seed, i]).permutation(len(source)):
            prompt = source[int(j)]["prompt"].decode("utf-8")
            if is_eval_prompt(prompt, exclude):
                held_out += 1
                continue
            if encode is not None:
                prompt = encode(prompt)
                if max_prompt_tokens is not None and len(prompt) > max_prompt_tokens:
                    continue
            picked[domain].append(prompt)
            if len(picked[domain]) == per_domain:
                break
        if len(picked[domain]) < per_domain:
            raise ValueError(f"domain {domain!r} has only {len(picked[domain])} train prompts within "
                             f"max_prompt_tokens={max_prompt_tokens}, fewer than per_domain={per_domain} "
                             f"({held_out} skipped as evaluation-set prompts)")
    texts, labels = [], []
    for k in range(per_domain):
        for domain in domains:
            texts.append(picked[domain][k])
            labels.append(domain)
    return texts, labels


def run_rollout_job(target, out_dir: str, *, data_dir: str, domains=TRAINABLE_DOMAINS,
                    per_domain: int = 400, seed: int = 0, drafter=None, max_new_tokens: int = 128,
                    batch_size: int = 32, max_prompt_tokens: int = 128, samples: int = 0,
                    temperature: float = 0.7, greedy: bool = True, progress: bool = True,
                    shards: tuple[int, int] | None = None) -> dict:
    """Writes (or resumes) rollouts of the target on the built-in training prompts (only the
    shards in [start, stop) with `shards`)."""
    from adaflash_jax.training.rollouts import generate_rollouts

    ids, labels = encoded_train_prompts(target, data_dir, domains, per_domain, seed, max_prompt_tokens)
    return generate_rollouts(target, ids, labels, out_dir, drafter=drafter, max_new_tokens=max_new_tokens,
                             batch_size=batch_size, samples=samples, temperature=temperature,
                             greedy=greedy, progress=progress, shards=shards)


def encoded_train_prompts(target, data_dir: str, domains=TRAINABLE_DOMAINS, per_domain: int = 400,
                          seed: int = 0, max_prompt_tokens: int | None = 128) -> tuple[list, list[str]]:
    """`interleaved_prompts` as token ids under the target's chat template."""
    from adaflash_jax.generation import encode_prompts

    encode = lambda text: encode_prompts(target, [text])[0]  # noqa: E731  (chat template + checks)
    return interleaved_prompts(data_dir, tuple(domains), per_domain, seed, encode=encode,
                               max_prompt_tokens=max_prompt_tokens)


def run_eval_set_rollouts(target, out_dir: str, *, drafter=None, max_new_tokens: int = 256,
                          batch_size: int = 32, progress: bool = True) -> dict:
    """The target's responses to the whole fixed evaluation set (every domain, HumanEval too):
    held-out rows for the trainer's teacher-forced τ (`data.eval_path`), never trained on."""
    from adaflash_jax.data.eval_set import load_eval_set
    from adaflash_jax.eval.heldout import heldout_prompts
    from adaflash_jax.training.rollouts import generate_rollouts

    sizes = {domain: len(prompts) for domain, prompts in load_eval_set().items()}
    ids, labels = [], []
    for domain, prompts in heldout_prompts(target, min(sizes.values()), domains=tuple(sizes)).items():
        ids += [p.ids for p in prompts]
        labels += [domain] * len(prompts)
    return generate_rollouts(target, ids, labels, out_dir, drafter=drafter, max_new_tokens=max_new_tokens,
                             batch_size=batch_size, progress=progress)
