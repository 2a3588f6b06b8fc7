"""Exports the decoding loops with `jax.export`: a serving artifact that needs no model code.

`export_decoder` lowers the engine's whole-batch decode (`engine.decode_batch`),
speculative and autoregressive, each as a pure function of (weights, padded
batch, sampling inputs) returning its outputs by name, with a
symbolic batch dimension and the maximum prompt / new-token lengths fixed, for
every platform asked (lowering for cpu, cuda and tpu all works from any host).
It also exports the serving engine itself (`export_engine`: init, insert, step,
evict over a symbolic slot count), which `serving.exported_engine` runs under
the continuous-batching scheduler; the engine is the speculative one when the
artifact has a drafter, else plain AR.
The speculative loop verifies whole blocks ("fixed", DFlash) or, for a drafter
with a length head, per-row lengths from the AdaFlash rule ("head": ρ and L_min
are inputs) through packed verification, whose bucket sizes are symbolic
multiples of the batch; or, with `tree_budget=N`, a best-first draft tree of N
nodes per step (`decoding.tree_step`; its verify_len input is ignored). ("auto",
for lengths or tree budgets, needs step costs calibrated on the serving
hardware, so it is not exported.) The artifact directory holds:

    manifest.json              versions, shapes, stop tokens, sampling modes, the function table
    weights.safetensors        target (and drafter) weights, named "target/..." / "drafter/..."
    <function>.jaxexport       one serialized `jax.export.Exported` per (loop, sampling mode)
                               (inputs: the weight groups, then manifest["inputs"]) and per
                               engine function (weight groups, state leaves, then "inputs")
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

from adaflash_jax.decoding import engine as engine_lib
from adaflash_jax.decoding.batching import bucket, cache_length
from adaflash_jax.decoding.engine_state import EngineConfig, EngineWeights, SlotParams
from adaflash_jax.decoding.export_engine import EngineExporter
from adaflash_jax.decoding.length_policy import unit_costs
from adaflash_jax.decoding.packing import default_buckets
from adaflash_jax.decoding.tree_policy import tree_budgets
from adaflash_jax.decoding.verify_plan import PlanParams, ProbeState

FORMAT = "adaflash-exported-decoder"
FORMAT_VERSION = 3  # 2: outputs by name (a dict), not a positional tuple; 3: + the engine functions
PLATFORMS = ("cpu", "cuda", "tpu")
MODES = ("greedy", "sample")
EXPORTED_POLICIES = ("fixed", "head")
# Positional inputs of every exported function after its weight groups (the runtime builds them).
INPUTS = {
    "autoregressive": ("tokens [b, max_prompt_len] int32", "lengths [b] int32", "active [b] bool",
                       "max_new [] int32", "key [2] uint32", "temperature [] float32", "top_p [] float32",
                       "eos_ids [E] int32"),
}
INPUTS["speculative"] = INPUTS["autoregressive"][:4] + ("verify_len [b] int32",) + INPUTS["autoregressive"][4:]
INPUTS["speculative_head"] = INPUTS["speculative"] + ("rho [] float32", "min_len [] int32")


def _flat_weights(state, prefix: str):
    """(names, leaves, treedef) of an nnx.State, names like 'target/layers/w_q'."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(state)
    names = [prefix + "/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
             for path, _ in with_paths]
    return names, [leaf for _, leaf in with_paths], treedef


def _tree_fields(drafter, tree_budget, length_policy) -> dict:
    """The EngineConfig fields of a tree-verifying artifact ({} for chain verification)."""
    if tree_budget is None:
        return {}
    if drafter is None:
        raise ValueError("tree_budget needs a drafter: the tree is built from its distributions")
    if tree_budget == "auto":
        raise ValueError("tree_budget 'auto' needs step costs calibrated where it runs, so it is not exported")
    (budget,) = tree_budgets(tree_budget, drafter.block_size)
    if length_policy not in (None, "fixed"):
        raise ValueError(f"a tree is sized by tree_budget; length_policy {length_policy!r} does not apply")
    return {"verify": "tree", "tree_budget": budget}


def _package_version() -> str:
    try:
        from importlib.metadata import version
        return version("adaflash-jax")
    except Exception:  # an uninstalled source tree
        return "unknown"


def check_options(out_dir: str, platforms: Sequence[str], modes: Sequence[str], max_prompt_len: int,
                  max_new_tokens: int, overwrite: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Validates what needs no model (the CLI calls this before loading one); returns the
    normalised (platforms, modes)."""
    platforms = tuple(dict.fromkeys(p.strip().lower() for p in platforms))
    bad = [p for p in platforms if p not in PLATFORMS]
    if bad or not platforms:
        raise ValueError(f"platforms must be a non-empty subset of {PLATFORMS}, got {list(platforms)}")
    modes = tuple(dict.fromkeys(m.strip() for m in modes))
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {list(modes)}")
    if int(max_new_tokens) < 1 or int(max_prompt_len) < 1:
        raise ValueError(f"max_prompt_len and max_new_tokens must be >= 1, got {max_prompt_len}, "
                         f"{max_new_tokens}")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not overwrite:
            raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True (--overwrite) "
                                  "to replace the artifact in it")
        if not os.path.isfile(os.path.join(out_dir, "manifest.json")):
            raise FileExistsError(f"{out_dir} holds files but no exported decoder (no manifest.json); "
                                  "overwrite only replaces a previous artifact, so pick a new or empty --out")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    return platforms, modes


def export_decoder(target, out_dir: str, *, drafter=None, platforms: Sequence[str] = ("cpu",),
                   max_prompt_len: int = 256, max_new_tokens: int = 128,
                   modes: Sequence[str] = MODES, length_policy: str | None = None,
                   tree_budget: int | None = None, overwrite: bool = False) -> dict:
    """Writes the artifact for `target` (and `drafter`) to `out_dir`; returns the manifest.

    platforms: any of "cpu", "cuda", "tpu" (one multi-platform function per entry).
    modes: "greedy" (temperature 0) and/or "sample" (temperature / top-p are inputs).
    length_policy: "fixed" or "head" (default: "head" when the drafter has a length head).
    tree_budget: verify a best-first tree of this many nodes per step instead of the block
    (length policy "fixed").
    An existing non-empty `out_dir` is never touched unless overwrite=True; the
    artifact is written to a temporary sibling and moved into place at the end.
    """
    platforms, modes = check_options(out_dir, platforms, modes, max_prompt_len, max_new_tokens, overwrite)
    tree = _tree_fields(drafter, tree_budget, length_policy)
    headroom = max(drafter.block_size, tree.get("tree_budget", 0)) if drafter is not None else 0
    if max_prompt_len + max_new_tokens + headroom > target.cfg.max_position_embeddings:
        raise ValueError(f"max_prompt_len + max_new_tokens (+ block size {headroom}) = "
                         f"{max_prompt_len + max_new_tokens + headroom} exceeds the target's context "
                         f"of {target.cfg.max_position_embeddings} tokens")
    policy = None
    if drafter is not None:
        drafter.cfg.check_target(target.cfg)
        policy = "fixed" if tree else length_policy or ("head" if drafter.has_length_head else "fixed")
        if policy not in EXPORTED_POLICIES:
            raise ValueError(f"length_policy must be one of {EXPORTED_POLICIES} for export, got {policy!r}"
                             + (" ('auto' needs step costs calibrated where it runs)" if policy == "auto"
                                else ""))
        if policy == "head" and not drafter.has_length_head:
            raise ValueError(f"length_policy='head' needs a drafter with a length head "
                             f"({drafter.name or 'this drafter'} has none)")
    elif length_policy is not None:
        raise ValueError("length_policy needs a drafter")

    max_new_cap = bucket(int(max_new_tokens), 16)
    cache_len = cache_length(int(max_prompt_len), max_new_cap, headroom)
    eos = tuple(int(i) for i in target.eos_token_ids)
    t_names, t_leaves, t_tree = _flat_weights(target.state, "target")
    d_names, d_leaves, d_tree = (_flat_weights(drafter.state, "drafter") if drafter is not None
                                 else ([], [], None))
    h_names, h_leaves, h_tree = (_flat_weights(drafter.head_state, "head") if policy == "head"
                                 else ([], [], None))
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct
    batch_args = [spec((b, max_prompt_len), jnp.int32), spec((b,), jnp.int32), spec((b,), jnp.bool_),
                  spec((), jnp.int32)]
    sampling_args = [spec((2,), jnp.uint32), spec((), jnp.float32), spec((), jnp.float32),
                     spec((len(eos),), jnp.int32)]
    weight_specs = [[spec(x.shape, x.dtype) for x in leaves] for leaves in (t_leaves, d_leaves, h_leaves)]

    def run(weights, tokens, lengths, active, max_new, verify_len, key, temperature, top_p, eos_ids, *,
            greedy, plan=None, **engine):
        """The engine's whole-batch decode; outputs by name (the runtime reads them so)."""
        b = tokens.shape[0]
        keys = jax.random.wrap_key_data(jnp.broadcast_to(key, (b, 2)))  # row i: stream i of the seed
        params = SlotParams(jnp.where(active, max_new, 0), jnp.broadcast_to(temperature, (b,)),
                            jnp.broadcast_to(top_p, (b,)), keys, jnp.arange(b, dtype=jnp.int32), verify_len)
        cfg = EngineConfig(target_def=target.graphdef, cache_len=cache_len, max_new_cap=max_new_cap,
                           greedy=greedy, **engine)
        out = engine_lib.decode_batch(cfg, weights, tokens, lengths, params, eos_ids, plan)
        return {"tokens": out.tokens, "num_out": out.num_out, "steps": out.steps, "commits": out.commits,
                "verified": out.verified, "drafted_steps": out.drafted_steps}

    def ar_fn(t_w, tokens, lengths, active, max_new, key, temperature, top_p, eos_ids, *, greedy):
        weights = EngineWeights(jax.tree_util.tree_unflatten(t_tree, t_w))
        return run(weights, tokens, lengths, active, max_new, jnp.ones(tokens.shape[:1], jnp.int32), key,
                   temperature, top_p, eos_ids, greedy=greedy)

    def spec_fn(t_w, d_w, *rest, greedy):
        h_w, rest = (rest[0], rest[1:]) if policy == "head" else (None, rest)
        weights = EngineWeights(jax.tree_util.tree_unflatten(t_tree, t_w),
                                jax.tree_util.tree_unflatten(d_tree, d_w),
                                jax.tree_util.tree_unflatten(h_tree, h_w) if policy == "head" else None)
        engine = dict(drafter_def=drafter.graphdef, block_size=drafter.block_size, **tree)
        plan = None
        if policy == "head":  # bucket sizes are symbolic multiples of the batch
            buckets = default_buckets(rest[0].shape[0], drafter.block_size)
            plan = PlanParams(rest[9], rest[10], unit_costs(buckets), jnp.int32(1), ProbeState.fresh(1))
            engine.update(length_head_def=drafter.head_graphdef, policy="head", buckets=buckets)
        return run(weights, *rest[:9], greedy=greedy, plan=plan, **engine)

    functions = {}
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        for mode in modes:
            greedy = mode == "greedy"
            jobs = [("autoregressive", ar_fn, ["target"], [*batch_args, *sampling_args])]
            if drafter is not None:
                groups = ["target", "drafter"] + (["head"] if policy == "head" else [])
                extra = [spec((), jnp.float32), spec((), jnp.int32)] if policy == "head" else []
                jobs.append(("speculative", spec_fn, groups,
                             [*batch_args, spec((b,), jnp.int32), *sampling_args, *extra]))
            for loop, fn, groups, args in jobs:
                name = f"{loop}_{mode}"
                group_specs = [weight_specs[("target", "drafter", "head").index(g)] for g in groups]
                exported = jax.export.export(jax.jit(lambda *a, f=fn: f(*a, greedy=greedy)),
                                             platforms=platforms)(*group_specs, *args)
                with open(os.path.join(staging, name + ".jaxexport"), "wb") as handle:
                    handle.write(exported.serialize())
                inputs = INPUTS["speculative_head" if loop == "speculative" and policy == "head" else loop]
                functions[name] = {"file": name + ".jaxexport", "loop": loop, "greedy": greedy,
                                   "weight_groups": groups, "inputs": list(inputs)}
        engine_groups = ["target", "drafter", "head"][:1 + (drafter is not None) + (policy == "head")]
        trees = {"target": (t_tree, weight_specs[0]), "drafter": (d_tree, weight_specs[1]),
                 "head": (h_tree, weight_specs[2])}
        exporter = EngineExporter(target, drafter, policy, cache_len=cache_len, max_new_cap=max_new_cap,
                                  num_eos=len(eos), groups=engine_groups, weight_trees=trees, tree=tree)
        for name, (exported, entry) in exporter.export(modes, platforms).items():
            with open(os.path.join(staging, entry["file"]), "wb") as handle:
                handle.write(exported.serialize())
            functions[name] = entry
        weights = dict(zip(t_names, (np.asarray(x) for x in t_leaves)))
        weights.update(zip(d_names, (np.asarray(x) for x in d_leaves)))
        weights.update(zip(h_names, (np.asarray(x) for x in h_leaves)))
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
                "num_layers": drafter.cfg.num_layers, "length_policy": policy,
                "verify": tree.get("verify", "chain"), "tree_budget": tree.get("tree_budget"),
                "rho": 1.3, "min_len": 1},
            "batch": "symbolic: any batch size >= 1",
            "max_prompt_len": int(max_prompt_len), "max_new_tokens": int(max_new_tokens),
            "max_new_cap": max_new_cap, "cache_len": cache_len, "eos_token_ids": list(eos),
            "tokenizer": "tokenizer" if target.tokenizer is not None else None,
            "weights": {"file": "weights.safetensors", "target": t_names, "drafter": d_names,
                        "head": h_names},
            "functions": functions,
            "engine": {**exporter.manifest(), "speculative": drafter is not None,
                       "slots": "symbolic: any slot count >= 1"},
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
