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
import os
import platform
import sys
import time

import jax
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kernel_cases.py sits beside this script

from adaflash_jax.eval.report import emit_json  # noqa: E402
from kernel_cases import (PALLAS_NOT_RUN, Inputs, Preset, block_attention_case,  # noqa: E402
                          fused_verify_case, train_cases, verify_cases)
from pallas_kernels.common import current_platform  # noqa: E402

KERNELS = ("block_attention", "block_attention_train", "verify_attention", "fused_verify")


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
    return emit_json(record, args.out)


if __name__ == "__main__":
    main()
