"""Calibrating the "auto" length policy's step costs on the running hardware.

The policy trades expected committed tokens against measured seconds, so it
needs, at the engine's padded batch: the time of one packed verify for every
bucket size and of one drafter block. These are measured once per (device,
kernel implementation `attn_impl`, target, drafter shape, batch, cache length,
buckets) with the same compiled pieces and kernels the engine runs, and kept in
memory and in a JSON file (`~/.cache/adaflash_jax/step_costs.json`, override
with ADAFLASH_COST_CACHE; its read-modify-write holds a sidecar file lock, so
concurrent runs never drop each other's rows), so later runs reuse them.
Medians of repeats, after a compile call.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.atomic_io import atomic_write_json, file_lock
from adaflash_jax.decoding.autoregressive import new_cache
from adaflash_jax.decoding.packed_verify import verify_packed, verify_shapes
from adaflash_jax.decoding.verify_plan import StepCosts
from adaflash_jax.decoding.step_costs import measure_draft, median_time
from adaflash_jax.models.drafter import new_context_cache

_MEMORY: dict[str, dict] = {}


def cost_cache_path() -> str:
    return os.environ.get("ADAFLASH_COST_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "adaflash_jax", "step_costs.json"))


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "shapes", "attn_impl"))
def _packed_step(target_def, drafter_def, tstate, dstate, cache, ctx, tokens, lengths, shape, *, shapes,
                 attn_impl):
    """The engine's verify at one packed shape, the drafter context append included."""
    target = nnx.merge(target_def, tstate)
    drafter = nnx.merge(drafter_def, dstate)
    ids, ctx, out_cache = verify_packed(target, tokens, lengths, cache, shapes, shape,
                                        layer_ids=drafter.cfg.target_layer_ids, attn_impl=attn_impl,
                                        greedy=True, drafter=drafter, ctx=ctx)
    return ids, ctx.layer_k(0)[0, 0, 0, 0], out_cache.layer_k(0)[0, 0, 0, 0]


def _key(target, drafter, batch: int, cache_len: int, buckets, attn_impl: str) -> str:
    dev = jax.devices()[0]
    return json.dumps(["v5", dev.platform, getattr(dev, "device_kind", ""), attn_impl, target.name,
                       target.cfg.dtype, target.layer_layout,
                       drafter.cfg.num_layers, drafter.cfg.hidden_size, drafter.block_size, batch,
                       cache_len, list(buckets)])


def _load_disk() -> dict:
    try:
        with open(cost_cache_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _store_disk(key: str, row: dict) -> None:
    path = cost_cache_path()
    try:
        with file_lock(path):  # another run's row, written meanwhile, is kept
            table = _load_disk()
            table[key] = row
            atomic_write_json(path, table, indent=1)
    except OSError:
        pass  # a read-only home only costs a re-calibration next time


def cached_row(key: str, measure_row, use_cache: bool = True) -> dict:
    """The timings stored under `key` (memory, then the JSON file), else `measure_row()`, stored."""
    row = _MEMORY.get(key) or (_load_disk().get(key) if use_cache else None)
    if row is None:
        row = measure_row()
        _store_disk(key, row)
    _MEMORY[key] = row
    return row


def device_key() -> list:
    """The running device, as cache keys name it."""
    dev = jax.devices()[0]
    return [dev.platform, getattr(dev, "device_kind", "")]


def calibrate(target, drafter, *, batch: int, cache_len: int, buckets: tuple[int, ...],
              context: int | None = None, repeats: int = 3, use_cache: bool = True,
              attn_impl: str = "xla") -> StepCosts:
    """Measured StepCosts for the engine's padded `batch`, one verify time per bucket, with
    the kernels of `attn_impl` (Pallas and XLA steps cost differently)."""
    key = _key(target, drafter, batch, cache_len, buckets, attn_impl)
    row = cached_row(key, lambda: measure(target, drafter, batch=batch, cache_len=cache_len, buckets=buckets,
                                          context=context, repeats=repeats, attn_impl=attn_impl), use_cache)
    return StepCosts(jnp.asarray(row["verify_s"], jnp.float32), jnp.float32(row["draft_s"]),
                     jnp.float32(row["ar_s"]))


def measure(target, drafter, *, batch: int, cache_len: int, buckets: tuple[int, ...],
            context: int | None = None, repeats: int = 3, attn_impl: str = "xla") -> dict:
    """{"verify_s": [per bucket], "draft_s", "ar_s"}: isolated timings of the engine's packed
    shapes (`verify_shapes`) at half-full caches by default."""
    context = context if context is not None else cache_len // 2
    bs = drafter.block_size
    cache = new_cache(target.model, batch, cache_len).with_lengths(jnp.full((batch,), context, jnp.int32))
    tokens = jnp.ones((batch, bs), jnp.int32)
    ctx = new_context_cache(drafter.module, batch, cache_len).with_lengths(
        jnp.full((batch,), context, jnp.int32))
    shapes = verify_shapes(batch, bs, buckets)
    step = functools.partial(_packed_step, target.graphdef, drafter.graphdef, shapes=shapes,
                             attn_impl=attn_impl)
    times = []
    for k, (slots, width) in enumerate(shapes):
        spread = np.diff(np.linspace(0, slots, batch + 1).astype(int))  # the slots, spread evenly
        lengths = jnp.asarray(np.minimum(width, spread), jnp.int32)
        times.append(median_time(step, target.state, drafter.state, cache, ctx, tokens, lengths,
                                 jnp.int32(k), repeats=repeats))
    draft = measure_draft(target, drafter, batch=batch, context=context, cache_len=cache_len,
                          repeats=repeats, attn_impl=attn_impl)
    return {"verify_s": times[1:], "draft_s": draft, "ar_s": times[0]}
