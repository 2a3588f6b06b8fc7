"""DFlash drafters in the published HF layout (z-lab `DFlashDraftModel`).

`config.json` is a Qwen3 config plus `block_size`, `num_target_layers` and
`dflash_config.{target_layer_ids, mask_token_id}`; tensors are named
`layers.{i}.self_attn.q_proj.weight`, ..., `fc.weight`, `hidden_norm.weight`,
`norm.weight` (no `model.` prefix; no embeddings or LM head — those are the
target's). A drafter saved here loads in the reference code and vice versa.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax import atomic_io
from adaflash_jax.checkpoints import hf
from adaflash_jax.errors import InputError
from adaflash_jax.models.config import ModelConfig, from_hf_config
from adaflash_jax.models.draft_vocab import check_d2t
from adaflash_jax.models.drafter import DFlashDrafter, DrafterConfig, default_target_layer_ids

DRAFTER_LAYER_RULES = tuple(
    hf.Rule(r.hf_name.removeprefix("model."), r.path, r.to_model, r.to_hf) for r in hf.LAYER_RULES)
DRAFTER_GLOBAL_RULES = (
    hf.Rule("fc.weight", ("fc",), hf._t, hf._t),
    hf.Rule("hidden_norm.weight", ("hidden_norm",), hf._identity, hf._identity),
    hf.Rule("norm.weight", ("norm",), hf._identity, hf._identity),
)
SAVE_DTYPES = ("float32", "bfloat16")
TARGET_RECORD_KEY = "adaflash_target"  # {"name", "fingerprint"} of the target it was trained for


def config_to_hf(cfg: DrafterConfig, *, dtype: str = "float32") -> dict:
    out = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids),
                          "mask_token_id": cfg.mask_token_id},
    }
    if cfg.draft_vocab_size is not None:
        out["draft_vocab_size"] = cfg.draft_vocab_size  # EAGLE-3's key; tables in the tensors
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
        out["rope_scaling"] = rope
    return out


def config_from_hf(hf_cfg: dict, *, dtype: str = "float32") -> DrafterConfig:
    """Reads a DFlash drafter config (published z-lab / AdaFlash layout)."""
    dflash = hf_cfg.get("dflash_config") or {}
    layer_ids = dflash.get("target_layer_ids", hf_cfg.get("target_layer_ids"))
    mask_id = dflash.get("mask_token_id", hf_cfg.get("mask_token_id"))
    if layer_ids is None and "num_target_layers" in hf_cfg and "num_hidden_layers" in hf_cfg:
        # the published code derives them when the config omits them: the same rule here
        layer_ids = default_target_layer_ids(int(hf_cfg["num_target_layers"]),
                                             int(hf_cfg["num_hidden_layers"]))
    if layer_ids is None or mask_id is None:
        raise InputError("drafter config.json lacks dflash_config.mask_token_id, or both "
                         "dflash_config.target_layer_ids and num_target_layers; "
                         "not a DFlash drafter checkpoint")
    as_target = from_hf_config(hf_cfg)
    num_target_layers = int(hf_cfg.get("num_target_layers", max(layer_ids) + 1))
    return DrafterConfig(
        hidden_size=as_target.hidden_size, intermediate_size=as_target.intermediate_size,
        num_layers=as_target.num_layers, num_heads=as_target.num_heads,
        num_kv_heads=as_target.num_kv_heads, head_dim=as_target.head_dim,
        vocab_size=as_target.vocab_size, target_layer_ids=tuple(int(i) for i in layer_ids),
        num_target_layers=num_target_layers, mask_token_id=int(mask_id),
        block_size=int(dflash.get("block_size", hf_cfg.get("block_size", 16))),
        rms_norm_eps=as_target.rms_norm_eps, rope_theta=as_target.rope_theta,
        rope_scaling=as_target.rope_scaling, attention_bias=as_target.attention_bias,
        max_position_embeddings=as_target.max_position_embeddings, dtype=dtype, param_dtype=dtype,
        draft_vocab_size=_draft_vocab_size(hf_cfg, as_target.vocab_size))


def _draft_vocab_size(hf_cfg: dict, vocab_size: int) -> int | None:
    k = hf_cfg.get("draft_vocab_size")
    return None if k is None or int(k) == vocab_size else int(k)


def _hook_cfg(cfg: DrafterConfig) -> ModelConfig:
    return cfg.layer_config()


def save(cfg: DrafterConfig, params: Mapping, path: str, *, dtype: str = "float32",
         extra_tensors: Mapping[str, np.ndarray] | None = None, extra_config: dict | None = None,
         d2t=None):
    """Writes config.json + model.safetensors; refuses to overwrite a non-drafter dir.
    d2t: the draft vocabulary's target ids (required when cfg.draft_vocab_size is set).

    Both files go to a fresh directory beside `path` that then replaces it, so a crash or a
    concurrent save never leaves a half-written or mixed drafter (see `atomic_io.replace_dir`).
    """
    from safetensors.flax import save_file

    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save dtype must be one of {SAVE_DTYPES}, got {dtype!r}")
    _check_replaceable(path)
    tensors = hf.named_tensors_from_params(params, layer_rules=DRAFTER_LAYER_RULES,
                                           global_rules=DRAFTER_GLOBAL_RULES,
                                           hook_cfg=_hook_cfg(cfg), num_layers=cfg.num_layers)
    tensors.update(extra_tensors or {})
    arrays = {k: jnp.asarray(v, dtype) for k, v in tensors.items()}
    arrays.update(draft_vocab_to_hf(d2t, cfg) if cfg.draft_vocab_size is not None else {})
    config = config_to_hf(cfg, dtype=dtype)
    config.update(extra_config or {})
    staging = atomic_io.staging_dir_beside(path)
    try:
        save_file(arrays, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        atomic_io.replace_dir(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _check_replaceable(path: str) -> None:
    """A save replaces the whole directory: only an empty one or a DFlash drafter may go."""
    if not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise InputError(f"{path} exists and is not a directory")
    existing = os.path.join(path, "config.json")
    if os.path.exists(existing):
        with open(existing) as f:
            if "dflash_config" not in json.load(f):
                raise InputError(f"{path} holds a config.json that is not a DFlash drafter; "
                                 "refusing to overwrite it")
    elif os.listdir(path):
        raise InputError(f"{path} is a non-empty directory without a drafter config.json; "
                         "refusing to replace it")


def load(path: str, *, dtype: str = "float32", extra_prefixes: tuple[str, ...] = ()):
    """Reads a drafter dir -> (DrafterConfig, DFlashDrafter, raw config, extra tensors by prefix)."""
    hf_cfg = hf.read_hf_config(path)
    cfg = config_from_hf(hf_cfg, dtype=dtype)
    tensors = hf.read_safetensors_dir(path)
    hf.check_finite(tensors, f"drafter {path}")
    extras = {k: v for k, v in tensors.items() if k.startswith(extra_prefixes)} if extra_prefixes else {}
    core = {k: v for k, v in tensors.items() if k not in extras and k not in DRAFT_VOCAB_TENSORS}
    params = hf.map_named_tensors(
        core, layer_rules=DRAFTER_LAYER_RULES, global_rules=DRAFTER_GLOBAL_RULES,
        hook_cfg=_hook_cfg(cfg), num_layers=cfg.num_layers,
        expected=hf.expected_shapes(lambda: DFlashDrafter(cfg, rngs=nnx.Rngs(0))))
    module = hf.build_module(lambda: DFlashDrafter(cfg, rngs=nnx.Rngs(0)), params,
                             jnp.dtype(cfg.param_dtype))
    if cfg.draft_vocab_size is not None:
        module.set_draft_vocab(draft_vocab_from_hf(tensors, cfg))
    return cfg, module, hf_cfg, extras


# --- the reduced draft vocabulary (EAGLE-3 layout: d2t offsets, t2d mask) ----------------------

DRAFT_VOCAB_TENSORS = ("d2t", "t2d")


def draft_vocab_to_hf(d2t, cfg: DrafterConfig) -> dict[str, np.ndarray]:
    """EAGLE-3's tables: `d2t` int64 [K] offsets (target id = i + d2t[i]), `t2d` bool [V]."""
    if d2t is None:
        raise ValueError("this drafter has a reduced draft vocabulary: pass its d2t table to save it")
    ids = check_d2t(d2t, cfg.vocab_size)
    if ids.shape[0] != cfg.draft_vocab_size:
        raise ValueError(f"d2t has {ids.shape[0]} ids, draft_vocab_size is {cfg.draft_vocab_size}")
    t2d = np.zeros(cfg.vocab_size, bool)
    t2d[ids] = True
    return {"d2t": ids.astype(np.int64) - np.arange(ids.shape[0]), "t2d": t2d}


def draft_vocab_from_hf(tensors: Mapping[str, np.ndarray], cfg: DrafterConfig) -> np.ndarray:
    """The draft vocabulary's target ids from a checkpoint's d2t offsets, checked against t2d."""
    if "d2t" not in tensors:
        raise ValueError(f"drafter config sets draft_vocab_size={cfg.draft_vocab_size} but the "
                         "checkpoint has no d2t tensor")
    offsets = np.asarray(tensors["d2t"]).astype(np.int64)
    if offsets.shape != (cfg.draft_vocab_size,):
        raise ValueError(f"d2t has shape {offsets.shape}, expected ({cfg.draft_vocab_size},)")
    ids = check_d2t(offsets + np.arange(offsets.shape[0]), cfg.vocab_size)
    if "t2d" in tensors:
        t2d = np.asarray(tensors["t2d"]).astype(bool)
        if t2d.shape != (cfg.vocab_size,) or not np.array_equal(np.flatnonzero(t2d), ids):
            raise ValueError("the checkpoint's t2d mask does not match its d2t table")
    return ids


# --- the AdaFlash adaptive length head (optional, stored beside the drafter) -----------------

LENGTH_HEAD_PREFIX = "thresh_head_two_model."


def length_head_to_hf(head) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, config keys) of a LengthHead in the published AdaFlash layout, ready for
    `save(..., extra_tensors=..., extra_config=...)` (merge the config's dflash_config)."""
    from adaflash_jax.models.length_head import HF_CONFIDENCE_NAME, HF_NAMES

    tensors = {}
    for attr, (name, transpose) in HF_NAMES.items():
        value = np.asarray(getattr(head, attr)[...], np.float32)
        tensors[name] = value.T if transpose else value
    keys = {"use_thresh_head_two_model": True, "thresh_head_bottleneck_dim": head.bottleneck,
            "thresh_head_direct_len": True}
    if head.uses_confidence:  # this framework's extension (see models.length_head)
        tensors[HF_CONFIDENCE_NAME] = np.asarray(head.w_conf[...], np.float32).T
        keys["thresh_head_confidence_width"] = head.confidence_width
    return tensors, keys


def length_head_from_hf(tensors: Mapping[str, np.ndarray], hf_cfg: dict, hidden_size: int, *,
                        dtype: str = "float32"):
    """The LengthHead stored in a drafter checkpoint, or None when it has none."""
    from adaflash_jax.models.length_head import HF_CONFIDENCE_NAME, HF_NAMES, LengthHead

    dflash = hf_cfg.get("dflash_config") or {}
    if not dflash.get("use_thresh_head_two_model"):
        return None
    width = int(dflash.get("thresh_head_confidence_width", 0))
    names = dict(HF_NAMES, **({"w_conf": (HF_CONFIDENCE_NAME, True)} if width else {}))
    missing = [name for name, _ in names.values() if name not in tensors]
    if missing:
        raise ValueError(f"drafter config enables the length head but tensors {missing} are missing")
    bottleneck = int(dflash.get("thresh_head_bottleneck_dim", 256))
    head = LengthHead(hidden_size, bottleneck, rngs=nnx.Rngs(0), param_dtype=jnp.dtype(dtype),
                      confidence_width=width)
    for attr, (name, transpose) in names.items():
        value = np.asarray(tensors[name], np.float32)
        value = value.T if transpose else value
        want = getattr(head, attr)[...].shape
        if value.shape != want:
            raise ValueError(f"length head tensor {name} has shape {value.shape}, expected {want}")
        getattr(head, attr)[...] = jnp.asarray(value, dtype)
    return head
