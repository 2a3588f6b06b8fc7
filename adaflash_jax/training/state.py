"""What a training run must persist to resume exactly, and the resumable data protocol.

A resumed run must continue the loss curve of an uninterrupted one, so the
state is everything that influences future steps: the step count, drafter
parameters, optimizer moments, the base RNG key (step keys are
`fold_in(key, step)`), and the data position. Data sources are iterables of
`Batch` with `get_state()` / `set_state()`; the state is a JSON-able value
or bytes (grain iterators return either), stored next to the arrays.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any, Iterator, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.training.step import Batch


@dataclasses.dataclass
class TrainState:
    step: int  # optimizer updates done; the next update uses fold_in(rng_key, step)
    params: nnx.State
    opt_state: Any
    rng_key: jax.Array  # typed base key
    data_state: Any = None  # from the data source's get_state()


# --- data sources -------------------------------------------------------------------------------

@runtime_checkable
class BatchSource(Protocol):
    """An endless iterator of host `Batch`es whose position can be saved and restored."""

    def __iter__(self) -> Iterator[Batch]: ...

    def __next__(self) -> Batch: ...

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


class ArrayBatchIterator:
    """Resumable batches over in-memory arrays: a fresh permutation per epoch from the seed.

    tokens int [N, T] (right-padded), prompt_lens / seq_lens int [N]. The order
    of epoch e depends only on (seed, e), so the state is just (epoch,
    position); incomplete final batches are dropped to keep shapes static. With
    `features` (cached target features per row) each batch carries its rows' features.
    `rows` (a slice of each batch) makes a process of a multi-process job load only
    its own part of every global batch; the state is the same on every process.
    """

    def __init__(self, tokens, prompt_lens, seq_lens, batch_size: int, seed: int = 0, features=None,
                 rows: slice | None = None):
        self.tokens = np.asarray(tokens, np.int32)
        self.features = features  # optional [N, T, k*D] (a memory map is fine: rows are gathered)
        self.prompt_lens = np.asarray(prompt_lens, np.int32)
        self.seq_lens = np.asarray(seq_lens, np.int32)
        n = self.tokens.shape[0]
        if self.tokens.ndim != 2 or self.prompt_lens.shape != (n,) or self.seq_lens.shape != (n,):
            raise ValueError(f"expected tokens [N, T] and lengths [N]; got {self.tokens.shape}, "
                             f"{self.prompt_lens.shape}, {self.seq_lens.shape}")
        if features is not None and tuple(features.shape[:2]) != self.tokens.shape:
            raise ValueError(f"features {features.shape} do not match tokens {self.tokens.shape}")
        if batch_size < 1 or batch_size > n:
            raise ValueError(f"batch_size {batch_size} must lie in [1, {n}] (the number of sequences)")
        if np.any(self.seq_lens > self.tokens.shape[1]) or np.any(self.prompt_lens < 1) or np.any(
                self.prompt_lens + 2 > self.seq_lens):
            raise ValueError("every sequence needs 1 <= prompt_len and prompt_len + 2 <= seq_len <= T "
                             "(at least one anchor with one label)")
        self.batch_size, self.seed = int(batch_size), int(seed)
        self.rows = rows if rows is not None else slice(0, self.batch_size)
        self.epoch, self.position = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.tokens.shape[0] // self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.tokens.shape[0])

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        rows = self._order(self.epoch)[self.position * self.batch_size:(self.position + 1) * self.batch_size]
        rows = rows[self.rows]
        self.position += 1
        feats = None if self.features is None else np.asarray(self.features[rows], np.float32)
        return Batch(self.tokens[rows], self.prompt_lens[rows], self.seq_lens[rows], feats)

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_sequences": int(self.tokens.shape[0]), "batch_size": self.batch_size}

    def set_state(self, state: dict) -> None:
        mine = self.get_state()
        for key in ("seed", "num_sequences", "batch_size"):
            if state.get(key) != mine[key]:
                raise ValueError(f"data iterator state is for {key}={state.get(key)}, this iterator "
                                 f"has {key}={mine[key]}; the data changed since the checkpoint")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def encode_data_state(state: Any) -> dict:
    """A JSON-able record of a data-source state (bytes are base64-encoded)."""
    if isinstance(state, (bytes, bytearray)):
        return {"kind": "bytes", "value": base64.b64encode(bytes(state)).decode("ascii")}
    try:
        json.dumps(state)
    except TypeError as e:
        raise TypeError(f"data source get_state() must return bytes or a JSON-able value: {e}") from None
    return {"kind": "none" if state is None else "json", "value": state}


def decode_data_state(record: dict) -> Any:
    if record["kind"] == "bytes":
        return base64.b64decode(record["value"])
    return record["value"]


# --- checkpoint metadata: what must match to resume -------------------------------------------

def leaf_paths(tree) -> dict[str, jax.Array]:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@jax.jit
def _fingerprint(leaves):
    return [jnp.stack([jnp.sum(x.astype(jnp.float32)), jnp.sum(jnp.abs(x.astype(jnp.float32)))])
            for x in leaves]


def fingerprint(tree) -> dict[str, list[float]]:
    """Per-leaf [sum, sum |x|]: catches restored bytes that decode but are not what was saved."""
    named = leaf_paths(tree)
    sums = jax.device_get(_fingerprint(list(named.values())))
    return {k: [float(a), float(b)] for k, (a, b) in zip(named, sums)}


def fingerprint_mismatches(saved: dict, restored: dict, rtol: float = 1e-5) -> list[str]:
    """Leaves whose fingerprints differ beyond f32 summation-order noise (mesh changes)."""
    bad = []
    for key, (s, a) in saved.items():
        r = restored.get(key)
        if r is None or abs(r[0] - s) > rtol * a + 1e-30 or abs(r[1] - a) > rtol * a + 1e-30:
            bad.append(key)
    return bad + [k for k in restored if k not in saved]


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# Settings that may change across a restart without affecting the model or the data order.
_HARMLESS = ("checkpoint.", "eval_every", "log_every", "progress", "tensorboard_dir")


def compare_meta(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(blocking, informational) differences between a checkpoint's metadata and this run's.

    Blocking: drafter architecture, target architecture, parameter shapes. The
    rest of the training config only changes how training continues.
    """
    blocking = []
    for section in ("drafter_config", "target_config", "param_shapes"):
        a, b = _flatten(saved.get(section, {})), _flatten(current[section])
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                blocking.append(f"{section}.{key}: checkpoint {a.get(key, '<absent>')}, "
                                f"this run {b.get(key, '<absent>')}")
    a, b = _flatten(saved.get("train_config", {})), _flatten(current["train_config"])
    info = [f"{k}: checkpoint {a.get(k, '<absent>')}, this run {b.get(k, '<absent>')}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not k.startswith(_HARMLESS)]
    return blocking, info
