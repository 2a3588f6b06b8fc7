"""`generate`: the one user-facing decode call (text or token-id prompts).

It validates inputs, applies the chat template to text prompts, pads the
batch to bucket shapes, runs the jitted loop, and trims the outputs to
exactly what each sequence emitted (up to and including its stop token).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from adaflash_jax.decoding import autoregressive
from adaflash_jax.decoding.compile_cache import compiled
from adaflash_jax.decoding.batching import bucket, pad_batch, trim_outputs, validate_prompts
from adaflash_jax.decoding.sampling import SamplingParams
from adaflash_jax.target_api import Target


@dataclasses.dataclass
class GenerateResult:
    token_ids: list[list[int]]  # new tokens only, stop token included
    texts: list[str] | None
    stats: dict[str, Any]


def encode_prompts(target: Target, prompts) -> list[list[int]]:
    """Text prompts get the checkpoint's chat template; id prompts pass through."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts must be a list (of strings or of token-id lists), not a single string")
    if len(prompts) and all(isinstance(p, str) for p in prompts):
        if target.tokenizer is None:
            raise ValueError("this target has no tokenizer; pass token-id prompts")
        tok = target.tokenizer
        out = []
        for i, text in enumerate(prompts):
            if not text.strip():
                raise ValueError(f"prompt {i} is empty")
            rendered = tok.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True)
            out.append(tok.encode(rendered))
        return out
    if any(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be all strings or all token-id lists, not a mix")
    return validate_prompts(prompts, target.cfg.vocab_size)


def cache_length(prompt_len: int, max_new_cap: int, headroom: int = 0) -> int:
    """Cache slots for a bucket: prompt + new tokens + engine headroom, rounded up."""
    return bucket(prompt_len + max_new_cap + headroom, 64)


def generate(target: Target, prompts: Sequence, *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             stop_token_ids: Sequence[int] | None = None, attn_impl: str = "xla",
             **speculative_kwargs) -> GenerateResult:
    """Decodes `prompts` with the target (autoregressively, or speculatively with `drafter=`).

    prompts: list[str] (chat template applied) or list[list[int]] (raw ids, used as-is).
    """
    if speculative_kwargs.get("drafter") is not None:
        from adaflash_jax.decoding.speculative import generate_speculative

        return generate_speculative(target, prompts, max_new_tokens=max_new_tokens,
                                    temperature=temperature, top_p=top_p, seed=seed,
                                    stop_token_ids=stop_token_ids, attn_impl=attn_impl,
                                    **speculative_kwargs)
    unknown = set(speculative_kwargs) - {"drafter"}
    if unknown:
        raise TypeError(f"generate() got unexpected arguments {sorted(unknown)}")
    params = SamplingParams(temperature, top_p)
    if int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = validate_prompts(encode_prompts(target, prompts), target.cfg.vocab_size)
    max_new_cap = bucket(max_new_tokens, 16)
    batch = pad_batch(ids, max_prompt_len=target.cfg.max_position_embeddings - max_new_tokens)
    cache_len = cache_length(batch.prompt_len, max_new_cap)
    eos = tuple(stop_token_ids) if stop_token_ids is not None else target.eos_token_ids

    args = (target.state, target.place_batch(batch.tokens),
            target.place_batch(batch.lengths), target.place_batch(batch.active),
            jnp.int32(max_new_tokens), jax.random.key(seed), jnp.float32(max(temperature, 1e-6)),
            jnp.float32(top_p), jnp.asarray(eos, jnp.int32))
    static = dict(max_new_cap=max_new_cap, cache_len=cache_len, greedy=params.greedy,
                  attn_impl=attn_impl)
    exe, compile_s = compiled(autoregressive.generate_padded, (target.graphdef,), args, static)
    t0 = time.perf_counter()
    out, num_out, steps = jax.block_until_ready(exe(*args))
    wall = time.perf_counter() - t0
    token_ids = trim_outputs(np.asarray(out), np.asarray(num_out), batch.num_prompts)
    total = sum(len(t) for t in token_ids)
    texts = ([target.tokenizer.decode(t, skip_special_tokens=True) for t in token_ids]
             if target.tokenizer is not None else None)
    stats = {"mode": "autoregressive", "steps": int(steps), "wall_time_s": wall,
             "compile_time_s": compile_s, "new_tokens": total,
             "tokens_per_s": total / wall if wall > 0 else float("inf"),
             "batch": batch.num_prompts, "padded_batch": batch.batch,
             "prompt_bucket": batch.prompt_len}
    return GenerateResult(token_ids, texts, stats)
