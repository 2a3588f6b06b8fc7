"""`Drafter`: a DFlash drafter bound to a target, and its public functions.

`init_drafter` (random init, for training), `save_drafter` / `load_drafter`
(HF layout of the published checkpoints, or a built-in name), and
`draft_logits` (the drafter's proposal for one block, for tests and tools).
An AdaFlash drafter also carries its adaptive length head (`length_head`),
saved and loaded with it in the published layout.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.checkpoints import drafter_hf
from adaflash_jax.errors import InputError, as_input_error
from adaflash_jax.models.length_head import LengthHead
from adaflash_jax.models import draft_vocab
from adaflash_jax.models.drafter import (DFlashDrafter, DrafterConfig, append_context, draft_block,
                                         drafter_config_for, new_context_cache)
from adaflash_jax.parallel.rules import shard_state
from adaflash_jax.target_api import Target

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "drafters")


@dataclasses.dataclass
class Drafter:
    cfg: DrafterConfig
    graphdef: Any
    state: nnx.State
    name: str = ""
    head_graphdef: Any = None  # the AdaFlash length head (None: a plain DFlash drafter)
    head_state: nnx.State | None = None
    # {"name", "fingerprint"} of the target it was trained for (saved with it; None: unknown)
    target_record: dict | None = None

    def for_target(self, target: Target) -> "Drafter":
        """The same drafter recording `target` as the one it was trained for (every process
        of a multi-process job must call it: the fingerprint gathers from all shards)."""
        return dataclasses.replace(self, target_record=target_record(target))

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def module(self) -> DFlashDrafter:
        return nnx.merge(self.graphdef, self.state)

    @property
    def has_length_head(self) -> bool:
        return self.head_state is not None

    @property
    def length_head(self) -> LengthHead | None:
        return nnx.merge(self.head_graphdef, self.head_state) if self.has_length_head else None

    def with_length_head(self, head: LengthHead | None) -> "Drafter":
        """The same drafter carrying `head` (None removes it)."""
        if head is None:
            return dataclasses.replace(self, head_graphdef=None, head_state=None)
        if head.hidden_size != self.cfg.hidden_size:
            raise ValueError(f"length head hidden size {head.hidden_size} != drafter hidden size "
                             f"{self.cfg.hidden_size}")
        return dataclasses.replace(self, head_graphdef=nnx.graphdef(head), head_state=nnx.state(head))

    def with_block_size(self, block_size: int) -> "Drafter":
        """The same weights drafting shorter blocks (block_size <= the trained one)."""
        if block_size == self.cfg.block_size:
            return self
        module = self.module
        module.cfg = self.cfg.replace(block_size=block_size)
        graphdef, state = nnx.split(module)
        return dataclasses.replace(self, cfg=module.cfg, graphdef=graphdef, state=state)

    def with_draft_vocab(self, d2t) -> "Drafter":
        """The same weights predicting over the target ids `d2t` only (a reduced draft
        vocabulary, `models/draft_vocab.py`); drafting and verification stay lossless."""
        d2t = np.asarray(d2t)
        module = self.module
        module.cfg = self.cfg.replace(draft_vocab_size=int(d2t.shape[0]))
        module.d2t = nnx.data(draft_vocab.DraftVocab(jnp.zeros(d2t.shape, jnp.int32)))
        module.set_draft_vocab(d2t)
        graphdef, state = nnx.split(module)
        return dataclasses.replace(self, cfg=module.cfg, graphdef=graphdef, state=state)

    def params(self) -> dict:
        return nnx.to_pure_dict(nnx.state(self.module, nnx.Param))


def target_record(target: Target) -> dict:
    """What a saved drafter records about its target (`drafter_hf.TARGET_RECORD_KEY`)."""
    return {"name": target.name, "fingerprint": target.fingerprint()}


def _bind(module: DFlashDrafter, target: Target, name: str) -> Drafter:
    with as_input_error():  # a drafter/target shape mismatch is a wrong pairing, not a bug
        module.cfg.check_target(target.cfg)
    graphdef, state = nnx.split(module)
    if target.mesh is not None:
        state = shard_state(state, target.mesh)
    return Drafter(module.cfg, graphdef, state, name)


def init_drafter(target: Target, num_layers: int = 2, block_size: int = 16, seed: int = 0,
                 **config_overrides) -> Drafter:
    """A randomly initialised drafter shaped for `target` (DFlash layer-selection rule)."""
    if config_overrides.get("mask_token_id") is None:
        config_overrides["mask_token_id"] = target.default_mask_token_id
    cfg = drafter_config_for(target.cfg, num_layers=num_layers, block_size=block_size,
                             **config_overrides)
    return _bind(DFlashDrafter(cfg, rngs=nnx.Rngs(seed)), target, f"random-{seed}")


def save_drafter(drafter: Drafter, path: str, *, target: Target | None = None,
                 dtype: str = "float32") -> None:
    """Writes the drafter in the z-lab HF layout (config.json + model.safetensors), with its
    length head (if any) in the published AdaFlash layout, and the target it was trained for
    (`target`, else the one the drafter already records) so loads can refuse another target."""
    tensors, extra_config = {}, {}
    record = target_record(target) if target is not None else drafter.target_record
    if record is not None:
        extra_config[drafter_hf.TARGET_RECORD_KEY] = dict(record)
    if drafter.has_length_head:
        tensors, keys = drafter_hf.length_head_to_hf(drafter.length_head)
        dflash = drafter_hf.config_to_hf(drafter.cfg, dtype=dtype)["dflash_config"]
        extra_config["dflash_config"] = {**dflash, **keys}
    d2t = drafter.module.d2t
    drafter_hf.save(drafter.cfg, drafter.params(), path, dtype=dtype, extra_tensors=tensors,
                    extra_config=extra_config, d2t=None if d2t is None else np.asarray(d2t[...]))


def resolve_drafter_path(name_or_path: str) -> str:
    builtin = os.path.join(ASSETS, name_or_path)
    if os.path.isdir(builtin):
        return builtin
    if os.path.isdir(name_or_path):
        return name_or_path
    known = sorted(os.listdir(ASSETS)) if os.path.isdir(ASSETS) else []
    raise InputError(f"unknown drafter {name_or_path!r}: not a directory and not a built-in drafter "
                     f"(built-in: {', '.join(known) or 'none installed'})")


def load_drafter(name_or_path: str, *, target: Target, dtype: str | None = None,
                 allow_target_mismatch: bool = False) -> Drafter:
    """Loads a drafter dir (or built-in name) and checks it fits `target`: shapes always, and,
    when the checkpoint records its training target, that target's fingerprint (a drafter
    trained for other weights of the same shape drafts garbage). allow_target_mismatch skips
    the fingerprint check."""
    path = resolve_drafter_path(name_or_path)
    dtype = dtype or target.cfg.dtype
    cfg, module, raw_cfg, extras = drafter_hf.load(path, dtype=dtype,
                                                   extra_prefixes=(drafter_hf.LENGTH_HEAD_PREFIX,))
    drafter = _bind(module, target, os.path.basename(os.path.normpath(name_or_path)))
    record = raw_cfg.get(drafter_hf.TARGET_RECORD_KEY)
    if record and not allow_target_mismatch:
        _check_target_record(drafter.name, record, target)
    drafter = dataclasses.replace(drafter, target_record=record or None)
    return drafter.with_length_head(drafter_hf.length_head_from_hf(extras, raw_cfg, cfg.hidden_size))


def _check_target_record(drafter_name: str, record: dict, target: Target) -> None:
    fingerprint = target.fingerprint()
    if record.get("fingerprint") != fingerprint:
        raise InputError(
            f"drafter {drafter_name} was trained for target {record.get('name')!r} (fingerprint "
            f"{record.get('fingerprint')}), but the target given is {target.name!r} (fingerprint "
            f"{fingerprint}); load it anyway with allow_target_mismatch=True "
            "(CLI: --allow-target-mismatch)")


def draft_logits(target: Target, drafter: Drafter, token_ids) -> np.ndarray:
    """int [B, T] -> float32 [B, block_size - 1, V]: the block anchored at token_ids[:, -1],
    with context features of token_ids[:, :-1]; row k is for the token at offset k + 1."""
    ids = np.asarray(token_ids, np.int32)
    if ids.ndim != 2 or ids.shape[1] < 2:
        raise ValueError(f"draft_logits needs token ids [batch, time] with time >= 2, got {ids.shape}")
    if ids.min() < 0 or ids.max() >= target.cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {target.cfg.vocab_size})")
    return np.asarray(_draft_logits(target.graphdef, drafter.graphdef, target.state, drafter.state,
                                    jnp.asarray(ids)))


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def"))
def _draft_logits(target_def, drafter_def, tstate, dstate, ids):
    target = nnx.merge(target_def, tstate)
    drafter = nnx.merge(drafter_def, dstate)
    b, t = ids.shape
    ctx_ids = ids[:, :-1]
    feats = target(ctx_ids, feature_layers=drafter.cfg.target_layer_ids).features
    positions = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32)[None], (b, t - 1))
    cache = new_context_cache(drafter, b, t - 1)
    cache = append_context(drafter, cache, feats, positions).with_lengths(jnp.full((b,), t - 1))
    hidden = draft_block(drafter, target.embed_tokens, ids[:, -1], cache)[:, 1:]
    return draft_vocab.full_logits(target, drafter, hidden)
