"""Pallas kernels against their XLA references at a model's shapes: median ms, speedup, estimated HBM bytes.

Each case builds its inputs once (normal floats and ragged per-row lengths
from a fixed numpy seed: every row's live context is drawn between 50% and
100% of the context), compiles each form ahead of time
(`jax.jit(f).lower(...).compile()`, so compile time is reported apart and never
timed), runs it once untimed, then reports the median of `--repeats` timed
runs. Both forms of a case are timed in the same process, one after the other,
so `speedup = xla_ms / pallas_ms` compares like with like.

Kernels and cases (B = batch, Bs = block size, S/T = context):

- block_attention: one draft block per row over its live context,
  q [B, H, Bs, Dh], cache [B, Hkv, S, Dh];
- block_attention_train: N blocks per sequence, q [Bt, H, N*Bs, Dh],
  context [Bt, Hkv, T, Dh], sorted anchors below each row's length; the
  forward alone and value_and_grad of a sum loss (forward + backward);
- verify_attention: the drafted bucket (N = B*Bs/2 packed slots, width Bs,
  ragged verified lengths 1..Bs) and the AR step (N = B, width 1); the XLA
  side also times the model's own XLA path (`models.layers.packed_attention`,
  `xla_model_ms`), since the reference gathers the cache once per slot;
- fused_verify: the verify head on N = B*Bs tokens, hidden [N, D] and the LM
  head [D, V] (greedy unless --temperature > 0).

"xla" is the kernel function with impl="xla" (its plain-jnp reference);
"pallas" is impl="pallas". Pallas runs only on an accelerator: on a CPU it
would run in interpret mode, which is a correctness tool and says nothing
about speed, so there only the XLA forms are timed, the record says so, and
shapes are capped to --small unless --full-on-cpu is given.

`hbm_bytes_estimated` is an analytic count, not a measurement: the bytes each
form must move between HBM and the chip if every materialised intermediate is
written once and read once (its `basis` says what is counted). Prints one JSON
object to stdout; progress and notes go to stderr.

    python benchmarks/kernels.py [--preset qwen3-8b|smollm2-135m] [--contexts 1024,2048]
        [--batch 16] [--dtype bfloat16|float32] [--repeats 5] [--kernels block_attention,...]
        [--small] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from adaflash_jax.decoding.packing import pack_layout
from adaflash_jax.models.layers import packed_attention
from pallas_kernels.block_attention import block_attention
from pallas_kernels.block_attention_train import block_attention_train
from pallas_kernels.common import current_platform
from pallas_kernels.fused_verify import verify_head
from pallas_kernels.verify_attention import verify_attention

KERNELS = ("block_attention", "block_attention_train", "verify_attention", "fused_verify")
PALLAS_NOT_RUN = "not run: no accelerator (interpret mode is not a performance measure)"
SEED = 0


@dataclasses.dataclass(frozen=True)
class Preset:
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    block_size: int
    batch: int
    contexts: tuple[int, ...]
    train_batch: int  # sequences per training case
    train_blocks: int  # anchors (draft blocks) per training sequence
    source: str


PRESETS = {
    "qwen3-8b": Preset(
        heads=32, kv_heads=8, head_dim=128, hidden=4096, vocab=151_936, block_size=16, batch=16,
        contexts=(1024, 2048, 4096, 8192), train_batch=1, train_blocks=512,
        source=("Qwen3-8B target / DFlash b16 drafter. Training: 512 anchors per sequence as in "
                "configs/qwen3_8b.py; one sequence with all 32 heads is the same work as that "
                "recipe's per-chip share (4 sequences, heads split 4 ways by tensor parallelism)")),
    "smollm2-135m": Preset(
        heads=9, kv_heads=3, head_dim=64, hidden=576, vocab=49_152, block_size=16, batch=16,
        contexts=(256, 512, 1024, 2048), train_batch=8, train_blocks=8,
        source="SmolLM2-135M-Instruct target; training: 8 sequences x 8 anchors as in configs/smollm2_135m.py"),
}
# --small: the preset's heads and head dim (the kernels' geometry) at tiny sizes.
SMALL = {"batch": 2, "contexts": (64, 128), "vocab": 2048, "hidden": 256, "train_batch": 1, "train_blocks": 4}


def _csv_int(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"needs positive integers, got {text!r}")
    return values


def _preset_table() -> str:
    lines = ["presets (--small keeps heads and head dim; batch 2, contexts 64,128, vocab <= 2048,",
             "hidden <= 256, one training sequence of 4 blocks):"]
    for name, p in PRESETS.items():
        lines.append(f"  {name}: {p.heads} query / {p.kv_heads} KV heads, head dim {p.head_dim}, "
                     f"hidden {p.hidden}, vocab {p.vocab:,}, block {p.block_size}, batch {p.batch},")
        lines.append(f"    contexts {','.join(map(str, p.contexts))}; training {p.train_batch} "
                     f"sequence(s) x {p.train_blocks} blocks")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0],
                                epilog="\n\n".join(doc[1:]) + "\n\n" + _preset_table(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b", help="model shapes (default qwen3-8b)")
    p.add_argument("--contexts", type=_csv_int, default=None,
                   help="comma list of context lengths S (default: the preset's)")
    p.add_argument("--batch", type=int, default=None, help="batch B of the inference cases (default: the preset's)")
    p.add_argument("--train-batch", type=int, default=None, help="sequences per training case (default: the preset's)")
    p.add_argument("--train-blocks", type=int, default=None,
                   help="draft blocks per training sequence, capped at the context (default: the preset's)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of activations, caches and the LM head (default bfloat16)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="fused_verify temperature: 0 = greedy (default), > 0 samples (Gumbel-max)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per form after one untimed run; median reported")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma subset of {','.join(KERNELS)}")
    p.add_argument("--small", action="store_true",
                   help="tiny shapes that finish in seconds on a CPU (the default on a CPU)")
    p.add_argument("--full-on-cpu", action="store_true",
                   help="on a CPU, use the preset's full shapes instead of --small (slow, XLA only)")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    args = p.parse_args(argv)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown or not kernels:
        p.error(f"--kernels: unknown {unknown}; choose from {','.join(KERNELS)}")
    args.kernels = [k for k in KERNELS if k in kernels]
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    for name in ("batch", "train_batch", "train_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    return args


def shapes_for(args, small: bool) -> Preset:
    base = PRESETS[args.preset]
    if small:
        base = dataclasses.replace(base, batch=SMALL["batch"], contexts=SMALL["contexts"],
                                   vocab=min(base.vocab, SMALL["vocab"]), hidden=min(base.hidden, SMALL["hidden"]),
                                   train_batch=SMALL["train_batch"], train_blocks=SMALL["train_blocks"])
    return dataclasses.replace(
        base, batch=args.batch or base.batch, contexts=tuple(args.contexts or base.contexts),
        train_batch=args.train_batch or base.train_batch, train_blocks=args.train_blocks or base.train_blocks)


# ------------------------------------------------------------------------------ timing


def time_form(fn, inputs: tuple, repeats: int) -> tuple[dict, object]:
    """AOT-compiles fn, runs it once untimed, then `repeats` timed runs; (timings, output)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*inputs).compile()
    compile_s = time.perf_counter() - t0
    out = jax.block_until_ready(compiled(*inputs))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        runs.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(runs), "runs_ms": runs, "compile_s": compile_s}, out


def compare(out, ref) -> dict:
    """Largest |pallas - xla| over the float outputs, and how many integer outputs differ."""
    diff, scale, mismatches = 0.0, 0.0, 0
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(b.dtype, np.floating) or b.dtype == jnp.bfloat16:
            a, b = a.astype(np.float32), b.astype(np.float32)
            finite = np.isfinite(b)
            if (np.isfinite(a) != finite).any():
                mismatches += int((np.isfinite(a) != finite).sum())
            if finite.any():
                diff = max(diff, float(np.abs(a[finite] - b[finite]).max()))
                scale = max(scale, float(np.abs(b[finite]).max()))
        else:
            mismatches += int((a != b).sum())
    return {"max_abs_diff": diff, "xla_max_abs": scale, "mismatched_entries": mismatches}


def run_case(case: dict, forms: dict, inputs: tuple, repeats: int, on_accelerator: bool) -> dict:
    """Times forms {"xla": fn, "pallas": fn, optional "xla_model": fn} on the same inputs."""
    outputs = {}
    for name, fn in forms.items():
        if name == "pallas" and not on_accelerator:
            case["pallas"] = PALLAS_NOT_RUN
            continue
        try:
            timing, outputs[name] = time_form(fn, inputs, repeats)
        except Exception as error:  # one failing form (e.g. out of memory) must not end the run
            if not on_accelerator:
                raise
            case[f"{name}_error"] = f"{type(error).__name__}: {error}"[:800]
            continue
        case[f"{name}_ms"] = timing["ms"]
        case[f"{name}_runs_ms"] = timing["runs_ms"]
        case[f"{name}_compile_s"] = timing["compile_s"]
    if "xla_ms" in case and "pallas_ms" in case:
        case["speedup"] = case["xla_ms"] / case["pallas_ms"]
        case["pallas_vs_xla"] = compare(outputs["pallas"], outputs["xla"])
    if "xla_model_ms" in case and "pallas_ms" in case:
        case["speedup_vs_xla_model"] = case["xla_model_ms"] / case["pallas_ms"]
    est = case.get("hbm_bytes_estimated", {})
    for name in ("xla", "pallas"):
        if est.get(name) and f"{name}_ms" in case:
            est[f"{name}_GBps_implied"] = est[name] / (case[f"{name}_ms"] * 1e-3) / 1e9
    return case


# ------------------------------------------------------------------------------ inputs


class Inputs:
    """Deterministic inputs from one numpy generator (host-side: no per-shape compiles)."""

    def __init__(self, dtype):
        self.dtype = jnp.dtype(dtype)
        self.rng = np.random.default_rng(SEED)

    def normal(self, shape, scale: float = 1.0):
        x = self.rng.standard_normal(shape, dtype=np.float32)
        if scale != 1.0:
            x *= scale
        return jax.device_put(x.astype(self.dtype))

    def lengths(self, batch: int, context: int, reserve: int = 0) -> np.ndarray:
        """Per-row live lengths in [context/2, context - reserve] (reserve: room for new tokens)."""
        hi = max(context - reserve, 1)
        lo = min(max(context // 2, 1), hi)
        return self.rng.integers(lo, hi + 1, size=batch).astype(np.int32)


# ------------------------------------------------------------------------------ cases


def block_attention_case(p: Preset, s: int, gen: Inputs, repeats: int, acc: bool) -> dict:
    b, h, hkv, bs, d = p.batch, p.heads, p.kv_heads, p.block_size, p.head_dim
    lens = gen.lengths(b, s)
    inputs = (gen.normal((b, h, bs, d)), gen.normal((b, hkv, s, d)), gen.normal((b, hkv, s, d)),
              jnp.asarray(lens), gen.normal((b, hkv, bs, d)), gen.normal((b, hkv, bs, d)))
    isz = gen.dtype.itemsize
    io = 2 * b * h * bs * d * isz + 2 * b * hkv * bs * d * isz  # q and output; block K/V
    scores = b * h * bs * (s + bs)
    group_rows = (h // hkv) * bs
    est = {
        "xla": io + 2 * b * hkv * s * d * isz + 2 * scores * 4 + 2 * scores * isz,
        "pallas": io + 2 * int(lens.sum()) * hkv * d * isz if group_rows <= 64 else None,
        "scores_f32_bytes": scores * 4,
        "basis": ("xla: q, output, block K/V, the whole cache (every slot, live or not), the float32 scores "
                  "[B,H,Bs,S+Bs] and the probabilities (q's dtype) each written once and read once; "
                  "pallas: q, output, block K/V and only the live cache slots (sum of ctx_lengths, not "
                  "rounded up to tiles), each read once: the query heads of a KV group share one query "
                  "tile when (H/Hkv)*Bs <= 64 rows (else not estimated)"),
    }
    case = {"kernel": "block_attention", "case": "draft block", "context": s,
            "shapes": {"q": [b, h, bs, d], "ctx_kv": [b, hkv, s, d], "blk_kv": [b, hkv, bs, d]},
            "ctx_lengths": lens.tolist(), "hbm_bytes_estimated": est}

    def form(impl):
        return lambda q, ck, cv, ln, bk, bv: block_attention(q, ck, cv, ln, bk, bv, impl=impl)

    return run_case(case, {"xla": form("xla"), "pallas": form("pallas")}, inputs, repeats, acc)


def train_cases(p: Preset, t: int, gen: Inputs, repeats: int, acc: bool) -> list[dict]:
    b, h, hkv, bs, d = p.train_batch, p.heads, p.kv_heads, p.block_size, p.head_dim
    n = min(p.train_blocks, t)
    rows = n * bs
    seq_lens = gen.lengths(b, t)
    anchors = np.sort(np.stack([gen.rng.integers(1, max(int(L) - 1, 2), size=n) for L in seq_lens]), axis=1)
    inputs = (gen.normal((b, h, rows, d)), gen.normal((b, hkv, t, d)), gen.normal((b, hkv, t, d)),
              gen.normal((b, hkv, rows, d)), gen.normal((b, hkv, rows, d)), jnp.asarray(anchors, jnp.int32))
    scores = b * h * rows * (t + rows) * 4
    shapes = {"q": [b, h, rows, d], "ctx_kv": [b, hkv, t, d], "blk_kv": [b, hkv, rows, d], "anchors": [b, n],
              "blocks_per_sequence": n}

    def fwd(impl):
        return lambda q, ck, cv, bk, bv, a: block_attention_train(q, ck, cv, bk, bv, a, block_size=bs, impl=impl)

    def fwd_bwd(impl):
        f = fwd(impl)

        def loss(q, ck, cv, bk, bv, a):
            return jnp.sum(f(q, ck, cv, bk, bv, a).astype(jnp.float32))

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))

    out = []
    for label, make in (("forward", fwd), ("forward+backward", fwd_bwd)):
        est = {"xla": None, "pallas": None, "scores_f32_bytes": scores,
               "basis": ("not estimated (depends on tiling and on what XLA keeps for the backward); "
                         "scores_f32_bytes is one [Bt,H,N*Bs,T+N*Bs] float32 array, of which the reference "
                         "materialises several (scores, probabilities, and in the backward their gradients) "
                         "and the kernel none")}
        case = {"kernel": "block_attention_train", "case": label, "context": t, "shapes": shapes,
                "sequence_lengths": seq_lens.tolist(), "hbm_bytes_estimated": est}
        out.append(run_case(case, {"xla": make("xla"), "pallas": make("pallas")}, inputs, repeats, acc))
    return out


_pack_layout = jax.jit(pack_layout, static_argnums=(1, 2))  # one compile per bucket, not per eager op


def verify_cases(p: Preset, s: int, gen: Inputs, repeats: int, acc: bool) -> list[dict]:
    b, h, hkv, bs, d = p.batch, p.heads, p.kv_heads, p.block_size, p.head_dim
    isz = gen.dtype.itemsize
    out = []
    for label, width, slots in (("drafted bucket", bs, max(b * bs // 2, b)), ("ar step", 1, b)):
        verified = gen.rng.integers(1, width + 1, size=b) if width > 1 else np.ones(b, np.int64)
        while verified.sum() > slots:  # trim the longest rows until the bucket holds them
            verified[int(np.argmax(verified))] -= 1
        cache_lens = gen.lengths(b, s, reserve=width)
        layout = _pack_layout(jnp.asarray(verified, jnp.int32), slots, width)
        lens = jnp.asarray(cache_lens)
        host = jax.device_get(layout)
        positions = jnp.asarray(cache_lens[host.seq_ids] + np.where(host.valid, host.offsets, 0), jnp.int32)
        inputs = (gen.normal((slots, h, d)), gen.normal((slots, hkv, d)), gen.normal((slots, hkv, d)),
                  gen.normal((b, hkv, s, d)), gen.normal((b, hkv, s, d)), layout.seq_ids, layout.offsets,
                  layout.valid, lens, layout, positions)
        io = 2 * slots * h * d * isz + 2 * slots * hkv * d * isz  # q, output, new K/V
        est = {
            "xla": (io + 2 * slots * hkv * s * d * (isz + 2 * 4) + 2 * slots * h * (s + slots) * 4),
            "pallas": io + 2 * int(cache_lens[verified > 0].sum()) * hkv * d * isz,
            "basis": ("xla (the reference, not xla_model): q, output, new K/V, each slot's gathered cache "
                      "row (read in the cache dtype, written and read back in float32) and the float32 "
                      "scores [N,H,S+N] written and read once; pallas: q, output, new K/V and each verifying "
                      "row's live cache slots read once per KV head (not rounded up to tiles)"),
        }
        case = {"kernel": "verify_attention", "case": label, "context": s, "width": width,
                "shapes": {"q": [slots, h, d], "kv_new": [slots, hkv, d], "cache_kv": [b, hkv, s, d]},
                "verified_lengths": verified.tolist(), "valid_slots": int(verified.sum()),
                "cache_lengths": cache_lens.tolist(), "hbm_bytes_estimated": est,
                "xla_model": "models.layers.packed_attention(impl='xla'): the padded [B,H,width] form the "
                             "engine runs without Pallas"}

        def form(impl, width=width):
            def f(q, kn, vn, ck, cv, seq, off, ok, ln, layout, pos):
                return verify_attention(q, kn, vn, ck, cv, seq, off, ok, ln, impl=impl, width=width)
            return f

        def model_form(q, kn, vn, ck, cv, seq, off, ok, ln, layout, pos):
            return packed_attention(q, kn, vn, ck, cv, layout, ln, pos, impl="xla")

        forms = {"xla": form("xla"), "xla_model": model_form, "pallas": form("pallas")}
        out.append(run_case(case, forms, inputs, repeats, acc))
    return out


def fused_verify_case(p: Preset, gen: Inputs, temperature: float, repeats: int, acc: bool) -> dict:
    n, dm, v = p.batch * p.block_size, p.hidden, p.vocab
    isz = gen.dtype.itemsize
    inputs = (gen.normal((n, dm)), gen.normal((dm, v), scale=1.0 / math.sqrt(dm)),
              jnp.asarray(gen.rng.integers(0, v, size=n), jnp.int32), jnp.int32(SEED))
    io = n * dm * isz + dm * v * isz + n * 4 + 4 * n * 4  # hidden, LM head, draft ids, 4 outputs
    est = {"xla": io + 2 * n * v * 4, "pallas": io, "logits_f32_bytes": n * v * 4,
           "basis": ("xla: hidden, the LM head read once, the [N,V] float32 logits written once and read once, "
                     "the per-position outputs; pallas: the same without the logits. A lower bound for pallas: "
                     "the LM head is read once per token tile, so more than once when N exceeds the tile")}
    case = {"kernel": "fused_verify", "case": "verify_head", "tokens": n, "temperature": temperature,
            "shapes": {"hidden": [n, dm], "lm_head": [dm, v], "draft_ids": [n]}, "hbm_bytes_estimated": est}

    def form(impl):
        def f(hidden, w, draft, seed):
            if temperature > 0:
                return verify_head(hidden, w, draft, temperature=temperature, seed=seed, impl=impl)
            return verify_head(hidden, w, draft, impl=impl)
        return f

    return run_case(case, {"xla": form("xla"), "pallas": form("pallas")}, inputs, repeats, acc)


# ------------------------------------------------------------------------------ main


def main(argv=None) -> dict:
    args = parse_args(argv)
    plat = current_platform()
    on_accelerator = plat in ("tpu", "gpu")
    small = args.small
    notes = []
    if not on_accelerator:
        notes.append(f"platform {plat}: only the XLA references are timed; Pallas would run in interpret mode, "
                     "which measures nothing about speed")
        if not small and not args.full_on_cpu:
            small = True
            notes.append("no accelerator: using --small shapes (pass --full-on-cpu for the preset's shapes; "
                         "explicit --contexts/--batch still apply)")
    for note in notes:
        print(f"kernels.py: {note}", file=sys.stderr)
    p = shapes_for(args, small)
    gen = Inputs(args.dtype)
    tasks = []
    for s in p.contexts:
        if "block_attention" in args.kernels:
            tasks.append((f"block_attention S={s}", lambda s=s: [block_attention_case(p, s, gen, args.repeats,
                                                                                     on_accelerator)]))
        if "block_attention_train" in args.kernels:
            tasks.append((f"block_attention_train T={s}", lambda s=s: train_cases(p, s, gen, args.repeats,
                                                                                 on_accelerator)))
        if "verify_attention" in args.kernels:
            tasks.append((f"verify_attention S={s}", lambda s=s: verify_cases(p, s, gen, args.repeats,
                                                                             on_accelerator)))
    if "fused_verify" in args.kernels:
        tasks.append((f"fused_verify N={p.batch * p.block_size}",
                      lambda: [fused_verify_case(p, gen, args.temperature, args.repeats, on_accelerator)]))
    t_start = time.perf_counter()
    cases = []
    with tqdm(total=len(tasks), desc="kernels", file=sys.stderr) as bar:
        for label, task in tasks:
            bar.set_postfix_str(label)
            cases.extend(task())
            bar.update()
    device = jax.devices()[0]
    record = {
        "benchmark": "kernels",
        "preset": args.preset, "small": small, "dtype": args.dtype, "repeats": args.repeats,
        "shapes": dataclasses.asdict(p),
        "pallas": "timed" if on_accelerator else PALLAS_NOT_RUN,
        "notes": notes + [
            ("*_ms: median wall time per call (dispatch included, until the outputs are ready) of the timed runs "
             "after one untimed run; *_compile_s: ahead-of-time compile, not timed"),
            ("hbm_bytes_estimated: analytic (see each case's basis), not measured; *_GBps_implied divides it "
             "by the median time"),
            "ragged inputs: per-row lengths drawn with a fixed seed between 50% and 100% of the context"],
        "device": {"platform": plat, "backend": jax.default_backend(), "device_kind": device.device_kind,
                   "devices": len(jax.devices()), "jax": jax.__version__, "python": platform.python_version(),
                   "cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "cases": cases,
        "total_time_s": time.perf_counter() - t_start,
    }
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return record


if __name__ == "__main__":
    main()
