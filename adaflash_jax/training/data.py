"""Training data on the host and on the mesh: the configured data set, held-out rows, batches.

`build_data` turns a `DataSpec` (an .npz of arrays, a rollout directory, or the
target's own greedy continuations for tests) into a resumable batch iterator
plus a held-out eval batch; `place_batch` pads a host batch and shards it over
the mesh's batch axes. With several processes each one loads only its
`process_rows` of every batch and the global array is assembled from them.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from adaflash_jax.generation import generate
from adaflash_jax.parallel.rules import batch_sharding
from adaflash_jax.target_api import Target
from adaflash_jax.training.config import TrainConfig
from adaflash_jax.training.state import ArrayBatchIterator
from adaflash_jax.training.step import Batch


def greedy_rollouts(target: Target, num: int, prompt_len: int, seq_len: int, seed: int) -> dict:
    """The target's own greedy continuations of random prompts (offline DFlash data; small
    targets: with several processes each decodes all rows with a full local copy)."""
    if jax.process_count() > 1:  # decode the same rows on every process, with a local copy
        import dataclasses

        from adaflash_jax.parallel.distributed import to_host

        local = jax.local_devices()[0]
        state = jax.tree.map(lambda x: jax.device_put(x, local), to_host(target.state))
        target = dataclasses.replace(target, state=state, mesh=None)
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, target.cfg.vocab_size, (num, prompt_len)).tolist()
    tokens = np.zeros((num, seq_len), np.int32)
    lens = np.zeros((num,), np.int32)
    for lo in range(0, num, 64):
        res = generate(target, prompts[lo:lo + 64], max_new_tokens=seq_len - prompt_len)
        for i, out in enumerate(res.token_ids):
            row = (prompts[lo + i] + list(out))[:seq_len]
            tokens[lo + i, :len(row)], lens[lo + i] = row, len(row)
    keep = lens >= prompt_len + 2
    return {"tokens": tokens[keep], "prompt_lens": np.full((int(keep.sum()),), prompt_len, np.int32),
            "seq_lens": lens[keep]}


def build_data(cfg: TrainConfig, target: Target, feature_layers=None,
               ) -> tuple[ArrayBatchIterator, Batch | None]:
    """The configured data set as a resumable iterator plus the held-out eval batch.

    With `data.cache_features`, the target's features at `feature_layers` are computed
    once for every row (or read back) under <checkpoint.dir>/features and travel in the batches.
    """
    d = cfg.data
    if d.source == "arrays":
        with np.load(d.path) as f:
            arrays = {k: f[k] for k in ("tokens", "prompt_lens", "seq_lens")}
    elif d.source == "rollouts":
        from adaflash_jax.training.rollouts import rollout_arrays

        arrays = rollout_arrays(d.path, d.seq_len)
    else:
        arrays = greedy_rollouts(target, d.num_sequences + d.eval_sequences, d.prompt_len,
                                 d.seq_len, cfg.seed)
    if d.max_rows:
        if d.max_rows > len(arrays["tokens"]):
            raise ValueError(f"data.max_rows={d.max_rows} but {d.path} holds {len(arrays['tokens'])} rows")
        arrays = {k: np.asarray(v)[:d.max_rows] for k, v in arrays.items()}
    n = len(arrays["tokens"])
    if d.eval_sequences >= n:
        raise ValueError(f"data.eval_sequences={d.eval_sequences} leaves no training rows of {n}")
    feats = None
    if d.cache_features and jax.process_count() > 1:
        raise ValueError("data.cache_features=true is single-process only for now; train multi-process "
                         "without it (features are then computed on the fly, sharded)")
    if d.cache_features:
        from adaflash_jax.training.features import cached_features

        tokens = np.asarray(arrays["tokens"], np.int32)
        tokens = np.pad(tokens, ((0, 0), (0, d.seq_len - tokens.shape[1])))
        arrays["tokens"] = tokens
        feats = cached_features(target, tokens, np.asarray(arrays["seq_lens"]), feature_layers,
                                os.path.join(os.path.abspath(cfg.checkpoint.dir), "features"),
                                progress=cfg.progress)
    order = np.random.default_rng([cfg.seed, 1]).permutation(n)
    held, rows = order[:d.eval_sequences], np.sort(order[d.eval_sequences:])
    pick = lambda idx: [np.asarray(arrays[k])[idx] for k in ("tokens", "prompt_lens", "seq_lens")]  # noqa: E731
    eval_batch = None
    if d.eval_sequences:
        eval_feats = None if feats is None else _RowView(feats, held)[np.arange(len(held))]
        eval_batch = Batch(*pick(held), eval_feats)
    if d.eval_path:
        eval_batch = _eval_rollouts(cfg, target, feature_layers)
    train_feats = None if feats is None else _RowView(feats, rows)
    local = process_rows(target.mesh, d.batch_size) if target.mesh is not None else None
    return ArrayBatchIterator(*pick(rows), batch_size=d.batch_size, seed=cfg.seed,
                              features=train_feats, rows=local), eval_batch


def _eval_rollouts(cfg: TrainConfig, target: Target, feature_layers) -> Batch:
    """The held-out batch from `data.eval_path` (rollouts of the fixed evaluation set), with
    cached features under <checkpoint.dir>/features_eval when the run caches features."""
    from adaflash_jax.training.rollouts import rollout_arrays

    d = cfg.data
    arrays = rollout_arrays(d.eval_path, d.seq_len)
    feats = None
    if d.cache_features:
        from adaflash_jax.training.features import cached_features

        feats = np.asarray(cached_features(
            target, arrays["tokens"], np.asarray(arrays["seq_lens"]), feature_layers,
            os.path.join(os.path.abspath(cfg.checkpoint.dir), "features_eval"), progress=cfg.progress))
    return Batch(arrays["tokens"], arrays["prompt_lens"], arrays["seq_lens"], feats)


class _RowView:
    """Rows `rows` of a (memory-mapped) array, indexable like the array itself."""

    def __init__(self, array, rows):
        self.array, self.rows = array, np.asarray(rows)
        self.shape = (len(self.rows),) + tuple(array.shape[1:])

    def __getitem__(self, idx):
        src = self.rows[idx]
        order = np.argsort(src)  # memory maps read fastest in ascending row order
        out = np.empty((len(src),) + self.shape[1:], np.float32)
        out[order] = self.array[src[order]]
        return out


def process_rows(mesh, batch: int) -> slice:
    """The rows of a global batch of `batch` rows that live on this process's devices.

    A process loads only these (multi-host input); when its shards are not one
    contiguous range (unusual device orders), it loads the whole batch instead.
    """
    if jax.process_count() == 1:
        return slice(0, batch)
    index = batch_sharding(mesh, 1, batch).addressable_devices_indices_map((batch,))
    spans = sorted({(s[0].start or 0, batch if s[0].stop is None else s[0].stop) for s in index.values()})
    lo, hi = spans[0][0], max(h for _, h in spans)
    return slice(lo, hi) if sum(h - l for l, h in spans) == hi - lo else slice(0, batch)


def place_batch(batch: Batch, mesh, seq_len: int, vocab: int, global_rows: int | None = None) -> Batch:
    """Host batch -> device batch sharded over (data, fsdp), padded to `seq_len`.

    `batch` holds either the whole global batch or (multi-host) this process's
    `process_rows` of it; `global_rows` is the global batch size (default: len(batch)).
    """
    tokens = np.asarray(batch.tokens, np.int32)
    if tokens.ndim != 2 or tokens.shape[1] > seq_len:
        raise ValueError(f"batch tokens must be [batch, <= data.seq_len={seq_len}], got {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(f"batch token ids must lie in [0, {vocab})")
    tokens = np.pad(tokens, ((0, 0), (0, seq_len - tokens.shape[1])))
    arrays = [tokens, np.asarray(batch.prompt_lens, np.int32), np.asarray(batch.seq_lens, np.int32)]
    if batch.features is not None:
        feats = np.asarray(batch.features, np.float32)
        if feats.shape[:2] != (tokens.shape[0], seq_len):
            raise ValueError(f"batch features must be [batch, data.seq_len={seq_len}, k*D], "
                             f"got {feats.shape}")
        arrays.append(feats)
    return Batch(*place_rows(arrays, mesh, global_rows))


def place_rows(arrays, mesh, global_rows: int | None = None) -> list[jax.Array]:
    """Host arrays with a leading batch axis -> device arrays sharded over (data, fsdp).

    Each array holds the global batch (`global_rows` rows; default: its own length) or,
    with several processes, this process's `process_rows` of it; the global array is
    assembled from every process's rows without any process holding all of them.
    """
    out = []
    for a in arrays:
        a = np.asarray(a)
        n = a.shape[0] if global_rows is None else int(global_rows)
        sharding = batch_sharding(mesh, a.ndim, n)
        if jax.process_count() == 1:
            if a.shape[0] != n:
                raise ValueError(f"batch has {a.shape[0]} rows, expected the global batch of {n}")
            out.append(jax.device_put(a, sharding))
            continue
        rows = process_rows(mesh, n)
        if a.shape[0] == n:
            local = a[rows]
        elif a.shape[0] == rows.stop - rows.start:
            local = a
        else:
            raise ValueError(f"process {jax.process_index()} got {a.shape[0]} rows; expected the global "
                             f"batch ({n}) or its own rows {rows.start}:{rows.stop}")
        out.append(jax.make_array_from_process_local_data(sharding, local, (n,) + a.shape[1:]))
    return out
