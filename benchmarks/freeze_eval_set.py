"""Freezes the held-out evaluation prompts into the package asset `adaflash_jax/assets/eval/`.

For each of code, math, prose and humaneval, takes the first `--per-domain` prompts of
this machine's eval split (stored order) whose chat-templated length under the SmolLM2
tokenizer fits `MAX_PROMPT_TOKENS`, and writes them with their sha256 (see
`adaflash_jax.data.eval_set`). Run once; the written files are the shipped set, so
regenerating changes what every later evaluation measures. Prints the manifest.

    python benchmarks/freeze_eval_set.py [--per-domain 32] [--data-dir DIR] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os

from adaflash_jax.checkpoints.gguf import smollm2_gguf_path
from adaflash_jax.checkpoints.tokenizer import Tokenizer
from adaflash_jax.data.eval_set import EVAL_SET_DIR, EVAL_SET_DOMAINS, EvalPrompt, prompt_hash, write_eval_set
from adaflash_jax.data.prompts import DEFAULT_PROMPT_DIR, build_prompt_datasets, load_prompts
from adaflash_jax.decoding.batching import encode_chat_prompts
from adaflash_jax.eval.heldout import MAX_PROMPT_TOKENS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-domain", type=int, default=32, help="prompts kept per domain (default: 32)")
    p.add_argument("--data-dir", default=DEFAULT_PROMPT_DIR, help="built-in prompt sets to freeze from")
    p.add_argument("--out-dir", default=EVAL_SET_DIR, help="where to write eval_set.jsonl / eval_set.json")
    return p.parse_args(argv)


def pick(domain: str, tokenizer: Tokenizer, data_dir: str, per_domain: int) -> list[EvalPrompt]:
    """The first `per_domain` eval-split prompts of `domain` that fit its token limit."""
    limit, picked = MAX_PROMPT_TOKENS[domain], []
    for row in load_prompts(domain, "eval", data_dir=data_dir):
        text = row["prompt"].decode("utf-8")
        if len(encode_chat_prompts([text], tokenizer, tokenizer.vocab_size)[0]) <= limit:
            picked.append(EvalPrompt(domain, text, row["source"].decode("utf-8"), prompt_hash(text)))
        if len(picked) == per_domain:
            return picked
    raise SystemExit(f"only {len(picked)} {domain} eval prompts fit in {limit} tokens; need {per_domain}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.per_domain < 1:
        raise SystemExit(f"--per-domain must be >= 1, got {args.per_domain}")
    data_dir = os.path.expanduser(args.data_dir)
    build_prompt_datasets(data_dir, EVAL_SET_DOMAINS)
    tokenizer = Tokenizer.from_gguf(smollm2_gguf_path())
    records = [r for d in EVAL_SET_DOMAINS for r in pick(d, tokenizer, data_dir, args.per_domain)]
    manifest = write_eval_set(records, args.out_dir, tokenizer="smollm2-135m-instruct chat template",
                              max_prompt_tokens={d: MAX_PROMPT_TOKENS[d] for d in EVAL_SET_DOMAINS},
                              selection=f"first {args.per_domain} fitting prompts of each eval split, stored order")
    print(json.dumps(manifest, indent=2))
    return manifest


if __name__ == "__main__":
    main()
