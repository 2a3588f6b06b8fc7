"""Cached target features: run the frozen target over the training set once.

Offline DFlash training needs, for every step, the target's hidden states at the
drafter's fused layers. Computing them on the fly costs a full target forward
per step (on a 2-core CPU, about 40% of a SmolLM2 step); over several epochs the
same sequences are re-encoded again and again. `cached_features` computes them
once, in chunks with a progress bar, into a float32 `.npy` under the run
directory, and memory-maps it afterwards, so a resumed run never recomputes.

The file is built as `features.partial.npy`, whose sidecar records how many rows
(in the length-sorted order) are complete, flushed about once a minute, so a build
that is stopped or killed resumes where it was (about 2 h for 3M tokens on a 2-core
CPU: longer than one sitting). It is renamed when complete; its `.json` sidecar
records what it was computed from (target, layers, a digest of the token arrays),
and a cache, finished or partial, that does not match is an error, never silently
reused or overwritten. One build per directory: the run directory's lock
(`run_lock`) keeps a second trainer out.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from adaflash_jax.atomic_io import atomic_write_json


def arrays_digest(tokens: np.ndarray, seq_lens: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in (np.ascontiguousarray(tokens, np.int32), np.ascontiguousarray(seq_lens, np.int32)):
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


@functools.partial(jax.jit, static_argnames=("graphdef", "layer_ids"))
def _features(graphdef, state, tokens, *, layer_ids):
    out = nnx.merge(graphdef, state)(tokens, feature_layers=layer_ids)
    return out.features, out.hidden


WIDTH_BUCKET = 64  # with seq_lens, chunks run at their longest row rounded up to this


def compute_features(target, tokens: np.ndarray, layer_ids, out: np.ndarray, *, chunk: int = 8,
                     progress: bool = True, hidden_out: np.ndarray | None = None,
                     seq_lens: np.ndarray | None = None, start: int = 0,
                     on_rows_done: Callable[[int], None] | None = None) -> None:
    """Fills out [N, T, k*D] with the target's features of `tokens` [N, T], `chunk` rows a call,
    and `hidden_out` [N, T, D] (when given) with its final-norm hidden states (the OPD teacher).

    With `seq_lens`, rows go longest first and each chunk runs only as wide as its longest
    row (rounded up to WIDTH_BUCKET: a few compiled widths), so padding costs little; features
    past a row's length are zero (the target is causal: those before it are unchanged).
    `start` skips the first rows of that order (already computed: a resumed build), and
    `on_rows_done(k)` hears after each chunk that the first k rows of the order are written.
    """
    n, t = tokens.shape
    layer_ids = tuple(int(i) for i in layer_ids)
    order = np.arange(n) if seq_lens is None else np.argsort(-np.asarray(seq_lens), kind="stable")
    bar = tqdm(total=n, initial=start, desc="target features", unit="seq", disable=not progress)
    for lo in range(start, n, chunk):
        idx = np.sort(order[lo:lo + chunk])
        width = t if seq_lens is None else min(t, -(-int(np.max(seq_lens[idx])) // WIDTH_BUCKET) * WIDTH_BUCKET)
        rows = np.asarray(tokens[idx, :width], np.int32)
        pad = chunk - rows.shape[0]  # keep one compiled shape for the last, short chunk
        if pad:
            rows = np.pad(rows, ((0, pad), (0, 0)))
        feats, hidden = _features(target.graphdef, target.state, jnp.asarray(rows), layer_ids=layer_ids)
        _put(out, idx, np.asarray(feats, np.float32)[:chunk - pad], t)
        if hidden_out is not None:
            _put(hidden_out, idx, np.asarray(hidden, np.float32)[:chunk - pad], t)
        bar.update(chunk - pad)
        if on_rows_done is not None:
            on_rows_done(min(lo + chunk, n))
    bar.close()


def _put(out: np.ndarray, idx: np.ndarray, values: np.ndarray, t: int) -> None:
    """out[idx] = values, zero-padded from values' width to t."""
    width = values.shape[1]
    if width < t:
        values = np.concatenate([values, np.zeros((len(idx), t - width) + values.shape[2:], values.dtype)], 1)
    if np.all(np.diff(idx) == 1):
        out[idx[0]:idx[-1] + 1] = values  # contiguous: one slice write into the memory map
    else:
        out[idx] = values


PROGRESS_EVERY_S = 60.0  # how often a build flushes its rows and records how far it got


def _read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def cached_features(target, tokens: np.ndarray, seq_lens: np.ndarray, layer_ids, cache_dir: str,
                    *, chunk: int = 8, progress: bool = True) -> np.ndarray:
    """float32 [N, T, k*D] features of `tokens`, read from `cache_dir`, or computed and saved
    there (resuming a build that was stopped)."""
    layer_ids = [int(i) for i in layer_ids]
    meta = {"target": target.name, "layer_ids": layer_ids, "shape": [int(s) for s in tokens.shape],
            "hidden_size": target.cfg.hidden_size, "digest": arrays_digest(tokens, seq_lens)}
    shape = (*tokens.shape, len(layer_ids) * target.cfg.hidden_size)
    path = os.path.join(cache_dir, "features.npy")
    meta_path = os.path.join(cache_dir, "features.json")
    if os.path.exists(path):
        saved = _read_json(meta_path)
        if saved != meta:
            raise ValueError(f"feature cache {path} was computed from other data or another target "
                             f"(cached: {saved}, needed: {meta}); remove it or point the run elsewhere")
        feats = np.load(path, mmap_mode="r")
        if feats.shape != shape:
            raise ValueError(f"feature cache {path} has shape {feats.shape}, expected {shape} (corrupt?)")
        return feats
    partial = os.path.join(cache_dir, "features.partial.npy")
    partial_meta = os.path.join(cache_dir, "features.partial.json")
    os.makedirs(cache_dir, exist_ok=True)
    done = 0
    if os.path.exists(partial):
        saved = _read_json(partial_meta) or {}
        done = int(saved.pop("rows_done", 0))
        if saved != meta:
            raise ValueError(f"partial feature cache {partial} was started from other data or another "
                             f"target (started: {saved or None}, needed: {meta}); remove it or point the run "
                             f"elsewhere")
        out = np.load(partial, mmap_mode="r+")
        if out.shape != shape:
            raise ValueError(f"partial feature cache {partial} has shape {out.shape}, expected {shape} (corrupt?)")
    else:
        atomic_write_json(partial_meta, {**meta, "rows_done": 0})  # first: a partial never lacks it
        out = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=shape)
    last = [time.monotonic()]

    def record(rows_done: int) -> None:
        """Flushes the rows, then records them: a kill between the two loses only the record."""
        if rows_done < len(tokens) and time.monotonic() - last[0] < PROGRESS_EVERY_S:
            return
        out.flush()
        atomic_write_json(partial_meta, {**meta, "rows_done": rows_done})
        last[0] = time.monotonic()

    compute_features(target, tokens, layer_ids, out, chunk=chunk, progress=progress,
                     seq_lens=np.asarray(seq_lens), start=done, on_rows_done=record)
    out.flush()
    out = None  # the memory map closes before the file is renamed
    atomic_write_json(meta_path, meta)
    os.replace(partial, path)
    os.remove(partial_meta)
    return np.load(path, mmap_mode="r")
