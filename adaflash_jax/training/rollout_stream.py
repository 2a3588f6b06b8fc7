"""Rollout shards decoded by continuous batching (`serving.scheduler`).

Decoding a fixed batch to completion waits for its longest response: with
responses of mixed lengths capped at 256 tokens, a third of the rows' steps
compute nothing. Here prompts stream through S engine slots instead: a slot
refills as soon as its response ends, and a shard is written once all of its
responses are in. Outputs are the ones `generate` gives for each prompt (the
engine's rows are independent); a sampled response uses the same seed and
stream as the per-shard path (`rollouts.write_rollout_shard`), so both write
identical stores.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from tqdm import tqdm

from adaflash_jax.serving.scheduler import Request, Scheduler
from adaflash_jax.serving.slot_engine import LocalEngine


def stream_shards(target, prompt_ids: Sequence[Sequence[int]], domains: Sequence[str], shards: Sequence[int],
                  write: Callable[[int, list[dict]], None], *, shard_size: int, slots: int,
                  max_new_tokens: int, drafter=None, samples: int = 0, temperature: float = 0.7,
                  greedy: bool = True, progress: bool = True) -> dict:
    """Decodes `shards` (shard k: prompts [k*shard_size, (k+1)*shard_size)) and calls
    write(shard, records) as each completes, records ordered by (sample, index); without
    `greedy`, only the sampled responses. At most 2 * slots requests wait at a time, so memory
    stays flat however many shards there are."""
    longest = max(len(prompt_ids[i]) for s in shards
                  for i in range(s * shard_size, min((s + 1) * shard_size, len(prompt_ids))))
    engine = dict(num_slots=slots, max_prompt_len=longest, max_new_tokens=max_new_tokens)
    engines = {"greedy": LocalEngine(target, drafter, **engine)} if greedy else {}
    if samples:
        engines["sample"] = LocalEngine(target, drafter, greedy=False, **engine)
    sched = Scheduler(engines, max_queue=4 * slots, max_prefill_tokens=max(2048, longest))
    pending = (req for s in shards for req in _shard_requests(s, prompt_ids, domains, shard_size, slots,
                                                                samples, temperature, max_new_tokens, greedy))
    expected = {s: (min((s + 1) * shard_size, len(prompt_ids)) - s * shard_size) * (samples + int(greedy))
                for s in shards}
    received: dict[int, list[dict]] = {s: [] for s in shards}
    responses: dict[int, list[int]] = {}
    stats = {"tokens": 0, "wall_s": 0.0}
    bar = tqdm(total=len(shards), desc="rollouts", unit="shard", disable=not progress)
    t0, exhausted = time.perf_counter(), False
    while not exhausted or not sched.idle():
        while not exhausted and sched.waiting < 2 * slots:
            request = next(pending, None)
            if request is None:
                exhausted = True
            else:
                sched.submit(request)
        for update in sched.iterate():
            shard, record = update.tag
            responses.setdefault(id(record), []).extend(update.new_tokens)
            if not update.done:
                continue
            record["response_ids"] = responses.pop(id(record))
            received[shard].append(record)
            stats["tokens"] += len(record["response_ids"])
            if len(received[shard]) == expected[shard]:
                write(shard, sorted(received.pop(shard), key=lambda r: (r["sample"], r["index"])))
                elapsed = time.perf_counter() - t0
                bar.update(1)
                bar.set_postfix(tok_s=f"{stats['tokens'] / elapsed:.0f}")
    stats["wall_s"] = time.perf_counter() - t0
    bar.close()
    return stats


def _shard_requests(shard: int, prompt_ids, domains, shard_size: int, slots: int, samples: int,
                    temperature: float, max_new_tokens: int, greedy: bool = True):
    """The shard's requests: every greedy response (unless not `greedy`), then each sampled round. A sampled
    response keeps the per-shard path's randomness: seed shard * 1000 + sample, and the stream
    of the prompt's row in its decode call of `slots` prompts."""
    lo, hi = shard * shard_size, min((shard + 1) * shard_size, len(prompt_ids))
    for sample in range(0 if greedy else 1, samples + 1):
        for i in range(lo, hi):
            record = {"index": i, "prompt_ids": list(map(int, prompt_ids[i])), "sample": sample,
                      "domain": domains[i]}
            sampling = {} if sample == 0 else dict(temperature=temperature, seed=shard * 1000 + sample,
                                                   stream=(i - lo) % slots)
            yield Request(record["prompt_ids"], max_new_tokens, tag=(shard, record), **sampling)
