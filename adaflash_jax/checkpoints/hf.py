"""HF-format target checkpoints: `config.json` + one or many `*.safetensors`.

Conversion is a name table plus small hook functions (transpose / reshape),
used in both directions. Loading fails loudly: every unmapped tensor, every
missing parameter and every shape mismatch is named in one error.
GGUF files are first turned into HF names (`checkpoints/gguf.py`) and then go
through the same table, so there is one mapping to maintain.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.errors import InputError
from adaflash_jax.models.config import ModelConfig
from adaflash_jax.models.target import TargetLM

Hook = Callable[[np.ndarray, ModelConfig], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Rule:
    """HF tensor name (with `{i}` for the layer) <-> path in the model's state."""

    hf_name: str
    path: tuple[str, ...]
    to_model: Hook
    to_hf: Hook


def _identity(x, cfg):
    return x


def _t(x, cfg):
    return x.T


def _heads_in(n_heads: Callable[[ModelConfig], int]) -> tuple[Hook, Hook]:
    """[heads*Dh, D] (HF q/k/v_proj) <-> [D, heads, Dh]."""
    return (lambda x, c: x.T.reshape(c.hidden_size, n_heads(c), c.head_dim),
            lambda x, c: x.reshape(c.hidden_size, -1).T)


def _bias_heads(n_heads: Callable[[ModelConfig], int]) -> tuple[Hook, Hook]:
    return (lambda x, c: x.reshape(n_heads(c), c.head_dim), lambda x, c: x.reshape(-1))


_q = lambda c: c.num_heads  # noqa: E731
_kv = lambda c: c.num_kv_heads  # noqa: E731

LAYER_RULES: tuple[Rule, ...] = (
    Rule("model.layers.{i}.input_layernorm.weight", ("layers", "attn_norm"), _identity, _identity),
    Rule("model.layers.{i}.self_attn.q_proj.weight", ("layers", "wq"), *_heads_in(_q)),
    Rule("model.layers.{i}.self_attn.k_proj.weight", ("layers", "wk"), *_heads_in(_kv)),
    Rule("model.layers.{i}.self_attn.v_proj.weight", ("layers", "wv"), *_heads_in(_kv)),
    Rule("model.layers.{i}.self_attn.o_proj.weight", ("layers", "wo"),
         lambda x, c: x.T.reshape(c.num_heads, c.head_dim, c.hidden_size),
         lambda x, c: x.reshape(-1, c.hidden_size).T),
    Rule("model.layers.{i}.self_attn.q_proj.bias", ("layers", "bq"), *_bias_heads(_q)),
    Rule("model.layers.{i}.self_attn.k_proj.bias", ("layers", "bk"), *_bias_heads(_kv)),
    Rule("model.layers.{i}.self_attn.v_proj.bias", ("layers", "bv"), *_bias_heads(_kv)),
    Rule("model.layers.{i}.self_attn.o_proj.bias", ("layers", "bo"), _identity, _identity),
    Rule("model.layers.{i}.self_attn.q_norm.weight", ("layers", "q_norm"), _identity, _identity),
    Rule("model.layers.{i}.self_attn.k_norm.weight", ("layers", "k_norm"), _identity, _identity),
    Rule("model.layers.{i}.post_attention_layernorm.weight", ("layers", "mlp_norm"), _identity, _identity),
    Rule("model.layers.{i}.mlp.gate_proj.weight", ("layers", "w_gate"), _t, _t),
    Rule("model.layers.{i}.mlp.up_proj.weight", ("layers", "w_up"), _t, _t),
    Rule("model.layers.{i}.mlp.down_proj.weight", ("layers", "w_down"), _t, _t),
)
GLOBAL_RULES: tuple[Rule, ...] = (
    Rule("model.embed_tokens.weight", ("embed",), _identity, _identity),
    Rule("model.norm.weight", ("final_norm",), _identity, _identity),
    Rule("lm_head.weight", ("lm_head",), _t, _t),
)


def read_safetensors_dir(path: str) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint dir (single file or sharded with an index), as arrays."""
    from safetensors import SafetensorError, safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise InputError(f"no *.safetensors files in {path}")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        try:
            with safe_open(os.path.join(path, name), framework="flax") as f:
                for key in f.keys():
                    if key in tensors:
                        raise InputError(f"tensor {key!r} appears in more than one shard of {path}")
                    tensors[key] = np.asarray(f.get_tensor(key))
        except (OSError, RuntimeError, SafetensorError) as err:  # how safetensors reports corruption
            raise InputError(f"cannot read safetensors file {os.path.join(path, name)}: {err}") from err
    return tensors


def read_hf_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise InputError(f"{path} has no config.json; not an HF checkpoint directory")
    with open(cfg_path) as f:
        return json.load(f)


def check_finite(tensors: Mapping[str, np.ndarray], source: str) -> None:
    """Raises InputError naming every float tensor of a checkpoint that holds NaN or Inf:
    such weights load silently and only show up later as garbage output or a NaN loss."""
    bad = []
    for name, value in tensors.items():
        value = np.asarray(value)
        if value.dtype.kind in "fc" or value.dtype.name == "bfloat16":
            finite = np.isfinite(value)
            if not finite.all():
                bad.append(f"{name} ({value.size - int(finite.sum())} of {value.size} values)")
    if bad:
        raise InputError(f"{source} holds NaN/Inf weights in {len(bad)} tensor(s): {', '.join(bad[:8])}"
                         + (" ..." if len(bad) > 8 else ""))


def _layer_name_regex(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> dict:
    """Maps HF-named target tensors to the model's pure state dict; raises on any mismatch."""
    # tied checkpoints may still carry a copy of the embedding as lm_head.weight
    ignore = ("lm_head.weight",) if cfg.tie_embeddings else ()
    return map_named_tensors(tensors, layer_rules=LAYER_RULES, global_rules=GLOBAL_RULES,
                             hook_cfg=cfg, num_layers=cfg.num_layers,
                             expected=expected_shapes(lambda: TargetLM(cfg, rngs=nnx.Rngs(0))),
                             ignore=ignore)


def map_named_tensors(tensors: Mapping[str, np.ndarray], *, layer_rules, global_rules, hook_cfg,
                      num_layers: int, expected: Mapping, ignore=()) -> dict:
    """Name-table conversion shared by targets and drafters; one error lists every problem.

    Every HF tensor that is unmapped (including ones the config has no parameter for,
    e.g. biases when `attention_bias` is off), missing, or of the wrong shape is named,
    with the HF-layout shape the config expects.
    """
    per_layer: dict[tuple[str, ...], list] = {}
    flat: dict[tuple[str, ...], np.ndarray] = {}
    unmapped, problems = [], []
    cfg = hook_cfg
    patterns = [(_layer_name_regex(r.hf_name), r) for r in layer_rules]
    globals_by_name = {r.hf_name: r for r in global_rules}
    bad_globals = set()
    for name, value in tensors.items():
        if name in ignore:
            continue
        if name in globals_by_name:
            rule = globals_by_name[name]
            if rule.path not in expected:
                unmapped.append(name)
                continue
            converted = _convert(rule, value, cfg, name, expected[rule.path], problems)
            if converted is None:
                bad_globals.add(rule.path)
            else:
                flat[rule.path] = converted
            continue
        for regex, rule in patterns:
            m = regex.match(name)
            if m:
                layer = int(m.group(1))
                if layer >= num_layers or rule.path not in expected:
                    unmapped.append(name)
                else:
                    slots = per_layer.setdefault(rule.path, [None] * num_layers)
                    converted = _convert(rule, value, cfg, name, expected[rule.path][1:], problems)
                    slots[layer] = False if converted is None else converted  # False: present, bad
                break
        else:
            if not name.endswith("rotary_emb.inv_freq"):
                unmapped.append(name)
    layer_paths = {r.path: r for r in layer_rules}
    global_paths = {r.path: r for r in global_rules}
    for path, shape in expected.items():
        if path in layer_paths:
            rule = layer_paths[path]
            slots = per_layer.get(path, [None] * num_layers)
            problems += [f"missing tensor {rule.hf_name.format(i=i)} {_hf_shape(rule, shape[1:], cfg)}"
                         for i, s in enumerate(slots) if s is None]
            if all(isinstance(s, np.ndarray) for s in slots):
                flat[path] = np.stack(slots)
        elif path in global_paths:
            rule = global_paths[path]
            if path not in flat and path not in bad_globals:
                problems.append(f"missing tensor {rule.hf_name} {_hf_shape(rule, shape, cfg)}")
        else:
            problems.append(f"no conversion rule for model parameter {'.'.join(path)} {shape}")
    if unmapped or problems:
        lines = [f"unmapped checkpoint tensor: {n}" for n in sorted(unmapped)] + problems
        raise InputError("checkpoint does not match the model config:\n  " + "\n  ".join(lines))
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _hf_shape(rule: Rule, model_shape: tuple[int, ...], cfg) -> tuple[int, ...]:
    """The HF-layout shape that `rule` converts to `model_shape`."""
    return tuple(rule.to_hf(np.zeros(model_shape, np.float32), cfg).shape)


def _convert(rule: Rule, value, cfg, name: str, model_shape: tuple[int, ...],
             problems: list) -> np.ndarray | None:
    """`rule.to_model(value)`; None (and a recorded problem) when its shape is wrong."""
    want = _hf_shape(rule, model_shape, cfg)
    if tuple(np.shape(value)) != want:
        problems.append(f"{name}: shape {tuple(np.shape(value))} != expected {want}")
        return None
    return np.asarray(rule.to_model(np.asarray(value), cfg))


def expected_shapes(make_module) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Parameter paths and shapes of the module `make_module()` builds (abstractly)."""
    abstract = nnx.eval_shape(make_module)
    pure = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    return {path: tuple(leaf.shape) for path, leaf in _flatten(pure)}


def _flatten(tree: Mapping, prefix=()):
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def build_target(cfg: ModelConfig, params: Mapping) -> TargetLM:
    """A TargetLM holding `params` (pure dict of arrays), cast to cfg.param_dtype."""
    return build_module(lambda: TargetLM(cfg, rngs=nnx.Rngs(0)), params, cfg.weight_dtype)


def build_module(make_module, params: Mapping, dtype):
    """The module `make_module()` builds, holding `params` (pure dict) cast to dtype."""
    graphdef, state = nnx.split(nnx.eval_shape(make_module))
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, dtype), dict(params)))
    return nnx.merge(graphdef, state)


def params_to_hf(cfg: ModelConfig, params: Mapping) -> dict[str, np.ndarray]:
    """Inverse of `params_from_hf`: HF-named float32 numpy tensors."""
    return named_tensors_from_params(params, layer_rules=LAYER_RULES, global_rules=GLOBAL_RULES,
                                     hook_cfg=cfg, num_layers=cfg.num_layers)


def named_tensors_from_params(params: Mapping, *, layer_rules, global_rules, hook_cfg,
                              num_layers: int) -> dict[str, np.ndarray]:
    """Inverse of `map_named_tensors`: HF-named float32 numpy tensors."""
    cfg = hook_cfg
    flat = dict(_flatten(params))
    out: dict[str, np.ndarray] = {}
    for rule in global_rules:
        if rule.path in flat:
            out[rule.hf_name] = np.asarray(rule.to_hf(np.asarray(flat[rule.path], np.float32), cfg))
    for rule in layer_rules:
        if rule.path in flat:
            stacked = np.asarray(flat[rule.path], np.float32)
            for i in range(num_layers):
                out[rule.hf_name.format(i=i)] = np.ascontiguousarray(rule.to_hf(stacked[i], cfg))
    return out
