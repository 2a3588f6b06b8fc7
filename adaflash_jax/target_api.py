"""`Target`: a loaded target LM with its tokenizer, and `load_target`.

A Target keeps the NNX graph definition and (possibly sharded) state apart,
so every jitted function takes the state as an argument instead of closing
over weights as constants.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from adaflash_jax.checkpoints import hf
from adaflash_jax.checkpoints.tokenizer import Tokenizer
from adaflash_jax.errors import InputError
from adaflash_jax.models.config import ModelConfig, from_hf_config
from adaflash_jax.models.decoder_layers import to_layout
from adaflash_jax.models.target import TargetLM
from adaflash_jax.parallel.mesh import host_staging
from adaflash_jax.parallel.rules import batch_sharding, shard_state

# Built-in targets by name, with what a drafter for them needs that the weights do not say:
# the MASK token of the block (SmolLM2: id 16, a reserved special token its text never uses).
# An entry matches by name, or by fingerprint when the same weights are loaded from a path.
BUILTIN_REGISTRY = {"smollm2-135m-instruct": {"mask_token_id": 16, "fingerprint": "sha256:ad3478d89217c692"}}
BUILTIN_TARGETS = tuple(BUILTIN_REGISTRY)
FINGERPRINT_GRID = (64, 32)  # sampled (vocab rows, hidden columns) of the output head


@dataclasses.dataclass
class Target:
    """A target LM ready for scoring and decoding."""

    cfg: ModelConfig
    graphdef: Any
    state: nnx.State
    tokenizer: Tokenizer | None
    name: str = ""
    mesh: Mesh | None = None

    @property
    def model(self) -> TargetLM:
        return nnx.merge(self.graphdef, self.state)

    @property
    def layer_layout(self) -> str:
        """How the decoder layers are held: "per_layer" or "stacked" (`models.decoder_layers`)."""
        return "per_layer" if "items" in self.state["layers"] else "stacked"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.cfg.eos_token_ids)
        if self.tokenizer is not None:
            ids += [i for i in self.tokenizer.eos_token_ids if i not in ids]
        return tuple(ids)

    @property
    def default_mask_token_id(self) -> int:
        """The MASK id a new drafter for this target uses: the registry's for a built-in
        target, else the last vocabulary id."""
        entry = BUILTIN_REGISTRY.get(self.name) or next(
            (e for e in BUILTIN_REGISTRY.values() if e["fingerprint"] == self.fingerprint()), None)
        return int(entry["mask_token_id"]) if entry else self.cfg.vocab_size - 1

    def fingerprint(self) -> str:
        """Identifies the target's output head (embedding or LM head) across load dtypes.

        A fixed strided grid of the [V, D] head is rounded to bfloat16 (what a bf16 load
        stores, so f32 and bf16 loads agree) and hashed with the shape. Every process of a
        multi-process job must call it (the sample is gathered from all shards)."""
        from adaflash_jax.parallel.distributed import to_host

        weight, layout = self.model.head_weight()
        vocab, hidden = (weight.shape if layout == "vd" else weight.shape[::-1])
        rows = np.unique(np.linspace(0, vocab - 1, FINGERPRINT_GRID[0]).round().astype(np.int32))
        cols = np.unique(np.linspace(0, hidden - 1, FINGERPRINT_GRID[1]).round().astype(np.int32))
        if layout == "vd":
            sample = jnp.take(jnp.take(weight, rows, axis=0), cols, axis=1)
        else:
            sample = jnp.take(jnp.take(weight, cols, axis=0), rows, axis=1).T
        sample = np.asarray(to_host(sample.astype(jnp.float32))).astype(jnp.bfloat16)
        digest = hashlib.sha256(f"{vocab}x{hidden}:".encode() + sample.view(np.uint16).tobytes())
        return "sha256:" + digest.hexdigest()[:16]

    def place_batch(self, array: np.ndarray) -> jax.Array:
        """Puts a host batch on device(s), batch-sharded when a mesh is set."""
        if self.mesh is None:
            return jnp.asarray(array)
        return jax.device_put(array, batch_sharding(self.mesh, array.ndim, array.shape[0]))

    def score(self, token_ids) -> np.ndarray:
        """Full causal forward, no cache: int [B, T] -> float32 numpy logits [B, T, V]."""
        ids = np.asarray(token_ids)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"score expects int token ids of shape [batch, time], got {ids.shape}")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        if ids.shape[1] > self.cfg.max_position_embeddings:
            raise ValueError(f"sequence of {ids.shape[1]} tokens is longer than the model's maximum "
                             f"of {self.cfg.max_position_embeddings} positions")
        return np.asarray(_score(self.graphdef, self.state, self.place_batch(ids.astype(np.int32))))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _score(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    return model.logits(model(tokens).hidden)


def target_from_params(cfg: ModelConfig, params, tokenizer: Tokenizer | None = None, *,
                       name: str = "", mesh: Mesh | None = None, layer_layout: str = "stacked") -> Target:
    """Wraps a pure param dict (stacked layers, the loading layout) as a Target whose layers are
    in `layer_layout` (`models.decoder_layers`), sharded over `mesh` if given (built on the host
    first, so no single device ever holds the whole model)."""
    with host_staging(mesh):
        model = hf.build_target(cfg, params)
    return _wrap(model, tokenizer, name, mesh, layer_layout)


def random_target(cfg: ModelConfig, seed: int = 0, tokenizer: Tokenizer | None = None,
                  mesh: Mesh | None = None, layer_layout: str = "stacked") -> Target:
    """A randomly initialised target (tests, benchmarks of shapes without weights)."""
    return _wrap(TargetLM(cfg, rngs=nnx.Rngs(seed)), tokenizer, f"random-{seed}", mesh, layer_layout)


def _wrap(model: TargetLM, tokenizer, name: str, mesh: Mesh | None, layer_layout: str) -> Target:
    """Splits a model, its layers converted to `layer_layout`, into graph + state (placed on
    `mesh` if given) as a Target."""
    with host_staging(mesh):
        to_layout(model, layer_layout)
    graphdef, state = nnx.split(model)
    if mesh is not None:
        state = shard_state(state, mesh)
    return Target(model.cfg, graphdef, state, tokenizer, name=name, mesh=mesh)


def resolve_target_path(name_or_path: str) -> str:
    """Maps a built-in name to its checkpoint file; passes paths through."""
    if name_or_path == "smollm2-135m-instruct":
        from adaflash_jax.checkpoints.gguf import smollm2_gguf_path

        return smollm2_gguf_path()
    if not os.path.exists(name_or_path):
        raise InputError(f"unknown target {name_or_path!r}: not a built-in name "
                         f"({', '.join(BUILTIN_TARGETS)}) and no such file or directory")
    return name_or_path


def load_target(name_or_path: str, *, dtype: str = "float32", param_dtype: str | None = None,
                mesh: Mesh | None = None, layer_layout: str = "stacked") -> Target:
    """Loads a target from a built-in name, an HF checkpoint dir or a `.gguf` file.

    layer_layout: "stacked" (default), one scanned layer body, or "per_layer", the unrolled
    inference layout whose steps run faster on CPU but whose programs compile ~4x slower and
    map ~4x more memory regions (`models.decoder_layers`); same outputs."""
    path = resolve_target_path(name_or_path)
    if os.path.isdir(path):
        hf_config = hf.read_hf_config(path)
        tensors = hf.read_safetensors_dir(path)
        tokenizer = Tokenizer.from_hf_dir(path) if os.path.exists(
            os.path.join(path, "tokenizer.json")) else None
    elif path.endswith(".gguf"):
        from adaflash_jax.checkpoints.gguf import read_gguf

        ckpt = read_gguf(path)
        hf_config, tensors = ckpt.config, ckpt.tensors
        tokenizer = Tokenizer.from_gguf(ckpt)
    else:
        raise InputError(f"{path} is neither an HF checkpoint directory nor a .gguf file")
    hf.check_finite(tensors, f"target {name_or_path}")
    cfg = from_hf_config(hf_config, dtype=dtype, param_dtype=param_dtype)
    params = hf.params_from_hf(cfg, tensors)
    return target_from_params(cfg, params, tokenizer, name=os.path.basename(name_or_path), mesh=mesh,
                              layer_layout=layer_layout)
