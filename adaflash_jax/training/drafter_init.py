"""How a new drafter starts: its draft vocabulary and (optionally) the target's own last layers,
or a saved drafter's weights and vocabulary (`drafter.init_from`).

Both are cheap levers for a CPU budget. A reduced draft vocabulary (`models/draft_vocab.py`)
cuts the LM head, the dominant cost of a small drafter, to the K most frequent response
tokens of the training data. Starting the drafter's layers from the target's last n
layers (same shapes: the drafter is shaped like the target's layers) gives it attention
and MLP weights that already read the target's hidden states: with `fc` selecting the
features of target layer L-n-1 and `hidden_norm` set to layer L-n's input norm, the
first drafter layer's context values are exactly the target layer L-n's, and its keys
are too up to the per-head RMS normalisation (q/k-norm) the drafter adds.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.atomic_io import temp_path_beside
from adaflash_jax.models.draft_vocab import check_d2t, coverage, frequent_tokens
from adaflash_jax.parallel.rules import shard_state


def response_tokens(tokens: np.ndarray, prompt_lens: np.ndarray, seq_lens: np.ndarray):
    """Each row's response ids (the tokens a drafter is asked to propose)."""
    for row, p, n in zip(tokens, prompt_lens, seq_lens):
        yield row[int(p):int(n)]


def draft_vocab_table(k: int, target, arrays, run_dir: str, heldout=None) -> tuple[np.ndarray, dict]:
    """d2t for a new run from the training responses' token counts (end-of-sequence ids always
    included; with fewer distinct tokens than K, the rest are the lowest unseen ids, which in
    a BPE vocabulary are its earliest, most frequent merges), saved as <run_dir>/d2t.npy so a
    resumed run keeps the table its weights were trained with even if the data grew.
    Returns (d2t, {K, coverage of the training responses, and of `heldout`'s if given})."""
    path = os.path.join(run_dir, "d2t.npy")
    responses = list(response_tokens(arrays.tokens, arrays.prompt_lens, arrays.seq_lens))
    if os.path.exists(path):
        d2t = check_d2t(np.load(path), target.cfg.vocab_size)
        if d2t.shape[0] != k:
            raise ValueError(f"{path} holds a draft vocabulary of {d2t.shape[0]} ids but the config asks "
                             f"for drafter.draft_vocab_size={k}; use a new run directory")
    else:
        d2t = frequent_tokens(responses, target.cfg.vocab_size, k, always=target.eos_token_ids)
        _save_d2t(path, d2t)
    info = {"draft_vocab_size": k, "draft_vocab_coverage": coverage(d2t, responses)}
    if heldout is not None:
        info["draft_vocab_heldout_coverage"] = coverage(
            d2t, response_tokens(heldout.tokens, heldout.prompt_lens, heldout.seq_lens))
    return d2t, info


def _save_d2t(path: str, d2t: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = temp_path_beside(path)
    with open(tmp, "wb") as f:
        np.save(f, d2t)
    os.replace(tmp, path)


# Fields a saved drafter must share with the configured one to start a run from its weights.
_SAME_SHAPE_FIELDS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                      "head_dim", "block_size", "mask_token_id", "target_layer_ids", "draft_vocab_size")


def init_from_saved_drafter(drafter_module, target, name_or_path: str, run_dir: str) -> dict:
    """Copies a saved drafter's weights and draft vocabulary into the new training drafter (in
    place): continuing on a grown data store, or fine-tuning on rollouts after pre-training on
    natural text. Its d2t is kept as <run_dir>/d2t.npy so a resumed run keeps it; a length head
    it carries is not trained offline and is dropped."""
    from adaflash_jax.drafter_api import load_drafter  # the public API imports training modules

    saved = load_drafter(name_or_path, target=target, dtype="float32").module
    cfg, scfg = drafter_module.cfg, saved.cfg
    diff = [f"{f}: config {getattr(cfg, f)!r}, saved {getattr(scfg, f)!r}" for f in _SAME_SHAPE_FIELDS
            if getattr(cfg, f) != getattr(scfg, f)]
    if diff:
        raise ValueError(f"drafter.init_from={name_or_path!r} is not shaped like the configured drafter ("
                         + "; ".join(diff) + "); set the drafter.* fields to match it")
    params = nnx.state(drafter_module, nnx.Param)
    nnx.update(drafter_module, jax.tree.map(lambda new, old: new.astype(old.dtype),
                                            nnx.state(saved, nnx.Param), params))
    if scfg.draft_vocab_size is None:
        return {"init_from": name_or_path}
    d2t = np.asarray(saved.d2t[...])
    path = os.path.join(run_dir, "d2t.npy")
    if os.path.exists(path) and not np.array_equal(np.load(path), d2t):
        raise ValueError(f"{path} holds another draft vocabulary than drafter.init_from={name_or_path!r}; "
                         "use a new run directory")
    _save_d2t(path, d2t)
    drafter_module.set_draft_vocab(d2t)
    return {"init_from": name_or_path}


def init_from_target_layers(drafter, target_module) -> None:
    """Copies the target's last `num_layers` decoder layers into the drafter (in place) and
    points the feature fusion at the input of the first copied layer (module docstring)."""
    cfg, tcfg = drafter.cfg, target_module.cfg
    n, L = cfg.num_layers, tcfg.num_layers
    if n > L:
        raise ValueError(f"cannot copy {n} layers from a {L}-layer target")
    shapes = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    tshapes = (tcfg.hidden_size, tcfg.intermediate_size, tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim)
    if shapes != tshapes:
        raise ValueError(f"drafter layers (hidden, ffn, heads, kv heads, head dim) {shapes} are not "
                         f"shaped like the target's {tshapes}; cannot start from the target's layers")
    src, dst = target_module.layers, drafter.layers
    for name, var in vars(dst).items():
        if isinstance(var, nnx.Param) and hasattr(src, name):  # q_norm / k_norm stay at ones
            var[...] = getattr(src, name)[...][L - n:].astype(var[...].dtype)
    feature = L - n - 1  # the output of this layer is the first copied layer's input
    ids = list(cfg.target_layer_ids)
    slot = ids.index(feature) if feature in ids else int(np.argmax(ids))
    d = cfg.hidden_size
    fc = np.zeros(drafter.fc[...].shape, np.float32)
    fc[slot * d:(slot + 1) * d] = np.eye(d, dtype=np.float32)
    drafter.fc[...] = jnp.asarray(fc, drafter.fc[...].dtype)
    drafter.hidden_norm[...] = src.attn_norm[...][L - n].astype(drafter.hidden_norm[...].dtype)
    drafter.norm[...] = target_module.final_norm[...].astype(drafter.norm[...].dtype)


def prepare_drafter(cfg, target, drafter, source, run_dir: str, heldout=None) -> tuple:
    """(drafter, info): a fresh training drafter with its draft vocabulary counted on the
    training responses and, with drafter.init_from_target, the target's last layers."""
    d, info = cfg.drafter, {}
    if d.draft_vocab_size is None and not d.init_from_target and not d.init_from:
        return drafter, info
    module = drafter.module
    if d.init_from:
        info = init_from_saved_drafter(module, target, d.init_from, run_dir)
    elif d.draft_vocab_size is not None:
        if not all(hasattr(source, a) for a in ("tokens", "prompt_lens", "seq_lens")):
            raise ValueError("drafter.draft_vocab_size counts tokens of the training arrays; this data "
                             "source does not expose tokens / prompt_lens / seq_lens")
        d2t, info = draft_vocab_table(d.draft_vocab_size, target, source, run_dir, heldout)
        module.set_draft_vocab(d2t)
    if d.init_from_target:
        init_from_target_layers(module, nnx.merge(target.graphdef, target.state))
    graphdef, state = nnx.split(module)
    return dataclasses.replace(drafter, graphdef=graphdef, state=shard_state(state, target.mesh)), info
