"""Exports the decoding loops with `jax.export`: a serving artifact that needs no model code.

`export_decoder` lowers the speculative loop (DFlash verification of the whole
block) and the autoregressive loop, each as a pure function of (weights,
padded batch, sampling inputs), with a symbolic batch dimension and the
maximum prompt / new-token lengths fixed, for every platform asked (lowering
for cpu, cuda and tpu all works from any host). The artifact directory holds:

    manifest.json              versions, shapes, stop tokens, sampling modes, the function table
    weights.safetensors        target (and drafter) weights, named "target/..." / "drafter/..."
    <function>.jaxexport       one serialized `jax.export.Exported` per (loop, sampling mode)
    tokenizer/                 tokenizer.json + chat template, when the target has a tokenizer

`adaflash_jax.serving.runtime.load_exported` runs it with jax alone. Weights are
inputs of the exported functions, not constants, so a function file stays small
and one weights file serves every function.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from adaflash_jax.decoding import autoregressive, speculative
from adaflash_jax.decoding.batching import bucket
from adaflash_jax.generation import cache_length

FORMAT = "adaflash-exported-decoder"
FORMAT_VERSION = 1
PLATFORMS = ("cpu", "cuda", "tpu")
MODES = ("greedy", "sample")
# Positional inputs of every exported function after the weights (the runtime builds them).
BATCH_INPUTS = ("tokens [b, max_prompt_len] int32", "lengths [b] int32", "active [b] bool",
                "max_new [] int32", "verify_len [b] int32 (speculative only)", "key [2] uint32",
                "temperature [] float32", "top_p [] float32", "eos_ids [E] int32")


def _flat_weights(state, prefix: str):
    """(names, leaves, treedef) of an nnx.State, names like 'target/layers/w_q'."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(state)
    names = [prefix + "/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
             for path, _ in with_paths]
    return names, [leaf for _, leaf in with_paths], treedef


def _package_version() -> str:
    try:
        from importlib.metadata import version
        return version("adaflash-jax")
    except Exception:  # an uninstalled source tree
        return "unknown"


def export_decoder(target, out_dir: str, *, drafter=None, platforms: Sequence[str] = ("cpu",),
                   max_prompt_len: int = 256, max_new_tokens: int = 128,
                   modes: Sequence[str] = MODES, overwrite: bool = False) -> dict:
    """Writes the artifact for `target` (and `drafter`) to `out_dir`; returns the manifest.

    platforms: any of "cpu", "cuda", "tpu" (one multi-platform function per entry).
    modes: "greedy" (temperature 0) and/or "sample" (temperature / top-p are inputs).
    An existing non-empty `out_dir` is never touched unless overwrite=True; the
    artifact is written to a temporary sibling and moved into place at the end.
    """
    platforms = tuple(dict.fromkeys(p.lower() for p in platforms))
    bad = [p for p in platforms if p not in PLATFORMS]
    if bad or not platforms:
        raise ValueError(f"platforms must be a non-empty subset of {PLATFORMS}, got {list(platforms)}")
    modes = tuple(dict.fromkeys(modes))
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {list(modes)}")
    if int(max_new_tokens) < 1 or int(max_prompt_len) < 1:
        raise ValueError(f"max_prompt_len and max_new_tokens must be >= 1, got {max_prompt_len}, "
                         f"{max_new_tokens}")
    headroom = drafter.block_size if drafter is not None else 0
    if max_prompt_len + max_new_tokens + headroom > target.cfg.max_position_embeddings:
        raise ValueError(f"max_prompt_len + max_new_tokens (+ block size {headroom}) = "
                         f"{max_prompt_len + max_new_tokens + headroom} exceeds the target's context "
                         f"of {target.cfg.max_position_embeddings} tokens")
    if drafter is not None:
        drafter.cfg.check_target(target.cfg)
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True (--overwrite) "
                              "to replace it")

    max_new_cap = bucket(int(max_new_tokens), 16)
    cache_len = cache_length(int(max_prompt_len), max_new_cap, headroom)
    eos = tuple(int(i) for i in target.eos_token_ids)
    t_names, t_leaves, t_tree = _flat_weights(target.state, "target")
    d_names, d_leaves, d_tree = (_flat_weights(drafter.state, "drafter") if drafter is not None
                                 else ([], [], None))
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct
    batch_args = [spec((b, max_prompt_len), jnp.int32), spec((b,), jnp.int32), spec((b,), jnp.bool_),
                  spec((), jnp.int32)]
    sampling_args = [spec((2,), jnp.uint32), spec((), jnp.float32), spec((), jnp.float32),
                     spec((len(eos),), jnp.int32)]
    weight_specs = [[spec(x.shape, x.dtype) for x in leaves] for leaves in (t_leaves, d_leaves)]

    def ar_fn(t_w, tokens, lengths, active, max_new, key, temperature, top_p, eos_ids, *, greedy):
        out, num_out, steps = autoregressive.generate_padded(
            target.graphdef, jax.tree_util.tree_unflatten(t_tree, t_w), tokens, lengths, active,
            max_new, jax.random.wrap_key_data(key), temperature, top_p, eos_ids,
            max_new_cap=max_new_cap, cache_len=cache_len, greedy=greedy)
        return out, num_out, steps

    def spec_fn(t_w, d_w, tokens, lengths, active, max_new, verify_len, key, temperature, top_p,
                eos_ids, *, greedy):
        out = speculative.speculative_padded(
            target.graphdef, drafter.graphdef, jax.tree_util.tree_unflatten(t_tree, t_w),
            jax.tree_util.tree_unflatten(d_tree, d_w), tokens, lengths, active, max_new, verify_len,
            jax.random.wrap_key_data(key), temperature, top_p, eos_ids, max_new_cap=max_new_cap,
            cache_len=cache_len, greedy=greedy)
        return out[:4]  # tokens, counts, steps, commits per step (for τ)

    functions = {}
    staging = tempfile.mkdtemp(prefix=".export-", dir=os.path.dirname(os.path.abspath(out_dir)) or ".")
    try:
        for mode in modes:
            greedy = mode == "greedy"
            jobs = [("autoregressive", ar_fn, [weight_specs[0], *batch_args, *sampling_args])]
            if drafter is not None:
                jobs.append(("speculative", spec_fn, [*weight_specs, *batch_args, spec((b,), jnp.int32),
                                                      *sampling_args]))
            for loop, fn, args in jobs:
                name = f"{loop}_{mode}"
                exported = jax.export.export(jax.jit(lambda *a, f=fn: f(*a, greedy=greedy)),
                                             platforms=platforms)(*args)
                with open(os.path.join(staging, name + ".jaxexport"), "wb") as handle:
                    handle.write(exported.serialize())
                functions[name] = {"file": name + ".jaxexport", "loop": loop, "greedy": greedy,
                                   "num_weight_groups": 2 if loop == "speculative" else 1}
        weights = dict(zip(t_names, (np.asarray(x) for x in t_leaves)))
        weights.update(zip(d_names, (np.asarray(x) for x in d_leaves)))
        save_file(weights, os.path.join(staging, "weights.safetensors"))
        if target.tokenizer is not None:
            target.tokenizer.save_hf_dir(os.path.join(staging, "tokenizer"))
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": {"jax": jax.__version__, "adaflash_jax": _package_version()},
            "platforms": list(platforms), "modes": list(modes),
            "target": {"name": target.name, "vocab_size": target.cfg.vocab_size,
                       "num_layers": target.cfg.num_layers, "hidden_size": target.cfg.hidden_size,
                       "dtype": target.cfg.dtype},
            "drafter": None if drafter is None else {
                "name": drafter.name, "block_size": drafter.block_size,
                "num_layers": drafter.cfg.num_layers, "verification": "fixed (whole block)"},
            "batch": "symbolic: any batch size >= 1",
            "max_prompt_len": int(max_prompt_len), "max_new_tokens": int(max_new_tokens),
            "max_new_cap": max_new_cap, "cache_len": cache_len, "eos_token_ids": list(eos),
            "tokenizer": "tokenizer" if target.tokenizer is not None else None,
            "weights": {"file": "weights.safetensors", "target": t_names, "drafter": d_names},
            "inputs": list(BATCH_INPUTS), "functions": functions,
        }
        with open(os.path.join(staging, "manifest.json"), "w") as handle:
            json.dump(manifest, handle, indent=1)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)  # only reached when empty or overwrite=True
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest
