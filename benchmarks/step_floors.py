"""The target's decode steps against the hardware's floors, in both layer layouts.

A step at batch 1 reads every weight once, so it cannot beat weight_bytes /
bandwidth; a T-token verify also does 2 x params x T flops, so it cannot beat
flops / matmul peak. This script measures both floors in the same process (a
large f32 matmul, the verify MLP's own shape, and an in-place add for the read
bandwidth), then times stand-alone jitted steps of SmolLM2-135M-Instruct with
a donated KV cache (context of `--context` tokens in a `--cache-len` cache):

- `ar`: one token per row, at each `--batches` size (the AR step);
- `verify<T>`: T tokens of one row through the causal forward (the chain's verify);
- `tree<N>`: a tree of N nodes of one row (`tree_forward`; a chain: the cost of a tree step
  depends on its node count, not its shape);

each followed by the greedy head, as the engine's steps are, in the stacked
(scanned) and per-layer (unrolled) layouts (`models.decoder_layers`). For every
step it reports the median time, its ratio to its floor, the compile time, and
how many `dynamic-slice` copies of a weight or cache buffer the optimised
program holds. `--hf` adds HF transformers (torch CPU) on the same steps. Prints
one JSON object.

    python benchmarks/step_floors.py [--batches 1,32] [--verify 4,8,16] [--tree 16]
        [--repeats 20] [--layouts per_layer,stacked] [--hf] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

import adaflash_jax as af
from adaflash_jax.decoding.autoregressive import new_cache
from adaflash_jax.eval.hlo import weight_and_cache_copies
from adaflash_jax.decoding.tree_build import ancestor_mask, chain_tree
from adaflash_jax.eval.report import emit_json
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # ar_decode.py sits beside this script
from ar_decode import _csv, measure_bandwidth  # noqa: E402

# Off the path again (python also puts a script's own folder first): benchmarks/kernels.py
# must not shadow the `kernels` package that transformers imports.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

MODEL = "smollm2-135m-instruct"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=_csv(int), default=[1, 32], help="AR batch sizes (default 1,32)")
    p.add_argument("--verify", type=_csv(int), default=[4, 8, 16], help="verify widths (default 4,8,16)")
    p.add_argument("--tree", type=_csv(int), default=[16], help="tree sizes (default 16)")
    p.add_argument("--layouts", type=_csv(str), default=["per_layer", "stacked"])
    p.add_argument("--context", type=int, default=200, help="committed tokens per row (default 200)")
    p.add_argument("--cache-len", type=int, default=512, help="KV cache length (default 512)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per step (median)")
    p.add_argument("--hf", action="store_true", help="also time HF transformers (torch CPU) steps")
    p.add_argument("--out", help="also write the JSON to this file")
    args = p.parse_args(argv)
    if args.context + max(args.verify + args.tree) > args.cache_len:
        p.error("--context plus the widest step must fit in --cache-len")
    bad = [x for x in args.layouts if x not in ("per_layer", "stacked")]
    if bad:
        p.error(f"unknown layouts {bad}")
    return args


def matmul_peak(m: int, k: int, n: int, runs: int = 10) -> float:
    """Best f32 GFLOP/s of an [m, k] x [k, n] matmul."""
    a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    jax.block_until_ready(f(a, b))
    best = min(_timed(lambda: jax.block_until_ready(f(a, b))) for _ in range(runs))
    return 2 * m * k * n / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def step_programs(target):
    """name -> (jitted step(state, cache, tokens) with the cache donated, tokens, batch, width)."""
    graphdef = target.graphdef

    def forward(state, cache, tokens):
        model = nnx.merge(graphdef, state)
        out = model(tokens, cache=cache)
        return model.greedy_tokens(out.hidden), out.cache

    def tree(state, cache, tokens):
        model = nnx.merge(graphdef, state)
        chain = chain_tree(tokens[:, 0], tokens[:, 1:])  # the chain's ancestor structure, N nodes
        out = model.tree_forward(chain.tokens, chain.depths, ancestor_mask(chain, tokens.shape[1] - 1), cache)
        return model.greedy_tokens(out.hidden), cache

    return jax.jit(forward, donate_argnums=1), jax.jit(tree, donate_argnums=1)


def time_step(fn, target, batch: int, width: int, cache_len: int, context: int, repeats: int) -> dict:
    tokens = jnp.asarray(np.random.default_rng(0).integers(100, 20000, (batch, width)), jnp.int32)
    fresh = new_cache(target.model, batch, cache_len).with_lengths(jnp.full((batch,), context, jnp.int32))
    t0 = time.perf_counter()
    compiled = fn.lower(target.state, fresh, tokens).compile()
    compile_s = time.perf_counter() - t0
    copies = weight_and_cache_copies(compiled.as_text(), target.model, batch, cache_len)
    holder = {"cache": fresh}

    def call():
        ids, holder["cache"] = compiled(target.state, holder["cache"], tokens)
        jax.block_until_ready(ids)

    call()
    times = [_timed(call) for _ in range(repeats)]
    return {"step_s": statistics.median(times), "compile_s": compile_s, "copies": copies}


def hf_step_times(args, widths) -> dict:
    """HF transformers (torch CPU, f32) on the same step shapes: forward + argmax with a cache."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from adaflash_jax.checkpoints.gguf import read_gguf, smollm2_gguf_path

    ckpt = read_gguf(smollm2_gguf_path())
    model = LlamaForCausalLM(LlamaConfig(**ckpt.config)).eval()
    state = {name: torch.from_numpy(np.asarray(t, np.float32)) for name, t in ckpt.tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF reference: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    torch.set_num_threads(os.cpu_count() or 1)
    out = {}
    rng = np.random.default_rng(0)
    for name, batch, width in widths:
        ctx = torch.as_tensor(rng.integers(100, 20000, (batch, args.context)))
        new = torch.as_tensor(rng.integers(100, 20000, (batch, width)))
        with torch.no_grad():
            past = model(ctx, use_cache=True).past_key_values
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                model(new, past_key_values=past, use_cache=True).logits.argmax(-1)
                times.append(time.perf_counter() - t0)
                past.crop(-width)  # back to the context
        out[name] = {"step_s": statistics.median(times)}
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    bw = measure_bandwidth()
    peak = {"matmul_2048_GFLOPs": matmul_peak(2048, 2048, 2048)}
    steps = ([(f"ar_b{b}", b, 1, "forward") for b in args.batches]
             + [(f"verify{t}", 1, t, "forward") for t in args.verify]
             + [(f"tree{n}", 1, n, "tree") for n in args.tree])
    record = {"benchmark": "step_floors", "model": MODEL, "context": args.context, "cache_len": args.cache_len,
              "repeats": args.repeats, "bandwidth": bw, "layouts": {}}
    with tqdm(total=len(args.layouts) * len(steps), desc="step_floors", file=sys.stderr) as bar:
        for layout in args.layouts:
            target = af.load_target(MODEL, layer_layout=layout)
            cfg = target.cfg
            if "verify_mlp_GFLOPs" not in peak:
                peak["verify_mlp_GFLOPs"] = matmul_peak(max(args.verify), cfg.hidden_size, cfg.intermediate_size)
            weight_bytes = int(sum(x.nbytes for x in jax.tree.leaves(target.state)))
            # 2 flops per weight per token, the embedding lookup aside (the tied head is a matmul)
            head = cfg.hidden_size * cfg.vocab_size
            flops_per_token = 2 * (cfg.num_params() - head) + 2 * head
            forward, tree = step_programs(target)
            results = {}
            for name, batch, width, kind in steps:
                bar.set_postfix_str(f"{layout} {name}")
                r = time_step(forward if kind == "forward" else tree, target, batch, width, args.cache_len,
                              args.context, args.repeats)
                bandwidth_floor = weight_bytes / (bw["used_GBps"] * 1e9)
                compute_floor = flops_per_token * batch * width / (peak["matmul_2048_GFLOPs"] * 1e9)
                r.update(batch=batch, tokens=width, bandwidth_floor_s=bandwidth_floor,
                         compute_floor_s=compute_floor, over_floor=r["step_s"] / max(bandwidth_floor, compute_floor))
                results[name] = r
                bar.update()
            ar = results.get("ar_b1")
            if ar is not None:
                for name, r in results.items():
                    r["over_ar_b1"] = r["step_s"] / ar["step_s"]
            record["layouts"][layout] = results
            del target
    record["peak"] = peak
    if {"per_layer", "stacked"} <= set(args.layouts):
        record["per_layer_over_stacked"] = {
            name: record["layouts"]["per_layer"][name]["step_s"] / record["layouts"]["stacked"][name]["step_s"]
            for name in record["layouts"]["per_layer"]}
    if args.hf:
        record["hf"] = hf_step_times(args, [(n, b, w) for n, b, w, kind in steps if kind == "forward"])
    record["machine"] = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
                         "processor": platform.processor() or platform.machine(), "jax": jax.__version__}
    record["total_time_s"] = time.perf_counter() - t_start
    return emit_json(record, args.out)


if __name__ == "__main__":
    main()
