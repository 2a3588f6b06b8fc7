"""`adaflash export` and `adaflash serve`: the exported decoder on the command line."""

from __future__ import annotations

import json
import os
import sys

from adaflash_jax.cli_train import add_target_mismatch_flag, help_formatter
from adaflash_jax.errors import InputError, as_input_error

EXPORT_EXAMPLES = """examples:
  adaflash export --out exported/smollm2                     # SmolLM2 + the shipped AdaFlash drafter, CPU
  adaflash export --out exported/smollm2 --platforms cpu,cuda,tpu --max-prompt-len 512
  adaflash export --drafter none --modes greedy --out exported/ar-only
"""

SERVE_EXAMPLES = """examples:
  adaflash serve exported/smollm2 --port 8000
  curl -s localhost:8000/v1/completions -d '{"prompt": "Name three primes.", "max_tokens": 32}'
"""


def add_export_parser(subparsers, default_target: str, default_drafter: str):
    p = subparsers.add_parser(
        "export", help="export the decoding loops with jax.export (weights + manifest)",
        description="Serialize the speculative and autoregressive decoding loops with jax.export\n"
                    "(symbolic batch, fixed maximum lengths), for the platforms asked, with the\n"
                    "AdaFlash length rule when the drafter has a length head, and with the\n"
                    "weights (safetensors), the tokenizer and a manifest. `af.load_exported(DIR)` and\n"
                    "`adaflash serve DIR` run the artifact without the model code.",
        epilog=EXPORT_EXAMPLES, formatter_class=help_formatter())
    p.add_argument("--target", default=default_target, metavar="NAME|PATH",
                   help=f"target: built-in name, HF dir or .gguf (default: {default_target})")
    p.add_argument("--drafter", default=default_drafter, metavar="NAME|PATH|none",
                   help=f"drafter to export with the target, or 'none' (default: {default_drafter})")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute and weight dtype (default: float32)")
    p.add_argument("--out", required=True, metavar="DIR", help="artifact directory (must be new or empty)")
    p.add_argument("--platforms", default="cpu", metavar="LIST",
                   help="comma-separated subset of cpu,cuda,tpu (default: cpu)")
    p.add_argument("--modes", default="greedy,sample", metavar="LIST",
                   help="greedy and/or sample (default: greedy,sample)")
    p.add_argument("--max-prompt-len", type=int, default=256, metavar="N",
                   help="longest prompt in tokens (default: 256)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="most new tokens per request (default: 128)")
    p.add_argument("--length-policy", choices=("fixed", "head"), default=None,
                   help="speculative verify lengths: fixed (whole blocks, DFlash) or head (the AdaFlash "
                        "rule, packed verification); default: head when the drafter has a length head")
    p.add_argument("--overwrite", action="store_true", help="replace an existing artifact in --out")
    add_target_mismatch_flag(p)
    p.set_defaults(run=_run_export)
    return p


def _run_export(args) -> int:
    import adaflash_jax as af
    from adaflash_jax.decoding.export import check_options, export_decoder

    with as_input_error(ValueError, FileExistsError):  # before the (slow) model load
        check_options(args.out, args.platforms.split(","), args.modes.split(","), args.max_prompt_len,
                      args.max_new_tokens, args.overwrite)
    print(f"loading target {args.target} ({args.dtype}) ...", file=sys.stderr, flush=True)
    target = af.load_target(args.target, dtype=args.dtype)
    drafter = None
    if args.drafter.lower() != "none":
        drafter = af.load_drafter(args.drafter, target=target,
                                  allow_target_mismatch=args.allow_target_mismatch)
    print("exporting ...", file=sys.stderr, flush=True)
    manifest = export_decoder(target, args.out, drafter=drafter, platforms=args.platforms.split(","),
                              max_prompt_len=args.max_prompt_len, max_new_tokens=args.max_new_tokens,
                              modes=args.modes.split(","), length_policy=args.length_policy,
                              overwrite=args.overwrite)
    print(json.dumps({"out": args.out, "functions": sorted(manifest["functions"]),
                      "platforms": manifest["platforms"]}))
    return 0


def add_serve_parser(subparsers):
    p = subparsers.add_parser(
        "serve", help="serve an exported decoder over HTTP JSON (loopback by default)",
        description="Serve POST /v1/completions {prompt, max_tokens, temperature, top_p, seed,\n"
                    "speculative} -> {text, token_ids, tau, timing} and GET /health from an artifact\n"
                    "written by `adaflash export`. Concurrent requests are batched (up to\n"
                    "--max-batch); SIGINT/SIGTERM finish the queued requests, then exit.",
        epilog=SERVE_EXAMPLES, formatter_class=help_formatter())
    p.add_argument("artifact", metavar="DIR", help="directory written by `adaflash export`")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1, loopback)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default: 8000)")
    p.add_argument("--max-batch", type=int, default=8, metavar="N",
                   help="most requests decoded in one call (default: 8)")
    p.add_argument("--batch-window-ms", type=float, default=5.0, metavar="MS",
                   help="how long the first queued request waits for others to join (default: 5)")
    p.set_defaults(run=_run_serve)
    return p


def _run_serve(args) -> int:
    from adaflash_jax.serving.server import serve

    if not 0 <= args.port < 65536:
        raise InputError(f"--port must lie in [0, 65535], got {args.port}")
    if not os.path.isfile(os.path.join(args.artifact, "manifest.json")):
        raise InputError(f"{args.artifact} is not an exported decoder (no manifest.json); "
                         "write one with `adaflash export --out DIR`")
    serve(args.artifact, host=args.host, port=args.port, max_batch=args.max_batch,
          batch_window_ms=args.batch_window_ms)
    return 0
