"""Validating prompts and padding them to a few bucket shapes.

Jitted loops compile once per input shape; padding batch size and prompt
length to powers of two bounds the number of compilations to a handful no
matter what users send. Padding rows are inactive (they produce nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

MIN_PROMPT_BUCKET = 16


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    size = max(int(minimum), 1)
    while size < n:
        size *= 2
    return size


def slot_rows(prompts: list[list[int]], max_width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The operands of a slot insert or prefill chunk: prompts right-padded, one row each, to a
    power-of-two width (at least MIN_PROMPT_BUCKET, at most max_width when given: whole prompts;
    a chunk after earlier ones runs as wide as it pads), and their lengths (an empty prompt
    counts one token, the padding)."""
    width = bucket(max(len(p) for p in prompts), MIN_PROMPT_BUCKET)
    tokens = np.zeros((len(prompts), width if max_width is None else min(width, max_width)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    return tokens, np.asarray([max(len(p), 1) for p in prompts], np.int32)


def cache_length(prompt_len: int, max_new_cap: int, headroom: int = 0) -> int:
    """Cache slots for a bucket: prompt + new tokens + engine headroom, rounded up to a multiple
    of 64. Every step attends over all of them, so a power of two would cost up to 2x the
    attention; the inputs are bucketed already, so shapes stay as few either way."""
    return -(-(prompt_len + max_new_cap + headroom) // 64) * 64


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
    tokens: np.ndarray  # int32 [B_pad, T_pad], right-padded with token 0
    lengths: np.ndarray  # int32 [B_pad] true prompt lengths (1 for padding rows)
    active: np.ndarray  # bool [B_pad]
    num_prompts: int

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.tokens.shape[1]


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """Checks token-id prompts; raises ValueError naming the offending prompt."""
    if isinstance(prompts, (str, bytes)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of prompts")
    out = []
    for i, p in enumerate(prompts):
        ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): "
                             f"{bad[:8]}")
        out.append(ids)
    return out


def encode_chat_prompts(prompts, tokenizer, vocab_size: int, owner: str = "target") -> list[list[int]]:
    """Validated token-id prompts: text gets the tokenizer's chat template (one user turn);
    id lists pass through. `owner` names what lacks a tokenizer in the error."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts must be a list (of strings or of token-id lists), not a single string")
    if len(prompts) and all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError(f"this {owner} has no tokenizer; pass token-id prompts")
        out = []
        for i, text in enumerate(prompts):
            if not text.strip():
                raise ValueError(f"prompt {i} is empty")
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True)
            out.append(tokenizer.encode(rendered))
        return validate_prompts(out, vocab_size)
    if any(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be all strings or all token-id lists, not a mix")
    return validate_prompts(prompts, vocab_size)


def pad_batch(prompts: list[list[int]], *, max_prompt_len: int, pad_to: int | None = None) -> PaddedBatch:
    """Right-pads prompts into bucket shapes (or exactly `pad_to` columns, for functions
    exported with a fixed prompt length); errors on prompts that cannot fit."""
    longest = max(len(p) for p in prompts)
    if longest > max_prompt_len:
        raise ValueError(f"prompt of {longest} tokens is longer than the maximum of {max_prompt_len} "
                         "tokens (model context minus max_new_tokens); shorten it or lower max_new_tokens")
    b_pad = bucket(len(prompts))
    t_pad = pad_to if pad_to is not None else min(bucket(longest, MIN_PROMPT_BUCKET),
                                                  max(max_prompt_len, longest))
    tokens = np.zeros((b_pad, t_pad), np.int32)
    lengths = np.ones((b_pad,), np.int32)
    active = np.zeros((b_pad,), bool)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
        lengths[i] = len(p)
        active[i] = True
    return PaddedBatch(tokens, lengths, active, len(prompts))


def trim_outputs(out_tokens: np.ndarray, num_out: np.ndarray, num_prompts: int) -> list[list[int]]:
    """Per-prompt generated ids from a padded [B, N] buffer and counts [B]."""
    return [out_tokens[i, :int(num_out[i])].tolist() for i in range(num_prompts)]
