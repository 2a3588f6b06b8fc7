"""The cases of benchmarks/kernels.py: per kernel, its inputs at a preset's shapes and its
forms (impl="xla" / impl="pallas"), and the harness that times them (see kernels.py)."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from adaflash_jax.models.packed_layout import pack_layout
from adaflash_jax.decoding.step_costs import timed_runs
from adaflash_jax.models.layers import packed_attention
from pallas_kernels.block_attention import block_attention
from pallas_kernels.block_attention_train import block_attention_train
from pallas_kernels.fused_verify import verify_head
from pallas_kernels.verify_attention import verify_attention

PALLAS_NOT_RUN = "not run: no accelerator (interpret mode is not a performance measure)"
SEED = 0


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model's attention / LM-head geometry and the sizes the cases run at."""

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


# ------------------------------------------------------------------------------ timing


def time_form(fn, inputs: tuple, repeats: int) -> tuple[dict, object]:
    """AOT-compiles fn, runs it once untimed, then `repeats` timed runs; (timings, output)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*inputs).compile()
    compile_s = time.perf_counter() - t0
    out, seconds = timed_runs(compiled, *inputs, repeats=repeats)
    runs = [s * 1e3 for s in seconds]
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
